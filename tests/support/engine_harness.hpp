// Two QpEngines joined by a simulated channel on a virtual clock: the test
// bed for the sans-I/O engine (docs/design.md, principle 1), shared by the
// unit tests (tests/unit/engine_test.cpp) and the microbenchmarks
// (bench/microbench.cpp) as the static library stellar_engine_harness.
//
// The channel drops, duplicates, reorders, delays and corrupts datagrams
// with given probabilities, from a seeded generator, so every run is
// reproducible. Nothing here is thread-safe: one test drives one Pair.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "stellar/offload/engine.hpp"

namespace stellar::test {

using namespace stellar::offload;

struct Region {
  uint64_t address;
  uint64_t length;
  uint32_t access;
};

// A protection domain's regions keyed by rkey. Local keys: any registered
// key is valid locally (the tests use one table for both).
class FakeMemory : public MemoryAccess {
 public:
  uint32_t add(void* base, uint64_t length, uint32_t access);
  void remove(uint32_t key);
  uint64_t generation() const override { return generation_; }
  bool local_valid(uint32_t lkey, const uint8_t*, uint64_t, uint32_t) override { return regions_.count(lkey) != 0; }
  uint8_t* resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t access) override;

 private:
  std::map<uint32_t, Region> regions_;
  uint32_t next_key_ = 0x1234;
  uint64_t generation_ = 0;
};

// Completions in arrival order, sends and receives apart.
class Collector : public CompletionSink {
 public:
  void deliver(const Completion& c) override { (c.is_receive() ? receives : sends).push_back(c); }
  std::vector<Completion> sends, receives;
};

struct ChannelFaults {
  double drop = 0, duplicate = 0, reorder = 0, corrupt = 0;  // probabilities per datagram
  uint64_t delay_ns = 2'000;       // one-way base delay
  uint64_t jitter_ns = 0;          // extra uniform delay
  uint64_t spacing_ns = 0;         // serialisation: datagrams leave at least this far apart
  // Two paths: every slow_every-th datagram takes one slow_extra_ns longer
  // (0: one path). Later datagrams on the fast path overtake it.
  uint32_t slow_every = 0;
  uint64_t slow_extra_ns = 0;
};

// What happens on one path (entropy) of a multipath link, by the path index
// each datagram carries (TxBuffer::path): index % paths.size().
struct PathFault {
  bool dead = false;       // every datagram on it is lost
  double drop = 0;         // or this share of them
  uint64_t extra_ns = 0;   // added one-way delay
  double mark = 0;         // this share arrives marked ECN CE (a queue that marks)
};

// One direction of the simulated link.
class Channel {
 public:
  Channel(ChannelFaults faults, uint64_t seed) : faults_(faults), rng_(seed) {}
  // Drops datagrams for which it returns true (targeted loss in tests).
  std::function<bool(const uint8_t*, size_t)> filter;

  // Takes a copy of the datagram, sent at virtual time `now` (ns) on path
  // `path` (Header::path).
  void send(const uint8_t* data, size_t length, uint64_t now, uint16_t path = 0);
  // Per-path faults (empty: every path alike). Both directions of a Pair
  // usually get the same: a reply leaves on its request's path.
  std::vector<PathFault> paths;
  // Datagrams sent per path index (what the channel saw).
  std::map<uint16_t, uint64_t> sent_per_path;
  // Hands every datagram due at `now` to f(data, length) or, if f takes it,
  // f(data, length, congestion_mark), in queue order.
  template <typename F>
  void deliver_due(uint64_t now, F&& f) {
    for (size_t i = 0; i < queue_.size();) {
      if (queue_[i].due <= now) {
        Datagram d = std::move(queue_[i]);
        queue_.erase(queue_.begin() + long(i));
        if constexpr (std::is_invocable_v<F, const uint8_t*, size_t, bool>) f(d.bytes.data(), d.bytes.size(), d.mark);
        else f(d.bytes.data(), d.bytes.size());
      } else {
        ++i;
      }
    }
  }
  bool empty() const { return queue_.empty(); }
  void set_faults(ChannelFaults f) { faults_ = f; }

 private:
  struct Datagram {
    std::vector<uint8_t> bytes;
    uint64_t due;
    bool mark = false;  // ECN CE
  };
  bool chance(double p);
  uint64_t jitter();
  ChannelFaults faults_;
  std::mt19937_64 rng_;
  std::deque<Datagram> queue_;
  uint64_t last_departure_ = 0;
  uint64_t sent_ = 0;
};

// Side A and side B of one connection.
struct Pair {
  static constexpr uint64_t token_a = 0x5eed0000a11ce001ull, token_b = 0x5eed0000b0b00002ull;
  FakeMemory memory_a, memory_b;
  Collector cq_a, cq_b;
  std::unique_ptr<QpEngine> a, b;
  Channel a_to_b, b_to_a;
  uint64_t now = 1'000'000;  // virtual time, ns
  bool b_alive = true;
  // The addresses each side's receive() is given (as received: source =
  // the peer). Zero (not loopback) unless a test sets them.
  IcrcAddresses rx_a{}, rx_b{};
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<TxBuffer> tx;
  std::vector<uint8_t> flat;
  // As EngineHost does with EngineConfig::defer_piggybacked_acks: after each
  // side transmitted, the acknowledgement it put off is taken.
  bool settle_after_transmit = false;

  // A's send PSN starts just below the wrap (both modes) to exercise it.
  Pair(Mode mode, ChannelFaults faults, uint64_t seed, EngineConfig base = {});

  // Transmits everything `e` has to send into `out`.
  void pump(QpEngine& e, Channel& out);

  // Advances virtual time until `done()` or `limit_ns` passes. Returns done().
  template <typename Done>
  bool run(Done&& done, uint64_t limit_ns = 10'000'000'000ull) {
    const uint64_t end = now + limit_ns;
    while (!done() && now < end) step();
    return done();
  }

 private:
  void step();  // one round: transmit, deliver what is due, jump to the next event
};

// n bytes from a seeded generator.
std::vector<uint8_t> pattern(size_t n, uint32_t seed);
// A one-segment work request.
SendWork make_work(WorkOpcode op, uint64_t wr_id, void* local, uint32_t length);

}  // namespace stellar::test

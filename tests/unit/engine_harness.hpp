// Two QpEngines joined by a simulated channel on a virtual clock: the test
// bed for the sans-I/O engine. The channel drops, duplicates, reorders,
// delays and corrupts datagrams with given probabilities, from a seeded
// generator, so every run is reproducible.
#pragma once

#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "stellar/offload/engine.hpp"

#define ASSERT_LEN(x) \
  do {                  \
    if (!(x)) std::abort(); \
  } while (0)

namespace stellar::test {

using namespace stellar::offload;

struct Region {
  uint64_t address;
  uint64_t length;
  uint32_t access;
};

// A protection domain's regions keyed by rkey.
class FakeMemory : public MemoryAccess {
 public:
  uint32_t add(void* base, uint64_t length, uint32_t access) {
    const uint32_t key = next_key_ += 0x9e37;
    regions_[key] = Region{reinterpret_cast<uint64_t>(base), length, access};
    return key;
  }
  void remove(uint32_t key) {
    regions_.erase(key);
    ++generation_;
  }
  // Local keys: any registered key is valid locally (the tests use one table).
  uint64_t generation() const override { return generation_; }
  bool local_valid(uint32_t lkey, const uint8_t*, uint64_t, uint32_t) override { return regions_.count(lkey) != 0; }
  uint8_t* resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t access) override {
    auto it = regions_.find(rkey);
    if (it == regions_.end()) return nullptr;
    const Region& r = it->second;
    if ((r.access & access) != access) return nullptr;
    if (address < r.address || length > r.length || address - r.address > r.length - length) return nullptr;
    return reinterpret_cast<uint8_t*>(address);
  }

 private:
  std::map<uint32_t, Region> regions_;
  uint32_t next_key_ = 0x1234;
  uint64_t generation_ = 0;
};

class Collector : public CompletionSink {
 public:
  void deliver(const Completion& c) override { (c.is_receive() ? receives : sends).push_back(c); }
  std::vector<Completion> sends, receives;
};

struct ChannelFaults {
  double drop = 0, duplicate = 0, reorder = 0, corrupt = 0;
  uint64_t delay_ns = 2'000;       // one-way base delay
  uint64_t jitter_ns = 0;          // extra uniform delay
  uint64_t spacing_ns = 0;         // serialisation: datagrams leave at least this far apart
};

class Channel {
 public:
  Channel(ChannelFaults faults, uint64_t seed) : faults_(faults), rng_(seed) {}
  // Drops datagrams for which it returns true (targeted loss in tests).
  std::function<bool(const uint8_t*, size_t)> filter;

  void send(const uint8_t* data, size_t length, uint64_t now) {
    if (filter && filter(data, length)) return;
    if (chance(faults_.drop)) return;
    const uint64_t departure = std::max(now, last_departure_ + faults_.spacing_ns);
    last_departure_ = departure;
    Datagram d{std::vector<uint8_t>(data, data + length), departure + faults_.delay_ns + jitter()};
    if (chance(faults_.corrupt) && length > 0) {
      std::uniform_int_distribution<size_t> at(0, length - 1);
      d.bytes[at(rng_)] ^= uint8_t(1u << (rng_() % 8));
    }
    if (chance(faults_.reorder)) d.due += faults_.delay_ns * 3 + 5'000;  // overtaken by later ones
    if (chance(faults_.duplicate)) queue_.push_back(Datagram{d.bytes, d.due + 1'000});
    queue_.push_back(std::move(d));
  }
  template <typename F>
  void deliver_due(uint64_t now, F&& f) {
    for (size_t i = 0; i < queue_.size();) {
      if (queue_[i].due <= now) {
        Datagram d = std::move(queue_[i]);
        queue_.erase(queue_.begin() + long(i));
        f(d.bytes.data(), d.bytes.size());
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
  };
  bool chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  uint64_t jitter() { return faults_.jitter_ns ? rng_() % faults_.jitter_ns : 0; }
  ChannelFaults faults_;
  std::mt19937_64 rng_;
  std::deque<Datagram> queue_;
  uint64_t last_departure_ = 0;
};

// Side A and side B of one connection.
struct Pair {
  static constexpr uint64_t token_a = 0x5eed0000a11ce001ull, token_b = 0x5eed0000b0b00002ull;
  FakeMemory memory_a, memory_b;
  Collector cq_a, cq_b;
  std::unique_ptr<QpEngine> a, b;
  Channel a_to_b, b_to_a;
  uint64_t now = 1'000'000;
  bool b_alive = true;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<TxBuffer> tx;
  std::vector<uint8_t> flat;

  Pair(Mode mode, ChannelFaults faults, uint64_t seed, EngineConfig base = {})
      : a_to_b(faults, seed), b_to_a(faults, seed * 7 + 1) {
    base.mode = mode;
    EngineConfig ca = base, cb = base;
    ca.local_qpn = 0x11;
    ca.remote_qpn = 0x22;
    cb.local_qpn = 0x22;
    cb.remote_qpn = 0x11;
    ca.send_psn = cb.receive_psn = mode == Mode::roce ? 0xfffff0 : 0xfffffff0;  // exercise wrap-around
    // stellar: every packet carries the receiver's connection token, as the
    // soft provider configures it (unless the test chose its own).
    if (mode == Mode::stellar && base.local_token == 0 && base.remote_token == 0) {
      ca.local_token = cb.remote_token = token_a;
      cb.local_token = ca.remote_token = token_b;
    }
    cb.send_psn = ca.receive_psn = 77;
    a = std::make_unique<QpEngine>(ca, memory_a, cq_a);
    b = std::make_unique<QpEngine>(cb, memory_b, cq_b);
    buffers.resize(32, std::vector<uint8_t>(base.mtu + max_header_bytes + 64));
    for (auto& b : buffers) tx.push_back(TxBuffer{b.data(), uint32_t(b.size()), 0});
  }

  void pump(QpEngine& e, Channel& out) {
    for (;;) {
      const size_t n = e.transmit(tx.data(), tx.size(), now);
      for (size_t i = 0; i < n; ++i) {
        flat.resize(tx[i].length);
        ASSERT_LEN(flatten(tx[i], flat.data(), flat.size()) == tx[i].length);
        out.send(flat.data(), flat.size(), now);
      }
      if (n < tx.size()) break;
    }
  }

  // Advances virtual time until `done()` or `limit_ns` passes. Returns done().
  template <typename Done>
  bool run(Done&& done, uint64_t limit_ns = 10'000'000'000ull) {
    const uint64_t end = now + limit_ns;
    while (!done() && now < end) {
      pump(*a, a_to_b);
      if (b_alive) pump(*b, b_to_a);
      a_to_b.deliver_due(now, [&](const uint8_t* d, size_t n) {
        if (b_alive) b->receive(d, n, IcrcAddresses{}, now);
      });
      b_to_a.deliver_due(now, [&](const uint8_t* d, size_t n) { a->receive(d, n, IcrcAddresses{}, now); });
      // Jump to the next event when nothing is in the channel.
      uint64_t next = std::min(a->next_wakeup_ns(now), b_alive ? b->next_wakeup_ns(now) : UINT64_MAX);
      if (!a_to_b.empty() || !b_to_a.empty()) next = std::min(next, now + 500);
      now = std::max(now + 100, std::min(next, now + 1'000'000));
    }
    return done();
  }
};

inline std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 r(seed);
  for (auto& x : v) x = uint8_t(r());
  return v;
}

inline SendWork make_work(WorkOpcode op, uint64_t wr_id, void* local, uint32_t length) {
  SendWork w;
  w.wr_id = wr_id;
  w.opcode = op;
  w.segment_count = 1;
  w.segments[0] = Segment{static_cast<uint8_t*>(local), length};
  return w;
}

}  // namespace stellar::test

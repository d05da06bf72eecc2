// Fault injection in front of the engine host's UDP socket: drops,
// duplicates and reorders datagrams on their way out, with its own seeded
// random generator and counters. Engines and the provider know nothing of
// it; tests and `--fault-*` options configure it (ContextOptions::faults).
//
// Every datagram handed to send() draws, in this order: drop; then (if no
// datagram is held back and none was released in this call) reorder, which
// holds a copy back to go out after the next datagram; then duplicate. A
// held datagram not overtaken by the end of a progress round goes out from
// release_held(). With every probability 0 the filter only forwards.
//
// Not thread-safe: used by the host under its lock. No allocation after
// configure().
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "host/udp_socket.hpp"

namespace stellar::host {

struct FaultOptions {
  double drop = 0;       // probabilities in [0, 1]
  double duplicate = 0;
  double reorder = 0;
  uint64_t seed = 0;     // 0: a random seed
};

struct FaultCounters {
  uint64_t dropped = 0, duplicated = 0, reordered = 0;
};

class FaultFilter {
 public:
  // Batches of at most `batch` datagrams are handed to the socket, and a
  // held datagram may be up to `datagram_capacity` bytes.
  FaultFilter(const FaultOptions& options, int batch, uint32_t datagram_capacity);

  // Sends `count` datagrams from `socket` through the filter; returns how
  // many the socket refused (send errors). A datagram held back for
  // reordering goes out behind the next one, from that one's socket (a
  // multipath host's sockets differ only in source port).
  uint64_t send(UdpSocket& socket, const Datagram* datagrams, int count);
  // Sends a datagram held back for reordering that nothing overtook; returns
  // the send errors (0 or 1).
  uint64_t release_held();

  bool active() const { return active_; }
  const FaultCounters& counters() const { return counters_; }

 private:
  double uniform() { return std::uniform_real_distribution<double>(0, 1)(random_); }
  uint64_t flush(UdpSocket& socket, int count);

  FaultOptions options_;
  bool active_ = false;
  int batch_;
  std::mt19937_64 random_;
  std::vector<Datagram> out_;       // batch + 1 entries
  std::vector<uint8_t> held_;       // the datagram held back for reordering
  uint32_t held_length_ = 0;
  sockaddr_in held_peer_{};
  uint8_t held_tos_ = 0;  // the held datagram's TOS (Datagram::tos)
  UdpSocket* held_socket_ = nullptr;
  FaultCounters counters_;
};

}  // namespace stellar::host

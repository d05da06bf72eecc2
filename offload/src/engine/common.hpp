// What the engine's units share (private to offload/src): limits, PSN
// arithmetic, the work-queue entries and PSN slots, scatter/gather helpers,
// and the Context every unit holds: the QP's normalised configuration, its
// counters, memory, completion sink and the QP-wide error state.
//
// The units (docs/design.md, "Layering"; issue 12):
//   Responder    (responder.hpp)      receive queue, acceptance, placement, responses, ACKs
//   Requester    (requester.hpp)      send queue, PSN slots, building requests, applying ACKs
//   LossRecovery (loss_recovery.hpp)  lost ring, timers, RTT, loss detection, roce go-back-N
//   PacketWriter (writer.hpp)         finishes every outgoing packet (piggy-backed ACK, encode)
// QpEngine (engine.cpp) composes them. Nothing here allocates after
// construction, locks or does I/O (principles 1 and 4).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "stellar/offload/engine.hpp"

namespace stellar::offload::detail {

inline constexpr uint64_t never = std::numeric_limits<uint64_t>::max();
inline constexpr uint32_t pending_capacity = 16;     // stellar: READ/atomic requests that arrived ahead of a gap
inline constexpr uint32_t control_capacity = 256;
inline constexpr uint32_t atomic_replay_capacity = 32;
// What follows the payload: roce pad (up to 3) + ICRC (4); stellar CRC-32C (4).
inline constexpr size_t max_trailer_bytes = 8;
inline constexpr uint32_t zero_copy_bytes = 1024;    // larger payloads are referenced, not copied, when sent
inline constexpr uint32_t big_packet_burst = 4;   // packets a path keeps when they are too large to share a GSO message

// Ring positions without a division. A `%` by a size known only at run
// time compiles to a div (~14 cycles on the Xeon guests we measure on), and
// an 8-byte ping-pong turn did over a dozen of them on each side, most of
// them on the way from a packet's arrival to the reply's send. Requires
// i < n and k <= n.
inline uint32_t ring_add(uint32_t i, uint32_t k, uint32_t n) {
  const uint32_t j = i + k;
  return j >= n ? j - n : j;
}
inline uint32_t ring_next(uint32_t i, uint32_t n) { return i + 1 == n ? 0 : i + 1; }
// Packets a message of `length` bytes takes at `mtu` bytes each, at least
// one; the usual small message without a division.
inline uint32_t packets_for(uint64_t length, uint32_t mtu) { return length <= mtu ? 1 : uint32_t((length + mtu - 1) / mtu); }

// PSN arithmetic: 24-bit PSNs in roce mode, 32-bit in stellar mode.
struct PsnSpace {
  uint32_t mask = 0xffffffff;
  uint32_t add(uint32_t psn, uint32_t n) const { return (psn + n) & mask; }
  int32_t diff(uint32_t a, uint32_t b) const {
    const uint32_t d = (a - b) & mask;
    return mask == 0xffffffff ? int32_t(d) : int32_t(d << 8) >> 8;
  }
};

// Per-PSN state of what the requester sent. slot_response: the packet belongs
// to a READ or atomic, whose response (not an ACK) is the evidence that it
// arrived; set once, when the slot is first used, so that loss recovery need
// not look at the send queue. slot_reordered: loss detection (not a timer)
// declared the packet lost; an early ACK of its resend proves reordering.
enum SlotFlags : uint8_t {
  slot_sent = 1,
  slot_done = 2,
  slot_lost = 4,
  slot_retransmitted = 8,
  slot_in_flight = 16,
  slot_response = 32,
  slot_reordered = 64,
};

struct Slot {
  uint32_t wqe = 0;
  uint8_t flags = 0;
  uint16_t path = 0;  // the path of its latest transmission
  uint64_t sent_ns = 0;
};

struct SendWqe {
  SendWork work;
  uint8_t inline_data[max_inline_bytes];
  uint32_t length = 0;
  uint32_t first_psn = 0;
  uint32_t packet_count = 0;
  uint32_t receive_sequence = 0;
  CompletionStatus status = CompletionStatus::success;
  bool failed = false;
  uint64_t generation = 0;  // MemoryAccess::generation() when the segments were last known valid
  uint32_t credits = 0;     // max_rd_atomic credits held: READ pieces or the atomic sent, not yet below una
  uint32_t ready = 0;       // payload bytes that may be sent (all of it unless SendWork::staged)
};

struct ReceiveWqe {
  ReceiveWork work;
  uint64_t capacity = 0;
  uint32_t byte_length = 0;
  uint32_t last_psn = 0;
  uint32_t imm = 0;
  bool last_seen = false;
  bool has_imm = false;
  bool rdma_with_imm = false;
  CompletionStatus status = CompletionStatus::success;
  uint64_t generation = 0;
};

// The QP-wide ERROR state (verbs): any unit may enter it (a failed WQE, a
// receive too small, retries exhausted); whoever composes the units (the
// facade) then flushes the work of every one of them.
class ErrorHandler {
 public:
  virtual void enter_error() = 0;

 protected:
  ~ErrorHandler() = default;
};

// Shared by every unit: one per QP, owned by the facade.
struct Context {
  EngineConfig config;  // normalised (window a power of two, minimums applied)
  MemoryAccess& memory;
  CompletionSink& sink;
  ErrorHandler& errors;
  EngineCounters counters;
  PsnSpace psn;
  uint32_t window_mask = 0;
  bool error = false;
  const bool direct;  // memory.direct(): registered memory is addressable here

  Context(const EngineConfig& c, MemoryAccess& m, CompletionSink& s, ErrorHandler& e);

  // Copies out of / into registered memory (a resolve() result or a keyed
  // segment's address): memcpy in the application's process, the
  // MemoryAccess's own copy in the daemon. False: out of reach.
  bool copy_out(void* to, const uint8_t* address, size_t n) {
    if (direct) {
      std::memcpy(to, address, n);
      return true;
    }
    return memory.read(to, address, n);
  }
  bool copy_in(uint8_t* address, const void* from, size_t n) {
    if (direct) {
      // The same place: the host had the kernel receive the payload
      // straight into it (QpEngine::receive_placed).
      if (address != from) std::memcpy(address, from, n);
      return true;
    }
    return memory.write(address, from, n);
  }

  uint32_t add(uint32_t p, uint32_t n) const { return psn.add(p, n); }
  int32_t diff(uint32_t a, uint32_t b) const { return psn.diff(a, b); }

  void deliver(const Completion& c) {
    ++counters.completions;
    sink.deliver(c);
  }
  void enter_error() {
    if (!error) errors.enter_error();
  }

  // A header addressed to the peer QP: partition, destination QPN and (stellar)
  // the peer's connection token. Every packet this engine sends starts here.
  Header addressed() const {
    Header h;
    h.pkey = config.pkey;
    h.dest_qpn = config.remote_qpn;
    h.token = config.remote_token;
    return h;
  }
};

inline Context::Context(const EngineConfig& c, MemoryAccess& m, CompletionSink& s, ErrorHandler& e)
    : config(c), memory(m), sink(s), errors(e), direct(m.direct()) {
  psn.mask = config.mode == Mode::roce ? 0xffffff : 0xffffffff;
  uint32_t window = 128;  // at least the 64 PSNs kept free below plus room to send
  while (window < config.window_packets && window < (1u << 22)) window <<= 1;
  config.window_packets = window;
  window_mask = window - 1;
  config.max_send_wr = std::max<uint32_t>(1, config.max_send_wr);
  config.max_recv_wr = std::max<uint32_t>(1, config.max_recv_wr);
  config.mtu = std::clamp<uint32_t>(config.mtu, 256, max_payload_bytes);  // a datagram stays under 64 KiB
  config.max_read_responses = std::max<uint32_t>(1, config.max_read_responses);
  config.paths = config.mode == Mode::roce ? 1 : std::clamp<uint16_t>(config.paths, 1, max_paths);
  // At most one 64 KiB GSO message's worth, so that one message carries a
  // burst; packets above 16 KiB (loopback's 61440 bytes) cannot share a GSO
  // message, but a burst of 4 still leaves in one sendmmsg from one path's
  // socket, where one packet per path cost a system call each.
  config.path_burst_packets =
      std::clamp<uint32_t>(config.path_burst_packets, 1, std::max<uint32_t>(big_packet_burst, 65536 / config.mtu));
  config.max_response_burst = std::max<uint32_t>(1, config.max_response_burst);
  // Bounded by what the responder can hold: early in-order requests and the atomic replay cache.
  config.max_rd_atomic = std::clamp<uint32_t>(config.max_rd_atomic, 1, std::min(pending_capacity, atomic_replay_capacity));
}

// ---- work requests ----

// Copies a posted work request with only the segments it uses: a work
// request holds max_segments of them (256 bytes), and copying them all
// was the largest cost of posting a small WRITE (engine_pingpong_8b).
// `from.segment_count` is at most max_segments (checked at post).
template <typename Work>
inline void copy_work(Work& to, const Work& from) {
  static_assert(std::is_trivially_copyable_v<Work> && std::is_standard_layout_v<Work>);
  constexpr size_t head = offsetof(Work, segments), tail = head + sizeof(Work::segments);
  auto* out = reinterpret_cast<unsigned char*>(&to);
  const auto* in = reinterpret_cast<const unsigned char*>(&from);
  std::memcpy(out, in, head);
  std::memcpy(out + head, in + head, size_t(std::min(from.segment_count, max_segments)) * sizeof(Segment));
  std::memcpy(out + tail, in + tail, sizeof(Work) - tail);
}

// ---- scatter/gather ----

// Copies between a scatter/gather list and a contiguous buffer. Keyed
// segments are registered memory (Context::copy_out/copy_in); unkeyed ones
// (lkey 0: an inline payload the engine holds) are its own. False if
// registered memory was out of reach (the daemon's client is gone).
inline bool gather(Context& ctx, const Segment* segments, uint32_t count, uint64_t offset, uint8_t* out, uint32_t length) {
  for (uint32_t i = 0; i < count && length > 0; ++i) {
    if (offset >= segments[i].length) {
      offset -= segments[i].length;
      continue;
    }
    const uint32_t n = uint32_t(std::min<uint64_t>(segments[i].length - offset, length));
    if (segments[i].lkey == 0) std::memcpy(out, segments[i].address + offset, n);
    else if (!ctx.copy_out(out, segments[i].address + offset, n)) return false;
    out += n;
    length -= n;
    offset = 0;
  }
  return true;
}

inline bool scatter(Context& ctx, const Segment* segments, uint32_t count, uint64_t offset, const uint8_t* in, uint32_t length) {
  for (uint32_t i = 0; i < count && length > 0; ++i) {
    if (offset >= segments[i].length) {
      offset -= segments[i].length;
      continue;
    }
    const uint32_t n = uint32_t(std::min<uint64_t>(segments[i].length - offset, length));
    if (segments[i].lkey == 0) std::memcpy(segments[i].address + offset, in, n);
    else if (!ctx.copy_in(segments[i].address + offset, in, n)) return false;
    in += n;
    length -= n;
    offset = 0;
  }
  return true;
}

// The pieces of a scatter/gather list covering [offset, offset + length).
inline uint32_t slice(const Segment* segments, uint32_t count, uint64_t offset, uint32_t length, PayloadPiece* out) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < count && length > 0; ++i) {
    if (offset >= segments[i].length) {
      offset -= segments[i].length;
      continue;
    }
    const uint32_t take = uint32_t(std::min<uint64_t>(segments[i].length - offset, length));
    out[n++] = PayloadPiece{segments[i].address + offset, take};
    length -= take;
    offset = 0;
  }
  return n;
}

// Whether every keyed segment overlapping [offset, offset + length) is still
// registered with `access` (a region may be deregistered after posting).
inline bool segments_valid(MemoryAccess& memory, const Segment* segments, uint32_t count, uint64_t offset, uint64_t length,
                           uint32_t access) {
  for (uint32_t i = 0; i < count; ++i) {
    const Segment& g = segments[i];
    const bool overlaps = offset < g.length && length > 0;
    if (overlaps && g.lkey && !memory.local_valid(g.lkey, g.address, g.length, access)) return false;
    const uint64_t used = std::min<uint64_t>(offset < g.length ? g.length - offset : 0, length);
    length -= used;
    offset = offset >= g.length ? offset - g.length : 0;
  }
  return true;
}

// ---- opcodes ----

// SEND and WRITE opcodes share one layout after their FIRST opcode (IBTA):
// +0 first, +1 middle, +2 last, +3 last with immediate, +4 only, +5 only with immediate.
inline uint8_t message_opcode(uint8_t first_opcode, bool first, bool last, bool imm) {
  if (first && last) return uint8_t(first_opcode + (imm ? 5 : 4));
  if (first) return first_opcode;
  if (last) return uint8_t(first_opcode + (imm ? 3 : 2));
  return uint8_t(first_opcode + 1);
}

inline bool is_atomic(WorkOpcode op) { return op == WorkOpcode::atomic_fetch_add || op == WorkOpcode::atomic_compare_swap; }
inline bool needs_response(WorkOpcode op) { return op == WorkOpcode::rdma_read || is_atomic(op); }
inline bool consumes_receive(WorkOpcode op) {
  return op == WorkOpcode::send || op == WorkOpcode::send_with_imm || op == WorkOpcode::rdma_write_with_imm;
}

inline CompletionStatus status_from_syndrome(uint8_t s) {
  switch (s) {
    case syndrome::nak_remote_access: return CompletionStatus::remote_access_error;
    case syndrome::nak_remote_operation: return CompletionStatus::remote_operation_error;
    default: return CompletionStatus::remote_invalid_request;
  }
}

}  // namespace stellar::offload::detail

// RC transport state machine. See engine.hpp for the contract and
// docs/wire-format.md for what goes on the wire. The requester and the
// responder halves of a QP live in one State because packets of both
// directions carry each other's acknowledgements.
#include "stellar/offload/engine.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

namespace stellar::offload {

namespace {

constexpr uint64_t never = std::numeric_limits<uint64_t>::max();
constexpr uint32_t duplicate_threshold = 3;  // later packets acknowledged before a hole counts as lost
constexpr uint32_t pending_capacity = 16;     // stellar: READ/atomic requests that arrived ahead of a gap
constexpr uint32_t control_capacity = 256;
constexpr uint32_t atomic_replay_capacity = 32;
// What follows the payload: roce pad (up to 3) + ICRC (4); stellar CRC-32C (4).
constexpr size_t max_trailer_bytes = 8;
constexpr uint32_t zero_copy_bytes = 1024;    // larger payloads are referenced, not copied, when sent

enum SlotFlags : uint8_t { slot_sent = 1, slot_done = 2, slot_lost = 4, slot_retransmitted = 8, slot_in_flight = 16 };

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

struct Slot {
  uint32_t wqe = 0;
  uint8_t flags = 0;
  uint64_t sent_ns = 0;
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

struct ReadResponse {
  uint32_t psn = 0;
  uint64_t address = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;
  uint32_t packets = 0;  // of the request (what the opcodes count)
  uint32_t sent = 0;
  uint32_t end = 0;      // packets to send: `packets`, fewer when a duplicate READ cut it short (roce)
};

struct Control {
  uint8_t opcode = opcode::acknowledge;
  uint8_t syndrome = syndrome::ack;
  uint32_t psn = 0;
  uint64_t atomic_original = 0;
};

struct AtomicReplay {
  uint32_t psn = 0;
  uint64_t original = 0;
  bool valid = false;
};

// Copies between a scatter/gather list and a contiguous buffer.
void gather(const Segment* segments, uint32_t count, uint64_t offset, uint8_t* out, uint32_t length) {
  for (uint32_t i = 0; i < count && length > 0; ++i) {
    if (offset >= segments[i].length) {
      offset -= segments[i].length;
      continue;
    }
    const uint32_t n = uint32_t(std::min<uint64_t>(segments[i].length - offset, length));
    std::memcpy(out, segments[i].address + offset, n);
    out += n;
    length -= n;
    offset = 0;
  }
}

// Whether every keyed segment overlapping [offset, offset + length) is still
// registered with `access` (a region may be deregistered after posting).
bool segments_valid(MemoryAccess& memory, const Segment* segments, uint32_t count, uint64_t offset, uint64_t length,
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

// The pieces of a scatter/gather list covering [offset, offset + length).
uint32_t slice(const Segment* segments, uint32_t count, uint64_t offset, uint32_t length, PayloadPiece* out) {
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

void scatter(const Segment* segments, uint32_t count, uint64_t offset, const uint8_t* in, uint32_t length) {
  for (uint32_t i = 0; i < count && length > 0; ++i) {
    if (offset >= segments[i].length) {
      offset -= segments[i].length;
      continue;
    }
    const uint32_t n = uint32_t(std::min<uint64_t>(segments[i].length - offset, length));
    std::memcpy(segments[i].address + offset, in, n);
    in += n;
    length -= n;
    offset = 0;
  }
}

// SEND and WRITE opcodes share one layout after their FIRST opcode (IBTA):
// +0 first, +1 middle, +2 last, +3 last with immediate, +4 only, +5 only with immediate.
uint8_t message_opcode(uint8_t first_opcode, bool first, bool last, bool imm) {
  if (first && last) return uint8_t(first_opcode + (imm ? 5 : 4));
  if (first) return first_opcode;
  if (last) return uint8_t(first_opcode + (imm ? 3 : 2));
  return uint8_t(first_opcode + 1);
}

CompletionOpcode completion_opcode(WorkOpcode op) {
  switch (op) {
    case WorkOpcode::send:
    case WorkOpcode::send_with_imm: return CompletionOpcode::send;
    case WorkOpcode::rdma_write:
    case WorkOpcode::rdma_write_with_imm: return CompletionOpcode::rdma_write;
    case WorkOpcode::rdma_read: return CompletionOpcode::rdma_read;
    case WorkOpcode::atomic_fetch_add: return CompletionOpcode::fetch_add;
    case WorkOpcode::atomic_compare_swap: return CompletionOpcode::compare_swap;
  }
  return CompletionOpcode::send;
}

bool is_atomic(WorkOpcode op) { return op == WorkOpcode::atomic_fetch_add || op == WorkOpcode::atomic_compare_swap; }
bool needs_response(WorkOpcode op) { return op == WorkOpcode::rdma_read || is_atomic(op); }
bool consumes_receive(WorkOpcode op) {
  return op == WorkOpcode::send || op == WorkOpcode::send_with_imm || op == WorkOpcode::rdma_write_with_imm;
}

CompletionStatus status_from_syndrome(uint8_t s) {
  switch (s) {
    case syndrome::nak_remote_access: return CompletionStatus::remote_access_error;
    case syndrome::nak_remote_operation: return CompletionStatus::remote_operation_error;
    default: return CompletionStatus::remote_invalid_request;
  }
}

}  // namespace

struct QpEngine::State {
  EngineConfig config;
  MemoryAccess& memory;
  CompletionSink& sink;
  std::unique_ptr<CongestionControl> cc;
  EngineCounters counters;
  uint32_t psn_mask;
  uint32_t window_mask;
  bool error = false;

  // ---------------- requester ----------------
  std::vector<SendWqe> sq;
  uint32_t sq_head = 0, sq_count = 0;
  uint32_t send_cursor = 0;       // WQE that holds send_psn (valid while send_psn != assign_psn)
  std::vector<Slot> slots;        // indexed by PSN & window_mask, valid in [una, max_sent)
  uint32_t una = 0;               // oldest PSN not done
  uint32_t send_psn = 0;          // next PSN to transmit in order (roce rewinds it)
  uint32_t max_sent = 0;          // one past the highest PSN ever transmitted
  uint32_t assign_psn = 0;        // next PSN a posted WQE gets
  uint32_t acked_upto = 0;        // cumulative acknowledgements already applied
  uint32_t highest_done = 0;      // one past the highest WRITE/SEND PSN done (loss detection)
  uint32_t highest_response_done = 0;  // the same for READ/atomic PSNs (their responses)
  uint32_t loss_scan = 0;
  uint32_t next_receive_sequence = 0;
  std::vector<uint32_t> lost;     // stellar: PSNs to retransmit, ring
  uint32_t lost_head = 0, lost_count = 0;
  uint32_t inflight_packets = 0;
  uint32_t outstanding_rd_atomic = 0;  // READ pieces and atomics sent and not yet below una
  uint64_t rto_deadline = never;
  uint64_t probe_deadline = never;
  uint64_t rto = 0;
  uint64_t srtt = 0, rttvar = 0;
  uint64_t latest_request_arrival = 0;  // arrival time of the latest request received (our ack's age)
  uint64_t ack_host_delay = 0;          // host delay inside the RTT sample being processed
  uint64_t transmit_now = 0;            // now of the transmit() call building packets
  uint32_t consecutive_timeouts = 0;
  // roce go-back-N recovery of READ/atomic responses: after asking again from
  // recovery_psn, responses past it keep arriving from the stream the
  // responder was sending before it got the re-request (and its queue). They
  // say nothing new: asking again for each of them would only pile up
  // duplicate streams. Only a stream that goes back (a response at or below
  // the one before it: the responder started over) and still lacks
  // recovery_psn, or the timer, asks again.
  bool recovering = false;
  uint32_t recovery_psn = 0;
  uint32_t last_response_psn = 0;  // PSN of the latest response for an outstanding request (>= una - 1)
  // Spurious-timeout detection (stellar mode): after a timeout, an ACK for a
  // packet it declared lost that was never resent proves the original
  // arrived; the congestion window cut is then undone.
  bool timeout_undo_possible = false;
  uint32_t timeout_end = 0;  // max_sent at the timeout: the packets it judged
  uint32_t consecutive_rnr = 0;
  uint64_t rnr_until = 0;
  bool fatal = false;             // a NAK failed a WQE: send nothing at or after fatal_psn
  bool local_fault = false;       // build_request found deregistered local memory
  uint32_t fatal_psn = 0;

  // ---------------- responder ----------------
  std::vector<ReceiveWqe> rq;
  uint32_t rq_head = 0, rq_count = 0;
  uint32_t rq_head_sequence = 0;  // receive sequence of rq[rq_head]
  uint32_t epsn = 0;              // every PSN before this one has arrived
  std::vector<uint8_t> received;  // stellar: arrival marks for [epsn, epsn + window)
  uint32_t received_end = 0;      // one past the highest PSN marked
  uint32_t msn = 0;
  std::vector<ReadResponse> reads;
  uint32_t reads_head = 0, reads_count = 0;
  std::vector<Control> control;
  uint32_t control_head = 0, control_count = 0;
  AtomicReplay atomic_replay[atomic_replay_capacity];
  uint32_t atomic_replay_next = 0;
  Header pending[pending_capacity];
  bool pending_used[pending_capacity] = {};
  uint32_t unacked = 0;
  uint64_t ack_due = never;
  bool sequence_nak_sent = false;  // roce: one NAK per gap
  bool responder_failed = false;
  uint32_t responder_failed_psn = 0;
  uint8_t responder_failed_syndrome = 0;
  // roce in-order placement cursors
  bool roce_in_send = false, roce_in_write = false;
  uint32_t roce_send_offset = 0;
  uint32_t roce_receive_sequence = 0;
  uint64_t roce_write_address = 0;
  uint32_t roce_write_rkey = 0, roce_write_length = 0, roce_write_offset = 0;

  State(const EngineConfig& c, MemoryAccess& m, CompletionSink& s) : config(c), memory(m), sink(s) {
    psn_mask = config.mode == Mode::roce ? 0xffffff : 0xffffffff;
    uint32_t window = 128;  // at least the 64 PSNs kept free below plus room to send
    while (window < config.window_packets && window < (1u << 22)) window <<= 1;
    config.window_packets = window;
    window_mask = window - 1;
    config.max_send_wr = std::max<uint32_t>(1, config.max_send_wr);
    config.max_recv_wr = std::max<uint32_t>(1, config.max_recv_wr);
    config.mtu = std::max<uint32_t>(256, config.mtu);
    config.max_read_responses = std::max<uint32_t>(1, config.max_read_responses);
    config.max_response_burst = std::max<uint32_t>(1, config.max_response_burst);
    // Bounded by what the responder can hold: early in-order requests and the atomic replay cache.
    config.max_rd_atomic = std::clamp<uint32_t>(config.max_rd_atomic, 1, std::min(pending_capacity, atomic_replay_capacity));
    sq.resize(config.max_send_wr);
    rq.resize(config.max_recv_wr);
    slots.resize(window);
    lost.resize(window);
    received.resize(window);
    reads.resize(config.max_read_responses);
    control.resize(control_capacity);
    CcConfig ccc = config.cc_config;
    ccc.mtu_bytes = config.mtu;
    cc = make_congestion_control(config.cc, ccc);
    una = send_psn = max_sent = assign_psn = acked_upto = highest_done = highest_response_done = loss_scan =
        config.send_psn & psn_mask;
    last_response_psn = add(una, psn_mask);  // una - 1
    epsn = received_end = config.receive_psn & psn_mask;
    rto = config.rto_initial_ns;
  }

  // ---- PSN arithmetic (24-bit in roce mode) ----
  uint32_t add(uint32_t psn, uint32_t n) const { return (psn + n) & psn_mask; }
  int32_t diff(uint32_t a, uint32_t b) const {
    const uint32_t d = (a - b) & psn_mask;
    return psn_mask == 0xffffffff ? int32_t(d) : int32_t(d << 8) >> 8;
  }
  Slot& slot(uint32_t psn) { return slots[psn & window_mask]; }
  bool outstanding(uint32_t psn) const { return diff(psn, una) >= 0 && diff(psn, max_sent) < 0; }

  // A READ is asked for in pieces: piece k covers PSNs [first + k*piece,
  // first + (k+1)*piece). At most half the window (the responder refuses
  // more, and the responses must fit the window with the requests behind
  // them) and at most max_read_request_packets: a piece's responses arrive as
  // one burst, which a software requester's socket must hold. Each piece
  // takes a max_rd_atomic credit when first sent and returns it when una
  // passes its end, so pieces pipeline (congestion control gates them by the
  // response packets they put in flight) without ever having more requests
  // at the responder than max_rd_atomic.
  uint32_t read_piece_packets() const {
    return std::max<uint32_t>(1, std::min(config.max_read_request_packets, config.window_packets / 2));
  }
  // PSNs one READ request from `psn` asks for: the rest of its piece, never
  // beyond. A re-request from the middle of a piece must stay inside the PSN
  // range the responder already accepted, as a verbs requester's retried
  // READ stays inside the original request.
  uint32_t read_request_packets(const SendWqe& w, uint32_t psn) const {
    const uint32_t piece = read_piece_packets();
    const uint32_t index = uint32_t(diff(psn, w.first_psn));
    return std::min(w.packet_count, (index / piece + 1) * piece) - index;
  }
  // Whether the packet at psn carries payload that is not in place yet
  // (a staged source still being copied).
  bool waits_for_payload(const SendWqe& w, uint32_t psn) const {
    if (w.ready >= w.length) return false;
    const uint64_t offset = uint64_t(diff(psn, w.first_psn)) * config.mtu;
    return offset + std::min<uint64_t>(config.mtu, w.length - offset) > w.ready;
  }
  // Whether the request at psn needs a max_rd_atomic credit: the first
  // transmission of an atomic or of a READ piece (retransmissions reuse it).
  bool needs_credit(const SendWqe& w, uint32_t psn) const {
    if (!needs_response(w.work.opcode) || diff(psn, max_sent) < 0) return false;
    return psn == w.first_psn || uint32_t(diff(psn, w.first_psn)) % read_piece_packets() == 0;
  }


  // =====================================================================
  // requester
  // =====================================================================
  PostResult post_send(const SendWork& work) {
    if (error) {
      flush_one_send(work);
      return PostResult::ok;
    }
    if (work.segment_count > max_segments) return PostResult::invalid_argument;
    uint64_t length = 0;
    for (uint32_t i = 0; i < work.segment_count; ++i) length += work.segments[i].length;
    if (length > (1ull << 31)) return PostResult::invalid_argument;
    if (is_atomic(work.opcode) &&
        (work.segment_count != 1 || work.segments[0].length != 8 || work.remote_addr % 8 != 0))
      return PostResult::invalid_argument;
    if (work.inline_data && (length > max_inline_bytes || needs_response(work.opcode)))
      return PostResult::invalid_argument;
    if (sq_count == config.max_send_wr) return PostResult::queue_full;
    const uint32_t packets = is_atomic(work.opcode) ? 1 : std::max<uint32_t>(1, uint32_t((length + config.mtu - 1) / config.mtu));
    // PSN comparisons (diff) hold within half the PSN space: the PSNs from the
    // oldest unacknowledged one to the end of this WR must span less than a
    // quarter of it (2^22 in roce mode, whose PSNs have 24 bits; e.g. 2 GiB at
    // a 256-byte MTU is 2^23). A READ larger than half the window is asked
    // for in pieces (read_request_packets).
    const uint32_t max_span = (psn_mask >> 2) + 1;
    if (packets > max_span) return PostResult::invalid_argument;
    if (uint64_t(uint32_t(diff(assign_psn, una))) + packets > max_span) return PostResult::queue_full;

    const uint32_t index = (sq_head + sq_count) % config.max_send_wr;
    SendWqe& w = sq[index];
    w.work = work;
    w.length = uint32_t(length);
    w.first_psn = assign_psn;
    w.packet_count = packets;
    w.status = CompletionStatus::success;
    w.failed = false;
    w.credits = 0;
    w.ready = work.staged && !work.inline_data && !needs_response(work.opcode) ? 0 : w.length;
    w.generation = memory.generation();
    w.receive_sequence = consumes_receive(work.opcode) ? next_receive_sequence++ : 0;
    if (work.inline_data) {
      gather(work.segments, work.segment_count, 0, w.inline_data, w.length);
      w.work.segment_count = 1;
      w.work.segments[0] = Segment{w.inline_data, w.length, 0};
    }
    if (send_psn == assign_psn) send_cursor = index;
    assign_psn = add(assign_psn, packets);
    ++sq_count;
    return PostResult::ok;
  }

  void flush_one_send(const SendWork& work) {
    Completion c;
    c.wr_id = work.wr_id;
    c.status = CompletionStatus::work_request_flushed;
    c.opcode = completion_opcode(work.opcode);
    c.qp_number = config.local_qpn;
    deliver(c);
  }

  void deliver(const Completion& c) {
    ++counters.completions;
    sink.deliver(c);
  }

  // The WQE whose PSN range holds psn (psn is assigned). Fast path: the cursor.
  uint32_t find_wqe(uint32_t psn) const {
    for (uint32_t i = 0; i < sq_count; ++i) {
      const uint32_t index = (sq_head + i) % config.max_send_wr;
      const SendWqe& w = sq[index];
      if (diff(psn, w.first_psn) >= 0 && diff(psn, add(w.first_psn, w.packet_count)) < 0) return index;
    }
    return sq_head;
  }

  void rewind(uint32_t psn, uint64_t now) {
    if (!outstanding(psn) && psn != max_sent) return;
    (void)now;
    if (diff(psn, send_psn) < 0) {
      // Everything from psn on is sent again (go-back-N); drop in-flight accounting of those.
      for (uint32_t p = psn; diff(p, max_sent) < 0; p = add(p, 1)) {
        Slot& s = slot(p);
        if (s.flags & slot_in_flight) {
          s.flags &= uint8_t(~slot_in_flight);
          --inflight_packets;
        }
      }
      send_psn = psn;
      send_cursor = find_wqe(psn);
    }
  }

  void mark_done(uint32_t psn, uint64_t now, uint64_t& rtt_sample, uint64_t& acked_bytes) {
    Slot& s = slot(psn);
    if (s.flags & slot_done) return;
    if (timeout_undo_possible && (s.flags & slot_lost) && !(s.flags & slot_retransmitted) && diff(psn, timeout_end) < 0) {
      timeout_undo_possible = false;
      ++counters.spurious_timeouts;
      cc->on_spurious_timeout(now);
    }
    if (!(s.flags & slot_retransmitted) && (s.flags & slot_sent)) rtt_sample = now - s.sent_ns;
    if (s.flags & slot_in_flight) --inflight_packets;
    s.flags = uint8_t((s.flags | slot_done) & ~(slot_in_flight | slot_lost));
    acked_bytes += config.mtu;
    // READ/atomic responses and ACKs of writes/sends are separate evidence:
    // a WRITE acknowledged after a READ says nothing about the READ's data.
    uint32_t& highest = needs_response(sq[s.wqe].work.opcode) ? highest_response_done : highest_done;
    if (diff(add(psn, 1), highest) > 0) highest = add(psn, 1);
  }

  // Applies "every PSN before cum has arrived" from the peer's responder.
  void apply_cumulative(uint32_t cum, uint64_t now, uint64_t& rtt, uint64_t& bytes) {
    if (diff(cum, max_sent) > 0 || diff(cum, una) <= 0) return;
    uint32_t from = diff(acked_upto, una) > 0 ? acked_upto : una;
    for (uint32_t p = from; diff(p, cum) < 0; p = add(p, 1)) {
      Slot& s = slot(p);
      if (!needs_response(sq[s.wqe].work.opcode)) mark_done(p, now, rtt, bytes);
    }
    if (diff(cum, acked_upto) > 0) acked_upto = cum;
    if (config.mode == Mode::roce) {
      // A cumulative ACK past a READ or atomic whose response never came means
      // the response was lost: a RoCE requester re-issues from there.
      for (uint32_t p = una; diff(p, cum) < 0; p = add(p, 1)) {
        if (!(slot(p).flags & slot_done)) {
          response_missing(p, false, 0, now);
          break;
        }
      }
    }
  }

  // roce: the response for p, the oldest one missing, is overdue: a response
  // (from_response, for PSN `evidence`) or an ACK for a later PSN came first.
  // Responses leave the responder in PSN order and the network keeps order,
  // so p's was lost: go back to p, once per gap. While the re-request is under
  // way, later responses of the streams sent before it are no news (see
  // `recovering`): they climb, one PSN after the other. A response at or
  // below the one before it comes from a stream the responder started over,
  // and if p is still missing then, that stream lost it too: ask again. An
  // ACK cannot tell the streams apart: during recovery it is left to the timer.
  // The timer restarts with every response of a stream still climbing: the
  // answer to the re-request queues behind it (a software responder may have
  // sent all of a READ's responses before the re-request reached it, and
  // their draining can outlast the RTO), and a timeout now would only ask
  // for yet another copy of everything.
  void response_missing(uint32_t p, bool from_response, uint32_t evidence, uint64_t now) {
    if (recovering && p == recovery_psn) {
      if (!from_response) return;
      if (diff(evidence, last_response_psn) > 0) {
        if (p == una) rto_deadline = now + rto;
        return;
      }
    } else if (!from_response && now - slot(p).sent_ns <= srtt) {
      return;  // an ACK overtaking a response still on its way (as before: not news yet)
    }
    rewind(p, now);
    recovering = true;
    recovery_psn = p;
    if (p == una) rto_deadline = now + rto;  // as TCP: the timer restarts with the head's retransmission
  }

  void apply_sack(uint32_t cum, uint64_t bitmap, uint64_t now, uint64_t& rtt, uint64_t& bytes) {
    for (uint32_t i = 0; bitmap != 0 && i < 64; ++i, bitmap >>= 1) {
      if (!(bitmap & 1)) continue;
      const uint32_t p = add(cum, i + 1);
      if (!outstanding(p)) continue;
      Slot& s = slot(p);
      if (!needs_response(sq[s.wqe].work.opcode)) mark_done(p, now, rtt, bytes);
    }
  }

  void detect_losses() {
    if (config.mode != Mode::stellar) return;
    const uint32_t highest = diff(highest_done, highest_response_done) > 0 ? highest_done : highest_response_done;
    if (diff(highest, add(una, duplicate_threshold)) <= 0) return;
    const uint32_t limit = (highest - duplicate_threshold) & psn_mask;
    uint32_t p = diff(loss_scan, una) > 0 ? loss_scan : una;
    bool undecided = false;  // the scan cursor stops at the first slot that may still be lost later
    for (; diff(p, limit) < 0; p = add(p, 1)) {
      Slot& s = slot(p);
      if ((s.flags & (slot_sent | slot_done | slot_lost)) != slot_sent) {
        if (!undecided) loss_scan = add(p, 1);
        continue;
      }
      const uint32_t evidence = needs_response(sq[s.wqe].work.opcode) ? highest_response_done : highest_done;
      if (diff(evidence, add(p, duplicate_threshold)) > 0) {
        queue_lost(p);
        if (!undecided) loss_scan = add(p, 1);
      } else {
        undecided = true;
      }
    }
  }

  void queue_lost(uint32_t psn) {
    Slot& s = slot(psn);
    if (s.flags & (slot_lost | slot_done)) return;
    if (lost_count == lost.size()) return;
    s.flags |= slot_lost;
    if (s.flags & slot_in_flight) {
      s.flags &= uint8_t(~slot_in_flight);
      --inflight_packets;
    }
    lost[(lost_head + lost_count) % lost.size()] = psn;
    ++lost_count;
  }

  void after_acknowledgement(uint64_t now, uint64_t rtt, uint64_t bytes) {
    if (rtt) update_rtt(rtt);  // the timers must cover the whole delay, host included
    if (bytes) {
      // Congestion control reacts to the network's share of the delay only.
      const uint64_t network = rtt > ack_host_delay ? rtt - ack_host_delay : (rtt ? 1 : 0);
      cc->on_ack(now, bytes, network);
      consecutive_timeouts = 0;
      consecutive_rnr = 0;
      rto = rto_base();
    }
    detect_losses();
    const uint32_t before = una;
    advance_una();
    if (una != before) rto_deadline = (una == max_sent) ? never : now + rto;
    if (una != before || bytes) arm_probe(now);
    complete_sends();
  }

  void advance_una() {
    while (diff(max_sent, una) > 0 && (slot(una).flags & slot_done)) {
      SendWqe& w = sq[slot(una).wqe];
      if (w.work.opcode == WorkOpcode::rdma_read && w.credits > 0) {
        const uint32_t below = uint32_t(diff(una, w.first_psn)) + 1;  // w's packets below una after this one
        if (below % read_piece_packets() == 0 || below == w.packet_count) {
          --w.credits;  // a whole piece is in: its credit comes back
          if (outstanding_rd_atomic > 0) --outstanding_rd_atomic;
        }
      }
      slot(una).flags = 0;
      una = add(una, 1);
    }
    if (timeout_undo_possible && diff(una, timeout_end) >= 0) timeout_undo_possible = false;  // all judged packets settled
    if (recovering && diff(una, recovery_psn) > 0) recovering = false;  // the gap is filled
    if (diff(una, last_response_psn) > 0) last_response_psn = add(una, psn_mask);
    // Keep the scan cursors inside the window so PSN arithmetic stays valid.
    if (diff(una, acked_upto) > 0) acked_upto = una;
    if (diff(una, loss_scan) > 0) loss_scan = una;
    if (diff(una, highest_done) > 0) highest_done = una;
    if (diff(una, highest_response_done) > 0) highest_response_done = una;
    if (diff(una, send_psn) > 0) {
      send_psn = una;
      if (send_psn != assign_psn) send_cursor = find_wqe(send_psn);
    }
  }

  void complete_sends() {
    while (sq_count > 0 && !error) {
      SendWqe& w = sq[sq_head];
      const uint32_t end = add(w.first_psn, w.packet_count);
      const uint32_t sent_end = diff(end, max_sent) > 0 ? max_sent : end;
      if (diff(una, w.failed ? sent_end : end) < 0) break;
      outstanding_rd_atomic -= std::min(outstanding_rd_atomic, w.credits);  // an atomic's, or a failed READ's rest
      w.credits = 0;
      if (w.failed) {
        Completion c;
        c.wr_id = w.work.wr_id;
        c.status = w.status;
        c.opcode = completion_opcode(w.work.opcode);
        c.qp_number = config.local_qpn;
        sq_head = (sq_head + 1) % config.max_send_wr;
        --sq_count;
        deliver(c);
        enter_error();
        return;
      }
      if (w.work.signaled) {
        Completion c;
        c.wr_id = w.work.wr_id;
        c.opcode = completion_opcode(w.work.opcode);
        c.byte_length = w.length;
        c.qp_number = config.local_qpn;
        deliver(c);
      }
      sq_head = (sq_head + 1) % config.max_send_wr;
      --sq_count;
    }
  }

  void fail_at(uint32_t psn, CompletionStatus status) {
    if (!outstanding(psn)) {
      ++counters.unexpected_packets;
      return;
    }
    // Only PSNs already sent have slots; the rest of the WQE is never sent
    // (fatal_psn) and complete_sends finishes it once una reaches max_sent.
    fail_wqe(slot(psn).wqe, status);
  }

  uint64_t rto_base() const {
    if (srtt == 0) return config.rto_initial_ns;
    return std::clamp<uint64_t>(srtt + 4 * rttvar, config.rto_min_ns, config.rto_max_ns);
  }

  void update_rtt(uint64_t sample) {
    if (srtt == 0) {
      srtt = sample;
      rttvar = sample / 2;
    } else {
      const uint64_t delta = sample > srtt ? sample - srtt : srtt - sample;
      rttvar = (3 * rttvar + delta) / 4;
      srtt = (7 * srtt + sample) / 8;
    }
  }

  void on_timeout(uint64_t now) {
    ++counters.timeouts;
    if (++consecutive_timeouts > config.retry_count) {
      fail_head(CompletionStatus::retry_exceeded);
      return;
    }
    cc->on_timeout(now);
    rto = std::min(rto * 2, config.rto_max_ns);
    if (config.mode == Mode::roce) {
      rewind(una, now);
      recovering = true;  // responses of the streams sent before are no news (response_missing)
      recovery_psn = una;
    } else {
      // As TCP after an RTO: everything unacknowledged counts as lost, so the
      // in-flight estimate drops to zero and the (collapsed) window can open.
      // Undo is only for a silent stall: if a later packet was acknowledged
      // while the head stayed missing, the head was really lost (and the
      // un-resent packets an ACK may cover later say nothing about it).
      // The queue starts over from the head, in PSN order, as TCP's
      // retransmission after an RTO does. Left as it was, the packets still
      // queued from an earlier timeout would go first and the head (whose
      // retransmission was lost again) would wait behind them: past the
      // SACK's 64-PSN reach each of them draws only a duplicate ACK, so
      // with the collapsed window they leave one per RTO and the retries
      // run out before the head's turn comes.
      for (uint32_t i = 0; i < lost_count; ++i) {
        const uint32_t p = lost[(lost_head + i) % lost.size()];
        if (outstanding(p)) slot(p).flags &= uint8_t(~slot_lost);
      }
      lost_count = 0;
      bool later_acknowledged = false;
      for (uint32_t p = una; diff(p, max_sent) < 0; p = add(p, 1)) {
        if (slot(p).flags & slot_done) later_acknowledged = true;
        if ((slot(p).flags & (slot_sent | slot_done)) == slot_sent) queue_lost(p);
      }
      timeout_undo_possible = !later_acknowledged;
      timeout_end = max_sent;
    }
    rto_deadline = now + rto;
    probe_deadline = never;
  }

  // Tail loss probe (stellar): when nothing was acknowledged for about two
  // RTTs, retransmit the oldest outstanding packet once. Either it was lost
  // (recovered an RTO early) or its duplicate draws a fresh SACK that lets
  // loss detection find what is missing. Not a timeout: the window and the
  // retry count are left alone.
  void on_probe(uint64_t now) {
    probe_deadline = never;
    (void)now;
    Slot& s = slot(una);
    if ((s.flags & (slot_sent | slot_done | slot_lost)) != slot_sent) return;
    ++counters.tail_probes;
    queue_lost(una);
  }

  void arm_probe(uint64_t now) {
    if (config.mode != Mode::stellar || una == max_sent) {
      probe_deadline = never;
      return;
    }
    const uint64_t pto = srtt ? std::max<uint64_t>(2 * srtt + config.ack_delay_ns, 20'000) : rto / 4;
    probe_deadline = pto < rto ? now + pto : never;
  }

  void fail_head(CompletionStatus status) {
    if (sq_count == 0) return;
    SendWqe& w = sq[sq_head];
    Completion c;
    c.wr_id = w.work.wr_id;
    c.status = status;
    c.opcode = completion_opcode(w.work.opcode);
    c.qp_number = config.local_qpn;
    sq_head = (sq_head + 1) % config.max_send_wr;
    --sq_count;
    deliver(c);
    enter_error();
  }

  void on_ack_packet(const Header& h, uint64_t now) {
    uint64_t rtt = 0, bytes = 0;
    if (config.mode == Mode::roce) {
      // AETH PSN: ACK = last PSN received; NAKs = the PSN refused (all before it arrived).
      const uint32_t cum = syndrome::is_ack(h.syndrome) ? add(h.psn, 1) : h.psn;
      apply_cumulative(cum, now, rtt, bytes);
    }
    if (syndrome::is_ack(h.syndrome)) {
      after_acknowledgement(now, rtt, bytes);
      return;
    }
    if (syndrome::is_rnr(h.syndrome)) {
      ++counters.rnr_naks_received;
      after_acknowledgement(now, rtt, bytes);
      // Every packet of a message may draw an RNR NAK: count one retry per wait period.
      const bool new_period = now >= rnr_until;
      if (new_period && config.rnr_retry != 7 && ++consecutive_rnr > config.rnr_retry) {
        fail_at(h.psn, CompletionStatus::rnr_retry_exceeded);
        return;
      }
      if (new_period) rnr_until = now + config.rnr_delay_ns;
      if (!outstanding(h.psn)) return;
      if (config.mode == Mode::roce) {
        rewind(h.psn, now);
      } else {
        slot(h.psn).flags &= uint8_t(~slot_lost);
        queue_lost(h.psn);
      }
      rto_deadline = rnr_until + rto;
      return;
    }
    if (h.syndrome == syndrome::nak_psn_sequence) {
      ++counters.sequence_naks_received;
      after_acknowledgement(now, rtt, bytes);
      cc->on_loss(now);
      rewind(h.psn, now);
      return;
    }
    after_acknowledgement(now, rtt, bytes);
    fail_at(h.psn, status_from_syndrome(h.syndrome));
  }

  // READ response or atomic ACK for PSN h.psn.
  void on_response(const Header& h, uint64_t now) {
    if (!outstanding(h.psn)) {
      ++counters.duplicates;
      return;
    }
    Slot& s = slot(h.psn);
    SendWqe& w = sq[s.wqe];
    const bool is_read = opcode_is_read_response(h.opcode);
    if ((is_read && w.work.opcode != WorkOpcode::rdma_read) || (!is_read && !is_atomic(w.work.opcode)) ||
        !(s.flags & slot_sent)) {
      ++counters.unexpected_packets;
      return;
    }
    if (s.flags & slot_done) {
      ++counters.duplicates;
      return;
    }
    uint64_t rtt = 0, bytes = 0;
    if (config.mode == Mode::roce) {
      // Responses imply that every earlier request was executed.
      apply_cumulative(w.first_psn, now, rtt, bytes);
      for (uint32_t p = diff(una, w.first_psn) > 0 ? una : w.first_psn; diff(p, h.psn) < 0; p = add(p, 1)) {
        if (!(slot(p).flags & slot_done)) {
          // Go-back-N: dropped; asked for again with everything from p.
          ++counters.out_of_order;
          response_missing(p, true, h.psn, now);
          last_response_psn = h.psn;
          after_acknowledgement(now, rtt, bytes);
          return;
        }
      }
      last_response_psn = h.psn;
    }
    if (is_read) {
      const uint64_t offset = uint64_t(diff(h.psn, w.first_psn)) * config.mtu;
      const uint32_t expected = uint32_t(std::min<uint64_t>(config.mtu, w.length - offset));
      if (h.payload_length != expected) {
        ++counters.invalid_requests;
        return;
      }
      if (!local_ok(w, offset, expected, access_local_write)) {
        fail_at(h.psn, CompletionStatus::local_protection_error);
        return;
      }
      scatter(w.work.segments, w.work.segment_count, offset, h.payload, h.payload_length);
    } else {
      if (!local_ok(w, 0, 8, access_local_write)) {
        fail_at(h.psn, CompletionStatus::local_protection_error);
        return;
      }
      uint64_t original = h.atomic_original;
      std::memcpy(w.work.segments[0].address, &original, 8);
    }
    mark_done(h.psn, now, rtt, bytes);
    after_acknowledgement(now, rtt, bytes);
  }

  bool may_send_request(uint64_t now, uint32_t bytes) const {
    if (now < rnr_until) return false;
    return cc->can_send(now, uint64_t(inflight_packets) * config.mtu, bytes);
  }

  // True if the WQE's local memory for [offset, offset + length) may be used.
  bool local_ok(SendWqe& w, uint64_t offset, uint64_t length, uint32_t access) {
    const uint64_t now_generation = memory.generation();
    if (w.generation == now_generation) return true;
    if (!segments_valid(memory, w.work.segments, w.work.segment_count, offset, length, access)) return false;
    w.generation = now_generation;  // still valid: no need to look again until the next deregistration
    return true;
  }

  // Fails a WQE before or while it is being sent (a local error): nothing
  // more of it goes out; it completes with `status` in posting order.
  void fail_wqe(uint32_t index, CompletionStatus status) {
    SendWqe& w = sq[index];
    if (w.failed) return;
    w.failed = true;
    w.status = status;
    uint64_t rtt = 0, bytes = 0;
    const uint32_t end = add(w.first_psn, w.packet_count);
    for (uint32_t p = diff(una, w.first_psn) > 0 ? una : w.first_psn; diff(p, end) < 0 && diff(p, max_sent) < 0; p = add(p, 1))
      mark_done(p, 0, rtt, bytes);
    if (!fatal || diff(w.first_psn, fatal_psn) < 0) {
      fatal = true;
      fatal_psn = w.first_psn;
    }
    advance_una();
    complete_sends();
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

  // stellar: a packet must carry this QP's token; roce has none on the wire.
  bool token_accepted(const Header& h) {
    if (config.mode != Mode::stellar || h.token == config.local_token) return true;
    ++counters.bad_token;
    return false;
  }

  // Builds the request packet for PSN psn into b. A READ request asks for
  // `read_packets` response packets from psn (at most to the end of its
  // piece, read_request_packets).
  uint32_t build_request(uint32_t psn, uint32_t wqe_index, uint32_t read_packets, TxBuffer& b, uint32_t& psns_used) {
    SendWqe& w = sq[wqe_index];
    const uint32_t index = uint32_t(diff(psn, w.first_psn));
    const uint64_t offset = uint64_t(index) * config.mtu;
    Header h = addressed();
    h.psn = psn;
    h.solicited = w.work.solicited;
    psns_used = 1;
    const bool first = index == 0, last = index + 1 == w.packet_count;
    uint32_t payload = 0;
    switch (w.work.opcode) {
      case WorkOpcode::send:
      case WorkOpcode::send_with_imm:
        h.opcode = message_opcode(opcode::send_first, first, last, w.work.opcode == WorkOpcode::send_with_imm);
        payload = uint32_t(std::min<uint64_t>(config.mtu, w.length - offset));
        break;
      case WorkOpcode::rdma_write:
      case WorkOpcode::rdma_write_with_imm:
        h.opcode = message_opcode(opcode::write_first, first, last, w.work.opcode == WorkOpcode::rdma_write_with_imm);
        payload = uint32_t(std::min<uint64_t>(config.mtu, w.length - offset));
        h.remote_addr = w.work.remote_addr;
        h.rkey = w.work.rkey;
        h.dma_length = w.length;
        break;
      case WorkOpcode::rdma_read: {
        h.opcode = opcode::read_request;
        h.remote_addr = w.work.remote_addr + offset;
        h.rkey = w.work.rkey;
        psns_used = std::max<uint32_t>(1, std::min(read_packets, read_request_packets(w, psn)));
        h.dma_length = uint32_t(std::min<uint64_t>(uint64_t(psns_used) * config.mtu, w.length - offset));
        break;
      }
      case WorkOpcode::atomic_fetch_add:
      case WorkOpcode::atomic_compare_swap:
        h.opcode = w.work.opcode == WorkOpcode::atomic_fetch_add ? opcode::fetch_add : opcode::compare_swap;
        h.remote_addr = w.work.remote_addr;
        h.rkey = w.work.rkey;
        h.swap_add = w.work.opcode == WorkOpcode::atomic_fetch_add ? w.work.compare_add : w.work.swap;
        h.compare = w.work.opcode == WorkOpcode::atomic_fetch_add ? 0 : w.work.compare_add;
        break;
    }
    if (payload || opcode_is_send(h.opcode) || opcode_is_write(h.opcode)) {
      h.message_offset = uint32_t(offset);
      h.message_length = w.length;
      h.receive_sequence = w.receive_sequence;
      h.payload_length = payload;
    }
    if (opcode_has_imm(h.opcode)) h.imm = w.work.imm;
    // Ask for an ACK at the end of a message and when the window is filling up.
    h.ack_request = last || needs_response(w.work.opcode) ||
                    uint32_t(diff(add(psn, psns_used), una)) > config.window_packets / 2;
    const size_t at = payload_offset(config.mode, h);
    if (b.capacity < at + payload + max_trailer_bytes) return 0;
    if (payload && !local_ok(w, offset, payload, 0)) {
      local_fault = true;
      return 0;
    }
    b.piece_count = 0;
    if (payload >= zero_copy_bytes) {
      b.piece_count = slice(w.work.segments, w.work.segment_count, offset, payload, b.pieces);
    } else if (payload) {
      gather(w.work.segments, w.work.segment_count, offset, b.data + at, payload);
    }
    return finish(h, b);
  }

  // Piggy-backs our responder's acknowledgement (stellar) and encodes.
  uint32_t finish(Header& h, TxBuffer& b) {
    if (config.mode == Mode::stellar) {
      h.has_ack = true;
      h.ack_psn = epsn;
      h.sack_bitmap = sack_bitmap();
      h.ack_delay_ns = latest_request_arrival && transmit_now >= latest_request_arrival
                           ? uint32_t(std::min<uint64_t>(transmit_now - latest_request_arrival, UINT32_MAX))
                           : 0;
      unacked = 0;
      ack_due = never;
    }
    if (b.piece_count) {
      b.header_length = uint32_t(encode_scattered(config.mode, h, b.data, b.capacity, b.pieces, b.piece_count, b.trailer,
                                                  b.trailer_length, config.tx_addresses));
      b.length = b.header_length ? b.header_length + h.payload_length + b.trailer_length : 0;
    } else {
      b.length = uint32_t(encode(config.mode, h, b.data, b.capacity, config.tx_addresses));
    }
    if (b.length) {
      ++counters.tx_packets;
      counters.tx_bytes += b.length;
    }
    return b.length;
  }

  void record_sent(uint32_t psn, uint32_t count, uint32_t wqe_index, uint64_t now, bool retransmission) {
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t p = add(psn, i);
      Slot& s = slot(p);
      if (diff(p, max_sent) >= 0) {
        s = Slot{wqe_index, 0, 0};
        max_sent = add(p, 1);
      }
      if (s.flags & slot_done) continue;
      if (retransmission || (s.flags & slot_sent)) s.flags |= slot_retransmitted;
      s.flags = uint8_t((s.flags | slot_sent | slot_in_flight) & ~slot_lost);
      s.sent_ns = now;
      ++inflight_packets;
    }
    if (rto_deadline == never) {
      rto_deadline = now + rto;
      arm_probe(now);
    }
  }

  // Whether the in-order loop of transmit_requests could send now, ignoring
  // congestion control (next_wakeup_ns asks it separately).
  bool in_order_ready() const {
    if (send_psn == assign_psn || error) return false;
    if (fatal && diff(send_psn, fatal_psn) >= 0) return false;
    uint32_t index = send_cursor;
    if (diff(send_psn, sq[index].first_psn) < 0 || diff(send_psn, add(sq[index].first_psn, sq[index].packet_count)) >= 0)
      index = find_wqe(send_psn);
    const SendWqe& w = sq[index];
    const uint32_t needed = w.work.opcode == WorkOpcode::rdma_read ? read_request_packets(w, send_psn) : 1;
    if (uint32_t(diff(send_psn, una)) + needed > config.window_packets - 64) return false;
    if (!w.failed && waits_for_payload(w, send_psn)) return false;
    if (needs_credit(w, send_psn) && outstanding_rd_atomic >= config.max_rd_atomic) return false;
    return true;
  }

  size_t transmit_requests(TxBuffer* buffers, size_t count, uint64_t now) {
    size_t n = 0;
    // Selective retransmissions first (stellar).
    while (n < count && lost_count > 0 && !error) {
      const uint32_t psn = lost[lost_head];
      Slot& s = slot(psn);
      if (!outstanding(psn) || (s.flags & slot_done) || !(s.flags & slot_lost) ||
          (fatal && diff(psn, fatal_psn) >= 0)) {
        if (outstanding(psn)) s.flags &= uint8_t(~slot_lost);
        lost_head = (lost_head + 1) % lost.size();
        --lost_count;
        continue;
      }
      if (!may_send_request(now, config.mtu)) return n;
      // Lost READ responses in a row (a timeout marks a whole piece lost) are
      // asked for again with one request, not one request per packet: a
      // responder that was only slow would otherwise be buried in requests.
      uint32_t run = 1;
      if (sq[s.wqe].work.opcode == WorkOpcode::rdma_read) {
        const uint32_t limit = std::min(lost_count, read_request_packets(sq[s.wqe], psn));
        while (run < limit && lost[(lost_head + run) % lost.size()] == add(psn, run) &&
               (slot(add(psn, run)).flags & (slot_lost | slot_done)) == slot_lost)
          ++run;
      }
      uint32_t used = 0;
      if (!build_request(psn, s.wqe, run, buffers[n], used)) {
        if (!local_fault) return n;
        local_fault = false;
        fail_wqe(s.wqe, CompletionStatus::local_protection_error);
        continue;
      }
      record_sent(psn, used, s.wqe, now, true);
      if (psn == una) rto_deadline = now + rto;  // as TCP: the timer restarts with the head's retransmission
      cc->on_send(now, buffers[n].length);
      ++counters.retransmitted_packets;
      ++counters.fast_retransmits;
      lost_head = (lost_head + used) % lost.size();
      lost_count -= used;
      ++n;
    }
    // In-order transmission (first transmissions; after a rewind, go-back-N).
    while (n < count && send_psn != assign_psn && !error) {
      if (fatal && diff(send_psn, fatal_psn) >= 0) break;
      SendWqe* w = &sq[send_cursor];
      if (diff(send_psn, add(w->first_psn, w->packet_count)) >= 0 || diff(send_psn, w->first_psn) < 0) {
        send_cursor = find_wqe(send_psn);
        w = &sq[send_cursor];
      }
      const uint32_t needed = w->work.opcode == WorkOpcode::rdma_read ? read_request_packets(*w, send_psn) : 1;
      if (uint32_t(diff(send_psn, una)) + needed > config.window_packets - 64) break;
      const bool credit = needs_credit(*w, send_psn);
      if (credit && outstanding_rd_atomic >= config.max_rd_atomic) break;
      if (w->failed) {
        send_psn = add(w->first_psn, w->packet_count);
        continue;
      }
      if (waits_for_payload(*w, send_psn)) break;  // set_ready() wakes the host's loop
      if (!may_send_request(now, config.mtu)) break;
      const bool retransmission = diff(send_psn, max_sent) < 0;
      uint32_t used = 0;
      if (!build_request(send_psn, send_cursor, needed, buffers[n], used)) {
        if (!local_fault) break;
        local_fault = false;
        fail_wqe(send_cursor, CompletionStatus::local_protection_error);
        continue;
      }
      record_sent(send_psn, used, send_cursor, now, retransmission);
      cc->on_send(now, buffers[n].length);
      if (retransmission) ++counters.retransmitted_packets;
      if (credit) {
        ++outstanding_rd_atomic;
        ++w->credits;
      }
      send_psn = add(send_psn, used);
      if (send_psn != assign_psn && diff(send_psn, add(w->first_psn, w->packet_count)) >= 0)
        send_cursor = (send_cursor + 1) % config.max_send_wr;
      ++n;
    }
    return n;
  }

  // =====================================================================
  // responder
  // =====================================================================
  uint64_t sack_bitmap() const {
    if (diff(received_end, epsn) <= 1) return 0;  // nothing beyond the first hole: the common case
    uint64_t bits = 0;
    for (uint32_t i = 0; i < 64; ++i)
      if (received[add(epsn, i + 1) & window_mask]) bits |= uint64_t(1) << i;
    return bits;
  }

  void queue_control(uint8_t op, uint8_t syn, uint32_t psn, uint64_t original = 0) {
    if (control_count == control.size()) return;  // the requester's timer recovers
    control[(control_head + control_count) % control.size()] = Control{op, syn, psn, original};
    ++control_count;
  }

  void schedule_ack(uint64_t now, bool immediately) {
    ++unacked;
    const uint64_t due = (immediately || unacked >= config.ack_every_packets) ? now : now + config.ack_delay_ns;
    ack_due = std::min(ack_due, due);
  }

  ReceiveWqe* receive_for(uint32_t sequence) {
    const int32_t ahead = int32_t(sequence - rq_head_sequence);
    if (ahead < 0 || uint32_t(ahead) >= rq_count) return nullptr;
    return &rq[(rq_head + uint32_t(ahead)) % config.max_recv_wr];
  }

  enum class Outcome { accepted, nak, rnr, dropped };

  void on_request(const Header& h, uint64_t now) {
    const int32_t d = diff(h.psn, epsn);
    const int32_t window = int32_t(config.window_packets);
    if (d < 0) {
      if (d < -window) {
        ++counters.out_of_window;
        return;
      }
      ++counters.duplicates;
      replay_duplicate(h, now);
      return;
    }
    if (d >= window) {
      ++counters.out_of_window;
      return;
    }
    if (responder_failed && diff(h.psn, responder_failed_psn) >= 0) {
      ++counters.naks_sent;
      queue_control(opcode::acknowledge, responder_failed_syndrome, responder_failed_psn);
      return;
    }
    if (config.mode == Mode::roce) {
      if (d > 0) {
        ++counters.out_of_order;
        if (!sequence_nak_sent) {
          sequence_nak_sent = true;
          ++counters.naks_sent;
          queue_control(opcode::acknowledge, syndrome::nak_psn_sequence, epsn);
        }
        return;
      }
    } else {
      if (received[h.psn & window_mask]) {
        ++counters.duplicates;
        schedule_ack(now, true);
        return;
      }
      if (d > 0) {
        ++counters.out_of_order;
        if (h.opcode == opcode::read_request || h.opcode == opcode::compare_swap || h.opcode == opcode::fetch_add) {
          // Reads and atomics execute in order (they must see earlier
          // writes). A re-request of one already waiting takes its slot (a
          // READ: the longer of the two), not another; with every slot
          // taken the request is dropped, and the requester asks again.
          uint32_t free_slot = pending_capacity;
          for (uint32_t i = 0; i < pending_capacity; ++i) {
            if (pending_used[i] && pending[i].psn == h.psn && pending[i].opcode == h.opcode) {
              if (h.opcode == opcode::read_request && h.dma_length > pending[i].dma_length) pending[i] = h;
              return;
            }
            if (!pending_used[i] && free_slot == pending_capacity) free_slot = i;
          }
          if (free_slot == pending_capacity) {
            ++counters.requests_dropped_full;
            return;
          }
          pending[free_slot] = h;
          pending_used[free_slot] = true;
          return;
        }
      }
    }
    execute(h, now, d > 0);
    drain_pending(now);
  }

  void execute(const Header& h, uint64_t now, bool out_of_order) {
    uint32_t consumed = 1;
    const Outcome outcome = apply_request(h, now, consumed);
    switch (outcome) {
      case Outcome::accepted:
        mark_received(h.psn, consumed);
        schedule_ack(now, out_of_order);  // out of order: SACK news, tell the requester at once
        complete_receives();
        break;
      case Outcome::nak: break;
      case Outcome::rnr:
        ++counters.rnr_naks_sent;
        queue_control(opcode::acknowledge, uint8_t(syndrome::rnr_nak | 0x0e), h.psn);
        break;
      case Outcome::dropped: break;
    }
  }

  void drain_pending(uint64_t now) {
    bool progress = true;
    while (progress) {
      progress = false;
      for (uint32_t i = 0; i < pending_capacity; ++i) {
        if (!pending_used[i]) continue;
        const int32_t d = diff(pending[i].psn, epsn);
        if (d > 0) continue;
        pending_used[i] = false;
        const Header h = pending[i];
        if (d == 0) {
          execute(h, now, false);
          progress = true;
        } else if (h.opcode == opcode::read_request) {
          // Overtaken by an overlapping re-request of the same piece: serve
          // it (its tail may lie past what the other one covered).
          replay_duplicate(h, now);
          progress = true;
        }
      }
    }
  }

  void mark_received(uint32_t psn, uint32_t count) {
    if (config.mode == Mode::roce) {
      epsn = add(epsn, count);
      sequence_nak_sent = false;
      return;
    }
    for (uint32_t i = 0; i < count; ++i) received[add(psn, i) & window_mask] = 1;
    if (diff(add(psn, count), received_end) > 0) received_end = add(psn, count);
    while (received[epsn & window_mask]) {
      received[epsn & window_mask] = 0;
      epsn = add(epsn, 1);
    }
  }

  // A fatal NAK (access or invalid request): like a verbs responder, accept
  // nothing at or after that PSN any more; repeat the NAK instead.
  void nak(uint32_t psn, uint8_t syn) {
    ++counters.naks_sent;
    queue_control(opcode::acknowledge, syn, psn);
    if (!responder_failed || diff(psn, responder_failed_psn) < 0) {
      responder_failed = true;
      responder_failed_psn = psn;
      responder_failed_syndrome = syn;
    }
  }

  Outcome apply_request(const Header& h, uint64_t now, uint32_t& consumed) {
    (void)now;
    const uint8_t op = h.opcode;
    if (opcode_is_send(op)) return apply_send(h);
    if (opcode_is_write(op)) return apply_write(h);
    if (op == opcode::read_request) {
      const uint32_t length = h.dma_length;
      const uint32_t packets = std::max<uint32_t>(1, uint32_t((uint64_t(length) + config.mtu - 1) / config.mtu));
      if (packets > config.window_packets / 2) {
        ++counters.invalid_requests;
        nak(h.psn, syndrome::nak_invalid_request);
        return Outcome::nak;
      }
      if (length && !memory.resolve(h.rkey, h.remote_addr, length, access_remote_read)) {
        ++counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        return Outcome::nak;
      }
      if (reads_count == reads.size()) {
        ++counters.requests_dropped_full;
        return Outcome::dropped;  // the requester retries
      }
      reads[(reads_head + reads_count) % reads.size()] = ReadResponse{h.psn, h.remote_addr, h.rkey, length, packets, 0, packets};
      ++reads_count;
      consumed = packets;
      msn = (msn + 1) & 0xffffff;
      return Outcome::accepted;
    }
    if (op == opcode::compare_swap || op == opcode::fetch_add) {
      if (h.remote_addr % 8 != 0) {
        ++counters.invalid_requests;
        nak(h.psn, syndrome::nak_invalid_request);
        return Outcome::nak;
      }
      uint8_t* target = memory.resolve(h.rkey, h.remote_addr, 8, access_remote_atomic);
      if (!target) {
        ++counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        return Outcome::nak;
      }
      auto* word = reinterpret_cast<uint64_t*>(target);
      uint64_t original;
      if (op == opcode::fetch_add) {
        original = __atomic_fetch_add(word, h.swap_add, __ATOMIC_SEQ_CST);
      } else {
        original = h.compare;
        __atomic_compare_exchange_n(word, &original, h.swap_add, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
      }
      atomic_replay[atomic_replay_next] = AtomicReplay{h.psn, original, true};
      atomic_replay_next = (atomic_replay_next + 1) % atomic_replay_capacity;
      queue_control(opcode::atomic_acknowledge, syndrome::ack, h.psn, original);
      msn = (msn + 1) & 0xffffff;
      return Outcome::accepted;
    }
    ++counters.invalid_requests;
    return Outcome::dropped;
  }

  Outcome apply_send(const Header& h) {
    const uint8_t op = h.opcode;
    uint32_t sequence, offset;
    if (config.mode == Mode::roce) {
      if (opcode_is_first(op) == roce_in_send) {  // a first packet inside a message, or a middle without a first
        ++counters.invalid_requests;
        nak(h.psn, syndrome::nak_invalid_request);
        return Outcome::nak;
      }
      sequence = roce_receive_sequence;
      offset = opcode_is_first(op) ? 0 : roce_send_offset;
    } else {
      sequence = h.receive_sequence;
      offset = h.message_offset;
    }
    ReceiveWqe* r = receive_for(sequence);
    if (!r) {
      if (int32_t(sequence - rq_head_sequence) < 0) {
        ++counters.invalid_requests;
        return Outcome::dropped;
      }
      return Outcome::rnr;
    }
    if (uint64_t(offset) + h.payload_length > r->capacity ||
        (config.mode == Mode::stellar && h.message_length > r->capacity)) {
      ++counters.invalid_requests;
      r->status = CompletionStatus::local_length_error;
      nak(h.psn, syndrome::nak_invalid_request);
      // A receive too small is fatal for the responder too (verbs semantics):
      // that receive completes with the length error, the rest are flushed.
      enter_error();
      return Outcome::nak;
    }
    if (r->generation != memory.generation()) {
      if (!segments_valid(memory, r->work.segments, r->work.segment_count, offset, h.payload_length, access_local_write)) {
        // The receive buffer was deregistered: fatal for this side, as in verbs.
        r->status = CompletionStatus::local_protection_error;
        nak(h.psn, syndrome::nak_remote_operation);
        enter_error();
        return Outcome::nak;
      }
      r->generation = memory.generation();
    }
    scatter(r->work.segments, r->work.segment_count, offset, h.payload, h.payload_length);
    if (config.mode == Mode::roce) {
      roce_in_send = !opcode_is_last(op);
      roce_send_offset = offset + h.payload_length;
    }
    if (opcode_is_last(op)) {
      r->last_seen = true;
      r->last_psn = h.psn;
      r->byte_length = config.mode == Mode::roce ? offset + h.payload_length : h.message_length;
      r->has_imm = opcode_has_imm(op);
      r->imm = h.imm;
      r->rdma_with_imm = false;
      if (config.mode == Mode::roce) ++roce_receive_sequence;
      msn = (msn + 1) & 0xffffff;
    }
    return Outcome::accepted;
  }

  Outcome apply_write(const Header& h) {
    const uint8_t op = h.opcode;
    uint8_t* base = nullptr;
    uint64_t offset;
    uint32_t total;
    if (config.mode == Mode::roce) {
      if (opcode_is_first(op) == roce_in_write) {
        ++counters.invalid_requests;
        nak(h.psn, syndrome::nak_invalid_request);
        return Outcome::nak;
      }
      if (opcode_is_first(op)) {
        roce_write_address = h.remote_addr;
        roce_write_rkey = h.rkey;
        roce_write_length = h.dma_length;
        roce_write_offset = 0;
        if (h.dma_length) {
          if (!memory.resolve(h.rkey, h.remote_addr, h.dma_length, access_remote_write)) {
            ++counters.access_errors;
            nak(h.psn, syndrome::nak_remote_access);
            return Outcome::nak;
          }
        }
      }
      offset = roce_write_offset;
      total = roce_write_length;
      if (offset + h.payload_length > total || (opcode_is_last(op) && offset + h.payload_length != total)) {
        ++counters.invalid_requests;
        nak(h.psn, syndrome::nak_invalid_request);
        return Outcome::nak;
      }
      // Resolve again per packet: the region may be deregistered between packets.
      if (h.payload_length) {
        uint8_t* at = memory.resolve(roce_write_rkey, roce_write_address + offset, h.payload_length, access_remote_write);
        if (!at) {
          ++counters.access_errors;
          nak(h.psn, syndrome::nak_remote_access);
          return Outcome::nak;
        }
        base = at - offset;
      }
    } else {
      offset = h.message_offset;
      total = h.message_length;
      if (h.dma_length != h.message_length) {
        ++counters.invalid_requests;
        nak(h.psn, syndrome::nak_invalid_request);
        return Outcome::nak;
      }
      if (total) {
        base = memory.resolve(h.rkey, h.remote_addr, total, access_remote_write);
        if (!base) {
          ++counters.access_errors;
          nak(h.psn, syndrome::nak_remote_access);
          return Outcome::nak;
        }
      }
    }
    ReceiveWqe* r = nullptr;
    if (opcode_has_imm(op)) {
      const uint32_t sequence = config.mode == Mode::roce ? roce_receive_sequence : h.receive_sequence;
      r = receive_for(sequence);
      if (!r) return int32_t(sequence - rq_head_sequence) < 0 ? Outcome::dropped : Outcome::rnr;
    }
    if (h.payload_length) std::memcpy(base + offset, h.payload, h.payload_length);
    if (config.mode == Mode::roce) {
      roce_write_offset = uint32_t(offset + h.payload_length);
      roce_in_write = !opcode_is_last(op);
    }
    if (opcode_is_last(op)) {
      msn = (msn + 1) & 0xffffff;
      if (r) {
        r->last_seen = true;
        r->last_psn = h.psn;
        r->byte_length = total;
        r->has_imm = true;
        r->imm = h.imm;
        r->rdma_with_imm = true;
        if (config.mode == Mode::roce) ++roce_receive_sequence;
      }
    }
    return Outcome::accepted;
  }

  // roce: a duplicate READ request at PSN q means the requester went back to
  // q (go-back-N) and asks again for everything from q on. As a RoCE
  // responder may (IBTA: responder behaviour on a duplicate RDMA READ), stop the responses
  // not yet sent for PSNs from q on: those of requests at q or later go, a
  // response that started before q ends at q. The requester re-sends the
  // later requests anyway; answering them all again behind what is still
  // queued would send each response twice, and on every further go-back a
  // third time. Responses before q (requests before q) are still owed and
  // stay. Atomic acknowledgements (the control queue, the replay cache) are
  // left alone: an atomic never executes twice, a re-sent one is answered
  // from the cache.
  void restart_reads_at(uint32_t q) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < reads_count; ++i) {
      ReadResponse r = reads[(reads_head + i) % reads.size()];
      if (diff(r.psn, q) >= 0) continue;
      const uint32_t before_q = uint32_t(diff(q, r.psn));
      if (r.end > before_q) r.end = before_q;
      if (r.sent >= r.end) continue;  // everything before q already went out
      reads[(reads_head + kept) % reads.size()] = r;
      ++kept;
    }
    reads_count = kept;
  }

  void replay_duplicate(const Header& h, uint64_t now) {
    if (h.opcode == opcode::read_request) {
      // Reads are idempotent: serve the (possibly partial) range again.
      const uint32_t length = h.dma_length;
      const uint32_t packets = std::max<uint32_t>(1, uint32_t((uint64_t(length) + config.mtu - 1) / config.mtu));
      if (packets > config.window_packets / 2) return;
      if (config.mode == Mode::roce) restart_reads_at(h.psn);
      if (reads_count == reads.size()) {
        ++counters.requests_dropped_full;
        return;
      }
      if (length && !memory.resolve(h.rkey, h.remote_addr, length, access_remote_read)) {
        ++counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        return;
      }
      reads[(reads_head + reads_count) % reads.size()] = ReadResponse{h.psn, h.remote_addr, h.rkey, length, packets, 0, packets};
      ++reads_count;
      // A re-request can start inside what was accepted and reach past it:
      // the first request for a piece was lost and a one-packet probe took
      // its place. The PSNs past epsn are this READ's own: accept them, or
      // every later request waits behind a PSN nobody will send again.
      const uint32_t end = add(h.psn, packets);
      if (diff(end, epsn) > 0 && !responder_failed) {
        mark_received(epsn, uint32_t(diff(end, epsn)));
        schedule_ack(now, true);
        complete_receives();  // messages that arrived ahead of the gap are in order now
        drain_pending(now);
      }
      return;
    }
    if (h.opcode == opcode::compare_swap || h.opcode == opcode::fetch_add) {
      // Never execute an atomic twice: answer from the replay cache.
      for (const AtomicReplay& a : atomic_replay) {
        if (a.valid && a.psn == h.psn) {
          queue_control(opcode::atomic_acknowledge, syndrome::ack, h.psn, a.original);
          return;
        }
      }
      return;
    }
    if (config.mode == Mode::roce) {
      queue_control(opcode::acknowledge, syndrome::ack, (epsn - 1) & psn_mask);
      ++counters.acks_sent;
    } else {
      schedule_ack(now, true);
    }
  }

  void complete_receives() {
    while (rq_count > 0 && !error) {
      ReceiveWqe& r = rq[rq_head];
      if (!r.last_seen || diff(r.last_psn, epsn) >= 0) break;
      Completion c;
      c.wr_id = r.work.wr_id;
      c.status = r.status;
      c.opcode = r.rdma_with_imm ? CompletionOpcode::receive_rdma_with_imm : CompletionOpcode::receive;
      c.byte_length = r.byte_length;
      c.imm = r.imm;
      c.has_imm = r.has_imm;
      c.qp_number = config.local_qpn;
      rq_head = (rq_head + 1) % config.max_recv_wr;
      --rq_count;
      ++rq_head_sequence;
      deliver(c);
      if (c.status != CompletionStatus::success) {
        enter_error();
        return;
      }
    }
  }

  size_t transmit_responses(TxBuffer* buffers, size_t count) {
    size_t n = 0;
    // roce: a burst, then back to the host, which hands in what arrived
    // meanwhile: a duplicate READ request must find the rest of the
    // responses still here to cut them short (restart_reads_at).
    if (config.mode == Mode::roce) count = std::min<size_t>(count, config.max_response_burst);
    while (n < count && (control_count > 0 || reads_count > 0)) {
      // Responses leave in PSN order, as a verbs responder sends them: an
      // atomic ACK must not overtake the data of an earlier READ.
      const bool control_first =
          control_count > 0 &&
          (reads_count == 0 || diff(control[control_head].psn, add(reads[reads_head].psn, reads[reads_head].sent)) < 0);
      if (control_first) {
        const Control& c = control[control_head];
        Header h = addressed();
        h.opcode = c.opcode;
        h.psn = c.psn;
        h.syndrome = c.syndrome;
        h.msn = msn;
        h.atomic_original = c.atomic_original;
        buffers[n].piece_count = 0;
        if (!finish(h, buffers[n])) break;
        control_head = (control_head + 1) % control.size();
        --control_count;
        ++n;
        continue;
      }
      ReadResponse& r = reads[reads_head];
      const uint64_t offset = uint64_t(r.sent) * config.mtu;
      const uint32_t length = uint32_t(std::min<uint64_t>(config.mtu, r.length - offset));
      Header h = addressed();
      h.psn = add(r.psn, r.sent);
      const bool first = r.sent == 0, last = r.sent + 1 == r.packets;
      h.opcode = first && last ? opcode::read_response_only
                 : first       ? opcode::read_response_first
                 : last        ? opcode::read_response_last
                               : opcode::read_response_middle;
      h.syndrome = syndrome::ack;
      h.msn = msn;
      h.message_offset = uint32_t(offset);
      h.message_length = r.length;
      h.payload_length = length;
      const size_t at = payload_offset(config.mode, h);
      if (buffers[n].capacity < at + length + max_trailer_bytes) break;
      if (length) {
        // Resolve again per packet: the region may have been deregistered since.
        const uint8_t* source = memory.resolve(r.rkey, r.address + offset, length, access_remote_read);
        if (!source) {
          ++counters.access_errors;
          nak(h.psn, syndrome::nak_remote_access);
          reads_head = (reads_head + 1) % reads.size();
          --reads_count;
          continue;
        }
        // Copied, not referenced: the responder's application may write this
        // memory at any time, and the checksum must match what goes out.
        std::memcpy(buffers[n].data + at, source, length);
        buffers[n].piece_count = 0;
      } else {
        buffers[n].piece_count = 0;
      }
      if (!finish(h, buffers[n])) break;
      ++n;
      if (++r.sent == r.end) {
        reads_head = (reads_head + 1) % reads.size();
        --reads_count;
      }
    }
    return n;
  }

  size_t transmit_ack(TxBuffer* buffers, size_t count, uint64_t now) {
    if (count == 0 || ack_due > now) return 0;
    Header h = addressed();
    h.opcode = opcode::acknowledge;
    h.syndrome = syndrome::ack;
    h.msn = msn;
    h.psn = (epsn - 1) & psn_mask;
    unacked = 0;
    ack_due = never;
    buffers[0].piece_count = 0;
    if (!finish(h, buffers[0])) return 0;
    ++counters.acks_sent;
    return 1;
  }

  // =====================================================================
  void enter_error() {
    if (error) return;
    error = true;
    while (sq_count > 0) {
      SendWqe& w = sq[sq_head];
      sq_head = (sq_head + 1) % config.max_send_wr;
      --sq_count;
      flush_one_send(w.work);
    }
    while (rq_count > 0) {
      ReceiveWqe& r = rq[rq_head];
      Completion c;
      c.wr_id = r.work.wr_id;
      c.status = r.status != CompletionStatus::success ? r.status : CompletionStatus::work_request_flushed;
      c.opcode = CompletionOpcode::receive;
      c.qp_number = config.local_qpn;
      rq_head = (rq_head + 1) % config.max_recv_wr;
      --rq_count;
      deliver(c);
    }
    lost_count = 0;
    reads_count = 0;
    outstanding_rd_atomic = 0;
    rto_deadline = never;
    probe_deadline = never;
    ack_due = never;
  }
};

// =========================================================================

QpEngine::QpEngine(const EngineConfig& config, MemoryAccess& memory, CompletionSink& sink)
    : s_(std::make_unique<State>(config, memory, sink)) {}
QpEngine::~QpEngine() = default;

PostResult QpEngine::post_send(const SendWork& work, uint64_t now_ns) {
  (void)now_ns;
  return s_->post_send(work);
}

PostResult QpEngine::post_receive(const ReceiveWork& work) {
  State& s = *s_;
  if (work.segment_count > max_segments) return PostResult::invalid_argument;
  if (s.error) {
    Completion c;
    c.wr_id = work.wr_id;
    c.status = CompletionStatus::work_request_flushed;
    c.opcode = CompletionOpcode::receive;
    c.qp_number = s.config.local_qpn;
    s.deliver(c);
    return PostResult::ok;
  }
  if (s.rq_count == s.config.max_recv_wr) return PostResult::queue_full;
  ReceiveWqe& r = s.rq[(s.rq_head + s.rq_count) % s.config.max_recv_wr];
  r = ReceiveWqe{};
  r.work = work;
  r.generation = s.memory.generation();
  for (uint32_t i = 0; i < work.segment_count; ++i) r.capacity += work.segments[i].length;
  ++s.rq_count;
  return PostResult::ok;
}

void QpEngine::receive(const uint8_t* data, size_t length, const IcrcAddresses& addresses, uint64_t now_ns, uint64_t arrival_ns) {
  Header h;
  const DecodeError e = decode(s_->config.mode, data, length, addresses, h);
  if (e != DecodeError::none) {
    ++s_->counters.decode_errors;
    return;
  }
  if (!s_->token_accepted(h)) return;
  s_->counters.rx_bytes += length;
  receive_decoded(h, now_ns, arrival_ns);
}

void QpEngine::receive_decoded(const Header& h, uint64_t now_ns, uint64_t arrival_ns) {
  State& s = *s_;
  // Before anything else: a packet without this connection's token (stellar)
  // changes no state: not the PSN window, not acknowledgements, not memory.
  if (!s.token_accepted(h)) return;
  ++s.counters.rx_packets;
  const uint64_t arrival = arrival_ns && arrival_ns <= now_ns ? arrival_ns : now_ns;
  if (h.dest_qpn != s.config.local_qpn || h.pkey != s.config.pkey) {
    ++s.counters.unexpected_packets;
    return;
  }
  if (s.error) return;
  if (opcode_is_request(h.opcode)) s.latest_request_arrival = arrival;
  // Host delay on both ends: this packet waited (now - arrival) for us to
  // poll; the peer held what it acknowledges for ack_delay_ns.
  s.ack_host_delay = (now_ns - arrival) + (s.config.mode == Mode::stellar && h.has_ack ? h.ack_delay_ns : 0);
  if (s.config.mode == Mode::stellar && h.has_ack) {
    uint64_t rtt = 0, bytes = 0;
    s.apply_cumulative(h.ack_psn, now_ns, rtt, bytes);
    s.apply_sack(h.ack_psn, h.sack_bitmap, now_ns, rtt, bytes);
    s.after_acknowledgement(now_ns, rtt, bytes);
    if (s.error) return;
  }
  if (opcode_is_request(h.opcode)) {
    s.on_request(h, now_ns);
  } else if (h.opcode == opcode::acknowledge) {
    s.on_ack_packet(h, now_ns);
  } else {
    s.on_response(h, now_ns);
  }
}

size_t QpEngine::transmit(TxBuffer* buffers, size_t count, uint64_t now_ns) {
  State& s = *s_;
  s.transmit_now = now_ns;
  s.cc->on_tick(now_ns);
  if (!s.error && s.rto_deadline <= now_ns && s.una != s.max_sent) s.on_timeout(now_ns);
  if (!s.error && s.probe_deadline <= now_ns && s.una != s.max_sent) s.on_probe(now_ns);
  size_t n = s.transmit_responses(buffers, count);
  if (!s.error) n += s.transmit_requests(buffers + n, count - n, now_ns);
  if (!s.error) n += s.transmit_ack(buffers + n, count - n, now_ns);
  return n;
}

uint64_t QpEngine::next_wakeup_ns(uint64_t now_ns) const {
  const State& s = *s_;
  if (s.control_count || s.reads_count) return now_ns;
  if (s.error) return never;
  uint64_t t = std::min(s.ack_due, s.una != s.max_sent ? std::min(s.rto_deadline, s.probe_deadline) : never);
  if (s.lost_count > 0 || s.in_order_ready()) {
    if (now_ns < s.rnr_until) return std::min(t, s.rnr_until);
    const uint64_t pace = s.cc->next_send_time_ns(now_ns, uint64_t(s.inflight_packets) * s.config.mtu, s.config.mtu);
    t = std::min(t, pace);
  }
  return t;
}

void QpEngine::acknowledge_now(uint64_t now_ns) {
  if (s_->ack_due != never) s_->ack_due = std::min(s_->ack_due, now_ns);
}

size_t QpEngine::transmit_final_acknowledgement(TxBuffer* buffers, size_t count, uint64_t now_ns) {
  if (s_->error) return 0;
  acknowledge_now(now_ns);
  return s_->transmit_ack(buffers, count, now_ns);
}

void QpEngine::enter_error() { s_->enter_error(); }

bool QpEngine::set_ready(uint64_t wr_id, uint32_t bytes) {
  State& s = *s_;
  for (uint32_t i = 0; i < s.sq_count; ++i) {
    SendWqe& w = s.sq[(s.sq_head + i) % s.config.max_send_wr];
    if (w.work.wr_id != wr_id) continue;
    w.ready = std::max(w.ready, std::min(bytes, w.length));
    return true;
  }
  return false;
}
bool QpEngine::in_error() const { return s_->error; }
uint32_t QpEngine::outstanding_sends() const { return s_->sq_count; }
uint32_t QpEngine::outstanding_receives() const { return s_->rq_count; }
const EngineCounters& QpEngine::counters() const { return s_->counters; }
const EngineConfig& QpEngine::config() const { return s_->config; }
uint64_t QpEngine::rto_ns() const { return s_->rto; }
uint64_t QpEngine::smoothed_rtt_ns() const { return s_->srtt; }
const CongestionControl& QpEngine::congestion_control() const { return *s_->cc; }

size_t flatten(const TxBuffer& b, uint8_t* out, size_t capacity) {
  if (b.length > capacity) return 0;
  if (b.piece_count == 0) {
    std::memcpy(out, b.data, b.length);
    return b.length;
  }
  uint8_t* p = out;
  std::memcpy(p, b.data, b.header_length);
  p += b.header_length;
  for (uint32_t i = 0; i < b.piece_count; ++i) {
    std::memcpy(p, b.pieces[i].data, b.pieces[i].length);
    p += b.pieces[i].length;
  }
  std::memcpy(p, b.trailer, b.trailer_length);
  return b.length;
}

const char* to_string(CompletionStatus s) {
  switch (s) {
    case CompletionStatus::success: return "success";
    case CompletionStatus::local_length_error: return "local length error";
    case CompletionStatus::local_qp_operation_error: return "local QP operation error";
    case CompletionStatus::local_protection_error: return "local protection error";
    case CompletionStatus::work_request_flushed: return "work request flushed";
    case CompletionStatus::bad_response: return "bad response";
    case CompletionStatus::remote_invalid_request: return "remote invalid request";
    case CompletionStatus::remote_access_error: return "remote access error";
    case CompletionStatus::remote_operation_error: return "remote operation error";
    case CompletionStatus::retry_exceeded: return "transport retry counter exceeded";
    case CompletionStatus::rnr_retry_exceeded: return "RNR retry counter exceeded";
  }
  return "?";
}

const char* to_string(CompletionOpcode o) {
  switch (o) {
    case CompletionOpcode::send: return "send";
    case CompletionOpcode::rdma_write: return "rdma_write";
    case CompletionOpcode::rdma_read: return "rdma_read";
    case CompletionOpcode::compare_swap: return "compare_swap";
    case CompletionOpcode::fetch_add: return "fetch_add";
    case CompletionOpcode::receive: return "receive";
    case CompletionOpcode::receive_rdma_with_imm: return "receive_rdma_with_imm";
  }
  return "?";
}

}  // namespace stellar::offload

// The requester: see requester.hpp for what it owns and whom it calls.
#include "requester.hpp"

namespace stellar::offload::detail {

Requester::Requester(Context& ctx, CongestionControl& cc, LossRecovery& recovery, PathSet& paths)
    : ctx_(ctx), cc_(cc), recovery_(recovery), paths_(paths), window_(ctx, paths), sq_(ctx.config.max_send_wr) {
  send_psn_ = assign_psn_ = acked_upto_ = window_.una;
}

void Requester::repacketize() {
  const uint32_t mtu = ctx_.config.mtu;
  uint32_t psn = window_.una;
  for (uint32_t k = 0; k < sq_count_; ++k) {
    SendWqe& w = sq_[ring_add(sq_head_, k, ctx_.config.max_send_wr)];
    w.first_psn = psn;
    w.packet_count = is_atomic(w.work.opcode) ? 1 : packets_for(w.length, mtu);
    psn = add(psn, w.packet_count);
  }
  assign_psn_ = psn;
  send_psn_ = window_.una;
  send_cursor_ = sq_head_;
}

// A READ is asked for in pieces: piece k covers PSNs [first + k*piece,
// first + (k+1)*piece). At most half the window (the responder refuses
// more, and the responses must fit the window with the requests behind
// them) and at most max_read_request_packets: a piece's responses arrive as
// one burst, which a software requester's socket must hold. Each piece
// takes a max_rd_atomic credit when first sent and returns it when una
// passes its end, so pieces pipeline (congestion control gates them by the
// response packets they put in flight) without ever having more requests
// at the responder than max_rd_atomic.
uint32_t Requester::read_piece_packets() const {
  return std::max<uint32_t>(1, std::min(ctx_.config.max_read_request_packets, ctx_.config.window_packets / 2));
}

// PSNs one READ request from `psn` asks for: the rest of its piece, never
// beyond. A re-request from the middle of a piece must stay inside the PSN
// range the responder already accepted, as a verbs requester's retried
// READ stays inside the original request.
uint32_t Requester::read_request_packets(const SendWqe& w, uint32_t psn) const {
  const uint32_t piece = read_piece_packets();
  const uint32_t index = uint32_t(diff(psn, w.first_psn));
  return std::min(w.packet_count, (index / piece + 1) * piece) - index;
}

// The bytes of a SEND or WRITE that its packet `index` carries. RoCE's
// layout (IBTA): every packet a full MTU but the last. A stellar-mode WRITE
// longer than an MTU and not a multiple of it puts the short piece first
// instead: the packets after the first, which the receiving host can place
// straight into the target (EngineHost::receive_into_place), are then all
// full, the last one included, and the bytes a receiver copies are the
// short piece rather than a whole MTU. A 64 KiB WRITE at loopback's 61440
// bytes: a 4096-byte first packet and a 61440-byte last one. The responder
// takes each packet at its message_offset, so only the sender's layout
// changes.
void Requester::packet_span(const SendWqe& w, uint32_t index, uint64_t& offset, uint32_t& payload) const {
  const uint32_t mtu = ctx_.config.mtu;
  // (The remainder only for a WRITE of more than one packet: a division.)
  const bool long_write = ctx_.config.mode == Mode::stellar && w.length > mtu &&
                          (w.work.opcode == WorkOpcode::rdma_write || w.work.opcode == WorkOpcode::rdma_write_with_imm);
  const uint32_t remainder = long_write ? uint32_t(w.length % mtu) : 0;
  if (remainder != 0) {
    offset = index == 0 ? 0 : remainder + uint64_t(index - 1) * mtu;
    payload = index == 0 ? remainder : mtu;
    return;
  }
  offset = uint64_t(index) * mtu;
  payload = uint32_t(std::min<uint64_t>(mtu, w.length > offset ? w.length - offset : 0));
}

// Whether the packet at psn carries payload that is not in place yet
// (a staged source still being copied).
bool Requester::waits_for_payload(const SendWqe& w, uint32_t psn) const {
  if (w.ready >= w.length) return false;
  uint64_t offset;
  uint32_t payload;
  packet_span(w, uint32_t(diff(psn, w.first_psn)), offset, payload);
  return offset + payload > w.ready;
}

// Whether the request at psn needs a max_rd_atomic credit: the first
// transmission of an atomic or of a READ piece (retransmissions reuse it).
bool Requester::needs_credit(const SendWqe& w, uint32_t psn) const {
  if (!needs_response(w.work.opcode) || diff(psn, window_.max_sent) < 0) return false;
  return psn == w.first_psn || uint32_t(diff(psn, w.first_psn)) % read_piece_packets() == 0;
}

PostResult Requester::post_send(const SendWork& work) {
  const EngineConfig& config = ctx_.config;
  if (ctx_.error) {
    flush_one_send(work);
    return PostResult::ok;
  }
  if (const PostResult shape = check_send_work(work, config); shape != PostResult::ok) return shape;
  if (sq_count_ == config.max_send_wr) return PostResult::queue_full;
  uint64_t length = 0;
  for (uint32_t i = 0; i < work.segment_count; ++i) length += work.segments[i].length;
  const uint32_t packets = is_atomic(work.opcode) ? 1 : packets_for(length, config.mtu);
  const uint32_t max_span = (ctx_.psn.mask >> 2) + 1;
  if (uint64_t(uint32_t(diff(assign_psn_, window_.una))) + packets > max_span) return PostResult::queue_full;

  const uint32_t index = ring_add(sq_head_, sq_count_, config.max_send_wr);
  SendWqe& w = sq_[index];
  copy_work(w.work, work);
  w.length = uint32_t(length);
  w.first_psn = assign_psn_;
  w.packet_count = packets;
  w.status = CompletionStatus::success;
  w.failed = false;
  w.credits = 0;
  w.ready = work.staged && !work.inline_data && !needs_response(work.opcode) ? 0 : w.length;
  w.generation = ctx_.memory.generation();
  w.receive_sequence = consumes_receive(work.opcode) ? next_receive_sequence_++ : 0;
  if (work.inline_data) {
    gather(ctx_, work.segments, work.segment_count, 0, w.inline_data, w.length);  // unkeyed: the caller's bytes
    w.work.segment_count = 1;
    w.work.segments[0] = Segment{w.inline_data, w.length, 0};
  }
  if (send_psn_ == assign_psn_) send_cursor_ = index;
  assign_psn_ = add(assign_psn_, packets);
  ++sq_count_;
  return PostResult::ok;
}

bool Requester::set_ready(uint64_t wr_id, uint32_t bytes) {
  for (uint32_t i = 0; i < sq_count_; ++i) {
    SendWqe& w = sq_[ring_add(sq_head_, i, ctx_.config.max_send_wr)];
    if (w.work.wr_id != wr_id) continue;
    w.ready = std::max(w.ready, std::min(bytes, w.length));
    return true;
  }
  return false;
}

void Requester::flush_one_send(const SendWork& work) {
  Completion c;
  c.wr_id = work.wr_id;
  c.status = CompletionStatus::work_request_flushed;
  c.opcode = completion_opcode(work.opcode);
  c.qp_number = ctx_.config.local_qpn;
  ctx_.deliver(c);
}

void Requester::flush() {
  while (sq_count_ > 0) {
    SendWqe& w = sq_[sq_head_];
    sq_head_ = ring_next(sq_head_, ctx_.config.max_send_wr);
    --sq_count_;
    flush_one_send(w.work);
  }
  outstanding_rd_atomic_ = 0;
}

// The WQE whose PSN range holds psn (psn is assigned). Fast path: the cursor.
uint32_t Requester::find_wqe(uint32_t psn) const {
  for (uint32_t i = 0; i < sq_count_; ++i) {
    const uint32_t index = ring_add(sq_head_, i, ctx_.config.max_send_wr);
    const SendWqe& w = sq_[index];
    if (diff(psn, w.first_psn) >= 0 && diff(psn, add(w.first_psn, w.packet_count)) < 0) return index;
  }
  return sq_head_;
}

void Requester::rewind(uint32_t psn) {
  if (!window_.outstanding(psn) && psn != window_.max_sent) return;
  if (diff(psn, send_psn_) < 0) {
    // Everything from psn on is sent again (go-back-N); drop in-flight accounting of those.
    for (uint32_t p = psn; diff(p, window_.max_sent) < 0; p = add(p, 1)) window_.leave_flight(slot(p));
    send_psn_ = psn;
    send_cursor_ = find_wqe(psn);
  }
}

void Requester::mark_done(uint32_t psn, uint64_t now, uint64_t& rtt_sample, uint64_t& acked_bytes) {
  Slot& s = slot(psn);
  if (s.flags & slot_done) return;
  recovery_.on_packet_done(psn, s, now, rtt_sample);
  window_.leave_flight(s);
  s.flags = uint8_t((s.flags | slot_done) & ~slot_lost);
  acked_bytes += ctx_.config.mtu;
}

// Applies "every PSN before cum has arrived" from the peer's responder.
void Requester::apply_cumulative(uint32_t cum, uint64_t now, uint64_t& rtt, uint64_t& bytes) {
  if (diff(cum, window_.max_sent) > 0 || diff(cum, window_.una) <= 0) return;
  uint32_t from = diff(acked_upto_, window_.una) > 0 ? acked_upto_ : window_.una;
  for (uint32_t p = from; diff(p, cum) < 0; p = add(p, 1)) {
    Slot& s = slot(p);
    if (!needs_response(sq_[s.wqe].work.opcode)) mark_done(p, now, rtt, bytes);
  }
  if (diff(cum, acked_upto_) > 0) acked_upto_ = cum;
  if (ctx_.config.mode == Mode::roce) {
    // A cumulative ACK past a READ or atomic whose response never came means
    // the response was lost: a RoCE requester re-issues from there.
    for (uint32_t p = window_.una; diff(p, cum) < 0; p = add(p, 1)) {
      if (!(slot(p).flags & slot_done)) {
        if (recovery_.response_missing(p, false, 0, now)) rewind(p);
        break;
      }
    }
  }
}

void Requester::apply_sack(uint32_t cum, uint64_t bitmap, uint16_t offset, uint64_t now, uint64_t& rtt, uint64_t& bytes) {
  for (uint32_t i = 0; bitmap != 0 && i < 64; ++i, bitmap >>= 1) {
    if (!(bitmap & 1)) continue;
    const uint32_t p = add(cum, i + 1 + offset);
    if (!window_.outstanding(p)) continue;
    Slot& s = slot(p);
    if (!needs_response(sq_[s.wqe].work.opcode)) mark_done(p, now, rtt, bytes);
  }
}

void Requester::after_acknowledgement(uint64_t now, uint64_t rtt, uint64_t bytes) {
  recovery_.on_acknowledgement(now, rtt, bytes, host_delay_);
  if (bytes) consecutive_rnr_ = 0;
  const uint32_t before = window_.una;
  advance_una();
  recovery_.rearm(now, window_.una != before, bytes != 0);
  complete_sends();
}

void Requester::advance_una() {
  uint32_t& una = window_.una;
  while (diff(window_.max_sent, una) > 0 && (slot(una).flags & slot_done)) {
    SendWqe& w = sq_[slot(una).wqe];
    if (w.work.opcode == WorkOpcode::rdma_read && w.credits > 0) {
      const uint32_t below = uint32_t(diff(una, w.first_psn)) + 1;  // w's packets below una after this one
      if (below % read_piece_packets() == 0 || below == w.packet_count) {
        --w.credits;  // a whole piece is in: its credit comes back
        if (outstanding_rd_atomic_ > 0) --outstanding_rd_atomic_;
      }
    }
    slot(una).flags = 0;
    una = add(una, 1);
  }
  recovery_.on_una_advanced();
  // Keep the cursors inside the window so PSN arithmetic stays valid.
  if (diff(una, acked_upto_) > 0) acked_upto_ = una;
  if (diff(una, send_psn_) > 0) {
    send_psn_ = una;
    if (send_psn_ != assign_psn_) send_cursor_ = find_wqe(send_psn_);
  }
}

void Requester::complete_sends() {
  while (sq_count_ > 0 && !ctx_.error) {
    SendWqe& w = sq_[sq_head_];
    const uint32_t end = add(w.first_psn, w.packet_count);
    const uint32_t sent_end = diff(end, window_.max_sent) > 0 ? window_.max_sent : end;
    if (diff(window_.una, w.failed ? sent_end : end) < 0) break;
    outstanding_rd_atomic_ -= std::min(outstanding_rd_atomic_, w.credits);  // an atomic's, or a failed READ's rest
    w.credits = 0;
    if (w.failed) {
      Completion c;
      c.wr_id = w.work.wr_id;
      c.status = w.status;
      c.opcode = completion_opcode(w.work.opcode);
      c.qp_number = ctx_.config.local_qpn;
      sq_head_ = ring_next(sq_head_, ctx_.config.max_send_wr);
      --sq_count_;
      ctx_.deliver(c);
      ctx_.enter_error();
      return;
    }
    if (w.work.signaled) {
      Completion c;
      c.wr_id = w.work.wr_id;
      c.opcode = completion_opcode(w.work.opcode);
      c.byte_length = w.length;
      c.qp_number = ctx_.config.local_qpn;
      ctx_.deliver(c);
    }
    sq_head_ = ring_next(sq_head_, ctx_.config.max_send_wr);
    --sq_count_;
  }
}

void Requester::fail_at(uint32_t psn, CompletionStatus status) {
  if (!window_.outstanding(psn)) {
    ++ctx_.counters.unexpected_packets;
    return;
  }
  // Only PSNs already sent have slots; the rest of the WQE is never sent
  // (fatal_psn) and complete_sends finishes it once una reaches max_sent.
  fail_wqe(slot(psn).wqe, status);
}

void Requester::fail_head(CompletionStatus status) {
  if (sq_count_ == 0) return;
  SendWqe& w = sq_[sq_head_];
  Completion c;
  c.wr_id = w.work.wr_id;
  c.status = status;
  c.opcode = completion_opcode(w.work.opcode);
  c.qp_number = ctx_.config.local_qpn;
  sq_head_ = ring_next(sq_head_, ctx_.config.max_send_wr);
  --sq_count_;
  ctx_.deliver(c);
  ctx_.enter_error();
}

// Fails a WQE before or while it is being sent (a local error): nothing
// more of it goes out; it completes with `status` in posting order.
void Requester::fail_wqe(uint32_t index, CompletionStatus status) {
  SendWqe& w = sq_[index];
  if (w.failed) return;
  w.failed = true;
  w.status = status;
  uint64_t rtt = 0, bytes = 0;
  const uint32_t end = add(w.first_psn, w.packet_count);
  for (uint32_t p = diff(window_.una, w.first_psn) > 0 ? window_.una : w.first_psn;
       diff(p, end) < 0 && diff(p, window_.max_sent) < 0; p = add(p, 1))
    mark_done(p, 0, rtt, bytes);
  if (!fatal_ || diff(w.first_psn, fatal_psn_) < 0) {
    fatal_ = true;
    fatal_psn_ = w.first_psn;
  }
  advance_una();
  complete_sends();
}

// True if the WQE's local memory for [offset, offset + length) may be used.
bool Requester::local_ok(SendWqe& w, uint64_t offset, uint64_t length, uint32_t access) {
  const uint64_t now_generation = ctx_.memory.generation();
  if (w.generation == now_generation) return true;
  if (!segments_valid(ctx_.memory, w.work.segments, w.work.segment_count, offset, length, access)) return false;
  w.generation = now_generation;  // still valid: no need to look again until the next deregistration
  return true;
}

// ---------------------------------------------------------------------------
// receive path

void Requester::on_piggybacked_ack(uint32_t ack_psn, uint64_t sack_bitmap, uint16_t sack_offset, uint64_t now,
                                   uint64_t host_delay) {
  host_delay_ = host_delay;
  uint64_t rtt = 0, bytes = 0;
  apply_cumulative(ack_psn, now, rtt, bytes);
  apply_sack(ack_psn, sack_bitmap, sack_offset, now, rtt, bytes);
  after_acknowledgement(now, rtt, bytes);
}

void Requester::on_ack_packet(const Header& h, uint64_t now, uint64_t host_delay) {
  host_delay_ = host_delay;
  const EngineConfig& config = ctx_.config;
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
    ++ctx_.counters.rnr_naks_received;
    after_acknowledgement(now, rtt, bytes);
    // Every packet of a message may draw an RNR NAK: count one retry per wait period.
    const bool new_period = now >= rnr_until_;
    if (new_period && config.rnr_retry != 7 && ++consecutive_rnr_ > config.rnr_retry) {
      fail_at(h.psn, CompletionStatus::rnr_retry_exceeded);
      return;
    }
    if (new_period) rnr_until_ = now + config.rnr_delay_ns;
    if (!window_.outstanding(h.psn)) return;
    if (config.mode == Mode::roce) {
      rewind(h.psn);
    } else {
      recovery_.requeue(h.psn);
    }
    recovery_.restart_timer_after(rnr_until_);
    return;
  }
  if (h.syndrome == syndrome::nak_psn_sequence) {
    ++ctx_.counters.sequence_naks_received;
    after_acknowledgement(now, rtt, bytes);
    cc_.on_loss(now);
    rewind(h.psn);
    return;
  }
  after_acknowledgement(now, rtt, bytes);
  fail_at(h.psn, status_from_syndrome(h.syndrome));
}

// READ response or atomic ACK for PSN h.psn.
void Requester::on_response(const Header& h, uint64_t now, uint64_t host_delay) {
  host_delay_ = host_delay;
  if (!window_.outstanding(h.psn)) {
    ++ctx_.counters.duplicates;
    return;
  }
  Slot& s = slot(h.psn);
  SendWqe& w = sq_[s.wqe];
  const bool is_read = opcode_is_read_response(h.opcode);
  if ((is_read && w.work.opcode != WorkOpcode::rdma_read) || (!is_read && !is_atomic(w.work.opcode)) ||
      !(s.flags & slot_sent)) {
    ++ctx_.counters.unexpected_packets;
    return;
  }
  if (s.flags & slot_done) {
    ++ctx_.counters.duplicates;
    return;
  }
  uint64_t rtt = 0, bytes = 0;
  if (ctx_.config.mode == Mode::roce) {
    // Responses imply that every earlier request was executed.
    apply_cumulative(w.first_psn, now, rtt, bytes);
    for (uint32_t p = diff(window_.una, w.first_psn) > 0 ? window_.una : w.first_psn; diff(p, h.psn) < 0; p = add(p, 1)) {
      if (!(slot(p).flags & slot_done)) {
        // Go-back-N: dropped; asked for again with everything from p.
        ++ctx_.counters.out_of_order;
        if (recovery_.response_missing(p, true, h.psn, now)) rewind(p);
        recovery_.response_arrived(h.psn);
        after_acknowledgement(now, rtt, bytes);
        return;
      }
    }
    recovery_.response_arrived(h.psn);
  }
  const uint32_t mtu = ctx_.config.mtu;
  if (is_read) {
    const uint64_t offset = uint64_t(diff(h.psn, w.first_psn)) * mtu;
    const uint32_t expected = uint32_t(std::min<uint64_t>(mtu, w.length - offset));
    if (h.payload_length != expected) {
      ++ctx_.counters.invalid_requests;
      return;
    }
    if (!local_ok(w, offset, expected, access_local_write)) {
      fail_at(h.psn, CompletionStatus::local_protection_error);
      return;
    }
    if (!scatter(ctx_, w.work.segments, w.work.segment_count, offset, h.payload, h.payload_length)) {
      fail_at(h.psn, CompletionStatus::local_protection_error);
      return;
    }
  } else {
    if (!local_ok(w, 0, 8, access_local_write)) {
      fail_at(h.psn, CompletionStatus::local_protection_error);
      return;
    }
    const uint64_t original = h.atomic_original;
    if (!ctx_.copy_in(w.work.segments[0].address, &original, 8)) {
      fail_at(h.psn, CompletionStatus::local_protection_error);
      return;
    }
  }
  mark_done(h.psn, now, rtt, bytes);
  after_acknowledgement(now, rtt, bytes);
}

// ---------------------------------------------------------------------------
// transmit path

void Requester::on_timers(uint64_t now) {
  if (!ctx_.error && recovery_.timeout_due(now)) {
    switch (recovery_.on_timeout(now)) {
      case LossRecovery::Timeout::retry_exceeded: fail_head(CompletionStatus::retry_exceeded); break;
      case LossRecovery::Timeout::go_back: rewind(window_.una); break;
      case LossRecovery::Timeout::retransmit: break;
    }
  }
  if (!ctx_.error && recovery_.probe_due(now)) recovery_.on_probe(now);
  if (!ctx_.error && recovery_.reorder_due(now)) recovery_.on_reorder_timer(now);
}

bool Requester::may_send_request(uint64_t now, uint32_t bytes) const {
  if (now < rnr_until_) return false;
  return cc_.can_send(now, uint64_t(window_.inflight_packets) * ctx_.config.mtu, bytes);
}

// Builds the request packet for PSN psn into b. A READ request asks for
// `read_packets` response packets from psn (at most to the end of its
// piece, read_request_packets).
uint32_t Requester::build_request(PacketWriter& writer, uint32_t psn, uint32_t wqe_index, uint32_t read_packets,
                                  uint16_t path, TxBuffer& b, uint32_t& psns_used) {
  const EngineConfig& config = ctx_.config;
  SendWqe& w = sq_[wqe_index];
  const uint32_t index = uint32_t(diff(psn, w.first_psn));
  uint64_t offset = uint64_t(index) * config.mtu;  // a READ's requests: whole MTUs
  uint32_t span = 0;
  if (w.work.opcode != WorkOpcode::rdma_read && !is_atomic(w.work.opcode)) packet_span(w, index, offset, span);
  Header h = ctx_.addressed();
  h.psn = psn;
  h.path = path;
  h.solicited = w.work.solicited;
  psns_used = 1;
  const bool first = index == 0, last = index + 1 == w.packet_count;
  uint32_t payload = 0;
  switch (w.work.opcode) {
    case WorkOpcode::send:
    case WorkOpcode::send_with_imm:
      h.opcode = message_opcode(opcode::send_first, first, last, w.work.opcode == WorkOpcode::send_with_imm);
      payload = span;
      break;
    case WorkOpcode::rdma_write:
    case WorkOpcode::rdma_write_with_imm:
      h.opcode = message_opcode(opcode::write_first, first, last, w.work.opcode == WorkOpcode::rdma_write_with_imm);
      payload = span;
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
                  uint32_t(diff(add(psn, psns_used), window_.una)) > config.window_packets / 2;
  const size_t at = payload_offset(config.mode, h);
  if (b.capacity < at + payload + max_trailer_bytes) return 0;
  if (payload && !local_ok(w, offset, payload, 0)) {
    local_fault_ = true;
    return 0;
  }
  b.piece_count = 0;
  if (payload >= zero_copy_bytes && ctx_.direct) {
    b.piece_count = slice(w.work.segments, w.work.segment_count, offset, payload, b.pieces);
  } else if (payload && !gather(ctx_, w.work.segments, w.work.segment_count, offset, b.data + at, payload)) {
    local_fault_ = true;  // the memory is out of reach: as a failed local check
    return 0;
  }
  return writer.finish(h, b);
}

void Requester::record_sent(uint32_t psn, uint32_t count, uint32_t wqe_index, uint64_t now, bool retransmission,
                            uint16_t path) {
  const uint8_t response = needs_response(sq_[wqe_index].work.opcode) ? slot_response : 0;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t p = add(psn, i);
    Slot& s = slot(p);
    if (diff(p, window_.max_sent) >= 0) {
      s = Slot{wqe_index, response, 0, 0};
      window_.max_sent = add(p, 1);
    }
    if (s.flags & slot_done) continue;
    if (retransmission || (s.flags & slot_sent)) s.flags |= slot_retransmitted;
    s.flags = uint8_t((s.flags | slot_sent | slot_in_flight) & ~slot_lost);
    s.sent_ns = now;
    s.path = path;
    ++window_.inflight_packets;
    paths_.on_sent(path);
  }
  recovery_.on_sent(now);
}

// Whether the in-order loop of transmit could send now, ignoring
// congestion control (next_wakeup_ns asks it separately).
bool Requester::in_order_ready() const {
  if (send_psn_ == assign_psn_ || ctx_.error) return false;
  if (fatal_ && diff(send_psn_, fatal_psn_) >= 0) return false;
  uint32_t index = send_cursor_;
  if (diff(send_psn_, sq_[index].first_psn) < 0 ||
      diff(send_psn_, add(sq_[index].first_psn, sq_[index].packet_count)) >= 0)
    index = find_wqe(send_psn_);
  const SendWqe& w = sq_[index];
  const uint32_t needed = w.work.opcode == WorkOpcode::rdma_read ? read_request_packets(w, send_psn_) : 1;
  if (uint32_t(diff(send_psn_, window_.una)) + needed > ctx_.config.window_packets - 64) return false;
  if (!w.failed && waits_for_payload(w, send_psn_)) return false;
  if (needs_credit(w, send_psn_) && outstanding_rd_atomic_ >= ctx_.config.max_rd_atomic) return false;
  return true;
}

size_t Requester::transmit(PacketWriter& writer, TxBuffer* buffers, size_t count, uint64_t now) {
  const EngineConfig& config = ctx_.config;
  size_t n = 0;
  // Selective retransmissions first (stellar).
  while (n < count && !ctx_.error) {
    uint32_t psn;
    if (!recovery_.next_lost(psn)) break;
    if (fatal_ && diff(psn, fatal_psn_) >= 0) {
      recovery_.discard_next();
      continue;
    }
    Slot& s = slot(psn);
    if (!may_send_request(now, config.mtu)) return n;
    // Lost READ responses in a row (a timeout marks a whole piece lost) are
    // asked for again with one request, not one request per packet: a
    // responder that was only slow would otherwise be buried in requests.
    uint32_t run = 1;
    if (sq_[s.wqe].work.opcode == WorkOpcode::rdma_read) run = recovery_.lost_run(psn, read_request_packets(sq_[s.wqe], psn));
    uint32_t used = 0;
    // Not the path it was lost on; after a timer (not marked by loss
    // detection), where a round trip worked.
    const uint16_t path = paths_.choose(now, s.path, !(s.flags & slot_reordered));
    if (!build_request(writer, psn, s.wqe, run, path, buffers[n], used)) {
      if (!local_fault_) return n;
      local_fault_ = false;
      fail_wqe(s.wqe, CompletionStatus::local_protection_error);
      continue;
    }
    record_sent(psn, used, s.wqe, now, true, path);
    recovery_.retransmitted(psn, used, now);
    cc_.on_send(now, buffers[n].length);
    ++ctx_.counters.retransmitted_packets;
    ++ctx_.counters.fast_retransmits;
    ++n;
  }
  // In-order transmission (first transmissions; after a rewind, go-back-N).
  while (n < count && send_psn_ != assign_psn_ && !ctx_.error) {
    if (fatal_ && diff(send_psn_, fatal_psn_) >= 0) break;
    SendWqe* w = &sq_[send_cursor_];
    if (diff(send_psn_, add(w->first_psn, w->packet_count)) >= 0 || diff(send_psn_, w->first_psn) < 0) {
      send_cursor_ = find_wqe(send_psn_);
      w = &sq_[send_cursor_];
    }
    const uint32_t needed = w->work.opcode == WorkOpcode::rdma_read ? read_request_packets(*w, send_psn_) : 1;
    if (uint32_t(diff(send_psn_, window_.una)) + needed > config.window_packets - 64) break;
    const bool credit = needs_credit(*w, send_psn_);
    if (credit && outstanding_rd_atomic_ >= config.max_rd_atomic) break;
    if (w->failed) {
      send_psn_ = add(w->first_psn, w->packet_count);
      continue;
    }
    if (waits_for_payload(*w, send_psn_)) break;  // set_ready() wakes the host's loop
    if (!may_send_request(now, config.mtu)) break;
    const bool retransmission = diff(send_psn_, window_.max_sent) < 0;
    uint32_t used = 0;
    const uint16_t path = paths_.choose(now);
    if (!build_request(writer, send_psn_, send_cursor_, needed, path, buffers[n], used)) {
      if (!local_fault_) break;
      local_fault_ = false;
      fail_wqe(send_cursor_, CompletionStatus::local_protection_error);
      continue;
    }
    record_sent(send_psn_, used, send_cursor_, now, retransmission, path);
    cc_.on_send(now, buffers[n].length);
    if (retransmission) ++ctx_.counters.retransmitted_packets;
    if (credit) {
      ++outstanding_rd_atomic_;
      ++w->credits;
    }
    send_psn_ = add(send_psn_, used);
    if (send_psn_ != assign_psn_ && diff(send_psn_, add(w->first_psn, w->packet_count)) >= 0)
      send_cursor_ = ring_next(send_cursor_, config.max_send_wr);
    ++n;
  }
  paths_.end_burst();
  return n;
}

uint64_t Requester::next_wakeup_ns(uint64_t now) const {
  uint64_t t = window_.idle() ? never : recovery_.deadline();
  if (recovery_.has_lost() || in_order_ready()) {
    if (now < rnr_until_) return std::min(t, rnr_until_);
    const uint64_t pace =
        cc_.next_send_time_ns(now, uint64_t(window_.inflight_packets) * ctx_.config.mtu, ctx_.config.mtu);
    t = std::min(t, pace);
  }
  return t;
}

}  // namespace stellar::offload::detail

namespace stellar::offload {

PostResult check_send_work(const SendWork& work, const EngineConfig& config) {
  if (work.segment_count > max_segments) return PostResult::invalid_argument;
  uint64_t length = 0;
  for (uint32_t i = 0; i < work.segment_count; ++i) length += work.segments[i].length;
  if (length > (1ull << 31)) return PostResult::invalid_argument;
  if (detail::is_atomic(work.opcode) &&
      (work.segment_count != 1 || work.segments[0].length != 8 || work.remote_addr % 8 != 0))
    return PostResult::invalid_argument;
  if (work.inline_data && (length > max_inline_bytes || detail::needs_response(work.opcode)))
    return PostResult::invalid_argument;
  if (config.mtu == 0) return PostResult::invalid_argument;
  const uint64_t packets = detail::is_atomic(work.opcode) ? 1 : detail::packets_for(length, config.mtu);
  // PSN comparisons (diff) hold within half the PSN space: the PSNs from the
  // oldest unacknowledged one to the end of this WR must span less than a
  // quarter of it (2^22 in roce mode, whose PSNs have 24 bits; e.g. 2 GiB at
  // a 256-byte MTU is 2^23). A READ larger than half the window is asked
  // for in pieces (read_request_packets).
  const uint32_t psn_mask = config.mode == Mode::roce ? 0xffffff : 0xffffffff;
  const uint64_t max_span = (psn_mask >> 2) + 1;
  return packets > max_span ? PostResult::invalid_argument : PostResult::ok;
}

}  // namespace stellar::offload

// The responder: see responder.hpp for what it owns and whom it calls.
#include "responder.hpp"

namespace stellar::offload::detail {

Responder::Responder(Context& ctx)
    : ctx_(ctx),
      rq_(ctx.config.max_recv_wr),
      received_(ctx.config.window_packets),
      reads_(ctx.config.max_read_responses),
      control_(control_capacity) {
  epsn_ = received_end_ = sack_cursor_ = ctx_.config.receive_psn & ctx_.psn.mask;
}

PostResult Responder::post_receive(const ReceiveWork& work) {
  if (work.segment_count > max_segments) return PostResult::invalid_argument;
  if (ctx_.error) {
    Completion c;
    c.wr_id = work.wr_id;
    c.status = CompletionStatus::work_request_flushed;
    c.opcode = CompletionOpcode::receive;
    c.qp_number = ctx_.config.local_qpn;
    ctx_.deliver(c);
    return PostResult::ok;
  }
  if (rq_count_ == ctx_.config.max_recv_wr) return PostResult::queue_full;
  ReceiveWqe& r = rq_[ring_add(rq_head_, rq_count_, ctx_.config.max_recv_wr)];
  r = ReceiveWqe{};
  copy_work(r.work, work);
  r.generation = ctx_.memory.generation();
  for (uint32_t i = 0; i < work.segment_count; ++i) r.capacity += work.segments[i].length;
  ++rq_count_;
  return PostResult::ok;
}

void Responder::fill_acknowledgement(Header& h, uint64_t transmit_now) {
  h.has_ack = true;
  h.ack_psn = epsn_;
  h.sack_offset = 0;
  h.sack_bitmap = 0;
  if (diff(received_end_, epsn_) > 1) {
    // Past the first hole: the 64 PSNs after it, unless arrivals further on
    // wait to be reported (then from the lowest of them, 64 at a time).
    const uint32_t first = add(epsn_, 1);
    if (diff(sack_cursor_, first) < 0) sack_cursor_ = first;
    uint32_t base = first;
    if (diff(sack_cursor_, add(first, 64)) >= 0 && diff(received_end_, sack_cursor_) > 0)
      base = diff(sack_cursor_, first) <= 0xffff ? sack_cursor_ : add(first, 0xffff);
    h.sack_offset = uint16_t(diff(base, first));
    h.sack_bitmap = sack_bitmap(base);
    if (diff(add(base, 64), sack_cursor_) > 0) sack_cursor_ = add(base, 64);
  } else {
    sack_cursor_ = received_end_;
  }
  h.ack_delay_ns = latest_request_arrival_ && transmit_now >= latest_request_arrival_
                       ? uint32_t(std::min<uint64_t>(transmit_now - latest_request_arrival_, UINT32_MAX))
                       : 0;
}

void Responder::flush() {
  while (rq_count_ > 0) {
    ReceiveWqe& r = rq_[rq_head_];
    Completion c;
    c.wr_id = r.work.wr_id;
    c.status = r.status != CompletionStatus::success ? r.status : CompletionStatus::work_request_flushed;
    c.opcode = CompletionOpcode::receive;
    c.qp_number = ctx_.config.local_qpn;
    rq_head_ = ring_next(rq_head_, ctx_.config.max_recv_wr);
    --rq_count_;
    ctx_.deliver(c);
  }
  reads_count_ = 0;
  ack_due_ = never;
}

uint64_t Responder::sack_bitmap(uint32_t base) const {
  uint64_t bits = 0;
  for (uint32_t i = 0; i < 64; ++i) {
    const uint32_t p = add(base, i);
    if (diff(p, received_end_) >= 0) break;
    if (received_[p & ctx_.window_mask]) bits |= uint64_t(1) << i;
  }
  return bits;
}

bool Responder::sack_pending() const {
  return ctx_.config.mode == Mode::stellar && diff(received_end_, add(epsn_, 65)) > 0 &&
         diff(received_end_, sack_cursor_) > 0;
}

void Responder::queue_control(uint8_t op, uint8_t syn, uint32_t psn, uint64_t original) {
  if (control_count_ == control_.size()) return;  // the requester's timer recovers
  control_[ring_add(control_head_, control_count_, uint32_t(control_.size()))] = Control{op, syn, psn, original};
  ++control_count_;
}

void Responder::schedule_ack(uint64_t now, bool immediately) {
  ++unacked_;
  const uint64_t due = (immediately || unacked_ >= ctx_.config.ack_every_packets) ? now : now + ctx_.config.ack_delay_ns;
  ack_due_ = std::min(ack_due_, due);
}

ReceiveWqe* Responder::receive_for(uint32_t sequence) {
  const int32_t ahead = int32_t(sequence - rq_head_sequence_);
  if (ahead < 0 || uint32_t(ahead) >= rq_count_) return nullptr;
  return &rq_[ring_add(rq_head_, uint32_t(ahead), ctx_.config.max_recv_wr)];
}

bool Responder::would_take(uint32_t psn) const {
  if (ctx_.config.mode != Mode::stellar) return false;
  const int32_t d = diff(psn, epsn_);
  if (d < 0 || d >= int32_t(ctx_.config.window_packets)) return false;
  if (failed_ && diff(psn, failed_psn_) >= 0) return false;
  return !received_[psn & ctx_.window_mask];
}

void Responder::on_request(const Header& h, uint64_t now) {
  const int32_t d = diff(h.psn, epsn_);
  const int32_t window = int32_t(ctx_.config.window_packets);
  if (d < 0) {
    if (d < -window) {
      ++ctx_.counters.out_of_window;
      return;
    }
    ++ctx_.counters.duplicates;
    replay_duplicate(h, now);
    return;
  }
  if (d >= window) {
    ++ctx_.counters.out_of_window;
    return;
  }
  if (failed_ && diff(h.psn, failed_psn_) >= 0) {
    ++ctx_.counters.naks_sent;
    queue_control(opcode::acknowledge, failed_syndrome_, failed_psn_);
    return;
  }
  if (ctx_.config.mode == Mode::roce) {
    if (d > 0) {
      ++ctx_.counters.out_of_order;
      if (!sequence_nak_sent_) {
        sequence_nak_sent_ = true;
        ++ctx_.counters.naks_sent;
        queue_control(opcode::acknowledge, syndrome::nak_psn_sequence, epsn_);
      }
      return;
    }
  } else {
    if (received_[h.psn & ctx_.window_mask]) {
      ++ctx_.counters.duplicates;
      // Its report may have been lost with an ACK (on a dead path): the
      // requester resent it. Report it again.
      if (diff(h.psn, sack_cursor_) < 0) sack_cursor_ = h.psn;
      schedule_ack(now, true);
      return;
    }
    if (d > 0) {
      ++ctx_.counters.out_of_order;
      if (h.opcode == opcode::read_request || h.opcode == opcode::compare_swap || h.opcode == opcode::fetch_add) {
        // Reads and atomics execute in order (they must see earlier
        // writes). A re-request of one already waiting takes its slot (a
        // READ: the longer of the two), not another; with every slot
        // taken the request is dropped, and the requester asks again.
        uint32_t free_slot = pending_capacity;
        for (uint32_t i = 0; i < pending_capacity; ++i) {
          if (pending_used_[i] && pending_[i].psn == h.psn && pending_[i].opcode == h.opcode) {
            if (h.opcode == opcode::read_request && h.dma_length > pending_[i].dma_length) pending_[i] = h;
            return;
          }
          if (!pending_used_[i] && free_slot == pending_capacity) free_slot = i;
        }
        if (free_slot == pending_capacity) {
          ++ctx_.counters.requests_dropped_full;
          return;
        }
        pending_[free_slot] = h;
        pending_used_[free_slot] = true;
        return;
      }
    }
  }
  execute(h, now, d > 0);
  drain_pending(now);
}

void Responder::execute(const Header& h, uint64_t now, bool out_of_order) {
  uint32_t consumed = 1;
  const Outcome outcome = apply_request(h, now, consumed);
  switch (outcome) {
    case Outcome::accepted: {
      // Out of order: SACK news. Filling a gap (epsn jumps past packets that
      // came ahead of it): the requester is timing the hole (loss detection
      // by time), so a delayed ACK would make a late packet look lost.
      // Either way, tell the requester at once, as TCP does (RFC 5681, 4.2).
      const uint32_t before = epsn_;
      mark_received(h.psn, consumed);
      schedule_ack(now, out_of_order || diff(epsn_, add(before, consumed)) > 0);
      complete_receives();
      break;
    }
    case Outcome::nak: break;
    case Outcome::rnr:
      ++ctx_.counters.rnr_naks_sent;
      queue_control(opcode::acknowledge, uint8_t(syndrome::rnr_nak | 0x0e), h.psn);
      break;
    case Outcome::dropped: break;
  }
}

void Responder::drain_pending(uint64_t now) {
  bool progress = true;
  while (progress) {
    progress = false;
    for (uint32_t i = 0; i < pending_capacity; ++i) {
      if (!pending_used_[i]) continue;
      const int32_t d = diff(pending_[i].psn, epsn_);
      if (d > 0) continue;
      pending_used_[i] = false;
      const Header h = pending_[i];
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

void Responder::mark_received(uint32_t psn, uint32_t count) {
  if (ctx_.config.mode == Mode::roce) {
    epsn_ = add(epsn_, count);
    sequence_nak_sent_ = false;
    return;
  }
  for (uint32_t i = 0; i < count; ++i) received_[add(psn, i) & ctx_.window_mask] = 1;
  if (diff(add(psn, count), received_end_) > 0) received_end_ = add(psn, count);
  if (diff(psn, sack_cursor_) < 0) sack_cursor_ = psn;  // a late arrival behind what was reported: report it
  while (received_[epsn_ & ctx_.window_mask]) {
    received_[epsn_ & ctx_.window_mask] = 0;
    epsn_ = add(epsn_, 1);
  }
}

// A fatal NAK (access or invalid request): like a verbs responder, accept
// nothing at or after that PSN any more; repeat the NAK instead.
void Responder::nak(uint32_t psn, uint8_t syn) {
  ++ctx_.counters.naks_sent;
  queue_control(opcode::acknowledge, syn, psn);
  if (!failed_ || diff(psn, failed_psn_) < 0) {
    failed_ = true;
    failed_psn_ = psn;
    failed_syndrome_ = syn;
  }
}

Responder::Outcome Responder::apply_request(const Header& h, uint64_t now, uint32_t& consumed) {
  (void)now;
  const uint8_t op = h.opcode;
  if (opcode_is_send(op)) return apply_send(h);
  if (opcode_is_write(op)) return apply_write(h);
  if (op == opcode::read_request) {
    const uint32_t length = h.dma_length;
    const uint32_t packets = packets_for(length, ctx_.config.mtu);
    if (packets > ctx_.config.window_packets / 2) {
      ++ctx_.counters.invalid_requests;
      nak(h.psn, syndrome::nak_invalid_request);
      return Outcome::nak;
    }
    if (length && !ctx_.memory.resolve(h.rkey, h.remote_addr, length, access_remote_read)) {
      ++ctx_.counters.access_errors;
      nak(h.psn, syndrome::nak_remote_access);
      return Outcome::nak;
    }
    if (reads_count_ == reads_.size()) {
      ++ctx_.counters.requests_dropped_full;
      return Outcome::dropped;  // the requester retries
    }
    reads_[ring_add(reads_head_, reads_count_, uint32_t(reads_.size()))] = ReadResponse{h.psn, h.remote_addr, h.rkey, length, packets, 0, packets};
    ++reads_count_;
    consumed = packets;
    msn_ = (msn_ + 1) & 0xffffff;
    return Outcome::accepted;
  }
  if (op == opcode::compare_swap || op == opcode::fetch_add) {
    if (h.remote_addr % 8 != 0) {
      ++ctx_.counters.invalid_requests;
      nak(h.psn, syndrome::nak_invalid_request);
      return Outcome::nak;
    }
    uint8_t* target = ctx_.memory.resolve(h.rkey, h.remote_addr, 8, access_remote_atomic);
    if (!target) {
      ++ctx_.counters.access_errors;
      nak(h.psn, syndrome::nak_remote_access);
      return Outcome::nak;
    }
    uint64_t original;
    if (ctx_.direct) {
      auto* word = reinterpret_cast<uint64_t*>(target);
      if (op == opcode::fetch_add) {
        original = __atomic_fetch_add(word, h.swap_add, __ATOMIC_SEQ_CST);
      } else {
        original = h.compare;
        __atomic_compare_exchange_n(word, &original, h.swap_add, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
      }
    } else {
      // The daemon: read, modify, write. Atomic with respect to every other
      // RDMA atomic on this memory (one engine host serialises them), as a
      // NIC's atomics are; not with respect to the CPU's own, as a NIC's
      // are not either (verbs' IBV_ATOMIC_HCA).
      uint64_t value = 0;
      bool ok = ctx_.copy_out(&value, target, 8);
      original = value;
      if (op == opcode::fetch_add) value += h.swap_add;
      else if (value == h.compare) value = h.swap_add;
      if (!ok || (value != original && !ctx_.copy_in(target, &value, 8))) {
        ++ctx_.counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        return Outcome::nak;
      }
    }
    atomic_replay_[atomic_replay_next_] = AtomicReplay{h.psn, original, true};
    atomic_replay_next_ = (atomic_replay_next_ + 1) % atomic_replay_capacity;
    queue_control(opcode::atomic_acknowledge, syndrome::ack, h.psn, original);
    msn_ = (msn_ + 1) & 0xffffff;
    return Outcome::accepted;
  }
  ++ctx_.counters.invalid_requests;
  return Outcome::dropped;
}

Responder::Outcome Responder::apply_send(const Header& h) {
  const uint8_t op = h.opcode;
  uint32_t sequence, offset;
  if (ctx_.config.mode == Mode::roce) {
    if (opcode_is_first(op) == roce_in_send_) {  // a first packet inside a message, or a middle without a first
      ++ctx_.counters.invalid_requests;
      nak(h.psn, syndrome::nak_invalid_request);
      return Outcome::nak;
    }
    sequence = roce_receive_sequence_;
    offset = opcode_is_first(op) ? 0 : roce_send_offset_;
  } else {
    sequence = h.receive_sequence;
    offset = h.message_offset;
  }
  ReceiveWqe* r = receive_for(sequence);
  if (!r) {
    if (int32_t(sequence - rq_head_sequence_) < 0) {
      ++ctx_.counters.invalid_requests;
      return Outcome::dropped;
    }
    return Outcome::rnr;
  }
  if (uint64_t(offset) + h.payload_length > r->capacity ||
      (ctx_.config.mode == Mode::stellar && h.message_length > r->capacity)) {
    ++ctx_.counters.invalid_requests;
    r->status = CompletionStatus::local_length_error;
    nak(h.psn, syndrome::nak_invalid_request);
    // A receive too small is fatal for the responder too (verbs semantics):
    // that receive completes with the length error, the rest are flushed.
    ctx_.enter_error();
    return Outcome::nak;
  }
  if (r->generation != ctx_.memory.generation()) {
    if (!segments_valid(ctx_.memory, r->work.segments, r->work.segment_count, offset, h.payload_length, access_local_write)) {
      // The receive buffer was deregistered: fatal for this side, as in verbs.
      r->status = CompletionStatus::local_protection_error;
      nak(h.psn, syndrome::nak_remote_operation);
      ctx_.enter_error();
      return Outcome::nak;
    }
    r->generation = ctx_.memory.generation();
  }
  if (!scatter(ctx_, r->work.segments, r->work.segment_count, offset, h.payload, h.payload_length)) {
    // The receive buffer is out of reach (the daemon's client unmapped it): as deregistered.
    r->status = CompletionStatus::local_protection_error;
    nak(h.psn, syndrome::nak_remote_operation);
    ctx_.enter_error();
    return Outcome::nak;
  }
  if (ctx_.config.mode == Mode::roce) {
    roce_in_send_ = !opcode_is_last(op);
    roce_send_offset_ = offset + h.payload_length;
  }
  if (opcode_is_last(op)) {
    r->last_seen = true;
    r->last_psn = h.psn;
    r->byte_length = ctx_.config.mode == Mode::roce ? offset + h.payload_length : h.message_length;
    r->has_imm = opcode_has_imm(op);
    r->imm = h.imm;
    r->rdma_with_imm = false;
    if (ctx_.config.mode == Mode::roce) ++roce_receive_sequence_;
    msn_ = (msn_ + 1) & 0xffffff;
  }
  return Outcome::accepted;
}

Responder::Outcome Responder::apply_write(const Header& h) {
  const uint8_t op = h.opcode;
  uint8_t* base = nullptr;
  uint64_t offset;
  uint32_t total;
  if (ctx_.config.mode == Mode::roce) {
    if (opcode_is_first(op) == roce_in_write_) {
      ++ctx_.counters.invalid_requests;
      nak(h.psn, syndrome::nak_invalid_request);
      return Outcome::nak;
    }
    if (opcode_is_first(op)) {
      roce_write_address_ = h.remote_addr;
      roce_write_rkey_ = h.rkey;
      roce_write_length_ = h.dma_length;
      roce_write_offset_ = 0;
      if (h.dma_length) {
        if (!ctx_.memory.resolve(h.rkey, h.remote_addr, h.dma_length, access_remote_write)) {
          ++ctx_.counters.access_errors;
          nak(h.psn, syndrome::nak_remote_access);
          return Outcome::nak;
        }
      }
    }
    offset = roce_write_offset_;
    total = roce_write_length_;
    if (offset + h.payload_length > total || (opcode_is_last(op) && offset + h.payload_length != total)) {
      ++ctx_.counters.invalid_requests;
      nak(h.psn, syndrome::nak_invalid_request);
      return Outcome::nak;
    }
    // Resolve again per packet: the region may be deregistered between packets.
    if (h.payload_length) {
      uint8_t* at = ctx_.memory.resolve(roce_write_rkey_, roce_write_address_ + offset, h.payload_length, access_remote_write);
      if (!at) {
        ++ctx_.counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        return Outcome::nak;
      }
      base = at - offset;
    }
  } else {
    offset = h.message_offset;
    total = h.message_length;
    if (h.dma_length != h.message_length) {
      ++ctx_.counters.invalid_requests;
      nak(h.psn, syndrome::nak_invalid_request);
      return Outcome::nak;
    }
    if (total) {
      base = ctx_.memory.resolve(h.rkey, h.remote_addr, total, access_remote_write);
      if (!base) {
        ++ctx_.counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        return Outcome::nak;
      }
    }
  }
  ReceiveWqe* r = nullptr;
  if (opcode_has_imm(op)) {
    const uint32_t sequence = ctx_.config.mode == Mode::roce ? roce_receive_sequence_ : h.receive_sequence;
    r = receive_for(sequence);
    if (!r) return int32_t(sequence - rq_head_sequence_) < 0 ? Outcome::dropped : Outcome::rnr;
  }
  if (h.payload_length && !ctx_.copy_in(base + offset, h.payload, h.payload_length)) {
    ++ctx_.counters.access_errors;
    nak(h.psn, syndrome::nak_remote_access);
    return Outcome::nak;
  }
  if (ctx_.config.mode == Mode::stellar) {
    // The guess comes from WRITEs of more than one packet: a one-packet
    // notification with an immediate after each data WRITE without one
    // would otherwise make every guess wrong.
    const bool multi_packet_last = op == opcode::write_last || op == opcode::write_last_imm;
    const bool imm = multi_packet_last ? op == opcode::write_last_imm : last_write_.last_with_imm;
    last_write_ = LastWrite{true, h.psn, h.rkey, total, uint32_t(offset + h.payload_length), h.remote_addr, imm};
  }
  if (ctx_.config.mode == Mode::roce) {
    roce_write_offset_ = uint32_t(offset + h.payload_length);
    roce_in_write_ = !opcode_is_last(op);
  }
  if (opcode_is_last(op)) {
    msn_ = (msn_ + 1) & 0xffffff;
    if (r) {
      r->last_seen = true;
      r->last_psn = h.psn;
      r->byte_length = total;
      r->has_imm = true;
      r->imm = h.imm;
      r->rdma_with_imm = true;
      if (ctx_.config.mode == Mode::roce) ++roce_receive_sequence_;
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
void Responder::restart_reads_at(uint32_t q) {
  uint32_t kept = 0;
  for (uint32_t i = 0; i < reads_count_; ++i) {
    ReadResponse r = reads_[ring_add(reads_head_, i, uint32_t(reads_.size()))];
    if (diff(r.psn, q) >= 0) continue;
    const uint32_t before_q = uint32_t(diff(q, r.psn));
    if (r.end > before_q) r.end = before_q;
    if (r.sent >= r.end) continue;  // everything before q already went out
    reads_[ring_add(reads_head_, kept, uint32_t(reads_.size()))] = r;
    ++kept;
  }
  reads_count_ = kept;
}

void Responder::replay_duplicate(const Header& h, uint64_t now) {
  if (h.opcode == opcode::read_request) {
    // Reads are idempotent: serve the (possibly partial) range again.
    const uint32_t length = h.dma_length;
    const uint32_t packets = packets_for(length, ctx_.config.mtu);
    if (packets > ctx_.config.window_packets / 2) return;
    if (ctx_.config.mode == Mode::roce) restart_reads_at(h.psn);
    if (reads_count_ == reads_.size()) {
      ++ctx_.counters.requests_dropped_full;
      return;
    }
    if (length && !ctx_.memory.resolve(h.rkey, h.remote_addr, length, access_remote_read)) {
      ++ctx_.counters.access_errors;
      nak(h.psn, syndrome::nak_remote_access);
      return;
    }
    reads_[ring_add(reads_head_, reads_count_, uint32_t(reads_.size()))] = ReadResponse{h.psn, h.remote_addr, h.rkey, length, packets, 0, packets};
    ++reads_count_;
    // A re-request can start inside what was accepted and reach past it:
    // the first request for a piece was lost and a one-packet probe took
    // its place. The PSNs past epsn are this READ's own: accept them, or
    // every later request waits behind a PSN nobody will send again.
    const uint32_t end = add(h.psn, packets);
    if (diff(end, epsn_) > 0 && !failed_) {
      mark_received(epsn_, uint32_t(diff(end, epsn_)));
      schedule_ack(now, true);
      complete_receives();  // messages that arrived ahead of the gap are in order now
      drain_pending(now);
    }
    return;
  }
  if (h.opcode == opcode::compare_swap || h.opcode == opcode::fetch_add) {
    // Never execute an atomic twice: answer from the replay cache.
    for (const AtomicReplay& a : atomic_replay_) {
      if (a.valid && a.psn == h.psn) {
        queue_control(opcode::atomic_acknowledge, syndrome::ack, h.psn, a.original);
        return;
      }
    }
    return;
  }
  if (ctx_.config.mode == Mode::roce) {
    queue_control(opcode::acknowledge, syndrome::ack, (epsn_ - 1) & ctx_.psn.mask);
    ++ctx_.counters.acks_sent;
  } else {
    schedule_ack(now, true);
  }
}

void Responder::complete_receives() {
  while (rq_count_ > 0 && !ctx_.error) {
    ReceiveWqe& r = rq_[rq_head_];
    if (!r.last_seen || diff(r.last_psn, epsn_) >= 0) break;
    Completion c;
    c.wr_id = r.work.wr_id;
    c.status = r.status;
    c.opcode = r.rdma_with_imm ? CompletionOpcode::receive_rdma_with_imm : CompletionOpcode::receive;
    c.byte_length = r.byte_length;
    c.imm = r.imm;
    c.has_imm = r.has_imm;
    c.qp_number = ctx_.config.local_qpn;
    rq_head_ = ring_next(rq_head_, ctx_.config.max_recv_wr);
    --rq_count_;
    ++rq_head_sequence_;
    ctx_.deliver(c);
    if (c.status != CompletionStatus::success) {
      ctx_.enter_error();
      return;
    }
  }
}

size_t Responder::transmit_responses(PacketWriter& writer, TxBuffer* buffers, size_t count) {
  size_t n = 0;
  // roce: a burst, then back to the host, which hands in what arrived
  // meanwhile: a duplicate READ request must find the rest of the
  // responses still here to cut them short (restart_reads_at).
  if (ctx_.config.mode == Mode::roce) count = std::min<size_t>(count, ctx_.config.max_response_burst);
  while (n < count && (control_count_ > 0 || reads_count_ > 0)) {
    // Responses leave in PSN order, as a verbs responder sends them: an
    // atomic ACK must not overtake the data of an earlier READ.
    const bool control_first =
        control_count_ > 0 &&
        (reads_count_ == 0 || diff(control_[control_head_].psn, add(reads_[reads_head_].psn, reads_[reads_head_].sent)) < 0);
    if (control_first) {
      const Control& c = control_[control_head_];
      Header h = ctx_.addressed();
      h.opcode = c.opcode;
      h.psn = c.psn;
      h.syndrome = c.syndrome;
      h.msn = msn_;
      h.atomic_original = c.atomic_original;
      buffers[n].piece_count = 0;
      if (!writer.finish(h, buffers[n])) break;
      control_head_ = ring_next(control_head_, uint32_t(control_.size()));
      --control_count_;
      ++n;
      continue;
    }
    ReadResponse& r = reads_[reads_head_];
    const uint64_t offset = uint64_t(r.sent) * ctx_.config.mtu;
    const uint32_t length = uint32_t(std::min<uint64_t>(ctx_.config.mtu, r.length - offset));
    Header h = ctx_.addressed();
    h.psn = add(r.psn, r.sent);
    const bool first = r.sent == 0, last = r.sent + 1 == r.packets;
    h.opcode = first && last ? opcode::read_response_only
               : first       ? opcode::read_response_first
               : last        ? opcode::read_response_last
                             : opcode::read_response_middle;
    h.syndrome = syndrome::ack;
    h.msn = msn_;
    h.message_offset = uint32_t(offset);
    h.message_length = r.length;
    h.payload_length = length;
    const size_t at = payload_offset(ctx_.config.mode, h);
    if (buffers[n].capacity < at + length + max_trailer_bytes) break;
    if (length) {
      // Resolve again per packet: the region may have been deregistered since.
      const uint8_t* source = ctx_.memory.resolve(r.rkey, r.address + offset, length, access_remote_read);
      if (!source) {
        ++ctx_.counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        reads_head_ = ring_next(reads_head_, uint32_t(reads_.size()));
        --reads_count_;
        continue;
      }
      // Copied, not referenced: the responder's application may write this
      // memory at any time, and the checksum must match what goes out.
      if (!ctx_.copy_out(buffers[n].data + at, source, length)) {
        ++ctx_.counters.access_errors;
        nak(h.psn, syndrome::nak_remote_access);
        reads_head_ = ring_next(reads_head_, uint32_t(reads_.size()));
        --reads_count_;
        continue;
      }
      buffers[n].piece_count = 0;
    } else {
      buffers[n].piece_count = 0;
    }
    if (!writer.finish(h, buffers[n])) break;
    ++n;
    if (++r.sent == r.end) {
      reads_head_ = ring_next(reads_head_, uint32_t(reads_.size()));
      --reads_count_;
    }
  }
  return n;
}

size_t Responder::transmit_ack(PacketWriter& writer, TxBuffer* buffers, size_t count, uint64_t now) {
  if (count == 0 || ack_due_ > now) return 0;
  // One ACK, or (stellar) a few more while arrivals far ahead of the first
  // hole wait to be reported, 64 PSNs per ACK: sprayed packets overtake by
  // thousands, and a packet never reported would be resent for nothing.
  size_t n = 0;
  do {
    Header h = ctx_.addressed();
    h.opcode = opcode::acknowledge;
    h.syndrome = syndrome::ack;
    h.msn = msn_;
    h.psn = (epsn_ - 1) & ctx_.psn.mask;
    unacked_ = 0;
    ack_due_ = never;
    buffers[n].piece_count = 0;
    if (!writer.finish(h, buffers[n])) break;
    ++ctx_.counters.acks_sent;
    ++n;
  } while (n < count && n < max_acks_per_transmit && sack_pending());
  return n;
}

}  // namespace stellar::offload::detail

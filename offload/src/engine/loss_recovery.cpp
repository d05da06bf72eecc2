// Loss recovery: see loss_recovery.hpp for what it owns and whom it calls.
#include "loss_recovery.hpp"

namespace stellar::offload::detail {

LossRecovery::LossRecovery(Context& ctx, SentWindow& window, CongestionControl& cc, PathSet& paths)
    : ctx_(ctx), window_(window), cc_(cc), paths_(paths), lost_(ctx.config.window_packets) {
  const uint32_t first = ctx_.config.send_psn & ctx_.psn.mask;
  loss_scan_ = highest_done_[0] = highest_done_[1] = first;
  last_response_psn_ = add(first, ctx_.psn.mask);  // first - 1
  rto_ = ctx_.config.rto_initial_ns;
}

void LossRecovery::on_packet_done(uint32_t psn, const Slot& s, uint64_t now, uint64_t& rtt_sample) {
  if (timeout_undo_possible_ && (s.flags & slot_lost) && !(s.flags & slot_retransmitted) && diff(psn, timeout_end_) < 0) {
    timeout_undo_possible_ = false;
    ++ctx_.counters.spurious_timeouts;
    cc_.on_spurious_timeout(now);
  }
  if (!(s.flags & slot_sent)) return;
  const uint64_t elapsed = now - s.sent_ns;
  paths_.on_acknowledged(s.path, now, (s.flags & slot_retransmitted) ? 0 : elapsed);
  // READ/atomic responses and ACKs of writes/sends are separate evidence:
  // a WRITE acknowledged after a READ says nothing about the READ's data.
  Delivered& d = delivered_[(s.flags & slot_response) ? 1 : 0];
  uint32_t& highest = highest_done_[(s.flags & slot_response) ? 1 : 0];
  if (diff(add(psn, 1), highest) > 0) highest = add(psn, 1);
  if (!(s.flags & slot_retransmitted)) {
    rtt_sample = elapsed;
    min_rtt_ = std::min(min_rtt_, elapsed);
  } else if (elapsed < min_rtt_) {
    // A resend acknowledged sooner than the minimum RTT after it: the ACK
    // may be the original's, so its send time (the resend's) and this RTT
    // are no evidence (RFC 8985, 6.2 step 2): taken as evidence, the tiny RTT
    // would declare everything sent before the resend lost at once.
    // Sooner than half the minimum it surely is the original's, and if loss
    // detection had declared it lost, the resend was spurious. (Half: a send
    // time is when the engine handed a batch over, so the minimum RTT can
    // include a batch's serialisation, and a lone resend goes round faster.)
    if (elapsed < min_rtt_ / 2 && (s.flags & slot_reordered)) {
      ++ctx_.counters.spurious_retransmits;
      reorder_steps_ = std::min<uint32_t>(reorder_steps_ * 2, 1u << 16);
      recoveries_since_spurious_ = 0;
    }
    return;
  }
  if (!d.valid || s.sent_ns > d.sent_ns || (s.sent_ns == d.sent_ns && diff(psn, d.psn) > 0))
    d = Delivered{true, s.sent_ns, psn, elapsed, s.path};
}

uint64_t LossRecovery::reorder_window() const {
  if (min_rtt_ == never) return 0;
  const uint64_t window = uint64_t(reorder_steps_) * (min_rtt_ / 4);
  return srtt_ ? std::min(window, srtt_ + 4 * rttvar_) : window;
}

void LossRecovery::on_acknowledgement(uint64_t now, uint64_t rtt, uint64_t bytes, uint64_t host_delay) {
  if (rtt) update_rtt(rtt);  // the timers must cover the whole delay, host included
  if (bytes) {
    // Congestion control reacts to the network's share of the delay only.
    const uint64_t network = rtt > host_delay ? rtt - host_delay : (rtt ? 1 : 0);
    cc_.on_ack(now, bytes, network);
    consecutive_timeouts_ = 0;
    // Karn's rule (RFC 6298, 5.7 and 3): a timer backed off by timeouts
    // stays backed off until a packet sent only once is acknowledged (a
    // sample). An ACK of a resend says nothing about the RTT: reset on it,
    // a peer that answers later than the RTO (a descheduled host) would
    // see every packet time out, twice, and the retries run out.
    if (rtt) rto_ = rto_base();
  }
  detect_losses(now);
}

void LossRecovery::on_una_advanced() {
  const uint32_t una = window_.una;
  if (timeout_undo_possible_ && diff(una, timeout_end_) >= 0) timeout_undo_possible_ = false;  // all judged packets settled
  if (recovering_ && diff(una, recovery_psn_) > 0) recovering_ = false;  // the gap is filled
  if (diff(una, last_response_psn_) > 0) last_response_psn_ = add(una, ctx_.psn.mask);
  if (diff(una, loss_scan_) > 0) loss_scan_ = una;
  for (uint32_t& h : highest_done_)
    if (diff(una, h) > 0) h = una;
}

void LossRecovery::rearm(uint64_t now, bool una_advanced, bool bytes_acknowledged) {
  if (una_advanced) rto_deadline_ = window_.idle() ? never : now + rto_;
  if (una_advanced || bytes_acknowledged) arm_probe(now);
}

// Responses leave the responder in PSN order and the network keeps order,
// so p's was lost: go back to p, once per gap. While the re-request is under
// way, later responses of the streams sent before it are no news (see
// `recovering_`): they climb, one PSN after the other. A response at or
// below the one before it comes from a stream the responder started over,
// and if p is still missing then, that stream lost it too: ask again. An
// ACK cannot tell the streams apart: during recovery it is left to the timer.
// The timer restarts with every response of a stream still climbing: the
// answer to the re-request queues behind it (a software responder may have
// sent all of a READ's responses before the re-request reached it, and
// their draining can outlast the RTO), and a timeout now would only ask
// for yet another copy of everything.
bool LossRecovery::response_missing(uint32_t p, bool from_response, uint32_t evidence, uint64_t now) {
  if (recovering_ && p == recovery_psn_) {
    if (!from_response) return false;
    if (diff(evidence, last_response_psn_) > 0) {
      if (p == window_.una) rto_deadline_ = now + rto_;
      return false;
    }
  } else if (!from_response && now - window_.slot(p).sent_ns <= srtt_) {
    return false;  // an ACK overtaking a response still on its way (as before: not news yet)
  }
  recovering_ = true;
  recovery_psn_ = p;
  if (p == window_.una) rto_deadline_ = now + rto_;  // as TCP: the timer restarts with the head's retransmission
  return true;
}

// RACK (RFC 8985, 6.2): a packet sent before the last-sent packet that was
// acknowledged is lost once that packet's RTT plus the reordering window has
// passed since its own send; until then it is undecided, and the reorder
// timer fires when the earliest undecided one's time is up.
void LossRecovery::detect_losses(uint64_t now) {
  reorder_deadline_ = never;
  if (ctx_.config.mode != Mode::stellar) return;
  if (!delivered_[0].valid && !delivered_[1].valid) return;
  const uint64_t window = reorder_window();
  // First transmissions leave in PSN order, so past the first one sent after
  // every piece of evidence nothing more can be judged.
  // (A batch shares one send time: among equals, PSN order decides.)
  const Delivered& newest = !delivered_[1].valid ? delivered_[0]
                            : !delivered_[0].valid ? delivered_[1]
                            : (delivered_[1].sent_ns > delivered_[0].sent_ns ||
                               (delivered_[1].sent_ns == delivered_[0].sent_ns && diff(delivered_[1].psn, delivered_[0].psn) > 0))
                                ? delivered_[1]
                                : delivered_[0];
  uint32_t p = diff(loss_scan_, window_.una) > 0 ? loss_scan_ : window_.una;
  bool undecided = false;  // the scan cursor stops at the first packet that may still be lost later
  for (; diff(p, window_.max_sent) < 0; p = add(p, 1)) {
    Slot& s = window_.slot(p);
    if ((s.flags & (slot_sent | slot_done | slot_lost)) != slot_sent) {
      if (!undecided) loss_scan_ = add(p, 1);
      continue;
    }
    if (!(s.flags & slot_retransmitted) && (s.sent_ns > newest.sent_ns || (s.sent_ns == newest.sent_ns && diff(p, newest.psn) > 0))) break;
    const int kind = (s.flags & slot_response) ? 1 : 0;
    const Delivered& d = delivered_[kind];
    const bool sent_before = d.valid && diff(p, highest_done_[kind]) < 0 &&
                             (s.sent_ns < d.sent_ns || (s.sent_ns == d.sent_ns && diff(p, d.psn) < 0));
    // The packet's own path may be slower than the one that brought the
    // evidence: it gets the difference too (packets sprayed over paths of
    // different delays are not lost for arriving in the slower path's time),
    // or the RTO while its path has no RTT sample.
    const uint64_t due = s.sent_ns + d.rtt_ns + paths_.extra_delay(s.path, d.path, rto_) + window;
    if (sent_before && now >= due) {
      queue_lost(p);
      s.flags |= slot_reordered;
      paths_.on_lost(s.path, now, false);
      if (!undecided) loss_scan_ = add(p, 1);
      continue;
    }
    undecided = true;
    if (sent_before) reorder_deadline_ = std::min(reorder_deadline_, due);
  }
}

void LossRecovery::queue_lost(uint32_t psn) {
  Slot& s = window_.slot(psn);
  if (s.flags & (slot_lost | slot_done)) return;
  if (lost_count_ == lost_.size()) return;
  s.flags = uint8_t((s.flags | slot_lost) & ~slot_reordered);  // detect_losses marks its own
  window_.leave_flight(s);
  lost_[ring_add(lost_head_, lost_count_, uint32_t(lost_.size()))] = psn;
  ++lost_count_;
}

void LossRecovery::requeue(uint32_t psn) {
  window_.slot(psn).flags &= uint8_t(~slot_lost);
  queue_lost(psn);
}

bool LossRecovery::next_lost(uint32_t& psn) {
  while (lost_count_ > 0) {
    psn = lost_[lost_head_];
    const Slot& s = window_.slot(psn);
    if (window_.outstanding(psn) && !(s.flags & slot_done) && (s.flags & slot_lost)) return true;
    discard_next();
  }
  return false;
}

void LossRecovery::discard_next() {
  const uint32_t psn = lost_[lost_head_];
  if (window_.outstanding(psn)) window_.slot(psn).flags &= uint8_t(~slot_lost);
  lost_head_ = ring_next(lost_head_, uint32_t(lost_.size()));
  --lost_count_;
}

uint32_t LossRecovery::lost_run(uint32_t psn, uint32_t limit) const {
  limit = std::min(lost_count_, limit);
  uint32_t run = 1;
  while (run < limit && lost_[ring_add(lost_head_, run, uint32_t(lost_.size()))] == add(psn, run) &&
         (window_.slot(add(psn, run)).flags & (slot_lost | slot_done)) == slot_lost)
    ++run;
  return run;
}

void LossRecovery::retransmitted(uint32_t psn, uint32_t used, uint64_t now) {
  if (psn == window_.una) rto_deadline_ = now + rto_;  // as TCP: the timer restarts with the head's retransmission
  // A resend can be lost too: loss detection judges it again, by its new send time.
  if (diff(psn, loss_scan_) < 0) loss_scan_ = psn;
  // Resends without a spurious one: after 16 of them the reordering window
  // shrinks back a step (RFC 8985, 6.2 step 4, counts recoveries).
  if (++recoveries_since_spurious_ >= 16) {
    reorder_steps_ = std::max<uint32_t>(reorder_steps_ / 2, 1);
    recoveries_since_spurious_ = 0;
  }
  lost_head_ = ring_add(lost_head_, used, uint32_t(lost_.size()));
  lost_count_ -= used;
}

uint64_t LossRecovery::rto_base() const {
  if (srtt_ == 0) return ctx_.config.rto_initial_ns;
  return std::clamp<uint64_t>(srtt_ + 4 * rttvar_, ctx_.config.rto_min_ns, ctx_.config.rto_max_ns);
}

void LossRecovery::update_rtt(uint64_t sample) {
  if (srtt_ == 0) {
    srtt_ = sample;
    rttvar_ = sample / 2;
  } else {
    const uint64_t delta = sample > srtt_ ? sample - srtt_ : srtt_ - sample;
    rttvar_ = (3 * rttvar_ + delta) / 4;
    srtt_ = (7 * srtt_ + sample) / 8;
  }
}

LossRecovery::Timeout LossRecovery::on_timeout(uint64_t now) {
  ++ctx_.counters.timeouts;
  if (++consecutive_timeouts_ > ctx_.config.retry_count) return Timeout::retry_exceeded;
  cc_.on_timeout(now);
  rto_ = std::min(rto_ * 2, ctx_.config.rto_max_ns);
  Timeout action = Timeout::retransmit;
  if (ctx_.config.mode == Mode::roce) {
    action = Timeout::go_back;
    recovering_ = true;  // responses of the streams sent before are no news (response_missing)
    recovery_psn_ = window_.una;
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
    for (uint32_t i = 0; i < lost_count_; ++i) {
      const uint32_t p = lost_[ring_add(lost_head_, i, uint32_t(lost_.size()))];
      if (window_.outstanding(p)) window_.slot(p).flags &= uint8_t(~slot_lost);
    }
    lost_count_ = 0;
    // The head's path failed it (or the whole fabric did): out with it.
    paths_.on_lost(window_.slot(window_.una).path, now, true);
    bool later_acknowledged = false;
    for (uint32_t p = window_.una; diff(p, window_.max_sent) < 0; p = add(p, 1)) {
      if (window_.slot(p).flags & slot_done) later_acknowledged = true;
      if ((window_.slot(p).flags & (slot_sent | slot_done)) == slot_sent) queue_lost(p);
    }
    timeout_undo_possible_ = !later_acknowledged;
    timeout_end_ = window_.max_sent;
  }
  rto_deadline_ = now + rto_;
  probe_deadline_ = never;
  return action;
}

// Tail loss probe (stellar): when nothing was acknowledged for about two
// RTTs, retransmit one outstanding packet once: the oldest with one path,
// the newest when sprayed (RFC 8985, 7.3). Either it was lost (recovered an
// RTO early) or its ACK draws a fresh SACK; the newest one's ACK is also
// evidence against every packet sent before it, so that the tail of a burst
// lost on a dead path is found by loss detection, not by the RTO. Not a
// timeout: the window and the retry count are left alone.
void LossRecovery::on_probe(uint64_t now) {
  probe_deadline_ = never;
  (void)now;
  uint32_t p = window_.una;
  if (paths_.count() > 1) {
    for (uint32_t q = add(window_.max_sent, ctx_.psn.mask); diff(q, window_.una) >= 0; q = add(q, ctx_.psn.mask)) {
      if ((window_.slot(q).flags & (slot_sent | slot_done | slot_lost)) == slot_sent) {
        p = q;
        break;
      }
    }
  }
  const Slot& s = window_.slot(p);
  if ((s.flags & (slot_sent | slot_done | slot_lost)) != slot_sent) return;
  ++ctx_.counters.tail_probes;
  queue_lost(p);
}

void LossRecovery::on_sent(uint64_t now) {
  if (rto_deadline_ == never) {
    rto_deadline_ = now + rto_;
    arm_probe(now);
  }
}

void LossRecovery::arm_probe(uint64_t now) {
  if (ctx_.config.mode != Mode::stellar || window_.idle()) {
    probe_deadline_ = never;
    return;
  }
  uint64_t pto = srtt_ ? std::max<uint64_t>(2 * srtt_ + ctx_.config.ack_delay_ns, 20'000) : rto_ / 4;
  // Sprayed: nothing is news before the slowest path with packets out had
  // its time (the connection's srtt is mostly the fast paths').
  pto = std::max(pto, paths_.slowest_in_flight() * 5 / 4 + ctx_.config.ack_delay_ns);
  probe_deadline_ = pto < rto_ ? now + pto : never;
}

void LossRecovery::stop() {
  lost_count_ = 0;
  rto_deadline_ = never;
  probe_deadline_ = never;
  reorder_deadline_ = never;
}

}  // namespace stellar::offload::detail

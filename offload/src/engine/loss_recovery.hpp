// Loss recovery, acknowledgement timing and timers of the requester.
//
// Owns: the lost ring (stellar: PSNs to retransmit, in order), the
// retransmission timer (RTO) and the tail-loss probe, the RTT estimate
// (srtt, rttvar, rto), time-based loss detection (stellar: RACK, RFC 8985),
// spurious-timeout undo, and the roce go-back-N recovery state of
// READ/atomic responses.
//
// Loss detection counts time, not packets: a packet is lost when one sent
// after it was acknowledged and it is itself still unacknowledged one RTT
// (that packet's) plus a reordering window after it was sent. Packets
// sprayed over paths of different delays arrive out of order by as many
// packets as the delay difference holds (thousands at a high rate), which
// a packet-count threshold would take for loss; a time window does not.
// The window is a number of quarters of the minimum RTT, capped at about an
// RTO: one at first, doubled by every resend that proves spurious (the ACK
// came sooner than half the minimum RTT after the resend, so it was the
// original's), halved back after 16 resends without one. (Learning the
// window from how late overtaken packets arrive was tried and dropped: a
// packet past the SACK's reach behind a hole is acknowledged late without
// being late, and the window grew to the length of every recovery.)
//
// May call: the SentWindow (read slots; take packets it declares lost out of
// flight), the PathSet (each packet's fate on its path, the path's RTT),
// congestion control (on_ack, on_timeout, on_spurious_timeout) and the
// counters. It never touches the send queue or the responder: what it
// decides that the requester must do (go back to a PSN, fail the head after
// too many timeouts) it returns. The requester calls it while applying
// acknowledgements, when sending, and when the timers fire. The responder
// does not know it exists.
#pragma once

#include <algorithm>
#include <vector>

#include "common.hpp"
#include "window.hpp"

namespace stellar::offload::detail {

class LossRecovery {
 public:
  LossRecovery(Context& ctx, SentWindow& window, CongestionControl& cc, PathSet& paths);

  // ---- acknowledgements (the requester, while it applies an ACK or a response) ----

  // psn, not done before, is acknowledged now; `s` is its slot before the
  // requester marks it done. Undoes a spurious timeout, takes the RTT sample
  // (packets never retransmitted only) and keeps the evidence loss detection
  // works from.
  void on_packet_done(uint32_t psn, const Slot& s, uint64_t now, uint64_t& rtt_sample);
  // One packet's acknowledgements are applied (before una advances): the RTT
  // sample (0: none) and bytes newly acknowledged (0: none) feed the estimate
  // and congestion control, `host_delay` being the share of the sample spent
  // in hosts; then loss detection runs.
  void on_acknowledgement(uint64_t now, uint64_t rtt, uint64_t bytes, uint64_t host_delay);
  // una moved: keeps the cursors inside the window so PSN arithmetic stays valid.
  void on_una_advanced();
  // After on_acknowledgement and una's advance: restarts the timer if una
  // moved and the probe if anything was acknowledged.
  void rearm(uint64_t now, bool una_advanced, bool bytes_acknowledged);

  // ---- roce: go-back-N for READ/atomic responses ----

  // The response for p, the oldest one missing, is overdue: a response
  // (from_response, for PSN `evidence`) or an ACK for a later PSN came first.
  // True: the requester must go back to p (rewind) and send from there.
  bool response_missing(uint32_t p, bool from_response, uint32_t evidence, uint64_t now);
  // A response for an outstanding request (PSN psn) arrived.
  void response_arrived(uint32_t psn) { last_response_psn_ = psn; }

  // ---- timers ----

  enum class Timeout { retransmit, go_back, retry_exceeded };
  bool timeout_due(uint64_t now) const { return rto_deadline_ <= now && !window_.idle(); }
  bool probe_due(uint64_t now) const { return probe_deadline_ <= now && !window_.idle(); }
  // stellar: a packet's reordering window ran out: loss detection runs again.
  bool reorder_due(uint64_t now) const { return reorder_deadline_ <= now && !window_.idle(); }
  void on_reorder_timer(uint64_t now) { detect_losses(now); }
  // The retransmission timer fired. stellar: everything outstanding is
  // queued as lost (retransmit); roce: the requester goes back to una
  // (go_back); after retry_count timeouts without progress: retry_exceeded
  // (the requester fails the head; nothing else changed but the count).
  Timeout on_timeout(uint64_t now);
  void on_probe(uint64_t now);
  // The tail-loss probe is due now (an address changed: what was in flight
  // may be gone, and waiting for the probe timer costs 2 RTTs or more).
  void probe_now(uint64_t now) { probe_deadline_ = std::min(probe_deadline_, now); }
  // Something was sent: arms the timers if they are not running.
  void on_sent(uint64_t now);
  // The timer restarts now (the head was sent again), or after `until` (RNR wait).
  void restart_timer(uint64_t now) { rto_deadline_ = now + rto_; }
  void restart_timer_after(uint64_t until) { rto_deadline_ = until + rto_; }
  // The earliest timer (only meaningful while something is outstanding).
  uint64_t deadline() const { return std::min({rto_deadline_, probe_deadline_, reorder_deadline_}); }
  // The QP entered ERROR: nothing is retransmitted, no timer runs.
  void stop();

  // ---- the retransmission queue (stellar) ----

  void queue_lost(uint32_t psn);
  // Queued again from scratch (an RNR NAK: the packet is sent after the wait).
  void requeue(uint32_t psn);
  bool has_lost() const { return lost_count_ > 0; }
  // The next PSN to retransmit, after dropping entries that need it no more
  // (acknowledged meanwhile, or below una). False when the queue is empty.
  bool next_lost(uint32_t& psn);
  // Drops the entry next_lost returned without retransmitting it.
  void discard_next();
  // How many queue entries from the head, up to `limit`, are the lost PSNs
  // psn, psn + 1, ... in a row (a READ asks again for them with one request).
  uint32_t lost_run(uint32_t psn, uint32_t limit) const;
  // The requester retransmitted `used` PSNs from the head of the queue (psn first).
  void retransmitted(uint32_t psn, uint32_t used, uint64_t now);

  uint64_t rto() const { return rto_; }
  uint64_t srtt() const { return srtt_; }
  // The reordering window loss detection allows now (ns).
  uint64_t reorder_window() const;

 private:
  uint32_t add(uint32_t p, uint32_t n) const { return ctx_.add(p, n); }
  int32_t diff(uint32_t a, uint32_t b) const { return ctx_.diff(a, b); }
  uint64_t rto_base() const;
  void update_rtt(uint64_t sample);
  void detect_losses(uint64_t now);
  void arm_probe(uint64_t now);

  Context& ctx_;
  SentWindow& window_;
  CongestionControl& cc_;
  PathSet& paths_;
  std::vector<uint32_t> lost_;  // stellar: PSNs to retransmit, ring
  uint32_t lost_head_ = 0, lost_count_ = 0;
  uint64_t rto_deadline_ = never;
  uint64_t probe_deadline_ = never;
  uint64_t rto_ = 0;
  uint64_t srtt_ = 0, rttvar_ = 0;
  uint32_t consecutive_timeouts_ = 0;
  // Loss detection (stellar). The evidence, per kind of acknowledgement
  // (0: ACKs of WRITE/SEND packets, 1: READ/atomic responses, which come
  // later than ACKs of what was sent after them and so are separate
  // evidence): of the packets acknowledged, the one sent last (its send time
  // and PSN, ties broken by PSN: a batch shares one time) and its RTT.
  struct Delivered {
    bool valid = false;
    uint64_t sent_ns = 0;
    uint32_t psn = 0;
    uint64_t rtt_ns = 0;
    uint16_t path = 0;
  };
  Delivered delivered_[2];
  // One past the highest PSN acknowledged, per kind. Only a packet below it
  // is judged: the SACK reaches 64 PSNs past the cumulative ACK, so a packet
  // further on may have arrived without anyone saying so, and a resend's
  // ACK (late evidence) would otherwise condemn all of them at once.
  uint32_t highest_done_[2] = {0, 0};
  uint64_t min_rtt_ = never;            // over first transmissions' samples
  uint64_t reorder_deadline_ = never;   // the earliest undecided packet's window ends
  uint32_t reorder_steps_ = 1;          // the window in quarters of min_rtt_
  uint32_t recoveries_since_spurious_ = 0;
  uint32_t loss_scan_ = 0;              // no undecided packet below it
  // roce go-back-N recovery of READ/atomic responses: after asking again from
  // recovery_psn, responses past it keep arriving from the stream the
  // responder was sending before it got the re-request (and its queue). They
  // say nothing new: asking again for each of them would only pile up
  // duplicate streams. Only a stream that goes back (a response at or below
  // the one before it: the responder started over) and still lacks
  // recovery_psn, or the timer, asks again.
  bool recovering_ = false;
  uint32_t recovery_psn_ = 0;
  uint32_t last_response_psn_ = 0;  // PSN of the latest response for an outstanding request (>= una - 1)
  // Spurious-timeout detection (stellar mode): after a timeout, an ACK for a
  // packet it declared lost that was never resent proves the original
  // arrived; the congestion window cut is then undone.
  bool timeout_undo_possible_ = false;
  uint32_t timeout_end_ = 0;  // max_sent at the timeout: the packets it judged
};

}  // namespace stellar::offload::detail

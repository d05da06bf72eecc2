// The requester half of the QP.
//
// Owns: the send queue (posted SendWqes, completed in posting order), the
// PSN slot table of what was sent (SentWindow), the send cursor (send_psn,
// go-back-N rewinds it), max_rd_atomic credits, the RNR wait, and the fatal
// PSN after a failed WQE. It builds and sends requests (retransmissions that
// LossRecovery queued first, then new PSNs in order), applies the peer's
// cumulative ACK, SACK, NAKs and READ/atomic responses, and completes sends.
//
// May call: PathSet (the path of each request), LossRecovery (acknowledgement evidence, timers, the lost queue;
// it rewinds when recovery says to go back), congestion control (may I send,
// what I sent), the PacketWriter it is handed to finish a request,
// MemoryAccess (its local segments) and the Context (counters, completions,
// the QP-wide error). It never sees the responder: this side's
// acknowledgement reaches its requests through the PacketWriter.
#pragma once

#include <vector>

#include "common.hpp"
#include "loss_recovery.hpp"
#include "window.hpp"
#include "writer.hpp"

namespace stellar::offload::detail {

class Requester {
 public:
  // `recovery` works on window(): it may be constructed after this one.
  Requester(Context& ctx, CongestionControl& cc, LossRecovery& recovery, PathSet& paths);

  SentWindow& window() { return window_; }

  PostResult post_send(const SendWork& work);
  bool set_ready(uint64_t wr_id, uint32_t bytes);
  uint32_t outstanding() const { return sq_count_; }
  // Posted requests not yet sent once (new PSNs waiting for their turn).
  bool unsent() const { return send_psn_ != assign_psn_; }

  // ---- receive path: the peer's acknowledgements of our requests ----
  // `host_delay`: how much of an RTT sample taken from this packet was spent
  // in hosts (waiting for our poll, held by the peer before acknowledging).

  // stellar: the cumulative ACK and SACK every packet carries.
  void on_piggybacked_ack(uint32_t ack_psn, uint64_t sack_bitmap, uint16_t sack_offset, uint64_t now, uint64_t host_delay);
  // An ACK or NAK packet (AETH).
  void on_ack_packet(const Header& h, uint64_t now, uint64_t host_delay);
  // A READ response or atomic acknowledgement.
  void on_response(const Header& h, uint64_t now, uint64_t host_delay);

  // ---- transmit path ----

  // Runs the retransmission timer and the tail-loss probe if they are due.
  void on_timers(uint64_t now);
  // Requests due now: retransmissions first, then new PSNs in order.
  size_t transmit(PacketWriter& writer, TxBuffer* buffers, size_t count, uint64_t now);
  // When the requester next has something to do (timers, pacing); never when idle.
  uint64_t next_wakeup_ns(uint64_t now) const;

  // ERROR: every queued WQE completes with work_request_flushed.
  void flush();
  // The oldest WQE completes with `status`; the QP enters ERROR.
  void fail_first(CompletionStatus status) { fail_head(status); }

  // No request has ever left (QpEngine::set_mtu may still change the size).
  bool nothing_sent() const { return window_.max_sent == (ctx_.config.send_psn & ctx_.psn.mask) && window_.idle(); }
  // Gives the queued WQEs their PSNs again, cut at the current
  // ctx.config.mtu. Only while nothing_sent().
  void repacketize();

 private:
  uint32_t add(uint32_t p, uint32_t n) const { return ctx_.add(p, n); }
  int32_t diff(uint32_t a, uint32_t b) const { return ctx_.diff(a, b); }
  Slot& slot(uint32_t psn) { return window_.slot(psn); }

  uint32_t read_piece_packets() const;
  uint32_t read_request_packets(const SendWqe& w, uint32_t psn) const;
  bool waits_for_payload(const SendWqe& w, uint32_t psn) const;
  void packet_span(const SendWqe& w, uint32_t index, uint64_t& offset, uint32_t& payload) const;
  bool needs_credit(const SendWqe& w, uint32_t psn) const;
  uint32_t find_wqe(uint32_t psn) const;

  void flush_one_send(const SendWork& work);
  void rewind(uint32_t psn);
  void mark_done(uint32_t psn, uint64_t now, uint64_t& rtt_sample, uint64_t& acked_bytes);
  void apply_cumulative(uint32_t cum, uint64_t now, uint64_t& rtt, uint64_t& bytes);
  void apply_sack(uint32_t cum, uint64_t bitmap, uint16_t offset, uint64_t now, uint64_t& rtt, uint64_t& bytes);
  void after_acknowledgement(uint64_t now, uint64_t rtt, uint64_t bytes);
  void advance_una();
  void complete_sends();
  void fail_at(uint32_t psn, CompletionStatus status);
  void fail_head(CompletionStatus status);
  void fail_wqe(uint32_t index, CompletionStatus status);
  bool local_ok(SendWqe& w, uint64_t offset, uint64_t length, uint32_t access);
  bool may_send_request(uint64_t now, uint32_t bytes) const;
  bool in_order_ready() const;
  uint32_t build_request(PacketWriter& writer, uint32_t psn, uint32_t wqe_index, uint32_t read_packets, uint16_t path,
                         TxBuffer& b, uint32_t& psns_used);
  void record_sent(uint32_t psn, uint32_t count, uint32_t wqe_index, uint64_t now, bool retransmission, uint16_t path);

  Context& ctx_;
  CongestionControl& cc_;
  LossRecovery& recovery_;
  PathSet& paths_;
  SentWindow window_;
  std::vector<SendWqe> sq_;
  uint32_t sq_head_ = 0, sq_count_ = 0;
  uint32_t send_cursor_ = 0;      // WQE that holds send_psn (valid while send_psn != assign_psn)
  uint32_t send_psn_ = 0;         // next PSN to transmit in order (roce rewinds it)
  uint32_t assign_psn_ = 0;       // next PSN a posted WQE gets
  uint32_t acked_upto_ = 0;       // cumulative acknowledgements already applied
  uint32_t next_receive_sequence_ = 0;
  uint32_t outstanding_rd_atomic_ = 0;  // READ pieces and atomics sent and not yet below una
  uint64_t host_delay_ = 0;       // host delay inside the RTT sample being processed
  uint32_t consecutive_rnr_ = 0;
  uint64_t rnr_until_ = 0;
  bool fatal_ = false;            // a NAK failed a WQE: send nothing at or after fatal_psn
  bool local_fault_ = false;      // build_request found deregistered local memory
  uint32_t fatal_psn_ = 0;
};

}  // namespace stellar::offload::detail

// The responder half of the QP.
//
// Owns: the receive queue, the acceptance window (epsn; stellar: arrival
// marks and the SACK bitmap built from them), roce in-order placement
// cursors, the READ response queue, the control queue (ACK/NAK/atomic
// acknowledgements to send), the atomic replay cache, READ/atomic requests
// that arrived ahead of a gap (stellar), the held-back ACK (ack_due,
// unacked) and the responder's failure state after a fatal NAK.
//
// Interface to the rest: on_request() takes an inbound request header;
// fill_acknowledgement()/acknowledgement_sent() are how every outgoing
// packet carries this side's ACK (through the PacketWriter); the transmit_*
// calls write responses and the pure ACK into TxBuffers; has_responses() and
// ack_due() are its part of the next wakeup.
//
// May call: MemoryAccess (rkeys, receive buffers), the PacketWriter it is
// handed, and the Context (counters, completions, the QP-wide error). It
// knows nothing of the requester or of loss recovery.
#pragma once

#include <vector>

#include "common.hpp"
#include "writer.hpp"

namespace stellar::offload::detail {

class Responder {
 public:
  explicit Responder(Context& ctx);

  PostResult post_receive(const ReceiveWork& work);
  uint32_t outstanding() const { return rq_count_; }

  // A request arrived (at `arrival`, host clock): the ACK delay is measured from it.
  void note_request_arrival(uint64_t arrival) { latest_request_arrival_ = arrival; }
  // A request addressed to this QP (already checked: token, partition, QPN).
  void on_request(const Header& h, uint64_t now);
  // Stellar mode: a request at `psn` arriving now would be new, not a
  // duplicate, inside the window, and not refused (no fatal NAK at or
  // before it): what direct placement needs before letting the kernel write
  // that packet's payload into its place (QpEngine::placement).
  bool would_take(uint32_t psn) const;
  // Stellar mode: the WRITE this responder last took a packet of, and where
  // its next packet's payload starts (QpEngine::expected_write).
  struct LastWrite {
    bool valid = false;
    uint32_t psn = 0, rkey = 0, message_length = 0, next_offset = 0;
    uint64_t remote_addr = 0;
    bool last_with_imm = false;  // the WRITE before it ended with an immediate
  };
  const LastWrite& last_write() const { return last_write_; }

  // ---- this side's acknowledgement (stellar: on every packet) ----

  // Cumulative ACK, SACK bitmap and ACK delay (measured to `transmit_now`).
  // The SACK reports the 64 PSNs after the first hole, or, while packets
  // arrived beyond them that no acknowledgement reported yet, the next 64
  // of those (sack_offset): ACK by ACK every arrival is reported once.
  void fill_acknowledgement(Header& h, uint64_t transmit_now);
  // Arrivals beyond the first 64 PSNs past the hole not reported yet: more
  // pure ACKs are worth sending.
  bool sack_pending() const;
  // An acknowledgement went out: nothing is held back any more.
  void acknowledgement_sent() {
    unacked_ = 0;
    ack_due_ = never;
  }
  uint64_t ack_due() const { return ack_due_; }
  // An acknowledgement is due now, even with nothing held back.
  void force_acknowledgement(uint64_t now) { ack_due_ = std::min(ack_due_, now); }
  // Makes a held-back acknowledgement due now.
  void acknowledge_now(uint64_t now) {
    if (ack_due_ != never) ack_due_ = std::min(ack_due_, now);
  }

  // ---- transmit ----

  // READ responses and control packets (ACK/NAK/atomic acknowledgements), in PSN order.
  size_t transmit_responses(PacketWriter& writer, TxBuffer* buffers, size_t count);
  // The pure ACK, if one is due at `now`.
  size_t transmit_ack(PacketWriter& writer, TxBuffer* buffers, size_t count, uint64_t now);
  bool has_responses() const { return control_count_ || reads_count_; }

  // ERROR: every posted receive completes (flushed, or with its own error);
  // queued READ responses and the held-back ACK are dropped.
  void flush();

 private:
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
  enum class Outcome { accepted, nak, rnr, dropped };

  uint32_t add(uint32_t p, uint32_t n) const { return ctx_.add(p, n); }
  int32_t diff(uint32_t a, uint32_t b) const { return ctx_.diff(a, b); }

  uint64_t sack_bitmap(uint32_t base) const;
  static constexpr size_t max_acks_per_transmit = 8;
  void queue_control(uint8_t op, uint8_t syn, uint32_t psn, uint64_t original = 0);
  void schedule_ack(uint64_t now, bool immediately);
  ReceiveWqe* receive_for(uint32_t sequence);
  void execute(const Header& h, uint64_t now, bool out_of_order);
  void drain_pending(uint64_t now);
  void mark_received(uint32_t psn, uint32_t count);
  void nak(uint32_t psn, uint8_t syn);
  Outcome apply_request(const Header& h, uint64_t now, uint32_t& consumed);
  Outcome apply_send(const Header& h);
  Outcome apply_write(const Header& h);
  void restart_reads_at(uint32_t q);
  void replay_duplicate(const Header& h, uint64_t now);
  void complete_receives();

  Context& ctx_;
  std::vector<ReceiveWqe> rq_;
  uint32_t rq_head_ = 0, rq_count_ = 0;
  uint32_t rq_head_sequence_ = 0;  // receive sequence of rq[rq_head]
  uint32_t epsn_ = 0;              // every PSN before this one has arrived
  LastWrite last_write_;
  std::vector<uint8_t> received_;  // stellar: arrival marks for [epsn, epsn + window)
  uint32_t received_end_ = 0;      // one past the highest PSN marked
  uint32_t sack_cursor_ = 0;       // stellar: the lowest PSN that arrived and no SACK reported yet (about)
  uint32_t msn_ = 0;
  std::vector<ReadResponse> reads_;
  uint32_t reads_head_ = 0, reads_count_ = 0;
  std::vector<Control> control_;
  uint32_t control_head_ = 0, control_count_ = 0;
  AtomicReplay atomic_replay_[atomic_replay_capacity];
  uint32_t atomic_replay_next_ = 0;
  Header pending_[pending_capacity];
  bool pending_used_[pending_capacity] = {};
  uint32_t unacked_ = 0;
  uint64_t ack_due_ = never;
  uint64_t latest_request_arrival_ = 0;  // arrival time of the latest request received (our ack's age)
  bool sequence_nak_sent_ = false;  // roce: one NAK per gap
  bool failed_ = false;             // a fatal NAK went out: nothing at or after failed_psn_ is accepted
  uint32_t failed_psn_ = 0;
  uint8_t failed_syndrome_ = 0;
  // roce in-order placement cursors
  bool roce_in_send_ = false, roce_in_write_ = false;
  uint32_t roce_send_offset_ = 0;
  uint32_t roce_receive_sequence_ = 0;
  uint64_t roce_write_address_ = 0;
  uint32_t roce_write_rkey_ = 0, roce_write_length_ = 0, roce_write_offset_ = 0;
};

}  // namespace stellar::offload::detail

// QpEngine: one RC QP's transport (engine.hpp is the contract,
// docs/wire-format.md what goes on the wire). A thin facade over three units
// (offload/src/engine/):
//   Responder     what the peer asks of us: placement, READ/atomic responses, ACKs
//   Requester     what we ask of the peer: the send queue, requests, applying ACKs
//   LossRecovery  the requester's timers, RTT, loss detection and go-back-N
//   PathSet       the paths requests are sprayed over (stellar), and failover
// and the PacketWriter that finishes every packet. Packets of both directions
// carry each other's acknowledgements: every request and response we send
// carries our responder's ACK (stellar), and every packet we receive may carry
// one for our requester. The facade checks each received packet (decode,
// token, partition, QPN), hands the acknowledgement to the requester and the
// packet to whichever unit it is for, and orders what goes out: responses,
// then requests, then a pure ACK.
#include "stellar/offload/engine.hpp"

#include <cstring>

#include "engine/common.hpp"
#include "engine/loss_recovery.hpp"
#include "engine/paths.hpp"
#include "engine/requester.hpp"
#include "engine/responder.hpp"
#include "engine/writer.hpp"

namespace stellar::offload {

using detail::never;

struct QpEngine::State final : detail::ErrorHandler {
  detail::Context ctx;
  std::unique_ptr<CongestionControl> cc;
  detail::PathSet paths;
  detail::ReplyPaths replies;
  // The requester owns the sent window loss recovery works on, so it is
  // built first; it only stores its reference to `recovery` (built next).
  detail::Requester requester;
  detail::LossRecovery recovery;
  detail::Responder responder;
  detail::PacketWriter writer;
  bool held = false;  // hold_requests
  // EngineConfig::defer_piggybacked_acks: the acknowledgement a request
  // carried, not taken yet (with the time it arrived and its host delay).
  struct DeferredAck {
    bool valid = false;
    uint16_t sack_offset = 0;
    uint32_t psn = 0;
    uint64_t sack_bitmap = 0, now = 0, host_delay = 0;
  } deferred;

  void settle() {
    if (!deferred.valid) return;
    deferred.valid = false;
    if (ctx.error) return;
    requester.on_piggybacked_ack(deferred.psn, deferred.sack_bitmap, deferred.sack_offset, deferred.now, deferred.host_delay);
  }

  State(const EngineConfig& c, MemoryAccess& m, CompletionSink& s)
      : ctx(c, m, s, *this),
        cc(make_cc(ctx.config)),
        paths(ctx),
        replies(ctx),
        requester(ctx, *cc, recovery, paths),
        recovery(ctx, requester.window(), *cc, paths),
        responder(ctx),
        writer(ctx, responder, replies) {}

  static std::unique_ptr<CongestionControl> make_cc(const EngineConfig& config) {
    CcConfig ccc = config.cc_config;
    ccc.mtu_bytes = config.mtu;
    return make_congestion_control(config.cc, ccc);
  }

  // The QP enters ERROR (verbs): everything posted completes, sends first,
  // flushed; nothing more is sent, retransmitted or acknowledged.
  void enter_error() override {
    deferred.valid = false;
    if (ctx.error) return;
    ctx.error = true;
    requester.flush();
    responder.flush();
    recovery.stop();
  }

  // stellar: a packet must carry this QP's token; roce has none on the wire.
  bool token_accepted(const Header& h) {
    if (ctx.config.mode != Mode::stellar || h.token == ctx.config.local_token) return true;
    ++ctx.counters.bad_token;
    return false;
  }
};

// =========================================================================

QpEngine::QpEngine(const EngineConfig& config, MemoryAccess& memory, CompletionSink& sink)
    : s_(std::make_unique<State>(config, memory, sink)) {}
QpEngine::~QpEngine() = default;

PostResult QpEngine::post_send(const SendWork& work, uint64_t now_ns) {
  (void)now_ns;
  PostResult r = s_->requester.post_send(work);
  if (r == PostResult::queue_full && s_->deferred.valid) {
    s_->settle();  // it may complete sends and make room
    r = s_->requester.post_send(work);
  }
  return r;
}

void QpEngine::settle_acknowledgement() { s_->settle(); }
bool QpEngine::acknowledgement_deferred() const { return s_->deferred.valid; }

PostResult QpEngine::post_receive(const ReceiveWork& work) { return s_->responder.post_receive(work); }

void QpEngine::receive(const uint8_t* data, size_t length, const IcrcAddresses& addresses, uint64_t now_ns, uint64_t arrival_ns,
                       bool congestion_mark) {
  Header h;
  // stellar mode: the addresses only tell whether an unchecked packet
  // (Header::unchecked) may be taken; a QP that did not agree to leave the
  // CRC out on loopback takes none (decode refuses them without addresses).
  const EngineConfig& c = s_->ctx.config;
  const bool refuse_unchecked = c.mode == Mode::stellar && !c.loopback_unchecked;
  const DecodeError e = decode(c.mode, data, length, refuse_unchecked ? IcrcAddresses{} : addresses, h);
  if (e != DecodeError::none) {
    ++s_->ctx.counters.decode_errors;
    return;
  }
  if (!s_->token_accepted(h)) return;
  s_->ctx.counters.rx_bytes += length;
  receive_decoded(h, now_ns, arrival_ns, congestion_mark);
}

bool QpEngine::expected_write(ExpectedWrite& w) const {
  const detail::Responder::LastWrite& l = s_->responder.last_write();
  if (!s_->ctx.direct || !l.valid || l.next_offset >= l.message_length) return false;
  w = ExpectedWrite{s_->ctx.add(l.psn, 1), l.rkey, l.message_length, l.next_offset, l.remote_addr, l.last_with_imm};
  return true;
}

uint8_t* QpEngine::placement(uint32_t psn, uint32_t rkey, uint64_t remote_addr, uint32_t message_length, uint32_t offset, uint32_t length) {
  State& s = *s_;
  if (s.ctx.config.mode != Mode::stellar || !s.ctx.direct || s.ctx.error || length == 0) return nullptr;
  // An honest requester never sends a message longer than 2^31 bytes
  // (check_send_work); a longer claim gets no place.
  if (message_length > (1u << 31) || offset > message_length || length > message_length - offset || !s.responder.would_take(psn))
    return nullptr;
  uint8_t* base = s.ctx.memory.resolve(rkey, remote_addr, message_length, access_remote_write);
  return base ? base + offset : nullptr;
}

bool QpEngine::awaiting(uint32_t psn) const { return !s_->ctx.error && s_->responder.would_take(psn); }

void QpEngine::receive_placed(const uint8_t* header, size_t header_length, const uint8_t* payload, uint32_t payload_length,
                              const uint8_t* trailer, const IcrcAddresses& addresses, uint64_t now_ns, uint64_t arrival_ns,
                              bool congestion_mark) {
  Header h;
  const EngineConfig& c = s_->ctx.config;
  if (c.mode != Mode::stellar) {
    ++s_->ctx.counters.decode_errors;
    return;
  }
  const DecodeError e = decode_placed(header, header_length, payload, payload_length, trailer,
                                      c.loopback_unchecked ? addresses : IcrcAddresses{}, h);
  if (e != DecodeError::none) {
    ++s_->ctx.counters.decode_errors;
    return;
  }
  if (!s_->token_accepted(h)) return;
  s_->ctx.counters.rx_bytes += header_length + payload_length + 4;
  receive_decoded(h, now_ns, arrival_ns, congestion_mark);
}

void QpEngine::receive_decoded(const Header& h, uint64_t now_ns, uint64_t arrival_ns, bool congestion_mark) {
  State& s = *s_;
  // Before anything else: a packet without this connection's token (stellar)
  // changes no state: not the PSN window, not acknowledgements, not memory.
  if (!s.token_accepted(h)) return;
  ++s.ctx.counters.rx_packets;
  const uint64_t arrival = arrival_ns && arrival_ns <= now_ns ? arrival_ns : now_ns;
  // Path validation and sizing belong to the host (it owns the addresses
  // and the socket); one that reaches an engine is out of place.
  if (h.dest_qpn != s.ctx.config.local_qpn || h.pkey != s.ctx.config.pkey || opcode_is_host_control(h.opcode)) {
    ++s.ctx.counters.unexpected_packets;
    return;
  }
  if (s.ctx.error) return;
  const bool stellar = s.ctx.config.mode == Mode::stellar;
  if (stellar) {
    s.replies.on_packet(h);  // the host maps any path value onto its ports
    if (!opcode_is_request(h.opcode) && h.path == h.echo_path) s.paths.on_round_trip(h.path);
    if (opcode_is_request(h.opcode)) s.replies.on_request(h.path);
    if (congestion_mark) {
      ++s.ctx.counters.congestion_marks;
      s.replies.on_congestion_mark(h.path);
    }
    if (h.ce_count) {
      s.paths.on_congestion_mark(h.echo_path, h.ce_count);
      if (s.paths.marked_everywhere(now_ns)) s.cc->on_loss(now_ns);  // rate-limited per RTT by the controller
    }
  }
  if (opcode_is_request(h.opcode)) s.responder.note_request_arrival(arrival);
  // Host delay on both ends: this packet waited (now - arrival) for us to
  // poll; the peer held what it acknowledges for ack_delay_ns.
  const uint64_t host_delay = (now_ns - arrival) + (stellar && h.has_ack ? h.ack_delay_ns : 0);
  // Acknowledgements are taken in the order they came: one put off goes first.
  s.settle();
  if (s.ctx.error) return;
  if (stellar && h.has_ack) {
    if (s.ctx.config.defer_piggybacked_acks && opcode_is_request(h.opcode)) {
      s.deferred = State::DeferredAck{true, h.sack_offset, h.ack_psn, h.sack_bitmap, now_ns, host_delay};
    } else {
      s.requester.on_piggybacked_ack(h.ack_psn, h.sack_bitmap, h.sack_offset, now_ns, host_delay);
      if (s.ctx.error) return;
    }
  }
  if (opcode_is_request(h.opcode)) {
    const uint64_t duplicates = s.ctx.counters.duplicates;
    s.responder.on_request(h, now_ns);
    if (stellar && s.ctx.counters.duplicates != duplicates) s.replies.on_duplicate();
  } else if (h.opcode == opcode::acknowledge) {
    s.requester.on_ack_packet(h, now_ns, host_delay);
  } else {
    s.requester.on_response(h, now_ns, host_delay);
  }
}

size_t QpEngine::transmit(TxBuffer* buffers, size_t count, uint64_t now_ns) {
  State& s = *s_;
  s.writer.set_now(now_ns);
  s.cc->on_tick(now_ns);
  // A deferred acknowledgement is taken before anything it could change:
  // a timer it would stop, resends of what it acknowledges. New requests
  // may go first (it only frees window); if they could not, it is taken
  // and they are tried again.
  if (s.deferred.valid && (s.recovery.deadline() <= now_ns || s.recovery.has_lost())) s.settle();
  s.requester.on_timers(now_ns);
  size_t n = s.responder.transmit_responses(s.writer, buffers, count);
  if (!s.ctx.error && !s.held) {
    n += s.requester.transmit(s.writer, buffers + n, count - n, now_ns);
    if (s.deferred.valid && n < count && s.requester.unsent()) {
      s.settle();
      if (!s.ctx.error) n += s.requester.transmit(s.writer, buffers + n, count - n, now_ns);
    }
  }
  if (!s.ctx.error) n += s.responder.transmit_ack(s.writer, buffers + n, count - n, now_ns);
  return n;
}

uint64_t QpEngine::next_wakeup_ns(uint64_t now_ns) const {
  const State& s = *s_;
  if (s.responder.has_responses()) return now_ns;
  if (s.ctx.error) return never;
  if (s.held) return s.responder.ack_due();
  return std::min(s.responder.ack_due(), s.requester.next_wakeup_ns(now_ns));
}

void QpEngine::hold_requests(bool held) { s_->held = held; }
bool QpEngine::requests_held() const { return s_->held; }

void QpEngine::fail_requests(CompletionStatus status) {
  State& s = *s_;
  if (s.ctx.error) return;
  s.settle();
  if (s.ctx.error) return;
  s.held = false;
  if (s.requester.outstanding()) s.requester.fail_first(status);
  else s.enter_error();
}

bool QpEngine::set_mtu(uint32_t mtu) {
  State& s = *s_;
  s.settle();
  if (mtu < 256 || mtu > s.ctx.config.mtu || !s.requester.nothing_sent()) return false;
  s.ctx.config.mtu = mtu;
  s.cc->set_mtu_bytes(mtu);
  s.requester.repacketize();
  return true;
}

void QpEngine::acknowledge_now(uint64_t now_ns) { s_->responder.acknowledge_now(now_ns); }

void QpEngine::addresses_changed(uint64_t now_ns) {
  if (s_->ctx.error || s_->ctx.config.mode != Mode::stellar) return;
  s_->settle();
  s_->paths.forget_routes();
  s_->responder.force_acknowledgement(now_ns);
  s_->recovery.probe_now(now_ns);
}

size_t QpEngine::transmit_final_acknowledgement(TxBuffer* buffers, size_t count, uint64_t now_ns) {
  if (s_->ctx.error) return 0;
  acknowledge_now(now_ns);
  return s_->responder.transmit_ack(s_->writer, buffers, count, now_ns);
}

void QpEngine::enter_error() { s_->enter_error(); }

bool QpEngine::set_ready(uint64_t wr_id, uint32_t bytes) { return s_->requester.set_ready(wr_id, bytes); }
bool QpEngine::in_error() const { return s_->ctx.error; }
uint32_t QpEngine::outstanding_sends() const { return s_->requester.outstanding(); }
uint32_t QpEngine::outstanding_receives() const { return s_->responder.outstanding(); }
const EngineCounters& QpEngine::counters() const { return s_->ctx.counters; }
const EngineConfig& QpEngine::config() const { return s_->ctx.config; }
void QpEngine::set_tx_addresses(const IcrcAddresses& addresses) { s_->ctx.config.tx_addresses = addresses; }
uint64_t QpEngine::rto_ns() const { return s_->recovery.rto(); }
uint64_t QpEngine::smoothed_rtt_ns() const { return s_->recovery.srtt(); }
const CongestionControl& QpEngine::congestion_control() const { return *s_->cc; }
bool QpEngine::path_info(uint16_t path, PathInfo& out) const {
  if (path >= s_->paths.count()) return false;
  s_->paths.info(path, out);
  return true;
}

const char* to_string(PathPolicy p) {
  switch (p) {
    case PathPolicy::oblivious: return "oblivious";
    case PathPolicy::reps: return "reps";
    case PathPolicy::two_choices: return "two-choices";
    case PathPolicy::bandit: return "bandit";
  }
  return "?";
}

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

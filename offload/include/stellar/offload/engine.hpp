// The offload engine: one reliable-connection (RC) queue pair's transport as a
// pure state machine (docs/design.md, principle 1).
//
// The host drives it: it posts work, hands in received datagrams together with
// the current time, asks for datagrams to send, and asks when the next timer
// is due. The engine never blocks, reads a clock, opens a socket, takes a lock
// or allocates after construction. Everything it needs from the outside comes
// through two narrow interfaces: MemoryAccess (registered memory of the QP's
// protection domain) and CompletionSink (where work completions go).
//
// Thread-safety: none. One engine is driven by one thread at a time; the
// provider serialises access.
//
// Time is in nanoseconds on any monotonic clock chosen by the host.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "stellar/completion_status.hpp"
#include "stellar/offload/cc.hpp"
#include "stellar/offload/wire.hpp"

namespace stellar::offload {

inline constexpr uint32_t max_segments = 16;      // scatter/gather entries per work request
inline constexpr uint32_t max_inline_bytes = 256;  // inline data per work request

enum class WorkOpcode : uint8_t {
  send,
  send_with_imm,
  rdma_write,
  rdma_write_with_imm,
  rdma_read,
  atomic_fetch_add,
  atomic_compare_swap,
};

// The public API's completion status, the one definition
// (stellar/completion_status.hpp, with its to_string): what the engine
// completes with reaches the user unchanged.
using CompletionStatus = stellar::WcStatus;

enum class CompletionOpcode : uint8_t {
  send,
  rdma_write,
  rdma_read,
  compare_swap,
  fetch_add,
  receive,
  receive_rdma_with_imm,
};
const char* to_string(CompletionOpcode);

// Memory the engine may read or write: already checked against the lkey and
// access rights by whoever built the work request.
struct Segment {
  uint8_t* address = nullptr;
  uint32_t length = 0;
  uint32_t lkey = 0;  // checked again if memory was deregistered since posting (0: not checked, e.g. inline)
};

struct SendWork {
  uint64_t wr_id = 0;
  WorkOpcode opcode = WorkOpcode::send;
  bool signaled = true;
  bool solicited = false;
  bool inline_data = false;  // copy the payload at post time (<= max_inline_bytes)
  bool staged = false;       // SEND/WRITE whose payload is still being filled in (a GPU source
                             // copied in chunks): nothing past set_ready()'s bytes goes out
  uint32_t segment_count = 0;
  Segment segments[max_segments];
  uint64_t remote_addr = 0;  // RDMA and atomics
  uint32_t rkey = 0;
  uint32_t imm = 0;            // *_with_imm, host order
  uint64_t compare_add = 0;    // fetch_add: the addend; compare_swap: the compare value
  uint64_t swap = 0;           // compare_swap: the new value
};

struct ReceiveWork {
  uint64_t wr_id = 0;
  uint32_t segment_count = 0;
  Segment segments[max_segments];
};

struct Completion {
  uint64_t wr_id = 0;
  CompletionStatus status = CompletionStatus::success;
  CompletionOpcode opcode = CompletionOpcode::send;
  uint32_t byte_length = 0;  // receives: bytes placed (or written, for RDMA WRITE with immediate)
  uint32_t imm = 0;
  bool has_imm = false;
  uint32_t qp_number = 0;
  bool is_receive() const { return opcode == CompletionOpcode::receive || opcode == CompletionOpcode::receive_rdma_with_imm; }
};

// Access rights a remote operation needs (the same bits as the public API).
enum : uint32_t {
  access_local_write = 1,
  access_remote_write = 2,
  access_remote_read = 4,
  access_remote_atomic = 8,
};

// Registered memory of the QP's protection domain. resolve returns where
// [address, address + length) lives if rkey names a region of this PD (and
// tenant) that contains the whole range and grants `access`; nullptr
// otherwise. Must not allocate; called per packet.
class MemoryAccess {
 public:
  virtual ~MemoryAccess() = default;
  virtual uint8_t* resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t access) = 0;
  // Local keys: a counter that changes whenever a region is deregistered, and
  // the check itself. The engine re-checks the segments of a posted request
  // before touching them only when the generation moved since it was posted,
  // so the common case costs one comparison.
  virtual uint64_t generation() const { return 0; }
  virtual bool local_valid(uint32_t lkey, const uint8_t* address, uint64_t length, uint32_t access) {
    (void)lkey, (void)address, (void)length, (void)access;
    return true;
  }

  // Whether registered memory is addressable here. true (the default): the
  // addresses resolve() returns and keyed segments carry may be dereferenced;
  // the engine copies with memcpy and sends large payloads zero-copy from
  // them. false (the engine daemon, offload/daemon): they are addresses in
  // the application's address space, and the engine copies only through
  // read() and write(). Asked once, at engine construction.
  virtual bool direct() const { return true; }
  // Copies out of / into registered memory at `address` (from resolve() or a
  // keyed segment). False if it is out of reach (the process is gone, or
  // unmapped it); the engine then treats it as an access error.
  virtual bool read(void* to, const uint8_t* address, size_t length) {
    std::memcpy(to, address, length);
    return true;
  }
  virtual bool write(uint8_t* address, const void* from, size_t length) {
    std::memcpy(address, from, length);
    return true;
  }
};

class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void deliver(const Completion&) = 0;
};

// How a stellar-mode QP chooses the path of each request (docs/multipath.md).
enum class PathPolicy : uint8_t {
  oblivious,    // round robin over every path that is not retired
  reps,         // REPS: reuse paths whose packets came back clean, explore others
  two_choices,  // power of two choices on expected delay (RTT, loss rate, packets queued)
  bandit,       // UCB1 bandit over a per-path reward (low RTT, no loss)
};
const char* to_string(PathPolicy);  // the public API's names (stellar::to_string(PathPolicy))
inline constexpr uint16_t max_paths = 256;

// One path's state, for telemetry and tests (QpEngine::path_info).
struct PathInfo {
  uint64_t srtt_ns = 0, min_rtt_ns = 0;  // 0: no sample yet
  uint32_t inflight_packets = 0;
  double loss_rate = 0;                  // smoothed, per packet
  double mark_rate = 0;                  // ECN CE marks the peer echoed, smoothed, per packet
  bool retired = false;                  // no packet goes there until its probe time
  uint64_t sent_packets = 0, acknowledged_packets = 0, lost_packets = 0, retirements = 0;
  uint64_t marked_packets = 0;           // echoed as ECN CE by the peer
};

struct EngineConfig {
  Mode mode = Mode::stellar;
  uint32_t mtu = 4096;             // payload bytes per packet (path MTU as RoCE counts it)
  uint32_t max_send_wr = 256;
  uint32_t max_recv_wr = 256;
  uint32_t window_packets = 16384;  // PSNs in flight; power of two
  uint16_t pkey = default_pkey;    // the tenant's partition key
  uint32_t local_qpn = 0;
  uint32_t remote_qpn = 0;
  // stellar mode: the connection tokens (docs/security.md). local_token is
  // what the peer must put on every packet to this QP: a packet carrying
  // another value is dropped before it touches any state (bad_token).
  // remote_token is what this QP puts on every packet it sends (the peer's
  // local_token). Hosts draw them from a CSPRNG; 0 is a valid value here (the
  // unit tests leave both 0), the soft provider never uses it. roce mode has
  // no token on the wire and ignores both.
  uint64_t local_token = 0;
  uint64_t remote_token = 0;
  uint32_t send_psn = 0;           // first PSN this side sends
  uint32_t receive_psn = 0;        // first PSN expected from the peer
  uint64_t rto_initial_ns = 1'000'000;
  uint64_t rto_min_ns = 1'000'000;
  uint64_t rto_max_ns = 64'000'000;
  uint32_t retry_count = 7;        // timeouts without progress before retry_exceeded
  uint32_t rnr_retry = 7;          // 7 = retry forever, as in verbs
  uint64_t rnr_delay_ns = 100'000;
  uint64_t ack_delay_ns = 10'000;  // hold a pure ACK this long hoping to piggy-back it
  uint32_t ack_every_packets = 16;
  uint32_t max_read_responses = 64;  // outstanding inbound READs served at once
  uint32_t max_read_request_packets = 256;  // a READ is asked for in pieces of at most this many
                                            // packets (and half the window): the responder sends a
                                            // piece in one burst, which the requester's socket must hold
  uint32_t max_rd_atomic = 16;       // READs + atomics this side keeps outstanding (verbs max_rd_atomic;
                                     // below the responder's atomic replay cache of 32)
  // roce: responses (READ data, atomic and other acknowledgements) one
  // transmit() call emits at most. A READ's responses then leave in bursts
  // with the host's receive in between, as a NIC's leave at link rate, so
  // that a duplicate READ request (the requester went back to a lost
  // response) still finds most of them queued and cuts them short, instead
  // of all of them being in the requester's socket already.
  uint32_t max_response_burst = 32;
  // stellar mode: the paths (entropies) requests are sprayed over, 1 to
  // max_paths; the host maps path i to one of its source ports. roce mode
  // always uses one. The policy chooses among them; a chosen path is kept
  // for path_burst_packets packets (one GSO message's worth: at most
  // 65536 / mtu, or 4 packets above 16 KiB, whatever is asked) before the
  // next choice.
  uint16_t paths = 1;
  PathPolicy path_policy = PathPolicy::two_choices;
  uint32_t path_burst_packets = 16;
  CcAlgorithm cc = CcAlgorithm::none;
  CcConfig cc_config{};
  IcrcAddresses tx_addresses{};    // roce mode ICRC of what we send; stellar: is_loopback
  // stellar mode: both ends agreed to leave the CRC-32C out between loopback
  // addresses; packets go without it while tx_addresses is_loopback
  // (Header::unchecked).
  bool loopback_unchecked = false;
  // stellar mode: both QPs advertised path MTU discovery: their hosts probe
  // the path and settle the payload size (at most `mtu`) before either side
  // sends a request (docs/wire-format.md, "Path MTU"). The engine only
  // holds requests and takes the size (QpEngine::hold_requests, set_mtu).
  bool size_path = false;
  // stellar mode: the cumulative ACK and SACK a request packet carries are
  // taken later, not before its data: at the next settle_acknowledgement()
  // or whatever call needs them first. A host that calls it after sending
  // its reply takes that work (about a third of a small message's receive
  // path) off the way from the data's arrival to the reply's departure.
  // Off: taken at once (as the unit tests drive the engine).
  bool defer_piggybacked_acks = false;
};

// One datagram to send. Small payloads are copied into `data`; large ones
// stay in registered memory and are referenced (zero-copy gather): the
// datagram is then data[0..header_length) + payload pieces + trailer. The
// pieces are valid until the next call into the engine.
struct TxBuffer {
  uint8_t* data = nullptr;
  uint32_t capacity = 0;       // >= mtu + max_header_bytes
  uint32_t length = 0;         // whole datagram, set by the engine
  uint32_t header_length = 0;  // bytes in data when piece_count > 0
  uint32_t piece_count = 0;    // 0: data[0..length) is the whole datagram
  PayloadPiece pieces[max_segments] = {};
  uint8_t trailer[8] = {};
  uint32_t trailer_length = 0;
  uint16_t path = 0;           // the path (entropy) index it leaves on (Header::path)
};

struct EngineCounters {
  uint64_t tx_packets = 0, tx_bytes = 0, rx_packets = 0, rx_bytes = 0;
  uint64_t retransmitted_packets = 0, timeouts = 0, fast_retransmits = 0, tail_probes = 0;
  uint64_t spurious_timeouts = 0;  // timeouts undone: a packet they declared lost arrived without retransmission
  // stellar: packets loss detection declared lost and resent whose original
  // was acknowledged after all (the ACK came sooner than the minimum RTT
  // after the resend); each one widens the reordering window.
  uint64_t spurious_retransmits = 0;
  uint64_t acks_sent = 0, naks_sent = 0, rnr_naks_sent = 0, rnr_naks_received = 0, sequence_naks_received = 0;
  uint64_t duplicates = 0;          // requests already seen (re-acknowledged)
  uint64_t out_of_window = 0;       // PSN outside the acceptance window: dropped
  uint64_t out_of_order = 0;        // accepted ahead of a gap (stellar) or dropped (roce)
  uint64_t access_errors = 0;       // bad rkey / bounds / rights: NAK, nothing written
  uint64_t invalid_requests = 0;    // malformed but well-checksummed requests: NAK
  uint64_t decode_errors = 0;       // truncated, bad opcode, bad checksum: dropped
  uint64_t bad_token = 0;           // stellar: well-formed, but not this connection's token (forged or
                                    // stale): dropped before touching any state; not in rx_packets/rx_bytes
  uint64_t unexpected_packets = 0;  // responses/acks that match nothing outstanding: dropped
  // READ/atomic requests the responder had no room for (all 16 slots for
  // requests ahead of a gap taken, or its READ response queue full):
  // dropped, asked for again by the requester after its timeout.
  uint64_t requests_dropped_full = 0;
  uint64_t completions = 0;
  // stellar: paths retired after losses in a row or a timeout (failover);
  // each is probed again later.
  uint64_t paths_retired = 0;
  // stellar: packets that arrived marked ECN CE (echoed to the peer).
  uint64_t congestion_marks = 0;
};

// Copies a (possibly scattered) datagram into one contiguous buffer; returns
// its length, 0 if `capacity` is too small. For tests and tools.
size_t flatten(const TxBuffer&, uint8_t* out, size_t capacity);

// The completion a work request of opcode `op` produces.
inline CompletionOpcode completion_opcode(WorkOpcode op) {
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

enum class PostResult : uint8_t { ok, queue_full, invalid_argument, qp_in_error };

// Whether a QP with `config` could ever take `work` (its shape: segments,
// length at most 2^31, atomics' 8 aligned bytes, inline limits, a PSN span
// under a quarter of the PSN space): ok or invalid_argument. Room is not
// looked at. QpEngine::post_send applies it; a host whose engine is
// elsewhere (the daemon's client) applies it before sending the WR away, so
// that a malformed post fails synchronously in every placement.
PostResult check_send_work(const SendWork&, const EngineConfig&);

class QpEngine {
 public:
  // Allocates every ring it will ever use. The references must outlive it.
  QpEngine(const EngineConfig&, MemoryAccess&, CompletionSink&);
  ~QpEngine();
  QpEngine(const QpEngine&) = delete;
  QpEngine& operator=(const QpEngine&) = delete;

  PostResult post_send(const SendWork&, uint64_t now_ns);
  PostResult post_receive(const ReceiveWork&);

  // A datagram from the peer. `addresses` describe it as received (source =
  // the peer); only roce mode uses them (ICRC).
  // `arrival_ns` (same clock as now_ns, <= now_ns; 0 = now_ns): when the
  // datagram reached the host (the socket's kernel timestamp), so that time it
  // waited for this host to poll counts as host delay, not network delay.
  // `congestion_mark`: the datagram arrived with ECN CE in its IP header
  // (stellar: echoed to the peer as a path signal, Header::ce_count).
  void receive(const uint8_t* data, size_t length, const IcrcAddresses& addresses, uint64_t now_ns, uint64_t arrival_ns = 0,
               bool congestion_mark = false);
  // The same for an already decoded packet (tests, fuzzing).
  void receive_decoded(const Header&, uint64_t now_ns, uint64_t arrival_ns = 0, bool congestion_mark = false);

  // Direct placement (stellar mode; docs/wire-format.md, "Receiving into
  // place"): a host that knows which WRITE packet it expects next may have
  // the kernel write that packet's payload straight into registered memory
  // instead of a receive buffer, saving a copy. placement() says where the
  // payload of the packet at `psn` of the WRITE message (rkey, remote_addr,
  // message_length) at [offset, offset + length) would go: a pointer the
  // kernel may write those bytes to now, whatever the datagram that comes
  // turns out to be, because that packet has not arrived, so nothing there
  // is final yet (the WRITE's target is undefined until it completes).
  // nullptr where that does not hold: the packet would be a duplicate, out
  // of the window or refused; the range is not this QP's remote-writable
  // memory; or memory is not addressable here (MemoryAccess::direct()).
  // Valid until the caller releases the lock the engine runs under.
  // The WRITE message this QP last took a packet of, while packets of it
  // remain: the next one's PSN and payload offset, and the message's key,
  // address and length, for the host to ask placement() about the packets
  // from there on. Only packets that passed every check (the token
  // included) set it. false when there is none, or that message is whole.
  // last_with_imm: whether this QP's previous WRITE of more than one packet
  // ended with an immediate (a guess at this one's last packet's header
  // length).
  struct ExpectedWrite {
    uint32_t psn = 0, rkey = 0, message_length = 0, offset = 0;
    uint64_t remote_addr = 0;
    bool last_with_imm = false;
  };
  bool expected_write(ExpectedWrite&) const;
  uint8_t* placement(uint32_t psn, uint32_t rkey, uint64_t remote_addr, uint32_t message_length, uint32_t offset, uint32_t length);
  // Whether the packet at `psn` would still be taken as new (the first
  // condition of placement(), without its memory lookup).
  bool awaiting(uint32_t psn) const;
  // A datagram received in pieces (decode_placed): checked and taken like
  // receive(); a WRITE whose payload already sits where it belongs is not
  // copied again.
  void receive_placed(const uint8_t* header, size_t header_length, const uint8_t* payload, uint32_t payload_length,
                      const uint8_t* trailer, const IcrcAddresses& addresses, uint64_t now_ns, uint64_t arrival_ns = 0,
                      bool congestion_mark = false);

  // Fills up to `count` buffers with datagrams due now (responses, retransmits,
  // new data, ACKs, in that order) and returns how many. It may return fewer
  // than `count` while more is due (roce: at most max_response_burst
  // responses a call); next_wakeup_ns() then says now: hand in what arrived,
  // and call again.
  size_t transmit(TxBuffer* buffers, size_t count, uint64_t now_ns);

  // The earliest time transmit() could produce something without new input;
  // UINT64_MAX when idle. now_ns or earlier means "call transmit now".
  uint64_t next_wakeup_ns(uint64_t now_ns) const;

  // EngineConfig::defer_piggybacked_acks: takes the acknowledgement a
  // received request carried and that was put off, if any (completing the
  // sends it acknowledges). next_wakeup_ns() does not count it (asking for
  // a round would put the scheduler back on the data's way): a host must
  // call this before it stops driving the engine (sleeps, or returns to an
  // application that may wait for a completion). Cheap when there is none.
  void settle_acknowledgement();
  bool acknowledgement_deferred() const;

  // Makes an acknowledgement held back for piggy-backing due now (the next
  // transmit() sends it). For hosts that are about to stop driving the engine
  // for a while, so that the peer's sends still complete.
  void acknowledge_now(uint64_t now_ns);

  // stellar: the connection's addresses changed (this side moved, or the
  // host validated the peer's new address). An acknowledgement goes out at
  // the next transmit even if none is held, and the tail-loss probe if
  // packets are outstanding, so that within one round trip the peer sees
  // the new address and each side learns what was lost in the move.
  void addresses_changed(uint64_t now_ns);
  // The host's or the peer's address changed (rebind, validated migration):
  // what config().tx_addresses holds from now on.
  void set_tx_addresses(const IcrcAddresses& addresses);

  // Path MTU discovery (the host's, at connection set-up; docs/wire-format.md,
  // "Path MTU"). While held, no request leaves (posted work queues; ACKs
  // and responses still go) and the requester asks for no wake-up.
  void hold_requests(bool held);
  bool requests_held() const;
  // Packets carry at most `mtu` payload bytes from now on (256 to the
  // configured mtu): the queued work is cut into packets of that size.
  // Only before the first request left (false then, and nothing changes):
  // both sides must cut every message, READ responses included, alike, so
  // the host settles the size with the peer before either side sends.
  bool set_mtu(uint32_t mtu);
  // The oldest posted send completes with `status`, the rest flushed, and
  // the QP enters the error state (a host that gave up on its peer before
  // anything was sent: path sizing that never settled).
  void fail_requests(CompletionStatus status);

  // For a QP being destroyed: its acknowledgement of what it accepted, if one
  // is held back, and nothing else (no requests, no READ responses). What
  // was delivered here must complete at the peer, as a NIC that acknowledged
  // at once would have it; what was not is the peer's timeout. Returns the
  // datagrams written (0 or 1).
  size_t transmit_final_acknowledgement(TxBuffer* buffers, size_t count, uint64_t now_ns);

  // Moves to the error state: everything posted completes with
  // work_request_flushed (verbs semantics of a QP in ERROR).
  void enter_error();

  // A staged SendWork (SendWork::staged): its first `bytes` of payload are in
  // place and may be sent. Only grows; the host calls it as each chunk of the
  // copy lands. False if no WQE with that wr_id is queued (completed, or
  // flushed). Packets wait for it, not the WQEs behind it: those wait
  // in PSN order as always.
  bool set_ready(uint64_t wr_id, uint32_t bytes);
  bool in_error() const;

  uint32_t outstanding_sends() const;
  uint32_t outstanding_receives() const;  // posted receives not yet completed
  const EngineCounters& counters() const;
  const EngineConfig& config() const;
  uint64_t rto_ns() const;
  uint64_t smoothed_rtt_ns() const;
  const CongestionControl& congestion_control() const;
  // The state of path `path` (< config().paths); false if there is none.
  bool path_info(uint16_t path, PathInfo& out) const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace stellar::offload

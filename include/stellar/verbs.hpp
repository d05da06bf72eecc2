// Stellar's verbs-shaped API: context, protection domain, memory region,
// completion queue and RC queue pair, with the semantics of libibverbs
// (docs/design.md, principle 2). A user who knows verbs knows this.
//
// Ownership: objects are handed out as std::shared_ptr; a child keeps its
// parents alive (a QP keeps its PD, CQs and context). Memory regions are
// std::unique_ptr: destroying one deregisters it.
//
// Thread-safety: every object may be used from several threads; calls on one
// QP (post_send) and one CQ (poll) are serialised internally. Buffers named
// in work requests must stay valid until their completion is polled.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "stellar/completion_status.hpp"
#include "stellar/status.hpp"

namespace stellar {

// The largest ContextOptions::mtu: 15 pages, the largest multiple of 4096
// whose datagram (IPv4 and UDP headers, at most 96 bytes of Stellar headers
// and trailer) stays inside IPv4's 65535-byte limit.
inline constexpr uint32_t max_mtu = 61440;

enum class Provider { soft, verbs };
enum class Mode { stellar, roce };  // soft provider wire protocol (docs/design.md, principle 3)
// Where the engines (transport, congestion control, timers) run
// (docs/engine-daemon.md). STELLAR_ENGINE=inline|thread|daemon overrides it.
enum class ProgressMode {
  inline_poll,  // the caller's poll/wait drives the transport (lowest latency, no extra thread)
  thread,       // a dedicated engine thread drives it
  daemon,       // stellar-engined drives it, outside the application (the SmartNIC placement): the
                // application only posts work and takes completions, through shared-memory rings
};
const char* to_string(ProgressMode);
enum class WaitPolicy {
  busy_poll,  // spin: lowest latency, one core per context
  adaptive,   // spin for spin_time (soft: without traffic), then sleep in the kernel until a packet or timer
};
enum class CongestionControl { automatic, none, dcqcn, swift };  // automatic: dcqcn for roce, swift for stellar

// How a stellar-mode connection chooses the path of each packet
// (docs/multipath.md): round robin; REPS (reuse paths whose packets came back
// clean); power of two choices on expected delay (the default); a UCB1 bandit.
enum class PathPolicy { oblivious, reps, two_choices, bandit };

const char* to_string(Provider);
const char* to_string(Mode);
const char* to_string(PathPolicy);
Result<PathPolicy> parse_path_policy(const std::string&);  // "oblivious", "reps", "two-choices", "bandit"
Result<Provider> parse_provider(const std::string&);
Result<Mode> parse_mode(const std::string&);

// Fault injection of the soft provider, applied to datagrams it sends.
// Probabilities in [0, 1].
struct FaultOptions {
  double drop = 0;
  double duplicate = 0;
  double reorder = 0;  // the datagram is held back and sent after the next one
  uint64_t seed = 0;   // 0: a random seed
  // STELLAR_FAULT_DROP, STELLAR_FAULT_DUP, STELLAR_FAULT_REORDER (e.g. "0.01"),
  // STELLAR_FAULT_SEED; unset variables keep `base`'s values.
  static Result<FaultOptions> from_environment(const FaultOptions& base);
};

// What a training job says about a QP's traffic (docs/scheduler.md): the
// flow scheduler turns it into a traffic class (the DSCP of the soft
// provider's packets, the GRH traffic class on the verbs provider) and a
// share of the engine host's transmit capacity.
enum class TrafficKind : uint8_t {
  unspecified,              // class 0 (best effort)
  gradient_allreduce,       // collectives' gradient traffic: class 4
  gradient_reduce_scatter,  // class 4
  gradient_allgather,       // class 4
  all_to_all,               // expert parallelism: class 4
  parameter_fetch,          // parameter-server or weight fetches: class 3
  kv_fetch,                 // KV-cache transfers (inference): class 3
  checkpoint,               // bulk that may wait: class 1
  control,                  // bootstrap, barriers, small messages: class 7, strict priority
};
const char* to_string(TrafficKind);  // the names parse_traffic_kind takes
// "allreduce", "reduce-scatter", "allgather", "all-to-all", "parameter-fetch",
// "kv-fetch", "checkpoint", "control", "unspecified".
Result<TrafficKind> parse_traffic_kind(const std::string&);

struct JobHints {
  std::string job;          // the job's name ("" : the tenant's default job)
  TrafficKind kind = TrafficKind::unspecified;
  int priority = -1;        // traffic class 0 (lowest) to 7 (control); -1: the kind's class
  uint32_t weight = 1;      // the job's share among its tenant's jobs (>= 1)
  // Optional, for deadline-aware ordering (docs/scheduler.md: recorded and
  // reported, not yet used to order jobs): the training step's period, the
  // bytes it moves per step, and a deadline within the step.
  std::chrono::nanoseconds step_period{0};
  uint64_t bytes_per_step = 0;
  std::chrono::nanoseconds deadline{0};
  // The traffic class (0-7) these hints give.
  uint8_t traffic_class() const;
  // "job=NAME,kind=KIND,priority=P,weight=W,step_ms=MS,bytes_per_step=B,deadline_ms=MS",
  // any subset, or just "KIND". invalid_argument names the bad field.
  static Result<JobHints> parse(const std::string&);
};

struct ContextOptions {
  Provider provider = Provider::soft;
  Mode mode = Mode::stellar;
  // soft: the IPv4 address the UDP socket binds. verbs: picks the device and
  // port whose RoCE v2 GID is ::ffff:<address>; the default (and "" or
  // 0.0.0.0) falls back to the first usable GID (docs/verbs-provider.md).
  std::string bind_address = "127.0.0.1";
  uint16_t udp_port = 0;                   // 0: any free port (roce mode tries 4791 first)
  // Payload bytes per packet, [256, max_mtu]; 0 (the default, or
  // STELLAR_MTU=auto): automatic. Soft provider, stellar mode: the largest
  // multiple of 256, at most max_mtu, whose datagram fits the MTU of the
  // bound address's interface (61440 on loopback, 8704 with 9000-byte
  // jumbo frames, 1280 on 1500-byte Ethernet); roce mode: the largest of
  // RoCE's MTUs (256 to 4096, powers of two) that fits; verbs:
  // the port's active MTU. Both sides of a QP use the smaller of their
  // two. Context::options() reports the value chosen.
  uint32_t mtu = 0;
  ProgressMode progress = ProgressMode::inline_poll;
  // ProgressMode::daemon: the daemon's Unix socket. "" = $STELLAR_ENGINED_SOCKET,
  // else /run/stellar/engined.sock.
  std::string engined_socket;
  WaitPolicy wait = WaitPolicy::busy_poll;
  std::chrono::nanoseconds spin_time{50'000};  // adaptive: spin this long (soft: since the last traffic) before sleeping
  CongestionControl congestion_control = CongestionControl::automatic;
  uint64_t line_rate_bps = 100'000'000'000ull;  // ceiling for rate-based congestion control
  // Swift: queueing delay tolerated above the base RTT before the window
  // shrinks. A software transport's delay is mostly host delay (scheduling,
  // socket queues), which NIC-based Swift budgets at about 100 us too.
  std::chrono::nanoseconds cc_target_delay{100'000};
  FaultOptions faults{};                       // merged with the environment at open
  // soft provider, stellar mode: the paths (entropies: UDP source ports that
  // ECMP hashes onto routes) each connection sprays its packets over, 1-256,
  // and how it chooses among them. The context opens one UDP socket per
  // path. roce mode is always one path. STELLAR_PATHS and STELLAR_PATH_POLICY
  // override them at open.
  uint16_t paths = 16;
  PathPolicy path_policy = PathPolicy::two_choices;
  // soft provider, stellar mode: when bind_address disappears from this host
  // (renumbering, a failed-over interface), move to the address the kernel
  // now sends from toward the peers, and keep every connection
  // (docs/multipath.md, "Address change"). STELLAR_FOLLOW_ADDRESS=0 turns it off.
  bool follow_address = true;
  // soft provider, stellar mode: before a connection's first packet, probe
  // the path to its peer with datagrams of the agreed size (and smaller
  // ones), and send packets no larger than every path carried: a fabric
  // with a 1500-byte link between 9000-byte hosts then works at 1280 bytes a
  // packet instead of losing every full packet (docs/wire-format.md, "Path
  // MTU"). Costs a few round trips before the first send; never between
  // loopback addresses or at an agreed MTU of 1280 or less. Both QPs must
  // have it on. STELLAR_PATH_MTU_DISCOVERY=0 turns it off.
  bool path_mtu_discovery = true;
  // soft provider, stellar mode: leave the CRC-32C trailer out of packets
  // between two loopback (127.0.0.0/8) addresses when the peer's QP agrees
  // (QpEndpoint::loopback_unchecked). On loopback a datagram goes from
  // memory to memory and the kernel checksums nothing (nor does it for TCP
  // there); off the host the CRC is always sent and checked
  // (docs/wire-format.md). STELLAR_LOOPBACK_CRC=1 keeps it on loopback too.
  bool loopback_crc = false;
  // soft provider, stellar mode: while a WRITE streams in, receive each
  // datagram's payload straight into the registered memory it is written
  // to (the kernel's copy is the only one) instead of into a receive
  // buffer that the engine then copies from (docs/wire-format.md,
  // "Receiving into place"). STELLAR_RX_PLACEMENT=0 turns it off.
  bool rx_placement = true;
  std::string device;                          // verbs provider: device name, e.g. "mlx5_0" ("" = chosen by bind_address)
  // Tenants (docs/scheduler.md). The context opens as `tenant` (its PDs'
  // default) with `credential`; with a tenants file, the file must list the
  // tenant with that credential, else open fails with permission_denied.
  // STELLAR_TENANT, STELLAR_TENANT_CREDENTIAL and STELLAR_TENANTS (the
  // file's path) override them at open. "" : the default tenant.
  std::string tenant;
  std::string credential;
  std::string tenants_file;
  // The QPs' job hints where QpInitAttributes gives none; STELLAR_JOB_HINTS
  // (JobHints::parse's form) overrides them at open.
  JobHints hints{};
  // DSCP (0-63) of each traffic class 0-7 on the soft provider's packets
  // (and the GRH traffic class, DSCP << 2, on the verbs provider).
  // STELLAR_TRAFFIC_CLASS_DSCP="0,8,16,24,32,40,46,48" overrides it.
  uint8_t class_dscp[8] = {0, 8, 16, 24, 32, 40, 46, 48};
  // soft provider, in-process engines: the rate (bytes/s) the flow scheduler
  // shapes this context's transmissions to, so that tenants' shares are
  // decided here instead of in a shared queue downstream; 0: none.
  // STELLAR_TX_RATE (bytes/s) overrides it.
  uint64_t tx_rate_bytes_per_s = 0;
};

// Memory access rights (ibv_access_flags).
enum Access : uint32_t {
  access_local_write = 1,
  access_remote_write = 2,
  access_remote_read = 4,
  access_remote_atomic = 8,
};

struct Sge {
  uint64_t addr = 0;
  uint32_t length = 0;
  uint32_t lkey = 0;
};

enum class WrOpcode { send, send_with_imm, rdma_write, rdma_write_with_imm, rdma_read, atomic_fetch_add, atomic_cmp_swap };

enum SendFlags : uint32_t {
  send_signaled = 1,   // generate a completion on success (errors always complete)
  send_inline = 2,     // copy the payload at post time; lkeys are not checked (<= max_inline_data)
  send_solicited = 4,
};

struct SendWr {
  uint64_t wr_id = 0;
  WrOpcode opcode = WrOpcode::send;
  uint32_t flags = send_signaled;
  std::span<const Sge> sg_list;
  uint64_t remote_addr = 0;  // RDMA and atomics; atomics need 8-byte alignment
  uint32_t rkey = 0;
  uint32_t imm_data = 0;     // host order
  uint64_t compare_add = 0;  // fetch_add: addend; cmp_swap: compare value
  uint64_t swap = 0;         // cmp_swap: value stored on match
};

struct RecvWr {
  uint64_t wr_id = 0;
  std::span<const Sge> sg_list;
};

// WcStatus (mirrors ibv_wc_status) and its to_string: completion_status.hpp.
enum class WcOpcode { send, rdma_write, rdma_read, compare_swap, fetch_add, recv, recv_rdma_with_imm };
const char* to_string(WcOpcode);

struct WorkCompletion {
  uint64_t wr_id = 0;
  WcStatus status = WcStatus::success;
  WcOpcode opcode = WcOpcode::send;
  uint32_t byte_len = 0;
  uint32_t imm_data = 0;
  bool has_imm = false;
  uint32_t qp_num = 0;
  // Provider detail of an error completion (0, 0 on success and in the soft
  // provider). verbs: the ibv_wc_status exactly as the NIC reported it
  // (several fold into one WcStatus) and its vendor_err syndrome; describe()
  // names both.
  uint32_t provider_status = 0;
  uint32_t vendor_error = 0;
  Provider provider = Provider::soft;  // which provider's codes provider_status/vendor_error are
};
// "remote access error", plus for verbs errors the original status:
// "remote access error (IBV_WC_REM_ACCESS_ERR: remote access error, vendor_err 0x88)".
std::string describe(const WorkCompletion&);

class CompletionQueue {
 public:
  virtual ~CompletionQueue() = default;
  // Takes up to out.size() completions, oldest first; never blocks. In
  // inline progress mode this also drives the transport. Returns the count.
  // Soft provider with the engines on an engine thread or in the daemon: an
  // empty poll while the CPUs are oversubscribed (the calling thread, or the
  // engine thread, was preempted lately) yields the core first
  // (sched_yield; ContextCounters::contention_yields), so that spinning on
  // poll cannot starve the threads that would fill this CQ. Never inline.
  virtual int poll(std::span<WorkCompletion> out) = 0;
  // Blocks until at least one completion or `timeout`; uses the context's
  // wait policy. Errc::timeout when nothing arrived.
  virtual Result<int> wait(std::span<WorkCompletion> out, std::chrono::nanoseconds timeout) = 0;
  // A file descriptor for epoll: readable after request_notify() once a
  // completion is queued (like ibv_req_notify_cq + the channel fd). Read 8
  // bytes to clear it. In inline mode, call poll() when it (or the context's
  // progress_fd) is readable, and at least every millisecond while work is
  // outstanding: the transport's timers (retransmission, delayed ACKs) and
  // the soft provider's GPU staging copies make no descriptor readable.
  // wait() and the engine thread handle both.
  virtual int fd() const = 0;
  virtual Status request_notify() = 0;
  virtual uint32_t capacity() const = 0;
};

enum class QpState { reset, init, rtr, rts, error };
const char* to_string(QpState);

struct QpCapabilities {
  uint32_t max_send_wr = 256;
  uint32_t max_recv_wr = 256;
  uint32_t max_send_sge = 16;
  uint32_t max_recv_sge = 16;
  uint32_t max_inline_data = 256;
};

struct QpInitAttributes {
  std::shared_ptr<CompletionQueue> send_cq;
  std::shared_ptr<CompletionQueue> recv_cq;
  QpCapabilities cap{};
  // The traffic's job hints; unset: ContextOptions::hints.
  std::optional<JobHints> hints;
};

// What a peer needs to connect to a QP (exchanged by the connection manager).
struct QpEndpoint {
  std::string address;  // soft: IPv4 of the peer's UDP socket; verbs: the IPv4 its GID carries (for logs)
  uint16_t udp_port = 0;  // soft: the UDP port; verbs: 4791 (RoCE v2), informational
  uint32_t qp_num = 0;
  uint32_t psn = 0;     // first PSN that side sends (24 bits)
  uint32_t mtu = 4096;  // bytes; both sides use the smaller
  uint16_t pkey = 0xffff;
  Mode mode = Mode::stellar;  // soft: its wire protocol; verbs: always roce (the NIC's RoCE v2)
  // verbs only: the port GID packets are addressed to, in sysfs form
  // ("0000:0000:0000:0000:0000:ffff:0a00:0001"), and the port's LID (used on
  // InfiniBand ports; 0 on RoCE). Empty/0 for soft endpoints; a verbs QP
  // refuses a peer without a GID.
  std::string gid;
  uint16_t lid = 0;
  // soft provider, stellar mode: this QP's connection token, the random
  // 64-bit secret the peer must put on every packet to it (docs/security.md);
  // carried by the connection manager. 0 in roce mode and on the verbs
  // provider; a stellar-mode QP refuses a remote endpoint with token 0 at RTR.
  uint64_t token = 0;
  // soft provider, stellar mode: this QP takes packets without the CRC-32C
  // between loopback addresses (ContextOptions::loopback_crc off), so the
  // peer may leave it out when both ends are on 127.0.0.0/8. Carried as
  // JSON "loopback_unchecked"; absent (an older peer): false.
  bool loopback_unchecked = false;
  // soft provider, stellar mode: this QP sizes its path before sending
  // (ContextOptions::path_mtu_discovery); only when both ends say so do the
  // two probe it (docs/wire-format.md, "Path MTU"). JSON
  // "path_mtu_discovery"; absent (an older peer): false.
  bool path_mtu_discovery = false;
};

// Transport timing of a QP (set at RTR/RTS, like ibv_qp_attr.timeout/retry_cnt).
struct QpTiming {
  std::chrono::nanoseconds rto_min{1'000'000};
  std::chrono::nanoseconds rto_max{64'000'000};
  uint32_t retry_count = 7;  // consecutive timeouts before retry_exceeded
  uint32_t rnr_retry = 7;    // 7: retry forever
};

struct QpModify {
  QpState state = QpState::init;
  uint32_t access = access_local_write | access_remote_write | access_remote_read | access_remote_atomic;  // INIT
  QpEndpoint remote{};  // RTR
  QpTiming timing{};    // RTR
};

// One path of a stellar-mode QP (docs/multipath.md): a UDP source port the
// fabric's ECMP hashes onto a route of its own. Counts are packets since the
// QP connected; rates are smoothed per packet (0..1). Read with
// QueuePair::path_counters.
struct PathCounters {
  uint16_t path = 0;
  uint64_t sent_packets = 0;          // request packets this QP sent on the path (WRITE, SEND, READ, atomic), resends included
  uint64_t acknowledged_packets = 0;  // of those, acknowledged by the peer
  uint64_t lost_packets = 0;          // declared lost (resent)
  uint64_t marked_packets = 0;        // echoed by the peer as ECN CE (a queue on the path)
  uint64_t retirements = 0;           // times taken out of use (losses in a row, a timeout)
  bool retired = false;               // out of use now, until its probe time
  uint32_t inflight_packets = 0;      // sent and not yet acknowledged or lost
  uint64_t srtt_ns = 0, min_rtt_ns = 0;  // 0: no sample yet
  double loss_rate = 0, mark_rate = 0;
};

class QueuePair {
 public:
  virtual ~QueuePair() = default;
  virtual uint32_t qp_num() const = 0;
  virtual QpState state() const = 0;
  // The verbs state machine: RESET->INIT->RTR->RTS, any->ERROR, any->RESET is
  // not supported (create a new QP). Invalid transitions fail with wrong_state.
  virtual Status modify(const QpModify&) = 0;
  // Valid in RTS (sends) and INIT/RTR/RTS (receives); ERROR completes the
  // request at once with work_request_flushed. Misuse fails and changes nothing.
  virtual Status post_send(const SendWr&) = 0;
  virtual Status post_recv(const RecvWr&) = 0;
  virtual QpEndpoint local_endpoint() const = 0;
  // Per-path counters of a connected QP (RTR or later), one entry per path
  // in path order: what a stream did on each route, for diagnosing
  // multipath (a path that loses, marks or was retired). A snapshot, copied
  // under the context's lock; thread-safe. The soft provider's in-process
  // engines only: unsupported in the engine daemon and on the verbs
  // provider (the NIC keeps no such counters); wrong_state before RTR.
  virtual Result<std::vector<PathCounters>> path_counters() const {
    return Status(Errc::unsupported, "path_counters: not available on this provider");
  }
};

class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual uint32_t lkey() const = 0;
  virtual uint32_t rkey() const = 0;
  virtual uint64_t addr() const = 0;
  virtual uint64_t length() const = 0;
  virtual uint32_t access() const = 0;
};

class ProtectionDomain {
 public:
  virtual ~ProtectionDomain() = default;
  // Registers [addr, addr+length). Keys are random, never sequential, and
  // unique within the PD's tenant. The memory must outlive the region.
  virtual Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length, uint32_t access) = 0;
  virtual Result<std::shared_ptr<QueuePair>> create_qp(const QpInitAttributes&) = 0;
  virtual const std::string& tenant() const = 0;
};

// A tenant: a principal with its own QP-number, key and partition spaces,
// a share of the transmit capacity and quotas (docs/scheduler.md). 0 in a
// quota means no limit.
struct TenantOptions {
  uint16_t pkey = 0;  // partition key on the wire; 0 picks a free one
  // Needed to use a tenant the tenants file defines (compared in constant
  // time). A tenant the file does not list is created with these options:
  // the process that creates it is its authority.
  std::string credential;
  uint32_t weight = 1;            // share of transmit capacity among tenants with traffic waiting
  uint64_t rate_bytes_per_s = 0;  // transmit rate limit; 0: none
  uint64_t burst_bytes = 0;       // its bucket depth; 0: max(64 KiB, 1 ms at the rate)
  uint32_t max_qps = 0;
  uint64_t max_registered_bytes = 0;
  uint32_t max_receive_wrs = 0;   // receive buffers posted and not yet completed, over all its QPs
  uint32_t max_send_wrs = 0;      // send work requests outstanding, over all its QPs
};

// Per tenant, and within it per (job, traffic class): what it sent and
// received, what was dropped and why, and how long its packets waited for
// the flow scheduler (Context::tenant_counters).
struct TrafficCounters {
  std::string job;
  uint8_t traffic_class = 0;
  uint32_t qps = 0;
  uint64_t tx_packets = 0, tx_bytes = 0, rx_packets = 0, rx_bytes = 0;
  uint64_t retransmitted_packets = 0;
  // Drops by reason (as in ContextCounters).
  uint64_t rx_dropped_malformed = 0, rx_dropped_out_of_window = 0, rx_dropped_bad_token = 0, rx_access_errors = 0;
  // Grants of the flow scheduler, and the time packets were due before one
  // came (queueing delay in the engine host).
  uint64_t scheduler_grants = 0, queue_delay_ns_total = 0, queue_delay_ns_max = 0;
};
struct TenantCounters {
  std::string tenant;
  uint16_t pkey = 0;
  uint32_t qps = 0;                 // QPs now
  uint64_t registered_bytes = 0;    // memory registered now
  uint32_t receive_wrs = 0, send_wrs = 0;  // outstanding now
  uint64_t quota_refusals = 0;      // requests refused with resource_exhausted
  uint64_t credential_refusals = 0; // uses refused with permission_denied (wrong or missing credential)
  std::vector<TrafficCounters> traffic;  // engines' counters, including QPs already destroyed
};

// Provider-wide counters: everything dropped or retransmitted is counted.
struct ContextCounters {
  uint64_t tx_packets = 0, tx_bytes = 0, rx_packets = 0, rx_bytes = 0;
  uint64_t retransmitted_packets = 0, timeouts = 0, tail_probes = 0;
  uint64_t rx_dropped_malformed = 0;      // truncated, bad checksum, bad opcode/version
  uint64_t rx_dropped_unknown_qp = 0;     // no QP with that number in that tenant
  uint64_t rx_dropped_out_of_window = 0;  // PSN outside the window
  uint64_t rx_dropped_bad_token = 0;      // stellar: not the connection's token (forged, or a stale connection)
  uint64_t rx_duplicates = 0;
  uint64_t rx_access_errors = 0;          // forged rkey, bounds, rights
  uint64_t rnr_naks_sent = 0;
  uint64_t rx_requests_dropped_full = 0;  // READ/atomic requests with no room at the responder: the requester retries
  uint64_t fault_dropped = 0, fault_duplicated = 0, fault_reordered = 0;
  uint64_t send_errors = 0;               // datagrams the kernel refused (e.g. ENOBUFS): lost, retransmitted
  uint64_t rx_receive_calls = 0;          // recvmmsg calls that returned data
  uint64_t rx_coalesced = 0;              // datagrams that arrived coalesced by UDP GRO
  // stellar: packets whose payload the kernel received straight into the
  // registered memory it was written to (ContextOptions::rx_placement), and
  // datagrams that were not the packets expected there (taken through a
  // receive buffer instead: a copy, nothing lost).
  uint64_t rx_placed = 0, rx_placement_misses = 0;
  // CPU time (user + system, ns) spent where the engines run outside the
  // calling threads: ProgressMode::thread, this context's engine thread;
  // ProgressMode::daemon, the whole stellar-engined process (every context it
  // serves). 0 inline: the engines run on the application's own threads.
  uint64_t engine_cpu_ns = 0;
  uint64_t daemon_refused_entries = 0;    // daemon: ring entries of this context it refused (malformed)
  // stellar: resends that proved unneeded (the original arrived late), and
  // paths taken out of use after losses in a row or a timeout (failover).
  uint64_t spurious_retransmits = 0, paths_retired = 0;
  // stellar: datagrams that arrived marked ECN CE (a queue on their path;
  // echoed to the sender, whose path choice avoids it).
  uint64_t rx_congestion_marks = 0;
  // stellar, address change (docs/multipath.md): peers' moves to a new
  // address accepted after it echoed our random challenge; challenges sent;
  // validations refused (a response that answers no challenge of ours, from
  // another address or with other bytes: a forged migration); datagrams
  // from an address under validation dropped beyond those held for after
  // it; this context's own moves (change_address, or following its address).
  uint64_t migrations = 0, path_challenges = 0, migrations_rejected = 0, migration_dropped = 0, address_changes = 0;
  // The latest of this context's moves: nanoseconds from its rebind to the
  // first acknowledgement a peer sent to the new address (the peer validated
  // it and answered). 0: no move yet, or no acknowledgement since.
  uint64_t last_address_change_ns = 0;
  // stellar, path MTU discovery (docs/wire-format.md, "Path MTU"): probes
  // sent; connections whose path carried less than the MTU both QPs agreed
  // on (they send smaller packets); connections whose sizing did not settle
  // within 1 s of work waiting (that work failed with retry_exceeded).
  uint64_t path_mtu_probes = 0, path_mtu_lowered = 0, path_mtu_failed = 0;
  // What the sizing cost: how long the first work posted to the latest
  // connection that had work waiting for its sizing waited, in nanoseconds
  // (0: none waited yet).
  uint64_t path_mtu_last_ns = 0;
  // Soft provider, WaitPolicy::adaptive: times CompletionQueue::wait slept
  // in the kernel (after spin_time with nothing received or sent).
  uint64_t wait_sleeps = 0;
  // Soft provider, ProgressMode::thread or daemon: times this process's
  // engine thread, or an empty CompletionQueue::poll, gave its core away
  // (sched_yield) because it or the engine thread had lately been
  // preempted: more busy threads than CPUs (e.g. two busy-polling processes
  // with an engine thread each on two CPUs). 0 while the CPUs suffice.
  uint64_t contention_yields = 0;
};

class Context : public std::enable_shared_from_this<Context> {
 public:
  // Opens a provider. verbs without an RDMA device fails with no_device.
  static Result<std::shared_ptr<Context>> open(const ContextOptions& = {});
  virtual ~Context() = default;

  // A tenant owns its own QP-number and memory-key spaces and partition key;
  // a packet or key of another tenant never matches. "" is the default tenant.
  // A tenant the tenants file lists needs its credential (options' other
  // fields are then the file's); permission_denied otherwise. Quotas refuse
  // with resource_exhausted. Weights and rate limits need the in-process
  // engine host (unsupported with ProgressMode::daemon and the verbs provider).
  virtual Status create_tenant(const std::string& name, const TenantOptions& = {}) = 0;
  virtual Result<std::shared_ptr<ProtectionDomain>> allocate_pd(const std::string& tenant = "") = 0;
  virtual Result<std::shared_ptr<CompletionQueue>> create_cq(uint32_t entries) = 0;

  // Drives the transport once (inline mode); a no-op with an engine thread.
  virtual void progress() = 0;
  // Sends now every acknowledgement the transport holds back hoping to
  // piggy-back it on data (at most ~10 us). With inline progress, call it
  // before pausing polling for a while, so that the peer's last sends
  // complete while this side is busy elsewhere. A no-op where hardware or an
  // engine thread acknowledges.
  virtual void flush_acknowledgements() = 0;
  // Readable when datagrams wait (inline mode: add it to epoll next to CQ fds).
  virtual int progress_fd() const = 0;
  virtual ContextCounters counters() const = 0;
  // Per tenant (and job and traffic class) counters; the soft provider
  // fills `traffic` (in-process and in the engine daemon), the verbs
  // provider only the tenant level.
  virtual std::vector<TenantCounters> tenant_counters() const = 0;
  // The options it was opened with (`wait` as opened: wait_policy() says
  // what applies now).
  virtual const ContextOptions& options() const = 0;
  // How CompletionQueue::wait (and, with ProgressMode::thread, the engine
  // thread) waits from now on: the communicator switches to adaptive when
  // more ranks share the host than there are CPUs (oversubscription).
  // Thread-safe; a wait in progress may finish under either policy. In the
  // daemon placement only this process's waits change: the daemon's shards
  // wait as stellar-engined --wait says.
  virtual void set_wait_policy(WaitPolicy) = 0;
  virtual WaitPolicy wait_policy() const = 0;
  // Address and port of the soft provider's UDP socket (they change when
  // the context moves).
  virtual std::string local_address() const = 0;
  virtual uint16_t local_port() const = 0;
  // Moves the context to another local IPv4 address (soft provider, stellar
  // mode): its sockets bind there (the same port when free) and every
  // connected QP carries on; each peer accepts the new address once it has
  // echoed a random challenge from there, and nothing is lost or delivered
  // twice. For an address that stays configured (a second interface);
  // ContextOptions::follow_address handles one that disappears. progress_fd
  // keeps its number, but an epoll set that holds it must add it again
  // (the kernel drops the old socket's registration). Moving to the
  // current address does nothing. Errors:
  // invalid_argument (not IPv4), io_error (cannot bind there), unsupported
  // (roce mode, the verbs provider, the engine daemon: it follows its
  // address itself). Thread-safe.
  virtual Status change_address(const std::string& address) = 0;
};

}  // namespace stellar

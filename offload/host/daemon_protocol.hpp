// The protocol between an application (RemoteHost) and stellar-engined.
//
// Two channels per application context:
//  - control: a Unix SOCK_SEQPACKET socket. One request, one reply, each a
//    single message: open the context (with the shared area's memfd and one
//    end of the "bell" socket pair attached), register and deregister
//    memory (keys and ranges),
//    attach and detach QPs, counters. The socket
//    is also how each side learns the other is gone (EOF / POLLHUP).
//  - data: two single-producer single-consumer rings in one shared memfd
//    (SharedArea): work requests application -> daemon, completions
//    daemon -> application. Posting and polling never make a system call
//    unless the other side announced it is asleep (then one datagram on the
//    bell pair). The bells are a Unix datagram socket pair, not eventfds:
//    the daemon sends and receives on them with MSG_DONTWAIT, so a client
//    that makes its end blocking (O_NONBLOCK is shared by everyone holding
//    the descriptor) or never reads cannot stall a daemon thread.
//
// Every message and ring entry is plain fixed-width data with its size
// asserted, so that an x86-64 application and an aarch64 daemon (a
// SmartNIC's cores) agree on the layout. Everything the daemon reads from a
// client, on the socket or in the rings, is hostile until checked: it copies
// an entry out of shared memory before looking at it, and refuses (and
// counts) what does not check out.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "host/host.hpp"
#include "stellar/offload/engine.hpp"

namespace stellar::host::daemon {

inline constexpr uint32_t protocol_magic = 0x53544c44;  // "STLD"
// 3: paths (multipath); 4: address-change counters; 5: traffic class;
// 6: tenant and credential in the open, job label in the attach;
// 7: loopback_unchecked in the attach (an older daemon would drop the
// unchecked packets the library's QPs agreed to); 8: size_path in the
// attach, path MTU counters in HostCounters (an older daemon would send at
// once while the peer holds its requests for the sizing)
inline constexpr uint32_t protocol_version = 8;
inline constexpr size_t max_message_bytes = 4096;
inline constexpr int max_message_fds = 2;  // the open's: shared area memfd, the daemon's end of the bell pair

enum class MessageType : uint32_t {
  open = 1,        // + fds: shared area memfd, the daemon's end of the bell pair (doorbells in, wake-ups out)
  register_memory,
  deregister_memory,
  attach,
  detach,
  enter_error,     // synchronous: the QP's work is flushed into the completion ring before the reply
  flush_acknowledgements,
  counters,
  flow_report,     // HandleRequest: `handle` is the row (tenant, job, class) asked for, from 0
  reply = 100,
};

struct MessageHeader {
  uint32_t type = 0;
  uint32_t length = 0;  // bytes of the whole message, header included
};
static_assert(sizeof(MessageHeader) == 8);

struct OpenRequest {
  MessageHeader h;
  uint32_t magic = protocol_magic;
  uint32_t version = protocol_version;
  char bind_address[16] = {};  // dotted IPv4, NUL-terminated
  uint16_t udp_port = 0;
  uint8_t mode = 0;            // offload::Mode
  uint8_t pad0 = 0;
  uint32_t mtu = 0;
  double drop = 0, duplicate = 0, reorder = 0;
  uint64_t seed = 0;
  uint32_t submit_capacity = 0, completion_capacity = 0;  // ring entries (powers of two)
  uint64_t area_bytes = 0;
  uint16_t paths = 1;          // UDP sockets (source ports) of the context, 1-256 (HostOptions::paths)
  uint16_t pad1[3] = {};
  // The tenant the context opens as, and its credential (NUL-terminated;
  // empty: none). A daemon with a tenants file (--tenants) serves only a
  // tenant it lists, with its credential; one without takes the name as a
  // label for sharing (docs/scheduler.md, "In the engine daemon").
  char tenant[264] = {};       // names and credentials up to 256 bytes (the tenants file's bound)
  char credential[264] = {};
};
static_assert(sizeof(OpenRequest) == 624);

// The daemon reads and writes registered memory in the registering process
// with process_vm_readv/writev (docs/engine-daemon.md, "Memory"): the
// request carries keys and the range, no memory.
struct RegisterRequest {
  MessageHeader h;
  uint32_t pd = 0, lkey = 0, rkey = 0, access = 0;
  uint64_t address = 0, length = 0;
};
static_assert(sizeof(RegisterRequest) == 40);

struct KeyRequest {  // deregister_memory
  MessageHeader h;
  uint32_t lkey = 0, pad = 0;  // keys are unique in a context, whatever their PD (the soft provider draws them so)
};

// The QP's engine configuration, field by field: only what the soft
// provider ever sets, each checked by the daemon (config_from); the rest
// stays at the engine's defaults.
struct AttachRequest {
  MessageHeader h;
  uint8_t mode = 0, cc = 0;
  uint16_t pkey = 0;
  uint32_t retry_count = 0, rnr_retry = 0;
  uint32_t mtu = 0, max_send_wr = 0, max_recv_wr = 0;
  uint32_t local_qpn = 0, remote_qpn = 0, send_psn = 0, receive_psn = 0;
  uint64_t local_token = 0, remote_token = 0;
  uint64_t rto_min_ns = 0, rto_max_ns = 0, line_rate_bps = 0, swift_target_delay_ns = 0;
  uint32_t peer_address = 0;  // network order
  uint16_t peer_port = 0;     // network order
  uint16_t paths = 1;         // EngineConfig::paths, 1-256
  uint32_t pd = 0, access = 0;
  uint8_t path_policy = 0;    // offload::PathPolicy
  // The QP's traffic class (0-7) and its DSCP (0-63, docs/scheduler.md):
  // the class orders its packets among the context's QPs, the DSCP marks them.
  uint8_t traffic_class = 0, dscp = 0;
  uint8_t loopback_unchecked = 0;  // EngineConfig::loopback_unchecked (0 or 1)
  uint8_t size_path = 0;           // EngineConfig::size_path (0 or 1)
  uint8_t pad3[3] = {};
  // The QP's job (JobHints: up to 128 bytes, NUL-terminated), its weight
  // among the tenant's jobs and its step (up to 24 h): the scheduler's
  // label (host::FlowLabel) beside the class.
  char job[136] = {};
  uint64_t step_period_ns = 0, deadline_ns = 0;
  uint32_t job_weight = 1, pad4 = 0;
};
static_assert(sizeof(AttachRequest) == 280);

AttachRequest attach_request(const offload::EngineConfig&);
// The engine configuration of an attach request, if every field is one the
// soft provider could have built with a session of `session_mtu`; else an
// error message in `error`.
bool config_from(const AttachRequest&, uint32_t session_mtu, offload::EngineConfig& out, std::string& error);

struct HandleRequest {  // detach, enter_error
  MessageHeader h;
  uint32_t handle = 0, pad = 0;
};

// Reply::denied.
enum Refusal : uint32_t {
  refused_other = 0,
  refused_user = 1,    // the client's uid/gid is not on the allow-list
  refused_tenant = 2,  // tenant not listed, or a wrong or missing credential
  refused_quota = 3,   // the tenant's quota (QPs, registered bytes, work requests)
};

struct Reply {
  MessageHeader h;
  int32_t ok = 0;          // 1: success
  uint32_t handle = 0;     // attach: the engine's handle
  uint32_t local_address = 0;  // open: the UDP socket (network order)
  uint16_t local_port = 0;
  uint8_t gso = 0, gro = 0;
  uint32_t daemon_pid = 0;
  uint32_t sessions = 0;    // counters: contexts the daemon serves now (this one included)
  uint32_t engines = 0;     // counters: QPs attached across all of them
  uint32_t denied = 0;      // !ok: why, when it is one of `Refusal`
  uint32_t tenant_pkey = 0; // open, with the daemon's tenants file: the tenant's partition key
  HostCounters counters{};  // counters: this context's
  // enter_error: completions the daemon has produced for this context so
  // far (ring and overflow), the flushed ones included: the client has
  // seen them all once its completion head reaches this.
  uint64_t completions_produced = 0;
  // flow_report: the rows there are, and row `handle`'s class and waits
  // (its counters in `counters.engines`, its engines in `engines`, its job
  // in `message`).
  uint32_t rows = 0;
  uint32_t traffic_class = 0;
  FlowWaits waits{};
  char message[512] = {};   // !ok: why
};

// ---- shared area: header, then the two rings ----

inline constexpr size_t cache_line = 64;

enum class EntryKind : uint32_t { post_send = 1, post_receive };

struct WireSegment {
  uint64_t address = 0;  // application address
  uint32_t length = 0;
  uint32_t lkey = 0;
};
static_assert(sizeof(WireSegment) == 16);

// A work request, application -> daemon. Five cache lines.
struct alignas(cache_line) SubmitEntry {
  uint32_t kind = 0;
  uint32_t handle = 0;
  uint64_t wr_id = 0;
  uint8_t opcode = 0, signaled = 0, solicited = 0, inline_data = 0;
  uint32_t count = 0;  // segments, or inline bytes
  uint64_t remote_addr = 0;
  uint32_t rkey = 0, imm = 0;
  uint64_t compare_add = 0, swap = 0;
  union {
    WireSegment segments[offload::max_segments];
    uint8_t inline_bytes[offload::max_inline_bytes];
  };
  SubmitEntry() : segments{} {}
};
static_assert(sizeof(SubmitEntry) == 320);

// A completion, daemon -> application. Half a cache line.
struct CompletionEntry {
  uint32_t handle = 0;
  uint8_t status = 0, opcode = 0, has_imm = 0, pad = 0;
  uint64_t wr_id = 0;
  uint32_t byte_length = 0, imm = 0;
  uint32_t qp_number = 0, pad2 = 0;
};
static_assert(sizeof(CompletionEntry) == 32);

// Indices count entries ever produced / consumed (never wrap in practice);
// each on its own cache line, written by one side only.
struct alignas(cache_line) Index {
  std::atomic<uint64_t> value{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct SharedArea {
  uint32_t magic = protocol_magic, version = protocol_version;
  uint32_t submit_capacity = 0, completion_capacity = 0;
  Index submit_tail;      // application writes
  Index submit_head;      // daemon writes
  Index completion_tail;  // daemon writes
  Index completion_head;  // application writes
  Index daemon_sleeping;  // daemon: 1 while it may sleep (then a post rings the doorbell)
  Index client_waiting;   // application: threads that may sleep for completions (then the daemon writes the wake fd)
  Index client_events;    // application: 1 once someone waits on the wake fd outside sleep_until_work
                          // (an epoll loop): the daemon writes it after every batch of completions
};

inline size_t submit_offset() { return (sizeof(SharedArea) + 4095) & ~size_t(4095); }
inline size_t completion_offset(uint32_t submit_capacity) { return submit_offset() + size_t(submit_capacity) * sizeof(SubmitEntry); }
inline size_t area_bytes(uint32_t submit_capacity, uint32_t completion_capacity) {
  return (completion_offset(submit_capacity) + size_t(completion_capacity) * sizeof(CompletionEntry) + 4095) & ~size_t(4095);
}
inline SubmitEntry* submit_ring(void* area) { return reinterpret_cast<SubmitEntry*>(static_cast<uint8_t*>(area) + submit_offset()); }
inline CompletionEntry* completion_ring(void* area, uint32_t submit_capacity) {
  return reinterpret_cast<CompletionEntry*>(static_cast<uint8_t*>(area) + completion_offset(submit_capacity));
}

// ---- the control socket ----

// Sends one message with `fds` attached (SCM_RIGHTS). False on failure.
// `flags` adds to MSG_NOSIGNAL (the daemon passes MSG_DONTWAIT: a client
// that does not read its replies is dropped, not waited for).
bool send_message(int socket, const void* data, size_t length, const int* fds = nullptr, int fd_count = 0, int flags = 0);
// Receives one message into `buffer` (at most `capacity` bytes) and up to
// `max_fds` descriptors (the rest are closed). Returns the bytes received, 0
// on EOF, -1 on error or on a message larger than `capacity` (its fds
// closed). Waits at most `timeout_ms` (-1: forever) for it.
long receive_message(int socket, void* buffer, size_t capacity, std::vector<int>& fds, int max_fds, int timeout_ms);


}  // namespace stellar::host::daemon

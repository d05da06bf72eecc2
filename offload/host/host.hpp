// What the application side of the soft provider reaches engines through:
// one interface, three placements (docs/design.md, "Engine placement").
//
//   inline  EngineHost in the application, progressed by the caller's poll
//   thread  EngineHost in the application, progressed by its engine thread
//   daemon  RemoteHost: the EngineHost runs in stellar-engined (offload/daemon),
//           reached over a Unix socket (control) and shared-memory rings (data)
//
// The placement decides only where the host runs and how the API side talks
// to it; the engines, the socket, the timers and the progress loop are the
// same code (EngineHost) in all three.
//
// Locking: as EngineHost's. Members marked "locked" expect the caller to hold
// the application side's mutex (the one the host was constructed with).
#pragma once

#include <netinet/in.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "host/fault_filter.hpp"
#include "host/flow_scheduler.hpp"
#include "host/udp_socket.hpp"
#include "stellar/offload/engine.hpp"

namespace stellar::host {

// CLOCK_MONOTONIC in nanoseconds: the clock engines run on.
uint64_t monotonic_ns();
// A kernel receive stamp (SO_TIMESTAMPNS: CLOCK_REALTIME ns, 0 = none) on
// the engines' clock, given CLOCK_REALTIME - CLOCK_MONOTONIC (`offset`, ns)
// taken a while ago and `now` (MONOTONIC ns). 0 (no estimate) without a
// stamp, or when the result is more than 1 s from `now`: CLOCK_REALTIME
// stepped since the offset was taken. May be a little later than `now`
// when `now` was read before the receive call; engines take that as no wait.
uint64_t arrival_from_stamp(uint64_t stamp, int64_t offset, uint64_t now);

struct HostOptions {
  std::string bind_address = "127.0.0.1";
  uint16_t udp_port = 0;  // 0: any free port (roce mode tries 4791 first)
  offload::Mode mode = offload::Mode::stellar;
  uint32_t mtu = 4096;    // payload bytes per packet (sizes the batches)
  // stellar mode: UDP sockets the host sends from, one source port each
  // (path i of an engine leaves from socket i % paths); everything is
  // received on the first. roce mode: 1.
  uint16_t paths = 1;
  FaultOptions faults;
  // stellar mode: when the bound address disappears (a send fails, or the
  // kernel reports an address change), rebind to the address the kernel now
  // sends from toward the peers (docs/multipath.md, "Address change").
  bool follow_address = true;
  // stellar mode: receive a streaming WRITE's payload into its place
  // (EngineHost, "direct placement"; docs/wire-format.md).
  bool rx_placement = true;
  // The rate (bytes/s) the flow scheduler shapes transmissions to; 0: none
  // (docs/scheduler.md).
  uint64_t tx_rate_bytes_per_s = 0;
  bool engine_thread = false;  // progress on a thread of the host's (else the caller's)
  bool adaptive_wait = false;  // the thread sleeps after spinning `spin_ns` without work
  uint64_t spin_ns = 0;
  std::string daemon_socket;   // RemoteHost: the daemon's Unix socket
  // RemoteHost: the tenant the context opens as and its credential, for a
  // daemon that holds the tenants file (stellar-engined --tenants).
  std::string tenant, credential;
};

struct HostCounters {
  offload::EngineCounters engines;  // attached engines and every detached one
  uint64_t malformed = 0;           // too short for a destination
  uint64_t unknown_qp = 0;          // no engine at (pkey, QPN), or not from its peer
  uint64_t send_errors = 0, receive_calls = 0, coalesced = 0;
  // Direct placement: packets whose payload the kernel wrote straight into
  // registered memory, and datagrams that turned out not to be the packets
  // expected (put back together in a receive buffer and taken from there).
  uint64_t placed = 0, placement_misses = 0;
  FaultCounters faults;
  // Address change (stellar mode, docs/multipath.md): peers' moves validated
  // (a challenge echoed from the new address), challenges sent, validations
  // refused (a response that answers no challenge of ours, from the wrong
  // address, or with the wrong bytes: a forged migration), datagrams from a
  // new address dropped while it was being validated (beyond those held for
  // after it), and this host's own moves (rebinds).
  uint64_t migrations = 0, path_challenges = 0, migrations_rejected = 0, migration_dropped = 0, rebinds = 0;
  // The latest rebind: ns from it to the first acknowledgement a peer sent
  // to the new address (0: no rebind, or no acknowledgement yet).
  uint64_t last_move_ns = 0;
  // Path MTU discovery (stellar mode; docs/wire-format.md, "Path MTU"):
  // probes sent (padded and unpadded, decisions included), connections
  // whose path carried less than the MTU both QPs agreed on (they send
  // smaller packets), and connections whose sizing did not finish in time
  // with work waiting (that work failed with retry_exceeded).
  uint64_t path_mtu_probes = 0, path_mtu_lowered = 0, path_mtu_failed = 0;
  // How long the first work posted to the latest connection that had work
  // waiting for its sizing waited (ns; 0: none waited yet).
  uint64_t path_mtu_last_ns = 0;
  // Daemon placement only: ring entries the daemon refused (forged handles,
  // bad segments).
  uint64_t refused_entries = 0;
  // CPU time (user + system, ns) where the engines run off the caller's
  // threads: the engine thread's, or the daemon process's. 0 inline.
  uint64_t engine_cpu_ns = 0;
};

// What the host calls back on the application side, under the lock.
class HostClient {
 public:
  virtual ~HostClient() = default;
  // At the start of every progress round: application-side work that feeds
  // engines or drains completions (GPU staging, held completions).
  virtual void on_progress_locked(uint64_t now_ns) = 0;
  // When that work wants to run again without new input; UINT64_MAX: never.
  virtual uint64_t next_wakeup_locked(uint64_t now_ns) = 0;
};

// A registered memory region as the daemon needs it to resolve keys itself
// (the in-process host resolves them through the QP's MemoryAccess instead).
struct MemoryRegistration {
  uint32_t pd = 0;  // the application side's protection-domain id
  uint32_t lkey = 0, rkey = 0;
  uint32_t access = 0;  // offload::access_* bits
  uint64_t address = 0, length = 0;
};

// What the daemon needs of a QP to check remote access the way the
// application side's SoftQp::resolve does.
struct QpBinding {
  uint32_t pd = 0;
  uint32_t access = 0;  // the QP's remote access flags (modify to INIT)
  // The flow scheduler's label of the QP's traffic (tenant, job, class) and
  // the DSCP (0-63) its packets carry (docs/scheduler.md).
  FlowLabel label;
  uint8_t dscp = 0;
};

// Per (tenant, job, traffic class): engines' counters (detached ones
// included) and the scheduler's waits.
struct FlowReport {
  FlowLabel label;
  uint32_t engines = 0;  // attached now
  offload::EngineCounters counters;
  FlowWaits waits;
};

class Host {
 public:
  struct Engine {  // one attached engine: an opaque handle
    virtual ~Engine() = default;
  };

  virtual ~Host() = default;

  // Opens the socket (or attaches to the daemon); nullopt on success.
  virtual std::optional<SocketError> open(const HostOptions&) = 0;
  // Starts the engine thread when HostOptions::engine_thread asks for one.
  virtual void start() = 0;
  // Stops and joins the engine thread (idempotent; without the lock).
  virtual void stop() = 0;

  // Readable when there is progress to make (datagrams, or completions from
  // the daemon).
  virtual int fd() const = 0;
  // The address and port peers send to. It changes when the host moves
  // (rebind_locked, HostOptions::follow_address): safe to call from any thread.
  virtual sockaddr_in local() const = 0;
  virtual bool gso() const = 0;
  virtual bool gro() const = 0;
  virtual const char* placement() const = 0;  // "inline", "engine-thread", "daemon"

  // ---- under the lock ----
  // Memory the daemon may touch; the in-process host needs nothing (the QP
  // resolves keys). An error message on failure.
  virtual std::optional<std::string> register_memory_locked(const MemoryRegistration&) { return std::nullopt; }
  virtual void deregister_memory_locked(uint32_t /*lkey*/) {}

  // Creates the engine of QP `qpn` in partition `pkey`, talking to `peer`
  // (the host fills the config's ICRC addresses); datagrams for (pkey, qpn)
  // from `peer` go to it from now on. The references must outlive it.
  // nullptr, with `error` set, if it cannot (the daemon is gone).
  virtual Engine* attach_locked(const offload::EngineConfig&, const sockaddr_in& peer, const QpBinding&,
                                offload::MemoryAccess&, offload::CompletionSink&, std::string& error) = 0;
  // Sends its held-back acknowledgement, keeps its counters, destroys it.
  virtual void detach_locked(Engine*) = 0;
  virtual offload::PostResult post_send_locked(Engine*, const offload::SendWork&, uint64_t now_ns) = 0;
  virtual offload::PostResult post_receive_locked(Engine*, const offload::ReceiveWork&) = 0;
  virtual bool set_ready_locked(Engine*, uint64_t wr_id, uint32_t bytes) = 0;  // QpEngine::set_ready
  virtual void enter_error_locked(Engine*) = 0;
  virtual bool in_error_locked(const Engine*) const = 0;
  // Work requests posted and not yet completed (the daemon placement counts
  // an unsignaled send until a later completion shows it done, as verbs do).
  virtual uint32_t outstanding_sends_locked(const Engine*) const = 0;
  virtual uint32_t outstanding_receives_locked(const Engine*) const = 0;
  // One path's state (QpEngine::path_info); false past the last path, or
  // where the placement cannot read the engine (the daemon's).
  virtual bool path_info_locked(const Engine*, uint16_t /*path*/, offload::PathInfo&) const { return false; }
  virtual bool has_path_info() const { return false; }
  // Work was posted to `engine`: inline progress transmits it now, the
  // engine thread or the daemon is woken.
  virtual void posted_locked(Engine*, uint64_t now_ns) = 0;

  // Receive, run timers, transmit (or: take the daemon's completions).
  // True if anything happened.
  virtual bool progress_locked(uint64_t now_ns) = 0;
  // Every engine sends its held-back acknowledgement now.
  virtual void flush_acknowledgements_locked(uint64_t now_ns) = 0;
  // The earliest timer across engines and the client; UINT64_MAX: none.
  virtual uint64_t next_wakeup_locked(uint64_t now_ns) = 0;
  virtual HostCounters counters_locked() const = 0;
  // The last failed request (registration, attach) passed the tenant's
  // quota in the engine daemon (its tenants file), not a local check.
  virtual bool quota_refused_locked() const { return false; }
  // The partition key of the tenant the context opened as, when the engine
  // daemon's tenants file assigns it (the daemon refuses QPs with another);
  // 0: the application assigns its keys.
  virtual uint16_t tenant_pkey() const { return 0; }
  // The flow scheduler's share of a tenant (weight, rate limit); false where
  // the placement has no scheduler for this application's tenants (the
  // daemon).
  virtual bool set_tenant_share_locked(const std::string& /*tenant*/, const TenantShare&) { return false; }
  // Per (tenant, job, class); empty where the placement does not report it.
  virtual std::vector<FlowReport> flow_report_locked() const { return {}; }
  // stellar mode: moves this host to `address` (IPv4 text): its sockets bind
  // there (the same port if free), and every connection carries on from it
  // once the peer has validated it. An error message if it cannot (roce
  // mode, which names connections by address; the address is not local).
  virtual std::optional<std::string> rebind_locked(const std::string& address, uint64_t now_ns) = 0;

  // ---- without the lock ----
  // Wakes the engine thread (or a sleep_until_work).
  virtual void kick() = 0;
  // The engine thread's wait from now on (HostOptions::adaptive_wait).
  virtual void set_adaptive_wait(bool) {}
  // The engine thread was preempted lately (ContentionDetector): more
  // threads want to run than there are CPUs, so busy threads of this
  // process give their core away when idle instead of spinning through the
  // others' time slices. Always false without an engine thread. Thread-safe.
  virtual bool contended(uint64_t /*now_ns*/) const { return false; }
  // Times the engine thread gave its core away so (ContextCounters::contention_yields).
  virtual uint64_t contention_yields() const { return 0; }
  // Blocks in the kernel until there is progress to make, a kick, `extra_fd`
  // is readable, or the next timer (at most until `limit_ns`).
  virtual void sleep_until_work(uint64_t limit_ns, int extra_fd) = 0;
};

}  // namespace stellar::host

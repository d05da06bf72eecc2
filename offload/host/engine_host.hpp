// The engine host: runs offload engines (QpEngine) on a UDP socket. It owns
// the socket and the fault filter in front of it, the receive and transmit
// batches, the dispatch of received datagrams to engines by (pkey, QPN), the
// timers (the next wake-up across engines), the progress rounds, and the
// engine thread of ProgressMode::thread (busy-poll, or spin then sleep in
// ppoll on the socket and a kick eventfd).
//
// The application side (the soft provider's context, PDs, MRs, CQs and QPs,
// tenants and keys, GPU staging) reaches engines only through this class:
// attach/detach an engine, post work, say that work was posted, progress,
// wait, counters. Each call is one message's worth of arguments in plain and
// offload types, so that the same interface can later be carried over
// shared-memory rings to an engine daemon (docs/design.md, "Layering").
// The engine's MemoryAccess and CompletionSink stay the application's.
//
// No dependency on src/: it builds into stellar_offload.
//
// Locking: the host does not own the lock; it is given the application
// side's mutex (the soft provider's context mutex, which also guards
// tenants and memory tables). Members marked "locked" expect the caller to
// hold it; the engine thread takes it once per progress batch. kick(),
// sleep_until_work() and the socket's identity need no lock.
#pragma once

#include <netinet/in.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "host/contention.hpp"
#include "host/fault_filter.hpp"
#include "host/host.hpp"
#include "host/udp_socket.hpp"
#include "stellar/offload/engine.hpp"

namespace stellar::host {

// Adds the counters of `e` to `sum`.
void accumulate(offload::EngineCounters& sum, const offload::EngineCounters& e);

class EngineHost final : public Host {
 public:
  struct Engine;  // one attached engine

  EngineHost(std::mutex& lock, HostClient& client);
  ~EngineHost() override;  // stops the engine thread
  EngineHost(const EngineHost&) = delete;
  EngineHost& operator=(const EngineHost&) = delete;

  // Host's members, as documented there.
  std::optional<SocketError> open(const HostOptions&) override;
  void start() override;
  void stop() override;

  int fd() const override { return socket_.fd(); }  // readable when datagrams wait
  sockaddr_in local() const override {
    std::lock_guard guard(local_lock_);
    return local_;
  }
  bool gso() const override { return socket_.gso(); }
  bool gro() const override { return socket_.gro(); }
  const char* placement() const override { return options_.engine_thread ? "engine-thread" : "inline"; }
  const HostOptions& options() const { return options_; }

  // ---- under the lock ----
  Host::Engine* attach_locked(const offload::EngineConfig&, const sockaddr_in& peer, const QpBinding&, offload::MemoryAccess&,
                              offload::CompletionSink&, std::string& error) override;
  void detach_locked(Host::Engine*) override;
  offload::PostResult post_send_locked(Host::Engine*, const offload::SendWork&, uint64_t now_ns) override;
  offload::PostResult post_receive_locked(Host::Engine*, const offload::ReceiveWork&) override;
  bool set_ready_locked(Host::Engine*, uint64_t wr_id, uint32_t bytes) override;
  void enter_error_locked(Host::Engine*) override;
  bool in_error_locked(const Host::Engine*) const override;
  uint32_t outstanding_sends_locked(const Host::Engine*) const override;
  bool path_info_locked(const Host::Engine*, uint16_t path, offload::PathInfo&) const override;
  bool has_path_info() const override { return true; }
  uint32_t outstanding_receives_locked(const Host::Engine*) const override;
  void posted_locked(Host::Engine*, uint64_t now_ns) override;

  bool progress_locked(uint64_t now_ns) override;
  void flush_acknowledgements_locked(uint64_t now_ns) override;
  uint64_t next_wakeup_locked(uint64_t now_ns) override;
  HostCounters counters_locked() const override;
  bool set_tenant_share_locked(const std::string& tenant, const TenantShare&) override;
  std::vector<FlowReport> flow_report_locked() const override;
  std::optional<std::string> rebind_locked(const std::string& address, uint64_t now_ns) override;

  // Orders this host's packets with `shared` (the engine daemon: one per
  // shard, across its contexts) instead of a scheduler of its own; the
  // sharer sets the link rate and tenants' shares there. Before the first
  // attach, under the lock.
  void use_scheduler_locked(std::shared_ptr<SharedScheduler> shared);
  // Transmits for this host's flows while one of them is next in the
  // scheduler's order (what a progress round does after receiving); the
  // sharer calls it on the host that owns the next flow. True if anything went.
  bool serve_scheduled_locked(uint64_t now_ns) {
    bool more = false;
    return serve_locked(now_ns, more);
  }
  // Takes this host's flows out of the scheduler's queue (its owner is
  // going and will not serve them); they queue again when due.
  void withdraw_locked(uint64_t now_ns);

  // ---- without the lock ----
  void kick() override;
  void set_adaptive_wait(bool adaptive) override {
    adaptive_wait_.store(adaptive, std::memory_order_relaxed);
    kick();  // a thread asleep under the old policy wakes to the new one
  }
  // Takes the lock to read the timers.
  void sleep_until_work(uint64_t limit_ns, int extra_fd) override;
  bool contended(uint64_t now_ns) const override { return contention_.contended(now_ns); }
  uint64_t contention_yields() const override { return contention_yields_.load(std::memory_order_relaxed); }

 private:
  // One round of progress_locked: receive, then flush what engines have
  // due; `more` says an engine still has datagrams due after its flush (a
  // capped burst of READ responses in roce mode).
  bool progress_round_locked(uint64_t now_ns, bool& more);
  size_t flush_engine(Engine&, uint64_t now_ns);
  // Transmits for the flows the scheduler grants, in its order (strict
  // priority for control, then weighted fair shares, within the token
  // buckets); `more` when the round's cap stopped it or a flow's burst cap
  // (roce READ responses) wants a receive in between. True if anything went.
  bool serve_locked(uint64_t now_ns, bool& more);
  void send_datagrams(size_t n, const sockaddr_in& peer, uint8_t tos = 0);
  // The socket an engine's path index leaves from (index modulo the sockets).
  UdpSocket& path_socket(uint16_t path);
  void engine_thread();

  // ---- address change (stellar mode; docs/multipath.md, "Address change") ----
  // A path_challenge or path_response for engine `e` from `from`.
  void on_path_validation(Engine& e, const sockaddr_in& from, const uint8_t* data, uint32_t length, uint64_t now);
  // A datagram for `e` from an address other than its peer's: held, and the
  // address challenged; nothing reaches the engine until it is validated.
  void on_unvalidated(Engine& e, const sockaddr_in& from, const uint8_t* data, uint32_t length, uint64_t now,
                      uint64_t arrival, bool congestion_mark);
  void send_challenge(Engine& e, uint64_t now);
  // Challenges again whose answer is overdue (and gives up after a few),
  // and repeats a moved host's announcement until its peer is heard.
  void address_timers_locked(uint64_t now);
  void send_validation(const Engine& e, const sockaddr_in& to, uint8_t opcode, uint64_t challenge);

  // ---- path MTU discovery (stellar mode; docs/wire-format.md, "Path MTU") ----
  // At attach: whether `e` sizes its path, and its role; holds its requests.
  void start_sizing(Engine& e, uint64_t now);
  // A path_size or path_size_ack for `e` from `from`.
  // `arrival`: when the kernel received it (0: unknown).
  void on_path_sizing(Engine& e, const sockaddr_in& from, const uint8_t* data, uint32_t length, uint64_t now,
                      uint64_t arrival);
  // The leader's next round: probes, or its decision again.
  void sizing_round(Engine& e, uint64_t now);
  // The leader settled on `size`: applies it and tells the follower.
  void decide_size(Engine& e, uint32_t size, uint64_t now);
  // Sizing is over for `e`: its requests go.
  void finish_sizing(Engine& e, uint64_t now);
  // One sizing message on `path` (the socket its data would leave from),
  // padded to `datagram_bytes` when that is more than its header.
  void send_sizing(const Engine& e, uint16_t path, uint8_t opcode, uint64_t nonce, uint32_t size, bool set,
                   uint32_t datagram_bytes);
  // Rounds and time limits of the engines sizing their paths.
  void sizing_timers_locked(uint64_t now);
  // Sends failed as they do when the bound address is gone, or the kernel
  // reported an address change: if our address is gone, rebind to the one
  // the kernel now sends from toward a peer.
  void follow_address_locked(uint64_t now);
  // Each segment of a received datagram from byte `from` on, to its engine.
  void deliver_datagram(const Datagram& d, uint32_t from, uint64_t now, uint64_t arrival);
  // A datagram from e's peer reached it (the peer knows where we are).
  void heard_from(Engine& e, const uint8_t* data, uint64_t arrival);
  // Direct placement (see engine_host.cpp): after e took a packet, whether
  // its WRITE's next packets are expected here; one datagram received into
  // place (none: the socket was empty; gave_up: nothing expected any more).
  void note_expectation(Engine& e);
  // `taken`: how many datagrams the receive took.
  enum class Placed { none, some, gave_up };
  Placed receive_into_place(uint64_t now, int& taken);
  // Packets one receive into place lays out (3 iovecs each): in one
  // datagram when GRO coalesces them (64 KiB holds 49 of 1280 bytes), else
  // one per datagram, all in one recvmmsg.
  static constexpr uint32_t max_placed_segments = 64;
  static constexpr uint32_t max_placed_datagrams = uint32_t(UdpSocket::max_scattered_batch);
  static constexpr uint32_t max_placed = max_placed_segments;
  static_assert(3 * max_placed_segments <= uint32_t(UdpSocket::max_scatter) && max_placed_datagrams <= max_placed);
  // Reads the kernel's address notifications (rate-limited by `now`, the
  // round's clock: no clock read of its own); true if any came.
  bool address_changes(uint64_t now);
  // CLOCK_REALTIME - CLOCK_MONOTONIC, for turning the kernel's arrival
  // stamps (REALTIME) into the engine's clock without two clock reads per
  // receive batch; refreshed every realtime_refresh_ns of `now`.
  int64_t realtime_offset(uint64_t now);
  static constexpr uint64_t realtime_refresh_ns = 50'000'000;

  static constexpr int rx_batch = 32;  // datagrams per receive call
  static constexpr int tx_batch = 64;  // datagrams per transmit pass (and per sendmmsg)
  static_assert(rx_batch <= UdpSocket::max_batch && tx_batch <= UdpSocket::max_batch,
                "the socket fills and sends at most UdpSocket::max_batch datagrams per call");
  static_assert(uint32_t(rx_batch) >= max_placed_datagrams, "a receive into place uses rx_'s datagrams");

  std::mutex& lock_;
  HostClient& client_;
  HostOptions options_;
  UdpSocket socket_;  // path 0: sends, and receives for every path
  // Paths 1..HostOptions::paths-1: send-only sockets on ports of their own
  // (each source port an entropy value ECMP hashes onto a route). Replies
  // come to socket_'s port.
  std::vector<std::unique_ptr<UdpSocket>> paths_;
  std::unique_ptr<FaultFilter> filter_;
  int kick_fd_ = -1;
  std::unordered_map<uint64_t, std::unique_ptr<Engine>> engines_;  // (pkey << 32 | qpn)
  // deliver_datagram's last find in engines_ (cleared by attach and detach).
  uint64_t last_key_ = 0;
  Engine* last_engine_ = nullptr;
  offload::EngineCounters retired_{};  // counters of detached engines
  // The flow scheduler, under its own lock (taken inside lock_): this
  // host's, or shared with other hosts (use_scheduler_locked).
  std::shared_ptr<SharedScheduler> scheduling_ = std::make_shared<SharedScheduler>();
  FlowScheduler& sched() const { return scheduling_->scheduler; }
  // The scheduler's lock, needed only while it is shared with other hosts
  // (each under its own context mutex); a host's own scheduler is already
  // guarded by the context mutex every *_locked caller holds, and taking a
  // second lock twice per busy-poll round cost cycles on the latency path.
  std::unique_lock<std::mutex> hold_scheduler() const {
    return shared_scheduler_ ? std::unique_lock(scheduling_->lock) : std::unique_lock<std::mutex>();
  }
  bool shared_scheduler_ = false;
  std::vector<Engine*> flow_engines_;  // by FlowScheduler::Flow
  // Detached engines' counters and waits, by "tenant\0job\0class".
  std::unordered_map<std::string, FlowReport> retired_flows_;
  // The receive and send buffers (6 MB at loopback's MTU): anonymous
  // memory, zero and faulted in a page at a time as datagrams use it. A
  // zero-filled vector touched every page at open, 4 ms an open on a
  // guest with dear page faults, most of them pages a ping-pong never uses.
  struct LazyMemory {
    uint8_t* data = nullptr;
    size_t size = 0;
    LazyMemory() = default;
    LazyMemory(const LazyMemory&) = delete;
    LazyMemory& operator=(const LazyMemory&) = delete;
    ~LazyMemory() { reset(0); }
    bool reset(size_t bytes);  // false: mmap failed (nothing held)
  };
  LazyMemory rx_memory_, tx_memory_;
  Datagram rx_[rx_batch];
  offload::TxBuffer tx_[tx_batch];
  iovec tx_parts_[tx_batch][offload::max_segments + 2];
  Datagram out_[tx_batch];
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> adaptive_wait_{false};  // options_.adaptive_wait, changeable while the thread runs
  ContentionDetector contention_;  // the engine thread's own preemptions
  std::atomic<uint64_t> contention_yields_{0};
  uint64_t malformed_ = 0, unknown_qp_ = 0, send_errors_ = 0, receive_calls_ = 0, coalesced_ = 0;
  uint64_t placed_ = 0, placement_misses_ = 0;
  Engine* expecting_ = nullptr;  // direct placement: whose WRITE the next datagrams likely continue
  // Engines holding an acknowledgement they put off (EngineConfig::
  // defer_piggybacked_acks), each with the progress call that took it
  // (progress_calls_ then): taken once the reply it made way for is sent
  // (posted_locked), at the end of a later progress call, or before the
  // host sleeps or flushes.
  struct Deferred {
    Engine* engine;
    uint64_t call;
  };
  std::vector<Deferred> deferred_;
  uint64_t progress_calls_ = 0;
  void note_deferred(Engine& e);
  void settle_deferred(uint64_t before_call);  // those taken in calls before this one
  bool placing_coalesced_ = false;  // the last receive into place found GRO's runs: lay out one datagram
  // Datagrams the next receive into place lays out when not coalesced:
  // halved after a batch with a miss (every datagram after a loss or an
  // acknowledgement lands one place off and is copied twice), doubled after
  // a batch that came whole.
  uint32_t place_batch_ = max_placed_datagrams;
  // Receives left that take one datagram (UdpSocket::receive_first) to find
  // where a WRITE starts before its rest is queued into receive buffers:
  // probe_budget after a batch copied packets that could have been placed,
  // or after a probe found a WRITE; each probe that found none spends one.
  static constexpr uint32_t probe_budget = 8;
  uint32_t probes_left_ = 0;
  bool expecting_placeable() const;
  uint64_t probes_ = 0;
  // A laid-out packet's header: a middle packet's, or (the message's last
  // packet) one with room for an immediate.
  static constexpr uint32_t placed_header_room = offload::stellar_write_header_bytes + 4;
  uint8_t placed_headers_[max_placed][placed_header_room];
  uint32_t placed_header_bytes_[max_placed] = {};
  uint8_t placed_trailers_[max_placed][4];
  uint8_t* placed_at_[max_placed] = {};
  uint64_t migrations_ = 0, path_challenges_ = 0, migrations_rejected_ = 0, migration_dropped_ = 0, rebinds_ = 0;
  uint64_t mtu_probes_ = 0, mtu_lowered_ = 0, mtu_failed_ = 0, mtu_last_ns_ = 0;  // HostCounters::path_mtu_*
  uint32_t sizing_engines_ = 0;  // engines whose path sizing is under way
  uint64_t sizing_due_ = 0;      // sizing_timers_locked's next run
  std::vector<uint8_t> sizing_buffer_;  // a padded probe (payload: zeros)
  // A copy of socket_.local() for readers without the lock (the socket
  // changes it only under the lock, when the host moves).
  mutable std::mutex local_lock_;
  sockaddr_in local_{};
  int netlink_fd_ = -1;           // RTMGRP_IPV4_IFADDR notifications (follow_address)
  uint64_t netlink_checked_ = 0;  // when it was last read
  int64_t realtime_offset_ = 0;   // realtime_offset()'s cached value
  uint64_t realtime_offset_at_ = 0;  // the `now` it was taken at (0: never)
  uint64_t follow_checked_ = 0;   // when follow_address_locked last looked
  uint64_t follow_logged_ = 0;    // when a failed rebind was last reported
  uint64_t timers_due_ = 0;       // address_timers_locked's next run
  // When the socket was last polled (progress_round_locked's `now`): a poll
  // within fresh_poll_ns of the last one is busy-polling, and a datagram it
  // finds arrived at most that long ago (UdpSocket::receive_batch, fresh).
  uint64_t last_poll_ns_ = 0;
  static constexpr uint64_t fresh_poll_ns = 2'000;
  uint64_t moved_at_ = 0;         // the last rebind, until the first acknowledgement after it
  uint64_t last_move_ns_ = 0;     // HostCounters::last_move_ns
  bool address_suspect_ = false;  // a send failed as if our address were gone
};

}  // namespace stellar::host

// The daemon placement's application side: a Host whose engines run in
// stellar-engined (offload/daemon), reached over its Unix socket (control:
// open, memory, attach/detach, counters) and a shared-memory area with two
// rings (data: work requests out, completions in; daemon_protocol.hpp).
//
// Memory: registration tells the daemon the keys and the range; it reads
// and writes registered memory in this process through /proc/PID/mem,
// as a NIC's DMA engine would, and resolves remote keys itself. Nothing is
// copied on this side. Deregistration returns only once the daemon has
// dropped the region: from then on it cannot touch it.
//
// A daemon that dies (its socket closes) puts every QP of the context in
// ERROR: outstanding work completes with work_request_flushed at the next
// progress, later posts are flushed the same way, and attach fails with a
// message naming the socket.
//
// Locking: as Host's; the control socket is used under the lock.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "host/daemon_protocol.hpp"
#include "host/host.hpp"

namespace stellar::host {

class RemoteHost final : public Host {
 public:
  struct Engine;

  RemoteHost(std::mutex& lock, HostClient& client);
  ~RemoteHost() override;
  RemoteHost(const RemoteHost&) = delete;
  RemoteHost& operator=(const RemoteHost&) = delete;

  std::optional<SocketError> open(const HostOptions&) override;
  void start() override {}
  void stop() override {}

  // Our end of the bell pair: readable when the daemon added completions
  // (asking for it makes the daemon ring it after every batch; progress
  // drains it).
  int fd() const override;
  sockaddr_in local() const override { return local_; }
  bool gso() const override { return gso_; }
  bool gro() const override { return gro_; }
  const char* placement() const override { return "daemon"; }

  std::optional<std::string> register_memory_locked(const MemoryRegistration&) override;
  void deregister_memory_locked(uint32_t lkey) override;
  Host::Engine* attach_locked(const offload::EngineConfig&, const sockaddr_in& peer, const QpBinding&, offload::MemoryAccess&,
                              offload::CompletionSink&, std::string& error) override;
  void detach_locked(Host::Engine*) override;
  offload::PostResult post_send_locked(Host::Engine*, const offload::SendWork&, uint64_t now_ns) override;
  offload::PostResult post_receive_locked(Host::Engine*, const offload::ReceiveWork&) override;
  bool set_ready_locked(Host::Engine*, uint64_t, uint32_t) override { return false; }  // no GPU staging in daemon mode
  void enter_error_locked(Host::Engine*) override;
  bool in_error_locked(const Host::Engine*) const override;
  uint32_t outstanding_sends_locked(const Host::Engine*) const override;
  uint32_t outstanding_receives_locked(const Host::Engine*) const override;
  void posted_locked(Host::Engine*, uint64_t now_ns) override;

  bool progress_locked(uint64_t now_ns) override;
  void flush_acknowledgements_locked(uint64_t now_ns) override;
  uint64_t next_wakeup_locked(uint64_t now_ns) override;
  HostCounters counters_locked() const override;
  bool quota_refused_locked() const override { return quota_refused_; }
  uint16_t tenant_pkey() const override { return tenant_pkey_; }
  std::vector<FlowReport> flow_report_locked() const override;
  // The daemon owns the sockets and follows its address itself
  // (HostOptions::follow_address); a context cannot move it.
  std::optional<std::string> rebind_locked(const std::string&, uint64_t) override {
    return std::string("the engine daemon owns the sockets and follows address changes itself");
  }

  void kick() override;
  void sleep_until_work(uint64_t limit_ns, int extra_fd) override;

  bool daemon_alive() const { return !dead_; }
  uint32_t daemon_pid() const { return daemon_pid_; }

 private:
  // One request and its reply; false (with the daemon declared dead, or
  // `error` set from the reply) on failure.
  bool call_locked(const void* request, size_t length, daemon::Reply& reply, std::string& error, const int* fds = nullptr,
                   int fd_count = 0) const;
  bool push_locked(const daemon::SubmitEntry&);
  void ring_doorbell();
  void drain_bell();
  size_t drain_completions_locked();
  void check_daemon_locked(uint64_t now_ns);
  void daemon_died_locked(const std::string& why) const;
  void flush_everything_locked();

  std::mutex& lock_;
  HostClient& client_;
  HostOptions options_;
  std::string path_;
  int socket_ = -1, area_fd_ = -1;
  int bell_fd_ = -1;  // our end of the bell socket pair: doorbells out, wake-ups in
  int kick_fd_ = -1;  // eventfd: kick() wakes our own sleepers
  void* area_memory_ = nullptr;
  size_t area_bytes_ = 0;
  daemon::SharedArea* area_ = nullptr;
  daemon::SubmitEntry* submit_ = nullptr;
  daemon::CompletionEntry* completions_ = nullptr;
  uint64_t submit_tail_ = 0, completion_head_ = 0;  // our own indices (the shared copies are for the daemon)
  sockaddr_in local_{};
  bool gso_ = false, gro_ = false;
  uint32_t daemon_pid_ = 0;
  mutable std::atomic<bool> dead_{false};  // read without the lock by sleep_until_work
  mutable bool denied_ = false;  // the daemon refused our credentials (uid, or tenant)
  mutable bool quota_refused_ = false;
  uint16_t tenant_pkey_ = 0;
  std::string tenant_;        // the tenant the context opened as (its flow report's rows)  // the daemon's tenants file: our tenant's partition key  // the last request passed the tenant's quota in the daemon
  uint64_t next_liveness_check_ns_ = 0;
  std::unordered_map<uint32_t, std::unique_ptr<Engine>> engines_;  // by the daemon's handle
  HostCounters retired_{};  // last counters the daemon gave, kept after it died
};

}  // namespace stellar::host

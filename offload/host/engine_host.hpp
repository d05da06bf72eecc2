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

#include "host/fault_filter.hpp"
#include "host/udp_socket.hpp"
#include "stellar/offload/engine.hpp"

namespace stellar::host {

// CLOCK_MONOTONIC in nanoseconds: the clock engines run on.
uint64_t monotonic_ns();

struct HostOptions {
  std::string bind_address = "127.0.0.1";
  uint16_t udp_port = 0;  // 0: any free port (roce mode tries 4791 first)
  offload::Mode mode = offload::Mode::stellar;
  uint32_t mtu = 4096;    // payload bytes per packet (sizes the batches)
  FaultOptions faults;
  bool engine_thread = false;  // progress on a thread of the host's (else the caller's)
  bool adaptive_wait = false;  // the thread sleeps after spinning `spin_ns` without work
  uint64_t spin_ns = 0;
};

struct HostCounters {
  offload::EngineCounters engines;  // attached engines and every detached one
  uint64_t malformed = 0;           // too short for a destination
  uint64_t unknown_qp = 0;          // no engine at (pkey, QPN), or not from its peer
  uint64_t send_errors = 0, receive_calls = 0, coalesced = 0;
  FaultCounters faults;
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

// Adds the counters of `e` to `sum`.
void accumulate(offload::EngineCounters& sum, const offload::EngineCounters& e);

class EngineHost {
 public:
  struct Engine;  // one attached engine: an opaque handle

  EngineHost(std::mutex& lock, HostClient& client);
  ~EngineHost();  // stops the engine thread
  EngineHost(const EngineHost&) = delete;
  EngineHost& operator=(const EngineHost&) = delete;

  // Opens the socket and sizes the batches; nullopt on success.
  std::optional<SocketError> open(const HostOptions&);
  // Starts the engine thread when HostOptions::engine_thread asks for one.
  void start();
  // Stops and joins the engine thread (idempotent; without the lock).
  void stop();

  int fd() const { return socket_.fd(); }  // readable when datagrams wait
  const sockaddr_in& local() const { return socket_.local(); }
  bool gso() const { return socket_.gso(); }
  bool gro() const { return socket_.gro(); }
  const HostOptions& options() const { return options_; }

  // ---- under the lock ----
  // Creates the engine of QP `qpn` in partition `pkey`, talking to `peer`
  // (the host fills the config's ICRC addresses); datagrams for (pkey, qpn)
  // from `peer` go to it from now on. The references must outlive it.
  Engine* attach_locked(const offload::EngineConfig&, const sockaddr_in& peer, offload::MemoryAccess&,
                        offload::CompletionSink&);
  // Sends its held-back acknowledgement, keeps its counters, destroys it.
  void detach_locked(Engine*);
  offload::PostResult post_send_locked(Engine*, const offload::SendWork&, uint64_t now_ns);
  offload::PostResult post_receive_locked(Engine*, const offload::ReceiveWork&);
  bool set_ready_locked(Engine*, uint64_t wr_id, uint32_t bytes);  // QpEngine::set_ready
  void enter_error_locked(Engine*);
  bool in_error_locked(const Engine*) const;
  uint32_t outstanding_sends_locked(const Engine*) const;
  uint32_t outstanding_receives_locked(const Engine*) const;
  // Work was posted to `engine`: inline progress transmits it now, the
  // engine thread is kicked.
  void posted_locked(Engine*, uint64_t now_ns);

  // Receive, run timers, transmit: rounds until no engine has more due now.
  // True if anything was received or sent.
  bool progress_locked(uint64_t now_ns);
  // Every engine sends its held-back acknowledgement now.
  void flush_acknowledgements_locked(uint64_t now_ns);
  // The earliest timer across engines and the client; UINT64_MAX: none.
  uint64_t next_wakeup_locked(uint64_t now_ns);
  HostCounters counters_locked() const;

  // ---- without the lock ----
  // Wakes the engine thread (or a sleep_until_work).
  void kick();
  // Blocks in the kernel until a datagram, a kick, `extra_fd` or the next
  // timer (at most until `limit_ns`). Takes the lock to read the timers.
  void sleep_until_work(uint64_t limit_ns, int extra_fd);

 private:
  // One round of progress_locked: receive, then flush what engines have
  // due; `more` says an engine still has datagrams due after its flush (a
  // capped burst of READ responses in roce mode).
  bool progress_round_locked(uint64_t now_ns, bool& more);
  size_t flush_engine(Engine&, uint64_t now_ns);
  void send_datagrams(size_t n, const sockaddr_in& peer);
  void engine_thread();

  static constexpr int rx_batch = 32;  // datagrams per receive call
  static constexpr int tx_batch = 64;  // datagrams per transmit pass (and per sendmmsg)
  static_assert(rx_batch <= UdpSocket::max_batch && tx_batch <= UdpSocket::max_batch,
                "the socket fills and sends at most UdpSocket::max_batch datagrams per call");

  std::mutex& lock_;
  HostClient& client_;
  HostOptions options_;
  UdpSocket socket_;
  std::unique_ptr<FaultFilter> filter_;
  int kick_fd_ = -1;
  std::unordered_map<uint64_t, std::unique_ptr<Engine>> engines_;  // (pkey << 32 | qpn)
  offload::EngineCounters retired_{};  // counters of detached engines
  std::vector<uint8_t> rx_memory_, tx_memory_;
  Datagram rx_[rx_batch];
  offload::TxBuffer tx_[tx_batch];
  iovec tx_parts_[tx_batch][offload::max_segments + 2];
  Datagram out_[tx_batch];
  std::thread thread_;
  std::atomic<bool> running_{false};
  uint64_t malformed_ = 0, unknown_qp_ = 0, send_errors_ = 0, receive_calls_ = 0, coalesced_ = 0;
};

}  // namespace stellar::host

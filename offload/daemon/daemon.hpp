// stellar-engined: the engine daemon (the SmartNIC placement of the offload
// engine, docs/engine-daemon.md). It hosts, for every application context
// attached to it, an EngineHost (the UDP socket, the engines of the
// context's QPs, their timers), the same code the inline and engine-thread
// placements run inside the application.
//
// Threads: one control thread (run(): accepts clients on the Unix socket,
// checks their credentials, answers their requests) and `cores` shard
// threads, each progressing the contexts assigned to it (a context's QPs
// stay on one shard). A context's mutex serialises the two.
//
// Trust: a client is checked once (SO_PEERCRED against the allow-list);
// after that everything it sends, on the socket or in its rings, is checked
// before use, and a client can name only its own engines and memory.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace stellar::engined {

struct DaemonOptions {
  std::string socket_path;
  unsigned cores = 1;           // shard threads
  bool busy_poll = true;        // shards spin; false: spin `spin_ns`, then sleep until a packet, doorbell or timer
  uint64_t spin_ns = 50'000;
  std::vector<uid_t> allow_uids;  // empty with empty allow_gids: the daemon's own uid and root
  std::vector<gid_t> allow_gids;
  // Quotas: what one client (one application context) may make the daemon
  // hold, and how many clients it serves at once. Beyond them a request
  // fails with a message; a ring entry is refused and counted.
  unsigned max_clients = 1024;
  unsigned max_qps_per_client = 4096;
  unsigned max_regions_per_client = 65536;
  // Tenants (docs/scheduler.md, "In the engine daemon"): with a file, only
  // its tenants are served, each with its credential, its quotas over all
  // its contexts, its weight and rate limit in its shard's scheduler.
  std::string tenants_file;
  // The rate (bytes/s) the daemon's packets leave at, split evenly over the
  // shards; 0: none.
  uint64_t tx_rate_bytes_per_s = 0;
};

class Shard;
class Session;
struct Stats;
struct TenantBook;

class Daemon {
 public:
  explicit Daemon(DaemonOptions);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Binds and listens on the socket (a stale socket file is replaced, a live
  // daemon's is not). An error message on failure.
  std::optional<std::string> start();
  // Starts the shards and serves until stop(); then closes every session.
  // The destructor removes the socket.
  void run();
  // Async-signal-safe.
  void stop();

 private:
  bool allowed(const ucred&, const std::vector<gid_t>& supplementary_groups) const;
  void serve_clients();
  void accept_client();
  void close_session(size_t index);
  // Puts a session that opened its context on a shard.
  void place(const std::shared_ptr<Session>&);

  DaemonOptions options_;
  int listen_fd_ = -1, stop_fd_ = -1;
  std::unique_ptr<Stats> stats_;  // before shards and sessions: sessions count themselves out in it
  std::unique_ptr<TenantBook> tenants_;  // likewise: sessions give their quota back in it
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::shared_ptr<Session>> sessions_;
  size_t next_shard_ = 0;
  uint64_t refused_clients_ = 0;
  uint64_t accept_paused_until_ns_ = 0;  // out of descriptors: accept again after this
};

}  // namespace stellar::engined

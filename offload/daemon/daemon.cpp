#include "daemon/daemon.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "host/contention.hpp"
#include "host/daemon_protocol.hpp"
#include "host/engine_host.hpp"
#include "host/tenants_file.hpp"

namespace stellar::engined {

namespace off = stellar::offload;
using namespace stellar::host;
using namespace stellar::host::daemon;

namespace {

void say(const char* format, ...) {
  char line[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  // Client-supplied text (tenant names) may hold anything: one line, printable.
  for (char* c = line; *c; ++c)
    if (static_cast<unsigned char>(*c) < 0x20 || *c == 0x7f) *c = '?';
  std::fprintf(stderr, "stellar-engined[%d] %ld.%03ld %s\n", int(getpid()), long(t.tv_sec), t.tv_nsec / 1'000'000, line);
}

uint64_t process_cpu_ns() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto ns = [](const timeval& t) { return uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_usec) * 1000ull; };
  return ns(u.ru_utime) + ns(u.ru_stime);
}

// The client's end of the bells must be a Unix datagram socket: we only
// ever send and receive on it with MSG_DONTWAIT, so nothing the client does
// to it can block us.
bool is_unix_datagram(int fd) {
  int domain = 0, type = 0;
  socklen_t n = sizeof domain;
  if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &n) != 0) return false;
  n = sizeof type;
  return ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &n) == 0 && domain == AF_UNIX && type == SOCK_DGRAM;
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77  // Linux 6.5; older kernels answer ENOPROTOOPT and we fall back to pidfd_open
#endif

// A pidfd of the process that connected: SO_PEERPIDFD names exactly that
// process; pidfd_open by its pid is the fallback (the pid of SO_PEERCRED,
// which is that process while the connection's other end is still open).
// -1 where neither exists (qemu-user, old kernels).
int peer_pidfd(int socket, pid_t pid) {
  int fd = -1;
  socklen_t n = sizeof fd;
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERPIDFD, &fd, &n) == 0 && fd >= 0) return fd;
#ifdef SYS_pidfd_open
  fd = int(::syscall(SYS_pidfd_open, pid, 0));
  if (fd >= 0) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return fd;
#else
  (void)pid;
  return -1;
#endif
}

// Whether the process behind `pidfd` has exited (a pidfd polls readable then).
bool exited(int pidfd) {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

// Whether every uid (real, effective, saved, filesystem) of process `pid`
// is `uid` and every gid is `gid`: the process that connected has not
// become a set-user-ID or set-group-ID program since (exec), whose memory
// its user must not reach through us.
bool same_identity(pid_t pid, uid_t uid, gid_t gid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/status", int(pid));
  FILE* f = std::fopen(path, "re");
  if (!f) return false;
  char line[256];
  int matched = 0;
  while (std::fgets(line, sizeof line, f)) {
    unsigned long a, b, c, d;
    const bool is_uid = std::strncmp(line, "Uid:", 4) == 0, is_gid = std::strncmp(line, "Gid:", 4) == 0;
    if (!is_uid && !is_gid) continue;
    if (std::sscanf(line + 4, "%lu %lu %lu %lu", &a, &b, &c, &d) != 4) break;
    const unsigned long want = is_uid ? uid : gid;
    if (a != want || b != want || c != want || d != want) break;
    ++matched;
  }
  std::fclose(f);
  return matched == 2;
}

// A memfd the client cannot shrink under our mapping (a shrunk file would
// turn our accesses into SIGBUS), at least `bytes` long.
bool sealed_memfd(int fd, uint64_t bytes) {
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || uint64_t(st.st_size) < bytes) return false;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SHRINK);
}

void close_all(std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
  fds.clear();
}

}  // namespace

// Daemon-wide figures a client may ask for (the counters request).
struct Stats {
  std::atomic<uint32_t> sessions{0}, engines{0};
};

// The daemon's tenants (--tenants FILE, docs/scheduler.md "In the engine
// daemon"): who may open contexts, with which credential, and what all of a
// tenant's contexts hold together against its quotas. Without a file
// `enabled` is false: any allowed user's context is served, its tenant name
// only a label. Touched by the control thread only (opens, requests and
// teardowns all happen there).
struct TenantBook {
  struct Usage {
    host::TenantEntry entry;
    unsigned sessions = 0;
    int shard = -1;  // the shard its contexts run on (all on one: its weight and rate limit hold there)
    uint64_t qps = 0, registered_bytes = 0;
    uint64_t quota_refusals = 0, credential_refusals = 0;
  };
  bool enabled = false;
  std::map<std::string, Usage> tenants;
};

// ---------------------------------------------------------------------------
// A session: one application context.

class Session final : public HostClient {
 public:
  // A registered region: addresses are the client's.
  struct Mr {
    uint32_t pd = 0, lkey = 0, rkey = 0, access = 0;
    uint64_t address = 0, length = 0;
    bool contains(uint64_t a, uint64_t n) const { return a >= address && n <= length && a - address <= length - n; }
  };

  // One QP's engine: its memory is the session's, checked as the
  // application side's SoftQp checks it, and reached in the client's process
  // (/proc/PID/mem); its completions go to the ring.
  struct Qp final : off::MemoryAccess, off::CompletionSink {
    Session& s;
    uint32_t handle = 0, pd = 0, access = 0;
    uint32_t max_send_wr = 0, max_recv_wr = 0;
    uint64_t key = 0;  // pkey << 32 | qpn
    Host::Engine* engine = nullptr;
    // WRs the engine had no room for (its PSN space: a quarter in flight),
    // posted in order later; an inline payload keeps its bytes here.
    struct Backlogged {
      off::SendWork w;
      uint8_t bytes[off::max_inline_bytes];
    };
    std::deque<Backlogged> backlog;
    Qp(Session& session) : s(session) {}

    uint8_t* resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t need) override {
      auto k = s.rkey_to_lkey_.find(rkey);
      if (k == s.rkey_to_lkey_.end()) return nullptr;
      const Mr& m = s.mrs_.at(k->second);
      if (m.pd != pd || (m.access & need) != need || !(access & need) || !m.contains(address, length)) return nullptr;
      return reinterpret_cast<uint8_t*>(address);  // the client's address: only read()/write() use it
    }
    uint64_t generation() const override { return s.generation_; }
    bool local_valid(uint32_t lkey, const uint8_t* address, uint64_t length, uint32_t need) override {
      auto it = s.mrs_.find(lkey);
      if (it == s.mrs_.end()) return false;
      const Mr& m = it->second;
      return m.pd == pd && (m.access & need) == need && m.contains(reinterpret_cast<uint64_t>(address), length);
    }
    bool direct() const override { return false; }
    bool read(void* to, const uint8_t* address, size_t length) override { return s.client_copy(to, address, length, false); }
    bool write(uint8_t* address, const void* from, size_t length) override {
      return s.client_copy(const_cast<void*>(from), address, length, true);
    }
    void deliver(const off::Completion& c) override {
      CompletionEntry e;
      e.handle = handle;
      e.status = uint8_t(c.status);
      e.opcode = uint8_t(c.opcode);
      e.has_imm = c.has_imm;
      e.wr_id = c.wr_id;
      e.byte_length = c.byte_length;
      e.imm = c.imm;
      e.qp_number = c.qp_number;
      s.push_completion(e);
    }
  };

  Session(int socket, ucred credentials, int pidfd, const DaemonOptions& options, Stats& stats, TenantBook& book)
      : socket_(socket), credentials_(credentials), pidfd_(pidfd), options_(options), stats_(stats), book_(book), host_(mutex_, *this) {
    ++stats_.sessions;
  }
  ~Session() override {
    --stats_.sessions;
    if (area_memory_) ::munmap(area_memory_, area_bytes_);
    for (int fd : {socket_, bell_fd_, mem_fd_, pidfd_})
      if (fd >= 0) ::close(fd);
  }

  // Copies between our buffer and the client's memory (a NIC's DMA): one
  // pread/pwrite on its /proc/PID/mem. Only ranges the engine checked
  // against a registration reach here. False if the client is gone (or
  // exec'd: the descriptor stays bound to the address space it was opened
  // on) or unmapped the range.
  bool client_copy(void* ours, const uint8_t* theirs, size_t length, bool to_client) {
    ssize_t n = -1;
    if (mem_fd_ >= 0) {
      const off_t at = off_t(reinterpret_cast<uintptr_t>(theirs));
      n = to_client ? ::pwrite(mem_fd_, ours, length, at) : ::pread(mem_fd_, ours, length, at);
    }
    if (n == ssize_t(length)) return true;
    if (copy_failures_++ < 4)
      say("client pid %d: %s %zu bytes at %p failed: %s", int(credentials_.pid), to_client ? "writing" : "reading", length,
          static_cast<const void*>(theirs), n < 0 ? std::strerror(errno) : "short copy");
    return false;
  }

  int socket() const { return socket_; }
  const ucred& credentials() const { return credentials_; }
  uint64_t accepted_at() const { return accepted_at_; }
  bool opened() const { return opened_.load(std::memory_order_acquire); }
  std::mutex& mutex() { return mutex_; }
  EngineHost& host() { return host_; }
  int bell_fd() const { return bell_fd_; }
  // Where the shard that serves this session is woken (Shard::add).
  void set_shard_wake(int fd) { shard_wake_fd_ = fd; }
  SharedArea* area() const { return area_; }
  bool broken() const { return broken_.load(std::memory_order_relaxed); }

  // Handles one request from the client and answers it (after the
  // session's lock is released: the shard need not wait for the socket);
  // false to end the session.
  bool handle(const uint8_t* message, long length, std::vector<int>& fds);
  // The client is gone: its QPs are freed, each sending its final
  // acknowledgement (the peer's last SEND completes there), and its memory
  // is never touched again (the engines go; the destructor closes the
  // /proc/PID/mem descriptor and unmaps the area). Its peers' later sends
  // fail with retry_exceeded, as to a crashed host's.
  void teardown() {
    broken_.store(true);  // a shard still holding it skips it from now on
    std::lock_guard lock(mutex_);
    for (auto& [handle, qp] : qps_) {
      host_.detach_locked(qp->engine);
      release_quota(*qp);
      --stats_.engines;
    }
    qps_.clear();
    engine_keys_.clear();
    if (mem_fd_ >= 0) ::close(mem_fd_);
    mem_fd_ = -1;
    // What it held against its tenant's quotas is free again.
    if (usage_) {
      for (auto& [lkey, m] : mrs_) usage_->registered_bytes -= m.length;
      mrs_.clear();
      rkey_to_lkey_.clear();
      if (--usage_->sessions == 0) usage_->shard = -1;
      usage_ = nullptr;
    }
  }

  // The tenant it opened as (authenticated when the daemon has a tenants
  // file), and the shard serving it (-1 before placement).
  const std::string& tenant() const { return tenant_; }
  TenantBook::Usage* tenant_usage() const { return usage_; }
  int shard() const { return shard_; }
  void set_shard(int shard) { shard_ = shard; }

  // ---- under the mutex ----
  // HostClient: the submission ring is the session's input besides the socket.
  void on_progress_locked(uint64_t) override {
    retry_backlog_locked();
    drain_submissions_locked();
    flush_overflow_locked();
  }
  uint64_t next_wakeup_locked(uint64_t now) override {
    if (!area_) return UINT64_MAX;
    if (area_->submit_tail.value.load(std::memory_order_acquire) != submit_head_) return now;
    return overflow_.empty() && !backlogged_ ? UINT64_MAX : now + 10'000;
  }
  // Without the lock (a shard about to sleep): both indices from the area.
  bool submissions_waiting() const {
    return area_ && area_->submit_tail.value.load(std::memory_order_seq_cst) !=
                        area_->submit_head.value.load(std::memory_order_relaxed);
  }
  // Wakes the client if it asked to be woken and got completions.
  void notify_client_locked() {
    if (!pushed_ || !area_) return;
    pushed_ = false;
    // Dekker with the client's sleep: we published the tail, it announces
    // its wait and then reads the tail. The fence orders our tail store
    // before our load of its announcement, so one of us sees the other.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (area_->client_waiting.value.load(std::memory_order_seq_cst) || area_->client_events.value.load(std::memory_order_relaxed)) {
      // Never blocks: a full buffer means the client has wake-ups unread.
      const char bell = 'w';
      [[maybe_unused]] ssize_t r = ::send(bell_fd_, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
  }
  // Reads the doorbells that woke a sleeping shard.
  void drain_doorbells() {
    char bells[64];
    while (bell_fd_ >= 0 && ::recv(bell_fd_, bells, sizeof bells, MSG_DONTWAIT) > 0) {
    }
  }

 private:
  Reply reply(bool ok, const char* format = "", ...) {
    Reply r;
    r.h = {uint32_t(MessageType::reply), sizeof r};
    r.ok = ok ? 1 : 0;
    if (!ok) {
      va_list args;
      va_start(args, format);
      std::vsnprintf(r.message, sizeof r.message, format, args);
      va_end(args);
    }
    return r;
  }
  // Never waits: a client whose socket buffer is full of unread replies
  // is not following the protocol, and its session ends.
  bool answer(const Reply& r) { return send_message(socket_, &r, sizeof r, nullptr, 0, MSG_DONTWAIT); }

  Reply respond_locked(MessageType type, const uint8_t* message, size_t length);
  Reply open_locked(const OpenRequest&, std::vector<int>& fds);
  Reply register_memory(const RegisterRequest&);
  Reply attach(const AttachRequest&);
  // A refusal for the tenant's quota (the client reports resource_exhausted).
  Reply over_quota(const char* what, uint64_t have, uint64_t asked, uint64_t quota) {
    ++usage_->quota_refusals;
    Reply r = reply(false, "tenant '%s': %s: %llu held + %llu asked would pass its quota of %llu (the daemon's tenants file)",
                    tenant_.c_str(), what, (unsigned long long)have, (unsigned long long)asked, (unsigned long long)quota);
    r.denied = refused_quota;
    return r;
  }
  bool reach_memory_locked(std::string& error);

  void push_completion(const CompletionEntry& e) {
    if (overflow_.empty() && push_ring(e)) return;
    // Never lost: delivered in order once the client has polled. An honest
    // client has at most one completion coming per WR it may have
    // outstanding; past twice that (and the ring) it is not polling at all
    // while it posts, and the session ends rather than the daemon's memory.
    if (overflow_.size() >= 2 * completion_budget_ + completion_capacity_) {
      if (!broken()) {
        say("client pid %d: %zu completions unconsumed: session closed", int(credentials_.pid), overflow_.size());
        broken_.store(true);
        ::shutdown(socket_, SHUT_RDWR);
      }
      return;
    }
    overflow_.push_back(e);
  }
  bool push_ring(const CompletionEntry& e) {
    // The client's head is its word: a lie only loses its own completions.
    const uint64_t head = area_->completion_head.value.load(std::memory_order_acquire);
    if (completion_tail_ - head >= completion_capacity_) return false;
    completions_[completion_tail_ & (completion_capacity_ - 1)] = e;
    ++completion_tail_;
    area_->completion_tail.value.store(completion_tail_, std::memory_order_release);
    pushed_ = true;
    return true;
  }
  void flush_overflow_locked() {
    while (!overflow_.empty() && push_ring(overflow_.front())) overflow_.pop_front();
  }

  void release_quota(const Qp&) {
    if (usage_) --usage_->qps;
  }
  void refuse_entry(const char* why) {
    if (refused_++ < 8) say("client pid %d: ring entry refused: %s", int(credentials_.pid), why);
  }
  void drain_submissions_locked();
  void submit_locked(const SubmitEntry&);
  bool try_post_locked(Qp&, const off::SendWork&);
  void enqueue_locked(Qp&, const off::SendWork&);
  void retry_backlog_locked();
  void fail_locked(Qp& qp, uint64_t wr_id, bool receive, off::CompletionStatus status, off::WorkOpcode opcode) {
    off::Completion c;
    c.wr_id = wr_id;
    c.status = status;
    c.opcode = receive ? off::CompletionOpcode::receive : off::completion_opcode(opcode);
    c.qp_number = uint32_t(qp.key);
    qp.deliver(c);
  }

  int socket_;
  ucred credentials_;
  int pidfd_;  // the client process, or -1 (no pidfds here)
  const DaemonOptions& options_;
  Stats& stats_;
  TenantBook& book_;
  const uint64_t accepted_at_ = monotonic_ns();
  std::string tenant_;
  TenantBook::Usage* usage_ = nullptr;  // with a tenants file: its tenant's
  int shard_ = -1;
  std::mutex mutex_;
  EngineHost host_;
  void* area_memory_ = nullptr;
  size_t area_bytes_ = 0;
  SharedArea* area_ = nullptr;
  SubmitEntry* submit_ = nullptr;
  CompletionEntry* completions_ = nullptr;
  uint32_t submit_capacity_ = 0, completion_capacity_ = 0;
  uint64_t submit_head_ = 0, completion_tail_ = 0;
  int bell_fd_ = -1;         // our end of the client's bell pair
  int shard_wake_fd_ = -1;   // the serving shard's eventfd (ours to write, never the client's)
  uint32_t mtu_ = 0;
  uint64_t completion_budget_ = 0;  // sum of the QPs' max_send_wr + max_recv_wr
  std::deque<CompletionEntry> overflow_;
  bool pushed_ = false;
  bool backlogged_ = false;
  std::atomic<bool> broken_{false};
  std::atomic<bool> opened_{false};  // the area and host are set up (shards look without the mutex)
  std::unordered_map<uint32_t, Mr> mrs_;  // by lkey
  std::unordered_map<uint32_t, uint32_t> rkey_to_lkey_;
  uint64_t generation_ = 1;
  std::unordered_map<uint32_t, std::unique_ptr<Qp>> qps_;  // by handle
  std::unordered_set<uint64_t> engine_keys_;
  uint32_t next_handle_ = 1;
  uint64_t refused_ = 0;
  uint64_t copy_failures_ = 0;
  int mem_fd_ = -1;  // the client's /proc/PID/mem, opened at its first registration
};

void Session::drain_submissions_locked() {
  if (!area_ || broken()) return;
  const uint64_t tail = area_->submit_tail.value.load(std::memory_order_acquire);
  if (tail - submit_head_ > submit_capacity_) {
    // An index no producer could have written: the session cannot be
    // trusted to mean anything any more. It ends (its socket is shut down,
    // the control thread tears it down); the daemon goes on.
    ++refused_;
    say("client pid %d: submission ring index corrupt (head %llu, tail %llu): session closed", int(credentials_.pid),
        (unsigned long long)submit_head_, (unsigned long long)tail);
    broken_.store(true);
    ::shutdown(socket_, SHUT_RDWR);
    return;
  }
  while (submit_head_ != tail) {
    SubmitEntry e;
    // Copied out before it is looked at: the client may rewrite the slot meanwhile.
    std::memcpy(static_cast<void*>(&e), &submit_[submit_head_ & (submit_capacity_ - 1)], sizeof e);
    ++submit_head_;
    submit_locked(e);
  }
  area_->submit_head.value.store(submit_head_, std::memory_order_release);
}

void Session::submit_locked(const SubmitEntry& e) {
  auto it = qps_.find(e.handle);
  if (it == qps_.end()) return refuse_entry("no such QP handle in this session");
  Qp& qp = *it->second;
  switch (EntryKind(e.kind)) {
    case EntryKind::post_receive: {
      if (e.count > off::max_segments) return refuse_entry("receive with too many segments");
      off::ReceiveWork r;
      r.wr_id = e.wr_id;
      r.segment_count = e.count;
      for (uint32_t i = 0; i < e.count; ++i) {
        const WireSegment& g = e.segments[i];
        auto m = mrs_.find(g.lkey);
        const bool ok = g.length == 0 || (m != mrs_.end() && m->second.pd == qp.pd &&
                                          (m->second.access & off::access_local_write) && m->second.contains(g.address, g.length));
        if (!ok) {
          // As a NIC: a receive whose lkey does not check out fails, and the QP with it.
          fail_locked(qp, e.wr_id, true, off::CompletionStatus::local_protection_error, off::WorkOpcode::send);
          host_.enter_error_locked(qp.engine);
          return refuse_entry("receive segment outside the client's registered memory");
        }
        r.segments[i] = off::Segment{reinterpret_cast<uint8_t*>(g.address), g.length, g.lkey};
      }
      const off::PostResult result = host_.post_receive_locked(qp.engine, r);
      if (result != off::PostResult::ok)
        fail_locked(qp, e.wr_id, true,
                    result == off::PostResult::qp_in_error ? off::CompletionStatus::work_request_flushed
                                                           : off::CompletionStatus::local_qp_operation_error,
                    off::WorkOpcode::send);
      return;
    }
    case EntryKind::post_send: {
      if (e.opcode > uint8_t(off::WorkOpcode::atomic_compare_swap)) return refuse_entry("unknown opcode");
      off::SendWork w;
      w.wr_id = e.wr_id;
      w.opcode = off::WorkOpcode(e.opcode);
      w.signaled = e.signaled;
      w.solicited = e.solicited;
      w.remote_addr = e.remote_addr;
      w.rkey = e.rkey;
      w.imm = e.imm;
      w.compare_add = e.compare_add;
      w.swap = e.swap;
      if (e.inline_data) {
        if (e.count > off::max_inline_bytes) return refuse_entry("inline payload too long");
        // The engine copies inline payloads when the WR is posted; the entry
        // is ours (copied out of the ring) until then. A backlogged WR keeps
        // its own copy (enqueue_locked).
        w.inline_data = true;
        w.segment_count = e.count ? 1 : 0;
        w.segments[0] = off::Segment{const_cast<uint8_t*>(e.inline_bytes), e.count, 0};
      } else {
        if (e.count > off::max_segments) return refuse_entry("send with too many segments");
        const bool writes_local = w.opcode == off::WorkOpcode::rdma_read || w.opcode == off::WorkOpcode::atomic_fetch_add ||
                                  w.opcode == off::WorkOpcode::atomic_compare_swap;
        const uint32_t need = writes_local ? uint32_t(off::access_local_write) : 0u;
        w.segment_count = e.count;
        for (uint32_t i = 0; i < e.count; ++i) {
          const WireSegment& g = e.segments[i];
          auto m = mrs_.find(g.lkey);
          const bool ok = g.length == 0 || (m != mrs_.end() && m->second.pd == qp.pd && (m->second.access & need) == need &&
                                            m->second.contains(g.address, g.length));
          if (!ok) {
            fail_locked(qp, e.wr_id, false, off::CompletionStatus::local_protection_error, w.opcode);
            host_.enter_error_locked(qp.engine);
            return refuse_entry("send segment outside the client's registered memory");
          }
          w.segments[i] = off::Segment{reinterpret_cast<uint8_t*>(g.address), g.length, g.lkey};
        }
      }
      // In order: behind WRs still waiting for room, or first in line. The
      // backlog holds at most what the QP may have outstanding (the client
      // counts that itself; one that does not is refused).
      if (qp.backlog.empty() && try_post_locked(qp, w)) return;
      if (qp.backlog.size() >= qp.max_send_wr) {
        fail_locked(qp, w.wr_id, false, off::CompletionStatus::local_qp_operation_error, w.opcode);
        return refuse_entry("more sends outstanding than the QP's max_send_wr");
      }
      enqueue_locked(qp, w);
      return;
    }
  }
  refuse_entry("unknown entry kind");
}

// False: the engine has no room now (the caller keeps the WR in order).
bool Session::try_post_locked(Qp& qp, const off::SendWork& w) {
  switch (host_.post_send_locked(qp.engine, w, monotonic_ns())) {
    case off::PostResult::ok: return true;
    case off::PostResult::queue_full: return false;
    case off::PostResult::invalid_argument:
      fail_locked(qp, w.wr_id, false, off::CompletionStatus::local_length_error, w.opcode);
      return true;
    case off::PostResult::qp_in_error:
      fail_locked(qp, w.wr_id, false, off::CompletionStatus::work_request_flushed, w.opcode);
      return true;
  }
  return true;
}

void Session::enqueue_locked(Qp& qp, const off::SendWork& w) {
  Qp::Backlogged& b = qp.backlog.emplace_back();  // deque: its address stays put until popped
  b.w = w;
  if (w.inline_data && w.segment_count) {
    std::memcpy(b.bytes, w.segments[0].address, w.segments[0].length);
    b.w.segments[0].address = b.bytes;
  }
  backlogged_ = true;
}

void Session::retry_backlog_locked() {
  if (!backlogged_) return;
  backlogged_ = false;
  for (auto& [handle, qp] : qps_) {
    while (!qp->backlog.empty() && try_post_locked(*qp, qp->backlog.front().w)) qp->backlog.pop_front();
    if (!qp->backlog.empty()) backlogged_ = true;
  }
}

Reply Session::open_locked(const OpenRequest& r, std::vector<int>& fds) {
  // A refused open is answered and the connection kept (the client closes it).
  auto refuse = [&](const char* why) {
    close_all(fds);
    return reply(false, "open: %s", why);
  };
  if (area_) return refuse("this connection already has a context");
  if (r.magic != protocol_magic || r.version != protocol_version) return refuse("protocol version mismatch (library and daemon differ)");
  if (fds.size() != 2) return refuse("expected the shared area memfd and the daemon's end of the bell socket pair");
  const uint32_t sc = r.submit_capacity, cc = r.completion_capacity;
  if (sc < 16 || sc > 65536 || (sc & (sc - 1)) || cc < 16 || cc > (1u << 20) || (cc & (cc - 1)))
    return refuse("ring capacities must be powers of two in [16, 65536] and [16, 1048576]");
  const size_t bytes = area_bytes(sc, cc);
  if (!sealed_memfd(fds[0], bytes)) return refuse("the shared area must be a memfd sealed against shrinking, of the rings' size");
  if (!is_unix_datagram(fds[1])) return refuse("the bell descriptor must be a Unix datagram socket");
  char address[sizeof r.bind_address + 1] = {};
  std::memcpy(address, r.bind_address, sizeof r.bind_address);
  auto bind = parse_ipv4(address, r.udp_port);
  if (!bind || bind->sin_addr.s_addr == 0) return refuse("bind address must be a concrete IPv4 address");
  if (r.udp_port != 0 && r.udp_port < 1024 && credentials_.uid != 0) return refuse("ports below 1024 are for root's contexts");
  if (r.mode > uint8_t(off::Mode::roce)) return refuse("unknown mode");
  if (r.mtu < 256 || r.mtu > off::max_payload_bytes) return refuse("mtu outside [256, 61440]");
  if (r.paths < 1 || r.paths > off::max_paths) return refuse("paths outside [1, 256]");
  for (double p : {r.drop, r.duplicate, r.reorder})
    if (!(p >= 0 && p <= 1)) return refuse("fault probabilities must be in [0, 1]");
  if (!std::memchr(r.tenant, 0, sizeof r.tenant) || !std::memchr(r.credential, 0, sizeof r.credential))
    return refuse("tenant or credential not NUL-terminated");
  const std::string tenant(r.tenant), credential(r.credential);
  TenantBook::Usage* usage = nullptr;
  if (book_.enabled) {
    // Only the file's tenants, each with its credential. The same answer
    // for an unknown tenant and a wrong credential: a guesser learns nothing.
    auto it = book_.tenants.find(tenant);
    const bool listed = it != book_.tenants.end();
    const bool matches = host::credential_matches(credential, listed ? it->second.entry.credential : std::string("-"));
    if (!listed || !matches) {
      if (listed) ++it->second.credential_refusals;
      close_all(fds);
      Reply no = reply(false, "open: tenant '%s' is not one of the daemon's tenants, or its credential is wrong or missing",
                       tenant.c_str());
      no.denied = refused_tenant;
      say("client pid %d uid %d: refused as tenant '%s' (unknown, or wrong credential)", int(credentials_.pid),
          int(credentials_.uid), tenant.c_str());
      return no;
    }
    usage = &it->second;
  }

  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  if (memory == MAP_FAILED) return refuse("cannot map the shared area");
  HostOptions h;
  h.bind_address = address;
  h.udp_port = r.udp_port;
  h.mode = off::Mode(r.mode);
  h.mtu = r.mtu;
  h.paths = h.mode == off::Mode::roce ? 1 : r.paths;
  h.faults = FaultOptions{r.drop, r.duplicate, r.reorder, r.seed};
  if (auto error = host_.open(h)) {
    ::munmap(memory, bytes);
    close_all(fds);
    return reply(false, "open: %s", error->message.c_str());
  }
  ::close(fds[0]);  // the mapping keeps the area
  tenant_ = tenant;
  if (usage) {
    usage_ = usage;
    ++usage_->sessions;
  }
  area_memory_ = memory;
  area_bytes_ = bytes;
  area_ = static_cast<SharedArea*>(memory);
  submit_ = submit_ring(memory);
  completions_ = completion_ring(memory, sc);
  submit_capacity_ = sc;
  completion_capacity_ = cc;
  // Our indices start at 0, whatever the client's area says; from here on
  // only ours count.
  submit_head_ = 0;
  completion_tail_ = 0;
  bell_fd_ = fds[1];
  fds.clear();
  mtu_ = r.mtu;
  opened_.store(true, std::memory_order_release);
  Reply ok = reply(true);
  if (usage_) ok.tenant_pkey = usage_->entry.pkey;
  ok.local_address = host_.local().sin_addr.s_addr;
  ok.local_port = host_.local().sin_port;
  ok.gso = host_.gso();
  ok.gro = host_.gro();
  ok.daemon_pid = uint32_t(getpid());
  say("client pid %d uid %d: context on %s:%u (%s mode)%s%s", int(credentials_.pid), int(credentials_.uid), address,
      unsigned(ntohs(ok.local_port)), r.mode ? "roce" : "stellar", tenant_.empty() ? "" : ", tenant ", tenant_.c_str());
  return ok;
}

// Opens the client's /proc/PID/mem (once, at its first registration: the
// client declares us its ptracer after the open's reply) and checks that
// it is the process that connected, with the identity it connected with.
// The descriptor is bound to that process's address space: if the client
// later execs (a set-user-ID program, say) or exits and its pid is reused,
// accesses through it fail instead of reaching the new program.
bool Session::reach_memory_locked(std::string& error) {
  if (mem_fd_ >= 0) return true;
  const int pid = int(credentials_.pid);
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/mem", pid);
  const int fd = ::open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    error = std::string("the daemon cannot open ") + path + " (" + std::strerror(errno) +
            "): it needs ptrace access to the application (same user and Yama ptrace_scope <= 1, or CAP_SYS_PTRACE)";
    return false;
  }
  // In this order: the identity is read after the descriptor is open, and
  // the process is still alive after both, so both were of the process
  // that connected (a pid is not reused while its process lives).
  if (!same_identity(credentials_.pid, credentials_.uid, credentials_.gid) || exited(pidfd_)) {
    ::close(fd);
    error = "process " + std::to_string(pid) + " is no longer the one that connected, with the uid and gid it connected with";
    return false;
  }
  mem_fd_ = fd;
  return true;
}

Reply Session::register_memory(const RegisterRequest& r) {
  auto refuse = [&](const char* why) { return reply(false, "register_memory: %s", why); };
  if (r.access & ~uint32_t(off::access_local_write | off::access_remote_write | off::access_remote_read | off::access_remote_atomic))
    return refuse("unknown access bits");
  if (r.lkey == 0 || r.rkey == 0 || mrs_.count(r.lkey) || rkey_to_lkey_.count(r.rkey) || mrs_.count(r.rkey) ||
      rkey_to_lkey_.count(r.lkey))
    return refuse("keys zero or already in use in this context");
  if (r.length > (uint64_t(1) << 47) || r.address + r.length < r.address) return refuse("range wraps or is too large");
  if (mrs_.size() >= options_.max_regions_per_client)
    return reply(false, "register_memory: this context has %zu regions, the daemon's limit (--max-regions)", mrs_.size());
  if (usage_ && usage_->entry.max_registered_bytes && r.length > usage_->entry.max_registered_bytes - std::min(usage_->registered_bytes, usage_->entry.max_registered_bytes))
    return over_quota("registered bytes", usage_->registered_bytes, r.length, usage_->entry.max_registered_bytes);
  std::string error;
  if (!reach_memory_locked(error)) return reply(false, "register_memory: %s", error.c_str());
  if (r.length) {
    // Reachable now, or the first packet would fail instead.
    uint8_t probe;
    if (!client_copy(&probe, reinterpret_cast<const uint8_t*>(r.address), 1, false))
      return reply(false, "register_memory: the daemon cannot read the region at 0x%llx in process %d (%s)",
                   (unsigned long long)r.address, int(credentials_.pid), std::strerror(errno));
  }
  Mr m;
  m.pd = r.pd;
  m.lkey = r.lkey;
  m.rkey = r.rkey;
  m.access = r.access;
  m.address = r.address;
  m.length = r.length;
  mrs_[m.lkey] = m;
  rkey_to_lkey_[m.rkey] = m.lkey;
  if (usage_) usage_->registered_bytes += m.length;
  return reply(true);
}

Reply Session::attach(const AttachRequest& r) {
  off::EngineConfig config;
  std::string error;
  if (!config_from(r, mtu_, config, error)) return reply(false, "%s", error.c_str());
  const uint64_t key = uint64_t(config.pkey) << 32 | config.local_qpn;
  if (engine_keys_.count(key)) return reply(false, "attach: QP %u of partition %u is already attached", config.local_qpn, config.pkey);
  if (qps_.size() >= options_.max_qps_per_client)
    return reply(false, "attach: this context has %zu QPs, the daemon's limit (--max-qps)", qps_.size());
  const uint32_t ip = ntohl(r.peer_address);
  if (ip == 0 || ip == 0xffffffffu || (ip >> 28) == 0xe || r.peer_port == 0)
    return reply(false, "attach: the peer is not a unicast address and port");
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_addr.s_addr = r.peer_address;
  peer.sin_port = r.peer_port;
  auto qp = std::make_unique<Qp>(*this);
  qp->handle = next_handle_++;
  qp->pd = r.pd;
  qp->access = r.access;
  qp->max_send_wr = config.max_send_wr;
  qp->max_recv_wr = config.max_recv_wr;
  qp->key = key;
  std::string unused;
  if (r.traffic_class > 7 || r.dscp > 63) return reply(false, "attach: traffic class outside [0, 7] or DSCP outside [0, 63]");
  if (!std::memchr(r.job, 0, sizeof r.job)) return reply(false, "attach: job name not NUL-terminated");
  constexpr uint64_t day_ns = 86'400ull * 1'000'000'000;
  if (r.job_weight < 1 || r.job_weight > 1'000'000 || r.step_period_ns > day_ns || r.deadline_ns > day_ns)
    return reply(false, "attach: job weight outside [1, 1000000], or step period or deadline over 24 h");
  if (usage_ && config.pkey != usage_->entry.pkey)
    return reply(false, "attach: partition key %u is not tenant '%s''s (%u): a context attaches only its own tenant's QPs",
                 unsigned(config.pkey), tenant_.c_str(), unsigned(usage_->entry.pkey));
  if (usage_) {
    const host::TenantEntry& q = usage_->entry;
    // QPs and registered bytes are counted here, over all the tenant's
    // contexts. Outstanding work requests (max_send_wrs, max_receive_wrs)
    // are the application side's check, as in-process; what a context can
    // make the daemon hold is bounded by its QPs and their queue depths.
    if (q.max_qps && usage_->qps + 1 > q.max_qps) return over_quota("QPs", usage_->qps, 1, q.max_qps);
  }
  // Its packets leave in the shard's scheduler order, as the tenant's
  // (the one the context opened as), the job's and the class's, and carry
  // the class's DSCP (docs/scheduler.md).
  QpBinding binding;
  binding.pd = r.pd;
  binding.access = r.access;
  // Without a tenants file the client's name is not trusted to define a
  // share (a client could open many): its user's contexts share one.
  binding.label.tenant = usage_ ? tenant_ : "uid " + std::to_string(credentials_.uid);
  binding.label.job = r.job;
  binding.label.job_weight = r.job_weight;
  binding.label.traffic_class = r.traffic_class;
  binding.label.step_period_ns = r.step_period_ns;
  binding.label.deadline_ns = r.deadline_ns;
  binding.dscp = r.dscp;
  qp->engine = host_.attach_locked(config, peer, binding, *qp, *qp, unused);  // never fails in-process
  engine_keys_.insert(key);
  completion_budget_ += uint64_t(config.max_send_wr) + config.max_recv_wr;
  if (usage_) ++usage_->qps;
  ++stats_.engines;
  Reply ok = reply(true);
  ok.handle = qp->handle;
  qps_[qp->handle] = std::move(qp);
  return ok;
}

bool Session::handle(const uint8_t* message, long length, std::vector<int>& fds) {
  MessageHeader h{};
  if (length < long(sizeof h)) {
    close_all(fds);
    return answer(reply(false, "malformed request"));
  }
  std::memcpy(&h, message, sizeof h);
  if (h.length != size_t(length)) {
    close_all(fds);
    return answer(reply(false, "malformed request (its length field says %u bytes, %ld arrived)", h.length, length));
  }
  const MessageType type = MessageType(h.type);
  Reply out;
  bool opened_now = false;
  {
    std::lock_guard lock(mutex_);
    if (type == MessageType::open) {
      OpenRequest r;
      if (size_t(length) != sizeof r) {
        out = reply(false, "malformed open request");
      } else {
        std::memcpy(&r, message, sizeof r);
        out = open_locked(r, fds);
        explicit_bzero(r.credential, sizeof r.credential);  // the file's copy is the one kept
        opened_now = out.ok == 1;
      }
    } else if (!area_) {
      out = reply(false, "open a context first");
    } else {
      out = respond_locked(type, message, size_t(length));
    }
    close_all(fds);  // only the open takes descriptors
    notify_client_locked();
  }
  if (opened_now && shard_wake_fd_ >= 0) {
    // The shard may be asleep without this session's socket and bell in its
    // poll set: wake it so that it adds them.
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(shard_wake_fd_, &one, sizeof one);
  }
  // A refused tenant is answered and then disconnected: one guess per
  // connection, and the connection does not keep a client slot.
  return answer(out) && out.denied != refused_tenant;
}

Reply Session::respond_locked(MessageType type, const uint8_t* message, size_t length) {
  // Work posted before this request comes first (a deregistration must not
  // overtake the sends that use the region; an attach its receives).
  drain_submissions_locked();
  Reply out;
  switch (type) {
    case MessageType::register_memory: {
      RegisterRequest r;
      if (length != sizeof r) {
        out = reply(false, "malformed register request");
        break;
      }
      std::memcpy(&r, message, sizeof r);
      out = register_memory(r);
      break;
    }
    case MessageType::deregister_memory: {
      KeyRequest r;
      if (length != sizeof r) {
        out = reply(false, "malformed deregister request");
        break;
      }
      std::memcpy(&r, message, sizeof r);
      auto it = mrs_.find(r.lkey);
      if (it == mrs_.end()) {
        out = reply(false, "deregister_memory: no region with lkey %u in this context", r.lkey);
        break;
      }
      rkey_to_lkey_.erase(it->second.rkey);
      if (usage_) usage_->registered_bytes -= it->second.length;
      mrs_.erase(it);
      ++generation_;  // engines re-check posted segments before touching them
      out = reply(true);
      break;
    }
    case MessageType::attach: {
      AttachRequest r;
      if (length != sizeof r) {
        out = reply(false, "malformed attach request");
        break;
      }
      std::memcpy(&r, message, sizeof r);
      out = attach(r);
      break;
    }
    case MessageType::detach: {
      HandleRequest r;
      if (length != sizeof r) {
        out = reply(false, "malformed detach request");
        break;
      }
      std::memcpy(&r, message, sizeof r);
      auto it = qps_.find(r.handle);
      if (it == qps_.end()) {
        out = reply(false, "detach: no QP handle %u in this context", r.handle);
        break;
      }
      host_.detach_locked(it->second->engine);
      engine_keys_.erase(it->second->key);
      completion_budget_ -= uint64_t(it->second->max_send_wr) + it->second->max_recv_wr;
      release_quota(*it->second);
      qps_.erase(it);
      --stats_.engines;
      out = reply(true);
      break;
    }
    case MessageType::enter_error: {
      HandleRequest r;
      if (length != sizeof r) {
        out = reply(false, "malformed enter_error request");
        break;
      }
      std::memcpy(&r, message, sizeof r);
      auto it = qps_.find(r.handle);
      if (it == qps_.end()) {
        out = reply(false, "enter_error: no QP handle %u in this context", r.handle);
        break;
      }
      Qp& qp = *it->second;
      host_.enter_error_locked(qp.engine);  // flushes what the engine holds, in order
      for (const Qp::Backlogged& b : qp.backlog)  // then what it had no room for yet
        fail_locked(qp, b.w.wr_id, false, off::CompletionStatus::work_request_flushed, b.w.opcode);
      qp.backlog.clear();
      out = reply(true);
      out.completions_produced = completion_tail_ + overflow_.size();
      break;
    }
    case MessageType::flush_acknowledgements:
      host_.flush_acknowledgements_locked(monotonic_ns());
      out = reply(true);
      break;
    case MessageType::counters:
      out = reply(true);
      out.counters = host_.counters_locked();
      out.counters.refused_entries = refused_;
      out.counters.engine_cpu_ns = process_cpu_ns();
      out.sessions = stats_.sessions.load();
      out.engines = stats_.engines.load();
      break;
    case MessageType::flow_report: {
      HandleRequest r;
      if (length != sizeof r) {
        out = reply(false, "malformed flow_report request");
        break;
      }
      std::memcpy(&r, message, sizeof r);
      // This context's rows (its QPs, live and detached), by job and class.
      const std::vector<FlowReport> rows = host_.flow_report_locked();
      out = reply(true);
      out.rows = uint32_t(rows.size());
      if (r.handle < rows.size()) {
        const FlowReport& row = rows[r.handle];
        out.traffic_class = row.label.traffic_class;
        out.engines = row.engines;
        out.counters.engines = row.counters;
        out.waits = row.waits;
        std::snprintf(out.message, sizeof out.message, "%s", row.label.job.c_str());
      }
      break;
    }
    default:
      out = reply(false, "unknown request type %u", unsigned(type));
      break;
  }
  return out;
}

// ---------------------------------------------------------------------------
// A shard: one thread progressing its sessions.

class Shard {
 public:
  // One flow scheduler for every context the shard serves: its share of
  // the daemon's rate (--tx-rate), the tenants' weights and rate limits.
  Shard(const DaemonOptions& options, unsigned index, const TenantBook& book)
      : options_(options), index_(index), scheduler_(std::make_shared<host::SharedScheduler>()) {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    const uint64_t now = monotonic_ns();
    const uint64_t rate = options.tx_rate_bytes_per_s;
    scheduler_->scheduler.set_link_rate(rate ? std::max<uint64_t>(1, rate / options.cores) : 0, 0, now);
    for (auto& [name, t] : book.tenants)
      scheduler_->scheduler.set_tenant(name, host::TenantShare{t.entry.weight, t.entry.rate_bytes_per_s, t.entry.burst_bytes}, now);
  }
  unsigned index() const { return index_; }
  const std::shared_ptr<host::SharedScheduler>& scheduler() const { return scheduler_; }
  ~Shard() {
    stop();
    ::close(wake_fd_);
  }
  void start() {
    running_.store(true);
    thread_ = std::thread([this] { run(); });
  }
  void stop() {
    running_.store(false);
    if (thread_.joinable()) {
      wake();
      thread_.join();
    }
  }
  void add(std::shared_ptr<Session> s) {
    s->set_shard_wake(wake_fd_);
    {
      std::lock_guard lock(mutex_);
      sessions_.push_back(std::move(s));
      ++version_;
    }
    wake();
  }
  void remove(const Session* s) {
    std::lock_guard lock(mutex_);
    std::erase_if(sessions_, [&](auto& p) { return p.get() == s; });
    ++version_;
  }
  size_t size() {
    std::lock_guard lock(mutex_);
    return sessions_.size();
  }
  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_fd_, &one, sizeof one);
  }

 private:
  void run();
  void sleep(std::vector<std::shared_ptr<Session>>& sessions);
  // Serves in the scheduler's order across the shard's contexts: each
  // context's round yields when another's flow is next, so after the pass
  // the owners of the next flows transmit in turn (a bounded number of
  // grants, then the shard receives again). True if anything went.
  bool dispatch(std::vector<std::shared_ptr<Session>>& sessions);

  const DaemonOptions& options_;
  unsigned index_;
  std::shared_ptr<host::SharedScheduler> scheduler_;
  int wake_fd_ = -1;
  std::mutex mutex_;
  std::vector<std::shared_ptr<Session>> sessions_;
  uint64_t version_ = 0;
  std::thread thread_;
  std::atomic<bool> running_{false};
  host::ContentionDetector contention_;  // this shard thread's preemptions
};

void Shard::run() {
  std::vector<std::shared_ptr<Session>> mine;
  uint64_t seen = UINT64_MAX;
  uint64_t idle_since = monotonic_ns();
  while (running_.load(std::memory_order_relaxed)) {
    {
      std::lock_guard lock(mutex_);
      if (version_ != seen) mine = sessions_, seen = version_;
    }
    bool work = false;
    for (auto& s : mine) {
      if (!s->opened() || s->broken()) continue;
      std::lock_guard lock(s->mutex());
      work = s->host().progress_locked(monotonic_ns()) || work;
      s->notify_client_locked();
    }
    if (mine.size() > 1) work = dispatch(mine) || work;
    const uint64_t now = monotonic_ns();
    if (work) {
      idle_since = now;
      continue;
    }
    // Busy polling is the default (a SmartNIC core does nothing else), but
    // a shard with no context to serve sleeps whatever the policy.
    if (mine.empty() || (!options_.busy_poll && now - idle_since >= options_.spin_ns)) {
      sleep(mine);
      idle_since = monotonic_ns();
    } else if (contention_.check(now)) {
      // Preempted: the daemon shares its CPUs with the applications it
      // serves (a host, not a SmartNIC). Spinning through their time slices
      // took a two-process ping-pong on two CPUs from ~37 us to 4 ms a round
      // trip; an idle round gives the core away instead.
      sched_yield();
    }
  }
}

bool Shard::dispatch(std::vector<std::shared_ptr<Session>>& sessions) {
  bool work = false;
  for (int turn = 0; turn < 64; ++turn) {
    const void* owner = nullptr;
    {
      std::lock_guard lock(scheduler_->lock);
      host::FlowScheduler::Flow flow;
      uint64_t budget;
      if (!scheduler_->scheduler.next(monotonic_ns(), flow, budget)) break;
      owner = scheduler_->scheduler.owner(flow);
    }
    Session* s = nullptr;
    for (auto& candidate : sessions)
      if (&candidate->host() == owner) s = candidate.get();
    if (!s) break;  // placed on us after this pass began: the next pass has it
    std::lock_guard lock(s->mutex());
    if (!s->opened() || s->broken()) {
      s->host().withdraw_locked(monotonic_ns());  // going: its flows must not hold up the others
      continue;
    }
    if (s->host().serve_scheduled_locked(monotonic_ns())) work = true;
    s->notify_client_locked();
  }
  return work;
}

void Shard::sleep(std::vector<std::shared_ptr<Session>>& sessions) {
  // Announce the sleep in every area, then look at the rings once more: a
  // client posting meanwhile sees the announcement and rings the doorbell.
  std::vector<pollfd> fds;
  std::vector<Session*> bells;  // whose bell is fds[2 + 2 i]
  fds.push_back({wake_fd_, POLLIN, 0});
  uint64_t wake = UINT64_MAX;
  const uint64_t now = monotonic_ns();
  bool pending = false;
  for (auto& s : sessions) {
    if (!s->opened() || s->broken()) continue;
    s->area()->daemon_sleeping.value.store(1, std::memory_order_seq_cst);
    if (s->submissions_waiting()) pending = true;
    std::lock_guard lock(s->mutex());
    wake = std::min(wake, s->host().next_wakeup_locked(now));
    fds.push_back({s->host().fd(), POLLIN, 0});
    fds.push_back({s->bell_fd(), POLLIN, 0});
    bells.push_back(s.get());
  }
  if (!pending && wake > now) {
    const uint64_t sleep_ns = std::min<uint64_t>(wake - now, 100'000'000);
    const timespec timeout{time_t(sleep_ns / 1'000'000'000), long(sleep_ns % 1'000'000'000)};
    ::ppoll(fds.data(), fds.size(), &timeout, nullptr);
  }
  for (auto& s : sessions)
    if (s->opened()) s->area()->daemon_sleeping.value.store(0, std::memory_order_relaxed);
  // The shard's own eventfd and the doorbells are read here; the UDP
  // sockets by progress.
  if (fds[0].revents & POLLIN) {
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof v);
  }
  for (size_t i = 0; i < bells.size(); ++i)
    if (fds[2 + 2 * i].revents & POLLIN) bells[i]->drain_doorbells();
}

// ---------------------------------------------------------------------------

Daemon::Daemon(DaemonOptions options)
    : options_(std::move(options)), stats_(std::make_unique<Stats>()), tenants_(std::make_unique<TenantBook>()) {}

Daemon::~Daemon() {
  for (auto& shard : shards_) shard->stop();
  sessions_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(options_.socket_path.c_str());
  }
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

std::optional<std::string> Daemon::start() {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (options_.socket_path.empty() || options_.socket_path.size() >= sizeof address.sun_path)
    return "socket path empty or longer than " + std::to_string(sizeof address.sun_path - 1) + " bytes";
  std::memcpy(address.sun_path, options_.socket_path.data(), options_.socket_path.size());
  if (options_.cores == 0 || options_.cores > 256) return std::string("--cores must be in [1, 256]");
  if (!options_.tenants_file.empty()) {
    std::string error;
    auto listed = host::load_tenants_file(options_.tenants_file, error);
    if (!listed) return error;
    tenants_->enabled = true;
    // Every tenant gets its partition key here, as an application reading
    // the same file assigns them: listed keys first, then the others from
    // 0x8001 up in name order, skipping listed ones. The open's reply tells
    // the application its key; attaches with another are refused.
    std::set<uint16_t> used;
    for (auto& [name, entry] : *listed)
      if (entry.pkey) used.insert(entry.pkey);
    uint16_t next = 0x8001;
    for (auto& [name, entry] : *listed) {
      if (!entry.pkey) {
        while (used.count(next)) ++next;
        entry.pkey = next;
        used.insert(next);
      }
      tenants_->tenants[name].entry = entry;
    }
  }
  // A socket file nobody answers on is a dead daemon's: replace it. One
  // somebody answers on is a live daemon's: leave it alone.
  const int probe = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (::connect(probe, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    ::close(probe);
    return "another stellar-engined serves " + options_.socket_path;
  }
  ::close(probe);
  ::unlink(options_.socket_path.c_str());
  listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) return std::string("socket: ") + std::strerror(errno);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0)
    return "bind " + options_.socket_path + ": " + std::strerror(errno);
  // Anyone may connect; the allow-list decides who is served.
  ::chmod(options_.socket_path.c_str(), 0666);
  if (::listen(listen_fd_, 64) != 0) return std::string("listen: ") + std::strerror(errno);
  stop_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  return std::nullopt;
}

void Daemon::run() {
  // Threads start here, not in start(): a daemon that detaches (fork) in
  // between keeps only the thread that forked.
  for (unsigned i = 0; i < options_.cores; ++i) {
    shards_.push_back(std::make_unique<Shard>(options_, i, *tenants_));
    shards_.back()->start();
  }
  say("serving %s with %u shard thread%s, %s", options_.socket_path.c_str(), options_.cores, options_.cores == 1 ? "" : "s",
      options_.busy_poll ? "busy polling" : "adaptive wait");
  if (tenants_->enabled)
    say("tenants: %zu from %s (only they are served)", tenants_->tenants.size(), options_.tenants_file.c_str());
  if (options_.tx_rate_bytes_per_s)
    say("transmit rate: %llu bytes/s (%llu per shard)", (unsigned long long)options_.tx_rate_bytes_per_s,
        (unsigned long long)(options_.tx_rate_bytes_per_s / options_.cores));
  serve_clients();
}

void Daemon::stop() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(stop_fd_, &one, sizeof one);
}

bool Daemon::allowed(const ucred& cred, const std::vector<gid_t>& groups) const {
  if (options_.allow_uids.empty() && options_.allow_gids.empty()) return cred.uid == 0 || cred.uid == ::geteuid();
  auto listed = [](const auto& list, auto id) { return std::find(list.begin(), list.end(), id) != list.end(); };
  if (listed(options_.allow_uids, cred.uid) || listed(options_.allow_gids, cred.gid)) return true;
  for (gid_t g : groups)
    if (listed(options_.allow_gids, g)) return true;
  return false;
}

void Daemon::accept_client() {
  // Non-blocking like the listening socket: the control thread never waits
  // on one client (answers are sent with MSG_DONTWAIT).
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // The connection stays queued and the listening socket readable:
      // stop looking at it for a while instead of spinning on it.
      accept_paused_until_ns_ = monotonic_ns() + 100'000'000;
      if (refused_clients_++ < 16) say("accept: %s: not accepting for 100 ms", std::strerror(errno));
    }
    return;
  }
  ucred cred{};
  socklen_t length = sizeof cred;
  const bool have_cred = ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) == 0;
  // Supplementary groups as the kernel recorded them at connect(), not as
  // the process has them now.
  std::vector<gid_t> groups(256);
  socklen_t bytes = socklen_t(groups.size() * sizeof(gid_t));
  groups.resize(have_cred && ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) == 0 ? bytes / sizeof(gid_t) : 0);
  // Told why, then closed: a refused client gets an error, not a hang.
  auto refuse = [&](bool denied, const std::string& why) {
    Reply r;
    r.h = {uint32_t(MessageType::reply), sizeof r};
    r.denied = denied ? 1 : 0;
    std::snprintf(r.message, sizeof r.message, "%s", why.c_str());
    send_message(fd, &r, sizeof r, nullptr, 0, MSG_DONTWAIT);
    ::close(fd);
    if (refused_clients_++ < 16) say("refused pid %d uid %d gid %d: %s", int(cred.pid), int(cred.uid), int(cred.gid), why.c_str());
  };
  if (!have_cred || !allowed(cred, groups))
    return refuse(true, "uid " + std::to_string(cred.uid) + " gid " + std::to_string(cred.gid) +
                            " is not allowed to use this engine daemon (its --allow-uid/--allow-gid list)");
  if (sessions_.size() >= options_.max_clients)
    return refuse(false, "the daemon already serves its maximum of " + std::to_string(options_.max_clients) + " clients (--max-clients)");
  // A shard takes it once it has opened its context (place()).
  sessions_.push_back(std::make_shared<Session>(fd, cred, peer_pidfd(fd, cred.pid), options_, *stats_, *tenants_));
}

void Daemon::place(const std::shared_ptr<Session>& session) {
  // A tenant's contexts share one shard, so that its weight and rate limit
  // hold across them (one scheduler per shard); a tenant new to the daemon,
  // and every context without tenants, goes to the least loaded shard.
  TenantBook::Usage* usage = session->tenant_usage();
  Shard* shard = nullptr;
  if (usage && usage->shard >= 0) {
    shard = shards_[size_t(usage->shard)].get();
  } else {
    shard = shards_[next_shard_++ % shards_.size()].get();
    for (auto& s : shards_)
      if (s->size() < shard->size()) shard = s.get();
  }
  if (usage) usage->shard = int(shard->index());
  session->set_shard(int(shard->index()));
  {
    std::lock_guard lock(session->mutex());
    session->host().use_scheduler_locked(shard->scheduler());
  }
  shard->add(session);
}

void Daemon::close_session(size_t index) {
  std::shared_ptr<Session> s = sessions_[index];
  sessions_.erase(sessions_.begin() + long(index));
  for (auto& shard : shards_) shard->remove(s.get());
  s->teardown();
  say("client pid %d: gone; its QPs freed, its memory never touched again", int(s->credentials().pid));
}

namespace {
constexpr uint64_t open_deadline_ns = 10'000'000'000;  // connect to open
}  // namespace

void Daemon::serve_clients() {
  std::vector<uint8_t> buffer(max_message_bytes);
  std::vector<int> fds;
  for (;;) {
    // Out of descriptors a while ago: the listening socket sits out (fd -1
    // is ignored by poll) until the pause is over.
    const bool accepting = monotonic_ns() >= accept_paused_until_ns_;
    std::vector<pollfd> polled{{stop_fd_, POLLIN, 0}, {accepting ? listen_fd_ : -1, POLLIN, 0}};
    for (auto& s : sessions_) polled.push_back({s->socket(), POLLIN, 0});
    if (::poll(polled.data(), polled.size(), accepting ? 1000 : 100) < 0 && errno != EINTR) break;
    if (polled[0].revents & POLLIN) break;
    // A connection that has not opened a context within the limit is
    // dropped: an idle socket must not hold a client slot for good.
    const uint64_t now = monotonic_ns();
    for (size_t i = sessions_.size(); i-- > 0;)
      if (!sessions_[i]->opened() && now - sessions_[i]->accepted_at() > open_deadline_ns) {
        say("client pid %d: no context opened within %llu s: disconnected", int(sessions_[i]->credentials().pid),
            (unsigned long long)(open_deadline_ns / 1'000'000'000));
        close_session(i);
        polled.erase(polled.begin() + long(i) + 2);
      }
    if (polled[1].revents & POLLIN) accept_client();
    // Back to front: closing a session shifts the ones behind it.
    for (size_t i = polled.size() - 1; i >= 2; --i) {
      const size_t index = i - 2;
      if (!polled[i].revents) continue;
      Session& s = *sessions_[index];
      bool keep = !s.broken();
      if (keep && (polled[i].revents & POLLIN)) {
        const long n = receive_message(s.socket(), buffer.data(), buffer.size(), fds, max_message_fds, 0);
        if (n <= 0) {
          keep = n < 0 && errno == EMSGSIZE ? s.handle(buffer.data(), 0, fds) : false;
        } else {
          keep = s.handle(buffer.data(), n, fds);
          explicit_bzero(buffer.data(), size_t(n));  // an open's credential
        }
        if (keep && s.opened() && s.shard() < 0) place(sessions_[index]);
      } else if (polled[i].revents & (POLLHUP | POLLERR)) {
        keep = false;
      }
      if (!keep) close_session(index);
    }
  }
  while (!sessions_.empty()) close_session(sessions_.size() - 1);
  say("stopped");
}

}  // namespace stellar::engined

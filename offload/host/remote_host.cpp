#include "host/remote_host.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>


namespace stellar::host {

namespace off = stellar::offload;
using namespace stellar::host::daemon;

namespace {

constexpr uint32_t submit_capacity = 1024;      // work requests in flight to the daemon
constexpr uint32_t completion_capacity = 8192;  // completions the daemon may queue before we poll
constexpr int reply_timeout_ms = 5000;          // a daemon that takes longer is treated as gone
constexpr uint64_t liveness_period_ns = 1'000'000;  // how often progress looks at the socket

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

struct RemoteHost::Engine final : Host::Engine {
  uint32_t handle = 0;
  off::CompletionSink* sink = nullptr;
  uint32_t qpn = 0, max_send_wr = 0, max_recv_wr = 0;
  off::EngineConfig config;  // what check_send_work needs (mode, mtu)
  // Sequence numbers (the soft provider's engine-side wr_ids, 1, 2, ...):
  // the last posted and the last completed. A queue completes in order, so
  // a completion of N says every WR up to N is done, unsignaled ones too.
  uint64_t sends_posted = 0, sends_completed = 0, receives_posted = 0, receives_completed = 0;
  std::vector<uint8_t> send_opcodes;  // by sequence % max_send_wr: for the flush after the daemon died
  bool error = false;
};

RemoteHost::RemoteHost(std::mutex& lock, HostClient& client) : lock_(lock), client_(client) {}

RemoteHost::~RemoteHost() {
  // Closing the socket is the detach of everything: the daemon flushes and
  // frees this context's QPs and unmaps its memory.
  if (socket_ >= 0) ::close(socket_);
  if (area_memory_) ::munmap(area_memory_, area_bytes_);
  for (int fd : {area_fd_, bell_fd_, kick_fd_})
    if (fd >= 0) ::close(fd);
}

std::optional<SocketError> RemoteHost::open(const HostOptions& options) {
  options_ = options;
  path_ = options.daemon_socket;
  auto fail = [&](const std::string& message, bool invalid = false) { return SocketError{invalid, message}; };
  if (options.tenant.size() >= sizeof OpenRequest::tenant)
    return fail("tenant name longer than " + std::to_string(sizeof OpenRequest::tenant - 1) + " bytes", true);
  if (options.credential.size() >= sizeof OpenRequest::credential)
    return fail("tenant credential longer than " + std::to_string(sizeof OpenRequest::credential - 1) + " bytes", true);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path_.empty() || path_.size() >= sizeof address.sun_path)
    return fail("engine daemon socket path '" + path_ + "' is empty or longer than " + std::to_string(sizeof address.sun_path - 1) +
                    " bytes",
                true);
  std::memcpy(address.sun_path, path_.data(), path_.size());
  socket_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (socket_ < 0) return fail(errno_text("socket(AF_UNIX)"));
  if (::connect(socket_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0)
    return fail("cannot reach stellar-engined at " + path_ + ": " + std::strerror(errno) +
                " (is it running? start it with `stellar-engined --socket " + path_ + "`)");

  // The shared area: sealed against shrinking, or a client could make the
  // daemon's accesses fault (the daemon refuses an unsealed one).
  area_bytes_ = daemon::area_bytes(submit_capacity, completion_capacity);
  area_fd_ = ::memfd_create("stellar-rings", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (area_fd_ < 0) return fail(errno_text("memfd_create"));
  if (::ftruncate(area_fd_, off_t(area_bytes_)) != 0) return fail(errno_text("ftruncate"));
  if (::fcntl(area_fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) return fail(errno_text("F_ADD_SEALS"));
  area_memory_ = ::mmap(nullptr, area_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, area_fd_, 0);
  if (area_memory_ == MAP_FAILED) {
    area_memory_ = nullptr;
    return fail(errno_text("mmap"));
  }
  area_ = new (area_memory_) SharedArea{};
  area_->submit_capacity = submit_capacity;
  area_->completion_capacity = completion_capacity;
  submit_ = submit_ring(area_memory_);
  completions_ = completion_ring(area_memory_, submit_capacity);
  // The bells: one datagram socket pair, ours and the daemon's end. A
  // datagram to the daemon's end is a doorbell (work in the ring), one to
  // ours a wake-up (completions in the ring). The kick eventfd is ours
  // alone: it wakes our own sleepers (kick()).
  int bells[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, bells) != 0) return fail(errno_text("socketpair"));
  bell_fd_ = bells[0];
  kick_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (kick_fd_ < 0) {
    ::close(bells[1]);
    return fail(errno_text("eventfd"));
  }

  OpenRequest r;
  r.h = {uint32_t(MessageType::open), sizeof r};
  if (options.bind_address.size() >= sizeof r.bind_address) return fail("bind address too long", true);
  std::memcpy(r.bind_address, options.bind_address.data(), options.bind_address.size());
  r.udp_port = options.udp_port;
  r.mode = uint8_t(options.mode);
  r.mtu = options.mtu;
  r.drop = options.faults.drop;
  r.duplicate = options.faults.duplicate;
  r.reorder = options.faults.reorder;
  r.seed = options.faults.seed;
  r.paths = options.paths;
  std::memcpy(r.tenant, options.tenant.data(), options.tenant.size());
  std::memcpy(r.credential, options.credential.data(), options.credential.size());
  r.submit_capacity = submit_capacity;
  r.completion_capacity = completion_capacity;
  r.area_bytes = area_bytes_;
  const int fds[2] = {area_fd_, bells[1]};
  Reply reply;
  std::string error;
  const bool opened = call_locked(&r, sizeof r, reply, error, fds, 2);
  explicit_bzero(r.credential, sizeof r.credential);
  ::close(bells[1]);  // the daemon has its own copy now
  if (!opened) {
    SocketError e{!denied_ && error.find("address") != std::string::npos, error};
    e.permission_denied = denied_;
    return e;
  }
  local_.sin_family = AF_INET;
  local_.sin_addr.s_addr = reply.local_address;
  local_.sin_port = reply.local_port;
  gso_ = reply.gso;
  gro_ = reply.gro;
  daemon_pid_ = reply.daemon_pid;
  tenant_pkey_ = uint16_t(reply.tenant_pkey);
  tenant_ = options.tenant;
  // The daemon reads and writes registered memory through /proc/PID/mem,
  // which Yama's ptrace_scope 1 allows only to a declared tracer.
  // (Without Yama this fails harmlessly; a daemon with CAP_SYS_PTRACE needs
  // nothing.) Registration checks that the daemon can reach us.
  ::prctl(PR_SET_PTRACER, daemon_pid_, 0, 0, 0);
  return std::nullopt;
}

int RemoteHost::fd() const {
  // Someone will wait on it outside our sleep_until_work (an epoll loop):
  // the daemon must write it after every batch of completions, not only
  // when a waiter announced itself.
  if (area_) area_->client_events.value.store(1, std::memory_order_seq_cst);
  return bell_fd_;
}

bool RemoteHost::call_locked(const void* request, size_t length, Reply& reply, std::string& error, const int* fds,
                             int fd_count) const {
  quota_refused_ = false;  // this request's answer, not an earlier one's
  if (dead_) {
    error = "stellar-engined at " + path_ + " is gone";
    return false;
  }
  if (!send_message(socket_, request, length, fds, fd_count)) {
    const std::string why = std::strerror(errno);
    // A daemon that refused us said why before it closed: read that.
    std::vector<int> none;
    Reply refusal{};
    if (receive_message(socket_, &refusal, sizeof refusal, none, 0, 100) == long(sizeof refusal) && refusal.ok == 0) {
      refusal.message[sizeof refusal.message - 1] = 0;
      error = std::string("stellar-engined: ") + refusal.message;
      denied_ = refusal.denied == refused_user || refusal.denied == refused_tenant;
      dead_ = true;  // refused, not gone: the caller reports it
      return false;
    }
    error = "stellar-engined at " + path_ + " is gone (" + why + ")";
    daemon_died_locked(why);
    return false;
  }
  std::vector<int> received;
  reply = Reply{};
  long n = receive_message(socket_, &reply, sizeof reply, received, 0, reply_timeout_ms);
  // A daemon that closed with our request unread (it refused us at accept)
  // makes the first receive report ECONNRESET; its answer is still queued.
  if (n < 0 && errno == ECONNRESET) n = receive_message(socket_, &reply, sizeof reply, received, 0, 0);
  if (n != long(sizeof reply) || reply.h.type != uint32_t(MessageType::reply)) {
    const std::string why = n == 0 ? "it closed the connection"
                            : n < 0 && errno == ETIMEDOUT ? "no reply within 5 s"
                            : n < 0 ? std::string(std::strerror(errno))
                                    : "a malformed reply";
    daemon_died_locked(why);
    error = "stellar-engined at " + path_ + ": " + why;
    return false;
  }
  if (reply.ok != 1) {
    denied_ = reply.denied == refused_user || reply.denied == refused_tenant;
    quota_refused_ = reply.denied == refused_quota;
    reply.message[sizeof reply.message - 1] = 0;
    error = std::string("stellar-engined: ") + reply.message;
    return false;
  }
  return true;
}

void RemoteHost::daemon_died_locked(const std::string& why) const {
  if (dead_) return;
  dead_ = true;
  // A daemon that stopped answering may only be slow: hang up, so that it
  // tears this context down (and stops touching its memory) when it looks.
  if (socket_ >= 0) ::shutdown(socket_, SHUT_RDWR);
  std::fprintf(stderr, "stellar: the engine daemon at %s is gone (%s): every QP of this context is now in ERROR\n", path_.c_str(),
               why.c_str());
}

std::optional<std::string> RemoteHost::register_memory_locked(const MemoryRegistration& m) {
  RegisterRequest r;
  r.h = {uint32_t(MessageType::register_memory), sizeof r};
  r.pd = m.pd;
  r.lkey = m.lkey;
  r.rkey = m.rkey;
  r.access = m.access;
  r.address = m.address;
  r.length = m.length;
  Reply reply;
  std::string error;
  if (!call_locked(&r, sizeof r, reply, error)) return error;
  return std::nullopt;
}

void RemoteHost::deregister_memory_locked(uint32_t lkey) {
  KeyRequest r;
  r.h = {uint32_t(MessageType::deregister_memory), sizeof r};
  r.lkey = lkey;
  Reply reply;
  std::string error;
  // Waits for the reply: once it returns the daemon will not touch the
  // region again (or is gone), and the application may free the memory.
  if (!call_locked(&r, sizeof r, reply, error) && !dead_)
    std::fprintf(stderr, "stellar: deregistering lkey %u in the engine daemon: %s\n", lkey, error.c_str());
}

Host::Engine* RemoteHost::attach_locked(const off::EngineConfig& config, const sockaddr_in& peer, const QpBinding& binding,
                                        off::MemoryAccess&, off::CompletionSink& sink, std::string& error) {
  AttachRequest r = attach_request(config);
  r.peer_address = peer.sin_addr.s_addr;
  r.peer_port = peer.sin_port;
  r.pd = binding.pd;
  r.access = binding.access;
  r.traffic_class = binding.label.traffic_class;
  r.dscp = binding.dscp;
  if (binding.label.job.size() >= sizeof r.job) {
    error = "job name longer than " + std::to_string(sizeof r.job - 1) + " bytes";
    return nullptr;
  }
  std::memcpy(r.job, binding.label.job.data(), binding.label.job.size());
  r.job_weight = std::max<uint32_t>(binding.label.job_weight, 1);
  r.step_period_ns = binding.label.step_period_ns;
  r.deadline_ns = binding.label.deadline_ns;
  Reply reply;
  if (!call_locked(&r, sizeof r, reply, error)) return nullptr;
  auto e = std::make_unique<Engine>();
  e->handle = reply.handle;
  e->sink = &sink;
  e->qpn = config.local_qpn;
  e->max_send_wr = config.max_send_wr;
  e->max_recv_wr = config.max_recv_wr;
  e->config = config;
  e->send_opcodes.assign(std::max<uint32_t>(config.max_send_wr, 1), 0);
  Engine* handle = e.get();
  engines_[reply.handle] = std::move(e);
  return handle;
}

void RemoteHost::detach_locked(Host::Engine* handle) {
  auto* e = static_cast<Engine*>(handle);
  // Completions still in the ring for it are the QP's: deliver them first.
  drain_completions_locked();
  HandleRequest r;
  r.h = {uint32_t(MessageType::detach), sizeof r};
  r.handle = e->handle;
  Reply reply;
  std::string error;
  if (!call_locked(&r, sizeof r, reply, error) && !dead_)
    std::fprintf(stderr, "stellar: detaching QP %u in the engine daemon: %s\n", e->qpn, error.c_str());
  engines_.erase(e->handle);
}

bool RemoteHost::push_locked(const SubmitEntry& entry) {
  const uint64_t deadline = monotonic_ns() + uint64_t(reply_timeout_ms) * 1'000'000;
  while (submit_tail_ - area_->submit_head.value.load(std::memory_order_acquire) >= submit_capacity) {
    // The daemon is behind by a whole ring: wake it and let it catch up.
    ring_doorbell();
    check_daemon_locked(0);
    if (dead_ || monotonic_ns() > deadline) {
      daemon_died_locked("its submission ring stayed full for 5 s");
      return false;
    }
    sched_yield();
  }
  submit_[submit_tail_ & (submit_capacity - 1)] = entry;
  ++submit_tail_;
  area_->submit_tail.value.store(submit_tail_, std::memory_order_release);
  return true;
}

off::PostResult RemoteHost::post_send_locked(Host::Engine* handle, const off::SendWork& w, uint64_t) {
  auto* e = static_cast<Engine*>(handle);
  // As the engine would answer, now: a WR no QP could take fails here, not
  // later in the daemon as an error completion.
  if (const off::PostResult shape = off::check_send_work(w, e->config); shape != off::PostResult::ok) return shape;
  if (!dead_ && e->sends_posted - e->sends_completed >= e->max_send_wr) return off::PostResult::queue_full;
  e->sends_posted = w.wr_id;
  e->send_opcodes[w.wr_id % e->send_opcodes.size()] = uint8_t(w.opcode);
  if (dead_) {
    flush_everything_locked();  // this one too
    return off::PostResult::ok;
  }
  SubmitEntry s;
  s.kind = uint32_t(EntryKind::post_send);
  s.handle = e->handle;
  s.wr_id = w.wr_id;
  s.opcode = uint8_t(w.opcode);
  s.signaled = w.signaled;
  s.solicited = w.solicited;
  s.remote_addr = w.remote_addr;
  s.rkey = w.rkey;
  s.imm = w.imm;
  s.compare_add = w.compare_add;
  s.swap = w.swap;
  if (w.inline_data) {
    // Inline sources need not be registered: their bytes travel in the entry.
    s.inline_data = 1;
    uint32_t n = 0;
    for (uint32_t i = 0; i < w.segment_count; ++i) {
      const off::Segment& g = w.segments[i];
      if (n + g.length > off::max_inline_bytes) return off::PostResult::invalid_argument;
      if (g.length) std::memcpy(s.inline_bytes + n, g.address, g.length);
      n += g.length;
    }
    s.count = n;
  } else {
    s.count = w.segment_count;
    for (uint32_t i = 0; i < w.segment_count; ++i)
      s.segments[i] = WireSegment{reinterpret_cast<uint64_t>(w.segments[i].address), w.segments[i].length, w.segments[i].lkey};
  }
  if (!push_locked(s)) {
    flush_everything_locked();
    return off::PostResult::ok;
  }
  return off::PostResult::ok;
}

off::PostResult RemoteHost::post_receive_locked(Host::Engine* handle, const off::ReceiveWork& r) {
  auto* e = static_cast<Engine*>(handle);
  if (r.segment_count > off::max_segments) return off::PostResult::invalid_argument;
  if (!dead_ && e->receives_posted - e->receives_completed >= e->max_recv_wr) return off::PostResult::queue_full;
  e->receives_posted = r.wr_id;
  if (dead_) {
    flush_everything_locked();
    return off::PostResult::ok;
  }
  SubmitEntry s;
  s.kind = uint32_t(EntryKind::post_receive);
  s.handle = e->handle;
  s.wr_id = r.wr_id;
  s.count = r.segment_count;
  for (uint32_t i = 0; i < r.segment_count; ++i)
    s.segments[i] = WireSegment{reinterpret_cast<uint64_t>(r.segments[i].address), r.segments[i].length, r.segments[i].lkey};
  if (!push_locked(s)) flush_everything_locked();
  return off::PostResult::ok;
}

void RemoteHost::enter_error_locked(Host::Engine* handle) {
  auto* e = static_cast<Engine*>(handle);
  e->error = true;
  if (dead_) return flush_everything_locked();
  // Synchronous, as the in-process engine's: once this returns, everything
  // posted is flushed and its slots free (the application side reuses them).
  HandleRequest r;
  r.h = {uint32_t(MessageType::enter_error), sizeof r};
  r.handle = e->handle;
  Reply reply;
  std::string error;
  if (!call_locked(&r, sizeof r, reply, error)) {
    if (dead_) flush_everything_locked();
    return;
  }
  // The flushed completions are in the ring, or (a full ring) in the
  // daemon's overflow, which it moves over as we drain: the reply says how
  // many the daemon has produced in all, so we know when we have them
  // (counting this QP's sequence numbers would not do: an unsignaled last
  // WR completes nothing).
  const uint64_t deadline = monotonic_ns() + uint64_t(reply_timeout_ms) * 1'000'000;
  drain_completions_locked();
  while (int64_t(reply.completions_produced - completion_head_) > 0 && !dead_) {
    if (monotonic_ns() > deadline) {
      daemon_died_locked("its flushed completions did not arrive within 5 s");
      break;
    }
    ring_doorbell();
    sched_yield();
    drain_completions_locked();
  }
  if (dead_) return flush_everything_locked();
  // Everything posted before the request is flushed or was completed.
  e->sends_completed = e->sends_posted;
  e->receives_completed = e->receives_posted;
}

bool RemoteHost::in_error_locked(const Host::Engine* handle) const { return dead_ || static_cast<const Engine*>(handle)->error; }

uint32_t RemoteHost::outstanding_sends_locked(const Host::Engine* handle) const {
  auto* e = static_cast<const Engine*>(handle);
  return uint32_t(e->sends_posted - e->sends_completed);
}
uint32_t RemoteHost::outstanding_receives_locked(const Host::Engine* handle) const {
  auto* e = static_cast<const Engine*>(handle);
  return uint32_t(e->receives_posted - e->receives_completed);
}

void RemoteHost::ring_doorbell() {
  // Never blocks: a full buffer means the daemon has doorbells unread already.
  const char bell = 'd';
  [[maybe_unused]] ssize_t r = ::send(bell_fd_, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

void RemoteHost::drain_bell() {
  char bells[64];
  while (::recv(bell_fd_, bells, sizeof bells, MSG_DONTWAIT) > 0) {
  }
}

void RemoteHost::posted_locked(Host::Engine*, uint64_t) {
  // Dekker with the daemon: it announces its sleep, then looks at the ring
  // once more; we publish the entry, then look at its announcement. One of
  // the two sees the other.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (area_ && area_->daemon_sleeping.value.load(std::memory_order_seq_cst)) ring_doorbell();
}

size_t RemoteHost::drain_completions_locked() {
  if (!area_) return 0;
  const uint64_t tail = area_->completion_tail.value.load(std::memory_order_acquire);
  if (tail - completion_head_ > completion_capacity) {
    daemon_died_locked("its completion ring index is corrupt");
    return 0;
  }
  size_t n = 0;
  while (completion_head_ != tail) {
    const CompletionEntry c = completions_[completion_head_ & (completion_capacity - 1)];
    ++completion_head_;
    ++n;
    auto it = engines_.find(c.handle);
    if (it == engines_.end()) continue;  // a QP destroyed since
    Engine& e = *it->second;
    off::Completion out;
    out.wr_id = c.wr_id;
    out.status = off::CompletionStatus(c.status);
    out.opcode = off::CompletionOpcode(c.opcode);
    out.byte_length = c.byte_length;
    out.imm = c.imm;
    out.has_imm = c.has_imm;
    out.qp_number = c.qp_number;
    if (out.is_receive()) e.receives_completed = std::max(e.receives_completed, c.wr_id);
    else e.sends_completed = std::max(e.sends_completed, c.wr_id);
    // An error completion moves an RC QP to ERROR (the daemon's engine is there).
    if (out.status != off::CompletionStatus::success) e.error = true;
    e.sink->deliver(out);
  }
  area_->completion_head.value.store(completion_head_, std::memory_order_release);
  return n;
}

void RemoteHost::check_daemon_locked(uint64_t now) {
  if (dead_ || (now && now < next_liveness_check_ns_)) return;
  next_liveness_check_ns_ = now + liveness_period_ns;
  // The daemon never writes to the socket unasked: readable means EOF.
  pollfd p{socket_, POLLIN, 0};
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR))) daemon_died_locked("it closed the connection");
}

void RemoteHost::flush_everything_locked() {
  // What the daemon completed before it went comes first (the ring is ours
  // and still mapped), then what its engines held, which is lost with it:
  // every outstanding work request completes as flushed, as verbs does for
  // a QP in ERROR.
  drain_completions_locked();
  for (auto& [handle, e] : engines_) {
    e->error = true;
    for (uint64_t s = e->sends_completed + 1; s <= e->sends_posted; ++s) {
      off::Completion c;
      c.wr_id = s;
      c.status = off::CompletionStatus::work_request_flushed;
      c.opcode = off::completion_opcode(off::WorkOpcode(e->send_opcodes[s % e->send_opcodes.size()]));
      c.qp_number = e->qpn;
      e->sends_completed = s;
      e->sink->deliver(c);
    }
    for (uint64_t s = e->receives_completed + 1; s <= e->receives_posted; ++s) {
      off::Completion c;
      c.wr_id = s;
      c.status = off::CompletionStatus::work_request_flushed;
      c.opcode = off::CompletionOpcode::receive;
      c.qp_number = e->qpn;
      e->receives_completed = s;
      e->sink->deliver(c);
    }
  }
}

bool RemoteHost::progress_locked(uint64_t now) {
  client_.on_progress_locked(now);
  // Someone polls our bell outside sleep_until_work (fd()): it is readable
  // until drained, so drain it before looking at the ring (a wake-up sent
  // after this is for completions we have not seen yet).
  if (area_ && area_->client_events.value.load(std::memory_order_relaxed)) drain_bell();
  size_t n = drain_completions_locked();
  if (n == 0) check_daemon_locked(now);
  if (dead_) {
    // Whatever it completed before it went was delivered above; the rest is flushed.
    drain_completions_locked();
    flush_everything_locked();
  }
  return n > 0;
}

void RemoteHost::flush_acknowledgements_locked(uint64_t) {
  MessageHeader r{uint32_t(MessageType::flush_acknowledgements), sizeof(MessageHeader)};
  Reply reply;
  std::string error;
  (void)call_locked(&r, sizeof r, reply, error);
}

uint64_t RemoteHost::next_wakeup_locked(uint64_t now) { return client_.next_wakeup_locked(now); }

HostCounters RemoteHost::counters_locked() const {
  MessageHeader r{uint32_t(MessageType::counters), sizeof(MessageHeader)};
  Reply reply;
  std::string error;
  auto& self = const_cast<RemoteHost&>(*this);
  if (call_locked(&r, sizeof r, reply, error)) self.retired_ = reply.counters;
  return retired_;
}

std::vector<FlowReport> RemoteHost::flow_report_locked() const {
  // Row by row (a reply is one fixed message); the daemon's rows are this
  // context's, under the tenant it opened as. A row count that changes
  // between calls (a QP attached meanwhile) only cuts the report short.
  std::vector<FlowReport> out;
  for (uint32_t i = 0; i < 4096; ++i) {
    HandleRequest r;
    r.h = {uint32_t(MessageType::flow_report), sizeof r};
    r.handle = i;
    Reply reply;
    std::string error;
    if (!call_locked(&r, sizeof r, reply, error) || i >= reply.rows) break;
    FlowReport row;
    row.label.tenant = tenant_;
    reply.message[sizeof reply.message - 1] = 0;
    row.label.job = reply.message;
    row.label.traffic_class = uint8_t(std::min<uint32_t>(reply.traffic_class, 7));
    row.engines = reply.engines;
    row.counters = reply.counters.engines;
    row.waits = reply.waits;
    out.push_back(std::move(row));
    if (i + 1 >= reply.rows) break;
  }
  return out;
}

void RemoteHost::kick() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(kick_fd_, &one, sizeof one);
}

void RemoteHost::sleep_until_work(uint64_t limit_ns, int extra_fd) {
  uint64_t wake;
  {
    std::lock_guard lock(lock_);
    wake = client_.next_wakeup_locked(monotonic_ns());
  }
  const uint64_t now = monotonic_ns();
  const uint64_t until = std::min(limit_ns, wake);
  if (until <= now || dead_) return;
  // Announce the wait, then look at the ring once more (the daemon pushes,
  // then looks at the announcement): no completion is slept through.
  // A count, not a flag: several threads may wait at once (a CQ's waiter
  // and the completion watcher), and one waking must not unannounce another.
  // The head is read from the area (what the last drain published), not
  // from completion_head_: this runs without the lock. A stale head only
  // makes us return early.
  area_->client_waiting.value.fetch_add(1, std::memory_order_seq_cst);
  if (area_->completion_tail.value.load(std::memory_order_seq_cst) !=
      area_->completion_head.value.load(std::memory_order_relaxed)) {
    area_->client_waiting.value.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  pollfd fds[4] = {{bell_fd_, POLLIN, 0}, {kick_fd_, POLLIN, 0}, {socket_, POLLIN, 0}, {extra_fd, POLLIN, 0}};
  const uint64_t sleep_ns = std::min<uint64_t>(until - now, 1'000'000'000);
  const timespec timeout{time_t(sleep_ns / 1'000'000'000), long(sleep_ns % 1'000'000'000)};
  ::ppoll(fds, extra_fd >= 0 ? 4 : 3, &timeout, nullptr);
  area_->client_waiting.value.fetch_sub(1, std::memory_order_relaxed);
  if (fds[0].revents & POLLIN) drain_bell();
  if (fds[1].revents & POLLIN) {
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(kick_fd_, &v, sizeof v);
  }
  if (fds[2].revents) {
    std::lock_guard lock(lock_);
    next_liveness_check_ns_ = 0;
    check_daemon_locked(monotonic_ns());
  }
}

}  // namespace stellar::host

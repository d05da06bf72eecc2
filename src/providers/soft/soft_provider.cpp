// The soft provider's application side: context, tenants and their key
// spaces, PDs, MRs, CQs and QPs over offload engines. The engines run in an
// engine host (offload/host: the socket, fault filter, dispatch, timers,
// progress and the engine thread), reached through host::EngineHost only;
// GPU memory goes through pinned shadows (gpu_staging.hpp). Runs on any
// Linux host.
//
// Locking: one mutex per context guards tenants, memory tables, QPs and their
// engines (the engine host is given it); it is taken once per progress
// batch, not per packet. Each CQ has its own mutex (order: context, then CQ).
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/log.hpp"
#include "core/providers.hpp"
#include "core/tenants.hpp"
#include "gpu/cuda_driver.hpp"
#include "host/contention.hpp"
#include "host/engine_host.hpp"
#include "host/remote_host.hpp"
#include "providers/soft/gpu_staging.hpp"
#include "stellar/offload/engine.hpp"

namespace stellar::provider {
namespace {

namespace off = stellar::offload;
using namespace stellar::provider::soft;
using host::monotonic_ns;

// 64 bits from the kernel CSPRNG (getrandom(2)): connection tokens, memory
// keys, QP numbers and initial PSNs must not be predictable from earlier ones
// (docs/security.md). Requests of 8 bytes are never short once the pool is
// initialised; EINTR (a signal while it is not) is retried. Kernels without
// getrandom (before 3.17) fall back to /dev/urandom.
uint64_t kernel_random() {
  uint64_t v = 0;
  auto* p = reinterpret_cast<uint8_t*>(&v);
  size_t got = 0;
  while (got < sizeof v) {
    const ssize_t n = ::getrandom(p + got, sizeof v - got, 0);
    if (n > 0) {
      got += size_t(n);
    } else if (n < 0 && errno != EINTR) {
      std::random_device urandom("/dev/urandom");
      return uint64_t(urandom()) << 32 | urandom();
    }
  }
  return v;
}

// The public and engine opcodes are cast into each other: every entry must
// match, not just the last (statuses are one enum, completion_status.hpp).
constexpr bool same_opcodes() {
  constexpr std::pair<WcOpcode, off::CompletionOpcode> completions[] = {
      {WcOpcode::send, off::CompletionOpcode::send},           {WcOpcode::rdma_write, off::CompletionOpcode::rdma_write},
      {WcOpcode::rdma_read, off::CompletionOpcode::rdma_read}, {WcOpcode::compare_swap, off::CompletionOpcode::compare_swap},
      {WcOpcode::fetch_add, off::CompletionOpcode::fetch_add}, {WcOpcode::recv, off::CompletionOpcode::receive},
      {WcOpcode::recv_rdma_with_imm, off::CompletionOpcode::receive_rdma_with_imm}};
  constexpr std::pair<WrOpcode, off::WorkOpcode> works[] = {
      {WrOpcode::send, off::WorkOpcode::send},
      {WrOpcode::send_with_imm, off::WorkOpcode::send_with_imm},
      {WrOpcode::rdma_write, off::WorkOpcode::rdma_write},
      {WrOpcode::rdma_write_with_imm, off::WorkOpcode::rdma_write_with_imm},
      {WrOpcode::rdma_read, off::WorkOpcode::rdma_read},
      {WrOpcode::atomic_fetch_add, off::WorkOpcode::atomic_fetch_add},
      {WrOpcode::atomic_cmp_swap, off::WorkOpcode::atomic_compare_swap}};
  for (auto [a, b] : completions)
    if (int(a) != int(b)) return false;
  for (auto [a, b] : works)
    if (int(a) != int(b)) return false;
  return true;
}
static_assert(same_opcodes(), "WcOpcode/WrOpcode and the engine's opcodes must list the same entries in the same order");
static_assert(max_mtu == off::max_payload_bytes, "the public MTU limit and the engine's must agree");

class SoftContext;
class SoftQp;
class SoftPd;

// A remote endpoint the engine can work with (modify to RTR): the engine
// divides by the MTU and addresses 24-bit QP numbers; stellar mode needs the
// peer's connection token.
Status check_remote(const QpEndpoint& r, Mode mode) {
  auto bad = [](const std::string& what) { return Status(Errc::invalid_argument, "RTR: remote endpoint " + what); };
  if (r.mtu < 256) return bad("mtu " + std::to_string(r.mtu) + " is below 256");
  if (r.qp_num == 0 || r.qp_num > 0xffffff) return bad("qp_num " + std::to_string(r.qp_num) + " is not in [1, 0xffffff]");
  if (r.udp_port == 0) return bad("udp_port 0");
  if (mode == Mode::stellar && r.token == 0)
    return bad("token 0: a stellar-mode peer must send its connection token (a connection manager without token support?)");
  return {};
}

// The peer's IPv4 address must name one host: not 0.0.0.0, the broadcast
// address or a multicast group.
Status check_peer_address(const sockaddr_in& a, const std::string& text) {
  const uint32_t ip = ntohl(a.sin_addr.s_addr);
  if (ip == 0 || ip == 0xffffffffu || (ip >> 28) == 0xe)
    return Status(Errc::invalid_argument, "RTR: remote endpoint address " + text +
                                              " is not a unicast host address (0.0.0.0, broadcast or multicast)");
  return {};
}

struct MrEntry {
  uint64_t addr = 0, length = 0;
  uint32_t access = 0;
  const SoftPd* pd = nullptr;
  uint32_t lkey = 0, rkey = 0;
  uint8_t* host = nullptr;          // where the engine reads and writes: addr itself, or the GPU shadow
  std::shared_ptr<GpuShadow> gpu;   // GPU memory only
  uint64_t shadow_offset = 0;       // GPU: addr - gpu->device (a cached shadow may start lower)
  std::shared_ptr<ShadowCache::Reference> shadow_use;  // GPU: this region's use of the cached shadow
};

// Per posted WR, from post to completion: the user's wr_id (the engine
// carries the sequence number instead; a slot is reused only after the
// engine has freed the WR's queue entry) and staged GPU parts.
struct WrSlot {
  uint64_t wr_id = 0;
  bool signaled = true;
  bool staging_failed = false;       // a source copy failed: the WR completes with a local error
  std::vector<StagedPart> parts;     // GPU destinations, copied to the device at completion
  std::vector<StagedPart> sources;   // GPU sources, copied to the shadow at post (translate -> post_send)
};

struct Tenant {
  std::string name;
  uint16_t pkey = 0;
  TenantOptions options;          // weight, rate limit, quotas (the file's for a tenant it lists)
  bool from_file = false;         // listed in the tenants file: usable only once its credential was given
  bool opened = true;
  // Quota use and refusals (docs/scheduler.md, "Quotas").
  uint32_t qp_count = 0;
  uint64_t registered_bytes = 0;
  uint64_t quota_refusals = 0, credential_refusals = 0;
  std::unordered_set<SoftQp*> qps;  // every QP of the tenant (outstanding-WR quotas)
  std::unordered_map<uint32_t, MrEntry> by_rkey;
  std::unordered_map<uint32_t, uint32_t> lkey_to_rkey;
  // Of those, the regions in GPU memory: an inline payload's key is looked
  // up (to stage a GPU source) only while there are any.
  uint32_t gpu_regions = 0;
  std::unordered_map<uint32_t, bool> qpns;
  std::vector<GpuShadow*> dirty_gpu;  // GPU regions peers wrote since the last receive completion
  // Shadows whose dirty ranges a held receive completion (HeldCompletion) is
  // copying to the device, with the sequence of the latest such flush: every
  // later receive of this tenant, on any of its QPs, waits for them too (a
  // receive says every earlier write is in place).
  std::unordered_map<GpuShadow*, uint64_t> flushing;
  uint64_t flush_sequence = 0;

  uint32_t fresh_key() {
    for (;;) {
      const uint32_t k = uint32_t(kernel_random());
      if (k != 0 && !by_rkey.count(k) && !lkey_to_rkey.count(k)) return k;
    }
  }
  uint32_t fresh_qpn() {
    for (;;) {
      const uint32_t q = uint32_t(kernel_random() & 0xffffff);
      if (q > 1 && !qpns.count(q)) return q;
    }
  }
};

class SoftCq final : public CompletionQueue {
 public:
  SoftCq(std::shared_ptr<SoftContext> context, uint32_t entries);
  ~SoftCq() override {
    ::close(event_fd_);
    ::close(wait_fd_);
  }
  int poll(std::span<WorkCompletion> out) override;
  int poll(std::span<WorkCompletion> out, bool& work);  // work: the progress call moved something
  Result<int> wait(std::span<WorkCompletion> out, std::chrono::nanoseconds timeout) override;
  int fd() const override { return event_fd_; }
  Status request_notify() override;
  uint32_t capacity() const override { return uint32_t(ring_.size()); }

  void push(const off::Completion& c) {
    std::lock_guard lock(mutex_);
    if (count_ == ring_.size()) {
      ++overflows_;  // the CQ is undersized: like a verbs CQ overrun, the entry is lost
      return;
    }
    // head_ < size and count_ < size: the slot without a division.
    const size_t at = head_ + count_;
    WorkCompletion& w = ring_[at >= ring_.size() ? at - ring_.size() : at];
    w.wr_id = c.wr_id;
    w.status = c.status;  // one enum (completion_status.hpp)
    w.opcode = WcOpcode(int(c.opcode));
    w.byte_len = c.byte_length;
    w.imm_data = c.imm;
    w.has_imm = c.has_imm;
    w.qp_num = c.qp_number;
    ++count_;
    queued_.store(count_, std::memory_order_release);
    if (armed_.load(std::memory_order_relaxed)) signal();
    if (waiting_.load(std::memory_order_relaxed)) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t r = ::write(wait_fd_, &one, sizeof one);
      wait_rung_.store(true, std::memory_order_release);  // after the write: see wait()
    }
  }

 private:
  void signal() {
    armed_.store(false);
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(event_fd_, &one, sizeof one);
  }
  int take(std::span<WorkCompletion> out) {
    std::lock_guard lock(mutex_);
    int n = 0;
    while (count_ > 0 && size_t(n) < out.size()) {
      out[size_t(n++)] = ring_[head_];
      if (++head_ == ring_.size()) head_ = 0;
      --count_;
    }
    queued_.store(count_, std::memory_order_release);
    return n;
  }
  std::shared_ptr<SoftContext> context_;
  std::mutex mutex_;
  std::vector<WorkCompletion> ring_;
  size_t head_ = 0, count_ = 0;
  std::atomic<size_t> queued_{0};  // count_, readable without the lock (poll's fast path)
  uint64_t overflows_ = 0;
  std::atomic<bool> armed_{false};
  int event_fd_ = -1;             // the application's notification fd (fd(), request_notify)
  std::atomic<bool> waiting_{false};
  int wait_fd_ = -1;              // wait()'s own wake-up, so it never steals the application's
  std::atomic<bool> wait_rung_{false};  // wait_fd_ was written since wait() last drained it
};

class SoftQp;

class SoftContext final : public Context, public host::HostClient {
 public:
  explicit SoftContext(const ContextOptions& options) : options_(options), wait_(options.wait) {
    // One engine host, three placements (offload/host/host.hpp): in this
    // process (inline or on its engine thread), or in stellar-engined.
    if (options_.progress == ProgressMode::daemon) host_ = std::make_unique<host::RemoteHost>(mutex_, *this);
    else host_ = std::make_unique<host::EngineHost>(mutex_, *this);
  }
  ~SoftContext() override {
    if (watcher_.joinable()) {
      watching_.store(false);
      host_->kick();
      watcher_.join();
    }
    host_->stop();  // no progress round runs from here on
  }

  // The daemon placement has no engine thread in this process to move
  // completions into CQs while the application sleeps on a CQ's fd: a
  // watcher thread does, started by the first request_notify. It sleeps
  // until the daemon says completions arrived (the wake eventfd), takes
  // them, and sleeps again; it costs nothing while none arrive.
  void watch_completions() {
    if (!daemon()) return;
    std::lock_guard lock(mutex_);
    if (watcher_.joinable()) return;
    watching_.store(true);
    watcher_ = std::thread([this] {
      while (watching_.load()) {
        host_->sleep_until_work(monotonic_ns() + 100'000'000, -1);
        std::lock_guard lock(mutex_);
        host_->progress_locked(monotonic_ns());
        if (!static_cast<host::RemoteHost&>(*host_).daemon_alive()) break;  // everything is flushed
      }
    });
  }

  Status start() {
    if (options_.bind_address == "0.0.0.0")
      return Status(Errc::invalid_argument,
                    "soft provider: bind a concrete IPv4 address, not 0.0.0.0 (peers send to it, and only datagrams from "
                    "a QP's peer address are accepted)");
    host::HostOptions h;
    h.bind_address = options_.bind_address;
    h.udp_port = options_.udp_port;
    h.mode = engine_mode();
    h.mtu = options_.mtu;
    h.paths = options_.mode == Mode::roce ? 1 : options_.paths;
    h.follow_address = options_.follow_address;
    h.rx_placement = options_.rx_placement;
    h.faults = host::FaultOptions{options_.faults.drop, options_.faults.duplicate, options_.faults.reorder, options_.faults.seed};
    h.engine_thread = options_.progress == ProgressMode::thread;
    h.adaptive_wait = options_.wait == WaitPolicy::adaptive;
    h.spin_ns = uint64_t(options_.spin_time.count());
    h.daemon_socket = options_.engined_socket;
    h.tenant = options_.tenant;
    h.credential = options_.credential;
    h.tx_rate_bytes_per_s = options_.tx_rate_bytes_per_s;
    if (daemon() && options_.tx_rate_bytes_per_s)
      return Status(Errc::unsupported, "tx_rate_bytes_per_s (STELLAR_TX_RATE) is applied by the in-process engine host; "
                                       "in the daemon placement the daemon's rate applies (stellar-engined --tx-rate)");
    if (auto error = host_->open(h))
      return Status(error->permission_denied ? Errc::permission_denied
                    : error->invalid_address   ? Errc::invalid_argument
                                               : Errc::io_error,
                    error->message);
    auto& t = tenants_[""];
    t.name = "";
    t.pkey = 0xffff;
    if (Status st = open_tenants(); !st.ok()) return st;
    log().info("soft provider: {} mode on {}:{}, mtu {}, {} paths ({}), UDP GSO {}, GRO {}, {} progress, faults drop {} dup {} reorder {}",
               to_string(options_.mode), local_address(), local_port(), options_.mtu, h.paths, to_string(options_.path_policy),
               host_->gso() ? "on" : "off",
               host_->gro() ? "on" : "off", host_->placement(),
               options_.faults.drop, options_.faults.duplicate, options_.faults.reorder);
    host_->start();
    return {};
  }

  // The tenants file's tenants (locked until their credential is given),
  // then the tenant this context opens as (ContextOptions::tenant).
  Status open_tenants() {
    std::lock_guard lock(mutex_);
    if (!options_.tenants_file.empty()) {
      auto listed = tenants::load(options_.tenants_file);
      if (!listed) return listed.status();
      // Tenants with a partition key of their own first, so that the keys
      // handed to the others (from 0x8001 up) never take one of theirs.
      for (bool explicit_key : {true, false})
        for (auto& [name, o] : *listed) {
          if ((o.pkey != 0) != explicit_key) continue;
          if (Status st = add_tenant_locked(name, o, false); !st.ok())
            return Status(st.code(), options_.tenants_file + ": " + st.message());
          tenants_[name].from_file = true;
          tenants_[name].opened = false;
        }
    }
    if (options_.tenant.empty()) return Status::success();
    TenantOptions o;
    o.credential = options_.credential;
    o.pkey = host_->tenant_pkey();  // the engine daemon's tenants file decides it (0: we do)
    return open_tenant_locked(options_.tenant, o);
  }

  // A tenant the file lists: the credential opens it. With a file, no other
  // tenant exists; without one, the caller defines the tenant.
  Status open_tenant_locked(const std::string& name, const TenantOptions& o) {
    auto it = tenants_.find(name);
    if (it != tenants_.end() && it->second.from_file) {
      Tenant& t = it->second;
      if (!tenants::credential_matches(o.credential, t.options.credential)) {
        ++t.credential_refusals;
        return Status(Errc::permission_denied, "tenant '" + name + "': " + (o.credential.empty() ? "no credential given" : "wrong credential"));
      }
      if (o.pkey && o.pkey != t.pkey)
        return Status(Errc::invalid_argument, "tenant '" + name + "': partition key " + std::to_string(t.pkey) +
                                                  " here, " + std::to_string(o.pkey) + " in the engine daemon's tenants file");
      if (daemon() && (t.options.weight > 1 || t.options.rate_bytes_per_s))
        return Status(Errc::unsupported, "tenant '" + name + "': its weight and rate limit are applied by the in-process engine "
                                         "host; in the daemon placement give them in the daemon's tenants file "
                                         "(stellar-engined --tenants)");
      t.opened = true;
      return Status::success();
    }
    if (it != tenants_.end()) return Status(Errc::invalid_argument, "tenant '" + name + "' exists");
    // With a tenants file, only its tenants exist.
    if (!options_.tenants_file.empty())
      return Status(Errc::permission_denied, "tenant '" + name + "' is not in the tenants file " + options_.tenants_file);
    return add_tenant_locked(name, o);
  }

  // `enforce_placement`: refuse weights and rate limits the placement cannot
  // apply (the file's tenants are checked when one is opened instead).
  Status add_tenant_locked(const std::string& name, const TenantOptions& o, bool enforce_placement = true) {
    const bool shares = o.weight > 1 || o.rate_bytes_per_s;
    if (shares && daemon() && enforce_placement)
      return Status(Errc::unsupported, "tenant '" + name + "': weights and rate limits are applied by the in-process engine host; "
                                       "in the daemon placement give them in the daemon's tenants file (stellar-engined --tenants)");
    if (o.weight == 0) return Status(Errc::invalid_argument, "tenant '" + name + "': weight 0 (weights are at least 1)");
    uint16_t pkey = o.pkey;
    auto used = [&](uint16_t k) {
      for (auto& [n, t] : tenants_)
        if (t.pkey == k) return true;
      return false;
    };
    if (pkey == 0) {
      pkey = 0x8001;
      while (used(pkey)) ++pkey;
    } else if (used(pkey)) {
      return Status(Errc::invalid_argument, "partition key " + std::to_string(pkey) + " belongs to another tenant");
    }
    Tenant& t = tenants_[name];
    t.name = name;
    t.pkey = pkey;
    t.options = o;
    t.options.pkey = pkey;
    host_->set_tenant_share_locked(name, host::TenantShare{std::max<uint32_t>(o.weight, 1), o.rate_bytes_per_s, o.burst_bytes});
    return {};
  }

  Status create_tenant(const std::string& name, const TenantOptions& o) override {
    std::lock_guard lock(mutex_);
    if (name.empty()) return Status(Errc::invalid_argument, "a tenant needs a name");
    return open_tenant_locked(name, o);
  }

  // A quota refusal, counted against the tenant.
  static Status over_quota(Tenant& t, const std::string& what) {
    ++t.quota_refusals;
    return Status(Errc::resource_exhausted, "tenant '" + t.name + "': " + what);
  }

  std::vector<TenantCounters> tenant_counters() const override;

  Result<std::shared_ptr<ProtectionDomain>> allocate_pd(const std::string& tenant) override;

  Result<std::shared_ptr<CompletionQueue>> create_cq(uint32_t entries) override {
    if (entries == 0 || entries > (1u << 22)) return Status(Errc::invalid_argument, "CQ entries must be in [1, 4194304]");
    return std::shared_ptr<CompletionQueue>(std::make_shared<SoftCq>(self(), entries));
  }

  void progress() override { progress_work(); }
  // progress(), saying whether anything moved (always false where the
  // engine thread progresses).
  bool progress_work() {
    if (options_.progress == ProgressMode::thread) return false;
    std::lock_guard lock(mutex_);
    return host_->progress_locked(monotonic_ns());
  }
  void flush_acknowledgements() override {
    std::lock_guard lock(mutex_);
    host_->flush_acknowledgements_locked(monotonic_ns());
  }
  int progress_fd() const override { return host_->fd(); }
  ContextCounters counters() const override;
  const ContextOptions& options() const override { return options_; }
  void set_wait_policy(WaitPolicy w) override {
    wait_.store(w, std::memory_order_relaxed);
    host_->set_adaptive_wait(w == WaitPolicy::adaptive);
  }
  WaitPolicy wait_policy() const override { return wait_.load(std::memory_order_relaxed); }
  std::string local_address() const override { return host::format_ipv4(host_->local()); }
  uint16_t local_port() const override { return ntohs(host_->local().sin_port); }
  Status change_address(const std::string& address) override {
    if (!host::parse_ipv4(address, 0)) return Status(Errc::invalid_argument, "not an IPv4 address: '" + address + "'");
    if (options_.mode == Mode::roce)
      return Status(Errc::unsupported, "roce mode names a connection by its addresses and ports: it cannot change address");
    if (daemon()) return Status(Errc::unsupported, "the engine daemon owns the sockets and follows address changes itself");
    std::lock_guard lock(mutex_);
    if (auto error = host_->rebind_locked(address, host::monotonic_ns()))
      return Status(Errc::io_error, "change_address " + address + ": " + *error);
    return Status::success();
  }
  bool daemon() const { return options_.progress == ProgressMode::daemon; }

  std::shared_ptr<SoftContext> self() { return std::static_pointer_cast<SoftContext>(shared_from_this()); }
  off::Mode engine_mode() const { return options_.mode == Mode::roce ? off::Mode::roce : off::Mode::stellar; }

  // HostClient: GPU copies feed engines (staged sources) and hold
  // completions (destinations); both are polled every progress round.
  void on_progress_locked(uint64_t) override {
    if (!staging_.empty()) poll_staging();
    if (held_completions_) poll_held_completions();
  }
  uint64_t next_wakeup_locked(uint64_t now) override {
    return staging_.empty() && !held_completions_ ? UINT64_MAX : now + 10'000;  // copies in flight: look again in 10 us
  }

  void poll_staging();              // advances pipelined GPU source copies (GpuStaging::poll)
  void poll_held_completions();     // delivers held completions whose copies are done

  std::mutex mutex_;
  ContextOptions options_;
  std::atomic<WaitPolicy> wait_;  // options_.wait, then set_wait_policy()
  std::atomic<uint64_t> wait_sleeps_{0};  // ContextCounters::wait_sleeps
  std::atomic<uint64_t> contention_yields_{0};  // the application's share of ContextCounters::contention_yields
  std::map<std::string, Tenant> tenants_;
  std::unordered_map<uint64_t, SoftQp*> qps_;  // (pkey << 32 | qpn) -> QP with an engine
  uint64_t memory_generation_ = 1;               // bumped by every deregistration (every removal from a by_rkey)
  GpuStaging staging_;              // shadows, staging streams, pipelined source copies
  uint64_t held_completions_ = 0;  // completions QPs hold for destination copies (HeldCompletion)
  uint32_t next_pd_ = 1;            // protection-domain ids (the daemon checks keys against them)
  std::thread watcher_;             // daemon placement: watch_completions()
  std::atomic<bool> watching_{false};
  std::unique_ptr<host::Host> host_;  // last: its engine thread stops before the rest goes
};

class SoftPd final : public ProtectionDomain, public std::enable_shared_from_this<SoftPd> {
 public:
  SoftPd(std::shared_ptr<SoftContext> context, std::string tenant, uint32_t id)
      : context_(std::move(context)), tenant_(std::move(tenant)), id_(id) {}
  Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length, uint32_t access) override;
  Result<std::shared_ptr<QueuePair>> create_qp(const QpInitAttributes&) override;
  const std::string& tenant() const override { return tenant_; }
  SoftContext& context() const { return *context_; }
  uint32_t id() const { return id_; }

 private:
  std::shared_ptr<SoftContext> context_;
  std::string tenant_;
  uint32_t id_;
};

class SoftMr final : public MemoryRegion {
 public:
  SoftMr(std::shared_ptr<SoftPd> pd, MrEntry e) : pd_(std::move(pd)), e_(e) {}
  ~SoftMr() override {
    SoftContext& c = pd_->context();
    std::lock_guard lock(c.mutex_);
    Tenant& t = c.tenants_.at(pd_->tenant());
    if (e_.gpu) {
      (void)e_.gpu->flush();  // peers' acknowledged writes reach the device even without a later receive
      // and so do copies a held completion queued (a flush or a landed
      // message): after deregistration the application may free the memory.
      (void)e_.gpu->synchronize();
      std::erase(t.dirty_gpu, e_.gpu.get());
      --t.gpu_regions;
    }
    t.by_rkey.erase(e_.rkey);
    t.lkey_to_rkey.erase(e_.lkey);
    t.registered_bytes -= std::min(t.registered_bytes, e_.length);
    c.host_->deregister_memory_locked(e_.lkey);  // the daemon: returns once it cannot touch the memory
    ++c.memory_generation_;  // engines re-check posted local segments before using them
  }
  uint32_t lkey() const override { return e_.lkey; }
  uint32_t rkey() const override { return e_.rkey; }
  uint64_t addr() const override { return e_.addr; }
  uint64_t length() const override { return e_.length; }
  uint32_t access() const override { return e_.access; }

 private:
  std::shared_ptr<SoftPd> pd_;
  MrEntry e_;
};

Result<std::unique_ptr<MemoryRegion>> SoftPd::register_memory(void* addr, size_t length, uint32_t access) {
  if (!addr && length) return Status(Errc::invalid_argument, "register_memory: null address");
  if (access & ~uint32_t(access_local_write | access_remote_write | access_remote_read | access_remote_atomic))
    return Status(Errc::invalid_argument, "register_memory: unknown access bits");
  if ((access & (access_remote_write | access_remote_atomic)) && !(access & access_local_write))
    return Status(Errc::invalid_argument, "register_memory: remote write/atomic access requires local write (as in verbs)");
  MrEntry e{reinterpret_cast<uint64_t>(addr), length, access, this, 0, 0, static_cast<uint8_t*>(addr), nullptr, 0, nullptr};
  // The tenant's registered-bytes quota: reserved now (before a GPU shadow
  // is set up), released if registration fails.
  struct Reservation {
    SoftContext& c;
    const std::string& tenant;
    uint64_t bytes;
    bool committed = false;
    ~Reservation() {
      if (committed) return;
      std::lock_guard lock(c.mutex_);
      Tenant& t = c.tenants_.at(tenant);
      t.registered_bytes -= std::min(t.registered_bytes, bytes);
    }
  };
  {
    std::lock_guard lock(context_->mutex_);
    Tenant& t = context_->tenants_.at(tenant_);
    if (t.options.max_registered_bytes &&
        (length > t.options.max_registered_bytes || t.registered_bytes > t.options.max_registered_bytes - length))
      return SoftContext::over_quota(t, "registering " + std::to_string(length) + " bytes would pass its quota of " +
                                            std::to_string(t.options.max_registered_bytes) + " (" +
                                            std::to_string(t.registered_bytes) + " registered)");
    t.registered_bytes += length;
  }
  Reservation reservation{*context_, tenant_, length};
  if (length && gpu::memory_kind(addr) == gpu::MemoryKind::device) {
    if (context_->daemon())
      return Status(Errc::unsupported, "register_memory: GPU memory in the daemon placement is not supported yet "
                                       "(STELLAR_ENGINE=inline or thread stage it through pinned shadows)");
    // The CPU cannot address device memory: stage it (GpuShadow).
    if (access & access_remote_atomic)
      return Status(Errc::unsupported, "register_memory: remote atomics on GPU memory are not supported by the soft provider (staged copies are not atomic)");
    auto driver = gpu::CudaDriver::load();
    if (!driver) return driver.status();
    auto info = gpu::query_pointer(**driver, addr);
    if (!info) return info.status();
    auto use = context_->staging_.shadow_for(**driver, *info, e.addr, length, context_->mutex_);
    if (!use) return use.status();
    e.gpu = use->shadow;
    e.shadow_offset = use->offset;
    e.host = e.gpu->host() + e.shadow_offset;
    e.shadow_use = use->use;
  }
  std::lock_guard lock(context_->mutex_);
  Tenant& t = context_->tenants_.at(tenant_);
  t.registered_bytes -= std::min(t.registered_bytes, uint64_t(length));  // the reservation becomes the region's below
  reservation.committed = true;
  e.rkey = t.fresh_key();
  t.by_rkey[e.rkey] = e;  // reserve before drawing the lkey
  e.lkey = t.fresh_key();
  t.by_rkey[e.rkey] = e;
  t.lkey_to_rkey[e.lkey] = e.rkey;
  if (auto error = context_->host_->register_memory_locked(host::MemoryRegistration{id_, e.lkey, e.rkey, access, e.addr, length})) {
    t.by_rkey.erase(e.rkey);
    t.lkey_to_rkey.erase(e.lkey);
    ++context_->memory_generation_;  // every erase from by_rkey does: SoftQp::resolve keeps an entry's address
    if (context_->host_->quota_refused_locked()) return SoftContext::over_quota(t, "register_memory: " + *error);
    return Status(Errc::invalid_argument, "register_memory: " + *error);
  }
  t.registered_bytes += length;
  if (e.gpu) ++t.gpu_regions;
  return std::unique_ptr<MemoryRegion>(std::make_unique<SoftMr>(shared_from_this(), e));
}

// A completion whose GPU destination copies are still running on the
// staging stream: delivered to the CQ when their events have completed, in
// the order of its queue (a QP's send or receive queue).
struct HeldCompletion {
  off::Completion c;
  bool report = true;  // false: an unsignaled send, held only to keep the order
  GpuCopies gpu;       // the copies it waits for
  std::vector<GpuShadow*> flushed;  // shadows whose dirty ranges these copies flush (Tenant::flushing)
  uint64_t flush_sequence = 0;
};

class SoftQp final : public QueuePair, public off::MemoryAccess, public off::CompletionSink {
 public:
  SoftQp(std::shared_ptr<SoftPd> pd, const QpInitAttributes& attr, uint32_t qpn, uint16_t pkey)
      : pd_(std::move(pd)),
        send_cq_(std::static_pointer_cast<SoftCq>(attr.send_cq)),
        recv_cq_(std::static_pointer_cast<SoftCq>(attr.recv_cq)),
        cap_(attr.cap),
        qpn_(qpn),
        pkey_(pkey),
        send_slots_(std::bit_ceil(std::max<uint32_t>(attr.cap.max_send_wr, 1))),
        recv_slots_(std::bit_ceil(std::max<uint32_t>(attr.cap.max_recv_wr, 1))) {
    hints_ = attr.hints.value_or(context().options_.hints);
    psn_ = uint32_t(kernel_random() & 0xffffff);
    // stellar mode: this QP's connection token, the secret every packet to it
    // must carry (docs/security.md). Never 0: 0 means "no token" (roce mode).
    if (context().options_.mode == Mode::stellar)
      while (token_ == 0) token_ = kernel_random();
  }
  ~SoftQp() override {
    SoftContext& c = context();
    std::lock_guard lock(c.mutex_);
    Tenant& t = c.tenants_.at(pd_->tenant());
    t.qpns.erase(qpn_);
    if (t.qps.erase(this)) --t.qp_count;
    c.staging_.drop_owned_by(this);
    poll_held(true);  // copies still write the device: wait, and deliver what completed
    if (engine_) {
      // The host acknowledges what was delivered here before the engine
      // goes (the peer's last SEND must complete there) and keeps its counters.
      c.qps_.erase(uint64_t(pkey_) << 32 | qpn_);
      c.host_->detach_locked(engine_);
      engine_ = nullptr;
    }
  }

  uint32_t qp_num() const override { return qpn_; }
  QpState state() const override {
    std::lock_guard lock(const_cast<SoftQp*>(this)->context().mutex_);
    return in_error() ? QpState::error : state_;
  }

  Status modify(const QpModify& m) override {
    SoftContext& c = context();
    std::lock_guard lock(c.mutex_);
    const QpState current = in_error() ? QpState::error : state_;
    auto bad = [&] {
      return Status(Errc::wrong_state, std::string("QP ") + std::to_string(qpn_) + ": cannot go from " + to_string(current) +
                                           " to " + to_string(m.state));
    };
    switch (m.state) {
      case QpState::init:
        if (current != QpState::reset && current != QpState::init) return bad();
        access_ = m.access;
        state_ = QpState::init;
        return {};
      case QpState::rtr: {
        if (current != QpState::init) return bad();
        if (m.remote.mode != c.options_.mode)
          return Status(Errc::invalid_argument, std::string("peer speaks mode ") + to_string(m.remote.mode) + ", this context " +
                                                    to_string(c.options_.mode));
        if (m.remote.pkey != pkey_) return Status(Errc::permission_denied, "peer QP belongs to another partition (tenant)");
        if (Status st = check_remote(m.remote, c.options_.mode); !st.ok()) return st;
        auto peer = host::parse_ipv4(m.remote.address, m.remote.udp_port);
        if (!peer) return Status(Errc::invalid_argument, "not an IPv4 address: '" + m.remote.address + "'");
        if (Status st = check_peer_address(*peer, m.remote.address); !st.ok()) return st;
        peer_ = *peer;
        off::EngineConfig e;
        e.mode = c.options_.mode == Mode::roce ? off::Mode::roce : off::Mode::stellar;
        e.mtu = std::min(c.options_.mtu, m.remote.mtu);
        e.max_send_wr = cap_.max_send_wr;
        e.max_recv_wr = cap_.max_recv_wr;
        e.pkey = pkey_;
        e.local_qpn = qpn_;
        e.remote_qpn = m.remote.qp_num;
        e.local_token = token_;
        e.remote_token = m.remote.token;
        e.loopback_unchecked = e.mode == off::Mode::stellar && !c.options_.loopback_crc && m.remote.loopback_unchecked;
        e.size_path = e.mode == off::Mode::stellar && c.options_.path_mtu_discovery && m.remote.path_mtu_discovery;
        e.send_psn = psn_;
        e.receive_psn = m.remote.psn;
        e.rto_min_ns = e.rto_initial_ns = uint64_t(m.timing.rto_min.count());
        e.rto_max_ns = std::max<uint64_t>(e.rto_min_ns, uint64_t(m.timing.rto_max.count()));
        e.retry_count = m.timing.retry_count;
        e.rnr_retry = m.timing.rnr_retry;
        switch (c.options_.congestion_control) {
          case CongestionControl::automatic:
            e.cc = e.mode == off::Mode::roce ? off::CcAlgorithm::dcqcn : off::CcAlgorithm::swift;
            break;
          case CongestionControl::none: e.cc = off::CcAlgorithm::none; break;
          case CongestionControl::dcqcn: e.cc = off::CcAlgorithm::dcqcn; break;
          case CongestionControl::swift: e.cc = off::CcAlgorithm::swift; break;
        }
        e.paths = c.options_.paths;
        switch (c.options_.path_policy) {
          case PathPolicy::oblivious: e.path_policy = off::PathPolicy::oblivious; break;
          case PathPolicy::reps: e.path_policy = off::PathPolicy::reps; break;
          case PathPolicy::two_choices: e.path_policy = off::PathPolicy::two_choices; break;
          case PathPolicy::bandit: e.path_policy = off::PathPolicy::bandit; break;
        }
        e.cc_config.line_rate_bps = c.options_.line_rate_bps;
        e.cc_config.swift_target_delay_ns = uint64_t(c.options_.cc_target_delay.count());
        // The host fills in the ICRC addresses and dispatches (pkey, qpn) from peer_ to the engine.
        std::string error;
        // The flow scheduler's label and the class's DSCP (docs/scheduler.md).
        host::QpBinding binding;
        binding.pd = pd_->id();
        binding.access = access_;
        binding.label = host::FlowLabel{pd_->tenant(), hints_.job, hints_.weight, hints_.traffic_class(),
                                        uint64_t(hints_.step_period.count()), uint64_t(hints_.deadline.count())};
        binding.dscp = c.options_.class_dscp[hints_.traffic_class()];
        engine_ = c.host_->attach_locked(e, peer_, binding, *this, *this, error);
        if (!engine_) {
          if (c.host_->quota_refused_locked()) return SoftContext::over_quota(*tenant_, "QP " + std::to_string(qpn_) + ": " + error);
          return Status(Errc::io_error, "QP " + std::to_string(qpn_) + ": " + error);
        }
        for (auto& r : early_receives_) c.host_->post_receive_locked(engine_, r);
        early_receives_.clear();
        c.qps_[uint64_t(pkey_) << 32 | qpn_] = this;
        state_ = QpState::rtr;
        return {};
      }
      case QpState::rts:
        if (current != QpState::rtr) return bad();
        state_ = QpState::rts;
        return {};
      case QpState::error:
        log().debug("QP {}: moved to ERROR by the user", qpn_);
        state_ = QpState::error;
        if (engine_) c.host_->enter_error_locked(engine_);
        else flush_early_receives();
        return {};
      case QpState::reset:
        return Status(Errc::unsupported, "moving a QP back to RESET is not supported; create a new QP");
    }
    return bad();
  }

  Status post_send(const SendWr& wr) override {
    SoftContext& c = context();
    std::lock_guard lock(c.mutex_);
    const QpState current = in_error() ? QpState::error : state_;
    if (current != QpState::rts && current != QpState::error)
      return Status(Errc::wrong_state, std::string("post_send on QP ") + std::to_string(qpn_) + " in " + to_string(current) + " (needs RTS)");
    if (wr.sg_list.size() > cap_.max_send_sge || wr.sg_list.size() > off::max_segments)
      return Status(Errc::invalid_argument, "post_send: " + std::to_string(wr.sg_list.size()) + " SGEs exceed max_send_sge");
    if (tenant_->options.max_send_wrs && tenant_outstanding(true) >= tenant_->options.max_send_wrs)
      return SoftContext::over_quota(*tenant_, "send work requests outstanding reached its quota of " +
                                                   std::to_string(tenant_->options.max_send_wrs));
    // Completions held for GPU copies still count as outstanding (the CQ was sized for max_send_wr of them).
    if (engine_ && !held_[0].empty() && c.host_->outstanding_sends_locked(engine_) + held_[0].size() >= cap_.max_send_wr)
      return Status(Errc::queue_full, "post_send: send queue full (max_send_wr " + std::to_string(cap_.max_send_wr) + ", some completions waiting for GPU copies)");
    off::SendWork w;
    // The engine sees the slot's sequence number; deliver() maps it back.
    // Filled aside and moved into its slot only once the engine took the WR:
    // while the queue is full that slot still belongs to the oldest WR.
    const uint64_t sequence = send_sequence_ + 1;
    WrSlot& slot = pending_slot_;
    slot.wr_id = wr.wr_id;
    slot.signaled = wr.flags & send_signaled;
    slot.parts.clear();
    slot.sources.clear();
    slot.staging_failed = false;
    w.wr_id = sequence;
    w.opcode = off::WorkOpcode(int(wr.opcode));
    w.signaled = wr.flags & send_signaled;
    w.solicited = wr.flags & send_solicited;
    w.inline_data = wr.flags & send_inline;
    w.remote_addr = wr.remote_addr;
    w.rkey = wr.rkey;
    w.imm = wr.imm_data;
    w.compare_add = wr.compare_add;
    w.swap = wr.swap;
    const bool writes_local = wr.opcode == WrOpcode::rdma_read || wr.opcode == WrOpcode::atomic_fetch_add ||
                              wr.opcode == WrOpcode::atomic_cmp_swap;
    uint64_t total = 0;
    for (const Sge& s : wr.sg_list) total += s.length;
    if (w.inline_data && total > cap_.max_inline_data)
      return Status(Errc::invalid_argument, "post_send: inline payload " + std::to_string(total) + " bytes exceeds max_inline_data");
    if (w.inline_data && writes_local) return Status(Errc::invalid_argument, "post_send: inline is only for sends and writes");
    if ((wr.opcode == WrOpcode::atomic_fetch_add || wr.opcode == WrOpcode::atomic_cmp_swap) && (total != 8 || wr.remote_addr % 8))
      return Status(Errc::invalid_argument, "post_send: atomics need one 8-byte local buffer and an 8-byte aligned remote address");
    if (Status s = translate(wr.sg_list, w.segments, w.inline_data, writes_local ? uint32_t(access_local_write) : 0u, slot); !s.ok()) return s;
    w.segment_count = uint32_t(wr.sg_list.size());
    if (!slot.parts.empty()) w.signaled = true;  // GPU destination: its completion copies to the device
    if (!engine_) return Status(Errc::wrong_state, "post_send: QP has no connection");
    // GPU sources: small ones copied now; large ones in chunks on a stream,
    // the engine sending each chunk as it lands.
    StagingJob job;
    if (!slot.sources.empty()) {
      if (total >= staging_pipeline_bytes && !c.host_->in_error_locked(engine_)) {
        job.owner = this;
        job.wr_id = sequence;
        job.total = uint32_t(total);
        if (Status st = c.staging_.start(job, slot.sources); !st.ok()) return st;
        w.staged = true;
      } else {
        for (const StagedPart& part : slot.sources)
          if (Status st = part.shadow->to_host(part.offset, part.length); !st.ok()) return st;
      }
      slot.sources.clear();
    }
    const uint64_t now = monotonic_ns();
    // In place before the engine sees the WR (it may complete it at once, e.g.
    // flushed in ERROR); swapped back out if the engine refuses it.
    WrSlot& placed = send_slot(sequence);
    std::swap(placed, slot);
    const off::PostResult posted = c.host_->post_send_locked(engine_, w, now);
    if (posted != off::PostResult::ok) std::swap(placed, slot);
    if (w.staged) {
      if (posted == off::PostResult::ok && c.host_->set_ready_locked(engine_, sequence, job.ready())) c.staging_.add(std::move(job));
      else GpuStaging::drop(job);  // refused, or flushed at once: the copies have nobody to feed
    }
    switch (posted) {
      case off::PostResult::ok: break;
      case off::PostResult::queue_full: return Status(Errc::queue_full, "post_send: send queue full (max_send_wr " + std::to_string(cap_.max_send_wr) + ", or a quarter of the PSN space in flight)");
      case off::PostResult::invalid_argument: return Status(Errc::invalid_argument, "post_send: rejected by the transport (message too large?)");
      case off::PostResult::qp_in_error: return Status(Errc::wrong_state, "post_send: QP in ERROR");
    }
    send_sequence_ = sequence;
    c.host_->posted_locked(engine_, now);  // inline: transmitted now; engine thread: kicked
    return {};
  }

  Status post_recv(const RecvWr& wr) override {
    SoftContext& c = context();
    std::lock_guard lock(c.mutex_);
    if (state_ == QpState::reset) return Status(Errc::wrong_state, "post_recv on QP " + std::to_string(qpn_) + " in RESET (needs INIT or later)");
    if (wr.sg_list.size() > cap_.max_recv_sge || wr.sg_list.size() > off::max_segments)
      return Status(Errc::invalid_argument, "post_recv: too many SGEs");
    if (tenant_->options.max_receive_wrs && tenant_outstanding(false) >= tenant_->options.max_receive_wrs)
      return SoftContext::over_quota(*tenant_, "receive buffers posted reached its quota of " +
                                                   std::to_string(tenant_->options.max_receive_wrs));
    if (engine_ && !held_[1].empty() && c.host_->outstanding_receives_locked(engine_) + held_[1].size() >= cap_.max_recv_wr)
      return Status(Errc::queue_full, "post_recv: receive queue full (max_recv_wr " + std::to_string(cap_.max_recv_wr) + ", some completions waiting for GPU copies)");
    off::ReceiveWork r;
    const uint64_t sequence = receive_sequence_ + 1;
    WrSlot& slot = pending_slot_;
    slot.wr_id = wr.wr_id;
    slot.signaled = true;
    slot.parts.clear();
    r.wr_id = sequence;
    if (Status s = translate(wr.sg_list, r.segments, false, access_local_write, slot); !s.ok()) return s;
    r.segment_count = uint32_t(wr.sg_list.size());
    if (!engine_) {
      if (state_ == QpState::error) {
        recv_cq_->push(off::Completion{wr.wr_id, off::CompletionStatus::work_request_flushed, off::CompletionOpcode::receive, 0, 0, false, qpn_});
        return {};
      }
      if (early_receives_.size() >= cap_.max_recv_wr) return Status(Errc::queue_full, "post_recv: receive queue full");
      early_receives_.push_back(r);
      receive_sequence_ = sequence;
      std::swap(recv_slot(sequence), slot);
      return {};
    }
    WrSlot& placed = recv_slot(sequence);
    std::swap(placed, slot);  // before the engine may complete it (see post_send)
    const off::PostResult posted = c.host_->post_receive_locked(engine_, r);
    if (posted != off::PostResult::ok) std::swap(placed, slot);
    switch (posted) {
      case off::PostResult::ok:
        receive_sequence_ = sequence;
        return {};
      case off::PostResult::queue_full: return Status(Errc::queue_full, "post_recv: receive queue full (max_recv_wr " + std::to_string(cap_.max_recv_wr) + ")");
      default: return Status(Errc::invalid_argument, "post_recv: rejected");
    }
  }

  Result<std::vector<PathCounters>> path_counters() const override {
    SoftContext& c = const_cast<SoftQp*>(this)->context();
    std::lock_guard lock(c.mutex_);
    if (!c.host_->has_path_info())
      return Status(Errc::unsupported, "path_counters: the engine daemon's engines keep their path state to themselves");
    if (!engine_) return Status(Errc::wrong_state, "path_counters: the QP is not connected (RTR) yet");
    std::vector<PathCounters> out;
    off::PathInfo info;
    for (uint32_t path = 0; path < off::max_paths && c.host_->path_info_locked(engine_, uint16_t(path), info); ++path) {
      PathCounters p;
      p.path = uint16_t(path);
      p.sent_packets = info.sent_packets;
      p.acknowledged_packets = info.acknowledged_packets;
      p.lost_packets = info.lost_packets;
      p.marked_packets = info.marked_packets;
      p.retirements = info.retirements;
      p.retired = info.retired;
      p.inflight_packets = info.inflight_packets;
      p.srtt_ns = info.srtt_ns;
      p.min_rtt_ns = info.min_rtt_ns;
      p.loss_rate = info.loss_rate;
      p.mark_rate = info.mark_rate;
      out.push_back(p);
    }
    return out;
  }

  QpEndpoint local_endpoint() const override {
    SoftContext& c = const_cast<SoftQp*>(this)->context();
    return QpEndpoint{c.local_address(), c.local_port(), qpn_, psn_,    c.options_.mtu,
                      pkey_,             c.options_.mode, {},   0,     token_,
                      c.options_.mode == Mode::stellar && !c.options_.loopback_crc,
                      c.options_.mode == Mode::stellar && c.options_.path_mtu_discovery};
  }

  // MemoryAccess: remote keys of this QP's tenant, for regions of this PD.
  uint8_t* resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t access) override {
    Tenant& t = *tenant_;
    // A peer's WRITEs mostly name one region: the last entry found is used
    // again while no region was deregistered since (every deregistration
    // bumps the generation; entries of a node-based map do not move when
    // others come). Saves a hash lookup, a division, per packet.
    const uint64_t generation = pd_->context().memory_generation_;
    if (rkey != resolved_rkey_ || generation != resolved_generation_ || !resolved_) {
      auto it = t.by_rkey.find(rkey);
      if (it == t.by_rkey.end()) return nullptr;
      resolved_ = &it->second;
      resolved_rkey_ = rkey;
      resolved_generation_ = generation;
    }
    const MrEntry& e = *resolved_;
    if (e.pd != pd_.get() || (e.access & access) != access || !(access_ & access)) return nullptr;
    if (address < e.addr || length > e.length || address - e.addr > e.length - length) return nullptr;
    if (e.gpu) {
      const uint64_t offset = e.shadow_offset + (address - e.addr);
      if (access & access_remote_write) {
        // A cached shadow may be shared by regions of several tenants: each
        // tenant whose peer wrote it must flush it at its next receive.
        if (std::find(t.dirty_gpu.begin(), t.dirty_gpu.end(), e.gpu.get()) == t.dirty_gpu.end()) t.dirty_gpu.push_back(e.gpu.get());
        e.gpu->mark_dirty(offset, length);
      } else if (access & access_remote_read) {
        // The device holds the newest data, except what peers wrote since.
        if (!e.gpu->flush().ok() || !e.gpu->to_host(offset, length).ok()) return nullptr;
        std::erase(t.dirty_gpu, e.gpu.get());
      }
    }
    return e.host + (address - e.addr);
  }
  void deliver(const off::Completion& engine_completion) override {
    off::Completion c = engine_completion;
    const bool receive = c.is_receive();
    WrSlot& slot = receive ? recv_slot(c.wr_id) : send_slot(c.wr_id);
    c.wr_id = slot.wr_id;
    if (slot.staging_failed && !receive) c.status = off::CompletionStatus::local_qp_operation_error;
    HeldCompletion held{c, slot.signaled || receive, {}, {}, 0};
    std::vector<StagedPart> copies;  // shadow -> device, before the completion may be seen
    uint64_t bytes = 0;
    if (c.status == off::CompletionStatus::success) {
      if (receive && !tenant_->dirty_gpu.empty()) {
        // A receive says every earlier write of the peer is in place: on the GPU too.
        for (GpuShadow* g : tenant_->dirty_gpu) {
          for (auto [begin, end] : g->dirty) copies.push_back({g->shared_from_this(), begin, end - begin}), bytes += end - begin;
          g->dirty.clear();
          held.flushed.push_back(g);
        }
        tenant_->dirty_gpu.clear();
      }
      // The bytes this WR placed in staged GPU destinations (a receive: its
      // byte count, in SGE order; a READ: all of them).
      // A WRITE with immediate consumes the receive but places nothing in it.
      uint64_t left = c.opcode == off::CompletionOpcode::receive_rdma_with_imm ? 0 : receive ? c.byte_length : UINT64_MAX;
      for (const StagedPart& part : slot.parts) {
        const uint64_t n = std::min<uint64_t>(part.length, left);
        if (n) copies.push_back({part.shadow, part.offset, n}), bytes += n;
        left -= n;
      }
    }
    std::deque<HeldCompletion>& queue = held_[receive ? 1 : 0];
    // Receives also wait for flushes other receives of this tenant started.
    const bool flushes_running = receive && c.status == off::CompletionStatus::success && !tenant_->flushing.empty();
    if (bytes >= staging_pipeline_bytes || !queue.empty() || flushes_running) {
      // Large copies do not hold up the progress loop (every QP's packets
      // and timers): they are queued on the staging stream and this
      // completion waits for them, and later ones of its queue behind it.
      bool ok = true;
      for (const StagedPart& copy : copies) ok = held.gpu.queue_copy(copy) && ok;
      if (flushes_running)
        for (auto& [g, sequence] : tenant_->flushing) held.gpu.wait_on_stream(g->shared_from_this());
      if (!held.gpu.record_events()) ok = false;
      if (!ok) held.c.status = off::CompletionStatus::local_protection_error;
      if (!held.flushed.empty()) {
        held.flush_sequence = ++tenant_->flush_sequence;
        for (GpuShadow* g : held.flushed) tenant_->flushing[g] = held.flush_sequence;
      }
      queue.push_back(std::move(held));
      ++context().held_completions_;
      if (context().options_.progress == ProgressMode::thread) context().host_->kick();  // its wake-up may be later than 10 us
      return;
    }
    for (const StagedPart& copy : copies)
      if (!copy.shadow->to_device(copy.offset, copy.length).ok()) held.c.status = off::CompletionStatus::local_protection_error;
    report(held);
  }

  // Delivers this QP's held completions whose copies have completed, in
  // order; with `wait`, waits for all of them (QP destruction).
  void poll_held(bool wait = false) {
    for (std::deque<HeldCompletion>& queue : held_) {
      while (!queue.empty()) {
        HeldCompletion& h = queue.front();
        bool failed = false;
        const bool ready = h.gpu.poll(wait, failed);
        if (failed) h.c.status = off::CompletionStatus::local_protection_error;
        if (!ready) break;  // in order: nothing behind it goes first
        report(h);
        queue.pop_front();
        --context().held_completions_;
      }
    }
  }
  uint64_t generation() const override { return pd_->context().memory_generation_; }
  bool local_valid(uint32_t lkey, const uint8_t* address, uint64_t length, uint32_t access) override {
    const Tenant& t = *tenant_;
    auto k = t.lkey_to_rkey.find(lkey);
    if (k == t.lkey_to_rkey.end()) return false;
    const MrEntry& e = t.by_rkey.at(k->second);
    const uint64_t a = reinterpret_cast<uint64_t>(address), base = reinterpret_cast<uint64_t>(e.host);
    return e.pd == pd_.get() && (e.access & access) == access && a >= base && length <= e.length && a - base <= e.length - length;
  }

  host::Host::Engine* engine() { return engine_; }
  bool in_error() const { return engine_ && pd_->context().host_->in_error_locked(engine_); }
  bool holds_completions() const { return !held_[0].empty() || !held_[1].empty(); }
  void mark_staging_failed(uint64_t engine_wr_id) { send_slot(engine_wr_id).staging_failed = true; }
  void bind_tenant(Tenant* t) { tenant_ = t; }
  // Work requests posted and not completed (under the context's lock).
  uint32_t outstanding(bool send) const {
    SoftContext& c = const_cast<SoftQp*>(this)->context();
    if (!engine_) return send ? 0 : uint32_t(early_receives_.size());
    return send ? c.host_->outstanding_sends_locked(engine_) : c.host_->outstanding_receives_locked(engine_);
  }
  // Over every QP of the tenant (the quotas are per tenant).
  uint32_t tenant_outstanding(bool send) const {
    uint32_t n = 0;
    for (SoftQp* qp : tenant_->qps) n += qp->outstanding(send);
    return n;
  }

 private:
  SoftContext& context() { return pd_->context(); }

  // Checks an SGE list against the tenant's regions and points the engine's
  // segments at the memory it may touch (a GPU region's shadow). `need`: 0
  // for sources, access_local_write for destinations; staged GPU
  // destinations are recorded in `slot` for the completion to copy back.
  Status translate(std::span<const Sge> list, off::Segment* out, bool inline_data, uint32_t need, WrSlot& slot) {
    Tenant& t = *tenant_;
    uint64_t message_offset = 0;
    for (size_t i = 0; i < list.size(); message_offset += list[i].length, ++i) {
      const Sge& s = list[i];
      out[i] = off::Segment{reinterpret_cast<uint8_t*>(s.addr), s.length, inline_data ? 0u : s.lkey};
      if (s.length == 0 || (inline_data && t.gpu_regions == 0)) continue;
      auto k = t.lkey_to_rkey.find(s.lkey);
      if (inline_data) {
        // Inline lkeys are not checked (verbs), but a registered GPU source is staged all the same.
        if (k == t.lkey_to_rkey.end()) continue;
        const MrEntry& e = t.by_rkey.at(k->second);
        if (!e.gpu || e.pd != pd_.get() || s.addr < e.addr || s.length > e.length || s.addr - e.addr > e.length - s.length) continue;
        if (Status st = e.gpu->flush(); !st.ok()) return st;  // peers' writes first, or the copy would undo them
        std::erase(t.dirty_gpu, e.gpu.get());
        if (Status st = e.gpu->to_host(e.shadow_offset + (s.addr - e.addr), s.length); !st.ok()) return st;
        out[i].address = e.host + (s.addr - e.addr);
        continue;
      }
      if (k == t.lkey_to_rkey.end())
        return Status(Errc::permission_denied, "SGE " + std::to_string(i) + ": lkey " + std::to_string(s.lkey) + " is not registered in this tenant");
      const MrEntry& e = t.by_rkey.at(k->second);
      if (e.pd != pd_.get()) return Status(Errc::permission_denied, "SGE " + std::to_string(i) + ": lkey belongs to another protection domain");
      if (s.addr < e.addr || s.length > e.length || s.addr - e.addr > e.length - s.length)
        return Status(Errc::permission_denied, "SGE " + std::to_string(i) + ": outside its memory region");
      if ((e.access & need) != need) return Status(Errc::permission_denied, "SGE " + std::to_string(i) + ": region lacks local write access");
      out[i].address = e.host + (s.addr - e.addr);
      if (e.gpu) {
        if (!need) {
          if (Status st = e.gpu->flush(); !st.ok()) return st;  // peers' writes first, or the copy would undo them
          std::erase(t.dirty_gpu, e.gpu.get());
          slot.sources.push_back({e.gpu, e.shadow_offset + (s.addr - e.addr), s.length, message_offset});  // copied by post_send
        } else {
          slot.parts.push_back({e.gpu, e.shadow_offset + (s.addr - e.addr), s.length});
        }
      }
    }
    return {};
  }

  void report(const HeldCompletion& h) {
    for (GpuShadow* g : h.flushed) {
      // Done, and so is every earlier flush of g (same stream); a later one may still run.
      auto it = tenant_->flushing.find(g);
      if (it != tenant_->flushing.end() && it->second == h.flush_sequence) tenant_->flushing.erase(it);
    }
    if (h.report || h.c.status != off::CompletionStatus::success) (h.c.is_receive() ? recv_cq_ : send_cq_)->push(h.c);
  }

  void flush_early_receives() {
    for (auto& r : early_receives_)
      recv_cq_->push(off::Completion{recv_slot(r.wr_id).wr_id, off::CompletionStatus::work_request_flushed,
                                     off::CompletionOpcode::receive, 0, 0, false, qpn_});
    early_receives_.clear();
  }

  std::shared_ptr<SoftPd> pd_;
  std::shared_ptr<SoftCq> send_cq_, recv_cq_;
  QpCapabilities cap_;
  uint32_t qpn_;
  uint16_t pkey_;
  JobHints hints_;  // its traffic's hints (QpInitAttributes::hints, else the context's)
  uint32_t psn_ = 0;
  uint64_t token_ = 0;  // stellar mode: what the peer must put on every packet to this QP
  uint32_t access_ = 0;
  Tenant* tenant_ = nullptr;
  QpState state_ = QpState::reset;
  sockaddr_in peer_{};
  host::Host::Engine* engine_ = nullptr;  // with the host from RTR on
  std::vector<off::ReceiveWork> early_receives_;
  // By the engine's sequence number of the WR (which grows without bound):
  // a power of two at least max_*_wr long, so that a mask, not a division,
  // finds a WR's slot on every post and completion.
  std::vector<WrSlot> send_slots_, recv_slots_;
  WrSlot& send_slot(uint64_t sequence) { return send_slots_[sequence & (send_slots_.size() - 1)]; }
  WrSlot& recv_slot(uint64_t sequence) { return recv_slots_[sequence & (recv_slots_.size() - 1)]; }
  WrSlot pending_slot_;  // the WR being posted
  // resolve()'s last lookup, valid while the context's memory generation
  // is resolved_generation_.
  MrEntry* resolved_ = nullptr;
  uint32_t resolved_rkey_ = 0;
  uint64_t resolved_generation_ = 0;
  std::deque<HeldCompletion> held_[2];  // send, receive queue: completions waiting for destination copies
  uint64_t send_sequence_ = 0, receive_sequence_ = 0;
};

SoftCq::SoftCq(std::shared_ptr<SoftContext> context, uint32_t entries)
    : context_(std::move(context)),
      ring_(entries),
      event_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      wait_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

int SoftCq::poll(std::span<WorkCompletion> out) {
  bool work;
  const int n = poll(out, work);
  // Where the engines run on another thread (ours or the daemon's), an
  // application spinning on an empty CQ is one more busy thread. When the
  // CPUs are oversubscribed, an empty poll gives the core away: the thread
  // that would fill this CQ (an engine, or a peer process) may be waiting
  // for it. This thread's own preemptions say so, and with the engine
  // thread also that thread's (EngineHost::engine_thread; the daemon's
  // threads are out of sight). Not inside wait(), which yields on its own;
  // never inline, where the caller's poll is the engine.
  const ProgressMode placement = context_->options().progress;
  if (n == 0 && placement != ProgressMode::inline_poll) {
    thread_local host::ContentionDetector caller;
    const uint64_t now = monotonic_ns();
    if (caller.check(now) || context_->host_->contended(now)) {
      context_->contention_yields_.fetch_add(1, std::memory_order_relaxed);
      sched_yield();
    }
  }
  return n;
}

int SoftCq::poll(std::span<WorkCompletion> out, bool& work) {
  work = false;
  if (queued_.load(std::memory_order_acquire) > 0) {
    if (int n = take(out); n > 0) return n;
  }
  work = context_->progress_work();
  return queued_.load(std::memory_order_acquire) > 0 ? take(out) : 0;
}

Result<int> SoftCq::wait(std::span<WorkCompletion> out, std::chrono::nanoseconds timeout) {
  const uint64_t start = monotonic_ns();
  const uint64_t deadline = start + uint64_t(std::max<int64_t>(0, timeout.count()));
  const ContextOptions& o = context_->options();
  const bool adaptive = context_->wait_policy() == WaitPolicy::adaptive;
  // The spin time runs from the last progress that moved anything, not
  // from the call: a WRITE stream's target gets no completion, and a wait
  // that slept whenever its call was older than the spin time slept after
  // every datagram (stop 49 measured a third of the testbed stream lost).
  uint64_t active = start;
  for (;;) {
    bool work;
    if (int n = poll(out, work); n > 0) return n;
    const uint64_t now = monotonic_ns();
    if (now >= deadline) return Status(Errc::timeout, "no completion within the timeout");
    if (work) active = now;
    if (adaptive && now - active >= uint64_t(o.spin_time.count())) {
      // Announce the wait, re-check, then sleep until a datagram, a timer or a completion.
      waiting_.store(true);
      if (int n = take(out); n > 0) {
        waiting_.store(false);
        return n;
      }
      context_->wait_sleeps_.fetch_add(1, std::memory_order_relaxed);
      if (o.progress == ProgressMode::thread) {
        // The engine thread owns the socket and its wake-up fd: wait on ours only.
        pollfd p{wait_fd_, POLLIN, 0};
        ::poll(&p, 1, int(std::min<uint64_t>((deadline - now + 999'999) / 1'000'000, 1000)));
      } else {
        context_->host_->sleep_until_work(deadline, wait_fd_);
      }
      waiting_.store(false);
      // Most wakes are the socket's, not ours: drain wait_fd_ only when it
      // was written (a read that finds nothing was 6% of a testbed
      // receiver's cycles). The flag is set after the write, so a write
      // this misses leaves the flag set for the next wake, which drains it.
      if (wait_rung_.exchange(false, std::memory_order_acquire)) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wait_fd_, &v, sizeof v);
      }
    } else if (o.progress == ProgressMode::thread) {
      std::this_thread::yield();
    }
  }
}

Status SoftCq::request_notify() {
  armed_.store(true);
  context_->watch_completions();
  std::lock_guard lock(mutex_);
  if (count_ > 0) signal();
  return {};
}

Result<std::shared_ptr<ProtectionDomain>> SoftContext::allocate_pd(const std::string& name) {
  std::lock_guard lock(mutex_);
  // "": the tenant this context opened as.
  const std::string& tenant = name.empty() ? options_.tenant : name;
  // With a tenants file, the unnamed default tenant (no credential, no
  // quotas) is not available: open as one of the file's.
  if (tenant.empty() && !options_.tenants_file.empty())
    return Status(Errc::permission_denied, "with a tenants file (" + options_.tenants_file +
                                               "), open the context as one of its tenants (ContextOptions::tenant, STELLAR_TENANT)");
  auto it = tenants_.find(tenant);
  if (it == tenants_.end()) return Status(Errc::not_found, "no tenant named '" + tenant + "'");
  if (!it->second.opened) {
    ++it->second.credential_refusals;
    return Status(Errc::permission_denied, "tenant '" + tenant + "' is in the tenants file: open it with its credential "
                                           "(ContextOptions::tenant or create_tenant)");
  }
  return std::shared_ptr<ProtectionDomain>(std::make_shared<SoftPd>(self(), tenant, next_pd_++));
}

std::vector<TenantCounters> SoftContext::tenant_counters() const {
  auto& self = const_cast<SoftContext&>(*this);
  std::lock_guard lock(self.mutex_);
  std::vector<TenantCounters> out;
  std::map<std::string, size_t> index;
  for (auto& [name, t] : tenants_) {
    if (!t.opened) continue;
    TenantCounters c;
    c.tenant = name;
    c.pkey = t.pkey;
    c.qps = t.qp_count;
    c.registered_bytes = t.registered_bytes;
    for (SoftQp* qp : t.qps) {
      c.send_wrs += qp->outstanding(true);
      c.receive_wrs += qp->outstanding(false);
    }
    c.quota_refusals = t.quota_refusals;
    c.credential_refusals = t.credential_refusals;
    index[name] = out.size();
    out.push_back(std::move(c));
  }
  for (const host::FlowReport& r : host_->flow_report_locked()) {
    auto it = index.find(r.label.tenant);
    if (it == index.end()) continue;
    TrafficCounters tc;
    tc.job = r.label.job;
    tc.traffic_class = r.label.traffic_class;
    tc.qps = r.engines;
    const off::EngineCounters& e = r.counters;
    tc.tx_packets = e.tx_packets, tc.tx_bytes = e.tx_bytes, tc.rx_packets = e.rx_packets, tc.rx_bytes = e.rx_bytes;
    tc.retransmitted_packets = e.retransmitted_packets;
    tc.rx_dropped_malformed = e.decode_errors, tc.rx_dropped_out_of_window = e.out_of_window;
    tc.rx_dropped_bad_token = e.bad_token, tc.rx_access_errors = e.access_errors;
    tc.scheduler_grants = r.waits.waits, tc.queue_delay_ns_total = r.waits.wait_ns_total, tc.queue_delay_ns_max = r.waits.wait_ns_max;
    out[it->second].traffic.push_back(std::move(tc));
  }
  for (TenantCounters& c : out)
    std::sort(c.traffic.begin(), c.traffic.end(),
              [](const TrafficCounters& a, const TrafficCounters& b) { return std::tie(a.job, a.traffic_class) < std::tie(b.job, b.traffic_class); });
  return out;
}

Result<std::shared_ptr<QueuePair>> SoftPd::create_qp(const QpInitAttributes& attr) {
  if (!attr.send_cq || !attr.recv_cq) return Status(Errc::invalid_argument, "create_qp: send_cq and recv_cq are required");
  if (!dynamic_cast<SoftCq*>(attr.send_cq.get()) || !dynamic_cast<SoftCq*>(attr.recv_cq.get()))
    return Status(Errc::invalid_argument, "create_qp: CQs come from another provider");
  const QpCapabilities& c = attr.cap;
  if (c.max_send_wr == 0 || c.max_send_wr > 65536 || c.max_recv_wr == 0 || c.max_recv_wr > 65536)
    return Status(Errc::invalid_argument, "create_qp: max_send_wr/max_recv_wr must be in [1, 65536]");
  if (c.max_send_sge > offload::max_segments || c.max_recv_sge > offload::max_segments)
    return Status(Errc::invalid_argument, "create_qp: at most " + std::to_string(offload::max_segments) + " SGEs");
  if (c.max_inline_data > offload::max_inline_bytes)
    return Status(Errc::invalid_argument, "create_qp: max_inline_data above " + std::to_string(offload::max_inline_bytes));
  // The hints' bounds are the text form's (JobHints::parse), so that every
  // placement carries them whole (the daemon's attach has room for these).
  const JobHints& h = attr.hints ? *attr.hints : context_->options_.hints;
  constexpr auto day = std::chrono::hours(24);
  if (h.job.size() > 128 || h.step_period > day || h.deadline > day || h.step_period.count() < 0 || h.deadline.count() < 0)
    return Status(Errc::invalid_argument, "create_qp: hints: job name over 128 bytes, or step period or deadline outside [0, 24 h]");
  std::shared_ptr<SoftQp> qp;
  {
    std::lock_guard lock(context_->mutex_);
    Tenant& t = context_->tenants_.at(tenant_);
    if (t.options.max_qps && t.qp_count >= t.options.max_qps)
      return SoftContext::over_quota(t, "QP quota (" + std::to_string(t.options.max_qps) + ") reached");
    const uint32_t qpn = t.fresh_qpn();
    t.qpns[qpn] = true;
    qp = std::make_shared<SoftQp>(shared_from_this(), attr, qpn, t.pkey);
    qp->bind_tenant(&t);
    ++t.qp_count;
    t.qps.insert(qp.get());
  }
  return std::shared_ptr<QueuePair>(qp);
}


void SoftContext::poll_held_completions() {
  for (auto& [key, qp] : qps_)
    if (qp->holds_completions()) qp->poll_held();
}

void SoftContext::poll_staging() {
  staging_.poll([this](StagingJob& job, bool failed) {
    SoftQp* qp = static_cast<SoftQp*>(const_cast<void*>(job.owner));
    if (failed) {
      // As a NIC's failed DMA read: this WR fails, the QP goes to ERROR.
      qp->mark_staging_failed(job.wr_id);
      host_->enter_error_locked(qp->engine());
      return false;
    }
    return host_->set_ready_locked(qp->engine(), job.wr_id, job.ready());  // false: the WR is gone (flushed)
  });
}

ContextCounters SoftContext::counters() const {
  auto& self = const_cast<SoftContext&>(*this);
  std::lock_guard lock(self.mutex_);
  const host::HostCounters h = host_->counters_locked();
  const off::EngineCounters& sum = h.engines;
  ContextCounters c;
  c.tx_packets = sum.tx_packets;
  c.tx_bytes = sum.tx_bytes;
  c.rx_packets = sum.rx_packets;
  c.rx_bytes = sum.rx_bytes;
  c.retransmitted_packets = sum.retransmitted_packets;
  c.timeouts = sum.timeouts;
  c.tail_probes = sum.tail_probes;
  c.rx_dropped_malformed = h.malformed + sum.decode_errors;
  c.rx_dropped_unknown_qp = h.unknown_qp + sum.unexpected_packets;
  c.rx_dropped_out_of_window = sum.out_of_window;
  c.rx_duplicates = sum.duplicates;
  c.rx_access_errors = sum.access_errors;
  c.rnr_naks_sent = sum.rnr_naks_sent;
  c.rx_requests_dropped_full = sum.requests_dropped_full;
  c.rx_dropped_bad_token = sum.bad_token;
  c.fault_dropped = h.faults.dropped;
  c.fault_duplicated = h.faults.duplicated;
  c.fault_reordered = h.faults.reordered;
  c.send_errors = h.send_errors;
  c.rx_receive_calls = h.receive_calls;
  c.rx_coalesced = h.coalesced;
  c.rx_placed = h.placed, c.rx_placement_misses = h.placement_misses;
  c.engine_cpu_ns = h.engine_cpu_ns;
  c.daemon_refused_entries = h.refused_entries;
  c.spurious_retransmits = sum.spurious_retransmits;
  c.paths_retired = sum.paths_retired;
  c.rx_congestion_marks = sum.congestion_marks;
  c.migrations = h.migrations, c.path_challenges = h.path_challenges, c.migrations_rejected = h.migrations_rejected;
  c.migration_dropped = h.migration_dropped, c.address_changes = h.rebinds;
  c.last_address_change_ns = h.last_move_ns;
  c.path_mtu_probes = h.path_mtu_probes, c.path_mtu_lowered = h.path_mtu_lowered, c.path_mtu_failed = h.path_mtu_failed;
  c.path_mtu_last_ns = h.path_mtu_last_ns;
  c.wait_sleeps = wait_sleeps_.load(std::memory_order_relaxed);
  c.contention_yields = contention_yields_.load(std::memory_order_relaxed) + host_->contention_yields();
  return c;
}

}  // namespace

// ContextOptions::mtu 0: the largest payload whose datagram fits the MTU
// of the interface that holds `address` (off::payload_for_link_mtu: 61440
// on loopback, 8704 on 9000-byte jumbo frames, 1280 on 1500-byte
// Ethernet in stellar mode; RoCE's MTUs in roce mode). Fewer, larger datagrams are most of what the host path costs
// per byte (docs/wire-format.md has the figures). 4096 when the interface
// cannot be found (the bind then says why).
uint32_t automatic_mtu(const std::string& address, Mode mode) {
  in_addr wanted{};
  if (::inet_pton(AF_INET, address.c_str(), &wanted) != 1) return 4096;
  int link_mtu = 0;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (const ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET ||
          reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr != wanted.s_addr)
        continue;
      ifreq request{};
      std::strncpy(request.ifr_name, i->ifa_name, IFNAMSIZ - 1);
      const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && ::ioctl(fd, SIOCGIFMTU, &request) == 0) link_mtu = request.ifr_mtu;
      if (fd >= 0) ::close(fd);
      break;
    }
    ::freeifaddrs(list);
  }
  if (link_mtu <= 0) return 4096;
  return off::payload_for_link_mtu(uint32_t(link_mtu), mode == Mode::roce ? off::Mode::roce : off::Mode::stellar);
}

Result<std::shared_ptr<Context>> open_soft(const ContextOptions& requested) {
  ContextOptions options = requested;
  if (options.mtu == 0) options.mtu = automatic_mtu(options.bind_address, options.mode);
  auto context = std::make_shared<SoftContext>(options);
  if (Status s = context->start(); !s.ok()) return s;
  return std::shared_ptr<Context>(context);
}

extern const Ops soft_ops;
const Ops soft_ops{Provider::soft, "soft", open_soft, nullptr, std::nullopt, nullptr, nullptr};

}  // namespace stellar::provider

// The verbs provider: the API's objects map 1:1 onto rdma-core's (a Context
// is an ibv_context on one port and GID, a PD an ibv_pd, an MR an ibv_mr, a
// CQ an ibv_cq with its own completion channel, a QueuePair an RC ibv_qp).
// The NIC runs the transport, so there is no engine, no progress thread and
// nothing for progress() to do. Value translation and the device/GID choice
// live in translate.cpp (unit-tested without a device); this file is the
// part that calls libibverbs. docs/verbs-provider.md.
//
// Locking: libibverbs' post and poll calls are thread-safe per object (the
// providers lock the queues), so the data path takes no lock of ours. A QP's
// mutex orders modify() calls and its cached state; a CQ's mutex orders use
// of its completion channel (request_notify, wait).
#include <arpa/inet.h>
#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/config.hpp"
#include "core/log.hpp"
#include "core/providers.hpp"
#include "core/tenants.hpp"
#include "gpu/cuda_driver.hpp"
#include "providers/verbs/rdma_cm.hpp"
#include "providers/verbs/shared_registrations.hpp"
#include "providers/verbs/translate.hpp"

namespace stellar::provider {
namespace {

using namespace verbs;
using Clock = std::chrono::steady_clock;

constexpr uint16_t roce_v2_udp_port = 4791;
constexpr uint32_t max_sges = 32;          // SGE storage on the stack per post
constexpr uint8_t max_rd_atomic = 16;      // outstanding READ/atomics per QP, as the soft provider allows
constexpr uint8_t hop_limit = 255;         // RoCE v2 crosses IP routers; NCCL uses the same

std::string call_failed(const std::string& call, int error) {
  return call + ": " + std::strerror(error) + " (errno " + std::to_string(error) + ")";
}

Errc errc_of(int error) {
  switch (error) {
    case EINVAL: return Errc::invalid_argument;
    case ENOMEM: return Errc::resource_exhausted;
    case EPERM:
    case EACCES: return Errc::permission_denied;
    case EOPNOTSUPP: return Errc::unsupported;
    default: return Errc::io_error;
  }
}

// Every device's GID table, from libibverbs (ibv_query_gid_table, rdma-core
// 32+ on kernels with the uverbs ioctl interface), else from sysfs.
std::vector<DeviceGids> query_gid_tables(ibv_device** list, int count) {
  std::vector<DeviceGids> out;
  std::vector<DeviceGids> sysfs;  // read once, only if some device needs it
  bool sysfs_read = false;
  for (int i = 0; i < count; ++i) {
    DeviceGids device{ibv_get_device_name(list[i]), {}};
    ibv_context* context = ibv_open_device(list[i]);
    if (!context) {
      log().warn("verbs provider: {}", call_failed(std::string("ibv_open_device(") + device.device + ")", errno));
      out.push_back(std::move(device));
      continue;
    }
    ibv_device_attr attr{};
    std::map<uint32_t, bool> active;
    size_t table_length = 0;
    if (ibv_query_device(context, &attr) == 0) {
      for (uint32_t port = 1; port <= attr.phys_port_cnt; ++port) {
        ibv_port_attr port_attr{};
        if (ibv_query_port(context, uint8_t(port), &port_attr) != 0) continue;
        active[port] = port_attr.state == IBV_PORT_ACTIVE;
        table_length += size_t(std::max(port_attr.gid_tbl_len, 0));
      }
    }
    std::vector<ibv_gid_entry> entries(std::max<size_t>(table_length, 1));
    const ssize_t n = ibv_query_gid_table(context, entries.data(), entries.size(), 0);
    if (n >= 0) {
      for (ssize_t k = 0; k < n; ++k) {
        const ibv_gid_entry& e = entries[size_t(k)];
        GidEntry g;
        g.port = e.port_num;
        g.index = e.gid_index;
        std::memcpy(g.gid.data(), e.gid.raw, 16);
        if (g.gid == Gid{}) continue;
        g.type = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? GidType::roce_v2 : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? GidType::roce_v1 : GidType::ib;
        char name[IF_NAMESIZE] = {};
        if (e.ndev_ifindex && if_indextoname(e.ndev_ifindex, name)) g.netdev = name;
        g.port_active = active[g.port];
        device.gids.push_back(std::move(g));
      }
      std::sort(device.gids.begin(), device.gids.end(),
                [](const GidEntry& a, const GidEntry& b) { return a.port != b.port ? a.port < b.port : a.index < b.index; });
    } else {
      // Older kernels lack the GID-table ioctl; sysfs has had the same table since 4.x.
      if (!sysfs_read) sysfs = read_sysfs_gid_tables("/sys"), sysfs_read = true;
      for (auto& d : sysfs)
        if (d.device == device.device) device.gids = d.gids;
      log().debug("verbs provider: {}: ibv_query_gid_table failed ({}), read the GID table from sysfs", device.device, std::strerror(int(-n)));
    }
    ibv_close_device(context);
    out.push_back(std::move(device));
  }
  return out;
}

class VerbsContext;
class VerbsPd;

class VerbsCq final : public CompletionQueue {
 public:
  VerbsCq(std::shared_ptr<VerbsContext> context, ibv_comp_channel* channel, ibv_cq* cq)
      : context_(std::move(context)), channel_(channel), cq_(cq) {}
  ~VerbsCq() override {
    // Every event taken was acknowledged at once, so destroy does not block.
    if (int rc = ibv_destroy_cq(cq_); rc != 0) log().error("verbs provider: {}", call_failed("ibv_destroy_cq", rc));
    ibv_destroy_comp_channel(channel_);
  }

  int poll(std::span<WorkCompletion> out) override {
    int total = 0;
    ibv_wc wc[32];
    while (size_t(total) < out.size()) {
      const int want = int(std::min<size_t>(std::size(wc), out.size() - size_t(total)));
      const int n = ibv_poll_cq(cq_, want, wc);
      if (n < 0) {
        log().error("verbs provider: ibv_poll_cq failed ({}); the CQ is unusable", n);
        break;
      }
      for (int i = 0; i < n; ++i) {
        out[size_t(total++)] = from_ibv_wc(wc[i]);
        if (wc[i].status != IBV_WC_SUCCESS)  // rare; debug level is off by default
          log().debug("verbs provider: QP {} WR {}: {}", wc[i].qp_num, wc[i].wr_id, describe_ibv_status(wc[i].status, wc[i].vendor_err));
      }
      if (n < want) break;
    }
    return total;
  }

  Result<int> wait(std::span<WorkCompletion> out, std::chrono::nanoseconds timeout) override;

  int fd() const override { return channel_->fd; }

  Status request_notify() override {
    std::lock_guard lock(mutex_);
    drain_events();
    if (int rc = ibv_req_notify_cq(cq_, 0); rc != 0) return Status(Errc::io_error, call_failed("ibv_req_notify_cq", rc));
    return {};
  }

  uint32_t capacity() const override { return uint32_t(cq_->cqe); }
  ibv_cq* cq() const { return cq_; }

 private:
  // Takes and acknowledges every event queued on the channel (its fd is
  // non-blocking), so the fd stops being readable until the next event.
  void drain_events() {
    ibv_cq* event_cq = nullptr;
    void* event_context = nullptr;
    unsigned taken = 0;
    while (ibv_get_cq_event(channel_, &event_cq, &event_context) == 0) ++taken;
    if (taken) ibv_ack_cq_events(cq_, taken);
  }

  std::shared_ptr<VerbsContext> context_;
  std::mutex mutex_;
  ibv_comp_channel* channel_;
  ibv_cq* cq_;
};

class VerbsContext final : public Context {
 public:
  VerbsContext(const ContextOptions& options, ibv_context* context, GidChoice choice, const ibv_device_attr& device,
               const ibv_port_attr& port, uint8_t traffic_class)
      : options_(options), wait_(options.wait), context_(context), choice_(std::move(choice)), device_(device), port_(port),
        traffic_class_(traffic_class) {
    tenants_[""] = Partition{0xffff, 0};
  }
  ~VerbsContext() override { ibv_close_device(context_); }

  Status create_tenant(const std::string& name, const TenantOptions& o) override {
    std::lock_guard lock(mutex_);
    if (name.empty() || tenants_.count(name)) return Status(Errc::invalid_argument, "tenant '" + name + "' exists or has no name");
    if (o.weight > 1 || o.rate_bytes_per_s || o.max_qps || o.max_registered_bytes || o.max_receive_wrs || o.max_send_wrs)
      return Status(Errc::unsupported, "verbs provider: tenant weights, rate limits and quotas are the soft provider's (the NIC's "
                                       "own QoS is configured outside Stellar); the traffic class follows the job hints");
    if (o.pkey == 0) {
      // Without a partition key of its own the tenant shares the default partition;
      // its PDs still keep its keys from every other PD's QPs (the NIC checks).
      tenants_[name] = Partition{0xffff, 0};
      return {};
    }
    const int index = ibv_get_pkey_index(context_, port_num(), htons(o.pkey));
    if (index < 0)
      return Status(Errc::not_found, "partition key " + std::to_string(o.pkey) + " is not in the P_Key table of " + choice_.device +
                                         " port " + std::to_string(port_num()) + " (the subnet manager / switch configures it)");
    tenants_[name] = Partition{o.pkey, uint16_t(index)};
    return {};
  }

  Result<std::shared_ptr<ProtectionDomain>> allocate_pd(const std::string& tenant) override;

  Result<std::shared_ptr<CompletionQueue>> create_cq(uint32_t entries) override {
    if (entries == 0 || entries > uint32_t(device_.max_cqe))
      return Status(Errc::invalid_argument, "CQ entries must be in [1, " + std::to_string(device_.max_cqe) + "] on " + choice_.device);
    ibv_comp_channel* channel = ibv_create_comp_channel(context_);
    if (!channel) return Status(errc_of(errno), call_failed("ibv_create_comp_channel", errno));
    // Non-blocking, so request_notify and wait can drain events without sleeping.
    const int flags = fcntl(channel->fd, F_GETFL);
    if (flags < 0 || fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
      const int e = errno;
      ibv_destroy_comp_channel(channel);
      return Status(Errc::io_error, call_failed("fcntl(O_NONBLOCK) on the completion channel", e));
    }
    ibv_cq* cq = ibv_create_cq(context_, int(entries), nullptr, channel, 0);
    if (!cq) {
      const int e = errno;
      ibv_destroy_comp_channel(channel);
      return Status(errc_of(e), call_failed("ibv_create_cq(" + std::to_string(entries) + ")", e));
    }
    return std::shared_ptr<CompletionQueue>(std::make_shared<VerbsCq>(self(), channel, cq));
  }

  void progress() override {}                // the NIC progresses itself
  void flush_acknowledgements() override {}  // the NIC acknowledges
  int progress_fd() const override { return -1; }
  ContextCounters counters() const override;
  std::vector<TenantCounters> tenant_counters() const override {
    std::lock_guard lock(const_cast<std::mutex&>(mutex_));
    std::vector<TenantCounters> out;
    for (auto& [name, p] : tenants_) {
      TenantCounters c;
      c.tenant = name;
      c.pkey = p.pkey;
      out.push_back(std::move(c));
    }
    return out;
  }
  const ContextOptions& options() const override { return options_; }
  void set_wait_policy(WaitPolicy w) override { wait_.store(w, std::memory_order_relaxed); }
  WaitPolicy wait_policy() const override { return wait_.load(std::memory_order_relaxed); }
  std::string local_address() const override { return choice_.ipv4.empty() ? options_.bind_address : choice_.ipv4; }
  uint16_t local_port() const override { return roce_v2_udp_port; }
  Status change_address(const std::string&) override {
    return Status(Errc::unsupported, "verbs provider: the NIC's GID names the connection (RoCE has no connection IDs)");
  }

  std::shared_ptr<VerbsContext> self() { return std::static_pointer_cast<VerbsContext>(shared_from_this()); }
  ibv_context* context() const { return context_; }
  uint8_t port_num() const { return uint8_t(choice_.entry.port); }
  const GidChoice& choice() const { return choice_; }
  const ibv_device_attr& device() const { return device_; }
  const ibv_port_attr& port() const { return port_; }
  bool ethernet() const { return port_.link_layer == IBV_LINK_LAYER_ETHERNET; }
  uint8_t traffic_class() const { return traffic_class_; }
  // The path MTU this side offers: the port's active MTU, at most options().mtu (0: no cap).
  uint32_t mtu() const { return std::min(mtu_bytes(port_.active_mtu), options_.mtu ? options_.mtu : 4096u); }

 private:
  struct Partition {
    uint16_t pkey = 0xffff;
    uint16_t index = 0;
  };
  ContextOptions options_;
  std::atomic<WaitPolicy> wait_;  // options_.wait, then set_wait_policy()
  ibv_context* context_;
  GidChoice choice_;
  ibv_device_attr device_;
  ibv_port_attr port_;
  uint8_t traffic_class_;
  std::mutex mutex_;
  std::map<std::string, Partition> tenants_;
};

class VerbsPd final : public ProtectionDomain, public std::enable_shared_from_this<VerbsPd> {
 public:
  using Shared = SharedRegistrations<ibv_mr*>;

  VerbsPd(std::shared_ptr<VerbsContext> context, ibv_pd* pd, std::string tenant, uint16_t pkey, uint16_t pkey_index)
      : context_(std::move(context)), pd_(pd), tenant_(std::move(tenant)), pkey_(pkey), pkey_index_(pkey_index) {}
  ~VerbsPd() override {
    if (int rc = ibv_dealloc_pd(pd_); rc != 0) log().error("verbs provider: {}", call_failed("ibv_dealloc_pd", rc));
  }
  Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length, uint32_t access) override;
  Result<std::shared_ptr<QueuePair>> create_qp(const QpInitAttributes&) override;
  const std::string& tenant() const override { return tenant_; }
  VerbsContext& context() const { return *context_; }
  uint16_t pkey() const { return pkey_; }
  uint16_t pkey_index() const { return pkey_index_; }

 private:
  Result<ibv_mr*> register_gpu(void* addr, size_t length, unsigned flags);

  std::shared_ptr<VerbsContext> context_;
  ibv_pd* pd_;
  std::string tenant_;
  uint16_t pkey_, pkey_index_;
  // Live GPU registrations, shared by registrations of the same allocation,
  // access and page cover (shared_registrations.hpp). Empty when the PD
  // goes: every MR holds the PD, and the last use of a registration
  // deregisters it.
  Shared shared_{[](ibv_mr*&& mr) {
    if (int rc = ibv_dereg_mr(mr); rc != 0) log().error("verbs provider: {}", call_failed("ibv_dereg_mr", rc));
  }};
};

Result<std::shared_ptr<ProtectionDomain>> VerbsContext::allocate_pd(const std::string& tenant) {
  Partition partition;
  {
    std::lock_guard lock(mutex_);
    auto it = tenants_.find(tenant);
    if (it == tenants_.end()) return Status(Errc::not_found, "no tenant named '" + tenant + "'");
    partition = it->second;
  }
  ibv_pd* pd = ibv_alloc_pd(context_);
  if (!pd) return Status(errc_of(errno), call_failed("ibv_alloc_pd", errno));
  return std::shared_ptr<ProtectionDomain>(std::make_shared<VerbsPd>(self(), pd, tenant, partition.pkey, partition.index));
}

// A registration: its own ibv_mr (host memory), or a use of a shared GPU
// registration that may cover more than this region (same keys).
class VerbsMr final : public MemoryRegion {
 public:
  VerbsMr(std::shared_ptr<VerbsPd> pd, ibv_mr* mr, uint64_t addr, uint64_t length, uint32_t access, VerbsPd::Shared::Use use = {})
      : pd_(std::move(pd)), mr_(mr), addr_(addr), length_(length), access_(access), use_(std::move(use)) {}
  ~VerbsMr() override {
    if (use_) {
      VerbsPd::Shared::release(use_);  // deregisters the shared MR if this was its last user
    } else if (int rc = ibv_dereg_mr(mr_); rc != 0) {
      log().error("verbs provider: {}", call_failed("ibv_dereg_mr", rc));
    }
  }
  uint32_t lkey() const override { return mr_->lkey; }
  uint32_t rkey() const override { return mr_->rkey; }
  uint64_t addr() const override { return addr_; }
  uint64_t length() const override { return length_; }
  uint32_t access() const override { return access_; }

 private:
  std::shared_ptr<VerbsPd> pd_;  // the PD outlives its regions
  ibv_mr* mr_;
  uint64_t addr_, length_;  // what the caller registered
  uint32_t access_;
  VerbsPd::Shared::Use use_;
};

// GPU memory (docs/gpu.md): dma-buf first, which needs no extra kernel
// module; the MR keeps its own reference to the dma-buf, so the fd closes
// when `buffer` goes out of scope. Then the nvidia-peermem route (the kernel
// module pins device pages behind ibv_reg_mr).
Result<ibv_mr*> VerbsPd::register_gpu(void* addr, size_t length, unsigned flags) {
  std::string dmabuf_failure;
  auto driver = gpu::CudaDriver::load();
  auto buffer = driver ? gpu::export_dmabuf(**driver, addr, length) : Result<gpu::DmaBuf>(driver.status());
  if (buffer) {
    if (ibv_mr* mr = ibv_reg_dmabuf_mr(pd_, buffer->offset(), length, reinterpret_cast<uint64_t>(addr), buffer->fd(), int(flags))) {
      log().debug("verbs provider: GPU memory {:#x} +{} registered through dma-buf", reinterpret_cast<uint64_t>(addr), length);
      return mr;
    }
    dmabuf_failure = call_failed("ibv_reg_dmabuf_mr", errno);
  } else {
    dmabuf_failure = buffer.status().to_string();
  }
  if (ibv_mr* mr = ibv_reg_mr_iova2(pd_, addr, length, reinterpret_cast<uint64_t>(addr), flags)) {
    log().debug("verbs provider: GPU memory {:#x} +{} registered through nvidia-peermem (dma-buf: {})", reinterpret_cast<uint64_t>(addr), length,
                dmabuf_failure);
    return mr;
  }
  const int e = errno;
  return Status(Errc::unsupported, "register_memory: GPU memory at " + std::to_string(reinterpret_cast<uint64_t>(addr)) +
                                       " could not be registered: dma-buf: " + dmabuf_failure + "; nvidia-peermem: " +
                                       call_failed("ibv_reg_mr_iova2", e) + " (load nvidia_peermem or use a dma-buf capable driver; `stellar doctor` checks both)");
}

Result<std::unique_ptr<MemoryRegion>> VerbsPd::register_memory(void* addr, size_t length, uint32_t access) {
  if (!addr && length) return Status(Errc::invalid_argument, "register_memory: null address");
  if (access & ~uint32_t(access_local_write | access_remote_write | access_remote_read | access_remote_atomic))
    return Status(Errc::invalid_argument, "register_memory: unknown access bits");
  if ((access & (access_remote_write | access_remote_atomic)) && !(access & access_local_write))
    return Status(Errc::invalid_argument, "register_memory: remote write/atomic access requires local write (as in verbs)");
  // Relaxed ordering lets the NIC's PCIe writes pass each other (a large win
  // behind some root complexes and for GPU memory). It is an optional flag:
  // libibverbs drops it where the kernel or device lacks it, and
  // ibv_reg_mr_iova2 is the call that passes optional flags on. iova = the
  // address, so remote peers use virtual addresses as everywhere else.
  const unsigned flags = to_ibv_access(access) | IBV_ACCESS_RELAXED_ORDERING;
  const uint64_t address = reinterpret_cast<uint64_t>(addr);
  if (length && gpu::memory_kind(addr) == gpu::MemoryKind::device) {
    auto driver = gpu::CudaDriver::load();
    auto info = driver ? gpu::query_pointer(**driver, addr) : Result<gpu::PointerInfo>(driver.status());
    if (!info) return info.status();
    // Keyed by page range (frameworks register neighbouring buffers of one
    // allocation, and dma-buf export rounds to pages anyway), but never
    // reaching into another allocation.
    const gpu::PageRange cover = gpu::page_cover_within(address, length, info->allocation_start, info->allocation_size, gpu::host_page_size());
    bool hit = false;
    auto use = shared_.acquire(
        address, length, cover.start, cover.length, access, info->buffer_id,
        [&](uint64_t start, uint64_t bytes) { return register_gpu(reinterpret_cast<void*>(start), bytes, flags); }, &hit);
    if (!use) return use.status();
    if (hit) log().debug("verbs provider: GPU memory {:#x} +{}: shares a live registration", address, length);
    ibv_mr* mr = use->handle().handle;
    return std::unique_ptr<MemoryRegion>(std::make_unique<VerbsMr>(shared_from_this(), mr, address, length, access, std::move(*use)));
  }
  ibv_mr* mr = ibv_reg_mr_iova2(pd_, addr, length, address, flags);
  if (!mr) {
    const int e = errno;
    std::string hint;
    if (e == ENOMEM) hint = " (pinned memory is limited by RLIMIT_MEMLOCK: raise `ulimit -l`)";
    if (e == EFAULT) hint = " (the range is not mapped)";
    return Status(e == EFAULT ? Errc::invalid_argument : errc_of(e),
                  call_failed("ibv_reg_mr_iova2(" + std::to_string(length) + " bytes)", e) + hint);
  }
  return std::unique_ptr<MemoryRegion>(std::make_unique<VerbsMr>(shared_from_this(), mr, address, length, access));
}

class VerbsQp final : public QueuePair {
 public:
  VerbsQp(std::shared_ptr<VerbsPd> pd, std::shared_ptr<VerbsCq> send_cq, std::shared_ptr<VerbsCq> recv_cq, ibv_qp* qp, QpCapabilities cap,
          uint8_t traffic_class)
      : pd_(std::move(pd)), send_cq_(std::move(send_cq)), recv_cq_(std::move(recv_cq)), qp_(qp), cap_(cap), traffic_class_(traffic_class) {
    std::random_device r;
    psn_ = r() & 0xffffff;
  }
  ~VerbsQp() override {
    if (int rc = ibv_destroy_qp(qp_); rc != 0) log().error("verbs provider: {}", call_failed("ibv_destroy_qp", rc));
  }

  uint32_t qp_num() const override { return qp_->qp_num; }

  QpState state() const override {
    std::lock_guard lock(mutex_);
    return current_locked();
  }

  Status modify(const QpModify& m) override;

  Status post_send(const SendWr& wr) override {
    const QpState s = cached_.load(std::memory_order_relaxed);
    if (s != QpState::rts && s != QpState::error)
      return Status(Errc::wrong_state, "post_send on QP " + std::to_string(qp_->qp_num) + " in " + to_string(s) + " (needs RTS)");
    std::array<ibv_sge, max_sges> sges;
    ibv_send_wr out;
    if (Status st = to_ibv_send_wr(wr, SendLimits{cap_.max_send_sge, cap_.max_inline_data}, sges, out); !st.ok()) return st;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(qp_, &out, &bad); rc != 0) {
      if (rc == ENOMEM) return Status(Errc::queue_full, "post_send: send queue full (max_send_wr " + std::to_string(cap_.max_send_wr) + ")");
      return Status(errc_of(rc), call_failed("post_send: ibv_post_send", rc));
    }
    return {};
  }

  Status post_recv(const RecvWr& wr) override {
    if (cached_.load(std::memory_order_relaxed) == QpState::reset)
      return Status(Errc::wrong_state, "post_recv on QP " + std::to_string(qp_->qp_num) + " in RESET (needs INIT or later)");
    std::array<ibv_sge, max_sges> sges;
    ibv_recv_wr out;
    if (Status st = to_ibv_recv_wr(wr, cap_.max_recv_sge, sges, out); !st.ok()) return st;
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(qp_, &out, &bad); rc != 0) {
      if (rc == ENOMEM) return Status(Errc::queue_full, "post_recv: receive queue full (max_recv_wr " + std::to_string(cap_.max_recv_wr) + ")");
      return Status(errc_of(rc), call_failed("post_recv: ibv_post_recv", rc));
    }
    return {};
  }

  // cm::Method::rdma_cm (rdma_cm.cpp).
  CmQp cm_info() const {
    std::lock_guard lock(mutex_);
    const VerbsContext& c = pd_->context();
    CmQp info;
    info.device = c.choice().device;
    info.port = uint8_t(c.port_num());
    info.source_address = c.local_address();  // the IPv4 the chosen GID carries, else bind_address
    info.mtu = c.mtu();
    info.state = current_locked();
    info.initiator_depth = uint8_t(std::min<int>(max_rd_atomic, std::max(c.device().max_qp_init_rd_atom, 1)));
    info.responder_resources = uint8_t(std::min<int>(max_rd_atomic, std::max(c.device().max_qp_rd_atom, 1)));
    return info;
  }
  Status modify_for_cm(ibv_qp_attr attr, int mask, const QpTiming& timing, uint32_t peer_mtu);

  QpEndpoint local_endpoint() const override {
    const VerbsContext& c = pd_->context();
    QpEndpoint e;
    e.address = c.local_address();
    e.udp_port = roce_v2_udp_port;
    e.qp_num = qp_->qp_num;
    e.psn = psn_;
    e.mtu = c.mtu();
    e.pkey = pd_->pkey();
    e.mode = Mode::roce;
    e.gid = format_gid(c.choice().entry.gid);
    e.lid = c.port().lid;
    return e;
  }

 private:
  // The NIC moves a QP to ERROR on its own (an error completion); ask it
  // whenever that can have happened. Not on the data path.
  QpState current_locked() const {
    if (state_ == QpState::rtr || state_ == QpState::rts) {
      ibv_qp_attr attr{};
      ibv_qp_init_attr init{};
      if (ibv_query_qp(qp_, &attr, IBV_QP_STATE, &init) == 0 &&
          (attr.qp_state == IBV_QPS_ERR || attr.qp_state == IBV_QPS_SQE || attr.qp_state == IBV_QPS_UNKNOWN)) {
        state_ = QpState::error;
        cached_.store(state_, std::memory_order_relaxed);
      }
    }
    return state_;
  }
  void set_state(QpState s) {
    state_ = s;
    cached_.store(s, std::memory_order_relaxed);
  }

  std::shared_ptr<VerbsPd> pd_;
  std::shared_ptr<VerbsCq> send_cq_, recv_cq_;  // kept alive while the QP uses them
  ibv_qp* qp_;
  QpCapabilities cap_;
  uint8_t traffic_class_;  // GRH traffic class (DSCP << 2)
  uint32_t psn_ = 0;
  VerbsTiming timing_{};  // from RTR, applied at RTS
  mutable std::mutex mutex_;
  mutable QpState state_ = QpState::reset;
  mutable std::atomic<QpState> cached_{QpState::reset};  // state_, read by post_* without the lock
};

Status VerbsQp::modify(const QpModify& m) {
  std::lock_guard lock(mutex_);
  VerbsContext& c = pd_->context();
  const QpState current = current_locked();
  const std::string qp_name = "QP " + std::to_string(qp_->qp_num);
  auto bad = [&] { return Status(Errc::wrong_state, qp_name + ": cannot go from " + to_string(current) + " to " + to_string(m.state)); };
  auto failed = [&](const char* step, int rc, const std::string& hint = "") {
    return Status(errc_of(rc), qp_name + ": " + call_failed(std::string("ibv_modify_qp(") + step + ")", rc) + hint);
  };
  ibv_qp_attr attr{};
  switch (m.state) {
    case QpState::init: {
      if (current != QpState::reset && current != QpState::init) return bad();
      attr.qp_state = IBV_QPS_INIT;
      attr.pkey_index = pd_->pkey_index();
      attr.port_num = c.port_num();
      attr.qp_access_flags = to_ibv_access(m.access);
      if (int rc = ibv_modify_qp(qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS); rc != 0)
        return failed("INIT", rc);
      set_state(QpState::init);
      return {};
    }
    case QpState::rtr: {
      if (current != QpState::init) return bad();
      if (m.remote.gid.empty())
        return Status(Errc::invalid_argument, qp_name + ": the peer endpoint carries no GID; a verbs QP connects only to a verbs QP "
                                                        "(is the peer running --provider soft?)");
      const auto gid = parse_gid(m.remote.gid);
      if (!gid) return Status(Errc::invalid_argument, qp_name + ": the peer's GID '" + m.remote.gid + "' is malformed");
      if (m.remote.pkey != pd_->pkey()) return Status(Errc::permission_denied, qp_name + ": the peer QP belongs to another partition (tenant)");
      const auto mtu = ibv_mtu_at_most(std::min(c.mtu(), m.remote.mtu));
      if (!mtu) return Status(Errc::invalid_argument, qp_name + ": path MTU below 256 bytes (peer offers " + std::to_string(m.remote.mtu) + ")");
      timing_ = to_verbs_timing(m.timing);
      attr.qp_state = IBV_QPS_RTR;
      attr.path_mtu = *mtu;
      attr.dest_qp_num = m.remote.qp_num & 0xffffff;
      attr.rq_psn = m.remote.psn & 0xffffff;
      attr.max_dest_rd_atomic = uint8_t(std::min<int>(max_rd_atomic, std::max(c.device().max_qp_rd_atom, 1)));
      attr.min_rnr_timer = timing_.min_rnr_timer;
      attr.ah_attr.port_num = c.port_num();
      attr.ah_attr.sl = 0;
      attr.ah_attr.src_path_bits = 0;
      attr.ah_attr.dlid = m.remote.lid;
      // RoCE always routes by GID (the GRH becomes the IP header; the kernel
      // resolves the next hop's MAC from it). InfiniBand routes by LID within
      // a subnet; a GRH is added only when the peer has no LID.
      attr.ah_attr.is_global = c.ethernet() || m.remote.lid == 0;
      if (attr.ah_attr.is_global) {
        std::memcpy(attr.ah_attr.grh.dgid.raw, gid->data(), 16);
        attr.ah_attr.grh.sgid_index = uint8_t(c.choice().entry.index);
        attr.ah_attr.grh.hop_limit = hop_limit;
        attr.ah_attr.grh.traffic_class = traffic_class_;
        attr.ah_attr.grh.flow_label = 0;
      }
      const int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
      if (int rc = ibv_modify_qp(qp_, &attr, mask); rc != 0)
        return failed("RTR", rc, rc == EINVAL || rc == ENETUNREACH || rc == EHOSTUNREACH
                                     ? " (is " + m.remote.address + " / GID " + m.remote.gid + " reachable from " + c.choice().device + " port " +
                                           std::to_string(c.port_num()) + "? the kernel resolves the peer's MAC from its GID)"
                                     : "");
      set_state(QpState::rtr);
      return {};
    }
    case QpState::rts: {
      if (current != QpState::rtr) return bad();
      attr.qp_state = IBV_QPS_RTS;
      attr.timeout = timing_.timeout;
      attr.retry_cnt = timing_.retry_cnt;
      attr.rnr_retry = timing_.rnr_retry;
      attr.sq_psn = psn_;
      attr.max_rd_atomic = uint8_t(std::min<int>(max_rd_atomic, std::max(c.device().max_qp_init_rd_atom, 1)));
      const int mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
      if (int rc = ibv_modify_qp(qp_, &attr, mask); rc != 0) return failed("RTS", rc);
      set_state(QpState::rts);
      return {};
    }
    case QpState::error: {
      attr.qp_state = IBV_QPS_ERR;
      if (int rc = ibv_modify_qp(qp_, &attr, IBV_QP_STATE); rc != 0) return failed("ERROR", rc);
      log().debug("{}: moved to ERROR by the user", qp_name);
      set_state(QpState::error);
      return {};
    }
    case QpState::reset:
      return Status(Errc::unsupported, "moving a QP back to RESET is not supported; create a new QP");
  }
  return bad();
}

Status VerbsQp::modify_for_cm(ibv_qp_attr attr, int mask, const QpTiming& timing, uint32_t peer_mtu) {
  std::lock_guard lock(mutex_);
  VerbsContext& c = pd_->context();
  const QpState current = current_locked();
  const std::string qp_name = "QP " + std::to_string(qp_->qp_num);
  const VerbsTiming t = to_verbs_timing(timing);
  QpState next;
  const char* step;
  switch (attr.qp_state) {
    case IBV_QPS_INIT:
      // RESET -> INIT, or INIT -> INIT for a QP the application moved to INIT itself.
      if (current != QpState::reset && current != QpState::init)
        return Status(Errc::wrong_state, qp_name + ": rdma_cm INIT from " + std::string(to_string(current)));
      // rdma_cm takes the partition from the IPoIB interface (active) or the
      // request (passive); a tenant's QP stays in its tenant's partition.
      if ((mask & IBV_QP_PKEY_INDEX) && attr.pkey_index != pd_->pkey_index())
        return Status(Errc::permission_denied, qp_name + ": rdma_cm would put the QP in partition index " + std::to_string(attr.pkey_index) +
                                                   ", its tenant's is " + std::to_string(pd_->pkey_index()));
      attr.qp_access_flags = to_ibv_access(access_local_write | access_remote_write | access_remote_read | access_remote_atomic);
      mask |= IBV_QP_ACCESS_FLAGS;
      next = QpState::init, step = "INIT";
      break;
    case IBV_QPS_RTR:
      if (current != QpState::init) return Status(Errc::wrong_state, qp_name + ": rdma_cm RTR from " + std::string(to_string(current)));
      // Both sides must use the same MTU: the smaller of the route's, this
      // side's and the peer's (which the private data carries).
      if (auto cap = ibv_mtu_at_most(std::min(c.mtu(), peer_mtu ? peer_mtu : c.mtu())); cap && (mask & IBV_QP_PATH_MTU) && attr.path_mtu > *cap)
        attr.path_mtu = *cap;
      // librdmacm's workaround for old rdma_ucm kernels, which report
      // RoCE-only mask bits (21-23) on InfiniBand ports.
      if (!c.ethernet()) mask &= ~0xe00000;
      if (attr.ah_attr.is_global && traffic_class_) attr.ah_attr.grh.traffic_class = traffic_class_;
      attr.min_rnr_timer = t.min_rnr_timer;
      mask |= IBV_QP_MIN_RNR_TIMER;
      next = QpState::rtr, step = "RTR";
      break;
    case IBV_QPS_RTS:
      if (current != QpState::rtr) return Status(Errc::wrong_state, qp_name + ": rdma_cm RTS from " + std::string(to_string(current)));
      // The NIC's retransmission timer and retries follow QpTiming, as with the TCP method.
      attr.timeout = t.timeout;
      attr.retry_cnt = t.retry_cnt;
      attr.rnr_retry = t.rnr_retry;
      mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY;
      next = QpState::rts, step = "RTS";
      break;
    default:
      return Status(Errc::invalid_argument, qp_name + ": rdma_cm asked for an unexpected QP state");
  }
  if (int rc = ibv_modify_qp(qp_, &attr, mask); rc != 0)
    return Status(errc_of(rc), qp_name + ": " + call_failed(std::string("ibv_modify_qp(") + step + ", rdma_cm attributes)", rc));
  set_state(next);
  return {};
}

Result<std::shared_ptr<QueuePair>> VerbsPd::create_qp(const QpInitAttributes& attr) {
  if (!attr.send_cq || !attr.recv_cq) return Status(Errc::invalid_argument, "create_qp: send_cq and recv_cq are required");
  auto send_cq = std::dynamic_pointer_cast<VerbsCq>(attr.send_cq);
  auto recv_cq = std::dynamic_pointer_cast<VerbsCq>(attr.recv_cq);
  if (!send_cq || !recv_cq) return Status(Errc::invalid_argument, "create_qp: CQs come from another provider");
  const QpCapabilities& c = attr.cap;
  const ibv_device_attr& d = context_->device();
  const uint32_t max_wr = uint32_t(std::max(d.max_qp_wr, 1));
  const uint32_t max_sge = std::min<uint32_t>(uint32_t(std::max(d.max_sge, 1)), max_sges);
  if (c.max_send_wr == 0 || c.max_send_wr > max_wr || c.max_recv_wr == 0 || c.max_recv_wr > max_wr)
    return Status(Errc::invalid_argument, "create_qp: max_send_wr/max_recv_wr must be in [1, " + std::to_string(max_wr) + "]");
  if (c.max_send_sge > max_sge || c.max_recv_sge > max_sge)
    return Status(Errc::invalid_argument, "create_qp: at most " + std::to_string(max_sge) + " SGEs on " + context_->choice().device);
  ibv_qp_init_attr init{};
  init.send_cq = send_cq->cq();
  init.recv_cq = recv_cq->cq();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // completions follow each WR's send_signaled flag
  init.cap.max_send_wr = c.max_send_wr;
  init.cap.max_recv_wr = c.max_recv_wr;
  init.cap.max_send_sge = std::max<uint32_t>(c.max_send_sge, 1);
  init.cap.max_recv_sge = std::max<uint32_t>(c.max_recv_sge, 1);
  init.cap.max_inline_data = c.max_inline_data;
  ibv_qp* qp = ibv_create_qp(pd_, &init);
  if (!qp) {
    const int e = errno;
    return Status(errc_of(e), call_failed("create_qp: ibv_create_qp", e) +
                                  (e == EINVAL ? " (max_inline_data " + std::to_string(c.max_inline_data) + " may exceed what the device offers)" : ""));
  }
  // The GRH traffic class: $STELLAR_VERBS_TC for every QP when set (as
  // NCCL_IB_TC), else the job hints' class's DSCP (docs/scheduler.md).
  const uint8_t tc = context_->traffic_class() ? context_->traffic_class()
                                               : tenants::tos_of(context_->options(), attr.hints.value_or(context_->options().hints));
  return std::shared_ptr<QueuePair>(std::make_shared<VerbsQp>(shared_from_this(), std::move(send_cq), std::move(recv_cq), qp, c, tc));
}

Result<int> VerbsCq::wait(std::span<WorkCompletion> out, std::chrono::nanoseconds timeout) {
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  const ContextOptions& o = context_->options();
  for (;;) {
    if (int n = poll(out); n > 0) return n;
    const auto now = Clock::now();
    if (now >= deadline) return Status(Errc::timeout, "no completion within the timeout");
    if (context_->wait_policy() == WaitPolicy::busy_poll || now - start < o.spin_time) continue;
    // Adaptive: arm the CQ, look once more (a completion may have landed
    // before the arm), then sleep on the channel until an event or the deadline.
    std::unique_lock lock(mutex_);
    drain_events();
    if (int rc = ibv_req_notify_cq(cq_, 0); rc != 0) return Status(Errc::io_error, call_failed("ibv_req_notify_cq", rc));
    if (int n = poll(out); n > 0) return n;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()) + std::chrono::milliseconds(1);
    lock.unlock();  // request_notify from another thread must not wait for this sleep
    pollfd p{channel_->fd, POLLIN, 0};
    ::poll(&p, 1, int(std::min<int64_t>(left.count(), 1000)));
    lock.lock();
    drain_events();
  }
}

// Port-wide counters from sysfs (since the port came up, all processes):
// the NIC keeps no per-context ones. Missing files read as 0.
ContextCounters VerbsContext::counters() const {
  const std::string base = "/sys/class/infiniband/" + choice_.device + "/ports/" + std::to_string(port_num()) + "/";
  auto read = [&](const std::string& name) -> uint64_t {
    std::ifstream in(base + name);
    uint64_t v = 0;
    in >> v;
    return in ? v : 0;
  };
  ContextCounters c;
  c.tx_packets = read("counters/port_xmit_packets");
  c.rx_packets = read("counters/port_rcv_packets");
  c.tx_bytes = read("counters/port_xmit_data") * 4;  // in units of 4 bytes (IBA PortCounters)
  c.rx_bytes = read("counters/port_rcv_data") * 4;
  c.timeouts = read("hw_counters/local_ack_timeout_err");
  c.rx_dropped_out_of_window = read("hw_counters/out_of_sequence");
  c.rx_duplicates = read("hw_counters/duplicate_request");
  return c;
}

}  // namespace

namespace verbs {

std::optional<CmQp> cm_qp(QueuePair& qp) {
  auto* v = dynamic_cast<VerbsQp*>(&qp);
  if (!v) return std::nullopt;
  return v->cm_info();
}

Status cm_modify(QueuePair& qp, ibv_qp_attr attr, int mask, const QpTiming& timing, uint32_t peer_mtu) {
  auto* v = dynamic_cast<VerbsQp*>(&qp);
  if (!v) return Status(Errc::invalid_argument, "rdma_cm: not a verbs-provider QP");
  return v->modify_for_cm(attr, mask, timing, peer_mtu);
}

}  // namespace verbs

Result<std::shared_ptr<Context>> open_verbs(const ContextOptions& options) {
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (!list || count == 0) {
    const int e = errno;
    if (list) ibv_free_device_list(list);
    return verbs::no_device_status(list || e == 0 ? "ibv_get_device_list returned none" : call_failed("ibv_get_device_list", e));
  }
  struct ListGuard {
    ibv_device** list;
    ~ListGuard() { ibv_free_device_list(list); }
  } guard{list};

  // Tenants as principals (a tenants file, a context's tenant and
  // credential) are the soft provider's; refusing beats ignoring them.
  if (options.tx_rate_bytes_per_s)
    return Status(Errc::unsupported, "verbs provider: tx_rate_bytes_per_s (STELLAR_TX_RATE) is the soft provider's flow scheduler; "
                                     "the NIC's rate limits are configured outside Stellar");
  if (!options.tenants_file.empty() || !options.tenant.empty())
    return Status(Errc::unsupported, "verbs provider: tenants files and ContextOptions::tenant (STELLAR_TENANTS, STELLAR_TENANT) "
                                     "are the soft provider's; create tenants with create_tenant (partition keys)");
  auto tc = config::integer("STELLAR_VERBS_TC", 0, 255);
  if (!tc) return tc.status();
  const uint8_t traffic_class = uint8_t(tc->value_or(0));

  auto choice = select_gid(query_gid_tables(list, count), options.device, options.bind_address);
  if (!choice) return choice.status();
  ibv_device* device = nullptr;
  for (int i = 0; i < count; ++i)
    if (choice->device == ibv_get_device_name(list[i])) device = list[i];
  ibv_context* context = device ? ibv_open_device(device) : nullptr;
  if (!context) return Status(Errc::io_error, "verbs provider: " + call_failed("ibv_open_device(" + choice->device + ")", errno));
  ibv_device_attr device_attr{};
  ibv_port_attr port_attr{};
  if (int rc = ibv_query_device(context, &device_attr); rc != 0) {
    ibv_close_device(context);
    return Status(Errc::io_error, "verbs provider: " + call_failed("ibv_query_device", rc));
  }
  if (int rc = ibv_query_port(context, uint8_t(choice->entry.port), &port_attr); rc != 0) {
    ibv_close_device(context);
    return Status(Errc::io_error, "verbs provider: " + call_failed("ibv_query_port", rc));
  }
  log().info("verbs provider: {} port {} ({}), GID index {} {} {}{}, active MTU {}, traffic class {}", choice->device, choice->entry.port,
             port_attr.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand", choice->entry.index, to_string(choice->entry.type),
             format_gid(choice->entry.gid), choice->entry.netdev.empty() ? "" : " on " + choice->entry.netdev, mtu_bytes(port_attr.active_mtu),
             traffic_class);
  return std::shared_ptr<Context>(std::make_shared<VerbsContext>(options, context, std::move(*choice), device_attr, port_attr, traffic_class));
}

extern const Ops verbs_ops;
const Ops verbs_ops{Provider::verbs, "verbs", open_verbs, verbs::describe_ibv_status, cm::Method::rdma_cm, verbs::rdma_cm_listen, verbs::rdma_cm_connect};

}  // namespace stellar::provider

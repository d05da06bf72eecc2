// libnccl-net-stellar.so: NCCL's net plugin over Stellar's verbs-shaped API
// (docs/nccl.md). One implementation, exported as ncclNetPlugin_v8 to _v12
// through thin per-version wrappers at the end of this file.
//
// Devices: one per IPv4 address in $STELLAR_NCCL_ADDRESS (comma-separated),
// else the first non-loopback IPv4 address that is up, else 127.0.0.1. Each
// device is a Stellar context (soft provider unless STELLAR_* says otherwise)
// and one protection domain.
//
// A connection is one RC queue pair with its own completion queue, set up by
// Stellar's connection manager (TCP) off NCCL's thread, so that listen,
// connect and accept never block. Data moves the way NCCL's own IB transport
// moves it, since two-sided SENDs could not honour tags within a multi-
// receive: irecv posts receive WRs and sends the sender a clear-to-send
// message (CTS) naming its n buffers (address, rkey, size, tag); isend takes
// the oldest CTS, picks the buffer whose tag matches and writes into it with
// RDMA WRITE with immediate, the immediate naming the receive and the buffer;
// the write's completion at the receiver gives the byte count.
//
// Every byte from the peer is checked: the CTS's shape and counts, the
// immediate's receive and buffer, the length against the buffer. A peer
// that breaks the protocol fails the comm (ncclRemoteError), never the
// process. A dead peer: a comm NCCL keeps calling that has heard nothing for
// a second writes an 8-byte keepalive to the peer, whose loss ends in a
// retry-exceeded completion, so every request then fails within the QP's
// retry budget.
//
// Thread-safety: NCCL calls a comm from its proxy threads; each comm has a
// mutex, the device table and the pending-connection table one each.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/config.hpp"  // libstellar's table of environment variables (exported)
#include "nccl_net.h"
#include "stellar/stellar.hpp"

#define STELLAR_EXPORT __attribute__((visibility("default")))

namespace {

using namespace stellar;
using Clock = std::chrono::steady_clock;

// ---- logging through NCCL's logger ----
std::atomic<ncclDebugLogger_t> g_logger{nullptr};  // set by init, which v11+ calls once per communicator

__attribute__((format(printf, 5, 6))) void log_line(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                                    int line, const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  if (ncclDebugLogger_t logger = g_logger.load())
    logger(level, flags, file, line, "NET/Stellar : %s", text);
  else if (level == NCCL_LOG_WARN)
    fprintf(stderr, "NET/Stellar WARN %s\n", text);
}
#define WARN(...) log_line(NCCL_LOG_WARN, NCCL_ALL, __FILE__, __LINE__, __VA_ARGS__)
#define INFO(flags, ...) log_line(NCCL_LOG_INFO, (flags), __FILE__, __LINE__, __VA_ARGS__)

// ---- limits ----
constexpr int max_recvs = 8;                         // buffers one irecv may group (NCCL's IB plugin: 8)
constexpr int max_requests = NCCL_NET_MAX_REQUESTS;  // irecvs outstanding per recv comm
constexpr int max_sends = max_requests * max_recvs;  // isends outstanding per send comm
constexpr size_t max_transfer = size_t(1) << 30;     // maxP2pBytes (the soft provider's messages go to 2 GiB)
constexpr int cts_slots = 2 * max_requests;          // receives the sender keeps posted for CTS messages
constexpr auto keepalive_after = std::chrono::seconds(1);

// ---- what crosses the wire and the out-of-band handle ----
constexpr uint32_t handle_magic = 0x53544e43;  // "STNC"
constexpr uint32_t hello_magic = 0x53544e48;   // "STNH"
constexpr uint32_t cts_magic = 0x53544e54;     // "STNT"
constexpr uint16_t protocol_version = 1;

// What listen() writes into NCCL's 128-byte handle, which NCCL carries to the
// sender out of band. `stage` is the sender's own: 0 as the listener writes
// it, then the id of the sender's pending connection (a key into a table,
// never a pointer: the handle came over the network).
struct Handle {
  uint32_t magic;
  uint16_t version;
  uint16_t port;     // the connection manager's TCP port, host order
  uint32_t ipv4;     // network order
  uint32_t reserved;
  uint64_t secret;   // proves to the listener that a connector read this handle
  uint64_t stage;
};
static_assert(sizeof(Handle) <= NCCL_NET_HANDLE_MAXSIZE);

// Connection manager private data, each way.
struct Hello {
  uint32_t magic;
  uint32_t version;
  uint64_t secret;          // connector: the handle's; acceptor: 0
  uint64_t keepalive_addr;  // an 8-byte word the peer may write
  uint32_t keepalive_rkey;
  uint32_t reserved;
};

struct CtsEntry {
  uint64_t addr;
  uint64_t size;  // the buffer's size: the most the sender may write
  uint32_t rkey;
  int32_t tag;
};
struct Cts {
  uint32_t magic;
  uint32_t seq;  // the receive's sequence number (24 bits on the wire, in the immediate)
  uint32_t n;
  uint32_t reserved;
  CtsEntry entry[max_recvs];
};
constexpr size_t cts_bytes(uint32_t n) { return offsetof(Cts, entry) + n * sizeof(CtsEntry); }
static_assert(cts_bytes(max_recvs) <= QpCapabilities{}.max_inline_data, "a CTS goes inline");

uint32_t immediate(uint32_t seq, int index) { return (seq & 0xffffff) << 8 | uint32_t(index); }

uint64_t random64() {
  uint64_t v = 0;
  while (v == 0)
    if (getrandom(&v, sizeof v, 0) != sizeof v) v = uint64_t(Clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  return v;
}

// ---- devices ----
struct Device {
  std::string address;
  std::string ifname;    // "" when no interface holds the address
  std::string name;      // for NCCL's logs
  std::string pci_path;  // "" : virtual (loopback, veth)
  int speed_mbps = 0;
  std::shared_ptr<Context> context;
  std::shared_ptr<ProtectionDomain> pd;
  std::vector<int> members;  // the physical devices a virtual device stands for ({itself} for a physical one)
  // Inline progress: when the plugin was last called (steady ns), and the
  // thread that drives the transport while nobody calls (standby()).
  Device* physical = this;  // a virtual device's comms run on (and keep alive) its physical device's standby
  std::atomic<int64_t> last_call{0};
  std::atomic<bool> stop{false};
  std::thread standby;
};

int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// NCCL's proxy thread stops calling test() when it has nothing left to wait
// for; a receiver that stops polling inline would leave the sender's last
// packets unacknowledged until its retries ran out, and no keepalive would
// be answered. So while nobody has called in for half a millisecond, this
// thread drives the transport: on each datagram, and every millisecond for
// its timers. While NCCL polls, it only looks at the clock.
void standby(Device* d) {
  constexpr int64_t idle_ns = 500'000;
  while (!d->stop.load(std::memory_order_relaxed)) {
    if (now_ns() - d->last_call.load(std::memory_order_relaxed) < idle_ns) {
      std::this_thread::sleep_for(std::chrono::microseconds(250));
      continue;
    }
    pollfd p{d->context->progress_fd(), POLLIN, 0};
    (void)::poll(&p, 1, 1);
    d->context->progress();
  }
}

struct Plugin {
  std::mutex mu;
  bool initialized = false;
  ncclResult_t init_result = ncclSuccess;
  std::vector<std::unique_ptr<Device>> devices;  // physical first, then makeVDevice's
  int physical = 0;
  int ptr_support = NCCL_PTR_HOST;
  std::chrono::milliseconds connect_timeout{20000};
};
Plugin& plugin() {
  static Plugin* p = new Plugin;  // never destroyed: NCCL may call in while the process exits
  return *p;
}

// At exit, before libstellar's statics go: the standby threads stop.
void stop_standby() {
  Plugin& p = plugin();
  std::lock_guard lock(p.mu);
  for (auto& d : p.devices) {
    d->stop = true;
    if (d->standby.joinable()) d->standby.join();
  }
}

Device* device(int dev) {
  Plugin& p = plugin();
  std::lock_guard lock(p.mu);
  if (!p.initialized || p.init_result != ncclSuccess || dev < 0 || dev >= int(p.devices.size())) return nullptr;
  return p.devices[size_t(dev)].get();
}

std::string read_line_of(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// The interface that holds `address`, and the first non-loopback IPv4
// address that is up (for the default device).
std::pair<std::string, std::string> interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  std::string ifname, first;
  if (getifaddrs(&list) != 0) return {};
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
    if (address == text && ifname.empty()) ifname = i->ifa_name;
    if (first.empty() && !(i->ifa_flags & IFF_LOOPBACK)) first = text;
  }
  freeifaddrs(list);
  return {ifname, first};
}

// The GPU bits of ptrSupport: the soft provider registers CUDA memory
// through pinned shadows (docs/gpu.md) and the verbs provider through
// dma-buf, so both are offered where a CUDA driver finds a GPU.
bool gpu_present() {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!cuda) return false;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  auto init = reinterpret_cast<Init>(dlsym(cuda, "cuInit"));
  auto count = reinterpret_cast<Count>(dlsym(cuda, "cuDeviceGetCount"));
  int n = 0;
  bool present = init && count && init(0) == 0 && count(&n) == 0 && n > 0;
  dlclose(cuda);
  return present;
}

// The speed NCCL plans with: the link's, but no more than this transport
// has moved on one connection (docs/nccl.md, "Properties"), since NCCL
// divides work by it. STELLAR_NCCL_SPEED_MBPS overrides it.
constexpr int soft_provider_speed_mbps = 25000;
constexpr float soft_provider_latency_us = 6.0f;

ncclResult_t init_devices() {
  Plugin& p = plugin();
  std::lock_guard lock(p.mu);
  if (p.initialized) return p.init_result;
  p.initialized = true;
  // The environment, through Stellar's one table of variables
  // (src/core/config.cpp): a malformed value fails init, naming it.
  auto speed = config::integer("STELLAR_NCCL_SPEED_MBPS", 1, 10'000'000);
  auto timeout = config::integer("STELLAR_NCCL_CONNECT_TIMEOUT_MS", 1, 3'600'000);
  auto gdr = config::integer("STELLAR_NCCL_GDR", 0, 1);
  for (const Status& s : {speed.status(), timeout.status(), gdr.status()})
    if (!s.ok()) {
      WARN("%s", s.message().c_str());
      return p.init_result = ncclInvalidUsage;
    }
  const int speed_cap = int(speed->value_or(soft_provider_speed_mbps));
  p.connect_timeout = std::chrono::milliseconds(timeout->value_or(20000));
  atexit(stop_standby);  // before any device: a failure below leaves earlier devices' threads to stop
  std::vector<std::string> addresses;
  if (auto list = config::text("STELLAR_NCCL_ADDRESS")) {
    std::string s = *list;
    for (size_t start = 0; start <= s.size();) {
      size_t comma = s.find(',', start);
      if (comma == std::string::npos) comma = s.size();
      if (comma > start) addresses.push_back(s.substr(start, comma - start));
      start = comma + 1;
    }
  } else {
    std::string first = interface_of("").second;
    addresses.push_back(first.empty() ? "127.0.0.1" : first);
  }
  for (const std::string& address : addresses) {
    in_addr parsed{};
    if (inet_pton(AF_INET, address.c_str(), &parsed) != 1) {
      WARN("STELLAR_NCCL_ADDRESS: '%s' is not an IPv4 address", address.c_str());
      return p.init_result = ncclInvalidUsage;
    }
    auto d = std::make_unique<Device>();
    d->address = address;
    d->ifname = interface_of(address).first;
    int link = 0;
    if (!d->ifname.empty()) {
      link = atoi(read_line_of("/sys/class/net/" + d->ifname + "/speed").c_str());  // -1 or absent on lo, veth
      if (char* real = realpath(("/sys/class/net/" + d->ifname + "/device").c_str(), nullptr)) {
        d->pci_path = real;
        free(real);
      }
    }
    d->speed_mbps = link > 0 ? std::min(link, speed_cap) : speed_cap;
    d->name = "stellar:" + (d->ifname.empty() ? address : d->ifname);
    ContextOptions options;
    options.bind_address = address;
    // Inline progress: NCCL's proxy thread, which polls test() anyway, runs
    // the transport itself (on the 2-core bench machine an engine thread
    // beside it cost 7x in latency and 3x in bandwidth, docs/nccl.md).
    // standby() covers the times the proxy stops calling in.
    // STELLAR_ENGINE=thread|daemon overrides the placement.
    options.progress = ProgressMode::inline_poll;
    options.wait = WaitPolicy::adaptive;
    auto context = Context::open(options);
    if (!context) {
      WARN("cannot open a Stellar context on %s: %s", address.c_str(), context.status().to_string().c_str());
      return p.init_result = ncclSystemError;
    }
    d->context = *context;
    auto pd = d->context->allocate_pd();
    if (!pd) {
      WARN("cannot allocate a protection domain: %s", pd.status().to_string().c_str());
      return p.init_result = ncclSystemError;
    }
    d->pd = *pd;
    d->members = {int(p.devices.size())};
    if (d->context->options().progress == ProgressMode::inline_poll) d->standby = std::thread(standby, d.get());
    INFO(NCCL_INIT | NCCL_NET, "device %zu: %s (%s provider, %s mode, engine %s, %d Mbps)", p.devices.size(),
         d->name.c_str(), to_string(d->context->options().provider), to_string(d->context->options().mode),
         to_string(d->context->options().progress), d->speed_mbps);
    p.devices.push_back(std::move(d));
  }
  p.physical = int(p.devices.size());
  // GPU memory only where every device is the soft provider's: it copies a
  // received GPU buffer to the device before the completion, so iflush has
  // nothing to do. The verbs provider would need a real flush (a loopback
  // READ, as NCCL's IB plugin does), which is not built.
  bool all_soft = true;
  for (auto& d : p.devices) all_soft = all_soft && d->context->options().provider == Provider::soft;
  if (gdr->value_or(1) == 1 && all_soft && gpu_present()) p.ptr_support |= NCCL_PTR_CUDA | NCCL_PTR_DMABUF;
  return ncclSuccess;
}

// ---- per-communicator context (v11, v12) ----
struct NetContext {
  uint64_t comm_id = 0;
  int traffic_class = NCCL_NET_TRAFFIC_CLASS_UNDEF;
};

// NCCL's traffic class is the IB TC byte: DSCP in its upper six bits. Its
// class selector (the DSCP's top three bits, CS0-CS7) is Stellar's traffic
// class, which the flow scheduler turns back into a DSCP (docs/scheduler.md).
std::optional<JobHints> hints_for(int traffic_class) {
  if (traffic_class < 0 || traffic_class > 255) return std::nullopt;
  JobHints h;
  h.kind = TrafficKind::gradient_allreduce;
  h.priority = (traffic_class >> 2) >> 3;
  return h;
}

// ---- comms and requests ----
enum class Role : uint8_t { send, recv };

struct Comm;
struct Request {
  Comm* comm = nullptr;
  bool in_use = false;
  bool done = false;
  int n = 0;
  int arrived = 0;
  uint32_t seq = 0;
  size_t capacity[max_recvs] = {};
  int sizes[max_recvs] = {};
  bool filled[max_recvs] = {};
};

struct ReceivedCts {
  Cts cts;
  bool used[max_recvs] = {};
  int left = 0;
};

struct MemoryHandle {
  std::unique_ptr<MemoryRegion> mr;  // null for a zero-length registration
  uint64_t addr = 0;
  size_t size = 0;
};

constexpr uint64_t control_wr = 0;  // wr_id of CTS sends and keepalive writes: nothing to complete

struct Comm {
  Role role;
  Device* dev = nullptr;
  std::mutex mu;
  std::shared_ptr<CompletionQueue> cq;
  std::shared_ptr<QueuePair> qp;
  // The word the peer's keepalives land in, and the peer's.
  uint64_t keepalive_word = 0;
  std::unique_ptr<MemoryRegion> keepalive_mr;
  uint64_t peer_keepalive_addr = 0;
  uint32_t peer_keepalive_rkey = 0;
  bool keepalive_in_flight = false;
  Clock::time_point last_heard = Clock::now();
  std::string failure;  // "" while healthy
  ncclResult_t failure_code = ncclSuccess;
  bool failure_reported = false;
  std::vector<Request> pool;
  // send side: CTS receive buffers and the CTSs not yet used up, oldest first
  std::vector<Cts> cts_buffers;
  std::unique_ptr<MemoryRegion> cts_mr;
  std::deque<ReceivedCts> fifo;
  // recv side: receives not yet complete, in posting order
  uint32_t next_seq = 0;
  std::deque<Request*> posted;

  explicit Comm(Role r) : role(r) {}
  ~Comm() {
    qp.reset();  // first: no transfer may touch NCCL's buffers after close
    cq.reset();
  }

  void fail(ncclResult_t code, std::string why) {
    if (!failure.empty()) return;
    failure = std::move(why);
    failure_code = code;
  }
  // Reports a failure once through NCCL's logger; returns its code.
  ncclResult_t failed() {
    if (!failure_reported) {
      failure_reported = true;
      const ContextCounters k = dev->context->counters();
      WARN("%s comm on %s: %s [context: %llu packets sent, %llu received, %llu retransmitted, %llu timeouts; dropped "
           "%llu malformed, %llu unknown QP, %llu out of window, %llu bad token, %llu access errors]",
           role == Role::send ? "send" : "recv", dev->name.c_str(), failure.c_str(), (unsigned long long)k.tx_packets,
           (unsigned long long)k.rx_packets, (unsigned long long)k.retransmitted_packets, (unsigned long long)k.timeouts,
           (unsigned long long)k.rx_dropped_malformed, (unsigned long long)k.rx_dropped_unknown_qp,
           (unsigned long long)k.rx_dropped_out_of_window, (unsigned long long)k.rx_dropped_bad_token,
           (unsigned long long)k.rx_access_errors);
    }
    return failure_code;
  }

  Request* take_request() {
    for (Request& r : pool)
      if (!r.in_use) {
        r = Request{};
        r.comm = this;
        r.in_use = true;
        return &r;
      }
    return nullptr;
  }

  Status post_cts_receive(int slot) {
    Sge sge{reinterpret_cast<uint64_t>(&cts_buffers[size_t(slot)]), uint32_t(sizeof(Cts)), cts_mr->lkey()};
    return qp->post_recv(RecvWr{uint64_t(slot), std::span<const Sge>(&sge, 1)});
  }

  // Takes every completion waiting; call with mu held.
  void progress() {
    std::array<WorkCompletion, 64> wcs;
    for (;;) {
      int got = cq->poll(wcs);
      for (int i = 0; i < got; ++i) complete(wcs[size_t(i)]);
      if (got < int(wcs.size())) break;
    }
    if (failure.empty() && Clock::now() - last_heard > keepalive_after && !keepalive_in_flight) {
      // Nothing heard for a while: write to the peer, whose death then ends
      // in an error completion instead of a silent wait.
      Sge sge{reinterpret_cast<uint64_t>(&keepalive_word), 8, keepalive_mr->lkey()};
      SendWr wr;
      wr.wr_id = control_wr;
      wr.opcode = WrOpcode::rdma_write;
      wr.sg_list = std::span<const Sge>(&sge, 1);
      wr.remote_addr = peer_keepalive_addr;
      wr.rkey = peer_keepalive_rkey;
      if (Status s = qp->post_send(wr); s.ok())
        keepalive_in_flight = true;
      else
        fail(ncclSystemError, "keepalive: " + s.to_string());
    }
  }

  void complete(const WorkCompletion& wc) {
    if (wc.status != WcStatus::success) {
      fail(wc.status == WcStatus::retry_exceeded || wc.status == WcStatus::rnr_retry_exceeded ? ncclSystemError
                                                                                             : ncclRemoteError,
           std::string("completion error: ") + describe(wc) + (wc.status == WcStatus::retry_exceeded ? " (is the peer gone?)" : ""));
      return;
    }
    last_heard = Clock::now();
    if (wc.wr_id == control_wr && (wc.opcode == WcOpcode::rdma_write || wc.opcode == WcOpcode::send)) {
      if (wc.opcode == WcOpcode::rdma_write) keepalive_in_flight = false;
      return;
    }
    if (role == Role::send) {
      if (wc.opcode == WcOpcode::recv) return take_cts(wc);
      if (wc.opcode == WcOpcode::rdma_write) {  // an isend's write with immediate
        auto* r = reinterpret_cast<Request*>(wc.wr_id);
        r->done = true;
        return;
      }
    } else if (wc.opcode == WcOpcode::recv_rdma_with_imm) {
      return take_write(wc);
    }
    fail(ncclRemoteError, std::string("unexpected completion ") + to_string(wc.opcode));
  }

  // send side: a CTS arrived in slot wc.wr_id.
  void take_cts(const WorkCompletion& wc) {
    if (wc.wr_id >= uint64_t(cts_slots)) return fail(ncclInternalError, "CTS receive with a foreign wr_id");
    const Cts& c = cts_buffers[size_t(wc.wr_id)];
    if (wc.byte_len < offsetof(Cts, entry) || c.magic != cts_magic || c.n < 1 || c.n > max_recvs ||
        wc.byte_len != cts_bytes(c.n))
      return fail(ncclRemoteError, "malformed clear-to-send message from the receiver (" + std::to_string(wc.byte_len) + " bytes)");
    if (fifo.size() >= size_t(max_requests))  // a receiver has at most max_requests receives posted
      return fail(ncclRemoteError, "the receiver sent more clear-to-send messages than it may have receives posted");
    ReceivedCts rc;
    rc.cts = c;
    rc.left = int(c.n);
    for (uint32_t i = 0; i < c.n; ++i)
      if (c.entry[i].size > max_transfer) return fail(ncclRemoteError, "clear-to-send names a buffer above maxP2pBytes");
    fifo.push_back(rc);
    if (Status s = post_cts_receive(int(wc.wr_id)); !s.ok()) fail(ncclSystemError, "reposting a CTS receive: " + s.to_string());
  }

  // recv side: a write with immediate landed.
  void take_write(const WorkCompletion& wc) {
    if (!wc.has_imm) return fail(ncclRemoteError, "write without an immediate");
    const uint32_t seq = wc.imm_data >> 8;
    const int index = int(wc.imm_data & 0xff);
    for (auto it = posted.begin(); it != posted.end(); ++it) {
      Request* r = *it;
      if ((r->seq & 0xffffff) != seq) continue;
      if (index >= r->n || r->filled[index] || wc.byte_len > r->capacity[index])
        return fail(ncclRemoteError, "write names buffer " + std::to_string(index) + " of receive " + std::to_string(seq) +
                                         " wrongly (" + std::to_string(wc.byte_len) + " bytes)");
      r->filled[index] = true;
      r->sizes[index] = int(wc.byte_len);
      if (++r->arrived == r->n) {
        r->done = true;
        posted.erase(it);
      }
      return;
    }
    fail(ncclRemoteError, "write for receive " + std::to_string(seq) + ", which is not posted");
  }
};

// Opens the QP of a new comm and brings it to INIT (so receives can be
// posted before the peer can send).
std::unique_ptr<Comm> open_comm(Role role, Device* dev, int traffic_class, std::string* why) {
  auto c = std::make_unique<Comm>(role);
  dev = dev->physical;
  c->dev = dev;
  auto cq = dev->context->create_cq(4 * max_sends);
  if (!cq) return *why = "create_cq: " + cq.status().to_string(), nullptr;
  c->cq = *cq;
  QpInitAttributes attr;
  attr.send_cq = c->cq;
  attr.recv_cq = c->cq;
  attr.cap.max_send_wr = uint32_t(max_sends + max_requests + 8);
  attr.cap.max_recv_wr = uint32_t(role == Role::send ? cts_slots : max_requests * max_recvs);
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  attr.hints = hints_for(traffic_class);
  auto qp = dev->pd->create_qp(attr);
  if (!qp) return *why = "create_qp: " + qp.status().to_string(), nullptr;
  c->qp = *qp;
  if (Status s = c->qp->modify(QpModify{QpState::init}); !s.ok()) return *why = "QP to INIT: " + s.to_string(), nullptr;
  auto ka = dev->pd->register_memory(&c->keepalive_word, sizeof c->keepalive_word, access_local_write | access_remote_write);
  if (!ka) return *why = "register keepalive: " + ka.status().to_string(), nullptr;
  c->keepalive_mr = std::move(*ka);
  if (role == Role::send) {
    c->pool.resize(max_sends);
    c->cts_buffers.resize(cts_slots);
    auto mr = dev->pd->register_memory(c->cts_buffers.data(), c->cts_buffers.size() * sizeof(Cts), access_local_write);
    if (!mr) return *why = "register CTS buffers: " + mr.status().to_string(), nullptr;
    c->cts_mr = std::move(*mr);
    for (int i = 0; i < cts_slots; ++i)
      if (Status s = c->post_cts_receive(i); !s.ok()) return *why = "post CTS receive: " + s.to_string(), nullptr;
  } else {
    c->pool.resize(max_requests);
  }
  return c;
}

Hello hello_of(const Comm& c, uint64_t secret) {
  Hello h{};
  h.magic = hello_magic;
  h.version = protocol_version;
  h.secret = secret;
  h.keepalive_addr = reinterpret_cast<uint64_t>(&c.keepalive_word);
  h.keepalive_rkey = c.keepalive_mr->rkey();
  return h;
}
std::vector<uint8_t> bytes_of(const Hello& h) {
  auto p = reinterpret_cast<const uint8_t*>(&h);
  return {p, p + sizeof h};
}
bool parse_hello(const std::vector<uint8_t>& data, Hello* out) {
  if (data.size() != sizeof(Hello)) return false;
  memcpy(out, data.data(), sizeof(Hello));
  return out->magic == hello_magic && out->version == protocol_version;
}
bool same_secret(uint64_t a, uint64_t b) {  // constant time
  volatile uint64_t d = a ^ b;
  return d == 0;
}

std::chrono::milliseconds connect_timeout() { return plugin().connect_timeout; }

// ---- listen / connect / accept ----
struct ListenComm {
  Device* dev = nullptr;
  int traffic_class = NCCL_NET_TRAFFIC_CLASS_UNDEF;
  std::unique_ptr<cm::Listener> listener;
  uint64_t secret = 0;
  std::unique_ptr<Comm> accepting;
  std::unique_ptr<cm::ConnectionRequest> request;
  std::future<Status> accepted;
};

struct PendingConnect {
  std::unique_ptr<Comm> comm;
  std::future<Result<cm::Connected>> connected;
};
// By Handle::stage. Never destroyed, like plugin(): a connect NCCL
// abandoned keeps its entry, and destroying it at exit would wait for its
// thread and touch libstellar after its statics are gone.
std::mutex& g_pending_mu = *new std::mutex;
std::unordered_map<uint64_t, std::unique_ptr<PendingConnect>>& g_pending =
    *new std::unordered_map<uint64_t, std::unique_ptr<PendingConnect>>;

ncclResult_t net_listen(int dev_index, void* opaque_handle, void** listen_comm, int traffic_class) {
  if (!opaque_handle || !listen_comm) return ncclInternalError;
  *listen_comm = nullptr;
  Device* dev = device(dev_index);
  if (!dev) {
    WARN("listen: no device %d", dev_index);
    return ncclInternalError;
  }
  auto l = std::make_unique<ListenComm>();
  l->dev = dev;
  l->traffic_class = traffic_class;
  auto listener = cm::Listener::listen(dev->address, 0);
  if (!listener) {
    WARN("listen on %s: %s", dev->address.c_str(), listener.status().to_string().c_str());
    return ncclSystemError;
  }
  l->listener = std::move(*listener);
  l->secret = random64();
  Handle h{};
  h.magic = handle_magic;
  h.version = protocol_version;
  h.port = l->listener->port();
  inet_pton(AF_INET, dev->address.c_str(), &h.ipv4);
  h.secret = l->secret;
  memset(opaque_handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(opaque_handle, &h, sizeof h);
  *listen_comm = l.release();
  return ncclSuccess;
}

ncclResult_t net_connect(int dev_index, void* opaque_handle, void** send_comm, ncclNetDeviceHandle_v8_t** dev_comm,
                         int traffic_class) {
  if (!opaque_handle || !send_comm) return ncclInternalError;
  *send_comm = nullptr;
  (void)dev_comm;  // a host plugin leaves NCCL's device handle NULL
  Handle h;
  memcpy(&h, opaque_handle, sizeof h);
  if (h.magic != handle_magic || h.version != protocol_version || h.port == 0 || h.ipv4 == 0) {
    WARN("connect: the handle is not a Stellar listen handle (magic %#x, version %u)", h.magic, h.version);
    return ncclInvalidUsage;
  }
  if (h.stage == 0) {  // first call: start connecting
    Device* dev = device(dev_index);
    if (!dev) {
      WARN("connect: no device %d", dev_index);
      return ncclInternalError;
    }
    std::string why;
    auto comm = open_comm(Role::send, dev, traffic_class, &why);
    if (!comm) {
      WARN("connect: %s", why.c_str());
      return ncclSystemError;
    }
    char address[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &h.ipv4, address, sizeof address);
    cm::ConnectOptions options;
    options.private_data = bytes_of(hello_of(*comm, h.secret));
    options.timeout = connect_timeout();
    auto pending = std::make_unique<PendingConnect>();
    pending->connected = std::async(std::launch::async, [qp = comm->qp, host = std::string(address), port = h.port, options] {
      return cm::connect(host, port, *qp, options);
    });
    pending->comm = std::move(comm);
    h.stage = random64();
    memcpy(opaque_handle, &h, sizeof h);
    std::lock_guard lock(g_pending_mu);
    g_pending[h.stage] = std::move(pending);
    return ncclSuccess;
  }
  std::unique_ptr<PendingConnect> pending;
  {
    std::lock_guard lock(g_pending_mu);
    auto it = g_pending.find(h.stage);
    if (it == g_pending.end()) {
      WARN("connect: the handle names no connection in progress");
      return ncclInternalError;
    }
    if (it->second->connected.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return ncclSuccess;
    pending = std::move(it->second);
    g_pending.erase(it);
  }
  h.stage = 0;
  memcpy(opaque_handle, &h, sizeof h);
  auto connected = pending->connected.get();
  if (!connected) {
    WARN("connect to the listener at port %u: %s", h.port, connected.status().to_string().c_str());
    return ncclSystemError;
  }
  Hello reply;
  if (!parse_hello(connected->private_data, &reply)) {
    WARN("connect: the listener's reply is not a Stellar hello");
    return ncclRemoteError;
  }
  pending->comm->peer_keepalive_addr = reply.keepalive_addr;
  pending->comm->peer_keepalive_rkey = reply.keepalive_rkey;
  pending->comm->last_heard = Clock::now();
  INFO(NCCL_NET, "connected to %s:%u (QP %u)", connected->remote.address.c_str(), connected->remote.udp_port,
       connected->remote.qp_num);
  *send_comm = pending->comm.release();
  return ncclSuccess;
}

ncclResult_t net_accept(void* listen_comm, void** recv_comm, ncclNetDeviceHandle_v8_t** dev_comm) {
  if (!listen_comm || !recv_comm) return ncclInternalError;
  *recv_comm = nullptr;
  (void)dev_comm;
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (l->accepted.valid()) {
    if (l->accepted.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return ncclSuccess;
    Status s = l->accepted.get();
    l->request.reset();
    if (!s.ok()) {
      WARN("accept: %s", s.to_string().c_str());
      l->accepting.reset();
      return ncclSystemError;
    }
    l->accepting->last_heard = Clock::now();
    *recv_comm = l->accepting.release();
    return ncclSuccess;
  }
  if (!l->accepting) {
    // Has a connector spoken? (A zero timeout polls.) Requests without this
    // handle's secret are refused, and listening goes on.
    auto request = l->listener->get_request(std::chrono::milliseconds(0));
    if (!request) {
      if (request.status().code() == Errc::timeout) return ncclSuccess;
      WARN("accept: %s", request.status().to_string().c_str());
      return ncclSystemError;
    }
    Hello hello;
    if (!parse_hello((*request)->private_data(), &hello) || !same_secret(hello.secret, l->secret)) {
      INFO(NCCL_NET, "accept: refused a connection request from %s that does not hold this listen handle",
           (*request)->remote().address.c_str());
      (void)(*request)->reject("not a Stellar NCCL connection with this listen handle");
      return ncclSuccess;
    }
    std::string why;
    auto comm = open_comm(Role::recv, l->dev, l->traffic_class, &why);
    if (!comm) {
      (void)(*request)->reject(why);
      WARN("accept: %s", why.c_str());
      return ncclSystemError;
    }
    comm->peer_keepalive_addr = hello.keepalive_addr;
    comm->peer_keepalive_rkey = hello.keepalive_rkey;
    l->request = std::move(*request);
    l->accepting = std::move(comm);
    // The answer waits for the connector's "ready": off NCCL's thread.
    l->accepted = std::async(std::launch::async, [req = l->request.get(), qp = l->accepting->qp,
                                                  reply = bytes_of(hello_of(*l->accepting, 0))] {
      return req->accept(*qp, reply);
    });
  }
  return ncclSuccess;
}

ncclResult_t net_close_listen(void* listen_comm) {
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (!l) return ncclSuccess;
  if (l->accepted.valid()) l->accepted.wait();  // bounded by the connection manager's deadline
  delete l;
  return ncclSuccess;
}

// ---- memory ----
ncclResult_t net_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  if (!comm || !mhandle) return ncclInternalError;
  *mhandle = nullptr;
  auto* c = static_cast<Comm*>(comm);
  if ((type & plugin().ptr_support) != type || type == 0) {
    WARN("regMr: memory type %#x is not supported here (ptrSupport %#x)", type, plugin().ptr_support);
    return ncclInvalidUsage;
  }
  auto h = std::make_unique<MemoryHandle>();
  h->addr = reinterpret_cast<uint64_t>(data);
  h->size = size;
  if (size > 0) {
    // The provider tells host from GPU memory itself (a GPU buffer is
    // staged on the soft provider, registered through dma-buf on verbs).
    // Only a receiver's buffers are written by the peer.
    const uint32_t access = c->role == Role::recv ? access_local_write | access_remote_write : access_local_write;
    auto mr = c->dev->pd->register_memory(data, size, access);
    if (!mr) {
      WARN("regMr of %zu bytes at %p: %s", size, data, mr.status().to_string().c_str());
      const Errc e = mr.status().code();
      return e == Errc::invalid_argument || e == Errc::permission_denied ? ncclInvalidUsage : ncclSystemError;
    }
    h->mr = std::move(*mr);
  }
  *mhandle = h.release();
  return ncclSuccess;
}

// NCCL exports a dma-buf of GPU memory and hands over its fd; Stellar's
// providers register GPU memory by address and make their own (verbs) or
// need none (soft: pinned shadows), so the fd is not used; NCCL closes it.
ncclResult_t net_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle) {
  (void)offset;
  (void)fd;
  return net_reg_mr(comm, data, size, type == NCCL_PTR_DMABUF ? NCCL_PTR_CUDA : type, mhandle);
}

ncclResult_t net_dereg_mr(void* comm, void* mhandle) {
  (void)comm;
  delete static_cast<MemoryHandle*>(mhandle);
  return ncclSuccess;
}

// ---- data ----
ncclResult_t net_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  if (!send_comm || !request) return ncclInternalError;
  *request = nullptr;
  auto* c = static_cast<Comm*>(send_comm);
  c->dev->last_call.store(now_ns(), std::memory_order_relaxed);
  auto* mh = static_cast<MemoryHandle*>(mhandle);
  if (size > 0 && (!mh || !mh->mr || reinterpret_cast<uint64_t>(data) < mh->addr ||
                   reinterpret_cast<uint64_t>(data) + size > mh->addr + mh->size)) {
    WARN("isend: %zu bytes at %p are not inside the registration given", size, data);
    return ncclInternalError;
  }
  if (size > max_transfer) {
    WARN("isend: %zu bytes is above maxP2pBytes (%zu)", size, max_transfer);
    return ncclInternalError;
  }
  std::lock_guard lock(c->mu);
  // Progress only when a clear-to-send is missing: each round is system
  // calls, and test() makes them anyway (it halved the latency).
  if (c->fifo.empty()) c->progress();
  if (!c->failure.empty()) return c->failed();
  if (c->fifo.empty()) return ncclSuccess;  // no clear-to-send yet: NCCL retries
  ReceivedCts& head = c->fifo.front();
  int index = -1;
  for (uint32_t i = 0; i < head.cts.n; ++i)
    if (!head.used[i] && head.cts.entry[i].tag == tag) {
      index = int(i);
      break;
    }
  if (index < 0) {  // the oldest receive has no buffer for this tag (yet): retry
    c->progress();     // (every "retry" drives the transport: the standby thread sleeps while NCCL calls)
    return ncclSuccess;
  }
  const CtsEntry& e = head.cts.entry[index];
  if (size > e.size) {
    WARN("isend: %zu bytes with tag %d, but the receiver's buffer holds %llu: the two sides' calls do not match", size,
         tag, (unsigned long long)e.size);
    return ncclInvalidUsage;
  }
  Request* r = c->take_request();
  if (!r) {  // every request slot busy: retry after a test
    c->progress();
    return ncclSuccess;
  }
  r->n = 1;
  r->sizes[0] = int(size);
  Sge sge{reinterpret_cast<uint64_t>(data), uint32_t(size), size ? mh->mr->lkey() : 0};
  SendWr wr;
  wr.wr_id = reinterpret_cast<uint64_t>(r);
  wr.opcode = WrOpcode::rdma_write_with_imm;
  wr.sg_list = size ? std::span<const Sge>(&sge, 1) : std::span<const Sge>();
  wr.remote_addr = e.addr;
  wr.rkey = e.rkey;
  wr.imm_data = immediate(head.cts.seq, index);
  if (Status s = c->qp->post_send(wr); !s.ok()) {
    r->in_use = false;
    if (s.code() == Errc::queue_full) {
      c->progress();
      return ncclSuccess;
    }
    c->fail(ncclSystemError, "post_send: " + s.to_string());
    return c->failed();
  }
  head.used[index] = true;
  if (--head.left == 0) c->fifo.pop_front();
  *request = r;
  return ncclSuccess;
}

ncclResult_t net_irecv(void* recv_comm, int n, void** data, const size_t* sizes, int* tags, void** mhandles, void** request) {
  if (!recv_comm || !request) return ncclInternalError;
  *request = nullptr;  // NCCL may have put NCCL_NET_OPTIONAL_RECV_COMPLETION there: never a request
  auto* c = static_cast<Comm*>(recv_comm);
  c->dev->last_call.store(now_ns(), std::memory_order_relaxed);
  if (n < 1 || n > max_recvs || !data || !sizes || !tags || !mhandles) {
    WARN("irecv: %d buffers (1 to %d allowed)", n, max_recvs);
    return ncclInternalError;
  }
  Cts cts{};
  cts.magic = cts_magic;
  cts.n = uint32_t(n);
  for (int i = 0; i < n; ++i) {
    auto* mh = static_cast<MemoryHandle*>(mhandles[i]);
    const uint64_t addr = reinterpret_cast<uint64_t>(data[i]);
    if (sizes[i] > max_transfer) {
      WARN("irecv: buffer %d of %zu bytes is above maxP2pBytes", i, sizes[i]);
      return ncclInternalError;
    }
    if (sizes[i] > 0 && (!mh || !mh->mr || addr < mh->addr || addr + sizes[i] > mh->addr + mh->size)) {
      WARN("irecv: buffer %d (%zu bytes at %p) is not inside the registration given", i, sizes[i], data[i]);
      return ncclInternalError;
    }
    CtsEntry& e = cts.entry[i];
    e.size = sizes[i];
    e.tag = tags[i];
    if (sizes[i] > 0) {
      e.addr = addr;
      e.rkey = mh->mr->rkey();
    } else {  // nothing may land: point at the keepalive word, which a zero-length write leaves alone
      e.addr = reinterpret_cast<uint64_t>(&c->keepalive_word);
      e.rkey = c->keepalive_mr->rkey();
    }
  }
  std::lock_guard lock(c->mu);
  if (!c->failure.empty()) return c->failed();  // (test() progresses and finds failures)
  Request* r = c->take_request();
  if (!r) {  // max_requests outstanding: retry
    c->progress();
    return ncclSuccess;
  }
  r->n = n;
  r->seq = c->next_seq++;
  for (int i = 0; i < n; ++i) r->capacity[i] = sizes[i];
  cts.seq = r->seq & 0xffffff;
  // One receive WR per buffer: each write with immediate consumes one.
  for (int i = 0; i < n; ++i)
    if (Status s = c->qp->post_recv(RecvWr{control_wr, {}}); !s.ok()) {
      c->fail(ncclSystemError, "post_recv: " + s.to_string());
      return c->failed();
    }
  Sge sge{reinterpret_cast<uint64_t>(&cts), uint32_t(cts_bytes(uint32_t(n))), 0};
  SendWr wr;
  wr.wr_id = control_wr;
  wr.opcode = WrOpcode::send;
  wr.flags = send_signaled | send_inline;
  wr.sg_list = std::span<const Sge>(&sge, 1);
  if (Status s = c->qp->post_send(wr); !s.ok()) {
    c->fail(ncclSystemError, "sending clear-to-send: " + s.to_string());
    return c->failed();
  }
  c->posted.push_back(r);
  *request = r;
  return ncclSuccess;
}

// Data is in place when a receive completes: host memory is written
// directly, and the soft provider copies GPU shadows to the device before
// it delivers the completion (docs/gpu.md); so there is nothing to wait for.
ncclResult_t net_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request) {
  (void)recv_comm;
  (void)n;
  (void)data;
  (void)sizes;
  (void)mhandles;
  if (request) *request = nullptr;
  return ncclSuccess;
}

ncclResult_t net_test(void* request, int* done, int* sizes) {
  if (!request || !done) return ncclInternalError;
  *done = 0;
  auto* r = static_cast<Request*>(request);
  Comm* c = r->comm;
  c->dev->last_call.store(now_ns(), std::memory_order_relaxed);
  std::lock_guard lock(c->mu);
  if (!r->done) c->progress();
  if (r->done) {
    *done = 1;
    if (sizes)
      for (int i = 0; i < r->n; ++i) sizes[i] = r->sizes[i];
    r->in_use = false;
    return ncclSuccess;
  }
  if (!c->failure.empty()) return c->failed();
  return ncclSuccess;
}

ncclResult_t net_close(void* comm) {
  // Requests still in flight die with the QP; NCCL's buffers are not
  // touched after this returns.
  delete static_cast<Comm*>(comm);
  return ncclSuccess;
}

// ---- properties ----
struct Properties {
  ncclNetProperties_v8_t base;
  ncclNetVDeviceProps_v12_t vprops;
};

ncclResult_t properties(int dev_index, Properties* out) {
  Device* dev = device(dev_index);
  if (!dev) {
    WARN("getProperties: no device %d", dev_index);
    return ncclInternalError;
  }
  ncclNetProperties_v8_t& p = out->base;
  p = {};
  p.name = const_cast<char*>(dev->name.c_str());
  p.pciPath = dev->pci_path.empty() ? nullptr : const_cast<char*>(dev->pci_path.c_str());
  p.guid = uint64_t(dev->members[0]);
  p.ptrSupport = plugin().ptr_support;
  p.regIsGlobal = 0;
  p.speed = dev->speed_mbps;
  p.port = 1;
  p.latency = soft_provider_latency_us;
  p.maxComms = 65536;
  p.maxRecvs = max_recvs;
  p.netDeviceType = NCCL_NET_DEVICE_HOST;
  p.netDeviceVersion = 0;
  out->vprops = {};
  out->vprops.ndevs = int(dev->members.size());
  for (size_t i = 0; i < dev->members.size(); ++i) out->vprops.devs[i] = dev->members[i];
  return ncclSuccess;
}

template <typename P>
void fill_v9_fields(const Properties& from, P* to) {
  to->name = from.base.name;
  to->pciPath = from.base.pciPath;
  to->guid = from.base.guid;
  to->ptrSupport = from.base.ptrSupport;
  to->regIsGlobal = from.base.regIsGlobal;
  to->forceFlush = 0;
  to->speed = from.base.speed;
  to->port = from.base.port;
  to->latency = from.base.latency;
  to->maxComms = from.base.maxComms;
  to->maxRecvs = from.base.maxRecvs;
  to->netDeviceType = from.base.netDeviceType;
  to->netDeviceVersion = from.base.netDeviceVersion;
  to->vProps.ndevs = from.vprops.ndevs;
  for (int i = 0; i < from.vprops.ndevs && i < int(sizeof to->vProps.devs / sizeof(int)); ++i)
    to->vProps.devs[i] = from.vprops.devs[i];
  to->maxP2pBytes = max_transfer;
  to->maxCollBytes = max_transfer;
}

// A virtual device of one physical device is that device under a second
// index. Fusing several is refused: each device already spreads its traffic
// over many paths (docs/multipath.md), and striping one comm over several
// contexts is not built.
ncclResult_t make_vdevice(int* d, int ndevs, const int* devs) {
  if (!d || ndevs < 1 || !devs) return ncclInternalError;
  Plugin& p = plugin();
  std::lock_guard lock(p.mu);
  if (!p.initialized || p.init_result != ncclSuccess) return ncclInternalError;
  for (int i = 0; i < ndevs; ++i)
    if (devs[i] < 0 || devs[i] >= p.physical) {
      WARN("makeVDevice: %d is not a physical device", devs[i]);
      return ncclInvalidArgument;
    }
  if (ndevs > 1) {
    WARN("makeVDevice: fusing %d devices into one is not supported by Stellar; set NCCL_NET_MERGE_LEVEL=LOC", ndevs);
    return ncclInvalidUsage;
  }
  const Device& physical = *p.devices[size_t(devs[0])];
  auto v = std::make_unique<Device>();
  v->address = physical.address;
  v->ifname = physical.ifname;
  v->name = physical.name;
  v->pci_path = physical.pci_path;
  v->speed_mbps = physical.speed_mbps;
  v->context = physical.context;
  v->pd = physical.pd;
  v->physical = physical.physical;
  v->members = {devs[0]};
  *d = int(p.devices.size());
  p.devices.push_back(std::move(v));
  return ncclSuccess;
}

ncclResult_t net_init(ncclDebugLogger_t logger) {
  if (logger) g_logger = logger;
  return init_devices();
}

ncclResult_t net_devices(int* ndev) {
  if (!ndev) return ncclInternalError;
  Plugin& p = plugin();
  std::lock_guard lock(p.mu);
  *ndev = p.init_result == ncclSuccess ? p.physical : 0;
  return p.initialized ? p.init_result : ncclInternalError;
}

// ---- the per-version entry points ----
ncclResult_t v8_init(ncclDebugLogger_t logger) { return net_init(logger); }
ncclResult_t v10_init(ncclDebugLogger_t logger, ncclProfilerCallback_t) { return net_init(logger); }
template <typename Config>
ncclResult_t v11_init(void** ctx, uint64_t comm_id, Config* config, ncclDebugLogger_t logger, ncclProfilerCallback_t) {
  if (!ctx) return ncclInternalError;
  *ctx = nullptr;
  if (ncclResult_t r = net_init(logger); r != ncclSuccess) return r;
  auto* c = new NetContext;
  c->comm_id = comm_id;
  if (config) c->traffic_class = config->trafficClass;  // copied: NCCL's config may not outlive the call
  *ctx = c;
  return ncclSuccess;
}
ncclResult_t v11_finalize(void* ctx) {
  delete static_cast<NetContext*>(ctx);
  return ncclSuccess;
}
int traffic_class_of(void* ctx) { return ctx ? static_cast<NetContext*>(ctx)->traffic_class : NCCL_NET_TRAFFIC_CLASS_UNDEF; }

ncclResult_t v8_properties(int dev, ncclNetProperties_v8_t* props) {
  Properties p;
  if (!props) return ncclInternalError;
  if (ncclResult_t r = properties(dev, &p); r != ncclSuccess) return r;
  *props = p.base;
  return ncclSuccess;
}
template <typename P>
ncclResult_t v9_properties(int dev, P* props) {
  Properties p;
  if (!props) return ncclInternalError;
  if (ncclResult_t r = properties(dev, &p); r != ncclSuccess) return r;
  *props = {};
  fill_v9_fields(p, props);
  return ncclSuccess;
}
template <typename P>
ncclResult_t v11_properties(int dev, P* props) {
  if (ncclResult_t r = v9_properties(dev, props); r != ncclSuccess) return r;
  props->maxMultiRequestSize = 1;
  return ncclSuccess;
}
ncclResult_t v12_properties(int dev, ncclNetProperties_v12_t* props) {
  if (ncclResult_t r = v11_properties(dev, props); r != ncclSuccess) return r;
  props->railId = NCCL_NET_ID_UNDEF;
  props->planeId = NCCL_NET_ID_UNDEF;
  return ncclSuccess;
}

ncclResult_t v8_listen(int dev, void* handle, void** listen_comm) {
  return net_listen(dev, handle, listen_comm, NCCL_NET_TRAFFIC_CLASS_UNDEF);
}
ncclResult_t v11_listen(void* ctx, int dev, void* handle, void** listen_comm) {
  return net_listen(dev, handle, listen_comm, traffic_class_of(ctx));
}
ncclResult_t v8_connect(int dev, void* handle, void** send_comm, ncclNetDeviceHandle_v8_t** dev_comm) {
  return net_connect(dev, handle, send_comm, dev_comm, NCCL_NET_TRAFFIC_CLASS_UNDEF);
}
ncclResult_t v10_connect(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** send_comm,
                         ncclNetDeviceHandle_v10_t** dev_comm) {
  return net_connect(dev, handle, send_comm, dev_comm, config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF);
}
ncclResult_t v11_connect(void* ctx, int dev, void* handle, void** send_comm, ncclNetDeviceHandle_v11_t** dev_comm) {
  return net_connect(dev, handle, send_comm, dev_comm, traffic_class_of(ctx));
}

ncclResult_t v8_isend(void* comm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) return ncclInternalError;
  return net_isend(comm, data, size_t(size), tag, mhandle, request);
}
ncclResult_t v9_isend(void* comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  return net_isend(comm, data, size, tag, mhandle, request);
}
ncclResult_t v10_isend(void* comm, void* data, size_t size, int tag, void* mhandle, void*, void** request) {
  return net_isend(comm, data, size, tag, mhandle, request);
}
ncclResult_t v8_irecv(void* comm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request) {
  if (n < 1 || n > max_recvs || !sizes) return net_irecv(comm, n, data, nullptr, tags, mhandles, request);
  size_t wide[max_recvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) return ncclInternalError;
    wide[i] = size_t(sizes[i]);
  }
  return net_irecv(comm, n, data, wide, tags, mhandles, request);
}
ncclResult_t v9_irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** request) {
  return net_irecv(comm, n, data, sizes, tags, mhandles, request);
}
ncclResult_t v10_irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void**, void** request) {
  return net_irecv(comm, n, data, sizes, tags, mhandles, request);
}
template <typename V>
ncclResult_t vdevice(int* d, V* props) {
  if (!props || props->ndevs < 1 || props->ndevs > int(sizeof props->devs / sizeof(int))) return ncclInternalError;
  return make_vdevice(d, props->ndevs, props->devs);
}

// Every entry point NCCL calls: no C++ exception crosses into NCCL's C
// (a thread that cannot start, an allocation that fails).
template <auto F>
struct Guarded;
template <typename... A, ncclResult_t (*F)(A...)>
struct Guarded<F> {
  static ncclResult_t call(A... args) noexcept {
    try {
      return F(args...);
    } catch (const std::exception& e) {
      WARN("%s", e.what());
      return ncclSystemError;
    } catch (...) {
      return ncclInternalError;
    }
  }
};
#define G(f) Guarded<f>::call

}  // namespace

extern "C" {

STELLAR_EXPORT extern const ncclNet_v8_t ncclNetPlugin_v8;
STELLAR_EXPORT extern const ncclNet_v9_t ncclNetPlugin_v9;
STELLAR_EXPORT extern const ncclNet_v10_t ncclNetPlugin_v10;
STELLAR_EXPORT extern const ncclNet_v11_t ncclNetPlugin_v11;
STELLAR_EXPORT extern const ncclNet_v12_t ncclNetPlugin_v12;

// irecvConsumed and getDeviceMr are NULL: a host plugin (netDeviceType HOST)
// has no device-side handles; setNetAttr is NULL too (NCCL allows it).
const ncclNet_v8_t ncclNetPlugin_v8 = {
    "Stellar", G(v8_init), G(net_devices), G(v8_properties), G(v8_listen), G(v8_connect), G(net_accept), G(net_reg_mr), G(net_reg_mr_dmabuf),
    G(net_dereg_mr), G(v8_isend), G(v8_irecv), G(net_iflush), G(net_test), G(net_close), G(net_close), G(net_close_listen), nullptr, nullptr};
const ncclNet_v9_t ncclNetPlugin_v9 = {
    "Stellar", G(v8_init), G(net_devices), G((v9_properties<ncclNetProperties_v9_t>)), G(v8_listen), G(v8_connect), G(net_accept),
    G(net_reg_mr), G(net_reg_mr_dmabuf), G(net_dereg_mr), G(v9_isend), G(v9_irecv), G(net_iflush), G(net_test), G(net_close), G(net_close),
    G(net_close_listen), nullptr, nullptr, G((vdevice<ncclNetVDeviceProps_v9_t>))};
const ncclNet_v10_t ncclNetPlugin_v10 = {
    "Stellar", G(v10_init), G(net_devices), G((v9_properties<ncclNetProperties_v10_t>)), G(v8_listen), G(v10_connect), G(net_accept),
    G(net_reg_mr), G(net_reg_mr_dmabuf), G(net_dereg_mr), G(v10_isend), G(v10_irecv), G(net_iflush), G(net_test), G(net_close), G(net_close),
    G(net_close_listen), nullptr, nullptr, G((vdevice<ncclNetVDeviceProps_v10_t>))};
const ncclNet_v11_t ncclNetPlugin_v11 = {
    "Stellar", G((v11_init<ncclNetCommConfig_v11_t>)), G(net_devices), G((v11_properties<ncclNetProperties_v11_t>)), G(v11_listen),
    G(v11_connect), G(net_accept), G(net_reg_mr), G(net_reg_mr_dmabuf), G(net_dereg_mr), G(v10_isend), G(v10_irecv), G(net_iflush), G(net_test),
    G(net_close), G(net_close), G(net_close_listen), nullptr, nullptr, G((vdevice<ncclNetVDeviceProps_v11_t>)), G(v11_finalize), nullptr};
const ncclNet_v12_t ncclNetPlugin_v12 = {
    "Stellar", G((v11_init<ncclNetCommConfig_v12_t>)), G(net_devices), G(v12_properties), G(v11_listen), G(v11_connect), G(net_accept),
    G(net_reg_mr), G(net_reg_mr_dmabuf), G(net_dereg_mr), G(v10_isend), G(v10_irecv), G(net_iflush), G(net_test), G(net_close), G(net_close),
    G(net_close_listen), nullptr, nullptr, G((vdevice<ncclNetVDeviceProps_v12_t>)), G(v11_finalize), nullptr};

#undef G

}  // extern "C"

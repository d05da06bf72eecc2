// Drives an NCCL net plugin the way NCCL's proxy does (docs/nccl.md): finds
// the library as NCCL_NET_PLUGIN names it, looks up ncclNetPlugin_vN from the
// newest version down (or the one --version names), and runs two processes
// (a fork; the handles go over a socketpair, as NCCL's bootstrap carries
// them) that each listen, connect and accept without blocking, then move
// data through every call NCCL makes.
//
//   stellar_nccl_harness [--plugin NAME|PATH] [--version 8..12] MODE
//   MODE: exchange  many outstanding multi-receives with tags, buffers larger
//                   than the sends, zero-length and 16 MiB messages, both ways
//         errors    bad handles, strangers at the listen port, a wrong
//                   secret, bad irecv counts, a send larger than the buffer
//         close     one side closes its comms with requests in flight
//         kill      one side dies (SIGKILL) mid-stream
//         bench     bandwidth (window of 8, like NCCL's steps) and 8 B latency
// Exit status 0 when every check passed; each failure is printed.
#include <dlfcn.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "nccl_net.h"

namespace {

using Clock = std::chrono::steady_clock;

int g_rank = 0;
int g_failures = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "rank %d: FAILED %s: ", g_rank, #cond);   \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);        \
      ++g_failures;                                             \
    }                                                           \
  } while (0)
#define REQUIRE(cond, ...)        \
  do {                            \
    if (!(cond)) {                \
      CHECK(cond, __VA_ARGS__);   \
      exit(1);                    \
    }                             \
  } while (0)

void logger(ncclDebugLogLevel level, unsigned long, const char* file, int line, const char* fmt, ...) {
  if (level > NCCL_LOG_WARN && !getenv("HARNESS_VERBOSE")) return;
  va_list args;
  va_start(args, fmt);
  fprintf(stderr, "rank %d %s %s:%d ", g_rank, level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line);
  vfprintf(stderr, fmt, args);
  fprintf(stderr, "\n");
  va_end(args);
}

// ---- the plugin, behind one interface whatever its version ----
struct Net {
  int version = 0;
  const void* table = nullptr;
  void* ctx = nullptr;  // v11+: the per-communicator context
  int traffic_class = NCCL_NET_TRAFFIC_CLASS_UNDEF;

  template <typename T>
  const T* as() const { return static_cast<const T*>(table); }

#define NET_CALL(member, ...)                                              \
  switch (version) {                                                       \
    case 8: return as<ncclNet_v8_t>()->member(__VA_ARGS__);                \
    case 9: return as<ncclNet_v9_t>()->member(__VA_ARGS__);                \
    case 10: return as<ncclNet_v10_t>()->member(__VA_ARGS__);              \
    case 11: return as<ncclNet_v11_t>()->member(__VA_ARGS__);              \
    default: return as<ncclNet_v12_t>()->member(__VA_ARGS__);              \
  }

  ncclResult_t init() {
    ncclNetCommConfig_v12_t config{traffic_class};
    switch (version) {
      case 8: return as<ncclNet_v8_t>()->init(logger);
      case 9: return as<ncclNet_v9_t>()->init(logger);
      case 10: return as<ncclNet_v10_t>()->init(logger, nullptr);
      case 11: return as<ncclNet_v11_t>()->init(&ctx, 0x1234, &config, logger, nullptr);
      default: return as<ncclNet_v12_t>()->init(&ctx, 0x1234, &config, logger, nullptr);
    }
  }
  ncclResult_t devices(int* n) { NET_CALL(devices, n) }
  // The fields every version has, plus maxP2pBytes (v9+).
  ncclResult_t properties(int dev, ncclNetProperties_v8_t* p, size_t* max_p2p) {
    *max_p2p = size_t(1) << 30;  // what NCCL's shim gives a v8 plugin
    switch (version) {
      case 8: return as<ncclNet_v8_t>()->getProperties(dev, p);
      case 9: return wide_properties(as<ncclNet_v9_t>()->getProperties, dev, p, max_p2p);
      case 10: return wide_properties(as<ncclNet_v10_t>()->getProperties, dev, p, max_p2p);
      case 11: return wide_properties(as<ncclNet_v11_t>()->getProperties, dev, p, max_p2p);
      default: return wide_properties(as<ncclNet_v12_t>()->getProperties, dev, p, max_p2p);
    }
  }
  template <typename P>
  static ncclResult_t wide_properties(ncclResult_t (*get)(int, P*), int dev, ncclNetProperties_v8_t* p, size_t* max_p2p) {
    P w{};
    ncclResult_t r = get(dev, &w);
    *p = ncclNetProperties_v8_t{w.name, w.pciPath, w.guid, w.ptrSupport, w.regIsGlobal, w.speed, w.port, w.latency,
                                w.maxComms, w.maxRecvs, w.netDeviceType, w.netDeviceVersion};
    *max_p2p = w.maxP2pBytes;
    return r;
  }
  ncclResult_t listen(int dev, void* handle, void** l) {
    switch (version) {
      case 8: return as<ncclNet_v8_t>()->listen(dev, handle, l);
      case 9: return as<ncclNet_v9_t>()->listen(dev, handle, l);
      case 10: return as<ncclNet_v10_t>()->listen(dev, handle, l);
      case 11: return as<ncclNet_v11_t>()->listen(ctx, dev, handle, l);
      default: return as<ncclNet_v12_t>()->listen(ctx, dev, handle, l);
    }
  }
  ncclResult_t connect(int dev, void* handle, void** s) {
    ncclNetDeviceHandle_v8_t* dh = nullptr;  // NCCL passes a NULL device handle for a HOST device
    ncclNetCommConfig_v10_t config{traffic_class};
    switch (version) {
      case 8: return as<ncclNet_v8_t>()->connect(dev, handle, s, &dh);
      case 9: return as<ncclNet_v9_t>()->connect(dev, handle, s, &dh);
      case 10: return as<ncclNet_v10_t>()->connect(dev, &config, handle, s, &dh);
      case 11: return as<ncclNet_v11_t>()->connect(ctx, dev, handle, s, &dh);
      default: return as<ncclNet_v12_t>()->connect(ctx, dev, handle, s, &dh);
    }
  }
  ncclResult_t accept(void* l, void** r) {
    ncclNetDeviceHandle_v8_t* dh = nullptr;
    NET_CALL(accept, l, r, &dh)
  }
  ncclResult_t reg_mr(void* comm, void* data, size_t size, void** mh) { NET_CALL(regMr, comm, data, size, NCCL_PTR_HOST, mh) }
  ncclResult_t dereg_mr(void* comm, void* mh) { NET_CALL(deregMr, comm, mh) }
  ncclResult_t isend(void* comm, void* data, size_t size, int tag, void* mh, void** req) {
    switch (version) {
      case 8: return as<ncclNet_v8_t>()->isend(comm, data, int(size), tag, mh, req);
      case 9: return as<ncclNet_v9_t>()->isend(comm, data, size, tag, mh, req);
      case 10: return as<ncclNet_v10_t>()->isend(comm, data, size, tag, mh, nullptr, req);
      case 11: return as<ncclNet_v11_t>()->isend(comm, data, size, tag, mh, nullptr, req);
      default: return as<ncclNet_v12_t>()->isend(comm, data, size, tag, mh, nullptr, req);
    }
  }
  ncclResult_t irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mh, void** req) {
    void* phandles[16] = {};
    if (version == 8) {
      int narrow[16];
      for (int i = 0; i < n && i < 16; ++i) narrow[i] = int(sizes[i]);
      return as<ncclNet_v8_t>()->irecv(comm, n, data, narrow, tags, mh, req);
    }
    switch (version) {
      case 9: return as<ncclNet_v9_t>()->irecv(comm, n, data, sizes, tags, mh, req);
      case 10: return as<ncclNet_v10_t>()->irecv(comm, n, data, sizes, tags, mh, phandles, req);
      case 11: return as<ncclNet_v11_t>()->irecv(comm, n, data, sizes, tags, mh, phandles, req);
      default: return as<ncclNet_v12_t>()->irecv(comm, n, data, sizes, tags, mh, phandles, req);
    }
  }
  ncclResult_t test(void* req, int* done, int* sizes) { NET_CALL(test, req, done, sizes) }
  ncclResult_t close_send(void* c) { NET_CALL(closeSend, c) }
  ncclResult_t close_recv(void* c) { NET_CALL(closeRecv, c) }
  ncclResult_t close_listen(void* c) { NET_CALL(closeListen, c) }
  ncclResult_t finalize() {
    if (version == 11) return as<ncclNet_v11_t>()->finalize(ctx);
    if (version == 12) return as<ncclNet_v12_t>()->finalize(ctx);
    return ncclSuccess;
  }
#undef NET_CALL
};

// NCCL's search: dlopen(NAME), then libnccl-net-NAME.so; symbols from v12 down.
Net load(const std::string& requested, int version) {
  std::string name = requested.empty() ? (getenv("NCCL_NET_PLUGIN") ? getenv("NCCL_NET_PLUGIN") : "libnccl-net.so") : requested;
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib && name.find('/') == std::string::npos && name.rfind("lib", 0) != 0) {
    std::string full = "libnccl-net-" + name + ".so";
    lib = dlopen(full.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  REQUIRE(lib, "dlopen %s: %s", name.c_str(), dlerror());
  Net net;
  for (int v = 12; v >= 8; --v) {
    if (version && v != version) continue;
    std::string symbol = "ncclNetPlugin_v" + std::to_string(v);
    if (const void* t = dlsym(lib, symbol.c_str())) {
      net.version = v;
      net.table = t;
      break;
    }
  }
  REQUIRE(net.table, "no ncclNetPlugin_v%s in %s", version ? std::to_string(version).c_str() : "8..12", name.c_str());
  return net;
}

// ---- out of band: the socketpair between the two ranks ----
int g_oob = -1;
void oob_send(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    ssize_t w = write(g_oob, c, n);
    REQUIRE(w > 0, "oob write");
    c += w;
    n -= size_t(w);
  }
}
void oob_recv(void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    ssize_t r = read(g_oob, c, n);
    REQUIRE(r > 0, "oob read: the peer is gone");
    c += r;
    n -= size_t(r);
  }
}
void barrier() {
  char b = 1;
  oob_send(&b, 1);
  oob_recv(&b, 1);
}

struct Link {
  void* send = nullptr;
  void* recv = nullptr;
};

// listen, swap handles, then connect and accept until both are set, as
// NCCL's proxy calls them (each call returns at once).
Link connect_pair(Net& net, double* seconds = nullptr) {
  char mine[NCCL_NET_HANDLE_MAXSIZE], peer[NCCL_NET_HANDLE_MAXSIZE];
  void* listen_comm = nullptr;
  REQUIRE(net.listen(0, mine, &listen_comm) == ncclSuccess && listen_comm, "listen");
  oob_send(mine, sizeof mine);
  oob_recv(peer, sizeof peer);
  Link link;
  const auto start = Clock::now();
  while (!link.send || !link.recv) {
    if (!link.send) REQUIRE(net.connect(0, peer, &link.send) == ncclSuccess, "connect");
    if (!link.recv) REQUIRE(net.accept(listen_comm, &link.recv) == ncclSuccess, "accept");
    REQUIRE(Clock::now() - start < std::chrono::seconds(30), "no connection within 30 s");
  }
  REQUIRE(net.close_listen(listen_comm) == ncclSuccess, "closeListen");
  if (seconds) *seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return link;
}

struct Buffer {
  std::vector<uint8_t> bytes;
  void* mh = nullptr;
};

uint8_t pattern(int rank, int iter, int req, int tag, size_t j) {
  return uint8_t(j * 131 + size_t(tag) * 17 + size_t(req) * 7 + size_t(iter) * 3 + size_t(rank) * 101);
}

// Tests every request in `reqs` until done; returns false on an error.
bool wait_all(Net& net, std::vector<void*>& reqs, std::vector<std::vector<int>>* sizes = nullptr,
              std::chrono::seconds limit = std::chrono::seconds(60)) {
  const auto start = Clock::now();
  size_t left = 0;
  for (void* r : reqs) left += r != nullptr;
  while (left) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (!reqs[i]) continue;
      int done = 0;
      int got[8] = {};
      if (net.test(reqs[i], &done, got) != ncclSuccess) return false;
      if (done) {
        if (sizes) (*sizes)[i].assign(got, got + 8);
        reqs[i] = nullptr;
        --left;
      }
    }
    if (Clock::now() - start > limit) {
      CHECK(false, "requests not done within %llds", (long long)limit.count());
      return false;
    }
  }
  return true;
}

// ---- exchange ----
void exchange(Net& net, Link& link, int maxrecvs) {
  const int peer = 1 - g_rank;
  std::mt19937 rng(12345);  // the same on both ranks: each knows what the other sends
  const int nreq = NCCL_NET_MAX_REQUESTS;
  const int n = std::min(maxrecvs, 8);
  for (int iter = 0; iter < 6; ++iter) {
    const bool large = iter == 5;
    const int reqs = large ? 2 : nreq;
    const int per = large ? 1 : n;
    // send sizes (the same stream on both ranks) and receive capacities
    std::vector<std::vector<size_t>> size(static_cast<size_t>(reqs), std::vector<size_t>(static_cast<size_t>(per), 0));
    std::vector<std::vector<int>> order(static_cast<size_t>(reqs));
    for (int r = 0; r < reqs; ++r) {
      for (int i = 0; i < per; ++i) {
        uint32_t x = rng();
        size[size_t(r)][size_t(i)] = large ? (size_t(16) << 20) + x % 4096 : (x % 5 == 0 ? 0 : x % 65536);
      }
      order[size_t(r)].resize(size_t(per));
      for (int i = 0; i < per; ++i) order[size_t(r)][size_t(i)] = i;
      std::shuffle(order[size_t(r)].begin(), order[size_t(r)].end(), rng);  // sends go out in another tag order
    }
    const size_t extra = 4096;  // receive buffers are larger than the sends
    std::vector<Buffer> rbuf(size_t(reqs * per)), sbuf(size_t(reqs * per));
    for (int r = 0; r < reqs; ++r)
      for (int i = 0; i < per; ++i) {
        Buffer& rb = rbuf[size_t(r * per + i)];
        rb.bytes.assign(size[size_t(r)][size_t(i)] + extra, 0xEE);
        REQUIRE(net.reg_mr(link.recv, rb.bytes.data(), rb.bytes.size(), &rb.mh) == ncclSuccess, "regMr recv");
        Buffer& sb = sbuf[size_t(r * per + i)];
        sb.bytes.resize(std::max<size_t>(size[size_t(r)][size_t(i)], 1));
        for (size_t j = 0; j < size[size_t(r)][size_t(i)]; ++j) sb.bytes[j] = pattern(g_rank, iter, r, i, j);
        REQUIRE(net.reg_mr(link.send, sb.bytes.data(), sb.bytes.size(), &sb.mh) == ncclSuccess, "regMr send");
      }
    // post every receive (tags: the buffer's index)
    std::vector<void*> rreq(size_t(reqs), nullptr);
    for (int r = 0; r < reqs; ++r) {
      void* data[8];
      size_t cap[8];
      int tags[8];
      void* mhs[8];
      for (int i = 0; i < per; ++i) {
        Buffer& rb = rbuf[size_t(r * per + i)];
        data[i] = rb.bytes.data();
        cap[i] = rb.bytes.size();
        tags[i] = i;
        mhs[i] = rb.mh;
      }
      if (net.version >= 9) rreq[size_t(r)] = reinterpret_cast<void*>(NCCL_NET_OPTIONAL_RECV_COMPLETION);
      const auto start = Clock::now();
      while (true) {
        REQUIRE(net.irecv(link.recv, per, data, cap, tags, mhs, &rreq[size_t(r)]) == ncclSuccess, "irecv");
        if (rreq[size_t(r)]) break;
        REQUIRE(Clock::now() - start < std::chrono::seconds(30), "irecv never accepted");
      }
      CHECK(rreq[size_t(r)] != reinterpret_cast<void*>(NCCL_NET_OPTIONAL_RECV_COMPLETION), "irecv left 0x1 as the request");
    }
    std::vector<std::vector<int>> got(size_t(reqs), std::vector<int>(8, -1));
    auto poll_recvs = [&] {
      for (size_t r = 0; r < rreq.size(); ++r) {
        int done = 0;
        int sizes[8] = {};
        if (!rreq[r]) continue;
        REQUIRE(net.test(rreq[r], &done, sizes) == ncclSuccess, "test recv");
        if (done) {
          got[r].assign(sizes, sizes + 8);
          rreq[r] = nullptr;
        }
      }
    };
    // send everything (retrying NULL requests), in the shuffled tag order
    std::vector<void*> sreq(size_t(reqs * per), nullptr);
    for (int r = 0; r < reqs; ++r)
      for (int k = 0; k < per; ++k) {
        const int i = order[size_t(r)][size_t(k)];
        Buffer& sb = sbuf[size_t(r * per + i)];
        void*& q = sreq[size_t(r * per + i)];
        const auto start = Clock::now();
        while (!q) {
          REQUIRE(net.isend(link.send, sb.bytes.data(), size[size_t(r)][size_t(i)], i, sb.mh, &q) == ncclSuccess, "isend");
          REQUIRE(Clock::now() - start < std::chrono::seconds(30), "isend never accepted");
          poll_recvs();  // keep receives moving while waiting for the peer's clear-to-send
        }
      }
    REQUIRE(wait_all(net, sreq), "send requests");
    REQUIRE(wait_all(net, rreq, &got), "recv requests");
    for (int r = 0; r < reqs; ++r)
      for (int i = 0; i < per; ++i) {
        const size_t want = size[size_t(r)][size_t(i)];
        CHECK(size_t(got[size_t(r)][size_t(i)]) == want, "iter %d recv %d buffer %d: size %d, sent %zu", iter, r, i,
              got[size_t(r)][size_t(i)], want);
        Buffer& rb = rbuf[size_t(r * per + i)];
        size_t bad = 0;
        for (size_t j = 0; j < want; ++j) bad += rb.bytes[j] != pattern(peer, iter, r, i, j);
        size_t past = 0;
        for (size_t j = want; j < rb.bytes.size(); ++j) past += rb.bytes[j] != 0xEE;
        CHECK(bad == 0, "iter %d recv %d buffer %d: %zu wrong bytes of %zu", iter, r, i, bad, want);
        CHECK(past == 0, "iter %d recv %d buffer %d: %zu bytes written past the message", iter, r, i, past);
      }
    for (Buffer& b : rbuf) CHECK(net.dereg_mr(link.recv, b.mh) == ncclSuccess, "deregMr");
    for (Buffer& b : sbuf) CHECK(net.dereg_mr(link.send, b.mh) == ncclSuccess, "deregMr");
    barrier();
  }
  printf("rank %d: exchange: 6 rounds (5 of %d receives x %d buffers up to 64 KiB, 1 of 2 x 16 MiB), both ways\n", g_rank,
         nreq, n);
}

// ---- errors ----
void errors(Net& net, Link& link) {
  // a handle that is not one
  char junk[NCCL_NET_HANDLE_MAXSIZE];
  memset(junk, 0x5a, sizeof junk);
  void* s = nullptr;
  ncclResult_t r = net.connect(0, junk, &s);
  CHECK(r != ncclSuccess && !s, "connect with a junk handle returned %d", r);

  // irecv with 0 or too many buffers
  void* data[16] = {};
  size_t sizes[16] = {};
  int tags[16] = {};
  void* mhs[16] = {};
  void* req = nullptr;
  CHECK(net.irecv(link.recv, 0, data, sizes, tags, mhs, &req) != ncclSuccess && !req, "irecv of 0 buffers accepted");
  CHECK(net.irecv(link.recv, 16, data, sizes, tags, mhs, &req) != ncclSuccess && !req, "irecv of 16 buffers accepted");

  // a send larger than the receiver's buffer: the sender refuses it
  std::vector<uint8_t> small(1024), big(2048, 1);
  void *smh = nullptr, *bmh = nullptr;
  REQUIRE(net.reg_mr(link.recv, small.data(), small.size(), &smh) == ncclSuccess, "regMr");
  REQUIRE(net.reg_mr(link.send, big.data(), big.size(), &bmh) == ncclSuccess, "regMr");
  data[0] = small.data();
  sizes[0] = small.size();
  mhs[0] = smh;
  while (!req) REQUIRE(net.irecv(link.recv, 1, data, sizes, tags, mhs, &req) == ncclSuccess, "irecv");
  // a send outside its registration
  void* sreq = nullptr;
  CHECK(net.isend(link.send, big.data() + 1024, 2048, 0, bmh, &sreq) != ncclSuccess && !sreq,
        "isend outside the registration accepted");
  const auto start = Clock::now();
  for (;;) {
    r = net.isend(link.send, big.data(), big.size(), 0, bmh, &sreq);
    if (r != ncclSuccess || sreq) break;
    int done = 0;
    REQUIRE(net.test(req, &done, nullptr) == ncclSuccess, "test");
    REQUIRE(Clock::now() - start < std::chrono::seconds(20), "no clear-to-send within 20 s");
  }
  CHECK(r == ncclInvalidUsage && !sreq, "a 2048-byte send into a 1024-byte buffer gave %d", r);
  CHECK(net.dereg_mr(link.recv, smh) == ncclSuccess && net.dereg_mr(link.send, bmh) == ncclSuccess, "deregMr");
  printf("rank %d: errors: junk handle, irecv counts, send outside its registration, send larger than the buffer\n", g_rank);
}

// A listen handle that strangers and a wrong secret reach first: the right
// connector still gets in. Rank 0 listens, rank 1 attacks and connects.
void strangers(Net& net) {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* listen_comm = nullptr;
  if (g_rank == 0) {
    REQUIRE(net.listen(0, handle, &listen_comm) == ncclSuccess, "listen");
    oob_send(handle, sizeof handle);
    void* recv = nullptr;
    const auto start = Clock::now();
    while (!recv) {
      REQUIRE(net.accept(listen_comm, &recv) == ncclSuccess, "accept after strangers");
      REQUIRE(Clock::now() - start < std::chrono::seconds(30), "no accept within 30 s");
    }
    net.close_listen(listen_comm);
    net.close_recv(recv);
    barrier();
    return;
  }
  oob_recv(handle, sizeof handle);
  // the handle's address and port (bytes 6-7 port, 8-11 IPv4), whatever they mean to the plugin
  uint16_t port;
  uint32_t ip;
  memcpy(&port, handle + 6, 2);
  memcpy(&ip, handle + 8, 4);
  // 1: a TCP client that sends a huge line; 2: one that sends JSON of the wrong type; 3: one that idles
  const char* lines[] = {"", "{\"type\":\"connect\",\"qp_num\":\"x\"}\n", nullptr};
  for (const char* line : lines) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = ip;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      if (line && !*line) {
        std::string huge(1 << 20, 'A');
        (void)!write(fd, huge.data(), huge.size());
      } else if (line) {
        (void)!write(fd, line, strlen(line));
      }
    }
    if (line) close(fd);  // the idle one stays open
  }
  // 4: a connector with the wrong secret (bytes 16-23)
  char forged[NCCL_NET_HANDLE_MAXSIZE];
  memcpy(forged, handle, sizeof forged);
  forged[16] ^= 0x01;
  void* s = nullptr;
  ncclResult_t r = ncclSuccess;
  const auto start = Clock::now();
  while (!s && r == ncclSuccess && Clock::now() - start < std::chrono::seconds(30)) r = net.connect(0, forged, &s);
  CHECK(r != ncclSuccess && !s, "a connect with the wrong secret gave %d", r);
  // the real one
  s = nullptr;
  while (!s) {
    REQUIRE(net.connect(0, handle, &s) == ncclSuccess, "connect after strangers");
    REQUIRE(Clock::now() - start < std::chrono::seconds(60), "no connect within 60 s");
  }
  net.close_send(s);
  barrier();
  printf("rank 1: strangers: a 1 MiB line, wrong JSON, an idle socket and a wrong secret were refused; the real connect got in\n");
}

// ---- close with requests in flight ----
void close_in_flight(Net& net, Link& link) {
  const size_t big = size_t(16) << 20;
  std::vector<uint8_t> buf(big * 4, 7);
  void* mh_send = nullptr;
  void* mh_recv = nullptr;
  REQUIRE(net.reg_mr(link.send, buf.data(), big * 2, &mh_send) == ncclSuccess, "regMr");
  REQUIRE(net.reg_mr(link.recv, buf.data() + big * 2, big * 2, &mh_recv) == ncclSuccess, "regMr");
  // both: receives for two large messages; rank 1 sends them and closes at once
  std::vector<void*> rreq(2, nullptr);
  for (int r = 0; r < 2; ++r) {
    void* data[1] = {buf.data() + big * size_t(2 + r)};
    size_t sizes[1] = {big};
    int tags[1] = {0};
    void* mhs[1] = {mh_recv};
    while (!rreq[size_t(r)]) REQUIRE(net.irecv(link.recv, 1, data, sizes, tags, mhs, &rreq[size_t(r)]) == ncclSuccess, "irecv");
  }
  barrier();
  if (g_rank == 1) {
    std::vector<void*> sreq(2, nullptr);
    const auto start = Clock::now();
    for (int r = 0; r < 2; ++r)
      while (!sreq[size_t(r)]) {
        REQUIRE(net.isend(link.send, buf.data() + big * size_t(r), big, 0, mh_send, &sreq[size_t(r)]) == ncclSuccess, "isend");
        REQUIRE(Clock::now() - start < std::chrono::seconds(20), "isend never accepted");
      }
    // close with both sends (32 MiB) and both receives in flight
    CHECK(net.dereg_mr(link.send, mh_send) == ncclSuccess, "deregMr");
    CHECK(net.dereg_mr(link.recv, mh_recv) == ncclSuccess, "deregMr");
    CHECK(net.close_send(link.send) == ncclSuccess, "closeSend with sends in flight");
    CHECK(net.close_recv(link.recv) == ncclSuccess, "closeRecv with receives in flight");
    memset(buf.data(), 0, buf.size());  // the buffers are ours again
    barrier();                          // rank 0 has seen its outcome
    printf("rank 1: close: closed a send comm with 2 x 16 MiB in flight and a recv comm with 2 receives posted\n");
    return;
  }
  // rank 0: its receives either complete or fail; none hangs
  const auto start = Clock::now();
  int completed = 0, failed = 0;
  for (void* q : rreq) {
    for (;;) {
      int done = 0;
      int sizes[1];
      if (net.test(q, &done, sizes) != ncclSuccess) {
        ++failed;
        break;
      }
      if (done) {
        ++completed;
        break;
      }
      REQUIRE(Clock::now() - start < std::chrono::seconds(30), "a receive neither completed nor failed within 30 s");
    }
  }
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  CHECK(completed + failed == 2, "outcomes");
  // its own send comm to the closed peer: a receive-less peer must fail a send too
  net.dereg_mr(link.send, mh_send);
  net.dereg_mr(link.recv, mh_recv);
  CHECK(net.close_recv(link.recv) == ncclSuccess, "closeRecv after the peer closed");
  CHECK(net.close_send(link.send) == ncclSuccess, "closeSend after the peer closed");
  barrier();
  printf("rank 0: close: peer closed mid-transfer: %d receive(s) completed, %d failed, after %.2f s\n", completed, failed, took);
}

// ---- a dead peer ----
void killed(Net& net, Link& link) {
  const size_t size = size_t(1) << 20;
  std::vector<uint8_t> buf(size * 8);
  void* mh = nullptr;
  REQUIRE(net.reg_mr(g_rank == 0 ? link.recv : link.send, buf.data(), buf.size(), &mh) == ncclSuccess, "regMr");
  if (g_rank == 1) {  // streams, then dies with sends in flight
    int sent = 0;
    std::vector<void*> q(8, nullptr);
    for (;;) {
      for (int i = 0; i < 8; ++i) {
        int done = 0;
        if (q[size_t(i)]) {
          REQUIRE(net.test(q[size_t(i)], &done, nullptr) == ncclSuccess, "test");
          if (done) q[size_t(i)] = nullptr;
        }
        if (!q[size_t(i)]) {
          REQUIRE(net.isend(link.send, buf.data() + size * size_t(i), size, 0, mh, &q[size_t(i)]) == ncclSuccess, "isend");
          if (q[size_t(i)] && ++sent == 40) raise(SIGKILL);
        }
      }
    }
  }
  // rank 0: receives until an error; it must come within a bound
  std::vector<void*> q(8, nullptr);
  int received = 0;
  Clock::time_point last = Clock::now();
  ncclResult_t error = ncclSuccess;
  while (error == ncclSuccess) {
    for (int i = 0; i < 8 && error == ncclSuccess; ++i) {
      if (!q[size_t(i)]) {
        void* data[1] = {buf.data() + size * size_t(i)};
        size_t sizes[1] = {size};
        int tags[1] = {0};
        void* mhs[1] = {mh};
        error = net.irecv(link.recv, 1, data, sizes, tags, mhs, &q[size_t(i)]);
        continue;
      }
      int done = 0;
      error = net.test(q[size_t(i)], &done, nullptr);
      if (done) {
        q[size_t(i)] = nullptr;
        ++received;
        last = Clock::now();
      }
    }
    REQUIRE(Clock::now() - last < std::chrono::seconds(30), "no error within 30 s of the peer's death");
  }
  const double after = std::chrono::duration<double>(Clock::now() - last).count();
  CHECK(error == ncclSystemError || error == ncclRemoteError, "error code %d", error);
  printf("rank 0: kill: peer killed after %d messages; error %d reported %.2f s after the last completion\n", received, error,
         after);
  net.dereg_mr(link.recv, mh);
  net.close_recv(link.recv);
  net.close_send(link.send);
}

// ---- bench ----
void bench(Net& net, Link& link, size_t max_size, double bytes_per_size) {
  // NCCL_STEPS: the proxy keeps 8 in flight per connection
  const int window = getenv("HARNESS_WINDOW") ? std::max(1, std::min(64, atoi(getenv("HARNESS_WINDOW")))) : 8;
  std::vector<uint8_t> buf(max_size * window);
  void* mh_s = nullptr;
  void* mh_r = nullptr;
  REQUIRE(net.reg_mr(link.send, buf.data(), buf.size(), &mh_s) == ncclSuccess, "regMr");
  REQUIRE(net.reg_mr(link.recv, buf.data(), buf.size(), &mh_r) == ncclSuccess, "regMr");
  auto post_recv = [&](int slot, size_t size, void** q) {
    void* data[1] = {buf.data() + max_size * size_t(slot)};
    size_t sizes[1] = {size};
    int tags[1] = {0};
    void* mhs[1] = {mh_r};
    while (!*q) REQUIRE(net.irecv(link.recv, 1, data, sizes, tags, mhs, q) == ncclSuccess, "irecv");
  };
  auto post_send = [&](int slot, size_t size, void** q) {
    while (!*q) REQUIRE(net.isend(link.send, buf.data() + max_size * size_t(slot), size, 0, mh_s, q) == ncclSuccess, "isend");
  };
  auto finish = [&](void** q) {
    int done = 0;
    while (!done) REQUIRE(net.test(*q, &done, nullptr) == ncclSuccess, "test");
    *q = nullptr;
  };
  // latency: 8 B ping-pong. Receives are posted one ahead, as NCCL posts
  // its steps ahead, so that a clear-to-send is off the round trip's path;
  // a send is tested for completion before its buffer is used again.
  {
    const int iters = 20000, warmup = 1000;
    std::vector<double> rtt;
    rtt.reserve(iters);
    void* s = nullptr;
    void* r[2] = {nullptr, nullptr};
    post_recv(0, 8, &r[0]);
    for (int i = 0; i < iters + warmup; ++i) {
      const auto t0 = Clock::now();
      const int cur = i % 2, next = 1 - cur;
      const bool more = i + 1 < iters + warmup;
      if (g_rank == 0) {
        if (s) finish(&s);
        post_send(1, 8, &s);
        if (more) post_recv(2 + next, 8, &r[next]);  // while the reply is on its way
        finish(&r[cur]);
      } else {
        finish(&r[cur]);
        if (s) finish(&s);
        post_send(1, 8, &s);
        if (more) post_recv(2 + next, 8, &r[next]);
      }
      if (i >= warmup) rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    if (s) finish(&s);
    std::sort(rtt.begin(), rtt.end());
    if (g_rank == 0)
      printf("latency 8 B: one-way p50 %.2f us, p99 %.2f us (half the isend/irecv round trip, %d round trips)\n",
             rtt[rtt.size() / 2] / 2, rtt[rtt.size() * 99 / 100] / 2, iters);
  }
  barrier();
  auto cpu_seconds = [] {  // this process, every thread: user + system
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  if (g_rank == 0) printf("%12s %12s %10s %12s\n", "bytes", "messages", "GB/s", "cpu_s_per_GB");
  for (size_t size = 4096; size <= max_size; size *= 4) {
    // both sides know the count: about bytes_per_size, within [64, 200000] messages
    const long count = std::max<long>(64, std::min<long>(200000, long(bytes_per_size / double(size))));
    std::vector<void*> q(window, nullptr);
    const double cpu0 = cpu_seconds();
    const auto t0 = Clock::now();
    long posted = 0, completed = 0;
    while (completed < count) {
      for (int i = 0; i < window; ++i) {
        if (q[size_t(i)]) {
          int done = 0;
          REQUIRE(net.test(q[size_t(i)], &done, nullptr) == ncclSuccess, "test");
          if (!done) continue;
          q[size_t(i)] = nullptr;
          ++completed;
        }
        if (posted < count) {
          if (g_rank == 0) post_send(i, size, &q[size_t(i)]);
          else post_recv(i, size, &q[size_t(i)]);
          ++posted;
        }
      }
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    double cpu = cpu_seconds() - cpu0;
    if (g_rank == 1) {
      oob_send(&cpu, sizeof cpu);
    } else {
      double peer_cpu = 0;
      oob_recv(&peer_cpu, sizeof peer_cpu);
      const double gb = double(count) * double(size) / 1e9;
      printf("%12zu %12ld %10.3f %12.4f\n", size, count, gb / s, (cpu + peer_cpu) / gb);
    }
    barrier();
  }
  net.dereg_mr(link.send, mh_s);
  net.dereg_mr(link.recv, mh_r);
}

int run_rank(const std::string& plugin, int version, const std::string& mode, int tc) {
  Net net = load(plugin, version);
  net.traffic_class = tc;
  REQUIRE(net.init() == ncclSuccess, "init");
  int ndev = 0;
  REQUIRE(net.devices(&ndev) == ncclSuccess && ndev >= 1, "devices: %d", ndev);
  ncclNetProperties_v8_t p{};
  size_t max_p2p = 0;
  REQUIRE(net.properties(0, &p, &max_p2p) == ncclSuccess, "getProperties");
  CHECK(p.name && *p.name, "name");
  CHECK(p.speed > 0 && p.maxComms > 0 && p.maxRecvs >= 1 && (p.ptrSupport & NCCL_PTR_HOST), "properties");
  CHECK(p.netDeviceType == NCCL_NET_DEVICE_HOST && p.netDeviceVersion == 0, "device type");
  CHECK(max_p2p > 0 && max_p2p <= NCCL_MAX_NET_SIZE_BYTES, "maxP2pBytes %zu", max_p2p);
  ncclNetProperties_v8_t bad{};
  CHECK(net.properties(ndev, &bad, &max_p2p) != ncclSuccess, "getProperties of device %d (of %d) succeeded", ndev, ndev);
  if (g_rank == 0)
    printf("plugin v%d: %d device(s); device 0 '%s' pci %s speed %d Mbps latency %.1f us maxRecvs %d ptrSupport %#x\n",
           net.version, ndev, p.name, p.pciPath ? p.pciPath : "(virtual)", p.speed, p.latency, p.maxRecvs, p.ptrSupport);
  if (mode == "strangers") {
    strangers(net);
    CHECK(net.finalize() == ncclSuccess, "finalize");
    return g_failures ? 1 : 0;
  }
  double took = 0;
  Link link = connect_pair(net, &took);
  if (mode == "exchange") exchange(net, link, p.maxRecvs);
  else if (mode == "errors") errors(net, link);
  else if (mode == "close") { close_in_flight(net, link); net.finalize(); return g_failures ? 1 : 0; }
  else if (mode == "kill") { killed(net, link); net.finalize(); return g_failures ? 1 : 0; }
  else if (mode == "bench") bench(net, link, size_t(64) << 20, double(size_t(2) << 30));
  else REQUIRE(false, "unknown mode %s", mode.c_str());
  barrier();
  CHECK(net.close_send(link.send) == ncclSuccess, "closeSend");
  CHECK(net.close_recv(link.recv) == ncclSuccess, "closeRecv");
  CHECK(net.finalize() == ncclSuccess, "finalize");
  return g_failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string plugin, mode;
  int version = 0, tc = NCCL_NET_TRAFFIC_CLASS_UNDEF;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--plugin" && i + 1 < argc) plugin = argv[++i];
    else if (a == "--version" && i + 1 < argc) version = atoi(argv[++i]);
    else if (a == "--traffic-class" && i + 1 < argc) tc = atoi(argv[++i]);
    else if (mode.empty() && a[0] != '-') mode = a;
    else {
      fprintf(stderr, "usage: %s [--plugin NAME|PATH] [--version 8..12] [--traffic-class TC] exchange|errors|strangers|close|kill|bench\n", argv[0]);
      return 2;
    }
  }
  if (mode.empty()) mode = "exchange";
  if (version && (version < 8 || version > 12)) {
    fprintf(stderr, "--version: 8 to 12\n");
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);  // writes to a socket the plugin closed fail instead
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 1;
  pid_t child = fork();  // before any thread or plugin exists
  if (child < 0) return 1;
  if (child == 0) {
    g_rank = 1;
    close(fds[0]);
    g_oob = fds[1];
    fflush(stdout);
    _exit(run_rank(plugin, version, mode, tc));
  }
  close(fds[1]);
  g_oob = fds[0];
  int rc = run_rank(plugin, version, mode, tc);
  int status = 0;
  waitpid(child, &status, 0);
  const bool child_ok = mode == "kill" ? WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL
                                       : WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!child_ok) fprintf(stderr, "rank 1 ended with status %#x\n", status);
  printf("%s: %s\n", mode.c_str(), rc == 0 && child_ok ? "passed" : "FAILED");
  return rc == 0 && child_ok ? 0 : 1;
}

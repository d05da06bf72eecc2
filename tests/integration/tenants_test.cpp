// Tenants as principals, quotas, traffic classes and the flow scheduler's
// shares, through the public API (docs/scheduler.md). The scheduler's exact
// arithmetic is tested on a virtual clock (tests/unit/scheduler_test.cpp);
// here it runs in the engine host with real sockets.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <thread>
#include <tuple>

#include "engined_process.hpp"
#include "stellar/stellar.hpp"

using namespace stellar;
using namespace std::chrono_literals;

namespace {

// A tenants file in the test's temporary directory.
struct TenantsFile {
  std::string path;
  explicit TenantsFile(const std::string& json) {
    char name[] = "/tmp/stellar-tenants-XXXXXX";
    const int fd = ::mkstemp(name);
    if (fd < 0) std::abort();
    ::close(fd);
    path = name;
    std::ofstream(path) << json;
  }
  ~TenantsFile() { std::remove(path.c_str()); }
};

const char* two_tenants = R"({"tenants": [
  {"name": "alpha", "credential": "alpha-secret", "weight": 2, "max_qps": 4},
  {"name": "beta", "credential": "beta-secret", "pkey": 33000}
]})";

ContextOptions with_file(const std::string& path, const std::string& tenant = "", const std::string& credential = "") {
  ContextOptions o;
  o.tenants_file = path;
  o.tenant = tenant;
  o.credential = credential;
  return o;
}

}  // namespace

TEST(Tenants, AContextOpensAsAFileTenantOnlyWithItsCredential) {
  TenantsFile file(two_tenants);
  auto wrong = Context::open(with_file(file.path, "alpha", "beta-secret"));
  ASSERT_FALSE(wrong);
  EXPECT_EQ(wrong.status().code(), Errc::permission_denied);
  EXPECT_NE(wrong.status().message().find("wrong credential"), std::string::npos) << wrong.status().message();
  auto missing = Context::open(with_file(file.path, "alpha"));
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.status().code(), Errc::permission_denied);
  auto unknown = Context::open(with_file(file.path, "gamma", "anything"));
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.status().code(), Errc::permission_denied);

  auto ctx = Context::open(with_file(file.path, "alpha", "alpha-secret"));
  ASSERT_TRUE(ctx) << ctx.status().to_string();
  // Its PDs are alpha's by default.
  auto pd = (*ctx)->allocate_pd();
  ASSERT_TRUE(pd);
  EXPECT_EQ((*pd)->tenant(), "alpha");
  // Another tenant of the file stays closed until its credential is given.
  auto closed = (*ctx)->allocate_pd("beta");
  ASSERT_FALSE(closed);
  EXPECT_EQ(closed.status().code(), Errc::permission_denied);
  TenantOptions guess;
  guess.credential = "beta-secre";
  EXPECT_EQ((*ctx)->create_tenant("beta", guess).code(), Errc::permission_denied);
  guess.credential = "beta-secret";
  ASSERT_TRUE((*ctx)->create_tenant("beta", guess).ok());
  auto open_pd = (*ctx)->allocate_pd("beta");
  ASSERT_TRUE(open_pd) << open_pd.status().to_string();
  // Beta's partition key is the file's.
  QpInitAttributes attr;
  attr.send_cq = attr.recv_cq = (*ctx)->create_cq(16).value();
  auto qp = (*open_pd)->create_qp(attr).value();
  EXPECT_EQ(qp->local_endpoint().pkey, 33000);
  bool seen = false;
  for (const TenantCounters& t : (*ctx)->tenant_counters())
    if (t.tenant == "beta") {
      seen = true;
      EXPECT_EQ(t.credential_refusals, 2u);  // the closed allocate_pd and the wrong guess
      EXPECT_EQ(t.qps, 1u);
    }
  EXPECT_TRUE(seen);
}

TEST(Tenants, WithAFileOnlyItsTenantsExist) {
  TenantsFile file(two_tenants);
  auto ctx = Context::open(with_file(file.path));
  ASSERT_TRUE(ctx) << ctx.status().to_string();
  // No unnamed default tenant (no credential, no quotas) and no new tenants.
  EXPECT_EQ((*ctx)->allocate_pd().status().code(), Errc::permission_denied);
  EXPECT_EQ((*ctx)->create_tenant("gamma", TenantOptions{}).code(), Errc::permission_denied);
  TenantOptions right;
  right.credential = "alpha-secret";
  ASSERT_TRUE((*ctx)->create_tenant("alpha", right).ok());
  EXPECT_TRUE((*ctx)->allocate_pd("alpha"));
}

TEST(Tenants, FileTenantsWithoutAPartitionKeyNeverTakeAListedOne) {
  // "a" sorts first and has no key; "b" asks for 0x8001, the first key
  // handed out: b keeps it and a gets another.
  TenantsFile file(R"({"tenants": [{"name": "a", "credential": "x"}, {"name": "b", "credential": "y", "pkey": 32769}]})");
  auto ctx = Context::open(with_file(file.path, "a", "x"));
  ASSERT_TRUE(ctx) << ctx.status().to_string();
  bool seen = false;
  for (const TenantCounters& t : (*ctx)->tenant_counters())
    if (t.tenant == "a") {
      seen = true;
      EXPECT_NE(t.pkey, 0x8001);
    }
  EXPECT_TRUE(seen);
}

TEST(Tenants, ABadTenantsFileIsRefusedWithItsReason) {
  struct Case {
    const char* json;
    const char* reason;
  } cases[] = {
      {"not json", "not valid JSON"},
      {R"({"tenants": [{"name": "a", "credential": "x", "wieght": 2}]})", "unknown key 'wieght'"},
      {R"({"tenants": [{"name": "a"}]})", "no credential"},
      {R"({"tenants": [{"name": "a", "credential": "x", "weight": -1}]})", "weight"},
      {R"({"tenants": [{"name": "a", "credential": "x"}, {"name": "a", "credential": "y"}]})", "listed twice"},
      {R"({"tenants": {"name": "a"}})", "expected"},
  };
  for (const Case& c : cases) {
    TenantsFile file(c.json);
    auto ctx = Context::open(with_file(file.path));
    ASSERT_FALSE(ctx) << c.json;
    EXPECT_EQ(ctx.status().code(), Errc::invalid_argument);
    EXPECT_NE(ctx.status().message().find(c.reason), std::string::npos) << ctx.status().message();
  }
  auto absent = Context::open(with_file("/nonexistent/tenants.json"));
  EXPECT_FALSE(absent);
  // A FIFO (nobody writing) or a directory is refused at once, not waited on.
  char dir[] = "/tmp/stellar-tenants-dir-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string fifo = std::string(dir) + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(Context::open(with_file(fifo)).status().code(), Errc::invalid_argument);
  EXPECT_EQ(Context::open(with_file(dir)).status().code(), Errc::invalid_argument);
  std::remove(fifo.c_str());
  ::rmdir(dir);
  // Larger than 1 MiB.
  TenantsFile big(std::string(2 << 20, ' ') + two_tenants);
  auto too_big = Context::open(with_file(big.path));
  ASSERT_FALSE(too_big);
  EXPECT_NE(too_big.status().message().find("1 MiB"), std::string::npos);
}

TEST(Tenants, QuotasRefuseWithResourceExhaustedAndFreeAgain) {
  auto ctx = Context::open({}).value();
  TenantOptions o;
  o.max_qps = 2;
  o.max_registered_bytes = 8192;
  o.max_receive_wrs = 3;
  ASSERT_TRUE(ctx->create_tenant("quota", o).ok());
  auto pd = ctx->allocate_pd("quota").value();
  QpInitAttributes attr;
  attr.send_cq = attr.recv_cq = ctx->create_cq(64).value();
  auto q1 = pd->create_qp(attr).value();
  auto q2 = pd->create_qp(attr).value();
  auto q3 = pd->create_qp(attr);
  ASSERT_FALSE(q3);
  EXPECT_EQ(q3.status().code(), Errc::resource_exhausted);
  q2.reset();  // a destroyed QP gives its place back
  q2 = pd->create_qp(attr).value();

  std::vector<uint8_t> memory(3 * 4096);
  auto m1 = pd->register_memory(memory.data(), 4096, access_local_write).value();
  auto m2 = pd->register_memory(memory.data() + 4096, 4096, access_local_write).value();
  auto m3 = pd->register_memory(memory.data() + 8192, 1, access_local_write);
  ASSERT_FALSE(m3);
  EXPECT_EQ(m3.status().code(), Errc::resource_exhausted);
  m2.reset();
  auto again = pd->register_memory(memory.data() + 8192, 4096, access_local_write);
  ASSERT_TRUE(again) << again.status().to_string();

  ASSERT_TRUE(q1->modify(QpModify{QpState::init}).ok());
  ASSERT_TRUE(q2->modify(QpModify{QpState::init}).ok());
  Sge s{reinterpret_cast<uint64_t>(memory.data()), 64, m1->lkey()};
  RecvWr r;
  r.sg_list = {&s, 1};
  ASSERT_TRUE(q1->post_recv(r).ok());
  ASSERT_TRUE(q1->post_recv(r).ok());
  ASSERT_TRUE(q2->post_recv(r).ok());
  const Status over = q2->post_recv(r);  // the quota is the tenant's, over both QPs
  EXPECT_EQ(over.code(), Errc::resource_exhausted) << over.to_string();

  // The default tenant has no quota and is untouched by quota's.
  auto other = ctx->allocate_pd().value();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(other->create_qp(attr));
  const auto counters = ctx->tenant_counters();
  for (const TenantCounters& t : counters) {
    if (t.tenant != "quota") continue;
    EXPECT_EQ(t.quota_refusals, 3u);
    EXPECT_EQ(t.qps, 2u);
    EXPECT_EQ(t.registered_bytes, 8192u);
    EXPECT_EQ(t.receive_wrs, 3u);
  }
}

namespace {

// Connects `qp` (stellar mode) to a plain UDP socket standing in for a peer,
// sends one WRITE and returns the TOS byte of the datagram that arrived.
int tos_of_first_datagram(Mode mode, const std::optional<JobHints>& hints, const ContextOptions& base = {}) {
  const int peer = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(peer, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1;
  socklen_t n = sizeof a;
  ::getsockname(peer, reinterpret_cast<sockaddr*>(&a), &n);
  const int on = 1;
  ::setsockopt(peer, IPPROTO_IP, IP_RECVTOS, &on, sizeof on);

  ContextOptions o = base;
  o.mode = mode;
  auto ctx = Context::open(o).value();
  auto pd = ctx->allocate_pd().value();
  QpInitAttributes attr;
  attr.send_cq = attr.recv_cq = ctx->create_cq(16).value();
  attr.hints = hints;
  auto qp = pd->create_qp(attr).value();
  std::vector<uint8_t> source(64, 7);
  auto mr = pd->register_memory(source.data(), source.size(), access_local_write).value();
  QpModify m{QpState::init};
  if (!qp->modify(m).ok()) return -2;
  m.state = QpState::rtr;
  m.remote.address = "127.0.0.1";
  m.remote.udp_port = ntohs(a.sin_port);
  m.remote.qp_num = 0x1234;
  m.remote.mode = mode;
  m.remote.token = mode == Mode::stellar ? 0x1122334455667788ull : 0;
  if (Status st = qp->modify(m); !st.ok()) return -3;
  m.state = QpState::rts;
  if (!qp->modify(m).ok()) return -4;
  Sge s{reinterpret_cast<uint64_t>(source.data()), 64, mr->lkey()};
  SendWr wr;
  wr.opcode = WrOpcode::rdma_write;
  wr.sg_list = {&s, 1};
  wr.remote_addr = 0x1000;
  wr.rkey = 0x99;
  if (!qp->post_send(wr).ok()) return -5;
  int tos = -6;
  for (int i = 0; i < 200 && tos < 0; ++i) {
    ctx->progress();
    pollfd p{peer, POLLIN, 0};
    if (::poll(&p, 1, 5) != 1) continue;
    uint8_t buffer[9000];
    char control[64];
    iovec v{buffer, sizeof buffer};
    msghdr h{};
    h.msg_iov = &v;
    h.msg_iovlen = 1;
    h.msg_control = control;
    h.msg_controllen = sizeof control;
    if (::recvmsg(peer, &h, 0) < 0) continue;
    for (cmsghdr* c = CMSG_FIRSTHDR(&h); c; c = CMSG_NXTHDR(&h, c))
      if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS) tos = *CMSG_DATA(c);
  }
  ::close(peer);
  return tos;
}

JobHints kind(TrafficKind k) {
  JobHints h;
  h.kind = k;
  return h;
}

}  // namespace

TEST(Tenants, PacketsCarryTheirTrafficClassDscp) {
  // stellar mode: DSCP << 2 | ECT(0).
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, std::nullopt), 0x02);                      // class 0, DSCP 0
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, kind(TrafficKind::control)), 48 << 2 | 2);  // class 7, CS6
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, kind(TrafficKind::gradient_allreduce)), 32 << 2 | 2);
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, kind(TrafficKind::checkpoint)), 8 << 2 | 2);
  JobHints explicit_priority = kind(TrafficKind::checkpoint);
  explicit_priority.priority = 5;
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, explicit_priority), 40 << 2 | 2);
  // roce mode: no ECN bits.
  EXPECT_EQ(tos_of_first_datagram(Mode::roce, kind(TrafficKind::parameter_fetch)), 24 << 2);
  // The mapping is configurable (as NCCL_IB_TC): class 4 to DSCP 26 (AF31).
  ContextOptions o;
  o.class_dscp[4] = 26;
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, kind(TrafficKind::all_to_all), o), 26 << 2 | 2);
  // And the context's hints apply where a QP gives none.
  o.hints = kind(TrafficKind::control);
  EXPECT_EQ(tos_of_first_datagram(Mode::stellar, std::nullopt, o), 48 << 2 | 2);
}

TEST(Tenants, JobHintsParse) {
  auto h = JobHints::parse("job=llama,kind=reduce-scatter,priority=5,weight=3,step_ms=120,bytes_per_step=1000000,deadline_ms=80");
  ASSERT_TRUE(h) << h.status().to_string();
  EXPECT_EQ(h->job, "llama");
  EXPECT_EQ(h->kind, TrafficKind::gradient_reduce_scatter);
  EXPECT_EQ(h->traffic_class(), 5);
  EXPECT_EQ(h->weight, 3u);
  EXPECT_EQ(h->step_period, 120ms);
  EXPECT_EQ(h->bytes_per_step, 1000000u);
  EXPECT_EQ(h->deadline, 80ms);
  EXPECT_EQ(JobHints::parse("checkpoint")->traffic_class(), 1);
  EXPECT_EQ(JobHints::parse("control")->traffic_class(), 7);
  for (const char* bad : {"kind=gossip", "priority=8", "weight=0", "colour=blue", "step_ms=-1", "priority",
                          "bytes_per_step=99999999999999999999", "weight=", "job=a,priority=1x"})
    EXPECT_EQ(JobHints::parse(bad).status().code(), Errc::invalid_argument) << bad;
}

namespace {

// One tenant's stream: a QP of `tenant` on A writing into B.
struct Stream {
  std::shared_ptr<ProtectionDomain> pd_a, pd_b;
  std::shared_ptr<CompletionQueue> cq_a, cq_b;
  std::shared_ptr<QueuePair> qp_a, qp_b;
  std::vector<uint8_t> source, target;
  std::unique_ptr<MemoryRegion> smr, tmr;
  uint32_t outstanding = 0;
  uint64_t completed_bytes = 0;
};

void connect_stream(Context& a, Context& b, const std::string& tenant, Stream& s, const JobHints& hints) {
  s.pd_a = a.allocate_pd(tenant).value();
  s.pd_b = b.allocate_pd(tenant).value();
  s.cq_a = a.create_cq(256).value();
  s.cq_b = b.create_cq(256).value();
  QpInitAttributes attr;
  attr.send_cq = attr.recv_cq = s.cq_a;
  attr.hints = hints;
  s.qp_a = s.pd_a->create_qp(attr).value();
  attr.send_cq = attr.recv_cq = s.cq_b;
  s.qp_b = s.pd_b->create_qp(attr).value();
  s.source.assign(64 << 10, 1);
  s.target.assign(64 << 10, 0);
  s.smr = s.pd_a->register_memory(s.source.data(), s.source.size(), access_local_write).value();
  s.tmr = s.pd_b->register_memory(s.target.data(), s.target.size(), access_local_write | access_remote_write).value();
  QpModify m{QpState::init};
  ASSERT_TRUE(s.qp_a->modify(m).ok());
  ASSERT_TRUE(s.qp_b->modify(m).ok());
  m.state = QpState::rtr;
  m.remote = s.qp_b->local_endpoint();
  ASSERT_TRUE(s.qp_a->modify(m).ok());
  m.remote = s.qp_a->local_endpoint();
  ASSERT_TRUE(s.qp_b->modify(m).ok());
  m.state = QpState::rts;
  ASSERT_TRUE(s.qp_a->modify(m).ok());
  ASSERT_TRUE(s.qp_b->modify(m).ok());
}

// Keeps `depth` 64 KiB WRITEs outstanding on the stream; returns false on an
// error completion.
bool pump(Stream& s, uint32_t depth) {
  WorkCompletion wc[16];
  const int n = s.cq_a->poll(wc);
  for (int i = 0; i < n; ++i) {
    if (wc[i].status != WcStatus::success) return false;
    --s.outstanding;
    s.completed_bytes += s.source.size();
  }
  while (s.outstanding < depth) {
    Sge sge{reinterpret_cast<uint64_t>(s.source.data()), uint32_t(s.source.size()), s.smr->lkey()};
    SendWr wr;
    wr.opcode = WrOpcode::rdma_write;
    wr.sg_list = {&sge, 1};
    wr.remote_addr = s.tmr->addr();
    wr.rkey = s.tmr->rkey();
    if (!s.qp_a->post_send(wr).ok()) return false;
    ++s.outstanding;
  }
  return true;
}

}  // namespace

TEST(Tenants, TheSchedulerSharesItsRateByTenantWeight) {
  // A's transmissions are shaped to 12 MB/s: the scheduler's rate, not the
  // CPU or loopback, is the limit (a sanitizer build moves ~30 MB/s here), so
  // each tenant's share is its weight's.
  constexpr double rate = 12e6;
  ContextOptions oa;
  oa.tx_rate_bytes_per_s = uint64_t(rate);
  // Congestion control off: the streams stay backlogged at the scheduler
  // (a window-limited flow is not, and would not claim its share).
  oa.congestion_control = CongestionControl::none;
  oa.progress = ProgressMode::thread;
  oa.wait = WaitPolicy::adaptive;
  ContextOptions ob;
  ob.progress = ProgressMode::thread;
  ob.wait = WaitPolicy::adaptive;
  auto a = Context::open(oa).value();
  auto b = Context::open(ob).value();
  const std::pair<const char*, uint32_t> tenants[] = {{"one", 1}, {"three", 3}};
  uint16_t pkey = 0x8100;
  Stream streams[2];
  for (int i = 0; i < 2; ++i) {
    TenantOptions t;
    t.pkey = pkey++;
    t.weight = tenants[i].second;
    ASSERT_TRUE(a->create_tenant(tenants[i].first, t).ok());
    t.weight = 1;
    ASSERT_TRUE(b->create_tenant(tenants[i].first, t).ok());
    connect_stream(*a, *b, tenants[i].first, streams[i], JobHints{"train", TrafficKind::gradient_allreduce});
  }
  // What each tenant has sent (the engines' own count: no completion lag).
  auto sent_by = [&] {
    std::map<std::string, double> m;
    for (const TenantCounters& t : a->tenant_counters())
      for (const TrafficCounters& c : t.traffic) m[t.tenant] += double(c.tx_bytes);
    return m;
  };
  const auto start = std::chrono::steady_clock::now();
  std::map<std::string, double> at_half;
  bool marked = false;
  while (std::chrono::steady_clock::now() - start < 2000ms) {
    for (Stream& s : streams) ASSERT_TRUE(pump(s, 16));
    if (!marked && std::chrono::steady_clock::now() - start >= 500ms) {
      at_half = sent_by();  // shares measured over the last 1.5 s, both backlogged
      marked = true;
    }
    std::this_thread::sleep_for(200us);
  }
  const auto end = sent_by();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double one = end.at("one") - at_half["one"], three = end.at("three") - at_half["three"];
  ASSERT_GT(one, 0);
  std::printf("shares over 1.5 s: one %.0f B, three %.0f B, ratio %.2f (want 3)\n", one, three, three / one);
  EXPECT_NEAR(three / one, 3.0, 0.3) << "one " << one << " three " << three;
  // Shaped: A never beats its rate (plus the initial burst), and the rate was the limit.
  const double total = end.at("one") + end.at("three");
  EXPECT_LE(total, rate * elapsed * 1.05 + 1e6);
  EXPECT_GT(total, rate * elapsed * 0.6);
  for (const TenantCounters& t : a->tenant_counters())
    for (const TrafficCounters& c : t.traffic) {
      EXPECT_EQ(c.job, "train");
      EXPECT_EQ(c.traffic_class, 4);
      EXPECT_GT(c.scheduler_grants, 0u);
    }
}

TEST(Tenants, WeightsAndRateLimitsNeedTheInProcessEngineHost) {
  // Run in both placements (ctest tenants_in_daemon runs it under the daemon).
  auto ctx = Context::open({}).value();
  TenantOptions weighted;
  weighted.weight = 2;
  TenantOptions limited;
  limited.rate_bytes_per_s = 1'000'000;
  TenantOptions quotas_only;
  quotas_only.max_qps = 1;
  const bool daemon = ctx->options().progress == ProgressMode::daemon;
  EXPECT_EQ(ctx->create_tenant("weighted", weighted).code(), daemon ? Errc::unsupported : Errc::ok);
  EXPECT_EQ(ctx->create_tenant("limited", limited).code(), daemon ? Errc::unsupported : Errc::ok);
  EXPECT_TRUE(ctx->create_tenant("quotas", quotas_only).ok());  // checked on the application side everywhere
  ContextOptions rate;
  rate.tx_rate_bytes_per_s = 1'000'000;
  EXPECT_EQ(Context::open(rate).status().code(), daemon ? Errc::unsupported : Errc::ok);
}

// ---- the engine daemon with a tenants file (stellar-engined --tenants) ----

namespace {

const char* daemon_tenants = R"({"tenants": [
  {"name": "one", "credential": "one-secret", "weight": 1, "pkey": 36865},
  {"name": "three", "credential": "three-secret", "weight": 3, "pkey": 36867},
  {"name": "small", "credential": "small-secret", "max_qps": 1, "max_registered_bytes": 8192},
  {"name": "spare", "credential": "spare-secret"}
]})";
// The keys the daemon gives the tenants without one: from 0x8001 in name order.
constexpr uint16_t small_pkey = 0x8001, spare_pkey = 0x8002;

// An in-process context (the daemon's tenants' peers) with `tenant` on `pkey`.
std::shared_ptr<Context> peer_context(const std::string& tenant, uint16_t pkey) {
  ContextOptions o;
  o.progress = ProgressMode::thread;
  o.wait = WaitPolicy::adaptive;
  auto c = Context::open(o).value();
  TenantOptions t;
  t.pkey = pkey;
  EXPECT_TRUE(c->create_tenant(tenant, t).ok());
  return c;
}

ContextOptions in_daemon(const test::Engined& daemon, const std::string& tenant, const std::string& credential) {
  ContextOptions o = daemon.options();
  o.tenant = tenant;
  o.credential = credential;
  return o;
}

// A QP of `a` connected to one of `b` (both in tenant `pd_*`'s partition):
// the status of the first step that failed.
Status connect_qps(ProtectionDomain& pd_a, ProtectionDomain& pd_b, std::shared_ptr<CompletionQueue> cq_a,
                   std::shared_ptr<CompletionQueue> cq_b, std::shared_ptr<QueuePair>& qp_a, std::shared_ptr<QueuePair>& qp_b) {
  QpInitAttributes attr;
  attr.send_cq = attr.recv_cq = cq_a;
  auto qa = pd_a.create_qp(attr);
  if (!qa) return qa.status();
  attr.send_cq = attr.recv_cq = cq_b;
  auto qb = pd_b.create_qp(attr);
  if (!qb) return qb.status();
  qp_a = *qa, qp_b = *qb;
  QpModify m{QpState::init};
  if (Status st = qp_a->modify(m); !st.ok()) return st;
  if (Status st = qp_b->modify(m); !st.ok()) return st;
  m.state = QpState::rtr;
  m.remote = qp_a->local_endpoint();
  if (Status st = qp_b->modify(m); !st.ok()) return st;
  m.remote = qp_b->local_endpoint();
  return qp_a->modify(m);  // the daemon attaches the engine here
}

}  // namespace

TEST(TenantsInDaemon, TheDaemonServesOnlyItsTenantsWithTheirCredentials) {
  TenantsFile file(daemon_tenants);
  test::Engined daemon({"--tenants", file.path});
  auto good = Context::open(in_daemon(daemon, "one", "one-secret"));
  ASSERT_TRUE(good) << good.status().to_string();
  EXPECT_TRUE((*good)->allocate_pd().ok());
  for (auto [tenant, credential] : {std::pair<std::string, std::string>{"one", "three-secret"}, {"one", ""},
                                    {"nobody", "one-secret"}, {"", ""}}) {
    auto refused = Context::open(in_daemon(daemon, tenant, credential));
    ASSERT_FALSE(refused) << "'" << tenant << "' with '" << credential << "' was let in";
    EXPECT_EQ(refused.status().code(), Errc::permission_denied) << refused.status().to_string();
    EXPECT_NE(refused.status().message().find("not one of the daemon's tenants"), std::string::npos) << refused.status().to_string();
  }
  // Refused, not broken: the daemon still serves its tenants.
  EXPECT_TRUE(Context::open(in_daemon(daemon, "three", "three-secret")));
  EXPECT_NE(daemon.log().find("refused as tenant 'nobody'"), std::string::npos) << daemon.log();
  EXPECT_TRUE(daemon.alive());
}

TEST(TenantsInDaemon, EachTenantHasTheDaemonsPartitionKey) {
  // The daemon's file assigns the keys (listed ones, then from 0x8001 in
  // name order) and tells each application its own; a QP of another
  // partition is refused at attach, so that tenants cannot share one.
  TenantsFile file(daemon_tenants);
  test::Engined daemon({"--tenants", file.path});
  const std::tuple<const char*, const char*, uint16_t> cases[] = {
      {"one", "one-secret", 36865}, {"small", "small-secret", small_pkey}, {"spare", "spare-secret", spare_pkey}};
  for (auto [tenant, credential, pkey] : cases) {
    auto ctx = Context::open(in_daemon(daemon, tenant, credential)).value();
    auto pd = ctx->allocate_pd().value();
    auto cq = ctx->create_cq(16).value();
    QpInitAttributes attr;
    attr.send_cq = attr.recv_cq = cq;
    EXPECT_EQ(pd->create_qp(attr).value()->local_endpoint().pkey, pkey) << tenant;
  }
  // An application that gives itself another tenant (its own partition) is
  // refused by the daemon when the QP attaches.
  auto ctx = Context::open(in_daemon(daemon, "spare", "spare-secret")).value();
  TenantOptions other;
  other.pkey = 36867;  // tenant three's
  ASSERT_TRUE(ctx->create_tenant("impostor", other).ok());
  auto peer = peer_context("three", 36867);
  std::shared_ptr<QueuePair> a, b;
  Status st = connect_qps(*ctx->allocate_pd("impostor").value(), *peer->allocate_pd("three").value(), ctx->create_cq(16).value(),
                          peer->create_cq(16).value(), a, b);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("is not tenant 'spare''s"), std::string::npos) << st.to_string();
  EXPECT_TRUE(daemon.alive());
}

TEST(TenantsInDaemon, ADeadDaemonAfterAQuotaRefusalIsNotReportedAsAQuota) {
  TenantsFile file(daemon_tenants);
  test::Engined daemon({"--tenants", file.path});
  auto ctx = Context::open(in_daemon(daemon, "small", "small-secret")).value();
  auto pd = ctx->allocate_pd().value();
  static uint8_t memory[16384];
  auto over = pd->register_memory(memory, 16384, access_local_write);
  ASSERT_FALSE(over);
  EXPECT_EQ(over.status().code(), Errc::resource_exhausted);
  daemon.stop(SIGKILL);
  auto gone = pd->register_memory(memory, 4096, access_local_write);
  ASSERT_FALSE(gone);
  EXPECT_NE(gone.status().code(), Errc::resource_exhausted) << gone.status().to_string();
}

TEST(TenantsInDaemon, QuotasHoldOverAllTheTenantsApplications) {
  TenantsFile file(daemon_tenants);
  test::Engined daemon({"--tenants", file.path});
  // Two applications of tenant "small" (its quotas: 1 QP, 8 KiB registered),
  // which know nothing of them: the daemon holds the file.
  auto first = Context::open(in_daemon(daemon, "small", "small-secret")).value();
  auto second = Context::open(in_daemon(daemon, "small", "small-secret")).value();
  auto peer = peer_context("small", small_pkey);
  auto pd1 = first->allocate_pd().value(), pd2 = second->allocate_pd().value(), pdp = peer->allocate_pd("small").value();
  static uint8_t memory[3][8192];
  auto mr1 = pd1->register_memory(memory[0], 8192, access_local_write);
  ASSERT_TRUE(mr1) << mr1.status().to_string();
  auto mr2 = pd2->register_memory(memory[1], 4096, access_local_write);
  ASSERT_FALSE(mr2);
  EXPECT_EQ(mr2.status().code(), Errc::resource_exhausted) << mr2.status().to_string();
  EXPECT_NE(mr2.status().message().find("quota of 8192"), std::string::npos) << mr2.status().to_string();
  mr1->reset();  // the tenant's room comes back
  mr2 = pd2->register_memory(memory[1], 4096, access_local_write);
  EXPECT_TRUE(mr2) << mr2.status().to_string();

  auto cq = [](Context& c) { return c.create_cq(16).value(); };
  std::shared_ptr<QueuePair> a1, p1, a2, p2;
  ASSERT_TRUE(connect_qps(*pd1, *pdp, cq(*first), cq(*peer), a1, p1).ok());
  Status over = connect_qps(*pd2, *pdp, cq(*second), cq(*peer), a2, p2);
  EXPECT_EQ(over.code(), Errc::resource_exhausted) << over.to_string();
  EXPECT_NE(over.message().find("QPs"), std::string::npos) << over.to_string();
  uint64_t refusals = 0;
  for (const TenantCounters& t : second->tenant_counters()) refusals += t.quota_refusals;
  EXPECT_EQ(refusals, 2u);  // the registration and the QP
  // The first application goes (its QP with it): the second may connect.
  a1.reset(), mr1->reset(), pd1.reset(), first.reset();
  Status again;
  for (int i = 0; i < 200; ++i) {
    a2.reset(), p2.reset();
    again = connect_qps(*pd2, *pdp, cq(*second), cq(*peer), a2, p2);
    if (again.code() != Errc::resource_exhausted) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(again.ok()) << again.to_string();
  EXPECT_TRUE(daemon.alive());
}

TEST(TenantsInDaemon, TheDaemonSharesItsRateByTenantWeightAcrossApplications) {
  // Two applications, tenants "one" (weight 1) and "three" (weight 3), each
  // streaming WRITEs through one daemon shaped to 12 MB/s: the shard's
  // scheduler orders both applications' packets, so each tenant gets its
  // weight's share (each application alone would take all of it).
  constexpr double rate = 12e6;
  TenantsFile file(daemon_tenants);
  // One shard (the default, said here because the test depends on it):
  // a tenant's contexts share one, different tenants may not.
  test::Engined daemon({"--tenants", file.path, "--tx-rate", "12000000", "--cores", "1"});
  const std::tuple<const char*, const char*, uint16_t> tenants[] = {{"one", "one-secret", 36865}, {"three", "three-secret", 36867}};
  std::shared_ptr<Context> senders[2], receivers[2];
  Stream streams[2];
  for (int i = 0; i < 2; ++i) {
    auto [tenant, credential, pkey] = tenants[i];
    ContextOptions o = in_daemon(daemon, tenant, credential);
    o.congestion_control = CongestionControl::none;  // backlogged at the scheduler, not window-limited
    senders[i] = Context::open(o).value();
    receivers[i] = peer_context(tenant, pkey);
    connect_stream(*senders[i], *receivers[i], tenant, streams[i], JobHints{"train", TrafficKind::gradient_allreduce});
  }
  auto sent = [&](int i) { return double(senders[i]->counters().tx_bytes); };
  const auto start = std::chrono::steady_clock::now();
  double at_half[2] = {0, 0};
  bool marked = false;
  while (std::chrono::steady_clock::now() - start < 2000ms) {
    for (Stream& s : streams) ASSERT_TRUE(pump(s, 16));
    if (!marked && std::chrono::steady_clock::now() - start >= 500ms) {
      at_half[0] = sent(0), at_half[1] = sent(1);
      marked = true;
    }
    std::this_thread::sleep_for(200us);
  }
  const double end[2] = {sent(0), sent(1)};
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double one = end[0] - at_half[0], three = end[1] - at_half[1];
  ASSERT_GT(one, 0);
  std::printf("daemon shares over 1.5 s: one %.0f B, three %.0f B, ratio %.2f (want 3)\n", one, three, three / one);
  EXPECT_NEAR(three / one, 3.0, 0.3) << "one " << one << " three " << three;
  EXPECT_LE(end[0] + end[1], rate * elapsed * 1.05 + 1e6);
  EXPECT_GT(end[0] + end[1], rate * elapsed * 0.6);
  // The daemon reports each context's (job, class) rows, as in-process.
  for (int i = 0; i < 2; ++i) {
    const auto counters = senders[i]->tenant_counters();
    auto mine = std::find_if(counters.begin(), counters.end(), [&](const TenantCounters& t) { return t.tenant == std::get<0>(tenants[i]); });
    ASSERT_NE(mine, counters.end());
    ASSERT_EQ(mine->traffic.size(), 1u);
    const TrafficCounters& c = mine->traffic[0];
    EXPECT_EQ(c.job, "train");
    EXPECT_EQ(c.traffic_class, 4);
    EXPECT_EQ(c.qps, 1u);
    EXPECT_GT(c.tx_bytes, 0u);
    EXPECT_GT(c.scheduler_grants, 0u);
  }
}

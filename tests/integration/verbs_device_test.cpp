// The verbs provider on a real RDMA device (a ConnectX NIC, or soft-RoCE:
// `rdma link add rxe0 type rxe netdev eth0`): two RC QPs of one context
// connected through stellar::cm over the GID's own IPv4 address, then every
// opcode, SGLs, inline, unsignaled sends, an error completion and the CQ's
// notification fd. Every test skips cleanly where no device exists.
//
// STELLAR_VERBS_DEVICE / STELLAR_VERBS_ADDRESS pick the device and address
// (default: the first usable GID).
#include <gtest/gtest.h>
#include <poll.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "stellar/stellar.hpp"

using namespace stellar;
using namespace std::chrono_literals;

namespace {

constexpr uint32_t all_access = access_local_write | access_remote_write | access_remote_read | access_remote_atomic;

struct Pair {
  std::shared_ptr<Context> ctx;
  std::shared_ptr<ProtectionDomain> pd;
  std::shared_ptr<CompletionQueue> cq_a, cq_b;
  std::shared_ptr<QueuePair> a, b;
  std::vector<uint8_t> mem_a = std::vector<uint8_t>(1 << 20), mem_b = std::vector<uint8_t>(1 << 20);
  std::unique_ptr<MemoryRegion> mr_a, mr_b;
  // rdma_cm: the connection lives as long as these do.
  std::unique_ptr<cm::ConnectionRequest> request;
  cm::Connected connected;
};

ContextOptions verbs_options() {
  ContextOptions o;
  o.provider = Provider::verbs;
  if (const char* d = std::getenv("STELLAR_VERBS_DEVICE")) o.device = d;
  if (const char* a = std::getenv("STELLAR_VERBS_ADDRESS")) o.bind_address = a;
  return o;
}

// One QP on the verbs provider, in RESET; nullopt (the test skips) without a device.
struct LoneQp {
  std::shared_ptr<Context> ctx;
  std::shared_ptr<ProtectionDomain> pd;
  std::shared_ptr<CompletionQueue> cq;
  std::shared_ptr<QueuePair> qp;
};
Result<LoneQp> lone_qp() {
  auto ctx = Context::open(verbs_options());
  if (!ctx) return ctx.status();
  LoneQp l;
  l.ctx = *ctx;
  l.pd = l.ctx->allocate_pd().value();
  l.cq = l.ctx->create_cq(16).value();
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = l.cq;
  l.qp = l.pd->create_qp(qa).value();
  return l;
}

// Opens the verbs provider and connects two QPs, or says why it cannot.
Status make_pair(Pair& p, cm::Method method = cm::Method::tcp) {
  auto ctx = Context::open(verbs_options());
  if (!ctx) return ctx.status();
  p.ctx = *ctx;
  p.pd = p.ctx->allocate_pd().value();
  p.cq_a = p.ctx->create_cq(256).value();
  p.cq_b = p.ctx->create_cq(256).value();
  p.mr_a = std::move(p.pd->register_memory(p.mem_a.data(), p.mem_a.size(), all_access).value());
  p.mr_b = std::move(p.pd->register_memory(p.mem_b.data(), p.mem_b.size(), all_access).value());
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = p.cq_a;
  p.a = p.pd->create_qp(qa).value();
  qa.send_cq = qa.recv_cq = p.cq_b;
  p.b = p.pd->create_qp(qa).value();
  const std::string address = p.ctx->local_address();
  auto listener = cm::Listener::listen(address, 0, method);
  if (!listener) return listener.status();
  Status accepted;
  const std::vector<uint8_t> hello = {'h', 'i'}, welcome = {'o', 'k', '!'};
  std::thread server([&] {
    auto request = (*listener)->get_request(10s);
    if (!request) {
      accepted = request.status();
      return;
    }
    p.request = std::move(*request);
    accepted = p.request->private_data() == hello ? p.request->accept(*p.b, welcome) : Status(Errc::protocol_error, "private data lost");
  });
  cm::ConnectOptions options;
  options.method = method;
  options.private_data = hello;
  auto connected = cm::connect(address, (*listener)->port(), *p.a, options);
  server.join();
  if (!connected) return connected.status();
  if (connected->private_data != welcome) return Status(Errc::protocol_error, "the acceptor's private data was lost");
  p.connected = std::move(*connected);
  return accepted;
}

std::vector<WorkCompletion> collect(CompletionQueue& cq, size_t count) {
  std::vector<WorkCompletion> all;
  WorkCompletion wc[16];
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (all.size() < count && std::chrono::steady_clock::now() < deadline) {
    const int n = cq.poll(wc);
    all.insert(all.end(), wc, wc + n);
  }
  return all;
}

class VerbsDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = make_pair(p);
    if (s.code() == Errc::no_device) GTEST_SKIP() << s.message();
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  Sge sge_a(size_t offset, uint32_t length) { return Sge{reinterpret_cast<uint64_t>(p.mem_a.data() + offset), length, p.mr_a->lkey()}; }
  Sge sge_b(size_t offset, uint32_t length) { return Sge{reinterpret_cast<uint64_t>(p.mem_b.data() + offset), length, p.mr_b->lkey()}; }
  uint64_t remote_b(size_t offset) const { return p.mr_b->addr() + offset; }
  Pair p;
};

// The same pair connected through librdmacm (cm::Method::rdma_cm).
class RdmaCmDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = make_pair(p, cm::Method::rdma_cm);
    if (s.code() == Errc::no_device) GTEST_SKIP() << s.message();
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  Pair p;
};

TEST_F(RdmaCmDevice, ConnectsAndCarriesAWriteAndARead) {
  EXPECT_EQ(p.a->state(), QpState::rts);
  EXPECT_EQ(p.b->state(), QpState::rts);
  EXPECT_TRUE(p.connected.connection) << "the rdma_cm id is kept with the connection";
  EXPECT_EQ(p.connected.remote.qp_num, p.b->qp_num());
  for (size_t i = 0; i < 4096; ++i) p.mem_a[i] = uint8_t(i * 13);
  Sge s{reinterpret_cast<uint64_t>(p.mem_a.data()), 4096, p.mr_a->lkey()};
  SendWr w;
  w.wr_id = 1;
  w.opcode = WrOpcode::rdma_write;
  w.sg_list = {&s, 1};
  w.remote_addr = p.mr_b->addr();
  w.rkey = p.mr_b->rkey();
  ASSERT_TRUE(p.a->post_send(w).ok());
  auto wc = collect(*p.cq_a, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, WcStatus::success) << describe(wc[0]);
  EXPECT_EQ(0, std::memcmp(p.mem_a.data(), p.mem_b.data(), 4096));
  Sge back{reinterpret_cast<uint64_t>(p.mem_a.data() + 8192), 4096, p.mr_a->lkey()};
  w.wr_id = 2;
  w.opcode = WrOpcode::rdma_read;
  w.sg_list = {&back, 1};
  ASSERT_TRUE(p.a->post_send(w).ok());
  wc = collect(*p.cq_a, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, WcStatus::success) << describe(wc[0]);
  EXPECT_EQ(0, std::memcmp(p.mem_a.data() + 8192, p.mem_b.data(), 4096));
}

TEST(RdmaCmDeviceReject, TheReasonReachesTheConnector) {
  auto lone = lone_qp();
  if (!lone && lone.status().code() == Errc::no_device) GTEST_SKIP() << lone.status().message();
  ASSERT_TRUE(lone) << lone.status().to_string();
  auto& ctx = lone->ctx;
  auto& qp = lone->qp;
  auto listener = cm::Listener::listen(ctx->local_address(), 0, cm::Method::rdma_cm);
  if (!listener && listener.status().code() == Errc::no_device) GTEST_SKIP() << listener.status().message();
  ASSERT_TRUE(listener) << listener.status().to_string();
  std::thread server([&] {
    auto request = (*listener)->get_request(10s);
    if (request) (void)(*request)->reject("no room for you");
  });
  cm::ConnectOptions options;
  options.method = cm::Method::rdma_cm;
  auto connected = cm::connect(ctx->local_address(), (*listener)->port(), *qp, options);
  server.join();
  ASSERT_FALSE(connected);
  EXPECT_EQ(connected.status().code(), Errc::connection_refused);
  EXPECT_NE(connected.status().message().find("no room for you"), std::string::npos) << connected.status().to_string();
}

TEST_F(VerbsDevice, EndpointCarriesGidAndQpsAreInRts) {
  const QpEndpoint e = p.a->local_endpoint();
  EXPECT_FALSE(e.gid.empty());
  EXPECT_EQ(e.mode, Mode::roce);
  EXPECT_EQ(p.a->state(), QpState::rts);
  EXPECT_EQ(p.b->state(), QpState::rts);
}

TEST_F(VerbsDevice, WriteReadAndAtomics) {
  for (size_t i = 0; i < 8192; ++i) p.mem_a[i] = uint8_t(i * 7);
  Sge s = sge_a(0, 8192);
  SendWr w;
  w.wr_id = 1;
  w.opcode = WrOpcode::rdma_write;
  w.sg_list = {&s, 1};
  w.remote_addr = remote_b(4096);
  w.rkey = p.mr_b->rkey();
  ASSERT_TRUE(p.a->post_send(w).ok());
  auto wc = collect(*p.cq_a, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, WcStatus::success) << describe(wc[0]);
  EXPECT_EQ(wc[0].opcode, WcOpcode::rdma_write);
  EXPECT_EQ(std::memcmp(p.mem_a.data(), p.mem_b.data() + 4096, 8192), 0);

  Sge back = sge_a(65536, 8192);
  SendWr r = w;
  r.wr_id = 2;
  r.opcode = WrOpcode::rdma_read;
  r.sg_list = {&back, 1};
  ASSERT_TRUE(p.a->post_send(r).ok());
  wc = collect(*p.cq_a, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].opcode, WcOpcode::rdma_read);
  EXPECT_EQ(std::memcmp(p.mem_a.data(), p.mem_a.data() + 65536, 8192), 0);

  uint64_t counter = 40;
  std::memcpy(p.mem_b.data() + 1024, &counter, 8);
  Sge old = sge_a(2048, 8);
  SendWr fa;
  fa.wr_id = 3;
  fa.opcode = WrOpcode::atomic_fetch_add;
  fa.sg_list = {&old, 1};
  fa.remote_addr = remote_b(1024);
  fa.rkey = p.mr_b->rkey();
  fa.compare_add = 2;
  ASSERT_TRUE(p.a->post_send(fa).ok());
  SendWr cs = fa;
  cs.wr_id = 4;
  cs.opcode = WrOpcode::atomic_cmp_swap;
  cs.compare_add = 42;
  cs.swap = 7;
  ASSERT_TRUE(p.a->post_send(cs).ok());
  wc = collect(*p.cq_a, 2);
  ASSERT_EQ(wc.size(), 2u);
  EXPECT_EQ(wc[0].opcode, WcOpcode::fetch_add);
  EXPECT_EQ(wc[1].opcode, WcOpcode::compare_swap);
  std::memcpy(&counter, p.mem_b.data() + 1024, 8);
  EXPECT_EQ(counter, 7u);
  std::memcpy(&counter, p.mem_a.data() + 2048, 8);
  EXPECT_EQ(counter, 42u);  // the compare-swap's old value
}

TEST_F(VerbsDevice, SendsWithImmediateSglInlineAndUnsignaled) {
  Sge landing = sge_b(0, 4096);
  ASSERT_TRUE(p.b->post_recv(RecvWr{10, {&landing, 1}}).ok());
  Sge landing2 = sge_b(8192, 4096);
  ASSERT_TRUE(p.b->post_recv(RecvWr{11, {&landing2, 1}}).ok());
  Sge landing3 = sge_b(16384, 64);
  ASSERT_TRUE(p.b->post_recv(RecvWr{12, {&landing3, 1}}).ok());
  std::memcpy(p.mem_a.data(), "hello ", 6);
  std::memcpy(p.mem_a.data() + 100, "world", 5);
  const Sge pieces[2] = {sge_a(0, 6), sge_a(100, 5)};
  SendWr s;
  s.wr_id = 20;
  s.opcode = WrOpcode::send_with_imm;
  s.imm_data = 0x12345678;
  s.sg_list = pieces;
  ASSERT_TRUE(p.a->post_send(s).ok());
  const char text[] = "inline bytes";
  Sge in{reinterpret_cast<uint64_t>(text), sizeof text, 0};
  SendWr i;
  i.wr_id = 21;
  i.opcode = WrOpcode::send;
  i.flags = send_inline;  // unsignaled: no completion on success
  i.sg_list = {&in, 1};
  ASSERT_TRUE(p.a->post_send(i).ok());
  Sge small = sge_a(0, 16);
  SendWr wi;
  wi.wr_id = 22;
  wi.opcode = WrOpcode::rdma_write_with_imm;
  wi.imm_data = 0xabcdef01;
  wi.sg_list = {&small, 1};
  wi.remote_addr = remote_b(32768);
  wi.rkey = p.mr_b->rkey();
  ASSERT_TRUE(p.a->post_send(wi).ok());
  auto sent = collect(*p.cq_a, 2);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].wr_id, 20u);
  EXPECT_EQ(sent[1].wr_id, 22u);  // 21 was unsignaled
  auto got = collect(*p.cq_b, 3);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].opcode, WcOpcode::recv);
  EXPECT_TRUE(got[0].has_imm);
  EXPECT_EQ(got[0].imm_data, 0x12345678u);
  EXPECT_EQ(got[0].byte_len, 11u);
  EXPECT_EQ(std::memcmp(p.mem_b.data(), "hello world", 11), 0);
  EXPECT_EQ(got[1].byte_len, sizeof text);
  EXPECT_EQ(std::memcmp(p.mem_b.data() + 8192, text, sizeof text), 0);
  EXPECT_EQ(got[2].opcode, WcOpcode::recv_rdma_with_imm);
  EXPECT_EQ(got[2].imm_data, 0xabcdef01u);
}

TEST_F(VerbsDevice, BadRkeyIsARemoteAccessErrorWithTheVerbsStatus) {
  Sge s = sge_a(0, 64);
  SendWr w;
  w.wr_id = 30;
  w.opcode = WrOpcode::rdma_write;
  w.sg_list = {&s, 1};
  w.remote_addr = remote_b(0);
  w.rkey = p.mr_b->rkey() ^ 0x5a5a00;
  ASSERT_TRUE(p.a->post_send(w).ok());
  auto wc = collect(*p.cq_a, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, WcStatus::remote_access_error);
  EXPECT_NE(describe(wc[0]).find("IBV_WC_REM_ACCESS_ERR"), std::string::npos) << describe(wc[0]);
  EXPECT_EQ(p.a->state(), QpState::error);
}

TEST_F(VerbsDevice, NotificationFdAndWait) {
  ASSERT_TRUE(p.cq_a->request_notify().ok());
  Sge s = sge_a(0, 64);
  SendWr w;
  w.opcode = WrOpcode::rdma_write;
  w.sg_list = {&s, 1};
  w.remote_addr = remote_b(0);
  w.rkey = p.mr_b->rkey();
  ASSERT_TRUE(p.a->post_send(w).ok());
  pollfd fd{p.cq_a->fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&fd, 1, 10000), 1);
  WorkCompletion wc[4];
  auto got = p.cq_a->wait(wc, 5s);
  ASSERT_TRUE(got) << got.status().to_string();
  EXPECT_EQ(*got, 1);
  EXPECT_EQ(p.cq_a->wait(wc, 10ms).status().code(), Errc::timeout);
}

TEST(VerbsDeviceMisuse, SoftEndpointIsRefused) {
  auto lone = lone_qp();
  if (!lone && lone.status().code() == Errc::no_device) GTEST_SKIP() << lone.status().message();
  ASSERT_TRUE(lone) << lone.status().to_string();
  auto& qp = lone->qp;
  QpModify m;
  m.state = QpState::init;
  ASSERT_TRUE(qp->modify(m).ok());
  m.state = QpState::rtr;
  m.remote.address = "127.0.0.1";  // a soft endpoint: no GID
  auto s = qp->modify(m);
  EXPECT_EQ(s.code(), Errc::invalid_argument);
  EXPECT_NE(s.message().find("no GID"), std::string::npos) << s.message();
  m.state = QpState::rts;
  EXPECT_EQ(qp->modify(m).code(), Errc::wrong_state);
}

}  // namespace

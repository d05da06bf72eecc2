// cm::Method::rdma_cm without an RDMA device: what can be checked here is
// that it refuses what it cannot do, clearly, before touching the network —
// a soft-provider QP, private data over the IB CM's limits, a bad address —
// and that with no RDMA device it fails at once saying so and naming the
// tcp method. The connection itself runs in stellar_verbs_device_tests
// (RdmaCmDevice.*) on a machine with a NIC or soft-RoCE.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include "core/providers.hpp"
#include "providers/verbs/rdma_cm.hpp"
#include "stellar/cm.hpp"
#include "stellar/verbs.hpp"

namespace {

using namespace stellar;
using namespace std::chrono_literals;

bool rdma_device_present() {
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list) ibv_free_device_list(list);
  return count > 0;
}

std::shared_ptr<QueuePair> soft_qp(std::shared_ptr<Context>& context) {
  context = Context::open().value();
  auto pd = context->allocate_pd().value();
  auto cq = context->create_cq(16).value();
  QpInitAttributes attributes;
  attributes.send_cq = attributes.recv_cq = cq;
  return pd->create_qp(attributes).value();
}

TEST(RdmaCm, MethodNames) {
  EXPECT_EQ(cm::method_from_string("tcp"), cm::Method::tcp);
  EXPECT_EQ(cm::method_from_string("rdma_cm"), cm::Method::rdma_cm);
  EXPECT_EQ(cm::method_from_string("rdmacm"), cm::Method::rdma_cm);
  EXPECT_FALSE(cm::method_from_string("udp"));
  EXPECT_STREQ(cm::to_string(cm::Method::rdma_cm), "rdma_cm");
  EXPECT_STREQ(cm::to_string(cm::Method::tcp), "tcp");
}

// The IB CM hands the receiver its whole fixed-size field (56 bytes of a
// REQ): the frame brings back exactly what was sent, and the sender's MTU
// (both sides must agree on it; nothing else in the CM exchange says it).
TEST(RdmaCm, PrivateDataComesBackExactlyFromAPaddedField) {
  using stellar::provider::verbs::rdma_cm_frame;
  using stellar::provider::verbs::rdma_cm_unframe;
  for (size_t n : {size_t(0), size_t(1), size_t(16), cm::rdma_cm_max_connect_data}) {
    std::vector<uint8_t> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = uint8_t(i * 29 + 1);
    std::vector<uint8_t> field = rdma_cm_frame(data, 1024);
    ASSERT_LE(field.size(), 56u);
    field.resize(56, 0);  // what rdma_cm reports for a REQ
    auto back = rdma_cm_unframe(field, "test");
    ASSERT_TRUE(back) << back.status().to_string();
    EXPECT_EQ(back->data, data);
    EXPECT_EQ(back->mtu, 1024u);
  }
  EXPECT_EQ(rdma_cm_unframe(rdma_cm_frame({}, 4096), "t")->mtu, 4096u);
  EXPECT_EQ(rdma_cm_unframe(rdma_cm_frame({}, 9000), "t")->mtu, 4096u) << "the largest IB MTU at most";
  EXPECT_EQ(rdma_cm_unframe(rdma_cm_frame({}, 1500), "t")->mtu, 1024u) << "the largest IB MTU that fits";
  std::vector<uint8_t> broken(56, 0);
  broken[0] = 3;   // a valid MTU code
  broken[1] = 60;  // a length beyond the field
  auto bad = rdma_cm_unframe(broken, "a request");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), Errc::protocol_error);
  std::vector<uint8_t> foreign(56, 0xff);  // another rdma_cm application's data
  EXPECT_EQ(rdma_cm_unframe(foreign, "a request").status().code(), Errc::protocol_error);
}

TEST(RdmaCm, ASoftProviderQpIsRefusedWithTheWayOut) {
  std::shared_ptr<Context> context;
  auto qp = soft_qp(context);
  cm::ConnectOptions options;
  options.method = cm::Method::rdma_cm;
  options.timeout = 500ms;
  auto r = cm::connect("127.0.0.1", 7471, *qp, options);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::invalid_argument);
  EXPECT_NE(r.status().message().find("Method::tcp"), std::string::npos) << r.status().to_string();
  EXPECT_EQ(qp->state(), QpState::reset) << "nothing was done to the QP";
}

TEST(RdmaCm, PrivateDataAboveTheIbCmLimitIsRefused) {
  std::shared_ptr<Context> context;
  auto qp = soft_qp(context);
  cm::ConnectOptions options;
  options.method = cm::Method::rdma_cm;
  options.private_data.assign(cm::rdma_cm_max_connect_data + 1, 0x42);
  auto r = cm::connect("127.0.0.1", 7471, *qp, options);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::invalid_argument);
  EXPECT_NE(r.status().message().find("54 bytes"), std::string::npos) << r.status().to_string();
}

TEST(RdmaCm, ListeningWithoutAnRdmaDeviceFailsAtOnceSayingSo) {
  auto bad = cm::Listener::listen("not-an-address", 0, cm::Method::rdma_cm);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), Errc::invalid_argument);
  if (rdma_device_present()) GTEST_SKIP() << "an RDMA device is present: listening may succeed here";
  auto listener = cm::Listener::listen("127.0.0.1", 0, cm::Method::rdma_cm);
  ASSERT_FALSE(listener);
  EXPECT_EQ(listener.status().code(), Errc::no_device) << listener.status().to_string();
  EXPECT_NE(listener.status().message().find("rdma_cm"), std::string::npos);
  EXPECT_NE(listener.status().message().find("tcp"), std::string::npos) << "names the method that works here";
}

}  // namespace

// The provider seam: the core reaches providers only through their tables.
namespace {
TEST(ProviderRegistry, EachProviderHasATableAndRdmaCmBelongsToVerbs) {
  ASSERT_EQ(stellar::provider::all().size(), 2u);
  for (stellar::Provider id : {stellar::Provider::soft, stellar::Provider::verbs}) {
    const stellar::provider::Ops* ops = stellar::provider::find(id);
    ASSERT_NE(ops, nullptr);
    EXPECT_EQ(ops->id, id);
    EXPECT_STREQ(ops->name, stellar::to_string(id));
    EXPECT_NE(ops->open, nullptr);
  }
  const stellar::provider::Ops* cm = stellar::provider::find(stellar::cm::Method::rdma_cm);
  ASSERT_NE(cm, nullptr);
  EXPECT_EQ(cm->id, stellar::Provider::verbs);
  EXPECT_NE(cm->cm_listen, nullptr);
  EXPECT_NE(cm->cm_connect, nullptr);
  EXPECT_EQ(stellar::provider::find(stellar::cm::Method::tcp), nullptr);  // the core's own method
  // describe() asks the provider that produced the completion.
  stellar::WorkCompletion wc;
  wc.status = stellar::WcStatus::remote_access_error;
  EXPECT_EQ(stellar::describe(wc), "remote access error");
  wc.provider = stellar::Provider::verbs;
  wc.provider_status = IBV_WC_REM_ACCESS_ERR;
  EXPECT_NE(stellar::describe(wc).find("IBV_WC_REM_ACCESS_ERR"), std::string::npos);
}
}  // namespace

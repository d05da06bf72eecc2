// The verbs provider's translation layer and device/GID choice, without a
// device: WR -> ibv_send_wr/ibv_recv_wr, ibv_wc -> WorkCompletion, QpTiming ->
// IB timeout/retry fields, MTU, GID tables from fixture sysfs trees
// (fixtures/gid/), and the no-device error of Context::open.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cstring>

#include "core/control_messages.hpp"
#include "providers/verbs/translate.hpp"
#include "stellar/verbs.hpp"

namespace {

using namespace stellar;
using namespace stellar::provider::verbs;
using namespace std::chrono_literals;

// ---------------------------------------------------------------- work requests

struct Translated {
  ibv_sge sges[16];
  ibv_send_wr wr;
};

Status translate(const SendWr& wr, Translated& t, SendLimits limits = {}) {
  return to_ibv_send_wr(wr, limits, t.sges, t.wr);
}

TEST(VerbsTranslate, AccessBits) {
  EXPECT_EQ(to_ibv_access(0), 0u);
  EXPECT_EQ(to_ibv_access(access_local_write), unsigned(IBV_ACCESS_LOCAL_WRITE));
  EXPECT_EQ(to_ibv_access(access_local_write | access_remote_write | access_remote_read | access_remote_atomic),
            unsigned(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC));
  EXPECT_EQ(to_ibv_access(access_remote_read), unsigned(IBV_ACCESS_REMOTE_READ));
}

TEST(VerbsTranslate, Opcodes) {
  EXPECT_EQ(to_ibv_opcode(WrOpcode::send), IBV_WR_SEND);
  EXPECT_EQ(to_ibv_opcode(WrOpcode::send_with_imm), IBV_WR_SEND_WITH_IMM);
  EXPECT_EQ(to_ibv_opcode(WrOpcode::rdma_write), IBV_WR_RDMA_WRITE);
  EXPECT_EQ(to_ibv_opcode(WrOpcode::rdma_write_with_imm), IBV_WR_RDMA_WRITE_WITH_IMM);
  EXPECT_EQ(to_ibv_opcode(WrOpcode::rdma_read), IBV_WR_RDMA_READ);
  EXPECT_EQ(to_ibv_opcode(WrOpcode::atomic_fetch_add), IBV_WR_ATOMIC_FETCH_AND_ADD);
  EXPECT_EQ(to_ibv_opcode(WrOpcode::atomic_cmp_swap), IBV_WR_ATOMIC_CMP_AND_SWP);
}

TEST(VerbsTranslate, SendFlags) {
  EXPECT_EQ(to_ibv_send_flags(0), 0u);  // unsignaled
  EXPECT_EQ(to_ibv_send_flags(send_signaled), unsigned(IBV_SEND_SIGNALED));
  EXPECT_EQ(to_ibv_send_flags(send_signaled | send_inline | send_solicited),
            unsigned(IBV_SEND_SIGNALED | IBV_SEND_INLINE | IBV_SEND_SOLICITED));
}

TEST(VerbsTranslate, SendWithSgeList) {
  const Sge list[3] = {{0x1000, 100, 11}, {0x2000, 0, 12}, {0x3000, 300, 13}};
  SendWr wr;
  wr.wr_id = 77;
  wr.opcode = WrOpcode::send;
  wr.sg_list = list;
  Translated t;
  ASSERT_TRUE(translate(wr, t).ok());
  EXPECT_EQ(t.wr.wr_id, 77u);
  EXPECT_EQ(t.wr.next, nullptr);
  EXPECT_EQ(t.wr.opcode, IBV_WR_SEND);
  EXPECT_EQ(t.wr.send_flags, unsigned(IBV_SEND_SIGNALED));
  ASSERT_EQ(t.wr.num_sge, 3);
  ASSERT_EQ(t.wr.sg_list, t.sges);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(t.sges[i].addr, list[i].addr);
    EXPECT_EQ(t.sges[i].length, list[i].length);
    EXPECT_EQ(t.sges[i].lkey, list[i].lkey);
  }
}

TEST(VerbsTranslate, ZeroLengthSendHasNoSges) {
  SendWr wr;
  wr.flags = 0;
  Translated t;
  ASSERT_TRUE(translate(wr, t).ok());
  EXPECT_EQ(t.wr.num_sge, 0);
  EXPECT_EQ(t.wr.sg_list, nullptr);
  EXPECT_EQ(t.wr.send_flags, 0u);
}

TEST(VerbsTranslate, ImmediateDataIsNetworkOrder) {
  for (WrOpcode op : {WrOpcode::send_with_imm, WrOpcode::rdma_write_with_imm}) {
    SendWr wr;
    wr.opcode = op;
    wr.imm_data = 0x01020304;
    wr.remote_addr = 0xabc000;
    wr.rkey = 99;
    Translated t;
    ASSERT_TRUE(translate(wr, t).ok());
    uint8_t bytes[4];
    std::memcpy(bytes, &t.wr.imm_data, 4);
    EXPECT_EQ(bytes[0], 0x01);
    EXPECT_EQ(bytes[3], 0x04);
    EXPECT_EQ(ntohl(t.wr.imm_data), 0x01020304u);
    if (op == WrOpcode::rdma_write_with_imm) {
      EXPECT_EQ(t.wr.opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
      EXPECT_EQ(t.wr.wr.rdma.remote_addr, 0xabc000u);
      EXPECT_EQ(t.wr.wr.rdma.rkey, 99u);
    } else {
      EXPECT_EQ(t.wr.opcode, IBV_WR_SEND_WITH_IMM);
    }
  }
}

TEST(VerbsTranslate, WriteAndReadCarryRemoteAddressAndKey) {
  const Sge s{0x5000, 4096, 7};
  for (WrOpcode op : {WrOpcode::rdma_write, WrOpcode::rdma_read}) {
    SendWr wr;
    wr.opcode = op;
    wr.sg_list = {&s, 1};
    wr.remote_addr = 0x7fff00001000;
    wr.rkey = 0xdeadbeef;
    Translated t;
    ASSERT_TRUE(translate(wr, t).ok());
    EXPECT_EQ(t.wr.opcode, op == WrOpcode::rdma_write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ);
    EXPECT_EQ(t.wr.wr.rdma.remote_addr, 0x7fff00001000u);
    EXPECT_EQ(t.wr.wr.rdma.rkey, 0xdeadbeefu);
    EXPECT_EQ(t.wr.num_sge, 1);
  }
}

TEST(VerbsTranslate, Atomics) {
  const Sge s{0x6000, 8, 3};
  SendWr wr;
  wr.sg_list = {&s, 1};
  wr.remote_addr = 0x9000;
  wr.rkey = 42;
  wr.compare_add = 5;
  wr.swap = 9;
  Translated t;
  wr.opcode = WrOpcode::atomic_fetch_add;
  ASSERT_TRUE(translate(wr, t).ok());
  EXPECT_EQ(t.wr.opcode, IBV_WR_ATOMIC_FETCH_AND_ADD);
  EXPECT_EQ(t.wr.wr.atomic.remote_addr, 0x9000u);
  EXPECT_EQ(t.wr.wr.atomic.rkey, 42u);
  EXPECT_EQ(t.wr.wr.atomic.compare_add, 5u);
  EXPECT_EQ(t.wr.wr.atomic.swap, 0u);  // fetch-add has no swap operand
  wr.opcode = WrOpcode::atomic_cmp_swap;
  ASSERT_TRUE(translate(wr, t).ok());
  EXPECT_EQ(t.wr.opcode, IBV_WR_ATOMIC_CMP_AND_SWP);
  EXPECT_EQ(t.wr.wr.atomic.compare_add, 5u);
  EXPECT_EQ(t.wr.wr.atomic.swap, 9u);
}

TEST(VerbsTranslate, AtomicMisuseIsRefused) {
  const Sge two[2] = {{0x6000, 4, 3}, {0x6004, 4, 3}};
  const Sge four{0x6000, 4, 3};
  const Sge eight{0x6000, 8, 3};
  Translated t;
  SendWr wr;
  wr.opcode = WrOpcode::atomic_fetch_add;
  wr.remote_addr = 0x9000;
  wr.sg_list = two;
  EXPECT_EQ(translate(wr, t).code(), Errc::invalid_argument);
  wr.sg_list = {&four, 1};
  EXPECT_EQ(translate(wr, t).code(), Errc::invalid_argument);
  wr.sg_list = {&eight, 1};
  wr.remote_addr = 0x9004;
  EXPECT_EQ(translate(wr, t).code(), Errc::invalid_argument);
  wr.remote_addr = 0x9008;
  EXPECT_TRUE(translate(wr, t).ok());
}

TEST(VerbsTranslate, InlineLimits) {
  const Sge s{0x1000, 200, 0};
  SendWr wr;
  wr.opcode = WrOpcode::rdma_write;
  wr.flags = send_signaled | send_inline;
  wr.sg_list = {&s, 1};
  Translated t;
  ASSERT_TRUE(translate(wr, t, {16, 256}).ok());
  EXPECT_EQ(t.wr.send_flags, unsigned(IBV_SEND_SIGNALED | IBV_SEND_INLINE));
  auto too_big = translate(wr, t, {16, 100});
  EXPECT_EQ(too_big.code(), Errc::invalid_argument);
  EXPECT_NE(too_big.message().find("max_inline_data"), std::string::npos);
  wr.opcode = WrOpcode::rdma_read;
  EXPECT_EQ(translate(wr, t).code(), Errc::invalid_argument);
}

TEST(VerbsTranslate, SgeLimits) {
  Sge list[5] = {};
  SendWr wr;
  wr.sg_list = list;
  Translated t;
  auto s = translate(wr, t, {4, 0});
  EXPECT_EQ(s.code(), Errc::invalid_argument);
  EXPECT_NE(s.message().find("max_send_sge"), std::string::npos);
  ibv_sge small[2];
  EXPECT_EQ(to_ibv_send_wr(wr, {16, 0}, small, t.wr).code(), Errc::invalid_argument);
}

TEST(VerbsTranslate, ReceiveRequests) {
  const Sge list[2] = {{0x1000, 64, 1}, {0x2000, 128, 2}};
  ibv_sge sges[4];
  ibv_recv_wr out;
  ASSERT_TRUE(to_ibv_recv_wr(RecvWr{5, list}, 4, sges, out).ok());
  EXPECT_EQ(out.wr_id, 5u);
  EXPECT_EQ(out.next, nullptr);
  ASSERT_EQ(out.num_sge, 2);
  EXPECT_EQ(out.sg_list[1].addr, 0x2000u);
  EXPECT_EQ(out.sg_list[1].length, 128u);
  EXPECT_EQ(out.sg_list[1].lkey, 2u);
  EXPECT_EQ(to_ibv_recv_wr(RecvWr{5, list}, 1, sges, out).code(), Errc::invalid_argument);
  ASSERT_TRUE(to_ibv_recv_wr(RecvWr{6, {}}, 1, sges, out).ok());
  EXPECT_EQ(out.num_sge, 0);
}

// ---------------------------------------------------------------- completions

TEST(VerbsTranslate, EveryIbvStatus) {
  const std::pair<ibv_wc_status, WcStatus> table[] = {
      {IBV_WC_SUCCESS, WcStatus::success},
      {IBV_WC_LOC_LEN_ERR, WcStatus::local_length_error},
      {IBV_WC_LOC_QP_OP_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_LOC_EEC_OP_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_LOC_PROT_ERR, WcStatus::local_protection_error},
      {IBV_WC_WR_FLUSH_ERR, WcStatus::work_request_flushed},
      {IBV_WC_MW_BIND_ERR, WcStatus::local_protection_error},
      {IBV_WC_BAD_RESP_ERR, WcStatus::bad_response},
      {IBV_WC_LOC_ACCESS_ERR, WcStatus::local_protection_error},
      {IBV_WC_REM_INV_REQ_ERR, WcStatus::remote_invalid_request},
      {IBV_WC_REM_ACCESS_ERR, WcStatus::remote_access_error},
      {IBV_WC_REM_OP_ERR, WcStatus::remote_operation_error},
      {IBV_WC_RETRY_EXC_ERR, WcStatus::retry_exceeded},
      {IBV_WC_RNR_RETRY_EXC_ERR, WcStatus::rnr_retry_exceeded},
      {IBV_WC_LOC_RDD_VIOL_ERR, WcStatus::local_protection_error},
      {IBV_WC_REM_INV_RD_REQ_ERR, WcStatus::remote_invalid_request},
      {IBV_WC_REM_ABORT_ERR, WcStatus::remote_operation_error},
      {IBV_WC_INV_EECN_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_INV_EEC_STATE_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_FATAL_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_RESP_TIMEOUT_ERR, WcStatus::retry_exceeded},
      {IBV_WC_GENERAL_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_TM_ERR, WcStatus::local_qp_operation_error},
      {IBV_WC_TM_RNDV_INCOMPLETE, WcStatus::local_qp_operation_error},
  };
  ASSERT_EQ(std::size(table), size_t(IBV_WC_TM_RNDV_INCOMPLETE) + 1);  // every value of the enum
  for (auto [ibv, want] : table) {
    SCOPED_TRACE(ibv_wc_status_str(ibv));
    EXPECT_EQ(from_ibv_status(ibv), want);
    ibv_wc wc{};
    wc.wr_id = 1234;
    wc.status = ibv;
    wc.opcode = IBV_WC_RDMA_WRITE;
    wc.vendor_err = 0x88;
    wc.qp_num = 0x1234;
    const WorkCompletion got = from_ibv_wc(wc);
    EXPECT_EQ(got.status, want);
    EXPECT_EQ(got.wr_id, 1234u);
    EXPECT_EQ(got.qp_num, 0x1234u);
    if (ibv == IBV_WC_SUCCESS) {
      EXPECT_EQ(got.provider_status, 0u);
      EXPECT_EQ(describe(got), "success");
    } else {
      // The original status survives, and describe() names it.
      EXPECT_EQ(got.provider_status, uint32_t(ibv));
      EXPECT_EQ(got.vendor_error, 0x88u);
      const std::string text = describe(got);
      EXPECT_NE(text.find(ibv_wc_status_str(ibv)), std::string::npos) << text;
      EXPECT_NE(text.find(to_string(want)), std::string::npos) << text;
      EXPECT_NE(text.find("vendor_err 0x88"), std::string::npos) << text;
    }
  }
  EXPECT_NE(describe_ibv_status(IBV_WC_REM_ACCESS_ERR, 0).find("IBV_WC_REM_ACCESS_ERR"), std::string::npos);
  EXPECT_EQ(from_ibv_status(ibv_wc_status(200)), WcStatus::local_qp_operation_error);  // newer than these headers
}

TEST(VerbsTranslate, EveryIbvOpcode) {
  EXPECT_EQ(from_ibv_opcode(IBV_WC_SEND), WcOpcode::send);
  EXPECT_EQ(from_ibv_opcode(IBV_WC_RDMA_WRITE), WcOpcode::rdma_write);
  EXPECT_EQ(from_ibv_opcode(IBV_WC_RDMA_READ), WcOpcode::rdma_read);
  EXPECT_EQ(from_ibv_opcode(IBV_WC_COMP_SWAP), WcOpcode::compare_swap);
  EXPECT_EQ(from_ibv_opcode(IBV_WC_FETCH_ADD), WcOpcode::fetch_add);
  EXPECT_EQ(from_ibv_opcode(IBV_WC_RECV), WcOpcode::recv);
  EXPECT_EQ(from_ibv_opcode(IBV_WC_RECV_RDMA_WITH_IMM), WcOpcode::recv_rdma_with_imm);
  for (ibv_wc_opcode other : {IBV_WC_BIND_MW, IBV_WC_LOCAL_INV, IBV_WC_TSO, IBV_WC_ATOMIC_WRITE, IBV_WC_TM_ADD, IBV_WC_TM_DEL,
                              IBV_WC_TM_SYNC, IBV_WC_TM_RECV, IBV_WC_TM_NO_TAG, IBV_WC_DRIVER1, IBV_WC_DRIVER2, IBV_WC_DRIVER3})
    EXPECT_FALSE(from_ibv_opcode(other).has_value()) << int(other);
  ibv_wc wc{};
  wc.opcode = IBV_WC_TSO;
  EXPECT_EQ(from_ibv_wc(wc).opcode, WcOpcode::send);  // not ours: reported as send
}

TEST(VerbsTranslate, ReceiveCompletionWithImmediate) {
  ibv_wc wc{};
  wc.wr_id = 9;
  wc.status = IBV_WC_SUCCESS;
  wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
  wc.byte_len = 4096;
  wc.wc_flags = IBV_WC_WITH_IMM;
  wc.imm_data = htonl(0xcafe0001);
  const WorkCompletion got = from_ibv_wc(wc);
  EXPECT_EQ(got.opcode, WcOpcode::recv_rdma_with_imm);
  EXPECT_TRUE(got.has_imm);
  EXPECT_EQ(got.imm_data, 0xcafe0001u);
  EXPECT_EQ(got.byte_len, 4096u);
  wc.wc_flags = 0;
  wc.opcode = IBV_WC_RECV;
  const WorkCompletion plain = from_ibv_wc(wc);
  EXPECT_FALSE(plain.has_imm);
  EXPECT_EQ(plain.imm_data, 0u);
}

// ---------------------------------------------------------------- timing and MTU

TEST(VerbsTranslate, TimeoutExponent) {
  EXPECT_EQ(ib_timeout(1), 8192ns);
  EXPECT_EQ(ib_timeout(8), 1'048'576ns);
  EXPECT_EQ(ib_timeout(14), 67'108'864ns);
  EXPECT_EQ(ib_timeout_exponent(0ns), 1);  // never 0: that would wait forever
  EXPECT_EQ(ib_timeout_exponent(1ms), 8);  // QpTiming's default: 1.05 ms
  EXPECT_EQ(ib_timeout_exponent(ib_timeout(14)), 14);         // exact: that exponent
  EXPECT_EQ(ib_timeout_exponent(ib_timeout(14) + 1ns), 15);   // never sooner than asked
  EXPECT_EQ(ib_timeout_exponent(4s), 20);  // NCCL's default 20 is ~4.3 s
  EXPECT_EQ(ib_timeout_exponent(std::chrono::hours(10)), 31);
  for (uint8_t e = 1; e <= 31; ++e) EXPECT_EQ(ib_timeout_exponent(ib_timeout(e)), e);
}

TEST(VerbsTranslate, QpTimingToVerbs) {
  QpTiming t;  // defaults: rto_min 1 ms, retry 7, rnr 7
  VerbsTiming v = to_verbs_timing(t);
  EXPECT_EQ(v.timeout, 8);
  EXPECT_EQ(v.retry_cnt, 7);
  EXPECT_EQ(v.rnr_retry, 7);  // 7: forever, in both APIs
  EXPECT_EQ(v.min_rnr_timer, 12);
  EXPECT_EQ(rnr_timer_delay(v.min_rnr_timer), 640us);
  t.rto_min = 100ms;
  t.retry_count = 20;  // the field has 3 bits
  t.rnr_retry = 3;
  v = to_verbs_timing(t);
  EXPECT_EQ(v.timeout, 15);  // 134 ms
  EXPECT_EQ(v.retry_cnt, 7);
  EXPECT_EQ(v.rnr_retry, 3);
  EXPECT_EQ(rnr_timer_delay(0), 655360us);
  EXPECT_EQ(rnr_timer_delay(1), 10us);
  EXPECT_EQ(rnr_timer_delay(31), 491520us);
}

TEST(VerbsTranslate, Mtu) {
  EXPECT_EQ(ibv_mtu_at_most(4096), IBV_MTU_4096);
  EXPECT_EQ(ibv_mtu_at_most(9000), IBV_MTU_4096);
  EXPECT_EQ(ibv_mtu_at_most(4095), IBV_MTU_2048);
  EXPECT_EQ(ibv_mtu_at_most(1500), IBV_MTU_1024);
  EXPECT_EQ(ibv_mtu_at_most(256), IBV_MTU_256);
  EXPECT_FALSE(ibv_mtu_at_most(255).has_value());
  EXPECT_EQ(mtu_bytes(IBV_MTU_256), 256u);
  EXPECT_EQ(mtu_bytes(IBV_MTU_1024), 1024u);
  EXPECT_EQ(mtu_bytes(IBV_MTU_4096), 4096u);
}

// ---------------------------------------------------------------- GIDs

const std::string fixtures = STELLAR_GID_FIXTURES;

TEST(VerbsGid, FormatAndParse) {
  const std::string text = "0000:0000:0000:0000:0000:ffff:0a00:0001";
  auto g = parse_gid(text);
  ASSERT_TRUE(g);
  EXPECT_EQ(format_gid(*g), text);
  EXPECT_EQ(gid_ipv4(*g), "10.0.0.1");
  EXPECT_EQ(parse_gid("::ffff:10.0.0.1"), g);
  auto ll = parse_gid("fe80::a00:ff:fe00:1");
  ASSERT_TRUE(ll);
  EXPECT_TRUE(gid_is_link_local(*ll));
  EXPECT_FALSE(gid_ipv4(*ll));
  EXPECT_FALSE(gid_is_link_local(*g));
  EXPECT_FALSE(parse_gid("10.0.0.1"));
  EXPECT_FALSE(parse_gid("fe80::zz"));
}

TEST(VerbsGid, ReadsSysfsTables) {
  const auto devices = read_sysfs_gid_tables(fixtures + "/roce_cluster");
  ASSERT_EQ(devices.size(), 3u);
  EXPECT_EQ(devices[0].device, "mlx5_0");
  EXPECT_EQ(devices[1].device, "mlx5_1");
  EXPECT_EQ(devices[2].device, "mlx5_2");
  // mlx5_0: 6 populated entries; the zero GID and the one without a type are skipped.
  ASSERT_EQ(devices[0].gids.size(), 6u);
  const GidEntry& e3 = devices[0].gids[3];
  EXPECT_EQ(e3.port, 1u);
  EXPECT_EQ(e3.index, 3u);
  EXPECT_EQ(e3.type, GidType::roce_v2);
  EXPECT_EQ(e3.netdev, "ens1f0");
  EXPECT_TRUE(e3.port_active);
  EXPECT_EQ(gid_ipv4(e3.gid), "10.0.0.1");
  EXPECT_EQ(devices[0].gids[2].type, GidType::roce_v1);  // "IB/RoCE v1" on Ethernet
  // mlx5_1: two ports, the second down.
  ASSERT_EQ(devices[1].gids.size(), 9u);
  EXPECT_EQ(devices[1].gids[5].port, 2u);
  EXPECT_FALSE(devices[1].gids[5].port_active);
  // mlx5_2: "IB/RoCE v1" on an InfiniBand port is an IB GID.
  ASSERT_EQ(devices[2].gids.size(), 1u);
  EXPECT_EQ(devices[2].gids[0].type, GidType::ib);
  EXPECT_TRUE(read_sysfs_gid_tables(fixtures + "/empty").empty());
  EXPECT_TRUE(read_sysfs_gid_tables(fixtures + "/no_such_tree").empty());
}

struct Cluster : ::testing::Test {
  std::vector<DeviceGids> devices = read_sysfs_gid_tables(fixtures + "/roce_cluster");
};

TEST_F(Cluster, SelectByAddress) {
  auto a = select_gid(devices, "", "10.0.0.1");
  ASSERT_TRUE(a) << a.status().to_string();
  EXPECT_EQ(a->device, "mlx5_0");
  EXPECT_EQ(a->entry.port, 1u);
  EXPECT_EQ(a->entry.index, 3u);  // the RoCE v2 one, not index 2 (v1) with the same address
  EXPECT_EQ(a->entry.type, GidType::roce_v2);
  EXPECT_EQ(a->ipv4, "10.0.0.1");
  auto b = select_gid(devices, "", "10.0.1.1");
  ASSERT_TRUE(b) << b.status().to_string();
  EXPECT_EQ(b->device, "mlx5_1");
  EXPECT_EQ(b->entry.port, 1u);
  EXPECT_EQ(b->entry.index, 3u);
}

TEST_F(Cluster, SelectByName) {
  auto a = select_gid(devices, "mlx5_1", "");
  ASSERT_TRUE(a) << a.status().to_string();
  EXPECT_EQ(a->device, "mlx5_1");
  EXPECT_EQ(a->ipv4, "10.0.1.1");  // IPv4-mapped RoCE v2 of the active port
  EXPECT_EQ(a->entry.index, 3u);
  auto ib = select_gid(devices, "mlx5_2", "");
  ASSERT_TRUE(ib) << ib.status().to_string();
  EXPECT_EQ(ib->entry.type, GidType::ib);
  EXPECT_EQ(ib->entry.index, 0u);
  EXPECT_EQ(ib->ipv4, "");
  auto both = select_gid(devices, "mlx5_0", "10.0.0.1");
  ASSERT_TRUE(both);
  EXPECT_EQ(both->entry.index, 3u);
  auto unknown = select_gid(devices, "mlx5_9", "");
  EXPECT_EQ(unknown.status().code(), Errc::not_found);
  EXPECT_NE(unknown.status().message().find("mlx5_0, mlx5_1, mlx5_2"), std::string::npos) << unknown.status().message();
}

TEST_F(Cluster, NameAndAddressMustAgree) {
  auto r = select_gid(devices, "mlx5_1", "10.0.0.1");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::not_found);
  EXPECT_NE(r.status().message().find("10.0.1.1"), std::string::npos) << r.status().message();  // lists what mlx5_1 carries
}

TEST_F(Cluster, DefaultAddressFallsBackToFirstUsableGid) {
  for (const char* address : {"127.0.0.1", "", "0.0.0.0"}) {
    auto r = select_gid(devices, "", address);
    ASSERT_TRUE(r) << address << ": " << r.status().to_string();
    EXPECT_EQ(r->device, "mlx5_0");
    EXPECT_EQ(r->entry.index, 3u);
  }
}

TEST_F(Cluster, NoMatchIsAClearError) {
  auto r = select_gid(devices, "", "10.9.9.9");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::not_found);
  const std::string m = r.status().message();
  EXPECT_NE(m.find("no RoCE v2 GID carries 10.9.9.9"), std::string::npos) << m;
  EXPECT_NE(m.find("mlx5_0 port 1: 10.0.0.1"), std::string::npos) << m;
}

TEST_F(Cluster, RoceV1OnlyIsRefused) {
  auto r = select_gid(devices, "", "192.168.5.1");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::not_found);
  EXPECT_NE(r.status().message().find("RoCE v1"), std::string::npos) << r.status().message();
}

TEST_F(Cluster, DownPortIsRefused) {
  auto r = select_gid(devices, "", "10.0.2.1");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::not_found);
  EXPECT_NE(r.status().message().find("not ACTIVE"), std::string::npos) << r.status().message();
}

TEST_F(Cluster, BadAddressIsInvalid) {
  EXPECT_EQ(select_gid(devices, "", "my-host").status().code(), Errc::invalid_argument);
  EXPECT_EQ(select_gid(devices, "", "::1").status().code(), Errc::invalid_argument);
}

TEST(VerbsGid, LinkLocalOnly) {
  const auto devices = read_sysfs_gid_tables(fixtures + "/link_local_only");
  auto any = select_gid(devices, "", "");
  ASSERT_TRUE(any) << any.status().to_string();
  EXPECT_EQ(any->device, "rxe0");
  EXPECT_EQ(any->entry.index, 1u);  // RoCE v2 link-local, never the v1 entry
  EXPECT_EQ(any->ipv4, "");
  auto by_ip = select_gid(devices, "", "10.0.0.1");
  ASSERT_FALSE(by_ip);
  EXPECT_NE(by_ip.status().message().find("no IPv4 RoCE v2 GID"), std::string::npos) << by_ip.status().message();
}

TEST(VerbsGid, NoDevice) {
  auto r = select_gid(read_sysfs_gid_tables(fixtures + "/empty"), "", "");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Errc::no_device);
  EXPECT_NE(r.status().message().find("--provider soft"), std::string::npos);
}

// ---------------------------------------------------------------- endpoints and open

TEST(VerbsEndpoint, JsonCarriesGidAndStaysCompatible) {
  QpEndpoint e;
  e.address = "10.0.0.1";
  e.udp_port = 4791;
  e.qp_num = 0x123;
  e.psn = 0xabcdef;
  e.mode = Mode::roce;
  e.gid = "0000:0000:0000:0000:0000:ffff:0a00:0001";
  e.lid = 7;
  auto j = control::endpoint_json(e);
  auto back = control::endpoint_from(j);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->gid, e.gid);
  EXPECT_EQ(back->lid, 7);
  EXPECT_EQ(back->qp_num, 0x123u);
  // A soft endpoint's JSON has no GID fields; an older peer's message without them still parses.
  QpEndpoint soft;
  soft.address = "127.0.0.1";
  soft.udp_port = 5000;
  soft.qp_num = 5;
  auto sj = control::endpoint_json(soft);
  EXPECT_FALSE(sj.contains("gid"));
  EXPECT_FALSE(sj.contains("lid"));
  auto old = control::endpoint_from(sj);
  ASSERT_TRUE(old);
  EXPECT_EQ(old->gid, "");
  EXPECT_EQ(old->lid, 0);
  // loopback_unchecked: sent only when true; absent (an older peer) reads as false; a non-boolean is refused.
  EXPECT_FALSE(sj.contains("loopback_unchecked"));
  EXPECT_FALSE(old->loopback_unchecked);
  soft.loopback_unchecked = true;
  auto uj = control::endpoint_json(soft);
  EXPECT_EQ(uj.at("loopback_unchecked"), true);
  auto agreed = control::endpoint_from(uj);
  ASSERT_TRUE(agreed);
  EXPECT_TRUE(agreed->loopback_unchecked);
  uj["loopback_unchecked"] = "yes";
  auto wrong = control::endpoint_from(uj);
  ASSERT_FALSE(wrong);
  EXPECT_EQ(wrong.status().code(), Errc::protocol_error);
}

TEST(VerbsOpen, WithoutDeviceSaysSoAndSuggestsSoft) {
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list) ibv_free_device_list(list);
  if (count > 0) GTEST_SKIP() << "this machine has an RDMA device";
  ContextOptions o;
  o.provider = Provider::verbs;
  auto ctx = Context::open(o);
  ASSERT_FALSE(ctx.ok());
  EXPECT_EQ(ctx.status().code(), Errc::no_device);
  EXPECT_NE(ctx.status().message().find("--provider soft"), std::string::npos) << ctx.status().message();
}

}  // namespace

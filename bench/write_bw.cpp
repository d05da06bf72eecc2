// stellar_write_bw: RDMA WRITE bandwidth, invoked like perftest's
// ib_write_bw (server without a host, client with the server's address).
// The client keeps `-t` writes of `-s` bytes outstanding for `-n` iterations
// and prints perftest's bandwidth columns. A first version for the core
// issue's figures; the benchmark-suite issue grows it to perftest's options.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "stellar/stellar.hpp"

using namespace stellar;
using Clock = std::chrono::steady_clock;

namespace {
template <typename T>
T check(Result<T> r, const char* what) {
  if (!r) {
    std::fprintf(stderr, "stellar_write_bw: %s: %s\n", what, r.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(r).value();
}
void check(Status s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "stellar_write_bw: %s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}
struct Remote {
  uint64_t addr;
  uint32_t rkey;
};
}  // namespace

int main(int argc, char** argv) {
  std::string server, mode = "stellar", provider = "soft", bind = "127.0.0.1";
  uint16_t port = 18516;
  uint32_t size = 1 << 20, iterations = 2000, depth = 16, mtu = 4096;
  CLI::App app{"Stellar RDMA WRITE bandwidth (perftest ib_write_bw style)"};
  app.add_option("server", server, "Server address (omit to run as the server)");
  app.add_option("-p,--port", port)->capture_default_str();
  app.add_option("-s,--size", size)->capture_default_str()->check(CLI::Range(1u, 1u << 26));
  app.add_option("-n,--iters", iterations)->capture_default_str()->check(CLI::Range(1u, 100'000'000u));
  app.add_option("-t,--tx-depth", depth, "Writes kept outstanding")->capture_default_str()->check(CLI::Range(1u, 1024u));
  app.add_option("--mode", mode)->check(CLI::IsMember({"stellar", "roce"}))->capture_default_str();
  app.add_option("--provider", provider)->check(CLI::IsMember({"soft", "verbs"}))->capture_default_str();
  app.add_option("--bind", bind)->capture_default_str();
  app.add_option("--mtu", mtu)->capture_default_str();
  std::string cc = "automatic";
  app.add_option("--cc", cc, "Congestion control")->check(CLI::IsMember({"automatic", "none", "dcqcn", "swift"}))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  ContextOptions co;
  co.provider = check(parse_provider(provider), "provider");
  co.mode = check(parse_mode(mode), "mode");
  co.bind_address = bind;
  co.mtu = mtu;
  co.congestion_control = cc == "none" ? CongestionControl::none : cc == "dcqcn" ? CongestionControl::dcqcn
                          : cc == "swift" ? CongestionControl::swift : CongestionControl::automatic;
  auto ctx = check(Context::open(co), "open context");
  auto pd = check(ctx->allocate_pd(), "allocate PD");
  auto cq = check(ctx->create_cq(4096), "create CQ");
  std::vector<uint8_t> buffer(size, 0x5a);
  auto mr = check(pd->register_memory(buffer.data(), buffer.size(), access_local_write | access_remote_write), "register");
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = cq;
  qa.cap.max_send_wr = std::max<uint32_t>(depth, 16);
  qa.cap.max_recv_wr = 16;
  auto qp = check(pd->create_qp(qa), "create QP");
  QpModify init;
  init.state = QpState::init;
  check(qp->modify(init), "modify INIT");
  check(qp->post_recv(RecvWr{0, {}}), "post_recv");  // the client's final WRITE_WITH_IMM
  Remote local{mr->addr(), mr->rkey()}, remote{};
  std::vector<uint8_t> mine(sizeof local), theirs;
  std::memcpy(mine.data(), &local, sizeof local);
  if (server.empty()) {
    auto listener = check(cm::Listener::listen(bind, port), "listen");
    auto request = check(listener->get_request(std::chrono::minutes(5)), "wait for client");
    check(request->accept(*qp, mine), "accept");
    // Serve until the client's WRITE_WITH_IMM says it is done.
    WorkCompletion wc[8];
    const auto deadline = Clock::now() + std::chrono::minutes(10);
    for (bool done = false; !done && Clock::now() < deadline;) {
      const int n = cq->poll(wc);
      for (int i = 0; i < n; ++i) done |= wc[i].opcode == WcOpcode::recv_rdma_with_imm;
    }
    const auto linger = Clock::now() + std::chrono::milliseconds(50);
    while (Clock::now() < linger) ctx->progress();
    const ContextCounters k = ctx->counters();
    std::fprintf(stderr, "# server: packets rx %llu in %llu receive calls (%llu coalesced by GRO), send errors %llu\n",
                 (unsigned long long)k.rx_packets, (unsigned long long)k.rx_receive_calls, (unsigned long long)k.rx_coalesced,
                 (unsigned long long)k.send_errors);
    return 0;
  }
  cm::ConnectOptions c;
  c.private_data = mine;
  c.timeout = std::chrono::seconds(20);
  theirs = check(cm::connect(server, port, *qp, c), "connect").private_data;
  std::memcpy(&remote, theirs.data(), sizeof remote);
  Sge sge{mr->addr(), size, mr->lkey()};
  SendWr wr;
  wr.opcode = WrOpcode::rdma_write;
  wr.sg_list = {&sge, 1};
  wr.remote_addr = remote.addr;
  wr.rkey = remote.rkey;
  uint32_t posted = 0, completed = 0;
  WorkCompletion wc[32];
  const auto start = Clock::now();
  while (completed < iterations) {
    while (posted < iterations && posted - completed < depth) {
      wr.wr_id = posted++;
      check(qp->post_send(wr), "post_send");
    }
    const int n = cq->poll(wc);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != WcStatus::success) {
        std::fprintf(stderr, "stellar_write_bw: write %llu failed: %s\n", (unsigned long long)wc[i].wr_id, to_string(wc[i].status));
        return 1;
      }
      ++completed;
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  wr.opcode = WrOpcode::rdma_write_with_imm;
  wr.wr_id = posted;
  sge.length = 0;
  check(qp->post_send(wr), "post_send");
  for (int got = 0; got == 0;) got = cq->poll(wc);
  const double mib = double(size) * iterations / (1 << 20);
  const ContextCounters k = ctx->counters();
  std::printf("---------------------------------------------------------------------------------------\n");
  std::printf(" RDMA_Write BW Test (stellar_write_bw)  provider: %s  mode: %s  MTU: %u  tx depth: %u\n", provider.c_str(), mode.c_str(), mtu, depth);
  std::printf(" #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]\n");
  std::printf(" %-10u %-14u %-19.2f %-21.2f %.6f\n", size, iterations, mib / seconds, mib / seconds, iterations / seconds / 1e6);
  std::printf("---------------------------------------------------------------------------------------\n");
  std::printf("# %.3f GB/s; packets tx %llu rx %llu, retransmitted %llu, timeouts %llu, faults dropped %llu, send errors %llu\n",
              double(size) * iterations / seconds / 1e9, (unsigned long long)k.tx_packets, (unsigned long long)k.rx_packets,
              (unsigned long long)k.retransmitted_packets, (unsigned long long)k.timeouts, (unsigned long long)k.fault_dropped,
              (unsigned long long)k.send_errors);
  return 0;
}

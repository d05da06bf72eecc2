// stellar_pingpong: RDMA WRITE ping-pong latency, invoked like perftest's
// ib_write_lat: the server runs without a host, the client names the server.
//
//   server: stellar_pingpong [-p PORT] [-s BYTES | -a] [-n ITERATIONS] [--mode stellar|roce]
//   client: stellar_pingpong SERVER [same options]
//
// Every wait on the peer is bounded: the server waits --wait_client seconds
// for a client (a failed attempt does not end it), each message 10 s.
//
// Each side registers a buffer and learns the other's address and rkey from
// the connection manager's private data. The client writes, the server waits
// for the write to land and writes back; one-way latency = round trip / 2.
// Messages up to one MTU are detected by polling the buffer's last byte
// (as perftest does); larger ones by RDMA WRITE with immediate, because the
// stellar mode may place packets of one message out of order.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_accounting.hpp"
#include "tenant_line.hpp"
#include "stellar/stellar.hpp"

using namespace stellar;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string server;
  uint16_t port = 18515;
  uint32_t size = 8;
  uint32_t iterations = 10000;
  uint32_t warmup = 200;
  std::string mode = "stellar";
  std::string provider = "soft";
  std::string bind = "127.0.0.1";
  std::string cm = "tcp";  // connection method
  uint32_t mtu = 0;  // 0: automatic (ContextOptions::mtu)
  bool adaptive = false;
  bool all = false;
  uint32_t wait_client = 300;  // seconds the server waits for a client that connects
  std::string tenant, hint;    // docs/scheduler.md
  uint64_t tx_rate = 0;        // bytes/s the flow scheduler shapes to (0: none)
};

struct Remote {
  uint64_t addr;
  uint32_t rkey;
};

// `what` is a C string: check() runs in the timed loop, where building a
// std::string per call would be measured as transport latency.
[[noreturn]] void fail(const char* what, const Status& s) {
  std::fprintf(stderr, "stellar_pingpong: %s: %s\n", what, s.to_string().c_str());
  std::exit(1);
}

template <typename T>
T check(Result<T> r, const char* what) {
  if (!r) fail(what, r.status());
  return std::move(r).value();
}

void check(const Status& s, const char* what) {
  if (!s.ok()) fail(what, s);
}

uint8_t marker(uint32_t i) { return uint8_t(i % 255 + 1); }

// One perftest-style row of one-way latencies (round trip / 2).
void print_row(uint32_t size, const std::vector<double>& rtt_us) {
  std::vector<double> one_way(rtt_us.size());
  std::transform(rtt_us.begin(), rtt_us.end(), one_way.begin(), [](double r) { return r / 2; });
  std::sort(one_way.begin(), one_way.end());
  double sum = 0, squares = 0;
  for (double v : one_way) sum += v;
  const double avg = sum / double(one_way.size());
  for (double v : one_way) squares += (v - avg) * (v - avg);
  auto pct = [&](double p) { return one_way[std::min(one_way.size() - 1, size_t(p / 100 * double(one_way.size())))]; };
  std::printf(" %-7u %-10zu %-14.2f %-14.2f %-16.2f %-14.2f %-15.2f %-22.2f %.2f\n", size, one_way.size(), one_way.front(), one_way.back(),
              one_way[one_way.size() / 2], avg, std::sqrt(squares / double(one_way.size())), pct(99), pct(99.9));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Stellar RDMA WRITE ping-pong latency (perftest ib_write_lat style)"};
  app.add_option("server", o.server, "Server address (omit to run as the server)");
  app.add_option("-p,--port", o.port, "Connection manager TCP port")->capture_default_str();
  app.add_option("-s,--size", o.size, "Message size in bytes")->capture_default_str()->check(CLI::Range(1u, 1u << 26));
  app.add_flag("-a,--all", o.all, "Run every size from 2 B to 8 MiB (powers of two) over one connection");
  app.add_option("--wait_client", o.wait_client, "Server: seconds to wait for a client to connect")->capture_default_str()->check(CLI::Range(1u, 86400u));
  app.add_option("-n,--iters", o.iterations, "Measured iterations")->capture_default_str()->check(CLI::Range(1u, 100'000'000u));
  app.add_option("--warmup", o.warmup, "Unmeasured iterations first (per size)")->capture_default_str()->check(CLI::Range(0u, 100'000'000u));
  app.add_option("--mode", o.mode, "Soft provider wire mode")->check(CLI::IsMember({"stellar", "roce"}))->capture_default_str();
  app.add_option("--provider", o.provider, "Provider")->check(CLI::IsMember({"soft", "verbs"}))->capture_default_str();
  app.add_option("--bind", o.bind, "Local IPv4 address for data and connection manager")->capture_default_str();
  app.add_option("--cm", o.cm, "Connection method: tcp (every provider) or rdma_cm (librdmacm; verbs provider)")
      ->check(CLI::IsMember({"tcp", "rdma_cm"}))
      ->capture_default_str();
  app.add_option("--mtu", o.mtu, "Payload bytes per packet (0: the largest the interface carries)")
      ->capture_default_str()
      ->check(CLI::Range(0u, stellar::max_mtu));
  app.add_flag("--adaptive", o.adaptive, "Spin then sleep instead of pure busy-polling");
  app.add_option("--tenant", o.tenant, "Open the context as this tenant (its credential from STELLAR_TENANT_CREDENTIAL; docs/scheduler.md)");
  app.add_option("--hint", o.hint, "Job hints of the QPs: a kind (allreduce, all-to-all, parameter-fetch, kv-fetch, checkpoint, control) "
                 "or job=NAME,kind=KIND,priority=P,weight=W");
  app.add_option("--tx_rate", o.tx_rate, "Soft provider: bytes/s the flow scheduler shapes this process's transmissions to (0: none)");
  CLI11_PARSE(app, argc, argv);
  const bool is_server = o.server.empty();

  ContextOptions co;
  co.provider = check(parse_provider(o.provider), "provider");
  co.mode = check(parse_mode(o.mode), "mode");
  co.bind_address = o.bind;
  co.mtu = o.mtu;
  co.wait = o.adaptive ? WaitPolicy::adaptive : WaitPolicy::busy_poll;
  co.tenant = o.tenant;
  if (!o.hint.empty()) co.hints = check(JobHints::parse(o.hint), "--hint");
  co.tx_rate_bytes_per_s = o.tx_rate;
  auto context = check(Context::open(co), "open context");
  o.mtu = context->options().mtu;  // the value chosen when automatic
  auto pd = check(context->allocate_pd(), "allocate PD");
  auto cq = check(context->create_cq(1024), "create CQ");
  // -a sweeps 2 B .. 8 MiB over one connection, as perftest's -a does.
  std::vector<uint32_t> sizes;
  if (o.all) {
    for (uint32_t s = 2; s <= (8u << 20); s *= 2) sizes.push_back(s);
  } else {
    sizes.push_back(o.size);
  }
  const uint32_t largest = sizes.back();
  std::vector<uint8_t> buffer(largest, 0);
  std::vector<uint8_t> outgoing(largest, 0);
  auto mr = check(pd->register_memory(buffer.data(), buffer.size(), access_local_write | access_remote_write), "register memory");
  auto out_mr = check(pd->register_memory(outgoing.data(), outgoing.size(), access_local_write), "register memory");
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = cq;
  constexpr uint32_t receive_depth = 200;  // WRITEs with immediate consume receives

  // A QP in INIT with its receives posted (verbs: post_recv needs INIT or later).
  auto fresh_qp = [&] {
    auto q = check(pd->create_qp(qa), "create QP");
    QpModify init;
    init.state = QpState::init;
    init.access = access_local_write | access_remote_write;
    check(q->modify(init), "modify QP to INIT");
    for (uint32_t i = 0; i < receive_depth; ++i) check(q->post_recv(RecvWr{i, {}}), "post_recv");
    return q;
  };

  Remote local{mr->addr(), mr->rkey()}, remote{};
  std::vector<uint8_t> mine(sizeof local);
  std::memcpy(mine.data(), &local, sizeof local);
  std::shared_ptr<QueuePair> qp;
  std::shared_ptr<void> connection;  // rdma_cm: keeps the connection's id until the end
  if (is_server) {
    auto listener = check(cm::Listener::listen(o.bind, o.port, *cm::method_from_string(o.cm)), "listen");
    std::printf("# stellar_pingpong server: waiting on %s:%u (%s mode, %s provider)\n", o.bind.c_str(), listener->port(), o.mode.c_str(),
                o.provider.c_str());
    std::fflush(stdout);
    // A connection attempt that fails (a client that closes, a bad address)
    // costs that attempt only: the server waits for the next one, up to
    // --wait_client seconds in all.
    const auto give_up = Clock::now() + std::chrono::seconds(o.wait_client);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
      if (left.count() <= 0)
        fail("wait for client", Status(Errc::timeout, "no client connected within " + std::to_string(o.wait_client) + " s"));
      auto waited = listener->get_request(left);
      if (!waited && waited.status().code() == Errc::timeout)
        fail("wait for client", Status(Errc::timeout, "no client connected within " + std::to_string(o.wait_client) + " s"));
      auto request = check(std::move(waited), "wait for client");
      if (request->private_data().size() != sizeof remote) {
        (void)request->reject("expected a buffer description (address, rkey) as private data");
        std::fprintf(stderr, "stellar_pingpong: refused a client from %s: no buffer description\n", request->remote().address.c_str());
        continue;
      }
      auto candidate = fresh_qp();
      if (Status s = request->accept(*candidate, mine); !s.ok()) {
        std::fprintf(stderr, "stellar_pingpong: a connection attempt from %s failed (%s); waiting for the next\n",
                     request->remote().address.c_str(), s.to_string().c_str());
        continue;
      }
      std::memcpy(&remote, request->private_data().data(), sizeof remote);
      qp = candidate;
      connection = std::shared_ptr<cm::ConnectionRequest>(std::move(request));  // rdma_cm: the connection lives with it
      break;
    }
  } else {
    qp = fresh_qp();
    cm::ConnectOptions c;
    c.private_data = mine;
    c.timeout = std::chrono::seconds(20);
    c.method = *cm::method_from_string(o.cm);
    auto connected = check(cm::connect(o.server, o.port, *qp, c), "connect");
    if (connected.private_data.size() != sizeof remote) fail("handshake", Status(Errc::protocol_error, "peer sent no buffer description"));
    std::memcpy(&remote, connected.private_data.data(), sizeof remote);
    connection = connected.connection;
  }

  std::vector<WorkCompletion> wc(32);
  uint32_t received = 0, receives_consumed = 0, pending_sends = 0;
  auto drain = [&] {
    const int n = cq->poll(wc);
    for (int i = 0; i < n; ++i) {
      if (wc[size_t(i)].status != WcStatus::success) {
        std::fprintf(stderr, "stellar_pingpong: completion of wr %llu failed: %s\n", (unsigned long long)wc[size_t(i)].wr_id,
                     to_string(wc[size_t(i)].status));
        std::exit(1);
      }
      if (wc[size_t(i)].opcode == WcOpcode::recv_rdma_with_imm) {
        ++received;
        check(qp->post_recv(RecvWr{wc[size_t(i)].wr_id, {}}), "post_recv");
      } else {
        --pending_sends;
      }
    }
    return n > 0;
  };

  if (!is_server) {
    std::printf("---------------------------------------------------------------------------------------\n");
    std::printf(" RDMA_Write Latency Test (stellar_pingpong)  provider: %s  mode: %s  MTU: %u\n", o.provider.c_str(), o.mode.c_str(), o.mtu);
    accounting::print_tenant_line(context->options());
    std::printf("---------------------------------------------------------------------------------------\n");
    std::printf(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99%% percentile[usec]   99.9%% percentile[usec]\n");
  }
  const uint32_t total = o.warmup + o.iterations;
  const accounting::CpuSample cpu_from = accounting::sample(*context);
  double moved_bytes = 0, round_trips = 0;
  for (const uint32_t size : sizes) {
    // Messages up to one MTU: the last byte's marker says the message landed
    // (sizes only grow, so that byte was never written before). Larger ones
    // use the immediate: stellar mode may place packets out of order.
    const bool with_imm = size > o.mtu;
    Sge sge{reinterpret_cast<uint64_t>(outgoing.data()), size, out_mr->lkey()};
    SendWr wr;
    wr.opcode = with_imm ? WrOpcode::rdma_write_with_imm : WrOpcode::rdma_write;
    wr.sg_list = {&sge, 1};
    wr.remote_addr = remote.addr;
    wr.rkey = remote.rkey;
    wr.flags = send_signaled | (size <= 64 ? uint32_t(send_inline) : 0u);
    volatile uint8_t* last = &buffer[size - 1];
    // Receives count across sizes: the peer's first message of this size may
    // have completed while we drained our last send of the previous one.
    const uint32_t base = receives_consumed;
    if (with_imm) receives_consumed += total;
    auto wait_for = [&](uint32_t i) {
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      uint64_t spins = 0;
      for (;;) {
        if (with_imm ? received > base + i : *last == marker(i)) return;
        drain();
        if ((++spins & 0xfff) == 0 && Clock::now() > deadline) {
          std::fprintf(stderr, "stellar_pingpong: no %u-byte message %u from the peer within 10 s (peer gone?)\n", size, i);
          std::exit(1);
        }
      }
    };
    auto send = [&](uint32_t i) {
      outgoing[size - 1] = marker(i);
      wr.wr_id = i;
      wr.imm_data = i;
      while (pending_sends >= 200) drain();
      check(qp->post_send(wr), "post_send");
      ++pending_sends;
    };
    std::vector<double> rtt_us;
    rtt_us.reserve(o.iterations);
    for (uint32_t i = 0; i < total; ++i) {
      if (is_server) {
        wait_for(i);
        send(i);
      } else {
        const auto start = Clock::now();
        send(i);
        wait_for(i);
        if (i >= o.warmup) rtt_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      }
    }
    if (!is_server) print_row(size, rtt_us);
    moved_bytes += 2.0 * size * total;  // both directions
    round_trips += total;
  }
  // Our last message must reach the peer before we exit (a send completes
  // when the peer acknowledged it; a large one under loss takes a while),
  // and the last acknowledgements must cross (ours are delayed a few
  // microseconds to ride on data) so that neither side sees a dead peer.
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (pending_sends > 0) {
    drain();
    if (Clock::now() > give_up) {
      std::fprintf(stderr, "stellar_pingpong: the peer did not acknowledge our last message within 10 s (peer gone?)\n");
      return 1;
    }
  }
  const auto linger = Clock::now() + std::chrono::milliseconds(20);
  while (Clock::now() < linger) drain();

  if (!is_server) {
    std::printf("---------------------------------------------------------------------------------------\n");
    const ContextCounters c = context->counters();
    std::printf("# packets tx %llu rx %llu, retransmitted %llu (tail probes %llu, spurious %llu), timeouts %llu, duplicates received %llu, "
                "faults dropped %llu duplicated %llu reordered %llu\n",
                (unsigned long long)c.tx_packets, (unsigned long long)c.rx_packets, (unsigned long long)c.retransmitted_packets,
                (unsigned long long)c.tail_probes, (unsigned long long)c.spurious_retransmits, (unsigned long long)c.timeouts,
                (unsigned long long)c.rx_duplicates, (unsigned long long)c.fault_dropped, (unsigned long long)c.fault_duplicated,
                (unsigned long long)c.fault_reordered);
  }
  accounting::print(stdout, *context, cpu_from, accounting::sample(*context), moved_bytes, round_trips);
  return 0;
}

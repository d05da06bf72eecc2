// perftest-compatible benchmark programs: stellar_{write,read,send}_{lat,bw}
// and stellar_atomic_lat are this one source, compiled with
// STELLAR_PERFTEST_OP (0 write, 1 read, 2 send, 3 atomic) and
// STELLAR_PERFTEST_BW (0 latency, 1 bandwidth). Invoked as perftest is: the
// server runs without a host, the client with the server's address; both
// sides must be given the same -s/-a/-n/-q.
//
// Latency: WRITE and SEND are ping-pongs reporting one-way time (RTT/2);
// READ and atomics report the full round trip, as perftest does. WRITE
// detects arrival by polling the last byte up to one MTU and by WRITE with
// immediate above it (the stellar mode may place packets out of order).
// Bandwidth: the client keeps -t operations in flight over -q QPs; the
// server serves until the client's final SEND says it is done.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "cpu_accounting.hpp"
#include "tenant_line.hpp"
#include "stellar/stellar.hpp"

#ifndef STELLAR_PERFTEST_OP
#define STELLAR_PERFTEST_OP 0
#endif
#ifndef STELLAR_PERFTEST_BW
#define STELLAR_PERFTEST_BW 0
#endif

using namespace stellar;
using Clock = std::chrono::steady_clock;

void print_counters(const ContextCounters& c);

namespace {

enum class Op { write, read, send, atomic };
constexpr Op op = Op(STELLAR_PERFTEST_OP);
constexpr bool bandwidth_test = STELLAR_PERFTEST_BW != 0;
constexpr uint32_t done_imm = 0xd09e;

const char* op_name() {
  switch (op) {
    case Op::write: return "RDMA_Write";
    case Op::read: return "RDMA_Read";
    case Op::send: return "Send";
    case Op::atomic: return "Atomic FETCH_AND_ADD";
  }
  return "?";
}

struct Options {
  std::string server, mode = "stellar", provider = "soft", bind = "127.0.0.1", out_json, cm = "tcp";
  uint16_t port = 18515;
  uint16_t udp_port = 0;  // 0: the provider picks (roce mode tries 4791); a fixed one pins the ECMP path on a testbed
  uint64_t size = bandwidth_test ? 65536 : 2;
  bool all = false, report_gbits = false, counters = false;
  uint32_t iterations = bandwidth_test ? 5000 : 1000;
  uint32_t duration = 0;  // seconds, bandwidth tests
  uint32_t qps = 1, tx_depth = 128, mtu = 0;  // mtu 0: automatic (ContextOptions::mtu)
  std::string cc = "auto";
  uint32_t cc_target_delay_us = 0;  // 0: the provider's default
  std::string wait = "busy";        // busy: spin on the CQ (perftest's way); adaptive: spin 50 us, then sleep
  uint32_t wait_client = 300;       // seconds the server waits for its clients to connect
  std::string tenant, hint;         // docs/scheduler.md
  uint64_t tx_rate = 0;             // bytes/s the flow scheduler shapes to (0: none)
};

struct Remote {
  uint64_t addr;
  uint32_t rkey;
};

[[noreturn]] void fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "perftest: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}
template <typename T>
T check(Result<T> r, const std::string& what) {
  if (!r) fail(what, r.status());
  return std::move(r).value();
}
void check(Status s, const std::string& what) {
  if (!s.ok()) fail(what, s);
}

struct Side {
  Options o;
  std::shared_ptr<Context> ctx;
  std::shared_ptr<ProtectionDomain> pd;
  std::shared_ptr<CompletionQueue> cq;
  std::vector<std::shared_ptr<QueuePair>> qps;
  std::vector<uint8_t> local, landing;  // local: what we send/read into; landing: what the peer writes
  std::unique_ptr<MemoryRegion> local_mr, landing_mr;
  std::vector<std::shared_ptr<void>> connections;  // rdma_cm: each connection's id, kept while the QPs run
  Remote remote{};
  bool peer_done = false;  // the end-of-run marker arrived (possibly while draining other work)
  uint64_t received = 0;           // latency runs: receive completions so far, every size
  uint64_t receives_consumed = 0;  // latency runs: receives the finished sizes' messages used
  std::vector<WorkCompletion> wc = std::vector<WorkCompletion>(64);

  // Polls once (adaptive: waits up to `timeout`, sleeping after the spin
  // time); fails the program on any error completion. Every adaptive wait
  // spins before it sleeps, so a loop that only needs to look around now and
  // then passes a long timeout: re-entering a 1 ms wait burns a spin per
  // millisecond, which an idle server or a client waiting on 1 MiB
  // completions would be charged for in the CPU accounting.
  int poll(std::vector<WorkCompletion>& out, std::chrono::milliseconds timeout = std::chrono::milliseconds(1)) {
    int n = 0;
    if (o.wait == "adaptive") {
      auto r = cq->wait(out, timeout);
      n = r.ok() ? *r : 0;
    } else {
      n = cq->poll(out);
    }
    for (int i = 0; i < n; ++i) {
      if (out[size_t(i)].status != WcStatus::success) {
        std::fprintf(stderr, "perftest: completion of wr %llu failed: %s\n", (unsigned long long)out[size_t(i)].wr_id,
                     to_string(out[size_t(i)].status));
        print_counters(ctx->counters());
        std::exit(1);
      }
      if (out[size_t(i)].has_imm && out[size_t(i)].imm_data == done_imm) peer_done = true;
    }
    return n;
  }
  void post_recv(QueuePair& qp, uint64_t id, uint32_t length) {
    Sge s{reinterpret_cast<uint64_t>(landing.data()), length, landing_mr->lkey()};
    check(qp.post_recv(RecvWr{id, {&s, length ? 1u : 0u}}), "post_recv");
  }
};

std::vector<uint64_t> sizes_of(const Options& o) {
  if (!o.all) return {o.size};
  std::vector<uint64_t> v;
  const uint64_t top = op == Op::atomic ? 8 : (1u << 23);
  for (uint64_t s = op == Op::atomic ? 8 : 2; s <= top; s *= 2) v.push_back(s);
  return v;
}

void setup(Side& side) {
  Options& o = side.o;
  ContextOptions co;
  co.provider = check(parse_provider(o.provider), "provider");
  co.mode = check(parse_mode(o.mode), "mode");
  co.bind_address = o.bind;
  if (o.cc == "none") co.congestion_control = CongestionControl::none;
  else if (o.cc == "dcqcn") co.congestion_control = CongestionControl::dcqcn;
  else if (o.cc == "swift") co.congestion_control = CongestionControl::swift;
  else if (o.cc != "auto") fail("--cc", Status(Errc::invalid_argument, "auto, none, dcqcn or swift"));
  if (o.cc_target_delay_us) co.cc_target_delay = std::chrono::microseconds(o.cc_target_delay_us);
  if (o.wait != "busy" && o.wait != "adaptive") fail("--wait", Status(Errc::invalid_argument, "busy or adaptive"));
  co.wait = o.wait == "adaptive" ? WaitPolicy::adaptive : WaitPolicy::busy_poll;
  co.udp_port = o.udp_port;
  co.mtu = o.mtu;
  co.tenant = o.tenant;
  if (!o.hint.empty()) co.hints = check(JobHints::parse(o.hint), "--hint");
  co.tx_rate_bytes_per_s = o.tx_rate;
  side.ctx = check(Context::open(co), "open context");
  side.o.mtu = side.ctx->options().mtu;  // the value chosen when automatic
  side.pd = check(side.ctx->allocate_pd(), "allocate PD");
  side.cq = check(side.ctx->create_cq(16384), "create CQ");
  const std::vector<uint64_t> sizes = sizes_of(o);
  const uint64_t largest = std::max<uint64_t>(8, *std::max_element(sizes.begin(), sizes.end()));
  side.local.assign(largest, 0x5a);
  side.landing.assign(largest, 0);
  const uint32_t all = access_local_write | access_remote_write | access_remote_read | access_remote_atomic;
  side.local_mr = check(side.pd->register_memory(side.local.data(), side.local.size(), all), "register");
  side.landing_mr = check(side.pd->register_memory(side.landing.data(), side.landing.size(), all), "register");
  Remote mine{side.landing_mr->addr(), side.landing_mr->rkey()};
  std::vector<uint8_t> blob(sizeof mine);
  std::memcpy(blob.data(), &mine, sizeof mine);
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = side.cq;
  qa.cap.max_send_wr = std::max<uint32_t>(o.tx_depth, 64);
  qa.cap.max_recv_wr = 1024;
  std::unique_ptr<cm::Listener> listener;
  if (o.server.empty()) {
    listener = check(cm::Listener::listen(o.bind, o.port, *cm::method_from_string(o.cm)), "listen");
    std::printf("# %s %s server on %s:%u, waiting for %u connection(s)\n", op_name(), bandwidth_test ? "BW" : "latency",
                o.bind.c_str(), listener->port(), o.qps);
    std::fflush(stdout);
  }
  // A QP in INIT with the receives the peer's SENDs and WRITEs with
  // immediate need, posted before connecting.
  auto fresh_qp = [&] {
    auto qp = check(side.pd->create_qp(qa), "create QP");
    QpModify init;
    init.state = QpState::init;
    check(qp->modify(init), "modify INIT");
    for (uint32_t r = 0; r < 512; ++r) side.post_recv(*qp, r, uint32_t(side.landing.size()));
    return qp;
  };
  const auto give_up = Clock::now() + std::chrono::seconds(o.wait_client);
  for (uint32_t i = 0; i < o.qps; ++i) {
    std::vector<uint8_t> theirs;
    std::shared_ptr<QueuePair> qp;
    if (listener) {
      // A failed connection attempt (a client that closes, a malformed
      // request) costs that attempt only; the server waits for the next.
      for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
        if (left.count() <= 0) fail("wait for client", Status(Errc::timeout, "no client connected within " + std::to_string(o.wait_client) + " s"));
        auto waited = listener->get_request(left);
        if (!waited && waited.status().code() == Errc::timeout)
          fail("wait for client", Status(Errc::timeout, "no client connected within " + std::to_string(o.wait_client) + " s"));
        auto request = check(std::move(waited), "wait for client");
        if (request->private_data().size() != sizeof(Remote)) {
          (void)request->reject("expected a buffer description (address, rkey) as private data");
          std::fprintf(stderr, "perftest: refused a client from %s: no buffer description\n", request->remote().address.c_str());
          continue;
        }
        auto candidate = fresh_qp();
        if (Status s = request->accept(*candidate, blob); !s.ok()) {
          std::fprintf(stderr, "perftest: a connection attempt from %s failed (%s); waiting for the next\n", request->remote().address.c_str(),
                       s.to_string().c_str());
          continue;
        }
        theirs = request->private_data();
        qp = candidate;
        side.connections.push_back(std::shared_ptr<cm::ConnectionRequest>(std::move(request)));
        break;
      }
    } else {
      qp = fresh_qp();
      cm::ConnectOptions c;
      c.private_data = blob;
      c.timeout = std::chrono::seconds(30);
      c.method = *cm::method_from_string(o.cm);
      auto connected = check(cm::connect(o.server, o.port, *qp, c), "connect");
      theirs = connected.private_data;
      side.connections.push_back(connected.connection);
    }
    if (theirs.size() != sizeof(Remote)) fail("handshake", Status(Errc::protocol_error, "peer sent no buffer description"));
    std::memcpy(&side.remote, theirs.data(), sizeof(Remote));
    side.qps.push_back(qp);
  }
}

SendWr make_wr(Side& side, Op kind, uint64_t size, Sge& sge) {
  SendWr wr;
  sge = Sge{reinterpret_cast<uint64_t>(side.local.data()), uint32_t(kind == Op::atomic ? 8 : size), side.local_mr->lkey()};
  wr.sg_list = {&sge, 1};
  wr.remote_addr = side.remote.addr;
  wr.rkey = side.remote.rkey;
  switch (kind) {
    case Op::write: wr.opcode = WrOpcode::rdma_write; break;
    case Op::read: wr.opcode = WrOpcode::rdma_read; break;
    case Op::send: wr.opcode = WrOpcode::send; break;
    case Op::atomic:
      wr.opcode = WrOpcode::atomic_fetch_add;
      wr.compare_add = 1;
      break;
  }
  return wr;
}

// Sends the end-of-run marker and waits for its completion.
void send_done(Side& side, QueuePair& qp) {
  SendWr wr;
  wr.opcode = WrOpcode::send_with_imm;
  wr.imm_data = done_imm;
  check(qp.post_send(wr), "post_send");
  for (int got = 0; got == 0;) {
    const int n = side.poll(side.wc);
    for (int i = 0; i < n; ++i) got += side.wc[size_t(i)].opcode == WcOpcode::send;
  }
}

// Serves one-sided traffic until the peer's end-of-run marker. One-sided
// traffic makes no completions here, so a client killed mid-run would leave
// the server waiting forever: a client that sends nothing at all (no
// request, no acknowledgement) for idle_limit is taken for dead. A probe of
// our own (a keepalive READ) was tried first and dropped: under loss, a
// READ-response flood to that very client fills its socket and the probe's
// retries run out while the client is alive.
void serve_until_done(Side& side) {
  constexpr auto idle_limit = std::chrono::seconds(10);
  // The verbs provider's packet counters are the port's (all traffic, or 0
  // where sysfs is unreadable): they say nothing about this client.
  const bool watch_client = side.o.provider == "soft";
  uint64_t last_rx = side.ctx->counters().rx_packets;
  auto last_heard = Clock::now(), next_check = last_heard + std::chrono::seconds(1);
  while (!side.peer_done) {
    const int n = side.poll(side.wc, std::chrono::milliseconds(100));  // the idle check runs once a second
    for (int i = 0; i < n; ++i) {
      const WorkCompletion& c = side.wc[size_t(i)];
      if (c.opcode == WcOpcode::recv || c.opcode == WcOpcode::recv_rdma_with_imm) {
        for (auto& qp : side.qps)
          if (qp->qp_num() == c.qp_num) side.post_recv(*qp, c.wr_id, uint32_t(side.landing.size()));
      }
    }
    const auto now = Clock::now();
    if (watch_client && now >= next_check) {
      next_check = now + std::chrono::seconds(1);
      const uint64_t rx = side.ctx->counters().rx_packets;
      if (rx != last_rx) {
        last_rx = rx;
        last_heard = now;
      } else if (now - last_heard >= idle_limit) {
        std::fprintf(stderr, "perftest: the client stopped answering: no packet from it for %lld s and no end-of-run marker; giving up\n",
                     (long long)idle_limit.count());
        print_counters(side.ctx->counters());
        std::exit(1);
      }
    }
  }
  const auto linger = Clock::now() + std::chrono::milliseconds(50);
  while (Clock::now() < linger) side.ctx->progress();
}

struct LatencyRow {
  uint64_t bytes;
  size_t iterations;
  double min, max, typical, avg, stdev, p99, p999;
};

LatencyRow summarize(uint64_t bytes, std::vector<double> t) {
  std::sort(t.begin(), t.end());
  double sum = 0, squares = 0;
  for (double v : t) sum += v;
  const double avg = sum / double(t.size());
  for (double v : t) squares += (v - avg) * (v - avg);
  auto pct = [&](double p) { return t[std::min(t.size() - 1, size_t(p / 100 * double(t.size())))]; };
  return {bytes, t.size(), t.front(), t.back(), t[t.size() / 2], avg, std::sqrt(squares / double(t.size())), pct(99), pct(99.9)};
}

// One latency run at `size`; returns per-iteration times in microseconds
// (client) or an empty vector (server).
std::vector<double> latency_run(Side& side, uint64_t size) {
  const bool client = !side.o.server.empty();
  QueuePair& qp = *side.qps[0];
  const uint32_t n = side.o.iterations + 100;  // 100 warm-up iterations
  std::vector<double> times;
  Sge sge;
  SendWr wr = make_wr(side, op, size, sge);
  wr.flags = send_signaled | (size <= 64 && (op == Op::write || op == Op::send) ? uint32_t(send_inline) : 0u);
  if (op == Op::read || op == Op::atomic) {
    if (!client) return times;  // passive side: the caller serves until done
    for (uint32_t i = 0; i < n; ++i) {
      const auto start = Clock::now();
      wr.wr_id = i;
      check(qp.post_send(wr), "post_send");
      for (int got = 0; got == 0;) got = side.poll(side.wc);
      if (i >= 100) times.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
    return times;
  }
  // Ping-pong: WRITE polls the last byte (or waits for the immediate), SEND waits for the receive.
  const bool by_imm = op == Op::send || size > side.o.mtu;
  if (op == Op::write && by_imm) wr.opcode = WrOpcode::rdma_write_with_imm;
  volatile uint8_t* last = &side.landing[size - 1];
  // Receives count across sizes: the peer's first message of the next size
  // may complete while this side still drains its last send of this one.
  uint64_t& received = side.received;
  uint32_t pending_sends = 0;
  auto drain = [&] {
    const int k = side.poll(side.wc);
    for (int j = 0; j < k; ++j) {
      const WorkCompletion& c = side.wc[size_t(j)];
      if (c.opcode == WcOpcode::recv || c.opcode == WcOpcode::recv_rdma_with_imm) {
        ++received;
        side.post_recv(qp, c.wr_id, uint32_t(side.landing.size()));
      } else {
        --pending_sends;
      }
    }
  };
  auto marker = [](uint32_t i) { return uint8_t(i % 255 + 1); };
  auto wait_for = [&](uint32_t i, uint64_t base) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (uint64_t spins = 0;; ++spins) {
      if (by_imm ? received > base : *last == marker(i)) return;
      drain();
      if ((spins & 0xfff) == 0 && Clock::now() > deadline) {
        print_counters(side.ctx->counters());
        fail("latency", Status(Errc::timeout, "no " + std::to_string(size) + "-byte message " + std::to_string(i) + " from the peer within 10 s (peer gone?)"));
      }
    }
  };
  auto send = [&](uint32_t i) {
    side.local[size - 1] = marker(i);
    wr.wr_id = i;
    while (pending_sends >= 32) drain();
    check(qp.post_send(wr), "post_send");
    ++pending_sends;
  };
  const uint64_t base = side.receives_consumed;
  if (by_imm) side.receives_consumed += n;
  for (uint32_t i = 0; i < n; ++i) {
    if (client) {
      const auto start = Clock::now();
      send(i);
      wait_for(i, base + i);
      if (i >= 100) times.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() / 2);
    } else {
      wait_for(i, base + i);
      send(i);
    }
  }
  while (pending_sends > 0) drain();
  return times;
}

struct BandwidthRow {
  uint64_t bytes, iterations;
  double peak_mib, avg_mib, msg_rate_mpps;
};

BandwidthRow bandwidth_run(Side& side, uint64_t size) {
  const Options& o = side.o;
  std::vector<SendWr> wrs(side.qps.size());
  std::vector<Sge> sges(side.qps.size());
  for (size_t q = 0; q < side.qps.size(); ++q) {
    wrs[q] = make_wr(side, op, size, sges[q]);
    wrs[q].flags = send_signaled;
  }
  const uint32_t depth_per_qp = std::max<uint32_t>(1, o.tx_depth / uint32_t(side.qps.size()));
  std::vector<uint32_t> in_flight(side.qps.size(), 0);
  uint64_t posted = 0, completed = 0;
  const auto start = Clock::now();
  const auto end_time = start + std::chrono::seconds(o.duration);
  auto window_start = start;
  uint64_t window_done = 0;
  double peak = 0;
  const uint64_t target = o.iterations;
  for (;;) {
    const bool more = o.duration ? Clock::now() < end_time : posted < target;
    for (size_t q = 0; more && q < side.qps.size(); ++q) {
      while (in_flight[q] < depth_per_qp && (o.duration || posted < target)) {
        wrs[q].wr_id = q;
        check(side.qps[q]->post_send(wrs[q]), "post_send");
        ++in_flight[q];
        ++posted;
      }
    }
    const int n = side.poll(side.wc, std::chrono::milliseconds(10));  // returns at the first completion
    for (int i = 0; i < n; ++i) {
      --in_flight[side.wc[size_t(i)].wr_id];
      ++completed;
      ++window_done;
    }
    const auto now = Clock::now();
    if (now - window_start >= std::chrono::milliseconds(20)) {
      peak = std::max(peak, double(window_done * size) / (1 << 20) / std::chrono::duration<double>(now - window_start).count());
      window_start = now;
      window_done = 0;
    }
    if (!more && completed == posted) break;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double avg = double(completed * size) / (1 << 20) / seconds;
  return {size, completed, std::max(peak, avg), avg, double(completed) / seconds / 1e6};
}

}  // namespace

void print_counters(const ContextCounters& c) {
  std::fprintf(stderr,
               "counters: tx %llu packets %llu bytes, rx %llu packets %llu bytes, retransmitted %llu, timeouts %llu, tail probes %llu, "
               "duplicates %llu, dropped: malformed %llu unknown-qp %llu out-of-window %llu bad-token %llu full %llu, access errors %llu, "
               "RNR NAKs sent %llu, injected drops %llu, send errors %llu, received into place %llu (misses %llu), receive calls %llu\n",
               (unsigned long long)c.tx_packets, (unsigned long long)c.tx_bytes, (unsigned long long)c.rx_packets, (unsigned long long)c.rx_bytes,
               (unsigned long long)c.retransmitted_packets, (unsigned long long)c.timeouts, (unsigned long long)c.tail_probes,
               (unsigned long long)c.rx_duplicates, (unsigned long long)c.rx_dropped_malformed, (unsigned long long)c.rx_dropped_unknown_qp,
               (unsigned long long)c.rx_dropped_out_of_window, (unsigned long long)c.rx_dropped_bad_token,
               (unsigned long long)c.rx_requests_dropped_full, (unsigned long long)c.rx_access_errors, (unsigned long long)c.rnr_naks_sent,
               (unsigned long long)c.fault_dropped, (unsigned long long)c.send_errors, (unsigned long long)c.rx_placed,
               (unsigned long long)c.rx_placement_misses, (unsigned long long)c.rx_receive_calls);
}

int main(int argc, char** argv) {
  Options o;
  CLI::App app{std::string("Stellar ") + op_name() + (bandwidth_test ? " bandwidth" : " latency") + " test (perftest style)"};
  app.add_option("server", o.server, "Server address (omit to run as the server)");
  app.add_option("-p,--port", o.port, "Connection manager TCP port")->capture_default_str();
  app.add_option("-s,--size", o.size, "Message size in bytes")->capture_default_str()->check(CLI::Range(uint64_t(1), uint64_t(1) << 26));
  app.add_flag("-a,--all", o.all, "Run sizes 2 to 2^23 bytes");
  app.add_option("-n,--iters", o.iterations, "Iterations per size")->capture_default_str()->check(CLI::Range(1u, 100'000'000u));
  if (bandwidth_test) app.add_option("-D,--duration", o.duration, "Run each size for this many seconds instead of -n");
  app.add_option("-q,--qp", o.qps, "Queue pairs (bandwidth tests spread over them)")->capture_default_str()->check(CLI::Range(1u, 64u));
  app.add_option("-t,--tx-depth", o.tx_depth, "Operations kept in flight (bandwidth)")->capture_default_str()->check(CLI::Range(1u, 4096u));
  app.add_option("-m,--mtu", o.mtu, "Payload bytes per packet (0: the largest the interface carries, as perftest's default)")
      ->capture_default_str()
      ->check(CLI::Range(0u, stellar::max_mtu));
  app.add_option("--wait_client", o.wait_client, "Server: seconds to wait for the client's connections")->capture_default_str()->check(CLI::Range(1u, 86400u));
  app.add_flag("--report_gbits", o.report_gbits, "Report bandwidth in Gbit/s");
  app.add_option("--wait", o.wait, "busy (spin on the CQ, as perftest) or adaptive (spin 50 us, then sleep: for more processes than cores)");
  app.add_option("--cc", o.cc, "Soft provider congestion control: auto, none, dcqcn or swift");
  app.add_option("--cc_target_delay_us", o.cc_target_delay_us, "Swift's queueing-delay target (us; default the provider's)");
  app.add_flag("--counters", o.counters, "Print the transport's counters (retransmissions, timeouts, drops) to stderr at the end");
  app.add_option("--out_json", o.out_json, "Also write the results to this JSON file");
  app.add_option("--provider", o.provider)->check(CLI::IsMember({"soft", "verbs"}))->capture_default_str();
  app.add_option("--mode", o.mode)->check(CLI::IsMember({"stellar", "roce"}))->capture_default_str();
  app.add_option("--bind", o.bind, "Local IPv4 address")->capture_default_str();
  app.add_option("--cm", o.cm, "Connection method: tcp (every provider) or rdma_cm (librdmacm; verbs provider)")
      ->check(CLI::IsMember({"tcp", "rdma_cm"}))
      ->capture_default_str();
  app.add_option("--udp_port", o.udp_port, "Local UDP port of the soft provider (0: any; roce mode tries 4791)")->capture_default_str();
  app.add_option("--tenant", o.tenant, "Open the context as this tenant (its credential from STELLAR_TENANT_CREDENTIAL; docs/scheduler.md)");
  app.add_option("--hint", o.hint, "Job hints of the QPs: a kind (allreduce, all-to-all, parameter-fetch, kv-fetch, checkpoint, control) "
                 "or job=NAME,kind=KIND,priority=P,weight=W");
  app.add_option("--tx_rate", o.tx_rate, "Soft provider: bytes/s the flow scheduler shapes this process's transmissions to (0: none)");
  CLI11_PARSE(app, argc, argv);
  if (op == Op::atomic) o.size = 8;
  if (!bandwidth_test) o.qps = 1;

  Side side;
  side.o = o;
  setup(side);
  o.mtu = side.o.mtu;  // the value chosen when automatic
  const bool client = !o.server.empty();
  const bool passive_server = !client && (op != Op::send || bandwidth_test) && !(op == Op::write && !bandwidth_test);
  nlohmann::json results = nlohmann::json::array();

  if (client) {
    std::printf("---------------------------------------------------------------------------------------\n");
    std::printf("                    %s %s Test (Stellar)\n provider: %s  mode: %s  QPs: %u  MTU: %u\n", op_name(),
                bandwidth_test ? "BW" : "Latency", o.provider.c_str(), o.mode.c_str(), o.qps, o.mtu);
    accounting::print_tenant_line(side.ctx->options());
    std::printf("---------------------------------------------------------------------------------------\n");
    if (bandwidth_test)
      std::printf(" #bytes     #iterations    BW peak[%s]    BW average[%s]   MsgRate[Mpps]\n", o.report_gbits ? "Gb/sec" : "MiB/sec",
                  o.report_gbits ? "Gb/sec" : "MiB/sec");
    else
      std::printf(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99%% percentile[usec]   99.9%% percentile[usec]\n");
  }
  // CPU time of this process and of the engines, over the measured runs.
  const accounting::CpuSample cpu_from = accounting::sample(*side.ctx);
  double moved_bytes = 0, operations = 0;
  if (passive_server) {  // one-sided traffic, or SEND bandwidth (receives are reposted as they complete)
    serve_until_done(side);
    accounting::print(stdout, *side.ctx, cpu_from, accounting::sample(*side.ctx), 0, 0);
    if (o.counters) print_counters(side.ctx->counters());
    return 0;
  }
  for (uint64_t size : sizes_of(o)) {
    if (bandwidth_test) {
      BandwidthRow r = bandwidth_run(side, size);
      moved_bytes += double(r.bytes) * double(r.iterations);
      operations += double(r.iterations);
      const double scale = o.report_gbits ? double(1 << 20) * 8 / 1e9 : 1.0;
      std::printf(" %-10llu %-14llu %-19.2f %-21.2f %.6f\n", (unsigned long long)r.bytes, (unsigned long long)r.iterations,
                  r.peak_mib * scale, r.avg_mib * scale, r.msg_rate_mpps);
      results.push_back({{"bytes", r.bytes}, {"iterations", r.iterations}, {"bw_peak_mib", r.peak_mib}, {"bw_avg_mib", r.avg_mib},
                         {"msg_rate_mpps", r.msg_rate_mpps}});
    } else {
      std::vector<double> t = latency_run(side, size);
      moved_bytes += double(size) * double(t.size());
      operations += double(t.size());
      if (client) {
        LatencyRow r = summarize(size, std::move(t));
        std::printf(" %-7llu %-10zu %-14.2f %-14.2f %-16.2f %-14.2f %-15.2f %-22.2f %.2f\n", (unsigned long long)r.bytes, r.iterations,
                    r.min, r.max, r.typical, r.avg, r.stdev, r.p99, r.p999);
        results.push_back({{"bytes", r.bytes}, {"iterations", r.iterations}, {"t_min_us", r.min}, {"t_max_us", r.max},
                           {"t_typical_us", r.typical}, {"t_avg_us", r.avg}, {"t_stdev_us", r.stdev}, {"p99_us", r.p99},
                           {"p999_us", r.p999}});
      }
    }
    std::fflush(stdout);
  }
  const accounting::CpuSample cpu_to = accounting::sample(*side.ctx);
  if (client) {
    std::printf("---------------------------------------------------------------------------------------\n");
    accounting::print(stdout, *side.ctx, cpu_from, cpu_to, moved_bytes, operations);
    send_done(side, *side.qps[0]);
    if (!o.out_json.empty()) {
      nlohmann::json cpu{{"placement", to_string(side.ctx->options().progress)},
                         {"application_s", double(cpu_to.process_ns - cpu_from.process_ns) / 1e9},
                         {"engine_s", double(cpu_to.engine_ns - cpu_from.engine_ns) / 1e9},
                         {"bytes", moved_bytes},
                         {"operations", operations}};
      nlohmann::json doc{{"test", std::string(op_name()) + (bandwidth_test ? " BW" : " latency")}, {"provider", o.provider},
                         {"mode", o.mode}, {"qps", o.qps}, {"mtu", o.mtu}, {"results", results}, {"cpu", cpu}};
      std::ofstream(o.out_json) << doc.dump(2) << "\n";
    }
  } else {
    serve_until_done(side);  // write/send latency servers: wait for the final marker
    accounting::print(stdout, *side.ctx, cpu_from, accounting::sample(*side.ctx), moved_bytes, operations);
  }
  if (o.counters) print_counters(side.ctx->counters());
  return 0;
}

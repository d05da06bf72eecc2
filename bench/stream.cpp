// stellar_stream: a verified RDMA WRITE stream, for fabric tests and
// benchmarks (multipath failover, lossy or degraded spines, link flaps).
//
//   server: stellar_stream [-p PORT] [options]
//   client: stellar_stream SERVER [-s CHUNK] [-n CHUNKS | -D SECONDS] [options]
//
// The client writes chunk i (a pattern seeded by i) with RDMA WRITE with
// immediate i into slot i % slots of the server's ring; the server checks
// every byte against the pattern and answers with a credit (a SEND with
// immediate i), and only then may the client reuse the slot. So the stream
// is byte-exact end to end or the run fails, and a stall anywhere shows up
// as a gap between completions. The client reports goodput, the longest gap
// between chunk completions and the time spent in gaps longer than
// --stall_ms, beside the transport's counters; the server reports chunks
// verified and mismatches. Exit status 1 on any error completion, mismatch,
// or 30 s without progress.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <vector>

#include "stellar/stellar.hpp"

using namespace stellar;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string server;
  uint16_t port = 18600;
  uint32_t chunk = 1 << 20;
  uint64_t chunks = 1000;
  double duration = 0;
  uint32_t slots = 8;
  std::string mode = "stellar";
  std::string bind = "127.0.0.1";
  uint32_t mtu = 0;  // 0: automatic (ContextOptions::mtu)
  uint16_t paths = 0;  // 0: the context's default (ContextOptions, STELLAR_PATHS)
  std::string policy;
  double stall_ms = 10;
  double split = 0;  // client: goodput before and after this many seconds, apart
  uint64_t line_rate_mbps = 0;  // 0: the context's default (ContextOptions::line_rate_bps)
  uint16_t udp_port = 0;        // 0: any (roce mode tries 4791)
  uint32_t wait_client = 60;
  std::string out_json;
  bool per_path = false;
};

struct Remote {
  uint64_t addr;
  uint32_t rkey;
  uint32_t slots;
  uint32_t chunk;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "stellar_stream: %s\n", what.c_str());
  std::exit(1);
}
template <typename T>
T check(Result<T> r, const std::string& what) {
  if (!r) fail(what + ": " + r.status().to_string());
  return std::move(r).value();
}
void check(Status s, const std::string& what) {
  if (!s.ok()) fail(what + ": " + s.to_string());
}

// Chunk i's bytes: four interleaved xorshift64* generators seeded from i
// (never 0), one 8-byte word each in turn, produced piece by piece. Four
// independent chains run about four times as fast as one (a chain's steps
// depend on each other), so that making and checking the pattern keeps up
// with the transport better.
class Pattern {
 public:
  explicit Pattern(uint64_t i) {
    for (uint64_t lane = 0; lane < 4; ++lane) x_[lane] = (i + 1) * 0x9e3779b97f4a7c15ull + lane * 0xbf58476d1ce4e5b9ull;
    for (uint64_t& x : x_)
      if (x == 0) x = 1;
  }
  // The pattern's next `bytes` (a multiple of 32 but for a chunk's last piece).
  void next(uint8_t* p, uint32_t bytes) {
    uint32_t at = 0;
    for (; at + 32 <= bytes; at += 32)
      for (int lane = 0; lane < 4; ++lane) {
        const uint64_t v = step(x_[lane]);
        std::memcpy(p + at + 8 * lane, &v, 8);
      }
    for (int lane = 0; at < bytes; at += 8, ++lane) {
      const uint64_t v = step(x_[lane]);
      std::memcpy(p + at, &v, std::min<uint32_t>(8, bytes - at));
    }
  }

 private:
  static uint64_t step(uint64_t& x) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    return x * 0x2545f4914f6cdd1dull;
  }
  uint64_t x_[4];
};

// Both ends drive the transport only when they poll (inline progress). A
// 3 MB chunk's pattern made or checked in one go (with one generator, at
// about 3 GB/s) kept an end from polling for a millisecond, long enough for
// the other's burst to overflow its socket: 1 000 chunks of 3 MB took over
// a thousand retransmission timeouts. So the pattern is made and checked in
// pieces, with `between` (a CQ poll) after each.
constexpr uint32_t piece_bytes = 256u << 10;

template <typename Between>
void fill(uint8_t* p, uint32_t bytes, uint64_t i, Between&& between) {
  Pattern pattern(i);
  for (uint32_t at = 0; at < bytes; at += piece_bytes) {
    pattern.next(p + at, std::min(piece_bytes, bytes - at));
    between();
  }
}

template <typename Between>
bool matches(const uint8_t* p, uint32_t bytes, uint64_t i, std::vector<uint8_t>& scratch, Between&& between) {
  scratch.resize(piece_bytes);
  Pattern pattern(i);
  bool same = true;
  for (uint32_t at = 0; at < bytes; at += piece_bytes) {
    const uint32_t piece = std::min(piece_bytes, bytes - at);
    pattern.next(scratch.data(), piece);
    same = std::memcmp(p + at, scratch.data(), piece) == 0 && same;
    between();
  }
  return same;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Stellar verified RDMA WRITE stream (byte-exact, with stall accounting)"};
  app.add_option("server", o.server, "Server address (omit to run as the server)");
  app.add_option("-p,--port", o.port, "Connection manager TCP port")->capture_default_str();
  app.add_option("-s,--chunk", o.chunk, "Bytes per WRITE")->capture_default_str()->check(CLI::Range(8u, 1u << 26));
  app.add_option("-n,--chunks", o.chunks, "Chunks to write (client)")->capture_default_str()->check(CLI::Range(uint64_t(1), uint64_t(UINT32_MAX)));
  app.add_option("-D,--duration", o.duration, "Write for this many seconds instead of -n (client)")->check(CLI::Range(0.0, 86400.0));
  app.add_option("--slots", o.slots, "Server ring slots = chunks in flight")->capture_default_str()->check(CLI::Range(1u, 256u));
  app.add_option("--mode", o.mode)->check(CLI::IsMember({"stellar", "roce"}))->capture_default_str();
  app.add_option("--bind", o.bind, "Local IPv4 address")->capture_default_str();
  app.add_option("--mtu", o.mtu, "Payload bytes per packet (0: the largest the interface carries)")
      ->capture_default_str()
      ->check(CLI::Range(0u, stellar::max_mtu));
  app.add_option("--paths", o.paths, "Paths (UDP source ports) to spray over, stellar mode (default: the context's, 16)")
      ->check(CLI::Range(1, 256));
  app.add_option("--path_policy", o.policy, "oblivious, reps, two-choices or bandit (default: the context's)");
  app.add_option("--stall_ms", o.stall_ms, "Gaps between chunk completions longer than this count as stalled time")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 60000.0));
  app.add_option("--split", o.split, "Client: also report goodput before and after this many seconds (a fault injected then)")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--line_rate_mbps", o.line_rate_mbps,
                 "The NIC's line rate for rate-based congestion control (DCQCN, roce mode), Mbit/s (default: the context's)")
      ->check(CLI::Range(uint64_t(1), uint64_t(10'000'000)));
  app.add_option("--udp_port", o.udp_port,
                 "Local UDP port (0: any; roce mode tries 4791, which makes every run the same ECMP flow)")
      ->capture_default_str();
  app.add_option("--wait_client", o.wait_client, "Server: seconds to wait for a client")->capture_default_str()->check(CLI::Range(1u, 86400u));
  app.add_option("--out_json", o.out_json, "Client: also write the result to this JSON file");
  app.add_flag("--per_path", o.per_path, "Client: also print each path's counters (QueuePair::path_counters) at the end");
  CLI11_PARSE(app, argc, argv);
  const bool is_server = o.server.empty();

  ContextOptions co;
  co.mode = check(parse_mode(o.mode), "mode");
  co.bind_address = o.bind;
  co.udp_port = o.udp_port;
  co.mtu = o.mtu;
  if (o.paths) co.paths = o.paths;
  if (o.line_rate_mbps) co.line_rate_bps = o.line_rate_mbps * 1'000'000;
  if (!o.policy.empty()) co.path_policy = check(parse_path_policy(o.policy), "path policy");
  auto context = check(Context::open(co), "open context");
  auto pd = check(context->allocate_pd(), "allocate PD");
  auto cq = check(context->create_cq(4 * o.slots + 64), "create CQ");
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = cq;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 2 * o.slots + 16;
  auto qp = check(pd->create_qp(qa), "create QP");
  QpModify init;
  init.state = QpState::init;
  init.access = access_local_write | access_remote_write;
  check(qp->modify(init), "modify QP to INIT");
  for (uint32_t i = 0; i < 2 * o.slots + 8; ++i) check(qp->post_recv(RecvWr{i, {}}), "post_recv");

  // Server: the ring the client writes into. Client: one source buffer per slot.
  std::vector<uint8_t> ring(size_t(o.slots) * o.chunk);
  auto mr = check(pd->register_memory(ring.data(), ring.size(), access_local_write | access_remote_write), "register memory");
  Remote local{mr->addr(), mr->rkey(), o.slots, o.chunk}, remote{};
  std::vector<uint8_t> mine(sizeof local);
  std::memcpy(mine.data(), &local, sizeof local);
  std::shared_ptr<void> connection;
  if (is_server) {
    auto listener = check(cm::Listener::listen(o.bind, o.port, cm::Method::tcp), "listen");
    std::printf("# stellar_stream server: waiting on %s:%u (%s mode)\n", o.bind.c_str(), listener->port(), o.mode.c_str());
    std::fflush(stdout);
    auto request = check(listener->get_request(std::chrono::seconds(o.wait_client)), "wait for client");
    if (request->private_data().size() != sizeof remote) fail("the client sent no stream description");
    std::memcpy(&remote, request->private_data().data(), sizeof remote);
    if (remote.slots != o.slots || remote.chunk != o.chunk) {
      (void)request->reject("slots and chunk size must match the server's");
      fail("the client's --slots/--chunk differ from the server's");
    }
    check(request->accept(*qp, mine), "accept");
    connection = std::shared_ptr<cm::ConnectionRequest>(std::move(request));
  } else {
    cm::ConnectOptions c;
    c.private_data = mine;
    c.timeout = std::chrono::seconds(20);
    auto connected = check(cm::connect(o.server, o.port, *qp, c), "connect");
    if (connected.private_data.size() != sizeof remote) fail("the server sent no ring description");
    std::memcpy(&remote, connected.private_data.data(), sizeof remote);
    connection = connected.connection;
  }

  std::vector<WorkCompletion> wc(64);
  std::vector<uint8_t> scratch;
  auto completion_failed = [&](const WorkCompletion& w) {
    // What the transport went through, for whoever reads the failure.
    const ContextCounters c = context->counters();
    fail(std::string("completion of wr ") + std::to_string(w.wr_id) + " failed: " + to_string(w.status) + " (tx " +
         std::to_string(c.tx_packets) + " rx " + std::to_string(c.rx_packets) + " packets, retransmitted " +
         std::to_string(c.retransmitted_packets) + ", timeouts " + std::to_string(c.timeouts) + ", tail probes " +
         std::to_string(c.tail_probes) + ", paths retired " + std::to_string(c.paths_retired) + ", spurious " +
         std::to_string(c.spurious_retransmits) + ", send errors " + std::to_string(c.send_errors) + ")");
  };
  const auto progress_limit = std::chrono::seconds(30);
  // Completions polled while a chunk's pattern is made or checked, each
  // with when it was found.
  std::deque<std::pair<WorkCompletion, Clock::time_point>> pending;
  auto pump = [&] {
    const int n = cq->poll(wc);
    const auto now = Clock::now();
    for (int k = 0; k < n; ++k) pending.emplace_back(wc[size_t(k)], now);
  };

  if (is_server) {
    uint64_t verified = 0, mismatches = 0, credits_out = 0;
    auto last_progress = Clock::now();
    Sge none{0, 0, 0};
    for (;;) {
      // Completions found while checking a chunk (pump) wait their turn.
      pump();
      const size_t n = pending.size();
      for (size_t k = 0; k < n; ++k) {
        const WorkCompletion w = pending.front().first;
        pending.pop_front();
        if (w.status != WcStatus::success) completion_failed(w);
        if (w.opcode == WcOpcode::send) {
          --credits_out;
          continue;
        }
        check(qp->post_recv(RecvWr{w.wr_id, {}}), "post_recv");
        last_progress = Clock::now();
        if (w.opcode != WcOpcode::recv_rdma_with_imm) {  // the client's "done"
          const ContextCounters c = context->counters();
          std::printf("stream server: verified %llu chunks (%llu bytes), mismatches %llu; retransmitted %llu timeouts %llu tail_probes %llu "
                      "paths_retired %llu migrations %llu migrations_rejected %llu address_changes %llu congestion_marks %llu "
                      "path_mtu_probes %llu path_mtu_lowered %llu\n",
                      (unsigned long long)verified, (unsigned long long)(verified * o.chunk), (unsigned long long)mismatches,
                      (unsigned long long)c.retransmitted_packets, (unsigned long long)c.timeouts, (unsigned long long)c.tail_probes,
                      (unsigned long long)c.paths_retired, (unsigned long long)c.migrations,
                      (unsigned long long)c.migrations_rejected, (unsigned long long)c.address_changes,
                      (unsigned long long)c.rx_congestion_marks, (unsigned long long)c.path_mtu_probes,
                      (unsigned long long)c.path_mtu_lowered);
          const auto linger = Clock::now() + std::chrono::milliseconds(200);
          while (Clock::now() < linger) cq->poll(wc);  // let our last credits' acknowledgements cross
          return mismatches ? 1 : 0;
        }
        const uint64_t i = w.imm_data;  // the low 32 bits of the chunk index
        const uint8_t* slot = ring.data() + size_t(i % o.slots) * o.chunk;
        if (!matches(slot, o.chunk, i, scratch, pump)) {
          ++mismatches;
          std::fprintf(stderr, "stellar_stream: chunk %llu is not what was written\n", (unsigned long long)i);
        }
        ++verified;
        SendWr credit;
        credit.wr_id = i;
        credit.opcode = WrOpcode::send_with_imm;
        credit.imm_data = uint32_t(i);
        credit.sg_list = {&none, 0};
        credit.flags = send_signaled;
        check(qp->post_send(credit), "post credit");
        ++credits_out;
      }
      if (n == 0 && pending.empty() && Clock::now() - last_progress > progress_limit) fail("no chunk for 30 s (client gone?)");
    }
  }

  // Client.
  std::vector<uint8_t> source(size_t(o.slots) * o.chunk);
  auto smr = check(pd->register_memory(source.data(), source.size(), access_local_write), "register memory");
  const bool timed = o.duration > 0;
  const uint64_t total = timed ? UINT64_MAX : o.chunks;
  uint64_t posted = 0, written = 0, credited = 0;
  // When each chunk was posted, by chunk index modulo its size: a credit may
  // come back before the WRITE's own completion, so more chunks than slots
  // can be awaiting completion (bounded below).
  constexpr uint64_t post_ring = 4096;
  std::vector<double> post_s(post_ring);
  std::vector<double> latency_ms;       // each chunk: post to WRITE completion
  uint64_t before_split = 0;            // chunks completed before --split
  const auto start = Clock::now();
  const auto end_by = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration));
  auto last_progress = start;
  double longest_gap = 0, stalled = 0, previous = 0;
  // Done when every chunk is both acknowledged (its WRITE completed) and
  // verified (its credit came back): either may come first.
  while (credited < posted || written < posted || posted < total) {
    if (timed && posted == credited && written == posted && Clock::now() >= end_by) break;
    // A slot is free once the server verified what it held.
    while (posted < total && posted - credited < o.slots && posted - written < post_ring && !(timed && Clock::now() >= end_by)) {
      uint8_t* p = source.data() + size_t(posted % o.slots) * o.chunk;
      fill(p, o.chunk, posted, pump);
      Sge s{reinterpret_cast<uint64_t>(p), o.chunk, smr->lkey()};
      SendWr wr;
      wr.wr_id = posted;
      wr.opcode = WrOpcode::rdma_write_with_imm;
      wr.imm_data = uint32_t(posted);
      wr.sg_list = {&s, 1};
      wr.remote_addr = remote.addr + (posted % o.slots) * o.chunk;
      wr.rkey = remote.rkey;
      wr.flags = send_signaled;
      check(qp->post_send(wr), "post WRITE");
      post_s[posted % post_ring] = std::chrono::duration<double>(Clock::now() - start).count();
      ++posted;
    }
    pump();
    const size_t n = pending.size();
    for (size_t k = 0; k < n; ++k) {
      const auto [w, now] = pending.front();
      pending.pop_front();
      if (w.status != WcStatus::success) completion_failed(w);
      if (w.opcode == WcOpcode::rdma_write) {
        ++written;
        const double t = std::chrono::duration<double>(now - start).count();
        const double gap = t - previous;
        longest_gap = std::max(longest_gap, gap);
        if (gap * 1000 > o.stall_ms) stalled += gap;
        previous = t;
        last_progress = now;
        latency_ms.push_back((t - post_s[w.wr_id % post_ring]) * 1000);
        if (o.split > 0 && t < o.split) ++before_split;
      } else if (w.opcode == WcOpcode::recv || w.opcode == WcOpcode::recv_rdma_with_imm) {
        ++credited;
        check(qp->post_recv(RecvWr{w.wr_id, {}}), "post_recv");
      }
    }
    if (n == 0 && Clock::now() - last_progress > progress_limit) fail("no progress for 30 s (server gone?)");
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // "Done": a SEND without immediate; the server prints its verdict.
  {
    Sge none{0, 0, 0};
    SendWr done;
    done.wr_id = ~0ull;
    done.opcode = WrOpcode::send;
    done.sg_list = {&none, 0};
    done.flags = send_signaled;
    check(qp->post_send(done), "post done");
    const auto give_up = Clock::now() + std::chrono::seconds(10);
    for (bool sent = false; !sent;) {
      const int n = cq->poll(wc);
      for (int k = 0; k < n; ++k) {
        if (wc[size_t(k)].status != WcStatus::success) completion_failed(wc[size_t(k)]);
        if (wc[size_t(k)].wr_id == ~0ull && wc[size_t(k)].opcode == WcOpcode::send) sent = true;
      }
      if (Clock::now() > give_up) fail("the server did not take the final message within 10 s");
    }
  }
  const ContextCounters c = context->counters();
  const double bytes = double(written) * o.chunk;
  std::sort(latency_ms.begin(), latency_ms.end());
  auto pct = [&](double p) { return latency_ms.empty() ? 0.0 : latency_ms[std::min(latency_ms.size() - 1, size_t(p * double(latency_ms.size())))]; };
  const double p50 = pct(0.5), p99 = pct(0.99);
  // Goodput before and after --split (seconds since the start).
  const double before_gbs = o.split > 0 ? double(before_split) * o.chunk / std::min(o.split, seconds) / 1e9 : 0;
  const double after_gbs = o.split > 0 && seconds > o.split ? double(written - before_split) * o.chunk / (seconds - o.split) / 1e9 : 0;
  const char* policy = to_string(co.path_policy);
  std::printf("stream: mode %s paths %u policy %s chunk %u chunks %llu bytes %.0f seconds %.3f goodput %.4f GB/s longest_gap_ms %.3f "
              "stalled_ms %.3f stalled_fraction %.5f chunk_p50_ms %.3f chunk_p99_ms %.3f before_split %.4f after_split %.4f "
              "retransmitted %llu timeouts %llu tail_probes %llu paths_retired %llu spurious %llu migrations %llu "
              "address_changes %llu move_to_ack_ms %.3f congestion_marks %llu path_mtu_probes %llu path_mtu_lowered %llu "
              "path_mtu_sizing_ms %.3f tx_packets %llu tx_bytes %llu local %s\n",
              o.mode.c_str(), o.mode == "roce" ? 1u : unsigned(co.paths), policy, o.chunk, (unsigned long long)written, bytes, seconds,
              bytes / seconds / 1e9, longest_gap * 1000, stalled * 1000, stalled / seconds, p50, p99, before_gbs, after_gbs,
              (unsigned long long)c.retransmitted_packets,
              (unsigned long long)c.timeouts, (unsigned long long)c.tail_probes, (unsigned long long)c.paths_retired,
              (unsigned long long)c.spurious_retransmits, (unsigned long long)c.migrations,
              (unsigned long long)c.address_changes, double(c.last_address_change_ns) / 1e6,
              (unsigned long long)c.rx_congestion_marks, (unsigned long long)c.path_mtu_probes,
              (unsigned long long)c.path_mtu_lowered, double(c.path_mtu_last_ns) / 1e6, (unsigned long long)c.tx_packets,
              (unsigned long long)c.tx_bytes,
              context->local_address().c_str());
  // Where the packets went: one line a path, for a run that stalled or
  // lost (which spine dropped, marked or was retired).
  nlohmann::json per_path = nlohmann::json::array();
  if (o.per_path) {
    auto paths = qp->path_counters();
    if (!paths) {
      std::printf("# per path: %s\n", paths.status().to_string().c_str());
    } else {
      std::printf("# path     sent    acked     lost   marked retired(now) srtt_us min_rtt_us  loss_rate  mark_rate\n");
      for (const PathCounters& p : *paths) {
        std::printf("%6u %8llu %8llu %8llu %8llu %4llu(%s) %9.1f %10.1f %10.4f %10.4f\n", unsigned(p.path),
                    (unsigned long long)p.sent_packets, (unsigned long long)p.acknowledged_packets, (unsigned long long)p.lost_packets,
                    (unsigned long long)p.marked_packets, (unsigned long long)p.retirements, p.retired ? "yes" : "no",
                    double(p.srtt_ns) / 1e3, double(p.min_rtt_ns) / 1e3, p.loss_rate, p.mark_rate);
        per_path.push_back({{"path", p.path}, {"sent", p.sent_packets}, {"acknowledged", p.acknowledged_packets},
                            {"lost", p.lost_packets}, {"marked", p.marked_packets}, {"retirements", p.retirements},
                            {"retired", p.retired}, {"srtt_ns", p.srtt_ns}, {"min_rtt_ns", p.min_rtt_ns},
                            {"loss_rate", p.loss_rate}, {"mark_rate", p.mark_rate}});
      }
    }
  }
  if (!o.out_json.empty()) {
    nlohmann::json j{{"mode", o.mode},
                     {"paths", o.mode == "roce" ? 1 : co.paths},
                     {"policy", policy},
                     {"chunk", o.chunk},
                     {"chunks", written},
                     {"seconds", seconds},
                     {"goodput_gbs", bytes / seconds / 1e9},
                     {"longest_gap_ms", longest_gap * 1000},
                     {"stalled_ms", stalled * 1000},
                     {"stalled_fraction", stalled / seconds},
                     {"chunk_p50_ms", p50},
                     {"chunk_p99_ms", p99},
                     {"goodput_before_split_gbs", before_gbs},
                     {"goodput_after_split_gbs", after_gbs},
                     {"retransmitted", c.retransmitted_packets},
                     {"timeouts", c.timeouts},
                     {"paths_retired", c.paths_retired},
                     {"address_changes", c.address_changes},
                     {"move_to_ack_ms", double(c.last_address_change_ns) / 1e6},
                     {"local_address", context->local_address()}};
    if (o.per_path) j["per_path"] = per_path;
    std::ofstream(o.out_json) << j.dump(2) << "\n";
  }
  return 0;
}

// stellar_allreduce: an nccl-tests-compatible allreduce benchmark and checker
// (all_reduce_perf's options and output) over Stellar's communicator.
//
//   stellar_allreduce -N 4 -b 8 -e 64M -f 2              # 4 local ranks (forked)
//   mpirun -np 4 stellar_allreduce -b 8 -e 64M -f 2      # Open MPI's environment
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 stellar_allreduce ...
//
// Columns as nccl-tests: size (B), count (elements), type, redop, then for
// out-of-place and in-place: time (us, the ranks' average), algbw = size /
// time (GB/s, 1e9), busbw = algbw * 2(n-1)/n, #wrong (values that differ
// from the serial reference, summed over ranks; -c 0 skips the check).
// Exits non-zero if any value is wrong or a call fails.
#include <CLI/CLI.hpp>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_accounting.hpp"
#include "stellar/coll.hpp"

using namespace stellar;
using namespace stellar::coll;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string min_bytes = "32M", max_bytes = "32M", step_bytes = "1M";
  double step_factor = 1;
  int iterations = 20, warmup = 5, check = 1;
  std::string type = "float", op = "sum";
  int local_ranks = 0;
  std::string mode = "stellar", provider = "soft", algorithm = "auto";
  std::string chunk = "512K";
  unsigned qps = 1;
  std::string cc = "auto";
  uint64_t line_rate_mbps = 0;  // 0: the context's default (ContextOptions::line_rate_bps)
  int timeout_ms = 30000;
  std::string wait = "auto";
  bool verbose = false;
  bool no_shm = false;
  bool no_direct = false;
  bool direct_gather = true;  // what the ranks run with (the header says it)
  uint32_t mtu = 0;  // payload bytes per packet; 0: the context's default
  std::string tenant, hint;  // docs/scheduler.md
  uint64_t tx_rate = 0;      // bytes/s the flow scheduler shapes each rank to (0: none)
};

Result<size_t> parse_size(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || v < 0) return Status(Errc::invalid_argument, "bad size '" + text + "'");
  double scale = 1;
  switch (*end) {
    case 'K': case 'k': scale = 1024; ++end; break;
    case 'M': case 'm': scale = 1024.0 * 1024; ++end; break;
    case 'G': case 'g': scale = 1024.0 * 1024 * 1024; ++end; break;
    default: break;
  }
  if (*end == 'B' || *end == 'b') ++end;
  if (*end) return Status(Errc::invalid_argument, "bad size '" + text + "'");
  return size_t(v * scale);
}

[[noreturn]] void die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "stellar_allreduce: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(2);
}

// Inputs as nccl-tests would check them: small integers, exact in every
// type, so the expected result is exact too (up to 16-bit rounding of avg).
double input(int rank, size_t i) { return double((rank * 7 + i * 3) % 5 + 1); }

void store(DataType t, void* b, size_t i, double v) {
  switch (t) {
    case DataType::float32: static_cast<float*>(b)[i] = float(v); break;
    case DataType::float64: static_cast<double*>(b)[i] = v; break;
    case DataType::int32: static_cast<int32_t*>(b)[i] = int32_t(v); break;
    case DataType::int64: static_cast<int64_t*>(b)[i] = int64_t(v); break;
    case DataType::uint8: static_cast<uint8_t*>(b)[i] = uint8_t(v); break;
    case DataType::int8: static_cast<int8_t*>(b)[i] = int8_t(v); break;
    case DataType::float16: {  // small integers: exact, no rounding needed
      const uint16_t h = v == 0 ? 0 : uint16_t(((int(std::log2(v)) + 15) << 10) | uint16_t((v / std::exp2(int(std::log2(v))) - 1) * 1024));
      static_cast<uint16_t*>(b)[i] = h;
      break;
    }
    case DataType::bfloat16: {
      float f = float(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      static_cast<uint16_t*>(b)[i] = uint16_t(u >> 16);  // exact for small integers
      break;
    }
  }
}

double load(DataType t, const void* b, size_t i) {
  switch (t) {
    case DataType::float32: return static_cast<const float*>(b)[i];
    case DataType::float64: return static_cast<const double*>(b)[i];
    case DataType::int32: return static_cast<const int32_t*>(b)[i];
    case DataType::int64: return double(static_cast<const int64_t*>(b)[i]);
    case DataType::uint8: return static_cast<const uint8_t*>(b)[i];
    case DataType::int8: return static_cast<const int8_t*>(b)[i];
    case DataType::float16: {
      const uint16_t h = static_cast<const uint16_t*>(b)[i];
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double mag = e == 0 ? m * std::exp2(-24) : e == 31 ? INFINITY : (1 + m / 1024.0) * std::exp2(e - 15);
      return h & 0x8000 ? -mag : mag;
    }
    case DataType::bfloat16: {
      const uint32_t u = uint32_t(static_cast<const uint16_t*>(b)[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
  }
  return 0;
}

double reference(ReduceOp op, DataType t, int world, size_t i) {
  double acc = input(0, i);
  for (int r = 1; r < world; ++r) {
    const double v = input(r, i);
    acc = op == ReduceOp::prod ? acc * v : op == ReduceOp::min ? std::min(acc, v) : op == ReduceOp::max ? std::max(acc, v) : acc + v;
  }
  if (op == ReduceOp::avg) acc = (t == DataType::int32 || t == DataType::int64) ? std::trunc(acc / world) : acc / world;
  return acc;
}

int64_t count_wrong(ReduceOp op, DataType t, int world, const void* b, size_t count) {
  const bool sixteen = t == DataType::float16 || t == DataType::bfloat16;
  int64_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const double want = reference(op, t, world, i), got = load(t, b, i);
    const double tolerance = sixteen ? 1e-2 * std::max(1.0, std::fabs(want)) : t == DataType::float32 ? 1e-6 * std::max(1.0, std::fabs(want)) : 0;
    if (!(std::fabs(got - want) <= tolerance)) ++wrong;
  }
  return wrong;
}

struct Measured {
  double time_us = 0;
  int64_t wrong = 0;
};

// `cpu` accumulates the CPU time of the allreduce calls (warm-up and timed),
// not of filling and checking the buffers: the accounting is the transport's
// and the collective's cost, and the test's own data work would only dilute it.
Measured measure(Communicator& comm, const Options& o, DataType t, ReduceOp op, size_t count, bool in_place, std::vector<uint8_t>& send,
                 std::vector<uint8_t>& recv, accounting::CpuSample& cpu) {
  const size_t e = size_of(t);
  auto fill = [&] {
    for (size_t i = 0; i < count; ++i) store(t, send.data(), i, input(comm.rank(), i));
  };
  void* out = in_place ? send.data() : recv.data();
  fill();
  auto run = [&] {
    if (Status s = comm.allreduce(send.data(), out, count, t, op); !s.ok()) die("allreduce", s);
  };
  const accounting::CpuSample cpu_from = accounting::sample(comm.counters().transport.engine_cpu_ns);
  for (int i = 0; i < o.warmup; ++i) run();
  if (Status s = comm.barrier(); !s.ok()) die("barrier", s);
  const auto start = Clock::now();
  for (int i = 0; i < o.iterations; ++i) run();
  double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / std::max(1, o.iterations);
  const accounting::CpuSample cpu_to = accounting::sample(comm.counters().transport.engine_cpu_ns);
  cpu.process_ns += cpu_to.process_ns - cpu_from.process_ns;
  cpu.engine_ns += cpu_to.engine_ns - cpu_from.engine_ns;
  Measured m;
  if (o.check) {
    fill();
    run();
    m.wrong = count_wrong(op, t, comm.size(), out, count);
  }
  (void)e;
  // The ranks' average time and total wrong values, as nccl-tests reports them.
  double time_sum = us;
  if (Status s = comm.allreduce(&time_sum, &time_sum, 1, DataType::float64, ReduceOp::sum); !s.ok()) die("allreduce", s);
  int64_t wrong = m.wrong;
  if (Status s = comm.allreduce(&wrong, &wrong, 1, DataType::int64, ReduceOp::sum); !s.ok()) die("allreduce", s);
  m.time_us = time_sum / comm.size();
  m.wrong = wrong;
  return m;
}

int run_rank(const Options& o, CommunicatorOptions co) {
  auto comm_result = Communicator::create(co);
  if (!comm_result) die("communicator", comm_result.status());
  Communicator& comm = **comm_result;
  const bool root = comm.rank() == 0;
  auto min_b = parse_size(o.min_bytes), max_b = parse_size(o.max_bytes), step_b = parse_size(o.step_bytes);
  if (!min_b || !max_b || !step_b) die("options", !min_b ? min_b.status() : !max_b ? max_b.status() : step_b.status());

  std::vector<DataType> types;
  std::vector<ReduceOp> ops;
  if (o.type == "all") types = {DataType::float32, DataType::float16, DataType::bfloat16, DataType::float64, DataType::int32, DataType::int64};
  else if (auto t = parse_data_type(o.type); t) types = {*t};
  else die("-d", t.status());
  if (o.op == "all") ops = {ReduceOp::sum, ReduceOp::prod, ReduceOp::max, ReduceOp::min, ReduceOp::avg};
  else if (auto p = parse_reduce_op(o.op); p) ops = {*p};
  else die("-o", p.status());

  if (root) {
    std::printf("# stellar_allreduce: nRanks %d minBytes %zu maxBytes %zu step: %s warmup iters: %d iters: %d validation: %d\n", comm.size(), *min_b,
                *max_b, o.step_factor > 1 ? (std::to_string(o.step_factor) + "(factor)").c_str() : (std::to_string(*step_b) + "(bytes)").c_str(),
                o.warmup, o.iterations, o.check);
    // The wait policy that runs, and why (the communicator counts the ranks
    // on this host at bootstrap: more than the CPUs means adaptive).
    const CommunicatorCounters c = comm.counters();
    const std::string wait = std::string(c.wait == WaitPolicy::busy_poll ? "busy" : "adaptive") + " (" + std::to_string(c.local_ranks) +
                             " ranks on this host, " + std::to_string(c.cpus) + " CPUs" +
                             (c.oversubscribed ? ": oversubscribed" : "") + (o.wait == "auto" ? "" : "; --wait " + o.wait) + ")";
    // Which pairs skip the network (ranks on this host, unless turned off).
    const std::string shm = comm.size() == 1 ? "none (one rank)"
                            : c.shared_memory_peers > 0
                                ? std::to_string(c.shared_memory_peers) + " of " + std::to_string(comm.size() - 1) + " peers (rank 0; " +
                                      std::to_string(c.shared_memory_single_copy_peers) + " single-copy)"
                                : std::string(o.no_shm ? "off (--no-shm)" : "off (no peer on this host could share it)");
    std::printf("# transport: provider %s, mode %s, cc %s, wait %s, algorithm %s, chunk %s, qps per peer %u, shared memory %s, direct gather %s\n#\n",
                o.provider.c_str(), o.mode.c_str(), o.cc.c_str(), wait.c_str(), o.algorithm.c_str(), o.chunk.c_str(), o.qps, shm.c_str(),
                o.direct_gather ? "on" : "off");
    std::printf("#                                              out-of-place                       in-place          \n");
    std::printf("#       size         count      type   redop     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
    std::printf("#        (B)    (elements)                       (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       \n");
    std::fflush(stdout);
  }
  accounting::CpuSample cpu_spent;  // the allreduce calls' CPU, summed over every measure()
  double reduced_bytes = 0, calls = 0;  // per allreduce call: its buffer's bytes
  std::vector<uint8_t> send, recv;
  double busbw_sum = 0;
  int results = 0;
  int64_t wrong_total = 0;
  const double bus_factor = comm.size() > 1 ? 2.0 * (comm.size() - 1) / comm.size() : 0;
  for (DataType t : types) {
    for (ReduceOp op : ops) {
      for (size_t bytes = *min_b; bytes <= *max_b;) {
        const size_t count = bytes / size_of(t);
        const size_t real = count * size_of(t);
        send.assign(real + 64, 0);
        recv.assign(real + 64, 0);
        Measured out_of_place = measure(comm, o, t, op, count, false, send, recv, cpu_spent);
        Measured in_place = measure(comm, o, t, op, count, true, send, recv, cpu_spent);
        calls += 2.0 * (o.warmup + o.iterations);
        reduced_bytes += 2.0 * (o.warmup + o.iterations) * double(real);
        if (root) {
          auto bw = [&](double us) { return us > 0 ? double(real) / (us * 1e-6) / 1e9 : 0.0; };
          const double a1 = bw(out_of_place.time_us), a2 = bw(in_place.time_us);
          std::printf("%12zu  %12zu  %8s  %6s  %7.2f  %6.2f  %6.2f  %5s  %7.2f  %6.2f  %6.2f  %5s\n", real, count, to_string(t), to_string(op),
                      out_of_place.time_us, a1, a1 * bus_factor, o.check ? std::to_string(out_of_place.wrong).c_str() : "N/A", in_place.time_us, a2,
                      a2 * bus_factor, o.check ? std::to_string(in_place.wrong).c_str() : "N/A");
          std::fflush(stdout);
          busbw_sum += a1 * bus_factor + a2 * bus_factor;
          results += 2;
        }
        wrong_total += out_of_place.wrong + in_place.wrong;
        const size_t next = o.step_factor > 1 ? size_t(double(bytes) * o.step_factor) : bytes + *step_b;
        if (next <= bytes) break;
        bytes = next;
      }
    }
  }
  if (root) {
    std::printf("# Out of bounds values : %lld %s\n", (long long)wrong_total, wrong_total ? "FAILED" : "OK");
    std::printf("# Avg bus bandwidth    : %g \n", results ? busbw_sum / results : 0.0);
  }
  // Every rank's own CPU (rank 0 prints first): per GB of buffer reduced and per allreduce call.
  const CommunicatorCounters after = comm.counters();
  const std::string who = "rank " + std::to_string(comm.rank());
  accounting::print(stdout, after.placement, accounting::CpuSample{}, cpu_spent, reduced_bytes, calls, who.c_str());
  if (root) std::printf("#\n");
  std::fflush(stdout);
  if (o.verbose) {
    const CommunicatorCounters c = comm.counters();
    std::fprintf(stderr, "# rank %d: %llu calls, %llu messages, %llu bytes sent; transport: %llu packets sent, %llu retransmitted, %llu timeouts, %llu tail probes, %llu duplicates received, %llu send errors, %llu packets received into place (%llu misses); %llu gather bytes written into place by the previous rank\n",
                 comm.rank(), (unsigned long long)c.calls, (unsigned long long)c.messages_sent, (unsigned long long)c.bytes_sent,
                 (unsigned long long)c.transport.tx_packets, (unsigned long long)c.transport.retransmitted_packets, (unsigned long long)c.transport.timeouts,
                 (unsigned long long)c.transport.tail_probes, (unsigned long long)c.transport.rx_duplicates, (unsigned long long)c.transport.send_errors,
                 (unsigned long long)c.transport.rx_placed, (unsigned long long)c.transport.rx_placement_misses,
                 (unsigned long long)c.bytes_gathered_in_place);
  }
  return wrong_total ? 1 : 0;
}

uint16_t free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return 29500;
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"stellar_allreduce: nccl-tests-style allreduce benchmark over Stellar"};
  app.add_option("-b,--minbytes", o.min_bytes, "smallest size (bytes, K/M/G suffixes)");
  app.add_option("-e,--maxbytes", o.max_bytes, "largest size");
  app.add_option("-i,--stepbytes", o.step_bytes, "size increment when no factor is given");
  app.add_option("-f,--stepfactor", o.step_factor, "size multiplication factor");
  app.add_option("-n,--iters", o.iterations, "timed iterations per size")->check(CLI::PositiveNumber);
  app.add_option("-w,--warmup_iters", o.warmup, "warm-up iterations per size")->check(CLI::NonNegativeNumber);
  app.add_option("-c,--check", o.check, "check results (0/1)");
  app.add_option("-d,--datatype", o.type, "float, half, bfloat16, double, int32, int64 or all");
  app.add_option("-o,--op", o.op, "sum, prod, min, max, avg or all");
  app.add_option("-N,--local-ranks", o.local_ranks, "fork this many ranks on this host (without a launcher's environment)");
  app.add_option("--mode", o.mode, "soft provider wire protocol: stellar or roce");
  app.add_option("--provider", o.provider, "soft or verbs");
  app.add_option("--algorithm", o.algorithm, "auto, ring, rd (recursive doubling) or hd (recursive halving and doubling)");
  app.add_option("--cc", o.cc, "congestion control of the soft provider: auto, none, dcqcn or swift");
  app.add_option("--line_rate_mbps", o.line_rate_mbps,
                 "the rate congestion control starts from and never exceeds (Mbit/s; default: the context's, 100 Gbit/s): a NIC's line rate")
      ->check(CLI::PositiveNumber);
  app.add_option("--chunk", o.chunk, "pipelining chunk / landing slot size");
  app.add_option("--qps", o.qps, "RC QPs per peer; messages of 32 KiB and more are striped over them (as NCCL_IB_QPS_PER_CONNECTION)")
      ->check(CLI::Range(1u, 16u));
  app.add_option("--timeout", o.timeout_ms, "fail a call after this long without progress (ms)");
  app.add_flag("-v,--verbose", o.verbose, "print each rank's transport counters at the end");
  app.add_option("-m,--mtu", o.mtu, "soft provider: payload bytes per packet (as perftest's -m; 0: the context's default)")
      ->check(CLI::Range(0u, stellar::max_mtu));
  app.add_flag("--no-shm", o.no_shm, "ranks on this host talk over the network too (default: shared memory between them; STELLAR_COLL_SHM=0)");
  app.add_flag("--no-direct", o.no_direct,
               "gather steps go through landing slots and a copy (default: written straight into the next rank's output; STELLAR_COLL_DIRECT=0)");
  app.add_option("--wait", o.wait, "busy (spin: lowest latency, one core per rank), adaptive (spin 50 us, then sleep) or auto: "
                 "busy, or adaptive when more ranks share this host than there are CPUs (counted at bootstrap)")
      ->capture_default_str();
  app.add_option("--tenant", o.tenant, "Open the context as this tenant (its credential from STELLAR_TENANT_CREDENTIAL; docs/scheduler.md)");
  app.add_option("--hint", o.hint, "Job hints of the QPs: a kind (allreduce, all-to-all, parameter-fetch, kv-fetch, checkpoint, control) "
                 "or job=NAME,kind=KIND,priority=P,weight=W");
  app.add_option("--tx_rate", o.tx_rate, "Soft provider: bytes/s the flow scheduler shapes this process's transmissions to (0: none)");
  CLI11_PARSE(app, argc, argv);

  CommunicatorOptions base;
  auto mode = parse_mode(o.mode);
  auto provider = parse_provider(o.provider);
  auto chunk = parse_size(o.chunk);
  if (!mode) die("--mode", mode.status());
  if (!provider) die("--provider", provider.status());
  if (!chunk) die("--chunk", chunk.status());
  base.context.mode = *mode;
  base.context.provider = *provider;
  if (o.wait != "auto" && o.wait != "busy" && o.wait != "adaptive") die("--wait", Status(Errc::invalid_argument, "auto, busy or adaptive"));
  base.context.wait = o.wait == "adaptive" ? WaitPolicy::adaptive : WaitPolicy::busy_poll;
  base.adapt_wait = o.wait == "auto";
  const bool wait_given = app.count("--wait") > 0;
  base.chunk_bytes = *chunk;
  base.qps_per_peer = o.qps;
  if (o.mtu) base.context.mtu = o.mtu;
  // STELLAR_COLL_SHM for forked ranks too (from_environment reads it under a launcher); --no-shm wins.
  if (const char* shm = std::getenv("STELLAR_COLL_SHM"); shm && o.local_ranks > 0) {
    if (std::string(shm) != "0" && std::string(shm) != "1") die("STELLAR_COLL_SHM", Status(Errc::invalid_argument, "0 or 1"));
    base.shared_memory = std::string(shm) == "1";
  }
  if (const char* direct = std::getenv("STELLAR_COLL_DIRECT"); direct && o.local_ranks > 0) {
    if (std::string(direct) != "0" && std::string(direct) != "1") die("STELLAR_COLL_DIRECT", Status(Errc::invalid_argument, "0 or 1"));
    base.direct_gather = std::string(direct) == "1";
  }
  base.timeout = std::chrono::milliseconds(o.timeout_ms);
  if (o.cc == "none") base.context.congestion_control = CongestionControl::none;
  else if (o.cc == "dcqcn") base.context.congestion_control = CongestionControl::dcqcn;
  else if (o.cc == "swift") base.context.congestion_control = CongestionControl::swift;
  else if (o.cc != "auto") die("--cc", Status(Errc::invalid_argument, "auto, none, dcqcn or swift"));
  if (o.line_rate_mbps) base.context.line_rate_bps = o.line_rate_mbps * 1'000'000;
  base.context.tenant = o.tenant;
  base.context.tx_rate_bytes_per_s = o.tx_rate;
  if (!o.hint.empty()) {
    auto hints = JobHints::parse(o.hint);
    if (!hints) die("--hint", hints.status());
    base.context.hints = *hints;
  }
  if (o.algorithm == "ring") base.allreduce_algorithm = AllreduceAlgorithm::ring;
  else if (o.algorithm == "rd") base.allreduce_algorithm = AllreduceAlgorithm::recursive_doubling;
  else if (o.algorithm == "hd") base.allreduce_algorithm = AllreduceAlgorithm::halving_doubling;
  else if (o.algorithm != "auto") die("--algorithm", Status(Errc::invalid_argument, "auto, ring, rd or hd"));

  if (o.local_ranks <= 0) {  // launched by mpirun or a torchrun-style environment
    auto co = CommunicatorOptions::from_environment(base);
    if (!co) die("environment", Status(co.status().code(), co.status().message() + "; or pass -N RANKS to fork local ranks"));
    if (wait_given) {  // the command line over STELLAR_COLL_WAIT
      co->context.wait = base.context.wait;
      co->adapt_wait = base.adapt_wait;
    }
    if (o.no_shm) co->shared_memory = false;
    if (o.no_direct) co->direct_gather = false;
    o.direct_gather = co->direct_gather;
    return run_rank(o, *co);
  }
  if (o.no_shm) base.shared_memory = false;
  if (o.no_direct) base.direct_gather = false;
  o.direct_gather = base.direct_gather;
  base.world_size = o.local_ranks;
  base.master_address = "127.0.0.1";
  base.master_port = free_port();
  std::vector<pid_t> children;
  for (int r = 0; r < o.local_ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      CommunicatorOptions co = base;
      co.rank = r;
      std::_Exit(run_rank(o, co));
    }
    children.push_back(pid);
  }
  int worst = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    worst = std::max(worst, code);
  }
  return worst;
}

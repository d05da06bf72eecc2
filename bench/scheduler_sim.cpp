// stellar_scheduler_sim: two (or more) training jobs' allreduce loops
// sharing one bottleneck, run through the flow scheduler's own code
// (offload/host/flow_scheduler.cpp) on a virtual clock. Each job computes
// for C (with jitter), then moves B bytes over its QPs; its iteration ends
// when the last byte is sent. Policies:
//   fair   plain weighted fair sharing (no step hints)
//   hints  the jobs give their step period (JobHints::step_period): the
//          scheduler orders their communication phases by deadline
// Prints mean and p99 iteration time per job and policy, and the ratios
// (docs/benchmarks.md, "Job-hint scheduling"). The testbed cannot show this
// yet: the scheduler is per engine host, and two jobs are two processes
// (docs/scheduler.md); this drives the same code the engine host runs.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "host/flow_scheduler.hpp"

using stellar::host::FlowLabel;
using stellar::host::FlowScheduler;

namespace {

struct Job {
  std::vector<FlowScheduler::Flow> flows;
  std::vector<uint64_t> remaining;  // bytes per flow in this phase
  uint64_t phase_start = 0, compute_until = 0, iteration_start = 0;
  bool communicating = false;
  std::vector<double> iterations;  // ns
};

struct Result {
  std::vector<double> mean, p99;
};

Result run(bool hints, int jobs, int qps, double rate, uint64_t bytes, uint64_t compute_ns, double jitter, int iterations,
           uint64_t offset_ns, uint64_t seed) {
  FlowScheduler s;
  s.set_link_rate(uint64_t(rate), 64 * 1024, 0);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-jitter, jitter);
  const uint64_t comm_ns = uint64_t(double(bytes) / rate * 1e9);
  std::vector<Job> js(static_cast<size_t>(jobs));
  for (int j = 0; j < jobs; ++j) {
    FlowLabel label{"cluster", "job" + std::to_string(j), 1, 4};
    if (hints) label.step_period_ns = compute_ns + comm_ns;  // what a job knows of its own step
    for (int q = 0; q < qps; ++q) js[size_t(j)].flows.push_back(s.add(label, 0));
    js[size_t(j)].remaining.assign(size_t(qps), 0);
    js[size_t(j)].compute_until = uint64_t(j) * offset_ns + uint64_t(double(compute_ns) * (1 + u(rng)));
  }
  uint64_t now = 0;
  auto done = [&] {
    for (const Job& j : js)
      if (int(j.iterations.size()) < iterations) return false;
    return true;
  };
  while (!done()) {
    // Jobs whose compute ended start communicating.
    for (Job& j : js) {
      if (j.communicating || now < j.compute_until) continue;
      j.communicating = true;
      for (size_t q = 0; q < j.flows.size(); ++q) {
        j.remaining[q] = bytes / j.flows.size();
        s.ready(j.flows[q], now);
      }
    }
    FlowScheduler::Flow f;
    uint64_t budget;
    if (s.next(now, f, budget)) {
      for (Job& j : js)
        for (size_t q = 0; q < j.flows.size(); ++q) {
          if (j.flows[q] != f) continue;
          const uint64_t b = std::min(budget, j.remaining[q]);
          j.remaining[q] -= b;
          s.served(f, b, j.remaining[q] > 0, now);
          bool finished = true;
          for (uint64_t r : j.remaining) finished = finished && r == 0;
          if (finished) {
            // The phase ends when its last byte has left (the link's time).
            const uint64_t end = now + uint64_t(double(b) / rate * 1e9);
            j.iterations.push_back(double(end - j.iteration_start));
            j.iteration_start = end;
            j.communicating = false;
            j.compute_until = end + uint64_t(double(compute_ns) * (1 + u(rng)));
          }
        }
      continue;
    }
    // Nothing may send now: the link refills, or a compute phase ends.
    uint64_t t = s.eligible_at(now);
    for (const Job& j : js)
      if (!j.communicating) t = std::min(t, j.compute_until);
    now = std::max(t, now + 1);
  }
  Result r;
  for (Job& j : js) {
    std::vector<double> v(j.iterations.begin() + 1, j.iterations.begin() + iterations);  // the first includes the offset
    double sum = 0;
    for (double x : v) sum += x;
    std::sort(v.begin(), v.end());
    r.mean.push_back(sum / double(v.size()));
    r.p99.push_back(v[std::min(v.size() - 1, size_t(double(v.size()) * 0.99))]);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"stellar_scheduler_sim: jobs' allreduce loops through the flow scheduler on a virtual clock"};
  int jobs = 2, qps = 2, iterations = 200;
  double rate_gbps = 10, compute_ms = 40, comm_ms = 40, jitter = 0.05, offset_ms = 0;
  uint64_t seed = 1;
  app.add_option("--jobs", jobs, "jobs sharing the bottleneck")->check(CLI::Range(1, 16));
  app.add_option("--qps", qps, "QPs (flows) per job")->check(CLI::Range(1, 64));
  app.add_option("--rate_gbps", rate_gbps, "the bottleneck's rate (Gbit/s)")->check(CLI::PositiveNumber);
  app.add_option("--compute_ms", compute_ms, "compute time per step")->check(CLI::NonNegativeNumber);
  app.add_option("--comm_ms", comm_ms, "communication time per step alone at the full rate (sets the bytes)")->check(CLI::PositiveNumber);
  app.add_option("--jitter", jitter, "compute time varies uniformly by this fraction")->check(CLI::Range(0.0, 0.9));
  app.add_option("--offset_ms", offset_ms, "job j starts j * offset later")->check(CLI::NonNegativeNumber);
  app.add_option("--iterations", iterations, "steps per job")->check(CLI::Range(10, 100000));
  app.add_option("--seed", seed, "jitter's seed");
  CLI11_PARSE(app, argc, argv);
  const double rate = rate_gbps * 1e9 / 8;
  const uint64_t bytes = uint64_t(rate * comm_ms / 1e3);
  const uint64_t compute_ns = uint64_t(compute_ms * 1e6), offset_ns = uint64_t(offset_ms * 1e6);
  std::printf("# %d jobs x %d QPs on %.1f Gbit/s; per step: compute %.1f ms (+-%.0f%%), %.1f MB (%.1f ms alone); %d steps\n", jobs, qps,
              rate_gbps, compute_ms, jitter * 100, double(bytes) / 1e6, comm_ms, iterations);
  const Result fair = run(false, jobs, qps, rate, bytes, compute_ns, jitter, iterations, offset_ns, seed);
  const Result hinted = run(true, jobs, qps, rate, bytes, compute_ns, jitter, iterations, offset_ns, seed);
  std::printf("%-6s %-14s %-14s %-14s %-14s\n", "job", "fair mean ms", "hints mean ms", "fair p99 ms", "hints p99 ms");
  double fm = 0, hm = 0, fp = 0, hp = 0;
  for (int j = 0; j < jobs; ++j) {
    std::printf("%-6d %-14.2f %-14.2f %-14.2f %-14.2f\n", j, fair.mean[size_t(j)] / 1e6, hinted.mean[size_t(j)] / 1e6,
                fair.p99[size_t(j)] / 1e6, hinted.p99[size_t(j)] / 1e6);
    fm += fair.mean[size_t(j)], hm += hinted.mean[size_t(j)];
    fp = std::max(fp, fair.p99[size_t(j)]), hp = std::max(hp, hinted.p99[size_t(j)]);
  }
  std::printf("average iteration: fair %.2f ms, hints %.2f ms: %.2fx better; worst p99: fair %.2f ms, hints %.2f ms: %.2fx\n",
              fm / jobs / 1e6, hm / jobs / 1e6, fm / hm, fp / 1e6, hp / 1e6, fp / hp);
  return 0;
}

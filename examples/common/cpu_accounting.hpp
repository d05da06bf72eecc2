// CPU accounting for the example and benchmark programs
// (docs/engine-daemon.md, "Accounting"): the application process's CPU time
// (getrusage: all its threads) and the CPU time where the engines run off
// the application's threads (ContextCounters::engine_cpu_ns: the context's
// engine thread, or the whole stellar-engined process), per GB moved and
// per operation. Header-only; used by examples/ and bench/perftest.cpp.
#pragma once

#include <sys/resource.h>

#include <cstdint>
#include <cstdio>

#include "stellar/verbs.hpp"

namespace stellar::accounting {

struct CpuSample {
  uint64_t process_ns = 0;  // this process, user + system, every thread
  uint64_t engine_ns = 0;   // ContextCounters::engine_cpu_ns
  uint64_t yields = 0;      // ContextCounters::contention_yields
};

inline uint64_t process_cpu_ns() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto ns = [](const timeval& t) { return uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_usec) * 1000ull; };
  return ns(u.ru_utime) + ns(u.ru_stime);
}

inline CpuSample sample(Context& context) {
  const ContextCounters c = context.counters();
  return CpuSample{process_cpu_ns(), c.engine_cpu_ns, c.contention_yields};
}
inline CpuSample sample(uint64_t engine_cpu_ns) { return CpuSample{process_cpu_ns(), engine_cpu_ns}; }

// One line, e.g. "# cpu: placement daemon; application 0.012 s = 0.0040 s/GB, 0.31 us/op;
// engines 0.210 s = 0.0700 s/GB, 5.20 us/op (stellar-engined, every context it serves)".
// `bytes` and `operations` are what this process moved in the interval (0: not
// normalised); `who` names the process among several (e.g. "rank 1").
inline void print(std::FILE* out, ProgressMode placement, const CpuSample& from, const CpuSample& to, double bytes, double operations,
                  const char* who = nullptr) {
  const double app = double(to.process_ns - from.process_ns) / 1e9;
  const double engine = double(to.engine_ns - from.engine_ns) / 1e9;
  const double gb = bytes / 1e9;
  std::fprintf(out, "# cpu%s%s: placement %s; application %.3f s", who ? " " : "", who ? who : "", to_string(placement), app);
  if (gb > 0) std::fprintf(out, " = %.4f s/GB", app / gb);
  if (operations > 0) std::fprintf(out, ", %.2f us/op", app * 1e6 / operations);
  if (placement != ProgressMode::inline_poll) {
    std::fprintf(out, "; engines %.3f s", engine);
    if (gb > 0) std::fprintf(out, " = %.4f s/GB", engine / gb);
    if (operations > 0) std::fprintf(out, ", %.2f us/op", engine * 1e6 / operations);
    std::fprintf(out, " (%s)", placement == ProgressMode::thread ? "the engine thread, also inside the application's figure"
                                                                  : "stellar-engined, every context it serves");
    // More busy threads than CPUs: the engine thread and empty CQ polls gave
    // their cores away (docs/architecture.md, "Soft provider threading").
    if (to.yields > from.yields)
      std::fprintf(out, "; CPUs oversubscribed: %llu yields", static_cast<unsigned long long>(to.yields - from.yields));
  }
  std::fprintf(out, "\n");
}
inline void print(std::FILE* out, const Context& context, const CpuSample& from, const CpuSample& to, double bytes, double operations) {
  print(out, context.options().progress, from, to, bytes, operations);
}

}  // namespace stellar::accounting

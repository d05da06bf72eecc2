// What the allreduce peer programs (Gloo, Open MPI) share with
// stellar_allreduce: the size sweep and nccl-tests' output columns, so that
// bench/allreduce_compare.sh parses all three the same way. Float sum only:
// the comparison the issue asks for.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace peer {

inline size_t parse_size(const char* text) {
  char* end = nullptr;
  double v = std::strtod(text, &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024.0 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return size_t(v);
}

struct Sweep {
  size_t min_bytes = 1024, max_bytes = 64 << 20;
  double factor = 2;
  int iterations = 20, warmup = 5;
  int ranks = 2;
};

// -b -e -f -n -w as nccl-tests, -N local ranks.
inline Sweep parse_sweep(int argc, char** argv) {
  Sweep s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string o = argv[i];
    if (o == "-b") s.min_bytes = parse_size(argv[i + 1]);
    else if (o == "-e") s.max_bytes = parse_size(argv[i + 1]);
    else if (o == "-f") s.factor = std::atof(argv[i + 1]);
    else if (o == "-n") s.iterations = std::atoi(argv[i + 1]);
    else if (o == "-w") s.warmup = std::atoi(argv[i + 1]);
    else if (o == "-N") s.ranks = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-N RANKS]\n", argv[0]);
      std::exit(2);
    }
  }
  if (s.factor <= 1) s.factor = 2;
  return s;
}

inline void print_header(const char* name, int ranks) {
  std::printf("# %s: nRanks %d, float sum, in place\n", name, ranks);
  std::printf("#       size         count      type   redop     time   algbw   busbw #wrong\n");
  std::printf("#        (B)    (elements)                       (us)  (GB/s)  (GB/s)       \n");
}

// time_us: the ranks' average time per call.
inline void print_row(size_t bytes, double time_us, int ranks, long wrong) {
  const double algbw = time_us > 0 ? double(bytes) / (time_us * 1e-6) / 1e9 : 0;
  const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
  std::printf("%12zu  %12zu  %8s  %6s  %7.2f  %6.2f  %6.2f  %5ld\n", bytes, bytes / 4, "float", "sum", time_us, algbw, busbw, wrong);
  std::fflush(stdout);
}

}  // namespace peer

// stellar_host_probe: how fast this host moves bytes from one CPU's cache to
// another's right now. Every loopback stream (Stellar's, UCX's, kernel
// TCP's) writes each byte on the sender's CPU and reads it on the
// receiver's, so on a virtual machine whose vCPUs the hypervisor places
// (and re-places) on physical cores, this rate decides their throughput.
// On the 2-vCPU development VM it swung between 3 and 38 GB/s within
// minutes, and UCX over TCP and Stellar fell from 5-6 GB/s to 1.6-1.8 GB/s
// together whenever it was low (docs/benchmarks.md, "The slow mode").
// bench/compare_core.sh runs it around every round so that each round's
// ratios are read against the phase they ran in.
//
// What it does: one thread pinned to the first CPU the process may use
// copies 64 KiB slots from a 1 MiB source into a 4 MiB ring; a second
// thread pinned to the second CPU copies each slot out into a 1 MiB
// destination, as a datagram's payload travels through the kernel.
// Prints "<GB/s>" (1e9 bytes) moved through the ring, or "n/a" when the
// process may use only one CPU.
// Usage: stellar_host_probe [MiB]   (default 1000)
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {
constexpr size_t slot_bytes = 64 << 10;
constexpr size_t slots = 64;
constexpr size_t side_bytes = 1 << 20;

bool pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}
}  // namespace

int main(int argc, char** argv) {
  const long mib = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 1000;
  if (mib <= 0 || mib > (1 << 20)) {
    std::fprintf(stderr, "usage: stellar_host_probe [MiB, 1..1048576]\n");
    return 2;
  }
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 1;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.size() < 2) {
    std::printf("n/a\n");
    return 0;
  }
  std::vector<char> ring(slots * slot_bytes, 0), source(side_bytes, 1), destination(side_bytes, 0);
  const uint64_t count = uint64_t(mib) * (1 << 20) / slot_bytes;
  // Slots filled (head) and emptied (tail); each side spins on the other's.
  std::atomic<uint64_t> head{0}, tail{0};
  bool pinned = true;
  std::thread consumer([&] {
    pinned = pin(cpus[1]) && pinned;
    for (uint64_t i = 0; i < count; ++i) {
      while (head.load(std::memory_order_acquire) == i) {
      }
      std::memcpy(&destination[(i * slot_bytes) % side_bytes], &ring[(i % slots) * slot_bytes], slot_bytes);
      tail.store(i + 1, std::memory_order_release);
    }
  });
  const bool producer_pinned = pin(cpus[0]);
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < count; ++i) {
    while (i - tail.load(std::memory_order_acquire) >= slots) {
    }
    std::memcpy(&ring[(i % slots) * slot_bytes], &source[(i * slot_bytes) % side_bytes], slot_bytes);
    head.store(i + 1, std::memory_order_release);
  }
  consumer.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!pinned || !producer_pinned) {
    std::fprintf(stderr, "stellar_host_probe: could not pin to CPUs %d and %d\n", cpus[0], cpus[1]);
    return 1;
  }
  // Read what was copied, so the copies cannot be optimized away.
  volatile char sink = destination[side_bytes - 1];
  (void)sink;
  std::printf("%.2f\n", double(count * slot_bytes) / seconds / 1e9);
  return 0;
}

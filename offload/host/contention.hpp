// Telling a busy-polling thread that it is oversubscribed: more threads want
// to run than there are CPUs, so its spinning burns the time slices of the
// threads it waits for (docs/architecture.md, "Soft provider threading").
//
// The kernel counts a thread's involuntary context switches (preempted while
// runnable, and yields that did switch). A spinning thread reads its own
// count once a millisecond of idling; two preemptions within 20 ms (a lone
// one is a kernel worker passing by, not a crowd) open a window of
// `window_ns` in which the caller should give its core away when idle
// (sched_yield). A yield that finds nobody else to run switches nothing and
// counts nothing, so the window closes by itself once the CPUs suffice.
//
// Thread-safety: check() belongs to the one thread whose count it reads;
// contended() may be read from any thread (an atomic).
#pragma once

#include <sys/resource.h>

#include <atomic>
#include <cstdint>

namespace stellar::host {

class ContentionDetector {
 public:
  static constexpr uint64_t check_interval_ns = 1'000'000;
  static constexpr uint64_t repeat_ns = 20'000'000;  // a second preemption within this: a crowd
  static constexpr uint64_t window_ns = 50'000'000;

  // The calling thread is idle at `now` (monotonic ns): reads its count when
  // due. True while the window is open.
  bool check(uint64_t now) {
    if (now - checked_at_ >= check_interval_ns) {
      checked_at_ = now;
      rusage u{};
      if (::getrusage(RUSAGE_THREAD, &u) == 0) {
        const uint64_t count = uint64_t(u.ru_nivcsw);
        if (started_ && count > involuntary_) {
          if (count - involuntary_ >= 2 || (preempted_at_ && now - preempted_at_ <= repeat_ns))
            until_.store(now + window_ns, std::memory_order_relaxed);
          preempted_at_ = now;
        }
        involuntary_ = count;
        started_ = true;
      }
    }
    return contended(now);
  }
  bool contended(uint64_t now) const { return now < until_.load(std::memory_order_relaxed); }

 private:
  uint64_t checked_at_ = 0, involuntary_ = 0, preempted_at_ = 0;
  bool started_ = false;  // the first reading only sets the baseline (the thread's history)
  std::atomic<uint64_t> until_{0};
};

}  // namespace stellar::host

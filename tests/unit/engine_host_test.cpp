// The in-process engine host (offload/host/engine_host.hpp) on real UDP
// sockets, where its clocks matter: the daemon posts work stamped on its
// client threads with a fresh clock while a shard serves with the `now` it
// read when its round began, so a post may be stamped slightly ahead of the
// serving clock. Path MTU discovery's time limit must not take that for a
// wait of 2^64 ns.
//
// Sizing runs only between non-loopback addresses, so the test moves its
// thread into a network namespace of its own (root only) with 10.77.0.1 on
// its loopback device: nothing leaves the namespace.
#include "host/engine_host.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "engine_harness.hpp"

namespace off = stellar::offload;
using stellar::host::EngineHost;
using stellar::host::HostClient;
using stellar::host::HostOptions;
using stellar::host::QpBinding;

namespace {

uint64_t monotonic_now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_nsec);
}

struct NoClient : HostClient {
  void on_progress_locked(uint64_t) override {}
  uint64_t next_wakeup_locked(uint64_t) override { return UINT64_MAX; }
};

// Runs `body` on a thread inside a fresh network namespace whose loopback
// device is up and also carries 10.77.0.1/32. Returns false (the caller
// skips) where that is not allowed.
template <typename Body>
bool in_private_namespace(Body&& body, std::string& why) {
  bool ran = false;
  std::thread t([&] {
    if (::unshare(CLONE_NEWNET) != 0) {
      why = "unshare(CLONE_NEWNET) refused (needs root)";
      return;
    }
    // system() forks from this thread: the child is in the new namespace.
    if (std::system("ip link set lo up && ip addr add 10.77.0.1/32 dev lo") != 0) {
      why = "could not configure the namespace's loopback with ip(8)";
      return;
    }
    ran = true;
    body();
  });
  t.join();
  return ran;
}

}  // namespace

// The leader of a sizing whose peer never answers holds a WRITE posted with
// a stamp 50 ms ahead of the serving clock. Rounds served "before" the post
// must not fail it; the time limit (1 s) still fails it once it has passed.
TEST(EngineHostSizing, APostStampedAheadOfTheServingClockWaitsForTheTimeLimit) {
  std::string why;
  const bool ran = in_private_namespace(
      [&] {
        std::mutex lock;
        NoClient client;
        EngineHost host(lock, client);
        HostOptions options;
        options.bind_address = "10.77.0.1";
        options.mtu = 4096;
        ASSERT_FALSE(host.open(options).has_value());
        // The peer: a socket that never answers.
        const int silent = ::socket(AF_INET, SOCK_DGRAM, 0);
        ASSERT_GE(silent, 0);
        sockaddr_in peer{};
        peer.sin_family = AF_INET;
        ::inet_pton(AF_INET, "10.77.0.1", &peer.sin_addr);
        ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&peer), sizeof peer), 0);
        socklen_t len = sizeof peer;
        ::getsockname(silent, reinterpret_cast<sockaddr*>(&peer), &len);

        off::EngineConfig config;
        config.mode = off::Mode::stellar;
        config.mtu = 4096;
        config.local_qpn = 0x100;
        config.remote_qpn = 0x200;
        config.local_token = 0x9000;  // larger: this side leads the sizing
        config.remote_token = 0x1000;
        config.size_path = true;
        stellar::test::FakeMemory memory;
        stellar::test::Collector sink;
        std::vector<uint8_t> source(8192, 0x5a);
        const uint32_t lkey = memory.add(source.data(), source.size(), 0);

        std::lock_guard guard(lock);
        std::string error;
        stellar::host::Host::Engine* engine = host.attach_locked(config, peer, QpBinding{}, memory, sink, error);
        ASSERT_NE(engine, nullptr) << error;
        off::SendWork w = stellar::test::make_work(off::WorkOpcode::rdma_write, 7, source.data(), uint32_t(source.size()));
        w.segments[0].lkey = lkey;
        w.remote_addr = 0x10000;
        w.rkey = 1;
        const uint64_t serving = monotonic_now();
        ASSERT_EQ(host.post_send_locked(engine, w, serving + 50'000'000), off::PostResult::ok);
        host.posted_locked(engine, serving);
        for (int i = 0; i < 20; ++i) host.progress_locked(serving + uint64_t(i) * 1'000'000);
        EXPECT_TRUE(sink.sends.empty()) << "a post stamped 50 ms ahead of the serving clock failed at once";
        EXPECT_FALSE(host.in_error_locked(engine));
        // Past the limit, counted from the post's own stamp: the work fails
        // as a dead peer's would.
        host.progress_locked(serving + 50'000'000 + 1'001'000'000);
        ASSERT_EQ(sink.sends.size(), 1u);
        EXPECT_EQ(sink.sends[0].status, off::CompletionStatus::retry_exceeded);
        host.detach_locked(engine);
        ::close(silent);
      },
      why);
  if (!ran) GTEST_SKIP() << why;
}

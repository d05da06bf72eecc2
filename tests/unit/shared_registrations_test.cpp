// The verbs provider's sharing of live GPU registrations
// (src/providers/verbs/shared_registrations.hpp), with fake handles: a
// registration is shared only by the same allocation with the same access,
// dies with its last user (a NIC key must not outlive it), is never handed
// out for memory freed and allocated again at the same address, and failed
// registrations are not remembered.
#include "providers/verbs/shared_registrations.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "stellar/verbs.hpp"

namespace {

using namespace stellar;
using stellar::provider::verbs::SharedRegistrations;

struct FakeMr {
  int serial = 0;
  uint64_t start = 0, length = 0;
};

struct Fixture {
  std::mutex mutex;
  std::vector<int> deregistered;
  int registered = 0;
  SharedRegistrations<FakeMr> shared{[this](FakeMr&& mr) {
    std::lock_guard lock(mutex);
    deregistered.push_back(mr.serial);
  }};
  bool fail_next = false;

  // Registers exactly the range asked for unless `cover_length` is set.
  Result<SharedRegistrations<FakeMr>::Use> acquire(uint64_t address, uint64_t length, uint32_t access, uint64_t allocation, bool* hit = nullptr,
                                                   uint64_t cover_start = 0, uint64_t cover_length = 0) {
    if (!cover_length) cover_start = address, cover_length = length;
    return shared.acquire(
        address, length, cover_start, cover_length, access, allocation,
        [&](uint64_t start, uint64_t bytes) -> Result<FakeMr> {
          if (fail_next) {
            fail_next = false;
            return Status(Errc::unsupported, "no dma-buf, no peermem");
          }
          std::lock_guard lock(mutex);
          return FakeMr{++registered, start, bytes};
        },
        hit);
  }
};

constexpr uint32_t local = access_local_write;
constexpr uint32_t remote = access_local_write | access_remote_write | access_remote_read;

TEST(SharedRegistrations, SameAllocationAndAccessShareOneLiveRegistration) {
  Fixture f;
  bool hit = true;
  auto a = f.acquire(0x100000, 1 << 20, remote, 7, &hit);
  ASSERT_TRUE(a);
  EXPECT_FALSE(hit);
  auto b = f.acquire(0x100000, 1 << 20, remote, 7, &hit);  // the same buffer again
  ASSERT_TRUE(b);
  EXPECT_TRUE(hit);
  EXPECT_EQ(f.registered, 1);
  EXPECT_EQ(b->handle().handle.serial, 1);
  EXPECT_EQ(a->handle().handle.start, 0x100000u);  // the cover given (here the exact range)
  EXPECT_EQ(a->handle().handle.length, 1u << 20);
  // A smaller range inside it does not get its key: the key would reach the
  // whole megabyte, and outlive its owner's deregistration.
  auto c = f.acquire(0x140000, 4096, remote, 7, &hit);
  ASSERT_TRUE(c);
  EXPECT_FALSE(hit);
  EXPECT_EQ(c->handle().handle.serial, 2);
  EXPECT_EQ(c->handle().handle.length, 4096u);

  // Releases: the registration lives while anyone uses it, and not a moment
  // longer (its rkey would stay valid at the NIC).
  SharedRegistrations<FakeMr>::release(*a);
  EXPECT_TRUE(f.deregistered.empty());
  EXPECT_EQ(f.shared.size(), 2u);
  SharedRegistrations<FakeMr>::release(*b);
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
  { auto dropped = std::move(*c); }  // destroying a use ends it too
  EXPECT_EQ(f.deregistered, std::vector<int>({1, 2}));
  EXPECT_EQ(f.shared.size(), 0u);

  auto d = f.acquire(0x100000, 1 << 20, remote, 7, &hit);  // nothing cached past the last user
  ASSERT_TRUE(d);
  EXPECT_FALSE(hit);
  EXPECT_EQ(d->handle().handle.serial, 3);
  SharedRegistrations<FakeMr>::release(*d);
}

TEST(SharedRegistrations, ThePageCoverIsRegisteredAndFoundByNeighbours) {
  Fixture f;
  bool hit = true;
  // A 100-byte buffer registers its whole page; another buffer in that page finds it.
  auto first = f.acquire(0x100040, 100, remote, 7, &hit, 0x100000, 4096);
  ASSERT_TRUE(first);
  EXPECT_FALSE(hit);
  EXPECT_EQ(first->handle().handle.start, 0x100000u);
  EXPECT_EQ(first->handle().handle.length, 4096u);
  auto neighbour = f.acquire(0x100800, 64, remote, 7, &hit, 0x100000, 4096);
  ASSERT_TRUE(neighbour);
  EXPECT_TRUE(hit);
  EXPECT_EQ(f.registered, 1);
  auto next_page = f.acquire(0x101000, 64, remote, 7, &hit, 0x101000, 4096);
  ASSERT_TRUE(next_page);
  EXPECT_FALSE(hit);
  auto bad_cover = f.acquire(0x100040, 100, remote, 7, &hit, 0x100080, 4096);  // does not contain the range
  ASSERT_FALSE(bad_cover);
  EXPECT_EQ(bad_cover.status().code(), Errc::invalid_argument);
  for (auto* u : {&*first, &*neighbour, &*next_page}) SharedRegistrations<FakeMr>::release(*u);
  EXPECT_EQ(f.deregistered.size(), 2u);
}

TEST(SharedRegistrations, OtherAccessOrAWiderRangeGetsItsOwn) {
  Fixture f;
  auto remote_use = f.acquire(0x100000, 1 << 20, remote, 7);
  auto local_use = f.acquire(0x100000, 1 << 20, local, 7);   // never an rkey with more access than asked
  auto wider = f.acquire(0x100000, (1 << 20) + 1, remote, 7);  // reaches past the registration
  auto before = f.acquire(0xff000, 8192, remote, 7);          // starts before it
  ASSERT_TRUE(remote_use && local_use && wider && before);
  EXPECT_EQ(f.registered, 4);
  EXPECT_NE(local_use->handle().handle.serial, remote_use->handle().handle.serial);
  bool hit = false;
  auto same_local = f.acquire(0x100000, 1 << 20, local, 7, &hit);
  ASSERT_TRUE(same_local);
  EXPECT_TRUE(hit);
  EXPECT_EQ(same_local->handle().handle.serial, local_use->handle().handle.serial);
  for (auto* u : {&*remote_use, &*local_use, &*wider, &*before, &*same_local}) SharedRegistrations<FakeMr>::release(*u);
  EXPECT_EQ(f.deregistered.size(), 4u);
}

TEST(SharedRegistrations, MemoryFreedAndAllocatedAgainAtTheSameAddressIsNeverShared) {
  Fixture f;
  auto old_use = f.acquire(0x100000, 1 << 20, remote, 7);  // allocation 7, still registered by someone
  auto old_local = f.acquire(0x100000, 4096, local, 7);
  ASSERT_TRUE(old_use && old_local);
  // cudaFree + cudaMalloc returned the same address: a new buffer id.
  bool hit = true;
  auto fresh = f.acquire(0x100000, 1 << 20, remote, 8, &hit);
  ASSERT_TRUE(fresh);
  EXPECT_FALSE(hit);
  EXPECT_EQ(fresh->handle().handle.serial, 3);
  EXPECT_EQ(fresh->handle().identity, 8u);
  // The old registrations stay with their users (no deregistration under
  // them) but are found no more, whatever their access.
  EXPECT_TRUE(f.deregistered.empty());
  auto fresh_local = f.acquire(0x100000, 4096, local, 8, &hit);
  ASSERT_TRUE(fresh_local);
  EXPECT_FALSE(hit);
  EXPECT_EQ(fresh_local->handle().handle.serial, 4);
  auto again = f.acquire(0x100000, 1 << 20, remote, 8, &hit);
  ASSERT_TRUE(again);
  EXPECT_TRUE(hit);
  EXPECT_EQ(again->handle().handle.serial, 3);
  SharedRegistrations<FakeMr>::release(*old_use);
  SharedRegistrations<FakeMr>::release(*old_local);
  EXPECT_EQ(f.deregistered, std::vector<int>({1, 2}));
  for (auto* u : {&*fresh, &*fresh_local, &*again}) SharedRegistrations<FakeMr>::release(*u);
  EXPECT_EQ(f.deregistered, std::vector<int>({1, 2, 4, 3}));
}

TEST(SharedRegistrations, AFailedRegistrationIsNotRemembered) {
  Fixture f;
  f.fail_next = true;
  auto failed = f.acquire(0x100000, 4096, remote, 7);
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.status().code(), Errc::unsupported);
  EXPECT_EQ(f.shared.size(), 0u);
  auto ok = f.acquire(0x100000, 4096, remote, 7);
  ASSERT_TRUE(ok);
  EXPECT_EQ(f.registered, 1);
  SharedRegistrations<FakeMr>::release(*ok);
  auto bad = f.acquire(0x100000, 4096, 16, 7);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), Errc::invalid_argument);
}

// Threads register and release overlapping ranges of a few allocations,
// sometimes "freeing" one (a new id at the same address). A handle must
// never be deregistered while a thread holds it, nor twice, and every
// registration must be deregistered at the end.
TEST(SharedRegistrations, ConcurrentUseNeverDeregistersAHeldRegistration) {
  std::mutex mutex;
  std::map<int, int> holders;  // serial -> uses held
  std::vector<int> dead;
  std::atomic<int> serial{0}, errors{0};
  SharedRegistrations<FakeMr> shared{[&](FakeMr&& mr) {
    std::lock_guard lock(mutex);
    if (holders[mr.serial] != 0) ++errors;
    if (std::find(dead.begin(), dead.end(), mr.serial) != dead.end()) ++errors;
    dead.push_back(mr.serial);
  }};
  std::atomic<uint64_t> generation[4] = {1, 1, 1, 1};
  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<SharedRegistrations<FakeMr>::Use> held;
    for (int i = 0; i < 4000; ++i) {
      const unsigned buffer = rng() % 4;
      if (rng() % 50 == 0) generation[buffer] += 1;  // freed and allocated again
      if (held.size() < 8 && rng() % 2) {
        const uint64_t base = 0x1000000 * (buffer + 1);
        const uint64_t address = base + (rng() % 4) * 4096, length = 4096 * (1 + rng() % 4);
        auto use = shared.acquire(address, length, address, length, rng() % 2 ? remote : local, generation[buffer].load(),
                                  [&](uint64_t start, uint64_t length) -> Result<FakeMr> { return FakeMr{++serial, start, length}; });
        if (!use) {
          ++errors;
          continue;
        }
        std::lock_guard lock(mutex);
        ++holders[use->handle().handle.serial];
        if (std::find(dead.begin(), dead.end(), use->handle().handle.serial) != dead.end()) ++errors;
        held.push_back(std::move(*use));
      } else if (!held.empty()) {
        const size_t k = rng() % held.size();
        {
          std::lock_guard lock(mutex);
          --holders[held[k].handle().handle.serial];
        }
        SharedRegistrations<FakeMr>::release(held[k]);
        held.erase(held.begin() + long(k));
      }
    }
    for (auto& use : held) {
      {
        std::lock_guard lock(mutex);
        --holders[use.handle().handle.serial];
      }
      SharedRegistrations<FakeMr>::release(use);
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) threads.emplace_back(worker, 100 + t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(int(dead.size()), serial.load());  // every registration deregistered, none cached past its users
  EXPECT_EQ(shared.size(), 0u);
}

}  // namespace

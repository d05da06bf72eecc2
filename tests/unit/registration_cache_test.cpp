// RegistrationCache invalidation rules: covering lookups, overlaps, partial
// covers, adjacent ranges, invalidation while referenced, and a new
// registration after free at the same address. It must never hand out a
// registration of freed or deregistered memory.
#include "core/registration_cache.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

using stellar::Errc;
using stellar::RegistrationCache;
using stellar::Result;
using stellar::Status;

namespace {

struct FakeMr {
  int serial = 0;
};

struct Fixture {
  std::vector<int> deregistered;
  RegistrationCache<FakeMr> cache{[this](FakeMr&& mr) { deregistered.push_back(mr.serial); }};
  int next_serial = 1;
  RegistrationCache<FakeMr>::Reference add(uint64_t start, uint64_t length) { return cache.insert(start, length, FakeMr{next_serial++}); }
};

constexpr uint64_t page = 4096;

}  // namespace

TEST(RegistrationCache, LookupNeedsFullCover) {
  Fixture f;
  f.add(0x10000, 0x2000);  // [0x10000, 0x12000), released at once: stays cached
  EXPECT_EQ(f.cache.size(), 1u);
  EXPECT_TRUE(f.deregistered.empty());
  EXPECT_TRUE(f.cache.lookup(0x10000, 0x2000));
  EXPECT_TRUE(f.cache.lookup(0x10800, 0x100));
  EXPECT_TRUE(f.cache.lookup(0x11fff, 1));
  EXPECT_FALSE(f.cache.lookup(0x11f00, 0x200));  // partial cover: runs past the end
  EXPECT_FALSE(f.cache.lookup(0x0ffff, 2));      // starts before
  EXPECT_FALSE(f.cache.lookup(0x12000, 1));      // adjacent, not covered
  EXPECT_FALSE(f.cache.lookup(0x10000, 0));      // empty ranges never match
  EXPECT_EQ(f.cache.hits(), 3u);
  EXPECT_EQ(f.cache.misses(), 4u);
}

TEST(RegistrationCache, AdjacentRegistrationsDoNotJoin) {
  Fixture f;
  f.add(0x10000, page);
  f.add(0x11000, page);
  EXPECT_TRUE(f.cache.lookup(0x10000, page));
  EXPECT_TRUE(f.cache.lookup(0x11000, page));
  EXPECT_FALSE(f.cache.lookup(0x10800, page));  // spans both: neither covers it alone
}

TEST(RegistrationCache, NewestCoveringEntryWins) {
  Fixture f;
  f.add(0x10000, 0x4000);
  auto second = f.add(0x11000, 0x1000);
  auto hit = f.cache.lookup(0x11000, 0x800);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->handle().serial, 2);
  auto wide = f.cache.lookup(0x10000, 0x3000);
  ASSERT_TRUE(wide);
  EXPECT_EQ(wide->handle().serial, 1);
}

TEST(RegistrationCache, InvalidateRemovesEveryOverlap) {
  Fixture f;
  f.add(0x10000, page);            // 1: [0x10000, 0x11000)
  f.add(0x11000, page);            // 2: [0x11000, 0x12000)
  f.add(0x10000, 4 * page);        // 3: [0x10000, 0x14000)
  f.add(0x20000, page);            // 4: far away
  EXPECT_EQ(f.cache.invalidate(0x12000, 0x1000), 1u);  // only 3 reaches it; 2 ends where it begins
  EXPECT_EQ(f.deregistered, std::vector<int>({3}));
  EXPECT_EQ(f.cache.invalidate(0x10fff, 2), 2u);       // one byte into 1 and one into 2
  EXPECT_EQ(f.cache.size(), 1u);
  EXPECT_FALSE(f.cache.lookup(0x10000, 1));
  EXPECT_FALSE(f.cache.lookup(0x11000, 1));
  EXPECT_TRUE(f.cache.lookup(0x20000, 1));
  EXPECT_EQ(f.cache.invalidate(0x1f000, 0x1000), 0u);  // adjacent below entry 4
  EXPECT_EQ(f.cache.invalidate(0x21000, 0x1000), 0u);  // adjacent above
  EXPECT_EQ(f.cache.invalidate(0x20000, 0), 0u);       // empty range
  EXPECT_EQ(f.cache.size(), 1u);
}

TEST(RegistrationCache, InvalidateWhileReferenced) {
  Fixture f;
  auto in_use = f.add(0x10000, page);
  EXPECT_EQ(f.cache.invalidate(0x10000, page), 1u);
  EXPECT_FALSE(f.cache.lookup(0x10000, page));  // never handed out again
  EXPECT_TRUE(f.deregistered.empty());          // but still registered for the operation holding it
  EXPECT_EQ(in_use.handle().serial, 1);
  in_use.reset();
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
  EXPECT_FALSE(in_use);
}

TEST(RegistrationCache, TwoReferencesDeregisterAfterTheLast) {
  Fixture f;
  auto a = f.add(0x10000, page);
  auto b = f.cache.lookup(0x10000, page);
  ASSERT_TRUE(b);
  f.cache.invalidate(0x10000, 1);
  a.reset();
  EXPECT_TRUE(f.deregistered.empty());
  b.reset();
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
}

TEST(RegistrationCache, RetireDeregistersAtTheLastUseInsteadOfCaching) {
  Fixture f;
  auto a = f.add(0x10000, page);
  auto b = f.cache.lookup(0x10000, page);
  ASSERT_TRUE(b);
  a.retire();  // not the last use: stays registered and findable
  EXPECT_FALSE(a);
  EXPECT_TRUE(f.deregistered.empty());
  EXPECT_EQ(f.cache.size(), 1u);
  b->retire();  // the last: gone now, not kept for later lookups
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
  EXPECT_EQ(f.cache.size(), 0u);
  EXPECT_FALSE(f.cache.lookup(0x10000, page));
  // An entry invalidated while in use is deregistered once, at its retirement.
  auto c = f.add(0x20000, page);
  f.cache.invalidate(0x20000, page);
  c.retire();
  EXPECT_EQ(f.deregistered, std::vector<int>({1, 2}));
  c.retire();  // a retired reference is empty: nothing happens twice
  EXPECT_EQ(f.deregistered.size(), 2u);
}

TEST(RegistrationCache, ReRegisterAfterFreeIsANewRegistration) {
  Fixture f;
  uint64_t first_id;
  {
    auto r = f.add(0x10000, page);
    first_id = r.id();
  }
  f.cache.invalidate(0x10000, page);  // free()
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
  EXPECT_FALSE(f.cache.lookup(0x10000, page));
  auto again = f.add(0x10000, page);  // malloc() returned the same address
  EXPECT_NE(again.id(), first_id);
  auto hit = f.cache.lookup(0x10000, page);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->handle().serial, 2);
}

TEST(RegistrationCache, InvalidateOnDeregister) {
  Fixture f;
  auto r = f.add(0x10000, page);
  auto other = f.add(0x10000, page);  // a second registration of the same range
  f.cache.invalidate(r);              // its owner deregisters r
  auto hit = f.cache.lookup(0x10000, page);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->handle().serial, 2);  // the other registration is untouched
  EXPECT_TRUE(f.deregistered.empty());
  r.reset();
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
  f.cache.invalidate(r);  // an empty reference: nothing happens
}

TEST(RegistrationCache, FlushKeepsReferencedEntries) {
  Fixture f;
  f.add(0x10000, page);
  auto held = f.add(0x20000, page);
  EXPECT_EQ(f.cache.flush(), 1u);
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
  EXPECT_TRUE(f.cache.lookup(0x20000, page));
}

TEST(RegistrationCache, AcquireRegistersPageRoundedRangeOnce) {
  Fixture f;
  int registrations = 0;
  auto make = [&](uint64_t start, uint64_t length) -> Result<FakeMr> {
    ++registrations;
    EXPECT_EQ(start % page, 0u);
    EXPECT_EQ(length % page, 0u);
    return FakeMr{f.next_serial++};
  };
  auto a = f.cache.acquire(0x10010, 100, page, make);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->start(), 0x10000u);
  EXPECT_EQ(a->length(), page);
  auto b = f.cache.acquire(0x10f00, 0x100, page, make);  // same page: a hit
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->id(), a->id());
  EXPECT_EQ(registrations, 1);
  auto c = f.cache.acquire(0x10f00, 0x200, page, make);  // spills into the next page: a new one
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->length(), 2 * page);
  EXPECT_EQ(registrations, 2);

  auto failed = f.cache.acquire(0x50000, 1, page, [](uint64_t, uint64_t) -> Result<FakeMr> { return Status(Errc::io_error, "ibv_reg_mr: ENOMEM"); });
  EXPECT_EQ(failed.status().code(), Errc::io_error);
  EXPECT_EQ(f.cache.size(), 2u);
}

TEST(RegistrationCache, AcquireDoesNotCacheWhatWasFreedMeanwhile) {
  Fixture f;
  auto racing = f.cache.acquire(0x10000, page, page, [&](uint64_t, uint64_t) -> Result<FakeMr> {
    f.cache.invalidate(0x10000, page);  // another thread frees the memory during registration
    return FakeMr{f.next_serial++};
  });
  ASSERT_TRUE(racing.ok());
  EXPECT_EQ(f.cache.size(), 0u);
  EXPECT_FALSE(f.cache.lookup(0x10000, page));
  EXPECT_TRUE(f.deregistered.empty());
  racing->reset();
  EXPECT_EQ(f.deregistered, std::vector<int>({1}));
}

TEST(RegistrationCache, AcquireReturnsTheWinnerOfARace) {
  Fixture f;
  auto mine = f.cache.acquire(0x10000, page, page, [&](uint64_t start, uint64_t length) -> Result<FakeMr> {
    f.add(start, length);  // another thread registered and cached the same range first
    return FakeMr{f.next_serial++};
  });
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(mine->handle().serial, 1);
  EXPECT_EQ(f.deregistered, std::vector<int>({2}));  // the loser's registration is undone
  EXPECT_EQ(f.cache.size(), 1u);
}

TEST(RegistrationCache, ReferencesMayOutliveTheCache) {
  std::vector<int> deregistered;
  RegistrationCache<FakeMr>::Reference kept;
  {
    RegistrationCache<FakeMr> cache([&](FakeMr&& mr) { deregistered.push_back(mr.serial); });
    cache.insert(0x10000, page, FakeMr{1});
    kept = cache.insert(0x20000, page, FakeMr{2});
  }
  EXPECT_EQ(deregistered, std::vector<int>({1}));
  EXPECT_EQ(kept.handle().serial, 2);
  kept.reset();
  EXPECT_EQ(deregistered, std::vector<int>({1, 2}));
}

// Many threads acquire, use, release and invalidate overlapping ranges. Every
// handle is deregistered exactly once, never while a thread still uses it,
// and every returned registration covers the range asked for.
TEST(RegistrationCache, ConcurrentUseNeverDeregistersInUseOrTwice) {
  constexpr int threads = 4, rounds = 2000, slots = 64;
  struct Tracking {
    std::atomic<int> users{0};
    std::atomic<int> deregistrations{0};
  };
  std::vector<Tracking> handles(threads * rounds + 1);
  std::atomic<int> next{1}, violations{0};
  {
    RegistrationCache<FakeMr> cache([&](FakeMr&& mr) {
      if (handles[mr.serial].users.load() != 0) ++violations;
      ++handles[mr.serial].deregistrations;
    });
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        std::mt19937 random(t);
        for (int i = 0; i < rounds; ++i) {
          const uint64_t address = 0x100000 + (random() % slots) * 0x800;
          const uint64_t length = 1 + random() % 0x1800;
          if (random() % 4 == 0) {
            cache.invalidate(address, length);
            continue;
          }
          auto ref = cache.acquire(address, length, page, [&](uint64_t, uint64_t) -> Result<FakeMr> { return FakeMr{next++}; });
          if (!ref) continue;
          ++handles[ref->handle().serial].users;
          if (ref->start() > address || ref->start() + ref->length() < address + length) ++violations;
          --handles[ref->handle().serial].users;
        }
      });
    for (auto& w : workers) w.join();
  }
  EXPECT_EQ(violations.load(), 0);
  for (int i = 1; i < next.load(); ++i) EXPECT_EQ(handles[i].deregistrations.load(), 1) << "handle " << i;
}

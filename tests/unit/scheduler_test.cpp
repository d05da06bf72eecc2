// The flow scheduler on a virtual clock (offload/host/flow_scheduler.hpp):
// shares by weight, work conservation, rate limits, control priority and
// its budget. The engine host's use of it is tested in the integration
// suite (Tenants.*). Also the host clock conversion of receive stamps.
#include "host/flow_scheduler.hpp"
#include "host/host.hpp"

#include <gtest/gtest.h>

#include <map>
#include <vector>

using stellar::host::FlowLabel;
using stellar::host::FlowScheduler;
using stellar::host::TenantShare;

namespace {

constexpr uint64_t ms = 1'000'000;

// Drives the scheduler as the engine host does, with flows that always have
// packets due (`backlogged`) or that send `control_bytes` once when asked.
struct Simulation {
  FlowScheduler s;
  uint64_t now = 0;
  std::map<FlowScheduler::Flow, uint64_t> sent;
  std::vector<FlowScheduler::Flow> order;  // grants, in order

  // One grant; the flow uses all of it. False when nothing may send (the
  // clock then moves to when something may).
  bool step(uint64_t max_bytes = FlowScheduler::quantum_bytes) {
    FlowScheduler::Flow f;
    uint64_t budget;
    if (!s.next(now, f, budget)) {
      const uint64_t at = s.eligible_at(now);
      if (at == UINT64_MAX) return false;
      now = std::max(at, now + 1);
      return true;
    }
    const uint64_t bytes = std::min(budget, max_bytes);
    sent[f] += bytes;
    order.push_back(f);
    s.served(f, bytes, true, now);
    return true;
  }
  void run_until(uint64_t t) {
    while (now < t && step()) {
    }
  }
};

}  // namespace

TEST(FlowScheduler, WeightsOneTwoFourGiveSharesWithinFivePercentInEveryTenMillisecondWindow) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);  // 1 GB/s: the scheduler's rate is the limit
  const uint32_t weights[] = {1, 2, 4};
  std::vector<FlowScheduler::Flow> flows;
  for (int i = 0; i < 3; ++i) {
    const std::string name = "tenant" + std::to_string(i);
    sim.s.set_tenant(name, TenantShare{weights[i], 0, 0}, 0);
    // Each tenant runs two jobs with a few QPs: the tenant's share must not
    // depend on how many flows it opens.
    for (int q = 0; q < 1 + 2 * i; ++q) {
      flows.push_back(sim.s.add(FlowLabel{name, q % 2 ? "a" : "b", 1, 3}, 0));
      sim.s.ready(flows.back(), 0);
    }
  }
  auto tenant_bytes = [&] {
    std::vector<uint64_t> b(3, 0);
    for (auto [f, bytes] : sim.sent) b[size_t(sim.s.label(f).tenant.back() - '0')] += bytes;
    return b;
  };
  for (int window = 0; window < 20; ++window) {
    const std::vector<uint64_t> before = tenant_bytes();
    sim.run_until(uint64_t(window + 1) * 10 * ms);
    const std::vector<uint64_t> after = tenant_bytes();
    double total = 0;
    for (int i = 0; i < 3; ++i) total += double(after[i] - before[i]);
    // The link's rate over 10 ms (one burst of slack).
    EXPECT_NEAR(total, 10e6, 10e6 * 0.02) << "window " << window;
    for (int i = 0; i < 3; ++i) {
      const double share = double(after[i] - before[i]) / total, want = weights[i] / 7.0;
      EXPECT_NEAR(share / want, 1.0, 0.05) << "tenant " << i << " window " << window;
    }
  }
}

TEST(FlowScheduler, AnIdleShareIsLentOutAndNotSavedUp) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  sim.s.set_tenant("big", TenantShare{4, 0, 0}, 0);
  sim.s.set_tenant("small", TenantShare{1, 0, 0}, 0);
  const auto big = sim.s.add(FlowLabel{"big", "", 1, 0}, 0);
  const auto small = sim.s.add(FlowLabel{"small", "", 1, 0}, 0);
  sim.s.ready(small, 0);
  sim.run_until(10 * ms);
  // Alone, the small tenant takes the whole link (work conservation).
  EXPECT_NEAR(double(sim.sent[small]), 10e6, 0.3e6);
  // The big tenant arrives: it gets 4/5 from now on, with no catch-up burst
  // for the time it was idle (virtual times start at the current one).
  sim.s.ready(big, sim.now);
  const uint64_t small_before = sim.sent[small];
  sim.run_until(30 * ms);
  const double small_share = double(sim.sent[small] - small_before) / double(sim.sent[big] + sim.sent[small] - small_before);
  EXPECT_NEAR(small_share, 0.2, 0.02);
}

TEST(FlowScheduler, ATenantRateLimitCapsItWhileOthersTakeTheRest) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  sim.s.set_tenant("capped", TenantShare{8, 100'000'000, 0}, 0);  // high weight, but 100 MB/s at most
  sim.s.set_tenant("other", TenantShare{1, 0, 0}, 0);
  const auto capped = sim.s.add(FlowLabel{"capped", "", 1, 0}, 0);
  const auto other = sim.s.add(FlowLabel{"other", "", 1, 0}, 0);
  sim.s.ready(capped, 0);
  sim.s.ready(other, 0);
  sim.run_until(100 * ms);
  // 100 MB/s over 100 ms plus its initial burst (1 ms at its rate) and one
  // grant of overdraft.
  EXPECT_LE(double(sim.sent[capped]), 10e6 + 100e3 + 65536.0);
  EXPECT_GE(double(sim.sent[capped]), 10e6 * 0.98);
  EXPECT_NEAR(double(sim.sent[other]), 90e6, 90e6 * 0.02);
}

TEST(FlowScheduler, WithoutALinkRateTheTenantBucketAloneHoldsItBack) {
  Simulation sim;
  sim.s.set_tenant("capped", TenantShare{1, 50'000'000, 100'000}, 0);
  const auto f = sim.s.add(FlowLabel{"capped", "", 1, 0}, 0);
  sim.s.ready(f, 0);
  sim.run_until(200 * ms);
  EXPECT_NEAR(double(sim.sent[f]), 10e6, 10e6 * 0.02);
}

TEST(FlowScheduler, ControlMessagesOvertakeASaturatingBulkFlow) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  const auto bulk1 = sim.s.add(FlowLabel{"a", "train", 1, 3}, 0);
  const auto bulk2 = sim.s.add(FlowLabel{"b", "ckpt", 1, 1}, 0);
  const auto control = sim.s.add(FlowLabel{"a", "train", 1, stellar::host::control_class}, 0);
  sim.s.ready(bulk1, 0);
  sim.s.ready(bulk2, 0);
  sim.run_until(5 * ms);
  // A control message becomes due while both bulk flows are backlogged:
  // the very next grant is its.
  sim.s.ready(control, sim.now);
  FlowScheduler::Flow f;
  uint64_t budget;
  sim.now = sim.s.eligible_at(sim.now);  // the link is busy with the last bulk grant
  ASSERT_TRUE(sim.s.next(sim.now, f, budget));
  EXPECT_EQ(f, control);
  sim.s.served(f, 64, false, sim.now);
  EXPECT_LE(sim.s.waits(control).wait_ns_max, 70'000u);  // one 64 KiB grant at 1 GB/s
  // And bulk carries on.
  sim.now = sim.s.eligible_at(sim.now);
  ASSERT_TRUE(sim.s.next(sim.now, f, budget));
  EXPECT_NE(f, control);
}

TEST(FlowScheduler, BulkMarkedAsControlGetsPriorityOnlyWithinTheControlBudget) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  // Tenant "liar" sends bulk in the control class; tenant "honest" sends
  // bulk as bulk with the same weight.
  const auto liar = sim.s.add(FlowLabel{"liar", "", 1, stellar::host::control_class}, 0);
  const auto honest = sim.s.add(FlowLabel{"honest", "", 1, 3}, 0);
  sim.s.ready(liar, 0);
  sim.s.ready(honest, 0);
  sim.run_until(100 * ms);
  // Past its control budget (5% of the link) the liar is scheduled by
  // weight, like everyone else: the honest tenant keeps about half.
  const double honest_share = double(sim.sent[honest]) / double(sim.sent[honest] + sim.sent[liar]);
  EXPECT_GT(honest_share, 0.45);
}

TEST(FlowScheduler, OnASlowLinkControlClassBulkDoesNotBeatTheTenantsWeight) {
  // 12 MB/s: a control budget with a 10 MB/s floor would give a weight-1
  // tenant that marks its bulk as control 10 of the 12 MB/s. The budget is
  // 5% of the link, and control grants are charged to the tenant's share
  // like any other: priority changes the order, not the share.
  Simulation sim;
  sim.s.set_link_rate(12'000'000, 65536, 0);
  sim.s.set_tenant("liar", TenantShare{1, 0, 0}, 0);
  sim.s.set_tenant("honest", TenantShare{3, 0, 0}, 0);
  const auto liar = sim.s.add(FlowLabel{"liar", "", 1, stellar::host::control_class}, 0);
  const auto honest = sim.s.add(FlowLabel{"honest", "", 1, 3}, 0);
  sim.s.ready(liar, 0);
  sim.s.ready(honest, 0);
  sim.run_until(2000 * ms);
  const double liar_share = double(sim.sent[liar]) / double(sim.sent[honest] + sim.sent[liar]);
  EXPECT_NEAR(liar_share, 0.25, 0.02);
}

TEST(FlowScheduler, LabelsOfGoneFlowsDoNotAccumulate) {
  // Tenant names that only label flows (the daemon without a tenants file)
  // go with their last flow; a configured tenant's share stays.
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  sim.s.set_tenant("configured", TenantShare{4, 0, 0}, 0);
  for (int i = 0; i < 1000; ++i) sim.s.remove(sim.s.add(FlowLabel{"label" + std::to_string(i), "", 1, 3}, 0));
  EXPECT_EQ(sim.s.tenant_count(), 1u);
  const auto a = sim.s.add(FlowLabel{"configured", "", 1, 3}, 0);
  const auto b = sim.s.add(FlowLabel{"label", "", 1, 3}, 0);
  sim.s.remove(a);
  sim.s.ready(b, 0);
  const auto c = sim.s.add(FlowLabel{"configured", "", 1, 3}, 0);
  sim.s.ready(c, 0);
  sim.run_until(10 * ms);
  EXPECT_NEAR(double(sim.sent[c]) / double(sim.sent[b]), 4.0, 0.2);  // its weight survived
}

TEST(FlowScheduler, JobWeightsSplitATenantsShare) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  const auto important = sim.s.add(FlowLabel{"t", "important", 3, 3}, 0);
  const auto other = sim.s.add(FlowLabel{"t", "other", 1, 3}, 0);
  const auto other2 = sim.s.add(FlowLabel{"t", "other", 1, 3}, 0);
  for (auto f : {important, other, other2}) sim.s.ready(f, 0);
  sim.run_until(50 * ms);
  const double total = double(sim.sent[important] + sim.sent[other] + sim.sent[other2]);
  EXPECT_NEAR(double(sim.sent[important]) / total, 0.75, 0.02);
  EXPECT_NEAR(double(sim.sent[other]) / double(sim.sent[other2]), 1.0, 0.05);
}

TEST(FlowScheduler, RemovedFlowsFreeTheirPlaceAndAFlowThatGoesIdleLeavesTheQueue) {
  Simulation sim;
  const auto a = sim.s.add(FlowLabel{"a", "", 1, 0}, 0);
  const auto b = sim.s.add(FlowLabel{"b", "", 1, 0}, 0);
  sim.s.ready(a, 0);
  sim.s.ready(b, 0);
  sim.s.remove(b);
  FlowScheduler::Flow f;
  uint64_t budget;
  ASSERT_TRUE(sim.s.next(0, f, budget));
  EXPECT_EQ(f, a);
  sim.s.served(f, 100, false, 0);
  EXPECT_FALSE(sim.s.any_ready());
  EXPECT_FALSE(sim.s.next(0, f, budget));
  EXPECT_EQ(sim.s.eligible_at(0), UINT64_MAX);
  const auto c = sim.s.add(FlowLabel{"c", "", 1, 0}, 0);
  EXPECT_EQ(c, b);  // the slot is reused
}

TEST(FlowScheduler, PeriodicJobsPhasesRunOneAfterTheOtherByDeadline) {
  // Two jobs of one tenant with a 10 ms step start their communication
  // phases 1 us apart, 1 MB each, on a 1 GB/s link. With step hints the
  // earlier phase goes at the full rate and finishes first (1 ms), then the
  // other; without, both share and both finish at about 2 ms.
  for (bool hints : {true, false}) {
    FlowScheduler s;
    s.set_link_rate(1'000'000'000, 65536, 0);
    const uint64_t step = hints ? 10 * ms : 0;
    const auto a = s.add(FlowLabel{"t", "a", 1, 4, step, 0}, 0);
    const auto b = s.add(FlowLabel{"t", "b", 1, 4, step, 0}, 0);
    std::map<FlowScheduler::Flow, uint64_t> left{{a, 1'000'000}, {b, 1'000'000}};
    std::map<FlowScheduler::Flow, uint64_t> finished;
    uint64_t now = 0;
    s.ready(a, now);
    now = 1000;
    s.ready(b, now);
    while (finished.size() < 2) {
      FlowScheduler::Flow f;
      uint64_t budget;
      if (!s.next(now, f, budget)) {
        now = std::max(s.eligible_at(now), now + 1);
        continue;
      }
      const uint64_t bytes = std::min(budget, left[f]);
      left[f] -= bytes;
      s.served(f, bytes, left[f] > 0, now);
      if (left[f] == 0) finished[f] = now;
    }
    if (hints) {
      EXPECT_LT(finished[a], 1100 * 1000u);  // about 1 ms: alone on the link
      EXPECT_GT(finished[b], 1600 * 1000u);  // then b (its last grant starts before 2 ms)
    } else {
      EXPECT_GT(finished[a], 1600 * 1000u);  // both about 2 ms: shared
      EXPECT_GT(finished[b], 1600 * 1000u);
    }
  }
}

TEST(FlowScheduler, ATenantWakingUpDoesNotStartBehindBecauseARateLimitedOneWasServed) {
  // "capped" is held back by its rate limit, so its virtual time stays far
  // behind "busy"'s; serving it must not drag the scheduler's clock back,
  // or "late", arriving afterwards, would start behind "busy" and take the
  // link until it caught up.
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  sim.s.set_tenant("capped", TenantShare{1, 10'000'000, 65536}, 0);
  const auto capped = sim.s.add(FlowLabel{"capped", "", 1, 0}, 0);
  const auto busy = sim.s.add(FlowLabel{"busy", "", 1, 0}, 0);
  const auto late = sim.s.add(FlowLabel{"late", "", 1, 0}, 0);
  sim.s.ready(capped, 0);
  sim.s.ready(busy, 0);
  sim.run_until(50 * ms);
  while (sim.order.empty() || sim.order.back() != capped) sim.step();  // right after capped's grant
  sim.s.ready(late, sim.now);
  const uint64_t busy_before = sim.sent[busy];
  sim.run_until(60 * ms);
  const double busy_got = double(sim.sent[busy] - busy_before), late_got = double(sim.sent[late]);
  EXPECT_NEAR(late_got / busy_got, 1.0, 0.1) << "late " << late_got << " busy " << busy_got;
}

TEST(FlowScheduler, ControlClassBulkBeyondItsBudgetDoesNotSinkTheBudgetForLong) {
  Simulation sim;
  sim.s.set_link_rate(1'000'000'000, 65536, 0);
  const auto bulk_as_control = sim.s.add(FlowLabel{"t", "", 1, stellar::host::control_class}, 0);
  const auto other = sim.s.add(FlowLabel{"u", "", 1, 0}, 0);
  sim.s.ready(bulk_as_control, 0);
  sim.s.ready(other, 0);
  sim.run_until(1000 * ms);  // ~500 MB of control-class bulk, mostly by weight
  sim.s.served(bulk_as_control, 0, false, sim.now);  // it stops
  // 20 ms later (the budget refills at 50 MB/s: 64 KiB in ~1.3 ms), a real
  // control message of the same tenant overtakes the other tenant's bulk again.
  sim.now += 20 * ms;
  sim.s.ready(bulk_as_control, sim.now);
  FlowScheduler::Flow f;
  uint64_t budget;
  sim.now = sim.s.eligible_at(sim.now);
  ASSERT_TRUE(sim.s.next(sim.now, f, budget));
  EXPECT_EQ(f, bulk_as_control);
}

// The engine host turns the kernel's CLOCK_REALTIME receive stamps into
// the engines' MONOTONIC clock with a cached offset, not two clock reads
// per receive batch: the conversion, and what it refuses.
TEST(HostClock, ArrivalStampsComeOutOnTheMonotonicClockOrNotAtAll) {
  const uint64_t now = 5'000'000'000'000ull;              // MONOTONIC
  const int64_t offset = 1'700'000'000'000'000'000ll - int64_t(now);  // REALTIME - MONOTONIC
  const auto realtime = [&](uint64_t monotonic) { return uint64_t(int64_t(monotonic) + offset); };
  EXPECT_EQ(stellar::host::arrival_from_stamp(realtime(now - 12'345), offset, now), now - 12'345);
  EXPECT_EQ(stellar::host::arrival_from_stamp(realtime(now), offset, now), now);
  // Stamped during the receive call, after `now` was read: kept, later than now.
  EXPECT_EQ(stellar::host::arrival_from_stamp(realtime(now + 800), offset, now), now + 800);
  EXPECT_EQ(stellar::host::arrival_from_stamp(0, offset, now), 0u);  // no stamp
  // More than a second away: CLOCK_REALTIME stepped, no estimate.
  EXPECT_EQ(stellar::host::arrival_from_stamp(realtime(now - 2'000'000'000), offset, now), 0u);
  EXPECT_EQ(stellar::host::arrival_from_stamp(realtime(now) + 3'000'000'000ull, offset, now), 0u);
  EXPECT_EQ(stellar::host::arrival_from_stamp(realtime(now) - 3'000'000'000ull, offset, now), 0u);
}

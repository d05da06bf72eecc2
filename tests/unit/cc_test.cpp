// Congestion control on synthetic signals and a virtual clock: no sleeping,
// no wall clock. Every expected value is derived from the algorithm's rule in
// the test itself, so a wrong phase, factor or bound fails.
#include "stellar/offload/cc.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace stellar::offload {
namespace {

constexpr double kGbps = 1e9;

// ---------------------------------------------------------------- factory, none

TEST(CcFactory, MakesEachAlgorithmAndNamesIt) {
  CcConfig config;
  for (CcAlgorithm algorithm : {CcAlgorithm::none, CcAlgorithm::dcqcn, CcAlgorithm::swift}) {
    auto cc = make_congestion_control(algorithm, config);
    ASSERT_NE(cc, nullptr);
    EXPECT_EQ(cc->algorithm(), algorithm);
  }
  EXPECT_STREQ(to_string(CcAlgorithm::none), "none");
  EXPECT_STREQ(to_string(CcAlgorithm::dcqcn), "dcqcn");
  EXPECT_STREQ(to_string(CcAlgorithm::swift), "swift");
  EXPECT_STREQ(to_string(static_cast<CcAlgorithm>(42)), "unknown");
  EXPECT_EQ(make_congestion_control(static_cast<CcAlgorithm>(42), config), nullptr);
}

TEST(CcNone, NeverBlocks) {
  auto cc = make_congestion_control(CcAlgorithm::none, CcConfig{});
  cc->on_congestion_notification(1);
  cc->on_loss(2);
  cc->on_timeout(3);
  cc->on_send(4, UINT32_MAX);
  EXPECT_TRUE(cc->can_send(5, UINT64_MAX - UINT32_MAX, UINT32_MAX));
  EXPECT_EQ(cc->next_send_time_ns(5, UINT64_MAX, 4096), 5u);
  EXPECT_EQ(cc->window_bytes(), UINT64_MAX);
  EXPECT_EQ(cc->rate_bps(), CcConfig{}.line_rate_bps);
}

TEST(CcConfigSanitizing, NonsenseKnobsDoNotBreakControllers) {
  CcConfig config;
  config.mtu_bytes = 0;
  config.line_rate_bps = 0;
  config.dcqcn_g = 0;
  config.dcqcn_alpha_timer_ns = 0;
  config.dcqcn_rate_timer_ns = 0;
  config.dcqcn_byte_counter = 0;
  config.swift_min_window_packets = 100;
  config.swift_max_window_packets = 0;
  config.swift_max_decrease = 7;
  for (CcAlgorithm algorithm : {CcAlgorithm::none, CcAlgorithm::dcqcn, CcAlgorithm::swift}) {
    auto cc = make_congestion_control(algorithm, config);
    for (uint64_t t = 1; t < 100; ++t) {
      cc->on_send(t, 1);
      cc->on_ack(t, 1, t % 3 == 0 ? 1'000'000 : 5);
      if (t % 7 == 0) cc->on_congestion_notification(t);
      if (t % 11 == 0) cc->on_loss(t);
      cc->on_tick(t);
      EXPECT_GE(cc->rate_bps(), 1u);
      EXPECT_GE(cc->window_bytes(), 1u);
      EXPECT_NE(cc->next_send_time_ns(t, 0, 1), UINT64_MAX);  // never stuck with nothing in flight
    }
  }
}

// ---------------------------------------------------------------- DCQCN

CcConfig dcqcn_config() { return CcConfig{}; }

TEST(CcDcqcn, StartsAtLineRateAndIsPureRate) {
  DcqcnControl cc(dcqcn_config());
  EXPECT_EQ(cc.rate_bps(), 100'000'000'000u);
  EXPECT_EQ(cc.window_bytes(), UINT64_MAX);
  EXPECT_DOUBLE_EQ(cc.alpha(), 1.0);
  EXPECT_FALSE(cc.recovering());
  EXPECT_TRUE(cc.can_send(0, UINT64_MAX / 2, 4096));  // inflight does not matter
}

TEST(CcDcqcn, CnpCutsRateByHalfAlpha) {
  CcConfig config = dcqcn_config();
  config.dcqcn_rate_timer_ns = 0;  // no recovery in between: isolate the cut
  const double g = config.dcqcn_g;
  const double k = static_cast<double>(config.dcqcn_alpha_timer_ns);
  DcqcnControl cc(config);

  // alpha starts at 1: the first cut halves; Rt remembers the old rate.
  cc.on_congestion_notification(1000);
  EXPECT_DOUBLE_EQ(cc.current_rate(), 50 * kGbps);
  EXPECT_DOUBLE_EQ(cc.target_rate(), 100 * kGbps);
  EXPECT_EQ(cc.rate_bps(), 50'000'000'000u);
  EXPECT_DOUBLE_EQ(cc.alpha(), 1.0);  // (1-g)*1 + g
  EXPECT_TRUE(cc.recovering());

  // Ten quiet alpha periods: alpha = (1-g)^10; the next cut is by alpha/2 of that.
  cc.on_tick(1000 + static_cast<uint64_t>(10 * k));
  const double decayed = std::pow(1 - g, 10);
  EXPECT_NEAR(cc.alpha(), decayed, 1e-12);
  cc.on_congestion_notification(1000 + static_cast<uint64_t>(10 * k) + 1);
  EXPECT_NEAR(cc.current_rate(), 50 * kGbps * (1 - decayed / 2), 1.0);
  EXPECT_DOUBLE_EQ(cc.target_rate(), 50 * kGbps);
  EXPECT_NEAR(cc.alpha(), (1 - g) * decayed + g, 1e-12);
  EXPECT_LT(cc.current_rate(), 50 * kGbps * 0.55);  // a small-ish alpha still cuts, but less than half
  EXPECT_GT(cc.current_rate(), 50 * kGbps * 0.5);
}

TEST(CcDcqcn, AlphaDecaysOnlyWithoutCnp) {
  CcConfig config = dcqcn_config();
  const double g = config.dcqcn_g;
  const uint64_t k = config.dcqcn_alpha_timer_ns;
  DcqcnControl cc(config);
  cc.on_tick(0);
  EXPECT_DOUBLE_EQ(cc.alpha(), 1.0);  // timers are not armed before the first cut
  cc.on_tick(100 * k);
  EXPECT_DOUBLE_EQ(cc.alpha(), 1.0);

  const uint64_t t0 = 100 * k + 1000;
  cc.on_congestion_notification(t0);
  cc.on_tick(t0 + k - 1);
  EXPECT_DOUBLE_EQ(cc.alpha(), 1.0);
  cc.on_tick(t0 + k);
  EXPECT_DOUBLE_EQ(cc.alpha(), 1 - g);
  cc.on_tick(t0 + 3 * k);
  EXPECT_NEAR(cc.alpha(), std::pow(1 - g, 3), 1e-15);

  // A CNP restarts the period: the old deadline (t0 + 4k) passes without decay.
  const uint64_t t1 = t0 + 3 * k + 5;
  cc.on_congestion_notification(t1);
  const double after_cnp = (1 - g) * std::pow(1 - g, 3) + g;
  EXPECT_NEAR(cc.alpha(), after_cnp, 1e-15);
  cc.on_tick(t0 + 4 * k);
  EXPECT_NEAR(cc.alpha(), after_cnp, 1e-15);
  cc.on_tick(t1 + k);
  EXPECT_NEAR(cc.alpha(), after_cnp * (1 - g), 1e-15);
}

TEST(CcDcqcn, AlphaGrowsWithRepeatedCnps) {
  CcConfig config = dcqcn_config();
  config.dcqcn_rate_timer_ns = 0;
  const double g = config.dcqcn_g;
  DcqcnControl cc(config);
  cc.on_congestion_notification(0);
  cc.on_tick(1000 * config.dcqcn_alpha_timer_ns);  // alpha ~ 0.02
  double alpha = cc.alpha();
  ASSERT_LT(alpha, 0.05);
  double rate = cc.current_rate();
  for (int i = 0; i < 20; ++i) {
    cc.on_congestion_notification(1000 * config.dcqcn_alpha_timer_ns + i);
    EXPECT_NEAR(cc.current_rate(), rate * (1 - alpha / 2), 1.0) << i;  // cut with the alpha before this CNP
    EXPECT_NEAR(cc.alpha(), (1 - g) * alpha + g, 1e-15) << i;
    EXPECT_GT(cc.alpha(), alpha) << i;
    alpha = cc.alpha();
    rate = cc.current_rate();
  }
}

TEST(CcDcqcn, RecoversFastThenAdditiveThenHyper) {
  CcConfig config = dcqcn_config();
  const uint64_t k = config.dcqcn_rate_timer_ns;
  const uint32_t f = config.dcqcn_fast_recovery_steps;
  const double ai = static_cast<double>(config.dcqcn_additive_increase_bps);
  const double hai = static_cast<double>(config.dcqcn_hyper_increase_bps);
  DcqcnControl cc(config);

  // Two cuts with alpha = 1: Rc 100 -> 50 (Rt 100), then Rt = 50, Rc = 25.
  cc.on_congestion_notification(0);
  cc.on_congestion_notification(0);
  double rt = 50 * kGbps, rc = 25 * kGbps;
  ASSERT_DOUBLE_EQ(cc.target_rate(), rt);
  ASSERT_DOUBLE_EQ(cc.current_rate(), rc);

  uint64_t now = 0;
  auto timer_event = [&] {
    now += k;
    cc.on_tick(now);
  };
  // Fast recovery: F timer events, Rt fixed, Rc halves the gap each time.
  for (uint32_t i = 1; i <= f; ++i) {
    timer_event();
    rc = (rt + rc) / 2;
    EXPECT_NEAR(cc.current_rate(), rc, 1.0) << i;
    EXPECT_DOUBLE_EQ(cc.target_rate(), rt) << i;
    EXPECT_EQ(cc.timer_events(), i);
  }
  EXPECT_NEAR(cc.current_rate(), 50 * kGbps - 25 * kGbps / 32, 1.0);

  // Additive increase: the target itself climbs past where it was cut.
  for (int i = 0; i < 15; ++i) {
    timer_event();
    rt += ai;
    rc = (rt + rc) / 2;
    EXPECT_NEAR(cc.target_rate(), rt, 1.0);
    EXPECT_NEAR(cc.current_rate(), rc, 1.0);
  }
  EXPECT_GT(cc.current_rate(), 50 * kGbps);  // above the old target
  EXPECT_EQ(cc.timer_events(), f + 15);
  EXPECT_EQ(cc.byte_events(), 0u);  // timer alone never reaches hyper increase

  // Bytes sent drive the other counter: additive until it passes F too, then hyper.
  const uint32_t chunk = static_cast<uint32_t>(config.dcqcn_byte_counter);
  for (uint32_t i = 1; i <= f; ++i) {
    cc.on_send(now + i, chunk);
    rt += ai;
    rc = (rt + rc) / 2;
    EXPECT_NEAR(cc.target_rate(), rt, 1.0) << i;
    EXPECT_EQ(cc.byte_events(), i);
  }
  cc.on_send(now + 10, chunk);  // BC = F+1, T = F+15: hyper stage 1
  rt += 1 * hai;
  rc = (rt + rc) / 2;
  EXPECT_NEAR(cc.target_rate(), rt, 1.0);
  EXPECT_NEAR(cc.current_rate(), rc, 1.0);
  cc.on_send(now + 11, chunk);  // BC = F+2: hyper stage 2
  rt += 2 * hai;
  rc = (rt + rc) / 2;
  EXPECT_NEAR(cc.target_rate(), rt, 1.0);
  timer_event();  // T grows too, min(T, BC) still F+2
  rt += 2 * hai;
  rc = (rt + rc) / 2;
  EXPECT_NEAR(cc.target_rate(), rt, 1.0);
  EXPECT_NEAR(cc.current_rate(), rc, 1.0);

  // Half a byte counter does nothing; the other half completes an event.
  const double before = cc.target_rate();
  cc.on_send(now + 1, chunk / 2);
  EXPECT_DOUBLE_EQ(cc.target_rate(), before);
  cc.on_send(now + 2, chunk / 2);
  EXPECT_GT(cc.target_rate(), before);

  // A new CNP starts over from fast recovery, byte counter included: half a
  // counter before the CNP and half after make no event.
  cc.on_send(now + 3, chunk / 2);
  cc.on_congestion_notification(now + 4);
  EXPECT_EQ(cc.timer_events(), 0u);
  EXPECT_EQ(cc.byte_events(), 0u);
  cc.on_send(now + 5, chunk / 2);
  EXPECT_EQ(cc.byte_events(), 0u);
  cc.on_send(now + 6, chunk / 2);
  EXPECT_EQ(cc.byte_events(), 1u);
}

TEST(CcDcqcn, RateStaysBetweenMinAndLine) {
  CcConfig config = dcqcn_config();
  const double line = static_cast<double>(config.line_rate_bps);
  const double floor = static_cast<double>(config.dcqcn_min_rate_bps);
  DcqcnControl cc(config);
  for (int i = 0; i < 100; ++i) {
    cc.on_congestion_notification(i);
    EXPECT_GE(cc.current_rate(), floor);
  }
  EXPECT_EQ(cc.rate_bps(), config.dcqcn_min_rate_bps);

  // A long silence catches up on the missed timer events in one call and
  // lands exactly on line rate, then stops increasing.
  cc.on_tick(3'600'000'000'000ull);
  EXPECT_EQ(cc.rate_bps(), config.line_rate_bps);
  EXPECT_DOUBLE_EQ(cc.target_rate(), line);
  EXPECT_FALSE(cc.recovering());

  // A deterministic storm of mixed signals never leaves [min, line].
  uint64_t now = 3'600'000'000'000ull;
  uint32_t lcg = 12345;
  for (int i = 0; i < 200'000; ++i) {
    lcg = lcg * 1664525u + 1013904223u;
    now += lcg % 20'000;
    switch ((lcg >> 16) % 8) {
      case 0: cc.on_congestion_notification(now); break;
      case 1: cc.on_loss(now); break;
      case 2: cc.on_send(now, UINT32_MAX); break;  // ~400 byte-counter events at once
      default: cc.on_send(now, 4096); cc.on_tick(now); break;
    }
    ASSERT_GE(cc.current_rate(), floor) << i;
    ASSERT_LE(cc.current_rate(), line) << i;
    ASSERT_LE(cc.target_rate(), line) << i;
  }
}

TEST(CcDcqcn, LossAndTimeoutCutLikeCnp) {
  DcqcnControl loss(dcqcn_config()), timeout(dcqcn_config()), cnp(dcqcn_config());
  loss.on_loss(10);
  timeout.on_timeout(10);
  cnp.on_congestion_notification(10);
  EXPECT_DOUBLE_EQ(loss.current_rate(), 50 * kGbps);
  EXPECT_DOUBLE_EQ(timeout.current_rate(), 50 * kGbps);
  EXPECT_DOUBLE_EQ(loss.alpha(), cnp.alpha());
  EXPECT_TRUE(timeout.recovering());
}

TEST(CcDcqcn, PacingSpacesSendsAtTheRate) {
  // 4100 bytes at 64 Gbit/s = 512.5 ns: fractional, yet exact in binary.
  // A sender may run up to 64 KiB of the rate (8192 ns here) ahead of its
  // pacing clock, so that a software host sends a GSO message per call.
  CcConfig config = dcqcn_config();
  config.line_rate_bps = 64'000'000'000ull;
  const uint32_t bytes = 4100;
  const uint64_t allowance = 8192;
  DcqcnControl cc(config);

  EXPECT_TRUE(cc.can_send(0, 0, bytes));
  EXPECT_EQ(cc.next_send_time_ns(0, 0, bytes), 0u);
  // A burst at one instant: packets until the clock is more than the
  // allowance ahead (16 packets = 8200 ns > 8192 after the 16th).
  int burst = 0;
  while (cc.can_send(0, 0, bytes)) {
    cc.on_send(0, bytes);
    ++burst;
  }
  EXPECT_EQ(burst, 16);
  // Then the clock decides: the next packet when it is within the allowance.
  EXPECT_EQ(cc.next_send_time_ns(0, 0, bytes), 8200u - allowance);
  EXPECT_FALSE(cc.can_send(7, 0, bytes));
  EXPECT_TRUE(cc.can_send(8, 0, bytes));

  // Back-to-back at the pacing clock: the half nanoseconds are not lost.
  uint64_t now = 8;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(cc.can_send(now, 0, bytes));
    cc.on_send(now, bytes);
    now = cc.next_send_time_ns(now, 0, bytes);
  }
  EXPECT_EQ(now, 116 * 5125u / 10 - allowance);  // 116 packets' time, less the allowance

  // Idle time is not banked: after a pause the burst is again at most 64 KiB.
  burst = 0;
  while (cc.can_send(1'000'000, 0, bytes)) {
    cc.on_send(1'000'000, bytes);
    ++burst;
  }
  EXPECT_EQ(burst, 16);

  // After a cut to half the rate, packets are twice as far apart (and the
  // allowance, still 64 KiB, twice as long).
  cc.on_congestion_notification(2'000'000);
  ASSERT_EQ(cc.rate_bps(), 32'000'000'000u);
  for (int i = 0; i < 20; ++i) cc.on_send(2'000'000, bytes);  // 20 x 1025 ns from 2 ms
  EXPECT_EQ(cc.next_send_time_ns(2'000'000, 0, bytes), 2'000'000u + 20 * 1025 - 2 * allowance);
}

TEST(CcDcqcn, SenderDrivenByNextSendTimeAchievesTheRate) {
  CcConfig config = dcqcn_config();
  config.dcqcn_rate_timer_ns = 0;
  config.dcqcn_byte_counter = 0;  // hold the cut rate still
  DcqcnControl cc(config);
  cc.on_congestion_notification(0);  // 50 Gbit/s
  uint64_t now = 0, sent = 0;
  const uint64_t end = 10'000'000;  // 10 ms
  while (now < end) {
    cc.on_send(now, 4096);
    sent += 4096;
    now = cc.next_send_time_ns(now, 0, 4096);
  }
  // The rate, plus at most the one 64 KiB burst the allowance lets through.
  const double rate_bytes = 50 * kGbps / 8 * (static_cast<double>(end) * 1e-9);
  EXPECT_GE(static_cast<double>(sent), rate_bytes);
  EXPECT_LE(static_cast<double>(sent), rate_bytes + 65536 + 4096);
}

// ---------------------------------------------------------------- Swift

CcConfig swift_config() {
  CcConfig config;
  config.base_rtt_ns = 10'000;
  config.swift_target_delay_ns = 25'000;  // target RTT 35 us
  config.initial_window_packets = 10;
  return config;
}

TEST(CcSwift, StartsAtInitialWindow) {
  SwiftControl cc(swift_config());
  EXPECT_EQ(cc.target_rtt_ns(), 35'000u);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 10);
  EXPECT_EQ(cc.window_bytes(), 10u * 4096);
  EXPECT_EQ(cc.rate_bps(), CcConfig{}.line_rate_bps);
  EXPECT_FALSE(cc.pacing());
}

TEST(CcSwift, GrowsAboutOnePacketPerRttUnderTarget) {
  SwiftControl cc(swift_config());
  cc.on_ack(1, 4096, 20'000);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 10.1);  // ai / cwnd per acked packet
  double expected = 10.1;
  for (int i = 0; i < 10; ++i) {
    cc.on_ack(2 + i, 4096, 34'999);
    expected += 1.0 / expected;
  }
  EXPECT_NEAR(cc.window_packets(), expected, 1e-12);
  EXPECT_GT(cc.window_packets(), 11.0);
  // A partial packet grows proportionally; an ack without an RTT sample does nothing.
  const double before = cc.window_packets();
  cc.on_ack(20, 2048, 20'000);
  EXPECT_NEAR(cc.window_packets(), before + 0.5 / before, 1e-12);
  const double now_window = cc.window_packets();
  cc.on_ack(21, 4096 * 100, 0);
  EXPECT_DOUBLE_EQ(cc.window_packets(), now_window);
  // CNPs are not Swift's signal.
  cc.on_congestion_notification(22);
  EXPECT_DOUBLE_EQ(cc.window_packets(), now_window);
}

TEST(CcSwift, ShrinksInProportionToExcessDelayBounded) {
  // rtt 70 us = 2x target: excess 0.5, factor 1 - 0.8 * 0.5 = 0.6.
  SwiftControl twice(swift_config());
  twice.on_ack(1, 4096, 70'000);
  EXPECT_NEAR(twice.window_packets(), 6.0, 1e-12);

  SwiftControl slight(swift_config()), more(swift_config()), huge(swift_config());
  slight.on_ack(1, 4096, 40'000);  // 1 - 0.8 * 5/40  = 0.9
  more.on_ack(1, 4096, 50'000);    // 1 - 0.8 * 15/50 = 0.76
  huge.on_ack(1, 4096, 1'000'000); // 1 - 0.8 * 0.965 = 0.228 -> bounded to 0.5
  EXPECT_NEAR(slight.window_packets(), 9.0, 1e-12);
  EXPECT_NEAR(more.window_packets(), 7.6, 1e-12);
  EXPECT_NEAR(huge.window_packets(), 5.0, 1e-12);
  EXPECT_GT(slight.window_packets(), more.window_packets());
  EXPECT_GT(more.window_packets(), huge.window_packets());

  // Exactly at target counts as over (no growth), with a zero-size cut.
  SwiftControl at(swift_config());
  at.on_ack(1, 4096, 35'000);
  EXPECT_DOUBLE_EQ(at.window_packets(), 10.0);
}

TEST(CcSwift, DecreasesAtMostOncePerRtt) {
  SwiftControl cc(swift_config());
  cc.on_ack(1000, 4096, 70'000);
  EXPECT_NEAR(cc.window_packets(), 6.0, 1e-12);
  cc.on_ack(1000 + 69'999, 4096, 70'000);  // same RTT: ignored
  EXPECT_NEAR(cc.window_packets(), 6.0, 1e-12);
  cc.on_loss(1000 + 69'999);               // loss in that RTT too
  EXPECT_NEAR(cc.window_packets(), 6.0, 1e-12);
  cc.on_ack(1000 + 70'000, 4096, 70'000);  // one RTT later: cut again
  EXPECT_NEAR(cc.window_packets(), 3.6, 1e-12);
  // Increases are not rate-limited.
  cc.on_ack(1000 + 70'001, 4096, 10'000);
  EXPECT_NEAR(cc.window_packets(), 3.6 + 1 / 3.6, 1e-12);
}

TEST(CcSwift, LossHalvesOncePerRtt) {
  CcConfig config = swift_config();
  config.initial_window_packets = 100;
  SwiftControl cc(config);
  cc.on_loss(0);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 50);
  cc.on_loss(9'999);  // no RTT sample yet: base RTT (10 us) is the interval
  EXPECT_DOUBLE_EQ(cc.window_packets(), 50);
  cc.on_loss(10'000);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 25);
}

TEST(CcSwift, TimeoutCollapsesToMinimum) {
  SwiftControl cc(swift_config());
  cc.on_timeout(5);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 1);
  EXPECT_EQ(cc.window_bytes(), 4096u);

  CcConfig config = swift_config();
  config.swift_min_window_packets = 4;
  SwiftControl floor4(config);
  floor4.on_timeout(5);
  EXPECT_DOUBLE_EQ(floor4.window_packets(), 4);
}

TEST(CcSwift, RespectsWindowBounds) {
  CcConfig config = swift_config();
  config.swift_min_window_packets = 2;
  config.swift_max_window_packets = 20;
  config.initial_window_packets = 1000;  // clamped
  SwiftControl cc(config);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 20);
  for (int i = 0; i < 1000; ++i) cc.on_ack(i, 4096, 10'000);
  EXPECT_DOUBLE_EQ(cc.window_packets(), 20);
  uint64_t now = 0;
  for (int i = 0; i < 50; ++i) {
    now += 1'000'000;
    cc.on_ack(now, 4096, 1'000'000);
    ASSERT_GE(cc.window_packets(), 2.0);
  }
  EXPECT_DOUBLE_EQ(cc.window_packets(), 2);
}

TEST(CcSwift, WindowGatesSends) {
  SwiftControl cc(swift_config());  // 10 packets = 40960 bytes
  EXPECT_TRUE(cc.can_send(0, 36864, 4096));
  EXPECT_EQ(cc.next_send_time_ns(7, 36864, 4096), 7u);
  EXPECT_FALSE(cc.can_send(0, 36865, 4096));
  EXPECT_EQ(cc.next_send_time_ns(7, 36865, 4096), UINT64_MAX);  // only an ack opens it
  EXPECT_TRUE(cc.can_send(0, 0, 1'000'000));  // nothing in flight: always one packet
}

TEST(CcSwift, PacesBelowOnePacket) {
  CcConfig config = swift_config();
  config.swift_min_window_packets = 0;
  config.initial_window_packets = 1;
  SwiftControl cc(config);
  cc.on_loss(0);
  ASSERT_DOUBLE_EQ(cc.window_packets(), 0.5);
  ASSERT_TRUE(cc.pacing());
  EXPECT_EQ(cc.window_bytes(), 2048u);
  // One packet every rtt / cwnd = 10 us / 0.5 = 20 us -> 4096 B per 20 us.
  EXPECT_EQ(cc.rate_bps(), 1'638'400'000u);

  EXPECT_TRUE(cc.can_send(1000, 0, 4096));
  cc.on_send(1000, 4096);
  EXPECT_FALSE(cc.can_send(20'999, 0, 4096));  // paced even with nothing in flight
  EXPECT_EQ(cc.next_send_time_ns(5000, 0, 4096), 21'000u);
  EXPECT_TRUE(cc.can_send(21'000, 4096, 4096));  // and not held by the window

  // Keeps shrinking toward the fractional floor, never to zero.
  uint64_t now = 21'000;
  for (int i = 0; i < 100; ++i) {
    now += 1'000'000;
    cc.on_loss(now);
  }
  EXPECT_GT(cc.window_packets(), 0.0);
  EXPECT_NE(cc.next_send_time_ns(now, 0, 4096), UINT64_MAX);

  // Below one packet the increase is ai per acked packet (not ai/cwnd, which
  // would explode), back into window mode.
  const double floor = cc.window_packets();
  EXPECT_NEAR(floor, 0.001, 1e-12);
  cc.on_ack(now, 4096, 10'000);
  EXPECT_NEAR(cc.window_packets(), floor + 1.0, 1e-12);
  EXPECT_FALSE(cc.pacing());
  EXPECT_EQ(cc.rate_bps(), config.line_rate_bps);
}

}  // namespace
}  // namespace stellar::offload

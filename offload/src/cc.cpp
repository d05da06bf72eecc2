#include "stellar/offload/cc.hpp"

#include <algorithm>
#include <cmath>

namespace stellar::offload {

namespace {

// A controller left without ticks for a very long time (idle QP) catches up at
// most this many DCQCN increase events per call; more than enough to climb
// from the minimum to line rate with the default knobs, and it keeps a single
// call bounded whatever the knobs or the gap.
constexpr uint32_t kMaxIncreaseEventsPerCall = 1u << 14;

// Swift lets the window fall to a thousandth of a packet before it stops
// shrinking (the paper's minimum); below that, pacing intervals get absurd.
constexpr double kSwiftWindowFloorPackets = 0.001;

constexpr double kNsPerSecond = 1e9;

uint64_t saturating_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

// Moves a pacing clock past one transmission of `delay_ns` (fractional).
// Idle time is not banked: a sender that was quiet starts from now, not from
// an old clock, so it cannot burst afterwards. The carried fraction keeps the
// long-run rate exact despite integer nanoseconds.
void advance_pacing(uint64_t now_ns, double delay_ns, uint64_t& clock_ns, double& carry_ns) {
  if (clock_ns < now_ns) {
    clock_ns = now_ns;
    carry_ns = 0;
  }
  const double total = carry_ns + delay_ns;
  const double whole = std::floor(total);
  carry_ns = total - whole;
  clock_ns = whole >= static_cast<double>(UINT64_MAX - clock_ns) ? UINT64_MAX : clock_ns + static_cast<uint64_t>(whole);
}

CcConfig sanitized(CcConfig c) {
  c.line_rate_bps = std::max<uint64_t>(c.line_rate_bps, 1);
  c.mtu_bytes = std::max<uint32_t>(c.mtu_bytes, 1);
  c.dcqcn_min_rate_bps = std::clamp<uint64_t>(c.dcqcn_min_rate_bps, 1, c.line_rate_bps);
  if (!(c.dcqcn_g > 0.0 && c.dcqcn_g <= 1.0)) c.dcqcn_g = 1.0 / 256;  // also catches NaN
  if (!(c.swift_beta >= 0.0)) c.swift_beta = 0.0;
  if (!(c.swift_max_decrease >= 0.0 && c.swift_max_decrease <= 1.0)) c.swift_max_decrease = 0.5;
  if (!(c.swift_additive_increase_packets >= 0.0)) c.swift_additive_increase_packets = 0.0;
  c.swift_max_window_packets = std::max<uint32_t>(c.swift_max_window_packets, 1);
  c.swift_min_window_packets = std::min(c.swift_min_window_packets, c.swift_max_window_packets);
  return c;
}

}  // namespace

const char* to_string(CcAlgorithm algorithm) {
  switch (algorithm) {
    case CcAlgorithm::none: return "none";
    case CcAlgorithm::dcqcn: return "dcqcn";
    case CcAlgorithm::swift: return "swift";
  }
  return "unknown";
}

std::unique_ptr<CongestionControl> make_congestion_control(CcAlgorithm algorithm, const CcConfig& config) {
  switch (algorithm) {
    case CcAlgorithm::none: return std::make_unique<NoCongestionControl>(config);
    case CcAlgorithm::dcqcn: return std::make_unique<DcqcnControl>(config);
    case CcAlgorithm::swift: return std::make_unique<SwiftControl>(config);
  }
  return nullptr;
}

NoCongestionControl::NoCongestionControl(const CcConfig& config)
    : line_rate_bps_(sanitized(config).line_rate_bps) {}

// ---------------------------------------------------------------- DCQCN

DcqcnControl::DcqcnControl(const CcConfig& config)
    : config_(sanitized(config)),
      current_rate_bps_(static_cast<double>(config_.line_rate_bps)),
      target_rate_bps_(current_rate_bps_) {}

void DcqcnControl::on_send(uint64_t now_ns, uint32_t bytes) {
  advance_timers(now_ns);
  advance_pacing(now_ns, bytes * 8.0 * kNsPerSecond / current_rate_bps_, pace_clock_ns_, pace_carry_ns_);
  // The byte counter only matters while recovering; at line rate an event
  // would change nothing.
  if (!recovering_ || config_.dcqcn_byte_counter == 0) return;
  bytes_since_event_ += bytes;
  uint32_t events = 0;
  while (bytes_since_event_ >= config_.dcqcn_byte_counter && recovering_ &&
         events++ < kMaxIncreaseEventsPerCall) {
    bytes_since_event_ -= config_.dcqcn_byte_counter;
    if (byte_events_ < UINT32_MAX) ++byte_events_;
    increase_event();
  }
  bytes_since_event_ %= config_.dcqcn_byte_counter;
}

void DcqcnControl::on_ack(uint64_t now_ns, uint64_t, uint64_t) { advance_timers(now_ns); }

void DcqcnControl::on_congestion_notification(uint64_t now_ns) { cut(now_ns); }
void DcqcnControl::on_loss(uint64_t now_ns) { cut(now_ns); }
void DcqcnControl::on_timeout(uint64_t now_ns) { cut(now_ns); }
void DcqcnControl::on_tick(uint64_t now_ns) { advance_timers(now_ns); }

// How far ahead of its pacing clock a sender may be: 64 KiB at the current
// rate, at most 1 ms (as Linux sizes TSO bursts). The long-run rate is the
// clock's, but a host that transmits in batches hands the kernel one GSO
// message of 16 packets instead of one packet per call -- which, at 100
// Gbit/s line rate (328 ns per 4 KiB packet), was one system call per
// packet. A NIC paces each packet; software cannot at this grain.
uint64_t DcqcnControl::pacing_allowance_ns() const {
  return static_cast<uint64_t>(std::min(65536.0 * 8.0 * kNsPerSecond / current_rate_bps_, 1e6));
}

bool DcqcnControl::can_send(uint64_t now_ns, uint64_t, uint32_t) const { return pace_clock_ns_ <= saturating_add(now_ns, pacing_allowance_ns()); }

uint64_t DcqcnControl::next_send_time_ns(uint64_t now_ns, uint64_t, uint32_t) const {
  const uint64_t allowance = pacing_allowance_ns();
  return std::max(now_ns, pace_clock_ns_ > allowance ? pace_clock_ns_ - allowance : 0);
}

void DcqcnControl::cut(uint64_t now_ns) {
  advance_timers(now_ns);  // events due before this CNP happened before it
  // Paper order: the cut uses the alpha of before this CNP, then alpha learns.
  target_rate_bps_ = current_rate_bps_;
  current_rate_bps_ = std::max(current_rate_bps_ * (1.0 - alpha_ / 2.0), static_cast<double>(config_.dcqcn_min_rate_bps));
  alpha_ = (1.0 - config_.dcqcn_g) * alpha_ + config_.dcqcn_g;
  // A CNP restarts every counter: the alpha timer measures "K without a CNP",
  // and recovery starts over from fast recovery.
  timer_events_ = 0;
  byte_events_ = 0;
  bytes_since_event_ = 0;
  alpha_timer_armed_ = config_.dcqcn_alpha_timer_ns != 0;
  alpha_deadline_ns_ = saturating_add(now_ns, config_.dcqcn_alpha_timer_ns);
  recovering_ = true;
  rate_deadline_ns_ = saturating_add(now_ns, config_.dcqcn_rate_timer_ns);
}

void DcqcnControl::advance_timers(uint64_t now_ns) {
  if (alpha_timer_armed_ && now_ns >= alpha_deadline_ns_) {
    // Every elapsed period without a CNP decays alpha once; done in one step
    // so a long quiet gap costs the same as a short one.
    const uint64_t periods = (now_ns - alpha_deadline_ns_) / config_.dcqcn_alpha_timer_ns + 1;
    alpha_ *= std::pow(1.0 - config_.dcqcn_g, static_cast<double>(periods));
    alpha_deadline_ns_ = saturating_add(alpha_deadline_ns_, periods * config_.dcqcn_alpha_timer_ns);
  }
  uint32_t events = 0;
  while (recovering_ && config_.dcqcn_rate_timer_ns != 0 && now_ns >= rate_deadline_ns_) {
    if (events++ == kMaxIncreaseEventsPerCall) {  // drop the rest of a huge gap
      rate_deadline_ns_ = saturating_add(now_ns, config_.dcqcn_rate_timer_ns);
      break;
    }
    rate_deadline_ns_ = saturating_add(rate_deadline_ns_, config_.dcqcn_rate_timer_ns);
    if (timer_events_ < UINT32_MAX) ++timer_events_;
    increase_event();
  }
}

// One rate-increase event (timer or byte counter), DCQCN's three phases:
// fast recovery while neither counter passed F, hyper increase once both
// have, additive increase in between.
void DcqcnControl::increase_event() {
  const uint32_t steps = config_.dcqcn_fast_recovery_steps;
  const uint32_t most = std::max(timer_events_, byte_events_);
  const uint32_t least = std::min(timer_events_, byte_events_);
  const double line = static_cast<double>(config_.line_rate_bps);
  if (most <= steps) {
    // Fast recovery: Rt stays, Rc closes half the gap.
  } else if (least > steps) {
    target_rate_bps_ += static_cast<double>(least - steps) * static_cast<double>(config_.dcqcn_hyper_increase_bps);
  } else {
    target_rate_bps_ += static_cast<double>(config_.dcqcn_additive_increase_bps);
  }
  target_rate_bps_ = std::min(target_rate_bps_, line);
  current_rate_bps_ = std::min((target_rate_bps_ + current_rate_bps_) / 2.0, line);
  // Back at line rate (within 1 bit/s, halving never quite lands on it):
  // nothing left to recover, stop the increase machinery.
  if (target_rate_bps_ >= line && line - current_rate_bps_ < 1.0) {
    current_rate_bps_ = line;
    recovering_ = false;
  }
}

// ---------------------------------------------------------------- Swift

SwiftControl::SwiftControl(const CcConfig& config)
    : config_(sanitized(config)),
      target_rtt_ns_(saturating_add(config_.base_rtt_ns, config_.swift_target_delay_ns)),
      min_window_packets_(std::max<double>(config_.swift_min_window_packets, kSwiftWindowFloorPackets)),
      max_window_packets_(config_.swift_max_window_packets),
      window_packets_(clamp(config_.initial_window_packets)),
      rtt_ns_(std::max<uint64_t>(config_.base_rtt_ns, 1)) {}

double SwiftControl::clamp(double window_packets) const {
  return std::clamp(window_packets, min_window_packets_, max_window_packets_);
}

void SwiftControl::on_send(uint64_t now_ns, uint32_t bytes) {
  if (!pacing()) return;
  // Below one packet per RTT Swift paces: one MTU every rtt/cwnd.
  const double packets = static_cast<double>(bytes) / config_.mtu_bytes;
  advance_pacing(now_ns, packets * static_cast<double>(rtt_ns_) / window_packets_, pace_clock_ns_, pace_carry_ns_);
}

void SwiftControl::on_ack(uint64_t now_ns, uint64_t acked_bytes, uint64_t rtt_ns) {
  if (rtt_ns == 0) return;  // no delay sample (retransmission ambiguity): no signal either way
  rtt_ns_ = rtt_ns;
  const double acked_packets = static_cast<double>(acked_bytes) / config_.mtu_bytes;
  if (rtt_ns < target_rtt_ns_) {
    // +ai per RTT: each acked packet adds ai/cwnd. Below one packet that would
    // explode, so Swift adds ai per packet there instead.
    const double ai = config_.swift_additive_increase_packets;
    window_packets_ += window_packets_ >= 1.0 ? ai * acked_packets / window_packets_ : ai * acked_packets;
    window_packets_ = clamp(window_packets_);
  } else if (can_decrease(now_ns)) {
    // Cut in proportion to how far over target the delay is, never more than
    // max_decrease at once.
    const double excess = static_cast<double>(rtt_ns - target_rtt_ns_) / static_cast<double>(rtt_ns);
    decrease_to(now_ns, std::max(1.0 - config_.swift_beta * excess, 1.0 - config_.swift_max_decrease));
  }
}

void SwiftControl::on_loss(uint64_t now_ns) {
  if (can_decrease(now_ns)) decrease_to(now_ns, 1.0 - config_.swift_max_decrease);
}

void SwiftControl::on_timeout(uint64_t now_ns) {
  // A timeout means even acks stopped: start over from the smallest window.
  window_before_timeout_ = window_packets_;  // what on_spurious_timeout restores (this timeout's only)
  window_packets_ = min_window_packets_;
  decreased_ = true;
  last_decrease_ns_ = now_ns;
}

void SwiftControl::on_spurious_timeout(uint64_t) {
  // Acks stopped because the peer stalled, not because the path dropped: the
  // window from before the timeout still matches the path.
  if (window_before_timeout_ > window_packets_) window_packets_ = clamp(window_before_timeout_);
  window_before_timeout_ = 0;
}

bool SwiftControl::can_decrease(uint64_t now_ns) const {
  // Once per RTT: a decrease must be seen by the network (and echoed back in
  // the delay) before the next one is justified.
  return !decreased_ || now_ns >= saturating_add(last_decrease_ns_, rtt_ns_);
}

void SwiftControl::decrease_to(uint64_t now_ns, double factor) {
  window_packets_ = clamp(window_packets_ * factor);
  decreased_ = true;
  last_decrease_ns_ = now_ns;
}

bool SwiftControl::can_send(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const {
  if (pacing()) return pace_clock_ns_ <= now_ns;
  return inflight_bytes == 0 || saturating_add(inflight_bytes, bytes) <= window_bytes();
}

uint64_t SwiftControl::next_send_time_ns(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const {
  if (pacing()) return std::max(now_ns, pace_clock_ns_);
  return can_send(now_ns, inflight_bytes, bytes) ? now_ns : UINT64_MAX;
}

uint64_t SwiftControl::window_bytes() const {
  return static_cast<uint64_t>(window_packets_ * config_.mtu_bytes);
}

uint64_t SwiftControl::rate_bps() const {
  if (!pacing()) return config_.line_rate_bps;
  const double rate = window_packets_ * config_.mtu_bytes * 8.0 * kNsPerSecond / static_cast<double>(rtt_ns_);
  return std::min(static_cast<uint64_t>(rate), config_.line_rate_bps);
}

}  // namespace stellar::offload

// Congestion control: one interface, several algorithms, driven by the engine.
//
// Sans-I/O like the rest of offload/: a controller never reads a clock, never
// allocates after construction, never locks and never logs. Time comes in as
// `now_ns` (any monotonic nanosecond clock, the same one for every call on a
// controller; it must not go backwards). Signals come in through the on_*
// calls; the engine asks can_send / next_send_time_ns before each packet.
//
// Thread-safety: none. One controller belongs to one QP (or one path of a
// QP) and is driven by the single thread that runs that QP's engine.
//
// Algorithms:
//   - none   no limit; tests and baselines.
//   - dcqcn  rate-based, ECN/CNP-driven reaction point of DCQCN (Zhu et al.,
//            SIGCOMM'15), the RoCEv2 baseline. Paces at the current rate.
//   - swift  delay-based window in the spirit of Swift (Kumar et al.,
//            SIGCOMM'20) / Timely: grows while RTT is under a target delay,
//            shrinks in proportion to the excess. Paces when the window is
//            below one packet.
#pragma once

#include <cstdint>
#include <memory>

namespace stellar::offload {

enum class CcAlgorithm : uint8_t { none, dcqcn, swift };
const char* to_string(CcAlgorithm);  // "none", "dcqcn", "swift"; "unknown" otherwise

// Knobs of every algorithm. Out-of-range values are clamped to something safe
// at construction (zero MTU -> 1 byte, min above max -> max, zero timer
// period -> that timer disabled, ...) rather than rejected.
struct CcConfig {
  uint64_t line_rate_bps = 100'000'000'000ull;  // bits per second; the ceiling of any rate
  uint32_t mtu_bytes = 4096;                    // payload bytes per packet
  uint64_t base_rtt_ns = 10'000;                // expected unloaded RTT (swift target base)

  // DCQCN knobs (defaults from the DCQCN paper / Mellanox defaults).
  double dcqcn_g = 1.0 / 256;                   // alpha gain, in (0, 1]
  uint64_t dcqcn_alpha_timer_ns = 55'000;       // alpha decays once per period without CNP
  uint64_t dcqcn_rate_timer_ns = 55'000;        // one rate-increase event per period
  uint64_t dcqcn_byte_counter = 10ull << 20;    // one rate-increase event per this many bytes sent
  uint32_t dcqcn_fast_recovery_steps = 5;       // F: events of fast recovery after a cut
  uint64_t dcqcn_additive_increase_bps = 40'000'000;  // R_AI, added to the target rate
  uint64_t dcqcn_hyper_increase_bps = 100'000'000;    // R_HAI, times the hyper stage
  uint64_t dcqcn_min_rate_bps = 10'000'000;           // floor of the current rate

  // Swift knobs. The target RTT is base_rtt_ns + swift_target_delay_ns.
  uint64_t swift_target_delay_ns = 25'000;      // queueing delay tolerated above base RTT
  double swift_additive_increase_packets = 1.0; // window growth per RTT under target
  double swift_beta = 0.8;                      // decrease gain per unit of relative excess delay
  double swift_max_decrease = 0.5;              // largest fraction cut at once (also on loss)
  // Window bounds, in packets. A minimum of 0 lets the window fall below one
  // packet (down to 1/1000 of a packet, as Swift does); sends are then paced
  // one packet every rtt/cwnd.
  uint32_t swift_min_window_packets = 1;
  uint32_t swift_max_window_packets = 4096;
  uint32_t initial_window_packets = 256;
};

// The interface the engine drives. All byte counts are payload bytes.
class CongestionControl {
 public:
  virtual ~CongestionControl() = default;
  virtual CcAlgorithm algorithm() const = 0;
  // Called when `bytes` of payload leave (first transmission or retransmission).
  virtual void on_send(uint64_t now_ns, uint32_t bytes) = 0;
  // Called when newly acknowledged payload bytes arrive; rtt_ns is a fresh RTT
  // sample or 0 when none (e.g. from a retransmitted packet).
  virtual void on_ack(uint64_t now_ns, uint64_t acked_bytes, uint64_t rtt_ns) = 0;
  // An explicit congestion notification (RoCE CNP / ECN echo) arrived.
  virtual void on_congestion_notification(uint64_t now_ns) = 0;
  // Loss detected by SACK / NAK (fast recovery) or by the retransmission timer.
  virtual void on_loss(uint64_t now_ns) = 0;
  virtual void on_timeout(uint64_t now_ns) = 0;
  // The last timeout was spurious: a packet it declared lost turned out to
  // have arrived without retransmission (the peer was slow, not the network
  // lossy, as F-RTO / Eifel detect it). Undo that timeout's reduction.
  virtual void on_spurious_timeout(uint64_t) {}
  // Advances internal timers (DCQCN alpha/rate timers). Cheap; call on every engine poll.
  virtual void on_tick(uint64_t now_ns) = 0;
  // Whether `bytes` more may be sent now given `inflight_bytes` unacknowledged.
  // Window controllers check the window, rate controllers the pacing clock.
  virtual bool can_send(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const = 0;
  // Earliest time at which can_send may turn true again without an ack
  // arriving (pacing); UINT64_MAX if only an ack can open it, now_ns if it can send now.
  virtual uint64_t next_send_time_ns(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const = 0;
  virtual uint64_t window_bytes() const = 0;  // UINT64_MAX for pure rate controllers
  virtual uint64_t rate_bps() const = 0;      // current pacing rate, line rate for pure window controllers
  // The connection's packets carry `bytes` of payload from now on (path MTU
  // discovery settled below the configured size before the first send).
  virtual void set_mtu_bytes(uint32_t bytes) { (void)bytes; }
};

// Allocates once (at QP creation); never on the hot path. Returns nullptr for
// a value outside CcAlgorithm.
std::unique_ptr<CongestionControl> make_congestion_control(CcAlgorithm, const CcConfig&);

// The concrete controllers are public so that tests can observe their state
// and an engine may embed one by value instead of going through the factory.

class NoCongestionControl final : public CongestionControl {
 public:
  explicit NoCongestionControl(const CcConfig& config);
  CcAlgorithm algorithm() const override { return CcAlgorithm::none; }
  void on_send(uint64_t, uint32_t) override {}
  void on_ack(uint64_t, uint64_t, uint64_t) override {}
  void on_congestion_notification(uint64_t) override {}
  void on_loss(uint64_t) override {}
  void on_timeout(uint64_t) override {}
  void on_tick(uint64_t) override {}
  bool can_send(uint64_t, uint64_t, uint32_t) const override { return true; }
  uint64_t next_send_time_ns(uint64_t now_ns, uint64_t, uint32_t) const override { return now_ns; }
  uint64_t window_bytes() const override { return UINT64_MAX; }
  uint64_t rate_bps() const override { return line_rate_bps_; }

 private:
  uint64_t line_rate_bps_;
};

// DCQCN reaction point. Starts at line rate with alpha = 1; the first cut
// arms the alpha and rate-increase timers. Loss and timeout cut the rate
// exactly like a CNP: a RoCE NIC on a fabric without ECN marking still has
// to back off somewhere, and DCQCN has no other decrease signal.
// The window is unlimited (UINT64_MAX); only the pacing clock gates sends.
class DcqcnControl final : public CongestionControl {
 public:
  explicit DcqcnControl(const CcConfig& config);
  CcAlgorithm algorithm() const override { return CcAlgorithm::dcqcn; }
  void on_send(uint64_t now_ns, uint32_t bytes) override;
  void on_ack(uint64_t now_ns, uint64_t acked_bytes, uint64_t rtt_ns) override;
  void on_congestion_notification(uint64_t now_ns) override;
  void on_loss(uint64_t now_ns) override;
  void on_timeout(uint64_t now_ns) override;
  void on_tick(uint64_t now_ns) override;
  bool can_send(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const override;
  uint64_t next_send_time_ns(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const override;
  uint64_t window_bytes() const override { return UINT64_MAX; }
  uint64_t rate_bps() const override { return static_cast<uint64_t>(current_rate_bps_); }

  // Observers (for tests and counters).
  double alpha() const { return alpha_; }
  double current_rate() const { return current_rate_bps_; }  // Rc, bits per second
  double target_rate() const { return target_rate_bps_; }    // Rt, bits per second
  uint32_t timer_events() const { return timer_events_; }    // T since the last cut
  uint32_t byte_events() const { return byte_events_; }      // BC since the last cut
  bool recovering() const { return recovering_; }      // climbing back after a cut

 private:
  uint64_t pacing_allowance_ns() const;
  void cut(uint64_t now_ns);
  void advance_timers(uint64_t now_ns);
  void increase_event();

  CcConfig config_;
  double alpha_ = 1.0;
  double current_rate_bps_;
  double target_rate_bps_;
  uint32_t timer_events_ = 0;
  uint32_t byte_events_ = 0;
  uint64_t bytes_since_event_ = 0;
  bool alpha_timer_armed_ = false;
  bool recovering_ = false;
  uint64_t alpha_deadline_ns_ = 0;
  uint64_t rate_deadline_ns_ = 0;
  uint64_t pace_clock_ns_ = 0;  // earliest time the next packet may leave
  double pace_carry_ns_ = 0;    // fraction of a nanosecond owed, keeps the long-run rate exact
};

// Swift-style delay-based window, in packets (fractional). Decreases (delay,
// loss) happen at most once per RTT, measured with the latest RTT sample
// (base_rtt_ns until the first one). CNPs are ignored: the delay signal
// already sees the queue that the ECN mark reports.
class SwiftControl final : public CongestionControl {
 public:
  explicit SwiftControl(const CcConfig& config);
  CcAlgorithm algorithm() const override { return CcAlgorithm::swift; }
  void on_send(uint64_t now_ns, uint32_t bytes) override;
  void on_ack(uint64_t now_ns, uint64_t acked_bytes, uint64_t rtt_ns) override;
  void on_congestion_notification(uint64_t) override {}
  void on_loss(uint64_t now_ns) override;
  void on_timeout(uint64_t now_ns) override;
  void on_spurious_timeout(uint64_t now_ns) override;
  void on_tick(uint64_t) override {}
  bool can_send(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const override;
  uint64_t next_send_time_ns(uint64_t now_ns, uint64_t inflight_bytes, uint32_t bytes) const override;
  uint64_t window_bytes() const override;
  uint64_t rate_bps() const override;
  void set_mtu_bytes(uint32_t bytes) override { config_.mtu_bytes = bytes ? bytes : 1; }

  // Observers (for tests and counters).
  double window_packets() const { return window_packets_; }
  uint64_t target_rtt_ns() const { return target_rtt_ns_; }
  bool pacing() const { return window_packets_ < 1.0; }

 private:
  bool can_decrease(uint64_t now_ns) const;
  void decrease_to(uint64_t now_ns, double factor);
  double clamp(double window_packets) const;

  CcConfig config_;
  uint64_t target_rtt_ns_;
  double min_window_packets_;
  double max_window_packets_;
  double window_packets_;
  double window_before_timeout_ = 0;  // restored if the timeout proves spurious
  uint64_t rtt_ns_;  // latest RTT sample
  bool decreased_ = false;
  uint64_t last_decrease_ns_ = 0;
  uint64_t pace_clock_ns_ = 0;
  double pace_carry_ns_ = 0;
};

}  // namespace stellar::offload

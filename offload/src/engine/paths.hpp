// Paths of a stellar-mode connection (issue 14, docs/multipath.md).
//
// A path is an entropy value: an index the host maps to one of its UDP
// source ports, which the fabric's ECMP hashes onto a route. The requester
// asks this unit which path each request takes; loss recovery tells it what
// became of each packet (acknowledged with an RTT, or lost), and it keeps a
// few tens of bytes per path: smoothed and minimum RTT, a loss rate, packets
// in flight, and whether the path is retired.
//
// Choosing (PathPolicy): oblivious round robin; REPS-style recycling of the
// paths whose packets came back clean; power of two choices on an expected
// delay (RTT, loss, queue); or a bandit (UCB1) over a per-path reward. The
// current path is kept for `path_burst_packets` packets, so that a run of
// packets still leaves as one GSO message, then chosen again. A
// retransmission avoids the path its packet was lost on.
//
// Failover, whatever the policy: a path whose packets are lost three times
// in a row, or whose packet timed out, is retired at once: no packet is
// sent on it until its probe time (a few RTTs at first, doubling with every
// failed probe up to ~0.5 s), when one packet probes it; an acknowledged
// probe brings it back. When every path is retired the least recently
// failed one is used anyway: the connection never stops for want of a path.
//
// Congestion control keeps one window per connection (the caller's); this
// unit only spreads what the window lets out. Not thread-safe, no
// allocation after construction, deterministic (its own seeded generator).
#pragma once

#include <vector>

#include "common.hpp"

namespace stellar::offload::detail {

class PathSet {
 public:
  explicit PathSet(Context& ctx);

  uint16_t count() const { return uint16_t(paths_.size()); }
  // The path of the next request packet. `avoid`: a path not to take (the
  // one a retransmitted packet was lost on); -1 for none. `blind`: a
  // retransmission that a timer (the RTO or the tail probe) sent, with no
  // evidence of which paths work: it takes the latest path with a round
  // trip (on_round_trip) when that is usable (not retired), since it must
  // get through and its ACK back, and a path chosen for its way out alone
  // may be dead on the way back. (A resend that loss detection asked for
  // is chosen as any packet: acknowledgements on other paths found it.)
  uint16_t choose(uint64_t now, int avoid = -1, bool blind = false);
  // The requester's transmit call is over: the next packet starts a new
  // burst (a burst only serves to keep one call's run of packets one GSO
  // message; sparse packets, e.g. one small message per call, each get a
  // path of their own, so that losses on one path are seen from others).
  void end_burst() { burst_left_ = 0; }
  // A packet left on `path` (first transmission or not).
  void on_sent(uint16_t path);
  // The peer's reply (ACK or response) came back on `path` and echoed
  // `path` as the latest of our packets it received: both directions of
  // that path worked a moment ago (each direction hashes onto a route of
  // its own, and an acknowledgement alone proves only the way out).
  // Retransmissions go there first (see choose). It does not end a
  // retirement: an acknowledged packet does that (on_acknowledged). Any
  // value is accepted: one out of range is ignored.
  void on_round_trip(uint16_t path) {
    if (path < paths_.size()) round_trip_ = path;
  }
  // A packet sent on `path` is no longer in flight (acknowledged or lost).
  void on_left_flight(uint16_t path);
  // A packet sent on `path` was acknowledged; `rtt` is its sample (0: none,
  // e.g. a retransmission's).
  void on_acknowledged(uint16_t path, uint64_t now, uint64_t rtt);
  // A packet sent on `path` was declared lost (`timeout`: by the
  // retransmission timer, which retires the path at once).
  void on_lost(uint16_t path, uint64_t now, bool timeout);
  // The peer received `count` of our packets marked ECN CE, on `path`:
  // queues build there. The path is chosen less (cost, REPS, bandit) but
  // never retired for it: marks mean congestion, not failure.
  void on_congestion_mark(uint16_t path, uint16_t count);
  // Most of the traffic meets marks: the mark rate averaged over the paths
  // in use is past one half. Then the bottleneck is shared (or there is one
  // path) and congestion control must slow down, as for a loss (RFC 3168);
  // marks on some paths only are for path choice to steer around.
  bool marked_everywhere(uint64_t now) const;
  // How much longer than a packet on path `evidence` a packet on `path` may
  // take (loss detection allows it beyond the evidence's RTT): the
  // difference of their minimum RTTs plus four times `path`'s RTT
  // variation, at least a quarter of its RTT; `unknown` while
  // `path` has no RTT sample (it may be much slower); 0 with one path.
  uint64_t extra_delay(uint16_t path, uint16_t evidence, uint64_t unknown) const;
  // The largest smoothed RTT of the paths with packets in flight (0: none).
  uint64_t slowest_in_flight() const;
  // For telemetry and tests.
  void info(uint16_t path, PathInfo& out) const;
  // An address changed: every path is a new route now (ECMP hashes the new
  // address), so what was learned about routes is forgotten: retirements,
  // probes, losses, rewards. RTT estimates and in-flight counts stay.
  void forget_routes() {
    for (Path& p : paths_) {
      p.retired_until = p.failed_at = p.fallback_at = 0;
      p.loss = p.marks = p.reward = p.pulls = p.clean_run = 0;
      p.consecutive_losses = p.backoff = 0;
      p.probing = false;
      p.probe_until = 0;
    }
    probing_count_ = 0;
    round_trip_ = -1;
  }

 private:
  struct Path {
    uint64_t srtt = 0, rttvar = 0, min_rtt = never;
    uint64_t sampled_at = 0;     // when the last RTT sample came (0: never)
    uint64_t retired_until = 0;  // > now: retired (no packet but a probe after it)
    uint64_t failed_at = 0;      // when it was last retired
    uint64_t fallback_at = 0;    // when it was last taken with every path retired
    uint32_t inflight = 0;
    uint32_t loss = 0;           // loss rate, EWMA in 1/65536 per packet
    uint32_t marks = 0;          // ECN CE rate, EWMA in 1/65536 per packet
    uint32_t reward = 0;         // bandit: EWMA of the reward in 1/65536
    uint32_t pulls = 0;          // bandit: packets sent on it (saturating)
    uint8_t consecutive_losses = 0;
    uint32_t clean_run = 0;      // REPS: clean ACKs in a row since it was last recycled
    uint8_t backoff = 0;         // retirements without an acknowledgement since
    bool probing = false;        // its probe is out: nothing more until it is answered, or probe_until
    uint64_t probe_until = 0;    // a probe whose fate stays unknown (its packet was acknowledged
                                 // through another copy) counts as failed then
    uint64_t sent = 0, acknowledged = 0, lost = 0, retirements = 0, marked = 0;
  };

  // Path::probing changes only here, so that pick() can skip its scan for
  // expired probes while none is out.
  void set_probing(Path& p, bool on) {
    if (p.probing == on) return;
    p.probing = on;
    if (on) ++probing_count_;
    else --probing_count_;
  }
  bool usable(const Path& p, uint64_t now) const {
    return p.retired_until <= now && !p.probing && !(retransmitting_ && p.retired_until != 0);
  }
  uint16_t pick(uint64_t now, int avoid);
  uint16_t pick_oblivious(uint64_t now, int avoid);
  uint16_t pick_reps(uint64_t now, int avoid);
  uint16_t pick_two_choices(uint64_t now, int avoid);
  uint16_t pick_bandit(uint64_t now, int avoid);
  uint64_t cost(const Path& p, uint64_t now) const;
  bool worse_than_others(uint16_t path) const;
  void retire(uint16_t path, uint64_t now);
  // A uniform draw from [0, n) without a division: the generator's high,
  // best-mixed 32 bits scaled by n (Lemire's multiply-shift).
  uint16_t random_below(uint16_t n) { return uint16_t(((random() >> 32) * n) >> 32); }
  uint64_t random() {  // xorshift64*
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545f4914f6cdd1dull;
  }

  Context& ctx_;
  std::vector<Path> paths_;
  uint16_t current_ = 0;
  int32_t round_trip_ = -1;           // the latest path with a round trip (on_round_trip); -1: none
  bool retransmitting_ = false;       // choosing for a retransmission: no probes
  uint32_t burst_left_ = 0;
  uint16_t next_ = 0;                 // oblivious / REPS exploration cursor
  std::vector<uint16_t> recycled_;    // REPS: paths whose packets came back clean, ring
  uint32_t recycled_head_ = 0, recycled_count_ = 0;
  uint64_t min_rtt_ = never;          // over every path
  uint64_t best_srtt_ = 0;            // the lowest smoothed RTT of any path (at the last choice; REPS and bandit only)
  uint16_t probing_count_ = 0;        // paths with Path::probing set
  uint64_t total_pulls_ = 0;
  uint64_t state_;
};

// The paths responses and ACKs leave on (stellar). Each goes on the path of
// the latest request received, so that a path carries both directions of an
// exchange; but ECMP hashes each direction on its own, so that path's way
// back may be dead while its way out works. Every packet the peer sends
// echoes the path of the latest packet it received from us (Header::
// echo_path): a path used for replies many times without an echo is
// suspect, and replies go on the latest echoed path instead; a suspect path
// is tried again now and then.
class ReplyPaths {
 public:
  explicit ReplyPaths(const Context& ctx) : single_(ctx.config.mode == Mode::roce) {}
  // A request arrived on `path` / a packet arrived (any kind).
  void on_request(uint16_t path) { latest_request_ = path; }
  void on_packet(const Header& h) {
    latest_received_ = h.path;
    uses_[h.echo_path % max_paths] = 0;
    confirmed_ = h.echo_path;
  }
  // A request arrived again (a duplicate): the requester resent it, most
  // likely because our acknowledgement was lost, on the path of our latest
  // reply: that path is suspect at once, and the next reply goes on the
  // latest path the requester echoed (its way back is known to work), not
  // on the resend's path, whose way back is unknown. If the latest reply
  // went on that echoed path already, the resend's path is tried instead:
  // an echo goes stale while nothing of ours arrives.
  void on_duplicate() {
    if (single_ || last_ == confirmed_) return;
    uses_[last_ % max_paths] = suspect_uses;
    answer_confirmed_ = true;
  }
  // A packet arrived on `path` marked congestion-experienced (ECN CE).
  void on_congestion_mark(uint16_t path) {
    marked_path_ = path;
    if (marks_ < UINT16_MAX) ++marks_;
  }
  // The path of the next response or ACK.
  uint16_t choose();
  // What our next packet echoes: the path of the latest packet received, or
  // while CE marks wait to be reported, the latest marked packet's path,
  // with their count (Header::ce_count); the count is reported once.
  uint16_t echo(uint16_t& ce_count) {
    ce_count = marks_;
    marks_ = 0;
    return ce_count ? marked_path_ : latest_received_;
  }

 private:
  static constexpr uint16_t suspect_uses = 16;  // replies on one path with no echo of it
  static constexpr uint16_t retry_every = 256;  // replies between tries of a suspect path
  bool single_;
  uint16_t latest_request_ = 0, latest_received_ = 0, confirmed_ = 0, last_ = 0;
  uint16_t skipped_ = 0;
  bool answer_confirmed_ = false;  // the next reply goes on confirmed_ (on_duplicate)
  uint16_t marked_path_ = 0, marks_ = 0;  // CE marks not yet echoed
  uint16_t uses_[max_paths] = {};
};

}  // namespace stellar::offload::detail

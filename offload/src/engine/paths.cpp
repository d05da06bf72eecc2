// Paths: see paths.hpp for what this unit keeps and decides.
#include "paths.hpp"

#include <cmath>

namespace stellar::offload::detail {

namespace {
// Loss rate and bandit reward are EWMAs in 1/65536, moving 1/64 of the way
// per packet (about the last hundred packets on the path).
constexpr uint32_t one = 65536;
constexpr uint32_t ewma_shift = 6;
// Losses in a row that retire a path. A dead path's packets are all declared
// lost in one pass of loss detection (a burst of them), so one RTT and a
// reordering window after a failure the path is out; random loss of 1%
// retires a path once in a million packets.
constexpr uint8_t losses_to_retire = 3;
constexpr uint64_t min_probe_interval_ns = 250'000;
constexpr uint64_t max_probe_interval_ns = 500'000'000;
// A path's RTT estimate is stale without a sample for this long (or 8 of its
// RTTs, if longer): see cost().
constexpr uint64_t stale_after_ns = 2'000'000;
}  // namespace

PathSet::PathSet(Context& ctx) : ctx_(ctx), paths_(ctx.config.paths), recycled_(std::min<size_t>(4u * ctx.config.paths, 1024)) {
  // Deterministic per connection, different across connections.
  state_ = (uint64_t(ctx.config.local_qpn) << 32 | ctx.config.remote_qpn) ^ ctx.config.local_token ^ 0x9e3779b97f4a7c15ull;
  if (state_ == 0) state_ = 1;
  next_ = uint16_t(random() % paths_.size());
}

uint16_t PathSet::choose(uint64_t now, int avoid, bool blind) {
  if (paths_.size() == 1) return 0;
  // A retransmission never probes a retired path: losing it again would
  // cost an RTO at the head of the window. New data probes.
  if (avoid >= 0) retransmitting_ = true;
  if (blind && avoid >= 0 && round_trip_ >= 0 && round_trip_ != avoid && usable(paths_[size_t(round_trip_)], now)) {
    retransmitting_ = false;
    Path& q = paths_[size_t(round_trip_)];
    if (q.pulls < UINT32_MAX) ++q.pulls;
    ++total_pulls_;
    return uint16_t(round_trip_);
  }
  if (avoid < 0 && burst_left_ > 0 && usable(paths_[current_], now)) {
    --burst_left_;
    return current_;
  }
  // The best path's smoothed RTT, the yardstick of "clean" (REPS) and of
  // the bandit's reward: the minimum RTT ever seen is not, once queues
  // build everywhere.
  // Only REPS and the bandit read it (on_acknowledged): the scan over every
  // path is skipped for the others, on each packet's way out.
  if (ctx_.config.path_policy == PathPolicy::reps || ctx_.config.path_policy == PathPolicy::bandit) {
    best_srtt_ = 0;
    for (const Path& q : paths_)
      if (q.srtt && (best_srtt_ == 0 || q.srtt < best_srtt_)) best_srtt_ = q.srtt;
  }
  const uint16_t p = pick(now, avoid);
  retransmitting_ = false;
  if (avoid < 0) {
    current_ = p;
    burst_left_ = ctx_.config.path_burst_packets - 1;
  }
  Path& q = paths_[p];
  // A retired path whose time came: this packet is its probe, and nothing
  // else goes there until the probe is answered (or, never answered,
  // counts as failed after a few RTTs).
  if (q.retired_until != 0) {
    set_probing(q, true);
    const uint64_t rtt = q.srtt ? q.srtt + 4 * q.rttvar : (min_rtt_ != never ? 4 * min_rtt_ : 0);
    q.probe_until = now + std::max<uint64_t>(2 * rtt, min_probe_interval_ns);
  }
  if (q.pulls < UINT32_MAX) ++q.pulls;
  ++total_pulls_;
  return p;
}

uint16_t PathSet::pick(uint64_t now, int avoid) {
  if (probing_count_ > 0)
    for (uint16_t i = 0; i < count(); ++i)
      if (paths_[i].probing && paths_[i].probe_until <= now) retire(i, now);
  switch (ctx_.config.path_policy) {
    case PathPolicy::oblivious: return pick_oblivious(now, avoid);
    case PathPolicy::reps: return pick_reps(now, avoid);
    case PathPolicy::two_choices: return pick_two_choices(now, avoid);
    case PathPolicy::bandit: return pick_bandit(now, avoid);
  }
  return pick_oblivious(now, avoid);
}

// Round robin over usable paths. With none usable (every path retired), the
// least recently failed one: the connection never waits for a path.
uint16_t PathSet::pick_oblivious(uint64_t now, int avoid) {
  const uint16_t n = count();
  for (uint16_t i = 0; i < n; ++i) {
    const uint16_t c = uint16_t((next_ + i) % n);
    if (c != avoid && usable(paths_[c], now)) {
      next_ = uint16_t((c + 1) % n);
      return c;
    }
  }
  // Every path is retired: the one that failed, or was last tried this
  // way, longest ago. A retired path that fails again keeps its first
  // failure time (retire() learns nothing from it), so the time it was last
  // taken here counts too: the choice goes round every path instead of
  // swinging between two that may both be dead.
  const auto last_tried = [&](uint16_t c) { return std::max(paths_[c].failed_at, paths_[c].fallback_at); };
  uint16_t best = avoid >= 0 && n > 1 ? uint16_t((avoid + 1) % n) : 0;
  for (uint16_t c = 0; c < n; ++c)
    if (c != avoid && last_tried(c) < last_tried(best)) best = c;
  paths_[best].fallback_at = now;
  return best;
}

// REPS (Bonato et al., 2024): a path whose packet came back clean (no loss,
// no inflated delay) is recycled for a later burst; one that saw loss or
// delay is not, and fades out. With nothing to recycle, explore in turn.
uint16_t PathSet::pick_reps(uint64_t now, int avoid) {
  while (recycled_count_ > 0) {
    const uint16_t c = recycled_[recycled_head_];
    recycled_head_ = ring_next(recycled_head_, uint32_t(recycled_.size()));
    --recycled_count_;
    if (c != avoid && usable(paths_[c], now)) return c;
  }
  return pick_oblivious(now, avoid);
}

// What a packet sent on p is expected to wait: its RTT, scaled by the
// packets already queued there and by its loss rate (a lost packet costs a
// recovery: counted 16 times its share).
// An estimate goes stale: a path that one slow or lossy moment made look
// costly loses every comparison, gets no packet, so no sample either, and
// would stay unused for good (a 1 MiB loopback stream kept one of 16 paths
// at 3 packets in 18 000 after its first sample took 4 ms). Without a
// sample for 8 of its RTTs (at least 2 ms) it is costed as a path with no
// sample (the best minimum RTT, nothing lost): it wins its next comparison,
// and the burst sent there brings a fresh estimate.
uint64_t PathSet::cost(const Path& p, uint64_t now) const {
  const bool stale = p.srtt && now - p.sampled_at > std::max<uint64_t>(8 * p.srtt, stale_after_ns);
  if (stale) return uint64_t(double(min_rtt_ != never ? min_rtt_ : p.srtt) * double(p.inflight + 1));
  const double base = double(p.srtt ? p.srtt : (min_rtt_ != never ? min_rtt_ : 1000));
  // An ECN mark costs a quarter of a loss: a queue, not a resend.
  return uint64_t(base * double(p.inflight + 1) * (1.0 + 16.0 * double(p.loss) / one + 4.0 * double(p.marks) / one));
}

uint16_t PathSet::pick_two_choices(uint64_t now, int avoid) {
  const uint16_t n = count();
  int a = -1, b = -1;
  // A few random draws; usually all usable, so two draws suffice.
  for (int tries = 0; tries < 8 && b < 0; ++tries) {
    const uint16_t c = random_below(n);
    if (c == avoid || c == a || !usable(paths_[c], now)) continue;
    if (a < 0) a = c;
    else b = c;
  }
  if (a < 0) return pick_oblivious(now, avoid);
  if (b < 0) return uint16_t(a);
  return cost(paths_[size_t(b)], now) < cost(paths_[size_t(a)], now) ? uint16_t(b) : uint16_t(a);
}

// UCB1 scores (mean reward plus an exploration bonus that shrinks as the
// path is tried; untried paths first), taken over four paths drawn at
// random rather than all of them: the argmax over all would put every burst
// on the one best path, and one path is one link's capacity. The sample
// keeps the load spread while the scores steer it.
uint16_t PathSet::pick_bandit(uint64_t now, int avoid) {
  const uint16_t n = count();
  int best = -1;
  double best_value = -1;
  const double log_total = std::log(double(total_pulls_ + 1));
  for (int draw = 0; draw < 8; ++draw) {
    const uint16_t c = random_below(n);
    const Path& p = paths_[c];
    if (c == avoid || !usable(p, now)) continue;
    const double value = p.pulls == 0 ? 1e9 : double(p.reward) / one + std::sqrt(2.0 * log_total / double(p.pulls));
    if (value > best_value) {
      best_value = value;
      best = c;
    }
    if (draw >= 3 && best >= 0) break;  // four usable draws at most
  }
  if (best < 0) return pick_oblivious(now, avoid);
  return uint16_t(best);
}

void PathSet::on_sent(uint16_t path) {
  Path& p = paths_[path];
  ++p.inflight;
  ++p.sent;
}

void PathSet::on_left_flight(uint16_t path) {
  Path& p = paths_[path];
  if (p.inflight) --p.inflight;
}

void PathSet::on_acknowledged(uint16_t path, uint64_t now, uint64_t rtt) {
  Path& p = paths_[path];
  ++p.acknowledged;
  p.consecutive_losses = 0;
  p.loss -= p.loss >> ewma_shift;
  p.marks -= p.marks >> ewma_shift;
  // Anything acknowledged proves the path's way out works: it is back in
  // use. (Its way back is the responder's concern, ReplyPaths; and
  // on_round_trip's, for where retransmissions go.)
  p.retired_until = 0;
  set_probing(p, false);
  p.backoff = 0;
  if (rtt == 0) return;
  p.sampled_at = now;
  if (p.srtt == 0) {
    p.srtt = rtt;
    p.rttvar = rtt / 2;
  } else {
    const uint64_t delta = rtt > p.srtt ? rtt - p.srtt : p.srtt - rtt;
    p.rttvar = (3 * p.rttvar + delta) / 4;
    p.srtt = (7 * p.srtt + rtt) / 8;
  }
  p.min_rtt = std::min(p.min_rtt, rtt);
  min_rtt_ = std::min(min_rtt_, rtt);
  // Reward: how close to the best path's smoothed RTT this sample came (1:
  // as fast), not to the minimum ever seen, which queueing everywhere would
  // make every path fall far short of.
  const uint64_t best = best_srtt_ ? best_srtt_ : p.srtt;
  const uint32_t reward = rtt <= best ? one : uint32_t(double(one) * double(best) / double(rtt));
  p.reward = p.reward + (reward >> ewma_shift) - (p.reward >> ewma_shift);
  // REPS: clean means no inflated delay either (at most twice the best
  // path's). A path returns to the recycling ring once per burst's worth of
  // clean ACKs in a row (a choice sends a burst): loss or delay breaks the
  // run, so a lossy path comes back less often.
  if (ctx_.config.path_policy == PathPolicy::reps) {
    if (rtt > 2 * best) {
      p.clean_run = 0;
    } else if (++p.clean_run >= ctx_.config.path_burst_packets) {
      p.clean_run = 0;
      if (recycled_count_ < recycled_.size()) {
        recycled_[ring_add(recycled_head_, recycled_count_, uint32_t(recycled_.size()))] = path;
        ++recycled_count_;
      }
    }
  }
}

void PathSet::on_congestion_mark(uint16_t path, uint16_t count) {
  if (path >= paths_.size()) return;  // a peer's echo is input: checked
  Path& p = paths_[path];
  p.marked += count;
  // One EWMA step per marked packet, as on_acknowledged decays per packet.
  for (uint16_t i = 0; i < std::min<uint16_t>(count, 64); ++i) {
    p.marks += (one - p.marks) >> ewma_shift;
    p.reward -= p.reward >> 5;  // bandit: a mark costs less than a loss (>> 3)
  }
  p.clean_run = 0;  // REPS: not clean
}

bool PathSet::marked_everywhere(uint64_t now) const {
  uint64_t sum = 0, used = 0;
  for (const Path& p : paths_) {
    if (p.retired_until > now) continue;
    sum += p.marks;
    ++used;
  }
  return used > 0 && sum > used * (one / 2);
}

void PathSet::on_lost(uint16_t path, uint64_t now, bool timeout) {
  Path& p = paths_[path];
  ++p.lost;
  p.loss += (one - p.loss) >> ewma_shift;
  p.reward -= p.reward >> 3;  // a loss costs a recovery: far worse than a slow ACK
  p.clean_run = 0;
  if (p.consecutive_losses < 255) ++p.consecutive_losses;
  if (paths_.size() == 1) return;
  if (timeout || p.probing || (p.consecutive_losses >= losses_to_retire && worse_than_others(path))) retire(path, now);
}

// Losses in a row on a path that loses no more than the others are
// congestion (a queue overflowing drops a run of packets on every path), not
// a failure: retiring it would only crowd the rest.
bool PathSet::worse_than_others(uint16_t path) const {
  uint64_t sum = 0;
  uint32_t n = 0;
  for (uint16_t i = 0; i < count(); ++i) {
    if (i == path || paths_[i].retired_until != 0) continue;
    sum += paths_[i].loss;
    ++n;
  }
  const uint64_t others = n ? sum / n : 0;
  return paths_[path].loss > 4 * others + one / 64;
}

void PathSet::retire(uint16_t path, uint64_t now) {
  Path& p = paths_[path];
  set_probing(p, false);
  if (p.retired_until > now) return;  // already out: its older packets' losses say nothing new
  const uint64_t rtt = p.srtt ? p.srtt : (min_rtt_ != never ? min_rtt_ : 0);
  const uint64_t base = std::max<uint64_t>(4 * rtt, min_probe_interval_ns);
  const uint64_t interval = std::min<uint64_t>(base << std::min<uint8_t>(p.backoff, 16), max_probe_interval_ns);
  p.retired_until = now + interval;
  p.failed_at = now;
  p.consecutive_losses = 0;
  if (p.backoff < 255) ++p.backoff;
  ++p.retirements;
  ++ctx_.counters.paths_retired;
  if (current_ == path) burst_left_ = 0;
}

uint64_t PathSet::extra_delay(uint16_t path, uint16_t evidence, uint64_t unknown) const {
  if (paths_.size() == 1) return 0;
  const Path& p = paths_[path];
  if (p.srtt == 0) return unknown;
  // The paths' own delays differ by their minimum RTTs (smoothed RTTs
  // would carry queueing of other times: the evidence's RTT has its own).
  // Plus four variations, but at least a quarter of the path's RTT: its
  // ACKs come back on whichever path the latest request took, and samples
  // taken from one burst agree so well that the variation collapses.
  const uint64_t base = paths_[evidence].min_rtt;
  return (base != never && p.min_rtt > base ? p.min_rtt - base : 0) + std::max(4 * p.rttvar, p.srtt / 4);
}

uint64_t PathSet::slowest_in_flight() const {
  if (paths_.size() == 1) return 0;
  uint64_t slowest = 0;
  for (const Path& p : paths_)
    if (p.inflight) slowest = std::max(slowest, p.srtt);
  return slowest;
}

uint16_t ReplyPaths::choose() {
  if (single_) return 0;
  uint16_t p = latest_request_;
  uint16_t& uses = uses_[p % max_paths];
  if (answer_confirmed_) {
    answer_confirmed_ = false;
    p = confirmed_;
  } else if (uses >= suspect_uses) {
    if (++skipped_ % retry_every == 0) uses = suspect_uses - 4;  // a few more tries: maybe it came back
    else p = confirmed_;
  }
  uint16_t& chosen = uses_[p % max_paths];
  if (chosen < UINT16_MAX) ++chosen;
  last_ = p;
  return p;
}

void PathSet::info(uint16_t path, PathInfo& out) const {
  const Path& p = paths_[path];
  out.srtt_ns = p.srtt;
  out.min_rtt_ns = p.min_rtt == never ? 0 : p.min_rtt;
  out.inflight_packets = p.inflight;
  out.loss_rate = double(p.loss) / one;
  out.mark_rate = double(p.marks) / one;
  out.marked_packets = p.marked;
  out.retired = p.retired_until != 0;
  out.sent_packets = p.sent;
  out.acknowledged_packets = p.acknowledged;
  out.lost_packets = p.lost;
  out.retirements = p.retirements;
}

}  // namespace stellar::offload::detail

// The flow scheduler: decides which engine's packets leave the engine host
// next (docs/scheduler.md). Every attached engine is a flow labelled with
// its tenant, its job and its traffic class (0-7, from the job's hints).
//
//   1. Strict priority for the control class (7): bootstrap, barriers and
//      other small messages overtake bulk traffic, up to a per-tenant
//      control budget (control_rate_fraction of the link, at least
//      min_control_rate) so that a tenant cannot starve others by marking
//      its bulk traffic as control; beyond it they queue like any class.
//      (Without a link rate the budget is min_control_rate.)
//   2. Weighted fair sharing, hierarchical and work-conserving: tenants by
//      their weight, the jobs of a tenant by the job's weight, the flows of
//      a job equally. Start-time fair queueing on virtual times: a flow
//      (job, tenant) that was idle starts at the level's current virtual
//      time, so an idle share is lent to whoever has traffic and never
//      saved up.
//      Within a tenant, jobs that gave a step period are ordered by the
//      deadline of their current communication phase (earliest first,
//      ahead of the tenant's other jobs): two jobs' phases then run one
//      after the other at full rate instead of both at half, and settle
//      into interleaving (CASSINI's effect, from the host's side).
//   3. Token buckets: each tenant's optional rate limit (bytes/s and burst)
//      and the host's optional link rate (the "scheduler's rate": shaping
//      at the sender, so that queueing happens here, where it is fair,
//      instead of in a shared socket or switch queue).
//
// Pure logic on a caller-supplied clock (nanoseconds): the engine host
// drives it on CLOCK_MONOTONIC, the tests on a virtual clock. Not
// thread-safe: callers hold SharedScheduler::lock.
//
// One scheduler may order the flows of several engine hosts (the engine
// daemon: every context a shard serves, so that tenants share the shard
// across applications). Each flow has an owner; a host serves only its own
// flows, and only while one of them is next in the common order.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace stellar::host {

inline constexpr uint8_t traffic_classes = 8;
inline constexpr uint8_t control_class = 7;

struct TenantShare {
  uint32_t weight = 1;            // share among tenants with packets waiting (>= 1)
  uint64_t rate_bytes_per_s = 0;  // 0: no limit of its own
  uint64_t burst_bytes = 0;       // bucket depth; 0: the larger of 64 KiB and 1 ms at the rate
};

struct FlowLabel {
  std::string tenant, job;
  uint32_t job_weight = 1;        // share among the tenant's jobs (>= 1)
  uint8_t traffic_class = 0;      // 0-7; control_class is strict priority
  // The job's training step (JobHints::step_period, ::deadline), in ns; 0:
  // not periodic. A periodic job's communication phase gets a deadline.
  uint64_t step_period_ns = 0, deadline_ns = 0;
};

// Per flow: how long it waited with packets due before it was served.
struct FlowWaits {
  uint64_t waits = 0;             // grants
  uint64_t wait_ns_total = 0, wait_ns_max = 0;
  uint64_t bytes = 0;             // bytes it sent through grants
};

class FlowScheduler {
 public:
  using Flow = uint32_t;
  // Bytes one grant lets a flow send (then the next flow's turn): 16
  // packets of 4 KiB, one GSO message.
  static constexpr uint64_t quantum_bytes = 64 * 1024;
  static constexpr double control_rate_fraction = 0.05;
  static constexpr uint64_t min_control_rate = 10'000'000;  // bytes/s: the budget when the link has no rate
  // A flow, job or tenant that had nothing due for less than this keeps its
  // virtual time (its place) when it has again: a window-limited flow
  // flutters between due and not due every round trip, and restarting it at
  // the current virtual time each time would cost it its share.
  static constexpr uint64_t idle_grace_ns = 1'000'000;

  // The host's link rate; 0: none (the engines' congestion control and the
  // socket are the only limits).
  void set_link_rate(uint64_t bytes_per_s, uint64_t burst_bytes, uint64_t now);
  void set_tenant(const std::string& tenant, const TenantShare&, uint64_t now);

  // `owner`: who transmits the flow's packets (the engine host), or null.
  Flow add(const FlowLabel&, uint64_t now, const void* owner = nullptr);
  void remove(Flow);

  // The flow has packets due (idempotent).
  void ready(Flow, uint64_t now);
  bool is_ready(Flow f) const { return flows_[f].ready; }
  bool any_ready() const { return ready_count_ > 0; }

  // The flow to serve now and the bytes it may send; false when no ready
  // flow may send now (eligible_at says when one may).
  bool next(uint64_t now, Flow& flow, uint64_t& budget_bytes);
  // After serving `flow`: the bytes it sent, and whether it should be
  // offered again (still has packets due and may go again this round).
  void served(Flow, uint64_t bytes, bool still_ready, uint64_t now);

  // When a ready flow may send next: now if one may, UINT64_MAX when none is
  // ready; else when the first bucket holding one back has refilled.
  uint64_t eligible_at(uint64_t now);
  // The same for one flow (its buckets alone).
  uint64_t eligible_at(Flow, uint64_t now);

  const void* owner(Flow f) const { return flows_[f].owner; }
  size_t tenant_count() const { return tenants_.size(); }
  const FlowLabel& label(Flow f) const { return flows_[f].label; }
  const FlowWaits& waits(Flow f) const { return flows_[f].waits; }

 private:
  struct Bucket {
    double rate = 0;   // bytes per ns; 0: unlimited
    double depth = 0;  // bytes
    double tokens = 0;
    uint64_t updated = 0;
    void configure(uint64_t bytes_per_s, uint64_t burst, uint64_t now);
    void refill(uint64_t now);
    bool allows() const { return rate == 0 || tokens > 0; }
    uint64_t refilled_at(uint64_t now) const;  // when tokens > 0 again
    void take(double bytes) {
      if (rate != 0) tokens -= bytes;
    }
  };
  struct Job {
    double vtime = 0, flow_vnow = 0;
    uint64_t idle_since = 0;  // when its last flow stopped being ready (0: never active)
    uint32_t weight = 1;
    uint32_t ready = 0, flows = 0;
    // Periodic jobs (FlowLabel::step_period_ns): the current phase's
    // deadline, and when a flow of the job last had packets due (a pause
    // longer than a quarter step starts a new phase).
    uint64_t step_period_ns = 0, deadline_ns = 0;
    uint64_t phase_deadline = 0, last_active = 0;
    bool in_phase = false;
  };
  struct Tenant {
    TenantShare share;
    Bucket bucket, control;
    double vtime = 0, job_vnow = 0;
    uint64_t idle_since = 0;
    uint32_t ready = 0, flows = 0;
    bool configured = false;  // set_tenant gave it a share
    std::unordered_map<std::string, Job> jobs;
  };
  struct FlowState {
    bool used = false, ready = false;
    const void* owner = nullptr;
    FlowLabel label;
    Tenant* tenant = nullptr;
    Job* job = nullptr;
    double vtime = 0;
    uint64_t ready_since = 0, idle_since = 0;
    FlowWaits waits;
  };

  Tenant& tenant(const std::string& name, uint64_t now);
  static bool before(const FlowState& a, const FlowState& b);
  void configure_control(Tenant&, uint64_t now);
  void unready(FlowState&, uint64_t now);
  static bool idle_long(uint64_t idle_since, uint64_t now) { return idle_since == 0 || now > idle_since + idle_grace_ns; }

  Bucket link_;
  uint64_t link_rate_ = 0;
  double tenant_vnow_ = 0;
  std::unordered_map<std::string, Tenant> tenants_;  // node-based: pointers stay valid
  std::vector<FlowState> flows_;
  std::vector<Flow> free_;
  std::vector<Flow> ready_list_;  // flows with ready set (unordered)
  static constexpr Flow no_flow = UINT32_MAX;
  Flow control_grant_ = no_flow;  // the flow next() last granted by control priority
  uint32_t ready_count_ = 0;
};

// A scheduler and the lock that guards it: owned by one engine host, or
// shared by the engine hosts of a daemon shard. Lock order: a host's own
// lock first, then this one.
struct SharedScheduler {
  std::mutex lock;
  FlowScheduler scheduler;
};

}  // namespace stellar::host

#include "host/flow_scheduler.hpp"

#include <algorithm>
#include <cmath>

namespace stellar::host {

void FlowScheduler::Bucket::configure(uint64_t bytes_per_s, uint64_t burst, uint64_t now) {
  rate = double(bytes_per_s) / 1e9;
  depth = burst ? double(burst) : std::max(64.0 * 1024, double(bytes_per_s) / 1000);
  tokens = depth;  // a new limit starts full: the first burst is not penalised
  updated = now;
}

void FlowScheduler::Bucket::refill(uint64_t now) {
  if (rate == 0 || now <= updated) return;
  tokens = std::min(depth, tokens + rate * double(now - updated));
  updated = now;
}

uint64_t FlowScheduler::Bucket::refilled_at(uint64_t now) const {
  if (allows()) return now;
  // Tokens go negative by at most one grant (a grant is not cut short);
  // the bucket allows again once they are above zero.
  return now + uint64_t(std::ceil((1.0 - tokens) / rate));
}

void FlowScheduler::set_link_rate(uint64_t bytes_per_s, uint64_t burst_bytes, uint64_t now) {
  link_rate_ = bytes_per_s;
  link_.configure(bytes_per_s, burst_bytes, now);
  for (auto& [name, t] : tenants_) configure_control(t, now);
}

void FlowScheduler::configure_control(Tenant& t, uint64_t now) {
  // With a link rate, a fraction of it and no floor: a floor above the
  // fraction would let any tenant take a slow link's control budget past
  // its weight by marking bulk as control.
  const uint64_t rate = link_rate_ ? std::max<uint64_t>(1, uint64_t(double(link_rate_) * control_rate_fraction)) : min_control_rate;
  t.control.configure(rate, 64 * 1024, now);
}

FlowScheduler::Tenant& FlowScheduler::tenant(const std::string& name, uint64_t now) {
  auto [it, fresh] = tenants_.try_emplace(name);
  if (fresh) configure_control(it->second, now);
  return it->second;
}

void FlowScheduler::set_tenant(const std::string& name, const TenantShare& share, uint64_t now) {
  Tenant& t = tenant(name, now);
  t.configured = true;
  t.share = share;
  t.share.weight = std::max<uint32_t>(share.weight, 1);
  t.bucket = Bucket{};
  if (share.rate_bytes_per_s) t.bucket.configure(share.rate_bytes_per_s, share.burst_bytes, now);
}

FlowScheduler::Flow FlowScheduler::add(const FlowLabel& label, uint64_t now, const void* owner) {
  Flow f;
  if (!free_.empty()) {
    f = free_.back();
    free_.pop_back();
  } else {
    f = Flow(flows_.size());
    flows_.emplace_back();
  }
  FlowState& s = flows_[f];
  s = FlowState{};
  s.used = true;
  s.owner = owner;
  s.label = label;
  s.label.job_weight = std::max<uint32_t>(label.job_weight, 1);
  s.label.traffic_class = std::min<uint8_t>(label.traffic_class, traffic_classes - 1);
  s.tenant = &tenant(label.tenant, now);
  auto [job, fresh] = s.tenant->jobs.try_emplace(label.job);
  s.job = &job->second;
  // The latest flow's hints set the job's weight and step (they come from one job).
  s.job->weight = s.label.job_weight;
  s.job->step_period_ns = label.step_period_ns;
  s.job->deadline_ns = label.deadline_ns ? label.deadline_ns : label.step_period_ns;
  ++s.job->flows;
  ++s.tenant->flows;
  return f;
}

void FlowScheduler::unready(FlowState& s, uint64_t now) {
  if (!s.ready) return;
  s.ready = false;
  s.idle_since = now;
  --ready_count_;
  if (--s.job->ready == 0) s.job->idle_since = now;
  if (--s.tenant->ready == 0) s.tenant->idle_since = now;
}

void FlowScheduler::remove(Flow f) {
  FlowState& s = flows_[f];
  if (!s.used) return;
  unready(s, 0);
  ready_list_.erase(std::remove(ready_list_.begin(), ready_list_.end(), f), ready_list_.end());
  if (--s.job->flows == 0) s.tenant->jobs.erase(s.label.job);
  // A configured tenant's share (weight, rate) stays; one that only labels
  // flows goes with its last flow (labels come from clients: they must not
  // accumulate).
  if (--s.tenant->flows == 0 && !s.tenant->configured) tenants_.erase(s.label.tenant);
  s = FlowState{};
  free_.push_back(f);
}

void FlowScheduler::ready(Flow f, uint64_t now) {
  FlowState& s = flows_[f];
  if (!s.used || s.ready) return;
  // Start-time fair queueing: a level that was idle starts at the current
  // virtual time of its parent, so it neither lost its place nor saved up
  // credit while it had nothing to send.
  if (s.tenant->ready == 0 && idle_long(s.tenant->idle_since, now)) s.tenant->vtime = std::max(s.tenant->vtime, tenant_vnow_);
  if (s.job->ready == 0 && idle_long(s.job->idle_since, now)) s.job->vtime = std::max(s.job->vtime, s.tenant->job_vnow);
  Job& job = *s.job;
  if (job.step_period_ns) {
    // A new communication phase once the job has been quiet for a quarter
    // of its step (packets pause for acknowledgements within a phase).
    const uint64_t quiet = std::max<uint64_t>(job.step_period_ns / 4, 100'000);
    if (!job.in_phase || (job.ready == 0 && now > job.last_active + quiet)) {
      job.in_phase = true;
      job.phase_deadline = now + job.deadline_ns;
    }
    job.last_active = now;
  }
  if (idle_long(s.idle_since, now)) s.vtime = std::max(s.vtime, s.job->flow_vnow);
  s.ready = true;
  s.ready_since = now;
  ++ready_count_;
  ++s.job->ready;
  ++s.tenant->ready;
  ready_list_.push_back(f);
}

// The weighted hierarchy's order: tenant virtual time; within a tenant,
// periodic jobs by phase deadline ahead of the others by virtual time; within
// a job, flow virtual time.
bool FlowScheduler::before(const FlowState& a, const FlowState& b) {
  if (a.tenant != b.tenant) return a.tenant->vtime < b.tenant->vtime;
  if (a.job != b.job) {
    const bool pa = a.job->step_period_ns != 0, pb = b.job->step_period_ns != 0;
    if (pa != pb) return pa;
    if (pa) {
      if (a.job->phase_deadline != b.job->phase_deadline) return a.job->phase_deadline < b.job->phase_deadline;
    } else if (a.job->vtime != b.job->vtime) {
      return a.job->vtime < b.job->vtime;
    }
  }
  return a.vtime < b.vtime;
}

bool FlowScheduler::next(uint64_t now, Flow& flow, uint64_t& budget) {
  if (ready_count_ == 0) return false;
  link_.refill(now);
  if (!link_.allows()) return false;
  // Control class within its budget first; then the weighted hierarchy:
  // the smallest (tenant, job, flow) virtual time among flows whose tenant
  // may send. Both in one pass over the ready flows.
  FlowState* control = nullptr;
  FlowState* best = nullptr;
  Flow control_id = 0, best_id = 0;
  for (Flow f : ready_list_) {
    FlowState& s = flows_[f];
    Tenant& t = *s.tenant;
    t.bucket.refill(now);
    if (!t.bucket.allows()) continue;
    if (s.label.traffic_class == control_class) {
      t.control.refill(now);
      if (t.control.allows() && (!control || s.vtime < control->vtime)) {
        control = &s;
        control_id = f;
      }
    }
    if (!best || before(s, *best)) {
      best = &s;
      best_id = f;
    }
  }
  // served() charges the control budget for this grant only (a caller that
  // does not serve it, an engine host yielding to the flow's owner, leaves
  // nothing behind for the next grant).
  control_grant_ = control ? control_id : no_flow;
  if (control) {
    flow = control_id;
  } else if (best) {
    flow = best_id;
  } else {
    return false;
  }
  // A flow alone needs no small grants to be fair: a whole transmit batch
  // per grant costs fewer system calls.
  budget = ready_count_ == 1 ? 4 * quantum_bytes : quantum_bytes;
  return true;
}

void FlowScheduler::served(Flow f, uint64_t bytes, bool still_ready, uint64_t now) {
  FlowState& s = flows_[f];
  if (!s.used) return;
  if (s.ready) {
    const uint64_t waited = now > s.ready_since ? now - s.ready_since : 0;
    ++s.waits.waits;
    s.waits.wait_ns_total += waited;
    s.waits.wait_ns_max = std::max(s.waits.wait_ns_max, waited);
  }
  s.waits.bytes += bytes;
  Tenant& t = *s.tenant;
  const double b = double(bytes);
  // The levels' current virtual times are the start tags of what was just
  // served (start-time fair queueing).
  // Only ever forward: a tenant held back by its rate limit keeps an old
  // virtual time, and serving it must not pull the others' clock back (a
  // tenant waking up later would start behind everyone and take the link).
  tenant_vnow_ = std::max(tenant_vnow_, t.vtime);
  t.job_vnow = std::max(t.job_vnow, s.job->vtime);
  s.job->flow_vnow = std::max(s.job->flow_vnow, s.vtime);
  t.vtime += b / double(t.share.weight);
  s.job->vtime += b / double(s.job->weight);
  s.vtime += b;
  link_.take(b);
  t.bucket.take(b);
  // The control budget pays only for grants it gave: control-class bulk
  // scheduled by weight beyond it does not push it further into debt.
  if (control_grant_ == f) t.control.take(b);
  control_grant_ = no_flow;
  s.job->last_active = now;
  // A periodic job still busy a whole step past its phase's deadline is no
  // longer in phases (a stream): it gets the next deadline, so that it
  // cannot keep the earliest one for good. A phase that merely runs late
  // keeps its deadline (moving it would let the other job preempt it).
  if (s.job->step_period_ns && s.job->in_phase && now > s.job->phase_deadline + s.job->step_period_ns)
    s.job->phase_deadline = now + s.job->deadline_ns;
  if (still_ready && bytes > 0) {
    s.ready_since = now;
  } else if (s.ready) {
    unready(s, now);
    auto it = std::find(ready_list_.begin(), ready_list_.end(), f);
    if (it != ready_list_.end()) ready_list_.erase(it);
  }
}

uint64_t FlowScheduler::eligible_at(Flow f, uint64_t now) {
  FlowState& s = flows_[f];
  link_.refill(now);
  s.tenant->bucket.refill(now);
  return std::max(link_.refilled_at(now), s.tenant->bucket.refilled_at(now));
}

uint64_t FlowScheduler::eligible_at(uint64_t now) {
  if (ready_count_ == 0) return UINT64_MAX;
  uint64_t t = UINT64_MAX;
  for (Flow f : ready_list_) t = std::min(t, eligible_at(f, now));
  return t;
}

}  // namespace stellar::host

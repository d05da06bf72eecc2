// The line the example and benchmark programs print when they run as a
// tenant, with job hints or under a transmit rate (docs/scheduler.md), so
// that a result says which scheduling it ran under. Header-only.
#pragma once

#include <cstdio>

#include "stellar/verbs.hpp"

namespace stellar::accounting {

// `o`: the context's effective options (Context::options(): the environment applied).
inline void print_tenant_line(const ContextOptions& o) {
  if (o.tenant.empty() && o.hints.kind == TrafficKind::unspecified && o.hints.priority < 0 && o.hints.job.empty() &&
      o.tx_rate_bytes_per_s == 0)
    return;
  const unsigned cls = o.hints.traffic_class();
  std::printf("# tenant: %s  job: %s  kind: %s  traffic class: %u (DSCP %u)  tx rate: %llu B/s%s\n",
              o.tenant.empty() ? "(default)" : o.tenant.c_str(), o.hints.job.empty() ? "(default)" : o.hints.job.c_str(),
              to_string(o.hints.kind), cls, unsigned(o.class_dscp[cls]), static_cast<unsigned long long>(o.tx_rate_bytes_per_s),
              o.tx_rate_bytes_per_s ? "" : " (unshaped)");
}

}  // namespace stellar::accounting

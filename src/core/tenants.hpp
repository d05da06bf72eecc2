// Tenants as principals (docs/scheduler.md): the tenants file, credential
// checks, and the job hints' text form. Used by Context::open and the soft
// provider (the parser itself is offload/host/tenants_file, shared with the
// engine daemon).
#pragma once

#include <map>
#include <string>

#include "stellar/verbs.hpp"

namespace stellar::tenants {

// The tenants file: {"tenants": [{"name": ..., "credential": ..., "pkey": ...,
// "weight": ..., "rate_bytes_per_s": ..., "burst_bytes": ..., "max_qps": ...,
// "max_registered_bytes": ..., "max_receive_wrs": ..., "max_send_wrs": ...}]}.
// Unknown keys, wrong types, duplicate names or partition keys, a file over
// 1 MiB: invalid_argument naming the place.
Result<std::map<std::string, TenantOptions>> load(const std::string& path);

// Compares in time that depends only on the lengths (a remote guesser learns
// nothing from how long a refusal took).
bool credential_matches(const std::string& given, const std::string& expected);

// Reads the tenant and job-hint variables (STELLAR_TENANT, ..._CREDENTIAL,
// STELLAR_TENANTS, STELLAR_JOB_HINTS, STELLAR_TRAFFIC_CLASS_DSCP,
// STELLAR_TX_RATE) into `options`.
Status apply_environment(ContextOptions& options);

// The verbs GRH traffic class / IP TOS byte (DSCP << 2, ECN bits 0) of hints.
inline uint8_t tos_of(const ContextOptions& o, const JobHints& h) { return uint8_t(o.class_dscp[h.traffic_class()] << 2); }

}  // namespace stellar::tenants

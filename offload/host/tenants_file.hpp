// The tenants file (docs/scheduler.md, "Tenants"): who may use the engines,
// with which credential, and what each tenant gets. Read by both places
// the engines run: the application's in-process engine host (through
// src/core/tenants, which turns entries into TenantOptions) and the engine
// daemon (`stellar-engined --tenants FILE`), which needs nothing of src/.
//
//   {"tenants": [{"name": "a", "credential": "...", "pkey": 0x8001, "weight": 2,
//                 "rate_bytes_per_s": 0, "burst_bytes": 0, "max_qps": 0,
//                 "max_registered_bytes": 0, "max_receive_wrs": 0, "max_send_wrs": 0}]}
//
// Strict: unknown keys, wrong types, duplicate names or partition keys, a
// missing name or credential, a file over 1 MiB or not a regular file are
// errors naming the place. Quotas of 0 mean unlimited.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace stellar::host {

struct TenantEntry {
  uint16_t pkey = 0;  // 0: assigned
  std::string credential;
  uint32_t weight = 1;
  uint64_t rate_bytes_per_s = 0, burst_bytes = 0;
  uint32_t max_qps = 0;
  uint64_t max_registered_bytes = 0;
  uint32_t max_receive_wrs = 0, max_send_wrs = 0;
};

// The file's tenants by name; nullopt with `error` ("tenants file PATH: why").
// Opened without blocking: a FIFO named by mistake cannot hang the caller.
std::optional<std::map<std::string, TenantEntry>> load_tenants_file(const std::string& path, std::string& error);

// Compares in time that depends only on the lengths (a guesser learns
// nothing from how long a refusal took). An empty `expected` never matches.
bool credential_matches(const std::string& given, const std::string& expected);

}  // namespace stellar::host

#include "core/tenants.hpp"

#include <charconv>
#include <sstream>

#include "core/config.hpp"
#include "host/tenants_file.hpp"

namespace stellar {

namespace {
struct KindName {
  TrafficKind kind;
  const char* name;
  uint8_t traffic_class;
};
// The kinds' default classes (docs/scheduler.md, "Traffic classes"): control
// alone at the top, then collectives' gradient traffic, fetches, best
// effort, and checkpoints (bulk that may wait) below best effort's DSCP.
constexpr KindName kinds[] = {
    {TrafficKind::unspecified, "unspecified", 0},
    {TrafficKind::gradient_allreduce, "allreduce", 4},
    {TrafficKind::gradient_reduce_scatter, "reduce-scatter", 4},
    {TrafficKind::gradient_allgather, "allgather", 4},
    {TrafficKind::all_to_all, "all-to-all", 4},
    {TrafficKind::parameter_fetch, "parameter-fetch", 3},
    {TrafficKind::kv_fetch, "kv-fetch", 3},
    {TrafficKind::checkpoint, "checkpoint", 1},
    {TrafficKind::control, "control", 7},
};

Result<uint64_t> number(const std::string& field, const std::string& text, uint64_t max) {
  uint64_t v = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || error != std::errc() || end != text.data() + text.size())
    return Status(Errc::invalid_argument, field + "='" + text + "' is not a decimal number below 2^64");
  if (v > max) return Status(Errc::invalid_argument, field + "=" + text + " is above " + std::to_string(max));
  return uint64_t(v);
}
}  // namespace

const char* to_string(TrafficKind k) {
  for (const auto& n : kinds)
    if (n.kind == k) return n.name;
  return "unspecified";
}

Result<TrafficKind> parse_traffic_kind(const std::string& s) {
  for (const auto& n : kinds)
    if (s == n.name) return n.kind;
  return Status(Errc::invalid_argument, "traffic kind '" + s +
                                            "' is not allreduce, reduce-scatter, allgather, all-to-all, parameter-fetch, "
                                            "kv-fetch, checkpoint, control or unspecified");
}

uint8_t JobHints::traffic_class() const {
  if (priority >= 0) return uint8_t(std::min(priority, 7));
  for (const auto& n : kinds)
    if (n.kind == kind) return n.traffic_class;
  return 0;
}

Result<JobHints> JobHints::parse(const std::string& text) {
  JobHints h;
  if (text.find('=') == std::string::npos) {  // just a kind
    auto k = parse_traffic_kind(text);
    if (!k) return k.status();
    h.kind = *k;
    return h;
  }
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return Status(Errc::invalid_argument, "job hint '" + item + "' is not key=value");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "job") {
      if (value.size() > 128) return Status(Errc::invalid_argument, "job name longer than 128 bytes");
      h.job = value;
    } else if (key == "kind") {
      auto k = parse_traffic_kind(value);
      if (!k) return k.status();
      h.kind = *k;
    } else if (key == "priority") {
      auto v = number(key, value, 7);
      if (!v) return v.status();
      h.priority = int(*v);
    } else if (key == "weight") {
      auto v = number(key, value, 1'000'000);
      if (!v) return v.status();
      if (*v == 0) return Status(Errc::invalid_argument, "weight=0: weights are at least 1");
      h.weight = uint32_t(*v);
    } else if (key == "step_ms" || key == "deadline_ms") {
      auto v = number(key, value, 86'400'000);
      if (!v) return v.status();
      (key == "step_ms" ? h.step_period : h.deadline) = std::chrono::milliseconds(*v);
    } else if (key == "bytes_per_step") {
      auto v = number(key, value, UINT64_MAX / 2);
      if (!v) return v.status();
      h.bytes_per_step = *v;
    } else {
      return Status(Errc::invalid_argument, "job hint key '" + key +
                                                "' is not job, kind, priority, weight, step_ms, bytes_per_step or deadline_ms");
    }
  }
  return h;
}

namespace tenants {

bool credential_matches(const std::string& given, const std::string& expected) { return host::credential_matches(given, expected); }

Result<std::map<std::string, TenantOptions>> load(const std::string& path) {
  std::string error;
  auto entries = host::load_tenants_file(path, error);
  if (!entries) return Status(Errc::invalid_argument, error);
  std::map<std::string, TenantOptions> out;
  for (auto& [name, e] : *entries) {
    TenantOptions& o = out[name];
    o.pkey = e.pkey;
    o.credential = e.credential;
    o.weight = e.weight;
    o.rate_bytes_per_s = e.rate_bytes_per_s;
    o.burst_bytes = e.burst_bytes;
    o.max_qps = e.max_qps;
    o.max_registered_bytes = e.max_registered_bytes;
    o.max_receive_wrs = e.max_receive_wrs;
    o.max_send_wrs = e.max_send_wrs;
  }
  return out;
}

Status apply_environment(ContextOptions& o) {
  if (auto v = config::text("STELLAR_TENANT")) o.tenant = *v;
  if (auto v = config::text("STELLAR_TENANT_CREDENTIAL")) o.credential = *v;
  if (auto v = config::text("STELLAR_TENANTS")) o.tenants_file = *v;
  if (auto v = config::text("STELLAR_JOB_HINTS")) {
    auto h = JobHints::parse(*v);
    if (!h) return Status(Errc::invalid_argument, "STELLAR_JOB_HINTS: " + h.status().message());
    o.hints = *h;
  }
  if (auto v = config::text("STELLAR_TRAFFIC_CLASS_DSCP")) {
    std::stringstream in(*v);
    std::string item;
    int i = 0;
    uint8_t dscp[8];
    while (std::getline(in, item, ',')) {
      auto n = number("STELLAR_TRAFFIC_CLASS_DSCP", item, 63);
      if (!n || i == 8) return Status(Errc::invalid_argument, "STELLAR_TRAFFIC_CLASS_DSCP='" + *v + "' is not 8 integers 0-63");
      dscp[i++] = uint8_t(*n);
    }
    if (i != 8) return Status(Errc::invalid_argument, "STELLAR_TRAFFIC_CLASS_DSCP='" + *v + "' is not 8 integers 0-63");
    std::copy(dscp, dscp + 8, o.class_dscp);
  }
  auto rate = config::integer("STELLAR_TX_RATE", 0, INT64_MAX / 4);
  if (!rate) return rate.status();
  if (*rate) o.tx_rate_bytes_per_s = uint64_t(**rate);
  for (uint8_t d : o.class_dscp)
    if (d > 63) return Status(Errc::invalid_argument, "ContextOptions::class_dscp: DSCP " + std::to_string(d) + " above 63");
  return Status();
}

}  // namespace tenants
}  // namespace stellar

// Provider-independent parts of the API: the environment, and Context::open's
// dispatch to a provider (names and parsing of enums are in names.cpp).
#include <cstdlib>
#include <stdexcept>

#include "core/providers.hpp"
#include "stellar/verbs.hpp"

namespace stellar {

std::string describe(const WorkCompletion& wc) {
  if (wc.provider_status != 0)
    if (const provider::Ops* ops = provider::find(wc.provider); ops && ops->describe_status)
      return ops->describe_status(wc.provider_status, wc.vendor_error);
  return to_string(wc.status);
}

namespace {
Status read_probability(const char* name, double& out) {
  const char* text = std::getenv(name);
  if (!text || !*text) return {};
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v >= 0.0 && v <= 1.0))
    return Status(Errc::invalid_argument, std::string(name) + "='" + text + "' is not a probability in [0, 1]");
  out = v;
  return {};
}
}  // namespace

Result<FaultOptions> FaultOptions::from_environment(const FaultOptions& given) {
  FaultOptions base = given;
  for (auto [name, field] : {std::pair{"STELLAR_FAULT_DROP", &base.drop}, std::pair{"STELLAR_FAULT_DUP", &base.duplicate},
                             std::pair{"STELLAR_FAULT_REORDER", &base.reorder}}) {
    if (Status s = read_probability(name, *field); !s.ok()) return s;
  }
  if (const char* seed = std::getenv("STELLAR_FAULT_SEED"); seed && *seed) base.seed = std::strtoull(seed, nullptr, 0);
  return base;
}

Result<std::shared_ptr<Context>> Context::open(const ContextOptions& options) {
  auto faults = FaultOptions::from_environment(options.faults);
  if (!faults) return faults.status();
  ContextOptions effective = options;
  effective.faults = *faults;
  if (effective.mtu < 256 || effective.mtu > 16384)
    return Status(Errc::invalid_argument, "mtu " + std::to_string(effective.mtu) + " outside [256, 16384]");
  const provider::Ops* ops = provider::find(effective.provider);
  if (!ops || !ops->open) return Status(Errc::invalid_argument, "provider '" + std::string(to_string(effective.provider)) + "' is not built in");
  return ops->open(effective);
}

}  // namespace stellar

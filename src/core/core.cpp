// Provider-independent parts of the API: the environment, and Context::open's
// dispatch to a provider (names and parsing of enums are in names.cpp).
#include <stdexcept>

#include "core/config.hpp"
#include "core/providers.hpp"
#include "core/tenants.hpp"
#include "stellar/verbs.hpp"

namespace stellar {

std::string describe(const WorkCompletion& wc) {
  if (wc.provider_status != 0)
    if (const provider::Ops* ops = provider::find(wc.provider); ops && ops->describe_status)
      return ops->describe_status(wc.provider_status, wc.vendor_error);
  return to_string(wc.status);
}

Result<FaultOptions> FaultOptions::from_environment(const FaultOptions& given) {
  FaultOptions base = given;
  for (auto [name, field] : {std::pair{"STELLAR_FAULT_DROP", &base.drop}, std::pair{"STELLAR_FAULT_DUP", &base.duplicate},
                             std::pair{"STELLAR_FAULT_REORDER", &base.reorder}}) {
    auto value = config::probability(name);
    if (!value) return value.status();
    if (*value) *field = **value;
  }
  auto seed = config::unsigned64("STELLAR_FAULT_SEED");
  if (!seed) return seed.status();
  if (*seed) base.seed = **seed;
  return base;
}

Result<std::shared_ptr<Context>> Context::open(const ContextOptions& options) {
  auto faults = FaultOptions::from_environment(options.faults);
  if (!faults) return faults.status();
  ContextOptions effective = options;
  effective.faults = *faults;
  // The placement of the engines: a deployment switches an unchanged
  // program to the daemon with the environment alone.
  if (auto engine = config::text("STELLAR_ENGINE")) {
    if (*engine == "inline") effective.progress = ProgressMode::inline_poll;
    else if (*engine == "thread") effective.progress = ProgressMode::thread;
    else if (*engine == "daemon") effective.progress = ProgressMode::daemon;
    else return Status(Errc::invalid_argument, "STELLAR_ENGINE='" + *engine + "' is not inline, thread or daemon");
  }
  auto paths = config::integer("STELLAR_PATHS", 1, 256);
  if (!paths) return paths.status();
  if (*paths) effective.paths = uint16_t(**paths);
  if (effective.paths < 1 || effective.paths > 256)
    return Status(Errc::invalid_argument, "paths " + std::to_string(effective.paths) + " outside [1, 256]");
  if (auto policy = config::text("STELLAR_PATH_POLICY")) {
    auto parsed = parse_path_policy(*policy);
    if (!parsed) return Status(Errc::invalid_argument, "STELLAR_PATH_POLICY: " + parsed.status().message());
    effective.path_policy = *parsed;
  }
  auto loopback_crc = config::integer("STELLAR_LOOPBACK_CRC", 0, 1);
  if (!loopback_crc) return loopback_crc.status();
  if (*loopback_crc) effective.loopback_crc = **loopback_crc == 1;
  auto placement = config::integer("STELLAR_RX_PLACEMENT", 0, 1);
  if (!placement) return placement.status();
  if (*placement) effective.rx_placement = **placement == 1;
  auto follow = config::integer("STELLAR_FOLLOW_ADDRESS", 0, 1);
  if (!follow) return follow.status();
  if (*follow) effective.follow_address = **follow == 1;
  auto sizing = config::integer("STELLAR_PATH_MTU_DISCOVERY", 0, 1);
  if (!sizing) return sizing.status();
  if (*sizing) effective.path_mtu_discovery = **sizing == 1;
  if (effective.engined_socket.empty())
    effective.engined_socket = config::text("STELLAR_ENGINED_SOCKET").value_or("/run/stellar/engined.sock");
  if (Status st = tenants::apply_environment(effective); !st) return st;
  if (auto mtu = config::text("STELLAR_MTU"); mtu && *mtu == "auto") {
    effective.mtu = 0;
  } else {
    auto bytes = config::integer("STELLAR_MTU", 256, max_mtu);
    if (!bytes) return bytes.status();
    if (*bytes) effective.mtu = uint32_t(**bytes);
  }
  if (effective.mtu != 0 && (effective.mtu < 256 || effective.mtu > max_mtu))
    return Status(Errc::invalid_argument,
                  "mtu " + std::to_string(effective.mtu) + " outside [256, " + std::to_string(max_mtu) + "] (0: automatic)");
  const provider::Ops* ops = provider::find(effective.provider);
  if (!ops || !ops->open) return Status(Errc::invalid_argument, "provider '" + std::string(to_string(effective.provider)) + "' is not built in");
  return ops->open(effective);
}

}  // namespace stellar

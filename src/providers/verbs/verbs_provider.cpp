// The verbs provider (rdma-core). This build checks for RDMA devices and
// reports clearly when there are none; the data path over ibv_* objects is
// the work of the hardware-paths issue and is not in this build yet.
#include <infiniband/verbs.h>

#include <string>

#include "core/providers.hpp"
#include "providers/verbs/translate.hpp"

namespace stellar::provider {

Result<std::shared_ptr<Context>> open_verbs(const ContextOptions& options) {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  std::string names;
  for (int i = 0; devices && i < count; ++i) names += std::string(names.empty() ? "" : ", ") + ibv_get_device_name(devices[i]);
  if (devices) ibv_free_device_list(devices);
  if (count == 0)
    return verbs::no_device_status("ibv_get_device_list returned none");
  return Status(Errc::unsupported, "verbs provider: found " + names + (options.device.empty() ? "" : " (asked for " + options.device + ")") +
                                       ", but this build's verbs data path is not implemented yet; use --provider soft");
}

}  // namespace stellar::provider

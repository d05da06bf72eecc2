// The provider seam: each provider is a factory returning the API's abstract
// objects (rdma-core style: a provider is a table of operations).
#pragma once

#include "stellar/verbs.hpp"

namespace stellar::provider {

Result<std::shared_ptr<Context>> open_soft(const ContextOptions&);
Result<std::shared_ptr<Context>> open_verbs(const ContextOptions&);

// WorkCompletion::provider_status/vendor_error of the verbs provider, in words.
std::string describe_verbs_status(uint32_t status, uint32_t vendor_error);

}  // namespace stellar::provider

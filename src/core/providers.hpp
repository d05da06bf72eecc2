// The provider seam: each provider is a factory returning the API's abstract
// objects (rdma-core style: a provider is a table of operations).
#pragma once

#include "stellar/verbs.hpp"

namespace stellar::provider {

Result<std::shared_ptr<Context>> open_soft(const ContextOptions&);
Result<std::shared_ptr<Context>> open_verbs(const ContextOptions&);

}  // namespace stellar::provider

// The built-in providers. A list rather than self-registration from static
// constructors: in a static libstellar.a the linker drops object files that
// nothing references, and with them any registration they would have made.
#include "core/providers.hpp"

namespace stellar::provider {

extern const Ops soft_ops;   // src/providers/soft/soft_provider.cpp
extern const Ops verbs_ops;  // src/providers/verbs/verbs_provider.cpp

namespace {
const Ops* const built_in[] = {&soft_ops, &verbs_ops};
}  // namespace

std::span<const Ops* const> all() { return built_in; }

const Ops* find(Provider id) {
  for (const Ops* ops : built_in)
    if (ops->id == id) return ops;
  return nullptr;
}

const Ops* find(cm::Method method) {
  for (const Ops* ops : built_in)
    if (ops->cm_method == method) return ops;
  return nullptr;
}

}  // namespace stellar::provider

// The provider seam, rdma-core's pattern: each provider is a table of
// operations (name, open, its status descriptions, its own connection-manager
// method if it has one). The core calls providers only through these tables
// and names none of them; the list of built-in providers lives with the
// providers (src/providers/registry.cpp). Internal header.
#pragma once

#include <optional>
#include <span>
#include <string>

#include "stellar/cm.hpp"
#include "stellar/verbs.hpp"

namespace stellar::provider {

struct Ops {
  Provider id;
  const char* name;
  // Opens a context; the options were checked by Context::open.
  Result<std::shared_ptr<Context>> (*open)(const ContextOptions&) = nullptr;
  // WorkCompletion::provider_status/vendor_error in words; null for a
  // provider that sets none.
  std::string (*describe_status)(uint32_t status, uint32_t vendor_error) = nullptr;
  // A connection-manager method of the provider's own (the verbs provider's
  // librdmacm), with its listen and connect; nullopt/null when it has none
  // (cm::Method::tcp is the core's and works for every provider).
  std::optional<cm::Method> cm_method;
  Result<std::unique_ptr<cm::Listener>> (*cm_listen)(const std::string& address, uint16_t port) = nullptr;
  Result<cm::Connected> (*cm_connect)(const std::string& address, uint16_t port, QueuePair&, const cm::ConnectOptions&) = nullptr;
};

// Every provider this library was built with, in a fixed order.
std::span<const Ops* const> all();
// The provider with that id, or with that connection-manager method; null if none.
const Ops* find(Provider);
const Ops* find(cm::Method);

}  // namespace stellar::provider

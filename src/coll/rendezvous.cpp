#include "coll/rendezvous.hpp"

#include <algorithm>
#include <string>

#include "coll/shared_memory.hpp"

namespace stellar::coll {

using control::json;

namespace {

// Job parameters that decide which messages a call sends.
constexpr const char* job_parameters[] = {"mode", "slots", "chunk_bytes", "allreduce_algorithm", "small_message_bytes", "qps_per_peer"};
constexpr size_t max_qps_per_peer = 16;
constexpr size_t max_endpoint_bytes = 400;  // one endpoint's JSON, generously

Status malformed(int rank, const std::string& why) {
  return Status(Errc::protocol_error, "rank " + std::to_string(rank) + " sent a malformed hello: " + why);
}

}  // namespace

size_t max_hello_bytes(int world, uint32_t qps_per_peer) {
  return 4096 + size_t(world) * (std::min<size_t>(qps_per_peer, max_qps_per_peer) * max_endpoint_bytes + 64);
}

Result<int> check_hello(const json& h, int world, const json& reference) {
  auto type = control::read_string(h, "type", 16);
  if (!type) return type.status();
  if (*type != "hello") return Status(Errc::protocol_error, "expected a hello, got '" + control::printable(*type, 16) + "'");
  auto rank = control::read_unsigned(h, "rank", 0, uint64_t(world) - 1);
  if (!rank) return Status(Errc::protocol_error, "hello: " + rank.status().message());
  const int r = int(*rank);
  auto version = control::read_unsigned(h, "version", 0, UINT32_MAX);
  if (!version) return malformed(r, version.status().message());
  if (*version != 4) return Status(Errc::protocol_error, "rank " + std::to_string(r) + " speaks rendezvous version " + std::to_string(*version) + ", not 4 (another Stellar release?)");
  // Which machine it runs on (a hash of its kernel's boot id) and the CPUs it
  // may use (hex mask): ranks count who shares their CPUs.
  if (auto host = control::read_string(h, "host", 64); !host) return malformed(r, host.status().message());
  auto cpus = control::read_string(h, "cpus", 256);
  if (!cpus) return malformed(r, cpus.status().message());
  if (cpus->empty() || cpus->find_first_not_of("0123456789abcdef") != std::string::npos)
    return malformed(r, "'cpus' is not a hex CPU mask");
  auto world_size = control::read_unsigned(h, "world_size", 0, UINT32_MAX);
  if (!world_size) return malformed(r, world_size.status().message());
  if (*world_size != uint64_t(world))
    return Status(Errc::invalid_argument,
                  "rank " + std::to_string(r) + " says the world size is " + std::to_string(*world_size) + ", this rank says " + std::to_string(world));
  for (const char* key : job_parameters) {
    const auto theirs = h.find(key);
    if (theirs == h.end()) return malformed(r, std::string("no '") + key + "'");
    if (*theirs != reference.at(key))
      return Status(Errc::invalid_argument, "rank " + std::to_string(r) + " uses another " + key + " than this rank (" + reference.at(key).dump() + ")");
  }
  const uint64_t qps = reference.at("qps_per_peer").get<uint64_t>();
  const auto endpoints = h.find("endpoints");
  const auto landing = h.find("landing");
  if (endpoints == h.end() || !endpoints->is_array() || endpoints->size() != size_t(world))
    return malformed(r, "'endpoints' is not a list of " + std::to_string(world) + " entries");
  if (landing == h.end() || !landing->is_array() || landing->size() != size_t(world))
    return malformed(r, "'landing' is not a list of " + std::to_string(world) + " entries");
  for (int peer = 0; peer < world; ++peer) {
    const json& e = (*endpoints)[size_t(peer)];
    const json& l = (*landing)[size_t(peer)];
    if (peer == r) {
      if (!e.is_null() || !l.is_null()) return malformed(r, "an entry for itself");
      continue;
    }
    if (!e.is_array() || e.size() != qps) return malformed(r, "endpoints towards rank " + std::to_string(peer) + " are not " + std::to_string(qps) + " QPs");
    for (const json& endpoint : e)
      if (auto checked = control::endpoint_from(endpoint); !checked)
        return malformed(r, "endpoint towards rank " + std::to_string(peer) + ": " + checked.status().message());
    if (!l.is_object()) return malformed(r, "landing entry for rank " + std::to_string(peer) + " is not an object");
    if (auto addr = control::read_unsigned(l, "addr", 1, UINT64_MAX); !addr)
      return malformed(r, "landing entry for rank " + std::to_string(peer) + ": " + addr.status().message());
  }
  if (world > 1)
    if (auto rkey = control::read_unsigned(h, "landing_rkey", 0, UINT32_MAX); !rkey) return malformed(r, rkey.status().message());
  // Whether it allows direct gather (absent: a rank that predates it, no).
  if (const auto direct = h.find("direct_gather"); direct != h.end() && !direct->is_boolean())
    return malformed(r, "'direct_gather' is not true or false");
  // Its shared-memory segment, which ranks on its host will map: a name of
  // Stellar's shape (nothing else under /dev/shm) and the token its header holds.
  if (const auto shm = h.find("shm"); shm != h.end() && !shm->is_null()) {
    if (!shm->is_object()) return malformed(r, "'shm' is not an object");
    auto name = control::read_string(*shm, "name", 96);
    if (!name) return malformed(r, "shm: " + name.status().message());
    if (!detail::valid_segment_name(*name)) return malformed(r, "shm: '" + control::printable(*name, 96) + "' is not a segment name");
    auto token = control::read_string(*shm, "token", 16);
    if (!token) return malformed(r, "shm: " + token.status().message());
    if (token->size() != 16 || token->find_first_not_of("0123456789abcdef") != std::string::npos) return malformed(r, "shm: the token is not 16 hex digits");
  }
  return r;
}

Result<std::vector<int>> read_shared_memory_pairs(const json& message, int world, int self) {
  const auto list = message.find("shm");
  if (list == message.end() || list->is_null()) return std::vector<int>{};
  if (!list->is_array() || list->size() >= size_t(world)) return Status(Errc::protocol_error, "'shm' is not a list of fewer than " + std::to_string(world) + " ranks");
  std::vector<int> ranks;
  for (const json& entry : *list) {
    if (!entry.is_number_integer() || entry.get<int64_t>() < 0 || entry.get<int64_t>() >= int64_t(world))
      return Status(Errc::protocol_error, "'shm' holds something that is not a rank");
    const int r = int(entry.get<int64_t>());
    if (r == self || std::find(ranks.begin(), ranks.end(), r) != ranks.end())
      return Status(Errc::protocol_error, "'shm' names rank " + std::to_string(r) + " twice or this rank itself");
    ranks.push_back(r);
  }
  return ranks;
}

Result<std::vector<json>> check_table(const json& reply, int world, const json& own) {
  auto type = control::read_string(reply, "type", 16);
  if (!type) return type.status();
  if (*type != "table") return Status(Errc::protocol_error, "expected the rendezvous table, got '" + control::printable(*type, 16) + "'");
  const auto ranks = reply.find("ranks");
  if (ranks == reply.end() || !ranks->is_array() || ranks->size() != size_t(world))
    return Status(Errc::protocol_error, "rendezvous table from rank 0 is not a list of " + std::to_string(world) + " hellos");
  std::vector<json> table;
  table.reserve(size_t(world));
  for (int r = 0; r < world; ++r) {
    const json& h = (*ranks)[size_t(r)];
    auto sender = check_hello(h, world, own);
    if (!sender) return Status(sender.status().code(), "rendezvous table, entry " + std::to_string(r) + ": " + sender.status().message());
    if (*sender != r) return Status(Errc::protocol_error, "rendezvous table: entry " + std::to_string(r) + " is rank " + std::to_string(*sender) + "'s");
    table.push_back(h);
  }
  return table;
}

}  // namespace stellar::coll

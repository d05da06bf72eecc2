// libFuzzer target over the control plane's message handlers: every line a
// peer can send the connection manager (connect, accept, reject) or the
// collectives' rendezvous (hello, table, ready, go, error) goes through the same
// checks as on the wire. The input is one line; its first byte also picks
// the world size the rendezvous checks assume. A crash, an abort, an
// uncaught exception or (under the sanitizers) a bad read fails.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "coll/rendezvous.hpp"
#include "core/control_messages.hpp"

using namespace stellar;
using control::json;

namespace {

// A valid hello of `rank` in a `world`-rank job with 2 QPs per peer.
json hello(int rank, int world) {
  json endpoints = json::array(), landing = json::array();
  for (int peer = 0; peer < world; ++peer) {
    if (peer == rank) {
      endpoints.push_back(nullptr);
      landing.push_back(nullptr);
      continue;
    }
    json qps = json::array();
    for (uint32_t j = 0; j < 2; ++j) {
      QpEndpoint e;
      e.address = "127.0.0.1";
      e.udp_port = uint16_t(40000 + rank);
      e.qp_num = uint32_t(100 + peer * 2 + j);
      e.token = 0x0123456789abcdefull;
      qps.push_back(control::endpoint_json(e));
    }
    endpoints.push_back(qps);
    landing.push_back(json{{"addr", 0x10000 + peer}});
  }
  return json{{"type", "hello"}, {"version", 4}, {"rank", rank}, {"host", "boot-id"}, {"cpus", "3"}, {"world_size", world}, {"mode", "stellar"}, {"slots", 8},
              {"chunk_bytes", 1 << 20}, {"allreduce_algorithm", 0}, {"small_message_bytes", 65536}, {"qps_per_peer", 2},
              {"endpoints", endpoints}, {"landing", landing}, {"landing_rkey", 77}};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int world = 1 + data[0] % 4;
  const std::string_view line(reinterpret_cast<const char*>(data + 1), size - 1);
  auto j = control::parse_line(line);
  if (!j) return 0;
  (void)control::parse_endpoint_message(*j, "connect");
  (void)control::parse_endpoint_message(*j, "accept");
  (void)control::endpoint_from(*j);
  (void)control::read_reason(*j);
  const json reference = hello(0, world);
  if (auto r = coll::check_hello(*j, world, reference); r && (*r < 0 || *r >= world)) __builtin_trap();
  (void)coll::check_table(*j, world, reference);
  // A ready's or go's shared-memory pairs: distinct ranks, never the reader.
  if (auto pairs = coll::read_shared_memory_pairs(*j, world, 0); pairs)
    for (size_t i = 0; i < pairs->size(); ++i) {
      const int r = (*pairs)[i];
      if (r <= 0 || r >= world) __builtin_trap();
      for (size_t k = 0; k < i; ++k)
        if ((*pairs)[k] == r) __builtin_trap();
    }
  // Messages that pass are written back out as the library would.
  if (auto m = control::parse_endpoint_message(*j, "connect"); m) {
    auto again = control::parse_endpoint_message(control::endpoint_message_json("connect", m->endpoint, m->private_data), "connect");
    if (!again || again->private_data != m->private_data || again->endpoint.qp_num != m->endpoint.qp_num ||
        again->endpoint.token != m->endpoint.token)
      __builtin_trap();
  }
  return 0;
}

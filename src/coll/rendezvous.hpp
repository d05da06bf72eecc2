// The collectives' rendezvous messages, checked (no I/O; the fuzz target
// drives these directly). Rank 0 serves a TCP rendezvous at MASTER_ADDR:
//   rank r -> rank 0   {"type":"hello", "version":4, "rank":r, "host", "cpus", "world_size", job
//                       parameters..., "endpoints":[per rank: null for r itself,
//                       else qps_per_peer endpoints], "landing":[per rank: null
//                       or {"addr":u64}], "landing_rkey":u32,
//                       "shm": null | {"name":"/stellar-coll-...", "token":16 hex digits}}
//   rank 0 -> rank r   {"type":"table", "ranks":[every rank's hello]} | {"type":"error","reason"}
//   rank r -> rank 0   {"type":"ready", "shm":[ranks whose segment r mapped]} | {"type":"failed","reason"}
//   rank 0 -> rank r   {"type":"go", "shm":[ranks r shares memory with]} | {"type":"error","reason"}
// "shm" is optional everywhere (absent = none): a rank of an earlier
// release simply talks over the network.
// Everything a hello says is checked here before anyone uses it: types,
// ranges, the table's shape, and the job parameters against the reader's
// own (they decide which messages a call sends, so all ranks must agree).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/control_messages.hpp"

namespace stellar::coll {

// The longest hello a rank of a `world`-rank job with `qps_per_peer` QPs per
// peer may send: the line cap of rank 0's rendezvous server.
size_t max_hello_bytes(int world, uint32_t qps_per_peer);

// Checks `h` as a hello of a `world`-rank job whose parameters must equal
// those of `reference` (the reader's own hello). Returns the sender's rank.
Result<int> check_hello(const control::json& h, int world, const control::json& reference);

// Checks rank 0's table (type "table") against `own` (this rank's hello):
// every entry is a valid hello of its own rank. Returns the entries.
Result<std::vector<control::json>> check_table(const control::json& reply, int world, const control::json& own);

// The "shm" list of a ready or go message: distinct ranks of the job other
// than `self`; absent means none.
Result<std::vector<int>> read_shared_memory_pairs(const control::json& message, int world, int self);

}  // namespace stellar::coll

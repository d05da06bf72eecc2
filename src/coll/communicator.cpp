// The communicator: bootstrap through rank 0's TCP rendezvous, one RC QP per
// peer, credit-based RDMA WRITE_WITH_IMM channels, and the algorithms (ring,
// recursive doubling, pipelined chain broadcast) on top of them.
//
// Channel protocol, per ordered pair of ranks (sender -> receiver):
//   - the receiver owns `slots` landing slots of chunk_bytes for the sender,
//     registered for remote write and advertised at bootstrap;
//   - the sender writes message m into slot m % slots with WRITE_WITH_IMM;
//     the immediate is [0][15-bit call tag][16-bit message index], and the
//     completion's byte count is the message length;
//   - after consuming slots the receiver returns credits: a zero-length
//     WRITE_WITH_IMM whose immediate says how many slots it freed. The
//     sender never has more than `slots` messages unconsumed, so a slot is
//     never overwritten early. Credits are coalesced: one message per
//     slots/2 freed, or sooner when the receiver has waited 100 us with
//     credits owed (so a sender that needs them is never stuck), since on
//     loopback each small message costs a system call on both sides.
// RC delivers a pair's messages in order, so messages of the next call that
// arrive early simply queue behind the current call's.
//
// Progress: the context's own choice (inline polling by default, the lowest
// latency). A call returns only after every message it wrote is acknowledged
// (a retransmission would read the caller's buffers again), and it flushes
// the acknowledgements this rank holds back, so that peers finish their calls
// while this rank computes without polling. Credits need no such wait: an
// unacknowledged credit is retransmitted when both sides poll again, and the
// QPs' retry budget covers the longest gap the timeout allows.
#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <thread>
#include <vector>

#include "coll/reduce.hpp"
#include "coll/rendezvous.hpp"
#include "coll/shared_memory.hpp"
#include "core/config.hpp"
#include "core/control_channel.hpp"
#include "core/log.hpp"
#include "stellar/coll.hpp"

namespace stellar::coll {

using control::Channel;
using control::Clock;
using control::json;
using control::tcp;

size_t size_of(DataType t) {
  switch (t) {
    case DataType::uint8:
    case DataType::int8: return 1;
    case DataType::float16:
    case DataType::bfloat16: return 2;
    case DataType::float32:
    case DataType::int32: return 4;
    case DataType::float64:
    case DataType::int64: return 8;
  }
  return 0;
}

const char* to_string(DataType t) {
  switch (t) {
    case DataType::float32: return "float";
    case DataType::float16: return "half";
    case DataType::bfloat16: return "bfloat16";
    case DataType::float64: return "double";
    case DataType::int32: return "int32";
    case DataType::int64: return "int64";
    case DataType::uint8: return "uint8";
    case DataType::int8: return "int8";
  }
  return "?";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::prod: return "prod";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::avg: return "avg";
    case ReduceOp::band: return "band";
    case ReduceOp::bor: return "bor";
    case ReduceOp::bxor: return "bxor";
  }
  return "?";
}

Result<DataType> parse_data_type(const std::string& name) {
  static const std::pair<const char*, DataType> names[] = {
      {"float", DataType::float32},   {"float32", DataType::float32}, {"f32", DataType::float32},
      {"half", DataType::float16},    {"float16", DataType::float16}, {"fp16", DataType::float16},
      {"bfloat16", DataType::bfloat16}, {"bf16", DataType::bfloat16},
      {"double", DataType::float64},  {"float64", DataType::float64}, {"f64", DataType::float64},
      {"int32", DataType::int32},     {"int", DataType::int32},       {"int64", DataType::int64},
      {"long", DataType::int64},     {"uint8", DataType::uint8},     {"byte", DataType::uint8},
      {"int8", DataType::int8},       {"char", DataType::int8}};
  for (const auto& [n, t] : names)
    if (name == n) return t;
  return Status(Errc::invalid_argument, "unknown data type '" + name + "' (float, half, bfloat16, double, int32, int64, uint8, int8)");
}

Result<ReduceOp> parse_reduce_op(const std::string& name) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max, ReduceOp::avg, ReduceOp::band, ReduceOp::bor, ReduceOp::bxor})
    if (name == to_string(op)) return op;
  return Status(Errc::invalid_argument, "unknown reduction '" + name + "' (sum, prod, min, max, avg, band, bor, bxor)");
}

Result<CommunicatorOptions> CommunicatorOptions::from_environment() { return from_environment(CommunicatorOptions{}); }

Result<CommunicatorOptions> CommunicatorOptions::from_environment(const CommunicatorOptions& base) {
  CommunicatorOptions o = base;
  // torchrun's RANK/WORLD_SIZE, else mpirun's; both must be there.
  const char* rank_name = "RANK";
  const char* size_name = "WORLD_SIZE";
  if (!config::text(rank_name) || !config::text(size_name)) {
    rank_name = "OMPI_COMM_WORLD_RANK";
    size_name = "OMPI_COMM_WORLD_SIZE";
  }
  if (config::text(rank_name) && config::text(size_name)) {
    auto s = config::integer(size_name, 1, 65536);
    if (!s) return s.status();
    auto r = config::integer(rank_name, 0, **s - 1);
    if (!r) return r.status();
    o.rank = int(**r);
    o.world_size = int(**s);
  } else if (o.rank < 0 || o.world_size < 1) {
    return Status(Errc::invalid_argument,
                  "no rank in the environment: set RANK and WORLD_SIZE (torchrun style) or run under mpirun (OMPI_COMM_WORLD_RANK/SIZE)");
  }
  if (auto a = config::text("MASTER_ADDR")) o.master_address = *a;
  auto port = config::integer("MASTER_PORT", 1, 65535);
  if (!port) return port.status();
  if (*port) o.master_port = uint16_t(**port);
  auto timeout = config::integer("STELLAR_COLL_TIMEOUT_MS", 1, 86'400'000);
  if (!timeout) return timeout.status();
  if (*timeout) o.timeout = std::chrono::milliseconds(**timeout);
  auto qps = config::integer("STELLAR_COLL_QPS_PER_PEER", 1, 16);
  if (!qps) return qps.status();
  if (*qps) o.qps_per_peer = uint32_t(**qps);
  if (auto shm = config::text("STELLAR_COLL_SHM")) {
    if (*shm != "0" && *shm != "1") return Status(Errc::invalid_argument, "STELLAR_COLL_SHM='" + *shm + "' is not 0 or 1");
    o.shared_memory = *shm == "1";
  }
  if (auto direct = config::text("STELLAR_COLL_DIRECT")) {
    if (*direct != "0" && *direct != "1") return Status(Errc::invalid_argument, "STELLAR_COLL_DIRECT='" + *direct + "' is not 0 or 1");
    o.direct_gather = *direct == "1";
  }
  if (auto w = config::text("STELLAR_COLL_WAIT")) {
    if (*w == "busy" || *w == "adaptive") {
      o.context.wait = *w == "busy" ? WaitPolicy::busy_poll : WaitPolicy::adaptive;
      o.adapt_wait = false;
    } else if (*w == "auto") {
      o.adapt_wait = true;
    } else {
      return Status(Errc::invalid_argument, "STELLAR_COLL_WAIT='" + *w + "' is not auto, busy or adaptive");
    }
  }
  return o;
}

namespace {

constexpr uint32_t control_bit = 0x80000000u;
// Credits: [1][15-bit kind 1][16-bit slots freed].
constexpr uint32_t credit_kind = control_bit | 0x10000u;
constexpr uint32_t credit_count_mask = 0xffffu;
uint32_t credit_imm(uint32_t slots) { return credit_kind | slots; }
// How long a rank waits without progress before it returns the credits it
// owes below a batch: a sender may be waiting for exactly those.
constexpr std::chrono::microseconds credit_idle_flush{100};
constexpr uint32_t abort_imm = control_bit | 2;
constexpr uint32_t bye_imm = control_bit | 3;
// Direct gather's advert (where this rank's output is), written into the
// previous rank's advert inbox: a control message, so it takes no landing
// slot and asks for no credit.
constexpr uint32_t advert_imm = control_bit | 4;
// The advert buffer: this rank's outgoing adverts, then its inbox for the
// next rank's, advert_entries of 16 bytes each (address 8, rkey 4, call
// tag 2, zero 2). The next rank is at most two adverts ahead of the ones
// this rank has read (it sends call k+1's only after finishing call k,
// which needed this rank's data of call k), and an outgoing entry is reused
// only four adverts later, long after its receiver used it.
constexpr size_t advert_entries = 4, advert_bytes = 16, advert_inbox_offset = advert_entries * advert_bytes;

// Direct gather on shared memory (process_vm_writev) while a ring segment
// (the call's output / ranks) is at most this; above it, the landing slots.
// Measured on the 2-vCPU VM, in-place float sum (stellar_allreduce -N 2 and
// -N 4, alternating --no-direct): single copy 20-30% ahead at 4 and 16 MiB
// (segments of 2-8 MiB), even with 16 MiB segments, and 15% behind with
// 32 MiB ones (2 ranks, 64 MiB). Both ranks of a pair decide alike: a pair
// shares memory only when both run this code (the segment's magic).
constexpr uint64_t shm_single_copy_max_segment = 8u << 20;

// Automatic allreduce: recursive halving and doubling up to this size (a
// power of two of at least 4 ranks), the ring above. Measured with 4 ranks
// on the 2-vCPU VM (stellar_allreduce -N 4 -b 128K -e 1M -f 2 -n 100 -w 10,
// --algorithm ring and hd alternating, four pairs, in-place busbw medians):
// network path 0.76 / 0.83 / 0.93 / 0.84 GB/s against the ring's 0.48 /
// 0.73 / 0.78 / 0.91 at 128 KiB / 256 KiB / 512 KiB / 1 MiB; shared memory
// 2.07 / 2.02 / 2.26 / 2.42 against 1.76 / 1.97 / 1.92 / 2.29. At 2 ranks
// the two move the same messages, and the ring gathers in place. Part of
// what the ranks must agree on: rendezvous version 4.
constexpr uint64_t halving_doubling_max_bytes = 512u << 10;

enum class CallKind : uint32_t { allreduce = 1, reduce_scatter, allgather, broadcast, barrier, reduce, all_to_all, point_to_point };

const char* to_string(CallKind k) {
  switch (k) {
    case CallKind::allreduce: return "allreduce";
    case CallKind::reduce_scatter: return "reduce_scatter";
    case CallKind::allgather: return "allgather";
    case CallKind::broadcast: return "broadcast";
    case CallKind::barrier: return "barrier";
    case CallKind::reduce: return "reduce";
    case CallKind::all_to_all: return "all_to_all";
    case CallKind::point_to_point: return "send/recv";
  }
  return "?";
}

struct Arrival {
  uint32_t imm;
  uint32_t length;
  bool placed = false;  // shared memory: the sender wrote it into our output (single copy), not the slot
};

// One peer's channel: qps_per_peer RC QPs (NCCL's QPs per connection). A
// large message is striped over them, part j over QP j into its share of
// the landing slot, each part a WRITE_WITH_IMM with the message's immediate;
// small messages and control messages (credits, abort, bye) use QP 0. Each
// QP keeps its own order and messages are consumed in order, so the next
// part on QP j belongs to the next message that uses QP j. The immediate
// says how many parts the sender made (data_imm), so a receiver expecting
// another split fails on part 0 instead of waiting or mis-assembling.
struct Peer {
  int rank = -1;
  std::vector<std::shared_ptr<QueuePair>> qps;
  // The peer's segment when the pair talks through shared memory (both on
  // this host, both allow it, both could map the other's segment); null:
  // the QPs. Owned by Comm::peer_segments_.
  detail::SharedSegment* shm = nullptr;
  uint64_t shm_seen = 0;  // the peer's messages in our segment already queued in arrivals[0]
  // Single copy on shared memory (direct gather with process_vm_writev):
  // we may write into the peer's memory (our probe of its segment passed),
  // and it may write into ours (it set ring_flag_direct in our segment).
  // Both also need `direct` (both ranks allow direct gather).
  bool shm_direct_out = false, shm_direct_in = false;
  // The kernel refused a write into the peer after bootstrap allowed it:
  // our direct-gather messages to it go through the slots from then on
  // (the receiver copies them out; the adverts and the ring's plan stay).
  bool shm_direct_refused = false;
  uint8_t* landing = nullptr;  // our slots for this peer's messages
  uint64_t remote_landing = 0;  // the peer's slots for ours
  uint32_t remote_rkey = 0;
  uint64_t data_posted = 0;      // messages written to the peer
  uint64_t credits = 0;          // slots the peer has freed
  uint64_t sends_posted = 0;     // every send (data and credits), numbered in posting order
  uint64_t sends_completed = 0;  // every send numbered up to this one has completed, all its parts
  uint64_t last_data_send = 0;   // sends_posted value of the latest data message
  std::vector<std::deque<uint64_t>> in_flight;  // per QP: the send numbers of its parts not yet completed
  std::deque<uint32_t> parts_left;              // parts still to complete of sends sends_completed+1, +2, ...
  uint64_t data_consumed = 0;    // the peer's messages we have consumed
  uint32_t credits_owed = 0;     // of those, slots not yet credited back (coalesced credits)
  // Direct gather: the peer's advert inbox, the adverts sent to it, and
  // (from the next rank) those received and not yet used.
  uint64_t remote_inbox = 0;
  uint32_t remote_inbox_rkey = 0;
  uint64_t adverts_sent = 0, adverts_received = 0;
  struct Advert {
    uint64_t work;
    uint32_t rkey;
    uint16_t tag;
    uint64_t bytes;  // the output's length (shared memory; on the network the rkey bounds it)
  };
  std::deque<Advert> adverts;
  std::vector<std::deque<Arrival>> arrivals;  // per QP: parts of the peer's messages not yet consumed
  uint32_t receiving_parts = 0;  // parts of the message receive() handed out, dropped by release()
  bool said_bye = false;
  bool direct = false;  // both ranks allow direct gather (CommunicatorOptions::direct_gather)
  uint32_t call_sent = 0, call_received = 0;  // message indices within the current call
  // Point-to-point transfers started and not yet done, in the order they
  // were started (the order they match in); the counts name them.
  struct Transfer {
    uint64_t id = 0;
    uint8_t* buffer = nullptr;
    size_t bytes = 0;
    uint16_t tag = 0;     // the messages' call tag: from the pair's sequence number, size and user tag
    size_t chunks = 1;    // messages (a zero-byte transfer is one empty message)
    size_t moved = 0;     // messages posted (send) or consumed (receive)
    uint64_t last_sequence = 0;  // send: number of its last message, done once that completed
    std::shared_ptr<MemoryRegion> mr;  // send over the network: the caller's buffer, registered (shared: Peer is copyable)
  };
  std::deque<Transfer> outgoing_transfers, incoming_transfers;
  uint64_t transfers_sent = 0, transfers_received = 0;
  bool has_arrival() const { return !arrivals.empty() && !arrivals[0].empty(); }
};

// A data message's immediate: [0][15-bit call tag][4-bit parts - 1][12-bit
// message index within the call]. Control immediates have the top bit set.
uint32_t data_imm(uint16_t tag, uint32_t parts, uint32_t index) { return uint32_t(tag) << 16 | (parts - 1) << 12 | (index & 0xfff); }

// Completions name the peer and the QP: rank in the low word, QP index above.
uint64_t channel_id(int rank, size_t qp) { return uint64_t(uint32_t(rank)) | uint64_t(qp) << 32; }

// Which machine this rank runs on, for counting the ranks that share its
// CPUs: the kernel's boot id (the same in every container and network
// namespace of one kernel), else the host name; hashed with the job's
// rendezvous address or the store's random salt (FNV-1a, 64 bits), so that
// the table, which any connection to rank 0 may see, does not hand out the
// machine's boot id.
std::string host_identity(const std::string& salt) {
  std::string id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  if (!std::getline(in, id) || id.empty()) {
    char name[65] = {};
    ::gethostname(name, sizeof name - 1);
    id = name;
  }
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : id + "|" + salt) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", (unsigned long long)h);
  return text;
}

// The CPUs this thread may run on (its affinity mask, which a launcher or
// container may have narrowed), as hex digits, lowest CPUs last: the bound
// (mpirun binds a rank to a core, srun to its cpus) that decides whether the
// ranks of one host have a CPU each.
std::string affinity_mask() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  }
  int top = CPU_SETSIZE - 1;
  while (top > 0 && !CPU_ISSET(top, &set)) --top;
  std::string hex;
  for (int nibble = top / 4; nibble >= 0; --nibble) {
    int v = 0;
    for (int b = 0; b < 4; ++b)
      if (nibble * 4 + b < CPU_SETSIZE && CPU_ISSET(nibble * 4 + b, &set)) v |= 1 << b;
    hex.push_back("0123456789abcdef"[v]);
  }
  return hex;
}

// The CPUs in the union of hex masks (as affinity_mask writes them).
int cpus_in_union(const std::vector<std::string>& masks) {
  std::vector<bool> cpu;
  for (const std::string& m : masks)
    for (size_t i = 0; i < m.size(); ++i) {
      const char c = m[m.size() - 1 - i];
      const int v = c >= 'a' ? c - 'a' + 10 : c - '0';
      for (int b = 0; b < 4; ++b)
        if (v >> b & 1) {
          if (cpu.size() <= i * 4 + size_t(b)) cpu.resize(i * 4 + size_t(b) + 1, false);
          cpu[i * 4 + size_t(b)] = true;
        }
    }
  return std::max<int>(1, int(std::count(cpu.begin(), cpu.end(), true)));
}

// Rendezvous messages: newline-delimited JSON objects (control_channel.hpp).
json hello_json(int rank, int world, const CommunicatorOptions& o, const std::string& salt, const std::vector<Peer>& peers) {
  json endpoints = json::array(), landing = json::array();
  for (const Peer& p : peers) {
    if (p.rank < 0) {
      endpoints.push_back(nullptr);
      landing.push_back(nullptr);
      continue;
    }
    json qps = json::array();
    for (const auto& qp : p.qps) qps.push_back(control::endpoint_json(qp->local_endpoint()));
    endpoints.push_back(qps);
    landing.push_back(json{{"addr", reinterpret_cast<uint64_t>(p.landing)}});
  }
  return json{{"type", "hello"},          {"version", 4},           {"rank", rank},
              {"host", host_identity(salt)}, {"cpus", affinity_mask()},
              {"world_size", world},      {"mode", to_string(o.context.mode)},
              {"slots", o.slots},         {"chunk_bytes", o.chunk_bytes},
              {"allreduce_algorithm", int(o.allreduce_algorithm)}, {"small_message_bytes", o.small_message_bytes},
              {"qps_per_peer", o.qps_per_peer},  {"direct_gather", o.direct_gather},
              {"endpoints", endpoints},   {"landing", landing}};
}

Result<asio::ip::address> resolve(const std::string& host) {
  asio::error_code ec;
  auto ip = asio::ip::make_address(host, ec);
  if (!ec) return ip;
  asio::io_context io;
  tcp::resolver resolver(io);
  auto results = resolver.resolve(tcp::v4(), host, "", ec);
  if (ec || results.empty()) return Status(Errc::invalid_argument, "cannot resolve master address '" + host + "': " + ec.message());
  return results.begin()->endpoint().address();
}

// The local IPv4 address the kernel would use to reach `to` (no packet is sent).
Result<std::string> local_address_towards(const asio::ip::address& to, uint16_t port) {
  asio::io_context io;
  asio::ip::udp::socket s(io);
  asio::error_code ec;
  s.open(asio::ip::udp::v4(), ec);
  if (!ec) s.connect(asio::ip::udp::endpoint(to, port), ec);
  if (ec) return Status(Errc::io_error, "no route to master " + to.to_string() + ": " + ec.message());
  return s.local_endpoint().address().to_string();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

uint16_t fnv16(std::initializer_list<uint64_t> values) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t v : values)
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return uint16_t((h ^ (h >> 16) ^ (h >> 32)) & 0x7fff);
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t, AlignedFree>;

AlignedBuffer allocate(size_t bytes) {
  const size_t rounded = std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096);
  return AlignedBuffer(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
}

class Comm final : public Communicator {
 public:
  ~Comm() override { say_goodbye(); }

  Status init(const CommunicatorOptions& o, Store* store);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status allreduce(const void* send, void* recv, size_t count, DataType, ReduceOp) override;
  Status reduce_scatter(const void* send, void* recv, size_t recv_count, DataType, ReduceOp) override;
  Status allgather(const void* send, void* recv, size_t send_count, DataType) override;
  Status broadcast(void* buffer, size_t count, DataType, int root) override;
  Status barrier() override;
  Status reduce(const void* send, void* recv, size_t count, DataType, ReduceOp, int root) override;
  Status all_to_all(const void* send, const size_t* send_counts, const size_t* send_offsets, void* recv, const size_t* recv_counts,
                    const size_t* recv_offsets, DataType) override;
  Result<uint64_t> start_send(int peer, const void* buffer, size_t bytes, uint32_t tag) override;
  Result<uint64_t> start_recv(int peer, void* buffer, size_t bytes, uint32_t tag) override;
  Result<bool> test(uint64_t request) override;
  Status wait(uint64_t request) override;
  CommunicatorCounters counters() const override {
    CommunicatorCounters c = counters_;
    if (context_) {
      c.transport = context_->counters();
      c.placement = context_->options().progress;
      c.wait = context_->wait_policy();
    }
    return c;
  }

 private:
  // ---- bootstrap ----
  Status bootstrap(Store* store);
  Status store_rendezvous(Store& store, const json& own, std::vector<json>& table, Clock::time_point deadline);
  Status serve_rendezvous(const json& own, std::vector<json>& table);
  Status join_rendezvous(const json& own, std::vector<json>& table, Clock::time_point deadline);
  Status connect_peers(const std::vector<json>& table);
  // Maps the segments of the ranks on this host that published one (into
  // peer_segments_; shm_opened_ lists them), and, once rank 0 has said which
  // pairs both sides mapped, switches those pairs to shared memory.
  void open_peer_segments(const std::vector<json>& table);
  Status use_shared_memory(const std::vector<int>& pairs);
  // Counts the ranks on this host (the table's "host") against the CPUs
  // this process may use, and waits adaptively when they are more
  // (CommunicatorOptions::adapt_wait).
  void adapt_wait(const json& own, const std::vector<json>& table);

  // ---- channel primitives ----
  Peer& peer(int r) { return peers_[size_t((r % size_ + size_) % size_)]; }
  Status begin_call(CallKind, size_t count, DataType, ReduceOp, int root);
  Status end_call(Status);
  // Waits (bounded) for anything: completions, shared-memory arrivals,
  // credits or flags. Returns after the first event or a short wait; the
  // callers loop on their condition.
  Status pump(const Peer* waiting_for, const char* what);
  Status pump_network(const Peer* waiting_for, const char* what);
  Status take_completions(const WorkCompletion* wcs, int n);
  Result<bool> poll_shared();  // true when something changed
  Status no_progress(const Peer* waiting_for, const char* what);
  bool can_post(const Peer& p) const {
    return p.data_posted - p.credits < options_.slots && p.sends_posted - p.sends_completed + 1 < max_send_wr_;
  }
  // How a message of `bytes` is striped: the number of parts (QPs 0..parts-1)
  // and the bytes of each but the last (a multiple of 4 KiB). Both ends
  // compute it from the size alone.
  uint32_t stripe(const Peer& p, size_t bytes, size_t* part) const {
    const size_t n = options_.qps_per_peer;
    if (n <= 1 || bytes < stripe_min_bytes || p.shm) {
      *part = bytes;
      return 1;
    }
    *part = ((bytes + n - 1) / n + 4095) / 4096 * 4096;
    return uint32_t((bytes + *part - 1) / *part);
  }
  static constexpr size_t stripe_min_bytes = 32 * 1024;  // smaller messages go whole over QP 0
  uint64_t number_send(Peer& p, uint32_t parts);          // registers a send of `parts` parts on QPs 0..parts-1
  Status complete_part(Peer& p, size_t qp);
  // A message of the current call (the next index to or from the peer).
  // `remote`/`rkey` (not 0): written there (the peer's output, direct
  // gather) instead of into the peer's next landing slot, which it still
  // takes as a credit.
  Status send(Peer& p, const uint8_t* source, uint32_t lkey, size_t bytes, uint64_t* sequence, uint64_t remote = 0, uint32_t rkey = 0);
  // Waits for the next message and checks it; `placed`: a gather message a
  // peer on shared memory must have written into our output (single copy).
  // *was_placed (where given): the sender did place it; it may not have
  // (shared memory after a refused write: the slot holds it instead).
  Result<const uint8_t*> receive(Peer& p, size_t bytes, bool placed = false, bool* was_placed = nullptr);
  Status release(Peer& p);                                // frees its slot: credit to the sender
  // The same with the message's name (call tag, index) given: what
  // point-to-point transfers use, outside any call.
  Status transmit(Peer& p, const uint8_t* source, uint32_t lkey, size_t bytes, uint64_t* sequence, uint16_t tag, uint32_t index,
                  uint64_t remote = 0, uint32_t rkey = 0);
  Result<const uint8_t*> arrive(Peer& p, size_t bytes, uint16_t tag, uint32_t index, bool point_to_point, bool placed = false,
                                bool* was_placed = nullptr);
  Status release_slot(Peer& p);
  // Point to point: moves what can move without waiting; *moved says whether
  // anything did. drain_transfers() waits for every outstanding one.
  Status progress_transfers(bool* moved);
  Status poll_once(bool* moved);
  Status drain_transfers();
  Status wait_sent(Peer& p, uint64_t sequence, const char* what);
  Status post_control(Peer& p, uint32_t imm);
  // Returns the credits owed to `p` (waiting for send-queue room), or to
  // every peer where there is room now without waiting.
  Status flush_credits(Peer& p);
  Status flush_owed_credits();
  // Tells `p` (the previous rank) where this call's output is; takes the
  // next rank's advert for this call, waiting for it.
  Status post_advert(Peer& p, uint64_t work, uint32_t rkey, uint64_t bytes);
  Result<Peer::Advert> take_advert(Peer& next);
  Status fail(Status s);
  void await_writer_stopped(const Peer& writer);
  void say_goodbye();

  // ---- algorithms ----
  struct RingPlan {
    const uint8_t* contribution = nullptr;  // this rank's input at element offsets (reduce steps)
    uint8_t* work = nullptr;                // partial results and gathered segments
    uint32_t work_lkey = 0;
    bool work_remote = false;               // registered for remote writes: the previous rank gathers into it
    uint32_t work_rkey = 0;                 // its rkey then
    uint8_t* own_result = nullptr;          // where segment `rank` ends after the reduce steps (null: work)
    const uint8_t* first_source = nullptr;  // the first step's segment
    uint32_t first_lkey = 0;
    std::vector<size_t> offset, count;      // per segment, in elements
    int first_step = 0, last_step = 0;      // 0..N-2 reduce, N-1..2N-3 gather
  };
  Status ring(const RingPlan&);
  // Direct gather: the previous rank writes our gather chunks into our output.
  bool gathers_into_us() {
    const Peer& prev = peer(rank_ - 1);
    return size_ > 1 && prev.direct && (!prev.shm || prev.shm_direct_in);
  }
  bool gathers_into(const Peer& next) const { return next.direct && (!next.shm || next.shm_direct_out); }
  Status recursive_doubling(uint8_t* work, uint32_t lkey, size_t count);
  Status fold_in_excess(uint8_t* work, uint32_t lkey, size_t bytes, int p, bool* excess);
  Status halving_doubling(const uint8_t* contribution, uint32_t contribution_lkey, uint8_t* work, uint32_t lkey, size_t count);
  // Sends `out_bytes` from `out` to `to` while receiving `in_bytes` from
  // `from` (the same peer or not), chunk by chunk: each chunk received lands
  // at `destination`, reduced with `operand` (same offsets) where that is
  // given, copied where not. *last_sent: the last send's sequence (0: none),
  // for wait_sent before `out` is overwritten.
  Status exchange(Peer& to, const uint8_t* out, uint32_t out_lkey, size_t out_bytes, Peer& from, uint8_t* destination, const uint8_t* operand,
                  size_t in_bytes, uint64_t* last_sent = nullptr);
  Status exchange_reduce(Peer& partner, uint8_t* work, uint32_t lkey, size_t count);
  Status send_all(Peer& p, const uint8_t* source, uint32_t lkey, size_t bytes);
  Status receive_all(Peer& p, uint8_t* destination, size_t bytes, bool reduce);
  Status chain_broadcast(uint8_t* buffer, uint32_t lkey, size_t bytes, int root);

  // A caller's buffer registered for one call, so the transport may read
  // it; nothing when every peer is on shared memory (no transport reads it).
  struct CallRegistration {
    std::unique_ptr<MemoryRegion> mr;
    uint32_t lkey() const { return mr ? mr->lkey() : 0; }
    uint32_t rkey() const { return mr ? mr->rkey() : 0; }
  };
  // `remote_write`: the peers may write into it too (direct gather).
  Result<CallRegistration> register_range(const void* address, size_t bytes, bool remote_write = false);
  Result<uint8_t*> scratch(size_t bytes, uint32_t* lkey);

  CommunicatorOptions options_;
  std::string identity_salt_;  // host_identity()'s salt: the rendezvous address, or the store's random salt
  uint64_t next_request_ = 1;  // point-to-point request ids
  size_t transfers_outstanding_ = 0;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<Context> context_;
  std::shared_ptr<ProtectionDomain> pd_;
  std::shared_ptr<CompletionQueue> cq_;
  // Shared memory: this rank's segment (holding its landing slots), the
  // peers' segments it mapped (by rank), and how many pairs use which path.
  // Declared before landing_mr_: the region is deregistered before the
  // memory under it goes.
  std::unique_ptr<detail::SharedSegment> own_segment_;
  AlignedBuffer landing_;  // the landing slots when they are not in own_segment_
  uint8_t* landing_base_ = nullptr;
  std::unique_ptr<MemoryRegion> landing_mr_;
  std::vector<std::unique_ptr<detail::SharedSegment>> peer_segments_;
  std::vector<int> shm_opened_;
  int shm_peers_ = 0, network_peers_ = 0;
  // The peer on shared memory that may still write into the current call's
  // output (single copy), from our advert to its last gather message.
  const Peer* advert_open_ = nullptr;
  uint64_t advert_open_until_ = 0;  // its messages published (`posted`) once it has written all of this call's
  uint64_t idle_polls_ = 0;  // pump() calls without progress in a row
  Clock::time_point idle_since_{}, liveness_checked_{};
  AlignedBuffer scratch_;
  // Where this rank's output is, for the previous rank's direct gather
  // writes: 16 bytes sent at the start of a call (address, rkey), read by
  // the transport until acknowledged, which end_call waits for.
  AlignedBuffer advert_;
  std::unique_ptr<MemoryRegion> advert_mr_;
  size_t scratch_bytes_ = 0;
  std::unique_ptr<MemoryRegion> scratch_mr_;
  std::vector<Peer> peers_;  // indexed by rank; peers_[rank_] unused
  uint32_t max_send_wr_ = 0, recv_depth_ = 0;
  uint32_t credit_batch_ = 1;          // slots freed per credit message: slots / 2
  uint64_t credits_owed_total_ = 0;    // sum of the peers' credits_owed
  Status broken_;
  bool connected_ = false;  // bootstrap finished: peers expect a goodbye
  uint64_t call_sequence_ = 0;
  uint16_t call_tag_ = 0;
  const char* call_name_ = "";
  DataType type_ = DataType::float32;
  ReduceOp op_ = ReduceOp::sum;
  size_t element_ = 4;
  Clock::time_point last_progress_{};
  CommunicatorCounters counters_;
};

Status Comm::init(const CommunicatorOptions& o, Store* store) {
  options_ = o;
  rank_ = o.rank;
  size_ = o.world_size;
  if (size_ < 1 || size_ > 4096 || rank_ < 0 || rank_ >= size_)
    return Status(Errc::invalid_argument, "communicator: rank " + std::to_string(rank_) + " of world size " + std::to_string(size_) + " is out of range");
  if (o.chunk_bytes < 4096 || o.chunk_bytes % 4096 || o.chunk_bytes > (64u << 20))
    return Status(Errc::invalid_argument, "communicator: chunk_bytes must be a multiple of 4096 in [4 KiB, 64 MiB]");
  if (o.slots < 1 || o.slots > 256) return Status(Errc::invalid_argument, "communicator: slots must be in [1, 256]");
  if (o.qps_per_peer < 1 || o.qps_per_peer > 16) return Status(Errc::invalid_argument, "communicator: qps_per_peer must be in [1, 16]");
  if (o.timeout.count() <= 0) return Status(Errc::invalid_argument, "communicator: timeout must be positive");
  identity_salt_ = o.master_address + ":" + std::to_string(o.master_port);
  return bootstrap(store);
}

Status Comm::bootstrap(Store* store) {
  const auto deadline = Clock::now() + options_.timeout;
  auto master = resolve(options_.master_address);
  if (!master) return master.status();
  std::string local = options_.local_address;
  if (local.empty()) {
    auto l = local_address_towards(*master, options_.master_port);
    if (!l) return l.status();
    local = *l;
  }
  ContextOptions co = options_.context;
  co.bind_address = local;
  co.udp_port = 0;
  auto context = Context::open(co);
  if (!context) return context.status();
  context_ = *context;
  auto pd = context_->allocate_pd();
  if (!pd) return pd.status();
  pd_ = *pd;

  max_send_wr_ = 4 * options_.slots + 16;
  // At most credit_batch_ - 1 freed slots wait for the next credit, so the
  // sender's window never shrinks below slots - credit_batch_ + 1.
  credit_batch_ = std::max(1u, options_.slots / 2);
  recv_depth_ = 2 * options_.slots + 4;
  const uint32_t peers = uint32_t(size_ - 1);
  auto cq = context_->create_cq(std::max<uint32_t>(16, peers * options_.qps_per_peer * (max_send_wr_ + recv_depth_)));
  if (!cq) return cq.status();
  cq_ = *cq;

  const size_t per_peer = size_t(options_.slots) * options_.chunk_bytes;
  peers_.resize(size_t(size_));
  if (peers) {
    // With shared memory allowed the landing slots live in this rank's
    // segment: ranks on this host write into them directly, the others
    // through RDMA WRITE as always.
    if (options_.shared_memory) {
      detail::SegmentShape shape{uint32_t(size_), options_.slots, options_.chunk_bytes};
      auto segment = detail::SharedSegment::create(shape, "r" + std::to_string(rank_));
      if (segment) {
        own_segment_ = std::move(*segment);
        landing_base_ = own_segment_->landing();
      } else {
        log().warn("coll: rank {}: no shared-memory channel, ranks on this host will talk over the network: {}", rank_, segment.status().to_string());
      }
    }
    if (!landing_base_) {
      landing_ = allocate(per_peer * peers);
      if (!landing_) return Status(Errc::resource_exhausted, "communicator: cannot allocate landing buffers");
      landing_base_ = landing_.get();
    }
    auto mr = pd_->register_memory(landing_base_, per_peer * peers, access_local_write | access_remote_write);
    if (!mr) return mr.status();
    landing_mr_ = std::move(*mr);
  }
  if (peers && options_.direct_gather) {
    advert_ = allocate(4096);
    if (!advert_) return Status(Errc::resource_exhausted, "communicator: cannot allocate the direct-gather buffer");
    auto advert_mr = pd_->register_memory(advert_.get(), 4096, access_local_write | access_remote_write);
    if (!advert_mr) return advert_mr.status();
    advert_mr_ = std::move(*advert_mr);
  }
  peer_segments_.resize(size_t(size_));
  network_peers_ = int(peers);
  size_t slot_index = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Peer& p = peers_[size_t(r)];
    p.rank = r;
    p.landing = landing_base_ + per_peer * slot_index++;
    QpInitAttributes attributes;
    attributes.send_cq = cq_;
    attributes.recv_cq = cq_;
    attributes.cap.max_send_wr = max_send_wr_;
    attributes.cap.max_recv_wr = recv_depth_;
    // Collectives carry gradient traffic unless the job said otherwise
    // (docs/scheduler.md): the context's hints with that kind.
    attributes.hints = context_->options().hints;
    if (attributes.hints->kind == TrafficKind::unspecified && attributes.hints->priority < 0)
      attributes.hints->kind = TrafficKind::gradient_allreduce;
    p.in_flight.resize(options_.qps_per_peer);
    p.arrivals.resize(options_.qps_per_peer);
    for (size_t j = 0; j < options_.qps_per_peer; ++j) {
      auto qp = pd_->create_qp(attributes);
      if (!qp) return qp.status();
      p.qps.push_back(*qp);
      QpModify init;
      init.state = QpState::init;
      init.access = access_local_write | access_remote_write;
      if (Status s = (*qp)->modify(init); !s.ok()) return s;
      for (uint32_t i = 0; i < recv_depth_; ++i)
        if (Status s = (*qp)->post_recv(RecvWr{channel_id(r, j), {}}); !s.ok()) return s;
    }
  }
  if (size_ == 1) {
    counters_.cpus = cpus_in_union({affinity_mask()});
    return {};
  }

  if (store) {
    // The store is shared by the job's ranks only; a salt from rank 0 keeps
    // host identities different from one job to the next.
    const std::string key = "stellar/coll/salt";
    if (rank_ == 0) {
      char salt[17];
      uint64_t v = 0;
      if (::getrandom(&v, sizeof v, 0) != ssize_t(sizeof v)) v = uint64_t(Clock::now().time_since_epoch().count()) ^ uint64_t(::getpid()) << 40;
      std::snprintf(salt, sizeof salt, "%016llx", (unsigned long long)v);
      if (Status s = store->set(key, salt); !s.ok()) return Status(s.code(), "rendezvous through the store: " + s.message());
    }
    auto salt = store->get(key, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    if (!salt) return Status(salt.status().code(), "rendezvous through the store: no salt from rank 0: " + salt.status().message());
    identity_salt_ = salt->substr(0, 64);
  }
  json own = hello_json(rank_, size_, options_, identity_salt_, peers_);
  own["landing_rkey"] = landing_mr_->rkey();
  if (advert_mr_) own["advert_inbox"] = json{{"addr", reinterpret_cast<uint64_t>(advert_.get() + advert_inbox_offset)}, {"rkey", advert_mr_->rkey()}};
  if (own_segment_) {
    char token[17];
    std::snprintf(token, sizeof token, "%016llx", (unsigned long long)own_segment_->token());
    own["shm"] = json{{"name", own_segment_->name()}, {"token", token}};
  } else {
    own["shm"] = nullptr;
  }
  std::vector<json> table;
  Status s = store ? store_rendezvous(*store, own, table, deadline) : rank_ == 0 ? serve_rendezvous(own, table) : join_rendezvous(own, table, deadline);
  if (s.ok()) adapt_wait(own, table);
  // Every peer that will map this rank's segment has done so (before it
  // said ready): the name can go, so nothing is left in /dev/shm however
  // the job ends from here on.
  if (own_segment_) own_segment_->unlink();
  if (!s.ok()) return s;
  connected_ = true;
  log().info("coll: rank {}/{} connected to all peers ({} mode, {} slots of {} KiB per peer; {} through shared memory)", rank_, size_,
             to_string(options_.context.mode), options_.slots, options_.chunk_bytes / 1024, shm_peers_);
  return {};
}

// The rendezvous through a store the job already has (torch.distributed's):
// the same messages as rank 0's server, under keys instead of lines. Each
// rank sets its hello, reads every other one (each checked as rank 0's
// server checks them), connects, sets its ready (or failed, with the
// reason), and reads every ready: once it has them all, every rank's QPs
// can receive, which is what rank 0's go says in the TCP rendezvous, and
// each rank works out the shared-memory pairs itself (both sides mapped).
Status Comm::store_rendezvous(Store& store, const json& own, std::vector<json>& table, Clock::time_point deadline) {
  const std::string prefix = "stellar/coll/";
  auto left = [&] { return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now())); };
  auto read = [&](const std::string& what, int r, size_t max_bytes) -> Result<json> {
    auto value = store.get(prefix + what + "/" + std::to_string(r), left());
    if (!value)
      return Status(value.status().code(), "rendezvous through the store: no " + what + " from rank " + std::to_string(r) + " within " +
                                               std::to_string(options_.timeout.count()) + " ms: " + value.status().message());
    if (value->size() > max_bytes) return Status(Errc::protocol_error, "rendezvous through the store: rank " + std::to_string(r) + "'s " + what + " is too long");
    json j = json::parse(*value, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return Status(Errc::protocol_error, "rendezvous through the store: rank " + std::to_string(r) + "'s " + what + " is not a JSON object");
    return j;
  };
  if (Status s = store.set(prefix + "hello/" + std::to_string(rank_), own.dump()); !s.ok())
    return Status(s.code(), "rendezvous through the store: " + s.message());
  table.assign(size_t(size_), json());
  table[size_t(rank_)] = own;
  const size_t hello_cap = max_hello_bytes(size_, options_.qps_per_peer);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    auto hello = read("hello", r, hello_cap);
    if (!hello) return hello.status();
    auto from = check_hello(*hello, size_, own);
    if (!from) return from.status();
    if (*from != r) return Status(Errc::protocol_error, "rendezvous through the store: the hello under rank " + std::to_string(r) + "'s key names rank " + std::to_string(*from));
    table[size_t(r)] = std::move(*hello);
  }
  Status connected = connect_peers(table);
  if (connected.ok()) open_peer_segments(table);
  json ready = connected.ok() ? json{{"type", "ready"}, {"shm", shm_opened_}} : json{{"type", "failed"}, {"reason", connected.to_string()}};
  if (Status s = store.set(prefix + "ready/" + std::to_string(rank_), ready.dump()); !s.ok())
    return Status(s.code(), "rendezvous through the store: " + s.message());
  if (!connected.ok()) return connected;
  std::vector<int> both;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    auto theirs = read("ready", r, 64 + 8 * size_t(size_));
    if (!theirs) return theirs.status();
    if ((*theirs)["type"] != "ready") return Status(Errc::connection_refused, "rank " + std::to_string(r) + " failed to connect: " + control::read_reason(*theirs));
    auto list = read_shared_memory_pairs(*theirs, size_, r);
    if (!list) return Status(Errc::protocol_error, "rendezvous through the store: rank " + std::to_string(r) + "'s ready: " + list.status().message());
    const bool we_mapped = std::find(shm_opened_.begin(), shm_opened_.end(), r) != shm_opened_.end();
    if (we_mapped && std::find(list->begin(), list->end(), rank_) != list->end()) both.push_back(r);
  }
  return use_shared_memory(both);
}

Status Comm::serve_rendezvous(const json& own, std::vector<json>& table) {
  const auto deadline = Clock::now() + options_.timeout;
  table.assign(size_t(size_), json());
  table[0] = own;
  std::vector<control::Arrival> joined(static_cast<size_t>(size_));
  // Hellos are read from every connection at once, each within 5 s, lines
  // capped by the world size: a stray, idle, oversized or malformed
  // connection is refused on its own and the rendezvous keeps waiting for
  // the real ranks until the job's timeout.
  control::LineServer::Options server_options;
  server_options.max_line = max_hello_bytes(size_, options_.qps_per_peer);
  server_options.share_io = true;  // one io_context for every rank's channel: rank 0 uses them from this thread only
  server_options.refusal_type = "error";
  server_options.what = "coll: rendezvous";
  control::LineServer server(server_options, [&](const json& h) -> Status {
    auto r = check_hello(h, size_, own);
    if (!r) return r.status();
    if (*r == 0 || joined[size_t(*r)].channel) return Status(Errc::invalid_argument, "rank " + std::to_string(*r) + " has already joined");
    return {};
  });
  const std::string master = resolve(options_.master_address).value().to_string();
  if (Status s = server.open(master, options_.master_port); !s.ok())
    return Status(Errc::io_error, "rank 0 cannot serve the rendezvous on " + master + ":" + std::to_string(options_.master_port) + ": " +
                                      s.message() + " (MASTER_ADDR must be an address of rank 0's host; is the port in use?)");
  auto broadcast_error = [&](const Status& s) {
    for (auto& a : joined)
      if (a.channel) (void)a.channel->write_line(json{{"type", "error"}, {"reason", s.to_string()}}, Clock::now() + std::chrono::seconds(1));
    return s;
  };
  int count = 1;
  while (count < size_) {
    auto arrival = server.next(deadline);
    if (!arrival) {
      std::string missing;
      for (int r = 1; r < size_; ++r)
        if (!joined[size_t(r)].channel) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      std::string refused;
      for (const std::string& why : server.refusals()) refused += "; " + why;
      return broadcast_error(Status(Errc::timeout, "rendezvous: only " + std::to_string(count) + " of " + std::to_string(size_) + " ranks arrived within " +
                                                       std::to_string(options_.timeout.count()) + " ms; never arrived: rank(s) " + missing +
                                                       (server.refused() ? "; refused " + std::to_string(server.refused()) + " connection(s)" + refused : "")));
    }
    const int r = int(arrival->first.at("rank").get<uint64_t>());  // checked by the server
    if (joined[size_t(r)].channel) {  // two hellos for one rank were read before either was taken
      (void)arrival->channel->write_line(json{{"type", "error"}, {"reason", "rank " + std::to_string(r) + " has already joined"}},
                                         Clock::now() + std::chrono::seconds(1));
      log().warn("coll: rendezvous refused {}: rank {} has already joined", arrival->peer, r);
      continue;
    }
    table[size_t(r)] = arrival->first;
    joined[size_t(r)] = std::move(*arrival);
    ++count;
  }
  json all{{"type", "table"}, {"ranks", table}};
  for (int r = 1; r < size_; ++r)
    if (Status s = joined[size_t(r)].channel->write_line(all, deadline); !s.ok()) return broadcast_error(s);
  if (Status s = connect_peers(table); !s.ok()) return broadcast_error(s);
  open_peer_segments(table);
  // Everyone's QPs are ready to receive before anyone sends. Each ready
  // also lists the segments that rank mapped; a pair uses shared memory
  // only when both sides mapped the other's.
  std::vector<std::vector<int>> mapped(static_cast<size_t>(size_));
  mapped[0] = shm_opened_;
  for (int r = 1; r < size_; ++r) {
    auto ready = joined[size_t(r)].channel->read_line(deadline);
    if (!ready) return broadcast_error(Status(ready.status().code(), "rendezvous: rank " + std::to_string(r) + " did not confirm: " + ready.status().message()));
    if ((*ready)["type"] != "ready")
      return broadcast_error(Status(Errc::connection_refused, "rank " + std::to_string(r) + " failed to connect: " + control::read_reason(*ready)));
    auto list = read_shared_memory_pairs(*ready, size_, r);
    if (!list) return broadcast_error(Status(Errc::protocol_error, "rendezvous: rank " + std::to_string(r) + "'s ready: " + list.status().message()));
    mapped[size_t(r)] = std::move(*list);
  }
  auto mutual = [&](int r) {
    std::vector<int> both;
    for (int p : mapped[size_t(r)])
      if (std::find(mapped[size_t(p)].begin(), mapped[size_t(p)].end(), r) != mapped[size_t(p)].end()) both.push_back(p);
    return both;
  };
  for (int r = 1; r < size_; ++r)
    if (Status s = joined[size_t(r)].channel->write_line(json{{"type", "go"}, {"shm", mutual(r)}}, deadline); !s.ok()) return s;
  return use_shared_memory(mutual(0));
}

Status Comm::join_rendezvous(const json& own, std::vector<json>& table, Clock::time_point deadline) {
  asio::io_context io;
  // The table holds every rank's hello.
  Channel channel(io, max_hello_bytes(size_, options_.qps_per_peer) * size_t(size_) + 4096);
  const std::string master = resolve(options_.master_address).value().to_string();
  if (Status s = control::connect_with_retry(channel, master, options_.master_port, deadline); !s.ok())
    return Status(s.code(), "rank " + std::to_string(rank_) + " cannot reach the rendezvous at rank 0 (MASTER_ADDR/MASTER_PORT): " + s.message());
  if (Status s = channel.write_line(own, deadline); !s.ok()) return s;
  auto reply = channel.read_line(deadline);
  if (!reply) return Status(reply.status().code(), "rendezvous: no table from rank 0: " + reply.status().message());
  if ((*reply)["type"] == "error") return Status(Errc::connection_refused, "rendezvous failed at rank 0: " + control::read_reason(*reply));
  auto checked = check_table(*reply, size_, own);
  if (!checked) return checked.status();
  table = std::move(*checked);
  Status connected = connect_peers(table);
  if (connected.ok()) open_peer_segments(table);
  json ready = connected.ok() ? json{{"type", "ready"}, {"shm", shm_opened_}} : json{{"type", "failed"}, {"reason", connected.to_string()}};
  if (Status s = channel.write_line(ready, deadline); !s.ok()) return s;
  if (!connected.ok()) return connected;
  auto go = channel.read_line(deadline);
  if (!go) return Status(go.status().code(), "rendezvous: rank 0 did not start the job: " + go.status().message());
  if ((*go)["type"] != "go") return Status(Errc::connection_refused, "rendezvous failed at rank 0: " + control::read_reason(*go));
  auto pairs = read_shared_memory_pairs(*go, size_, rank_);
  if (!pairs) return Status(Errc::protocol_error, "rendezvous: rank 0's go: " + pairs.status().message());
  return use_shared_memory(*pairs);
}

void Comm::open_peer_segments(const std::vector<json>& table) {
  if (!own_segment_) return;  // this rank keeps to the network
  const detail::SegmentShape shape{uint32_t(size_), options_.slots, options_.chunk_bytes};
  const json& host = table[size_t(rank_)].at("host");
  for (const Peer& p : peers_) {
    if (p.rank < 0) continue;
    const json& theirs = table[size_t(p.rank)];  // checked by check_hello, "shm" included
    const auto shm = theirs.find("shm");
    if (theirs.at("host") != host || shm == theirs.end() || shm->is_null()) continue;
    const uint64_t token = std::strtoull(shm->at("token").get<std::string>().c_str(), nullptr, 16);
    // The single-copy probe only where direct gather is allowed: a rank that
    // turned it off makes no process_vm_* call at all.
    auto segment = detail::SharedSegment::open(shm->at("name").get<std::string>(), token, shape, p.direct);
    if (!segment) {  // another /dev/shm (container), another user, a full tmpfs: the network it is
      log().info("coll: rank {}: rank {} is on this host but its shared memory cannot be mapped ({}); using the network", rank_, p.rank,
                 segment.status().to_string());
      continue;
    }
    // Tell the owner it may take our gather chunks where we write them,
    // before our ready (it reads the flag after every ready is in).
    if (p.direct && (*segment)->direct_writable())
      (*segment)->sender_line(rank_).flags.fetch_or(detail::ring_flag_direct, std::memory_order_seq_cst);
    peer_segments_[size_t(p.rank)] = std::move(*segment);
    shm_opened_.push_back(p.rank);
  }
}

Status Comm::use_shared_memory(const std::vector<int>& pairs) {
  for (int r : pairs) {
    if (!peer_segments_[size_t(r)])  // rank 0 named a pair this rank never mapped
      return Status(Errc::protocol_error, "rendezvous: rank 0 says rank " + std::to_string(r) + " shares memory with this rank, which did not map it");
    Peer& p = peers_[size_t(r)];
    p.shm = peer_segments_[size_t(r)].get();
    p.shm_direct_out = p.direct && p.shm->direct_writable();
    p.shm_direct_in = p.direct && (own_segment_->sender_line(r).flags.load(std::memory_order_seq_cst) & detail::ring_flag_direct);
    counters_.shared_memory_single_copy_peers += p.shm_direct_out ? 1 : 0;
  }
  for (int r = 0; r < size_; ++r)
    if (!peers_[size_t(r)].shm) peer_segments_[size_t(r)].reset();
  shm_peers_ = int(pairs.size());
  network_peers_ = size_ - 1 - shm_peers_;
  counters_.shared_memory_peers = shm_peers_;
  return {};
}

void Comm::adapt_wait(const json& own, const std::vector<json>& table) {
  // The ranks on this host and the CPUs they may use between them (the union
  // of their affinity masks: ranks bound a core each to one socket are not
  // oversubscribed, ranks all bound to one core are).
  int local = 0, lowest = -1;
  std::vector<std::string> masks;
  for (size_t r = 0; r < table.size(); ++r)
    if (table[r].at("host") == own.at("host")) {  // both checked by check_hello
      ++local;
      if (lowest < 0) lowest = int(r);
      masks.push_back(table[r].at("cpus").get<std::string>());
    }
  const int cpus = cpus_in_union(masks);
  // With an engine thread each rank keeps two threads busy.
  const int threads = context_->options().progress == ProgressMode::thread ? 2 * local : local;
  counters_.local_ranks = local;
  counters_.cpus = cpus;
  counters_.oversubscribed = threads > cpus;
  if (!counters_.oversubscribed || rank_ != lowest) {
  } else if (options_.adapt_wait && context_->wait_policy() == WaitPolicy::busy_poll) {
    log().info("communicator: {} ranks on this host, {} CPUs between them: waiting adaptively (oversubscribed)", local, cpus);
  } else if (context_->wait_policy() == WaitPolicy::busy_poll) {
    log().warn("communicator: {} ranks on this host, {} CPUs between them, and busy polling was asked for: ranks will spin on "
               "each other's cores", local, cpus);
  }
  if (options_.adapt_wait && counters_.oversubscribed && context_->wait_policy() == WaitPolicy::busy_poll)
    context_->set_wait_policy(WaitPolicy::adaptive);
}

Status Comm::connect_peers(const std::vector<json>& table) {
  for (Peer& p : peers_) {
    if (p.rank < 0) continue;
    const json& theirs = table[size_t(p.rank)];  // checked by check_hello
    const json& towards_us = theirs.at("endpoints").at(size_t(rank_));
    if (!towards_us.is_array() || towards_us.size() != p.qps.size())
      return Status(Errc::protocol_error, "rendezvous: rank " + std::to_string(p.rank) + " sent a malformed endpoint list");
    try {
      p.remote_landing = theirs.at("landing").at(size_t(rank_)).at("addr").get<uint64_t>();
      p.remote_rkey = theirs.at("landing_rkey").get<uint32_t>();
      // Absent from a rank built before direct gather (or before its advert
      // inbox): it expects slots.
      p.direct = options_.direct_gather && theirs.value("direct_gather", false) && theirs.contains("advert_inbox");
      if (p.direct) {
        p.remote_inbox = theirs.at("advert_inbox").at("addr").get<uint64_t>();
        p.remote_inbox_rkey = theirs.at("advert_inbox").at("rkey").get<uint32_t>();
      }
    } catch (const std::exception& e) {
      return Status(Errc::protocol_error, std::string("rendezvous: malformed landing buffer entry: ") + e.what());
    }
    // Between calls a rank may compute for a long time without polling, while
    // a peer already in the next call retransmits to it every rto_max: retry
    // for as long as the timeout allows, which then names the silent rank.
    // rto_min 5 ms, not 1: ranks share cores with the job's own threads, and
    // a rank descheduled for a few milliseconds must not look like loss
    // (SACK and the tail probe still repair real loss within a round trip).
    QpTiming timing;
    timing.rto_min = std::chrono::milliseconds(5);
    timing.retry_count = uint32_t(options_.timeout / timing.rto_max) + 8;
    for (size_t j = 0; j < p.qps.size(); ++j) {
      auto remote = control::endpoint_from(towards_us[j]);
      if (!remote) return remote.status();
      if (Status s = control::to_rts(*p.qps[j], *remote, timing); !s.ok()) return s;
    }
  }
  return {};
}

// ---------------------------------------------------------------- channels

Status Comm::fail(Status s) {
  if (broken_.ok()) {
    broken_ = s;
    log().warn("coll: rank {}: {}", rank_, s.to_string());
    for (Peer& p : peers_)  // best effort: tell the others to stop waiting for us
      if (p.rank >= 0 && (p.shm || (!p.qps.empty() && p.qps[0]->state() == QpState::rts))) (void)post_control(p, abort_imm);
    if (advert_open_) await_writer_stopped(*advert_open_);
  }
  return s;
}

// The previous rank on shared memory may still be writing gather chunks
// into this call's output with process_vm_writev, and the caller may free
// the output once this call returns: wait until that rank has seen our
// abort (its own abort flag arrives: it writes nothing after setting it),
// published this call's last message (it writes before it publishes), said
// goodbye, or exited, bounded by the timeout. (On the network the
// output's registration ends with the call, which refuses late writes.)
void Comm::await_writer_stopped(const Peer& writer) {
  advert_open_ = nullptr;
  const auto deadline = Clock::now() + options_.timeout;
  auto checked = Clock::now();
  for (;;) {
    const uint32_t bell = own_segment_->doorbell();
    const detail::RingSenderLine& line = own_segment_->sender_line(writer.rank);
    const uint32_t flags = line.flags.load(std::memory_order_acquire);
    if (flags & (detail::ring_flag_abort | detail::ring_flag_bye)) return;
    if (line.posted.load(std::memory_order_acquire) >= advert_open_until_) return;  // it wrote all this call's chunks
    const auto now = Clock::now();
    if (now >= deadline) {
      log().warn("coll: rank {}: rank {} did not acknowledge the abort within {} ms; it may still write into the failed call's output", rank_,
                 writer.rank, options_.timeout.count());
      return;
    }
    if (now - checked > std::chrono::milliseconds(20)) {
      checked = now;
      if (!writer.shm->owner_alive()) return;
    }
    own_segment_->sleep_on_doorbell(bell, std::chrono::microseconds(1000));
  }
}

uint64_t Comm::number_send(Peer& p, uint32_t parts) {
  ++p.sends_posted;
  for (uint32_t j = 0; j < parts; ++j) p.in_flight[j].push_back(p.sends_posted);
  p.parts_left.push_back(parts);
  return p.sends_posted;
}

// A send completion on QP `qp`: the oldest part in flight there (a QP
// completes in order). A send counts as completed when all its parts have.
Status Comm::complete_part(Peer& p, size_t qp) {
  if (p.in_flight[qp].empty()) return Status(Errc::protocol_error, "communicator: a send completion nobody posted");
  const uint64_t number = p.in_flight[qp].front();
  p.in_flight[qp].pop_front();
  --p.parts_left[size_t(number - p.sends_completed - 1)];
  while (!p.parts_left.empty() && p.parts_left.front() == 0) {
    p.parts_left.pop_front();
    ++p.sends_completed;
  }
  return {};
}

Status Comm::post_control(Peer& p, uint32_t imm) {
  if (p.shm) {  // abort and bye are flags in the peer's segment (credits are release()'s)
    p.shm->sender_line(rank_).flags.fetch_or(imm == abort_imm ? detail::ring_flag_abort : detail::ring_flag_bye, std::memory_order_release);
    p.shm->ring_doorbell();
    p.sends_completed = ++p.sends_posted;
    return {};
  }
  SendWr wr;
  wr.wr_id = channel_id(p.rank, 0);
  wr.opcode = WrOpcode::rdma_write_with_imm;
  wr.remote_addr = p.remote_landing;
  wr.rkey = p.remote_rkey;
  wr.imm_data = imm;
  if (Status s = p.qps[0]->post_send(wr); !s.ok()) return s;
  number_send(p, 1);
  return {};
}

Status Comm::no_progress(const Peer* waiting_for, const char* what) {
  return fail(Status(Errc::timeout, std::string(call_name_) + ": no progress for " + std::to_string(options_.timeout.count()) + " ms waiting for " + what +
                                        (waiting_for ? " of rank " + std::to_string(waiting_for->rank) : std::string()) + " (dead or hung?)"));
}

Status Comm::pump(const Peer* waiting_for, const char* what) {
  if (shm_peers_ == 0) return pump_network(waiting_for, what);
  // Read before looking, so that a ring after the look ends the sleep below.
  const uint32_t bell = own_segment_->doorbell();
  auto changed = poll_shared();
  if (!changed) return changed.status();
  bool progress = *changed;
  if (network_peers_ > 0) {
    WorkCompletion wcs[64];
    const int n = cq_->poll(wcs);  // also drives the transport in inline mode
    if (n > 0) {
      progress = true;
      if (Status s = take_completions(wcs, n); !s.ok()) return s;
    }
  }
  const auto now = Clock::now();
  if (progress) {
    last_progress_ = now;
    idle_polls_ = 0;
    return {};
  }
  if (idle_polls_++ == 0) idle_since_ = now;
  if (now - last_progress_ > options_.timeout) return no_progress(waiting_for, what);
  if (credits_owed_total_ && now - idle_since_ >= credit_idle_flush)
    if (Status s = flush_owed_credits(); !s.ok()) return s;
  // A rank on this host that died (kill -9) releases its segment's lock:
  // an error now, not at the timeout. One system call every 20 ms of waiting.
  if (waiting_for && waiting_for->shm && !waiting_for->said_bye && now - liveness_checked_ > std::chrono::milliseconds(20)) {
    liveness_checked_ = now;
    if (!waiting_for->shm->owner_alive())
      return fail(Status(Errc::io_error, std::string(call_name_) + ": rank " + std::to_string(waiting_for->rank) +
                                             " on this host exited without destroying its communicator (killed?) while this rank waited for " + what));
  }
  const auto idle = now - idle_since_;
  if (context_->wait_policy() == WaitPolicy::busy_poll) {
    // Busy polling never sleeps, but gives the core away now and then so a
    // peer descheduled on it can run.
    if (idle_polls_ % 4096 == 0) sched_yield();
    else cpu_relax();
    return {};
  }
  if (counters_.oversubscribed) {
    // More ranks than CPUs: the peer this rank waits for most likely waits
    // for this core. Give it away at once (as Open MPI does when
    // oversubscribed) for a while before sleeping: spinning would burn the
    // peer's time, and a futex wake-up costs a trip through the scheduler
    // on both sides.
    if (idle < std::chrono::microseconds(1000)) {
      sched_yield();
      return {};
    }
  } else if (idle < std::chrono::microseconds(50)) {
    cpu_relax();
    return {};
  }
  // Adaptive: sleep until a peer on this host rings. Waiting for a network
  // peer, sleep in the CQ instead (it drives the transport), at most 1 ms;
  // waiting for a peer on this host while network peers exist, at most
  // 100 us, since in inline mode the transport's acknowledgements and
  // retransmissions to them move only when this rank polls.
  if (waiting_for && !waiting_for->shm) {
    WorkCompletion wcs[64];
    auto n = cq_->wait(wcs, std::chrono::milliseconds(1));
    if (n) {
      last_progress_ = Clock::now();
      idle_polls_ = 0;
      return take_completions(wcs, *n);
    }
    if (n.status().code() != Errc::timeout) return fail(n.status());
    return {};
  }
  own_segment_->sleep_on_doorbell(bell, std::chrono::microseconds(network_peers_ > 0 ? 100 : 20'000));
  return {};
}

Result<bool> Comm::poll_shared() {
  bool changed = false;
  for (Peer& p : peers_) {
    if (!p.shm) continue;
    const detail::RingSenderLine& in = own_segment_->sender_line(p.rank);
    // Flags before `posted`: the peer publishes its last message before its
    // bye, so a bye seen here comes with every message before it.
    const uint32_t flags = in.flags.load(std::memory_order_acquire);
    const uint64_t posted = in.posted.load(std::memory_order_acquire);
    if (posted != p.shm_seen) {
      // The peer's words are as untrusted as a packet: a count that goes
      // back or past the credits it was given is an error, not a read of
      // slots it may still be writing.
      if (posted < p.shm_seen || posted - p.data_consumed > options_.slots)
        return fail(Status(Errc::protocol_error, "rank " + std::to_string(p.rank) + " wrote past its landing slots in shared memory"));
      for (; p.shm_seen < posted; ++p.shm_seen) {
        const uint64_t meta = own_segment_->meta(p.rank, p.shm_seen).load(std::memory_order_relaxed);  // ordered by `posted`
        const uint32_t length = uint32_t(meta);
        // Written into our memory: only by a peer we said may (and then the
        // ring placed it by our advert, and takes it where it is).
        if ((length & detail::ring_meta_direct) && !p.shm_direct_in)
          return fail(Status(Errc::protocol_error, "rank " + std::to_string(p.rank) + " says it wrote into this rank's memory, which it was not given"));
        p.arrivals[0].push_back({uint32_t(meta >> 32), length & ~detail::ring_meta_direct, (length & detail::ring_meta_direct) != 0});
      }
      changed = true;
    }
    // The next rank's adverts (where its output is), in its segment.
    if (p.shm_direct_out) {
      const detail::RingAdvertLines& lines = p.shm->advert_lines(rank_);
      const uint64_t adverts = lines.posted.load(std::memory_order_acquire);
      if (adverts != p.adverts_received) {
        if (adverts < p.adverts_received || adverts - p.adverts_received > detail::RingAdvertLines::entries || &p != &peer(rank_ + 1))
          return fail(Status(Errc::protocol_error, "rank " + std::to_string(p.rank) + " wrote direct-gather adverts it has no reason to write"));
        for (; p.adverts_received < adverts; ++p.adverts_received) {
          const size_t entry = p.adverts_received % detail::RingAdvertLines::entries;
          p.adverts.push_back({lines.address[entry].load(std::memory_order_relaxed), 0, uint16_t(lines.tag[entry].load(std::memory_order_relaxed)),
                               lines.bytes[entry].load(std::memory_order_relaxed)});
        }
        changed = true;
      }
    }
    const uint64_t consumed = p.shm->receiver_line(rank_).consumed.load(std::memory_order_acquire);
    if (consumed != p.credits) {
      if (consumed < p.credits || consumed > p.data_posted)
        return fail(Status(Errc::protocol_error, "rank " + std::to_string(p.rank) + " returned credits it was never given (shared memory)"));
      p.credits = consumed;
      changed = true;
    }
    if (flags & detail::ring_flag_abort)
      return fail(Status(Errc::io_error, std::string(call_name_) + ": rank " + std::to_string(p.rank) + " aborted the communicator (see its error)"));
    if ((flags & detail::ring_flag_bye) && !p.said_bye) {
      p.said_bye = true;
      changed = true;
    }
  }
  return changed;
}

Status Comm::pump_network(const Peer* waiting_for, const char* what) {
  WorkCompletion wcs[64];
  // Oversubscribed: poll and yield the core for up to 1 ms before the
  // context's adaptive wait, whose spin would burn the time slice of the
  // peer this rank waits for (see pump()).
  if (counters_.oversubscribed && context_->wait_policy() == WaitPolicy::adaptive) {
    const int n = cq_->poll(wcs);  // drives the transport in inline mode
    const auto now = Clock::now();
    if (n > 0) {
      last_progress_ = now;
      idle_polls_ = 0;
      return take_completions(wcs, n);
    }
    if (idle_polls_++ == 0) idle_since_ = now;
    if (credits_owed_total_ && now - idle_since_ >= credit_idle_flush)
      if (Status s = flush_owed_credits(); !s.ok()) return s;
    if (now - idle_since_ < std::chrono::microseconds(1000)) {
      if (now - last_progress_ > options_.timeout) return no_progress(waiting_for, what);
      sched_yield();
      return {};
    }
  }
  // Returns at the first completion; the timeout only paces the no-progress
  // check (and, with credits owed, their idle flush). An adaptive wait
  // spins before it sleeps, so a short timeout here would burn a spin per
  // re-entry while a rank waits on its peer.
  auto n = cq_->wait(wcs, credits_owed_total_ ? std::chrono::nanoseconds(credit_idle_flush) : std::chrono::milliseconds(20));
  if (!n) {
    if (n.status().code() != Errc::timeout) return fail(n.status());
    if (credits_owed_total_)
      if (Status s = flush_owed_credits(); !s.ok()) return s;
    if (Clock::now() - last_progress_ > options_.timeout) return no_progress(waiting_for, what);
    return {};
  }
  last_progress_ = Clock::now();
  idle_polls_ = 0;
  return take_completions(wcs, *n);
}

Status Comm::take_completions(const WorkCompletion* wcs, int n) {
  for (int i = 0; i < n; ++i) {
    const WorkCompletion& wc = wcs[i];
    const int from = int(uint32_t(wc.wr_id));
    const size_t qp = size_t(wc.wr_id >> 32);
    if (from < 0 || from >= size_ || from == rank_ || qp >= options_.qps_per_peer)
      return fail(Status(Errc::protocol_error, "completion for an unknown peer"));
    Peer& p = peers_[size_t(from)];
    if (p.shm) return fail(Status(Errc::protocol_error, "rank " + std::to_string(from) + " used the network although the pair agreed on shared memory"));
    if (wc.status != WcStatus::success)
      return fail(Status(Errc::io_error, std::string(call_name_) + ": transport to rank " + std::to_string(from) + " failed: " + to_string(wc.status) +
                                             (wc.status == WcStatus::retry_exceeded ? " (rank dead or unreachable)" : "")));
    if (wc.opcode != WcOpcode::recv_rdma_with_imm) {
      if (Status s = complete_part(p, qp); !s.ok()) return fail(s);
      continue;
    }
    if (Status s = p.qps[qp]->post_recv(RecvWr{wc.wr_id, {}}); !s.ok()) return fail(s);
    if ((wc.imm_data & ~credit_count_mask) == credit_kind) {
      const uint32_t freed = wc.imm_data & credit_count_mask;
      if (freed == 0 || p.credits + freed > p.data_posted)
        return fail(Status(Errc::protocol_error, "rank " + std::to_string(from) + " returned credits for slots it was never sent"));
      p.credits += freed;
    } else if (wc.imm_data == abort_imm) {
      return fail(Status(Errc::io_error, std::string(call_name_) + ": rank " + std::to_string(from) + " aborted the communicator (see its error)"));
    } else if (wc.imm_data == bye_imm) {
      p.said_bye = true;
    } else if (wc.imm_data == advert_imm) {
      if (&p != &peer(rank_ + 1) || !p.direct || !advert_)
        return fail(Status(Errc::protocol_error, "rank " + std::to_string(from) + " sent a direct-gather advert it has no reason to send"));
      const uint8_t* entry = advert_.get() + advert_inbox_offset + (p.adverts_received++ % advert_entries) * advert_bytes;
      Peer::Advert a{};
      std::memcpy(&a.work, entry, 8);
      std::memcpy(&a.rkey, entry + 8, 4);
      std::memcpy(&a.tag, entry + 12, 2);
      a.bytes = UINT64_MAX;  // the rkey bounds the writes
      p.adverts.push_back(a);
    } else if (wc.imm_data & control_bit) {
      return fail(Status(Errc::protocol_error, "rank " + std::to_string(from) + " sent an unknown control message"));
    } else {
      p.arrivals[qp].push_back({wc.imm_data, wc.byte_len});
    }
  }
  return {};
}

Status Comm::send(Peer& p, const uint8_t* source, uint32_t lkey, size_t bytes, uint64_t* sequence, uint64_t remote, uint32_t rkey) {
  Status s = transmit(p, source, lkey, bytes, sequence, call_tag_, p.call_sent, remote, rkey);
  if (s.ok()) ++p.call_sent;
  return s;
}

Status Comm::transmit(Peer& p, const uint8_t* source, uint32_t lkey, size_t bytes, uint64_t* sequence, uint16_t tag, uint32_t index,
                      uint64_t remote, uint32_t rkey) {
  while (!can_post(p))
    if (Status s = pump(&p, "credits"); !s.ok()) return s;
  if (p.shm) {
    // Straight into the peer's landing slot, then publish: the source may
    // be reused at once (nothing will read it again).
    if (bytes > options_.chunk_bytes) return fail(Status(Errc::invalid_argument, "communicator: a message larger than a landing slot"));
    uint64_t length = bytes;
    if (remote && !p.shm_direct_refused) {  // direct gather: one copy, by the kernel, into the peer's output; the slot carries only the name
      if (!p.shm_direct_out) return fail(Status(Errc::wrong_state, "communicator: a direct write to a peer on shared memory that does not allow it"));
      // A receiver that aborted may be about to hand its output back to its
      // caller: never write after seeing that (it waits for our own abort).
      if (own_segment_->sender_line(p.rank).flags.load(std::memory_order_acquire) & detail::ring_flag_abort)
        return fail(Status(Errc::io_error, std::string(call_name_) + ": rank " + std::to_string(p.rank) + " aborted the communicator (see its error)"));
      Status s = p.shm->write_into_owner(remote, source, bytes);
      if (s.code() == Errc::permission_denied) {
        // Nothing was written: this and later messages take the slot (two
        // copies, as without single copy), and the job goes on.
        log().warn("coll: rank {}: single copy into rank {} no longer allowed, its gathers go through the slots: {}", rank_, p.rank, s.message());
        p.shm_direct_refused = true;
        --counters_.shared_memory_single_copy_peers;
        remote = 0;
      } else if (!s.ok()) {
        return fail(Status(s.code(), std::string(call_name_) + ": rank " + std::to_string(p.rank) + ": " + s.message()));
      } else {
        length |= detail::ring_meta_direct;
      }
    }
    if (!(length & detail::ring_meta_direct)) {
      std::memcpy(p.shm->slots_of(rank_, p.rank) + (p.data_posted % options_.slots) * options_.chunk_bytes, source, bytes);
    }
    p.shm->meta(rank_, p.data_posted).store(uint64_t(data_imm(tag, 1, index)) << 32 | length, std::memory_order_relaxed);
    p.shm->sender_line(rank_).posted.store(p.data_posted + 1, std::memory_order_release);
    p.shm->ring_doorbell();
    *sequence = p.last_data_send = p.sends_completed = ++p.sends_posted;
    ++p.data_posted;
    counters_.bytes_sent += bytes;
    ++counters_.messages_sent;
    return {};
  }
  size_t part = 0;
  const uint32_t parts = stripe(p, bytes, &part);
  *sequence = p.last_data_send = number_send(p, parts);  // before any part can complete
  for (uint32_t j = 0; j < parts; ++j) {
    const size_t offset = size_t(j) * part;
    Sge sge{reinterpret_cast<uint64_t>(source + offset), uint32_t(std::min(part, bytes - offset)), lkey};
    SendWr wr;
    wr.wr_id = channel_id(p.rank, j);
    wr.opcode = WrOpcode::rdma_write_with_imm;
    wr.sg_list = {&sge, bytes ? 1u : 0u};
    wr.remote_addr = (remote ? remote : p.remote_landing + (p.data_posted % options_.slots) * options_.chunk_bytes) + offset;
    wr.rkey = remote ? rkey : p.remote_rkey;
    wr.imm_data = data_imm(tag, parts, index);
    if (Status s = p.qps[j]->post_send(wr); !s.ok()) return fail(s);
  }
  ++p.data_posted;
  counters_.bytes_sent += bytes;
  ++counters_.messages_sent;
  return {};
}

Result<const uint8_t*> Comm::receive(Peer& p, size_t bytes, bool placed, bool* was_placed) {
  return arrive(p, bytes, call_tag_, p.call_received, false, placed, was_placed);
}

Result<const uint8_t*> Comm::arrive(Peer& p, size_t bytes, uint16_t tag, uint32_t index, bool point_to_point, bool placed, bool* was_placed) {
  size_t part = 0;
  const uint32_t parts = stripe(p, bytes, &part);
  auto mismatch = [&] {
    if (point_to_point)
      return fail(Status(Errc::protocol_error, "recv: rank " + std::to_string(p.rank) + "'s next message does not match this receive of " +
                                                   std::to_string(bytes) + " bytes: the sizes or tags of the pair's sends and receives differ, "
                                                   "or their point-to-point and collective calls come in different orders"));
    return fail(Status(Errc::protocol_error,
                       std::string(call_name_) + ": rank " + std::to_string(p.rank) + "'s call does not match this rank's (" + call_name_ + " of " +
                           to_string(type_) + ", reduction " + to_string(op_) +
                           "): operation, element count, data type, reduction or root differ, or the ranks' calls are out of order"));
  };
  // Every part carries the message's immediate (with the sender's part
  // count); part j arrives on QP j. Part 0 is checked before waiting for more.
  auto matches = [&](uint32_t j) {
    const Arrival& a = p.arrivals[j].front();
    // On shared memory the sender says where it put the bytes: a placed
    // message where a slot was expected would take stale bytes. The reverse
    // is a sender whose single copy was refused (Peer::shm_direct_refused).
    return a.imm == data_imm(tag, parts, index) && a.length == std::min(part, bytes - size_t(j) * part) && (!a.placed || placed);
  };
  for (uint32_t j = 0; j < parts; ++j) {
    while (p.arrivals[j].empty()) {
      if (p.said_bye && j == 0)
        return fail(Status(Errc::protocol_error, std::string(call_name_) + ": rank " + std::to_string(p.rank) +
                                                     " destroyed its communicator; the ranks made different numbers of calls"));
      if (Status s = pump(&p, "data"); !s.ok()) return s;
    }
    if (!matches(j)) return mismatch();
  }
  if (was_placed) *was_placed = p.arrivals[0].front().placed;
  p.receiving_parts = parts;
  return p.landing + (p.data_consumed % options_.slots) * options_.chunk_bytes;
}

Status Comm::release(Peer& p) {
  ++p.call_received;
  return release_slot(p);
}

Status Comm::release_slot(Peer& p) {
  for (uint32_t j = 0; j < p.receiving_parts; ++j) p.arrivals[j].pop_front();
  p.receiving_parts = 0;
  ++p.data_consumed;
  if (p.shm) {  // the credit is the consumed count in our segment
    own_segment_->receiver_line(p.rank).consumed.store(p.data_consumed, std::memory_order_release);
    p.shm->ring_doorbell();
    return {};
  }
  ++p.credits_owed;
  ++credits_owed_total_;
  if (p.credits_owed < credit_batch_) return {};
  return flush_credits(p);
}

Status Comm::flush_credits(Peer& p) {
  while (p.credits_owed > 0 && p.sends_posted - p.sends_completed + 1 >= max_send_wr_)
    if (Status s = pump(&p, "send queue room"); !s.ok()) return s;
  if (p.credits_owed == 0) return {};  // pump flushed them meanwhile
  if (Status s = post_control(p, credit_imm(p.credits_owed)); !s.ok()) return fail(s);
  credits_owed_total_ -= p.credits_owed;
  p.credits_owed = 0;
  return {};
}

Status Comm::post_advert(Peer& p, uint64_t work, uint32_t rkey, uint64_t bytes) {
  if (p.shm) {  // into our segment's advert lines for p, which p reads (it has our segment mapped)
    detail::RingAdvertLines& lines = own_segment_->advert_lines(p.rank);
    const size_t entry = p.adverts_sent % detail::RingAdvertLines::entries;
    lines.address[entry].store(work, std::memory_order_relaxed);
    lines.bytes[entry].store(bytes, std::memory_order_relaxed);
    lines.tag[entry].store(call_tag_, std::memory_order_relaxed);
    lines.posted.store(++p.adverts_sent, std::memory_order_release);
    p.shm->ring_doorbell();
    return {};
  }
  while (p.sends_posted - p.sends_completed + 1 >= max_send_wr_)
    if (Status s = pump(&p, "send queue room"); !s.ok()) return s;
  const size_t entry = (p.adverts_sent % advert_entries) * advert_bytes;
  uint8_t* out = advert_.get() + entry;
  std::memcpy(out, &work, 8);
  std::memcpy(out + 8, &rkey, 4);
  std::memcpy(out + 12, &call_tag_, 2);
  std::memset(out + 14, 0, 2);
  Sge sge{reinterpret_cast<uint64_t>(out), uint32_t(advert_bytes), advert_mr_->lkey()};
  SendWr wr;
  wr.wr_id = channel_id(p.rank, 0);
  wr.opcode = WrOpcode::rdma_write_with_imm;
  wr.sg_list = {&sge, 1u};
  wr.remote_addr = p.remote_inbox + entry;
  wr.rkey = p.remote_inbox_rkey;
  wr.imm_data = advert_imm;
  if (Status s = p.qps[0]->post_send(wr); !s.ok()) return fail(s);
  number_send(p, 1);
  ++p.adverts_sent;
  return {};
}

Result<Peer::Advert> Comm::take_advert(Peer& next) {
  while (next.adverts.empty()) {
    if (next.said_bye)
      return fail(Status(Errc::protocol_error, std::string(call_name_) + ": rank " + std::to_string(next.rank) +
                                                   " destroyed its communicator; the ranks made different numbers of calls"));
    if (Status s = pump(&next, "the output address (direct gather)"); !s.ok()) return s;
  }
  const Peer::Advert a = next.adverts.front();
  next.adverts.pop_front();
  if (a.tag != call_tag_)
    return fail(Status(Errc::protocol_error, std::string(call_name_) + ": rank " + std::to_string(next.rank) +
                                                 "'s call does not match this rank's (its direct-gather advert is for another call)"));
  if (a.work == 0)
    return fail(Status(Errc::protocol_error, std::string(call_name_) + ": rank " + std::to_string(next.rank) + " sent no output buffer for direct gather"));
  return a;
}

Status Comm::flush_owed_credits() {
  for (Peer& p : peers_) {
    if (p.credits_owed == 0 || p.sends_posted - p.sends_completed + 1 >= max_send_wr_) continue;
    if (Status s = post_control(p, credit_imm(p.credits_owed)); !s.ok()) return fail(s);
    credits_owed_total_ -= p.credits_owed;
    p.credits_owed = 0;
  }
  return {};
}

Status Comm::wait_sent(Peer& p, uint64_t sequence, const char* what) {
  if (p.sends_completed >= sequence) return {};
  // The peer may be waiting for our acknowledgement just as we wait for its
  // one (both sent, both received, both about to reuse their buffers): send
  // ours now instead of after the transport's piggy-backing delay.
  context_->flush_acknowledgements();
  while (p.sends_completed < sequence)
    if (Status s = pump(&p, what); !s.ok()) return s;
  return {};
}

Status Comm::begin_call(CallKind kind, size_t count, DataType type, ReduceOp op, int root) {
  if (!broken_.ok()) return Status(broken_.code(), "communicator is broken by an earlier error: " + broken_.message());
  const bool floating = type == DataType::float32 || type == DataType::float64 || type == DataType::float16 || type == DataType::bfloat16;
  if (floating && (op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor))
    return Status(Errc::invalid_argument, std::string(to_string(kind)) + ": the bitwise reduction " + to_string(op) + " needs an integer type, not " + to_string(type));
  // Point-to-point transfers share the pairs' channels, in order: finish them first.
  if (transfers_outstanding_)
    if (Status s = drain_transfers(); !s.ok()) return s;
  call_name_ = to_string(kind);
  type_ = type;
  op_ = op;
  element_ = size_of(type);
  call_tag_ = fnv16({++call_sequence_, uint64_t(kind), uint64_t(count), uint64_t(type), uint64_t(op), uint64_t(int64_t(root))});
  for (Peer& p : peers_) p.call_sent = p.call_received = 0;
  last_progress_ = Clock::now();
  ++counters_.calls;
  return {};
}

// Every message this rank wrote must be acknowledged before the caller may
// reuse its buffers (a retransmission reads them again).
Status Comm::end_call(Status s) {
  if (!s.ok()) return s;
  for (Peer& p : peers_)
    if (p.rank >= 0)
      if (Status w = wait_sent(p, p.last_data_send, "acknowledgements"); !w.ok()) return w;
  if (network_peers_ > 0) context_->flush_acknowledgements();
  return {};
}

void Comm::say_goodbye() {
  if (!broken_.ok() || !connected_) return;
  // Tell every peer we are gone, and stay until they have all said so too
  // and acknowledged our last messages; bounded, since a peer may be dead.
  call_name_ = "communicator destruction";
  last_progress_ = Clock::now();
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(2));
  for (Peer& p : peers_)
    if (p.rank >= 0 && post_control(p, bye_imm).ok()) {}
  auto done = [&] {
    for (const Peer& p : peers_)
      if (p.rank >= 0 && (!p.said_bye || p.sends_completed < p.sends_posted)) return false;
    return true;
  };
  while (!done() && Clock::now() < deadline && pump(nullptr, "goodbyes").ok()) {}
  context_->flush_acknowledgements();
}

Result<Comm::CallRegistration> Comm::register_range(const void* address, size_t bytes, bool remote_write) {
  if (network_peers_ == 0) return CallRegistration{};
  auto mr = pd_->register_memory(const_cast<void*>(address), bytes, access_local_write | (remote_write ? access_remote_write : 0u));
  if (!mr) return mr.status();
  return CallRegistration{std::move(*mr)};
}

Result<uint8_t*> Comm::scratch(size_t bytes, uint32_t* lkey) {
  if (bytes > scratch_bytes_) {
    scratch_mr_.reset();
    scratch_ = allocate(bytes);
    if (!scratch_) return Status(Errc::resource_exhausted, "communicator: cannot allocate " + std::to_string(bytes) + " bytes of scratch");
    auto mr = pd_->register_memory(scratch_.get(), bytes, access_local_write);
    if (!mr) return mr.status();
    scratch_mr_ = std::move(*mr);
    scratch_bytes_ = bytes;
  }
  *lkey = scratch_mr_->lkey();
  return scratch_.get();
}

// ---------------------------------------------------------------- algorithms

// The ring. Step s (0 <= s <= 2N-3): rank r sends segment (r-s-1) mod N to
// r+1 and receives segment (r-s-2) mod N from r-1. Steps 0..N-2 reduce (the
// received partial result with this rank's contribution), so that after step
// N-2 rank r holds the full reduction of segment r; steps N-1..2N-3 pass the
// finished segments around. Each segment travels in chunks, and a chunk is
// forwarded as soon as it is reduced, so the transfers pipeline.
//
// Direct gather (CommunicatorOptions::direct_gather): where a pair allows
// it, the gather steps write each finished chunk straight to its place in
// the receiver's `work` rather than into a landing slot the receiver copies
// out of. The receiver says where `work` is with an advert into the previous
// rank's inbox (post_advert: address, rkey, call tag); the slot and its
// credit are still taken per data message, so flow control is unchanged. That
// the writer may overwrite the receiver's partial result of that chunk is
// safe: the finished chunk exists only after the next rank took that
// partial result whole, so a retransmission of it still reading `work`
// would be a duplicate the next rank drops unread. A pair on shared memory
// does the same with process_vm_writev into the receiver's process (the
// advert goes into the receiver's segment, with the output's length, which
// bounds the writes); the slot then carries only the message's name.
Status Comm::ring(const RingPlan& plan) {
  const int n = size_;
  Peer& next = peer(rank_ + 1);
  Peer& prev = peer(rank_ - 1);
  const bool gathers = plan.last_step >= n - 1;
  const uint64_t work_bytes = (plan.offset.back() + plan.count.back()) * element_;
  const bool single_copy = work_bytes / uint64_t(n) <= shm_single_copy_max_segment;
  const bool into_us = gathers && gathers_into_us() && (!prev.shm || single_copy);   // prev writes into our work
  const bool into_next = gathers && gathers_into(next) && (!next.shm || single_copy);  // we write into next's work
  uint64_t next_work = 0, next_work_bytes = 0;
  uint32_t next_rkey = 0;
  bool have_next_work = !into_next;
  if (into_us) {
    if (!plan.work_remote) return fail(Status(Errc::wrong_state, std::string(call_name_) + ": the output is not registered for direct gather"));
    if (Status s = post_advert(prev, reinterpret_cast<uint64_t>(plan.work), plan.work_rkey, work_bytes); !s.ok()) return s;
  }
  // next's advert says where its work is.
  auto take_next_work = [&]() -> Status {
    auto a = take_advert(next);
    if (!a) return a.status();
    next_work = a->work;
    next_work_bytes = a->bytes;
    next_rkey = a->rkey;
    have_next_work = true;
    return {};
  };
  const size_t chunk_elements = options_.chunk_bytes / element_;
  auto chunks = [&](int segment) { return (plan.count[size_t(segment)] + chunk_elements - 1) / chunk_elements; };
  auto chunk_bytes = [&](int segment, size_t k) {
    return std::min(chunk_elements, plan.count[size_t(segment)] - k * chunk_elements) * element_;
  };
  auto received_segment = [&](int step) { return ((rank_ - step - 2) % n + 2 * n) % n; };
  size_t max_chunks = 0;
  for (int s = 0; s < n; ++s) max_chunks = std::max(max_chunks, chunks(s));
  if (into_us && prev.shm) {
    // Until prev has published its last message of this call it may write
    // into `work` with process_vm_writev: a failure meanwhile waits for it
    // (fail()). Its messages of this call are the next ones it publishes.
    uint64_t expected = 0;
    for (int s = plan.first_step; s <= plan.last_step; ++s) expected += chunks(received_segment(s));
    advert_open_ = &prev;
    advert_open_until_ = prev.data_consumed + expected;
  }
  // Send sequence of the last message read from each chunk of `work`: the
  // chunk may be overwritten only once that message is acknowledged.
  std::vector<uint64_t> read_by(size_t(n) * max_chunks, 0);

  struct Outgoing {
    const uint8_t* source;
    uint32_t lkey;
    size_t bytes;
    size_t chunk_id;
    bool gather;           // sent in a gather step: into next's work where the pair allows it
    size_t work_offset;    // bytes into work where the chunk belongs
  };
  std::deque<Outgoing> outgoing;
  const int first_segment = ((rank_ - plan.first_step - 1) % n + n) % n;
  for (size_t k = 0; k < chunks(first_segment); ++k)
    outgoing.push_back({plan.first_source + k * chunk_elements * element_, plan.first_lkey, chunk_bytes(first_segment, k),
                        size_t(first_segment) * max_chunks + k, plan.first_step >= n - 1,
                        (plan.offset[size_t(first_segment)] + k * chunk_elements) * element_});

  int step = plan.first_step;
  size_t k = 0;
  auto skip_empty = [&] {
    while (step <= plan.last_step && chunks(received_segment(step)) == 0) ++step;
  };
  skip_empty();
  while (step <= plan.last_step || !outgoing.empty()) {
    bool did = false;
    while (!outgoing.empty() && can_post(next)) {
      const Outgoing o = outgoing.front();
      const bool direct = o.gather && into_next;
      if (direct && !have_next_work)
        if (Status s = take_next_work(); !s.ok()) return s;
      outgoing.pop_front();
      // The advert is the peer's word: on shared memory nothing but this
      // check (the kernel's, for unmapped pages) keeps a write in its output.
      if (direct && (o.work_offset > next_work_bytes || o.bytes > next_work_bytes - o.work_offset))
        return fail(Status(Errc::protocol_error, std::string(call_name_) + ": rank " + std::to_string(next.rank) +
                                                     "'s direct-gather advert is shorter than this call's output"));
      uint64_t sequence = 0;
      if (Status s = send(next, o.source, o.lkey, o.bytes, &sequence, direct ? next_work + o.work_offset : 0, direct ? next_rkey : 0); !s.ok())
        return s;
      read_by[o.chunk_id] = sequence;
      did = true;
    }
    if (step <= plan.last_step && prev.has_arrival()) {
      const int segment = received_segment(step);
      const size_t bytes = chunk_bytes(segment, k);
      const bool reducing = step <= n - 2;
      bool placed = false;
      auto incoming = receive(prev, bytes, into_us && !reducing && prev.shm, &placed);
      if (!incoming) return incoming.status();
      const size_t element_offset = plan.offset[size_t(segment)] + k * chunk_elements;
      const size_t id = size_t(segment) * max_chunks + k;
      uint8_t* destination = plan.work + element_offset * element_;
      if (reducing && step == n - 2 && plan.own_result) destination = plan.own_result + k * chunk_elements * element_;
      // (Also with direct gather, where prev has written it already: by then
      // the next rank holds that send whole, so this wait is short.)
      else if (Status s = wait_sent(next, read_by[id], "acknowledgement of a forwarded chunk"); !s.ok()) return s;
      if (reducing) {
        detail::reduce(type_, op_, destination, plan.contribution + element_offset * element_, *incoming, bytes / element_);
        if (step == n - 2 && op_ == ReduceOp::avg) detail::divide(type_, destination, bytes / element_, n);
      } else if (into_us && (!prev.shm || placed)) {
        counters_.bytes_gathered_in_place += bytes;  // prev wrote it where it belongs
      } else {
        std::memcpy(destination, *incoming, bytes);
      }
      if (Status s = release(prev); !s.ok()) return s;
      if (step < plan.last_step)
        outgoing.push_back({destination, plan.work_lkey, bytes, id, step + 1 >= n - 1, element_offset * element_});
      if (++k == chunks(segment)) {
        k = 0;
        ++step;
        skip_empty();
        if (step > plan.last_step) advert_open_ = nullptr;  // prev has written all it will into our output
      }
      continue;
    }
    if (!did)
      if (Status s = pump(step <= plan.last_step ? &prev : &next, step <= plan.last_step ? "data" : "credits"); !s.ok()) return s;
  }
  // Every segment empty for us to send: next's message is still to be taken.
  if (!have_next_work)
    if (Status s = take_next_work(); !s.ok()) return s;
  advert_open_ = nullptr;  // (also when every segment prev writes was empty)
  return {};
}

Status Comm::send_all(Peer& p, const uint8_t* source, uint32_t lkey, size_t bytes) {
  for (size_t at = 0; at < bytes; at += options_.chunk_bytes) {
    uint64_t sequence;
    if (Status s = send(p, source + at, lkey, std::min(options_.chunk_bytes, bytes - at), &sequence); !s.ok()) return s;
  }
  return {};
}

Status Comm::receive_all(Peer& p, uint8_t* destination, size_t bytes, bool reduce) {
  for (size_t at = 0; at < bytes; at += options_.chunk_bytes) {
    const size_t length = std::min(options_.chunk_bytes, bytes - at);
    auto incoming = receive(p, length);
    if (!incoming) return incoming.status();
    if (reduce) detail::reduce(type_, op_, destination + at, destination + at, *incoming, length / element_);
    else std::memcpy(destination + at, *incoming, length);
    if (Status s = release(p); !s.ok()) return s;
  }
  return {};
}

// Both partners send their whole vector and reduce the other's into it.
// a op b == b op a bit for bit (IEEE sum, product, min, max are
// commutative), so both end with identical values.
Status Comm::exchange_reduce(Peer& partner, uint8_t* work, uint32_t lkey, size_t count) {
  const size_t bytes = count * element_;
  const size_t chunks = (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes;
  std::vector<uint64_t> sequence(chunks);
  size_t sent = 0, reduced = 0;
  while (reduced < chunks) {
    while (sent < chunks && can_post(partner)) {
      const size_t at = sent * options_.chunk_bytes;
      if (Status s = send(partner, work + at, lkey, std::min(options_.chunk_bytes, bytes - at), &sequence[sent]); !s.ok()) return s;
      ++sent;
    }
    if (reduced < sent && partner.has_arrival()) {
      const size_t at = reduced * options_.chunk_bytes;
      const size_t length = std::min(options_.chunk_bytes, bytes - at);
      auto incoming = receive(partner, length);
      if (!incoming) return incoming.status();
      if (Status s = wait_sent(partner, sequence[reduced], "acknowledgement"); !s.ok()) return s;
      detail::reduce(type_, op_, work + at, work + at, *incoming, length / element_);
      if (Status s = release(partner); !s.ok()) return s;
      ++reduced;
      continue;
    }
    if (Status s = pump(&partner, "data"); !s.ok()) return s;
  }
  return {};
}

// Ranks p..N-1 (p the largest power of two <= N) fold their vector into
// rank r-p, which reduces it into its own, and wait for the result, which
// rank r-p sends back at the end (send_all). *excess: this rank is one of
// them, and `work` holds the result.
Status Comm::fold_in_excess(uint8_t* work, uint32_t lkey, size_t bytes, int p, bool* excess) {
  *excess = rank_ >= p;
  if (*excess) {
    Peer& partner = peer(rank_ - p);
    if (Status s = send_all(partner, work, lkey, bytes); !s.ok()) return s;
    if (Status s = wait_sent(partner, partner.sends_posted, "acknowledgement"); !s.ok()) return s;
    return receive_all(partner, work, bytes, false);
  }
  if (rank_ + p < size_) return receive_all(peer(rank_ + p), work, bytes, true);
  return {};
}

// Recursive doubling on the largest power of two p <= N (ranks past it
// fold in and out: fold_in_excess).
Status Comm::recursive_doubling(uint8_t* work, uint32_t lkey, size_t count) {
  int p = 1;
  while (p * 2 <= size_) p *= 2;
  const size_t bytes = count * element_;
  bool excess = false;
  if (Status s = fold_in_excess(work, lkey, bytes, p, &excess); !s.ok() || excess) return s;
  for (int mask = 1; mask < p; mask <<= 1)
    if (Status s = exchange_reduce(peer(rank_ ^ mask), work, lkey, count); !s.ok()) return s;
  if (op_ == ReduceOp::avg) detail::divide(type_, work, count, size_);
  if (rank_ + p < size_)
    if (Status s = send_all(peer(rank_ + p), work, lkey, bytes); !s.ok()) return s;
  return {};
}

Status Comm::exchange(Peer& to, const uint8_t* out, uint32_t out_lkey, size_t out_bytes, Peer& from, uint8_t* destination, const uint8_t* operand,
                      size_t in_bytes, uint64_t* last_sent) {
  const size_t chunk = options_.chunk_bytes;
  const size_t out_chunks = (out_bytes + chunk - 1) / chunk, in_chunks = (in_bytes + chunk - 1) / chunk;
  size_t sent = 0, received = 0;
  uint64_t last = 0;
  while (sent < out_chunks || received < in_chunks) {
    bool moved = false;
    while (sent < out_chunks && can_post(to)) {
      const size_t at = sent * chunk;
      if (Status s = send(to, out + at, out_lkey, std::min(chunk, out_bytes - at), &last); !s.ok()) return s;
      ++sent;
      moved = true;
    }
    if (received < in_chunks && from.has_arrival()) {
      const size_t at = received * chunk, length = std::min(chunk, in_bytes - at);
      auto incoming = receive(from, length);
      if (!incoming) return incoming.status();
      if (operand) detail::reduce(type_, op_, destination + at, operand + at, *incoming, length / element_);
      else std::memcpy(destination + at, *incoming, length);
      if (Status s = release(from); !s.ok()) return s;
      ++received;
      continue;
    }
    if (!moved)
      if (Status s = pump(received < in_chunks ? &from : &to, received < in_chunks ? "data" : "credits"); !s.ok()) return s;
  }
  if (last_sent) *last_sent = last;
  return {};
}

// Rabenseifner's allreduce on the largest power of two p <= N. Reduce-
// scatter by recursive halving: at distance p/2, p/4, ..., 1 a rank and its
// partner split their common range in two, each sends the half the other
// keeps and reduces the other's copy of the half it keeps; after log2(p)
// steps each rank holds one p-th, reduced. Allgather by recursive doubling
// undoes the splits in reverse, each step swapping the halves. The ring's
// bytes (2(p-1)/p of the vector) in 2 log2(p) messages-worth of steps
// instead of 2(p-1). Ranks p..N-1 fold in and out as in recursive doubling.
// The first step reads the contribution directly (no copy into `work` when
// out of place), as the ring does.
Status Comm::halving_doubling(const uint8_t* contribution, uint32_t contribution_lkey, uint8_t* work, uint32_t lkey, size_t count) {
  int p = 1;
  while (p * 2 <= size_) p *= 2;
  const size_t bytes = count * element_;
  if (p != size_ && contribution != work) {  // the fold reduces into work: start it from the contribution
    std::memcpy(work, contribution, bytes);
    contribution = work;
    contribution_lkey = lkey;
  }
  bool excess = false;
  if (Status s = fold_in_excess(work, lkey, bytes, p, &excess); !s.ok() || excess) return s;
  // Reduce-scatter: the ranges split so far (element offsets), to undo in reverse.
  std::vector<std::pair<size_t, size_t>> parents;
  size_t lo = 0, hi = count;
  for (int mask = p / 2; mask >= 1; mask /= 2) {
    Peer& partner = peer(rank_ ^ mask);
    const size_t mid = lo + (hi - lo) / 2;
    const bool keep_lower = (rank_ & mask) == 0;
    const size_t keep_lo = keep_lower ? lo : mid, keep_hi = keep_lower ? mid : hi;
    const size_t give_lo = keep_lower ? mid : lo, give_hi = keep_lower ? hi : mid;
    const uint8_t* source = parents.empty() ? contribution : work;  // after step one, work holds the partial sums
    const uint32_t source_lkey = parents.empty() ? contribution_lkey : lkey;
    uint64_t last = 0;
    if (Status s = exchange(partner, source + give_lo * element_, source_lkey, (give_hi - give_lo) * element_, partner, work + keep_lo * element_,
                            source + keep_lo * element_, (keep_hi - keep_lo) * element_, &last);
        !s.ok())
      return s;
    // The half given away is overwritten in the allgather: sent first.
    if (last)
      if (Status s = wait_sent(partner, last, "acknowledgement"); !s.ok()) return s;
    parents.emplace_back(lo, hi);
    lo = keep_lo;
    hi = keep_hi;
  }
  if (op_ == ReduceOp::avg) detail::divide(type_, work + lo * element_, hi - lo, size_);
  // Allgather: swap halves back up, nearest partner first.
  for (int mask = 1; mask < p; mask *= 2) {
    Peer& partner = peer(rank_ ^ mask);
    const auto [parent_lo, parent_hi] = parents.back();
    parents.pop_back();
    const size_t other_lo = lo == parent_lo ? hi : parent_lo, other_hi = lo == parent_lo ? parent_hi : lo;
    if (Status s = exchange(partner, work + lo * element_, lkey, (hi - lo) * element_, partner, work + other_lo * element_, nullptr,
                            (other_hi - other_lo) * element_);
        !s.ok())
      return s;
    lo = parent_lo;
    hi = parent_hi;
  }
  if (rank_ + p < size_)
    if (Status s = send_all(peer(rank_ + p), work, lkey, bytes); !s.ok()) return s;
  return {};
}

// A pipelined chain root -> root+1 -> ... -> root-1: each chunk is forwarded
// as soon as it arrives.
Status Comm::chain_broadcast(uint8_t* buffer, uint32_t lkey, size_t bytes, int root) {
  const int position = ((rank_ - root) % size_ + size_) % size_;
  Peer& next = peer(rank_ + 1);
  Peer& prev = peer(rank_ - 1);
  const bool forwards = position < size_ - 1;
  if (position == 0) return send_all(next, buffer, lkey, bytes);
  for (size_t at = 0; at < bytes; at += options_.chunk_bytes) {
    const size_t length = std::min(options_.chunk_bytes, bytes - at);
    auto incoming = receive(prev, length);
    if (!incoming) return incoming.status();
    std::memcpy(buffer + at, *incoming, length);
    if (Status s = release(prev); !s.ok()) return s;
    uint64_t sequence;
    if (forwards)
      if (Status s = send(next, buffer + at, lkey, length, &sequence); !s.ok()) return s;
  }
  return {};
}

// ---------------------------------------------------------------- operations

Status Comm::allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op) {
  const size_t bytes = count * size_of(type);
  if (count && (!send || !recv)) return Status(Errc::invalid_argument, "allreduce: null buffer");
  if (send != recv && overlaps(send, bytes, recv, bytes)) return Status(Errc::invalid_argument, "allreduce: buffers overlap without being equal");
  if (Status s = begin_call(CallKind::allreduce, count, type, op, -1); !s.ok()) return s;
  if (count == 0) return {};
  if (size_ == 1) {
    if (send != recv) std::memmove(recv, send, bytes);
    return {};
  }
  const bool small = options_.allreduce_algorithm == AllreduceAlgorithm::recursive_doubling ||
                     (options_.allreduce_algorithm == AllreduceAlgorithm::automatic && bytes <= options_.small_message_bytes);
  // Automatic: recursive halving and doubling where it measured ahead of
  // the ring (a power of two, at least 4 ranks, up to 512 KiB; see the
  // constant), the ring above.
  const bool power_of_two = (size_ & (size_ - 1)) == 0;
  const bool halving = !small && (options_.allreduce_algorithm == AllreduceAlgorithm::halving_doubling ||
                                  (options_.allreduce_algorithm == AllreduceAlgorithm::automatic && power_of_two && size_ >= 4 &&
                                   bytes <= halving_doubling_max_bytes));
  // The ring's gather steps may write into recv from the previous rank.
  const bool ring_gathers_into_us = !small && !halving && gathers_into_us();
  auto recv_mr = register_range(recv, bytes, ring_gathers_into_us);
  if (!recv_mr) return fail(recv_mr.status());
  ++(small ? counters_.allreduce_recursive_doubling : halving ? counters_.allreduce_halving_doubling : counters_.allreduce_ring);
  if (small) {
    if (send != recv) std::memcpy(recv, send, bytes);
    return end_call(recursive_doubling(static_cast<uint8_t*>(recv), recv_mr->lkey(), count));
  }
  CallRegistration send_mr;
  if (send != recv) {
    auto mr = register_range(send, bytes);
    if (!mr) return fail(mr.status());
    send_mr = std::move(*mr);
  }
  if (halving)
    return end_call(halving_doubling(static_cast<const uint8_t*>(send), send_mr.mr ? send_mr.lkey() : recv_mr->lkey(), static_cast<uint8_t*>(recv),
                                     recv_mr->lkey(), count));
  RingPlan plan;
  plan.contribution = static_cast<const uint8_t*>(send);
  plan.work = static_cast<uint8_t*>(recv);
  plan.work_lkey = recv_mr->lkey();
  plan.work_remote = ring_gathers_into_us;
  plan.work_rkey = recv_mr->rkey();
  plan.first_step = 0;
  plan.last_step = 2 * size_ - 3;
  for (int s = 0; s < size_; ++s) {
    plan.count.push_back(count / size_t(size_) + (size_t(s) < count % size_t(size_) ? 1 : 0));
    plan.offset.push_back(size_t(s) * (count / size_t(size_)) + std::min(size_t(s), count % size_t(size_)));
  }
  const int first = (rank_ - 1 + size_) % size_;
  plan.first_source = plan.contribution + plan.offset[size_t(first)] * element_;
  plan.first_lkey = send_mr.mr ? send_mr.lkey() : plan.work_lkey;
  return end_call(ring(plan));
}

Status Comm::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType type, ReduceOp op) {
  const size_t element = size_of(type), block = recv_count * element, total = block * size_t(size_);
  if (recv_count && (!send || !recv)) return Status(Errc::invalid_argument, "reduce_scatter: null buffer");
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  const bool nccl_in_place = out == in + size_t(rank_) * block;
  if (!nccl_in_place && out != in && overlaps(in, total, out, block))
    return Status(Errc::invalid_argument, "reduce_scatter: buffers overlap without being in place (recv == send or recv == send + rank * recv_count)");
  if (Status s = begin_call(CallKind::reduce_scatter, recv_count, type, op, -1); !s.ok()) return s;
  if (recv_count == 0) return {};
  if (size_ == 1) {
    if (out != in) std::memmove(out, in, block);
    return {};
  }
  auto send_mr = register_range(send, total);
  if (!send_mr) return fail(send_mr.status());
  uint32_t work_lkey = 0;
  auto work = scratch(total, &work_lkey);
  if (!work) return fail(work.status());
  RingPlan plan;
  plan.contribution = in;
  plan.work = *work;
  plan.work_lkey = work_lkey;
  // The own segment is finished in place only where that cannot clobber an
  // input still needed (out of place, or NCCL's in-place layout).
  const bool direct = nccl_in_place || !overlaps(in, total, out, block);
  plan.own_result = direct ? out : *work + size_t(rank_) * block;
  plan.first_step = 0;
  plan.last_step = size_ - 2;
  for (int s = 0; s < size_; ++s) {
    plan.count.push_back(recv_count);
    plan.offset.push_back(size_t(s) * recv_count);
  }
  plan.first_source = in + size_t((rank_ - 1 + size_) % size_) * block;
  plan.first_lkey = send_mr->lkey();
  Status s = end_call(ring(plan));
  if (s.ok() && !direct) std::memcpy(out, *work + size_t(rank_) * block, block);
  return s;
}

Status Comm::allgather(const void* send, void* recv, size_t send_count, DataType type) {
  const size_t element = size_of(type), block = send_count * element, total = block * size_t(size_);
  if (send_count && (!send || !recv)) return Status(Errc::invalid_argument, "allgather: null buffer");
  auto* out = static_cast<uint8_t*>(recv);
  const auto* in = static_cast<const uint8_t*>(send);
  uint8_t* own = out + size_t(rank_) * block;
  if (in != own && overlaps(in, block, out, total))
    return Status(Errc::invalid_argument, "allgather: buffers overlap without being in place (send == recv + rank * send_count)");
  if (Status s = begin_call(CallKind::allgather, send_count, type, ReduceOp::sum, -1); !s.ok()) return s;
  if (send_count == 0) return {};
  if (in != own) std::memcpy(own, in, block);
  if (size_ == 1) return {};
  auto recv_mr = register_range(recv, total, gathers_into_us());
  if (!recv_mr) return fail(recv_mr.status());
  RingPlan plan;
  plan.work = out;
  plan.work_lkey = recv_mr->lkey();
  plan.work_remote = gathers_into_us();
  plan.work_rkey = recv_mr->rkey();
  plan.first_step = size_ - 1;
  plan.last_step = 2 * size_ - 3;
  for (int s = 0; s < size_; ++s) {
    plan.count.push_back(send_count);
    plan.offset.push_back(size_t(s) * send_count);
  }
  plan.first_source = own;
  plan.first_lkey = plan.work_lkey;
  return end_call(ring(plan));
}

Status Comm::broadcast(void* buffer, size_t count, DataType type, int root) {
  if (root < 0 || root >= size_) return Status(Errc::invalid_argument, "broadcast: root " + std::to_string(root) + " is not a rank");
  if (count && !buffer) return Status(Errc::invalid_argument, "broadcast: null buffer");
  if (Status s = begin_call(CallKind::broadcast, count, type, ReduceOp::sum, root); !s.ok()) return s;
  if (count == 0 || size_ == 1) return {};
  const size_t bytes = count * size_of(type);
  auto mr = register_range(buffer, bytes);
  if (!mr) return fail(mr.status());
  return end_call(chain_broadcast(static_cast<uint8_t*>(buffer), mr->lkey(), bytes, root));
}

Status Comm::barrier() {
  if (Status s = begin_call(CallKind::barrier, 1, DataType::int32, ReduceOp::sum, -1); !s.ok()) return s;
  if (size_ == 1) return {};
  uint32_t lkey = 0;
  auto work = scratch(sizeof(int32_t), &lkey);
  if (!work) return fail(work.status());
  std::memset(*work, 0, sizeof(int32_t));
  return end_call(recursive_doubling(*work, lkey, 1));
}

// Small vectors: recursive doubling (every rank ends with the result, in
// log2 N exchanges; only the root keeps it). Larger: the ring's
// reduce-scatter half, then each rank sends its finished segment to the
// root, which is what NCCL's ring reduce moves too (each byte crosses
// about 2 links per rank).
Status Comm::reduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op, int root) {
  if (root < 0 || root >= size_) return Status(Errc::invalid_argument, "reduce: root " + std::to_string(root) + " is not a rank");
  const size_t element = size_of(type), bytes = count * element;
  const bool is_root = rank_ == root;
  if (count && (!send || (is_root && !recv))) return Status(Errc::invalid_argument, "reduce: null buffer");
  if (is_root && send != recv && overlaps(send, bytes, recv, bytes)) return Status(Errc::invalid_argument, "reduce: buffers overlap without being equal");
  if (Status s = begin_call(CallKind::reduce, count, type, op, root); !s.ok()) return s;
  if (count == 0) return {};
  if (size_ == 1) {
    if (send != recv) std::memmove(recv, send, bytes);
    return {};
  }
  const bool small = bytes <= options_.small_message_bytes;
  if (small) {
    uint8_t* work = nullptr;
    uint32_t lkey = 0;
    CallRegistration mr;
    if (is_root) {
      auto r = register_range(recv, bytes);
      if (!r) return fail(r.status());
      mr = std::move(*r);
      work = static_cast<uint8_t*>(recv);
      lkey = mr.lkey();
    } else {
      auto w = scratch(bytes, &lkey);
      if (!w) return fail(w.status());
      work = *w;
    }
    if (work != send) std::memcpy(work, send, bytes);
    return end_call(recursive_doubling(work, lkey, count));
  }
  auto send_mr = register_range(send, bytes);
  if (!send_mr) return fail(send_mr.status());
  uint32_t work_lkey = 0;
  auto work = scratch(bytes, &work_lkey);
  if (!work) return fail(work.status());
  RingPlan plan;
  plan.contribution = static_cast<const uint8_t*>(send);
  plan.work = *work;
  plan.work_lkey = work_lkey;
  plan.first_step = 0;
  plan.last_step = size_ - 2;
  for (int s = 0; s < size_; ++s) {
    plan.count.push_back(count / size_t(size_) + (size_t(s) < count % size_t(size_) ? 1 : 0));
    plan.offset.push_back(size_t(s) * (count / size_t(size_)) + std::min(size_t(s), count % size_t(size_)));
  }
  // The root finishes its own segment straight into recv; in place, that
  // segment's input is read at the same positions as it is written.
  auto* out = static_cast<uint8_t*>(recv);
  if (is_root) plan.own_result = out + plan.offset[size_t(rank_)] * element;
  const int first = (rank_ - 1 + size_) % size_;
  plan.first_source = plan.contribution + plan.offset[size_t(first)] * element;
  plan.first_lkey = send_mr->lkey();
  if (Status s = ring(plan); !s.ok()) return s;
  if (!is_root)
    return end_call(send_all(peer(root), *work + plan.offset[size_t(rank_)] * element, work_lkey, plan.count[size_t(rank_)] * element));
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || plan.count[size_t(r)] == 0) continue;
    if (Status s = receive_all(peer(r), out + plan.offset[size_t(r)] * element, plan.count[size_t(r)] * element, false); !s.ok()) return s;
  }
  return end_call({});
}

// Sends out_bytes to `to` while receiving in_bytes from `from`, chunk by
// chunk, interleaved: every rank does this at once with other partners, so
// neither direction may wait for the other to finish.
// Pairwise exchange in N-1 steps: at step s rank r sends to r+s and
// receives from r-s, so every rank has one partner each way per step.
Status Comm::all_to_all(const void* send, const size_t* send_counts, const size_t* send_offsets, void* recv, const size_t* recv_counts,
                        const size_t* recv_offsets, DataType type) {
  if (!send_counts || !send_offsets || !recv_counts || !recv_offsets) return Status(Errc::invalid_argument, "all_to_all: null count or offset array");
  const size_t element = size_of(type);
  size_t send_end = 0, recv_end = 0;
  for (int r = 0; r < size_; ++r) {
    const size_t sc = send_counts[r], so = send_offsets[r], rc = recv_counts[r], ro = recv_offsets[r];
    if (sc > (SIZE_MAX / element) - so || rc > (SIZE_MAX / element) - ro) return Status(Errc::invalid_argument, "all_to_all: counts overflow");
    if (sc) send_end = std::max(send_end, (so + sc) * element);
    if (rc) recv_end = std::max(recv_end, (ro + rc) * element);
  }
  if ((send_end && !send) || (recv_end && !recv)) return Status(Errc::invalid_argument, "all_to_all: null buffer");
  if (send_end && recv_end && overlaps(send, send_end, recv, recv_end)) return Status(Errc::invalid_argument, "all_to_all: send and recv overlap");
  if (Status s = begin_call(CallKind::all_to_all, 0, type, ReduceOp::sum, -1); !s.ok()) return s;
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  if (recv_counts[rank_] != send_counts[rank_])
    return fail(Status(Errc::invalid_argument, "all_to_all: this rank sends itself " + std::to_string(send_counts[rank_]) + " elements but receives " +
                                                   std::to_string(recv_counts[rank_])));
  if (send_counts[rank_]) std::memcpy(out + recv_offsets[rank_] * element, in + send_offsets[rank_] * element, send_counts[rank_] * element);
  if (size_ == 1) return {};
  CallRegistration send_mr;
  if (send_end) {
    auto mr = register_range(send, send_end);
    if (!mr) return fail(mr.status());
    send_mr = std::move(*mr);
  }
  for (int step = 1; step < size_; ++step) {
    Peer& to = peer(rank_ + step);
    Peer& from = peer(rank_ - step);
    if (Status s = exchange(to, in + send_offsets[to.rank] * element, send_mr.lkey(), send_counts[to.rank] * element, from,
                            out + recv_offsets[from.rank] * element, nullptr, recv_counts[from.rank] * element);
        !s.ok())
      return s;
  }
  return end_call({});
}

// ---------------------------------------------------------------- point to point

Result<uint64_t> Comm::start_send(int to, const void* buffer, size_t bytes, uint32_t tag) {
  if (!broken_.ok()) return Status(broken_.code(), "communicator is broken by an earlier error: " + broken_.message());
  if (to < 0 || to >= size_ || to == rank_) return Status(Errc::invalid_argument, "send: " + std::to_string(to) + " is not another rank of the communicator");
  if (bytes && !buffer) return Status(Errc::invalid_argument, "send: null buffer");
  Peer& p = peers_[size_t(to)];
  Peer::Transfer t;
  t.id = next_request_++;
  t.buffer = static_cast<uint8_t*>(const_cast<void*>(buffer));
  t.bytes = bytes;
  t.tag = fnv16({++p.transfers_sent, uint64_t(CallKind::point_to_point), uint64_t(bytes), uint64_t(tag)});
  t.chunks = std::max<size_t>(1, (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes);
  if (!p.shm && bytes) {
    auto mr = pd_->register_memory(t.buffer, bytes, access_local_write);
    if (!mr) return mr.status();
    t.mr = std::move(*mr);
  }
  if (transfers_outstanding_ == 0) last_progress_ = Clock::now();
  p.outgoing_transfers.push_back(std::move(t));
  ++transfers_outstanding_;
  return p.outgoing_transfers.back().id;
}

Result<uint64_t> Comm::start_recv(int from, void* buffer, size_t bytes, uint32_t tag) {
  if (!broken_.ok()) return Status(broken_.code(), "communicator is broken by an earlier error: " + broken_.message());
  if (from < 0 || from >= size_ || from == rank_) return Status(Errc::invalid_argument, "recv: " + std::to_string(from) + " is not another rank of the communicator");
  if (bytes && !buffer) return Status(Errc::invalid_argument, "recv: null buffer");
  Peer& p = peers_[size_t(from)];
  Peer::Transfer t;
  t.id = next_request_++;
  t.buffer = static_cast<uint8_t*>(buffer);
  t.bytes = bytes;
  t.tag = fnv16({++p.transfers_received, uint64_t(CallKind::point_to_point), uint64_t(bytes), uint64_t(tag)});
  t.chunks = std::max<size_t>(1, (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes);
  if (transfers_outstanding_ == 0) last_progress_ = Clock::now();
  p.incoming_transfers.push_back(std::move(t));
  ++transfers_outstanding_;
  return p.incoming_transfers.back().id;
}

Status Comm::progress_transfers(bool* moved) {
  call_name_ = "send/recv";
  const size_t chunk = options_.chunk_bytes;
  for (Peer& p : peers_) {
    if (p.rank < 0) continue;
    // Sends post in order as credits allow; each is done once its last
    // message is acknowledged (the caller may then reuse its buffer).
    for (Peer::Transfer& t : p.outgoing_transfers) {
      while (t.moved < t.chunks && can_post(p)) {
        const size_t at = t.moved * chunk;
        if (Status s = transmit(p, t.buffer + at, t.mr ? t.mr->lkey() : 0, std::min(chunk, t.bytes - at), &t.last_sequence, t.tag, uint32_t(t.moved)); !s.ok())
          return s;
        ++t.moved;
        *moved = true;
      }
      if (t.moved < t.chunks) break;
    }
    while (!p.outgoing_transfers.empty() && p.outgoing_transfers.front().moved == p.outgoing_transfers.front().chunks &&
           p.sends_completed >= p.outgoing_transfers.front().last_sequence) {
      p.outgoing_transfers.pop_front();
      --transfers_outstanding_;
      *moved = true;
    }
    // Receives take the pair's messages in order.
    while (!p.incoming_transfers.empty() && p.has_arrival()) {
      Peer::Transfer& t = p.incoming_transfers.front();
      const size_t at = t.moved * chunk, length = std::min(chunk, t.bytes - at);
      auto incoming = arrive(p, length, t.tag, uint32_t(t.moved), true);
      if (!incoming) return incoming.status();
      std::memcpy(t.buffer + at, *incoming, length);
      if (Status s = release_slot(p); !s.ok()) return s;
      *moved = true;
      if (++t.moved == t.chunks) {
        p.incoming_transfers.pop_front();
        --transfers_outstanding_;
      }
    }
  }
  if (*moved) last_progress_ = Clock::now();
  return {};
}

Status Comm::poll_once(bool* moved) {
  if (shm_peers_ > 0) {
    auto changed = poll_shared();
    if (!changed) return changed.status();
    *moved |= *changed;
  }
  if (network_peers_ > 0) {
    WorkCompletion wcs[64];
    const int n = cq_->poll(wcs);  // also drives the transport in inline mode
    if (n > 0) {
      *moved = true;
      if (Status s = take_completions(wcs, n); !s.ok()) return s;
    }
  }
  if (*moved) {
    last_progress_ = Clock::now();
  } else if (credits_owed_total_ && Clock::now() - last_progress_ >= credit_idle_flush) {
    // A caller that only tests still returns what it owes (see pump()).
    if (Status s = flush_owed_credits(); !s.ok()) return s;
  }
  return {};
}

bool transfer_pending(const std::deque<Peer::Transfer>& q, uint64_t id) {
  return std::any_of(q.begin(), q.end(), [&](const Peer::Transfer& t) { return t.id == id; });
}

Result<bool> Comm::test(uint64_t request) {
  if (request == 0 || request >= next_request_) return Status(Errc::invalid_argument, "test: no such request");
  if (!broken_.ok()) return Status(broken_.code(), "communicator is broken by an earlier error: " + broken_.message());
  bool moved = false;
  if (Status s = progress_transfers(&moved); !s.ok()) return s;
  if (Status s = poll_once(&moved); !s.ok()) return s;
  if (Status s = progress_transfers(&moved); !s.ok()) return s;
  for (const Peer& p : peers_)
    if (transfer_pending(p.outgoing_transfers, request) || transfer_pending(p.incoming_transfers, request)) {
      if (!moved && Clock::now() - last_progress_ > options_.timeout) return no_progress(&p, "point-to-point data");
      return false;
    }
  return true;
}

Status Comm::wait(uint64_t request) {
  while (true) {
    auto done = test(request);
    if (!done) return done.status();
    if (*done) return {};
    const Peer* waiting_for = nullptr;
    for (const Peer& p : peers_)
      if (transfer_pending(p.outgoing_transfers, request) || transfer_pending(p.incoming_transfers, request)) waiting_for = &p;
    context_->flush_acknowledgements();
    if (Status s = pump(waiting_for, "point-to-point data"); !s.ok()) return s;
  }
}

Status Comm::drain_transfers() {
  while (transfers_outstanding_) {
    bool moved = false;
    if (Status s = progress_transfers(&moved); !s.ok()) return s;
    if (!transfers_outstanding_) break;
    if (moved) continue;
    context_->flush_acknowledgements();
    if (Status s = pump(nullptr, "point-to-point transfers before a collective call"); !s.ok()) return s;
  }
  return {};
}

}  // namespace

Result<std::unique_ptr<Communicator>> Communicator::create(const CommunicatorOptions& options) {
  auto comm = std::make_unique<Comm>();
  if (Status s = comm->init(options, nullptr); !s.ok()) return s;
  return std::unique_ptr<Communicator>(std::move(comm));
}

Result<std::unique_ptr<Communicator>> Communicator::create(const CommunicatorOptions& options, Store& store) {
  auto comm = std::make_unique<Comm>();
  if (Status s = comm->init(options, &store); !s.ok()) return s;
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace stellar::coll

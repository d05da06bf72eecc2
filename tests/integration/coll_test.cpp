// Collectives across real processes (one per rank, forked) over loopback:
// every operation, data type and reduction against a serial reference, for
// sizes from 0 to several MiB with odd counts, on 2, 3 and 4 ranks, with and
// without fault injection; dead, hung and mismatched ranks.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include "coll/reduce.hpp"
#include "coll/rendezvous.hpp"
#include "coll/shared_memory.hpp"
#include "core/control_messages.hpp"
#include "stellar/coll.hpp"

using namespace stellar;
using namespace stellar::coll;
using namespace std::chrono_literals;

namespace {

uint16_t free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

CommunicatorOptions base_options(int rank, int world, uint16_t port) {
  CommunicatorOptions o;
  o.rank = rank;
  o.world_size = world;
  o.master_port = port;
  o.timeout = 20s;
  o.context.wait = WaitPolicy::adaptive;  // more processes than cores here
  // These ranks all share one host: the network path is what most tests
  // are about (loss, reordering, striping, dead peers on the wire), so the
  // shared-memory channel is turned on only by the tests that say so.
  o.shared_memory = false;
  return o;
}

// Runs body(communicator) in `world` forked processes. Returns each rank's
// exit code: body's return value, 100 + Errc when create() failed, or -signal.
// Ranks still running after `limit` are killed (a hang fails the test).
std::vector<int> run_ranks(int world, const std::function<int(Communicator&, int)>& body,
                           const std::function<void(CommunicatorOptions&)>& tweak = {}, std::chrono::seconds limit = 240s) {
  const uint16_t port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      // Sibling ranks may write into each other (single copy) also where
      // Yama's ptrace_scope is 1 (a launcher's ranks are siblings too; the
      // library itself does not loosen this, docs/security.md).
      ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
      CommunicatorOptions o = base_options(r, world, port);
      if (tweak) tweak(o);
      auto comm = Communicator::create(o);
      if (!comm) {
        std::fprintf(stderr, "rank %d: create: %s\n", r, comm.status().to_string().c_str());
        std::fflush(stderr);
        _exit(100 + int(comm.status().code()));
      }
      const int rc = body(**comm, r);
      comm->reset();
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(size_t(world), -1000);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  size_t done = 0;
  while (done < pids.size()) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -1000) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        ++done;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (codes[i] == -1000) {
          kill(pids[i], SIGKILL);
          waitpid(pids[i], nullptr, 0);
          codes[i] = -SIGKILL;
          ++done;
        }
    }
    std::this_thread::sleep_for(5ms);
  }
  return codes;
}

// ---- serial reference ----

double input_value(int rank, size_t i) { return double((rank * 7 + i * 3) % 5 + 1); }

void store(DataType t, void* buffer, size_t i, double v) {
  switch (t) {
    case DataType::float32: static_cast<float*>(buffer)[i] = float(v); break;
    case DataType::float64: static_cast<double*>(buffer)[i] = v; break;
    case DataType::int32: static_cast<int32_t*>(buffer)[i] = int32_t(v); break;
    case DataType::int64: static_cast<int64_t*>(buffer)[i] = int64_t(v); break;
    case DataType::uint8: static_cast<uint8_t*>(buffer)[i] = uint8_t(v); break;
    case DataType::int8: static_cast<int8_t*>(buffer)[i] = int8_t(v); break;
    case DataType::float16: static_cast<uint16_t*>(buffer)[i] = detail::float_to_half(float(v)); break;
    case DataType::bfloat16: static_cast<uint16_t*>(buffer)[i] = detail::float_to_bfloat16(float(v)); break;
  }
}

double load(DataType t, const void* buffer, size_t i) {
  switch (t) {
    case DataType::float32: return static_cast<const float*>(buffer)[i];
    case DataType::float64: return static_cast<const double*>(buffer)[i];
    case DataType::int32: return static_cast<const int32_t*>(buffer)[i];
    case DataType::int64: return double(static_cast<const int64_t*>(buffer)[i]);
    case DataType::uint8: return static_cast<const uint8_t*>(buffer)[i];
    case DataType::int8: return static_cast<const int8_t*>(buffer)[i];
    case DataType::float16: return detail::half_to_float(static_cast<const uint16_t*>(buffer)[i]);
    case DataType::bfloat16: return detail::bfloat16_to_float(static_cast<const uint16_t*>(buffer)[i]);
  }
  return 0;
}

bool is_integer(DataType t) { return t == DataType::int32 || t == DataType::int64 || t == DataType::uint8 || t == DataType::int8; }

double expected(ReduceOp op, DataType t, int world, size_t i, int index_shift = 0) {
  double acc = input_value(0, i + size_t(index_shift));
  for (int r = 1; r < world; ++r) {
    const double v = input_value(r, i + size_t(index_shift));
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += v; break;
      case ReduceOp::prod: acc *= v; break;
      case ReduceOp::min: acc = std::min(acc, v); break;
      case ReduceOp::max: acc = std::max(acc, v); break;
      case ReduceOp::band: acc = double(int64_t(acc) & int64_t(v)); break;
      case ReduceOp::bor: acc = double(int64_t(acc) | int64_t(v)); break;
      case ReduceOp::bxor: acc = double(int64_t(acc) ^ int64_t(v)); break;
    }
  }
  if (op == ReduceOp::avg) acc = is_integer(t) ? std::trunc(acc / world) : acc / world;
  return acc;
}

bool close_enough(DataType t, double got, double want) {
  const double tolerance = t == DataType::float16 || t == DataType::bfloat16 ? 1e-2 : t == DataType::float32 ? 1e-6 : 0;
  return std::fabs(got - want) <= tolerance * std::max(1.0, std::fabs(want));
}

constexpr DataType all_types[] = {DataType::float32, DataType::float16, DataType::bfloat16, DataType::float64,
                                  DataType::int32,   DataType::int64,   DataType::uint8,    DataType::int8};
constexpr ReduceOp all_ops[] = {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max, ReduceOp::avg, ReduceOp::band, ReduceOp::bor, ReduceOp::bxor};

bool is_bitwise(ReduceOp op) { return op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor; }
// Reductions whose exact result the inputs (1..5) keep within the type.
bool representable(DataType t, ReduceOp op) {
  if (is_bitwise(op)) return is_integer(t);
  return !(op == ReduceOp::prod && (t == DataType::uint8 || t == DataType::int8));  // 5^4 wraps
}

#define CHECK_OK(expr, what)                                                                     \
  do {                                                                                           \
    Status s_ = (expr);                                                                          \
    if (!s_.ok()) {                                                                              \
      std::fprintf(stderr, "rank %d: %s: %s\n", comm.rank(), what, s_.to_string().c_str());     \
      return 2;                                                                                  \
    }                                                                                            \
  } while (0)

// Returns the number of wrong values (and prints the first).
size_t compare(const char* what, DataType t, ReduceOp op, const void* got, size_t count, int world, int rank, size_t shift = 0) {
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const double want = expected(op, t, world, i, int(shift));
    const double have = load(t, got, i);
    if (!close_enough(t, have, want)) {
      if (!wrong)
        std::fprintf(stderr, "rank %d: %s %s/%s count %zu: [%zu] = %g, want %g\n", rank, what, to_string(t), to_string(op), count, i, have, want);
      ++wrong;
    }
  }
  return wrong;
}

// Every operation, type and reduction at the given element counts.
int exercise_all(Communicator& comm, const std::vector<size_t>& counts, bool full_matrix) {
  const int world = comm.size(), rank = comm.rank();
  size_t wrong = 0;
  for (DataType t : all_types) {
    const size_t e = size_of(t);
    for (size_t count : counts) {
      for (ReduceOp op : all_ops) {
        if (!full_matrix && op != ReduceOp::sum && op != ReduceOp::avg) continue;
        if (!representable(t, op)) continue;
        std::vector<uint8_t> in(count * e + 1), out(count * e + 1, 0xee);
        for (size_t i = 0; i < count; ++i) store(t, in.data(), i, input_value(rank, i));
        // out of place, then in place
        CHECK_OK(comm.allreduce(in.data(), out.data(), count, t, op), "allreduce");
        wrong += compare("allreduce", t, op, out.data(), count, world, rank);
        CHECK_OK(comm.allreduce(in.data(), in.data(), count, t, op), "allreduce in place");
        wrong += compare("allreduce in place", t, op, in.data(), count, world, rank);
      }
      // reduce-scatter: block r of a world*count vector.
      {
        const ReduceOp op = full_matrix ? ReduceOp::max : ReduceOp::sum;
        std::vector<uint8_t> in(count * e * size_t(world) + 1), out(count * e + 1);
        for (size_t i = 0; i < count * size_t(world); ++i) store(t, in.data(), i, input_value(rank, i));
        CHECK_OK(comm.reduce_scatter(in.data(), out.data(), count, t, op), "reduce_scatter");
        wrong += compare("reduce_scatter", t, op, out.data(), count, world, rank, size_t(rank) * count);
        for (ReduceOp o2 : {ReduceOp::sum, ReduceOp::avg}) {
          for (size_t i = 0; i < count * size_t(world); ++i) store(t, in.data(), i, input_value(rank, i));
          CHECK_OK(comm.reduce_scatter(in.data(), in.data() + size_t(rank) * count * e, count, t, o2), "reduce_scatter in place");
          wrong += compare("reduce_scatter in place", t, o2, in.data() + size_t(rank) * count * e, count, world, rank, size_t(rank) * count);
        }
      }
      // allgather: block r comes from rank r.
      {
        std::vector<uint8_t> mine(count * e + 1), all(count * e * size_t(world) + 1);
        for (size_t i = 0; i < count; ++i) store(t, mine.data(), i, double((rank + 1) * 3 + i % 7));
        CHECK_OK(comm.allgather(mine.data(), all.data(), count, t), "allgather");
        for (int r = 0; r < world; ++r)
          for (size_t i = 0; i < count; ++i)
            if (load(t, all.data(), size_t(r) * count + i) != load(t, mine.data(), i) - double((rank + 1) * 3) + double((r + 1) * 3)) {
              if (!wrong) std::fprintf(stderr, "rank %d: allgather %s count %zu: block %d [%zu] wrong\n", rank, to_string(t), count, r, i);
              ++wrong;
            }
      }
      // reduce to every root: the result on the root only, in and out of place.
      for (int root = 0; root < world; ++root) {
        const ReduceOp op = full_matrix && is_integer(t) ? ReduceOp::bxor : full_matrix ? ReduceOp::min : ReduceOp::sum;
        std::vector<uint8_t> in(count * e + 1), out(count * e + 1, 0xee);
        for (size_t i = 0; i < count; ++i) store(t, in.data(), i, input_value(rank, i));
        const std::vector<uint8_t> original = in;
        CHECK_OK(comm.reduce(in.data(), rank == root ? out.data() : nullptr, count, t, op, root), "reduce");
        if (rank == root) wrong += compare("reduce", t, op, out.data(), count, world, rank);
        if (in != original) {
          if (!wrong) std::fprintf(stderr, "rank %d: reduce %s root %d changed its input\n", rank, to_string(t), root);
          ++wrong;
        }
        CHECK_OK(comm.reduce(in.data(), in.data(), count, t, ReduceOp::sum, root), "reduce in place");
        if (rank == root) wrong += compare("reduce in place", t, ReduceOp::sum, in.data(), count, world, rank);
      }
      // all-to-all with uneven blocks: rank r sends rank q (count + r + 2q) % 5 + count / 3 elements of value r * 10 + q + i % 3.
      {
        auto block = [&](int from, int to) { return size_t((count + size_t(from) + 2 * size_t(to)) % 5 + count / 3); };
        const auto n = static_cast<size_t>(world);
        std::vector<size_t> send_counts(n), send_offsets(n), recv_counts(n), recv_offsets(n);
        size_t send_total = 0, recv_total = 0;
        for (int q = 0; q < world; ++q) {
          send_counts[size_t(q)] = block(rank, q);
          send_offsets[size_t(q)] = send_total + 1;  // a gap of one element before each block
          send_total += block(rank, q) + 1;
          recv_counts[size_t(q)] = block(q, rank);
          recv_offsets[size_t(q)] = recv_total;
          recv_total += block(q, rank) + 2;
        }
        std::vector<uint8_t> in(send_total * e + 1), out(recv_total * e + 1);
        for (int q = 0; q < world; ++q)
          for (size_t i = 0; i < send_counts[size_t(q)]; ++i) store(t, in.data(), send_offsets[size_t(q)] + i, double(rank * 10 + q + int(i % 3)));
        CHECK_OK(comm.all_to_all(in.data(), send_counts.data(), send_offsets.data(), out.data(), recv_counts.data(), recv_offsets.data(), t), "all_to_all");
        for (int q = 0; q < world; ++q)
          for (size_t i = 0; i < recv_counts[size_t(q)]; ++i)
            if (load(t, out.data(), recv_offsets[size_t(q)] + i) != double(q * 10 + rank + int(i % 3))) {
              if (!wrong) std::fprintf(stderr, "rank %d: all_to_all %s count %zu: block from %d [%zu] wrong\n", rank, to_string(t), count, q, i);
              ++wrong;
            }
      }
      // broadcast from every root.
      for (int root = 0; root < world; ++root) {
        std::vector<uint8_t> buffer(count * e + 1);
        for (size_t i = 0; i < count; ++i) store(t, buffer.data(), i, rank == root ? double(root + 1 + i % 11) : -1.0);
        CHECK_OK(comm.broadcast(buffer.data(), count, t, root), "broadcast");
        for (size_t i = 0; i < count; ++i)
          if (load(t, buffer.data(), i) != double(root + 1 + i % 11)) {
            if (!wrong) std::fprintf(stderr, "rank %d: broadcast %s root %d count %zu: [%zu] wrong\n", rank, to_string(t), root, count, i);
            ++wrong;
          }
      }
    }
  }
  CHECK_OK(comm.barrier(), "barrier");
  return wrong ? 3 : 0;
}

void expect_all_zero(const std::vector<int>& codes) {
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Chunks of 8 KiB so that a few MiB cross many pipelined chunks; sizes cover
// 0, 1, counts below, at and above the rank count and odd counts, below and
// above the recursive-doubling threshold.
void small_chunks(CommunicatorOptions& o) {
  o.chunk_bytes = 8192;
  o.small_message_bytes = 4096;
}

}  // namespace

TEST(Collectives, EveryOperationTypeAndReductionOnTwoRanks) {
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return exercise_all(c, {0, 1, 2, 3, 1001, 12347}, true); }, small_chunks));
}

TEST(Collectives, EveryOperationTypeAndReductionOnThreeRanks) {
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return exercise_all(c, {0, 1, 2, 5, 1001, 12347}, true); }, small_chunks));
}

TEST(Collectives, EveryOperationTypeAndReductionOnFourRanks) {
  expect_all_zero(run_ranks(4, [](Communicator& c, int) { return exercise_all(c, {0, 3, 4, 7, 4099}, true); }, small_chunks));
}

TEST(Collectives, SeveralMebibytesWithDefaultChunks) {
  // 3 ranks, 2^20 + 3 elements: 4 MiB of float, 8 MiB of double and int64.
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return exercise_all(c, {(1u << 20) + 3}, false); }));
}

TEST(Collectives, CorrectUnderInjectedLossDuplicationAndReordering) {
  auto faults = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.context.faults = FaultOptions{0.02, 0.01, 0.02, 0};
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return exercise_all(c, {1, 7, 3001, 40000}, false); }, faults));
}

TEST(Collectives, StripedOverThreeQpsPerPeerUnderInjectedFaults) {
  // 64 KiB chunks split into 24+24+16 KiB parts on three QPs per peer; the
  // parts of one message travel (and are lost, duplicated, reordered)
  // independently and must be put back together. Messages under 32 KiB
  // (the small counts, the recursive-doubling exchanges) stay on QP 0.
  auto striped = [](CommunicatorOptions& o) {
    o.chunk_bytes = 64 * 1024;
    o.small_message_bytes = 4096;
    o.qps_per_peer = 3;
    o.context.faults = FaultOptions{0.02, 0.01, 0.02, 0};
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return exercise_all(c, {1, 7, 3001, 40000, 100003}, false); }, striped));
}

// Direct gather: an allreduce and an allgather of int32 (exact sums), in
// place and out of place, large enough for the ring; `expect_in_place` says
// whether the previous rank writes this rank's gather chunks straight into
// its output (CommunicatorCounters::bytes_gathered_in_place) or not.
int gather_directly(Communicator& comm, bool expect_in_place) {
  const int world = comm.size(), rank = comm.rank();
  const size_t count = 100003;  // over the recursive-doubling threshold, odd, many 8 KiB chunks
  std::vector<int32_t> input(count), output(count), in_place(count);
  for (size_t i = 0; i < count; ++i) in_place[i] = input[i] = int32_t(i % 1000) * (rank + 1) - rank;
  const uint64_t before = comm.counters().bytes_gathered_in_place;
  if (!comm.allreduce(input.data(), output.data(), count, DataType::int32, ReduceOp::sum).ok()) return 1;
  if (!comm.allreduce(in_place.data(), in_place.data(), count, DataType::int32, ReduceOp::sum).ok()) return 2;
  const uint64_t after_allreduce = comm.counters().bytes_gathered_in_place;
  if (comm.counters().allreduce_ring == 0) return 7;  // the ring (direct gather) is what this tests
  for (size_t i = 0; i < count; ++i) {
    int64_t expected = 0;
    for (int r = 0; r < world; ++r) expected += int64_t(i % 1000) * (r + 1) - r;
    if (output[i] != expected || in_place[i] != expected) return 3;
  }
  const size_t block = 30011;
  std::vector<int32_t> mine(block), gathered(block * size_t(world));
  for (size_t i = 0; i < block; ++i) mine[i] = int32_t(i) * 7 + rank * 1000003;
  if (!comm.allgather(mine.data(), gathered.data(), block, DataType::int32).ok()) return 4;
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < block; ++i)
      if (gathered[size_t(r) * block + i] != int32_t(i) * 7 + r * 1000003) return 5;
  // Each of the two calls gathered in place (or neither did).
  const uint64_t allreduce_bytes = after_allreduce - before, allgather_bytes = comm.counters().bytes_gathered_in_place - after_allreduce;
  if (expect_in_place != (allreduce_bytes > 0) || expect_in_place != (allgather_bytes > 0)) {
    std::fprintf(stderr, "rank %d: %llu allreduce and %llu allgather bytes gathered in place, expected %s\n", rank,
                 (unsigned long long)allreduce_bytes, (unsigned long long)allgather_bytes, expect_in_place ? "some" : "none");
    return 6;
  }
  return 0;
}

TEST(Collectives, DirectGatherWritesIntoTheOutputWherePairsAllowIt) {
  // Every pair allows it (the default): every rank's gather chunks land in place.
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return gather_directly(c, true); }, small_chunks));
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return gather_directly(c, true); }, small_chunks));
  // Rank 1 refuses: the pairs (0,1) and (1,2) use landing slots, so only
  // rank 0, whose previous rank is 2, receives in place.
  auto rank1_refuses = [](CommunicatorOptions& o) {
    small_chunks(o);
    if (o.rank == 1) o.direct_gather = false;
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int rank) { return gather_directly(c, rank == 0); }, rank1_refuses));
  // Under loss, duplication and reordering, and in roce mode (go-back-N).
  auto faults = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.context.faults = FaultOptions{0.02, 0.01, 0.02, 0};
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return gather_directly(c, true); }, faults));
  auto roce = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.context.mode = Mode::roce;
  };
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return gather_directly(c, true); }, roce));
  // Striped over three QPs per peer: each part lands at its offset.
  auto striped = [](CommunicatorOptions& o) {
    o.chunk_bytes = 64 * 1024;
    o.small_message_bytes = 4096;
    o.qps_per_peer = 3;
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return gather_directly(c, true); }, striped));
  // Ranks 0 and 1 share memory, rank 2 stays on the network: the network
  // pairs (1,2) and (2,0) write in place with RDMA WRITEs, the pair (0,1)
  // with process_vm_writev, so every rank receives in place.
  auto mixed = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.shared_memory = o.rank != 2;
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return gather_directly(c, true); }, mixed));
}

TEST(Collectives, ForcedAlgorithmsAgreeOnNonPowerOfTwoRanks) {
  for (auto algorithm : {AllreduceAlgorithm::ring, AllreduceAlgorithm::recursive_doubling}) {
    auto forced = [algorithm](CommunicatorOptions& o) {
      small_chunks(o);
      o.allreduce_algorithm = algorithm;
    };
    expect_all_zero(run_ranks(3, [](Communicator& c, int) { return exercise_all(c, {1, 2, 999, 20001}, false); }, forced));
  }
}

// Recursive halving and doubling: powers of two and not (ranks past the
// largest power of two fold in and out), every reduction and type, counts
// that split unevenly down to empty halves, over the network under injected
// faults and over shared memory.
TEST(Collectives, HalvingDoublingOnEveryRankCount) {
  auto forced = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.allreduce_algorithm = AllreduceAlgorithm::halving_doubling;
  };
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return exercise_all(c, {1, 3, 999, 20001}, true); }, forced));
  expect_all_zero(run_ranks(4, [](Communicator& c, int) { return exercise_all(c, {1, 2, 3, 5, 999, 20001}, true); }, forced));
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return exercise_all(c, {1, 7, 20001}, false); }, forced));
  expect_all_zero(run_ranks(5, [](Communicator& c, int) { return exercise_all(c, {3, 4099}, false); }, forced));
  auto lossy = [&forced](CommunicatorOptions& o) {
    forced(o);
    o.context.faults = FaultOptions{0.02, 0.01, 0.02, 0};
  };
  expect_all_zero(run_ranks(4, [](Communicator& c, int) { return exercise_all(c, {1001, 40000}, false); }, lossy));
  auto shared = [&forced](CommunicatorOptions& o) {
    forced(o);
    o.shared_memory = true;
  };
  expect_all_zero(run_ranks(4, [](Communicator& c, int) { return exercise_all(c, {0, 1, 12347}, true); }, shared));
  // Automatic picks it on 4 ranks up to 512 KiB (and the ring above): the same results.
  expect_all_zero(run_ranks(4, [](Communicator& c, int) {
    if (int rc = exercise_all(c, {(256u << 10) / 4 + 1}, false); rc != 0) return rc;
    const CommunicatorCounters n = c.counters();
    return n.allreduce_halving_doubling > 0 && n.allreduce_ring > 0 ? 0 : 8;  // float64's 512 KiB + 8 bytes take the ring
  }, [](CommunicatorOptions& o) { o.chunk_bytes = 64 * 1024; }));
}

// Oversubscription (issue 16): each rank's affinity mask is narrowed to one
// CPU, so 3 ranks on this host are more than the CPUs each may use: the
// communicator waits adaptively instead of spinning, says so in its
// counters, and still computes right; told not to adapt, it keeps busy.
TEST(Collectives, MoreRanksOnTheHostThanCpusWaitAdaptively) {
  // Busy polling asked for (the suite's default is adaptive: more processes than cores here).
  auto one_cpu = [](CommunicatorOptions& o) {
    o.context.wait = WaitPolicy::busy_poll;
    // The first CPU this process may use (a container's cpuset may not hold CPU 0).
    cpu_set_t mine, one;
    sched_getaffinity(0, sizeof mine, &mine);
    int first = 0;
    while (first < CPU_SETSIZE - 1 && !CPU_ISSET(first, &mine)) ++first;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) _exit(90);
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int) {
    const CommunicatorCounters k = c.counters();
    if (k.local_ranks != 3 || k.cpus != 1 || !k.oversubscribed) return 1;
    if (k.wait != WaitPolicy::adaptive) return 2;
    return exercise_all(c, {1, 4099}, false);
  }, one_cpu));
  expect_all_zero(run_ranks(2, [](Communicator& c, int) {
    const CommunicatorCounters k = c.counters();
    return k.oversubscribed && k.wait == WaitPolicy::busy_poll ? 0 : 1;
  }, [&](CommunicatorOptions& o) {
    one_cpu(o);
    o.adapt_wait = false;
  }));
  // With the whole machine: oversubscribed only if it has fewer CPUs than busy threads.
  cpu_set_t all;
  sched_getaffinity(0, sizeof all, &all);
  const int cpus = CPU_COUNT(&all);
  expect_all_zero(run_ranks(2, [cpus](Communicator& c, int) {
    const CommunicatorCounters k = c.counters();
    // Two threads a rank when the engines run on threads of their own (STELLAR_ENGINE=thread).
    const bool over = (k.placement == ProgressMode::thread ? 4 : 2) > cpus;
    if (k.local_ranks != 2 || k.cpus != cpus || k.oversubscribed != over) return 1;
    return k.wait == (over ? WaitPolicy::adaptive : WaitPolicy::busy_poll) ? 0 : 2;
  }, [](CommunicatorOptions& o) { o.context.wait = WaitPolicy::busy_poll; }));
}

// A valid hello of rank 1 in a 2-rank job, through text as on the wire
// (numbers then parse as unsigned).
static control::json valid_hello() {
  QpEndpoint e;
  e.address = "127.0.0.1";
  e.udp_port = 40000;
  e.qp_num = 7;
  e.token = 1;
  return control::json::parse(control::json{{"type", "hello"}, {"version", 4}, {"rank", 1}, {"host", "0123456789abcdef"}, {"cpus", "3"},
                                            {"world_size", 2}, {"mode", "stellar"}, {"slots", 4}, {"chunk_bytes", 524288},
                                            {"allreduce_algorithm", 0}, {"small_message_bytes", 65536}, {"qps_per_peer", 1},
                                            {"endpoints", {control::json::array({control::endpoint_json(e)}), nullptr}},
                                            {"landing", {{{"addr", 4096}}, nullptr}}, {"landing_rkey", 9}}.dump());
}

// The hello's host and CPU mask are checked like its other fields: a rank
// that sends garbage there is refused with the reason, not trusted.
TEST(Rendezvous, HostAndCpuMaskAreChecked) {
  const control::json good = valid_hello();
  ASSERT_TRUE(coll::check_hello(good, 2, good)) << coll::check_hello(good, 2, good).status().to_string();
  for (auto [key, value] : std::vector<std::pair<const char*, control::json>>{
           {"host", 5}, {"host", std::string(65, 'a')}, {"cpus", "xyz"}, {"cpus", ""}, {"cpus", std::string(257, 'f')}, {"cpus", 3}}) {
    control::json bad = good;
    bad[key] = control::json::parse(value.dump());
    auto r = coll::check_hello(bad, 2, good);
    EXPECT_FALSE(r) << key << " = " << value.dump();
    if (!r) {
      EXPECT_EQ(r.status().code(), Errc::protocol_error);
    }
  }
  for (const char* key : {"host", "cpus"}) {
    control::json missing = good;
    missing.erase(key);
    EXPECT_FALSE(coll::check_hello(missing, 2, good)) << key;
  }
}

TEST(Collectives, RoceModeToo) {
  auto roce = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.context.mode = Mode::roce;
  };
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return exercise_all(c, {5, 30001}, false); }, roce));
}

TEST(Collectives, ADeadRankFailsTheOthersWithinTheTimeout) {
  auto short_timeout = [](CommunicatorOptions& o) { o.timeout = 2s; };
  const auto codes = run_ranks(
      3,
      [](Communicator& comm, int rank) {
        if (rank == 2) _exit(0);  // dies without a word
        std::vector<float> v(100000, 1.0f);
        Status s = comm.allreduce(v.data(), v.data(), v.size(), DataType::float32, ReduceOp::sum);
        if (s.ok()) return 1;
        std::fprintf(stderr, "rank %d got the expected error: %s\n", rank, s.to_string().c_str());
        // The communicator stays broken with the same error.
        Status again = comm.barrier();
        return again.ok() ? 4 : (s.code() == Errc::timeout || s.code() == Errc::io_error ? 0 : 5);
      },
      short_timeout, 60s);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(codes[2], 0);
}

TEST(Collectives, AHungRankFailsTheOthersWithinTheTimeout) {
  auto short_timeout = [](CommunicatorOptions& o) { o.timeout = 2s; };
  const auto codes = run_ranks(
      2,
      [](Communicator& comm, int rank) -> int {
        if (rank == 1) raise(SIGSTOP);  // hangs (engine thread included) until the harness kills it
        std::vector<int32_t> v(10, 1);
        Status s = comm.allreduce(v.data(), v.data(), v.size(), DataType::int32, ReduceOp::sum);
        std::fprintf(stderr, "rank %d: %s\n", rank, s.to_string().c_str());
        _exit(s.ok() ? 1 : 0);  // skip the goodbye: the peer is stopped
      },
      short_timeout, 15s);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], -SIGKILL);
}

TEST(Collectives, MismatchedCountsOrTypesGetAnErrorNotCorruptData) {
  for (int variant = 0; variant < 3; ++variant) {
    auto short_timeout = [](CommunicatorOptions& o) { o.timeout = 5s; };
    const auto codes = run_ranks(
        2,
        [variant](Communicator& comm, int rank) {
          std::vector<float> v(300000, 1.0f);
          Status s;
          if (variant == 0) s = comm.allreduce(v.data(), v.data(), rank == 0 ? 1000 : 2000, DataType::float32, ReduceOp::sum);
          if (variant == 1) s = comm.allreduce(v.data(), v.data(), 1000, rank == 0 ? DataType::float32 : DataType::int32, ReduceOp::sum);
          if (variant == 2) s = comm.allreduce(v.data(), v.data(), rank == 0 ? 200000 : 100000, DataType::float32, ReduceOp::max);
          if (s.ok()) return 1;
          std::fprintf(stderr, "rank %d (variant %d): %s\n", rank, variant, s.to_string().c_str());
          return 0;
        },
        short_timeout, 60s);
    EXPECT_EQ(codes[0], 0) << "variant " << variant;
    EXPECT_EQ(codes[1], 0) << "variant " << variant;
  }
}

TEST(Collectives, RanksThatDisagreeOnJobParametersFailAtBootstrap) {
  auto disagree = [](CommunicatorOptions& o) {
    o.timeout = 5s;
    if (o.rank == 1) o.chunk_bytes = 16384;  // job parameters must match too
  };
  const auto codes = run_ranks(2, [](Communicator&, int) { return 0; }, disagree, 30s);
  EXPECT_NE(codes[0], 0);
  EXPECT_NE(codes[1], 0);
  auto stripes_differ = [](CommunicatorOptions& o) {
    o.timeout = 5s;
    if (o.rank == 1) o.qps_per_peer = 2;
  };
  const auto striped = run_ranks(2, [](Communicator&, int) { return 0; }, stripes_differ, 30s);
  EXPECT_NE(striped[0], 0);
  EXPECT_NE(striped[1], 0);
}

TEST(Collectives, ASingleRankWorldCopies) {
  const auto codes = run_ranks(1, [](Communicator& c, int) { return exercise_all(c, {0, 5, 100}, true); });
  expect_all_zero(codes);
}

// ---- point to point ----

// Both ranks of each pair start a send and a receive of several landing
// slots' worth (more than the channel buffers) before waiting for either:
// progress must interleave them, as torch's isend/irecv need. Then many
// small messages with tags, a zero-byte one, and a collective right after.
int point_to_point(Communicator& comm) {
  const int rank = comm.rank(), world = comm.size();
  const int to = (rank + 1) % world, from = (rank - 1 + world) % world;
  for (size_t bytes : {size_t(0), size_t(1), size_t(4095), size_t(3) << 20}) {
    std::vector<uint8_t> out(bytes + 1), in(bytes + 1, 0xee);
    for (size_t i = 0; i < bytes; ++i) out[i] = uint8_t(i * 7 + rank);
    auto sent = comm.start_send(to, out.data(), bytes, 5);
    auto received = comm.start_recv(from, in.data(), bytes, 5);
    if (!sent || !received) return 2;
    CHECK_OK(comm.wait(*received), "wait recv");
    CHECK_OK(comm.wait(*sent), "wait send");
    for (size_t i = 0; i < bytes; ++i)
      if (in[i] != uint8_t(i * 7 + from)) {
        std::fprintf(stderr, "rank %d: %zu-byte recv [%zu] wrong\n", rank, bytes, i);
        return 3;
      }
    if (in[bytes] != 0xee) return 4;  // nothing written past the end
  }
  // 40 small messages in flight each way (more than the slots), checked by test().
  std::vector<std::vector<int32_t>> outs(40), ins(40);
  std::vector<uint64_t> ids;
  for (int k = 0; k < 40; ++k) {
    outs[size_t(k)].assign(size_t(k + 1), rank * 1000 + k);
    ins[size_t(k)].assign(size_t(k + 1), -1);
    auto r = comm.start_recv(from, ins[size_t(k)].data(), ins[size_t(k)].size() * 4, uint32_t(k));
    auto s = comm.start_send(to, outs[size_t(k)].data(), outs[size_t(k)].size() * 4, uint32_t(k));
    if (!r || !s) return 5;
    ids.push_back(*r);
    ids.push_back(*s);
  }
  for (uint64_t id : ids) {
    while (true) {
      auto done = comm.test(id);
      if (!done) {
        std::fprintf(stderr, "rank %d: test: %s\n", rank, done.status().to_string().c_str());
        return 6;
      }
      if (*done) break;
    }
  }
  for (int k = 0; k < 40; ++k)
    for (int32_t v : ins[size_t(k)])
      if (v != from * 1000 + k) return 7;
  // A collective right after outstanding sends: they complete first.
  int32_t value = rank;
  std::vector<int32_t> late(1000, rank);
  std::vector<int32_t> late_in(1000, -1);
  auto s = comm.start_send(to, late.data(), 4000, 99);
  auto r = comm.start_recv(from, late_in.data(), 4000, 99);
  if (!s || !r) return 8;
  CHECK_OK(comm.allreduce(&value, &value, 1, DataType::int32, ReduceOp::sum), "allreduce after sends");
  if (value != world * (world - 1) / 2) return 9;
  auto done = comm.test(*r);
  if (!done || !*done || late_in[999] != from) return 10;
  return 0;
}

TEST(PointToPoint, SendsAndReceivesInterleaveWithoutDeadlock) {
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return point_to_point(c); }));
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return point_to_point(c); }, [](CommunicatorOptions& o) { o.shared_memory = true; }));
}

// Credits are coalesced (one per slots/2 freed), so a receiver may owe a
// sender the credit it needs while it waits on someone else. Rank 0 sends
// five messages to rank 1 (one more than the four slots) and needs the
// fifth posted before it can send to rank 2; rank 1 takes the first, then
// waits for rank 2, which waits for rank 0. Rank 1 owes one credit, below
// a batch: only the idle flush lets rank 0 go on, well inside the timeout.
TEST(PointToPoint, AReceiverReturnsOwedCreditsWhileItWaitsElsewhere) {
  auto opts = [](CommunicatorOptions& o) {
    o.slots = 4;
    o.timeout = 5s;
  };
  expect_all_zero(run_ranks(
      3,
      [](Communicator& comm, int rank) {
        std::vector<int32_t> m(5 * 64, rank), x(64, 7);
        if (rank == 0) {
          std::vector<uint64_t> ids;
          for (int k = 0; k < 5; ++k) {
            auto id = comm.start_send(1, m.data() + 64 * k, 256, uint32_t(k));
            if (!id) return 2;
            ids.push_back(*id);
          }
          CHECK_OK(comm.wait(ids.back()), "wait for the fifth send");
          auto id = comm.start_send(2, x.data(), 256, 9);
          if (!id) return 3;
          CHECK_OK(comm.wait(*id), "send to rank 2");
          for (uint64_t i : ids) CHECK_OK(comm.wait(i), "sends to rank 1");
        } else if (rank == 1) {
          std::vector<int32_t> in(5 * 64, -1), y(64, -1);
          auto first = comm.start_recv(0, in.data(), 256, 0);
          if (!first) return 4;
          CHECK_OK(comm.wait(*first), "first message");
          auto from2 = comm.start_recv(2, y.data(), 256, 9);
          if (!from2) return 5;
          CHECK_OK(comm.wait(*from2), "rank 2's message");
          for (int k = 1; k < 5; ++k) {
            auto id = comm.start_recv(0, in.data() + 64 * k, 256, uint32_t(k));
            if (!id) return 6;
            CHECK_OK(comm.wait(*id), "the rest from rank 0");
          }
          for (int32_t v : in)
            if (v != 0) return 7;
          if (y[0] != 7) return 8;
        } else {
          std::vector<int32_t> in(64, -1);
          auto id = comm.start_recv(0, in.data(), 256, 9);
          if (!id) return 9;
          CHECK_OK(comm.wait(*id), "rank 0's message");
          auto out = comm.start_send(1, in.data(), 256, 9);
          if (!out) return 10;
          CHECK_OK(comm.wait(*out), "send to rank 1");
        }
        return 0;
      },
      opts, 60s));
}

TEST(PointToPoint, MismatchedSizesOrTagsAndSilentPeersAreErrors) {
  auto short_timeout = [](CommunicatorOptions& o) { o.timeout = 3s; };
  for (int variant = 0; variant < 3; ++variant) {
    const auto codes = run_ranks(
        2,
        [variant](Communicator& comm, int rank) {
          std::vector<uint8_t> buffer(10000);
          Status s;
          if (rank == 0 && variant < 2) {
            auto id = comm.start_send(1, buffer.data(), 100, 1);
            if (!id) return 1;
            s = comm.wait(*id);
            // The send itself completes (the transport acknowledged it);
            // the receiver is the one that sees the mismatch. Wait for its verdict.
            int32_t v = 0;
            (void)comm.allreduce(&v, &v, 1, DataType::int32, ReduceOp::sum);
            return s.ok() ? 0 : 1;
          }
          if (rank == 0) {  // variant 2: the sender never sends
            std::this_thread::sleep_for(6s);
            return 0;
          }
          auto id = comm.start_recv(0, buffer.data(), variant == 0 ? 200 : 100, variant == 1 ? 2 : 1);
          if (!id) return 1;
          s = comm.wait(*id);
          std::fprintf(stderr, "rank 1 (variant %d): %s\n", variant, s.to_string().c_str());
          if (variant < 2) return s.code() == Errc::protocol_error ? 0 : 2;
          return s.code() == Errc::timeout ? 0 : 3;
        },
        short_timeout, 60s);
    EXPECT_EQ(codes[1], 0) << "variant " << variant;
  }
  // Arguments are checked before anything moves.
  const auto codes = run_ranks(2, [](Communicator& comm, int rank) {
    uint8_t b = 0;
    if (comm.start_send(rank, &b, 1, 0).ok() || comm.start_recv(7, &b, 1, 0).ok() || comm.start_send(1 - rank, nullptr, 1, 0).ok()) return 1;
    if (comm.test(12345).ok()) return 2;
    float f = 1;
    if (comm.allreduce(&f, &f, 1, DataType::float32, ReduceOp::band).code() != Errc::invalid_argument) return 3;
    return 0;
  });
  expect_all_zero(codes);
}

// ---- the rendezvous through a store (torch.distributed's) ----

// A store in a directory: set writes a file and renames it into place, get
// polls for it, as torch's FileStore works across processes.
class DirectoryStore final : public Store {
 public:
  explicit DirectoryStore(std::string dir) : dir_(std::move(dir)) {}
  Status set(const std::string& key, const std::string& value) override {
    const std::string path = dir_ + "/" + escape(key);
    {
      std::ofstream out(path + ".tmp", std::ios::binary);
      out << value;
      if (!out) return Status(Errc::io_error, "cannot write " + path);
    }
    std::filesystem::rename(path + ".tmp", path);
    return {};
  }
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      std::ifstream in(dir_ + "/" + escape(key), std::ios::binary);
      if (in) return std::string(std::istreambuf_iterator<char>(in), {});
      if (std::chrono::steady_clock::now() > deadline) return Status(Errc::timeout, "no key " + key);
      std::this_thread::sleep_for(2ms);
    }
  }

 private:
  static std::string escape(std::string key) {
    for (char& c : key)
      if (c == '/') c = '_';
    return key;
  }
  std::string dir_;
};

// Forks `world` ranks that meet through a DirectoryStore (no rendezvous port).
// Only ranks below `started` (default: all) are forked, to leave some missing.
std::vector<int> run_ranks_with_store(int world, bool shared, const std::function<int(Communicator&, int)>& body,
                                      const std::function<void(int, DirectoryStore&)>& before = {}, int started = -1,
                                      std::chrono::milliseconds timeout = 10s) {
  if (started < 0) started = world;
  char dir[] = "/tmp/stellar-store-XXXXXX";
  if (!mkdtemp(dir)) return std::vector<int>(size_t(world), -1);
  std::vector<pid_t> pids;
  for (int r = 0; r < started; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // single copy between siblings under Yama too (see run_ranks)
      DirectoryStore store(dir);
      if (before) before(r, store);
      CommunicatorOptions o = base_options(r, world, 1);  // port 1: nobody serves or dials it
      o.timeout = timeout;
      o.shared_memory = shared;
      auto comm = Communicator::create(o, store);
      if (!comm) {
        std::fprintf(stderr, "rank %d: create through the store: %s\n", r, comm.status().to_string().c_str());
        _exit(100 + int(comm.status().code()));
      }
      const int rc = body(**comm, r);
      comm->reset();
      _exit(rc);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
  }
  std::filesystem::remove_all(dir);
  return codes;
}

TEST(StoreRendezvous, RanksMeetThroughTheStoreOnTheNetworkAndOnSharedMemory) {
  for (bool shared : {false, true}) {
    const auto codes = run_ranks_with_store(3, shared, [shared](Communicator& c, int) {
      if (c.counters().shared_memory_peers != (shared ? 2 : 0)) return 9;
      if (c.counters().shared_memory_single_copy_peers != (shared ? 2 : 0)) return 10;  // the probe's flag arrives before the store's readies
      return exercise_all(c, {1, 1001, 70000}, false);
    });
    expect_all_zero(codes);
  }
}

TEST(StoreRendezvous, BadEntriesAndMissingRanksFailWithAMessage) {
  // Garbage under rank 1's key (a stray writer to the store), and rank 1
  // never starts: rank 0 fails on the garbage at once, not at the timeout.
  auto garbage = [](int r, DirectoryStore& store) {
    if (r == 0) (void)store.set("stellar/coll/hello/1", "{\"type\":\"hello\",\"rank\":\"one\"}");
  };
  auto t0 = std::chrono::steady_clock::now();
  auto codes = run_ranks_with_store(2, false, [](Communicator&, int) { return 0; }, garbage, 1, 20s);
  ASSERT_EQ(codes.size(), 1u);
  EXPECT_EQ(codes[0], 100 + int(Errc::protocol_error));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  // A well-formed hello under the wrong key (rank 1's process replays rank
  // 0's hello as its own, then leaves) is refused the same way.
  auto impostor = [](int r, DirectoryStore& store) {
    if (r != 1) return;
    auto hello = store.get("stellar/coll/hello/0", 10s);
    if (hello) (void)store.set("stellar/coll/hello/1", *hello);
    _exit(77);
  };
  codes = run_ranks_with_store(2, false, [](Communicator&, int) { return 0; }, impostor, 2, 20s);
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[0], 100 + int(Errc::protocol_error));
  EXPECT_EQ(codes[1], 77);
  // Rank 2 of 3 never arrives: the two that did time out (bounded by the
  // 2 s timeout), never hang.
  codes = run_ranks_with_store(3, false, [](Communicator&, int) { return 0; }, {}, 2, 2s);
  ASSERT_EQ(codes.size(), 2u);
  for (int c : codes) EXPECT_EQ(c, 100 + int(Errc::timeout));
  // A world of one needs nobody.
  expect_all_zero(run_ranks_with_store(1, false, [](Communicator&, int) { return 0; }));
}

// ---- the shared-memory channel between ranks on one host ----

void shared_memory(CommunicatorOptions& o) { o.shared_memory = true; }

// The Stellar segments now in /dev/shm: a run must leave none behind.
std::set<std::string> segments_in_dev_shm() {
  std::set<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec))
    if (entry.path().filename().string().rfind("stellar-coll-", 0) == 0) names.insert(entry.path().filename().string());
  return names;
}

// No segment of this test's ranks is left (others' stale ones may go).
void expect_no_new_segments(const std::set<std::string>& before) {
  for (const std::string& name : segments_in_dev_shm()) EXPECT_TRUE(before.count(name)) << "left in /dev/shm: " << name;
}

// Every rank reports its peers on shared memory, then the whole matrix.
int all_peers_shared_then(Communicator& c, const std::vector<size_t>& counts, bool full) {
  if (c.counters().shared_memory_peers != c.size() - 1) {
    std::fprintf(stderr, "rank %d: %d of %d peers on shared memory\n", c.rank(), c.counters().shared_memory_peers, c.size() - 1);
    return 9;
  }
  return exercise_all(c, counts, full);
}

TEST(SharedMemory, EveryOperationTypeAndReductionOnTwoThreeAndFourRanks) {
  const auto before = segments_in_dev_shm();
  auto small = [](CommunicatorOptions& o) {
    small_chunks(o);
    shared_memory(o);
  };
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return all_peers_shared_then(c, {0, 1, 2, 3, 1001, 12347}, true); }, small));
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return all_peers_shared_then(c, {0, 1, 2, 5, 1001, 12347}, true); }, small));
  expect_all_zero(run_ranks(4, [](Communicator& c, int) { return all_peers_shared_then(c, {0, 3, 4, 7, 4099}, false); }, small));
  expect_no_new_segments(before);
}

TEST(SharedMemory, SeveralMebibytesWithDefaultChunksAndEveryAlgorithm) {
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return all_peers_shared_then(c, {(1u << 20) + 3}, false); }, shared_memory));
  for (auto algorithm : {AllreduceAlgorithm::ring, AllreduceAlgorithm::recursive_doubling})
    expect_all_zero(run_ranks(3, [](Communicator& c, int) { return all_peers_shared_then(c, {1, 999, 20001}, false); },
                              [algorithm](CommunicatorOptions& o) {
                                small_chunks(o);
                                shared_memory(o);
                                o.allreduce_algorithm = algorithm;
                              }));
}

// A job mixing both paths: rank 2 keeps to the network (as a rank on
// another host, or in a container with its own /dev/shm, would), the others
// share memory among themselves and reach rank 2 over lossy, reordering
// loopback; every pair must agree on which path it uses.
TEST(SharedMemory, JobsMixingSharedMemoryAndNetworkPairsWork) {
  auto mixed = [](CommunicatorOptions& o) {
    small_chunks(o);
    o.shared_memory = o.rank != 2;
    o.context.faults = FaultOptions{0.02, 0.01, 0.02, 0};
  };
  expect_all_zero(run_ranks(4, [](Communicator& c, int rank) {
    const int want = rank == 2 ? 0 : 2;
    if (c.counters().shared_memory_peers != want) {
      std::fprintf(stderr, "rank %d: %d peers on shared memory, want %d\n", rank, c.counters().shared_memory_peers, want);
      return 9;
    }
    return exercise_all(c, {1, 7, 3001, 40000}, false);
  }, mixed));
}

// Direct gather between ranks on shared memory: one copy by the kernel
// (process_vm_writev) into the next rank's output. The forked ranks may
// write into each other (same user), so every pair passes the probe.
TEST(SharedMemory, DirectGatherWritesIntoTheNextRanksProcess) {
  auto shared_small = [](CommunicatorOptions& o) {
    small_chunks(o);
    shared_memory(o);
    o.allreduce_algorithm = AllreduceAlgorithm::ring;  // 4 ranks would take halving and doubling, which gathers through slots
  };
  auto single_copy_everywhere = [](Communicator& c, int) {
    if (c.counters().shared_memory_single_copy_peers != c.size() - 1) {
      std::fprintf(stderr, "rank %d: %d single-copy peers of %d\n", c.rank(), c.counters().shared_memory_single_copy_peers, c.size() - 1);
      return 9;
    }
    return gather_directly(c, true);
  };
  expect_all_zero(run_ranks(2, single_copy_everywhere, shared_small));
  expect_all_zero(run_ranks(4, single_copy_everywhere, shared_small));
  // Every operation, every type, in and out of place, with default chunks too.
  expect_all_zero(run_ranks(3, [](Communicator& c, int) { return all_peers_shared_then(c, {1001, 12347, 100003}, true); }, shared_small));
  expect_all_zero(run_ranks(2, [](Communicator& c, int) { return all_peers_shared_then(c, {(3u << 20) + 7}, false); }, shared_memory));
  // Rank 1 refuses direct gather: the pairs (0,1) and (1,2) keep to their
  // slots, so only rank 0 (written into by rank 2) receives in place.
  auto rank1_refuses = [](CommunicatorOptions& o) {
    small_chunks(o);
    shared_memory(o);
    if (o.rank == 1) o.direct_gather = false;
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int rank) { return gather_directly(c, rank == 0); }, rank1_refuses));
  // Above the single-copy segment size (8 MiB a rank) the slots carry it.
  expect_all_zero(run_ranks(2, [](Communicator& c, int) {
    const size_t count = (9u << 20) / 4 * 2;  // 9 MiB a rank's segment
    std::vector<int32_t> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = int32_t(i % 977) + c.rank();
    const uint64_t before = c.counters().bytes_gathered_in_place;
    if (!c.allreduce(data.data(), data.data(), count, DataType::int32, ReduceOp::sum).ok()) return 1;
    for (size_t i = 0; i < count; ++i)
      if (data[i] != 2 * int32_t(i % 977) + 1) return 2;
    return c.counters().bytes_gathered_in_place == before ? 0 : 3;
  }, shared_memory));
}

// Makes process_vm_writev fail with EPERM in the calling thread from now
// on, as a seccomp profile applied after bootstrap would.
bool refuse_process_vm_writev() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_writev, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{uint16_t(sizeof filter / sizeof filter[0]), filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// The probe at bootstrap allowed single copy, then the kernel refuses it:
// the writer carries on through the slots and the receiver copies out of
// them; every result is still right.
TEST(SharedMemory, ASingleCopyRefusedAfterBootstrapFallsBackToTheSlots) {
  auto shared_small = [](CommunicatorOptions& o) {
    small_chunks(o);
    shared_memory(o);
    o.allreduce_algorithm = AllreduceAlgorithm::ring;
  };
  expect_all_zero(run_ranks(3, [](Communicator& c, int rank) {
    if (c.counters().shared_memory_single_copy_peers != 2) return 8;
    if (rank == 1 && !refuse_process_vm_writev()) return 9;
    // Rank 1 writes into rank 2: only rank 2 receives through its slots.
    if (int r = gather_directly(c, rank != 2); r != 0) return r;
    if (c.counters().shared_memory_single_copy_peers != (rank == 1 ? 1 : 2)) return 10;
    return all_peers_shared_then(c, {1001, 12347, 100003}, true);
  }, shared_small));
}

// kill -9 of a rank while the previous rank writes into its output with
// process_vm_writev: the writer's next write finds the process gone (or its
// lock says so first), and every survivor fails with io_error in time.
TEST(SharedMemory, AReceiverKilledWhileItsWriterWritesIsAnErrorNotACrash) {
  const auto before = segments_in_dev_shm();
  const auto codes = run_ranks(
      3,
      [](Communicator& comm, int rank) {
        std::vector<int32_t> v(1 << 20, 1);
        Status s;
        for (int i = 0; i < 100000 && s.ok(); ++i) {
          s = comm.allreduce(v.data(), v.data(), v.size(), DataType::int32, ReduceOp::max);
          // The kill's timer starts once the writes have run: started at
          // once, a loaded host (ctest -j2) could spend it on bootstrap.
          if (rank == 2 && i == 0)
            std::thread([] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); raise(SIGKILL); }).detach();
        }
        std::fprintf(stderr, "rank %d: %s, %llu bytes gathered in place\n", rank, s.to_string().c_str(),
                     (unsigned long long)comm.counters().bytes_gathered_in_place);
        if (s.ok()) return 1;
        if (comm.counters().bytes_gathered_in_place == 0) return 2;  // the writes were not what ran
        return s.code() == Errc::io_error ? 0 : 5;
      },
      [](CommunicatorOptions& o) {
        shared_memory(o);
        o.allreduce_algorithm = AllreduceAlgorithm::ring;
        o.timeout = 60s;  // the harness gives up at 30 s
      },
      30s);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(codes[2], -SIGKILL);
  expect_no_new_segments(before);
}

// kill -9 of a rank on the same host: its liveness lock goes with it, so
// the others fail with io_error long before their (long) timeout.
TEST(SharedMemory, AKilledRankIsAnErrorOnTheOthersAtOnce) {
  const auto before = segments_in_dev_shm();
  const auto codes = run_ranks(
      3,
      [](Communicator& comm, int rank) {
        if (rank == 2) raise(SIGKILL);
        std::vector<float> v(100000, 1.0f);
        Status s = comm.allreduce(v.data(), v.data(), v.size(), DataType::float32, ReduceOp::sum);
        std::fprintf(stderr, "rank %d: %s\n", rank, s.to_string().c_str());
        if (s.ok()) return 1;
        return s.code() == Errc::io_error && !comm.barrier().ok() ? 0 : 5;
      },
      [](CommunicatorOptions& o) {
        shared_memory(o);
        o.timeout = 60s;  // the harness gives up at 30 s: only the lock can end this in time
      },
      30s);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(codes[2], -SIGKILL);
  expect_no_new_segments(before);
}

TEST(SharedMemory, AHungRankTimesOutAndMismatchedCallsFail) {
  const auto hung = run_ranks(
      2,
      [](Communicator& comm, int rank) -> int {
        if (rank == 1) raise(SIGSTOP);
        std::vector<int32_t> v(10, 1);
        Status s = comm.allreduce(v.data(), v.data(), v.size(), DataType::int32, ReduceOp::sum);
        std::fprintf(stderr, "rank %d: %s\n", rank, s.to_string().c_str());
        _exit(s.code() == Errc::timeout ? 0 : 1);
      },
      [](CommunicatorOptions& o) {
        shared_memory(o);
        o.timeout = 2s;
      },
      8s);
  EXPECT_EQ(hung[0], 0);
  EXPECT_EQ(hung[1], -SIGKILL);
  for (int variant = 0; variant < 2; ++variant) {
    const auto codes = run_ranks(
        2,
        [variant](Communicator& comm, int rank) {
          std::vector<float> v(300000, 1.0f);
          Status s = variant == 0 ? comm.allreduce(v.data(), v.data(), rank == 0 ? 1000 : 2000, DataType::float32, ReduceOp::sum)
                                  : comm.allreduce(v.data(), v.data(), rank == 0 ? 200000 : 100000, DataType::float32, ReduceOp::max);
          std::fprintf(stderr, "rank %d (variant %d): %s\n", rank, variant, s.to_string().c_str());
          return s.code() == Errc::protocol_error || s.code() == Errc::io_error ? 0 : 1;
        },
        [](CommunicatorOptions& o) {
          shared_memory(o);
          o.timeout = 5s;
        },
        60s);
    EXPECT_EQ(codes[0], 0) << "variant " << variant;
    EXPECT_EQ(codes[1], 0) << "variant " << variant;
  }
}

// A rank that never arrives: the others give up at bootstrap and still
// remove their segments.
TEST(SharedMemory, AFailedBootstrapLeavesNothingInDevShm) {
  const auto before = segments_in_dev_shm();
  const auto codes = run_ranks(
      3, [](Communicator&, int) { return 0; },
      [](CommunicatorOptions& o) {
        shared_memory(o);
        o.timeout = 2s;
        if (o.rank == 2) _exit(7);
      },
      30s);
  EXPECT_NE(codes[0], 0);
  EXPECT_NE(codes[1], 0);
  EXPECT_EQ(codes[2], 7);
  expect_no_new_segments(before);
}

// The segment itself: a peer maps it only with the published token and the
// job's shape, sees the owner alive while its lock is held and gone after.
TEST(SharedMemory, SegmentsOpenOnlyWithTheirTokenAndShapeAndTellLiveness) {
  const detail::SegmentShape shape{3, 4, 8192};
  auto own = detail::SharedSegment::create(shape, "test");
  ASSERT_TRUE(own) << own.status().to_string();
  const std::string name = (*own)->name();
  EXPECT_TRUE(detail::valid_segment_name(name)) << name;
  EXPECT_FALSE(detail::SharedSegment::open(name, (*own)->token() ^ 1, shape)) << "wrong token";
  EXPECT_FALSE(detail::SharedSegment::open(name, (*own)->token(), detail::SegmentShape{3, 8, 8192})) << "wrong shape";
  EXPECT_FALSE(detail::SharedSegment::open("/stellar-coll-none-0000000000000000", 1, shape)) << "no such segment";
  for (const char* bad : {"/etc/passwd", "/stellar-coll-../x", "stellar-coll-x", "/stellar-coll-", "/stellar-coll-A"})
    EXPECT_FALSE(detail::valid_segment_name(bad)) << bad;
  auto peer = detail::SharedSegment::open(name, (*own)->token(), shape);
  ASSERT_TRUE(peer) << peer.status().to_string();
  // The same memory: what one side writes in its landing slots the other sees.
  (*own)->slots_of(1, 0)[5] = 42;
  EXPECT_EQ((*peer)->slots_of(1, 0)[5], 42);
  EXPECT_EQ((*peer)->slots_of(2, 0), (*peer)->slots_of(1, 0) + 4 * 8192);
  EXPECT_TRUE((*peer)->owner_alive());
  const uint32_t bell = (*own)->doorbell();
  (*peer)->ring_doorbell();
  EXPECT_NE((*own)->doorbell(), bell);
  (*own)->sleep_on_doorbell(bell, std::chrono::microseconds(1'000'000));  // returns at once: it rang
  own->reset();
  EXPECT_FALSE((*peer)->owner_alive());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + name)) << "the owner removes its name";
}

// The single-copy probe: a peer in another process may write into the
// owner's memory (same user), within what the owner mapped; a segment whose
// owner is gone (its name left behind) does not pass it.
TEST(SharedMemory, TheSingleCopyProbeAndWritesIntoTheOwner) {
  const detail::SegmentShape shape{2, 4, 8192};
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  static char target[64];  // the owner's buffer the peer writes into (the same address in the forked child)
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::memset(target, 0, sizeof target);
    auto own = detail::SharedSegment::create(shape, "probe");
    if (!own) _exit(10);
    char line[128] = {};
    std::snprintf(line, sizeof line, "%s %016llx", (*own)->name().c_str(), (unsigned long long)(*own)->token());
    if (::write(to_parent[1], line, sizeof line) != ssize_t(sizeof line)) _exit(11);
    char go = 0;
    if (::read(to_child[0], &go, 1) != 1) _exit(12);
    // Leave the name behind (as a killed rank would): no destructor.
    _exit(std::strcmp(target, "written by the peer") == 0 ? 0 : 13);
  }
  char line[128] = {};
  ASSERT_EQ(::read(to_parent[0], line, sizeof line), ssize_t(sizeof line));
  char name[100] = {};
  unsigned long long token = 0;
  ASSERT_EQ(std::sscanf(line, "%99s %llx", name, &token), 2);
  {
    auto peer = detail::SharedSegment::open(name, token, shape);
    ASSERT_TRUE(peer) << peer.status().to_string();
    EXPECT_TRUE((*peer)->direct_writable());
    const char text[] = "written by the peer";
    EXPECT_TRUE((*peer)->write_into_owner(reinterpret_cast<uint64_t>(target), text, sizeof text).ok());
    auto outside = (*peer)->write_into_owner(16, text, sizeof text);  // not the owner's memory
    EXPECT_EQ(outside.code(), Errc::invalid_argument) << outside.to_string();
  }
  ASSERT_EQ(::write(to_child[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the owner did not see the write: " << status;
  auto orphan = detail::SharedSegment::open(name, token, shape);  // its owner is gone: the pid names nobody
  ASSERT_TRUE(orphan) << orphan.status().to_string();
  EXPECT_FALSE((*orphan)->direct_writable());
  EXPECT_EQ((*orphan)->write_into_owner(reinterpret_cast<uint64_t>(target), "x", 1).code(), Errc::wrong_state);
  ::shm_unlink(name);
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) ::close(fd);
}

// A segment left by a rank killed during the rendezvous (the name still
// there, its lock free, untouched for over a minute) is removed by the next
// segment created; a live one of the same age stays.
TEST(SharedMemory, StaleSegmentsOfDeadRanksAreRemoved) {
  const detail::SegmentShape shape{2, 1, 4096};
  auto live = detail::SharedSegment::create(shape, "live");
  ASSERT_TRUE(live) << live.status().to_string();
  const std::string stale = "/stellar-coll-stale-00000000deadbeef";
  const int fd = shm_open(stale.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  const timespec old[2] = {{std::time(nullptr) - 3600, 0}, {std::time(nullptr) - 3600, 0}};
  ASSERT_EQ(futimens(fd, old), 0);
  close(fd);
  const int live_fd = shm_open((*live)->name().c_str(), O_RDWR, 0);
  ASSERT_GE(live_fd, 0);
  ASSERT_EQ(futimens(live_fd, old), 0);
  close(live_fd);
  auto next = detail::SharedSegment::create(shape, "next");
  ASSERT_TRUE(next) << next.status().to_string();
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + stale)) << "the stale segment is removed";
  EXPECT_TRUE(std::filesystem::exists("/dev/shm" + (*live)->name())) << "a live one stays";
  shm_unlink(stale.c_str());
}

TEST(Rendezvous, SharedMemoryFieldsAreChecked) {
  control::json good = valid_hello();
  good["shm"] = control::json{{"name", "/stellar-coll-r1-0123456789abcdef"}, {"token", "00000000000000ff"}};
  ASSERT_TRUE(coll::check_hello(good, 2, good)) << coll::check_hello(good, 2, good).status().to_string();
  control::json none = good;
  none["shm"] = nullptr;
  EXPECT_TRUE(coll::check_hello(none, 2, good));
  none.erase("shm");
  EXPECT_TRUE(coll::check_hello(none, 2, good)) << "an earlier release sends no shm";
  for (const char* bad : {R"("x")", R"({"name":"/dev/../etc/shadow","token":"00000000000000ff"})", R"({"name":"/stellar-coll-a","token":"ff"})",
                          R"({"name":"/stellar-coll-a","token":"zz00000000000000"})", R"({"name":5,"token":"00000000000000ff"})",
                          R"({"token":"00000000000000ff"})"}) {
    control::json h = good;
    h["shm"] = control::json::parse(bad);
    EXPECT_FALSE(coll::check_hello(h, 2, good)) << bad;
  }
  using control::json;
  EXPECT_EQ(coll::read_shared_memory_pairs(json::parse(R"({"type":"go","shm":[1,3]})"), 4, 0).value(), (std::vector<int>{1, 3}));
  EXPECT_TRUE(coll::read_shared_memory_pairs(json::parse(R"({"type":"go"})"), 4, 0).value().empty());
  for (const char* bad : {R"({"shm":[0]})", R"({"shm":[1,1]})", R"({"shm":[4]})", R"({"shm":[-1]})", R"({"shm":["1"]})", R"({"shm":{}})",
                          R"({"shm":[1,2,3,1]})"})
    EXPECT_FALSE(coll::read_shared_memory_pairs(json::parse(bad), 4, 0)) << bad;
}

TEST(CommunicatorOptions, ReadsTorchrunAndMpirunEnvironments) {
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("MASTER_ADDR", "10.1.2.3", 1);
  setenv("MASTER_PORT", "1234", 1);
  auto o = CommunicatorOptions::from_environment();
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->rank, 3);
  EXPECT_EQ(o->world_size, 8);
  EXPECT_EQ(o->master_address, "10.1.2.3");
  EXPECT_EQ(o->master_port, 1234);

  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  setenv("STELLAR_COLL_TIMEOUT_MS", "1500", 1);
  setenv("STELLAR_COLL_QPS_PER_PEER", "4", 1);
  o = CommunicatorOptions::from_environment();
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->rank, 1);
  EXPECT_EQ(o->world_size, 2);
  EXPECT_EQ(o->timeout, 1500ms);
  EXPECT_EQ(o->qps_per_peer, 4u);
  setenv("STELLAR_COLL_QPS_PER_PEER", "17", 1);
  EXPECT_EQ(CommunicatorOptions::from_environment().status().code(), Errc::invalid_argument);
  unsetenv("STELLAR_COLL_QPS_PER_PEER");
  setenv("STELLAR_COLL_SHM", "0", 1);
  o = CommunicatorOptions::from_environment();
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->shared_memory);
  setenv("STELLAR_COLL_SHM", "yes", 1);
  EXPECT_EQ(CommunicatorOptions::from_environment().status().code(), Errc::invalid_argument);
  unsetenv("STELLAR_COLL_SHM");
  EXPECT_TRUE(CommunicatorOptions::from_environment().value().shared_memory) << "on by default";

  setenv("OMPI_COMM_WORLD_RANK", "2", 1);  // rank >= size
  EXPECT_EQ(CommunicatorOptions::from_environment().status().code(), Errc::invalid_argument);
  setenv("OMPI_COMM_WORLD_RANK", "x", 1);
  EXPECT_EQ(CommunicatorOptions::from_environment().status().code(), Errc::invalid_argument);
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(CommunicatorOptions::from_environment().status().code(), Errc::invalid_argument);
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "STELLAR_COLL_TIMEOUT_MS"}) unsetenv(v);
}

TEST(Reduce, SixteenBitFloatsRoundToNearestEven) {
  EXPECT_EQ(detail::float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(detail::float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(detail::float_to_half(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(detail::float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(detail::float_to_half(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(detail::float_to_half(1.0f + 0x1p-11f), 0x3c00);  // tie: to even
  EXPECT_EQ(detail::float_to_half(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_TRUE(std::isnan(detail::half_to_float(detail::float_to_half(NAN))));
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(detail::float_to_half(detail::half_to_float(uint16_t(h))), h);
  EXPECT_EQ(detail::float_to_bfloat16(1.0f), 0x3f80);
  EXPECT_EQ(detail::float_to_bfloat16(1.0f + 0x1p-8f), 0x3f80);  // tie: to even
  EXPECT_EQ(detail::float_to_bfloat16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_TRUE(std::isnan(detail::bfloat16_to_float(detail::float_to_bfloat16(NAN))));
}

TEST(Reduce, KernelsMatchScalarArithmetic) {
  std::vector<float> a(1000), b(1000), out(1000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i) * 0.5f, b[i] = 1000.0f - float(i);
  detail::reduce(DataType::float32, ReduceOp::max, out.data(), a.data(), b.data(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(out[i], std::max(a[i], b[i]));
  detail::reduce(DataType::float32, ReduceOp::prod, a.data(), a.data(), b.data(), a.size());  // in place
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], float(i) * 0.5f * (1000.0f - float(i)));
  std::vector<int32_t> big{INT32_MAX, INT32_MIN}, two{2, 2}, wrapped(2);
  detail::reduce(DataType::int32, ReduceOp::prod, wrapped.data(), big.data(), two.data(), 2);  // wraps, no UB
  EXPECT_EQ(wrapped, (std::vector<int32_t>{-2, 0}));
  detail::reduce(DataType::int32, ReduceOp::sum, wrapped.data(), big.data(), two.data(), 2);
  EXPECT_EQ(wrapped, (std::vector<int32_t>{INT32_MIN + 1, INT32_MIN + 2}));
  std::vector<int64_t> x{-7, 9, 10}, y{2, 2, 2};
  detail::reduce(DataType::int64, ReduceOp::sum, x.data(), x.data(), y.data(), 3);
  detail::divide(DataType::int64, x.data(), 3, 2);
  EXPECT_EQ(x, (std::vector<int64_t>{-2, 5, 6}));
}

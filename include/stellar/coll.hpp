// Collectives over Stellar: a communicator of N ranks (processes) with
// allreduce, reduce-scatter, allgather, broadcast and barrier, in the shape
// of NCCL's and Gloo's APIs. Library target: Stellar::stellar_coll.
//
// Transport: one RC queue pair per pair of ranks on the soft (or verbs)
// provider. Data moves with RDMA WRITE_WITH_IMM into registered landing
// buffers of the receiver (credit-based flow control, as NCCL's InfiniBand
// transport does); the immediate value names the call, so a rank that calls
// a different operation, count, type, reduction or root gets an error
// instead of corrupt data.
//
// Bootstrap: rank 0 serves a small TCP rendezvous (Asio) at
// master_address:master_port; every rank sends it its queue-pair endpoints
// and landing buffers and gets back the whole table.
//
// Units: counts are in elements of the given DataType, never bytes; buffers
// are plain host pointers owned by the caller and must stay valid for the
// call. A call returns when this rank's part is done and its buffers may be
// reused.
//
// Thread-safety: a Communicator is used by one thread at a time (like an
// NCCL communicator on one stream); different communicators are independent.
//
// Errors: a dead or hung rank makes every call fail with Errc::timeout or
// Errc::io_error within `timeout` (measured as time without any progress);
// mismatched calls fail with Errc::protocol_error. After an error the
// communicator is broken: every later call fails at once with the first
// error; destroy it and create a new one.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "stellar/status.hpp"
#include "stellar/verbs.hpp"

namespace stellar::coll {

enum class DataType { float32, float16, bfloat16, float64, int32, int64, uint8, int8 };
// avg: sum / number of ranks (integer division for integers). band, bor,
// bxor: bitwise, integer types only (invalid_argument on floating types).
enum class ReduceOp { sum, prod, min, max, avg, band, bor, bxor };

size_t size_of(DataType);
const char* to_string(DataType);  // "float", "half", "bfloat16", "double", "int32", "int64", "uint8", "int8" (nccl-tests names)
const char* to_string(ReduceOp);  // "sum", "prod", "min", "max", "avg", "band", "bor", "bxor"
// Accepts the names above and the aliases nccl-tests and PyTorch use
// ("float32", "fp16", "bf16", "float64", "int", ...).
Result<DataType> parse_data_type(const std::string&);
Result<ReduceOp> parse_reduce_op(const std::string&);

enum class AllreduceAlgorithm {
  automatic,           // recursive doubling up to small_message_bytes; above, halving_doubling up to 512 KiB on 4, 8, 16... ranks; the ring
  ring,                // reduce-scatter then allgather around a ring, chunked and pipelined
  recursive_doubling,  // log2(N) exchanges of the whole vector (latency-optimised)
  // Rabenseifner's: reduce-scatter by recursive halving, allgather by
  // recursive doubling (2 log2(N) exchanges, the ring's bytes); ranks past the
  // largest power of two fold into a partner first, as in recursive doubling.
  halving_doubling,
};

struct CommunicatorOptions {
  int rank = -1;
  int world_size = -1;
  std::string master_address = "127.0.0.1";  // where rank 0 serves the rendezvous
  uint16_t master_port = 29500;
  // Local IPv4 address for this rank's transport socket; "" picks the local
  // address that routes to master_address.
  std::string local_address;
  ContextOptions context{};  // provider, mode, progress, faults; bind_address is set from local_address
  // A call fails when it makes no progress for this long (a rank died or
  // hangs); bootstrap fails when not all ranks arrive within it.
  std::chrono::milliseconds timeout{30'000};
  AllreduceAlgorithm allreduce_algorithm = AllreduceAlgorithm::automatic;
  size_t small_message_bytes = 64 * 1024;  // automatic: recursive doubling at or below this size
  size_t chunk_bytes = 512 * 1024;         // pipelining unit and landing-slot size (multiple of 4 KiB)
  uint32_t slots = 4;                      // landing slots per peer = messages in flight per peer
  // RC QPs per peer (NCCL_IB_QPS_PER_CONNECTION): messages of 32 KiB and more
  // are striped over them in equal 4 KiB-aligned parts. On the verbs provider
  // each QP is its own RoCEv2 flow (UDP source port), so ECMP spreads one
  // peer's traffic over several paths; on the soft provider all QPs of a
  // rank share its UDP socket (one flow). Must agree across ranks. [1, 16]
  uint32_t qps_per_peer = 1;
  // Oversubscription: when more ranks share this host (the same kernel, as
  // the ranks tell each other at bootstrap) than this process may run on
  // CPUs (its affinity mask; with ProgressMode::thread two threads a rank),
  // a busy-polling context switches to WaitPolicy::adaptive, as Open MPI
  // yields when oversubscribed: spinning ranks would take each other's
  // cores. false: keep context.wait whatever the count (the caller chose).
  bool adapt_wait = true;
  // Shared memory between ranks on one host (as NCCL's SHM transport): a
  // pair of ranks on the same kernel that can both map each other's segment
  // in /dev/shm writes into the other's landing slots directly (one copy in,
  // the reduction reads it there) instead of through the transport. Decided
  // per pair at bootstrap: a rank with false (or STELLAR_COLL_SHM=0), or one
  // in a container with its own /dev/shm, talks to the others over the
  // network, so jobs mixing local and remote ranks work. Each rank that
  // allows it holds a segment of about (world_size - 1) * slots *
  // chunk_bytes bytes; its name is removed from /dev/shm once the peers have
  // mapped it. Benchmarks of the network path turn it off.
  bool shared_memory = true;
  // Direct gather: in a ring's gather steps (allreduce's second half,
  // allgather) each rank writes the finished chunks straight into the next
  // rank's output buffer instead of into a landing slot that the next rank
  // then copies out of, as NCCL's registered-buffer path does: one copy of
  // each gathered byte less. Each rank tells the previous one where its
  // output is (16 bytes at the start of the call) and registers it for
  // remote writes for the call's duration. Decided per pair at bootstrap:
  // both ranks must allow it (false here or STELLAR_COLL_DIRECT=0 on either
  // keeps the pair on landing slots). A pair on shared memory does it with
  // process_vm_writev(2) (single copy, as Open MPI's vader and UCX's cma
  // do) where the kernel lets the writer into the reader's process (same
  // user, no Yama or seccomp rule against it: probed at bootstrap), and
  // keeps to its slots where not.
  bool direct_gather = true;

  // Reads the launcher's environment on top of `base`: torchrun's RANK,
  // WORLD_SIZE, MASTER_ADDR, MASTER_PORT; mpirun's OMPI_COMM_WORLD_RANK and
  // OMPI_COMM_WORLD_SIZE (with MASTER_ADDR/MASTER_PORT, or their defaults
  // above); STELLAR_COLL_TIMEOUT_MS, STELLAR_COLL_QPS_PER_PEER and
  // STELLAR_COLL_WAIT (auto: adapt_wait; busy or adaptive: that policy,
  // whatever the count), STELLAR_COLL_SHM (0 or 1: shared_memory) and
  // STELLAR_COLL_DIRECT (0 or 1: direct_gather). Fails with invalid_argument when no rank/size is
  // found or the values are out of range.
  static Result<CommunicatorOptions> from_environment(const CommunicatorOptions& base);
  static Result<CommunicatorOptions> from_environment();  // on top of the defaults
};

// A key-value store every rank of the job reaches (torch.distributed's
// Store, a file system, etcd): Communicator::create(options, store) runs the
// rendezvous through it instead of serving one at rank 0, so a framework
// that already has a store does not open a second rendezvous port. Keys are
// written once; a store shared by several communicators must give each its
// own key space (torch's per-group PrefixStore does).
// Thread-safety: called from the creating thread only, during create().
class Store {
 public:
  virtual ~Store() = default;
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for `key` to be set and returns its value;
  // Errc::timeout when it is not.
  virtual Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

struct CommunicatorCounters {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;      // payload bytes this rank wrote to peers
  uint64_t messages_sent = 0;   // data messages (credits not counted)
  ContextCounters transport{};  // the provider's counters (drops, retransmissions, ...)
  ProgressMode placement = ProgressMode::inline_poll;  // where the engines run (after STELLAR_ENGINE)
  // The wait policy the calls run with, and why: ranks found on this host
  // at bootstrap, the CPUs this process may use, and whether that made it
  // switch to adaptive (CommunicatorOptions::adapt_wait).
  WaitPolicy wait = WaitPolicy::busy_poll;
  int local_ranks = 1;
  int cpus = 1;
  bool oversubscribed = false;
  int shared_memory_peers = 0;  // peers this rank talks to through shared memory (the rest: the network)
  // Of those, the peers this rank may write into with one copy
  // (process_vm_writev: direct gather on shared memory).
  int shared_memory_single_copy_peers = 0;
  // Gather-step bytes the previous rank wrote straight into this rank's
  // output (CommunicatorOptions::direct_gather), not copied out of a slot.
  uint64_t bytes_gathered_in_place = 0;
  // Allreduce calls by the algorithm that ran (AllreduceAlgorithm).
  uint64_t allreduce_ring = 0, allreduce_recursive_doubling = 0, allreduce_halving_doubling = 0;
};

class Communicator {
 public:
  // Bootstraps: opens a context, connects one QP to every other rank through
  // the rendezvous and waits until all ranks are connected. Blocks up to
  // options.timeout.
  static Result<std::unique_ptr<Communicator>> create(const CommunicatorOptions&);
  // The same, with the rendezvous through `store` (master_address and
  // master_port are then unused, except that local_address "" picks the
  // address that routes to master_address). The store is used only during
  // the call.
  static Result<std::unique_ptr<Communicator>> create(const CommunicatorOptions&, Store& store);
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv[i] = op over ranks of send[i], for i < count. send == recv is in-place.
  virtual Status allreduce(const void* send, void* recv, size_t count, DataType, ReduceOp) = 0;
  // send holds size() * recv_count elements; rank r receives the reduction of
  // block r. In-place when send == recv (the result is then block r of it,
  // written at the start of recv, as MPI_Reduce_scatter_block).
  virtual Status reduce_scatter(const void* send, void* recv, size_t recv_count, DataType, ReduceOp) = 0;
  // recv holds size() * send_count elements; block r comes from rank r.
  // In-place when send == recv + rank() * send_count elements.
  virtual Status allgather(const void* send, void* recv, size_t send_count, DataType) = 0;
  // buffer's count elements of rank `root` are copied to every rank's buffer.
  virtual Status broadcast(void* buffer, size_t count, DataType, int root) = 0;
  // Returns once every rank has entered the barrier.
  virtual Status barrier() = 0;
  // recv on `root` = op over ranks of send (count elements each); recv is
  // not touched on other ranks (may be null there). send == recv is in-place.
  virtual Status reduce(const void* send, void* recv, size_t count, DataType, ReduceOp, int root) = 0;
  // All-to-all with per-peer sizes (MPI_Alltoallv): this rank sends
  // send_counts[r] elements at send + send_offsets[r] to rank r and receives
  // recv_counts[r] elements from rank r at recv + recv_offsets[r] (offsets
  // in elements; each array has size() entries). Every rank's send_counts[r]
  // must equal rank r's recv_counts[rank] (else protocol_error). send and
  // recv must not overlap.
  virtual Status all_to_all(const void* send, const size_t* send_counts, const size_t* send_offsets, void* recv, const size_t* recv_counts,
                            const size_t* recv_offsets, DataType) = 0;

  // ---- point to point (torch.distributed's isend/irecv) ----
  // Starts sending `bytes` bytes of `buffer` to rank `peer`, or receiving
  // them from it; returns a request id for test() and wait(). Messages
  // between a pair of ranks match in the order they were started, and each
  // must agree in size and tag with its counterpart (else protocol_error).
  // Requests progress only inside test(), wait() and the collective calls;
  // the buffer belongs to the communicator until the request is done. A
  // collective call first completes every outstanding request (a pair's
  // point-to-point and collective calls must come in the same order on
  // both ranks, as with NCCL). A peer that sends nothing fails the request
  // with Errc::timeout after `timeout` without progress.
  virtual Result<uint64_t> start_send(int peer, const void* buffer, size_t bytes, uint32_t tag) = 0;
  virtual Result<uint64_t> start_recv(int peer, void* buffer, size_t bytes, uint32_t tag) = 0;
  // Progresses every outstanding request without waiting; true once
  // `request` is done (ids of finished requests stay done).
  virtual Result<bool> test(uint64_t request) = 0;
  virtual Status wait(uint64_t request) = 0;

  virtual CommunicatorCounters counters() const = 0;
};

}  // namespace stellar::coll

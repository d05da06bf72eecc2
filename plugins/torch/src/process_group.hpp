// ProcessGroupStellar: torch.distributed's c10d::ProcessGroup over a
// stellar::coll::Communicator (the "stellar" backend of stellar_torch).
//
// Every operation is queued and run in the order it was issued by one worker
// thread that owns the communicator, so a call returns a Work at once (what
// async_op=True hands back) and Python never blocks while holding the GIL.
// Point-to-point operations (send, recv) only start on the worker; it keeps
// progressing them between queued operations and completes every one of
// them before the next collective, which is the communicator's own ordering
// rule (a pair's point-to-point and collective calls come in the same order
// on both sides, as with NCCL).
//
// Tensors: CPU tensors of any layout (a non-contiguous tensor is copied to a
// contiguous one and the result copied back). A CUDA tensor is staged
// through host memory (copied to a CPU tensor and back; never run: Debian's
// torch has no CUDA); a tensor on any other device is refused. Reductions take
// float32, float16, bfloat16, float64, int32, int64, uint8 and int8;
// broadcast, allgather, gather, scatter, all_to_all and send/recv move bytes,
// so they take every dtype.
//
// Errors: a bad argument throws at the call (TORCH_CHECK: RuntimeError in
// Python); a failure inside Stellar (a dead or hung rank, a mismatched call,
// the timeout) completes the Work with an exception that carries Stellar's
// message, so work.wait() (and the synchronous form) raises it. The
// communicator's timeout is the one handed to init_process_group; per-call
// timeouts in the options are not used.
//
// Thread-safety: the ProcessGroup's methods may be called from any thread;
// operations run in the order their calls were made. Destruction runs what
// is still queued (each bounded by the timeout) and joins the worker, with
// the GIL released when the caller holds it.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <stellar/coll.hpp>

namespace stellar_torch {

// The Work of one operation: completed (with its output tensors, or with an
// exception) by the worker thread. getFuture() is what DDP's reducer and
// comm hooks chain on; its value is the list of output tensors.
class WorkStellar final : public c10d::Work {
 public:
  WorkStellar(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // Called once, on the worker thread.
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupStellar final : public c10d::ProcessGroup {
 public:
  // Runs the communicator's rendezvous through `store` (torch's per-group
  // PrefixStore) and blocks until every rank has arrived or `timeout` has
  // passed (then throws with Stellar's message). Options not in the
  // arguments come from the environment as for any Stellar communicator:
  // MASTER_ADDR (the address whose route picks this rank's local address),
  // STELLAR_COLL_SHM, STELLAR_COLL_WAIT, STELLAR_COLL_QPS_PER_PEER.
  ProcessGroupStellar(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout);
  ~ProcessGroupStellar() override;

  const std::string getBackendName() const override { return "stellar"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // The communicator's counters (bytes, calls, shared-memory peers), read on
  // the worker between operations.
  stellar::coll::CommunicatorCounters counters();

 private:
  // A queued operation. A collective's body runs to completion on the worker;
  // a point-to-point body only starts its request and returns its id and
  // what to do when it is done (copy a staged receive back).
  struct Op {
    c10::intrusive_ptr<WorkStellar> work;
    std::function<void(stellar::coll::Communicator&)> collective;
    std::function<uint64_t(stellar::coll::Communicator&)> start_point_to_point;
    std::function<void()> after;  // on the worker, once the data is in place: copy results back
  };
  struct Pending {
    c10::intrusive_ptr<WorkStellar> work;
    uint64_t request;
    std::function<void()> after;
  };

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, Op op);
  void run();
  void finish_pending(Pending& p, std::exception_ptr error);
  void drain_pending();

  std::unique_ptr<stellar::coll::Communicator> comm_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Op> queue_;
  bool stopping_ = false;
  std::deque<Pending> pending_;  // worker only
  std::thread worker_;
};

}  // namespace stellar_torch

#include "process_group.hpp"

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdlib>
#include <numeric>
#include <optional>
#include <stdexcept>

namespace stellar_torch {

using stellar::Errc;
using stellar::Status;
using stellar::coll::Communicator;
using stellar::coll::CommunicatorOptions;
using stellar::coll::DataType;
using StellarOp = stellar::coll::ReduceOp;

namespace {

// A failure inside Stellar, as the exception a Work completes with.
[[noreturn]] void fail(const Status& s, const std::string& what) { throw std::runtime_error("stellar: " + what + " failed: " + s.to_string()); }

void check(const Status& s, const char* what) {
  if (!s.ok()) fail(s, what);
}

// torch's c10d::Store (a per-group PrefixStore over torchrun's TCPStore, a
// FileStore, ...) as the communicator's rendezvous store.
class TorchStore final : public stellar::coll::Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  Status set(const std::string& key, const std::string& value) override {
    try {
      store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      return {};
    } catch (const std::exception& e) {
      return Status(Errc::io_error, std::string("torch store set '") + key + "': " + e.what());
    }
  }
  stellar::Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      store_->wait({key}, timeout);  // throws when the key does not come in time
      const std::vector<uint8_t> value = store_->get(key);
      return std::string(value.begin(), value.end());
    } catch (const std::exception& e) {
      return Status(Errc::timeout, std::string("torch store get '") + key + "': " + e.what());
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

std::optional<DataType> data_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::float32;
    case at::kHalf: return DataType::float16;
    case at::kBFloat16: return DataType::bfloat16;
    case at::kDouble: return DataType::float64;
    case at::kInt: return DataType::int32;
    case at::kLong: return DataType::int64;
    case at::kByte: return DataType::uint8;
    case at::kChar: return DataType::int8;
    default: return std::nullopt;
  }
}

DataType reduction_type(const at::Tensor& t, const char* op) {
  const auto d = data_type(t.scalar_type());
  TORCH_CHECK(d, "stellar: ", op, " of ", t.scalar_type(),
              " tensors is not supported (float32, float16, bfloat16, float64, int32, int64, uint8 and int8 are)");
  return *d;
}

// torch's reduce op as Stellar's; PREMUL_SUM (sum of factor * input) is a
// sum after scaling the staged input, so it also carries the factor.
struct Reduction {
  StellarOp op = StellarOp::sum;
  std::optional<at::Tensor> factor;
};

Reduction reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* what) {
  const bool floating = at::isFloatingType(t.scalar_type());
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {StellarOp::sum, {}};
    case c10d::ReduceOp::AVG: return {StellarOp::avg, {}};
    case c10d::ReduceOp::PRODUCT: return {StellarOp::prod, {}};
    case c10d::ReduceOp::MIN: return {StellarOp::min, {}};
    case c10d::ReduceOp::MAX: return {StellarOp::max, {}};
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(!floating, "stellar: ", what, " with a bitwise op (BAND, BOR, BXOR) needs an integer tensor, not ", t.scalar_type());
      return {op.op_ == c10d::ReduceOp::BAND ? StellarOp::band : op.op_ == c10d::ReduceOp::BOR ? StellarOp::bor : StellarOp::bxor, {}};
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(supplement, "stellar: PREMUL_SUM without its factor");
      at::Tensor factor = supplement->tensor_factors.empty() ? at::scalar_tensor(supplement->double_factor, t.options().device(at::kCPU))
                                                              : supplement->tensor_factors.front().to(at::kCPU);
      return {StellarOp::sum, factor};
    }
    default: TORCH_CHECK(false, "stellar: ", what, " with reduce op ", int(op.op_), " is not supported");
  }
}

// A host-resident, contiguous tensor with `user`'s data (the same tensor
// when it already is one), and whether results must be copied back.
struct Staged {
  at::Tensor host;
  at::Tensor user;
  bool copy_back = false;
  void* data() const { return host.data_ptr(); }
  size_t bytes() const { return size_t(host.numel()) * host.element_size(); }
  void unstage() {
    if (copy_back) user.copy_(host);
  }
};

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "stellar: ", what, ": an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "stellar: ", what, ": only dense (strided) tensors, not ", t.layout());
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "stellar: ", what, ": tensors on ", t.device(),
              " are not supported (CPU tensors, and CUDA ones staged through host memory)");
}

// Stages `t` (copying its values in when `copy_in`, else only its shape).
Staged stage(const at::Tensor& t, const char* what, bool copy_in = true) {
  check_tensor(t, what);
  if (t.device().is_cpu() && t.is_contiguous()) return {t, t, false};
  at::Tensor host = copy_in ? t.to(at::kCPU).contiguous() : at::empty(t.sizes(), t.options().device(at::kCPU));
  return {host, t, true};
}

void check_one(const std::vector<at::Tensor>& tensors, const char* what) {
  TORCH_CHECK(tensors.size() == 1, "stellar: ", what, " takes one tensor per call (one device per process), got ", tensors.size());
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "stellar: ", what, ": tensors of ", a.scalar_type(), " and ", b.scalar_type());
}

// Each rank's part of a list-of-tensors call flattened into one host buffer.
at::Tensor concatenate(const std::vector<at::Tensor>& tensors, const char* what) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    check_tensor(t, what);
    check_same(t, tensors.front(), what);
    flat.push_back(t.to(at::kCPU).reshape({-1}));
  }
  return at::cat(flat);
}

// Copies consecutive pieces of `flat` into `tensors` (sizes from each).
void scatter_into(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t at = 0;
  for (at::Tensor& t : tensors) {
    t.copy_(flat.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
}

int checked_root(int64_t root, int size, const char* what) {
  TORCH_CHECK(root >= 0 && root < size, "stellar: ", what, ": root rank ", root, " is not in [0, ", size, ")");
  return int(root);
}

}  // namespace

// ---- WorkStellar ----

WorkStellar::WorkStellar(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void WorkStellar::complete(std::exception_ptr error) {
  // The future first: a thread woken by wait() may go straight to it.
  if (error)
    future_->setError(error);
  else
    future_->markCompleted(c10::IValue(outputs_));
  finish(error);
}

// ---- ProcessGroupStellar ----

ProcessGroupStellar::ProcessGroupStellar(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout)
    : c10d::ProcessGroup(rank, size) {
  CommunicatorOptions base;
  base.rank = rank;
  base.world_size = size;
  auto options = CommunicatorOptions::from_environment(base);
  if (!options) throw std::runtime_error("stellar: " + options.status().to_string());
  // A subgroup's rank and size are not the job's (RANK, WORLD_SIZE).
  options->rank = rank;
  options->world_size = size;
  if (!std::getenv("STELLAR_COLL_TIMEOUT_MS") && timeout.count() > 0) options->timeout = timeout;
  TorchStore rendezvous(store);
  auto comm = Communicator::create(*options, rendezvous);
  if (!comm) throw std::runtime_error("stellar: creating the communicator of rank " + std::to_string(rank) + " of " + std::to_string(size) +
                                      " failed: " + comm.status().to_string());
  comm_ = std::move(*comm);
  init();
  worker_ = std::thread([this] { run(); });
}

ProcessGroupStellar::~ProcessGroupStellar() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  // Queued operations still run (each bounded by the communicator's timeout),
  // so every Work handed out completes.
  if (!worker_.joinable()) return;
  // Python drops the last reference with the GIL held; the worker, freeing
  // the tensors of its last operation, may need the GIL to release their
  // Python objects: joining it with the GIL held would deadlock.
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release release;
    worker_.join();
  } else {
    worker_.join();
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, Op op) {
  op.work = c10::make_intrusive<WorkStellar>(rank_, type, std::move(outputs));
  auto work = op.work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "stellar: the process group is being destroyed");
    queue_.push_back(std::move(op));
  }
  wake_.notify_one();
  return work;
}

void ProcessGroupStellar::finish_pending(Pending& p, std::exception_ptr error) {
  if (!error) {
    try {
      if (p.after) p.after();
    } catch (...) {
      error = std::current_exception();
    }
  }
  p.work->complete(error);
}

void ProcessGroupStellar::drain_pending() {
  while (!pending_.empty()) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    const Status s = comm_->wait(p.request);
    std::exception_ptr error;
    if (!s.ok()) error = std::make_exception_ptr(std::runtime_error("stellar: point-to-point transfer failed: " + s.to_string()));
    finish_pending(p, error);
  }
}

void ProcessGroupStellar::run() {
  int idle_rounds = 0;
  while (true) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (pending_.empty()) {
        wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
      } else if (queue_.empty() && idle_rounds > 64) {
        // Transfers in flight and nothing new: poll them, but give the CPU
        // back between rounds once they have stalled for a while.
        wake_.wait_for(lock, std::chrono::microseconds(50));
      }
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (!op.work) {  // only transfers to progress
      bool progressed = false;
      for (auto it = pending_.begin(); it != pending_.end();) {
        auto done = comm_->test(it->request);
        if (!done || *done) {
          std::exception_ptr error;
          if (!done) error = std::make_exception_ptr(std::runtime_error("stellar: point-to-point transfer failed: " + done.status().to_string()));
          Pending p = std::move(*it);
          it = pending_.erase(it);
          finish_pending(p, error);
          progressed = true;
        } else {
          ++it;
        }
      }
      idle_rounds = progressed ? 0 : idle_rounds + 1;
      continue;
    }
    idle_rounds = 0;
    try {
      if (op.start_point_to_point) {
        const uint64_t request = op.start_point_to_point(*comm_);
        pending_.push_back(Pending{op.work, request, std::move(op.after)});
        continue;
      }
      drain_pending();
      op.collective(*comm_);
      op.work->complete(nullptr);
    } catch (...) {
      op.work->complete(std::current_exception());
    }
  }
}

stellar::coll::CommunicatorCounters ProcessGroupStellar::counters() {
  auto result = std::make_shared<stellar::coll::CommunicatorCounters>();
  Op op;
  op.collective = [result](Communicator& c) { *result = c.counters(); };
  enqueue(c10d::OpType::UNKNOWN, {}, std::move(op))->wait();
  return *result;
}

// ---- collectives ----

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  check_one(tensors, "allreduce");
  Staged s = stage(tensors[0], "allreduce");
  const DataType type = reduction_type(s.host, "allreduce");
  const Reduction r = reduction(opts.reduceOp, s.host, "allreduce");
  if (r.factor) {  // PREMUL_SUM: scale a private copy, then sum
    if (!s.copy_back) s = Staged{s.host.clone(), s.user, true};
    s.host.mul_(*r.factor);
  }
  Op op;
  op.collective = [s, type, r](Communicator& c) mutable {
    check(c.allreduce(s.data(), s.data(), size_t(s.host.numel()), type, r.op), "allreduce");
    s.unstage();
  };
  return enqueue(c10d::OpType::ALLREDUCE, tensors, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                      const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "stellar: allreduce_coalesced of no tensors");
  std::vector<Staged> staged;
  std::vector<DataType> types;
  for (const at::Tensor& t : tensors) {
    staged.push_back(stage(t, "allreduce_coalesced"));
    types.push_back(reduction_type(t, "allreduce_coalesced"));
  }
  const Reduction r = reduction(opts.reduceOp, tensors[0], "allreduce_coalesced");
  TORCH_CHECK(!r.factor, "stellar: allreduce_coalesced with PREMUL_SUM is not supported");
  Op op;
  op.collective = [staged, types, r](Communicator& c) mutable {
    for (size_t i = 0; i < staged.size(); ++i) {
      check(c.allreduce(staged[i].data(), staged[i].data(), size_t(staged[i].host.numel()), types[i], r.op), "allreduce_coalesced");
      staged[i].unstage();
    }
  };
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, tensors, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  check_one(tensors, "broadcast");
  const int root = checked_root(opts.rootRank, size_, "broadcast");
  Staged s = stage(tensors[0], "broadcast", rank_ == root);
  Op op;
  op.collective = [s, root](Communicator& c) mutable {
    check(c.broadcast(s.data(), s.bytes(), DataType::uint8, root), "broadcast");
    s.unstage();
  };
  return enqueue(c10d::OpType::BROADCAST, tensors, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  check_one(tensors, "reduce");
  const int root = checked_root(opts.rootRank, size_, "reduce");
  Staged s = stage(tensors[0], "reduce");
  const DataType type = reduction_type(s.host, "reduce");
  const Reduction r = reduction(opts.reduceOp, s.host, "reduce");
  if (r.factor) {
    if (!s.copy_back) s = Staged{s.host.clone(), s.user, true};
    s.host.mul_(*r.factor);
  }
  const int me = rank_;
  Op op;
  op.collective = [s, type, r, root, me](Communicator& c) mutable {
    check(c.reduce(s.data(), s.data(), size_t(s.host.numel()), type, r.op, root), "reduce");
    if (me == root) s.unstage();
  };
  return enqueue(c10d::OpType::REDUCE, tensors, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions&) {
  check_one(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "stellar: allgather takes one output list, got ", outputs.size());
  TORCH_CHECK(int(outputs[0].size()) == size_, "stellar: allgather needs ", size_, " output tensors, got ", outputs[0].size());
  Staged in = stage(inputs[0], "allgather");
  for (const at::Tensor& o : outputs[0]) {
    check_tensor(o, "allgather");
    check_same(o, in.host, "allgather");
    TORCH_CHECK(o.numel() == in.host.numel(), "stellar: allgather: an output of ", o.numel(), " elements for an input of ", in.host.numel());
  }
  std::vector<at::Tensor> outs = outputs[0];
  Op op;
  op.collective = [in, outs, world = size_](Communicator& c) mutable {
    at::Tensor flat = at::empty({int64_t(world) * in.host.numel()}, in.host.options());
    check(c.allgather(in.data(), flat.data_ptr(), in.bytes(), DataType::uint8), "allgather");
    scatter_into(flat, outs);
  };
  return enqueue(c10d::OpType::ALLGATHER, outs, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) {
  Staged in = stage(input, "allgather_into_tensor");
  Staged out = stage(output, "allgather_into_tensor", false);
  check_same(output, input, "allgather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * size_, "stellar: allgather_into_tensor: the output has ", output.numel(), " elements, not ",
              size_, " x ", input.numel());
  Op op;
  op.collective = [in, out](Communicator& c) mutable {
    check(c.allgather(in.data(), out.data(), in.bytes(), DataType::uint8), "allgather_into_tensor");
    out.unstage();
  };
  return enqueue(c10d::OpType::_ALLGATHER_BASE, {output}, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                                         const c10d::GatherOptions& opts) {
  check_one(inputs, "gather");
  const int root = checked_root(opts.rootRank, size_, "gather");
  Staged in = stage(inputs[0], "gather");
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && int(outputs[0].size()) == size_, "stellar: gather needs ", size_, " output tensors on the root");
    for (const at::Tensor& o : outputs[0]) {
      check_tensor(o, "gather");
      check_same(o, in.host, "gather");
      TORCH_CHECK(o.numel() == in.host.numel(), "stellar: gather: an output of ", o.numel(), " elements for an input of ", in.host.numel());
    }
    outs = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), "stellar: gather: only the root passes output tensors");
  }
  // A gather is an all-to-all in which only the root receives.
  Op op;
  op.collective = [in, outs, root, me = rank_, world = size_](Communicator& c) mutable {
    const size_t n = in.bytes();
    std::vector<size_t> send_counts(world, 0), send_offsets(world, 0), recv_counts(world, 0), recv_offsets(world, 0);
    send_counts[root] = n;
    at::Tensor flat = at::empty({me == root ? int64_t(world) * in.host.numel() : 1}, in.host.options());
    if (me == root)
      for (int r = 0; r < world; ++r) {
        recv_counts[r] = n;
        recv_offsets[r] = size_t(r) * n;
      }
    check(c.all_to_all(in.data(), send_counts.data(), send_offsets.data(), flat.data_ptr(), recv_counts.data(), recv_offsets.data(), DataType::uint8),
          "gather");
    if (me == root) scatter_into(flat, outs);
  };
  return enqueue(c10d::OpType::GATHER, outs, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ScatterOptions& opts) {
  check_one(outputs, "scatter");
  const int root = checked_root(opts.rootRank, size_, "scatter");
  Staged out = stage(outputs[0], "scatter", false);
  at::Tensor flat;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && int(inputs[0].size()) == size_, "stellar: scatter needs ", size_, " input tensors on the root");
    for (const at::Tensor& i : inputs[0]) {
      check_same(i, out.host, "scatter");
      TORCH_CHECK(i.numel() == out.host.numel(), "stellar: scatter: an input of ", i.numel(), " elements for an output of ", out.host.numel());
    }
    flat = concatenate(inputs[0], "scatter");
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), "stellar: scatter: only the root passes input tensors");
    flat = at::empty({1}, out.host.options());
  }
  // A scatter is an all-to-all in which only the root sends.
  Op op;
  op.collective = [out, flat, root, me = rank_, world = size_](Communicator& c) mutable {
    const size_t n = out.bytes();
    std::vector<size_t> send_counts(world, 0), send_offsets(world, 0), recv_counts(world, 0), recv_offsets(world, 0);
    recv_counts[root] = n;
    if (me == root)
      for (int r = 0; r < world; ++r) {
        send_counts[r] = n;
        send_offsets[r] = size_t(r) * n;
      }
    check(c.all_to_all(flat.data_ptr(), send_counts.data(), send_offsets.data(), out.data(), recv_counts.data(), recv_offsets.data(), DataType::uint8),
          "scatter");
    out.unstage();
  };
  return enqueue(c10d::OpType::SCATTER, outputs, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) {
  check_one(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && int(inputs[0].size()) == size_, "stellar: reduce_scatter needs ", size_, " input tensors");
  Staged out = stage(outputs[0], "reduce_scatter", false);
  for (const at::Tensor& i : inputs[0]) {
    check_same(i, out.host, "reduce_scatter");
    TORCH_CHECK(i.numel() == out.host.numel(), "stellar: reduce_scatter: an input of ", i.numel(), " elements for an output of ", out.host.numel());
  }
  const DataType type = reduction_type(out.host, "reduce_scatter");
  const Reduction r = reduction(opts.reduceOp, out.host, "reduce_scatter");
  at::Tensor flat = concatenate(inputs[0], "reduce_scatter");
  if (r.factor) flat.mul_(*r.factor);  // a private copy already
  Op op;
  op.collective = [out, flat, type, r](Communicator& c) mutable {
    check(c.reduce_scatter(flat.data_ptr(), out.data(), size_t(out.host.numel()), type, r.op), "reduce_scatter");
    out.unstage();
  };
  return enqueue(c10d::OpType::REDUCE_SCATTER, outputs, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                       const c10d::ReduceScatterOptions& opts) {
  Staged in = stage(input, "reduce_scatter_tensor");
  Staged out = stage(output, "reduce_scatter_tensor", false);
  check_same(output, input, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * size_, "stellar: reduce_scatter_tensor: the input has ", input.numel(), " elements, not ", size_,
              " x ", output.numel());
  const DataType type = reduction_type(out.host, "reduce_scatter_tensor");
  const Reduction r = reduction(opts.reduceOp, out.host, "reduce_scatter_tensor");
  if (r.factor) {
    if (!in.copy_back) in = Staged{in.host.clone(), in.user, false};  // the input is never written back
    in.host.mul_(*r.factor);
  }
  Op op;
  op.collective = [in, out, type, r](Communicator& c) mutable {
    check(c.reduce_scatter(in.data(), out.data(), size_t(out.host.numel()), type, r.op), "reduce_scatter_tensor");
    out.unstage();
  };
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                                                std::vector<int64_t>& input_splits, const c10d::AllToAllOptions&) {
  Staged in = stage(input, "all_to_all_single");
  Staged out = stage(output, "all_to_all_single", false);
  check_same(output, input, "all_to_all_single");
  // Splits are rows of dimension 0; none given means equal parts.
  auto counts = [this](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const size_t row_bytes = rows == 0 ? 0 : size_t(t.numel() / rows) * t.element_size();
    std::vector<size_t> bytes(size_), offsets(size_);
    if (splits.empty()) {
      TORCH_CHECK(rows % size_ == 0, "stellar: all_to_all_single: the ", which, "'s ", rows, " rows do not split into ", size_, " equal parts");
      for (int r = 0; r < size_; ++r) bytes[r] = size_t(rows / size_) * row_bytes;
    } else {
      TORCH_CHECK(int(splits.size()) == size_, "stellar: all_to_all_single: ", splits.size(), " ", which, " splits for ", size_, " ranks");
      int64_t sum = 0;
      for (int r = 0; r < size_; ++r) {
        TORCH_CHECK(splits[r] >= 0, "stellar: all_to_all_single: a negative ", which, " split");
        sum += splits[r];
        bytes[r] = size_t(splits[r]) * row_bytes;
      }
      TORCH_CHECK(sum == rows, "stellar: all_to_all_single: the ", which, " splits add up to ", sum, " rows, not ", rows);
    }
    for (int r = 1; r < size_; ++r) offsets[r] = offsets[r - 1] + bytes[r - 1];
    return std::pair{bytes, offsets};
  };
  auto [send_counts, send_offsets] = counts(in.host, input_splits, "input");
  auto [recv_counts, recv_offsets] = counts(out.host, output_splits, "output");
  Op op;
  op.collective = [in, out, send_counts, send_offsets, recv_counts, recv_offsets](Communicator& c) mutable {
    check(c.all_to_all(in.data(), send_counts.data(), send_offsets.data(), out.data(), recv_counts.data(), recv_offsets.data(), DataType::uint8),
          "all_to_all_single");
    out.unstage();
  };
  return enqueue(c10d::OpType::ALLTOALL_BASE, {output}, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                           const c10d::AllToAllOptions&) {
  TORCH_CHECK(int(inputs.size()) == size_ && int(outputs.size()) == size_, "stellar: all_to_all needs ", size_, " input and ", size_,
              " output tensors, got ", inputs.size(), " and ", outputs.size());
  for (const at::Tensor& o : outputs) {
    check_tensor(o, "all_to_all");
    check_same(o, inputs[0], "all_to_all");
  }
  at::Tensor send = concatenate(inputs, "all_to_all");
  std::vector<size_t> send_counts(size_), send_offsets(size_), recv_counts(size_), recv_offsets(size_);
  const size_t e = send.element_size();
  int64_t recv_total = 0;
  for (int r = 0; r < size_; ++r) {
    send_counts[r] = size_t(inputs[r].numel()) * e;
    recv_counts[r] = size_t(outputs[r].numel()) * e;
    if (r > 0) {
      send_offsets[r] = send_offsets[r - 1] + send_counts[r - 1];
      recv_offsets[r] = recv_offsets[r - 1] + recv_counts[r - 1];
    }
    recv_total += outputs[r].numel();
  }
  std::vector<at::Tensor> outs = outputs;
  Op op;
  op.collective = [send, outs, recv_total, send_counts, send_offsets, recv_counts, recv_offsets](Communicator& c) mutable {
    at::Tensor recv = at::empty({recv_total}, send.options());
    check(c.all_to_all(send.data_ptr(), send_counts.data(), send_offsets.data(), recv.data_ptr(), recv_counts.data(), recv_offsets.data(),
                       DataType::uint8),
          "all_to_all");
    scatter_into(recv, outs);
  };
  return enqueue(c10d::OpType::ALLTOALL, outs, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::barrier(const c10d::BarrierOptions&) {
  Op op;
  op.collective = [](Communicator& c) { check(c.barrier(), "barrier"); };
  return enqueue(c10d::OpType::BARRIER, {}, std::move(op));
}

// ---- point to point ----

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_one(tensors, "send");
  TORCH_CHECK(dst >= 0 && dst < size_ && dst != rank_, "stellar: send to rank ", dst, " (this is rank ", rank_, " of ", size_, ")");
  Staged s = stage(tensors[0], "send");
  Op op;
  op.start_point_to_point = [s, dst, tag](Communicator& c) {
    auto request = c.start_send(dst, s.data(), s.bytes(), uint32_t(tag));
    if (!request) fail(request.status(), "send");
    return *request;
  };
  op.after = [s] {};  // holds the staged tensor until the data is out
  return enqueue(c10d::OpType::SEND, tensors, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_one(tensors, "recv");
  TORCH_CHECK(src >= 0 && src < size_ && src != rank_, "stellar: recv from rank ", src, " (this is rank ", rank_, " of ", size_, ")");
  Staged s = stage(tensors[0], "recv", false);
  Op op;
  op.start_point_to_point = [s, src, tag](Communicator& c) {
    auto request = c.start_recv(src, s.data(), s.bytes(), uint32_t(tag));
    if (!request) fail(request.status(), "recv");
    return *request;
  };
  op.after = [s]() mutable { s.unstage(); };
  return enqueue(c10d::OpType::RECV, tensors, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupStellar::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "stellar: recv from any source is not supported: name the source rank (src=...)");
}

}  // namespace stellar_torch

// stellar_torch._C: the Python face of ProcessGroupStellar. `create` is the
// creator torch.distributed.Backend.register_backend calls with the group's
// store, rank, size and timeout (stellar_torch/__init__.py registers it).
#include <pybind11/chrono.h>
#include <torch/python.h>

#include "process_group.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Stellar's torch.distributed backend (see stellar_torch)";
  // torch's own bindings of ProcessGroup and Store must be loaded first: the
  // class below derives from the former, `create` takes the latter.
  py::module_::import("torch.distributed");

  py::class_<stellar_torch::ProcessGroupStellar, c10d::ProcessGroup, c10::intrusive_ptr<stellar_torch::ProcessGroupStellar>>(m, "ProcessGroupStellar")
      .def(
          "counters",
          [](stellar_torch::ProcessGroupStellar& pg) {
            stellar::coll::CommunicatorCounters c;
            {
              // Queued behind the group's operations, whose tensors the
              // worker may need the GIL to free.
              py::gil_scoped_release release;
              c = pg.counters();
            }
            py::dict d;
            d["calls"] = c.calls;
            d["bytes_sent"] = c.bytes_sent;
            d["messages_sent"] = c.messages_sent;
            d["shared_memory_peers"] = c.shared_memory_peers;
            d["local_ranks"] = c.local_ranks;
            d["cpus"] = c.cpus;
            d["oversubscribed"] = c.oversubscribed;
            d["wait"] = c.wait == stellar::WaitPolicy::busy_poll ? "busy" : "adaptive";
            return d;
          },
          "The communicator's counters (calls, bytes, shared-memory peers, the wait policy and why).");

  m.def(
      "create",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
        return c10::make_intrusive<stellar_torch::ProcessGroupStellar>(store, rank, size, timeout);
      },
      // The rendezvous blocks until every rank arrives: without the GIL, so
      // the process's other Python threads run meanwhile.
      py::call_guard<py::gil_scoped_release>(), py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
      "Creates the process group of `rank` of `size` through `store` (torch.distributed's backend creator).");
}

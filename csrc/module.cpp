// Python bindings: torch_tdist._C.ProcessGroupTDist.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "nvshmem_bootstrap.hpp"
#include "process_group_tdist.hpp"
#include "stream_program.hpp"

namespace py = pybind11;
using tdist::ProcessGroupTDist;

#ifdef TDIST_WITH_ROCSHMEM
namespace tdist::rocshmem {
void bind(py::module_& m); // rocshmem_bootstrap.cpp (setup.py: TDIST_ROCSHMEM_HOME)
} // namespace tdist::rocshmem
#endif

namespace {

using FallbackMap =
    std::unordered_map<std::string, c10::intrusive_ptr<c10d::Backend>>;

c10::intrusive_ptr<ProcessGroupTDist> create(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    py::object executor,
    FallbackMap fallbacks,
    const std::vector<std::string>& servedDevices,
    const std::vector<std::string>& devices) {
  TORCH_CHECK_VALUE(
      !executor.is_none(), "ProcessGroupTDist: executor must not be None");
  return c10::make_intrusive<ProcessGroupTDist>(
      store,
      rank,
      size,
      timeout,
      std::move(executor),
      std::move(fallbacks),
      servedDevices,
      devices);
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch-tdist C++ backend";
  // Registers c10d's Store and Backend types with pybind11, so that our
  // class can derive from torch.distributed's Backend.
  py::module_::import("torch.distributed");

  py::class_<
      ProcessGroupTDist,
      c10d::Backend,
      c10::intrusive_ptr<ProcessGroupTDist>>(m, "ProcessGroupTDist")
      .def(
          py::init(&create),
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"),
          py::arg("executor"),
          py::arg("fallbacks"),
          py::arg("served_devices"),
          py::arg("devices"))
      .def(
          "fused_all_gather_matmul",
          &ProcessGroupTDist::fusedAllGatherMatmul,
          py::arg("a"),
          py::arg("bs"),
          py::arg("dim"),
          py::arg("return_a"),
          py::arg("below_autograd") = false,
          "(A gathered, [outputs]) of a torch_tdist.ops.all_gather_matmul call "
          "issued from C++ the way its signature's first call ran; None where "
          "no such call was remembered (the Python path serves it).")
      .def(
          "fused_matmul_reduce_scatter",
          &ProcessGroupTDist::fusedMatmulReduceScatter,
          py::arg("a"),
          py::arg("b"),
          py::arg("dim"),
          py::arg("reduce_op"),
          py::arg("below_autograd") = false,
          "The output of a torch_tdist.ops.matmul_reduce_scatter call issued "
          "from C++, or None (fused_all_gather_matmul).")
      .def(
          "remember_fused",
          &ProcessGroupTDist::rememberFused,
          py::arg("op"),
          py::arg("a"),
          py::arg("bs"),
          py::arg("dim"),
          py::arg("flag"),
          py::arg("program"),
          py::arg("staging"),
          py::arg("operands"),
          py::arg("state"),
          py::arg("counts"),
          "Issue later calls of this signature from C++: the sequential way "
          "(program None) or the recorded StreamProgram.")
      .def(
          "stats",
          &ProcessGroupTDist::stats,
          "{op: {'tdist': calls served by tdist, 'fallback': calls forwarded "
          "to the fallback backend}}")
      .def(
          "reset_stats",
          &ProcessGroupTDist::resetStats,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "set_gpu_size_limit",
          &ProcessGroupTDist::setGpuSizeLimit,
          py::arg("op"),
          py::arg("max_bytes"),
          py::arg("served_from") = -1,
          "GPU calls of `op` larger than `max_bytes` (-1: any) and smaller "
          "than `served_from` (-1: any) go to the fallback")
      .def(
          "set_communication",
          &ProcessGroupTDist::setCommunication,
          py::arg("on"),
          "False: every call returns at once, nothing moved (measurements of the step time "
          "with free communication)")
      .def(
          "set_gpu_uneven_all_to_all",
          &ProcessGroupTDist::setGpuUnevenAllToAll,
          py::arg("served"))
      .def(
          "abort",
          &ProcessGroupTDist::abort,
          py::call_guard<py::gil_scoped_release>(),
          "Abort the group: its waits give up and every later call raises.")
      .def(
          "check_open",
          &ProcessGroupTDist::checkOpen,
          py::arg("op"),
          py::call_guard<py::gil_scoped_release>(),
          "Raise the error later calls get once the group was aborted.")
      .def(
          "order_queued",
          &ProcessGroupTDist::orderQueued,
          py::arg("device"),
          py::call_guard<py::gil_scoped_release>(),
          "Make the CUDA device's current stream wait for the group's last "
          "call where that ran on another stream (before a call of "
          "torch_tdist.ops).")
      .def(
          "watch_queued",
          &ProcessGroupTDist::watchQueued,
          py::arg("op"),
          py::arg("device"),
          py::call_guard<py::gil_scoped_release>(),
          "Watch the work `op` (all_gather_matmul or matmul_reduce_scatter) "
          "queued on the CUDA device's current stream, as the group's calls "
          "are: the group is aborted if it does not finish within the timeout.")
      .def_property_readonly(
          "abort_word_address", &ProcessGroupTDist::abortWordAddress)
      .def_property_readonly("executor", &ProcessGroupTDist::executor)
      .def_property_readonly(
          "served_devices", &ProcessGroupTDist::servedDevices)
      .def_property_readonly("devices", &ProcessGroupTDist::devices)
      .def(
          "fallback",
          &ProcessGroupTDist::fallbackBackend,
          py::arg("device"),
          "The inner backend for a device type ('cpu', 'cuda'), or None.");

  m.def(
      "nvshmem_bootstrap",
      [](const c10::intrusive_ptr<c10d::Store>& store,
         const std::string& key,
         int rank,
         int worldSize,
         const std::string& libraryPath) {
        tdist::nvshmem::Status status;
        {
          py::gil_scoped_release noGil; // waits on peers through the store
          status = tdist::nvshmem::bootstrap(
              store, key, rank, worldSize, libraryPath);
        }
        return py::make_tuple(
            status.initialisedHere, status.myPe, status.nPes);
      },
      py::arg("store"),
      py::arg("key"),
      py::arg("rank"),
      py::arg("world_size"),
      py::arg("library_path"),
      "(initialised here, my PE, number of PEs); NVSHMEM over the group");
  py::class_<tdist::FusedCounts, std::shared_ptr<tdist::FusedCounts>>(m, "FusedCounts")
      .def(py::init<>())
      .def_readonly("sequential", &tdist::FusedCounts::sequential)
      .def_readonly("program", &tdist::FusedCounts::program)
      .def_readonly("graph", &tdist::FusedCounts::graph);
  py::class_<tdist::StreamProgram>(m, "StreamProgram")
      .def(
          py::init<const py::list&, const std::vector<std::tuple<int64_t, int64_t, int64_t>>&>(),
          py::arg("steps"),
          py::arg("side_streams"))
      .def(
          "run",
          &tdist::StreamProgram::run,
          py::arg("roles"),
          py::call_guard<py::gil_scoped_release>(),
          "Queue the recorded call with these tensors in place of the recorded ones.")
      .def(
          "add_graph",
          &tdist::StreamProgram::addGraph,
          py::arg("addresses"),
          py::arg("graph_exec"),
          py::arg("graph"))
      .def("drop_graph", &tdist::StreamProgram::dropGraph, py::arg("addresses"));
  m.def("nvshmem_malloc", &tdist::nvshmem::malloc, py::arg("nbytes"));
  m.def("nvshmem_free", &tdist::nvshmem::free, py::arg("address"));
  m.def(
      "nvshmem_ptr",
      &tdist::nvshmem::peerPointer,
      py::arg("address"),
      py::arg("pe"));
  m.def(
      "nvshmem_init_module",
      &tdist::nvshmem::initModule,
      py::arg("cu_module"));
#ifdef TDIST_WITH_ROCSHMEM
  tdist::rocshmem::bind(m);
#endif
}

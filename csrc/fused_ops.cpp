// The custom ops torch.ops.tdist.all_gather_matmul and
// torch.ops.tdist.matmul_reduce_scatter: schemas and kernels registered with
// the dispatcher from C++, so that a call that records no gradient (from
// torch.compile's code, the async-TP pass, inference) reaches the group's C++
// issue path (fused_calls.cpp) without a Python frame. torch.library.custom_op's
// Python layers cost 15-20 us of host time a call, as much as the call's own
// work.
//
// - Autograd key: a call that needs no gradient goes below autograd at once;
//   one that does runs Python's autograd.Function (custom_ops.py), whose
//   forward calls the op again, below autograd.
// - CompositeExplicitAutograd (every device): the signature's call issued from
//   C++ where the group's tdist backend remembered it; else Python's
//   implementation (the first call of a signature, tuning, the checks and
//   their errors, another backend or device).
// - The fake kernels (torch.compile, meta tensors) are Python's
//   (torch.library.register_fake in custom_ops.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include "process_group_tdist.hpp"

namespace tdist {

namespace {

using GatherResult = std::tuple<at::Tensor, std::vector<at::Tensor>>;

// torch_tdist.overlap.custom_ops.<name>, looked up once and kept for the
// life of the process (never released: at exit the interpreter may be gone).
// Called with the GIL held, which guards the map.
py::object pythonFunction(const char* name) {
  static auto* functions = new std::unordered_map<std::string, PyObject*>();
  auto found = functions->find(name);
  if (found == functions->end()) {
    py::object f = py::module_::import("torch_tdist.overlap.custom_ops").attr(name);
    found = functions->emplace(name, f.release().ptr()).first;
  }
  return py::reinterpret_borrow<py::object>(found->second);
}

// The tdist backend that serves `device` in the group named `groupName`, or
// none (another backend, torch's debug wrapper, no such group: Python's path
// gives those their errors).
c10::intrusive_ptr<ProcessGroupTDist> tdistBackend(
    const std::string& groupName,
    const c10::Device& device) {
  try {
    auto backend = c10d::resolve_process_group(groupName)->getBackend(device.type());
    if (dynamic_cast<ProcessGroupTDist*>(backend.get()) == nullptr) {
      return {};
    }
    return c10::static_intrusive_pointer_cast<ProcessGroupTDist>(backend);
  } catch (const std::exception&) {
    return {};
  }
}

// Whether a call must go through autograd: a gradient to record, or a
// forward-mode tangent (which Python's autograd.Function refuses clearly).
bool needsGrad(const at::Tensor& a, at::TensorList bs) {
  bool record = at::GradMode::is_enabled();
  auto wants = [record](const at::Tensor& t) {
    return (record && t.requires_grad()) || t._fw_grad(/*level=*/0).defined();
  };
  return wants(a) || std::any_of(bs.begin(), bs.end(), wants);
}

// The call issued from C++ by the group's tdist backend (`issue`: None where
// its signature was not remembered), else by Python's `implementation`.
template <typename Result, typename Issue, typename... Args>
Result issuedOrPython(
    const at::Tensor& a,
    const std::string& group,
    Issue issue,
    const char* implementation,
    const Args&... args) {
  py::gil_scoped_acquire gil;
  py::object result = py::none();
  if (auto backend = tdistBackend(group, a.device())) {
    result = issue(*backend);
  }
  if (result.is_none()) {
    result = pythonFunction(implementation)(args...);
  }
  return result.cast<Result>();
}

GatherResult allGatherMatmul(
    const at::Tensor& a,
    at::TensorList bs,
    c10::string_view groupName,
    int64_t gatherDim,
    bool returnA) {
  std::string group(groupName);
  std::vector<at::Tensor> bList(bs.begin(), bs.end());
  return issuedOrPython<GatherResult>(
      a, group,
      [&](ProcessGroupTDist& backend) {
        return backend.fusedAllGatherMatmul(a, bList, gatherDim, returnA, /*belowAutograd=*/true);
      },
      "all_gather_matmul_impl", a, bList, group, gatherDim, returnA);
}

at::Tensor matmulReduceScatter(
    const at::Tensor& a,
    const at::Tensor& b,
    c10::string_view groupName,
    int64_t scatterDim,
    c10::string_view reduceOp) {
  std::string group(groupName), reduce(reduceOp);
  return issuedOrPython<at::Tensor>(
      a, group,
      [&](ProcessGroupTDist& backend) {
        return backend.fusedMatmulReduceScatter(a, b, scatterDim, reduce, /*belowAutograd=*/true);
      },
      "matmul_reduce_scatter_impl", a, b, group, scatterDim, reduce);
}

GatherResult allGatherMatmulAutograd(
    const at::Tensor& a,
    at::TensorList bs,
    c10::string_view groupName,
    int64_t gatherDim,
    bool returnA) {
  if (!needsGrad(a, bs)) {
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("tdist::all_gather_matmul", "")
                         .typed<decltype(allGatherMatmul)>();
    return op.call(a, bs, groupName, gatherDim, returnA);
  }
  std::vector<at::Tensor> bList(bs.begin(), bs.end());
  py::gil_scoped_acquire gil;
  return pythonFunction("all_gather_matmul_autograd")(a, bList, std::string(groupName), gatherDim, returnA)
      .cast<GatherResult>();
}

at::Tensor matmulReduceScatterAutograd(
    const at::Tensor& a,
    const at::Tensor& b,
    c10::string_view groupName,
    int64_t scatterDim,
    c10::string_view reduceOp) {
  if (!needsGrad(a, {b})) {
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("tdist::matmul_reduce_scatter", "")
                         .typed<decltype(matmulReduceScatter)>();
    return op.call(a, b, groupName, scatterDim, reduceOp);
  }
  py::gil_scoped_acquire gil;
  return pythonFunction("matmul_reduce_scatter_autograd")(
             a, b, std::string(groupName), scatterDim, std::string(reduceOp))
      .cast<at::Tensor>();
}

} // namespace

TORCH_LIBRARY_FRAGMENT(tdist, m) {
  // (as torch.library.custom_op tags its ops: torch.compile may keep them in
  // a full graph where it allows only PT2-compliant ops)
  m.def(
      "all_gather_matmul(Tensor a_shard, Tensor[] bs, str group_name, int gather_dim, bool return_a)"
      " -> (Tensor, Tensor[])",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "matmul_reduce_scatter(Tensor a, Tensor b, str group_name, int scatter_dim, str reduce_op)"
      " -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tdist, Autograd, m) {
  m.impl("all_gather_matmul", allGatherMatmulAutograd);
  m.impl("matmul_reduce_scatter", matmulReduceScatterAutograd);
}

TORCH_LIBRARY_IMPL(tdist, CompositeExplicitAutograd, m) {
  m.impl("all_gather_matmul", allGatherMatmul);
  m.impl("matmul_reduce_scatter", matmulReduceScatter);
}

} // namespace tdist

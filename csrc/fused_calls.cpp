// torch_tdist.ops' calls issued from C++: after the first call of a signature
// ran in Python (torch_tdist/overlap/custom_ops.py), later calls of that
// signature run the same way here, without the Python frames that cost 100-200
// us of host time a call (tuning lookup, rounds, recorded-program lookup,
// CUDA-graph lookup). Each function mirrors its Python counterpart step for
// step, so that both give the same tensors (a GPU check compares them bit for
// bit): _all_gather / _reduce_scatter for the sequential way,
// _overlapped_all_gather_matmul / _overlapped_matmul_reduce_scatter for the
// pipelined way, with _as_rows, _from_rows and _row_major.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include "process_group_tdist.hpp"
#include "stream_program.hpp"

namespace tdist {

namespace {

constexpr const char* kFusedOps[] = {"all_gather_matmul", "matmul_reduce_scatter"};

// A tensor the plans may take: dense, strided, without a Python subclass,
// functionalization or functorch wrapper (those take the dispatcher's path).
bool plain(const at::Tensor& t) {
  constexpr c10::DispatchKey wrappers[] = {
      c10::DispatchKey::Python,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::Conjugate,
      c10::DispatchKey::Negative,
  };
  if (!t.defined() || t.layout() != at::kStrided) {
    return false;
  }
  auto keys = t.key_set();
  for (auto key : wrappers) {
    if (keys.has(key)) {
      return false;
    }
  }
  return true;
}

// _row_major: `t` with row-major strides, a view where only dimensions of size
// 1 differ, a copy otherwise.
at::Tensor rowMajor(const at::Tensor& t) {
  std::vector<int64_t> strides(t.dim());
  int64_t step = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    strides[d] = step;
    step *= std::max<int64_t>(t.size(d), 1);
  }
  if (t.strides() == c10::IntArrayRef(strides)) {
    return t;
  }
  bool same = true;
  for (int64_t d = 0; d < t.dim(); ++d) {
    same = same && (t.size(d) <= 1 || t.stride(d) == strides[d]);
  }
  if (same) {
    return t.as_strided(t.sizes(), strides);
  }
  return at::empty_strided(t.sizes(), strides, t.options()).copy_(t);
}

// _as_rows: [rows, last dimension] contiguous, `dim` first.
at::Tensor asRows(const at::Tensor& t, int64_t dim) {
  if (dim == 0 && t.dim() == 2 && t.is_contiguous()) {
    return t;
  }
  return t.movedim(dim, 0).reshape({-1, t.size(-1)}).contiguous();
}

// _from_rows: `rows` as a row-major tensor of `shape`.
at::Tensor fromRows(at::Tensor rows, std::vector<int64_t> shape, int64_t dim) {
  if (dim != 0 || shape.size() != 2) {
    std::vector<int64_t> front{shape[dim]};
    for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
      if (d != dim) {
        front.push_back(shape[d]);
      }
    }
    rows = rows.reshape(front).movedim(0, dim);
  }
  return rowMajor(rows);
}

// What torch.distributed does with a synchronous call's Work (a fallback backend may still
// return one that is not done: Gloo's for CPU tensors).
void waitFor(const c10::intrusive_ptr<c10d::Work>& work) {
  if (work) {
    py::gil_scoped_release released;
    work->wait();
  }
}

// custom_ops._side_by_side: the Bs' columns side by side, transposes of row-major
// matrices joined as those (a plain copy rather than a transposing one).
at::Tensor sideBySide(const std::vector<at::Tensor>& bs) {
  if (bs.size() == 1) {
    return bs[0];
  }
  bool transposed = true;
  for (const auto& b : bs) {
    transposed = transposed && b.stride(0) == 1 && b.stride(1) == b.size(0);
  }
  if (!transposed) {
    return at::cat(bs, 1);
  }
  std::vector<at::Tensor> rows;
  for (const auto& b : bs) {
    rows.push_back(b.t());
  }
  return at::cat(rows, 0).t();
}

std::vector<at::Tensor> together(const at::Tensor& a, const std::vector<at::Tensor>& bs) {
  std::vector<at::Tensor> all{a};
  all.insert(all.end(), bs.begin(), bs.end());
  return all;
}

} // namespace

std::vector<int64_t> ProcessGroupTDist::fusedKey(
    int op,
    const at::Tensor& a,
    const std::vector<at::Tensor>& bs,
    int64_t dim,
    int64_t flag) const {
  std::vector<int64_t> key{
      op,
      dim,
      flag,
      static_cast<int64_t>(a.scalar_type()),
      static_cast<int64_t>(a.device().type()),
      a.device().index()};
  for (const auto& t : together(a, bs)) {
    key.push_back(t.dim());
    key.insert(key.end(), t.sizes().begin(), t.sizes().end());
    key.insert(key.end(), t.strides().begin(), t.strides().end());
    key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
  }
  return key;
}

std::optional<ProcessGroupTDist::FusedPlan> ProcessGroupTDist::fusedPlan(
    int op,
    const at::Tensor& a,
    const std::vector<at::Tensor>& bs,
    int64_t dim,
    int64_t flag,
    bool belowAutograd) const {
  if (fusedPlans_.empty() || bs.empty() || !plain(a) || a.dim() < 2) {
    return std::nullopt;
  }
  // float32 matmuls follow the TF32 setting of the moment (Python keys its programs on it)
  if (a.scalar_type() != at::kBFloat16 && a.scalar_type() != at::kHalf) {
    return std::nullopt;
  }
  if (at::autocast::is_autocast_enabled(a.device().type()) ||
      c10::impl::TorchDispatchModeTLS::any_modes_set()) {
    return std::nullopt;
  }
  bool grad = !belowAutograd && at::GradMode::is_enabled();
  for (const auto& t : together(a, bs)) {
    if (!plain(t) || t.device() != a.device() || t.scalar_type() != a.scalar_type() ||
        (grad && t.requires_grad()) || t._fw_grad(/*level=*/0).defined()) {
      return std::nullopt; // (a dual tensor's tangent needs the custom op's forward-mode rule)
    }
  }
  if (dim < -a.dim() || dim >= a.dim()) {
    return std::nullopt;
  }
  auto found = fusedPlans_.find(fusedKey(op, a, bs, dim < 0 ? dim + a.dim() : dim, flag));
  if (found == fusedPlans_.end()) {
    return std::nullopt;
  }
  // the program's way runs as Python's outside CUDA graph captures only (a capture gets its own
  // scratch there, and the steps rather than a graph)
  if (found->second.program && a.is_cuda() && captureId(currentStream(a.device())) != 0) {
    return std::nullopt;
  }
  if (found->second.program && !communicate_) { // (its steps move data themselves)
    return std::nullopt;
  }
  return found->second; // (a copy: Python may run, and change the plans, while it is used)
}

void ProcessGroupTDist::rememberFused(
    const std::string& op,
    const at::Tensor& a,
    const std::vector<at::Tensor>& bs,
    int64_t dim,
    int64_t flag,
    py::object program,
    std::optional<at::Tensor> staging,
    int64_t operands,
    py::object state,
    std::shared_ptr<FusedCounts> counts) {
  int index = op == kFusedOps[0] ? 0 : op == kFusedOps[1] ? 1 : -1;
  TORCH_CHECK_VALUE(index >= 0, "tdist: remember_fused: no fused op named '", op, "'");
  TORCH_CHECK_VALUE(program.is_none() || a.is_cuda(), "tdist: remember_fused: a stream program runs on CUDA tensors");
  FusedPlan plan;
  if (!program.is_none()) {
    program.cast<StreamProgram*>(); // (a clear error for anything else)
    plan.program = std::make_shared<GilSafeObject>(program);
  }
  plan.state = std::make_shared<GilSafeObject>(state);
  if (staging) {
    plan.staging = *staging;
    // ProgramReplay.scratch grew into new memory: plans still holding the old one would keep it
    // (they record again, with the new one, on their next call)
    const void* now = staging->storage().data();
    for (auto it = fusedPlans_.begin(); it != fusedPlans_.end();) {
      const auto& old = it->second.staging;
      bool stale = old.defined() && old.scalar_type() == staging->scalar_type() &&
          old.device() == staging->device() && old.storage().data() != now;
      it = stale ? fusedPlans_.erase(it) : std::next(it);
    }
  }
  plan.operands = operands;
  plan.counts = std::move(counts);
  fusedPlans_[fusedKey(index, a, bs, dim < 0 ? dim + a.dim() : dim, flag)] = std::move(plan);
}

void ProcessGroupTDist::startFused(const char* op, const at::Tensor& a) {
  checkNotAborted(op);
  // Executor._begin's check (an attribute, read without a Python call)
  py::object stopped = py::getattr(executor_.get(), "_stopped", py::none());
  if (!stopped.is_none()) { // (what the collectives raise then: their Python error, as C++ maps it)
    C10_THROW_ERROR(
        DistBackendError,
        std::string("tdist ") + op + ": this group stopped after " +
            py::str(stopped).cast<std::string>() + "; destroy it and create a new one");
  }
  if (a.is_cuda()) { // (custom_ops._ordered: before anything of the call is queued)
    orderQueued(a.device().index());
  }
}

void ProcessGroupTDist::runProgram(
    int op,
    const FusedPlan& plan,
    const std::vector<at::Tensor>& roles) {
  const char* name = kFusedOps[op];
  auto device = roles[0].device().index();
  try {
    auto program = plan.program->get();
    bool launched = false;
    try {
      launched = program.cast<StreamProgram*>()->runGraph(roles);
    } catch (...) { // (as Executor.run_unplanned: peers may be left part-way)
      executor_.get().attr("_stopped") = std::string(name) + " failed part-way (its CUDA graph)";
      throw;
    }
    if (launched) {
      plan.counts->graph[op] += 1;
    } else {
      plan.state->get().attr("replay_program")(name, program, roles);
      plan.counts->program[op] += 1;
    }
  } catch (...) {
    watchQueued(name, device); // (what the call queued before it failed)
    throw;
  }
  watchQueued(name, device);
}

py::object ProcessGroupTDist::fusedAllGatherMatmul(
    const at::Tensor& a,
    const std::vector<at::Tensor>& bs,
    int64_t dim,
    bool returnA,
    bool belowAutograd) {
  auto plan = fusedPlan(0, a, bs, dim, returnA, belowAutograd);
  if (!plan) {
    return py::none();
  }
  startFused(kFusedOps[0], a);
  dim = dim < 0 ? dim + a.dim() : dim;
  auto shape = a.sizes().vec();
  shape[dim] *= size_;
  if (!plan->program) { // custom_ops._all_gather, then torch.matmul
    auto rows = a.movedim(dim, 0).contiguous();
    auto sizes = rows.sizes().vec();
    sizes[0] *= size_;
    auto gathered = at::empty(sizes, rows.options());
    c10d::AllgatherOptions opts;
    opts.asyncOp = false;
    waitFor(_allgather_base(gathered, rows, opts));
    auto aFull = rowMajor(gathered.movedim(0, dim));
    std::vector<at::Tensor> outs;
    for (const auto& b : bs) {
      outs.push_back(at::matmul(aFull, b));
    }
    plan->counts->sequential[0] += 1;
    return py::make_tuple(aFull, outs);
  }
  // custom_ops._overlapped_all_gather_matmul, pipelined
  auto rows = asRows(a, dim);
  auto m = size_ * rows.size(0);
  std::vector<at::Tensor> roles{rows}, outs; // (roles: A, the Bs, their outputs, A gathered)
  std::vector<int64_t> widths;
  for (const auto& b : bs) {
    widths.push_back(b.size(1));
  }
  if (plan->operands == static_cast<int64_t>(bs.size())) { // one matmul per B
    roles.insert(roles.end(), bs.begin(), bs.end());
    for (auto width : widths) {
      outs.push_back(at::empty({m, width}, rows.options()));
    }
  } else {
    auto b = sideBySide(bs);
    roles.push_back(b);
    outs.push_back(at::empty({m, b.size(1)}, rows.options()));
  }
  roles.insert(roles.end(), outs.begin(), outs.end());
  auto gathered = at::empty({m, rows.size(1)}, rows.options());
  roles.push_back(gathered);
  runProgram(0, *plan, roles);
  if (outs.size() != bs.size()) {
    outs = outs[0].split_with_sizes(widths, 1);
  }
  std::vector<at::Tensor> results;
  for (const auto& o : outs) {
    auto outShape = shape;
    outShape.back() = o.size(1);
    results.push_back(fromRows(o, outShape, dim));
  }
  return py::make_tuple(fromRows(gathered, shape, dim), results);
}

py::object ProcessGroupTDist::fusedMatmulReduceScatter(
    const at::Tensor& a,
    const at::Tensor& b,
    int64_t dim,
    const std::string& reduceOp,
    bool belowAutograd) {
  int64_t flag = reduceOp == "sum" ? 0 : reduceOp == "avg" ? 1 : -1;
  auto plan = flag < 0 ? std::nullopt : fusedPlan(1, a, {b}, dim, flag, belowAutograd);
  if (!plan) {
    return py::none();
  }
  startFused(kFusedOps[1], a);
  dim = dim < 0 ? dim + a.dim() : dim;
  if (!plan->program) { // torch.matmul, then custom_ops._reduce_scatter
    auto rows = at::matmul(a, b).movedim(dim, 0).contiguous();
    auto sizes = rows.sizes().vec();
    sizes[0] /= size_;
    auto out = at::empty(sizes, rows.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = flag == 0 ? c10d::ReduceOp::SUM : c10d::ReduceOp::AVG;
    opts.asyncOp = false;
    waitFor(_reduce_scatter_base(out, rows, opts));
    plan->counts->sequential[1] += 1;
    return py::cast(rowMajor(out.movedim(0, dim)));
  }
  // custom_ops._overlapped_matmul_reduce_scatter, pipelined
  auto rows = asRows(a, dim);
  auto out = at::empty({rows.size(0) / size_, b.size(1)}, rows.options());
  runProgram(1, *plan, {rows, b, out, plan->staging});
  auto shape = a.sizes().vec();
  shape.back() = b.size(1);
  shape[dim] /= size_;
  return py::cast(fromRows(out, shape, dim));
}

} // namespace tdist

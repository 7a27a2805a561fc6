// The member templates of ProcessGroupTDist that every collective entry
// point instantiates: execute() (a served call through the Python executor),
// executePlanned() (a recorded launch plan replayed, or the executor), and
// handOver() (a call the fallback backend serves, in the group's stream
// order). In a header because collective_ops.cpp and process_group_tdist.cpp
// both instantiate them.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "process_group_tdist.hpp"

namespace tdist {

using c10d::OpType;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

// Called with the GIL held. ValueError/TypeError/NotImplementedError keep
// their Python type; a TimeoutError becomes a DistBackendError with its message;
// anything else becomes a DistBackendError that carries the Python traceback.
[[noreturn]] void throwPythonError(Op op, py::error_already_set& e);

template <typename... Args>
std::optional<CallPlan> ProcessGroupTDist::execute(
    Op op,
    const char* method,
    Args&&... args) {
  if (!communicate_) {
    return std::nullopt;
  }
  py::gil_scoped_acquire gil;
  try {
    py::object plan =
        executor_.get().attr(method)(std::forward<Args>(args)...);
    if (plan.is_none()) {
      return std::nullopt;
    }
    return CallPlan::fromPython(plan);
  } catch (py::error_already_set& e) {
    throwPythonError(op, e);
  }
}

template <typename... Args>
void ProcessGroupTDist::executePlanned(
    const PlanKey& key,
    const at::Tensor& input,
    const at::Tensor& output,
    Op op,
    const char* method,
    Args&&... args) {
  if (!communicate_) {
    return;
  }
  if (!input.is_cpu() && LaunchPlan::fits(input) && LaunchPlan::fits(output)) {
    std::lock_guard<std::mutex> lock(plansMutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      c10::impl::VirtualGuardImpl impl(input.device().type());
      it->second.launch(
          input, output, impl.getStream(input.device()).native_handle());
      return;
    }
  }
  auto plan = execute(op, method, std::forward<Args>(args)...);
  if (plan) {
    std::lock_guard<std::mutex> lock(plansMutex_);
    plans_.emplace(key, std::move(*plan));
  }
}

template <typename Checks>
void ProcessGroupTDist::checkOrReject(
    Op op,
    const at::Tensor& call,
    int64_t root,
    const Checks& checks) {
  try {
    checks();
  } catch (const c10::ValueError& e) {
    rejectCall(op, call, root, e.what_without_backtrace());
    throw;
  } catch (const c10::TypeError& e) {
    rejectCall(op, call, root, e.what_without_backtrace());
    throw;
  }
}

template <typename CallOptions, typename Call>
WorkPtr ProcessGroupTDist::handOver(
    Op op,
    OpType type,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const CallOptions& opts,
    size_t n,
    Call call) {
  if (!communicate_) {
    return finishWork(startWork(op, type, inputs, outputs, opts.asyncOp), op, n, Route::Fallback);
  }
  const auto& ref = inputs.empty() ? outputs.at(0) : inputs[0];
  auto& backend = fallbackFor(op, ref.device().type());
  if (!ref.is_cuda()) {
    count(op, Route::Fallback, n);
    return call(backend, opts);
  }
  if (!opts.asyncOp) {
    auto caller = currentStream(ref.device());
    uint64_t capture = captureId(caller);
    waitForLastCall(caller, capture);
    auto work = call(backend, opts);
    count(op, Route::Fallback, n);
    becomeLastCall(caller, capture);
    return work;
  }
  auto work = startWork(op, type, inputs, outputs, true);
  CallOptions onStream = opts;
  onStream.asyncOp = false; // (NCCL: on the current stream, startWork's)
  auto nested = call(backend, onStream);
  if (nested) {
    nested->wait(); // (a backend that still returns Work for a synchronous call)
  }
  return finishWork(work, op, n, Route::Fallback);
}

} // namespace tdist

// The torch.distributed entry points of ProcessGroupTDist: all-gather,
// reduce-scatter, all-reduce, all-to-all, the rooted ops, point-to-point.
// Each one checks its arguments (validation.hpp), routes the call to tdist or
// to the fallback backend (handOver), and runs a served call between
// startWork and finishWork through the executor (execution.hpp).
#include "process_group_tdist.hpp"

#include <optional>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "execution.hpp"
#include "validation.hpp"

namespace tdist {

using c10d::ReduceOp;

namespace {

std::vector<at::Tensor> column(
    const std::vector<std::vector<at::Tensor>>& lists,
    size_t j) {
  std::vector<at::Tensor> out;
  out.reserve(lists.size());
  for (const auto& list : lists) {
    out.push_back(list[j]);
  }
  return out;
}

std::vector<at::Tensor> flatten(
    const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) {
    out.insert(out.end(), list.begin(), list.end());
  }
  return out;
}

} // namespace

// ---------------------------------------------------------------- all-gather

WorkPtr ProcessGroupTDist::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGatherIntoTensor;
  bool fallback = !(strided(input) && strided(output));
  if (!fallback) {
    checkDevice(op, input, "input");
    checkAllGatherPair(op, output, input, size_);
    fallback = limitBySize(op, routeMovement(input), input) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::_ALLGATHER_BASE, {input}, {output}, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b._allgather_base(output, input, o);
        });
  }
  auto work = startWork(op, OpType::_ALLGATHER_BASE, {input}, {output}, opts.asyncOp);
  executePlanned(
      planKey(op, input, output),
      input,
      output,
      op,
      "all_gather_into_tensor",
      output,
      input);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGatherIntoTensor;
  checkSameLength(op, outputs, inputs);
  bool layoutsServed = strided(inputs) && strided(outputs);
  Route route = layoutsServed ? Route::Tdist : Route::Fallback;
  for (size_t i = 0; layoutsServed && i < inputs.size(); ++i) {
    checkDevice(op, inputs[i], "input");
    checkSameDevice(op, inputs[0], "input 0", inputs[i], "input");
    checkAllGatherPair(op, outputs[i], inputs[i], size_);
    if (limitBySize(op, routeMovement(inputs[i]), inputs[i]) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::COALESCED, inputs, outputs, opts, inputs.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.allgather_into_tensor_coalesced(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::COALESCED, inputs, outputs, opts.asyncOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    execute(op, "all_gather_into_tensor", outputs[i], inputs[i]);
  }
  return finishWork(work, op, inputs.size());
}

WorkPtr ProcessGroupTDist::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGather;
  checkSingle(op, inputs, "input");
  TORCH_CHECK_VALUE(
      outputs.size() == 1,
      prefix(op),
      "expected one output list, got ",
      outputs.size());
  const auto& input = inputs[0];
  bool fallback = !strided(inputs) || !strided(outputs[0]);
  if (!fallback) {
    checkDevice(op, input, "input");
    checkGroupSize(op, outputs[0].size(), "tensor_list");
    checkListLike(op, outputs[0], "tensor_list", input, "input");
    fallback = limitBySize(op, routeMovement(input), input) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::ALLGATHER, inputs, outputs[0], opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.allgather(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::ALLGATHER, inputs, outputs[0], opts.asyncOp);
  execute(op, "all_gather", outputs[0], input);
  return finishWork(work, op);
}

// outputLists[r][j] receives input j of rank r.
WorkPtr ProcessGroupTDist::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGather;
  checkGroupSize(op, outputLists.size(), "output_tensor_lists");
  bool layoutsServed = strided(inputs) && strided(flatten(outputLists));
  Route route = layoutsServed ? Route::Tdist : Route::Fallback;
  for (size_t j = 0; layoutsServed && j < inputs.size(); ++j) {
    checkDevice(op, inputs[j], "input");
    if (routeMovement(inputs[j]) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  for (size_t r = 0; layoutsServed && r < outputLists.size(); ++r) {
    TORCH_CHECK_VALUE(
        outputLists[r].size() == inputs.size(),
        prefix(op),
        "output_tensor_lists[",
        r,
        "] has ",
        outputLists[r].size(),
        " tensors, expected ",
        inputs.size(),
        " (one per input)");
    for (size_t j = 0; j < inputs.size(); ++j) {
      const auto& out = outputLists[r][j];
      Name name("output_tensor_lists", static_cast<int64_t>(r), static_cast<int64_t>(j));
      checkLike(op, inputs[j], "its input", out, name);
      TORCH_CHECK_VALUE(
          out.numel() == inputs[j].numel(),
          prefix(op),
          name,
          " has ",
          out.numel(),
          " elements, expected ",
          inputs[j].numel(),
          " (as many as input ",
          j,
          ")");
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::ALLGATHER_COALESCED, inputs, flatten(outputLists), opts, inputs.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.allgather_coalesced(outputLists, inputs, o);
        });
  }
  auto work = startWork(
      op, OpType::ALLGATHER_COALESCED, inputs, flatten(outputLists), opts.asyncOp);
  for (size_t j = 0; j < inputs.size(); ++j) {
    execute(op, "all_gather", column(outputLists, j), inputs[j]);
  }
  return finishWork(work, op, inputs.size());
}

// ----------------------------------------------------------- reduce-scatter

WorkPtr ProcessGroupTDist::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  constexpr Op op = Op::ReduceScatterTensor;
  bool fallback = !(strided(input) && strided(output));
  if (!fallback) {
    checkDevice(op, input, "input");
    checkReduceScatterPair(op, output, input, size_);
    fallback = limitBySize(op, routeReduction(op, input, opts.reduceOp), input) ==
        Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::_REDUCE_SCATTER_BASE, {input}, {output}, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b._reduce_scatter_base(output, input, o);
        });
  }
  auto work = startWork(op, OpType::_REDUCE_SCATTER_BASE, {input}, {output}, opts.asyncOp);
  executePlanned(
      planKey(op, input, output, static_cast<int>(opts.reduceOp.op_)),
      input,
      output,
      op,
      "reduce_scatter_tensor",
      output,
      input,
      executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr Op op = Op::ReduceScatterTensor;
  checkSameLength(op, outputs, inputs);
  bool layoutsServed = strided(inputs) && strided(outputs);
  Route route = layoutsServed ? Route::Tdist : Route::Fallback;
  for (size_t i = 0; layoutsServed && i < inputs.size(); ++i) {
    checkDevice(op, inputs[i], "input");
    checkSameDevice(op, inputs[0], "input 0", inputs[i], "input");
    checkReduceScatterPair(op, outputs[i], inputs[i], size_);
    if (routeReduction(op, inputs[i], opts.reduceOp) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::COALESCED, inputs, outputs, opts, inputs.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.reduce_scatter_tensor_coalesced(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::COALESCED, inputs, outputs, opts.asyncOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    execute(
        op,
        "reduce_scatter_tensor",
        outputs[i],
        inputs[i],
        executorOpName(opts.reduceOp.op_));
  }
  return finishWork(work, op, inputs.size());
}

WorkPtr ProcessGroupTDist::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr Op op = Op::ReduceScatter;
  checkSingle(op, outputs, "output");
  TORCH_CHECK_VALUE(
      inputs.size() == 1,
      prefix(op),
      "expected one input list, got ",
      inputs.size());
  const auto& output = outputs[0];
  bool fallback = !strided(outputs) || !strided(inputs[0]);
  if (!fallback) {
    checkDevice(op, output, "output");
    checkGroupSize(op, inputs[0].size(), "input_list");
    checkListLike(op, inputs[0], "input_list", output, "output");
    fallback = routeReduction(op, output, opts.reduceOp) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::REDUCE_SCATTER, inputs[0], outputs, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.reduce_scatter(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::REDUCE_SCATTER, inputs[0], outputs, opts.asyncOp);
  execute(
      op,
      "reduce_scatter",
      output,
      inputs[0],
      executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

// --------------------------------------------------------------- all-reduce

WorkPtr ProcessGroupTDist::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  constexpr Op op = Op::AllReduce;
  checkSingle(op, tensors, "input");
  const auto& t = tensors[0];
  bool fallback = !strided(tensors);
  if (!fallback) {
    checkDevice(op, t, "tensor");
    fallback = limitBySize(op, routeReduction(op, t, opts.reduceOp), t) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::ALLREDUCE, tensors, tensors, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.allreduce(tensors, o);
        });
  }
  auto work = startWork(op, OpType::ALLREDUCE, tensors, tensors, opts.asyncOp);
  executePlanned(
      planKey(op, t, t, static_cast<int>(opts.reduceOp.op_)),
      t,
      t,
      op,
      "all_reduce",
      t,
      executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  constexpr Op op = Op::AllReduce;
  bool layoutsServed = strided(tensors);
  Route route = layoutsServed ? Route::Tdist : Route::Fallback;
  for (size_t i = 0; layoutsServed && i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    checkDevice(op, t, "tensor");
    checkSameDevice(op, tensors[0], "tensor 0", t, "tensor");
    if (routeReduction(op, t, opts.reduceOp) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::ALLREDUCE_COALESCED, tensors, tensors, opts, tensors.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.allreduce_coalesced(tensors, o);
        });
  }
  auto work = startWork(op, OpType::ALLREDUCE_COALESCED, tensors, tensors, opts.asyncOp);
  for (const auto& t : tensors) {
    execute(op, "all_reduce", t, executorOpName(opts.reduceOp.op_));
  }
  return finishWork(work, op, tensors.size());
}

// --------------------------------------------------------------- all-to-all

WorkPtr ProcessGroupTDist::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  constexpr Op op = Op::AllToAllSingle;
  bool even = inputSplitSizes.empty() && outputSplitSizes.empty();
  bool fallback = !(strided(input) && strided(output));
  std::vector<int64_t> inSplits, outSplits;
  if (!fallback) {
    {
      checkDevice(op, input, "input");
      checkLike(op, input, "input", output, "output");
      TORCH_CHECK_VALUE(
          input.dim() >= 1 && output.dim() >= 1,
          prefix(op),
          "input and output need at least one dimension");
      TORCH_CHECK_VALUE(
          rowNumel(input) == rowNumel(output),
          prefix(op),
          "input rows have ",
          rowNumel(input),
          " elements but output rows have ",
          rowNumel(output),
          "; they must match (input shape ",
          input.sizes(),
          ", output shape ",
          output.sizes(),
          ")");
      TORCH_CHECK_VALUE(
          !even || input.numel() == output.numel(),
          prefix(op),
          "without split sizes, input and output must hold the same number of elements (input "
          "shape ",
          input.sizes(),
          ", output shape ",
          output.sizes(),
          ")");
      inSplits = resolveSplits(op, inputSplitSizes, input, "input", "input_split_sizes", size_);
      outSplits =
          resolveSplits(op, outputSplitSizes, output, "output", "output_split_sizes", size_);
    }
    fallback = limitBySize(op, routeMovement(input), input, even) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::ALLTOALL_BASE, {input}, {output}, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, o);
        });
  }
  auto work = startWork(op, OpType::ALLTOALL_BASE, {input}, {output}, opts.asyncOp);
  if (even) {
    // even splits: the shapes alone determine the call, the same on every rank (passed on as
    // no split sizes, so the executor may choose its kernel and grid by size)
    executePlanned(
        planKey(op, input, output),
        input,
        output,
        op,
        "all_to_all_single",
        output,
        input,
        std::vector<int64_t>{},
        std::vector<int64_t>{});
  } else {
    try {
      executeUneven(input, output, inSplits, outSplits);
    } catch (...) {
      // a rank pair too large for a mailbox raises after the launch: later calls still wait
      // for that kernel, and the watchdog watches it
      finishWork(work, op);
      throw;
    }
  }
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  constexpr Op op = Op::AllToAll;
  checkGroupSize(op, inputs.size(), "input_tensor_list");
  checkGroupSize(op, outputs.size(), "output_tensor_list");
  const auto& ref = inputs[0];
  bool fallback = !strided(inputs) || !strided(outputs);
  if (!fallback) {
    checkDevice(op, ref, "input");
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto index = static_cast<int64_t>(i);
      checkLike(op, ref, "input_tensor_list[0]", inputs[i], Name("input_tensor_list", index));
      checkLike(op, ref, "input_tensor_list[0]", outputs[i], Name("output_tensor_list", index));
    }
    fallback = limitBySize(op, routeMovement(ref), ref, false) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::ALLTOALL, inputs, outputs, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.alltoall(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::ALLTOALL, inputs, outputs, opts.asyncOp);
  execute(op, "all_to_all", outputs, inputs);
  return finishWork(work, op);
}

// ----------------------------------------------------------- rooted and misc

WorkPtr ProcessGroupTDist::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  constexpr Op op = Op::Broadcast;
  checkSingle(op, tensors, "input");
  const auto& t = tensors[0];
  bool fallback = !strided(tensors);
  if (!fallback) {
    checkDevice(op, t, "tensor");
    checkRoot(op, opts.rootRank, "src");
    TORCH_CHECK_VALUE(opts.rootTensor == 0, prefix(op), "root tensor must be 0");
    fallback = limitBySize(op, routeMovement(t), t) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::BROADCAST, tensors, tensors, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.broadcast(tensors, o);
        });
  }
  auto work = startWork(op, OpType::BROADCAST, tensors, tensors, opts.asyncOp);
  executePlanned(
      planKey(op, t, t, -1, opts.rootRank),
      t,
      t,
      op,
      "broadcast",
      t,
      opts.rootRank);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::barrier(const c10d::BarrierOptions& opts) {
  constexpr Op op = Op::Barrier;
  if (served_.empty()) {
    count(op, Route::Fallback);
    return fallbackForBarrier(opts).barrier(opts);
  }
  std::optional<c10::Device> device;
  if (served_.count(c10::kCUDA) > 0) {
    device = opts.device.has_value()
        ? *opts.device
        : c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
  }
  auto work = startWork(op, OpType::BARRIER, {}, {}, opts.asyncOp, device);
  execute(op, "barrier");
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  constexpr Op op = Op::Scatter;
  checkSingle(op, outputs, "output");
  const auto& output = outputs[0];
  // routed by the tensor every rank has: the root's list is checked, and rejected, with it
  bool fallback = !strided(outputs);
  std::vector<at::Tensor> scatterList;
  if (!fallback) {
    checkOrReject(op, output, opts.rootRank, [&] {
      checkDevice(op, output, "output");
      checkRoot(op, opts.rootRank, "src");
      scatterList =
          rootList(op, inputs, opts.rootRank, "src", "scatter_list", output, "output");
    });
    fallback = routeMovement(output) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::SCATTER, flatten(inputs), outputs, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.scatter(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::SCATTER, scatterList, outputs, opts.asyncOp);
  execute(op, "scatter", output, scatterList, opts.rootRank);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  constexpr Op op = Op::Gather;
  checkSingle(op, inputs, "input");
  const auto& input = inputs[0];
  bool fallback = !strided(inputs); // (as scatter's)
  std::vector<at::Tensor> gatherList;
  if (!fallback) {
    checkOrReject(op, input, opts.rootRank, [&] {
      checkDevice(op, input, "input");
      checkRoot(op, opts.rootRank, "dst");
      gatherList = rootList(op, outputs, opts.rootRank, "dst", "gather_list", input, "input");
    });
    fallback = routeMovement(input) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::GATHER, inputs, flatten(outputs), opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.gather(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::GATHER, inputs, gatherList, opts.asyncOp);
  execute(op, "gather", gatherList, input, opts.rootRank);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  constexpr Op op = Op::Reduce;
  checkSingle(op, tensors, "input");
  const auto& t = tensors[0];
  bool fallback = !strided(tensors);
  if (!fallback) {
    checkDevice(op, t, "tensor");
    checkRoot(op, opts.rootRank, "dst");
    TORCH_CHECK_VALUE(opts.rootTensor == 0, prefix(op), "root tensor must be 0");
    fallback = routeReduction(op, t, opts.reduceOp) == Route::Fallback;
  }
  if (fallback) {
    return handOver(
        op, OpType::REDUCE, tensors, tensors, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.reduce(tensors, o);
        });
  }
  auto work = startWork(op, OpType::REDUCE, tensors, tensors, opts.asyncOp);
  execute(
      op, "reduce", t, opts.rootRank, executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

// --------------------------------------------- point-to-point (fallback only)

WorkPtr ProcessGroupTDist::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  constexpr Op op = Op::Send;
  checkSingle(op, tensors, "input");
  checkDevice(op, tensors[0], "tensor");
  checkRoot(op, dstRank, "dst");
  count(op, Route::Fallback);
  return fallbackFor(op, tensors[0].device().type())
      .send(tensors, dstRank, tag);
}

WorkPtr ProcessGroupTDist::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  constexpr Op op = Op::Recv;
  checkSingle(op, tensors, "output");
  checkDevice(op, tensors[0], "tensor");
  checkRoot(op, srcRank, "src");
  count(op, Route::Fallback);
  return fallbackFor(op, tensors[0].device().type())
      .recv(tensors, srcRank, tag);
}

WorkPtr ProcessGroupTDist::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  constexpr Op op = Op::Recv;
  checkSingle(op, tensors, "output");
  checkDevice(op, tensors[0], "tensor");
  count(op, Route::Fallback);
  return fallbackFor(op, tensors[0].device().type())
      .recvAnysource(tensors, tag);
}

} // namespace tdist

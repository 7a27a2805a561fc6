// Argument checks: the free helpers of validation.hpp, and the
// ProcessGroupTDist members that check against the group (its devices, its
// GPU, its size, the root's lists). Apart from the entry points so that each
// collective reads as check, route, run.
#include "validation.hpp"

#include <algorithm>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace tdist {

std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

std::string dtypeName(const at::Tensor& t) {
  return dtypeName(t.scalar_type());
}

std::string deviceTypeName(c10::DeviceType type) {
  return c10::DeviceTypeName(type, /*lower_case=*/true);
}

std::string prefix(Op op) {
  return std::string("tdist ") + opName(op) + ": ";
}

void checkSingle(Op op, const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK_VALUE(
      ts.size() == 1,
      prefix(op),
      "expected exactly one ",
      what,
      " tensor, got ",
      ts.size(),
      " (one tensor per process)");
}

std::ostream& operator<<(std::ostream& os, const Name& name) {
  os << name.base;
  if (name.i >= 0) {
    os << "[" << name.i << "]";
  }
  if (name.j >= 0) {
    os << "[" << name.j << "]";
  }
  return os;
}

void checkSameDtype(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == ref.scalar_type(),
      prefix(op),
      name,
      " has dtype ",
      dtypeName(t),
      " but ",
      refName,
      " has dtype ",
      dtypeName(ref),
      "; they must match");
}

void checkSameDevice(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name) {
  TORCH_CHECK_VALUE(
      t.device() == ref.device(),
      prefix(op),
      name,
      " is on ",
      t.device(),
      " but ",
      refName,
      " is on ",
      ref.device(),
      "; they must be on the same device");
}

void checkLike(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name) {
  checkSameDtype(op, ref, refName, t, name);
  checkSameDevice(op, ref, refName, t, name);
}

// Every tensor of a list has the dtype, device and element count of `ref`.
void checkListLike(
    Op op,
    const std::vector<at::Tensor>& list,
    const char* listName,
    const at::Tensor& ref,
    const char* refName) {
  for (size_t i = 0; i < list.size(); ++i) {
    Name name(listName, static_cast<int64_t>(i));
    checkLike(op, ref, refName, list[i], name);
    TORCH_CHECK_VALUE(
        list[i].numel() == ref.numel(),
        prefix(op),
        name,
        " has ",
        list[i].numel(),
        " elements, expected ",
        ref.numel(),
        " (as many as ",
        refName,
        ")");
  }
}

// Elements per row (dim 0) of a tensor with at least one dimension.
int64_t rowNumel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) {
    n *= t.size(d);
  }
  return n;
}

// Validates explicit split sizes or computes even ones.
std::vector<int64_t> resolveSplits(
    Op op,
    const std::vector<int64_t>& splits,
    const at::Tensor& t,
    const char* tensorName,
    const char* splitsName,
    int worldSize) {
  int64_t rows = t.size(0);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(
        rows % worldSize == 0,
        prefix(op),
        "world size ",
        worldSize,
        " does not divide dim 0 of ",
        tensorName,
        " (",
        rows,
        ") and no ",
        splitsName,
        " were given");
    return std::vector<int64_t>(worldSize, rows / worldSize);
  }
  TORCH_CHECK_VALUE(
      splits.size() == static_cast<size_t>(worldSize),
      prefix(op),
      splitsName,
      " has ",
      splits.size(),
      " entries, expected ",
      worldSize,
      " (the world size)");
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    TORCH_CHECK_VALUE(
        splits[i] >= 0,
        prefix(op),
        splitsName,
        "[",
        i,
        "] is ",
        splits[i],
        "; split sizes must be non-negative");
    sum += splits[i];
  }
  TORCH_CHECK_VALUE(
      sum == rows,
      prefix(op),
      splitsName,
      " sum to ",
      sum,
      " but dim 0 of ",
      tensorName,
      " is ",
      rows);
  return splits;
}

void checkAllGatherPair(
    Op op,
    const at::Tensor& output,
    const at::Tensor& input,
    int worldSize) {
  checkLike(op, input, "input", output, "output");
  TORCH_CHECK_VALUE(
      output.numel() == input.numel() * worldSize,
      prefix(op),
      "output has ",
      output.numel(),
      " elements, expected ",
      input.numel() * worldSize,
      " (input ",
      input.numel(),
      " elements x world size ",
      worldSize,
      ")");
}

void checkReduceScatterPair(
    Op op,
    const at::Tensor& output,
    const at::Tensor& input,
    int worldSize) {
  checkLike(op, input, "input", output, "output");
  TORCH_CHECK_VALUE(
      input.numel() % worldSize == 0,
      prefix(op),
      "world size ",
      worldSize,
      " does not divide input of ",
      input.numel(),
      " elements");
  TORCH_CHECK_VALUE(
      input.numel() == output.numel() * worldSize,
      prefix(op),
      "output has ",
      output.numel(),
      " elements, expected ",
      input.numel() / worldSize,
      " (input ",
      input.numel(),
      " elements / world size ",
      worldSize,
      ")");
}

void checkSameLength(
    Op op,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(
      outputs.size() == inputs.size(),
      prefix(op),
      "got ",
      outputs.size(),
      " outputs for ",
      inputs.size(),
      " inputs");
}

// ------------------------------------------------- checks against the group

void ProcessGroupTDist::checkDevice(
    Op op,
    const at::Tensor& t,
    const char* what) const {
  auto type = t.device().type();
  if (std::find(devices_.begin(), devices_.end(), type) != devices_.end()) {
    if (type == c10::kCUDA) {
      checkGpu(op, t, what);
    }
    return;
  }
  std::vector<std::string> names;
  for (auto d : devices_) {
    names.push_back(deviceTypeName(d));
  }
  TORCH_CHECK_VALUE(
      false,
      prefix(op),
      what,
      " is on ",
      deviceTypeName(type),
      ", but this group serves ",
      c10::Join(", ", names));
}

// One GPU per rank and group, as with NCCL: the first CUDA tensor picks it. Checked before any
// stream or event is touched, so a tensor on another GPU gets this error, not an event's.
void ProcessGroupTDist::checkGpu(Op op, const at::Tensor& t, const char* what)
    const {
  auto index = t.device().index();
  if (gpuIndex_ < 0) {
    gpuIndex_ = index;
  }
  TORCH_CHECK_VALUE(
      index == gpuIndex_,
      prefix(op),
      what,
      " is on cuda:",
      static_cast<int>(index),
      ", but this group runs on cuda:",
      static_cast<int>(gpuIndex_),
      " (one GPU per rank and group)");
}

void ProcessGroupTDist::checkRoot(Op op, int64_t root, const char* what)
    const {
  TORCH_CHECK_VALUE(
      root >= 0 && root < size_,
      prefix(op),
      what,
      " ",
      root,
      " is not a rank of this group of size ",
      size_);
}

void ProcessGroupTDist::checkGroupSize(
    Op op,
    size_t got,
    const char* what,
    const char* whose) const {
  TORCH_CHECK_VALUE(
      got == static_cast<size_t>(size_),
      prefix(op),
      what,
      whose ? whose : "",
      " has ",
      got,
      " tensors, expected ",
      size_,
      " (the world size)");
}

// The root's tensor list of scatter/gather, checked against `ref`; other ranks pass none.
std::vector<at::Tensor> ProcessGroupTDist::rootList(
    Op op,
    const std::vector<std::vector<at::Tensor>>& lists,
    int64_t root,
    const char* rootName,
    const char* listName,
    const at::Tensor& ref,
    const char* refName) const {
  if (rank_ != root) {
    TORCH_CHECK_VALUE(
        lists.empty() || (lists.size() == 1 && lists[0].empty()),
        prefix(op),
        listName,
        " must be empty on ranks other than ",
        rootName);
    return {};
  }
  TORCH_CHECK_VALUE(
      lists.size() == 1,
      prefix(op),
      "the ",
      rootName,
      " rank needs one ",
      listName,
      ", got ",
      lists.size());
  checkGroupSize(op, lists[0].size(), listName, " on the root rank");
  checkListLike(op, lists[0], listName, ref, refName);
  TORCH_CHECK_VALUE(
      strided(lists[0]), prefix(op), listName, " holds a tensor that is not strided (sparse)");
  return lists[0];
}

} // namespace tdist

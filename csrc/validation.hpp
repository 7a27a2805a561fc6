// Argument checks shared by the collective entry points (collective_ops.cpp)
// and the backend (process_group_tdist.cpp). Every failure raises a c10 error
// whose message starts with "tdist <op>: " (the Python tests match these
// messages); ValueError for bad values and shapes, TypeError for dtypes.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include "process_group_tdist.hpp"

namespace tdist {

// Names as torch prints them ("torch.float32", "cuda").
std::string dtypeName(at::ScalarType t);
std::string dtypeName(const at::Tensor& t);
std::string deviceTypeName(c10::DeviceType type);

// "tdist <op>: ", the start of every message.
std::string prefix(Op op);

void checkSingle(Op op, const std::vector<at::Tensor>& ts, const char* what);

// A tensor's name in messages ("scatter_list[3]"), formatted only when a check fails:
// validation runs on every call and must not build strings.
struct Name {
  Name(const char* base, int64_t i = -1, int64_t j = -1) : base(base), i(i), j(j) {}
  const char* base;
  int64_t i, j;
};

std::ostream& operator<<(std::ostream& os, const Name& name);

void checkSameDtype(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name);
void checkSameDevice(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name);
void checkLike(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name);
void checkListLike(
    Op op,
    const std::vector<at::Tensor>& list,
    const char* listName,
    const at::Tensor& ref,
    const char* refName);

int64_t rowNumel(const at::Tensor& t);
std::vector<int64_t> resolveSplits(
    Op op,
    const std::vector<int64_t>& splits,
    const at::Tensor& t,
    const char* tensorName,
    const char* splitsName,
    int worldSize);

// An output and input pair of all_gather_into_tensor / reduce_scatter_tensor,
// and the coalesced variants' lists.
void checkAllGatherPair(
    Op op,
    const at::Tensor& output,
    const at::Tensor& input,
    int worldSize);
void checkReduceScatterPair(
    Op op,
    const at::Tensor& output,
    const at::Tensor& input,
    int worldSize);
void checkSameLength(
    Op op,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs);
} // namespace tdist

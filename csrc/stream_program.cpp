#include "stream_program.hpp"

#include <ATen/ops/mm.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace tdist {

namespace {

using Ptr = unsigned long long; // CUdeviceptr
using MemcpyAsync = int (*)(Ptr dst, Ptr src, size_t bytes, void* stream);
using MemsetD32Async = int (*)(Ptr dst, unsigned value, size_t count, void* stream);
using WriteValue64 = int (*)(void* stream, Ptr address, uint64_t value, unsigned flags);
using EventRecord = int (*)(void* event, void* stream);
using WaitEvent = int (*)(void* stream, void* event, unsigned flags);
using EventCreate = int (*)(void** event, unsigned flags);
using EventDestroy = int (*)(void* event);

struct Driver {
  MemcpyAsync memcpyAsync;
  MemsetD32Async memsetD32Async;
  WriteValue64 writeValue64;
  EventRecord eventRecord;
  WaitEvent waitEvent;
  EventCreate eventCreate;
  EventDestroy eventDestroy;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d{};
    d.memcpyAsync = reinterpret_cast<MemcpyAsync>(driverSymbol("cuMemcpyAsync"));
    d.memsetD32Async = reinterpret_cast<MemsetD32Async>(driverSymbol("cuMemsetD32Async"));
    // (what cuda.h's cuStreamWriteValue64 names since CUDA 11.7)
    d.writeValue64 = reinterpret_cast<WriteValue64>(driverSymbol("cuStreamWriteValue64_v2"));
    d.eventRecord = reinterpret_cast<EventRecord>(driverSymbol("cuEventRecord"));
    d.waitEvent = reinterpret_cast<WaitEvent>(driverSymbol("cuStreamWaitEvent"));
    d.eventCreate = reinterpret_cast<EventCreate>(driverSymbol("cuEventCreate"));
    d.eventDestroy = reinterpret_cast<EventDestroy>(driverSymbol("cuEventDestroy_v2"));
    return d;
  }();
  return d;
}

void check(int rc, const char* call) {
  TORCH_CHECK(rc == 0, "tdist: ", call, " failed with CUDA error ", rc);
}

constexpr unsigned kEventDisableTiming = 2; // CU_EVENT_DISABLE_TIMING

} // namespace

StreamProgram::Address StreamProgram::address(const py::handle& item) {
  auto pair = item.cast<py::tuple>();
  return {pair[0].cast<int>(), pair[1].cast<uint64_t>()};
}

StreamProgram::View StreamProgram::view(const py::handle& item) {
  auto t = item.cast<py::tuple>();
  View v;
  v.role = t[0].cast<int>();
  if (v.role < 0) {
    v.fixed = t[1].cast<at::Tensor>();
  }
  v.offset = t[2].cast<int64_t>();
  v.sizes = t[3].cast<std::vector<int64_t>>();
  v.strides = t[4].cast<std::vector<int64_t>>();
  return v;
}

StreamProgram::StreamProgram(
    const py::list& steps,
    const std::vector<std::tuple<int64_t, int64_t, int64_t>>& sideStreams) {
  for (const auto& [id, index, type] : sideStreams) {
    sides_.push_back(c10::Stream::unpack3(
        id, static_cast<c10::DeviceIndex>(index), static_cast<c10::DeviceType>(type)));
  }
  for (size_t i = 0; i <= sides_.size(); ++i) {
    void* event = nullptr;
    check(driver().eventCreate(&event, kEventDisableTiming), "cuEventCreate");
    events_.push_back(event);
  }
  for (const auto& item : steps) {
    auto t = item.cast<py::tuple>();
    auto kind = t[0].cast<std::string>();
    Step s{};
    if (kind == "copy") {
      s = {Copy, t[1].cast<int>(), address(t[2]), address(t[3]), t[4].cast<uint64_t>()};
    } else if (kind == "zero") {
      s = {Zero, t[1].cast<int>(), address(t[2]), {}, t[3].cast<uint64_t>()};
    } else if (kind == "write") {
      s = {Write, t[1].cast<int>(), address(t[2]), {}, t[3].cast<uint64_t>()};
    } else if (kind == "after") {
      s.kind = After;
      s.stream = t[1].cast<int>();
      s.waited = t[2].cast<int>();
    } else if (kind == "mm") {
      s.kind = Matmul;
      s.stream = t[1].cast<int>();
      s.out = view(t[2]);
      s.a = view(t[3]);
      s.b = view(t[4]);
    } else if (kind == "launch") {
      s.kind = Launch;
      s.stream = t[1].cast<int>();
      s.launch = static_cast<int>(launches_.size());
      launches_.push_back(LaunchPlan::fromPython(t[2]));
    } else {
      TORCH_CHECK(false, "tdist: a stream program has no step '", kind, "'");
    }
    for (int index : {s.stream, s.waited}) {
      TORCH_CHECK(index >= 0 && static_cast<size_t>(index) <= sides_.size(),
                  "tdist: a stream program's step uses stream ", index, " of ", sides_.size() + 1);
    }
    TORCH_CHECK(s.kind != After || s.stream != s.waited,
                "tdist: a stream program orders stream ", s.stream, " after itself");
    steps_.push_back(std::move(s));
  }
}

StreamProgram::~StreamProgram() {
  for (void* event : events_) {
    driver().eventDestroy(event); // (at exit the context may be gone: nothing to do)
  }
}

uintptr_t StreamProgram::resolve(const Address& a, const std::vector<uintptr_t>& roles) const {
  if (a.role < 0) {
    return a.value;
  }
  TORCH_CHECK(static_cast<size_t>(a.role) < roles.size(), "tdist: a stream program names tensor ",
              a.role, " of ", roles.size());
  return roles[a.role] + a.value;
}

at::Tensor StreamProgram::resolve(const View& v, const std::vector<at::Tensor>& roles) const {
  if (v.role < 0) {
    return v.fixed;
  }
  TORCH_CHECK(static_cast<size_t>(v.role) < roles.size(), "tdist: a stream program names tensor ",
              v.role, " of ", roles.size());
  const auto& t = roles[v.role];
  return t.as_strided(v.sizes, v.strides, t.storage_offset() + v.offset);
}

void StreamProgram::run(const std::vector<at::Tensor>& roles) const {
  TORCH_CHECK(!roles.empty() && roles[0].is_cuda(), "tdist: a stream program runs on CUDA tensors");
  std::vector<uintptr_t> addresses;
  for (const auto& t : roles) {
    addresses.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()));
  }
  c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  const c10::Stream main = guard.getStream(roles[0].device());
  const auto& cu = driver();
  auto torchStream = [&](int index) { return index == 0 ? main : sides_[index - 1]; };
  auto stream = [&](int index) { return torchStream(index).native_handle(); };
  for (const auto& s : steps_) {
    switch (s.kind) {
      case Copy:
        check(cu.memcpyAsync(resolve(s.dst, addresses), resolve(s.src, addresses), s.count,
                             stream(s.stream)),
              "cuMemcpyAsync");
        break;
      case Zero:
        check(cu.memsetD32Async(resolve(s.dst, addresses), 0, 2 * s.count, stream(s.stream)),
              "cuMemsetD32Async");
        break;
      case Write:
        check(cu.writeValue64(stream(s.stream), resolve(s.dst, addresses), s.count, 0),
              "cuStreamWriteValue64");
        break;
      case After:
        check(cu.eventRecord(events_[s.waited], stream(s.waited)), "cuEventRecord");
        check(cu.waitEvent(stream(s.stream), events_[s.waited], 0), "cuStreamWaitEvent");
        break;
      case Matmul: {
        auto out = resolve(s.out, roles);
        guard.exchangeStream(torchStream(s.stream)); // cuBLAS runs on the current stream
        try {
          at::mm_out(out, resolve(s.a, roles), resolve(s.b, roles));
        } catch (...) {
          guard.exchangeStream(main);
          throw;
        }
        guard.exchangeStream(main);
        break;
      }
      case Launch:
        launches_[s.launch].launch(addresses, stream(s.stream));
        break;
    }
  }
}

} // namespace tdist

#include "stream_program.hpp"

#include <ATen/ops/mm.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace tdist {

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
    events_.push_back(driver::eventCreate());
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
    driver::eventDestroy(event); // (at exit the context may be gone: nothing to do)
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
  auto torchStream = [&](int index) { return index == 0 ? main : sides_[index - 1]; };
  auto stream = [&](int index) { return torchStream(index).native_handle(); };
  for (const auto& s : steps_) {
    switch (s.kind) {
      case Copy:
        driver::memcpyAsync(
            resolve(s.dst, addresses), resolve(s.src, addresses), s.count, stream(s.stream));
        break;
      case Zero:
        driver::memsetD32Async(resolve(s.dst, addresses), 0, 2 * s.count, stream(s.stream));
        break;
      case Write:
        driver::streamWriteValue64(stream(s.stream), resolve(s.dst, addresses), s.count);
        break;
      case After:
        driver::eventRecord(events_[s.waited], stream(s.waited));
        driver::streamWaitEvent(stream(s.stream), events_[s.waited]);
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

void StreamProgram::addGraph(
    const std::vector<uintptr_t>& addresses,
    uintptr_t graphExec,
    py::object graph) {
  TORCH_CHECK(graphExec != 0, "tdist: a stream program's graph has no instantiated graph");
  graphs_[addresses] = {reinterpret_cast<void*>(graphExec), std::move(graph)};
}

void StreamProgram::dropGraph(const std::vector<uintptr_t>& addresses) {
  graphs_.erase(addresses);
}

bool StreamProgram::runGraph(const std::vector<at::Tensor>& roles) const {
  if (graphs_.empty()) {
    return false;
  }
  std::vector<uintptr_t> addresses;
  addresses.reserve(roles.size());
  for (const auto& t : roles) {
    addresses.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()));
  }
  auto found = graphs_.find(addresses);
  if (found == graphs_.end()) {
    return false;
  }
  c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  driver::graphLaunch(found->second.first, guard.getStream(roles[0].device()).native_handle());
  return true;
}

} // namespace tdist

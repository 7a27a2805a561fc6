#include "device_path.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace tdist {

namespace {

c10::impl::VirtualGuardImpl guardFor(c10::DeviceType type) {
  return c10::impl::VirtualGuardImpl(type);
}

} // namespace

std::unique_ptr<c10::Event> EventPool::take(const c10::Device& device) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // An event belongs to the device it was first recorded on (recording it on another's stream
    // raises): a call on a tensor of another GPU, refused, still recorded one there.
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      auto index = (*it)->device_index();
      if ((*it)->device_type() == device.type() && (index == -1 || index == device.index())) {
        auto event = std::move(*it);
        free_.erase(std::next(it).base());
        return event;
      }
    }
  }
  return std::make_unique<c10::Event>(device.type());
}

void EventPool::give(std::unique_ptr<c10::Event> event) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(event));
}

void EventPool::recordOn(c10::Event& event, const c10::Stream& stream) {
  // An event c10 has created is recorded again through the driver, on the
  // current device's context as the kernels are launched: c10's record goes
  // through the runtime and switches the current device there and back, about
  // 0.6 us a call more.
  if (stream.device_type() == c10::DeviceType::CUDA && event.eventId() != nullptr &&
      event.device_index() == stream.device_index() &&
      driver::recordIfLoaded(event.eventId(), stream.native_handle())) {
    return;
  }
  event.record(stream);
}

std::shared_ptr<c10::Event> EventPool::record(const c10::Stream& stream) {
  auto event = take(stream.device());
  recordOn(*event, stream);
  return std::shared_ptr<c10::Event>(
      event.release(), [pool = shared_from_this()](c10::Event* e) {
        pool->give(std::unique_ptr<c10::Event>(e));
      });
}

StreamScope::StreamScope(c10::Stream comm, std::shared_ptr<EventPool> events)
    : comm_(comm),
      caller_(guardFor(comm.device_type()).getStream(comm.device())),
      events_(std::move(events)) {
  if (onCallerStream()) {
    return;
  }
  auto ready = events_->take(comm.device());
  EventPool::recordOn(*ready, caller_);
  // (the wait is enqueued: the event may be recorded anew; while the caller
  // captures a CUDA graph, this wait brings comm_ into the capture)
  ready->block(comm_);
  events_->give(std::move(ready));
  guardFor(comm.device_type()).exchangeStream(comm_);
}

StreamScope::~StreamScope() {
  if (!onCallerStream()) {
    guardFor(comm_.device_type()).exchangeStream(caller_);
  }
}

std::shared_ptr<c10::Event> StreamScope::recordEnd() const {
  return events_->record(comm_);
}

c10::Stream currentStream(const c10::Device& device) {
  return guardFor(device.type()).getStream(device);
}

c10::Stream newCommStream(const c10::Device& device) {
  return guardFor(device.type())
      .getStreamFromGlobalPool(device, /*isHighPriority=*/true);
}

bool PlanKey::operator==(const PlanKey& o) const {
  return op == o.op && dtype == o.dtype && numelIn == o.numelIn &&
      numelOut == o.numelOut && reduceOp == o.reduceOp && root == o.root &&
      device == o.device;
}

size_t PlanKeyHash::operator()(const PlanKey& k) const {
  size_t h = std::hash<int64_t>()(k.numelIn);
  for (int64_t v :
       {static_cast<int64_t>(k.op),
        static_cast<int64_t>(k.dtype),
        k.numelOut,
        static_cast<int64_t>(k.reduceOp),
        k.root,
        static_cast<int64_t>(k.device)}) {
    h = h * 1000003u ^ std::hash<int64_t>()(v);
  }
  return h;
}

LaunchPlan LaunchPlan::fromPython(const py::handle& plan) {
  LaunchPlan p;
  auto tuple = plan.cast<py::tuple>();
  TORCH_CHECK(tuple.size() == 6, "tdist: a launch plan is a 6-tuple");
  p.function_ = reinterpret_cast<void*>(tuple[0].cast<uint64_t>());
  auto grid = tuple[1].cast<std::vector<unsigned>>();
  TORCH_CHECK(grid.size() == 3, "tdist: a launch plan's grid has 3 sizes");
  std::copy(grid.begin(), grid.end(), p.grid_.begin());
  p.threads_ = tuple[2].cast<unsigned>();
  p.sharedBytes_ = tuple[3].cast<unsigned>();
  p.params_ = tuple[4].cast<std::vector<std::pair<int, uint64_t>>>();
  p.dependentLaunch_ = tuple[5].cast<bool>();
  TORCH_CHECK(
      p.params_.size() <= kMaxParams, "tdist: a launch plan has too many parameters");
  return p;
}

bool LaunchPlan::fits(const at::Tensor& t) {
  return t.is_contiguous() &&
      reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

void LaunchPlan::launch(
    const at::Tensor& input,
    const at::Tensor& output,
    void* stream) const {
  launch(
      {reinterpret_cast<uintptr_t>(input.data_ptr()),
       reinterpret_cast<uintptr_t>(output.data_ptr())},
      stream);
}

void LaunchPlan::launch(const std::vector<uintptr_t>& roles, void* stream)
    const {
  std::array<uint64_t, kMaxParams> values{};
  std::array<void*, kMaxParams> args{};
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [kind, value] = params_[i];
    if (kind >= RolePtr) {
      size_t role = kind - RolePtr;
      TORCH_CHECK(role < roles.size(), "tdist: a launch plan names tensor ", role,
                  " of a call with ", roles.size());
      values[i] = roles[role] + value;
    } else { // a 32-bit literal sits in the low bytes (little-endian)
      values[i] = value;
    }
    args[i] = &values[i];
  }
  driver::launchKernel(
      function_, grid_, threads_, sharedBytes_, stream, args.data(), dependentLaunch_);
}

CallPlan CallPlan::fromPython(const py::handle& plan) {
  CallPlan p;
  for (const auto& launch : plan.cast<py::list>()) {
    p.launches_.push_back(LaunchPlan::fromPython(launch));
  }
  TORCH_CHECK(!p.launches_.empty(), "tdist: a call plan has no launch");
  return p;
}

void CallPlan::launch(const at::Tensor& input, const at::Tensor& output, void* stream) const {
  launch(
      {reinterpret_cast<uintptr_t>(input.data_ptr()),
       reinterpret_cast<uintptr_t>(output.data_ptr())},
      stream);
}

void CallPlan::launch(const std::vector<uintptr_t>& roles, void* stream) const {
  for (const auto& one : launches_) {
    one.launch(roles, stream);
  }
}

} // namespace tdist

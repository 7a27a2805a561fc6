// ROCSHMEM for the `rocshmem` heap transport (AMD GPUs), bootstrapped through the
// group's c10d store with a unique id, as the NVSHMEM one is (no MPI).
//
// Compiled only when setup.py finds ROCSHMEM (TDIST_ROCSHMEM_HOME, a ROCm build of
// torch): its API is C++ (namespace rocshmem) with no versioned C structs to declare
// here, so the extension includes its header and links its host library
// (librocshmem_host.so, the one without device globals, for kernels compiled at run
// time that link librocshmem_device.bc). The bindings are added to torch_tdist._C by
// bind(); Python sees ROCSHMEM as compiled in when _C has rocshmem_bootstrap.
#include <dlfcn.h>

#include <array>
#include <cstring>
#include <mutex>
#include <string>

#include <rocshmem/rocshmem.hpp>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

namespace tdist::rocshmem {
namespace {

namespace api = ::rocshmem;

std::mutex mutex;
// ROCSHMEM has no query of whether it is up: every group that spans the job
// bootstraps in the same order on every rank, so this flag agrees across ranks.
bool initialised = false;

void check(hipError_t rc, const char* call) {
  TORCH_CHECK(rc == hipSuccess, "tdist: ", call, " failed: ", hipGetErrorString(rc));
}

// (initialised here, my PE, number of PEs)
std::tuple<bool, int, int> bootstrap(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& key,
    int rank,
    int worldSize) {
  std::lock_guard<std::mutex> guard(mutex);
  const bool here = !initialised;
  if (here) {
    api::rocshmem_uniqueid_t id{};
    const std::string idKey = key + "/unique_id";
    if (rank == 0) {
      TORCH_CHECK(
          api::rocshmem_get_uniqueid(&id) == api::ROCSHMEM_SUCCESS,
          "tdist: rocshmem_get_uniqueid failed");
      store->set(idKey, std::vector<uint8_t>(id.begin(), id.end()));
    } else {
      auto bytes = store->get(idKey);
      TORCH_CHECK(bytes.size() == id.size(), "tdist: bad ROCSHMEM unique id in the store");
      std::memcpy(id.data(), bytes.data(), id.size());
    }
    api::rocshmem_init_attr_t attr{};
    TORCH_CHECK(
        api::rocshmem_set_attr_uniqueid_args(rank, worldSize, &id, &attr) ==
            api::ROCSHMEM_SUCCESS,
        "tdist: rocshmem_set_attr_uniqueid_args failed");
    TORCH_CHECK(
        api::rocshmem_init_attr(api::ROCSHMEM_INIT_WITH_UNIQUEID, &attr) ==
            api::ROCSHMEM_SUCCESS,
        "tdist: ROCSHMEM initialisation failed (rank ",
        rank,
        " of ",
        worldSize,
        ")");
    initialised = true;
  }
  return {here, api::rocshmem_my_pe(), api::rocshmem_n_pes()};
}

// Collective over every PE; the memory is zeroed before any PE returns from the
// transport's setup (the caller publishes that through the store).
uintptr_t malloc(size_t bytes) {
  void* address = api::rocshmem_malloc(bytes);
  if (address != nullptr) {
    check(hipMemset(address, 0, bytes), "hipMemset");
    check(hipDeviceSynchronize(), "hipDeviceSynchronize");
  }
  return reinterpret_cast<uintptr_t>(address);
}

void initModule(uintptr_t module) {
  TORCH_CHECK(
      api::rocshmem_hipmodule_init(reinterpret_cast<hipModule_t>(module), nullptr) ==
          api::ROCSHMEM_SUCCESS,
      "tdist: rocshmem_hipmodule_init failed for a kernel that uses ROCSHMEM calls");
  // (it copies ROCSHMEM's device state on the per-thread stream, unsynchronised)
  check(hipStreamSynchronize(hipStreamPerThread), "hipStreamSynchronize");
}

// The directory of the host library this process loaded: librocshmem_device.bc is
// installed beside it.
std::string libraryDir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&api::rocshmem_get_uniqueid), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  std::string path = info.dli_fname;
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

} // namespace

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "rocshmem_bootstrap",
      [](const c10::intrusive_ptr<c10d::Store>& store,
         const std::string& key,
         int rank,
         int worldSize) {
        py::gil_scoped_release noGil; // waits on peers through the store
        return bootstrap(store, key, rank, worldSize);
      },
      py::arg("store"),
      py::arg("key"),
      py::arg("rank"),
      py::arg("world_size"),
      "(initialised here, my PE, number of PEs); ROCSHMEM over the group");
  m.def("rocshmem_malloc", &malloc, py::arg("nbytes"));
  m.def(
      "rocshmem_free",
      [](uintptr_t address) { api::rocshmem_free(reinterpret_cast<void*>(address)); },
      py::arg("address"));
  m.def(
      "rocshmem_ptr",
      [](uintptr_t address, int pe) {
        return reinterpret_cast<uintptr_t>(
            api::rocshmem_ptr(reinterpret_cast<const void*>(address), pe));
      },
      py::arg("address"),
      py::arg("pe"));
  m.def("rocshmem_init_module", &initModule, py::arg("hip_module"));
  m.attr("rocshmem_library_dir") = libraryDir();
}

} // namespace tdist::rocshmem

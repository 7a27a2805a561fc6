#include "nvshmem_bootstrap.hpp"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <vector>

#include <c10/util/Exception.h>

namespace tdist::nvshmem {
namespace {

// NVSHMEM's versioned ABI structs (nvshmem_uniqueid.h, nvshmem_types.h, NVSHMEM 3.x):
// the version word is (1 << 16) + sizeof(struct).
struct UniqueId {
  int version;
  char internal[124];
};
struct UniqueIdArgs {
  int version;
  UniqueId* id;
  int myrank;
  int nranks;
};
struct InitArgs {
  int version;
  UniqueIdArgs uidArgs;
  char content[96];
};
struct InitAttr {
  int version;
  void* mpiComm;
  InitArgs args;
};
static_assert(sizeof(UniqueId) == 128 && sizeof(UniqueIdArgs) == 24);
static_assert(sizeof(InitArgs) == 128 && sizeof(InitAttr) == 144);

constexpr unsigned kInitWithUniqueId = 1u << 3; // NVSHMEMX_INIT_WITH_UNIQUEID
constexpr int kStatusInitialised = 2; // NVSHMEM_STATUS_IS_INITIALIZED

template <typename T>
constexpr int version() {
  return (1 << 16) + static_cast<int>(sizeof(T));
}

struct Library {
  int (*getUniqueId)(UniqueId*);
  int (*setUniqueIdArgs)(int, int, const UniqueId*, InitAttr*);
  int (*hostlibInitAttr)(unsigned, InitAttr*);
  int (*initStatus)();
  int (*myPe)();
  int (*nPes)();
  void* (*malloc)(size_t);
  void (*free)(void*);
  void* (*ptr)(const void*, int);
  int (*cumoduleInit)(void*);
};

std::mutex mutex;
Library* library = nullptr;

template <typename F>
void bind(void* handle, F& slot, const char* name, const std::string& path) {
  void* symbol = dlsym(handle, name);
  TORCH_CHECK(
      symbol != nullptr,
      "tdist: nvshmem transport: ",
      path,
      " has no symbol ",
      name,
      " (an NVSHMEM 3.x host library is needed)");
  slot = reinterpret_cast<F>(symbol);
}

Library& open(const std::string& path) {
  if (library != nullptr) {
    return *library;
  }
  // RTLD_GLOBAL and the wheel's path: the very library torch's symmetric memory loads.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(
      handle != nullptr,
      "tdist: the nvshmem transport needs NVSHMEM's host library (",
      path,
      "), from the nvidia-nvshmem-cu12/cu13 wheel: ",
      dlerror(),
      ". Use TDIST_TRANSPORT=cuda within a node.");
  auto* lib = new Library();
  bind(handle, lib->getUniqueId, "nvshmemx_get_uniqueid", path);
  bind(handle, lib->setUniqueIdArgs, "nvshmemx_set_attr_uniqueid_args", path);
  bind(handle, lib->hostlibInitAttr, "nvshmemx_hostlib_init_attr", path);
  bind(handle, lib->initStatus, "nvshmemx_init_status", path);
  bind(handle, lib->myPe, "nvshmem_my_pe", path);
  bind(handle, lib->nPes, "nvshmem_n_pes", path);
  bind(handle, lib->malloc, "nvshmem_malloc", path);
  bind(handle, lib->free, "nvshmem_free", path);
  bind(handle, lib->ptr, "nvshmem_ptr", path);
  bind(handle, lib->cumoduleInit, "nvshmemx_cumodule_init", path);
  library = lib;
  return *lib;
}

Library& opened() {
  TORCH_CHECK(
      library != nullptr, "tdist: NVSHMEM is not bootstrapped in this process");
  return *library;
}

} // namespace

Status bootstrap(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& key,
    int rank,
    int worldSize,
    const std::string& libraryPath) {
  std::lock_guard<std::mutex> guard(mutex);
  Library& lib = open(libraryPath);
  // Every rank decides the same way: the group spans every process, so either all of
  // them have NVSHMEM up already or none has.
  bool up = lib.initStatus() >= kStatusInitialised;
  store->set(key + "/up/" + std::to_string(rank), std::vector<uint8_t>{up});
  for (int peer = 0; peer < worldSize; ++peer) {
    auto seen = store->get(key + "/up/" + std::to_string(peer));
    TORCH_CHECK(
        !seen.empty() && static_cast<bool>(seen[0]) == up,
        "tdist: nvshmem transport: NVSHMEM is initialised on some ranks of the group "
        "and not on others (rank ",
        peer,
        "); initialise torch's NVSHMEM symmetric memory on every rank or on none");
  }
  if (!up) {
    UniqueId id{};
    id.version = version<UniqueId>();
    const std::string idKey = key + "/unique_id";
    if (rank == 0) {
      TORCH_CHECK(
          lib.getUniqueId(&id) == 0, "tdist: nvshmemx_get_uniqueid failed");
      const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
      store->set(idKey, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    } else {
      auto bytes = store->get(idKey);
      TORCH_CHECK(bytes.size() == sizeof(id), "tdist: bad NVSHMEM unique id in the store");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    InitAttr attr{};
    attr.version = version<InitAttr>();
    attr.args.version = version<InitArgs>();
    attr.args.uidArgs.version = version<UniqueIdArgs>();
    TORCH_CHECK(
        lib.setUniqueIdArgs(rank, worldSize, &id, &attr) == 0,
        "tdist: nvshmemx_set_attr_uniqueid_args failed");
    TORCH_CHECK(
        lib.hostlibInitAttr(kInitWithUniqueId, &attr) == 0,
        "tdist: NVSHMEM initialisation failed (rank ",
        rank,
        " of ",
        worldSize,
        "); NVSHMEM_DEBUG=INFO says why");
  }
  return Status{!up, lib.myPe(), lib.nPes()};
}

uintptr_t malloc(size_t bytes) {
  return reinterpret_cast<uintptr_t>(opened().malloc(bytes));
}

void free(uintptr_t address) {
  opened().free(reinterpret_cast<void*>(address));
}

uintptr_t peerPointer(uintptr_t address, int pe) {
  return reinterpret_cast<uintptr_t>(
      opened().ptr(reinterpret_cast<const void*>(address), pe));
}

void initModule(uintptr_t cuModule) {
  TORCH_CHECK(
      opened().cumoduleInit(reinterpret_cast<void*>(cuModule)) == 0,
      "tdist: nvshmemx_cumodule_init failed for a kernel that uses NVSHMEM calls");
}

} // namespace tdist::nvshmem

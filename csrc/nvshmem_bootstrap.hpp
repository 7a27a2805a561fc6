// NVSHMEM for the `nvshmem` heap transport, bootstrapped through the group's c10d
// store with a unique id (no MPI, no socket-interface guessing).
//
// The host library (libnvshmem_host.so.3 from the nvidia-nvshmem-cu1x wheel) is opened
// at run time, so the extension builds without NVSHMEM and a machine without it gets a
// clear error. It is the same shared library torch's NVSHMEM symmetric memory links, so
// both see one NVSHMEM state: whoever comes first initialises it, the other reuses it.
#pragma once

#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tdist::nvshmem {

struct Status {
  bool initialisedHere; // false: NVSHMEM was already up (torch, or an earlier group)
  int myPe;
  int nPes;
};

// Opens the host library at `libraryPath` (once per process) and makes sure NVSHMEM is
// initialised over `worldSize` processes: rank 0 of the group publishes a unique id in
// `store` under `key`, every rank initialises with it. The caller's current CUDA device
// must be the rank's device.
Status bootstrap(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& key,
    int rank,
    int worldSize,
    const std::string& libraryPath);

uintptr_t malloc(size_t bytes); // collective over every PE
void free(uintptr_t address); // collective over every PE
uintptr_t peerPointer(uintptr_t address, int pe); // 0 when `pe` is not P2P-reachable
void initModule(uintptr_t cuModule); // device state for a kernel using NVSHMEM calls

} // namespace tdist::nvshmem

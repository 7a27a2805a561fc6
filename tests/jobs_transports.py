"""Jobs for test_transports.py (run inside the ranks)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.common import rank_gen

TIMEOUT = timedelta(seconds=60)


def shm_segments_through_the_interface(rank, ws, seed, nbytes):
    """Each rank creates a segment through the shm transport, fills it (past the token) with
    its own random bytes, passes its handle through the store and opens every peer's; it
    returns what it read of each peer, checked there against the peer's data built from the
    seed, and what was left named in /dev/shm or mapped after everything was freed."""
    from torch_tdist import transports
    from torch_tdist.transports import shm

    transport = transports.get("shm")
    cpu = torch.device("cpu")
    store = dist.PrefixStore(f"transports-test/{seed}/{nbytes}", dist.distributed_c10d._get_default_store())
    mapped_before = shm.mapped_segments()
    token = shm.ShmSegment.TOKEN_BYTES

    def data_of(peer):
        return torch.randint(0, 256, (nbytes - token,), dtype=torch.uint8, generator=rank_gen(seed, peer))

    own = transport.create(nbytes, cpu)
    own.bytes[token:] = data_of(rank)
    store.set(f"handle/{rank}", own.handle)
    store.wait([f"handle/{peer}" for peer in range(ws)], TIMEOUT)
    handles = [store.get(f"handle/{peer}") for peer in range(ws)]
    segments = [own if peer == rank else transport.open(handles[peer], nbytes, cpu) for peer in range(ws)]
    wrong = [peer for peer in range(ws) if not torch.equal(segments[peer].bytes[token:], data_of(peer))]
    store.set(f"read/{rank}", "1")
    store.wait([f"read/{peer}" for peer in range(ws)], TIMEOUT)
    # a peer's write lands in the owner's memory (the mapping is shared, not a copy)
    right = (rank + 1) % ws
    mark = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=rank_gen(seed, rank, salt=1))
    segments[right].bytes[token:token + 64] = mark
    store.set(f"mapped/{rank}", "1")
    store.wait([f"mapped/{peer}" for peer in range(ws)], TIMEOUT)
    left = (rank - 1) % ws
    seen_from_left = torch.equal(own.bytes[token:token + 64],
                                 torch.randint(0, 256, (64,), dtype=torch.uint8, generator=rank_gen(seed, left, salt=1)))
    for handle in handles:
        transport.forget(handle)
    own.all_peers_mapped()
    named = [os.path.basename(own.path)] if os.path.exists(own.path) else []
    store.set(f"forgotten/{rank}", "1")
    store.wait([f"forgotten/{peer}" for peer in range(ws)], TIMEOUT)
    names = {h.decode().partition(":")[0] for h in handles}
    still_named = sorted(names & shm.shm_segment_names())
    mapped_while_open = shm.mapped_segments() - mapped_before
    host_page = transport.map_host_page(4096 * 7, 4096, cpu)
    for segment in segments:
        segment.close()
    del segments, own
    return {"wrong_peers": wrong, "peer_write_seen": seen_from_left, "named_after_forget": named,
            "still_named": still_named, "mapped_while_open": mapped_while_open,
            "mapped_after_close": shm.mapped_segments() - mapped_before, "host_page": host_page,
            "stream_ops": transport.stream_ops()}


def new_group_with_transport(rank, ws, transport):
    """dist.new_group(backend="tdist") with TDIST_TRANSPORT=``transport`` (raises on bad ones)."""
    os.environ["TDIST_TRANSPORT"] = transport
    try:
        group = dist.new_group(list(range(ws)), backend="tdist")
    finally:
        del os.environ["TDIST_TRANSPORT"]
    dist.destroy_process_group(group)


def new_group_as_on_a_gpu_without_cuda_python(rank, ws):
    """dist.new_group on a group whose executor serves CUDA tensors, on a machine where torch
    sees a GPU (both faked: this one has neither) but cuda-python is missing."""
    from torch_tdist import backend
    from torch_tdist.collectives import Executor

    def gpu_executor(*args, **kwargs):
        executor = Executor(*args, **kwargs)
        executor.served_devices = ["cuda"]
        return executor

    previous = backend.set_executor_factory(gpu_executor)
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        dist.new_group(list(range(ws)), backend="tdist")
    finally:
        torch.cuda.is_available = real
        backend.set_executor_factory(previous)


def all_reduce_on_a_new_group(rank, ws, seed):
    """The pool still works after the refused groups: a new tdist group sums random data."""
    group = dist.new_group(list(range(ws)), backend="tdist")
    xs = [torch.randn(1000, generator=rank_gen(seed, r)) for r in range(ws)]
    x = xs[rank].clone()
    dist.all_reduce(x, group=group)
    dist.destroy_process_group(group)
    return torch.allclose(x, sum(xs), rtol=1e-5, atol=1e-5)


def hip_handles_through_the_store(rank, ws, seed, nbytes):
    """Each rank packs a hip transport handle around its own random 64 bytes (HIP's IPC handle
    is opaque to tdist: no GPU made these), passes it through the store, and unpacks every
    peer's as the heap's ``open`` does before any HIP call. It also hands the hip transport's
    ``open`` real handles it must refuse before calling HIP: the next rank's shm segment handle
    and a hip handle of a larger heap. Returns the unpacked bytes in rank order and the errors."""
    from torch_tdist import transports
    from torch_tdist.transports import hip_ipc

    store = dist.PrefixStore(f"hip-handles-test/{seed}/{nbytes}", dist.distributed_c10d._get_default_store())
    ipc = bytes(torch.randint(0, 256, (hip_ipc.IPC_HANDLE_BYTES,), dtype=torch.uint8,
                              generator=rank_gen(seed, rank)).tolist())
    shm_segment = transports.get("shm").create(nbytes, torch.device("cpu"))
    store.set(f"handle/{rank}", hip_ipc.pack_handle(ipc, nbytes))
    store.set(f"larger/{rank}", hip_ipc.pack_handle(ipc, 2 * nbytes))
    store.set(f"shm/{rank}", shm_segment.handle)
    store.wait([f"{kind}/{peer}" for kind in ("handle", "larger", "shm") for peer in range(ws)], TIMEOUT)
    unpacked = [hip_ipc.unpack_handle(store.get(f"handle/{peer}"), nbytes) for peer in range(ws)]
    hip, gpu, right = transports.get("hip"), torch.device("cuda", 0), (rank + 1) % ws
    refused = {}
    for kind in ("larger", "shm"):
        try:
            hip.open(store.get(f"{kind}/{right}"), nbytes, gpu)
        except ValueError as err:
            refused[kind] = str(err)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{peer}" for peer in range(ws)], TIMEOUT)
    transports.get("shm").forget(shm_segment.handle)
    shm_segment.close()
    return {"unpacked": unpacked, "refused": refused}


def gpu_hosts_with_builds(rank, ws, seed, rocm_ranks):
    """The exchange of builds and hosts (``heap.gpu_hosts``: at group creation and at each GPU
    heap) through the group's store, with torch reporting a ROCm build on ``rocm_ranks``
    (``torch.version.hip`` set there: the exchange reads nothing else of the build)."""
    from torch_tdist import heap

    store = dist.PrefixStore(f"gpu-hosts-test/{seed}/{rocm_ranks}", dist.distributed_c10d._get_default_store())
    real = torch.version.hip, torch.version.cuda
    if rank in rocm_ranks:
        torch.version.hip, torch.version.cuda = "6.4.43482", None
    try:
        return heap.gpu_hosts(store, "heap", rank, ws, TIMEOUT)
    finally:
        torch.version.hip, torch.version.cuda = real

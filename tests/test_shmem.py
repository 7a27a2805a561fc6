"""torch_tdist.shmem_device functions, the hierarchical all-gather and the MoE dispatch example,
across real processes on the interpreter; NVSHMEM's bootstrap errors."""

import pytest
import torch
import torch.distributed as dist

from tests import jobs_shmem as J
from tests.helpers import ws_param


@pytest.mark.tdist_only
@ws_param()
def test_every_shmem_call(pool, seed):
    pool.run(J.every_call, seed)


@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 2), (4, 1), (3, 3), (2, 1)],
                         ids=["4=2x2", "4=4x1", "3=1x3", "2=2x1"])
def test_hierarchical_all_gather(pool, seed, ranks_per_node):
    pool.run(J.hierarchical, seed, ranks_per_node)


@pytest.mark.tdist_only
@ws_param([2, 4])
@pytest.mark.parametrize("pieces", [1, 3])
def test_moe_dispatch_example(pool, seed, pieces):
    pool.run(J.moe_dispatch, seed, pieces)


def test_nvshmem_missing_library_is_a_clear_error():
    from torch_tdist import _C

    store = dist.HashStore()
    with pytest.raises(RuntimeError, match="nvshmem transport needs NVSHMEM's host library"):
        _C.nvshmem_bootstrap(store, "k", 0, 1, "/nonexistent/libnvshmem_host.so.3")


def test_nvshmem_transport_rejects_cpu_tensors():
    from torch_tdist.transports import resolve

    with pytest.raises(ValueError, match="cannot serve cpu tensors"):
        resolve("nvshmem", "cpu")
    assert resolve("auto", "cuda", spans_nodes=True) == "nvshmem"
    assert resolve("auto", "cuda") == "cuda"

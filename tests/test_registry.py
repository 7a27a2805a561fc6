"""The worked example of docs/architecture.md ("Adding an algorithm"): its code, run as written on
rank processes of their own (it adds to the registry), serves the all_reduces it fits."""

import os
import re

import pytest

from tests import jobs_registry as J
from tests.multiproc import RankPool, backend_under_test

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "architecture.md")


def _example_blocks() -> list[str]:
    """The python code blocks of the section "Adding an algorithm"."""
    text = open(DOC).read()
    section = text[text.index("## Adding an algorithm"):]
    following = section.find("\n## ", 1)
    section = section if following < 0 else section[:following]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size", [2, 3])
def test_adding_an_algorithm_example_runs(world_size, seed):
    blocks = _example_blocks()
    assert len(blocks) == 3, f"expected the module, the registry line and a use; found {len(blocks)} blocks"
    pool = RankPool(world_size, backend_under_test(), name=f"RankPool(ws={world_size}, registry example)")
    try:
        served = pool.run(J.adding_an_algorithm, blocks, seed, timeout=240)
    finally:
        pool.shutdown()
    for rank, sizes in enumerate(served):
        # the example's call (8 per rank) and the two whole-share calls; not the one that does not fit
        assert sizes == [8 * world_size, 1000 * world_size, 333 * world_size], \
            f"rank {rank}: the new algorithm served calls of {sizes} elements"

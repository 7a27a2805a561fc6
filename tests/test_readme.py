"""The README's user-kernel example and its torch_tdist.ops block run as written and compute the
right data."""

import pytest

from tests import jobs_readme as J
from tests.helpers import ws_param


@pytest.mark.tdist_only
@ws_param()
def test_readme_kernel_example(pool, seed):
    pool.run(J.ring_shift_example, seed)


@pytest.mark.tdist_only
@ws_param([2, 3])
def test_readme_ops_example(pool, seed):
    pool.run(J.ops_example, seed)

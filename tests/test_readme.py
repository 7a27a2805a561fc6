"""The README's user-kernel example runs as written and moves the right data."""

import pytest

from tests import jobs_readme as J
from tests.helpers import ws_param


@pytest.mark.tdist_only
@ws_param()
def test_readme_kernel_example(pool, seed):
    pool.run(J.ring_shift_example, seed)

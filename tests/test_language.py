"""Every primitive of torch_tdist.language in one user kernel, across real processes."""

import pytest

from tests import jobs_language as J
from tests.helpers import ws_param


@pytest.mark.tdist_only
@ws_param()
def test_every_primitive(pool, seed):
    pool.run(J.every_primitive, seed)


@pytest.mark.tdist_only
@ws_param()
def test_signals_to_and_from_every_rank_at_once(pool, seed):
    pool.run(J.every_rank_at_once, seed)


@pytest.mark.tdist_only
@ws_param()
def test_a_wait_for_data_stored_for_polling(pool, seed):
    pool.run(J.data_as_signal, seed)

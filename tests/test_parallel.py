"""torch_tdist.parallel on the CPU, one process per rank: a two-layer MLP and a llama-style block
(attention and SwiGLU feed-forward, sequence parallel) parallelised with tdist's styles on a tdist
mesh match torch's styles on a Gloo mesh in outputs and gradients, through the overlapped tdist
ops; where there is nothing to fuse the styles are torch's."""

from __future__ import annotations

import pytest

from tests import jobs_parallel as J
from tests.helpers import skip_on, ws_param

pytestmark = skip_on("gloo", "torch_tdist.parallel compares a tdist mesh with a Gloo one")


@ws_param([2])
@pytest.mark.parametrize("model", ["mlp", "block"])
def test_styles_match_torch(pool, model, seed):
    pool.run(J.styles_match_torch, seed, model, timeout=300)


@ws_param([2])
def test_torch_style_where_nothing_fuses(pool, seed):
    pool.run(J.torch_style_elsewhere, seed, timeout=120)

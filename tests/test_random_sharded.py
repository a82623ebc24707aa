"""Dropout (plain and channel), `rand_like` and `randn_like` in sharded steps draw what one device draws
(pt3func/spmd/random_ops.py).

Each rank draws over the whole value, from its own generator (seeded alike on every rank), and keeps its block:
the sharded step's losses and parameters equal the single-device step's, on real gloo worlds of 2 and 4 ranks, for
values split along the batch (dp, FSDP), along features (tp) and along both (dp x tp). Before, every rank drew
the same numbers for its own block, and these runs differed from one device's.
"""

from __future__ import annotations

import pytest
import random_cases as rc
import torch
import torch.nn.functional as F
from dist import run_world


def _check(got: tuple[dict, list[float]], want: tuple[dict, list[float]], label: str) -> None:
    params, losses = got
    assert losses == pytest.approx(want[1], rel=1e-5, abs=1e-6), label
    for k, v in want[0].items():
        assert torch.allclose(params[k], v, rtol=1e-5, atol=1e-6), f"{label}: {k}"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_sharded_random_draws_equal_one_device_on_4_ranks(backend):
    want = rc.run_single(backend)
    names = ["dp4", "tp4", "dp_tp"]
    for rank, results in enumerate(run_world(4, rc.run_sharded, names, backend)):
        for name in names:
            _check(results[name], want, f"{name} rank {rank}")


def test_sharded_random_draws_equal_one_device_on_2_ranks():
    want = rc.run_single("eager")
    names = ["dp2", "fsdp2"]
    for rank, results in enumerate(run_world(2, rc.run_sharded, names, "eager")):
        for name in names:
            _check(results[name], want, f"{name} rank {rank}")


def test_blocks_of_one_draw_what_is_left_alone_and_what_warns():
    # Each rank's dropout output is its block of the single-device draw; replicated values, evaluation mode and
    # p = 0 are left as called (None). Alpha dropout is not redrawn: the trace warns, naming the function and
    # the user's line, and the covered F.dropout beside it says nothing.
    results = run_world(2, rc.rank_checks)
    x = results[0]["x"]
    torch.manual_seed(0)
    want = F.dropout(x, 0.5, True)
    assert torch.equal(torch.cat([r["block"] for r in results]), want)
    for r in results:
        assert r["left_alone"] == [None, None, None]
        messages = r["warnings"]
        assert messages and all(m.startswith("alpha_dropout on a value split over the mesh") for m in messages)
        assert "random_cases.py" in messages[0] and "F.alpha_dropout(a, 0.5, True)" in messages[0]

"""A pending sum (Partial over tp) on a dp x tp mesh is never reduce-scattered onto a dim that does not split evenly.

`((x @ w1) @ w2).square().mean()` with w1 P(None, "tp") and x P("dp") of 6 rows gave 27.65 instead of 42.87:
DTensor reduce-scattered the pending sum's 3 rows per dp rank 2/1 over tp (a pad row), then all-gathered the
blocks over dp+tp in one go and kept `[:6]`, a pad row in place of real row 5. pt3func now sets such strategies
aside (`spmd/partial_sums.py`): DTensor reduce-scatters onto an even dim where there is one (the 6 columns), else
all-reduces; an even split of the rows keeps its reduce-scatter. (5 or 7 rows do not split over dp at all:
`device_put` refuses them.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION

SPECS = (P(None, "tp"), P(), P("dp"))


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)


def _args(rows: int, cols: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randn(8, cols, generator=g), torch.randn(rows, 6, generator=g)


def _mean(w1, w2, x):
    return ((x @ w1) @ w2).square().mean()


def _sum(w1, w2, x):
    return ((x @ w1) @ w2).square().sum()


def _mean_dim0(w1, w2, x):
    return ((x @ w1) @ w2).square().mean(0)


def _sharded(fn: Callable, mesh, args: tuple, backend: str = "eager"):
    step = pf.jit(fn, backend=backend)
    with pf.set_mesh(mesh):
        placed = pf.device_put(args, SPECS)
        return pf.device_get(step(*placed)), step.lower(*placed).as_text()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_reported_case_mean_of_six_rows(mesh, backend):
    args = _args(6)
    got, _ = _sharded(_mean, mesh, args, backend)
    torch.testing.assert_close(got, _mean(*args))  # was 27.65 against 42.87


@pytest.mark.parametrize(("rows", "cols"), [(2, 6), (6, 6), (10, 6), (6, 5), (2, 3)])
@pytest.mark.parametrize("fn", [_mean, _sum, _mean_dim0])
def test_uneven_sizes_and_reductions(mesh, fn, rows, cols):
    # 2, 6 and 10 rows: 1, 3 and 5 per dp rank, which tp (2) does not divide; 5 or 3 columns: neither dim splits
    # evenly, so the pending sum is all-reduced.
    args = _args(rows, cols)
    got, text = _sharded(fn, mesh, args)
    torch.testing.assert_close(got, fn(*args), rtol=1e-4, atol=1e-4)
    assert "constant_pad_nd" not in text  # no block padded anywhere
    if cols % 2:
        assert "reduce_scatter" not in text


def test_training_step_loss_and_grads(mesh):
    args = _args(6)
    step = pf.jit(pf.value_and_grad(_mean, argnums=(0, 1)), backend="eager")
    want_loss, want_grads = step(*args)
    with pf.set_mesh(mesh):
        got_loss, got_grads = pf.device_get(step(*pf.device_put(args, SPECS)))
    torch.testing.assert_close(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_even_split_keeps_its_reduce_scatter(mesh):
    # 8 rows: 4 per dp rank, 2 per tp rank: the pending sum is reduce-scattered as before (half the traffic).
    args = _args(8)
    got, text = _sharded(_mean, mesh, args)
    torch.testing.assert_close(got, _mean(*args))
    if TORCH_VERSION >= (2, 13):  # torch 2.11's DTensor all-reduces this sum whatever pt3func allows
        assert "reduce_scatter" in text

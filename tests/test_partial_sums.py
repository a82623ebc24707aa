"""A pending sum (Partial) meeting a whole value in an addition is reduced there, inside pf.jit's sharded traces:
the residual stream of a tensor parallel block stays whole, as in Megatron, and no weight is gathered. DTensor used
eagerly keeps its own choice."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial

import pt3func as pf
from pt3func import P
from pt3func.analysis import is_collective


def _block_params() -> dict:
    g = torch.Generator().manual_seed(0)
    blocks = {str(i): {"up": torch.randn(8, 16, generator=g) * 0.3, "down": torch.randn(16, 8, generator=g) * 0.3}
              for i in range(2)}
    return {"blocks": blocks, "head": torch.randn(8, 4, generator=g) * 0.3}


def _rms(x: torch.Tensor) -> torch.Tensor:  # as Hugging Face writes it: linear in x once the scale is known
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _two_blocks(p: dict, x: torch.Tensor) -> torch.Tensor:
    for block in p["blocks"].values():
        # Column-parallel up, row-parallel down: the branch ends in a partial sum that joins the residual stream.
        x = x + torch.relu(_rms(x) @ block["up"]) @ block["down"]
    return (_rms(x) @ p["head"]).square().mean()


SPECS = {"blocks": {str(i): {"up": P(None, "tp"), "down": P("tp", None)} for i in range(2)}, "head": P()}


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("tp",), virtual=True)


def test_residual_stream_is_reduced_at_the_addition(mesh):
    params, x = _block_params(), torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    step = pf.jit(pf.value_and_grad(_two_blocks))
    want_loss, want_grads = step(params, x)
    with pf.set_mesh(mesh):
        sharded = pf.device_put(params, SPECS)
        loss, grads = step(sharded, pf.device_put(x, P()))
        gm = step.lower(sharded, pf.device_put(x, P())).graph_module
        loss, grads = pf.device_get((loss, grads))
    torch.testing.assert_close(loss, want_loss)
    for got, want in zip(pf.tree.leaves(grads), pf.tree.leaves(want_grads), strict=True):
        torch.testing.assert_close(got, want)
    collectives = [n for n in gm.graph.nodes if is_collective(n) and "wait" not in str(n.target)]
    forward = [n for n in collectives if not n.meta.get("custom")]  # the backward's and outputs' are labelled
    # One all-reduce per block, where the row-parallel output joins the residual (Megatron's); no weight or
    # activation gathered anywhere. DTensor's own choice kept the stream partial and all-gathered every later
    # block's `up` weight to multiply it (forward and backward).
    assert [str(n.target) for n in forward] == ["_c10d_functional.all_reduce.default"] * 2
    assert not [n for n in collectives if "all_gather" in str(n.target)]


def test_eager_dtensor_keeps_its_own_choice(mesh):
    # Outside pf.jit, after a sharded trace on the same rank threads, DTensor still makes the whole value partial
    # (no choice made inside the trace is reused from a cache outside it).
    test_residual_stream_is_reduced_at_the_addition(mesh)
    with pf.set_mesh(mesh):
        partial = pf.device_put(torch.randn(4, 8), P(None, "tp")) @ pf.device_put(torch.randn(8, 3), P("tp", None))
        assert partial.placements == (Partial(),)
        assert (partial + pf.device_put(torch.randn(4, 3), P())).placements == (Partial(),)


def test_partial_plus_partial_stays_pending(mesh):
    # Two row-parallel outputs summed: one reduction of the sum, not one of each term.
    def f(p, x):
        a, b = (torch.relu(x @ blk["up"]) @ blk["down"] for blk in p["blocks"].values())
        return (a + b).square().mean()

    params, x = _block_params(), torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with pf.set_mesh(mesh):
        sharded = pf.device_put(params, SPECS)
        gm = pf.jit(f).lower(sharded, pf.device_put(x, P())).graph_module
        got = pf.device_get(pf.jit(f)(sharded, pf.device_put(x, P())))
    torch.testing.assert_close(got, f(params, x))
    reduces = [n for n in gm.graph.nodes if is_collective(n) and "reduce" in str(n.target) and not n.meta.get("custom")]
    assert len(reduces) == 1

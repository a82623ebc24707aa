"""`topk(bucketed=True)`: one top-k selection over a bucket of leaves (global top-k), on 2 gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_world

import pt3func as pf
from pt3func import compress as C

pytestmark = pytest.mark.slow


def _loss(params, x):
    # The gradient of "loud" is 1000 x that of "quiet": a global selection spends the whole budget on it.
    return (1000.0 * params["loud"] * x).sum() + (params["quiet"] * x).sum()


def _step(params, ex, x):
    return pf.grad(_loss)(params, x), ex


def _exchange(rank: int, world: int, fmt_text: str, layout: str) -> dict:
    fmt = eval(fmt_text, vars(C))  # noqa: S307 - test constants
    mesh = pf.make_mesh((world,), ("dp",))
    spec = pf.P() if layout == "dp" else pf.P("dp")
    with pf.set_mesh(mesh):
        params = pf.device_put({"loud": torch.zeros(8, 8), "quiet": torch.zeros(8, 8)}, pf.NamedSharding(mesh, spec))
        g = torch.Generator().manual_seed(0)
        # Each rank's rows of the batch: the gradients are partial sums, reduced across the ranks.
        x = pf.device_put(torch.randn(2 * world, 8, 8, generator=g).abs() + 0.5, pf.NamedSharding(mesh, pf.P("dp")))
        ex = fmt.init(params)
        step = pf.jit(_step, grad_exchange=fmt, exchange_guard=None, backend="eager")
        text = step.lower(params, ex, x).as_text()
        grads, ex = step(params, ex, x)
        return {
            "grads": pf.tree.map(lambda t: t.clone(), pf.device_get(grads)),
            "residual": {k: v.residual for k, v in pf.device_get(ex.leaves).items()},
            "text": text,
        }


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_one_selection_over_the_bucket_spends_the_budget_where_the_magnitudes_are(layout):
    out = run_world(2, _exchange, "topk(0.25, bucketed=True)", layout)[0]
    assert "one bucket" in out["text"] and "one selection per bucket" in out["text"]
    k = math.ceil(0.25 * 128)  # per rank, over both 8 x 8 leaves
    # Every rank sends its 32 entries from "loud" (its 64 entries outweigh all of "quiet"); nothing of "quiet".
    assert int((out["grads"]["quiet"] != 0).sum()) == 0
    assert k <= int((out["grads"]["loud"] != 0).sum()) <= 2 * k
    # What was not sent stays in each rank's residual: all of "quiet"'s gradient.
    quiet = out["residual"]["quiet"]
    assert bool((quiet != 0).all())
    per_leaf = run_world(2, _exchange, "topk(0.25)", layout)[0]
    assert int((per_leaf["grads"]["quiet"] != 0).sum()) > 0  # per leaf, each leaf gets its own 25%

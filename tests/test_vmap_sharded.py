"""`pf.vmap` over a batch-sharded argument in a sharded step (per-example gradients, DP-SGD): each rank maps the
function over its own examples; same numbers as one device, including gradients taken through the vmap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, generator=g), torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _example_loss(w, x, y):
    return F.cross_entropy((x @ w)[None], y[None])


def dp_sgd_step(w, x, y):
    """Per-example gradients, clipped to norm 1, averaged: the DP-SGD update."""
    g = pf.vmap(pf.grad(_example_loss), in_axes=(None, 0, 0))(w, x, y)
    norms = g.flatten(1).norm(dim=1)
    clipped = g / torch.clamp(norms, min=1.0)[:, None, None]
    return w - 0.1 * clipped.mean(0), norms


def grad_through_vmap(w, x, y):
    return pf.grad(lambda w: pf.vmap(_example_loss, in_axes=(None, 0, 0))(w, x, y).mean())(w)


def closure_over_a_dtensor(w, x, y):
    return pf.vmap(lambda a: a @ w)(x)  # w is read from the closure, not mapped: each rank's whole copy


@pytest.mark.parametrize("fn", [dp_sgd_step, grad_through_vmap, closure_over_a_dtensor])
@pytest.mark.parametrize(("shape", "axes", "batch"), [((2,), ("dp",), P("dp")), ((2, 2), ("dp", "tp"), P("dp"))])
def test_vmap_over_sharded_examples_equals_one_device(fn, shape, axes, batch):
    w, x, y = _data()
    ref = pf.jit(fn, backend="eager")(w, x, y)
    mesh = pf.make_mesh(shape, axes, virtual=True)
    with pf.set_mesh(mesh):
        out = pf.jit(fn)(pf.device_put(w, P()), pf.device_put(x, batch), pf.device_put(y, batch))
        out = pf.device_get(out)
    for a, b in zip(pf.tree.leaves(out), pf.tree.leaves(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

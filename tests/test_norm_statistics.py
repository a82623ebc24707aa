"""Batch / instance norm running statistics in jitted steps (session 13): kept when the step returns only them
(one device), and updated on meshes, 2-D ones included, as on one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pt3func as pf
from pt3func import P


def _model(norm: str) -> nn.Module:
    torch.manual_seed(0)
    if norm == "batch":
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    return nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.InstanceNorm1d(4, affine=True, track_running_stats=True))


def _batch(norm: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 5, 5, generator=g) if norm == "batch" else torch.randn(8, 3, 6, generator=g) + 0.5


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_a_step_returning_only_the_statistics_keeps_them(norm, backend):
    """BN recalibration (swa_utils.update_bn): dead-code elimination must not drop the statistics' update."""
    model = _model(norm).train()
    params, apply = pf.functionalize(model)
    x = _batch(norm)
    got = pf.jit(lambda p, x: apply.with_updates(p, x)[1], backend=backend)(params, x)
    model(x)
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            keys = name.split(".")
            torch.testing.assert_close(got[keys[0]][keys[1]], buffer, rtol=1e-5, atol=1e-6)


def _step(apply):
    def step(params, x):
        def loss_fn(p):
            out, new = apply.with_updates(p, x)
            return (out * out).mean(), new

        (loss, new), grads = pf.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, new, grads

    return step


@pytest.mark.parametrize("norm", ["batch", "instance"])
@pytest.mark.parametrize(("shape", "names"), [((2,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_statistics_on_a_mesh_equal_one_device(norm, shape, names):
    params, apply = pf.functionalize(_model(norm).train())
    x = _batch(norm)
    want = pf.jit(_step(apply), backend="eager")(params, x)
    mesh = pf.make_mesh(shape, names, virtual=True)
    with pf.set_mesh(mesh):
        got = pf.device_get(pf.jit(_step(apply), in_shardings=(P(), P("dp")), backend="eager")(params, x))
    for g, w in zip(pf.tree.leaves(got), pf.tree.leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)

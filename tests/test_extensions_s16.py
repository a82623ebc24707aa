"""Session 16 fixes: torch.utils.checkpoint inside a traced step, torch.func.hessian under Inductor, weight_norm in
sharded steps (each against eager PyTorch / the single-device run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint as bound_checkpoint

import pt3func as pf
from pt3func import P
from pt3func.errors import TracingError
from pt3func.runtime.backend import zeros_for_efficient_zeros
from pt3func.trace.torch_checkpoint import torch_checkpoint_as_regions

# --- torch.utils.checkpoint around a dropout ------------------------------------------------------------------


def _block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.tanh(h @ w), 0.5, training=True)


def _eager_and_jitted(loss: Callable, w: torch.Tensor, x: torch.Tensor, backend: str = "eager") -> None:
    """Loss, gradient and the generator after the step: eager torch (whose checkpoint replays the RNG) vs pf.jit."""
    torch.manual_seed(42)
    ww = w.clone().requires_grad_()
    want_loss = loss(ww, x)
    want_loss.backward()  # not autograd.grad, which a reentrant checkpoint refuses
    want_grad = ww.grad
    want_next = torch.rand(3)
    torch.manual_seed(42)
    # The trace enters torch_checkpoint_as_regions itself (trace/capture.py).
    got_loss, got_grad = pf.jit(pf.value_and_grad(loss), backend=backend)(w, x)
    assert torch.equal(torch.rand(3), want_next)  # one draw per dropout: the recompute drew nothing
    torch.testing.assert_close(got_loss, want_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_with_dropout_has_eager_gradients(reentrant: bool) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(6, 6), torch.randn(4, 6)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(_block, x, w, use_reentrant=reentrant).pow(2).sum()

    _eager_and_jitted(loss, w, x)


def test_checkpoint_bound_by_import_and_checkpoint_sequential_are_routed_too() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(6, 6), torch.randn(4, 6)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = bound_checkpoint(_block, x, w, use_reentrant=False)
        layers = [partial(_block, w=w), torch.tanh, partial(_block, w=w), torch.sin]
        return tuc.checkpoint_sequential(layers, 2, h, use_reentrant=False).pow(2).sum()

    _eager_and_jitted(loss, w, x)


def test_torch_checkpoint_outside_a_trace_is_torchs() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(6, 6, requires_grad=True), torch.randn(4, 6)
    with torch_checkpoint_as_regions():
        torch.manual_seed(1)
        out = tuc.checkpoint(_block, x, w, use_reentrant=False)
        assert out.grad_fn is not None and tuc.checkpoint is bound_checkpoint
        (grad,) = torch.autograd.grad(out.sum(), w)
    torch.manual_seed(1)
    (want,) = torch.autograd.grad(_block(x, w).sum(), w)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize(
    ("option", "named"),
    [({"context_fn": partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])}, "context_fn"),
     ({"debug": True}, "debug=True")],
)
def test_torch_checkpoint_options_a_trace_cannot_honour_are_refused(option: dict, named: str) -> None:
    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(_block, x, w, use_reentrant=False, **option).sum()

    with pytest.raises(TracingError, match=named) as info:
        pf.jit(pf.grad(loss))(torch.randn(6, 6), torch.randn(4, 6))
    assert "test_extensions_s16.py" in str(info.value)  # the user's line


# --- torch.func.hessian under Inductor -------------------------------------------------------------------------

_HESSIAN_STEP = textwrap.dedent(
    """
    import torch, torch.nn.functional as F, torch.func as tf
    import pt3func as pf
    torch.manual_seed(0)
    p = {"w1": torch.randn(8, 4), "b1": torch.randn(8), "w2": torch.randn(2, 8), "b2": torch.randn(2)}
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    def net(p, x):
        return F.linear(torch.tanh(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])
    def loss(p, x, y):  # a curvature penalty beside the data loss
        H = tf.hessian(lambda xi: net(p, xi).pow(2).sum())(x[0])
        return H.trace() + F.mse_loss(net(p, x), y)
    got = pf.jit(pf.value_and_grad(loss))(p, x, y)
    want = pf.value_and_grad(loss)(p, x, y)
    print(all(torch.allclose(a, b, atol=1e-5) for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want))))
    """
)


@pytest.mark.slow  # Inductor compiles a C++ program (~20 s on two cores)
def test_hessian_step_under_inductor_does_not_crash() -> None:
    # In a child process: without the fix Inductor's program died with SIGSEGV.
    run = subprocess.run([sys.executable, "-c", _HESSIAN_STEP], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("True")


def test_efficient_zero_tensors_become_zeros_before_inductor() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(4)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return tf.hessian(lambda xi: torch.tanh(xi @ w).pow(2).sum())(x).trace()

    gm = pf.jit(pf.value_and_grad(loss), backend="eager").lower(w, x).graph_module
    efficient = torch.ops.aten._efficientzerotensor.default
    assert any(node.target is efficient for node in gm.graph.nodes)
    gm = zeros_for_efficient_zeros(gm)
    assert not any(node.target is efficient for node in gm.graph.nodes)
    got = gm(w, x)
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(pf.value_and_grad(loss)(w, x))):
        torch.testing.assert_close(a, b)


# --- weight_norm in sharded steps ------------------------------------------------------------------------------


@pytest.mark.parametrize(("new_api", "dim", "axis"),
                         [(True, 0, "dp"), (True, 1, "dp"), (False, 0, "dp"), (True, 0, "tp"), (False, 1, "tp")])
def test_weight_norm_in_a_sharded_step_matches_one_device(new_api: bool, dim: int, axis: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    if new_api:
        parametrizations.weight_norm(model[0], dim=dim)
    else:
        nn.utils.weight_norm(model[0], dim=dim)
    params, apply = pf.functionalize(model)
    x, y = torch.randn(8, 6), torch.randn(8, 4)

    def step(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return pf.value_and_grad(lambda p: F.mse_loss(apply(p, x), y))(p)

    want = step(params, x, y)
    if axis == "dp":
        shardings = (P(), P("dp"), P("dp"))
    else:  # the first layer's rows (its weight's g and v, and its bias) split over tp
        shardings = (pf.tree.map_with_path(
            lambda path, leaf: P("tp") if path[0] == "0" and leaf.dim() and leaf.shape[0] == 8 else P(), params),
            P(), P())
    with pf.set_mesh(pf.make_mesh((2,), (axis,), virtual=True)):
        got = pf.jit(step, in_shardings=shardings, backend="eager")(params, x, y)
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want)):
        torch.testing.assert_close(pf.device_get(a), b, atol=1e-5, rtol=1e-5)

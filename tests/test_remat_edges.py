"""Remat and memory_budget edge cases found in session 13: batch norm's statistics, keyword arguments of an eager
region, budget 0 with random ops, the budget's type."""

from __future__ import annotations

import fractions

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pt3func as pf
from pt3func.passes.remat_budget import saved_bytes


def _bn_step(wrap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).train()
    params, apply = pf.functionalize(model)
    forward = wrap(apply.with_updates)

    def step(params, x, y):
        def loss_fn(p):
            out, new = forward(p, x)
            return F.mse_loss(out, y), new

        (loss, new), grads = pf.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, new, grads

    return step, params


@pytest.mark.parametrize("how", ["checkpoint", "memory_budget"])
def test_recomputed_batch_norm_updates_its_statistics_once(how):
    """native_batch_norm writes running_mean / running_var without saying so in its schema: it must never be
    recomputed (a second momentum update)."""
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    ref_step, params = _bn_step(lambda f: f)
    ref_loss, ref_new, ref_grads = ref_step(params, x, y)
    if how == "checkpoint":
        step, params = _bn_step(pf.checkpoint)
        jitted = pf.jit(step, backend="eager")
    else:
        step, params = _bn_step(lambda f: f)
        jitted = pf.jit(step, backend="eager", memory_budget=0.0)
    loss, new, grads = jitted(params, x, y)
    torch.testing.assert_close(loss, ref_loss)
    for got, want in zip(pf.tree.leaves((new, grads)), pf.tree.leaves((ref_new, ref_grads))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    text = jitted.lower(params, x, y).as_text()
    assert not any("batch_norm" in line and "REMAT of" in line for line in text.splitlines())


def test_batch_norm_writing_an_input_is_refused():
    def step(x, running_mean, running_var):
        return F.batch_norm(x, running_mean, running_var, training=True).sum()

    with pytest.raises(pf.ImpureFunctionError, match="writes in place into input running_mean"):
        pf.jit(step, backend="eager")(torch.randn(8, 3), torch.zeros(3), torch.ones(3))
    # In eval mode batch norm only reads its statistics: fine.
    out = pf.jit(lambda x, m, v: F.batch_norm(x, m, v, training=False).sum(), backend="eager")(
        torch.randn(8, 3), torch.zeros(3), torch.ones(3)
    )
    assert torch.isfinite(out)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_eager_region_passes_keyword_arguments_torch_checkpoint_also_takes(policy):
    """torch.utils.checkpoint takes debug= / preserve_rng_state= itself: the user's function must get them."""

    def fun(x, w, debug=False, preserve_rng_state=1.0):
        return (x @ w) * (10.0 if debug else 1.0) * preserve_rng_state

    x, w = torch.ones(1, 2), torch.ones(2, 3).requires_grad_()
    region = pf.checkpoint(fun, getattr(pf.checkpoint_policies, policy))
    out = region(x, w, debug=True, preserve_rng_state=3.0)
    assert out.tolist() == [[60.0, 60.0, 60.0]]
    out.sum().backward()
    assert w.grad.tolist() == [[30.0] * 3] * 2


def test_budget_zero_keeps_the_least_with_random_ops():
    """At 0 the cut alone decides: a random op's bool mask is kept rather than its fp32 draw."""
    g = torch.Generator().manual_seed(0)
    p = {"w1": torch.randn(8, 8, generator=g), "w2": torch.randn(8, 8, generator=g)}
    x = torch.randn(4, 8, generator=g)

    def loss(p, x):
        h = torch.tanh(x @ p["w1"])
        h = h * (torch.rand_like(h) > 0.3)
        return ((h @ p["w2"]).sin() ** 2).sum()

    def step(p, x):
        return pf.value_and_grad(loss)(p, x)

    sizes = {b: saved_bytes(pf.jit(step, backend="eager", memory_budget=b).lower(p, x).graph_module.graph)
             for b in (1.0, 0.5, 0.1, 0.0)}
    assert sizes[0.0] == min(sizes.values()), sizes
    assert sizes[1.0] >= sizes[0.5] >= sizes[0.1] >= sizes[0.0], sizes


@pytest.mark.parametrize("budget", [np.float32(0.5), np.int64(0), torch.tensor(0.25), fractions.Fraction(1, 2), 1])
def test_memory_budget_takes_any_real_number(budget):
    assert pf.jit(lambda x: x * 2, memory_budget=budget).memory_budget == float(budget)


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        ("0.5", TypeError, "got str '0.5'"),
        ([0.5], TypeError, "got list"),
        (True, TypeError, "got bool"),
        (torch.ones(2), TypeError, "got a tensor"),
        (1.5, ValueError, r"in \[0, 1\] or None, got 1.5"),
        (float("nan"), ValueError, "got nan"),
        (-0.1, ValueError, "got -0.1"),
    ],
)
def test_memory_budget_errors_name_the_value(budget, error, match):
    with pytest.raises(error, match=match):
        pf.jit(lambda x: x * 2, memory_budget=budget)


def _inplace_on_matmul(x, w):
    a = x @ w
    a.relu_()
    return (a * 2).tanh()


def _grad_inside(x, w):
    g = pf.grad(lambda x: (torch.tanh(x @ w) ** 3).sum())(x)
    return torch.sin(g @ w)


@pytest.mark.parametrize("region", [_inplace_on_matmul, _grad_inside])
def test_eager_selective_checkpoint_failures_say_what_to_do(region):
    """Outside pf.jit, dots_saveable is torch's selective checkpoint, which cannot run these; under pf.jit it can."""
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    dots = pf.checkpoint_policies.dots_saveable
    want = pf.grad(lambda w: (region(x, w) ** 2).sum())(w)
    with pytest.raises(RuntimeError, match="outside pf.jit runs torch's selective activation checkpoint"):
        pf.grad(lambda w: (pf.checkpoint(region, dots)(x, w) ** 2).sum())(w)
    got = pf.jit(lambda w, x: pf.grad(lambda w: (pf.checkpoint(region, dots)(x, w) ** 2).sum())(w))(w, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

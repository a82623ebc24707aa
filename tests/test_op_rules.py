"""Sharded steps meet ops and values DTensor alone refuses: fused CPU attention (`F.scaled_dot_product_attention`
on a gloo world) in data parallel (batch sharded) and tensor parallel (heads sharded) steps, with and without a
mask, equal to one device; plain tensors made inside the step (masks, positions) taken as replicated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION

B, T, D, H = 4, 8, 16, 4


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"qkv": torch.randn(D, 3 * D, generator=g) * 0.3, "out": torch.randn(D, D, generator=g) * 0.3}


def _batch() -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))


def _make_step(mask: str, heads_sharded: bool = False):
    def loss_fn(p, x):
        q, k, v = (x @ p["qkv"]).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if heads_sharded:  # tensor parallel attention: each rank holds half the heads of q, k and v
            q, k, v = (pf.with_sharding_constraint(t, P(None, "dp")) for t in (q, k, v))
        if mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif mask == "bool":  # a sliding window of 3, made inside the step: a plain tensor beside DTensors
            window = torch.ones(T, T, dtype=torch.bool).tril().triu(-2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return (y.transpose(1, 2).reshape(B, T, D) @ p["out"]).square().mean()

    def step(p, x):
        loss, g = pf.value_and_grad(loss_fn)(p, x)
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    return step


def _run(step, params, x, steps=3):
    losses = []
    for _ in range(steps):
        params, loss = step(params, x)
        losses.append(float(loss))
    return params, losses


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


@pytest.mark.parametrize("mask", ["none", "causal", "bool"])
@pytest.mark.parametrize("layout", ["batch", "heads"])
def test_fused_cpu_attention_shards_like_one_device(mesh, mask, layout):
    ref_params, ref_losses = _run(pf.jit(_make_step(mask), backend="eager"), _params(), _batch())
    with pf.set_mesh(mesh):
        params = pf.device_put(_params(), P())
        x = pf.device_put(_batch(), P("dp") if layout == "batch" else P())
        jitted = pf.jit(_make_step(mask, heads_sharded=layout == "heads"), backend="eager")
        program = jitted.lower(params, x).as_text()
        params, losses = _run(jitted, params, x)
        params = pf.device_get(params)
    assert "flash_attention_for_cpu" in program  # the fused kernel, not a decomposition
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6)


def test_tensors_made_inside_a_sharded_step_are_replicated(mesh):
    def step(x):
        positions = torch.arange(x.shape[1], dtype=x.dtype)  # a plain tensor, the same on every rank
        return x * positions + torch.ones(x.shape[1:]).tril()

    x = _batch()[..., :T]
    with pf.set_mesh(mesh):
        out = pf.device_get(pf.jit(step, backend="eager")(pf.device_put(x, P("dp"))))
    torch.testing.assert_close(out, step(x))


@pytest.mark.skipif(
    TORCH_VERSION < (2, 13),
    reason="torch 2.11's DTensor reduces over each mesh axis in turn (no flattened collectives)",
)
def test_gradient_replicated_over_two_axes_is_reduced_once():
    def step(p, x):
        loss, g = pf.value_and_grad(lambda p, x: (F.layer_norm(x, (D,), p["ln"]) @ p["w"]).square().mean())(p, x)
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    params = {"ln": torch.ones(D), "w": torch.randn(D, D, generator=torch.Generator().manual_seed(0))}
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1))
    ref = pf.jit(step, backend="eager")(params, x)
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    with pf.set_mesh(mesh):
        args = pf.device_put(params, {"ln": P(), "w": P(None, "tp")}), pf.device_put(x, P("dp"))
        jitted = pf.jit(step, backend="eager")
        text = jitted.lower(*args).as_text()
        out = pf.device_get(jitted(*args))
    for a, b in zip(pf.tree.leaves(out), pf.tree.leaves(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The layer norm weight's gradient is pending over dp and tp: one all-reduce over both, not one per axis.
    ln_grad = [line for line in text.splitlines() if "COLLECTIVE" in line and "grad of p['ln']" in line]
    assert len(ln_grad) == 1 and "all_reduce over 'dp+tp'" in ln_grad[0], ln_grad


"""Lookups into a row-sharded (vocabulary-parallel) embedding table: same losses and params as one device, on
1-D and 2-D virtual meshes, with a tied output head and with padding_idx; one all-reduce for the lookup."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P

V, D, B, T = 16, 6, 4, 5


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(V, D, generator=g) * 0.5, "w": torch.randn(D, D, generator=g) * 0.5}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, T), generator=g)
    idx[0, :3] = 0  # the padding row, read a few times
    return idx, torch.randint(0, V, (B, T), generator=g)


def _make_step(padding_idx: int | None):
    opt = pf.optim.adamw(1e-2)

    def loss_fn(p, batch):
        idx, tgt = batch
        h = torch.tanh(F.embedding(idx, p["emb"], padding_idx=padding_idx) @ p["w"])
        logits = h @ p["emb"].T  # tied head: the same table, transposed
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

    def step(p, s, batch):
        loss, g = pf.value_and_grad(loss_fn)(p, batch)
        updates, s = opt.update(g, s, p)
        return pf.optim.apply_updates(p, updates), s, loss

    return step, opt


def _train(jitted, opt, params, batch, steps=3):
    state, losses = opt.init(params), []
    for _ in range(steps):
        params, state, loss = jitted(params, state, batch)
        losses.append(float(pf.device_get(loss)))
    return params, losses


@pytest.mark.parametrize(
    ("mesh_shape", "axes", "emb_spec", "batch_spec"),
    [
        ((2,), ("tp",), P("tp", None), P()),
        ((2, 2), ("dp", "tp"), P("tp", None), P("dp")),
        ((4,), ("tp",), P("tp", None), P()),
    ],
    ids=["tp2", "dp2xtp2", "tp4"],
)
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_row_sharded_lookup_equals_one_device(mesh_shape, axes, emb_spec, batch_spec, padding_idx):
    step, opt = _make_step(padding_idx)
    ref_params, ref_losses = _train(pf.jit(step, backend="eager"), opt, _params(), _batch())
    mesh = pf.make_mesh(mesh_shape, axes, virtual=True)
    with pf.set_mesh(mesh):
        params = pf.device_put(_params(), {"emb": emb_spec, "w": P()})
        batch = pf.device_put(_batch(), batch_spec)
        jitted = pf.jit(step, backend="eager")
        text = jitted.lower(params, opt.init(params), batch).as_text()
        params, losses = _train(jitted, opt, params, batch)
        params = pf.device_get(params)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6)
    # The lookup's partial sums are reduced over the axis that splits the rows, where the forward first uses them
    # (an all-reduce; on dp x tp DTensor picks a reduce-scatter, then gathers what the next op needs).
    first = next(line for line in text.splitlines() if "COLLECTIVE" in line)
    assert "over 'tp'" in first and f", {T}, {D}] = " in first, first
    assert "COLLECTIVE all_reduce" in first or "COLLECTIVE reduce_scatter" in first, first


def test_lookups_dtensor_handles_are_left_to_it():
    # A table split on its embedding dim: DTensor's own rule (no partial sums), same numbers as one device.
    step, opt = _make_step(None)
    ref_params, ref_losses = _train(pf.jit(step, backend="eager"), opt, _params(), _batch())
    mesh = pf.make_mesh((2,), ("tp",), virtual=True)
    with pf.set_mesh(mesh):
        params = pf.device_put(_params(), {"emb": P(None, "tp"), "w": P()})
        params, losses = _train(pf.jit(step, backend="eager"), opt, params, pf.device_put(_batch(), P()))
        params = pf.device_get(params)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(params["emb"], ref_params["emb"], rtol=1e-5, atol=1e-6)

"""`cast_before_gather`: FSDP shards are gathered in the dtype the step uses them in, with identical values."""

from __future__ import annotations

import pytest
import torch
from dist import run_world

import pt3func as pf

pytestmark = pytest.mark.slow


def _fsdp_mixed_precision(rank: int, world: int, disabled: bool) -> dict:
    pf.config.disabled_passes = frozenset({"cast_before_gather"} if disabled else ())
    mesh = pf.make_mesh((world,), ("dp",))
    torch.manual_seed(0)
    params = {"w1": torch.randn(16, 8), "w2": torch.randn(8, 8), "scale": torch.randn(8)}
    data = torch.randn(4 * world, 16), torch.randn(4 * world, 8)
    sharded = pf.NamedSharding(mesh, pf.P("dp"))
    params = pf.device_put(params, sharded)
    batch = pf.device_put(data, sharded)

    def loss_fn(p, x, y):
        bf = torch.bfloat16
        h = torch.tanh(x.to(bf) @ p["w1"].to(bf))  # fp32 master weights, bf16 compute
        out = (h @ p["w2"].to(bf)).float() * p["scale"]  # scale stays fp32: its gather must stay fp32
        return ((out - y) ** 2).mean()

    def step(p, x, y):
        loss, g = pf.value_and_grad(loss_fn)(p, x, y)
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    jitted = pf.jit(step, backend="eager")
    text = jitted.lower(params, *batch).as_text()
    for _ in range(2):
        params, loss = jitted(params, *batch)
    pf.config.disabled_passes = frozenset()
    return {"text": text, "params": pf.tree.map(lambda t: t.clone(), pf.device_get(params)), "loss": float(loss)}


def _gathers(text: str) -> list[str]:
    """The dtype[shape] of every all-gather in the program's text (`%name: bf16[16, 8] = ...`)."""
    return [line.split(":")[1].split("=")[0].strip() for line in text.splitlines() if "all_gather_into_tensor(" in line]


def test_cast_before_gather_halves_the_gathers_and_keeps_the_values():
    on = run_world(2, _fsdp_mixed_precision, False)[0]
    off = run_world(2, _fsdp_mixed_precision, True)[0]
    param_gathers_on = [g for g in _gathers(on["text"]) if g.startswith(("bf16[8, 8]", "bf16[16, 8]", "f32[8]"))]
    assert sorted(param_gathers_on) == ["bf16[16, 8]", "bf16[8, 8]", "f32[8]"], _gathers(on["text"])
    assert "bf16[16, 8]" not in " ".join(_gathers(off["text"]))
    assert on["loss"] == off["loss"]
    for name in ("w1", "w2", "scale"):
        assert torch.equal(on["params"][name], off["params"][name]), name

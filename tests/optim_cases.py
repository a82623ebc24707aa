"""pf.optim on real gloo worlds: functions run on every rank (see test_optim.py)."""

from __future__ import annotations

import torch

import pt3func as pf
from pt3func.sharding import P


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    # w splits over the ranks, b (3 rows) does not: the usual FSDP spec mixes split and whole leaves.
    return {"w": torch.randn(4, 6, generator=g), "b": torch.randn(3, generator=g)}


def _loss(p: dict, x: torch.Tensor) -> torch.Tensor:
    return ((x @ p["w"]).sum(-1, keepdim=True) * p["b"]).square().mean()


def apply_if_finite_mixed_layouts(rank: int, world: int) -> dict:
    """apply_if_finite(adam) over split and whole params, with a NaN batch at step 1: eager DTensors and pf.jit.
    Returns the final params (full) of each, the counters' types and the jitted step's trace count."""
    mesh = pf.make_mesh((world,), ("dp",))
    specs = {"w": P("dp"), "b": P()}
    opt = pf.optim.apply_if_finite(pf.optim.adam(0.1), 3)
    xs = [torch.full((2, 4), float(t + 1)) for t in range(3)]
    xs[1] = xs[1].clone()
    xs[1][0, 0] = float("nan")

    def step(p, s, x):
        g = pf.grad(_loss)(p, x)
        u, s = opt.update(g, s, p)
        return pf.optim.apply_updates(p, u), s

    out = {}
    with pf.set_mesh(mesh):
        jstep = pf.jit(step, backend="eager")
        for name, fn in (("eager", step), ("jit", jstep)):
            p = pf.device_put(_params(), specs)
            s = opt.init(p)
            for x in xs:
                p, s = fn(p, s, pf.device_put(x, P()))
            out[name] = {"params": pf.device_get(p), "total_notfinite": int(pf.device_get(s.total_notfinite)),
                         "counter_types": sorted({type(s.notfinite_count).__name__,
                                                  type(s.inner_state[0].count).__name__})}
        out["trace_count"] = jstep.trace_count()
    return out


def apply_if_finite_one_device() -> dict:
    opt = pf.optim.apply_if_finite(pf.optim.adam(0.1), 3)
    p, s = _params(), None
    s = opt.init(p)
    for t in range(3):
        x = torch.full((2, 4), float(t + 1))
        if t == 1:
            x[0, 0] = float("nan")
        u, s = opt.update(pf.grad(_loss)(p, x), s, p)
        p = pf.optim.apply_updates(p, u)
    return p


def zero_by_prefix(rank: int, world: int) -> dict:
    """ZeRO as the API words it: params whole, the optimizer state annotated P("dp") as one prefix (its 0-d step
    counter included). Returns the full params after 2 steps and the state's placements."""
    mesh = pf.make_mesh((world,), ("dp",))
    opt = pf.optim.adam(0.1)
    params = {"w": _params()["w"]}

    def step(p, s, x):
        u, s = opt.update(pf.grad(lambda p, x: (x @ p["w"]).square().mean())(p, x), s, p)
        return pf.optim.apply_updates(p, u), s

    with pf.set_mesh(mesh):
        jstep = pf.jit(step, in_shardings=(P(), P("dp"), P()), backend="eager")
        p = pf.device_put(params, P())
        s = opt.init(p)
        for t in range(2):
            p, s = jstep(p, s, torch.full((2, 4), float(t + 1)))
        placements = {k: str(getattr(v, "placements", "plain")) for k, v in
                      (("count", s[0].count), ("mu", s[0].mu["w"]), ("nu", s[0].nu["w"]))}
    return {"params": pf.device_get(p), "placements": placements}

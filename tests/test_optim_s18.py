"""Session 18 fixes in `pf.optim`: skipped steps on a virtual mesh, state leaves kept in their form (ZeRO state with
apply_if_finite and donation), schedules on a virtual mesh's count, moments of low-precision params computed in
float32."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

import pt3func as pf
from pt3func import P

S = pf.optim


def _run_eager(opt, params, grads, put):
    """`len(grads)` eager updates; the final params and state, gathered into plain tensors."""
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"w": put(g)}, state, params)
        params = S.apply_updates(params, updates)
    return pf.device_get(params), pf.device_get(state)


@pytest.mark.parametrize("wrap", ["apply_if_finite", "MultiSteps"])
def test_skipped_steps_keep_the_old_state_on_a_virtual_mesh(wrap):
    """Eager updates on a virtual mesh's arrays: the skipped steps (a NaN gradient; the first micro-step of a window)
    kept the new inner state, as `_select_tree` selected torch.Tensor leaves only."""
    inner = S.sgd(0.1, momentum=0.9)
    if wrap == "apply_if_finite":
        opt = S.apply_if_finite(inner, 3)
        grads = [torch.ones(4), torch.full((4,), float("nan")), torch.ones(4)]
    else:
        opt = S.MultiSteps(inner, 2).gradient_transformation()
        grads = [torch.full((4,), float(i + 1)) for i in range(4)]
    params = {"w": torch.zeros(4)}
    want_params, want_state = _run_eager(opt, params, grads, lambda g: g)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        got_params, got_state = _run_eager(opt, pf.device_put(params, P()), grads, lambda g: pf.device_put(g, P()))
    torch.testing.assert_close(got_params, want_params)
    for got, want in zip(pf.tree.leaves(got_state), pf.tree.leaves(want_state), strict=True):
        torch.testing.assert_close(got, want)


def test_zero_state_with_apply_if_finite_keeps_its_form_and_donates():
    """A ZeRO state (`P("dp")` over the whole state) through apply_if_finite: `last_finite` came back a plain tensor
    beside the replicated counters, so a donated state could not run and an undonated one retraced."""
    opt = S.apply_if_finite(S.sgd(0.1, momentum=0.9), 3)

    def step(p, s, g):
        u, s = opt.update({"w": g}, s, p)
        return S.apply_updates(p, u), s

    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        f = pf.jit(step, in_shardings=(P(), P("dp"), P()), out_shardings=(P(), P("dp")), donate_argnums=(0, 1),
                   backend="eager")
        w = torch.arange(8.0).reshape(4, 2)
        p, s = {"w": w.clone()}, opt.init({"w": w.clone()})
        for g in (torch.ones(4, 2), torch.full((4, 2), float("nan"))):
            p, s = f(p, s, g)
        assert f.trace_count() == 1
        for name in ("notfinite_count", "last_finite", "total_notfinite"):
            assert getattr(s, name).placements == (Replicate(),), name
        state = pf.device_get(s)
    assert state.last_finite.item() is False
    assert state.total_notfinite.item() == 1


def test_last_finite_keeps_the_form_of_the_state():
    """Eagerly: a replicated DTensor `last_finite` comes back replicated, a plain one plain."""
    opt = S.apply_if_finite(S.sgd(0.1), 3)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        params = pf.device_put({"w": torch.ones(4)}, P())
        grads = pf.device_put({"w": torch.ones(4)}, P())
        for state in (pf.device_put(opt.init({"w": torch.ones(4)}), P("dp")), opt.init(params)):
            _, new = opt.update(grads, state, params)
            for name in ("notfinite_count", "last_finite", "total_notfinite"):
                before, after = getattr(state, name), getattr(new, name)
                assert getattr(after, "placements", ()) == getattr(before, "placements", ()), name


def test_schedule_learning_rate_with_a_virtual_count():
    """A schedule's count that is a virtual mesh's array (the state placed with pf.device_put) crashed with
    "object of type 'VirtualArray' has no len()"."""
    opt = S.adam(S.linear(0.1, 0.0, 10))
    want, _ = opt.update({"w": torch.ones(4)}, opt.init({"w": torch.ones(4)}), {"w": torch.ones(4)})
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        state = pf.device_put(opt.init({"w": torch.ones(4)}), P("dp"))
        params, grads = pf.device_put(({"w": torch.ones(4)}, {"w": torch.ones(4)}), P())
        updates, _ = opt.update(grads, state, params)
        got = pf.device_get(updates)
    torch.testing.assert_close(got, want)


def test_schedule_names_a_count_it_cannot_take():
    with pytest.raises(TypeError, match=r"schedule got the step count 'three' \(a str\)"):
        S.linear(0.1, 0.0, 10)("three")


def test_adam_second_moment_of_float16_does_not_overflow():
    """`g * g` in float16 overflowed for |g| > 256: nu was inf for good and the update 0; torch.optim.Adam gives
    nu = 90, 160 and a -lr step."""
    opt = S.adam(0.1)
    w = {"w": torch.zeros(2, dtype=torch.float16)}
    updates, state = opt.update({"w": torch.tensor([300.0, -400.0], dtype=torch.float16)}, opt.init(w), w)
    assert state[0].nu["w"].tolist() == [90.0, 160.0]
    assert state[0].nu["w"].dtype == torch.float16
    assert updates["w"].tolist() == [-0.0999755859375, 0.0999755859375]


def _bf16(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()


def test_bfloat16_moments_are_rounded_once():
    """The moments of bfloat16 params are computed in float32 and rounded once to bfloat16 (each op rounded
    before, where Inductor rounds once: eager and compiled steps disagreed)."""
    m, g = _bf16()
    m32, g32 = m.float(), g.float()

    adam = S.scale_by_adam()
    state = adam.init({"w": m})._replace(mu={"w": m.clone()}, nu={"w": m.abs()})
    _, new = adam.update({"w": g}, state, None)
    assert torch.equal(new.nu["w"], (m.abs().float() * 0.999 + (1 - 0.999) * (g32 * g32)).bfloat16())
    assert torch.equal(new.mu["w"], torch.lerp(m32, g32, 1 - 0.9).bfloat16())

    for nesterov in (False, True):
        updates, new = S.trace(0.9, nesterov=nesterov).update({"w": g}, S.TraceState(trace={"w": m}), None)
        trace32 = g32 + 0.9 * m32
        assert torch.equal(new.trace["w"], trace32.bfloat16())
        assert torch.equal(updates["w"], (g32 + 0.9 * trace32 if nesterov else trace32).bfloat16())
        assert updates["w"].dtype == new.trace["w"].dtype == torch.bfloat16

    lion = S.scale_by_lion()
    _, new = lion.update({"w": g}, lion.init({"w": m})._replace(mu={"w": m}), None)
    assert torch.equal(new.mu["w"], (0.99 * m32 + (1 - 0.99) * g32).bfloat16())


def test_float32_adam_moments_unchanged():
    """float32 moments are computed as before the widening (the torch.optim comparisons rely on it)."""
    gen = torch.Generator().manual_seed(1)
    m, v, g = (torch.randn(64, generator=gen) for _ in range(3))
    adam = S.scale_by_adam()
    _, new = adam.update({"w": g}, adam.init({"w": m})._replace(mu={"w": m}, nu={"w": v.abs()}), None)
    assert torch.equal(new.nu["w"], v.abs() * 0.999 + (1 - 0.999) * (g * g))

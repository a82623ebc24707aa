"""The exchange guard (`pf.compress.Guard`, `pf.jit(exchange_guard=...)`): a compressed gradient exchange that
costs more than `max_overhead` against the reference exchange is switched off, identically on every rank, with a
logged reason; the trial calls are real training steps.

Timings come from an injected timer (`Guard(timer=...)`), so each test decides which program "is slower".
"""

from __future__ import annotations

import logging

import compress_cases as cc
import pytest
import torch
from dist import run_world
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func.compress.guard import forward_unchanged_inputs
from pt3func.runtime.donated import is_donated

C = pf.compress
OPT = pf.optim.sgd(0.1, momentum=0.9)
INT8 = C.int8()
STEPS = 10  # 1 warm-up + 3 timed calls of each program, then 2 calls of the chosen one


def train_step(params, opt_state, x, y):
    inner, ex = opt_state
    loss, grads = pf.value_and_grad(cc.loss_fn)(params, x, y)
    updates, inner = OPT.update(grads, inner, params)
    return pf.optim.apply_updates(params, updates), (inner, ex), loss


def fake_timer(compressed_s: float, reference_s: float):
    """A timer that runs the call and reports fixed seconds per program; `calls` records which ran."""

    def timer(program, run):
        timer.calls.append(program)
        return run(), compressed_s if program == "compressed" else reference_s

    timer.calls = []
    return timer


@pytest.fixture(autouse=True)
def guard_on(monkeypatch):
    monkeypatch.setattr(pf.config, "exchange_guard", "auto")  # tests/conftest.py turns it off for other tests


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def jitted(grad_exchange=INT8, donate=True, backend="eager", layout="dp2", **kwargs):
    specs, batch = cc.LAYOUTS[layout][2:4]
    return pf.jit(train_step, in_shardings=(specs, None, batch, batch), grad_exchange=grad_exchange,
                  donate_argnums=(0, 1) if donate else (), backend=backend, **kwargs)


def start(fmt=INT8, layout="dp2"):
    specs, data_axes = cc.LAYOUTS[layout][2], cc.LAYOUTS[layout][4]
    params = pf.device_put(cc.init_params(), specs)
    return params, (pf.jit(OPT.init, backend="eager")(params), fmt.init(params, data_axes=data_axes))


def train(mesh, step, steps=STEPS, fmt=INT8, layout="dp2"):
    """Run `step` `steps` times; return the final params (full tensors) and the state's step counter after each."""
    with pf.set_mesh(mesh):
        params, state = start(fmt, layout)
        counters = []
        for t in range(steps):
            params, state, _ = step(params, state, *cc.batch(t))
            counters.append(int(pf.device_get(state[1].step)))
        return pf.device_get(params), counters


def test_switched_off_when_compression_is_slower(mesh, caplog):
    timer = fake_timer(0.1207, 0.0470)
    step = jitted(exchange_guard=C.Guard(timer=timer))
    with caplog.at_level(logging.INFO, logger="pt3func.jit"):
        _, counters = train(mesh, step)
    d = step.exchange_decision()
    assert not d.kept
    assert (d.format, d.reference, d.trial_steps, d.max_overhead) == ("int8, block 256, EF", "bf16", 3, 0.03)
    assert d.compressed_ms == pytest.approx(120.7) and d.reference_ms == pytest.approx(47.0)
    assert d.overhead == pytest.approx(120.7 / 47.0 - 1)
    logged = [r for r in caplog.records if "grad_exchange" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING  # once (rank 0), as a warning
    message = logged[0].getMessage()
    assert message == d.reason
    assert message.startswith("pf.jit(train_step): grad_exchange int8 (block 256, EF) switched off: +156.8% step "
                              "time against bf16 (120.7 ms vs 47.0 ms, median of 3 steps each")
    assert "using bf16 from now on" in message
    # Both rank threads: one untimed call of each program, then 3 timed ones each, then the reference only.
    assert sorted(timer.calls) == ["compressed"] * 6 + ["reference"] * 6
    assert counters == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]  # the state's counter counts compressed exchanges only


def test_kept_when_within_the_allowed_overhead(mesh, caplog):
    step = jitted(exchange_guard=C.Guard(timer=fake_timer(0.1025, 0.1000)))
    with caplog.at_level(logging.INFO, logger="pt3func.jit"):
        _, counters = train(mesh, step)
    d = step.exchange_decision()
    assert d.kept and d.overhead == pytest.approx(0.025)
    logged = [r for r in caplog.records if "grad_exchange" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    assert "int8 (block 256, EF) kept: +2.5% step time against bf16 (102.5 ms vs 100.0 ms" in logged[0].getMessage()
    assert counters == [1, 1, 2, 2, 3, 3, 4, 4, 5, 6]
    # The same rule, a tighter bound: 2.5% is too much for 2%.
    strict = jitted(exchange_guard=C.Guard(max_overhead=0.02, timer=fake_timer(0.1025, 0.1000)))
    train(mesh, strict)
    assert not strict.exchange_decision().kept


@pytest.mark.parametrize("kept", [True, False])
def test_training_equals_running_the_chosen_programs_directly(mesh, kept):
    # Reference none(): the program's own fp32 reduction, which pf.jit without grad_exchange runs directly.
    timer = fake_timer(0.1, 0.1) if kept else fake_timer(0.2, 0.1)
    guarded = jitted(exchange_guard=C.Guard(reference=C.none(), timer=timer))
    got, _ = train(mesh, guarded)
    assert guarded.exchange_decision().kept is kept
    want = run_chosen_programs_directly(mesh, kept, STEPS)
    for k in cc.NAMES:
        assert torch.equal(got[k], want[k]), k


def run_chosen_programs_directly(mesh, kept, steps):
    """The final params of the guard's schedule (4 pairs of trial calls, then the chosen program) run with the
    compressed and reference programs jitted apart, without a guard."""
    compressed, reference = jitted(exchange_guard=None), jitted(grad_exchange=None)
    schedule = [compressed, reference] * 4 + [compressed if kept else reference] * (steps - 8)
    with pf.set_mesh(mesh):
        params, state = start()
        for t, step in enumerate(schedule):
            params, state, _ = step(params, state, *cc.batch(t))
        return pf.device_get(params)


@pytest.mark.parametrize("kept", [True, False])
def test_decided_program_runs_on_the_fast_path(mesh, kept):
    # After the trials the chosen program is called as a program without a guard: the leaves a call returned are
    # remembered (pt3func/trace/leaf_memo.py), so the next call reads only the batch's keys; the numbers are
    # those of running the chosen programs directly.
    timer = fake_timer(0.1, 0.1) if kept else fake_timer(0.2, 0.1)
    guarded = jitted(exchange_guard=C.Guard(reference=C.none(), timer=timer))
    read_key = guarded._leaf_memo._leaf_key
    reads = [0]

    def counted(leaf):
        reads[0] += 1
        return read_key(leaf)

    guarded._leaf_memo._leaf_key = counted
    steps, per_call = STEPS + 3, []
    with pf.set_mesh(mesh):
        params, state = start()
        for t in range(steps):
            before = reads[0]
            params, state, _ = guarded(params, state, *cc.batch(t))
            per_call.append(reads[0] - before)
        got = pf.device_get(params)
    switch = next(iter(guarded._cache.values()))._switch
    assert (switch.program is next(iter(guarded._cache.values()))) is kept
    decided = 8  # calls 0-7 are the trials; call 8 runs the chosen program and remembers its leaves
    assert per_call[decided + 1:] == [2 * 2] * (steps - decided - 1)  # x and y, on each of the 2 rank threads
    assert per_call[decided] > 4 * per_call[-1]
    want = run_chosen_programs_directly(mesh, kept, steps)
    for k in cc.NAMES:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("layout,donate", [("dp2", True), ("dp2", False), ("fsdp2", True)])
def test_reference_program_passes_the_exchange_state_through(mesh, layout, donate):
    step = jitted(donate=donate, layout=layout, exchange_guard=C.Guard(timer=fake_timer(0.2, 0.1)))
    with pf.set_mesh(mesh):
        params, state = start(layout=layout)
        params, state, _ = step(params, state, *cc.batch(0))  # compressed: the residuals are now non-zero
        before = pf.device_get(state[1])
        assert float(before.leaves["w1"].residual.abs().sum()) > 0
        old = state[1].leaves["w1"].residual.locals
        buffers = [r._local_tensor.data_ptr() for r in old]
        params, state, _ = step(params, state, *cc.batch(1))  # the reference program's warm-up call
        after = pf.device_get(state[1])
        assert int(after.step) == int(before.step) == 1
        for a, b in zip(pf.tree.leaves(after.leaves), pf.tree.leaves(before.leaves)):
            assert torch.equal(a, b)
        # Donated or not, the state comes back in its own buffers, never copied; donated, the reference program
        # consumes it as the compressed one does (the old handles are unusable, not silently shared).
        assert [r._local_tensor.data_ptr() for r in state[1].leaves["w1"].residual.locals] == buffers
        assert [is_donated(r) for r in old] == [donate] * 2


def test_forward_unchanged_inputs():
    def program(x, y):
        return [x.view(4, 2).view(8), y.view(2, 4), x + 1, torch.ops.aten.alias(y)]

    gm = make_fx(program, tracing_mode="fake")(torch.empty(8), torch.empty(8))
    gm = forward_unchanged_inputs(gm)
    x, y = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outs[0] is x and outs[3] is y  # views of the input's own shape: the input itself
    assert outs[1].target is torch.ops.aten.view.default and outs[2].target is torch.ops.aten.add.Tensor
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(torch.ops.aten.view.default) == 1


def test_one_slow_rank_of_a_2d_mesh_decides_for_all():
    # FSDP x TP on a 2 x 2 virtual mesh: rank 3 alone times compression slower; the medians are maximised over
    # both mesh axes, so all four ranks switch off, and their programs keep running in step.
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)

    def timer(program, run):
        slow = torch.distributed.get_rank() == 3 and program == "compressed"
        return run(), 0.2 if slow else 0.1

    step = jitted(layout="fsdp_tp", exchange_guard=C.Guard(timer=timer))
    _, counters = train(mesh, step, layout="fsdp_tp")
    decisions = [compiled.exchange_decision() for compiled in step._cache.values()]  # one program per rank
    assert [d.kept for d in decisions] == [False] * 4
    assert {(d.compressed_ms, d.reference_ms) for d in decisions} == {(200.0, 100.0)}
    assert counters == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]


def test_default_guard_and_no_guard(mesh, monkeypatch):
    auto = jitted()  # exchange_guard="auto": int8 is guarded, timed by the wall clock
    train(mesh, auto)
    assert auto.exchange_decision() is not None and auto.exchange_decision().trial_steps == 3
    # No guard: every call compressed, as before the guard existed; pf.config's "off" turns any guard off.
    plain, plain_counters = train(mesh, jitted(exchange_guard=None))
    assert plain_counters == list(range(1, STEPS + 1))
    monkeypatch.setattr(pf.config, "exchange_guard", "off")
    off_step = jitted(exchange_guard=C.Guard(timer=fake_timer(1.0, 0.1)))
    off, off_counters = train(mesh, off_step)
    assert off_counters == plain_counters and off_step.exchange_decision() is None
    for k in cc.NAMES:
        assert torch.equal(off[k], plain[k])
    monkeypatch.setattr(pf.config, "exchange_guard", "auto")
    # bf16 is already the reference: "auto" guards nothing there (one program, no trial).
    bf16 = jitted(grad_exchange=C.bf16())
    with pf.set_mesh(mesh):
        params, state = start(C.bf16())
        assert bf16.lower(params, state, *cc.batch(0))._make_switch is None


def test_lowered_describes_the_compressed_program(mesh):
    step = jitted(exchange_guard=C.Guard(timer=fake_timer(0.2, 0.1)))
    with pf.set_mesh(mesh):
        params, state = start()
        before = step.lower(params, state, *cc.batch(0))
        text, cost = before.as_text(), before.cost_analysis()
        for t in range(STEPS):
            params, state, _ = step(params, state, *cc.batch(t))
        after = step.lower(params, state, *cc.batch(0))
    assert not step.exchange_decision().kept
    assert "int8" in text and after.as_text() == text and after.cost_analysis() == cost
    assert after.compile().exchange_decision() == step.exchange_decision()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="reference must be a format that keeps no state"):
        C.Guard(reference=C.int8())
    with pytest.raises(ValueError, match="max_overhead"):
        C.Guard(max_overhead=-0.1)
    with pytest.raises(ValueError, match="trial_steps"):
        C.Guard(trial_steps=0)
    with pytest.raises(TypeError, match="exchange_guard"):
        pf.jit(train_step, grad_exchange=C.int8(), exchange_guard=0.03)
    with pytest.raises(ValueError, match="exchange_guard is one of 'auto', 'off', got 'maybe'.*PT3FUNC_EXCHANGE_GUARD"):
        pf.config.exchange_guard = "maybe"


def _ranks_disagree(rank: int, world: int, backend: str) -> dict:
    """Rank 1 alone finds compression slower (first jit) or the reference slower (second): the decision follows
    the slowest rank on every rank, and the ranks' params stay identical (their collectives matched)."""
    pf.config.exchange_guard = "auto"
    mesh = pf.make_mesh((world,), ("dp",))
    out = {}
    with pf.set_mesh(mesh):
        for name, slow in (("off", fake_timer(0.2, 0.1)), ("kept", fake_timer(0.1, 0.2))):
            timer = slow if rank == 1 else fake_timer(0.1, 0.1)
            step = jitted(backend=backend, exchange_guard=C.Guard(timer=timer))
            params, state = start()
            for t in range(STEPS):
                params, state, _ = step(params, state, *cc.batch(t))
            d = step.exchange_decision()
            local = {k: v._local_tensor.clone() for k, v in params.items()}
            out[name] = dict(kept=d.kept, ms=(d.compressed_ms, d.reference_ms), params=local,
                             step=int(state[1].step._local_tensor))
    return out


@pytest.mark.slow
def test_decision_is_the_same_on_every_rank():
    r0, r1 = run_world(2, _ranks_disagree, "eager")
    assert r0["off"]["kept"] is r1["off"]["kept"] is False
    assert r0["kept"]["kept"] is r1["kept"]["kept"] is True
    assert r0["off"]["ms"] == r1["off"]["ms"] == (200.0, 100.0)
    assert r0["kept"]["ms"] == r1["kept"]["ms"] == (100.0, 200.0)
    assert (r0["off"]["step"], r0["kept"]["step"]) == (4, 6)
    for name in ("off", "kept"):
        for k in cc.NAMES:
            assert torch.equal(r0[name]["params"][k], r1[name]["params"][k])


@pytest.mark.slow
def test_inductor_programs(mesh):
    # Both programs compiled by Inductor, the donated state aliased through the reference one.
    step = jitted(backend="inductor", exchange_guard=C.Guard(reference=C.none(), timer=fake_timer(0.2, 0.1)))
    got, counters = train(mesh, step)
    assert counters == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4] and not step.exchange_decision().kept
    eager = jitted(exchange_guard=C.Guard(reference=C.none(), timer=fake_timer(0.2, 0.1)))
    want, _ = train(mesh, eager)
    for k in cc.NAMES:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=1e-5)

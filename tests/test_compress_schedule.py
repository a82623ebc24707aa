"""Phased compressed exchange: dense warm-up, DGC's sparsity warm-up and momentum correction, PowerSGD's
small-matrix fallback (`pf.compress.topk(dense_steps=, warmup_steps=, momentum=)`, `powersgd(dense_steps=,
min_compression_rate=)`), and how jit picks the program of each phase from the ExchangeState's step."""

from __future__ import annotations

import compress_cases as cc
import pytest
import torch
from dist import run_world
from test_compress import _collectives, _reduction_graph
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func.compress import state as exchange_state
from pt3func.passes import grad_exchange
from pt3func.spmd.lower import GRAD_OF

C = pf.compress


def test_warm_up_schedules():
    fmt = C.topk(0.01, dense_steps=10, warmup_steps=30)
    # DGC: 25% kept, then 4x fewer per stage while above the target ratio, in equal stages after the dense steps.
    assert fmt.ramp() == (0.25, 0.0625, 0.015625, 0.01)
    assert fmt.schedule() == (10, 20, 30, 40)
    assert fmt.at(0) is None and fmt.at(9) is None
    assert [fmt.at(s).ratio for s in (10, 19, 20, 30, 40, 1000)] == [0.25, 0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert fmt.at(40) == C.topk(0.01) and fmt.at(40).schedule() == ()
    assert "dense for 10 steps" in str(fmt) and "0.25->0.0625->0.015625->0.01 over 30" in str(fmt)
    assert C.topk(0.01).schedule() == () and C.topk(0.01).at(0) == C.topk(0.01)
    assert C.topk(0.3, warmup_steps=10).schedule() == ()  # already above the warm-up's first ratio
    assert C.topk(0.1, warmup_steps=4).ramp() == (0.25, 0.1)  # 6.25% would be under the target
    assert C.topk(0.1, warmup_steps=4).schedule() == (4,)
    ps = C.powersgd(4, dense_steps=5)
    assert ps.schedule() == (5,) and ps.at(4) is None and ps.at(5) == C.powersgd(4)
    assert C.skip_small(ps).schedule() == (5,)
    with pytest.raises(ValueError, match="error_feedback"):
        C.topk(0.01, error_feedback=False, momentum=0.9)
    with pytest.raises(ValueError, match="dense_steps"):
        C.powersgd(4, dense_steps=-1)
    with pytest.raises(ValueError, match="min_compression_rate"):
        C.powersgd(4, min_compression_rate=0.5)


def test_powersgd_leaves_matrices_that_compress_less_than_min_rate_uncompressed():
    # (16 + 12) * 4 = 112 values sent for 192: 1.7x, under the default rate of 2.
    assert C.powersgd(4).resolve("['w']", (16, 12)) is None
    assert C.powersgd(4, min_compression_rate=1.0).resolve("['w']", (16, 12)) is not None
    assert C.powersgd(4).resolve("['w']", (64, 32)) == C.powersgd(4)
    assert C.powersgd(4).resolve("['b']", (64,)) is None


def test_state_phase_follows_the_step_counter():
    fmt = C.powersgd(2, dense_steps=3)
    params = {"w": torch.zeros(8, 8)}
    ex = fmt.init(params)
    assert ex.current_phase() == 0
    treedefs = {}
    for step in (0, 2, 3, 7):
        ex.step = torch.tensor(step)
        treedefs[step] = pf.tree.flatten(ex)[1]
    # The phase is part of the structure jit keys programs on: one structure per phase.
    assert treedefs[0] == treedefs[2] != treedefs[3] == treedefs[7]
    moved = pf.tree.unflatten(treedefs[7], pf.tree.leaves(ex))
    assert moved.phase == 3
    # In the last phase the counter is not read any more; a traced (fake) counter keeps the phase it came with.
    moved.step = torch.tensor(0)
    assert moved.current_phase() == 3
    assert exchange_state.host_step(torch.tensor(4)) == 4
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        t = mode.from_tensor(torch.tensor(5))
    assert exchange_state.host_step(t) is None
    from pt3func.runtime.donated import invalidate

    donated = torch.tensor(6)
    invalidate(donated, "step")
    assert exchange_state.host_step(donated) is None  # jit reports the donated argument itself


def _step_graph(shape=(64, 32)):
    ops = torch.ops._c10d_functional

    def program(x, step):
        return [ops.wait_tensor(ops.all_reduce(x, "sum", "group0")) * 2, step]

    gm = make_fx(program, tracing_mode="fake")(torch.empty(shape), torch.zeros((), dtype=torch.int64))
    node = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
    node.meta["custom"] = {GRAD_OF: "params['w']"}
    return gm


def test_pass_emits_the_program_of_the_state_phase():
    fmt = C.powersgd(2, error_feedback=False, warm_start=False, dense_steps=3)
    dense = grad_exchange.rewrite(_step_graph(), fmt, grad_exchange.StateBinding(fmt, None, 1, 1, phase=0),
                                  group_info=lambda n: (4, 0))
    # The dense phase: the fp32 all-reduce as traced, and the step counter still goes up.
    assert [(k, d, s) for k, d, s, _ in _collectives(dense)] == [("all_reduce", torch.float32, (64, 32))]
    outputs = next(n for n in dense.graph.nodes if n.op == "output").args[0]
    assert outputs[1].target is torch.ops.aten.add.Tensor
    compressed = grad_exchange.rewrite(_step_graph(), fmt, grad_exchange.StateBinding(fmt, None, 1, 1, phase=3),
                                       group_info=lambda n: (4, 0))
    assert [(k, s) for k, _, s, _ in _collectives(compressed)] == [("all_reduce", (64, 2)), ("all_reduce", (32, 2))]
    with pytest.raises(grad_exchange.GradExchangeError, match="changes program at steps"):
        grad_exchange.rewrite(_reduction_graph("all_reduce", (64, 32)), fmt, None, group_info=lambda n: (4, 0))
    inner = C.per_leaf(lambda path, shape: fmt)
    with pytest.raises(grad_exchange.GradExchangeError, match="per_leaf cannot know"):
        grad_exchange.rewrite(_step_graph(), inner, grad_exchange.StateBinding(inner, None, 1, 1),
                              group_info=lambda n: (4, 0))


@pytest.mark.slow
def test_dense_warm_up_then_compressed_on_two_ranks():
    formats = {"powersgd": "powersgd(4, dense_steps=2)",
               "topk": "topk(0.1, dense_steps=1, warmup_steps=2)"}
    r = run_world(2, cc.scheduled, formats, 5)[0]
    n = 32 * 64 + 64 + 64 * 16  # fp32 all-reduce of every leaf
    ps, tk = r["powersgd"], r["topk"]
    # PowerSGD: two dense steps (fp32 all-reduces, exact gradient, residuals untouched), then its factors.
    assert [sum(c.values()) for c in ps["comm_bytes"][:2]] == [4 * n] * 2
    assert all(sum(c.values()) < 4 * n / 2 for c in ps["comm_bytes"][2:])
    assert max(ps["err"][:2]) < 1e-6 and min(ps["err"][2:]) > 1e-4
    assert ps["residual"][:2] == [0.0, 0.0] and ps["residual"][2] > 0
    assert ps["phase"] == [0, 2, 2, 2, 2] and ps["programs"] == 2 and ps["step"] == 5
    # Top-k: dense, then 25% kept for two steps (8 bytes per value and index, all-gathered), then the 10% target.
    gathered = [c.get("all_gather_into_tensor", 0) for c in tk["comm_bytes"]]
    assert tk["comm_bytes"][0] == {"all_reduce": 4 * n} and tk["err"][0] < 1e-6
    assert gathered[1] == gathered[2] > gathered[3] == gathered[4] > 0
    assert tk["programs"] == 3


@pytest.mark.slow
def test_momentum_correction_matches_dgc_step_by_step():
    r = run_world(2, cc.momentum_correction, 0.1, 0.9, 4)[0]
    assert max(r["errs"]) < 1e-6, r["errs"]
    assert min(r["sent_norms"]) > 0


@pytest.mark.slow
def test_dense_warm_up_on_a_virtual_mesh():
    # The main thread sees VirtualArrays (no step to read): each rank thread picks its phase from its own counter.
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    specs, batch_spec = cc.LAYOUTS["dp2"][2], cc.LAYOUTS["dp2"][3]
    fmt = C.powersgd(4, dense_steps=2)
    shardings = (specs, None, batch_spec, batch_spec)
    with pf.set_mesh(mesh):
        params = pf.device_put(cc.init_params(), specs)
        ex = fmt.init(params)
        step = pf.jit(cc.grad_step, in_shardings=shardings, grad_exchange=fmt, backend="eager", **cc._jit_kwargs())
        exact_step = pf.jit(cc.grad_step, in_shardings=shardings, backend="eager")
        sent, errs = [], []
        for t in range(3):
            sent.append(sum(step.lower(params, ex, *cc.batch(t)).cost_analysis()["comm_bytes"].values()))
            exact = pf.device_get(exact_step(params, None, *cc.batch(t))[0])
            grads, ex = step(params, ex, *cc.batch(t))
            got = pf.device_get(grads)
            errs.append(max(float((got[k] - exact[k]).abs().max()) for k in cc.NAMES))
    assert sent[0] == sent[1] == 4 * (32 * 64 + 64 + 64 * 16) > sent[2]
    assert errs[0] == errs[1] == 0.0 and errs[2] > 1e-4
    assert int(pf.device_get(ex.step)) == 3 and ex.current_phase() == 2

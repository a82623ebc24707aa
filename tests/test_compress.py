"""Compressed gradient exchange (`pf.compress`, `jit(grad_exchange=...)`): formats, the pass, EF state."""

from __future__ import annotations

import math

import compress_cases as cc
import pytest
import torch
from dist import run_world
from torch.distributed.tensor import Shard
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func.compress import formats
from pt3func.passes import grad_exchange
from pt3func.spmd.lower import GRAD_OF

C = pf.compress

FORMATS = {
    "bf16": "bf16()", "fp16": "fp16()", "int8": "int8()", "int4": "int4()", "topk": "topk(0.1)",
    "topk_all": "topk(1.0)", "powersgd": "powersgd(4)", "topk_bf16": "chain(topk(0.1), bf16())",
}
# One step from zero state, relative L2 error of the reduced gradient: casts tight, int8 ~1%, the rest bounded
# (top-k 10% and rank-4 PowerSGD drop most of one step's gradient: error feedback sends it later).
ONE_STEP_BOUND = {"bf16": 5e-3, "fp16": 1e-3, "int8": 1.5e-2, "int4": 0.25, "topk": 0.8, "topk_all": 1e-6,
                  "powersgd": 0.8, "topk_bf16": 0.8}
EF_FORMATS = {
    "int8": "int8()", "int8_no_ef": "int8(error_feedback=False)", "int4": "int4()",
    "int4_no_ef": "int4(error_feedback=False)", "topk": "topk(0.1)", "powersgd": "powersgd(4)",
    "topk_int8": "chain(topk(0.1), int8())", "int8_stochastic": "int8(stochastic_rounding=True)",
    "topk_bucketed": "topk(0.1, bucketed=True)",
}
EF_STEPS = 12
# FSDP runs the same code after the reduction's first phase: a few formats suffice there.
EF_LAYOUTS = {
    "dp": EF_FORMATS,
    "fsdp": {k: EF_FORMATS[k] for k in ("int8", "int8_no_ef", "topk", "powersgd", "topk_bucketed")},
}


# ------------------------------------------------------------------------------------------- formats (unit)


def test_formats_are_small_hashable_values():
    assert C.int8() == C.int8() and hash(C.int8()) == hash(C.int8())
    assert C.int8(block=128) != C.int8()
    assert str(C.int8()) == "int8, block 256, EF"
    assert str(C.int4(stochastic_rounding=True, error_feedback=False)) == "int4, block 128, stochastic rounding"
    assert str(C.chain(C.topk(0.01), C.bf16())) == "top-k 0.01, values bf16, EF"
    assert "PowerSGD rank 4" in str(C.powersgd())
    assert C.none().resolve("['w']", (64, 64)) is None


def test_format_arguments_are_checked():
    with pytest.raises(ValueError, match="total_steps"):
        C.topk(0.01, adaptive=True)
    with pytest.raises(ValueError, match="ratio"):
        C.topk(0.0)
    with pytest.raises(ValueError, match="even"):
        C.int4(block=33)
    with pytest.raises(TypeError, match="first must be topk"):
        C.chain(C.int8(), C.bf16())
    with pytest.raises(TypeError, match="codec must be"):
        C.chain(C.topk(0.01), C.powersgd())
    with pytest.raises(TypeError, match="pf.compress format"):
        pf.jit(lambda x: x, grad_exchange="int8")


def test_per_leaf_selection():
    fmt = C.skip_small(C.int8(), min_numel=1000)
    assert fmt.resolve("['b']", (64,)) is None
    assert fmt.resolve("['w']", (32, 64)) == C.int8()
    # PowerSGD leaves vectors and matrices whose factors are not smaller uncompressed.
    assert C.powersgd(4).resolve("['b']", (64,)) is None
    assert C.powersgd(4).resolve("['w']", (8, 8)) is None
    assert C.powersgd(4).resolve("['w']", (64, 32)) == C.powersgd(4)
    chosen = C.per_leaf(lambda path, shape: C.bf16() if "embed" in path else C.int8())
    assert chosen.resolve("['embed']", (100, 8)) == C.bf16()
    assert chosen.resolve("['w']", (100, 8)) == C.int8()


def test_adaptive_alpha_schedule():
    for step, want in ((0, 0.1), (5, 0.055), (10, 0.01), (25, 0.01)):
        assert float(C.adaptive_alpha(torch.tensor(step), 10)) == pytest.approx(want)
    v = torch.tensor([3.0, -4.0, 0.0, 0.0])  # ||v|| = 5, sqrt(d) = 2
    fmt = C.topk(1.0, adaptive=True, total_steps=4)
    assert float(fmt.threshold(v, torch.tensor(0))) == pytest.approx(0.1 * 5 / 2)
    assert float(fmt.threshold(v, torch.tensor(2))) == pytest.approx(0.055 * 5 / 2)


def test_wire_layout_of_quantised_payload():
    # Two-phase int8: one payload row per rank, its values then its scales' bytes; decode inverts encode.
    q = formats.Quantize(8, 4)
    rows = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]])
    payload, _ = q.encode(rows, None, None)
    assert payload.dtype == torch.uint8 and payload.shape == (2, 4 + 4)
    assert torch.allclose(q.decode(payload, 4), rows, atol=4.0 / 127)
    q4 = formats.Quantize(4, 4)
    payload4, _ = q4.encode(rows, None, None)
    assert payload4.shape == (2, 2 + 4)
    assert torch.allclose(q4.decode(payload4, 4), rows, atol=4.0 / 7)


# ---------------------------------------------------------------------------------------- the pass (unit)


def _reduction_graph(kind: str, shape: tuple[int, ...], label: str = "params['w']"):
    """A hand-made program: one gradient reduction of `x` over a 4-rank group, then a use of the result."""
    ops = torch.ops._c10d_functional

    def program(x):
        if kind == "all_reduce":
            reduced = ops.all_reduce(x, "sum", "group0")
        else:
            reduced = ops.reduce_scatter_tensor(x, "sum", 4, "group0")
        return [ops.wait_tensor(reduced) * 2]

    gm = make_fx(program, tracing_mode="fake")(torch.empty(shape))
    for node in gm.graph.nodes:
        if node.op == "call_function" and "c10d" in str(node.target):
            node.meta["custom"] = {"pt3func": f"grad of {label}", GRAD_OF: label}
    return gm


def _collectives(gm) -> list[tuple[str, torch.dtype, tuple, str]]:
    from pt3func import analysis

    return [(analysis.collective_kind(n), n.args[0].meta["val"].dtype, tuple(n.meta["val"].shape),
             (n.meta.get("custom") or {}).get("pt3func")) for n in gm.graph.nodes if analysis.is_collective(n)]


def test_pass_rewrites_an_all_reduce_into_two_phase_bf16():
    gm = _reduction_graph("all_reduce", (64, 8))
    out_before = next(n for n in gm.graph.nodes if n.op == "output").args[0][0].meta["val"].shape
    gm = grad_exchange.rewrite(gm, C.bf16(), group_info=lambda name: (4, 1))
    assert _collectives(gm) == [
        ("all_to_all_single", torch.bfloat16, (4, 128), "grad of params['w'] (bf16)"),
        ("all_gather_into_tensor", torch.bfloat16, (4, 128), "grad of params['w'] (bf16)"),
    ]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out.meta["val"].shape == out_before and out.meta["val"].dtype == torch.float32


def test_pass_never_reduces_quantised_values():
    for kind, shape in (("all_reduce", (64, 8)), ("reduce_scatter", (64, 8))):
        gm = _reduction_graph(kind, shape)
        out_before = next(n for n in gm.graph.nodes if n.op == "output").args[0][0].meta["val"].shape
        binding = None
        gm = grad_exchange.rewrite(gm, C.int8(block=32, error_feedback=False), binding,
                                   group_info=lambda name: (4, 0))
        got = _collectives(gm)
        kinds = [k for k, *_ in got]
        assert kinds == (["all_to_all_single", "all_gather_into_tensor"] if kind == "all_reduce"
                         else ["all_to_all_single"])
        # 512 values over 4 ranks: 128 per rank = 4 blocks of 32; a row is 128 int8 + 4 fp32 scales.
        assert all(dtype == torch.uint8 for _, dtype, _, _ in got)
        assert got[0][2] == (4, 128 + 16)
        assert not any(k in ("all_reduce", "reduce_scatter_tensor") for k in kinds)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        assert out.meta["val"].shape == out_before


def test_pass_leaves_other_collectives_and_uncompressed_leaves_alone():
    gm = _reduction_graph("all_reduce", (8,), label="params['b']")
    gm = grad_exchange.rewrite(gm, C.skip_small(C.int8(error_feedback=False), 100), group_info=lambda n: (4, 0))
    assert [k for k, *_ in _collectives(gm)] == ["all_reduce"]
    gm = _reduction_graph("all_reduce", (64, 8))
    for node in gm.graph.nodes:
        node.meta.pop("custom", None)  # not a gradient reduction (e.g. a loss average)
    gm = grad_exchange.rewrite(gm, C.bf16(), group_info=lambda n: (4, 0))
    assert [k for k, *_ in _collectives(gm)] == ["all_reduce"]


def test_pass_asks_for_state_when_the_format_keeps_some():
    gm = _reduction_graph("all_reduce", (64, 8))
    with pytest.raises(grad_exchange.GradExchangeError, match="takes no ExchangeState"):
        grad_exchange.rewrite(gm, C.int8(), group_info=lambda n: (4, 0))


# ----------------------------------------------------------------------------------------- one device


def test_one_device_is_a_no_op_except_the_step_counter():
    params = cc.init_params()
    ex = C.int8().init(params)
    assert pf.tree.leaves(ex.leaves) == []  # plain tensors have no reductions, so no residuals
    step = pf.jit(cc.grad_step, grad_exchange=C.int8(), backend="eager")
    grads, ex2 = step(params, ex, *cc.batch(0))
    want = pf.grad(cc.loss_fn)(params, *cc.batch(0))
    for k in cc.NAMES:
        assert torch.equal(grads[k], want[k])
    assert int(ex2.step) == 1
    assert "all_to_all" not in step.lower(params, ex2, *cc.batch(0)).as_text()


def test_state_without_grad_exchange_is_reported(caplog):
    params = cc.init_params()
    with caplog.at_level("WARNING", logger="pt3func.jit"):
        pf.jit(cc.grad_step, backend="eager").lower(params, C.int8().init(params), *cc.batch(0))
    assert "grad_exchange=...) is not set" in caplog.text


# ------------------------------------------------------------------------------------------ gloo worlds

@pytest.fixture(scope="module")
def one_step():
    return {layout: run_world(4, cc.one_step_errors, layout, FORMATS)[0] for layout in ("dp", "fsdp")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp", "fsdp"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_reduced_gradient_close_to_exact(one_step, layout, name):
    r = one_step[layout][name]
    for leaf, err in r["rel"].items():
        assert err <= ONE_STEP_BOUND[name], (leaf, err)
    assert r["step"] == 1


@pytest.mark.slow
def test_as_text_shows_the_rewritten_collectives(one_step):
    text = one_step["dp"]["int8"]["text"]
    assert "all_to_all_single" in text and "all_gather_into_tensor" in text
    # One bucket (pf.config.grad_exchange_bucket_bytes) for the three leaves, named in backward order; per leaf in
    # test_grad_exchange_bucket.py.
    assert ("COLLECTIVE all_to_all_single over 'dp', 4.1 KiB: grad of 3 leaves in one bucket, 12.2 KiB of gradients "
            "(int8, block 256, EF): params['w2'], params['b1'], params['w1']") in text
    fsdp = one_step["fsdp"]["int8"]["text"]
    assert "(int8, block 256, EF): params['w2'], params['w1'], params['b1']" in fsdp
    assert "reduce_scatter_tensor" not in fsdp
    assert "grad of params['w1'] (top-k 0.1, values bf16, EF)" in one_step["dp"]["topk_bf16"]["text"]


@pytest.mark.slow
def test_comm_bytes_are_the_compressed_volumes(one_step):
    world, block = 4, 256

    def int8_rows(n):  # per rank: ceil(n / world) padded to the block, int8 values + one fp32 scale per block
        c = math.ceil(math.ceil(n / world) / block) * block
        return world * (c + 4 * c // block)

    sizes = [32 * 64, 64, 64 * 16]
    per_leaf = sum(int8_rows(n) for n in sizes)
    assert one_step["dp"]["int8"]["comm_bytes"] == {"all_to_all_single": per_leaf, "all_gather_into_tensor": per_leaf}
    param_bytes = 4 * sum(sizes)  # FSDP's forward all-gathers of the fp32 parameters
    # + one fp32 flag: every rank's reduced shards finite (a skipped step keeps the exchange state)
    assert one_step["fsdp"]["int8"]["comm_bytes"] == {"all_to_all_single": per_leaf,
                                                       "all_gather_into_tensor": param_bytes, "all_reduce": 4}
    # bf16: 2 bytes a value each way; top-k 10%: k values (4 B) + k int32 indices from each rank.
    assert one_step["dp"]["bf16"]["comm_bytes"] == {"all_to_all_single": 2 * sum(sizes),
                                                    "all_gather_into_tensor": 2 * sum(sizes)}
    k = [math.ceil(0.1 * n) for n in sizes]
    assert one_step["dp"]["topk"]["comm_bytes"] == {"all_gather_into_tensor": world * 8 * sum(k)}
    assert one_step["dp"]["topk_bf16"]["comm_bytes"] == {"all_gather_into_tensor": world * 6 * sum(k)}


@pytest.mark.slow
def test_quantised_formats_never_reduce_quantised_values(one_step):
    for layout in ("dp", "fsdp"):
        for name in ("int8", "int4", "bf16", "topk"):
            assert one_step[layout][name]["reduced_dtypes"] == [], (layout, name)


@pytest.fixture(scope="module")
def ef_sums():
    return {layout: run_world(4, cc.error_feedback_sums, layout, fmts, EF_STEPS)[0]
            for layout, fmts in EF_LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "name"), [(layout, name) for layout, fmts in EF_LAYOUTS.items() for name in fmts
                                              if not name.endswith("no_ef")])
def test_error_feedback_running_sum_tracks_the_exact_sum(ef_sums, layout, name):
    # The defining identity of error feedback: what was sent over all steps plus what every rank still holds
    # equals the exact sum of the gradients.
    r, exact = ef_sums[layout][name], ef_sums[layout]["exact"]
    assert r["step"] == EF_STEPS
    for leaf in cc.NAMES:
        total = r["got"][leaf] + r["held"][leaf]
        assert cc._rel(total, exact[leaf]) < 1e-5, leaf


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "bits"), [("dp", "int8"), ("dp", "int4"), ("fsdp", "int8")])
def test_error_feedback_beats_no_error_feedback(ef_sums, layout, bits):
    r, exact = ef_sums[layout], ef_sums[layout]["exact"]
    for leaf in cc.NAMES:
        with_ef = cc._rel(r[bits]["got"][leaf], exact[leaf])
        without = cc._rel(r[f"{bits}_no_ef"]["got"][leaf], exact[leaf])
        assert with_ef < 0.5 * without, (leaf, with_ef, without)


@pytest.mark.slow
def test_adaptive_topk_threshold_per_step():
    total = 6
    r = run_world(4, cc.adaptive_topk, total)[0]
    assert max(r["max_err"]) < 1e-6, r["max_err"]
    # alpha decays from 0.1 to 0.01: fewer entries fall under the threshold as training goes on.
    assert r["dropped"][0] > r["dropped"][total] > 0


@pytest.mark.slow
def test_int8_error_feedback_trains_like_fp32():
    formats_ = {"fp32": None, "int8": "int8()", "int4": "int4()", "topk": "topk(0.05)",
                "powersgd": "powersgd(2)"}
    r = run_world(4, cc.train, "dp", formats_, 40)[0]
    base = r["fp32"][-1]
    assert base < 0.1 * r["fp32"][0]  # it trains
    assert abs(r["int8"][-1] - base) <= 0.01 * base
    assert abs(r["int4"][-1] - base) <= 0.03 * base
    # Top-k 5% and rank-2 PowerSGD delay most of each gradient (error feedback sends it later): they train,
    # more slowly at 40 steps of adam.
    for name in ("topk", "powersgd"):
        assert r[name][-1] < 0.25 * r[name][0], (name, r[name])


@pytest.mark.slow
def test_fsdp_tp_and_two_rank_worlds():
    r = run_world(4, cc.one_step_errors, "fsdp_tp", {"int8": "int8()", "topk_all": "topk(1.0)"})[0]
    assert max(r["int8"]["rel"].values()) < 1.5e-2
    assert max(r["topk_all"]["rel"].values()) < 1e-6
    assert "(int8, block 256, EF): params['w2']" in r["int8"]["text"]
    two = run_world(2, cc.one_step_errors, "fsdp2", {"int8": "int8()", "powersgd": "powersgd(2)"})[0]
    assert max(two["int8"]["rel"].values()) < 1.5e-2 and two["int8"]["world"] == 2


@pytest.mark.slow
def test_reductions_users_write_are_compressed():
    r = run_world(2, cc.reductions_users_write)[0]
    # A tied embedding (lookup + head) and a weight with a penalty in the loss: DTensor reduced their gradient
    # mid-backward, uncompressed (error 0, residual 0); now both go through int8 with error feedback.
    for leaf, got in r["tied"].items():
        assert 1e-4 < got["rel"] < 3e-2 and got["residual"] > 0, (leaf, got)
    assert "grad of 2 leaves in one bucket" in r["text"]
    # Two arguments' ['x'] shared one residual before.
    assert r["two_args_diff"] == 0.0
    for text in ("chain(powersgd(2), int8(block=16))", "chain(powersgd(2), bf16())"):
        assert r[text] < 1e-5, (text, r[text])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "fsdp2"])
def test_a_skipped_non_finite_step_leaves_the_exchange_state_as_it_was(layout):
    # apply_if_finite skips a NaN batch; the exchange must not keep a NaN residual (every later step would be NaN)
    # nor count the step: the run then equals one without that batch.
    formats_ = {"int8": "int8()", "topk": "topk(0.25)", "powersgd": "powersgd(1)"}
    r = run_world(2, cc.nan_batch, layout, formats_, 5, 2)
    for rank_result in r:
        for name, runs in rank_result.items():
            poisoned, clean = runs["poisoned"], runs["clean"]
            assert int(poisoned["notfinite"]) == 1, name
            for a, b in zip(pf.tree.leaves(poisoned["params"]), pf.tree.leaves(clean["params"])):
                assert torch.equal(a, b), name
            for a, b in zip(pf.tree.leaves(poisoned["ex"]), pf.tree.leaves(clean["ex"])):
                assert torch.equal(a, b), name
            assert int(poisoned["step"]) == int(clean["step"]) + 1 == 6  # the counter counts the skipped step


@pytest.mark.slow
@pytest.mark.parametrize("text", ["int8(stochastic_rounding=True)", "topk(0.1, adaptive=True, total_steps=8)"])
def test_checkpoint_resume_is_bit_exact(tmp_path, text):
    r = run_world(2, cc.resume, "dp2", text, str(tmp_path / "ckpt"), 3, 3)
    for rank_result in r:
        assert torch.equal(rank_result["saved_residual"], rank_result["restored_residual"])
        assert rank_result["saved_residual"].abs().sum() > 0
        a, b = rank_result["uninterrupted"], rank_result["resumed"]
        for x, y in zip(pf.tree.leaves(a), pf.tree.leaves(b)):
            assert torch.equal(x, y)
        assert int(a["step"]) == 6
        assert rank_result["placements"] == (str(Shard(0)),)  # each rank holds its own row
        assert rank_result["trace_count"] == 1
    # Each rank keeps its own residual row (different data, different rounding errors).
    rows = r[0]["saved_residual"]
    assert rows.shape[0] == 2 and not torch.equal(rows[0], rows[1])


@pytest.mark.slow
def test_clear_errors():
    r = run_world(4, cc.errors)[0]
    assert "takes no ExchangeState" in r["missing"] and "exchange.init(params)" in r["missing"]
    assert "does not return it" in r["not_returned"]
    assert "built by int4" in r["other_format"]
    assert r["bf16_without_state"] is None
    assert "data_axes" in r["no_data_axes"] and "('dp', 'tp')" in r["no_data_axes"]
    assert "names no axis" in r["bad_data_axes"]
    assert "params['b1']" in r["wrong_data_axes"] and "data_axes" in r["wrong_data_axes"]


@pytest.mark.slow
def test_virtual_mesh_builds_state_in_the_rank_threads():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    specs, batch_spec = cc.LAYOUTS["dp2"][2], cc.LAYOUTS["dp2"][3]
    with pf.set_mesh(mesh):
        params = pf.device_put(cc.init_params(), specs)
        ex = C.int8().init(params)
        assert ex.leaves["w1"].residual.shape == (2, 32, 64)
        step = pf.jit(cc.grad_step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=C.int8(),
                      backend="eager")
        exact = pf.device_get(pf.jit(cc.grad_step, in_shardings=(specs, None, batch_spec, batch_spec),
                                     backend="eager")(params, None, *cc.batch(0))[0])
        for t in range(2):
            grads, ex = step(params, ex, *cc.batch(t))
            if t == 0:
                got = pf.device_get(grads)
                assert max(cc._rel(got[k], exact[k]) for k in cc.NAMES) < 1.5e-2
        assert int(pf.device_get(ex.step)) == 2
        assert float(pf.device_get(ex.leaves["w1"].residual).abs().sum()) > 0


@pytest.mark.slow
def test_inductor_compiles_the_rewritten_program():
    # Payload bytes reinterpreted (view dtype), the kernels' custom ops and all-to-all, through Inductor.
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    specs, batch_spec = cc.LAYOUTS["dp2"][2], cc.LAYOUTS["dp2"][3]
    fmt = C.chain(C.topk(0.1), C.int8(block=64))
    with pf.set_mesh(mesh):
        params = pf.device_put(cc.init_params(), specs)
        results = {}
        for backend in ("eager", "inductor"):
            step = pf.jit(cc.grad_step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                          backend=backend)
            ex = fmt.init(params)
            for t in range(2):
                grads, ex = step(params, ex, *cc.batch(t))
            results[backend] = pf.device_get((grads, ex.leaves))
    for a, b in zip(pf.tree.leaves(results["eager"]), pf.tree.leaves(results["inductor"])):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_rewritten_collectives_stay_tagged_with_their_leaf_and_are_not_rewritten_twice():
    ops = torch.ops._c10d_functional

    def program(x, step):
        return [ops.wait_tensor(ops.all_reduce(x, "sum", "group0")) * 2, step]

    gm = make_fx(program, tracing_mode="fake")(torch.empty(64, 32), torch.zeros((), dtype=torch.int64))
    next(n for n in gm.graph.nodes if "all_reduce" in str(n.target)).meta["custom"] = {GRAD_OF: "params['w']"}
    fmt = C.powersgd(2, error_feedback=False, warm_start=False)  # a fresh Q from the step counter each step
    binding = grad_exchange.StateBinding(fmt, None, step_in=1, step_out=1)
    gm = grad_exchange.rewrite(gm, fmt, binding, group_info=lambda n: (4, 0))
    got = _collectives(gm)
    assert [(k, shape) for k, _, shape, _ in got] == [("all_reduce", (64, 2)), ("all_reduce", (32, 2))]
    for node in gm.graph.nodes:
        if node.op == "call_function" and "c10d" in str(node.target):
            assert node.meta["custom"][GRAD_OF] == "params['w']"
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outputs[1].target is torch.ops.aten.add.Tensor  # the step counter goes up
    again = grad_exchange.rewrite(gm, C.bf16(), group_info=lambda n: (4, 0))
    assert _collectives(again) == got

"""Bucketed compressed gradient exchange: leaves of an elementwise format packed into one compressed reduction.

The bucket's layout keeps every leaf's chunks, blocks and residuals as they are per leaf (formats.two_phase_bucket),
so bucketed and per-leaf programs must agree bit for bit (round-to-nearest) and share their ExchangeState.
"""

from __future__ import annotations

import compress_cases as cc
import pytest
import torch
from dist import run_world
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func import analysis
from pt3func.compress import formats
from pt3func.config import config
from pt3func.passes import grad_exchange
from pt3func.spmd.lower import GRAD_OF

C = pf.compress
_ops = torch.ops._c10d_functional
_aten = torch.ops.aten


def _collectives(gm) -> list[tuple[str, tuple[int, ...], str]]:
    """The program's collectives but the 0-d flag of reduce-scatters ("every reduced gradient finite")."""
    return [(analysis.collective_kind(n), tuple(n.args[0].meta["val"].shape), n.meta["custom"].get("pt3func"))
            for n in gm.graph.nodes if analysis.is_collective(n) and n.args[0].meta["val"].ndim > 0]


def _tag(gm, labels: list[str]) -> None:
    """Tag the program's collectives, in order, as the gradient reductions of `labels`."""
    collectives = [n for n in gm.graph.nodes if analysis.is_collective(n)]
    assert len(collectives) == len(labels)
    for node, label in zip(collectives, labels):
        node.meta["custom"] = {"pt3func": f"grad of {label}", GRAD_OF: label}


def _three_reductions(kind: str = "all_reduce", early_read: bool = False):
    """Gradients of a, b, c each reduced over a 4-rank group as the backward makes them; with `early_read`, b's
    reduced gradient is read before c's gradient is computed (as an optimizer step interleaved with the
    backward would)."""

    def reduce(g):
        if kind == "all_reduce":
            return _ops.wait_tensor(_ops.all_reduce(g, "sum", "group0"))
        return _ops.wait_tensor(_ops.reduce_scatter_tensor(g, "sum", 4, "group0"))

    def program(a, b, c):
        ra = reduce(a * a)
        rb = reduce(b.sin())
        early = rb.neg() if early_read else b
        rc = reduce(c.cos() + early.sum())
        return [ra, rb, rc]

    gm = make_fx(program, tracing_mode="fake")(torch.empty(64, 8), torch.empty(40), torch.empty(16, 4))
    _tag(gm, ["params['a']", "params['b']", "params['c']"])
    return gm


def _outputs(gm) -> list[tuple[int, ...]]:
    return [tuple(o.meta["val"].shape) for o in next(n for n in gm.graph.nodes if n.op == "output").args[0]]


# ---------------------------------------------------------------------------------------------- the pass (unit)


def test_one_bucket_replaces_the_per_leaf_reductions():
    info = lambda name: (4, 1)  # noqa: E731
    per_leaf = grad_exchange.rewrite(_three_reductions(), C.bf16(), group_info=info, bucket_bytes=0)
    assert [k for k, _, _ in _collectives(per_leaf)] == ["all_to_all_single", "all_gather_into_tensor"] * 3
    gm = _three_reductions()
    shapes = _outputs(gm)
    gm = grad_exchange.rewrite(gm, C.bf16(), group_info=info, bucket_bytes=1 << 20)
    got = _collectives(gm)
    # Each rank's row holds its chunk of every leaf: 512 / 4, 40 / 4, 64 / 4 elements.
    why = ("grad of 3 leaves in one bucket, 2.4 KiB of gradients (bf16): params['a'], params['b'], params['c']")
    assert got == [("all_to_all_single", (4, 128 + 10 + 16), why), ("all_gather_into_tensor", (1, 154), why)]
    assert _outputs(gm) == shapes
    node = next(n for n in gm.graph.nodes if analysis.is_collective(n))
    assert node.meta["custom"][grad_exchange.BUCKET] == ["params['a']", "params['b']", "params['c']"]
    assert node.meta["custom"][GRAD_OF] == "params['a'], params['b'], params['c']"
    # The bytes on the wire are the per-leaf program's, in 2 collectives instead of 6.
    assert analysis.comm_bytes(gm) == analysis.comm_bytes(per_leaf)


def test_a_result_read_early_closes_the_bucket():
    gm = grad_exchange.rewrite(_three_reductions(early_read=True), C.int8(block=32, error_feedback=False),
                               group_info=lambda n: (4, 0), bucket_bytes=1 << 20)
    got = _collectives(gm)
    # a and b in one bucket; c alone: b's result is read before c's gradient exists.
    assert [k for k, _, _ in got] == ["all_to_all_single", "all_gather_into_tensor"] * 2
    assert "params['a'], params['b']" in got[0][2] and got[2][2] == "grad of params['c'] (int8, block 32)"
    # The first bucket's result is delivered before its reader; the graph is in a valid order (lint) and the
    # reader of b's result comes after the first all-gather and before c's all-to-all.
    gm.graph.lint()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = [n for n in gm.graph.nodes if analysis.is_collective(n) and "gather" in str(n.target)]
    reader = next(n for n in gm.graph.nodes if n.target is _aten.neg.default)
    c_exchange = [n for n in gm.graph.nodes if analysis.is_collective(n)][2]
    assert order[gathers[0]] < order[reader] < order[c_exchange]


def test_buckets_close_at_their_size_and_each_starts_where_its_last_gradient_is():
    gm = _three_reductions()
    grads = {label: n.args[0] for n, label in zip([n for n in gm.graph.nodes if analysis.is_collective(n)], "abc")}
    gm = grad_exchange.rewrite(gm, C.bf16(), group_info=lambda n: (4, 0), bucket_bytes=2048)
    got = _collectives(gm)
    # a (2 KiB) fills a bucket by itself; b and c share the next one.
    assert [(k, s) for k, s, _ in got] == [("all_to_all_single", (4, 128)), ("all_gather_into_tensor", (1, 128)),
                                           ("all_to_all_single", (4, 26)), ("all_gather_into_tensor", (1, 26))]
    assert got[0][2] == "grad of params['a'] (bf16)"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    second = [n for n in gm.graph.nodes if analysis.is_collective(n)][2]
    assert order[grads["c"]] < order[second]


def test_reduce_scatter_buckets_keep_each_ranks_chunk_of_every_leaf():
    gm = _three_reductions("reduce_scatter")
    shapes = _outputs(gm)
    gm = grad_exchange.rewrite(gm, C.int8(block=8, error_feedback=False), group_info=lambda n: (4, 2),
                               bucket_bytes=1 << 20)
    got = _collectives(gm)
    # Chunks of 128, 10 and 16 elements, each padded to the block of 8: 128 + 16 + 16 int8 and 20 fp32 scales.
    assert [(k, s) for k, s, _ in got] == [("all_to_all_single", (4, 160 + 4 * 20))]
    assert _outputs(gm) == shapes == [(16, 8), (10,), (4, 4)]


def test_only_elementwise_formats_are_bucketed():
    gm = _three_reductions()
    mixed = C.per_leaf(lambda path, shape: C.topk(0.5, error_feedback=False) if "b" in path else C.bf16())
    got = _collectives(grad_exchange.rewrite(gm, mixed, group_info=lambda n: (4, 0), bucket_bytes=1 << 20))
    # a and c (bf16) share a bucket around b's top-k all-gather, which stays per leaf; the bucket goes where c was.
    assert [why for _, _, why in got] == [
        "grad of params['b'] (top-k 0.5)",
        "grad of 2 leaves in one bucket, 2.2 KiB of gradients (bf16): params['a'], params['c']",
        "grad of 2 leaves in one bucket, 2.2 KiB of gradients (bf16): params['a'], params['c']",
    ]
    # Different formats never share a bucket, and do not split one another's: a and c still share theirs.
    gm = _three_reductions()
    two = C.per_leaf(lambda path, shape: C.fp16() if "b" in path else C.bf16())
    got = _collectives(grad_exchange.rewrite(gm, two, group_info=lambda n: (4, 0), bucket_bytes=1 << 20))
    assert [why.split(":")[0] for _, _, why in got] == ["grad of params['b'] (fp16)"] * 2 + [
        "grad of 2 leaves in one bucket, 2.2 KiB of gradients (bf16)"] * 2
    # Uncompressed leaves (skip_small) keep their all-reduce.
    gm = _three_reductions()
    small = C.skip_small(C.bf16(), 50)  # b (40 elements) stays fp32; a and c share a bucket around it
    got = _collectives(grad_exchange.rewrite(gm, small, group_info=lambda n: (4, 0), bucket_bytes=1 << 20))
    assert [k for k, _, _ in got] == ["all_reduce", "all_to_all_single", "all_gather_into_tensor"]


def test_config_sets_the_default_bucket_size(monkeypatch):
    monkeypatch.setattr(config, "grad_exchange_bucket_bytes", 0)
    assert len(_collectives(grad_exchange.rewrite(_three_reductions(), C.bf16(), group_info=lambda n: (4, 0)))) == 6
    monkeypatch.setattr(config, "grad_exchange_bucket_bytes", 1 << 20)
    assert len(_collectives(grad_exchange.rewrite(_three_reductions(), C.bf16(), group_info=lambda n: (4, 0)))) == 2


def test_bucket_layout_is_the_per_leaf_layout_side_by_side():
    # Without collectives: the encoded rows of a bucket are the per-leaf rows concatenated, so every block and
    # scale is the leaf's own (a block never straddles two leaves).
    codec = formats.Quantize(8, 16)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(40, generator=g), torch.randn(3, 7, generator=g) * 100, torch.randn(5, generator=g)]
    world = 4
    per_leaf = []
    for x in xs:
        m, c = formats._chunk(x.numel(), world, codec.align)
        per_leaf.append(formats._rows(x.reshape(-1), world, m, c))
    rows = torch.cat(per_leaf, 1)
    payload, _ = codec.encode(rows, None, None)
    decoded = codec.decode(payload, rows.shape[1])
    for part, alone in zip(decoded.split([p.shape[1] for p in per_leaf], 1), per_leaf):
        payload_alone, _ = codec.encode(alone, None, None)
        assert torch.equal(part, codec.decode(payload_alone, alone.shape[1]))


# ------------------------------------------------------------------------------------ programs on a virtual mesh


def _run_steps(fmt, bucket_bytes: int, steps: int, backend: str = "eager", layout: str = "dp2",
               donate: bool = False) -> dict:
    """`steps` grad steps on a 2-rank virtual mesh at fixed params: per-step reduced gradients, the final state,
    the collectives of the program."""
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    specs, batch_spec = cc.LAYOUTS[layout][2], cc.LAYOUTS[layout][3]
    saved = config.grad_exchange_bucket_bytes
    config.grad_exchange_bucket_bytes = bucket_bytes
    try:
        with pf.set_mesh(mesh):
            params = pf.device_put(cc.init_params(), specs)
            ex = fmt.init(params)
            step = pf.jit(cc.grad_step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                          backend=backend, donate_argnums=(1,) if donate else ())
            lowered = step.lower(params, ex, *cc.batch(0))
            grads = []
            for t in range(steps):
                g, ex = step(params, ex, *cc.batch(t))
                grads.append(pf.device_get(g))
            state = pf.device_get(ex.leaves)
    finally:
        config.grad_exchange_bucket_bytes = saved
    return {"grads": grads, "state": state, "collectives": _collectives(lowered.graph_module),
            "comm_bytes": lowered.cost_analysis()["comm_bytes"], "text": lowered.as_text()}


def _assert_same(a, b, exact: bool = True) -> None:
    la, lb = pf.tree.leaves(a), pf.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape
        if exact:
            assert torch.equal(x, y)
        else:
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "fsdp2"])
@pytest.mark.parametrize("text", ["bf16()", "fp16()", "int8()", "int4()", "int8(error_feedback=False)"])
def test_bucketed_equals_per_leaf_bit_for_bit(layout, text):
    fmt = eval(text, vars(C))  # noqa: S307 - test constants
    per_leaf = _run_steps(fmt, 0, 3, layout=layout)
    bucketed = _run_steps(fmt, 64 << 20, 3, layout=layout)
    # Gradients of every step and the final residuals (which carry every earlier step's rounding).
    _assert_same(per_leaf["grads"], bucketed["grads"])
    _assert_same(per_leaf["state"], bucketed["state"])
    phases = 1 if layout == "fsdp2" else 2  # a reduce-scatter has no all-gather phase
    assert len(per_leaf["collectives"]) - len(bucketed["collectives"]) == 2 * phases
    assert [k for k, _, _ in bucketed["collectives"]][-phases:] == (
        ["all_to_all_single"] if phases == 1 else ["all_to_all_single", "all_gather_into_tensor"])
    assert per_leaf["comm_bytes"] == bucketed["comm_bytes"]


@pytest.mark.slow
def test_stochastic_rounding_bucketed_is_close_and_keeps_the_error_feedback_identity():
    fmt = C.int8(stochastic_rounding=True)
    per_leaf = _run_steps(fmt, 0, 1)
    bucketed = _run_steps(fmt, 64 << 20, 6)
    exact = _run_steps(C.none(), 0, 6)
    # Another random stream than per leaf (the first leaf's, over bucket positions), as close to the exact sum.
    for k in cc.NAMES:
        assert cc._rel(bucketed["grads"][0][k], exact["grads"][0][k]) < 2e-2
        assert cc._rel(per_leaf["grads"][0][k], exact["grads"][0][k]) < 2e-2
    assert not torch.equal(bucketed["grads"][0]["w1"], per_leaf["grads"][0]["w1"])
    # sum of what was exchanged + what every rank still holds == sum of the exact gradients.
    state = bucketed["state"]
    for k in cc.NAMES:
        want = sum(g[k] for g in exact["grads"])
        held = state[k].residual.sum(0)
        server = state[k].server_residual
        m = -(-want.numel() // server.shape[0])
        held = held + server[:, :m].reshape(-1)[:want.numel()].view_as(want)
        assert cc._rel(sum(g[k] for g in bucketed["grads"]) + held, want) < 1e-5, k


@pytest.mark.slow
def test_a_mix_of_buckets_and_single_leaves_under_a_small_cap():
    fmt = C.int4()
    per_leaf = _run_steps(fmt, 0, 2)
    # w2 (4 KiB) fills a bucket alone; b1 and w1 share the next one.
    capped = _run_steps(fmt, 4000, 2)
    whys = [why for _, _, why in capped["collectives"]]
    assert whys[:2] == ["grad of params['w2'] (int4, block 128, EF)"] * 2
    assert whys[2].endswith("(int4, block 128, EF): params['b1'], params['w1']")
    _assert_same(per_leaf["grads"], capped["grads"])
    _assert_same(per_leaf["state"], capped["state"])


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_inductor_compiles_the_bucketed_program(donate):
    # Three steps, each reading the residuals the previous one wrote (donated: in place). Bucketed equals per
    # leaf bit for bit under Inductor too; Inductor's gradients differ from eager's in the last bits, which can
    # move a block's scale, so against eager only closeness is asked.
    fmt = C.int8(block=64)
    inductor = _run_steps(fmt, 64 << 20, 3, backend="inductor", donate=donate)
    assert len(inductor["collectives"]) == 2
    _assert_same(_run_steps(fmt, 0, 3, backend="inductor", donate=donate)["grads"], inductor["grads"])
    eager = _run_steps(fmt, 64 << 20, 3)
    for got, want in zip(inductor["grads"], eager["grads"]):
        for k in cc.NAMES:
            assert cc._rel(got[k], want[k]) < 1e-2, k


# ------------------------------------------------------------------------------------------- gloo: checkpoints


def resume_both_ways(rank: int, world: int, directory: str, text: str) -> dict:
    """cc.resume (train, checkpoint, train; restore, train again) with one compressed reduction per leaf, then
    bucketed."""
    out = {}
    for bucket_bytes in (0, 64 << 20):
        config.grad_exchange_bucket_bytes = bucket_bytes
        out[bucket_bytes] = cc.resume(rank, world, "dp2", text, f"{directory}/{bucket_bytes}", 3, 3)
    return out


@pytest.mark.slow
def test_checkpoint_resume_bucketed_equals_uninterrupted_and_per_leaf(tmp_path):
    # int8 + EF. A resumed bucketed run equals the uninterrupted one bit for bit; and bucketed and per-leaf
    # runs are the same run: the checkpointed residuals (per leaf, same shapes) and the end states are equal,
    # so a checkpoint of either restores into the other.
    results = run_world(2, resume_both_ways, str(tmp_path), "int8()")
    for r in results:
        per_leaf, bucketed = r[0], r[64 << 20]
        assert bucketed["saved_residual"].abs().sum() > 0
        assert torch.equal(bucketed["saved_residual"], bucketed["restored_residual"])
        assert torch.equal(per_leaf["saved_residual"], bucketed["saved_residual"])
        _assert_same(bucketed["uninterrupted"], bucketed["resumed"])
        _assert_same(per_leaf["uninterrupted"], bucketed["resumed"])
        assert bucketed["trace_count"] == 1

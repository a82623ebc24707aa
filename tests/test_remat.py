"""Rematerialisation: pf.checkpoint policies, memory_budget; numbers equal to no remat (offload: test_offload.py)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import pt3func as pf
from pt3func.passes.remat import (
    NAME_KEY,
    POLICY_KEY,
    REGION_KEY,
    Policy,
    alias_root,
    apply_remat,
    fence_recomputation,
    is_random,
    is_view,
    plan_from_policies,
    rematerialize,
)
from pt3func.passes.remat_budget import plan_budget, saved_bytes

CP = pf.checkpoint_policies
D, HEADS, FF = 16, 2, 32


def init_params(n_blocks: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    return [{"ln": torch.ones(D), "qkv": w(D, 3 * D), "proj": w(D, D), "fc": w(D, FF), "out": w(FF, D)}
            for _ in range(n_blocks)]


def block(x: torch.Tensor, p: dict, dropout: float = 0.1) -> torch.Tensor:
    b, s, _ = x.shape
    h = F.layer_norm(x, (D,), p["ln"])
    qkv = pf.checkpoint_name(h @ p["qkv"], "qkv")
    q, k, v = qkv.view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + y.transpose(1, 2).reshape(b, s, D) @ p["proj"]
    h = pf.checkpoint_name(F.layer_norm(x, (D,)) @ p["fc"], "mlp_in")
    h = F.dropout(F.gelu(h), dropout, training=True)
    return x + h @ p["out"]


def mlp_block(x: torch.Tensor, p: dict, dropout: float = 0.1) -> torch.Tensor:
    """The MLP half of `block` (what the Inductor tests compile: a quarter of the kernels)."""
    h = pf.checkpoint_name(F.layer_norm(x, (D,), p["ln"]) @ p["fc"], "mlp_in")
    h = F.dropout(F.gelu(h), dropout, training=True)
    return x + h @ p["out"]


def make_step(policy: Policy | None | str = "none", dropout: float = 0.1, body=block, **checkpoint_kwargs):
    """An AdamW step over transformer blocks, each checkpointed with `policy` ("none": no checkpoint)."""
    opt = pf.optim.adamw(1e-2, weight_decay=0.01)
    run_block = functools.partial(body, dropout=dropout)
    if policy != "none":
        run_block = pf.checkpoint(run_block, policy, **checkpoint_kwargs)

    def loss_fn(params, x, y):
        for p in params:
            x = run_block(x, p)
        return F.mse_loss(x, y)

    def step(params, opt_state, x, y):
        loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss

    return step, opt


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 8, D, generator=g), torch.randn(2, 8, D, generator=g)


def train(step_fn, opt, steps: int = 3, n_blocks: int = 2, **jit_kwargs):
    """`steps` jitted steps (each seeded, so dropout draws the same masks every run); losses and params."""
    params = init_params(n_blocks)
    opt_state = opt.init(params)
    step = pf.jit(step_fn, **jit_kwargs)
    x, y = data()
    losses = []
    for i in range(steps):
        torch.manual_seed(i)
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    return torch.stack(losses), params, step.lower(params, opt_state, x, y)


def assert_same(a, b):
    for u, v in zip(pf.tree.leaves(a), pf.tree.leaves(b)):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@functools.cache
def reference(backend: str):
    losses, params, lowered = train(*make_step("none"), backend=backend)
    return losses, params, lowered


POLICIES = {
    "everything": CP.everything_saveable,
    "nothing": CP.nothing_saveable,
    "default": None,
    "dots": CP.dots_saveable,
    "names": CP.save_only_these_names("qkv", "mlp_in"),
    "offload": CP.offload_to_host("mlp_in"),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_gives_the_same_numbers_eager_backend(name):
    losses, params, _ = train(*make_step(POLICIES[name]), backend="eager")
    ref_losses, ref_params, _ = reference("eager")
    assert_same(losses, ref_losses)  # dropout included: the masks are kept, never drawn again
    assert_same(params, ref_params)


@functools.cache
def inductor_run(policy_name: str, **jit_kwargs):
    """One MLP block under Inductor: (losses, params, number of matmul calls in the generated program)."""
    from torch._inductor.utils import run_and_get_code

    policy = POLICIES.get(policy_name, "none")
    (losses, params, _), codes = run_and_get_code(
        lambda: train(*make_step(policy, body=mlp_block), n_blocks=1, backend="inductor", **jit_kwargs))
    body = codes[0][codes[0].index("def call("):]
    return losses, params, sum(body.count(f"extern_kernels.{k}(") for k in ("mm", "addmm", "bmm"))


@pytest.mark.parametrize("name", ["nothing", "dots"])
def test_policy_gives_the_same_numbers_inductor(name):
    losses, params, _ = inductor_run(name)
    ref_losses, ref_params, _ = inductor_run("none")
    assert_same(losses, ref_losses)  # with dropout: Inductor runs the same random ops once, masks are kept
    assert_same(params, ref_params)


def test_recomputation_survives_inductor():
    """Inductor must not merge the recomputed matmuls back into the forward ones (CSE) or drop them."""
    assert inductor_run("nothing")[2] > inductor_run("none")[2]
    assert inductor_run("dots")[2] == inductor_run("none")[2]  # dots kept: only the cheap ops are recomputed


def _saved_nodes(lowered) -> list[fx.Node]:
    by_name = {n.name: n for n in lowered.graph_module.graph.nodes}
    return [by_name[row["name"]] for row in lowered.saved_activations()]


def _in_region(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(REGION_KEY))


def _random(node: fx.Node) -> bool:
    """The dropout mask: a random op, or the buffer one filled (bernoulli_ writes into an empty_like)."""
    root = alias_root(node)
    return is_random(node) or is_random(root) or any(is_random(u) for u in root.users)


def _lower(policy) -> pf.Lowered:
    step, opt = make_step(policy)
    params = init_params()
    return pf.jit(step, backend="eager").lower(params, opt.init(params), *data())


def _region_saved(policy) -> list[fx.Node]:
    """Saved values computed inside a region: not dropout masks, not the region's outputs (read by the next
    block's region or by the code after the last block: kept, as in JAX)."""

    def region_output(n):
        return any(_region(u) != _region(n) and not _is_backward(u) for u in n.users)

    return [n for n in _saved_nodes(_lower(policy)) if _in_region(n) and not _random(n) and not region_output(n)]


def _is_backward(node: fx.Node) -> bool:
    from pt3func.passes.remat import is_backward

    return is_backward(node)


def test_a_region_output_read_after_the_last_block_is_kept_not_recomputed():
    """The last block's output feeds the code after the blocks, whose backward reads it: recomputing it ran the
    block's last matmul again, a matmul its own backward never needs."""
    lowered = _lower(CP.nothing_saveable)
    nodes = list(lowered.graph_module.graph.nodes)
    outputs = [
        n for n in _saved_nodes(lowered)
        if _in_region(n) and any(not _in_region(u) and not _is_backward(u) for u in n.users)
    ]
    assert outputs, "the last block's output is kept"
    matmuls_behind = {
        alias_root(i).name
        for n in outputs
        for i in n.all_input_nodes
        if alias_root(i).target is torch.ops.aten.mm.default
    }
    assert matmuls_behind
    remat_of = {str((n.meta.get("custom") or {}).get("pt3func", "")) for n in nodes}
    assert not {f"remat of %{name}" for name in matmuls_behind} & remat_of, matmuls_behind


def _region(node: fx.Node) -> str | None:
    return (node.meta.get("custom") or {}).get(REGION_KEY)


def test_nothing_saveable_keeps_only_region_inputs_and_masks():
    assert _region_saved(CP.nothing_saveable) == []
    saved = _saved_nodes(_lower(CP.nothing_saveable))
    assert any(_random(n) and _in_region(n) for n in saved)  # each block's dropout mask is kept
    assert _saved_bytes(_lower(CP.nothing_saveable)) < _saved_bytes(_lower("none"))


def _saved_bytes(lowered) -> int:
    return sum(r["bytes"] for r in lowered.saved_activations())


def _nbytes(node: fx.Node) -> int:
    v = node.meta["val"]
    return v.numel() * v.element_size()


def test_dots_saveable_keeps_matmul_outputs():
    saved = _region_saved(CP.dots_saveable)
    assert saved and all(alias_root(n).target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
                         for n in saved)
    everything = _region_saved(CP.everything_saveable)
    assert len(everything) > len(saved)


def test_save_only_these_names_keeps_exactly_the_named():
    saved = _region_saved(CP.save_only_these_names("mlp_in"))
    assert saved and all("mlp_in" in (n.meta["custom"].get(NAME_KEY) or ()) for n in saved)
    assert len(saved) == 2  # one per block
    both = _region_saved(CP.save_only_these_names("qkv", "mlp_in"))
    assert {name for n in both for name in n.meta["custom"][NAME_KEY]} == {"qkv", "mlp_in"}


def test_named_output_keeps_its_siblings():
    """Naming attention's output keeps its logsumexp too: the attention kernel is not run again."""

    def attn(x, w):
        b, s, _ = x.shape
        q, k, v = (x @ w).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        return pf.checkpoint_name(F.scaled_dot_product_attention(q, k, v, is_causal=True), "attn").sum()

    def step(x, w):
        return pf.value_and_grad(lambda w: pf.checkpoint(attn, CP.save_only_these_names("attn"))(x, w))(w)

    x, w = torch.randn(2, 8, D), torch.randn(D, 3 * D)
    remat = [line for line in pf.jit(step, backend="eager").lower(x, w).as_text().splitlines() if "REMAT" in line]
    assert any("aten.mm" in line for line in remat)  # the projection is recomputed
    assert not any("attention" in line for line in remat)


def test_everything_saveable_changes_nothing():
    assert _lower(CP.everything_saveable).as_text().count("REMAT") == 0
    assert [r["bytes"] for r in _lower(CP.everything_saveable).saved_activations()] == [
        r["bytes"] for r in _lower("none").saved_activations()
    ]


def test_recomputed_copies_are_shown():
    text = _lower(CP.nothing_saveable).as_text()
    assert "REMAT of %" in text
    random_ops = [n for n in _lower(CP.nothing_saveable).graph_module.graph.nodes if is_random(n)]
    assert len(random_ops) == len([n for n in _lower("none").graph_module.graph.nodes if is_random(n)]) == 2


def test_eager_checkpoint_outside_jit_gives_the_same_numbers():
    params = init_params()
    x, y = data()

    def loss_and_grads(policy):
        run = functools.partial(block, dropout=0.1)
        if policy != "none":
            run = pf.checkpoint(run, policy)

        def loss_fn(ps):
            h = x
            for p in ps:
                h = run(h, p)
            return F.mse_loss(h, y)

        torch.manual_seed(0)
        return pf.value_and_grad(loss_fn)(params)

    ref = loss_and_grads("none")
    for policy in POLICIES.values():
        assert_same(loss_and_grads(policy), ref)


def test_memory_budget_shrinks_saved_bytes_monotonically():
    step, opt = make_step("none")
    params = init_params()
    x, y = data()
    sizes = []
    for budget in (1.0, 0.5, 0.0):
        lowered = pf.jit(step, memory_budget=budget, backend="eager").lower(params, opt.init(params), x, y)
        sizes.append(_saved_bytes(lowered))
        if budget < 1.0:
            assert "REMAT of" in lowered.as_text()
    assert sizes[0] > sizes[1] > sizes[2]
    ref_losses, ref_params, ref_lowered = reference("eager")
    assert sizes[0] == _saved_bytes(ref_lowered)
    for budget in (0.5, 0.0):
        losses, params_out, _ = train(step, opt, memory_budget=budget, backend="eager")
        assert_same(losses, ref_losses)
        assert_same(params_out, ref_params)


def test_memory_budget_meets_its_target_on_the_pass():
    step, opt = make_step("none")
    params = init_params()
    gm = pf.jit(step, backend="eager").lower(params, opt.init(params), *data()).graph_module
    before = saved_bytes(gm.graph)
    masks = sum(_nbytes(n) for n in gm.graph.nodes if n.target is torch.ops.aten.empty_like.default
                and any(is_random(u) for u in n.users))
    for budget in (0.75, 0.5, 0.25):
        plan = plan_budget(gm, budget)
        assert plan.recompute
    import copy

    for budget in (0.75, 0.5):
        g2 = copy.deepcopy(gm)
        apply_remat(g2, plan_budget(g2, budget))
        assert saved_bytes(g2.graph) <= budget * before
    g0 = copy.deepcopy(gm)
    apply_remat(g0, plan_budget(g0, 0.0))
    assert saved_bytes(g0.graph) == masks  # only what cannot be recomputed: the dropout masks


def test_memory_budget_with_inductor_gives_the_same_numbers():
    losses, params, mms = inductor_run("none-budget", memory_budget=0.0)
    ref_losses, ref_params, ref_mms = inductor_run("none")
    assert_same(losses, ref_losses)
    assert_same(params, ref_params)
    assert mms > ref_mms


# --- the pass alone, on hand-made graphs --------------------------------------------------------------------

aten = torch.ops.aten


def _graph(policy: Policy, device: str = "cpu", collective: bool = False):
    """x -> mm -> relu -> (named) mul -> sum, in a region; a backward that reads relu and mul."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        xv, wv = torch.empty(4, 4, device=device), torch.empty(4, 4, device=device)
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = xv, wv
    region = {REGION_KEY: "1", POLICY_KEY: policy.as_meta()}

    def op(target, *args, custom=None):
        node = g.call_function(target, args)
        with mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        node.meta["custom"] = dict(custom or region)
        return node

    mm = op(aten.mm.default, x, w)
    if collective:
        reduced = op(torch.ops._c10d_functional.all_reduce.default, mm, "sum", "0")
        mm = op(torch.ops._c10d_functional.wait_tensor.default, reduced)
    relu = op(aten.relu.default, mm)
    mul = op(aten.mul.Tensor, relu, relu)
    mul.meta["custom"][NAME_KEY] = ("act",)
    loss = op(aten.sum.default, mul, custom={})
    bwd = {"pt3func": "backward of value_and_grad(f)"}
    grad = op(aten.ones_like.default, loss, custom=bwd)
    g1 = op(aten.mul.Tensor, grad, mul, custom=bwd)
    g2 = op(aten.threshold_backward.default, g1, relu, 0, custom=bwd)
    g.output((loss, g2))
    return fx.GraphModule(torch.nn.Module(), g)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_recomputes_chain_before_first_backward_use():
    gm = rematerialize(_graph(CP.nothing_saveable))
    nodes = list(gm.graph.nodes)
    copies = [n for n in nodes if str(n.meta.get("custom", {}).get("pt3func", "")).startswith("remat of")]
    # mm, relu and mul are recomputed from x and w, once each, after the backward starts
    assert [c.target for c in copies] == [aten.mm.default, aten.relu.default, aten.mul.Tensor]
    first_backward = next(n for n in nodes if n.target is aten.ones_like.default)
    assert all(nodes.index(c) > nodes.index(first_backward) for c in copies)
    backward_mul = next(n for n in nodes if n.target is aten.mul.Tensor and n.args[0].target is aten.ones_like.default)
    assert backward_mul.args[1] is copies[2]
    assert copies[0].meta["custom"][REGION_KEY] == "1"  # annotations kept on copies


def test_fence_makes_recomputation_wait_for_the_backward():
    gm = fence_recomputation(rematerialize(_graph(CP.nothing_saveable)))
    nodes = list(gm.graph.nodes)
    where = [n for n in nodes if n.target is aten.where.ScalarSelf]
    assert len(where) == 1  # one input of the first copy; the others follow it through data dependencies
    never = where[0].args[0]
    assert never.target is aten.logical_and.default
    token = never.args[0].args[0]
    while token.target is aten.select.int:
        token = token.args[0]
    assert token.target is aten.ones_like.default  # the backward value computed just before the copies
    mm_copy = next(n for n in nodes if n.target is aten.mm.default and n is not nodes[2])
    assert where[0] in mm_copy.args
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(gm(x, w), rematerialize(_graph(CP.nothing_saveable))(x, w), rtol=0, atol=0)


def test_pass_keeps_what_the_policy_saves():
    gm = rematerialize(_graph(CP.save_only_these_names("act")))
    recomputed = [n.target for n in gm.graph.nodes if "remat of" in str(n.meta.get("custom", {}).get("pt3func"))]
    assert recomputed == [aten.mm.default, aten.relu.default]  # mul (named "act") is kept
    assert _targets(rematerialize(_graph(CP.everything_saveable))).count(aten.mm.default) == 1


def test_pass_never_recomputes_collectives_by_default():
    gm = _graph(CP.nothing_saveable, collective=True)
    plan = plan_from_policies(gm)
    assert not any(n.target is torch.ops._c10d_functional.all_reduce.default for n in plan.recompute)
    assert not any(n.target is aten.mm.default for n in plan.recompute)  # the chain stops at the wait
    rematerialize(gm)
    assert _targets(gm).count(torch.ops._c10d_functional.all_reduce.default) == 1


def test_pass_never_recomputes_random_ops():
    def f(x):
        return torch.nn.functional.dropout(x.sin(), 0.5, training=True).cos().sum()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(4))
    region = {REGION_KEY: "1", POLICY_KEY: CP.nothing_saveable.as_meta()}
    bwd = {"pt3func": "backward of f"}
    for node in gm.graph.nodes:
        node.meta["custom"] = dict(region)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    cos = next(n for n in gm.graph.nodes if n.target is aten.cos.default)
    with gm.graph.inserting_before(out):
        grad = gm.graph.call_function(aten.sin.default, (cos.args[0],))  # a "backward" read of the dropout output
    grad.meta = {"custom": bwd, "val": cos.meta["val"]}
    out.args = ((out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0], grad),)
    gm.recompile()
    plan = plan_from_policies(gm)
    assert plan.recompute and not any(is_random(n) for n in plan.recompute)
    rematerialize(gm)
    assert sum(map(is_random, gm.graph.nodes)) == 1


# --- errors -------------------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(TypeError, match="unknown policy"):
        pf.checkpoint(block, "dots_saveable")
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        Policy("save_some")
    with pytest.raises(TypeError, match="must be a string"):
        pf.checkpoint_name(torch.ones(2), 3)
    for bad, error in ((1.5, ValueError), (-0.1, ValueError), (True, TypeError), ("half", TypeError)):
        with pytest.raises(error, match="memory_budget"):
            pf.jit(lambda x: x, memory_budget=bad)
    assert pf.remat is pf.checkpoint
    assert repr(CP.save_only_these_names("a")) == "checkpoint_policies.save_only_these_names('a')"


def test_checkpoint_name_outside_a_region_is_fine():
    x = torch.randn(3, requires_grad=True)
    assert pf.checkpoint_name(x, "a") is x

    def f(x):
        return pf.checkpoint_name(x.sin(), "a").sum()

    out = pf.jit(lambda x: pf.value_and_grad(f)(x), backend="eager")(x.detach())
    torch.testing.assert_close(out[1], x.detach().cos())


# --- sharded ------------------------------------------------------------------------------------------------


def _sharded(rank: int, world: int) -> dict:
    import spmd_cases

    from pt3func.analysis import collective_kind, is_collective

    def loss_fn(params, x, y, policy, collectives):
        def mlp(params, x):
            h = torch.tanh(x @ params["fc1"]["w"] + params["fc1"]["b"])
            return h @ params["fc2"]["w"]

        return ((pf.checkpoint(mlp, policy, recompute_collectives=collectives)(params, x) - y) ** 2).mean()

    def train_step(params, opt_state, batch, policy=None, collectives=False):
        loss, grads = pf.value_and_grad(loss_fn)(params, *batch, policy, collectives)
        updates, opt_state = spmd_cases.OPT.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss

    out = {}
    for case in ("fsdp2", "tp"):
        shape, axes, specs, _, batch_spec = spmd_cases.CASES[case]
        mesh = pf.make_mesh((world,), axes)
        for policy, collectives in ((None, False), (CP.nothing_saveable, False), (CP.nothing_saveable, True)):
            with pf.set_mesh(mesh):
                params = pf.device_put(spmd_cases.init_params(), specs)
                opt_state = pf.jit(spmd_cases.OPT.init, backend="eager")(params)
                step = pf.jit(functools.partial(train_step, policy=policy, collectives=collectives),
                              in_shardings=(specs, None, (batch_spec, batch_spec)), backend="eager")
                lowered = step.lower(params, opt_state, spmd_cases.batches()[0])
                losses = []
                for batch in spmd_cases.batches():
                    params, opt_state, loss = step(params, opt_state, batch)
                    losses.append(float(pf.device_get(loss)))
            kinds = [collective_kind(n) for n in lowered.graph_module.graph.nodes if is_collective(n)]
            out[case, policy is not None, collectives] = {
                "losses": losses,
                "params": pf.tree.map(lambda t: t.clone(), pf.device_get(params)),
                "kinds": sorted(kinds),
                "remat": lowered.as_text().count("REMAT of"),
            }
    return out


@pytest.mark.slow
def test_sharded_remat_keeps_numbers_and_collectives():
    import spmd_cases
    from dist import run_world

    results = run_world(2, _sharded)[0]
    ref_params, ref_losses = spmd_cases.reference()
    for case in ("fsdp2", "tp"):
        base = results[case, False, False]
        remat = results[case, True, False]
        regather = results[case, True, True]
        for r in (base, remat, regather):
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
            for a, b in zip(pf.tree.leaves(r["params"]), pf.tree.leaves(ref_params)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert remat["losses"] == base["losses"]
        assert remat["remat"] > 0
        assert remat["kinds"] == base["kinds"]  # no collective is issued twice by default
    # recompute_collectives=True: FSDP's parameter gathers are issued again in the backward (ZeRO-3's
    # reshard-after-forward) instead of the gathered parameters being kept
    extra = list(results["fsdp2", True, True]["kinds"])
    for kind in results["fsdp2", False, False]["kinds"]:
        extra.remove(kind)
    assert extra == ["all_gather_into_tensor"] * 3


def test_fence_leaves_views_of_kept_values_alone():
    """A recomputed detach of a kept value (autograd saves attention's output as one) is not fenced: fenced, the
    attention backward, an extern kernel, would read a materialised copy of it."""

    def attn_block(x: torch.Tensor, p: dict) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = F.layer_norm(x, (D,), p["ln"]) @ p["qkv"]
        q, k, v = qkv.view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = pf.checkpoint_name(F.scaled_dot_product_attention(q, k, v, is_causal=True), "attn")
        return x + torch.tanh(y.transpose(1, 2).reshape(b, s, D) @ p["proj"])

    policy = pf.checkpoint_policies.save_only_these_names("attn")
    step_fn, opt = make_step(policy, body=lambda x, p, dropout: attn_block(x, p))
    params = init_params()
    lowered = pf.jit(step_fn).lower(params, opt.init(params), *data())
    fences = [n for n in lowered.graph_module.graph.nodes if n.target is torch.ops.aten.where.ScalarSelf]
    assert fences, "the recomputed LayerNorm / matmul inputs are still fenced"
    for fence in fences:
        assert not any(is_view(user) for user in fence.users), fence.format_node()


def test_fence_token_is_a_library_kernel_output_that_reads_no_copy():
    """Each group of copies waits for a matmul (or attention, or a collective) of the backward that reads no
    recomputed value: a pointwise token pulled the copies into its own kernel, and a token reading the group
    before chained the groups, so the recomputed GELU could not fuse with the GELU backward (one kernel in
    torch.compile's remat, two in ours before: 0.09 ms a block on an H200)."""
    from pt3func.passes.remat import _made_by_opaque_kernel

    policy = pf.checkpoint_policies.save_only_these_names("mlp_in")
    step_fn, opt = make_step(policy, dropout=0.0, body=mlp_block)
    params = init_params()
    step = pf.jit(step_fn)
    lowered = step.lower(params, opt.init(params), *data())
    nodes = list(lowered.graph_module.graph.nodes)
    copies = {n for n in nodes if str(n.meta.get("custom", {}).get("pt3func", "")).startswith("remat of")}
    assert any(n.target is aten.gelu.default for n in copies)
    fences = [n for n in nodes if n.target is aten.where.ScalarSelf]
    assert len(fences) >= 2
    position = {n: i for i, n in enumerate(nodes)}
    first_opaque = min(position[n] for n in nodes if _is_backward(n) and _made_by_opaque_kernel(n))
    for fence in fences:
        token = fence.args[0].args[0].args[0]  # where(never, ...) <- logical_and <- isnan <- select
        while token.target is aten.select.int:
            token = token.args[0]
        # (before the backward's first matmul, the latest backward value of any kind)
        assert _made_by_opaque_kernel(token) or position[fence] < first_opaque, token.format_node()
        reads = set(token.all_input_nodes)
        while any(is_view(r) for r in reads):  # through views to what they view
            reads = {s for r in reads for s in (r.all_input_nodes if is_view(r) else [r])}
        assert not reads & copies, token.format_node()
    # Under Inductor the recomputed GELU shares a kernel with the GELU backward.
    from torch._inductor.utils import run_and_get_code

    state = opt.init(params)
    _, codes = run_and_get_code(lambda: step(params, state, *data()))
    code = next(c for c in codes if "def call(" in c)
    kernels = re.findall(r"^(?:async_compile\.\w+\(|)(\w*fused\w*) = ", code, re.M)
    assert any("gelu_gelu_backward" in k for k in kernels), kernels


def locality_seen_by_inductor(monkeypatch):
    """The `reorder_for_locality` setting of each Inductor compilation from now on (a list that fills up)."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen = []
    real = compile_fx_module.compile_fx

    def spy(*args, **kwargs):
        seen.append(inductor_config.reorder_for_locality)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    return seen


@pytest.mark.parametrize("reorder", [True, False])
def test_locality_reorder_option_reaches_inductor_and_keeps_numbers(monkeypatch, reorder):
    """`pf.config.inductor_reorder_for_locality` is what Inductor compiles with; either way the same numbers."""
    seen = locality_seen_by_inductor(monkeypatch)
    monkeypatch.setattr(pf.config, "inductor_reorder_for_locality", reorder)
    policy = pf.checkpoint_policies.save_only_these_names("mlp_in")
    step_fn, opt = make_step(policy, dropout=0.0, body=mlp_block)
    losses, params, _ = train(step_fn, opt)
    assert seen and all(value is reorder for value in seen)
    ref_losses, ref_params, _ = train(*make_step("none", dropout=0.0, body=mlp_block), backend="eager")
    for u, v in zip(pf.tree.leaves((losses, params)), pf.tree.leaves((ref_losses, ref_params))):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_locality_reorder_off_for_programs_drawing_twice(monkeypatch):
    """Two random draws (dropout, then a uniform_ fill) keep their order: Inductor compiles such a program without
    `reorder_for_locality`, which swapped them on an H200; with one draw the setting stands. Numbers equal the
    function run eagerly (not jitted) from the same seed."""
    seen = locality_seen_by_inductor(monkeypatch)
    monkeypatch.setattr(pf.config, "inductor_reorder_for_locality", True)
    x = torch.randn(8, 16)

    def two_draws(x):
        h = torch.nn.functional.dropout(torch.tanh(x), 0.3, True)
        return h + torch.empty_like(h).uniform_(-1, 1)

    def one_draw(x):
        return torch.nn.functional.dropout(torch.tanh(x), 0.3, True) * 2

    for fn, reorder in ((two_draws, False), (one_draw, True)):
        seen.clear()
        torch.manual_seed(0)
        got = pf.jit(fn, backend="inductor")(x)
        torch.manual_seed(0)
        assert torch.equal(got, fn(x)), fn.__name__
        assert seen == [reorder], fn.__name__

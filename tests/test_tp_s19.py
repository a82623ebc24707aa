"""Tensor parallelism of a LLaMA-style model with vocabulary-parallel embedding and head (session 19).

- A pending sum (Partial) reaching `F.scaled_dot_product_attention` as q: DTensor reduce-scattered it inside the
  op and labelled the output with q's transposed strides while its block was contiguous; the heads' `reshape`
  then failed ("Cannot view a tensor with shape ..."). Equal to one device now, on tp=2 and dp2 x tp2.
- The vocabulary-parallel lookup is reduced right away (Megatron): no q/k/v weight gathered to multiply it.
- Behind a vocabulary-parallel head, the gradient's pending sum is reduced where a matrix product meets it, not
  the row-parallel weights gathered whole every layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION
from pt3func.analysis import collective_kind, is_collective

V, D, H, FF, B, T, LAYERS = 16, 16, 4, 32, 4, 6, 2
HD = D // H


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _llama_params() -> dict:
    g = torch.Generator().manual_seed(0)

    def n(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    layer = lambda: {"attn_norm": 1 + n(D, std=0.1), "wq": n(D, D), "wk": n(D, D), "wv": n(D, D), "wo": n(D, D),  # noqa: E731
                     "mlp_norm": 1 + n(D, std=0.1), "gate": n(FF, D), "up": n(FF, D), "down": n(D, FF)}
    return {"embed": n(V, D, std=1.0), "layers": [layer() for _ in range(LAYERS)], "norm": 1 + n(D, std=0.1),
            "head": n(V, D)}


def _llama_specs(head: P | None = None) -> dict:
    col, row = P("tp", None), P(None, "tp")
    layer = {"attn_norm": P(), "wq": col, "wk": col, "wv": col, "wo": row,
             "mlp_norm": P(), "gate": col, "up": col, "down": row}
    return {"embed": col, "layers": [layer] * LAYERS, "norm": P(), "head": col if head is None else head}


def _llama_loss(p: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # No position embedding added after the lookup (rotary models): the lookup's sum meets RMSNorm first.
    x = F.embedding(tokens, p["embed"])
    for L in p["layers"]:
        h = _rms(x, L["attn_norm"])
        q, k, v = (F.linear(h, L[w]).view(B, T, H, HD).transpose(1, 2) for w in ("wq", "wk", "wv"))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, D), L["wo"])
        h = _rms(x, L["mlp_norm"])
        x = x + F.linear(F.silu(F.linear(h, L["gate"])) * F.linear(h, L["up"]), L["down"])
    logits = F.linear(_rms(x, p["norm"]), p["head"])
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _grad_step(p, tokens, targets):
    return pf.value_and_grad(_llama_loss)(p, tokens, targets)


def _assert_same(got, want) -> None:
    got = pf.device_get(got)
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _collectives(lowered) -> list:
    return [n for n in lowered.graph_module.graph.nodes if is_collective(n)]


def _gathered_weights(lowered, params: dict) -> list:
    """All-gathers whose result has the (global, or transposed) shape of a 2-D weight: a weight gathered whole."""
    shapes = {tuple(w.shape) for w in pf.tree.leaves(params) if w.ndim == 2}
    shapes |= {s[::-1] for s in shapes}
    return [n for n in _collectives(lowered)
            if "all_gather" in collective_kind(n) and tuple(n.meta["val"].shape) in shapes]


@pytest.fixture(scope="module")
def tp2():
    return pf.make_mesh((2,), ("tp",), virtual=True)


@pytest.fixture(scope="module")
def dp2tp2():
    return pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)


def test_partial_query_into_attention_equals_one_device(tp2):
    # q a pending sum (features split, row-parallel weight): DTensor reduce-scatters it onto the batch inside the
    # attention op. The output's strides now follow its local block, so the heads' reshape copies as it must.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, T, D, generator=g), torch.randn(D, D, generator=g) * 0.3

    def f(x, w):
        q = F.linear(x, w).view(2, T, H, HD).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return o.transpose(1, 2).reshape(2, T, D).sin().sum()

    want = pf.jit(pf.value_and_grad(f, argnums=(0, 1)), backend="eager")(x, w)
    with pf.set_mesh(tp2):
        got = pf.jit(pf.value_and_grad(f, argnums=(0, 1)), in_shardings=(P(None, None, "tp"), P(None, "tp")),
                     backend="eager")(x, w)
    _assert_same(got, want)


def test_attention_output_strides_follow_its_block(tp2):
    # The DTensor the attention op returns claims the strides its local block has (DTensor.from_local's).
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_global_tensor_info

    seen = []

    def f(x, w):
        q = F.linear(x, w).view(2, T, H, HD).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q)
        if isinstance(o, DTensor):
            local = o.to_local()
            seen.append((o.stride(), tuple(compute_global_tensor_info(local, o.device_mesh, list(o.placements))[1])))
        return o.sum()

    with pf.set_mesh(tp2):
        step = pf.jit(f, in_shardings=(P(None, None, "tp"), P(None, "tp")), backend="eager")
        step.lower(torch.randn(2, T, D), torch.randn(D, D))
    assert seen and all(claimed == implied for claimed, implied in seen), seen


@pytest.mark.parametrize("mesh_name", ["tp2", "dp2tp2"])
def test_llama_with_vocab_parallel_embedding_equals_one_device(request, mesh_name):
    params, (tokens, targets) = _llama_params(), _tokens()
    want = pf.jit(_grad_step, backend="eager")(params, tokens, targets)
    batch = P("dp") if mesh_name == "dp2tp2" else P()
    with pf.set_mesh(request.getfixturevalue(mesh_name)):
        specs = _llama_specs()
        step = pf.jit(_grad_step, in_shardings=(specs, batch, batch), backend="eager")
        got = step(pf.device_put(params, specs), tokens, targets)
    _assert_same(got, want)


def test_vocab_parallel_lookup_is_reduced_right_away(tp2):
    # One all-reduce of the lookup, first thing; then Megatron's one per block. Left pending, the lookup's sum went
    # through RMSNorm into q/k/v, whose weights DTensor gathered whole (forward and backward) to multiply it.
    params, (tokens, targets) = _llama_params(), _tokens()
    with pf.set_mesh(tp2):
        specs = _llama_specs(head=P())
        step = pf.jit(_grad_step, in_shardings=(specs, P(), P()), backend="eager")
        lowered = step.lower(pf.device_put(params, specs), tokens, targets)
    collectives = _collectives(lowered)
    forward = [n for n in collectives if not n.meta.get("custom")]  # the backward's and outputs' are labelled
    assert not _gathered_weights(lowered, params), [n.format_node() for n in _gathered_weights(lowered, params)]
    assert [collective_kind(n) for n in forward] == ["all_reduce"] * (1 + 2 * LAYERS)
    assert tuple(forward[0].meta["val"].shape) == (B, T, D)


def test_lookup_with_indices_split_like_the_rows_keeps_the_batch_split(tp2):
    # Rows and indices both split over one axis: the lookup's sums go back onto the batch (a reduce-scatter), not
    # whole to every rank.
    g = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(V, D, generator=g), "w": torch.randn(D, D, generator=g) * 0.3}
    tokens = torch.randint(0, V, (B, T), generator=g)

    def loss(p, tokens, sharded=False):
        if sharded:
            tokens = pf.with_sharding_constraint(tokens, P("tp"))
        return torch.tanh(F.embedding(tokens, p["embed"]) @ p["w"]).square().mean()

    step = pf.jit(pf.value_and_grad(loss), static_argnums=2, backend="eager")
    want = step(params, tokens, False)
    with pf.set_mesh(tp2):
        sharded = pf.device_put(params, {"embed": P("tp", None), "w": P()})
        got = step(sharded, tokens, True)
        collectives = _collectives(step.lower(sharded, tokens, True))
    _assert_same(got, want)
    forward = [collective_kind(n) for n in collectives if not n.meta.get("custom")]
    assert forward == ["all_gather_into_tensor", "reduce_scatter_tensor"], forward  # the indices, the rows
    reduced = next(n for n in collectives if collective_kind(n) == "reduce_scatter_tensor")
    assert reduced.meta["val"].numel() == B * T * D // 2


def _head_case():
    g = torch.Generator().manual_seed(0)
    params = {"up": torch.randn(64, D, generator=g) * 0.2, "down": torch.randn(D, 64, generator=g) * 0.2,
              "head": torch.randn(32, D, generator=g) * 0.2}
    specs = {"up": P("tp", None), "down": P(None, "tp"), "head": P("tp", None)}  # column / row / vocab-parallel
    x, y = torch.randn(B, T, D, generator=g), torch.randint(0, 32, (B, T), generator=g)

    def loss(p, x, y):
        h = x + F.linear(F.silu(F.linear(x, p["up"])), p["down"])  # an MLP on the residual stream
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)  # the final RMSNorm
        return F.cross_entropy(F.linear(h, p["head"]).flatten(0, 1), y.flatten())

    return params, specs, x, y, loss


def test_vocab_parallel_head_gradient_is_reduced_not_the_weights_gathered(tp2):
    params, specs, x, y, loss = _head_case()
    step = pf.jit(pf.value_and_grad(loss), backend="eager")
    want = step(params, x, y)
    with pf.set_mesh(tp2):
        sharded = pf.device_put(params, specs)
        got = step(sharded, x, y)
        lowered = step.lower(sharded, x, y)
    _assert_same(got, want)
    # The head input's gradient is a pending sum through the norm's backward and the residual addition; each
    # product that reads it reduces it (activations), so no weight is gathered and no weight's gradient is
    # reduce-scattered. DTensor gathered `down` whole (twice) and reduce-scattered its gradient.
    assert not _gathered_weights(lowered, params)
    kinds = [collective_kind(n) for n in _collectives(lowered)]
    assert "reduce_scatter_tensor" not in kinds, kinds
    comm = lowered.cost_analysis()["comm_bytes"]
    assert sum(comm.values()) <= 4 * B * T * D * 4 + 64 * B * T * 4, comm


# merge_duplicate_collectives: one collective where two moved the same value the same way.

_C10D = torch.ops._c10d_functional


class _Graph:
    """A hand-built program of functional collectives (never run: the pass reads only its structure and meta)."""

    def __init__(self):
        self.graph = torch.fx.Graph()
        self.x = self._node(self.graph.placeholder("x"), torch.empty(4, 6))

    def _node(self, node, val, label=None, **custom):
        node.meta["val"] = val
        if label or custom:
            node.meta["custom"] = {"pt3func": label, **custom} if label else custom
        return node

    def op(self, target, *args, val, label=None):
        return self._node(self.graph.call_function(target, args), val, label)

    def collective(self, target, source, *args, label=None, **custom):
        val = torch.empty(source.meta["val"].shape)
        if target is _C10D.all_gather_into_tensor.default:
            val = torch.empty(2 * val.shape[0], *val.shape[1:])
        node = self._node(self.graph.call_function(target, (source, *args)), val, label, **custom)
        return self.op(_C10D.wait_tensor.default, node, val=val, label=label)

    def module(self, *outs):
        self.graph.output(tuple(outs))
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def _kinds(gm) -> list:
    return [(collective_kind(n), n.args[-1]) for n in gm.graph.nodes if is_collective(n)]


def test_merge_keeps_one_collective_of_one_value():
    from pt3func.passes.merge_collectives import merge_duplicate_collectives

    g = _Graph()
    # The same value gathered three times over group "0" (through fresh views, as DTensor makes them), once over
    # group "1", and another value once over "0".
    views = [g.op(torch.ops.aten.view.default, g.x, [4, 6], val=torch.empty(4, 6)) for _ in range(3)]
    same = [g.collective(_C10D.all_gather_into_tensor.default, v, 2, "0") for v in views]
    other_group = g.collective(_C10D.all_gather_into_tensor.default, views[0], 2, "1")
    y = g.op(torch.ops.aten.sin.default, g.x, val=torch.empty(4, 6))
    other_input = g.collective(_C10D.all_gather_into_tensor.default, y, 2, "0")
    gm = merge_duplicate_collectives(g.module(*same, other_group, other_input))
    assert _kinds(gm) == [("all_gather_into_tensor", "0"), ("all_gather_into_tensor", "1"),
                          ("all_gather_into_tensor", "0")]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outs[0] is outs[1] is outs[2] and len({outs[0], outs[3], outs[4]}) == 3


def test_merge_leaves_other_ops_args_phases_and_gradient_reductions():
    from pt3func.passes.merge_collectives import merge_duplicate_collectives

    g = _Graph()
    kept = [
        g.collective(_C10D.all_reduce.default, g.x, "sum", "0"),
        g.collective(_C10D.all_reduce.default, g.x, "avg", "0"),  # another reduce op
        g.collective(_C10D.reduce_scatter_tensor.default, g.x, "sum", 2, "0"),  # another collective
        g.collective(_C10D.all_reduce.default, g.x, "sum", "0", label="backward of value_and_grad(f)"),
        g.collective(_C10D.all_reduce.default, g.x, "sum", "0", label="grad of p['w']", pt3func_grad_of="p['w']"),
    ]
    gm = merge_duplicate_collectives(g.module(*kept))
    assert len(_kinds(gm)) == 5


def test_merge_all_reduces_of_a_value_and_its_transpose():
    # Behind a vocabulary-parallel head, a pending gradient was all-reduced as `t(g)` for the weight's gradient and
    # as `g` for the input's: one all-reduce of `g`, and the transpose taken of its result.
    from pt3func.passes.merge_collectives import merge_duplicate_collectives

    g = _Graph()
    t = g.op(torch.ops.aten.t.default, g.x, val=torch.empty(6, 4))
    of_t = g.collective(_C10D.all_reduce.default, t, "sum", "0")
    of_x = g.collective(_C10D.all_reduce.default, g.x, "sum", "0")
    gm = merge_duplicate_collectives(g.module(of_t, of_x))
    (reduce,) = [n for n in gm.graph.nodes if is_collective(n)]
    assert reduce.args[0].name == "x"
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outs[0].target is torch.ops.aten.t.default and outs[0].args[0] is outs[1]
    assert outs[0].meta["val"].shape == (6, 4)


def _sequence_parallel_case():
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(D, D, generator=g) * 0.3 for n in ("wq", "wk", "wv")}
    x = torch.randn(2, 8, D, generator=g)

    def loss(p, x, sharded=False):
        if sharded:  # a sequence-parallel residual stream
            x = pf.with_sharding_constraint(x, P(None, "tp", None))
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        q, k, v = (F.linear(h, p[n]) for n in ("wq", "wk", "wv"))  # column-parallel
        return (q * k * v).sum()

    return params, {n: P("tp", None) for n in params}, x, loss


def _signature(gm) -> list:
    return [(collective_kind(n), n.args[1:], tuple(n.meta["val"].shape)) for n in gm.graph.nodes if is_collective(n)]


@pytest.fixture
def no_merging(monkeypatch):
    def switch(off: bool):
        monkeypatch.setattr(pf.config, "disabled_passes", frozenset({"merge_duplicate_collectives"} if off else ()))
    return switch


@pytest.mark.skipif(TORCH_VERSION < (2, 12), reason="torch 2.11: no strided layouts")
def test_sequence_parallel_gathers_the_activation_once(tp2, no_merging):
    params, specs, x, loss = _sequence_parallel_case()
    step = pf.jit(pf.value_and_grad(loss), static_argnums=2, backend="eager")
    want = step(params, x, False)
    runs = {}
    for off in (True, False):
        no_merging(off)
        with pf.set_mesh(tp2):
            sharded = pf.device_put(params, specs)
            step = pf.jit(pf.value_and_grad(loss), static_argnums=2, backend="eager")
            runs[off] = pf.device_get(step(sharded, x, True)), step.lower(sharded, x, True)
    gathers = {off: [n for n in _collectives(lowered) if "all_gather" in collective_kind(n)]
               for off, (_, lowered) in runs.items()}
    # q, k and v each gathered the normed activations (forward and backward); now the forward gathers them once
    # and the backward once (again, as Megatron does, rather than keeping the forward's gathered copy alive).
    assert len(gathers[True]) == 6 and len(gathers[False]) == 2
    _assert_same(runs[False][0], want)
    for a, b in zip(pf.tree.leaves(runs[False][0]), pf.tree.leaves(runs[True][0]), strict=True):
        assert torch.equal(a, b)  # the same values, only fewer collectives
    # Every rank of the virtual mesh runs the same collectives, in the same order.
    per_rank = [_signature(lowered.graph_module) for lowered in runs[False][1]._ranks]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]


def test_vocab_parallel_head_gradient_is_reduced_once_per_block(tp2):
    # A LLaMA with vocabulary-parallel embedding and head: in the backward one all-reduce of the activations'
    # gradient per block (Megatron's), not one for each of the two products that read it.
    params, (tokens, targets) = _llama_params(), _tokens()
    with pf.set_mesh(tp2):
        specs = _llama_specs()
        lowered = pf.jit(_grad_step, in_shardings=(specs, P(), P()), backend="eager").lower(
            pf.device_put(params, specs), tokens, targets)
    backward = [n for n in _collectives(lowered) if str((n.meta.get("custom") or {}).get("pt3func", "")).startswith(
        "backward of") and n.meta["val"].numel() == B * T * D]
    assert [collective_kind(n) for n in backward] == ["all_reduce"] * (2 * LAYERS + 1)  # per block, the lookup's


def _merged_in_a_process_world(rank: int, world: int) -> dict:
    params, specs, x, loss = _sequence_parallel_case()
    mesh = pf.make_mesh((world,), ("tp",))
    with pf.set_mesh(mesh):
        sharded = pf.device_put(params, specs)
        step = pf.jit(pf.value_and_grad(loss), static_argnums=2, backend="eager")
        out = pf.device_get(step(sharded, x, True))
        signature = _signature(step.lower(sharded, x, True).graph_module)
    return {"signature": signature, "out": pf.tree.map(lambda t: t.clone(), out)}


@pytest.mark.skipif(TORCH_VERSION < (2, 12), reason="torch 2.11: no strided layouts")
@pytest.mark.slow
def test_merged_program_is_the_same_on_every_process():
    from dist import run_world

    params, _, x, loss = _sequence_parallel_case()
    want = pf.jit(pf.value_and_grad(loss), static_argnums=2, backend="eager")(params, x, False)
    ranks = run_world(2, _merged_in_a_process_world)
    assert ranks[0]["signature"] == ranks[1]["signature"]
    assert sum("all_gather" in kind for kind, *_ in ranks[0]["signature"]) == 2
    for r in ranks:
        _assert_same(r["out"], want)


def _gathers_around_a_write(x):
    h = x * 1
    v = h.view(8, 2)  # a view of h, taken before h is written
    a = torch.cumsum(v, 0)  # dim 0 split over tp: a gather of v
    h.add_(100)  # v sees this write
    b = torch.cumsum(v, 0)  # v gathered again: must see the +100
    return a, b


def test_collectives_of_a_value_written_between_them_are_not_merged():
    mesh = pf.make_mesh((2,), ("tp",), virtual=True)
    x = torch.arange(16.0).reshape(8, 2)
    want = _gathers_around_a_write(x.clone())
    with pf.set_mesh(mesh):
        got = pf.device_get(pf.jit(_gathers_around_a_write, backend="eager")(pf.device_put(x, P("tp"))))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

"""`keep_backward_in_backward`: composite backward ops read their forward inputs behind their own gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

import pt3func as pf
from pt3func.passes.backward_fence import keep_backward_in_backward
from pt3func.passes.remat import alias_root, is_backward

aten = torch.ops.aten


def _params() -> dict:
    torch.manual_seed(0)
    return {
        "w1": torch.randn(16, 32) * 0.2,
        "w2": torch.randn(32, 8) * 0.2,
        "ln": torch.ones(32),
    }


def _step(p: dict, x: torch.Tensor, y: torch.Tensor):
    def loss_fn(p, x, y):
        h = F.layer_norm(x @ p["w1"], (32,), p["ln"])
        h = F.gelu(h, approximate="tanh")
        return F.cross_entropy(h @ p["w2"], y)

    loss, g = pf.value_and_grad(loss_fn)(p, x, y)
    return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(6, 16), torch.randint(0, 8, (6,))


def _depends_on(node: fx.Node, target: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is target:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def test_forward_inputs_are_read_behind_the_gradient():
    gm = pf.jit(_step, backend="eager").lower(_params(), *_batch()).graph_module
    keep_backward_in_backward(gm)
    fenced = {aten.native_layer_norm_backward.default: 1, aten.gelu_backward.default: 1,
              aten._log_softmax_backward_data.default: 1}
    seen = set()
    for node in gm.graph.nodes:
        if node.target not in fenced:
            continue
        seen.add(node.target)
        gradient, value = node.args[0], node.args[fenced[node.target]]
        assert is_backward(alias_root(gradient))
        assert value.target is aten.where.ScalarSelf, node.format_node()
        assert _depends_on(value.args[0], gradient)  # the condition comes from this op's own gradient
    assert seen == set(fenced)
    # Small forward inputs (LayerNorm's mean and rstd, its weight) are read as they are.
    ln = next(n for n in gm.graph.nodes if n.target is aten.native_layer_norm_backward.default)
    assert all(a.target is not aten.where.ScalarSelf for a in ln.args[3:6] if isinstance(a, fx.Node))


def test_idempotent_on_a_program_without_composite_backward_ops():
    def step(w, x):
        loss, g = pf.value_and_grad(lambda w, x: (x @ w).square().sum())(w, x)
        return w - g, loss

    gm = pf.jit(step, backend="eager").lower(torch.randn(4, 3), torch.randn(2, 4)).graph_module
    before = gm.code
    keep_backward_in_backward(gm)
    assert gm.code == before


def test_same_numbers_as_without_the_pass_under_inductor():
    results = []
    for enabled in (True, False):
        pf.config.fence_backward_ops = enabled
        try:
            jitted = pf.jit(_step)
            params = _params()
            for _ in range(3):
                params, loss = jitted(params, *_batch())
            nodes = jitted.lower(params, *_batch()).graph_module.graph.nodes
            fences = sum(n.target is aten.where.ScalarSelf for n in nodes)
        finally:
            pf.config.fence_backward_ops = False
        results.append((params, loss, fences))
    (p1, l1, f1), (p2, l2, f2) = results
    assert f1 > 0 and f2 == 0
    assert torch.equal(l1, l2)
    for k in p1:
        assert torch.equal(p1[k], p2[k]), k


def test_only_the_named_ops_are_fenced():
    gm = pf.jit(_step, backend="eager").lower(_params(), *_batch()).graph_module
    keep_backward_in_backward(gm, [aten.native_layer_norm_backward.default])
    ops = {n.target: n for n in gm.graph.nodes}
    assert ops[aten.native_layer_norm_backward.default].args[1].target is aten.where.ScalarSelf
    assert ops[aten.gelu_backward.default].args[1].target is not aten.where.ScalarSelf


def test_config_names_select_the_ops_and_unknown_names_are_refused():
    import pytest

    pf.config.fence_backward_ops = frozenset({"native_layer_norm_backward"})
    try:
        jitted = pf.jit(_step)
        jitted(_params(), *_batch())
        nodes = list(jitted.lower(_params(), *_batch()).graph_module.graph.nodes)
        assert sum(n.target is aten.where.ScalarSelf for n in nodes) == 1  # LayerNorm's input only
        pf.config.fence_backward_ops = frozenset({"layer_norm_bwd"})
        with pytest.raises(ValueError, match="layer_norm_bwd"):
            pf.jit(_step).lower(_params(), *_batch())
    finally:
        pf.config.fence_backward_ops = False

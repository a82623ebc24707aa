"""`memory_budget`'s cost model: what recomputing a value costs, and which values alias one buffer."""

from __future__ import annotations

import argparse
import operator
import sys
from pathlib import Path

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import pt3func as pf
from pt3func.passes.remat import alias_root, is_view
from pt3func.passes.remat_budget import _FLOPS_PER_BYTE, recompute_cost

aten = torch.ops.aten


def _graph(build) -> dict[str, fx.Node]:
    """Nodes by name of a graph `build(graph, placeholder)` makes, with fake `val` metadata from running it."""
    graph = fx.Graph()
    mode = FakeTensorMode()
    nodes: dict[str, fx.Node] = {}

    def op(name, target, *args):
        node = graph.call_function(target, args)
        vals = fx.node.map_arg(args, lambda n: n.meta["val"])
        with mode:
            node.meta["val"] = target(*vals)
        nodes[name] = node
        return node

    def placeholder(name, *shape):
        node = graph.placeholder(name)
        with mode:
            node.meta["val"] = torch.empty(*shape)
        nodes[name] = node
        return node

    build(op, placeholder)
    return nodes


def test_a_matmul_costs_its_flops():
    nodes = _graph(lambda op, ph: op("mm", aten.mm.default, ph("a", 8, 1024), ph("b", 1024, 8)))
    assert recompute_cost(nodes["mm"]) == 2 * 8 * 1024 * 8  # more than its 256 output bytes' worth


def test_an_elementwise_op_costs_its_bytes():
    nodes = _graph(lambda op, ph: op("gelu", aten.gelu.default, ph("x", 64, 64)))
    assert recompute_cost(nodes["gelu"]) == _FLOPS_PER_BYTE * 64 * 64 * 4


def test_an_output_of_a_multi_output_op_costs_the_whole_op():
    def build(op, ph):
        x = ph("x", 16, 1024)
        out = op("ln", aten.native_layer_norm.default, x, [1024], None, None, 1e-5)
        op("mean", operator.getitem, out, 1)

    nodes = _graph(build)
    assert recompute_cost(nodes["mean"]) == recompute_cost(nodes["ln"]) > 0


def test_elements_of_a_view_op_and_unsafe_views_alias_their_input():
    def build(op, ph):
        qkv = ph("qkv", 3, 4, 8)
        parts = op("unbind", aten.unbind.int, qkv)
        op("q", operator.getitem, parts, 0)
        mm = op("mm", aten.mm.default, ph("a", 4, 8), ph("b", 8, 8))
        op("reshaped", aten._unsafe_view.default, mm, [2, 2, 8])

    nodes = _graph(build)
    assert is_view(nodes["q"]) and alias_root(nodes["q"]) is nodes["qkv"]
    assert is_view(nodes["reshaped"]) and alias_root(nodes["reshaped"]) is nodes["mm"]


def test_a_mild_budget_recomputes_cheap_values_not_matmuls_or_attention():
    """On a GPT step (d 512: a matmul costs more per byte than any elementwise op), `memory_budget=0.9` meets
    its budget by recomputing elementwise values; with getitems priced at 0 and the FLOP formulas never
    applied it used to drop q, k, v and LayerNorm outputs and recompute their matmuls and attention."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import lm_step

    a = argparse.Namespace(
        layers=2, d=512, heads=8, seq=128, batch=2, vocab=1024, precision="bf16", policy="none", remat_blocks=None
    )
    step, opt = lm_step.make_train_step(a, "cpu")
    params = lm_step.init_params(a, torch.device("cpu"))
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    lowered = pf.jit(step, memory_budget=0.9, backend="eager").lower(params, opt.init(params), idx, idx)
    recomputed = [
        n
        for n in lowered.graph_module.graph.nodes
        if str((n.meta.get("custom") or {}).get("pt3func", "")).startswith("remat of")
    ]
    assert recomputed, "a budget of 0.9 recomputes something"
    expensive = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    names = {str(n.target) for n in recomputed}
    assert not [n for n in recomputed if n.target in expensive or "attention" in str(n.target)], names

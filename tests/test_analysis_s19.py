"""Session 19: FLOPs of grouped convolutions and of programs without inputs, closure constants in
memory_analysis(), visualize_sharding of uneven and strided DTensors, explain_cache_misses messages, donation
pairing and pf.lax.pmean's name in as_text()."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION
from pt3func.analysis import flop_formula
from pt3func.sharding.visualize import _blocks

# FLOPs of grouped / depthwise convolutions: each output sees in_channels / groups input channels, in the forward and
# in both gradients (torch's formula counts the weight gradient over every input channel: `groups` times over).

def _conv_cases():
    n, c, h, w, k = 2, 8, 6, 6, 3
    depthwise = (lambda w, x: F.conv2d(x, w, padding=k // 2, groups=c), torch.randn(c, 1, k, k),
                 torch.randn(n, c, h, w), 2 * n * c * h * w * k * k)
    length, cin, cout, groups, k1 = 10, 8, 12, 4, 3
    # conv1d(8 -> 12, groups=4): 12 outputs, each a sum over 8 / 4 = 2 input channels x 3 taps, per position
    grouped = (lambda w, x: F.conv1d(x, w, groups=groups), torch.randn(cout, cin // groups, k1),
               torch.randn(n, cin, length), 2 * n * cout * (length - k1 + 1) * (cin // groups) * k1)
    transposed = (lambda w, x: F.conv_transpose1d(x, w, groups=groups), torch.randn(cin, cout // groups, k1),
                  torch.randn(n, cin, length), 2 * n * cin * length * (cout // groups) * k1)
    return {"depthwise2d": depthwise, "conv1d_groups4": grouped, "conv_transpose1d_groups4": transposed}


@pytest.mark.parametrize("name", list(_conv_cases()))
def test_grouped_conv_flops_forward_and_backward(name):
    conv, w, x, forward = _conv_cases()[name]
    assert pf.jit(conv, backend="eager").lower(w, x).cost_analysis()["flops"] == forward
    both = pf.jit(pf.grad(lambda w, x: conv(w, x).sum(), argnums=(0, 1)), backend="eager")
    assert both.lower(w, x).cost_analysis()["flops"] == 3 * forward  # forward, input gradient, weight gradient
    only_w = pf.jit(pf.grad(lambda w, x: conv(w, x).sum()), backend="eager")
    assert only_w.lower(w, x).cost_analysis()["flops"] == 2 * forward


def test_the_memory_budget_planner_reads_the_same_conv_formula():
    # passes/remat_budget.py calls flop_formula(node.target) on the node's values: ours, not torch's registry's.
    conv, w, x, forward = _conv_cases()["depthwise2d"]
    gm = pf.jit(pf.grad(lambda w, x: conv(w, x).sum(), argnums=(0, 1)), backend="eager").lower(w, x).graph_module
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    assert flop_formula(node.target)(*args, **kwargs, out_val=node.meta["val"]) == 2 * forward


def test_flops_of_a_program_without_inputs():
    weight = torch.randn(64, 64)

    def f(n):  # static n: no tensor input, the weight a closure constant
        return (torch.ones(n, 64) @ weight).sum()

    assert pf.jit(f, static_argnums=0, backend="eager").lower(32).cost_analysis()["flops"] == 2 * 32 * 64 * 64


# Closure-captured weights (the program's constants) are neither temporaries nor left out: `constant_bytes`, resident
# for the whole call, part of the peak, in the traced and the compiled program's figures alike.

def test_closure_constants_are_counted_as_resident_in_both_memory_analyses():
    model = nn.Linear(256, 256)
    constants = sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(2, 256)
    lowered = pf.jit(lambda x: model(x)).lower(x)
    before = lowered.memory_analysis()
    assert before["constant_bytes"] == constants
    assert before["temp_bytes"] == 0
    assert before["peak_bytes"] == before["argument_bytes"] + constants + before["output_bytes"]
    after = lowered.compile().memory_analysis()
    assert after["constant_bytes"] == constants
    assert after["peak_bytes"] >= after["argument_bytes"] + constants + after["output_bytes"]
    assert after["temp_bytes"] < constants


def test_a_returned_constant_is_no_new_output_memory():
    weight = torch.randn(64, 64)
    memory = pf.jit(lambda x: (x + 1, weight), backend="eager").lower(torch.randn(4)).memory_analysis()
    assert memory["constant_bytes"] == 64 * 64 * 4
    assert memory["output_bytes"] == 4 * 4


# visualize_sharding: blocks as DTensor places them (uneven splits, _StridedShard).

@pytest.fixture
def fake_world_of_2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield pf.make_mesh((2,), ("dp",))
    dist.destroy_process_group()


def test_visualize_draws_uneven_blocks_as_dtensor_splits_them(fake_world_of_2):
    from torch.distributed.tensor import Shard, distribute_tensor

    d = distribute_tensor(torch.arange(15.0).reshape(5, 3), fake_world_of_2.device_mesh, [Shard(0)])
    assert tuple(d.to_local().shape) == (3, 3)  # torch.chunk: 3 rows then 2
    assert _blocks(d) == {(((0, 3),), ((0, 3),)): [0], (((3, 5),), ((0, 3),)): [1]}
    text = pf.visualize_sharding(d)
    assert "[0:3, 0:3]" in text and "[3:5, 0:3]" in text and "[0:2" not in text


def _indices(runs):
    return torch.cat([torch.arange(start, stop) for start, stop in runs])


@pytest.mark.skipif(TORCH_VERSION < (2, 12), reason="torch 2.11: no strided layouts")
def test_visualize_draws_a_strided_shard_truthfully_and_sharding_of_says_why_not():
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    x = pf.device_put(torch.arange(32.0).reshape(8, 4), pf.NamedSharding(mesh, P("dp", "tp")))
    y = x.reshape(32)  # eager reshape of a 2-D split: dp rows contiguous, tp columns strided
    assert "_StridedShard" in str(y.locals[0].placements)
    full = pf.device_get(y)
    for rank, local in enumerate(y.locals):
        held = [block for block, ranks in _blocks(local).items() if rank in ranks]
        assert len(held) == 1
        assert torch.equal(full[_indices(held[0][0])], local.to_local()), (rank, held)
    text = pf.visualize_sharding(y, width=200)
    assert "_StridedShard" in text and "strided" in text
    assert "{0:2, 4:6, 8:10, 12:14}" in text and "{18:20, 22:24, 26:28, 30:32}" in text
    with pytest.raises(pf.ShardingError, match=r"_S\(0, 4\)|_StridedShard"):
        pf.sharding_of(y)


@pytest.mark.skipif(TORCH_VERSION < (2, 12), reason="torch 2.11: no strided layouts")
def test_visualize_names_strided_blocks_it_cannot_locate(monkeypatch):
    # A torch whose private split is missing (or disagrees with its own offsets): each rank's block by size and
    # index, never a made-up range, and no crash.
    from pt3func.sharding import visualize

    monkeypatch.setattr(visualize, "_split_runs", lambda *args: None)
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    y = pf.device_put(torch.arange(32.0).reshape(8, 4), pf.NamedSharding(mesh, P("dp", "tp"))).reshape(32)
    text = pf.visualize_sharding(y, width=200)
    for block in range(4):
        assert f"[strided: 8 elements, block {block}]" in text
    assert "0:8" not in text


# explain_cache_misses: which argument, which path, which module.

def _step(params, batch, num_layers, act):
    h = batch
    for i in range(num_layers):
        h = act(h @ params[f"w{i}"])
    return h.sum()


def test_explain_names_static_arguments_instances_and_paths(explain_misses, caplog):
    j = pf.jit(_step, static_argnums=(2, 3), backend="eager")
    params = {f"w{i}": torch.randn(8, 8) for i in range(4)}
    x, relu = torch.randn(4, 8), nn.ReLU()
    j(params, x, 2, relu)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        caplog.clear()
        j(params, x, 3, relu)
        assert "static argument num_layers changed: 2 -> 3" in caplog.text
        assert "act" not in caplog.text  # unchanged: not printed
        caplog.clear()
        j(params, x, 3, nn.ReLU())
        assert re.search(r"static argument act changed: another instance of ReLU \(equal repr ReLU\(\)\)",
                         caplog.text), caplog.text
        assert "num_layers" not in caplog.text
        caplog.clear()
        j({**params, "w_extra": torch.randn(8, 8)}, x, 3, relu)
        assert "params['w_extra'] added" in caplog.text and "PyTreeSpec" not in caplog.text
        caplog.clear()
        j({"w0": params["w0"], "w1": params["w1"], "w2": params["w2"]}, x, 3, relu)
        assert "params['w3'] removed" in caplog.text and "params['w_extra'] removed" in caplog.text
        caplog.clear()
        j({"w0": params["w0"], "w1": params["w1"], "w2": (params["w2"],)}, x, 2, relu)  # (w2 unused)
        assert "params['w2']: a leaf -> a tuple of 1" in caplog.text


def test_explain_reports_a_jitted_methods_mode_change(explain_misses, caplog):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @pf.jit(backend="eager")
        def forward(self, x):
            return F.dropout(self.lin(x), 0.1, self.training)

    net, x = Net(), torch.randn(2, 4)
    net(x)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        net.eval()
        net(x)
    assert re.search(r"the train / eval mode of module self \(Net at 0x[0-9a-f]+\) changed: train -> eval",
                     caplog.text), caplog.text
    assert "a leaf's signature changed" not in caplog.text


def test_varargs_leaves_are_labelled_by_their_parameter(explain_misses, caplog):
    @pf.jit(backend="eager")
    def f(x, *rest):
        return x + sum(rest)

    x = torch.randn(3)
    f(x, x, x)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        f(x, x, x.double())
    assert "rest[1]: float32[3] on cpu -> float64[3] on cpu" in caplog.text, caplog.text
    assert "args[2]" not in caplog.text


# Donation pairing: the outputs donated inputs naturally become are paired first, fallbacks after.

def test_donation_pairs_same_path_outputs_before_fallbacks():
    def step(state):
        return {"b": state["b"].double(), "c": state["c"]}  # b's output no longer fits b; c is returned unchanged

    state = {"b": torch.randn(4), "c": torch.randn(4)}
    lowered = pf.jit(step, donate_argnums=0, backend="eager").lower(state)
    rows = {row["input"]: row for row in lowered.donation_report()}
    assert rows["state['c']"]["aliased"] and rows["state['c']"]["output"] == "out['c']"
    assert not rows["state['b']"]["aliased"] and "no output left" in rows["state['b']"]["reason"]
    assert not [line for line in lowered.as_text().splitlines() if "copy_" in line]


def test_plan_donation_takes_fallbacks_only_after_preferred_pairs():
    from pt3func.passes.donation import LeafMeta, plan_donation

    cpu = torch.device("cpu")
    meta = [LeafMeta(f"in{i}", (4,), torch.float32, cpu) for i in range(2)]
    outs = [LeafMeta("out0", (4,), torch.float64, cpu), LeafMeta("out1", (4,), torch.float32, cpu)]
    plan = plan_donation(meta, outs, [0, 1], preferred={0: 0, 1: 1})
    assert plan.aliases == {1: 1} and 0 in plan.unused


# pf.lax.pmean under its own name in as_text().

def test_pmean_is_named_pmean_in_as_text():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    sm = pf.shard_map(lambda a: pf.lax.pmean(a, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    with pf.set_mesh(mesh):
        text = pf.jit(sm, backend="eager").lower(pf.device_put(torch.ones(4), P())).as_text()
    assert re.search(r"COLLECTIVE all_reduce over 'dp'.*: pf\.lax\.pmean", text), text
    assert "pf.lax.psum" not in text

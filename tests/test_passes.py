"""Graph -> Graph passes, each tested alone on a small traced graph."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pt3func.passes.donation import LeafMeta, apply_donation, plan_donation
from pt3func.passes.overlap import sink_waits


def _meta(shape, path="x"):
    return LeafMeta(path, shape, torch.float32, torch.device("cpu"))


def test_sink_waits_moves_each_wait_to_its_first_user():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    busy = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))  # compute that can overlap the collective
    busy2 = graph.call_function(torch.ops.aten.sin.default, (busy,))
    use = graph.call_function(torch.ops.aten.add.Tensor, (waited, busy2))
    graph.output((use,))
    gm = sink_waits(torch.fx.GraphModule(torch.nn.Module(), graph))
    order = [n.target for n in gm.graph.nodes]
    wait = order.index(torch.ops._c10d_functional.wait_tensor.default)
    assert order[wait + 1] is torch.ops.aten.add.Tensor
    assert order.index(torch.ops._c10d_functional.all_reduce.default) < order.index(torch.ops.aten.mul.Tensor) < wait


def test_donation_pass_writes_outputs_into_inputs():
    def step(w, g):
        return w - 0.1 * g, (g * g).sum()

    w, g = torch.randn(3, 2), torch.randn(3, 2)
    gm = make_fx(step)(w, g)
    plan = plan_donation([_meta((3, 2), "w"), _meta((3, 2), "g")],
                         [_meta((3, 2), "new_w"), LeafMeta("loss", (), torch.float32, torch.device("cpu"))], [0])
    assert plan.aliases == {0: 0}
    gm = apply_donation(gm, plan)
    expected = w - 0.1 * g
    ptr = w.data_ptr()
    (loss,) = gm(w, g)
    torch.testing.assert_close(w, expected)  # written in place
    assert w.data_ptr() == ptr and loss.shape == ()


def test_donation_pass_refuses_when_an_output_views_the_input():
    def step(w):
        return w + 1, w.t()

    gm = make_fx(step)(torch.randn(2, 2))
    plan = plan_donation([_meta((2, 2), "w")], [_meta((2, 2), "a"), _meta((2, 2), "b")], [0])
    apply_donation(gm, plan)
    assert plan.aliases == {} and "reads this input's memory" in plan.unused[0]


def test_plan_prefers_the_output_at_the_same_path():
    inputs = [_meta((4,), "params['a']"), _meta((4,), "params['b']")]
    outputs = [_meta((4,), "out[0]['a']"), _meta((4,), "out[0]['b']")]
    plan = plan_donation(inputs, outputs, [0, 1], preferred={0: 1, 1: 0})
    assert plan.aliases == {1: 0, 0: 1}

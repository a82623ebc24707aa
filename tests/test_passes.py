"""Graph -> Graph passes, each tested alone on a small traced graph."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func.passes.donation import LeafMeta, apply_donation, plan_donation
from pt3func.passes.overlap import issue_collectives_early, order_by_readiness, sink_waits


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


_AR = torch.ops._c10d_functional.all_reduce.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_ops = torch.ops.aten


def test_issue_collectives_early_moves_each_collective_up_to_its_last_input():
    # As FSDP traces: both gradients are ready mid-backward but their reductions were recorded at the end.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    g1 = graph.call_function(_ops.sin.default, (x,))
    busy = graph.call_function(_ops.mul.Tensor, (g1, g1))
    g2 = graph.call_function(_ops.cos.default, (busy,))
    busy2 = graph.call_function(_ops.exp.default, (g2,))
    r2 = graph.call_function(_AR, (g2, "sum", "0"))
    r1 = graph.call_function(_AR, (g1, "sum", "0"))
    w1 = graph.call_function(_WAIT, (r1,))
    w2 = graph.call_function(_WAIT, (r2,))
    graph.output((w1, w2, busy2))
    gm = issue_collectives_early(torch.fx.GraphModule(torch.nn.Module(), graph))
    order = list(gm.graph.nodes)
    assert order[order.index(g1) + 1] is r1 and order[order.index(g2) + 1] is r2
    assert order.index(r1) < order.index(busy) < order.index(r2) < order.index(busy2)
    assert order[-1].op == "output" and len(order) == 10
    gm.graph.lint()


def test_order_by_readiness_runs_updates_in_the_order_their_collectives_were_issued():
    graph = torch.fx.Graph()
    p1, p2, g1, g2 = (graph.placeholder(n) for n in ("p1", "p2", "g1", "g2"))
    r1 = graph.call_function(_AR, (g1, "sum", "0"))  # issued first: its update should run first
    r2 = graph.call_function(_AR, (g2, "sum", "0"))
    w2 = graph.call_function(_WAIT, (r2,))
    w1 = graph.call_function(_WAIT, (r1,))
    lr = graph.call_function(_ops.mul.Tensor, (p2, 0.1))  # depends on no collective: stays with its user
    u2 = graph.call_function(_ops.sub.Tensor, (p2, w2))
    u2b = graph.call_function(_ops.add.Tensor, (u2, lr))
    u1 = graph.call_function(_ops.sub.Tensor, (p1, w1))
    c2 = graph.call_function(_ops.copy_.default, (p2, u2b))  # donation's in-place write comes after reads
    c1 = graph.call_function(_ops.copy_.default, (p1, u1))
    graph.output((c1, c2))
    gm = order_by_readiness(torch.fx.GraphModule(torch.nn.Module(), graph))
    order = list(gm.graph.nodes)
    assert order.index(w1) < order.index(u1) < order.index(w2) < order.index(u2)
    assert order.index(u1) < order.index(c1) < order.index(u2)
    assert order.index(lr) < order.index(u2b) < order.index(c2)
    gm.graph.lint()


def test_order_by_readiness_keeps_in_place_writes_after_every_read():
    graph = torch.fx.Graph()
    p, g, q = (graph.placeholder(n) for n in ("p", "g", "q"))
    r = graph.call_function(_AR, (g, "sum", "0"))
    rq = graph.call_function(_AR, (q, "sum", "0"))
    w = graph.call_function(_WAIT, (r,))
    wq = graph.call_function(_WAIT, (rq,))
    new_p = graph.call_function(_ops.sub.Tensor, (p, w))
    late_read = graph.call_function(_ops.mul.Tensor, (p, wq))  # reads the old p, waits on the later collective
    write = graph.call_function(_ops.copy_.default, (p, new_p))
    graph.output((write, late_read))
    gm = order_by_readiness(torch.fx.GraphModule(torch.nn.Module(), graph))
    order = list(gm.graph.nodes)
    assert order.index(late_read) < order.index(write)


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


def _grad_reduction(graph, x, label):
    from pt3func.spmd.lower import GRAD_OF

    reduced = graph.call_function(_AR, (x, "sum", "0"))
    reduced.meta["custom"] = {"pt3func": f"grad of {label}", GRAD_OF: label}
    return reduced, graph.call_function(_WAIT, (reduced,))


def _with_vals(graph, shapes):
    """Fake values on every node (the pass reads shapes and dtypes from them, as in a traced program)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        env = {}
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = torch.empty(shapes[node.name])
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                env[node] = node.target(*args)
            else:
                continue
            node.meta["val"] = env[node]


def test_bucketing_packs_consecutive_gradient_all_reduces():
    from pt3func.passes.bucketing import bucket_gradient_all_reduces

    graph = torch.fx.Graph()
    a, b, c = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("c")
    ga = graph.call_function(_ops.mul.Tensor, (a, a))
    _, wa = _grad_reduction(graph, ga, "params['a']")
    gb = graph.call_function(_ops.sin.default, (b,))
    _, wb = _grad_reduction(graph, gb, "params['b']")
    early = graph.call_function(_ops.neg.default, (wb,))  # reads b's result before c's reduction: bucket closes
    gc = graph.call_function(_ops.cos.default, (c,))
    _, wc = _grad_reduction(graph, gc, "params['c']")
    graph.output((wa, early, wc))
    _with_vals(graph, {"a": (4, 3), "b": (5,), "c": (2, 2)})
    # Values are checked where collectives run: the 2-rank Inductor tests of test_spmd_jit.py (bucketed
    # programs against one device); here, the program's structure.
    gm = bucket_gradient_all_reduces(torch.fx.GraphModule(torch.nn.Module(), graph), bucket_bytes=1 << 20)
    reductions = [n for n in gm.graph.nodes if n.target is _AR]
    assert len(reductions) == 2  # a and b in one bucket; c alone (b's result is read before c's reduction)
    bucket = reductions[0]
    assert bucket.meta["custom"]["pt3func_bucket"] == ["params['a']", "params['b']"]
    assert bucket.args[0].target is _ops.cat.default
    assert bucket.args[0].meta["val"].shape == (17,)
    assert reductions[1].meta["custom"]["pt3func"] == "grad of params['c']"
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(4, 3), (5,), (2, 2)]


def test_bucketing_closes_a_bucket_at_its_size():
    from pt3func.passes.bucketing import bucket_gradient_all_reduces

    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(4)]
    grads = [graph.call_function(_ops.neg.default, (x,)) for x in xs]
    waits = [_grad_reduction(graph, g, f"p[{i}]")[1] for i, g in enumerate(grads)]
    graph.output(tuple(waits))
    _with_vals(graph, {f"x{i}": (256,) for i in range(4)})  # 1 KiB each
    gm = bucket_gradient_all_reduces(torch.fx.GraphModule(torch.nn.Module(), graph), bucket_bytes=2048)
    buckets = [n.meta["custom"]["pt3func_bucket"] for n in gm.graph.nodes if n.target is _AR]
    assert buckets == [["p[0]", "p[1]"], ["p[2]", "p[3]"]]


def _add_scaled_product(p, a, b):
    return torch.add(p, a @ b, alpha=-0.1), p.clone().sub_(a @ b, alpha=0.5)


def test_adds_of_scaled_products_keep_their_alpha_under_inductor():
    """Inductor (2.13, CPU) folds `add(p, a @ b, alpha)` into addmm and dropped alpha (`passes/scaled_add.py`)."""
    from pt3func.passes.scaled_add import scale_products_before_adding

    p, a, b = torch.randn(3, 2), torch.randn(3, 4), torch.randn(4, 2)
    for got, want in zip(pf.jit(_add_scaled_product)(p, a, b), _add_scaled_product(p, a, b)):
        torch.testing.assert_close(got, want)
    gm = scale_products_before_adding(make_fx(_add_scaled_product)(p, a, b))
    adds = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub_.Tensor)]
    assert len(adds) == 2 and all("alpha" not in n.kwargs for n in adds)

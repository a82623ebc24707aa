"""Common modules in a data-parallel step (params replicated, batch split), equal to one device: ops DTensor has no
rule for (`_trilinear` of nn.Bilinear, `adaptive_max_pool2d_backward`, `tril_` of the orthogonal parametrization,
`_embedding_bag` with offsets), and a clear refusal where such an op cannot run."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrizations

import pt3func as pf
from pt3func import P

B = 4


def _case(name: str):
    torch.manual_seed(0)
    split = True
    if name == "bilinear":
        net = torch.nn.Bilinear(3, 3, 2)
        x = torch.randn(B, 3)
        params, apply = pf.functionalize(net)
        fwd = lambda p, x: apply(p, x, x * 2)  # noqa: E731
    elif name == "adaptive_max_pool":
        net = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1), torch.nn.AdaptiveMaxPool2d(2))
        x = torch.randn(B, 2, 5, 5)
        params, apply = pf.functionalize(net)
        fwd = apply
    elif name == "orthogonal":
        net = parametrizations.orthogonal(torch.nn.Linear(3, 2))
        x = torch.randn(B, 3)
        params, apply = pf.functionalize(net)
        fwd = apply
    else:  # embedding bags over 1-D indices with offsets: every operand replicated
        net = torch.nn.EmbeddingBag(10, 3)
        x = torch.randint(0, 10, (8,))
        offsets = torch.tensor([0, 3, 5, 6])
        params, apply = pf.functionalize(net)
        fwd = lambda p, x: apply(p, x, offsets)  # noqa: E731
        split = False
    return params, fwd, x, split


def _train_step(fwd):
    opt = pf.optim.sgd(0.1)

    def step(params, opt_state, x):
        loss, grads = pf.value_and_grad(lambda p: fwd(p, x).square().mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, grads, pf.optim.apply_updates(params, updates)

    return opt, step


@pytest.mark.parametrize("name", ["bilinear", "adaptive_max_pool", "orthogonal", "bag_offsets"])
def test_data_parallel_step_equals_one_device(name):
    params, fwd, x, split = _case(name)
    opt, step = _train_step(fwd)
    jitted = pf.jit(step, backend="eager")
    want = jitted(params, opt.init(params), x)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        sharded = pf.device_put(params, P())
        got = pf.device_get(jitted(sharded, opt.init(sharded), pf.device_put(x, P("dp") if split else P())))
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bilinear_data_parallel_under_inductor():
    params, fwd, x, _ = _case("bilinear")
    step = pf.jit(pf.value_and_grad(lambda p, x: fwd(p, x).square().mean()), backend="inductor")
    want = step(params, x)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        got = pf.device_get(step(pf.device_put(params, P()), pf.device_put(x, P("dp"))))
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_in_place_rule_less_op_on_a_pending_sum_is_reduced_first():
    # x.T @ x over a split batch is a pending sum; tril_ (no DTensor rule) runs on its reduced value, and a view
    # of it taken before reads the result.
    def f(x):
        m = x.T @ x
        v = m.view(9)
        m.tril_()
        return v * 2, m

    x = torch.randn(B, 3)
    want = pf.jit(f, backend="eager")(x)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        got = pf.device_get(pf.jit(f, backend="eager")(pf.device_put(x, P("dp"))))
    torch.testing.assert_close(got, want)
    assert torch.count_nonzero(want[1].triu(1)) == 0


def test_rule_less_op_on_a_split_operand_names_op_placements_and_line():
    def f(x):
        return (x * 2).tril_()  # tril_ of a batch-split value: DTensor has no rule

    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        with pytest.raises(pf.ShardingError, match=r"aten\.tril_\.default at .*test_sharded_modules_s18\.py:\d+.*"
                                                   r"Shard\(dim=0\)"):
            pf.jit(f, backend="eager")(pf.device_put(torch.randn(B, 3), P("dp")))


def test_in_place_rule_less_op_on_an_integer_pending_sum() -> None:
    # The written pending sum holds the result on the ranks at coordinate 0 and zeros elsewhere: DTensor's own
    # split (value / n on every rank) truncated integers (odd values lost 1).
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    a, w = torch.arange(16).reshape(4, 4) % 3, torch.ones(4, 4, dtype=torch.int64)

    def f(a, w):
        y = a @ w  # a pending sum over tp: a's columns and w's rows are split
        y.tril_()  # no DTensor rule
        return y

    got = pf.jit(f, backend="eager")(
        pf.device_put(a, pf.NamedSharding(mesh, P(None, "tp"))), pf.device_put(w, pf.NamedSharding(mesh, P("tp")))
    )
    assert torch.equal(pf.device_get(got), f(a, w))

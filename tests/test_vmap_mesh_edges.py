"""`pf.vmap` edges found by running users' code (session 13), each against the single-device run of the same code:
a sharded step's vmapped function reading parameters from its closure, mapped arguments in different layouts,
`pf.lax` collectives under `pf.vmap` in `shard_map`, argument checks (`in_axes`, `axis_size`, Python numbers), a
1-element loss under `pf.vmap(pf.grad)`, and `pf.grad` / `pf.vmap` of virtual arrays outside `pf.jit`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P

lax = pf.lax


@pytest.fixture(scope="module")
def dp_mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


@pytest.fixture(scope="module")
def dp_tp_mesh():
    return pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)


def _data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, generator=g)
    return w, torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _example_loss(w, x, y):
    return F.cross_entropy((x @ w)[None], y[None])


def _assert_trees_close(got, want):
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _on_mesh(mesh, fn, args, specs):
    with pf.set_mesh(mesh):
        return pf.device_get(pf.jit(fn)(*[pf.device_put(a, s) for a, s in zip(args, specs)]))


# A sharded step's vmapped function reading a replicated (or split) parameter from its closure. It met the local
# examples as a DTensor under torch.func.vmap and failed in DTensor's rules ("Dimension out of range" for
# `(x @ w.T).sum()` and `F.linear`, "permute(sparse_coo)" with an out_axes pytree).

def closure_sum(w, x, y):
    return pf.vmap(lambda xx: (xx @ w).sum())(x)


def closure_linear(w, x, y):
    return pf.vmap(lambda xx: F.linear(xx, w.T).sum())(x)


def closure_out_axes_tree(w, x, y):
    return pf.vmap(lambda xx: {"a": xx @ w, "b": (xx.sum(), xx[:2])}, out_axes={"a": 1, "b": (0, -1)})(x)


def closure_grad_through_vmap(w, x, y):
    return pf.grad(lambda w: pf.vmap(lambda xx, yy: _example_loss(w, xx, yy))(x, y).mean())(w)


def closure_per_example_grads(w, x, y):
    return pf.vmap(lambda xx, yy: pf.grad(_example_loss)(w, xx, yy))(x, y)


def closure_nested_vmap(w, x, y):
    return pf.vmap(lambda xx: pf.vmap(lambda col: (xx @ col).tanh(), in_axes=1)(w))(x)


def closure_over_a_plain_batch(w, x, y):
    return pf.vmap(lambda i: (x[i] @ w).sum())(torch.arange(8))  # mapped: a tensor made in the step


CLOSURES = [closure_sum, closure_linear, closure_out_axes_tree, closure_grad_through_vmap, closure_per_example_grads,
            closure_nested_vmap, closure_over_a_plain_batch]


@pytest.mark.parametrize("fn", CLOSURES)
def test_closure_over_a_replicated_parameter_equals_one_device(dp_mesh, fn):
    w, x, y = _data()
    _assert_trees_close(_on_mesh(dp_mesh, fn, (w, x, y), (P(), P("dp"), P("dp"))), fn(w, x, y))


@pytest.mark.parametrize("fn", [closure_sum, closure_grad_through_vmap, closure_per_example_grads])
@pytest.mark.parametrize("w_spec", [P(), P("tp"), P(None, "dp")])
def test_closure_on_dp_tp_mesh_equals_one_device(dp_tp_mesh, fn, w_spec):
    """A parameter split over tp (or dp) is read whole (gathered); its gradient comes back in its own layout."""
    w, x, y = _data()
    w = torch.cat([w, w[:, :1]], dim=1)  # 4 columns: P(None, "dp") splits them
    _assert_trees_close(_on_mesh(dp_tp_mesh, fn, (w, x, y % 3), (w_spec, P("dp"), P("dp"))), fn(w, x, y % 3))


# Mapped arguments in different layouts: inputs split over dp beside labels every rank holds whole.

def per_example_loss(w, x, y):
    return pf.vmap(_example_loss, in_axes=(None, 0, 0))(w, x, y)


def per_example_grads(w, x, y):
    return pf.vmap(pf.grad(_example_loss), in_axes=(None, 0, 0))(w, x, y)


def grad_of_mean_per_example_loss(w, x, y):
    return pf.grad(lambda w: per_example_loss(w, x, y).mean())(w)


@pytest.mark.parametrize("fn", [per_example_loss, per_example_grads, grad_of_mean_per_example_loss])
@pytest.mark.parametrize(("shape", "axes", "x_spec"), [((2,), ("dp",), P("dp")), ((2, 2), ("dp", "tp"), P("dp")),
                                                       ((2, 2), ("dp", "tp"), P(("dp", "tp")))])
def test_mapped_arguments_in_different_layouts_equal_one_device(fn, shape, axes, x_spec):
    w, x, y = _data()
    mesh = pf.make_mesh(shape, axes, virtual=True)
    _assert_trees_close(_on_mesh(mesh, fn, (w, x, y), (P(), x_spec, P())), fn(w, x, y))


@pytest.mark.parametrize("fn", [per_example_loss, per_example_grads, grad_of_mean_per_example_loss])
@pytest.mark.parametrize(("x_spec", "y_spec"), [(P("dp", "tp"), P()), (P(None, "dp"), P()), (P(None, "dp"), P("dp")),
                                                (P("tp", "dp"), P("dp"))])
def test_mapped_argument_split_along_its_features_equals_one_device(dp_tp_mesh, fn, x_spec, y_spec):
    """Split along a dim that is not the examples' (gathered; resplit along the examples where others are split
    so): DTensor's rules under torch.func.vmap failed on `(x @ w).sum()`."""
    w, x, y = _data()
    _assert_trees_close(_on_mesh(dp_tp_mesh, fn, (w, x, y), (P(), x_spec, y_spec)), fn(w, x, y))


def test_examples_on_dim_1_split_along_dim_0_equal_one_device(dp_mesh):
    w, x, _ = _data()

    def fn(w, z):
        return pf.grad(lambda w: pf.vmap(lambda col: (col @ w).tanh().sum(), in_axes=1)(z).sum())(w)

    _assert_trees_close(_on_mesh(dp_mesh, fn, (w, x.T.contiguous()), (P(), P("dp"))), fn(w, x.T.contiguous()))


def test_gradient_of_a_replicated_mapped_argument_equals_one_device(dp_mesh):
    w, x, _ = _data()
    t = torch.randn(8)

    def fn(w, x, t):  # t is mapped and replicated: its gradient is gathered back from the ranks' examples
        return pf.grad(lambda t: pf.vmap(lambda xx, tt: ((xx @ w).sum() * tt).tanh())(x, t).sum())(t)

    _assert_trees_close(_on_mesh(dp_mesh, fn, (w, x, t), (P(), P("dp"), P())), fn(w, x, t))


# pf.lax collectives under pf.vmap inside shard_map (torch: "You tried to vmap over _Psum, but it does not have
# vmap support").

def _lax_cases():
    return {
        "psum": (lambda x: pf.vmap(lambda r: lax.psum(r, "dp"))(x), P(), lambda x: x.view(4, 2, 3).sum(1)),
        "pmean, in_axes=1": (lambda x: pf.vmap(lambda c: lax.pmean(c, "dp"), in_axes=1)(x), P(),
                             lambda x: x.view(4, 2, 3).mean(1).T),
        "all_gather": (lambda x: pf.vmap(lambda r: lax.all_gather(r, "dp"))(x), P(), lambda x: x),
        "all_gather, not tiled, out_axes=1": (
            lambda x: pf.vmap(lambda r: lax.all_gather(r, "dp", tiled=False), out_axes=1)(x), P(),
            lambda x: x.view(4, 2, 3).transpose(0, 1)),
        "psum_scatter": (lambda x: pf.vmap(lambda r: lax.psum_scatter(r, "dp"))(x.repeat(1, 2)), P(None, "dp"),
                         lambda x: x.view(4, 2, 3).sum(1).repeat(1, 2)),
        # Row j of each rank's (2, 3) block, scaled by j + 1, goes to rank j: rank j gets (j + 1) * its whole row.
        "all_to_all": (lambda x: pf.vmap(lambda r: lax.all_to_all(r * torch.tensor([[1.0], [2.0]]), "dp", 0, 1))(x),
                       P(None, None, "dp"), lambda x: torch.cat([x, 2 * x], dim=1)[:, None]),
        "ppermute": (lambda x: pf.vmap(lambda r: lax.ppermute(r, "dp", [(0, 1), (1, 0)]))(x), P(None, "dp"),
                     lambda x: x.view(4, 2, 3).flip(1).reshape(4, 6)),
        "grad of psum": (lambda x: pf.vmap(pf.grad(lambda r: lax.psum((r * r).sum(), "dp")))(x), P(None, "dp"),
                         lambda x: 4 * x),
        "grad of all_gather": (
            lambda x: pf.vmap(pf.grad(lambda r: (lax.all_gather(r, "dp") * torch.arange(6.0)).sum()))(x),
            P(None, "dp"), lambda x: 2 * torch.arange(6.0).expand(4, 6)),
    }


@pytest.mark.parametrize("name", list(_lax_cases()))
def test_lax_collectives_under_vmap_in_shard_map(dp_mesh, name):
    body, out_spec, reference = _lax_cases()[name]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with pf.set_mesh(dp_mesh):
        step = pf.jit(pf.shard_map(body, mesh=dp_mesh, in_specs=(P(None, "dp"),), out_specs=out_spec))
        out = pf.device_get(step(x))
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)


def test_gradient_of_a_gradient_goes_through_the_backward_collective(dp_mesh):
    """The collectives' backward now applies the transposed collective as a differentiable op (which their vmap
    rules need): before, it ran under no_grad, and a second derivative through it was silently zero."""

    def body(r):
        inner = pf.grad(lambda r: (lax.psum(r, "dp") ** 2).sum())  # 4 S on each rank, S = psum(r)
        return pf.grad(lambda r: inner(r).pow(2).sum())(r)  # 16 sum(S^2): 64 S, with psum's transpose psum

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with pf.set_mesh(dp_mesh):
        out = pf.device_get(pf.jit(pf.shard_map(body, mesh=dp_mesh, in_specs=(P(None, "dp"),),
                                                out_specs=P(None, "dp")))(x))
    torch.testing.assert_close(out, 64 * x.view(4, 2, 3).sum(1).repeat(1, 2), rtol=1e-5, atol=1e-5)


# Argument checks and small gaps against JAX / pf.grad.

def test_dict_in_axes_for_one_argument_is_refused_clearly():
    with pytest.raises(TypeError, match=r"in_axes=\(\{'a': 0\},\)"):
        pf.vmap(lambda d: d["a"] * 2, in_axes={"a": 0})({"a": torch.ones(5, 3)})
    x = torch.randn(5, 3)
    torch.testing.assert_close(pf.vmap(lambda d: d["a"] * 2, in_axes=({"a": 0},))({"a": x}), x * 2)


def test_a_python_number_given_a_batch_axis_is_refused():
    with pytest.raises(ValueError, match=r"args\[1\] is a Python float"):
        pf.vmap(lambda x, s: x * s)(torch.ones(5, 3), 2.0)
    torch.testing.assert_close(pf.vmap(lambda x, s: x * s, in_axes=(0, None))(torch.ones(5, 3), 2.0),
                               torch.full((5, 3), 2.0))


def test_axis_size_with_no_mapped_argument():
    w = torch.randn(3)
    out = pf.vmap(lambda w: w * 2, in_axes=None, axis_size=4)(w)
    torch.testing.assert_close(out, (w * 2).expand(4, 3))
    draws = pf.vmap(lambda w: torch.rand(()) + w[0], in_axes=None, axis_size=4, randomness="different")(w)
    assert draws.shape == (4,) and len(set(draws.tolist())) == 4
    with pytest.raises(ValueError, match="axis_size=3, but the mapped arguments have \\[5\\] examples"):
        pf.vmap(lambda x: x, axis_size=3)(torch.ones(5))
    with pytest.raises(ValueError, match="or axis_size="):
        pf.vmap(lambda w: w * 2, in_axes=None)(w)


def test_axis_size_inside_a_sharded_step(dp_mesh):
    w, x, _ = _data()

    def fn(w, x):
        return pf.vmap(lambda w: (x @ w).sum(), in_axes=None, axis_size=3)(w)

    _assert_trees_close(_on_mesh(dp_mesh, fn, (w, x), (P(), P("dp"))), fn(w, x))


def test_vmap_of_grad_takes_a_one_element_loss_as_grad_does():
    w, xs = torch.randn(3), torch.randn(5, 3)

    def loss(w, x):
        return (x * w).sum(0, keepdim=True)  # shape [1]: pf.grad takes it

    want = torch.stack([pf.grad(loss)(w, x) for x in xs])
    torch.testing.assert_close(pf.vmap(pf.grad(loss), in_axes=(None, 0))(w, xs), want)
    value, g = pf.vmap(pf.value_and_grad(loss), in_axes=(None, 0))(w, xs)
    torch.testing.assert_close(value, xs @ w[:, None])  # the value keeps its shape [1] per example
    with pytest.raises(TypeError, match="must return a scalar tensor"):
        pf.vmap(pf.grad(lambda w, x: x * w), in_axes=(None, 0))(w, xs)


# Virtual arrays outside pf.jit: pf.grad raised "must return a scalar tensor ..., got VirtualArray".

def test_grad_and_vmap_of_virtual_arrays_outside_jit(dp_mesh):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(4, 3, generator=g), torch.randn(8, 4, generator=g)

    def loss(w, x):
        return (x @ w).pow(2).sum()

    with pf.set_mesh(dp_mesh):
        vw, vx = pf.device_put(w, P()), pf.device_put(x, P("dp"))
        grad = pf.device_get(pf.grad(loss)(vw, vx))
        per_example = pf.device_get(pf.vmap(pf.grad(loss), in_axes=(None, 0))(vw, vx[:, None]))
    torch.testing.assert_close(grad, pf.grad(loss)(w, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_example, pf.vmap(pf.grad(loss), in_axes=(None, 0))(w, x[:, None]),
                               rtol=1e-5, atol=1e-5)


def test_grad_of_a_closure_over_a_virtual_array_says_what_to_do(dp_mesh):
    with pf.set_mesh(dp_mesh):
        vx = pf.device_put(torch.randn(8, 4), P("dp"))
        with pytest.raises(TypeError, match="pass them as arguments, or call it under pf.jit"):
            pf.grad(lambda s: (vx * s).sum())(torch.tensor(2.0))  # vx from the closure: a virtual array

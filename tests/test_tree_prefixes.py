"""Pytree prefixes (weight-decay masks, vmap axes, shardings) matched to dicts by key, and what pf.grad, device_put
and pf.optim make of the trees they are given: repeated tensors, torch-registered classes, Python floats, tensors
that require grad, complex parameters. Each is compared with eager PyTorch or torch.func."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.utils._pytree as torch_pytree

import pt3func as pf
from pt3func import P
from pt3func.tree import PrefixError, broadcast_prefix


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _state_dict() -> OrderedDict:
    """An nn.Module's state_dict order: weight before bias (a plain dict flattens as bias, weight)."""
    g = torch.Generator().manual_seed(0)
    return OrderedDict([("weight", torch.randn(3, 4, generator=g)), ("bias", torch.randn(3, generator=g))])


def test_broadcast_prefix_matches_dicts_by_key():
    full = OrderedDict([("z", 1), ("a", OrderedDict([("y", 2), ("b", 3)]))])
    assert broadcast_prefix({"a": {"b": "B", "y": "Y"}, "z": "Z"}, full) == ["Z", "Y", "B"]
    assert broadcast_prefix(OrderedDict([("a", "A"), ("z", "Z")]), full) == ["Z", "A", "A"]
    assert broadcast_prefix({"x": 0, "y": 1}, OrderedDict([("y", 5), ("x", 6)])) == [1, 0]
    with pytest.raises(PrefixError, match=r"at \['a'\]: the prefix has a list of 2 where the value has a tuple of 2"):
        broadcast_prefix({"a": [0, 1]}, {"a": (5, 6)})


def test_weight_decay_mask_dict_over_state_dict_matches_torch_adamw():
    params = _state_dict()
    grads = pf.tree.map(lambda p: torch.full_like(p, 0.3), params)
    opt = pf.optim.adamw(0.1, weight_decay=0.5, mask={"weight": True, "bias": False})
    state = opt.init(params)
    ours = params
    for _ in range(3):
        updates, state = opt.update(grads, state, ours)
        ours = pf.optim.apply_updates(ours, updates)
    theirs = {k: v.clone().requires_grad_() for k, v in params.items()}
    reference = torch.optim.AdamW([{"params": [theirs["weight"]], "weight_decay": 0.5},
                                   {"params": [theirs["bias"]], "weight_decay": 0.0}], lr=0.1)
    for _ in range(3):
        for k, v in theirs.items():
            v.grad = grads[k].clone()
        reference.step()
    for k in params:
        torch.testing.assert_close(ours[k], theirs[k].detach(), rtol=1e-6, atol=1e-6)


def test_callable_mask_over_state_dict():
    params = _state_dict()
    tx = pf.optim.add_decayed_weights(0.1, mask=lambda p: {k: k.endswith("weight") for k in p})
    updates, _ = tx.update(pf.tree.map(torch.zeros_like, params), tx.init(params), params)
    torch.testing.assert_close(updates["weight"], 0.1 * params["weight"])
    assert torch.equal(updates["bias"], torch.zeros(3))


def test_vmap_in_axes_dict_over_ordereddict():
    x, y = torch.randn(3, 4), torch.randn(4, 3)
    got = pf.vmap(lambda d: d["z"] @ d["a"], in_axes=({"z": 0, "a": 1},))(OrderedDict([("z", x), ("a", y)]))
    want = torch.func.vmap(lambda z, a: z @ a, in_dims=(0, 1))(x, y)
    torch.testing.assert_close(got, want)


def test_vmap_out_axes_entry_for_a_none_output():
    x = torch.randn(4, 3)
    out, nothing = pf.vmap(lambda a: (a * 2, None), out_axes=(1, 0))(x)
    torch.testing.assert_close(out, torch.func.vmap(lambda a: a * 2, out_dims=1)(x))
    assert nothing is None


def test_device_put_and_jit_shardings_dict_over_ordereddict(mesh):
    value = OrderedDict([("w", torch.randn(4, 6)), ("b", torch.randn(4, 6))])
    specs = {"w": P("dp"), "b": P()}
    with pf.set_mesh(mesh):
        placed = pf.device_put(value, specs)
        assert (pf.sharding_of(placed["w"]).spec, pf.sharding_of(placed["b"]).spec) == (P("dp"), P())
        step = pf.jit(lambda d: pf.tree.map(lambda v: v * 2, d), in_shardings=(specs,), out_shardings=specs,
                      backend="eager")
        out = step(value)
        assert (pf.sharding_of(out["w"]).spec, pf.sharding_of(out["b"]).spec) == (P("dp"), P())
        for k, v in pf.device_get(out).items():
            torch.testing.assert_close(v, value[k] * 2)
        with pytest.raises(pf.ShardingError, match=r"at \['w'\]"):  # b fits P(); w's dim 0 of 5 does not split
            pf.device_put(OrderedDict([("w", torch.randn(5, 6)), ("b", torch.randn(5))]), specs)


def test_prefix_errors_name_the_path_and_keys_not_values(mesh):
    params = {"0": {"weight": torch.randn(64, 64), "bias": torch.randn(64)},
              "2": {"1": {"weight": torch.randn(8, 64), "bias": torch.randn(8)}}}
    specs = pf.tree.map(lambda x: P(), params)
    del specs["2"]["1"]["bias"]
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError) as caught:
        pf.device_put(params, specs)
    message = str(caught.value)
    assert "at ['2']['1']: the prefix has keys ['weight'] where the value has keys ['bias', 'weight']" in message
    assert "missing from the prefix: ['bias']" in message
    assert "tensor(" not in message and len(message) < 300
    with pytest.raises(ValueError, match=r"at \['b'\]: the prefix has a tuple of 2 where the value has a Tensor "
                                         r"of shape \(3,\)"):
        pf.optim.add_decayed_weights(0.1, mask={"w": True, "b": (True, False)}).update(
            {"w": torch.ones(2), "b": torch.ones(3)}, None, {"w": torch.ones(2), "b": torch.ones(3)})
    with pytest.raises(ValueError, match=r"in_axes\[0\] is not a pytree prefix.*at the root: the prefix has "
                                         r"keys \['x'\] where the value has keys \['y'\]"):
        pf.vmap(lambda d: d["y"], in_axes=({"x": 0},))({"y": torch.ones(2)})


@pytest.mark.parametrize("requires_grad", [False, True])
def test_grad_of_a_tensor_given_twice(requires_grad):
    x = torch.ones(3, requires_grad=requires_grad)

    def loss(p):
        return (p["a"] * 2.0 + p["b"] * 3.0).sum()

    want = torch.func.grad(loss)({"a": x.detach(), "b": x.detach()})
    got = pf.grad(loss)({"a": x, "b": x})
    assert torch.equal(got["a"], want["a"]) and torch.equal(got["b"], want["b"])
    ga, gb = pf.grad(lambda a, b: loss({"a": a, "b": b}), argnums=(0, 1))(x, x)
    assert torch.equal(ga, want["a"]) and torch.equal(gb, want["b"])


def test_grad_of_a_parameter_given_twice_still_reaches_it():
    w = torch.nn.Parameter(torch.ones(3))
    g = pf.grad(lambda ps: (ps[0] * 2.0).sum() + (ps[1] * 3.0).sum())([w, w])
    assert g[0].tolist() == [2.0] * 3 and g[1].tolist() == [3.0] * 3
    (g[0] * w).sum().backward()  # the gradient keeps its graph to the parameter (create_graph)
    assert w.grad is not None


class _TorchRegistered:
    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        self.w, self.b = w, b


torch_pytree.register_pytree_node(_TorchRegistered, lambda p: ([p.w, p.b], None),
                                  lambda children, _: _TorchRegistered(*children))


def test_grad_of_a_torch_registered_class_outside_jit():
    p = _TorchRegistered(torch.randn(3, 2), torch.randn(2))
    x = torch.randn(4, 3)

    def loss(p, x):
        return ((x @ p.w + p.b) ** 2).sum()

    got = pf.grad(loss)(p, x)
    want = torch.func.grad(loss)(p, x)
    assert isinstance(got, _TorchRegistered)
    torch.testing.assert_close(got.w, want.w)
    torch.testing.assert_close(got.b, want.b)


def test_a_python_float_in_the_tree_stays_a_number_outside_jit():
    # Config in the params tree (an eps passed on to torch as a float) must keep working: it gets None.
    def loss(p):
        return torch.nn.functional.layer_norm(p["w"], (3,), eps=p["eps"]).square().sum() * p["scale"]

    p = {"w": torch.arange(3.0), "eps": 1e-5, "scale": 2.0}
    grads = pf.grad(loss)(p)
    assert grads["eps"] is None and grads["scale"] is None
    assert grads["w"].shape == (3,)
    assert pf.grad(lambda w, n: (w * n).sum(), argnums=1)(torch.ones(3), 2) is None  # an int is not differentiated


def test_device_put_of_parameters_on_a_virtual_mesh(mesh):
    module = torch.nn.Linear(4, 4)
    params = dict(module.named_parameters())
    x = torch.randn(2, 4)
    with pf.set_mesh(mesh):
        placed = pf.device_put(params, P("dp"))
        for k, v in pf.device_get(placed).items():
            torch.testing.assert_close(v, params[k].detach())
        out = pf.jit(lambda p, x: x @ p["weight"].T + p["bias"], in_shardings=(P(), P()), backend="eager")(params, x)
        torch.testing.assert_close(pf.device_get(out), module(x).detach())


def test_put_of_a_tensor_with_a_graph(world_of_one_mesh):
    w = torch.randn(4, 3, requires_grad=True)
    with pf.set_mesh(world_of_one_mesh):
        placed = pf.device_put(w * 2, P("dp"))  # differentiable, as jax.device_put is (split locally, no scatter)
        torch.testing.assert_close(pf.device_get(placed).detach(), (w * 2).detach())
        placed.full_tensor().sum().backward()
        torch.testing.assert_close(w.grad, torch.full_like(w, 2.0))

        def loss(w):  # with_sharding_constraint of an intermediate stays differentiable
            return (pf.with_sharding_constraint(w * 2, P("dp")) ** 2).sum().full_tensor()

        torch.testing.assert_close(pf.grad(loss)(w), 8 * w.detach())


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_and_adamw_on_complex_params_match_torch_optim(name):
    torch.manual_seed(0)
    w0 = torch.randn(4, 3, dtype=torch.complex64)
    x, y = torch.randn(5, 4, dtype=torch.complex64), torch.randn(5, 3, dtype=torch.complex64)

    def loss(w):
        return ((x @ w - y).abs() ** 2).mean()

    ours = pf.optim.adam(1e-2) if name == "adam" else pf.optim.adamw(1e-2, weight_decay=0.1)
    reference = w0.clone().requires_grad_()
    theirs = torch.optim.Adam([reference], lr=1e-2) if name == "adam" else torch.optim.AdamW([reference], lr=1e-2,
                                                                                              weight_decay=0.1)
    w, state = w0.clone(), ours.init(w0)
    for _ in range(3):
        updates, state = ours.update(pf.grad(loss)(w), state, w)
        w = pf.optim.apply_updates(w, updates)
        theirs.zero_grad()
        loss(reference).backward()
        theirs.step()
    torch.testing.assert_close(w, reference.detach(), rtol=1e-6, atol=1e-6)


def test_lion_on_complex_params_is_lion_on_their_real_parts():
    torch.manual_seed(0)
    w0 = torch.randn(4, 3, dtype=torch.complex64)
    grads = [torch.randn(4, 3, dtype=torch.complex64) for _ in range(3)]
    results = []
    for as_real in (False, True):
        opt = pf.optim.lion(1e-2, weight_decay=0.1)
        w = torch.view_as_real(w0).clone() if as_real else w0.clone()
        state = opt.init(w)
        for g in grads:
            updates, state = opt.update(torch.view_as_real(g) if as_real else g, state, w)
            w = pf.optim.apply_updates(w, updates)
        results.append(w)
    torch.testing.assert_close(torch.view_as_real(results[0]), results[1])

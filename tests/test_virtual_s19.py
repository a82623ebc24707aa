"""Session 19: Python conversions of virtual arrays (bool/int/len/in/...) and pf.optim.chain of MultiSteps."""

from __future__ import annotations

import operator

import numpy as np
import pytest
import torch

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION
from pt3func.runtime.virtual import VirtualArray


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _put(mesh, value, spec=None):
    with pf.set_mesh(mesh):
        return pf.device_put(value, P() if spec is None else spec)


# --- Python conversions of a VirtualArray -------------------------------------------------------------------------


def test_bool_int_index_complex_read_the_value(mesh):
    false, zero, zero_f, three = (_put(mesh, torch.tensor(v)) for v in (False, 0, 0.0, 3))
    assert isinstance(false, VirtualArray)
    assert bool(false) is False and (not false) is True and ("taken" if false else "not") == "not"
    assert bool(zero) is False and bool(zero_f) is False and bool(three) is True
    assert int(three) == 3 and int(_put(mesh, torch.tensor(2.7))) == 2 and int(_put(mesh, torch.tensor([5]))) == 5
    assert operator.index(three) == 3 and operator.index(false) == 0 and list(range(three)) == [0, 1, 2]
    assert ["a", "b", "c", "d"][three] == "d"
    assert complex(_put(mesh, torch.tensor(1.5))) == 1.5 + 0j and float(three) == 3.0
    # A split array of one element: gathered, as a real world's DTensor is not (rank 1's shard is empty there).
    assert int(_put(mesh, torch.tensor([7, 8]), P("dp"))[1:]) == 8


def test_conversions_raise_torchs_errors_without_gathering(mesh, monkeypatch):
    split = _put(mesh, torch.arange(4.0), P("dp"))
    empty = _put(mesh, torch.zeros(0))
    monkeypatch.setattr(VirtualArray, "full", lambda self: pytest.fail("gathered an array it cannot convert"))
    plain = torch.arange(4.0)
    for convert in (bool, int, float, complex, operator.index):
        with pytest.raises(Exception) as want:
            convert(plain)
        with pytest.raises(type(want.value), match=str(want.value)):
            convert(split)
    with pytest.raises(RuntimeError, match="with no values is ambiguous"):
        bool(empty)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="only integer tensors of a single element"):
        operator.index(_put(mesh, torch.tensor(2.0)))  # a float, as torch refuses


def test_multisteps_has_updated_is_truthy_on_the_emitting_micro_step_only(mesh):
    ms = pf.optim.MultiSteps(pf.optim.sgd(0.1), 3)
    with pf.set_mesh(mesh):
        params = pf.device_put({"w": torch.ones(4)}, P())
        state = pf.device_put(ms.init(params), P("dp"))

        @pf.jit(in_shardings=(P(), P("dp"), P("dp")), backend="eager")
        def step(p, st, x):
            g = pf.grad(lambda p, x: (p["w"] * x).sum())(p, x)
            u, st = ms.update(g, st, p)
            return pf.optim.apply_updates(p, u), st, ms.has_updated(st)

        seen = []
        for _ in range(3):
            params, state, updated = step(params, state, torch.ones(4, 4))
            seen.append((bool(updated), not updated, int(state.gradient_step)))
    assert seen == [(False, True, 0), (False, True, 0), (True, False, 1)]


def test_len_iter_reversed_contains_format_and_numpy(mesh):
    split = _put(mesh, torch.arange(4.0), P("dp"))
    scalar = _put(mesh, torch.tensor(2.5))
    assert len(split) == 4
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(scalar)
    rows = list(split)
    assert all(isinstance(r, VirtualArray) for r in rows) and [float(r) for r in rows] == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        iter(scalar)
    if TORCH_VERSION >= (2, 12):  # torch 2.11's DTensor has no rule for flip
        assert pf.device_get(reversed(split)).tolist() == [3.0, 2.0, 1.0, 0.0]
    # The global array's elements, from any rank's shard (a DTensor's own `in` looks at its rank's shard only).
    assert 3.0 in split and 0.0 in split and 7 not in split and torch.tensor(1.0) in split
    with pytest.raises(RuntimeError, match="only supports Tensor or scalar"):
        "a" in split  # noqa: B015
    assert f"{scalar:.2f}" == "2.50" and f"{_put(mesh, torch.tensor(3)):d}" == "3"
    assert np.asarray(split).tolist() == [0.0, 1.0, 2.0, 3.0] and np.asarray(scalar).shape == ()


def test_in_place_operators_change_the_array_for_every_name(mesh):
    params = {"w": _put(mesh, torch.arange(4.0), P("dp"))}
    w = params["w"]
    w += 1
    w *= 2
    assert w is params["w"] and pf.device_get(params["w"]).tolist() == [2.0, 4.0, 6.0, 8.0]
    # Shifts: a DTensor's own `<<`/`>>` return it unshifted (torch 2.13); a virtual array's shift.
    n = _put(mesh, torch.tensor([4, 8]), P("dp"))
    assert pf.device_get(n << 2).tolist() == [16, 32] and pf.device_get(n >> 2).tolist() == [1, 2]
    assert pf.device_get(1 << n).tolist() == [16, 256] and pf.device_get(256 >> n).tolist() == [16, 1]
    n >>= 1
    assert pf.device_get(n).tolist() == [2, 4]


# --- pf.optim.chain -----------------------------------------------------------------------------------------------


def test_chain_takes_multisteps_and_names_an_argument_that_is_no_transformation():
    opt = pf.optim.chain(pf.optim.clip_by_global_norm(1.0), pf.optim.MultiSteps(pf.optim.sgd(1.0), 2))
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    grads = {"w": torch.full((3,), 0.1)}
    for want_update in (0.0, -0.1):
        updates, state = opt.update(grads, state, params)
        torch.testing.assert_close(updates["w"], torch.full((3,), want_update))
    with pytest.raises(TypeError, match="chain: argument 1 is a function, not a gradient transformation"):
        pf.optim.chain(pf.optim.sgd(0.1), lambda g: g)
    sgd = pf.optim.sgd(1.0)
    pair = pf.optim.chain((sgd.init, sgd.update))  # a plain (init, update) pair, as before
    torch.testing.assert_close(pair.update(grads, pair.init(params), params)[0]["w"], torch.full((3,), -0.1))

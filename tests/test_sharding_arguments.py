"""How `in_shardings` / `out_shardings` are read (session 13): one bare sharding for every argument, a plain
output placed as out_shardings asks, and a string where a spec belongs refused."""

from __future__ import annotations

import pytest
import torch
from dist import run_world

import pt3func as pf
from pt3func import P


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


@pytest.mark.parametrize("spec", [P("dp"), P("dp", None)])
def test_a_bare_spec_applies_to_every_argument(mesh, spec):
    with pf.set_mesh(mesh):
        out = pf.jit(lambda x, y, lr: (x * lr, y + 1), in_shardings=spec)(torch.ones(4, 2), torch.ones(6, 3),
                                                                           torch.tensor(0.5))
    for leaf in out:
        assert pf.sharding_of(leaf).spec == P("dp")
    assert pf.device_get(out[0]).tolist() == [[0.5, 0.5]] * 4


def test_a_bare_named_sharding_applies_to_every_argument(mesh):
    f = pf.jit(lambda x, y: x + y, in_shardings=pf.NamedSharding(mesh, P("dp")))
    out = f(torch.ones(4), torch.arange(4.0))
    assert pf.sharding_of(out).spec == P("dp")
    assert pf.device_get(out).tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_out_shardings_places_a_plain_output(mesh, backend):
    """A step whose inputs are all plain tensors returns plain tensors; out_shardings still places them."""
    with pf.set_mesh(mesh):
        out = pf.jit(lambda x: (x * 2, x.sum()), out_shardings=(P("dp"), None), backend=backend)(torch.ones(4, 2))
    assert pf.sharding_of(out[0]) == pf.NamedSharding(mesh, P("dp"))
    assert pf.device_get(out[0]).tolist() == [[2.0, 2.0]] * 4
    assert pf.sharding_of(out[1]) is None and float(out[1]) == 8.0
    named = pf.jit(lambda x: x * 2, out_shardings=pf.NamedSharding(mesh, P(None, "dp")))(torch.ones(4, 2))
    assert pf.sharding_of(named).spec == P(None, "dp")


def test_out_shardings_of_a_plain_output_is_checked(mesh):
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=r"out_shardings of out\[1\]: dim 0 of shape \(5,\)"):
        pf.jit(lambda x: (x, x[:5] * 2), out_shardings=(None, P("dp")))(torch.ones(6))
    with pytest.raises(pf.ShardingError, match=r"out_shardings of out: spec P\('dp'\) needs a mesh"):
        pf.jit(lambda x: x * 2, out_shardings=P("dp"))(torch.ones(4))


def test_a_string_is_not_a_spec(mesh):
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=r"got str 'dp'; write P\('dp'\)"):
        pf.jit(lambda x: x * 2, in_shardings=("dp",))(torch.ones(4))
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=r"got str 'dp'"):
        pf.device_put(torch.ones(4), "dp")


def _plain_output_on_ranks(rank: int, world: int) -> list:
    mesh = pf.make_mesh((world,), ("dp",))
    with pf.set_mesh(mesh):
        out = pf.jit(lambda x: x * 2, out_shardings=P("dp"))(torch.arange(8.0))
    return [str(pf.sharding_of(out).spec), out.to_local().tolist(), pf.device_get(out).tolist()]


@pytest.mark.slow
def test_out_shardings_places_a_plain_output_on_two_ranks():
    results = run_world(2, _plain_output_on_ranks)
    assert results[0] == ["P('dp')", [0.0, 2.0, 4.0, 6.0], [2.0 * i for i in range(8)]]
    assert results[1] == ["P('dp')", [8.0, 10.0, 12.0, 14.0], [2.0 * i for i in range(8)]]


def test_a_split_spec_of_a_python_number_is_refused(mesh):
    refused = r"in_shardings of lr: spec P\('dp'\) splits a Python number"
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=refused):
        pf.jit(lambda x, lr: x * lr, in_shardings=(P("dp"), P("dp")))(torch.ones(4), 0.5)
    with pf.set_mesh(mesh):  # a bare spec broadcast to every argument leaves the number whole
        out = pf.jit(lambda x, lr: x * lr, in_shardings=P("dp"))(torch.ones(4), 0.5)
    assert pf.device_get(out).tolist() == [0.5] * 4

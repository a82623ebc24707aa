"""out_shardings and jitted DTensor outputs, fixed in session 16: a sharding on another mesh than the output's is
refused (not applied on the wrong mesh), out_shardings errors name the output, and an output whose layout is a
strided split (`x.flatten()` of a 2-D split value) keeps its shard order or comes back with a PartitionSpec."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func import P


def _skip_unless_dtensor_views(value: object, op: object) -> None:
    """Skip where this torch's DTensor refuses the view itself (torch 2.11: "Attempted to flatten multiple
    dimensions"): there is no strided output to test."""
    try:
        op(value)  # type: ignore[operator]
    except RuntimeError as exc:
        pytest.skip(f"this torch's DTensor has no strided view layout: {str(exc)[:80]}")


@pytest.fixture(scope="module")
def mesh22() -> pf.Mesh:
    return pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)


def test_out_sharding_on_another_mesh_is_refused(mesh22: pf.Mesh) -> None:
    other = pf.make_mesh((4, 1), ("x", "y"), virtual=True)
    x = torch.arange(32.0).reshape(8, 4)
    xa = pf.device_put(x, pf.NamedSharding(mesh22, P("dp")))
    # Control: a sharding on the arguments' own mesh is applied.
    own = pf.jit(lambda v: v + 1, out_shardings=pf.NamedSharding(mesh22, P(None, "tp")), backend="eager")(xa)
    assert pf.sharding_of(own) == pf.NamedSharding(mesh22, P(None, "tp"))
    assert torch.equal(pf.device_get(own), x + 1)
    # Before the fix: placements computed for `other`, applied on mesh22 (P('dp'), 4 rows per rank, not 2).
    step = pf.jit(lambda v: {"y": v + 1}, out_shardings={"y": pf.NamedSharding(other, P("x"))}, backend="eager")
    with pytest.raises(pf.ShardingError) as info:
        step(xa)
    text = str(info.value)
    assert text.startswith("out_shardings of out['y']:")
    assert repr(other) in text and repr(mesh22) in text and "pf.device_put" in text


def test_out_shardings_errors_name_the_output() -> None:
    mesh = pf.make_mesh((4,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        xs = pf.device_put(torch.randn(8, 4), P("dp"))
        tupled = pf.jit(lambda v: (v.sum(), {"h": v[:6]}), out_shardings=(None, {"h": P("dp")}), backend="eager")
        with pytest.raises(pf.ShardingError, match=r"^out_shardings of out\[1\]\['h'\]: dim 0 of shape \(6, 4\)"):
            tupled(xs)
        single = pf.jit(lambda v: v[:6], out_shardings=P("dp"), backend="eager")
        with pytest.raises(pf.ShardingError, match=r"^out_shardings of out: dim 0 of shape \(6, 4\)"):
            single(xs)


def test_strided_output_gets_a_partition_spec(mesh22: pf.Mesh) -> None:
    x = torch.arange(64.0).reshape(8, 8)
    with pf.set_mesh(mesh22):
        a = pf.device_put(x, P("tp", "dp"))
        _skip_unless_dtensor_views(a, lambda v: v.flatten())
        flat = pf.jit(lambda v: v.flatten(), backend="eager")(a)
        # Before the fix the output's _StridedShard lost its shard order: device_get and `+ 1` raised in torch.
        assert torch.equal(pf.device_get(flat), x.flatten())
        assert torch.equal(pf.device_get(flat + 1), x.flatten() + 1)
        assert pf.sharding_of(flat) == pf.NamedSharding(mesh22, P("tp"))  # dp's strided split gathered
        b = pf.device_put(x, P("dp"))
        s = pf.jit(lambda v: v.t().reshape(-1), backend="eager")(b)
        assert torch.equal(pf.device_get(s), x.t().reshape(-1))
        assert pf.sharding_of(s) == pf.NamedSharding(mesh22, P())  # raised "_S(0, 8) has no PartitionSpec"


def test_output_split_strided_over_two_axes_keeps_eager_layout(mesh22: pf.Mesh) -> None:
    # One dim strided over both axes: torch cannot gather it (eager DTensor cannot either), so the output keeps
    # eager's layout; before the fix it was rebuilt without its shard order, another layout with the same blocks.
    x = torch.arange(64.0).reshape(8, 8)
    with pf.set_mesh(mesh22):
        a = pf.device_put(x, P(("dp", "tp")))
        _skip_unless_dtensor_views(a, lambda v: v.t().reshape(-1))
        jitted = pf.jit(lambda v: v.t().reshape(-1), backend="eager")(a)
        eager = a.t().reshape(-1)
    for rank in range(4):
        mine, theirs = jitted.locals[rank], eager.locals[rank]
        assert torch.equal(mine.to_local(), theirs.to_local())
        assert mine.placements == theirs.placements
        assert str(mine._spec) == str(theirs._spec)  # the spec's text shows the shard order
        for name in ("shard_order", "use_strided_shard_as_shard_order"):
            assert getattr(mine._spec, name, None) == getattr(theirs._spec, name, None)

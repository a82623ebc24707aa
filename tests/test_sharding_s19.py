"""Session 19: sharding helpers found wrong by running code no test of ours ran."""

from __future__ import annotations

import pytest
import torch
from dist import run_world

import pt3func as pf
from pt3func import P


def _outcome(fn):
    try:
        return fn()
    except pf.ShardingError as exc:
        return str(exc)


def _blocks(rank: int, world: int) -> dict:
    mesh = pf.make_mesh((world,), ("dp",))
    rows = torch.arange(24.0).reshape(6, 4)
    uneven = rows[:3] if rank == 0 else rows[3:5]  # a smaller last batch on rank 1
    out = {}
    with pf.set_mesh(mesh):
        # Given the global shape, the rank whose block is smaller says so (no communication).
        out["short"] = _outcome(lambda: pf.make_array_from_process_local_data(P("dp"), uneven, global_shape=(6, 4))
                                .shape)
        out["uneven"] = _outcome(lambda: pf.make_array_from_process_local_data(P("dp"), uneven, global_shape=(5, 4)))
        local = rows[3 * rank:3 * rank + 3]
        batch = pf.make_array_from_process_local_data(P("dp"), local, global_shape=(6, 4))
        out["shape"] = tuple(batch.shape)
        out["mean"] = pf.device_get(pf.jit(lambda x: x.mean(0), backend="eager")(batch)).tolist()
        wrong = rows[:2] if rank == 0 else local  # rank 0's block of (6, 4) has 3 rows
        out["wrong"] = _outcome(lambda: pf.make_array_from_process_local_data(P("dp"), wrong, global_shape=(6, 4))
                                .shape)
        out["bad"] = _outcome(lambda: pf.make_array_from_process_local_data(P("dp"), local, global_shape=(6,)))
    return out


@pytest.mark.slow
def test_per_rank_blocks_of_different_shapes_are_refused():
    rows = torch.arange(24.0).reshape(6, 4)
    for rank, out in enumerate(run_world(2, _blocks)):
        if rank == 1:
            assert "gives this rank (rank 1) a block of shape (3, 4), but local_data has shape (2, 4)" in out["short"]
        else:
            assert out["short"] == (6, 4)
        assert "dim 0 of shape (5, 4) (size 5) is not divisible by the axis size 2" in out["uneven"]
        assert out["shape"] == (6, 4)
        torch.testing.assert_close(torch.tensor(out["mean"]), rows.mean(0))
        assert out["bad"].startswith("make_array_from_process_local_data: global_shape (6,) does not fit")
        if rank == 0:
            assert "gives this rank (rank 0) a block of shape (3, 4), but local_data has shape (2, 4)" in out["wrong"]
        else:
            assert out["wrong"] == (6, 4)


def test_make_mesh_takes_a_timeout_in_seconds():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True, timeout=30)
    assert mesh.world.timeout.total_seconds() == 30
    with pytest.raises(pf.ShardingError, match="timeout must be a datetime.timedelta or a number of seconds > 0, "
                                               "got '30'"):
        pf.make_mesh((2,), ("dp",), virtual=True, timeout="30")


def test_out_shardings_refuse_a_string_where_a_spec_belongs():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    x = torch.ones(4, 4)
    with pf.set_mesh(mesh):
        with pytest.raises(pf.ShardingError, match=r"out_shardings of out: .* got str 'dp'; write P\('dp'\)"):
            pf.jit(lambda a: a + 1, out_shardings="dp", backend="eager")(x)
        with pytest.raises(pf.ShardingError, match=r"out_shardings of out\[0\]: .* got str 'dp'"):
            pf.jit(lambda a: (a + 1, a), out_shardings=("dp", None), backend="eager")(x)

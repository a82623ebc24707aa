"""Plain tensors given to a sharded step are global values: ranks of a process world that pass different ones
are refused (session 13), and per-rank data goes through pf.make_array_from_process_local_data."""

from __future__ import annotations

import pytest
import torch
from dist import run_world

import pt3func as pf
from pt3func import P


def _step(p, x):
    loss, grads = pf.value_and_grad(lambda p: ((x @ p["w"]) ** 2).mean())(p)
    return loss, {"w": p["w"] - 0.1 * grads["w"]}


def _outcome(fn):
    try:
        fn()
        return "ok"
    except pf.ShardingError as exc:
        return str(exc)


def _mismatches(rank: int, world: int) -> dict:
    mesh = pf.make_mesh((world,), ("dp",))
    params = {"w": torch.ones(4, 2)}
    step = pf.jit(_step, in_shardings=(P(), P("dp")))
    out = {}
    with pf.set_mesh(mesh):
        # each rank its own batch size (the DDP habit)
        out["rows"] = _outcome(lambda: step(params, torch.ones(8 if rank == 0 else 6, 4)))
        # unseeded weights: replicated, so their values must agree
        out["weights"] = _outcome(lambda: step({"w": torch.full((4, 2), float(rank))}, torch.ones(8, 4)))
        # a split input may differ outside the rank's own block: only shapes are compared
        out["split"] = _outcome(lambda: step(params, torch.full((8, 4), float(rank))))
        # NaN equals NaN; a second call with the same shapes is not checked again
        nan = {"w": torch.full((4, 2), float("nan"))}
        out["nan"] = _outcome(lambda: step(nan, torch.ones(8, 4)))
    return out


@pytest.mark.slow
def test_ranks_passing_different_plain_tensors_are_refused():
    for rank, out in enumerate(run_world(2, _mismatches)):
        assert "x: rank 0 (8, 4) torch.float32, rank 1 (6, 4) torch.float32" in out["rows"], rank
        assert "p['w'] (taken replicated): the values of rank(s) [1] differ from rank 0's" in out["weights"], rank
        assert "make_array_from_process_local_data" in out["weights"]
        assert out["split"] == "ok" and out["nan"] == "ok", (rank, out)


def _local_rows(rank: int, world: int) -> list:
    mesh = pf.make_mesh((world,), ("dp",))
    rows = torch.arange(32.0).reshape(8, 4)
    local = rows[rank * 4:(rank + 1) * 4] + 0.0  # this rank's own rows only
    params = {"w": torch.linspace(-1, 1, 8).reshape(4, 2)}
    with pf.set_mesh(mesh):
        batch = pf.make_array_from_process_local_data(P("dp"), local)
        loss, new = pf.jit(_step, in_shardings=(P(), None))(params, batch)
        named = pf.make_array_from_process_local_data(pf.NamedSharding(mesh, P(None, "dp")), local[:, :2])
    return [tuple(batch.shape), float(loss), pf.device_get(new)["w"].tolist(), tuple(named.shape),
            str(pf.sharding_of(named).spec)]


@pytest.mark.slow
def test_per_rank_blocks_make_one_global_array():
    params = {"w": torch.linspace(-1, 1, 8).reshape(4, 2)}
    want_loss, want = _step(params, torch.arange(32.0).reshape(8, 4))
    for shape, loss, w, named_shape, named_spec in run_world(2, _local_rows):
        assert shape == (8, 4) and named_shape == (4, 4) and named_spec == "P(None, 'dp')"
        assert abs(loss - float(want_loss)) <= 1e-5 * abs(float(want_loss))
        torch.testing.assert_close(torch.tensor(w), want["w"])


def test_make_array_from_process_local_data_errors():
    with pytest.raises(pf.ShardingError, match="needs a mesh"):
        pf.make_array_from_process_local_data(P("dp"), torch.ones(2))
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pytest.raises(pf.ShardingError, match="is virtual .*pf.device_put"):
        pf.make_array_from_process_local_data(pf.NamedSharding(mesh, P("dp")), torch.ones(2))
    with pytest.raises(pf.ShardingError, match="local_data must be a plain tensor, got list"):
        pf.make_array_from_process_local_data(pf.NamedSharding(mesh, P("dp")), [1.0])

"""Eager torch on virtual arrays: what each process of a real world would run on its DTensor, every rank thread
runs on its own (`opt.init(params)` outside a jitted step, arithmetic, methods, indexing)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import pt3func as pf
from pt3func import P
from pt3func.runtime.virtual import VirtualArray


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g)}


def _put(mesh, params):
    with pf.set_mesh(mesh):
        return pf.device_put(params, {"w": P("dp"), "b": P()})


def test_optimizer_init_outside_jit_equals_jitted_init(mesh):
    params = _put(mesh, _params())
    opt = pf.optim.adamw(1e-2)
    eager = opt.init(params)
    with pf.set_mesh(mesh):
        jitted = pf.jit(opt.init, backend="eager")(params)
    # Same values (the step counter is a plain tensor eagerly, as on a real world, and replicated when jitted).
    with pf.set_mesh(mesh):
        for a, b in zip(pf.tree.leaves(pf.device_get(eager)), pf.tree.leaves(pf.device_get(jitted)), strict=True):
            assert torch.equal(a, b)
    mu = eager.mu if hasattr(eager, "mu") else eager[0].mu  # adamw: a chain, the Adam state first
    assert isinstance(mu["w"], VirtualArray) and mu["w"].placements == (Shard(0),)
    assert all(isinstance(local, DTensor) and local.to_local().shape == (2, 6) for local in mu["w"].locals)


def test_operators_methods_and_indexing_act_on_the_global_array(mesh):
    plain = _params()
    params = _put(mesh, plain)
    w, b = params["w"], params["b"]
    cases = {
        "w * 2 + 1": (w * 2 + 1, plain["w"] * 2 + 1),
        "1 - w": (1 - w, 1 - plain["w"]),
        "w @ b": (w @ b, plain["w"] @ plain["b"]),
        "-w": (-w, -plain["w"]),
        "w.sum(0)": (w.sum(0), plain["w"].sum(0)),
        "w.float().square().mean()": (w.float().square().mean(), plain["w"].square().mean()),
        "w[1:3]": (w[1:3], plain["w"][1:3]),
        "torch.zeros_like(w)": (torch.zeros_like(w), torch.zeros_like(plain["w"])),
        "torch.where(w > 0, w, 0)": (torch.where(w > 0, w, 0), torch.where(plain["w"] > 0, plain["w"], 0)),
    }
    for name, (got, want) in cases.items():
        assert isinstance(got, VirtualArray), name
        torch.testing.assert_close(got.full(), want, msg=name)
    assert w.T.shape == (6, 4) and w.is_floating_point() is True
    assert float(w.sum()) == pytest.approx(float(plain["w"].sum()), rel=1e-5)  # sharded: summed in two parts
    # As on a real world, DTensor refuses to mix with a plain tensor in one op: the same error, from every rank.
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        w + torch.ones(6)


def test_private_names_stay_the_handles_own(mesh):
    w = _put(mesh, _params())["w"]
    assert getattr(w, "_local_tensor", None) is None
    with pytest.raises(AttributeError):
        w.no_such_method()


def test_checkpoint_of_virtual_arrays_saves_each_ranks_shards_and_restores_them(mesh, tmp_path):
    params = _put(mesh, _params())
    opt = pf.optim.adamw(1e-2)
    state = {"params": params, "opt": opt.init(params), "step": 7}
    manager = pf.checkpointing.CheckpointManager(tmp_path / "ckpt")  # async: a virtual save is synchronous
    manager.save(7, state)
    assert manager.all_steps() == [7]
    restored = manager.restore(7, target=state)
    assert isinstance(restored["params"]["w"], VirtualArray) and restored["step"] == 7
    assert restored["params"]["w"].placements == params["w"].placements
    with pf.set_mesh(mesh):
        for a, b in zip(pf.tree.leaves(pf.device_get(restored)), pf.tree.leaves(pf.device_get(state)), strict=True):
            assert a == b if not isinstance(a, torch.Tensor) else torch.equal(a, b)
    full = manager.restore(7)  # no target: plain full tensors, as a checkpoint of a real world gives
    assert torch.equal(full["params"]["w"], _params()["w"])


def test_sharded_outputs_share_one_spec_per_leaf_across_calls(mesh):
    # Rebuilding a compiled program's DTensor outputs reuses one DTensorSpec per output leaf (building a spec was
    # most of the per-call host cost of a sharded step with hundreds of leaves).
    params = _put(mesh, _params())
    with pf.set_mesh(mesh):
        step = pf.jit(lambda p: pf.tree.map(lambda t: t * 2, p), backend="eager")
        first, second = step(params), step(params)
    for key in ("w", "b"):
        for rank in range(2):
            a, b = first[key].locals[rank], second[key].locals[rank]
            assert a._spec is b._spec and a.placements == params[key].placements
        assert torch.equal(second[key].full(), params[key].full() * 2)


def test_virtual_meshes_leave_the_process_excepthook_alone():
    import sys

    before = sys.excepthook
    pf.make_mesh((2,), ("dp",), virtual=True)
    pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    assert sys.excepthook is before  # no "[rank0]: [rank1]: ..." prefixes stacked on later tracebacks


def test_sharding_of_a_virtual_array_names_its_mesh_and_spec():
    mesh2 = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    x = pf.device_put(torch.randn(4, 8), pf.NamedSharding(mesh2, P(None, ("dp", "tp"))))
    assert pf.sharding_of(x) == pf.NamedSharding(mesh2, P(None, ("dp", "tp")))
    assert pf.sharding_of(pf.device_put(torch.randn(4), pf.NamedSharding(mesh2, P()))).spec == P()

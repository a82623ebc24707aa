"""Copies and pickles of meshes, DTensors, optimizer states and checkpoint managers; the setter form of set_mesh
seen from other threads; a misfit in_shardings entry named by its argument."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import pt3func as pf
from pt3func import P


def _step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return w - 0.1 * w * x


def test_copied_dtensors_run_the_program_of_the_original(world_of_one_mesh):
    """copy.deepcopy / torch.load give a DTensor a new, equal DeviceMesh: the step runs the program it has."""
    mesh = world_of_one_mesh
    ns = pf.NamedSharding(mesh, P("dp"))
    step = pf.jit(_step, backend="eager")
    w0, x0 = torch.arange(8.0).reshape(4, 2), torch.full((4, 2), 0.5)
    w, x = pf.device_put(w0, ns), pf.device_put(x0, ns)
    w = step(w, x)
    expect = _step(w0, x0)
    for _ in range(2):
        snapshot = copy.deepcopy(w)
        assert snapshot.device_mesh is not w.device_mesh  # the case at hand: a new DeviceMesh, equal
        w = step(snapshot, x)
        expect = _step(expect, x0)
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    w = step(torch.load(buf, weights_only=False), x)
    expect = _step(expect, x0)
    assert step.trace_count() == 1
    torch.testing.assert_close(pf.device_get(w), expect)


def test_different_meshes_keep_different_programs(world_of_one_mesh):
    """Other axis names or other process groups over the same ranks are other meshes (other programs)."""
    from pt3func.trace.signature import _mesh_id

    dm = world_of_one_mesh.device_mesh
    assert _mesh_id(copy.deepcopy(dm)) == _mesh_id(dm)
    renamed = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
    regrouped = DeviceMesh.from_group(dist.new_group([0]), "cpu", mesh_dim_names=("dp",))
    assert regrouped == dm and regrouped._dim_group_names != dm._dim_group_names  # DeviceMesh's == misses groups
    assert len({_mesh_id(dm), _mesh_id(renamed), _mesh_id(regrouped)}) == 3
    step = pf.jit(_step, backend="eager")
    x0 = torch.ones(4, 2)
    for device_mesh in (dm, renamed, regrouped):
        w = pf.device_put(x0, pf.NamedSharding(pf.sharding.mesh.mesh_of(device_mesh), P()))
        out = step(w, w)
        assert out.device_mesh == device_mesh
        torch.testing.assert_close(pf.device_get(out), _step(x0, x0))
    assert step.trace_count() == 3


def test_real_mesh_copies_are_the_mesh(world_of_one_mesh):
    _check_mesh_copies(world_of_one_mesh)


def test_virtual_mesh_copies_are_the_mesh():
    _check_mesh_copies(pf.make_mesh((1,), ("dp",), virtual=True))


def _check_mesh_copies(mesh: pf.Mesh) -> None:
    ns = pf.NamedSharding(mesh, P("dp"))
    assert copy.copy(mesh) is mesh and copy.deepcopy(mesh) is mesh
    assert copy.deepcopy(ns) == ns and copy.copy(ns) == ns
    holder = torch.nn.Linear(2, 2)
    holder.sharding = ns  # a module keeping its sharding for with_sharding_constraint, deep-copied for an EMA
    assert copy.deepcopy(holder).sharding == ns
    with pytest.raises(TypeError, match=r"Mesh\(dp=1.*cannot be pickled.*pf\.make_mesh"):
        pickle.dumps(mesh)


def test_set_mesh_setter_is_seen_by_other_threads():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    step = pf.jit(lambda x: (x * 2).sum(), in_shardings=P("dp"), backend="eager")
    x = torch.arange(8.0)
    try:
        pf.set_mesh(mesh)  # in the main thread: the mesh of threads that set none
        with cf.ThreadPoolExecutor(1) as pool:
            seen, out = pool.submit(lambda: (pf.get_mesh(), step(x))).result(timeout=120)
            assert seen is mesh
            torch.testing.assert_close(pf.device_get(out), (x * 2).sum())
            with pf.set_mesh(None):  # the main thread's current mesh, in a `with` block too
                assert pf.get_mesh() is None
                assert pool.submit(pf.get_mesh).result(timeout=60) is None
            assert pf.get_mesh() is mesh
            assert pool.submit(pf.get_mesh).result(timeout=60) is mesh

            def own_block() -> tuple:  # a thread's own mesh is its own, and leaves no trace behind
                with pf.set_mesh(None):
                    inside = pf.get_mesh()
                return inside, pf.get_mesh()

            assert pool.submit(own_block).result(timeout=60) == (None, mesh)
            assert pf.get_mesh() is mesh
            pf.set_mesh(None)
            assert pool.submit(pf.get_mesh).result(timeout=60) is None
    finally:
        pf.set_mesh(None)


def test_overlapping_set_mesh_blocks_of_threads_never_change_the_main_threads_mesh(world_of_one_mesh):
    """Two threads entering and leaving `with pf.set_mesh(...)` while the main thread set its own: before, the
    blocks chained a process-wide default and left it on one of theirs for good."""
    import sys
    import threading

    a, b, c = world_of_one_mesh, *(pf.make_mesh((1,), (name,)) for name in ("b", "c"))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pf.set_mesh(a)
        stop, wrong = threading.Event(), []

        def loop(mesh: pf.Mesh) -> None:
            while not stop.is_set():
                with pf.set_mesh(mesh):
                    if pf.get_mesh() is not mesh:
                        wrong.append(pf.get_mesh())

        threads = [threading.Thread(target=loop, args=(m,)) for m in (b, c)]
        for t in threads:
            t.start()
        seen = [pf.get_mesh() for _ in range(20000)]
        stop.set()
        for t in threads:
            t.join()
        assert all(m is a for m in seen) and not wrong
        assert pf.get_mesh() is a
    finally:
        sys.setswitchinterval(interval)
        pf.set_mesh(None)


def test_misfit_in_shardings_entry_names_its_argument():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    specs = {"w": P("dp"), "b": P()}
    step = pf.jit(lambda p, s: (p["w"] * 2, s), in_shardings=(specs, specs), backend="eager")
    p = {"w": torch.ones(4), "b": torch.ones(1)}
    s = (torch.zeros(4), torch.zeros(1))  # a tuple where the specs have a dict
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=r"^in_shardings of s: .*not a pytree prefix"):
        step(p, s)


@pytest.mark.parametrize("make", [
    lambda: pf.optim.chain(pf.optim.clip_by_global_norm(1.0), pf.optim.adamw(1e-3)),
    lambda: pf.optim.lion(1e-3),
    lambda: pf.optim.sgd(0.1, momentum=0.9),
    lambda: pf.optim.apply_if_finite(pf.optim.adam(1e-3), 3),
    lambda: pf.optim.chain(pf.optim.scale_by_schedule(pf.optim.constant(1.0)), pf.optim.scale(-1.0)),
])
def test_optim_state_loads_with_weights_only(make):
    opt = make()
    params = {"w": torch.ones(3)}
    grads = {"w": torch.full((3,), 0.5)}
    _, state = opt.update(grads, opt.init(params), params)
    buf = io.BytesIO()
    torch.save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert pf.tree.structure(loaded) == pf.tree.structure(state)
    for a, b in zip(pf.tree.leaves(loaded), pf.tree.leaves(state)):
        torch.testing.assert_close(a, b)


def test_optim_multisteps_state_loads_with_weights_only():
    state = pf.optim.MultiSteps(pf.optim.adam(1e-3), 2).init({"w": torch.ones(3)})
    buf = io.BytesIO()
    torch.save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert type(loaded) is pf.optim.MultiStepsState
    assert pf.tree.structure(loaded) == pf.tree.structure(state)


def test_checkpoint_manager_copies_are_the_manager(tmp_path):
    mgr = pf.checkpointing.CheckpointManager(tmp_path, async_save=False)
    trainer = {"manager": mgr, "w": torch.ones(2)}
    copied = copy.deepcopy(trainer)
    assert copied["manager"] is mgr and copy.copy(mgr) is mgr
    assert copied["w"] is not trainer["w"]
    with pytest.raises(TypeError, match="CheckpointManager.*cannot be pickled"):
        pickle.dumps(mgr)

"""Virtual meshes over their lifetime: several caller threads, dropped meshes, copies of their arrays."""

import copy
import gc
import threading
import warnings
import weakref

import pytest
import torch

import pt3func as pf
from pt3func import P
from pt3func._compat import VIRTUAL_RANK_THREADS_CAN_END
from pt3func.errors import ShardingError
from pt3func.runtime.virtual import VirtualArray

pytestmark = pytest.mark.filterwarnings("ignore")


def _virtual_mesh(n: int = 2) -> pf.Mesh:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pf.make_mesh((n,), ("dp",), virtual=True)


def _in_threads(work, count: int, timeout: float = 30.0) -> None:
    """Run `work(k)` for k < count in daemon threads at once; fail (rather than hang) if they do not finish."""
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            work(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "virtual mesh callers hung"
    if errors:
        raise errors[0]


def _storage(x: torch.Tensor) -> int:
    """The address of a rank value's memory (a DTensor's is its local tensor's)."""
    return getattr(x, "_local_tensor", x).untyped_storage().data_ptr()


def _vleaves(t):
    return pf.tree.leaves(t, is_leaf=lambda x: isinstance(x, VirtualArray))


def test_two_threads_on_one_mesh_get_their_own_results():
    mesh = _virtual_mesh()
    step = pf.jit(lambda w, x: (x @ w).sum(0), in_shardings=(P(), P("dp")), backend="eager")
    w_full = torch.randn(16, 8)
    w = pf.device_put(w_full, pf.NamedSharding(mesh, P()))
    xs = [torch.randn(32, 16) * (k + 1) for k in range(2)]
    step(w, xs[0])  # traced before the threads start
    outs: dict[int, list] = {0: [], 1: []}

    def work(k: int) -> None:
        for _ in range(25):
            outs[k].append(step(w, xs[k]))
            outs[k].append(pf.device_get(w))

    _in_threads(work, 2)
    for k in range(2):
        want = (xs[k] @ w_full).sum(0)
        for i in range(0, len(outs[k]), 2):
            torch.testing.assert_close(pf.device_get(outs[k][i]), want, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(outs[k][i + 1], w_full)


def test_two_threads_on_two_meshes_at_once():
    # Every threaded world names its process groups alike, and torch pairs a collective's ranks by that name:
    # collectives of two meshes running at once would meet (a hang).
    meshes = [_virtual_mesh(), _virtual_mesh()]
    step = pf.jit(lambda w, x: (x @ w).sum(0), in_shardings=(P(), P("dp")), backend="eager")
    w_full = torch.randn(16, 8)
    ws = [pf.device_put(w_full, pf.NamedSharding(m, P())) for m in meshes]
    xs = [torch.randn(32, 16) * (k + 1) for k in range(2)]
    for k in range(2):
        step(ws[k], xs[k])
    got: dict[int, list] = {0: [], 1: []}

    def work(k: int) -> None:
        for _ in range(15):
            got[k].append(pf.device_get(step(ws[k], xs[k])))

    _in_threads(work, 2)
    for k in range(2):
        for out in got[k]:
            torch.testing.assert_close(out, (xs[k] @ w_full).sum(0), rtol=1e-5, atol=1e-4)


def test_dropped_mesh_stops_its_threads_and_frees_its_values():
    mesh = _virtual_mesh()
    step = pf.jit(lambda w: w * 2, backend="eager")
    w_full = torch.randn(64, 32)
    w = pf.device_put(w_full, pf.NamedSharding(mesh, P("dp")))
    out = step(w)
    torch.testing.assert_close(pf.device_get(out), w_full * 2)
    threads = list(mesh.world._threads)
    mesh_ref = weakref.ref(mesh)
    local_refs = [weakref.ref(t) for t in (*w.locals, *out.locals)]
    del mesh, w, out, step
    gc.collect()
    assert mesh_ref() is None
    assert all(r() is None for r in local_refs)
    if VIRTUAL_RANK_THREADS_CAN_END:
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
    # The next mesh (in a process whose dropped worlds left) computes as before.
    mesh = _virtual_mesh()
    x = pf.device_put(w_full, pf.NamedSharding(mesh, P("dp")))
    torch.testing.assert_close(pf.device_get(pf.jit(lambda v: v.sum(0), backend="eager")(x)), w_full.sum(0))


def test_dropped_mesh_leaves_a_live_mesh_working():
    keep, drop = _virtual_mesh(), _virtual_mesh()
    step = pf.jit(lambda w, x: (x @ w).sum(0), in_shardings=(P(), P("dp")), backend="eager")
    w_full, x = torch.randn(8, 4), torch.randn(16, 8)
    for mesh in (keep, drop):
        torch.testing.assert_close(pf.device_get(step(pf.device_put(w_full, pf.NamedSharding(mesh, P())), x)),
                                   (x @ w_full).sum(0), rtol=1e-5, atol=1e-5)
    threads = list(drop.world._threads)
    del drop, mesh
    step = None  # its compiled programs hold the meshes they run on
    gc.collect()
    if VIRTUAL_RANK_THREADS_CAN_END:
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
    step = pf.jit(lambda w, x: (x @ w).sum(0), in_shardings=(P(), P("dp")), backend="eager")
    w = pf.device_put(w_full, pf.NamedSharding(keep, P()))
    torch.testing.assert_close(pf.device_get(step(w, x)), (x @ w_full).sum(0), rtol=1e-5, atol=1e-5)


def test_last_call_arguments_are_not_kept_by_the_rank_threads():
    mesh = _virtual_mesh()
    step = pf.jit(lambda w: (w * 2).sum(), backend="eager")
    w_full = torch.randn(64, 32)
    w = pf.device_put(w_full, pf.NamedSharding(mesh, P("dp")))
    out = step(w)  # the mesh's last job: its closure holds the arguments
    refs = [weakref.ref(t) for t in w.locals]
    del w
    gc.collect()
    assert all(r() is None for r in refs)
    torch.testing.assert_close(pf.device_get(out), (w_full * 2).sum())


def test_a_mesh_its_steps_ran_on_lives_as_long_as_the_step():
    # A jitted step's signature names a rank's DeviceMesh by identity: a mesh its programs ran on must not be freed
    # (and its address reused by a new mesh) while those programs can still be found.
    step = pf.jit(lambda v: v * 3, backend="eager")
    w_full = torch.randn(8, 4)
    mesh = _virtual_mesh()
    torch.testing.assert_close(pf.device_get(step(pf.device_put(w_full, pf.NamedSharding(mesh, P("dp"))))), w_full * 3)
    mesh_ref = weakref.ref(mesh)
    del mesh
    gc.collect()
    assert mesh_ref() is not None
    for _ in range(3):  # new meshes, each its own program
        mesh = _virtual_mesh()
        v = pf.device_put(w_full + 1, pf.NamedSharding(mesh, P("dp")))
        torch.testing.assert_close(pf.device_get(step(v)), (w_full + 1) * 3)
        del mesh, v
        gc.collect()


def test_job_asking_its_own_mesh_raises_instead_of_hanging():
    mesh = _virtual_mesh()

    def work(_: int) -> None:
        with pytest.raises(ShardingError, match="one job at a time"):
            mesh.run(lambda rank: mesh.run(lambda r: r))

    _in_threads(work, 1, timeout=20)
    assert mesh.run(lambda rank: rank) == [0, 1]  # still serving


def test_deepcopy_of_virtual_params_and_optimizer_state():
    mesh = _virtual_mesh()
    shardings = {"w": pf.NamedSharding(mesh, P("dp")), "b": pf.NamedSharding(mesh, P())}
    params = pf.device_put({"w": torch.randn(8, 4), "b": torch.randn(4)}, shardings)
    opt = pf.optim.adam(1e-2)
    state = opt.init(params)
    loss = pf.jit(lambda p: (p["w"] * p["b"]).sum(), backend="eager")
    loss(params)
    for tree in (params, state):
        copied = copy.deepcopy(tree)
        for a, b in zip(_vleaves(copied), _vleaves(tree), strict=True):
            if isinstance(b, VirtualArray):
                assert a.mesh is mesh and a.placements == b.placements
                assert all(_storage(x) != _storage(y) for x, y in zip(a.locals, b.locals, strict=True))
            torch.testing.assert_close(torch.as_tensor(pf.device_get(a)), torch.as_tensor(pf.device_get(b)))
    best = copy.deepcopy(params)
    want = pf.device_get(params)
    traces = len(loss._cache)
    torch.testing.assert_close(pf.device_get(loss(best)), (want["w"] * want["b"]).sum())
    assert len(loss._cache) == traces  # the copy is on the same meshes: the same program
    params = pf.device_put({"w": torch.zeros(8, 4), "b": torch.zeros(4)}, shardings)
    torch.testing.assert_close(pf.device_get(best), want)  # the copy is its own

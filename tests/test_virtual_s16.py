"""A virtual mesh whose ranks disagree: an error on one rank only, a collective one rank never reaches, Ctrl-C.

Without care the other ranks wait for ever in a collective: the caller hangs, the error never reaches it, and every
later call on the mesh hangs too. Each case runs in a daemon thread that fails the test rather than hanging it.
"""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pt3func as pf
from pt3func import P

pytestmark = pytest.mark.filterwarnings("ignore")


def _virtual_mesh(timeout: timedelta | None = None) -> pf.Mesh:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pf.make_mesh((2,), ("dp",), virtual=True, timeout=timeout)


def _guarded(fn, timeout: float = 30.0):
    """fn() in a daemon thread: its result, or the exception it raised; fails (rather than hangs) if it hangs."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the virtual mesh hung"
    return box


def _embedding_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
    params, apply = pf.functionalize(model)

    def step(p, tok):
        loss, g = pf.value_and_grad(lambda p: apply(p, tok).pow(2).mean())(p)
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    return params, step


def _assert_step_matches_one_device(mesh: pf.Mesh, jitted, step, params, *batch) -> None:
    ref_params, ref_loss = step(params, *batch)
    sharded = pf.device_put(params, pf.NamedSharding(mesh, P()))

    def call():
        with pf.set_mesh(mesh):
            new, loss = jitted(sharded, *batch)
        return pf.device_get(new), float(loss)

    box = _guarded(call)
    assert "error" not in box, box.get("error")
    new, loss = box["result"]
    assert abs(loss - ref_loss.item()) < 1e-5
    for a, b in zip(pf.tree.leaves(new), pf.tree.leaves(ref_params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_runtime_error_on_one_rank_is_raised_and_the_mesh_keeps_working():
    mesh = _virtual_mesh(timeout=timedelta(seconds=5))
    params, step = _embedding_step()
    jitted = pf.jit(step, in_shardings=(P(), P("dp")), backend="eager")
    good = torch.randint(0, 10, (4, 3))
    bad = good.clone()
    bad[3, 0] = 12  # out of the embedding's range, in rank 1's half of the batch only
    _assert_step_matches_one_device(mesh, jitted, step, params, good)
    sharded = pf.device_put(params, pf.NamedSharding(mesh, P()))

    def bad_call():
        with pf.set_mesh(mesh):
            return jitted(sharded, bad)

    box = _guarded(bad_call)
    error = box.get("error")
    assert isinstance(error, IndexError), box  # the embedding's own error, not a hang or a timeout
    if sys.version_info >= (3, 11):
        assert any("virtual rank 1 of 2" in note for note in error.__notes__)
    _assert_step_matches_one_device(mesh, jitted, step, params, good)


def test_trace_error_on_one_rank_is_raised_and_the_mesh_keeps_working():
    mesh = _virtual_mesh()
    params, step = _embedding_step()
    tok = torch.randint(0, 10, (4, 3))

    class Boom(Exception):
        pass

    def rank1_fails(p, tok):
        if dist.get_rank() == 1:
            raise Boom("only rank 1 at trace")
        return step(p, tok)

    sharded = pf.device_put(params, pf.NamedSharding(mesh, P()))
    failing = pf.jit(rank1_fails, in_shardings=(P(), P("dp")), backend="eager")

    def bad_call():
        with pf.set_mesh(mesh):
            return failing(sharded, tok)

    box = _guarded(bad_call)
    assert isinstance(box.get("error"), Boom), box
    _assert_step_matches_one_device(mesh, pf.jit(step, in_shardings=(P(), P("dp")), backend="eager"), step, params, tok)


def _rank1_reduces_alone(rank: int):
    """A collective only rank 1 reaches: rank 0 finishes, rank 1 waits for it."""
    x = torch.ones(2)
    if rank == 1:
        dist.all_reduce(x)
    return x


def _sum_over_ranks(rank: int):
    x = torch.full((1,), float(rank + 1))
    dist.all_reduce(x)
    return x


def test_collective_one_rank_never_reaches_times_out_with_the_mesh_timeout():
    mesh = _virtual_mesh(timeout=timedelta(seconds=1))
    box = _guarded(lambda: mesh.run(_rank1_reduces_alone))
    error = box.get("error")
    assert isinstance(error, TimeoutError), box
    assert "[1]" in str(error)  # names the rank left waiting
    box = _guarded(lambda: mesh.run(_sum_over_ranks))
    assert "error" not in box, box.get("error")
    assert [float(x) for x in box["result"]] == [3.0, 3.0]


def test_ctrl_c_while_ranks_wait_leaves_the_mesh_working():
    mesh = _virtual_mesh()  # no timeout: only the interrupt ends the wait
    # A real Ctrl-C: SIGINT to the main thread interrupts its wait (`_thread.interrupt_main` would not wake it).
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            mesh.run(_rank1_reduces_alone)
    finally:
        timer.cancel()
    box = _guarded(lambda: mesh.run(_sum_over_ranks))
    assert "error" not in box, box.get("error")
    assert [float(x) for x in box["result"]] == [3.0, 3.0]

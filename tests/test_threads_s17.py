"""Session 17: pf.jit from several threads (one compile per signature, per-call state, locks after fork), the rank
programs of `lower()` on a virtual mesh paired per call, and copies / pickles of jitted functions and their stages."""

from __future__ import annotations

import copy
import os
import pickle
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pt3func as pf
import pt3func.jitted as jitted_module
from pt3func import P
from pt3func.runtime.donated import is_donated


def _rank_values(out: Any) -> list[float]:
    return [float(t.to_local() if hasattr(t, "to_local") else t) for t in out.locals]


def test_virtual_lower_runs_each_ranks_program_of_that_call() -> None:
    # One rank lowering once more than the others (here rank 0 alone; in real runs a retrace on one rank) shifted the
    # pairing of the ranks' programs: `a.lower(...).compile()(...)` ran b's program on rank 1.
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    torch.manual_seed(0)
    w, x, y = torch.randn(6, 3), torch.randn(8, 6), torch.randn(8, 3)

    def make_loss(scale: float) -> Any:
        def loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(x @ w, y) * scale

        return pf.jit(loss, in_shardings=(P(), P("dp"), P("dp")), backend="eager")

    with pf.set_mesh(mesh):
        extra = make_loss(3.0)
        mesh.run(lambda rank: extra.lower(w.clone(), x.clone(), y.clone()) if rank == 0 else None)
        a, b = make_loss(1.0), make_loss(100.0)
        lowered_a = a.lower(w, x, y)
        b.lower(w, x, y)
        got = _rank_values(lowered_a.compile()(w, x, y))
    want = float(F.mse_loss(x @ w, y))
    assert got == pytest.approx([want, want], rel=1e-5)


def test_threads_racing_a_first_call_trace_and_compile_it_once() -> None:
    traces = []

    def step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        traces.append(threading.get_ident())
        time.sleep(0.2)  # at trace time only: the other threads arrive while this one traces
        return torch.tanh(x @ w).sum(0)

    jitted = pf.jit(step, backend="eager")
    w = torch.randn(4, 3)
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    outs: list[Any] = [None] * 4
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        barrier.wait()
        outs[i] = jitted(w, xs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(traces) == 1 and jitted.trace_count() == 1
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, torch.tanh(x @ w).sum(0))


def test_a_failed_first_compile_leaves_the_signature_to_the_next_thread() -> None:
    attempts = []

    def step(x: torch.Tensor) -> torch.Tensor:
        attempts.append(1)
        time.sleep(0.1)
        if len(attempts) == 1:
            raise ValueError("first trace fails")
        return x * 2

    jitted = pf.jit(step, backend="eager")
    results: list[Any] = [None] * 3
    barrier = threading.Barrier(3)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jitted(torch.full((2,), float(i)))
        except ValueError as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    errors = [r for r in results if isinstance(r, ValueError)]
    assert len(errors) == 1 and len(attempts) == 2  # the failure released the signature; one more trace, then cached
    for i, r in enumerate(results):
        if not isinstance(r, ValueError):
            torch.testing.assert_close(r, torch.full((2,), 2.0 * i))


def test_virtual_donated_plain_arguments_are_invalidated_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread's call between a call's rank threads naming the donated arguments and the caller invalidating
    # them reset one attribute shared by every call: the caller's donated tensor stayed readable.
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    sharding = pf.NamedSharding(mesh, P("dp"))

    @pf.jit(in_shardings=(sharding, sharding), donate_argnums=0, backend="eager")
    def step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return w - 0.5 * x

    real = jitted_module.virtual_call
    busy = []

    def with_another_call_in_between(*args: Any) -> Any:
        out = real(*args)
        if not busy:
            busy.append(1)
            placed = pf.device_put(torch.ones(8), sharding)  # nothing for in_shardings to place: no donated originals
            other = threading.Thread(target=lambda: step(placed, torch.ones(8)))
            other.start()
            other.join()
        return out

    monkeypatch.setattr(jitted_module, "virtual_call", with_another_call_in_between)
    w = torch.ones(8)
    out = step(w, torch.ones(8))
    assert is_donated(w)
    torch.testing.assert_close(pf.device_get(out), torch.full((8,), 0.5))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_forked_child_compiles_a_signature_another_parent_thread_was_compiling() -> None:
    jitted = pf.jit(lambda x: x + 1, backend="eager")
    compiling = threading.Event()
    real_compile = jitted._compile
    parent_thread: list[threading.Thread] = []

    def slow_compile(*args: Any) -> Any:  # holds the signature's lock, not the trace lock
        if threading.current_thread() in parent_thread:
            compiling.set()
            time.sleep(3)
        return real_compile(*args)

    jitted._compile = slow_compile  # type: ignore[method-assign]
    t = threading.Thread(target=lambda: jitted(torch.ones(2)), daemon=True)
    parent_thread.append(t)
    t.start()
    assert compiling.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: only this thread lives on
        code = 1
        try:
            code = 0 if torch.equal(jitted(torch.ones(2)), torch.full((2,), 2.0)) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    status = None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = code
        else:
            time.sleep(0.05)
    if status is None:  # hung
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    t.join()
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child hung or failed"


class _Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(3, 1)
        self.scale = 1.0
        self.forward = pf.jit(self._forward, backend="eager")
        self.forward_model = pf.jit(self.model, backend="eager")

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.scale


def _reset(trainer: _Trainer) -> None:
    with torch.no_grad():
        trainer.model.weight.zero_()
        trainer.model.bias.fill_(5.0)
    trainer.scale = 2.0


def test_deepcopy_of_a_jitted_method_or_module_runs_the_copy() -> None:
    x = torch.ones(2, 3)
    trainer = _Trainer()
    before = trainer.model(x).detach()
    trainer.forward(x), trainer.forward_model(x)  # compiled for the original object
    copied = copy.deepcopy(trainer)
    _reset(copied)
    assert copied.forward.fn.__self__ is copied and copied.forward_model.fn is copied.model
    torch.testing.assert_close(copied.forward(x), torch.full((2, 1), 10.0))
    torch.testing.assert_close(copied.forward_model(x), torch.full((2, 1), 5.0))
    torch.testing.assert_close(trainer.forward(x), before)  # the original is untouched
    # The jitted method copied on its own: a copy of its instance holding that copy.
    alone = copy.deepcopy(trainer.forward)
    assert alone.fn.__self__ is not trainer and alone.fn.__self__.forward is alone
    _reset(alone.fn.__self__)
    torch.testing.assert_close(alone(x), torch.full((2, 1), 10.0))


def test_pickle_of_a_jitted_method_runs_the_unpickled_object() -> None:
    x = torch.ones(2, 3)
    trainer = _Trainer()
    trainer.forward(x)
    loaded = pickle.loads(pickle.dumps(trainer))
    assert loaded.forward.fn.__self__ is loaded and loaded.forward_model.fn is loaded.model
    _reset(loaded)
    torch.testing.assert_close(loaded.forward(x), torch.full((2, 1), 10.0))
    torch.testing.assert_close(loaded.forward_model(x), torch.full((2, 1), 5.0))


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


_aliased_step = pf.jit(_plus_one, backend="eager")


def test_plain_functions_copy_by_reference_and_an_alias_pickles() -> None:
    assert copy.deepcopy(_aliased_step) is _aliased_step and copy.copy(_aliased_step) is _aliased_step
    loaded = pickle.loads(pickle.dumps(_aliased_step))  # `step = pf.jit(_impl)`: not a global of its own name
    assert loaded.fn is _plus_one and loaded.backend == "eager"
    torch.testing.assert_close(loaded(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(pickle.PicklingError, match="local function or lambda"):
        pickle.dumps(pf.jit(lambda x: x))


def test_lowered_and_compiled_refuse_pickle_and_copies() -> None:
    # A pickled Lowered silently reported 0 flops / 0 bytes (its graph's metadata dropped); a deep copy on a mesh
    # failed inside torch; a copied Compiled no longer read the captured tensors its original reads.
    step = pf.jit(lambda w, x: torch.tanh(x @ w).sum(), backend="eager")
    lowered = step.lower(torch.randn(4, 4), torch.randn(2, 4))
    compiled = lowered.compile()
    for stage in (lowered, compiled):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied.*lower\(\*args\)"):
            pickle.dumps(stage)
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.deepcopy(stage)

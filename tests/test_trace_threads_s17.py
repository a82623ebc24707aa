"""Traces and threads (session 17): a trace's guards act in its own thread only, a cached step does not trace again
because another thread traces, a forked child gets torch's functions and the locks back, and refuses the parent's
virtual mesh rather than hanging; a donated virtual array prints, and pickling one names it."""

from __future__ import annotations

import contextlib
import copy
import io
import multiprocessing as mp
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn

import pt3func as pf
from pt3func import P
from pt3func.errors import ImpureFunctionError, ShardingError

pytestmark = pytest.mark.filterwarnings("ignore")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork start method")


@contextlib.contextmanager
def _tracing_in_another_thread(step_body: Callable[[torch.Tensor], torch.Tensor] = lambda x: x * 2) -> Iterator[None]:
    """Within the block, another thread is inside the trace of a jitted step (it waits there until the block ends)."""
    started, release = threading.Event(), threading.Event()

    @pf.jit(backend="eager")
    def slow(x):
        started.set()
        release.wait(20)  # at trace time only
        return step_body(x)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            slow(torch.ones(3))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(20)
    try:
        yield
    finally:
        release.set()
        t.join(30)
    assert not t.is_alive() and not errors, errors


def test_eager_code_of_other_threads_is_not_guarded_during_a_trace():
    """print(tensor), f-strings, loss.backward() and torch.manual_seed in the main thread raised ImpureFunctionError
    naming another thread's step, and the user's anomaly mode was switched off, while that step was traced."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    expected_grad = torch.func.grad(lambda w: torch.nn.functional.linear(x, w, model.bias).sum())(model.weight)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.autograd.set_detect_anomaly(True)
    try:
        with _tracing_in_another_thread():
            assert str(torch.tensor([1.5, 2.5])) == "tensor([1.5000, 2.5000])"
            assert f"{torch.tensor(3.0)}" == "3.0"
            assert torch.is_anomaly_enabled()  # the user's mode: torch keeps one for the whole process
            model(x).sum().backward()
            torch.manual_seed(5)
            draw = torch.rand(3)
    finally:
        torch.autograd.set_detect_anomaly(False)
    torch.testing.assert_close(model.weight.grad, expected_grad)
    torch.testing.assert_close(draw, expected_draw)


def test_guards_still_act_in_the_tracing_thread():
    """The guards made thread-local still refuse printing and reseeding inside a step traced in another thread."""
    box: dict = {}

    def run() -> None:
        for name, body in (("print", lambda x: (print(x), x)[1]), ("seed", lambda x: (torch.manual_seed(0), x)[1])):
            try:
                pf.jit(body, backend="eager")(torch.ones(2))
                box[name] = None
            except ImpureFunctionError as exc:
                box[name] = str(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert "printing or formatting a tensor" in box["print"]
    assert "manual_seed() inside jitted" in box["seed"]


def _child_after_fork_during_trace(q) -> None:
    """Run in a child forked while the parent's other thread traces: report what it finds."""
    from pt3func.trace import capture, module_modes

    found = {
        "repr": "tensor([1., 1.])" == repr(torch.ones(2)),
        "lock": capture.TRACE_LOCK.acquire(blocking=False),
        "no hook": module_modes._record not in nn.modules.module._global_forward_pre_hooks.values(),
        "train": nn.Module.train is module_modes._wrapped_train,
    }
    try:
        found["step"] = pf.jit(lambda x: x * 3, backend="eager")(torch.ones(2)).tolist() == [3.0, 3.0]
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        found["step"] = repr(exc)
    q.put(found)


@needs_fork
def test_child_forked_during_a_trace_gets_torch_back_and_can_trace():
    """A child forked while another thread traced (a DataLoader worker started meanwhile) inherited TRACE_LOCK held
    by a thread it does not have: its first jitted call hung; torch's functions stayed patched in it."""
    originals = (torch.Tensor.__repr__, torch.manual_seed, torch.autograd.backward)
    model = nn.Linear(2, 2)
    params, apply = pf.functionalize(model)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    # The traced step calls a module, so the recording hook and the `train` patch are installed at the fork.
    with _tracing_in_another_thread(lambda x: apply(params, x[:2])):
        assert torch.Tensor.__repr__ is not originals[0]
        child = ctx.Process(target=_child_after_fork_during_trace, args=(q,))
        child.start()
        child.join(30)
        if child.is_alive():
            child.kill()
            pytest.fail("the forked child hung")
    assert q.get(timeout=5) == {"repr": True, "lock": True, "no hook": True, "train": True, "step": True}
    assert (torch.Tensor.__repr__, torch.manual_seed, torch.autograd.backward) == originals


def test_cached_step_does_not_trace_again_while_another_thread_traces():
    """pt3func's own module-recording hook, installed while any thread traces, entered the cache key of
    module-calling steps as a global hook: the call traced again, and later calls (no trace running) once more."""
    torch.manual_seed(0)
    params, apply = pf.functionalize(nn.Linear(4, 4))

    @pf.jit(backend="eager")
    def g(p, x):
        return apply(p, x).sum()

    x = torch.randn(2, 4)
    expected = apply(params, x).sum()
    g(params, x)
    with _tracing_in_another_thread():
        torch.testing.assert_close(g(params, x), expected)
        assert g.trace_count() == 1
    g(params, x)
    assert g.trace_count() == 1
    # a hook of the user's still keys the step
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: o * 2)
    try:
        torch.testing.assert_close(g(params, x), apply(params, x).sum())  # eager runs the hook too
        torch.testing.assert_close(g(params, x), 2 * expected)
        assert g.trace_count() == 2
    finally:
        handle.remove()


def _virtual_mesh() -> pf.Mesh:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pf.make_mesh((2,), ("dp",), virtual=True)


def test_virtual_mesh_module_step_traces_once_per_rank():
    """On a virtual mesh one rank computed its cache key while the other's trace had the recording hook installed:
    the second call traced again on that rank (a recompile under Inductor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    params, apply = pf.functionalize(model)
    traces = []

    def step(p, x):
        traces.append(1)
        loss, g = pf.value_and_grad(lambda p: apply(p, x).pow(2).mean())(p)
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    mesh = _virtual_mesh()
    x = torch.randn(8, 6)
    with pf.set_mesh(mesh):
        jstep = pf.jit(step, in_shardings=(P(), P("dp")), backend="eager")
        p = pf.device_put(params, P())
        for _ in range(4):
            p, loss = jstep(p, x)
    ref = params
    for _ in range(4):
        ref, ref_loss = step(ref, x)
    torch.testing.assert_close(pf.device_get(loss), ref_loss)
    assert len(traces) == 4 + 2  # the eager reference's 4 calls, and one trace per rank


def _child_using_parents_mesh(q, x, f) -> None:
    try:
        q.put(("ok", pf.device_get(f(x)).tolist()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", type(exc).__name__, str(exc)))
    try:
        mesh = _virtual_mesh()
        y = pf.device_put(torch.arange(4.0), pf.NamedSharding(mesh, P("dp")))
        q.put(("own mesh", pf.device_get(f(y)).tolist()))
    except BaseException as exc:  # noqa: BLE001
        q.put(("own mesh", repr(exc)))


@needs_fork
def test_forked_child_refuses_the_parents_virtual_mesh():
    """A forked child calling a step (or device_get) on the parent's virtual mesh waited forever for rank threads
    that only the parent has."""
    mesh = _virtual_mesh()
    x = pf.device_put(torch.arange(4.0), pf.NamedSharding(mesh, P("dp")))
    f = pf.jit(lambda a: a * 2, backend="eager")
    assert pf.device_get(f(x)).tolist() == [0.0, 2.0, 4.0, 6.0]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child_using_parents_mesh, args=(q, x, f))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung on the parent's virtual mesh")
    kind, name, message = q.get(timeout=5)
    assert (kind, name) == ("error", ShardingError.__name__)
    assert "forked" in message and "Make the mesh in the child" in message and "spawn" in message
    assert q.get(timeout=5) == ("own mesh", [0.0, 2.0, 4.0, 6.0])  # a mesh made in the child works
    assert pf.device_get(f(x)).tolist() == [0.0, 2.0, 4.0, 6.0]  # the parent's is unaffected


def test_donated_virtual_array_prints():
    """repr / str / f-string of a donated virtual array raised DonationError (a donated tensor prints)."""
    mesh = _virtual_mesh()
    w = pf.device_put(torch.ones(4, 2), pf.NamedSharding(mesh, P("dp")))
    def double(w):
        return w * 2

    jitted = pf.jit(double, donate_argnums=0, backend="eager")
    out = jitted(w)
    plain = torch.ones(2)
    jitted(plain)  # a donated plain tensor prints as DonatedTensor(<donated to jitted '...double'>)
    assert repr(plain).startswith("DonatedTensor(<donated to jitted '") and repr(plain).endswith("double'>)")
    assert repr(w) == str(w) == f"{w}" == repr(plain).replace("DonatedTensor", "VirtualArray")
    with pytest.raises(pf.DonationError):
        w.sum()
    assert repr(out).startswith("VirtualArray(shape=(4, 2)")
    torch.testing.assert_close(pf.device_get(out), torch.full((4, 2), 2.0))


def test_pickling_a_virtual_array_names_it():
    """torch.save / pickle of virtual-mesh params failed with "cannot pickle 'HashStore' object", naming no pt3func
    object; copy.copy and copy.deepcopy keep working."""
    mesh = _virtual_mesh()
    params = pf.device_put({"w": torch.randn(4, 3)}, pf.NamedSharding(mesh, P("dp")))
    for save in (lambda t: torch.save(t, io.BytesIO()), pickle.dumps):
        with pytest.raises(pickle.PicklingError, match=r"VirtualArray\(shape=\(4, 3\).*pf.device_get.*checkpointing"):
            save({"params": params})
    full = pf.device_get(params)
    for copied in (copy.copy(params["w"]), copy.deepcopy(params["w"])):
        torch.testing.assert_close(pf.device_get(copied), full["w"])
    assert torch.load(io.BytesIO(_saved(full)))["w"].equal(full["w"])  # the way out the error names


def _saved(tree) -> bytes:
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return buffer.getvalue()

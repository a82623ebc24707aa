"""Trace a pure function of flat tensors into one aten FX graph, refusing impure or dynamic steps.

The trace runs in fake mode (no real compute, no real memory), records the whole step (forward,
the backward that `torch.autograd.grad` runs, the optimizer) and the user's source line of every op.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.overrides import TorchFunctionMode

from pt3func.errors import DataDependentControlFlowError, ImpureFunctionError, TracingError
from pt3func.trace.source import (
    describe,
    is_stdlib_file,
    is_third_party_file,
    is_user_file,
    library_frame_in_traceback,
    user_frame_in_stack_trace,
    user_frame_in_traceback,
)
from pt3func.trace.torch_checkpoint import torch_checkpoint_as_regions

_DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (GuardOnDataDependentSymNode,)
try:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    _DATA_DEPENDENT_ERRORS += (DataDependentOutputException, DynamicOutputShapeException)
except ImportError:  # pragma: no cover - names are stable across 2.11-2.13
    pass

try:
    from torch.fx.experimental.symbolic_shapes import PendingUnbackedSymbolNotFound

    _DATA_DEPENDENT_ERRORS += (PendingUnbackedSymbolNotFound,)  # a boolean mask's shape, met by DTensor
except ImportError:  # pragma: no cover
    pass

# How a data-dependent read surfaces in a sharded step, where DTensor's dispatch wraps or replaces torch's error:
# a RuntimeError carrying the guard's message (DTensor hashes its op schema), DTensor's refusal of .tolist(), or
# the missing sharding rule of an op whose output shape depends on values.
_DATA_DEPENDENT_MESSAGES = ("Could not guard on data-dependent expression", ".tolist() is not supported for tensor "
                            "subclasses",
                            # torch.func.vmap's refusal of `.item()` / `if t` on a batched tensor (pf.vmap in a step)
                            "vmap: It looks like you're")
_VALUE_SHAPED_OPS = ("aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique", "aten.argwhere",
                     "aten.nonzero_numpy", "aten.repeat_interleave.Tensor")


def _is_data_dependent(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a read of a tensor's value into Python or a value-dependent shape."""
    if isinstance(exc, TracingError):  # ours (the print guard, ...): already says what is wrong
        return False
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, _DATA_DEPENDENT_ERRORS):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and any(m in text for m in _DATA_DEPENDENT_MESSAGES):
            return True
        if isinstance(exc, TypeError) and "FakeTensor" in text:
            # A traced tensor where torch wants a Python number (`torch.zeros(batch_sizes[0])` in a packed
            # sequence's RNN: "argument 'size' ... got FakeTensor")
            return True
        if isinstance(exc, NotImplementedError) and "sharding strategy" in text and any(
            f"{op}." in text or f"{op} " in text for op in _VALUE_SHAPED_OPS
        ):
            return True
        exc = exc.__cause__  # an explicit `raise ... from`: not any error met while handling another
        seen += 1
    return False


# make_fx, our print guard and Inductor patch process-wide state: one trace or compile at a time, which
# matters for the virtual mesh, whose ranks are threads of one process.
TRACE_LOCK = threading.RLock()

# The names of the steps this thread traces now, innermost last (a jitted step inlined in another's trace nests).
# The guards below patch torch process-wide, but act only in a tracing thread: another thread's eager code (a
# training loop printing metrics, calling loss.backward() or torch.manual_seed while a background thread compiles
# an eval step) is not inside any step.
_TRACING = threading.local()

# Undo functions of what the traces running now patched, outermost first: a child forked meanwhile (a DataLoader
# worker started while another thread traces) has no tracing thread to put the originals back (`_after_fork`).
_UNDO: list[Callable[[], None]] = []


def _in_trace() -> bool:
    """Whether the calling thread runs inside a trace: its own, or a trace's backward that autograd runs in a device
    thread (fake CUDA tensors), which has the tracing thread's proxy mode but not its thread-local state."""
    if getattr(_TRACING, "names", None):
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


@contextlib.contextmanager
def _tracing_in_this_thread(fn_name: str) -> Iterator[None]:
    names = getattr(_TRACING, "names", None)
    if names is None:
        names = _TRACING.names = []
    names.append(fn_name)
    try:
        yield
    finally:
        names.pop()


@contextlib.contextmanager
def _undone_in_forked_child(undo: Callable[[], None]) -> Iterator[None]:
    """Run `undo` on exit; registered meanwhile, so a child forked inside the block runs it too (`_after_fork`)."""
    _UNDO.append(undo)
    try:
        yield
    finally:
        undo()
        _UNDO.remove(undo)


def _after_fork() -> None:
    """In a child forked while another thread of the parent traced: that thread does not exist here, so put back what
    its trace patched (the child's own eager code and traces see torch's functions) and free TRACE_LOCK, which it
    held. A child forked by the thread holding the lock (inside the step) is left as it is: its trace goes on."""
    if getattr(_TRACING, "names", None) or TRACE_LOCK._is_owned():
        return
    for undo in reversed(_UNDO):
        undo()
    _UNDO.clear()
    TRACE_LOCK._at_fork_reinit()  # in place: other modules imported the lock object itself


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(after_in_child=_after_fork)

_FIX_CONTROL_FLOW = (
    "A jitted step is traced once into a static program, so it cannot branch in Python on a tensor's "
    "value. Use torch.where / masking, or pass the value as a static argument (static_argnums / "
    "static_argnames) so each value gets its own program."
)


@contextlib.contextmanager
def _no_printing_traced_tensors(fn_name: str) -> Iterator[None]:
    """Make `print(t)` / `str(t)` / f-strings of a traced tensor inside user code raise, not print garbage."""
    originals = {name: getattr(torch.Tensor, name) for name in ("__repr__", "__str__", "__format__")}

    def guarded(name: str) -> Callable:
        original = originals[name]

        def method(self: torch.Tensor, *args: object, **kwargs: object) -> str:
            if not _in_trace():
                return original(self, *args, **kwargs)
            caller = sys._getframe(1)
            while caller.f_back is not None and is_stdlib_file(caller.f_code.co_filename):
                caller = caller.f_back  # pprint, logging, reprlib formatting it for the user
            if is_user_file(caller.f_code.co_filename):
                raise ImpureFunctionError(
                    f"{describe(caller.f_code.co_filename, caller.f_lineno)}: printing or formatting a tensor "
                    f"inside jitted '{fn_name}' is I/O, which a static program cannot do (the value does not "
                    "exist while tracing). Return the value as an output (e.g. in a metrics dict) and print "
                    "it outside the step."
                )
            return original(self, *args, **kwargs)  # torch's __repr__ passes tensor_contents= back to itself

        return method

    with _attributes_replaced([(torch.Tensor, name, guarded(name)) for name in originals]):
        yield


@contextlib.contextmanager
def _attributes_replaced(replacements: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each `(owner, name, value)` for the duration; the originals are put back after."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]

    def put_back() -> None:
        for owner, name, original in originals:
            setattr(owner, name, original)

    with _undone_in_forked_child(put_back):
        for owner, name, value in replacements:
            setattr(owner, name, value)
        yield


@contextlib.contextmanager
def _no_file_io(fn_name: str) -> Iterator[None]:
    """Make `open()` called by user code inside the step raise (also through pathlib, io, json.load's caller): a trace
    runs the step's Python once, so the file would be read or written once while tracing, never at later calls."""
    original = builtins.open

    def guarded(*args: object, **kwargs: object) -> object:
        if _in_trace():
            caller = sys._getframe(1)
            while caller.f_back is not None and is_stdlib_file(caller.f_code.co_filename):
                caller = caller.f_back  # pathlib's Path.open / read_text, io.open called for the user
            # Libraries read their own files lazily (networkx its entry points when torch first imports it): only
            # the user's own code is refused.
            filename = caller.f_code.co_filename
            if is_user_file(filename) and not is_third_party_file(filename):
                target = args[0] if args else kwargs.get("file", "")
                raise ImpureFunctionError(
                    f"{describe(caller.f_code.co_filename, caller.f_lineno)}: opening a file ({target!r}) inside "
                    f"jitted '{fn_name}' is I/O, which a static program cannot do: it would happen once while "
                    "tracing, never at later calls. Read the file before the step and pass its contents in, or "
                    "write the step's outputs after it returns."
                )
        return original(*args, **kwargs)

    with _attributes_replaced([(builtins, "open", guarded), (io, "open", guarded)]):
        yield


_SEEDING = (("torch", "manual_seed"), ("torch.random", "manual_seed"), ("torch", "seed"), ("torch.random", "seed"),
            ("torch.cuda", "manual_seed"), ("torch.cuda", "manual_seed_all"),
            ("torch", "set_rng_state"), ("torch.random", "set_rng_state"), ("torch.cuda", "set_rng_state"),
            ("torch.cuda", "set_rng_state_all"))
# Methods of torch.Generator (a C type: they cannot be patched) that set its state.
_GENERATOR_SETTERS = frozenset({"manual_seed", "seed", "set_state", "graphsafe_set_state"})


@contextlib.contextmanager
def _no_reseeding(fn_name: str) -> Iterator[None]:
    """Make `torch.manual_seed` (and friends) called by user code inside the step raise: a trace runs the step's
    Python once, so the program would not reseed at later calls (its draws would differ from eager's)."""
    import importlib

    patched = []
    for module_name, attr in _SEEDING:
        module = importlib.import_module(module_name)
        original = getattr(module, attr, None)
        if original is None:
            continue

        def guarded(*args: object, _original: Callable = original, _attr: str = attr, **kwargs: object) -> object:
            if not _in_trace():
                return _original(*args, **kwargs)
            caller = sys._getframe(1)
            while caller.f_back is not None and is_stdlib_file(caller.f_code.co_filename):
                caller = caller.f_back  # pprint, logging, reprlib formatting it for the user
            if is_user_file(caller.f_code.co_filename):
                raise ImpureFunctionError(
                    _reseeding_message(describe(caller.f_code.co_filename, caller.f_lineno), f"{_attr}()", fn_name)
                )
            return _original(*args, **kwargs)

        patched.append((module, attr, guarded))
    with _attributes_replaced(patched):
        yield


def _reseeding_message(where: str, call: str, fn_name: str) -> str:
    return (
        f"{where}: {call} inside jitted '{fn_name}' sets the global generator, which happens once while tracing, "
        "not at every call. Seed before calling the step (torch.manual_seed(s); step(...) reproduces its draws), "
        "or pass a torch.Generator to the random ops."
    )


# torch.set_default_dtype and torch.set_default_tensor_type both end in these: patched rather than the Python
# wrappers, so a name imported before the trace (`from torch import set_default_dtype`) is covered too.
_DEFAULT_DTYPE_SETTERS = {"_set_default_dtype": "set_default_dtype",
                          "_set_default_tensor_type": "set_default_tensor_type"}
_TORCH_INIT = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "__init__.py")


@contextlib.contextmanager
def _no_default_dtype_changes(fn_name: str) -> Iterator[None]:
    """Make a change of the default dtype by user code inside the step raise.

    The trace records a factory op without a dtype (`aten.ones([4])`) and a Python scalar's promotion
    (`aten.div.Tensor(int64, 3.0)`) as torch calls them, and the program runs them under the default dtype of its
    caller: the dtype the step set while traced was lost (its float64 table computed in float32). A set that
    changes nothing runs (the restore in a `finally` after this refusal, a library setting the dtype already set);
    so does torch's own (its numpy layer sets and restores the dtype around a conversion).
    """
    import torch._C as C

    patched = []
    for name, public in _DEFAULT_DTYPE_SETTERS.items():
        original = getattr(C, name)

        def guarded(value: Any, _original: Callable = original, _public: str = public) -> None:
            dtype = value if _public == "set_default_dtype" else getattr(value, "dtype", None)
            if not _in_trace() or dtype == torch.get_default_dtype():
                return _original(value)
            caller = sys._getframe(1)
            while caller.f_back is not None and (is_stdlib_file(caller.f_code.co_filename)
                                                 or os.path.abspath(caller.f_code.co_filename) == _TORCH_INIT):
                caller = caller.f_back  # torch.set_default_dtype's wrapper, a contextlib-made context manager
            if is_user_file(caller.f_code.co_filename):
                raise ImpureFunctionError(
                    f"{describe(caller.f_code.co_filename, caller.f_lineno)}: torch.{_public}() inside jitted "
                    f"'{fn_name}' changes the default dtype, which a trace cannot record: the program would run the "
                    "step's factory ops (torch.ones(n)) and Python-scalar promotions under the default dtype of the "
                    "code calling it, not the one set here. Set the default dtype around the call instead "
                    "(torch.set_default_dtype(d); step(...): a program is kept per default dtype), or give the "
                    "ops in the step an explicit dtype (torch.ones(n, dtype=torch.float64), x.double())."
                )
            return _original(value)

        patched.append((C, name, guarded))
    with _attributes_replaced(patched):
        yield


def _default_generator_states() -> list[torch.Tensor]:
    """The states of torch's default generators: the CPU one, and CUDA's where CUDA is started."""
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators += list(torch.cuda.default_generators)
    return [g.get_state() for g in generators]


def _check_default_generators_untouched(before: list[torch.Tensor], retrace: Callable[[], object],
                                        fn_name: str) -> None:
    """Refuse a step that set a default generator's state while traced (`torch.default_generator.manual_seed(s)`),
    which a program would not do at its calls; `torch.manual_seed` and `set_rng_state` are refused as they run.

    A trace draws nothing (its tensors are fake), so a changed state means a setter ran, here or in another
    thread (a data loader's). `retrace` runs the trace again with a profiler hook on this thread only, which
    finds the user's line; nothing found there, the change came from elsewhere and the step is kept.
    """
    from pt3func.runtime import virtual

    if virtual.in_rank_thread():
        return  # a virtual mesh's other ranks draw from the same generators meanwhile: no retrace for each of them
    after = _default_generator_states()
    if len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before)):
        return
    found: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if (event == "c_call" and not found and isinstance(getattr(arg, "__self__", None), torch.Generator)
                and getattr(arg, "__name__", "") in _GENERATOR_SETTERS and is_user_file(frame.f_code.co_filename)):
            found.append(f"{describe(frame.f_code.co_filename, frame.f_lineno)}: Generator.{arg.__name__}()")

    sys.setprofile(hook)
    try:
        retrace()
    except Exception:  # noqa: BLE001 - the first trace succeeded; only the setter's line is looked for
        pass
    finally:
        sys.setprofile(None)
    if found:  # the user's setter ran (twice): the generators as they were before the step was traced
        _set_default_generator_states(before)
        where, call = found[0].split(": ", 1)
        raise ImpureFunctionError(_reseeding_message(where, call, fn_name))


def _set_default_generator_states(states: list[torch.Tensor]) -> None:
    torch.default_generator.set_state(states[0])
    for g, state in zip(torch.cuda.default_generators if len(states) > 1 else (), states[1:]):
        g.set_state(state)


_BACKWARD_CALLERS = ("torch/utils/checkpoint.py", "torch/autograd/function.py")


@contextlib.contextmanager
def _no_backward(fn_name: str) -> Iterator[None]:
    """Make `loss.backward()` / `torch.autograd.backward` called by user code inside the step raise: it writes
    `.grad` of tensors outside the step (a closure module's parameters), which a program cannot do; they were left
    holding the trace's fake tensors and the model never trained. `Tensor.backward` calls
    `torch.autograd.backward`, so patching that module attribute covers both."""
    original = torch.autograd.backward

    def guarded(*args: object, **kwargs: object) -> object:
        # The nearest user frame is the caller, unless torch calls it on its own behalf on the way (a reentrant
        # checkpoint's or a custom Function's backward): those are left alone.
        if not _in_trace():
            return original(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            if frame.f_code.co_filename.replace("\\", "/").endswith(_BACKWARD_CALLERS):
                frame = None
                break
            frame = frame.f_back
        if frame is not None:
            raise ImpureFunctionError(
                f"{describe(frame.f_code.co_filename, frame.f_lineno)}: .backward() inside jitted '{fn_name}' "
                "accumulates into .grad of tensors outside the step, which a static program cannot do. Take the "
                "gradient as a value: grads = pf.grad(loss_fn)(params, ...) or loss, grads = "
                "pf.value_and_grad(loss_fn)(params, ...), and return it (apply the update in the step too)."
            )
        return original(*args, **kwargs)

    with _attributes_replaced([(torch.autograd, "backward", guarded)]):
        yield


@contextlib.contextmanager
def _record_user_frames() -> Iterator[None]:
    """Keep the user's frames in each node's stack trace.

    make_fx's tracer keeps only frames named `forward` (it was written for nn.Modules); a pure step has
    none, so swap in a filter that keeps every frame outside torch and pt3func.
    """
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    had_own = "_filter_traceback_frames" in PythonKeyTracer.__dict__
    original = PythonKeyTracer.__dict__.get("_filter_traceback_frames")

    def keep_user_frames(self: object, summary: traceback.StackSummary) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([f for f in summary if is_user_file(f.filename)])

    def put_back() -> None:
        if had_own:
            PythonKeyTracer._filter_traceback_frames = original
        elif "_filter_traceback_frames" in PythonKeyTracer.__dict__:
            del PythonKeyTracer._filter_traceback_frames

    with _undone_in_forked_child(put_back):
        PythonKeyTracer._filter_traceback_frames = keep_user_frames
        yield


@contextlib.contextmanager
def _dtensor_bookkeeping_untraced() -> Iterator[None]:
    """Run DTensor's shard-offset arithmetic outside the trace.

    DTensor computes a block's offsets with small index tensors (`torch.arange(...)`, `.tolist()`, `int(t[0])`).
    Under make_fx those are fake: `_StridedShard` (what a view of a sharded dim gives) recorded thousands of dead
    nodes, and `int(offsets[0])` is a data-dependent read that failed the trace (argmax / argmin over a split
    dim: its handler converts local indices to global ones). Outside the trace they are small real tensors and
    the offsets plain ints.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import _utils as dtensor_utils
    from torch.distributed.tensor import placement_types
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    targets = [(getattr(placement_types, "_StridedShard", None), "local_shard_size_and_offset"),
               (dtensor_utils, "_get_shard_size_and_offsets"), (dtensor_utils, "_get_first_offset")]
    patched = []
    for owner, name in targets:
        raw = vars(owner).get(name) if owner is not None else None
        if raw is None or isinstance(raw, (staticmethod, classmethod)):
            continue

        def untraced(*args: object, _raw: Callable = raw, **kwargs: object) -> object:
            with unset_fake_temporarily(), disable_proxy_modes_tracing():
                return _raw(*args, **kwargs)

        patched.append((owner, name, untraced))
    with _attributes_replaced(patched):
        yield


# In-place fills whose fake-tensor implementation (torch's reference) refuses a generator: their parameters.
_FILLS_WITHOUT_FAKE_GENERATOR = {
    torch.Tensor.exponential_: (("lambd", 1.0),),
    torch.Tensor.geometric_: (("p", None),),
    torch.Tensor.cauchy_: (("median", 0.0), ("sigma", 1.0)),
    torch.Tensor.log_normal_: (("mean", 1.0), ("std", 2.0)),
}


def _fill_with_generator(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """`x.exponential_(..., generator=g)` (and the other `_FILLS_WITHOUT_FAKE_GENERATOR`) traced as
    `x.copy_(pt3func::random_fill(...))`: the same fill of a buffer with `x`'s layout from `g` (fake tensors
    failed with "generator is not supported in refs")."""
    from pt3func.passes.random_fills import generator_key

    x, *given = args
    names = _FILLS_WITHOUT_FAKE_GENERATOR[func]
    numbers = [float(kwargs.get(name, given[i] if i < len(given) else default)) for i, (name, default) in
               enumerate(names) if i < len(given) or name in kwargs or default is not None]
    drawn = torch.ops.pt3func.random_fill.default(
        list(x.shape), list(x.stride()), x.dtype, x.device, func.__name__, numbers, None,
        generator_key(kwargs["generator"]),
    )
    return x.copy_(drawn)


RECURRENT_KERNELS = frozenset({torch._C._VariableFunctions.lstm, torch._C._VariableFunctions.gru,
                                torch._C._VariableFunctions.rnn_tanh, torch._C._VariableFunctions.rnn_relu})


class _TracedCallRules(TorchFunctionMode):
    """Calls a trace handles its own way.

    - Recurrent layers go through their plain kernels, not oneDNN's (CPU). With oneDNN on, `nn.LSTM` on CPU lowers
      to `mkldnn_rnn_layer`, whose traced backward reads a workspace the fake forward never made: every pf.jit of
      an LSTM step on CPU failed ("Expected a proper Tensor but got None ... 'workspace'"). CUDA's kernels are
      not affected; the rest of the step keeps oneDNN.
    - `F.embedding(..., sparse=True)` (`nn.Embedding(sparse=True)`) differentiated is refused: its sparse
      gradient cannot be traced, and failed with a misleading data-dependent error (with `padding_idx`) or inside
      Inductor. Without a gradient the lookup runs as a dense one (the same values).
    """

    def __init__(self, fn_name: str) -> None:
        super().__init__()
        self.fn_name = fn_name

    def __torch_function__(self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if func in RECURRENT_KERNELS:
            with torch.backends.mkldnn.flags(enabled=False):
                return func(*args, **kwargs)
        if func in _FILLS_WITHOUT_FAKE_GENERATOR and kwargs.get("generator") is not None:
            return _fill_with_generator(func, args, kwargs)
        if func is torch.nn.functional.embedding and (kwargs.get("sparse") or (len(args) > 6 and args[6])):
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if not (torch.is_grad_enabled() and getattr(weight, "requires_grad", False)):
                # no gradient taken: sparse only changes the backward, the lookup is the same
                args, kwargs = args[:6], {**kwargs, "sparse": False}
                return func(*args, **kwargs)
            raise TracingError(
                f"{_user_location()}: an embedding with sparse=True inside jitted '{self.fn_name}': its sparse "
                "gradient cannot be traced into a program. Use sparse=False (nn.Embedding's default); the dense "
                "gradient gives the same numbers."
            )
        return func(*args, **kwargs)


def _user_location() -> str:
    """`file:line` of the innermost user frame calling now, for errors raised from inside torch's calls."""
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return describe(frame.f_code.co_filename, frame.f_lineno) if frame is not None else "in the step"


def _user_stacklevel() -> int:
    """The `stacklevel` of `warnings.warn`, called by this function's caller, that names the innermost user
    frame (the line calling the jitted step); 2 (the caller) when none is found."""
    frame, level = sys._getframe(1), 1
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


_PT3FUNC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_pt3func_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PT3FUNC_DIR)


class _FinishedTraceMode(FakeTensorMode):
    """A finished trace's fake mode: a tensor of it used by the user's code raises, where it gave more fake tensors
    (`t.sum()`) or torch's GuardOnDataDependentSymNode (`float(t)`).

    A value can leave a trace through a side channel (a forward hook storing activations in a dict, a global, a
    list the step appends to). It is a FakeTensor of the trace's mode; used outside any fake mode, FakeTensor's
    dispatch enters that mode (`with fake_mode:`), which lands here. pt3func's own passes, which compute on the
    graph's fake values after the trace, and anything running inside another fake mode are left alone. Runs
    only when an escaped value is used: no cost to traces or calls."""

    _pt3func_step = "the step"

    def __enter__(self) -> FakeTensorMode:
        caller = sys._getframe(1)
        if caller.f_code.co_name == "__torch_dispatch__" and caller.f_code.co_filename.endswith("fake_tensor.py"):
            frame = caller.f_back
            while frame is not None and not (is_user_file(frame.f_code.co_filename)
                                             or _is_pt3func_file(frame.f_code.co_filename)):
                frame = frame.f_back
            if frame is not None and is_user_file(frame.f_code.co_filename):
                raise TracingError(
                    f"{describe(frame.f_code.co_filename, frame.f_lineno)}: uses a value that escaped from inside "
                    f"jitted '{self._pt3func_step}' while it was traced (kept by a forward hook, a global, a "
                    "closure's dict or list): it is a placeholder (FakeTensor) that only exists during tracing, as "
                    "JAX's UnexpectedTracerError says. Return the value from the step (an activations or metrics "
                    "dict among its outputs) instead."
                )
        return super().__enter__()


def _finish_fake_mode(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], fn_name: str) -> None:
    """Make the fake tensors of the trace that made `gm` refuse later use by user code (`_FinishedTraceMode`)."""
    from torch.distributed.tensor import DTensor

    def fake_of(value: object) -> FakeTensor | None:
        value = value._local_tensor if isinstance(value, DTensor) else value
        return value if isinstance(value, FakeTensor) else None

    mode = None
    for node in gm.graph.nodes:
        if (fake := fake_of(node.meta.get("val"))) is not None:
            mode = fake.fake_mode
            break
    # A mode given by the inputs or active around the trace (the user's own FakeTensorMode, another trace's) lives
    # on: it is not this trace's.
    if mode is None or type(mode) is not FakeTensorMode or torch._C._get_dispatch_mode(
        torch._C._TorchDispatchModeKey.FAKE
    ) is not None or any(
        (fake := fake_of(x)) is not None and fake.fake_mode is mode for x in example_inputs
    ):
        return
    mode.__class__ = _FinishedTraceMode
    mode._pt3func_step = fn_name


def trace(
    fn: Callable[..., Sequence[torch.Tensor]], example_inputs: Sequence[torch.Tensor], fn_name: str
) -> torch.fx.GraphModule:
    """Trace `fn(*flat_tensors) -> list of tensors` into an aten GraphModule (fake mode, stack traces kept)."""
    try:
        with TRACE_LOCK, _tracing_in_this_thread(fn_name), _no_printing_traced_tensors(fn_name), \
                _no_reseeding(fn_name), _no_default_dtype_changes(fn_name), _no_backward(fn_name), \
                _no_file_io(fn_name), _record_user_frames(), _dtensor_bookkeeping_untraced(), \
                _TracedCallRules(fn_name), _inlining_compiled_functions(), _anomaly_nan_checks_off(fn_name), \
                torch_checkpoint_as_regions():
            # Tensors captured from a closure or global are real: they enter the graph as constants (get_attr),
            # read by the program at every call. Without this flag fake mode refused them with an internal error.
            def traced() -> torch.fx.GraphModule:
                gm = make_fx(fn, tracing_mode="fake", record_stack_traces=True, _allow_non_fake_inputs=True)(
                    *example_inputs
                )
                _finish_fake_mode(gm, example_inputs, fn_name)
                return gm

            states = _default_generator_states()
            gm = traced()
            _check_default_generators_untouched(states, traced, fn_name)
    except SyntaxError as exc:
        # FX prints each op as Python: an overload named after a keyword (`aten.random_.from`, from
        # `Tensor.random_(low, high)`) cannot be printed, and make_fx fails in its code generation.
        raise TracingError(
            f"in '{fn_name}': torch's FX could not write the traced program as Python at `{(exc.text or '').strip()}` "
            "(an op overload named after a Python keyword, such as Tensor.random_(from, to)). Use another "
            "spelling of the op (torch.randint(low, high, shape) for random_(low, high))."
        ) from None
    except Exception as exc:
        _refuse_fake_kernel_gaps(exc, fn_name)
        if not _is_data_dependent(exc):
            raise
        frame = user_frame_in_traceback(exc.__traceback__)
        where = describe(*frame) if frame else f"in '{fn_name}'"
        inner = library_frame_in_traceback(exc.__traceback__)
        inside = f" (inside {describe(*inner)})" if inner else ""
        if inner and f"distributions{os.sep}" in inner[0]:
            fix = (
                "torch.distributions checks its arguments' values (validate_args): pass validate_args=False to the "
                "distribution, or call torch.distributions.Distribution.set_default_validate_args(False)."
            )
        else:
            fix = _FIX_CONTROL_FLOW
        raise DataDependentControlFlowError(
            f"{where}{inside}: Python control flow on a tensor's value, or a read of it into Python (`if t`, "
            f"float(t), int(t), a tensor as a size or slice bound). {fix}"
        ) from None
    # DTensor's own bookkeeping (mesh coordinates read with .tolist()) leaves dead scalar reads behind;
    # only values the program uses count.
    eliminate_dead_code(gm.graph)
    gm.recompile()
    check_static(gm, fn_name)
    return gm


def _refuse_fake_kernel_gaps(exc: BaseException, fn_name: str) -> None:
    """Raise a TracingError naming the user's line for an op whose tracing (meta) kernel refuses what its real
    kernel runs; torch's own message points nowhere near the step."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and "Expected inputs of BF16 type" in text):
        return
    # aten._grouped_mm's meta kernel follows the CUDA kernel (bfloat16 only); the CPU kernel runs float32 too, so a
    # step that runs eagerly fails to trace (Hugging Face's MoE experts, `experts_implementation="grouped_mm"`).
    frame = user_frame_in_traceback(exc.__traceback__)
    inner = library_frame_in_traceback(exc.__traceback__)
    where = describe(*frame) if frame else f"in '{fn_name}'"
    inside = f" (inside {describe(*inner)})" if inner else ""
    raise TracingError(
        f"{where}{inside}: torch cannot trace aten._grouped_mm on this dtype: its tracing kernel takes bfloat16 "
        f"only, though the CPU kernel runs it eagerly ({text.splitlines()[0][:160]}). Run those matmuls in "
        "bfloat16, or another way (a Hugging Face MoE model: config._experts_implementation = 'batched_mm')."
    ) from None


_warned_anomaly = False


@contextlib.contextmanager
def _anomaly_nan_checks_off(fn_name: str) -> Iterator[None]:
    """Trace with the NaN checks of autograd's anomaly detection off, put back after.

    Under `torch.autograd.set_detect_anomaly(True)` the autograd engine checks each backward output for NaN by
    reading its value (`isnan(t).any()` into Python): in a trace every step taking a gradient failed with a
    data-dependent-control-flow error blaming the user's code. A compiled program has no such checks anyway.

    torch keeps anomaly mode for the whole process, not per thread: only `check_nan` is switched off (anomaly mode
    itself stays on), so other threads keep the mode they set, but do not check for NaN while a trace runs.
    """
    global _warned_anomaly
    if not torch.is_anomaly_enabled():
        yield
        return
    if not _warned_anomaly:
        _warned_anomaly = True
        warnings.warn(
            f"jitted '{fn_name}': torch.autograd.set_detect_anomaly(True) is on, but anomaly detection (NaN checks, "
            "forward tracebacks) does not run inside a compiled program; the step is traced without it. Run the "
            "function without pf.jit to hunt a NaN.",
            stacklevel=_user_stacklevel(),
        )
    if not torch.is_anomaly_check_nan_enabled():
        yield
        return

    def put_back() -> None:
        # Only while the mode is the one set here: another thread may have set its own meanwhile.
        if torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled():
            torch.autograd.set_detect_anomaly(True, check_nan=True)

    with _undone_in_forked_child(put_back):
        torch.autograd.set_detect_anomaly(True, check_nan=False)
        yield


@contextlib.contextmanager
def _inlining_compiled_functions() -> Iterator[None]:
    """A `torch.compile`d model or function called inside the step is traced through (its code is part of the
    program pt3func compiles), as outside `pf.jit` it runs; Dynamo refused it ("Detected that you are using FX to
    symbolically trace a dynamo-optimized function")."""
    import torch._dynamo

    with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
        yield


def _where(node: torch.fx.Node, fn_name: str) -> str:
    frame = user_frame_in_stack_trace(node.meta.get("stack_trace"))
    return describe(*frame) if frame else f"in '{fn_name}'"


def check_static(gm: torch.fx.GraphModule, fn_name: str) -> None:
    """Refuse reads of tensor values into Python (`.item()`, `.tolist()`) and data-dependent shapes."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._local_scalar_dense.default:
            raise DataDependentControlFlowError(
                f"{_where(node, fn_name)}: reads a tensor's value into Python (.item(), .tolist(), float(t), "
                f"int(t)). {_FIX_CONTROL_FLOW}"
            )
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val.shape):
            raise DataDependentControlFlowError(
                f"{_where(node, fn_name)}: `{node.target}` gives a shape that depends on tensor values "
                "(boolean masking, nonzero, unique ...). A static program needs static shapes: use "
                "torch.where or a mask multiply instead."
            )


def _is_view(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


# Batch-norm kernels that update `running_mean` / `running_var` in place when `training` is true although their
# schemas carry no `(a!)` annotation: without this, remat recomputes them (a second momentum update of the
# statistics) and an input written by them is not refused.
_UNANNOTATED_STAT_WRITERS = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"})


def _argument(node: torch.fx.Node, index: int, name: str) -> Any:
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Node arguments the op writes in place (from its schema's alias annotations)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        written = arg.alias_info is not None and arg.alias_info.is_write
        if not written and schema.name.removeprefix("aten::") in _UNANNOTATED_STAT_WRITERS:
            written = arg.name in ("running_mean", "running_var") and bool(_argument(node, 5, "training"))
        if written:
            value = _argument(node, i, arg.name)
            # `Tensor(a!)[]`: the `torch._foreach_*_` ops write every tensor of a list (an EMA's lerp_).
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.fx.Node):
                    out.append(item)
    return out


def eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """FX's dead-code elimination, keeping ops that write an argument their schema does not mark (batch norm's
    running statistics): a step that returns only the updated statistics (BN recalibration) would lose them."""
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or bool(mutated_args(n)))


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow view ops (view, t, slice, detach, ...) back to the node that owns the storage.

    Also steps through `operator.getitem` of an op whose list result aliases its input (`Tensor(a)[]`: unbind,
    split, chunk, split_with_sizes): the piece is a view, though getitem itself has no schema to say so.
    """
    import operator  # local: only this function (edited apart from the rest of the module) needs it

    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        if not (_is_view(node.target) or (node.target is operator.getitem and _is_view(node.args[0].target))):
            break
        node = node.args[0]
    return node


def check_no_input_mutation(gm: torch.fx.GraphModule, input_names: Sequence[str], fn_name: str) -> None:
    """Refuse in-place writes into an input (or a view of one) or into a tensor captured from outside."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders, input_names))
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for target in mutated_args(node):
            root = storage_root(target)
            if root.op == "placeholder":
                what = f"input {names.get(root, root.name)}"
            elif root.op == "get_attr":
                what = "a tensor captured from outside the step (a closure or global)"
            else:
                continue
            op = getattr(node.target, "__name__", str(node.target))
            raise ImpureFunctionError(
                f"{_where(node, fn_name)}: `{op}` writes in place into {what}. A jitted step must be pure: "
                "compute a new tensor and return it (x = x + 1, not x += 1); to reuse the input's memory, "
                "donate it (donate_argnums)."
            )

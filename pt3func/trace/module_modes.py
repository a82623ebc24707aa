"""The train / eval mode of the `nn.Module`s a step calls: part of its jit signature.

A trace reads `module.training` once (dropout on or off, batch norm's batch or running statistics) and the program
keeps that choice. `pf.functionalize`'s `apply` runs "in the module's current mode", and a closure module's
`.eval()` is how PyTorch users switch, so a jitted step must trace again when the mode of a module it called
changes, as eager PyTorch would change its behaviour, and keep both programs (training and validation alternate).

While a trace runs (in its thread), a global forward pre-hook records every module called through `__call__`; each
signature keeps weak references to the modules its own trace called (`ModuleWatch`), and a call matches that
signature's program only while their modes, and the hooks registered on them (and the global module hooks), are the
ones it was traced with (a guard, as Dynamo's). Modules given as static arguments (a jitted method's `self`) key the
signature by their mode too. A step that reads `module.training` of a module it neither calls nor takes as a static
argument is not seen.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

_local = threading.local()
_lock = threading.Lock()
_recorders = 0
_hook: Any = None
# The `nn.Module.train` the recording patch wraps and puts back: read when the patch is installed, not at import,
# so a patch of the user's (or a library's) made after importing pt3func runs during traces and survives them.
_wrapped_train: Any = nn.Module.train


class Recording:
    """What a trace did with modules: those it called (by id: the module and its mode at its first call), and the
    ids of those whose mode it set itself (`model.train(flag)` / `.eval()` inside the step)."""

    def __init__(self) -> None:
        self.called: dict[int, tuple[nn.Module, bool]] = {}
        self.set_by_step: set[int] = set()


@contextlib.contextmanager
def recording_called_modules() -> Iterator[Recording]:
    """Yield a `Recording` of the modules called, and those whose mode was set, in this thread while the context is
    active.

    The global hook is installed only while some thread records: an installed global hook sends every module call
    in the process down `nn.Module`'s slow path."""
    global _recorders, _hook, _wrapped_train
    with _lock:
        if _recorders == 0:
            _hook = nn.modules.module.register_module_forward_pre_hook(_record)
            if nn.Module.train is not _train:
                _wrapped_train = nn.Module.train
            nn.Module.train = _train  # type: ignore[method-assign]
        _recorders += 1
    previous = getattr(_local, "recording", None)
    recording = Recording()
    _local.recording = recording
    try:
        yield recording
    finally:
        _local.recording = previous
        if previous is not None:  # a nested trace (pf.jit inlined in another's trace): the outer one did this too
            for k, v in recording.called.items():
                previous.called.setdefault(k, v)
            previous.set_by_step |= recording.set_by_step
        with _lock:
            _recorders -= 1
            if _recorders == 0:
                _hook.remove()
                _hook = None
                if nn.Module.train is _train:  # one set while the trace ran (by the step itself) is left in place
                    nn.Module.train = _wrapped_train  # type: ignore[method-assign]


def _after_fork() -> None:
    """In a child forked while another thread of the parent recorded (a DataLoader worker started during a trace):
    that thread does not exist here, so remove the global hook and the `train` patch it installed (every module
    call of the child took the slow path), and free the lock, which it may have held."""
    global _recorders, _hook
    if getattr(_local, "recording", None) is not None:
        return  # forked by the recording thread itself (inside the step): its trace goes on
    _lock._at_fork_reinit()
    if _recorders:
        _recorders = 0
        if _hook is not None:
            _hook.remove()
            _hook = None
        if nn.Module.train is _train:
            nn.Module.train = _wrapped_train  # type: ignore[method-assign]


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(after_in_child=_after_fork)


def _record(module: nn.Module, _args: Any) -> None:
    recording = getattr(_local, "recording", None)
    if recording is not None and id(module) not in recording.called:
        recording.called[id(module)] = (module, module.training)


def _train(self: nn.Module, mode: bool = True) -> nn.Module:
    recording = getattr(_local, "recording", None)
    if recording is not None:
        recording.set_by_step.add(id(self))
    return _wrapped_train(self, mode)


class ModuleWatch:
    """The modules one trace called whose mode decides its program, weakly held: a signature's guard.

    Left out: modules the trace set the mode of itself (`model.train(flag)` inside the step: the step decides, a
    static flag keys it) and modules made inside the step (they die after the trace; a dead module reads None)."""

    def __init__(self, recording: Recording | None = None) -> None:
        called = recording.called.values() if recording is not None else ()
        skip = recording.set_by_step if recording is not None else set()
        kept = [module for module, first in called if id(module) not in skip and module.training == first]
        self._refs = [weakref.ref(m) for m in kept]
        self.names = [type(m).__name__ for m in kept]
        self.ids = frozenset(id(m) for m in kept)

    def alive(self) -> bool:
        """Whether every watched module is still alive (then `ids` name exactly these modules)."""
        return all(r() is not None for r in self._refs)

    def modes(self) -> tuple:
        """Each watched module's `training` flag (None once it is gone), with its hooks' handle ids where it has
        hooks, then the global module hooks' where there are any; () when no module is watched.

        A trace runs the hooks registered then and the program keeps what they did: a hook registered or removed
        later (a forward hook that edits an activation) must trace again, as eager PyTorch would run it (Dynamo
        guards on hooks too). A hook's handle id is new for every registration."""
        if not self._refs:
            return ()
        out = [None if (m := r()) is None else
               (m.training if not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                                   or m._backward_pre_hooks) else _with_hooks(m))
               for r in self._refs]
        if _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or _GLOBAL_HOOKS[2] or _GLOBAL_HOOKS[3]:
            # Without pt3func's own recording hook, installed while any thread traces (a nested trace's key, another
            # thread's trace, a virtual mesh's other rank): the key must not depend on whether a trace runs, or a
            # cached step would trace again. Known by its function, not its handle: another thread may install or
            # remove it meanwhile (and `tuple(items())` copies each dict at once, under the GIL).
            others = tuple(tuple(k for k, hook in tuple(hooks.items()) if hook is not _record)
                           for hooks in _GLOBAL_HOOKS)
            if any(others):
                out.append(("global hooks", *others))
        return tuple(out)

    def describe_change(self, old: tuple, new: tuple) -> str | None:
        """The modules whose modes or hooks differ between two `modes()` tuples, in words; None if none differs."""
        if old[len(self.names):] != new[len(self.names):]:
            return "the global module hooks (torch.nn.modules.module.register_module_forward_hook, ...) changed"
        changed = [(name, a, b) for name, a, b in zip(self.names, old, new) if a != b]
        if not changed:
            return None
        modes = [(name, _training(a), _training(b)) for name, a, b in changed if _training(a) != _training(b)]
        if not modes:
            names = list(dict.fromkeys(name for name, _, _ in changed))
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            return f"hooks of modules the step calls were registered or removed ({', '.join(names[:4])}{more})"
        names = list(dict.fromkeys(name for name, _, _ in modes))
        kinds = "; ".join(sorted({f"{_mode(a)} -> {_mode(b)}" for _, a, b in modes}))
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return f"the mode of modules the step calls changed ({', '.join(names[:4])}{more}): {kinds}"


_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
                 nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks)


def _with_hooks(m: nn.Module) -> tuple:
    return (m.training, tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks),
            tuple(m._backward_pre_hooks))


def _training(mode: Any) -> bool | None:
    return mode[0] if isinstance(mode, tuple) else mode


NO_WATCH = ModuleWatch()


def static_module_modes(static: tuple) -> tuple:
    """The modes of modules given as static arguments (`static_argnums` naming a module): a forward that reads
    `self.training` (`F.dropout(x, p, self.training)`) calls no module the trace could see. (A module passed as
    an ordinary argument is a static leaf: `trace.signature.leaf_key` keys it by its mode.)"""
    static_pos, static_kw = static
    if not static_pos and not static_kw:
        return ()
    return tuple(v.training for _, v in (*static_pos, *static_kw) if isinstance(v, nn.Module))


def _mode(training: bool | None) -> str:
    return "gone" if training is None else "train" if training else "eval"

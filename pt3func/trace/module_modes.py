"""The train / eval mode of the `nn.Module`s a step calls: part of its jit signature.

A trace reads `module.training` once (dropout on or off, batch norm's batch or running statistics) and the program
keeps that choice. `pf.functionalize`'s `apply` runs "in the module's current mode", and a closure module's
`.eval()` is how PyTorch users switch, so a jitted step must trace again when the mode of a module it called
changes, as eager PyTorch would change its behaviour, and keep both programs (training and validation alternate).

While a trace runs (in its thread), a global forward pre-hook records every module called through `__call__`; the
`Jitted` keeps weak references to them and adds their modes to each call's signature. A step that reads
`module.training` without calling the module is not seen (pass such a flag as a static argument).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

_local = threading.local()
_lock = threading.Lock()
_recorders = 0
_hook: Any = None


@contextlib.contextmanager
def recording_called_modules() -> Iterator[dict[int, nn.Module]]:
    """Yield a dict that collects (by id) the modules called in this thread while the context is active.

    The global hook is installed only while some thread records: an installed global hook sends every module call
    in the process down `nn.Module`'s slow path."""
    global _recorders, _hook
    with _lock:
        if _recorders == 0:
            _hook = nn.modules.module.register_module_forward_pre_hook(_record)
        _recorders += 1
    previous = getattr(_local, "modules", None)
    found: dict[int, nn.Module] = {}
    _local.modules = found
    try:
        yield found
    finally:
        _local.modules = previous
        if previous is not None:  # a nested trace (pf.jit inlined in another's trace): the outer one calls these too
            previous.update(found)
        with _lock:
            _recorders -= 1
            if _recorders == 0:
                _hook.remove()
                _hook = None


def _record(module: nn.Module, _args: Any) -> None:
    found = getattr(_local, "modules", None)
    if found is not None:
        found.setdefault(id(module), module)


class ModuleModes:
    """The modules a jitted function's traces called (weakly held) and, per call, their modes as a tuple."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._names: list[str] = []
        self._by_id: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()  # a virtual mesh's rank threads trace, and add what they met, at once

    def watch(self, modules: dict[int, nn.Module]) -> None:
        """Add these modules (the signature then has an entry for each new one)."""
        with self._lock:
            for module in modules.values():
                known = self._by_id.get(id(module))
                if known is not None and known() is module:
                    continue
                ref = self._by_id[id(module)] = weakref.ref(module)
                self._refs.append(ref)
                self._names.append(type(module).__name__)

    def modes(self) -> tuple:
        """Each watched module's `training` flag (None once it is gone); () when none is watched."""
        if not self._refs:
            return ()
        return tuple([None if (m := r()) is None else m.training for r in self._refs])

    def describe_change(self, old: tuple, new: tuple) -> str | None:
        """The modules whose modes differ between two `modes()` tuples, in words; None if none differs."""
        changed = [(name, a, b) for name, a, b in zip(self._names, old, new) if a != b]
        if not changed:
            return None
        names = list(dict.fromkeys(name for name, _, _ in changed))
        kinds = "; ".join(sorted({f"{_mode(a)} -> {_mode(b)}" for _, a, b in changed}))
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return f"the mode of modules the step calls changed ({', '.join(names[:4])}{more}): {kinds}"


def _mode(training: bool | None) -> str:
    return "gone" if training is None else "train" if training else "eval"

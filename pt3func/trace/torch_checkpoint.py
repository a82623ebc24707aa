"""While a step is traced, `torch.utils.checkpoint.checkpoint` regions are `pf.checkpoint` regions.

Torch's checkpoint recomputes its region in the backward and replays the forward's random numbers by stashing
the generator's state (`torch.get_rng_state`) and restoring it around the recompute. Under the trace both run
once, at trace time, not in the program: the traced backward's recompute drew a new dropout mask (a gradient
off by whole units, with the right loss), and the step advanced the generator twice. A `pf.checkpoint` region
is only marked while traced; the remat pass then recomputes what it may and never a random op, so the backward
reads the forward's mask and the draws are eager torch's.

`checkpoint` reaches its two variants through module globals looked up at each call:
`_checkpoint_without_reentrant_generator` (use_reentrant=False) and `CheckpointFunction` (use_reentrant=True).
Replacing those reaches every way of calling it: `torch.utils.checkpoint.checkpoint(...)`, a `checkpoint`
bound by `from torch.utils.checkpoint import checkpoint` before the step was defined, and
`checkpoint_sequential`, which calls `checkpoint` per segment. Outside a trace (eager code, torch.compile,
pf.checkpoint's own eager path) the replacements call torch's.

`preserve_rng_state=False` is followed in spirit: it lets torch skip the replay, and pt3func needs none.
`determinism_check` ("default" or "none") checks a recompute's shapes against the forward's; the remat pass
copies the traced ops, which match by construction. `early_stop` only saves recompute work. A custom
`context_fn` (selective checkpointing) and `debug=True` would be dropped silently: they are refused.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from pt3func.errors import TracingError
from pt3func.trace.source import describe, is_user_file

_ORIGINAL_GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator
_ORIGINAL_FUNCTION = torch_checkpoint.CheckpointFunction
_GENERATOR_SIGNATURE = inspect.signature(_ORIGINAL_GENERATOR)
_CHECKS = ("default", "none")


@contextlib.contextmanager
def torch_checkpoint_as_regions() -> Iterator[None]:
    """Within this block, `torch.utils.checkpoint.checkpoint` called while pt3func traces is a `pf.checkpoint`
    region (see the module doc)."""
    saved = (torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction)
    torch_checkpoint._checkpoint_without_reentrant_generator = _generator_as_region
    torch_checkpoint.CheckpointFunction = _ReentrantAsRegion
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction = saved


def _tracing() -> bool:
    from pt3func.remat import tracing  # here: pt3func.remat imports the trace package

    return tracing()


@contextlib.contextmanager
def _region() -> Iterator[None]:
    from pt3func.remat import checkpoint_policies, traced_region

    with traced_region(checkpoint_policies.nothing_saveable):  # torch's checkpoint keeps only the inputs
        yield


def _generator_as_region(*args: Any, **kwargs: Any) -> Iterator[None]:
    """Torch's `_checkpoint_without_reentrant_generator`, whose first `next()` runs before the checkpointed
    function and the second after it: while traced, a region open around the function."""
    if not _tracing():
        yield from _ORIGINAL_GENERATOR(*args, **kwargs)
        return
    bound = _GENERATOR_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    options = bound.arguments
    context_fn = options["context_fn"]
    if context_fn is not torch_checkpoint.noop_context_fn:
        _refuse(
            f"context_fn={getattr(context_fn, '__name__', type(context_fn).__name__)}",
            "a context_fn (selective checkpointing: which ops to save) is not applied in a traced step",
            "use pf.checkpoint(fn, policy=pf.checkpoint_policies.dots_saveable / save_only_these_names(...)) "
            "for a selective policy, or drop context_fn",
        )
    debug = torch_checkpoint._checkpoint_debug_enabled
    if debug if debug is not None else options["debug"]:
        _refuse("debug=True", "its op-by-op trace of the recompute is not made in a traced step",
                "drop debug (and torch.utils.checkpoint.set_checkpoint_debug_enabled(True))")
    if options["determinism_check"] not in _CHECKS:
        _refuse(f"determinism_check={options['determinism_check']!r}", "it is not one torch knows",
                f"use one of {_CHECKS}")
    with _region():
        yield


class _ReentrantAsRegion(_ORIGINAL_FUNCTION):
    """Torch's `CheckpointFunction` (use_reentrant=True); while traced, `apply` runs the function in a region
    (its backward would run `torch.autograd.backward` inside the trace, and refuses `torch.autograd.grad`)."""

    @classmethod
    def apply(cls, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:  # type: ignore[override]
        if not _tracing():
            return _ORIGINAL_FUNCTION.apply(function, preserve_rng_state, *args)
        with _region():
            return function(*args)


def _refuse(option: str, why: str, fix: str) -> None:
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    where = describe(frame.f_code.co_filename, frame.f_lineno) + ": " if frame is not None else ""
    raise TracingError(f"{where}torch.utils.checkpoint.checkpoint({option}) inside a jitted step: {why}; {fix}.")

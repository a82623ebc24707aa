"""Each virtual rank draws random numbers from a generator of its own, as a process of a real world does.

The ranks of a virtual mesh are threads of one process, and torch has one default CPU generator per process: a
program's random ops (a dropout's `bernoulli_`, `torch.rand`, pt3func's `random_fill`) drawn by four rank threads
took turns on it, so every rank drew other numbers than one device (or a rank of a real world) would, and which
ones depended on the threads' order. `drawing_from(generator)` runs a rank's job under a dispatch mode (modes are
per thread) that hands each CPU random op without a generator the rank's own; `VirtualWorld.run` gives every rank
a copy of the caller's default generator for the job, and leaves the caller's generator where rank 0's ended, as
the generator of a real world's rank 0 process would be. Ops drawing inside another op's kernel (none on the CPU
paths pt3func traces: a CPU dropout is traced as `bernoulli_`) are not reached. Outside a jitted step, random ops
on virtual arrays run as DTensor runs them (its CPU random-op support, which DTensor warns is incomplete).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_FAKE = torch._C._TorchDispatchModeKey.FAKE
_SEEDED = torch.Tag.nondeterministic_seeded


def _generator_index(op: Any) -> int | None:
    """The position of `op`'s `generator` argument in its schema; None when it takes none."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "generator":
            return i
    return None


def _with_generator_overload(op: Any) -> Any:
    """The overload of `op` that takes a generator (`aten.rand.default` -> `aten.rand.generator`); None if none."""
    name = op._overloadname
    alternative = {"default": "generator", "names": "generator_with_names"}.get(name, f"{name}_generator")
    candidate = getattr(op.overloadpacket, alternative, None)
    return candidate if candidate is not None and _generator_index(candidate) is not None else None


def _device_type(args: tuple, kwargs: dict) -> str:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    return "cpu"  # a factory without a device: the default device, CPU unless set otherwise


class _RankGenerator(TorchDispatchMode):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator
        from pt3func.passes.random_fills import generator_key

        self._key = generator_key(generator)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _SEEDED in func.tags and torch._C._get_dispatch_mode(_FAKE) is None:
            func, args, kwargs = self._drawn_by_rank(func, args, kwargs)
        return func(*args, **kwargs)

    def _drawn_by_rank(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        if any(isinstance(a, torch._subclasses.FakeTensor) for a in args) or _device_type(args, kwargs) != "cpu":
            return func, args, kwargs  # a trace's fake draw, or a CUDA one (its generators are per device already)
        if func is torch.ops.pt3func.random_fill.default:  # names its generator by a key (-1: the global one)
            index, value = _generator_index(func), self._key
            assert index is not None
            return func, *_set(args, kwargs, index, "generator", value, unset=-1)
        index = _generator_index(func)
        if index is None:
            overload = _with_generator_overload(func)
            if overload is None or any(isinstance(a, DTensor) for a in args):
                # (DTensor has no sharding rules for the generator overloads: an eager `torch.rand_like` of a
                # DTensor still draws from the shared generator)
                return func, args, kwargs
            func, index = overload, _generator_index(overload)
        return func, *_set(args, kwargs, index, "generator", self.generator, unset=None)


def _set(args: tuple, kwargs: dict, index: int, name: str, value: Any, unset: Any) -> tuple[tuple, dict]:
    """`args` / `kwargs` with argument `name` (at schema position `index`) set to `value` where it is `unset`."""
    if index < len(args):
        if args[index] is unset:
            args = (*args[:index], value, *args[index + 1:])
    elif kwargs.get(name, unset) is unset:
        kwargs = {**kwargs, name: value}
    return args, kwargs


def drawing_from(generator: torch.Generator) -> _RankGenerator:
    """A context in which this thread's CPU random ops that name no generator draw from `generator`."""
    return _RankGenerator(generator)

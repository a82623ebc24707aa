"""Each virtual rank draws random numbers from a generator of its own, as a process of a real world does.

The ranks of a virtual mesh are threads of one process, and torch has one default CPU generator per process: a
program's random ops (a dropout's `bernoulli_`, `torch.rand`, pt3func's `random_fill`) drawn by four rank threads
took turns on it, so every rank drew other numbers than one device (or a rank of a real world) would, and which
ones depended on the threads' order. Now rank 0 draws from the process's generator, as the caller would on one
device, and every other rank from a generator of its own that `VirtualWorld.run` sets to the caller's state before
each job (`RankGenerators`): ranks seeded alike draw alike, and the process's generator ends where one device's
would. The other ranks' draws reach their generators through a dispatch mode (modes are per thread) that hands each
CPU random op without a generator the rank's own. It is entered only around what may draw (`drawing_as_rank`: a
program with random ops, an eager op on virtual arrays), since it costs a Python call per op.

Not reached: ops drawing inside another op's kernel (none on the CPU paths pt3func traces: a CPU dropout is traced
as `bernoulli_`); outside a jitted step, random ops on virtual arrays run as DTensor runs them (its CPU random-op
support, which DTensor warns is incomplete); a virtual mesh over CUDA devices, whose ranks share the device's
generator; another thread drawing from the process's generator while a job runs (rank 0 then draws after it, the
others not).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
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
    """The overload of `op` that takes a generator besides `op`'s own arguments (`aten.rand.default` ->
    `aten.rand.generator`, `aten.randint_like.low_dtype` -> `low_generator_dtype`); None if none."""
    names = [a.name for a in op._schema.arguments]
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        arguments = [a.name for a in candidate._schema.arguments]
        if "generator" in arguments and [a for a in arguments if a != "generator"] == names:
            return candidate
    return None


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


class RankGenerators:
    """The generators of a virtual world's ranks 1..n-1 (rank 0 draws from the process's), made once per world."""

    def __init__(self, size: int) -> None:
        self._modes: list[_RankGenerator | None] = [None] + [_RankGenerator(torch.Generator()) for _ in range(1, size)]

    def reseed(self) -> None:
        """Before a job: every rank's generator at the caller's state, as every process of a world seeded alike."""
        if len(self._modes) > 1:
            state = torch.default_generator.get_state()
            for mode in self._modes[1:]:
                assert mode is not None
                mode.generator.set_state(state)

    @contextlib.contextmanager
    def of_rank(self, rank: int) -> Iterator[None]:
        """The job of rank `rank` runs in this block: `drawing_as_rank()` in it draws from the rank's generator."""
        _CURRENT.mode = self._modes[rank]
        try:
            yield
        finally:
            _CURRENT.mode = None


_CURRENT = threading.local()  # .mode: the running rank's _RankGenerator (None on rank 0 and outside a job)


def drawing_as_rank() -> contextlib.AbstractContextManager:
    """A block that may draw random numbers: in a virtual rank's job, they come from the rank's generator."""
    mode = getattr(_CURRENT, "mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def draws_random(gm: Any) -> bool:
    """Whether a traced program has random ops (that draw from a generator when it runs)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and _SEEDED in target.tags:
            return True
    return False

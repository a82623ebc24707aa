"""Run a compiled program by replaying one CUDA graph of it (`pf.jit(..., cuda_graphs=True)`).

A jitted step is one static program per input signature, so it can be captured whole: after a warm-up call
(Triton autotuning, cuBLAS handles, lazy initialisation), the next call captures the program once into a
`torch.cuda.CUDAGraph` with its own memory pool (the static memory of the program: every temporary lives at
a fixed address), and every later call is a copy of the inputs that changed plus one `replay()`: one launch
instead of hundreds, no allocator traffic.

Buffers, and why they keep the donation contract:
- A donated input that the program updates in place (params, optimizer state) is captured as the caller's
  buffer itself. Its output is that same buffer, so when the caller passes back what the last call returned,
  nothing is copied. Passed any other tensor, its value is copied into the captured buffer first (the
  caller donated the old one, so writing it is allowed).
- Every other tensor input (the batch) has a buffer of the graph's own and is copied into it each call: the
  caller's tensor is never written, and may change or die between calls.
- A Python scalar input (learning rate, step) has a 0-d buffer that is filled with the new value each call.
- Outputs that are not donated inputs (loss, metrics; every output when nothing is donated) live in the
  graph's pool and the next replay overwrites them, so they are cloned before being returned: the caller
  owns what it gets, as without graphs. With params and state donated that is a few scalars; without
  donation it is a copy of every output each call, so donate them when using CUDA graphs.

Teardown with NCCL: a graph that captured NCCL collectives holds a reference on the communicator, and NCCL's
`ncclCommDestroy` waits until every such graph is destroyed (pytorch/pytorch#115388). Left to the interpreter's
teardown, or with `torch.distributed.destroy_process_group()` called while a step still holds its graph, the
process hangs at exit. So every captured graph is released (`release_cuda_graphs`) by an exit hook and before
`destroy_process_group` runs; a step called after that captures again.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from pt3func.analysis import is_collective
from pt3func.errors import TracingError

WARMUP_CALLS = 1
"""Calls run as usual before the capture: the first run autotunes Triton kernels and initialises libraries,
which must not happen inside a capture."""


def check_capturable(
    name: str,
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    labels: Sequence[str],
    scalar_inputs: Sequence[int],
) -> torch.device:
    """Refuse, before compiling, a program that cannot be one CUDA graph; return the device it runs on.

    Every tensor input must be on one CUDA device, and collectives must run on NCCL >= 2.9 (which can be
    captured); gloo and threaded (virtual mesh) collectives cannot, nor `offload_to_host`'s copies.
    """
    devices: dict[torch.device, str] = {}
    scalars = set(scalar_inputs)
    for i, (x, label) in enumerate(zip(example_inputs, labels)):
        if i in scalars:
            continue
        if x.device.type != "cuda":
            raise TracingError(
                f"{name}: cuda_graphs=True needs CUDA tensors; got a {x.device.type.upper()} input at {label}. "
                "Move the arguments to the GPU (pf.device_put / .cuda()) or drop cuda_graphs=True."
            )
        devices.setdefault(x.device, label)
    if not devices:
        raise TracingError(f"{name}: cuda_graphs=True needs CUDA tensor inputs; this step has none")
    if len(devices) > 1:
        (d0, l0), (d1, l1) = list(devices.items())[:2]
        raise TracingError(
            f"{name}: cuda_graphs=True captures a program on one device, but {l0} is on {d0} and {l1} on {d1}"
        )
    from pt3func.passes.remat_offload import OPS as offload_ops

    for node in gm.graph.nodes:
        if node.target in offload_ops:
            raise TracingError(
                f"{name}: cuda_graphs=True cannot capture checkpoint_policies.offload_to_host ({node.name}): its "
                "host copies are allocated on every call, and a replay would write into memory freed since. Use "
                "save_only_these_names / nothing_saveable, or drop cuda_graphs=True."
            )
        if is_collective(node):
            backend = _backend_of(node)
            if backend != "nccl":
                raise TracingError(
                    f"{name}: cuda_graphs=True cannot capture the collective {node.name} "
                    f"({node.target}) on the {backend!r} backend; only NCCL collectives can be captured in a "
                    "CUDA graph. Use NCCL (pf.make_mesh on GPUs under torchrun) or drop cuda_graphs=True."
                )
            version = torch.cuda.nccl.version()
            if tuple(version) < (2, 9, 6):
                raise TracingError(
                    f"{name}: cuda_graphs=True needs NCCL >= 2.9.6 to capture collectives; this is NCCL "
                    f"{'.'.join(map(str, version))}"
                )
    return next(iter(devices))


def _backend_of(node: fx.Node) -> str:
    """The process-group backend a functional collective node runs on ("nccl", "gloo", ...)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, str):
            try:
                group = _resolve_process_group(arg)
            except (KeyError, ValueError, RuntimeError):
                continue
            try:
                return str(dist.get_backend(group))
            except (RuntimeError, ValueError):
                return type(group).__name__
    return "unknown"


_LIVE: weakref.WeakSet[CUDAGraphRunner] = weakref.WeakSet()
_HOOKS_INSTALLED = False


def release_cuda_graphs() -> int:
    """Destroy every captured graph of every jitted step (they capture again on their next call).

    Needed before NCCL communicators are destroyed (see the module's docstring); runs by itself at exit and
    before `torch.distributed.destroy_process_group`. Returns how many graphs were released.
    """
    runners = [r for r in list(_LIVE) if r.captured]
    if runners and torch.cuda.is_available():
        torch.cuda.synchronize()  # a replay still running must finish before its graph goes
    for runner in runners:
        runner.release()
    return len(runners)


def _install_release_hooks() -> None:
    """Release graphs at exit and before `destroy_process_group` (installed at the first capture)."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    # Registered after torch's own exit handlers, so it runs before them (atexit is last in, first out).
    atexit.register(release_cuda_graphs)
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        release_cuda_graphs()
        return original(*args, **kwargs)

    # Both names users reach it by; a reference taken before the first capture is not covered (the exit
    # hook still is).
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


class _CaptureSideEffects:
    """What a failed capture leaves behind, and how to undo it.

    When a capture is invalidated (a host sync, an uncapturable op), `torch.cuda.graph.__exit__` raises from
    `capture_end` before it ends the capture's bookkeeping: the device's default generator stays marked as
    capturing, so every later random op on that device fails ("Offset increment outside graph capture
    encountered unexpectedly"), and the capture's side stream stays current. The user sees our TracingError
    and must be able to go on (with cuda_graphs=False): so put back the generator state as it was before the
    capture (a capture never advances it: its draws are counted per graph) and the stream.
    """

    def __init__(self, generator: torch.Generator, rng_state: torch.Generator, stream: torch.cuda.Stream):
        self._generator, self._rng_state, self._stream = generator, rng_state, stream

    @classmethod
    def record(cls) -> _CaptureSideEffects:
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        return cls(generator, generator.clone_state(), torch.cuda.current_stream())

    def restore(self) -> None:
        self._generator.graphsafe_set_state(self._rng_state)
        torch.cuda.set_stream(self._stream)


class CUDAGraphRunner:
    """`run(inputs) -> outputs` for one compiled program: warm up, capture once, then replay.

    `inputs` holds one entry per program input: a tensor, or a Python number for a scalar input. `run`
    replaces each donated (aliased) input in the list with the buffer that now holds its new value.
    """

    def __init__(
        self,
        fn: Callable[..., Sequence[torch.Tensor]],
        name: str,
        device: torch.device,
        aliased_inputs: Sequence[int],
        scalar_dtypes: dict[int, torch.dtype],
    ):
        self._fn = fn
        self._name = name
        self._device = device
        self._aliased = sorted(set(aliased_inputs))
        self._scalars = dict(scalar_dtypes)
        self._warmups_left = WARMUP_CALLS
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_in: list[torch.Tensor] = []
        self._static_addresses: list[int] = []
        self._static_out: list[torch.Tensor] = []
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def run(self, inputs: list[Any]) -> list[torch.Tensor]:
        if self._graph is None:
            if self._warmups_left > 0:
                self._warmups_left -= 1
                return list(self._fn(*self._as_tensors(inputs)))
            self._capture(inputs)
        else:
            self._load(inputs)
        self._graph.replay()  # type: ignore[union-attr]
        self.replays += 1
        for i in self._aliased:
            inputs[i] = self._static_in[i]
        return [out.clone() for out in self._static_out]

    def _as_tensors(self, inputs: list[Any]) -> list[torch.Tensor]:
        return [
            torch.tensor(x, dtype=self._scalars[i], device=self._device) if i in self._scalars else x
            for i, x in enumerate(inputs)
        ]

    def _load(self, inputs: list[Any]) -> None:
        static, addresses = self._static_in, self._static_addresses
        for i, x in enumerate(inputs):
            if i in self._scalars:
                static[i].fill_(x)
            elif x.data_ptr() != addresses[i]:  # the buffer the last call returned needs no copy
                static[i].copy_(x)

    def _capture(self, inputs: list[Any]) -> None:
        aliased = set(self._aliased)
        static = []
        for i, x in enumerate(self._as_tensors(inputs)):
            if i in aliased:
                static.append(x.detach())  # the donated buffer itself: the program updates it in place
            elif i in self._scalars:
                static.append(x)  # made above, owned here
            else:
                own = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                own.copy_(x)
                static.append(own)
        graph = torch.cuda.CUDAGraph()
        cause: Exception | None = None
        before = _CaptureSideEffects.record()
        try:
            with torch.cuda.graph(graph):
                try:
                    # Inductor's wrapper clears the list it is given: pass a copy, keep `static`.
                    outs = list(self._fn(*static))
                except Exception as e:  # the op's own error; ending the broken capture raises another
                    cause = e
                    raise
        except Exception as e:
            cause = cause or e
            before.restore()
            raise TracingError(
                f"{self._name}: cuda_graphs=True: the compiled program cannot be captured in a CUDA graph: "
                f"{type(cause).__name__}: {cause}. Some op in it synchronises with the host or is not "
                "capturable; run this step with cuda_graphs=False."
            ) from cause
        self._graph, self._static_in, self._static_out = graph, static, outs
        # Read on every replay for every input: the captured buffers' addresses, which never change.
        self._static_addresses = [t.data_ptr() for t in static]
        _LIVE.add(self)
        _install_release_hooks()

    def release(self) -> None:
        """Destroy the graph and its buffers; the next call captures again (no warm-up: it was done)."""
        if self._graph is not None:
            self._graph.reset()
        self._graph, self._static_in, self._static_out = None, [], []
        self._static_addresses = []

"""The exchange guard: switch a compressed gradient exchange off where it makes the step slower.

Compression pays on slow links and costs on fast ones: on 2 H200s over NVLink the anchor step takes 47.0 ms with
the bf16 exchange and 120.7 ms with int8 + error feedback, whose quantise / dequantise work costs more than the
bytes it saves (Agarwal et al., MLSys 2022, found compression faster in 6 of 200+ setups). So
`pf.jit(step, grad_exchange=fmt)` guards every format but bf16, fp16 and none (which are references themselves):

- each signature is lowered twice from one trace: the compressed program, and a reference program whose gradient
  reductions use the guard's `reference` format (bf16 by default); the reference program passes the step's
  `ExchangeState` through unchanged (residuals and step counter as they came in);
- the first calls run one untimed warm-up call of each program (Inductor autotuning, CUDA graph capture), then
  alternate them `trial_steps` times each, timed between device synchronisations. Every one of these calls is a
  real training step (the reference exchange is a valid, uncompressed-enough step);
- the median step time of each program is combined over the ranks (all-reduce MAX over every axis of the mesh, so
  every rank takes the same decision and the programs' collectives stay matched), and compression is kept iff
  median(compressed) <= (1 + max_overhead) * median(reference). The reason is logged on logger `pt3func.jit`
  (rank 0): WARNING when compression is switched off, INFO when kept; `Compiled.exchange_decision()` and
  `Jitted.exchange_decision()` return it.

After a switch-off the error-feedback residuals accumulated so far are simply not applied any more: the state
passes through the reference program unchanged, so a checkpoint still holds them.

    step = pf.jit(train_step, grad_exchange=pf.compress.int8(),
                  exchange_guard=pf.compress.Guard(max_overhead=0.03, trial_steps=5))   # or None: always compress

`pf.config.exchange_guard = "off"` (environment: `PT3FUNC_EXCHANGE_GUARD=off`) turns every guard off, for tests and
benchmarks that measure a format itself.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from pt3func.compress.formats import Cast, Format, NoCompression, SkipSmall, bf16
from pt3func.passes import replace_outputs

log = logging.getLogger("pt3func.jit")

COMPRESSED = "compressed"
REFERENCE = "reference"

# timer(program, run) -> (run's result, seconds); program is COMPRESSED or REFERENCE.
Timer = Callable[[str, Callable[[], Any]], tuple[Any, float]]


@dataclass(frozen=True)
class Guard:
    """Time a compressed exchange against `reference` on the first calls; keep it only if it costs at most
    `max_overhead` (0.03: 3% of the reference's step time).

    Args:
        max_overhead: the step time compression may add, as a fraction of the reference step's.
        reference: the exchange to fall back to: `pf.compress.bf16()` (default), `fp16()` or `none()` (the
            program's own fp32 reduction). It keeps no state.
        trial_steps: timed calls of each program (the decision compares their medians).
        warmup_steps: untimed calls of each program before the timed ones (compilation, autotuning, CUDA graph
            capture happen there).
        timer: `timer(program, run) -> (result, seconds)` runs one call and says how long it took; `program` is
            "compressed" or "reference". Default: wall time between device synchronisations
            (`torch.cuda.synchronize` on CUDA). Tests inject one to choose which program is slower.
    """

    max_overhead: float = 0.03
    reference: Format = field(default_factory=bf16)
    trial_steps: int = 3
    warmup_steps: int = 1
    timer: Timer | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.max_overhead, (int, float)) and self.max_overhead >= 0):
            raise ValueError(f"Guard: max_overhead must be a fraction >= 0 (0.03 is 3%), got {self.max_overhead!r}")
        if not _stateless(self.reference):
            raise ValueError(
                f"Guard: reference must be a format that keeps no state, pf.compress.bf16(), fp16() or none(); "
                f"got {self.reference!r}"
            )
        if not (isinstance(self.trial_steps, int) and self.trial_steps >= 1):
            raise ValueError(f"Guard: trial_steps must be an int >= 1, got {self.trial_steps!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"Guard: warmup_steps must be an int >= 0, got {self.warmup_steps!r}")


@dataclass(frozen=True)
class ExchangeDecision:
    """What the guard decided for one compiled signature, and why."""

    kept: bool  # True: the compressed exchange runs from now on; False: the reference one
    format: str  # the compressed exchange, as `Format.describe()` says
    reference: str
    compressed_ms: float  # median step time of the compressed program (slowest rank's median)
    reference_ms: float
    overhead: float  # compressed_ms / reference_ms - 1
    max_overhead: float
    trial_steps: int  # timed calls of each program behind the medians
    reason: str  # the message logged


def guard_for(exchange_guard: Any, fmt: Format | None) -> Guard | None:
    """The guard `pf.jit(grad_exchange=fmt, exchange_guard=...)` runs, or None.

    "auto" guards every format except those that are already a reference (bf16, fp16, none); a `Guard` guards
    any format but its own reference; None, or `pf.config.exchange_guard == "off"`, guards nothing.
    """
    from pt3func.config import config

    if config.exchange_guard not in ("auto", "off"):
        raise ValueError(
            f"pf.config.exchange_guard (PT3FUNC_EXCHANGE_GUARD) must be 'auto' or 'off', got {config.exchange_guard!r}"
        )
    if fmt is None or exchange_guard is None or config.exchange_guard == "off":
        return None
    if exchange_guard == "auto":
        return None if _stateless(fmt) else Guard()
    return None if fmt == exchange_guard.reference else exchange_guard


def check_exchange_guard(exchange_guard: Any) -> None:
    if exchange_guard is not None and exchange_guard != "auto" and not isinstance(exchange_guard, Guard):
        raise TypeError(f"pf.jit: exchange_guard must be 'auto', None or a pf.compress.Guard, got {exchange_guard!r}")


def _stateless(fmt: Format) -> bool:
    """bf16 / fp16 without error feedback, or no compression: a format cheap enough to be the reference."""
    if isinstance(fmt, SkipSmall):
        return _stateless(fmt.inner)
    return isinstance(fmt, NoCompression) or (isinstance(fmt, Cast) and not fmt.error_feedback)


def _name(fmt: Format) -> str:
    """"int8, block 256, EF" -> "int8 (block 256, EF)": the format, then its options."""
    head, _, rest = fmt.describe().partition(", ")
    return f"{head} ({rest})" if rest else head


def copy_program(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a traced program that passes can rewrite apart from the original: its own nodes, each with a
    shallow copy of the original's meta (passes replace a node's meta["custom"] rather than mutate it)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.alias.default)


def forward_unchanged_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Each output that is an input seen through views of the input's own shape and strides becomes that input
    (Graph -> Graph, in place; returns `gm`).

    The reference program returns the `ExchangeState` unchanged, and a DTensor input returned unchanged comes out
    of the trace as view(view(input)) (from_local, to_local). Donation refuses a view of a donated input as its
    output, so the residuals would be neither aliased nor invalidated there; as the input itself, donation hands
    the buffer straight back, as the compressed program does with its new residuals.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    changed = False
    for j, out in enumerate(outs):
        source = out
        while isinstance(source, fx.Node) and source.op == "call_function" and source.target in _VIEWS:
            source = source.args[0]
        if source is out or not isinstance(source, fx.Node) or source.op != "placeholder":
            continue
        a, b = out.meta.get("val"), source.meta.get("val")
        if (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        ):
            outs[j] = source
            changed = True
    if changed:
        replace_outputs(gm, outs)
    return gm


def wall_timer(device: torch.device) -> Timer:
    """Wall time of one call between two device synchronisations (queued work is waited for on both sides)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timer(program: str, run: Callable[[], Any]) -> tuple[Any, float]:
        sync()
        start = time.perf_counter()
        out = run()
        sync()
        return out, time.perf_counter() - start

    return timer


class ExchangeSwitch:
    """Runs the trial calls of one compiled signature, decides, then runs the chosen program.

    `compressed` is the compressed program's `Compiled` (run through its `_run_leaves`, which bypasses this
    switch); `reference()` compiles the reference program (on its first call, which is its warm-up) and returns
    its `Compiled`. `mesh` (a DeviceMesh, or None for one process) is where the ranks' timings are combined.
    After the decision `program` is the `Compiled` that runs from now on, so that `Jitted` can call it on its
    fast path (remembered leaves, `run_flat`) as it calls any program without a guard.
    """

    def __init__(
        self, guard: Guard, name: str, fmt: Format, compressed: Any,
        reference: Callable[[], Any], device: torch.device, mesh: Any,
    ) -> None:
        self.guard = guard
        self.name = name
        self.format = fmt
        self._compressed_program = compressed
        self._compressed: Callable[[list[Any]], Any] = compressed._run_leaves
        self._compile_reference: Callable[[], Any] | None = reference
        self._reference_compiled: Any = None
        self._reference: Callable[[list[Any]], Any] | None = None
        self._device = device
        self._mesh = mesh
        self._timer = guard.timer or wall_timer(device)
        pair = [(COMPRESSED, False), (REFERENCE, False)] * guard.warmup_steps
        self._schedule = pair + [(COMPRESSED, True), (REFERENCE, True)] * guard.trial_steps
        self._calls = 0
        self._times: dict[str, list[float]] = {COMPRESSED: [], REFERENCE: []}
        self.decision: ExchangeDecision | None = None
        self.program: Any = None  # the chosen Compiled, once decided

    def __call__(self, leaves: list[Any]) -> Any:
        if self.program is not None:
            return self.program._run_leaves(leaves)
        program, timed = self._schedule[self._calls]
        self._calls += 1
        run = self._compressed if program == COMPRESSED else self._reference_program()
        if timed:
            out, seconds = self._timer(program, lambda: run(leaves))
            self._times[program].append(float(seconds))
        else:
            out = run(leaves)
        if self._calls == len(self._schedule):
            self._decide()
        return out

    def _reference_program(self) -> Callable[[list[Any]], Any]:
        if self._reference is None:
            self._reference_compiled = self._compile_reference()
            self._reference = self._reference_compiled._run_leaves
            self._compile_reference = None
        return self._reference

    def _decide(self) -> None:
        mine = [statistics.median(self._times[COMPRESSED]), statistics.median(self._times[REFERENCE])]
        compressed, reference = self._slowest_rank(mine)
        limit = 1 + self.guard.max_overhead
        kept = compressed <= limit * reference
        overhead = compressed / reference - 1 if reference > 0 else (0.0 if compressed <= 0 else float("inf"))
        ref_name = self.guard.reference.describe()
        fmt_name = _name(self.format)
        numbers = (
            f"{overhead:+.1%} step time against {ref_name} ({compressed * 1e3:.1f} ms vs {reference * 1e3:.1f} ms, "
            f"median of {self.guard.trial_steps} steps each, slowest rank)"
        )
        if kept:
            reason = (
                f"pf.jit({self.name}): grad_exchange {fmt_name} kept: {numbers}, within the "
                f"{self.guard.max_overhead:.0%} allowed"
            )
        else:
            reason = (
                f"pf.jit({self.name}): grad_exchange {fmt_name} switched off: {numbers}, over the "
                f"{self.guard.max_overhead:.0%} allowed; using {ref_name} from now on (error-feedback residuals "
                "are no longer applied)"
            )
        self.decision = ExchangeDecision(
            kept, self.format.describe(), ref_name, compressed * 1e3, reference * 1e3, overhead,
            self.guard.max_overhead, self.guard.trial_steps, reason,
        )
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.log(logging.INFO if kept else logging.WARNING, reason)
        self.program = self._compressed_program if kept else self._reference_compiled
        if kept:  # the reference program is no longer referenced: its compiled code (and CUDA graph) can go
            self._reference = self._reference_compiled = None

    def _slowest_rank(self, values: list[float]) -> list[float]:
        """`values` maximised over every rank of the mesh: one all-reduce per mesh axis (a row then a column of a
        grid reach every rank), so every rank decides on the same numbers."""
        if self._mesh is None or not dist.is_initialized():
            return values
        device = self._device if self._mesh.device_type == self._device.type else torch.device(self._mesh.device_type)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        for dim in range(self._mesh.ndim):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._mesh.get_group(dim))
        return t.tolist()

"""Process-wide switches (`pf.config.explain_cache_misses = True`, ...)."""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any


def _disabled_from_env() -> frozenset[str]:
    return frozenset(name.strip() for name in os.environ.get("PT3FUNC_DISABLE_PASSES", "").split(",") if name.strip())


def _fence_ops_from_env() -> bool | frozenset[str]:
    value = os.environ.get("PT3FUNC_FENCE_BACKWARD_OPS", "").strip()
    if value.lower() in ("", "0", "off", "false"):
        return False
    if value.lower() in ("1", "on", "all", "true"):
        return True
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def _int_from_env(name: str, default: int) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


@dataclass
class Config:
    explain_cache_misses: bool = False
    """Log, at WARNING on logger `pt3func.jit`, why a jitted call traced again."""

    strict_donation: bool = False
    """Raise `DonationError` instead of warning when a donated buffer cannot be reused."""

    disabled_passes: frozenset[str] = field(default_factory=_disabled_from_env)
    """Optimisation passes to skip, by function name (e.g. {"issue_collectives_early"}), to measure what each
    buys or to rule one out; also read from the PT3FUNC_DISABLE_PASSES environment variable (comma-separated).
    Passes that make the program correct (donation, sharding, remat asked for by the user) cannot be skipped."""

    exchange_guard: str = field(default_factory=lambda: os.environ.get("PT3FUNC_EXCHANGE_GUARD", "auto"))
    """Either "auto": `pf.jit(exchange_guard=...)` decides whether a compressed gradient exchange is timed against
    bf16 and switched off where it costs more than it saves (pt3func/compress/guard.py), or "off": never, every
    grad_exchange format runs as given (tests and benchmarks of the formats themselves). Read from the
    PT3FUNC_EXCHANGE_GUARD environment variable too; applies to programs lowered after it is set."""

    gradient_bucket_bytes: int | None = None
    """Pack consecutive data-parallel gradient all-reduces of Inductor-compiled programs into buckets of about
    this many bytes (pt3func/passes/bucketing.py; DDP's default is 25 MiB); None: one all-reduce per gradient.
    Off by default: on 2 H200s over NVLink the anchor step ran 2% slower bucketed (47.7 vs 46.7 ms), the copies
    into the buckets costing more than the fewer, larger all-reduces save there. Slower links may differ."""

    grad_exchange_bucket_bytes: int | None = field(
        default_factory=lambda: _int_from_env("PT3FUNC_GRAD_EXCHANGE_BUCKET_BYTES", 64 * 2**20)
    )
    """Compressed gradient exchange (`pf.jit(grad_exchange=...)`) of elementwise formats (bf16, fp16, int8, int4):
    pack consecutive gradient reductions into buckets of about this many bytes of gradients, one compressed
    reduction each (pt3func/passes/grad_exchange.py); None or 0: one per leaf. 64 MiB by default: per leaf, int8 +
    EF was launch-bound on 2 H200s (2,417 kernels a step), and a compressed bucket is 4x smaller on the wire
    than DDP's 25 MiB fp32 one. Also read from PT3FUNC_GRAD_EXCHANGE_BUCKET_BYTES; applies to programs lowered
    after it is set."""

    loss_chunk_bytes: int | None = field(default_factory=lambda: _int_from_env("PT3FUNC_LOSS_CHUNK_BYTES", 0))
    """Inductor-compiled programs whose loss is `cross_entropy(h @ W.T, targets)` compute it, its gradient and
    the gradient's matmuls a block of rows at a time, with at most this many bytes of fp32 logits per block
    (pt3func/passes/chunked_loss.py): the whole logits and their gradient never exist at once. 0 or None: off,
    the default: on the anchor GPT step on an H200 (vocab 32768) the chunked program peaked higher, not lower
    (10.3 vs 10.2 GiB at 256 MiB chunks; Inductor schedules other work around the chunks), though it lowers the
    CPU-compiled peak. Also read from PT3FUNC_LOSS_CHUNK_BYTES."""

    fence_backward_ops: bool | frozenset[str] = field(default_factory=_fence_ops_from_env)
    """Read the forward inputs of composite backward ops (LayerNorm's, GELU's, softmax's) behind their incoming
    gradient (pt3func/passes/backward_fence.py), so that Inductor cannot compute pieces of them in the forward
    and keep the result until the backward. True: every such op; a set of aten op names
    ({"native_layer_norm_backward"}): only those. Off by default: fencing all of them on the anchor GPT step on
    an H200 raised the peak (10.48 vs 10.16 GiB) and the step time (43.3 vs 42.3 ms) rather than lowering them.
    Also read from PT3FUNC_FENCE_BACKWARD_OPS ("all" or comma-separated names)."""

    bucket_collectives: str = field(default_factory=lambda: os.environ.get("PT3FUNC_BUCKET_COLLECTIVES", "auto"))
    """Inductor's collective bucketing passes (all-gathers, reduce-scatters and all-reduces merged into buckets,
    one launch each), for Inductor-compiled programs: "on", "off", or "auto" (the default): on for CUDA programs
    with an all-gather or reduce-scatter (FSDP), off otherwise. On 2 H200s the anchor step with FSDP + CUDA graphs
    ran 46.8-46.9 ms bucketed against 48.7 unbucketed (JAX's FSDP: 47.2-47.3 ms in the same calls); compiling
    takes longer (80-96 s against 60 s). Data parallel is left unbucketed by "auto": 46.1 ms bucketed against
    45.7 for DDP + torch.compile in the same call, no gain shown. Never on a virtual mesh (torch's threaded
    process group lacks the `out=` collectives a bucketed program calls). Also read from
    PT3FUNC_BUCKET_COLLECTIVES; applies to programs compiled after it is set."""

    inductor_reorder_for_locality: bool = field(
        default_factory=lambda: os.environ.get("PT3FUNC_INDUCTOR_REORDER_FOR_LOCALITY", "1") != "0"
    )
    """Inductor's `reorder_for_locality` post-grad pass, for Inductor-compiled programs (on by default, as in
    Inductor). It moves every node down to just before its first user; in a whole-step program a weight
    gradient's first user is that weight's optimizer update at the end of the step, so each weight-gradient
    matmul, and a recomputed value it reads, sinks there: a recomputed GELU then lands more than 64 nodes from
    its GELU backward, the most apart Inductor fuses (session 9, fusion log on an H200), and costs a kernel of
    its own. Off: the program keeps pt3func's order and the recomputed GELU shares the GELU backward's kernel.
    On an H200 (session 10) off is worth +0.7% with GELU recomputed in 6 of 12 blocks (and 0.24 GiB less peak)
    but costs 0.7% without remat, hence on by default: turn it off together with a recompute policy. A program
    that draws random numbers twice or more is always compiled without it: the pass can swap two draws (seen on
    an H200), and each would read the other's numbers from the generator. Also read from
    PT3FUNC_INDUCTOR_REORDER_FOR_LOCALITY ("0": off); applies to programs compiled after it is set."""

    def __setattr__(self, name: str, value: Any) -> None:
        # A misspelt switch (`config.explain_cache_miss = True`) would otherwise be a new attribute that nothing
        # reads: the setting silently does nothing.
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, sorted(_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(sorted(_FIELDS))}"
            raise AttributeError(f"pf.config has no setting {name!r}{hint}")
        # A wrong value would otherwise be taken as is and fail, or do nothing, only when a program is compiled:
        # a str for `disabled_passes` matched substrings of pass names.
        object.__setattr__(self, name, _CHECKS[name](name, value))


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"pf.config.{name} is True or False, got {value!r}")
    return value


def _bytes(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"pf.config.{name} is a number of bytes (an int >= 0) or None, got {value!r}")
    return value


def _choice(*choices: str) -> Any:
    def check(name: str, value: Any) -> str:
        if isinstance(value, str):  # environment values: " On", "" (unset: the default, the first choice)
            value = value.strip().lower() or choices[0]
        if value not in choices:
            raise ValueError(f"pf.config.{name} is one of {', '.join(map(repr, choices))}, got {value!r} (also read "
                             f"from PT3FUNC_{name.upper()})")
        return value

    return check


# Every pass `disabled_passes` can skip (the functions' names). An unknown name is warned about, not refused: a
# setting written for another version of pt3func keeps working.
SKIPPABLE_PASSES = frozenset({
    "accumulate_in_place", "bucket_gradient_all_reduces", "cast_before_gather", "chunk_cross_entropy",
    "issue_collectives_early", "keep_backward_in_backward", "merge_duplicate_collectives", "order_by_readiness",
    "reduce_partial_sums", "sink_waits",
})


def _names(name: str, value: Any) -> frozenset[str]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in _iterable(name, value)):
        raise ValueError(f"pf.config.{name} is a set of names, e.g. {{'sink_waits'}}, got {value!r}")
    return frozenset(value)


def _iterable(name: str, value: Any) -> Any:
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"pf.config.{name} is a set of names, e.g. {{'sink_waits'}}, got {value!r}") from None


def _passes(name: str, value: Any) -> frozenset[str]:
    names = _names(name, value)
    for unknown in sorted(names - SKIPPABLE_PASSES):
        close = difflib.get_close_matches(unknown, sorted(SKIPPABLE_PASSES), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"the passes are {', '.join(sorted(SKIPPABLE_PASSES))}"
        warnings.warn(f"pf.config.{name}: no pass is named {unknown!r} (it skips nothing); {hint}", stacklevel=3)
    return names


def _fence(name: str, value: Any) -> bool | frozenset[str]:
    return value if isinstance(value, bool) else _names(name, value)


_CHECKS: dict[str, Any] = {
    "explain_cache_misses": _flag, "strict_donation": _flag, "inductor_reorder_for_locality": _flag,
    "disabled_passes": _passes, "exchange_guard": _choice("auto", "off"),
    "bucket_collectives": _choice("auto", "on", "off"), "gradient_bucket_bytes": _bytes,
    "grad_exchange_bucket_bytes": _bytes, "loss_chunk_bytes": _bytes, "fence_backward_ops": _fence,
}
_FIELDS = frozenset(f.name for f in fields(Config))
assert _FIELDS == set(_CHECKS), "every setting has a check"


config = Config()

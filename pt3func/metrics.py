"""Training-run metrics: step time, tokens/s, MFU, communication and peak memory, per step.

`RunMetrics` records one row per step and writes it to `LOG_DIR/metrics.jsonl` (one JSON object a line,
flushed), to TensorBoard event files when `tensorboard` is installed, and to Prometheus gauges when asked
for a port. Only rank 0 of a torch.distributed world records; on other ranks every method does nothing.

    lowered = step.lower(params, opt_state, batch)
    metrics = pf.metrics.RunMetrics("runs/lm", **pf.metrics.from_lowered(lowered),
                                    tokens_per_step=batch_size * seq, peak_flops=989e12)
    for i in range(1, steps + 1):
        with metrics.timed(i) as record:
            params, opt_state, out = step(params, opt_state, next(batches))
            record["loss"] = float(out["loss"])  # waits for the step, so its time is honest
        if i % 100 == 0:
            metrics.log(i, val_loss=evaluate(params))  # outside the timed block: not in the step time
        bar.set_postfix(metrics.postfix())
    metrics.close()

Plot a run with `python scripts/plot_run.py runs/lm/metrics.jsonl -o run.png`.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pt3func.analysis import format_bytes

__all__ = ["RunMetrics", "from_lowered", "peak_memory_bytes"]

JSONL_NAME = "metrics.jsonl"
# Keys `step` may compute; a user scalar of the same name would be ambiguous in the files.
_COMPUTED = frozenset({"step", "time", "step_time_s", "tokens_per_s", "flops_per_s", "mfu", "comm_bytes",
                       "peak_mem_bytes"})


def from_lowered(lowered: Any) -> dict[str, Any]:
    """`flops_per_step` and `comm_bytes_per_step` of a `Lowered` (or `Compiled`) step, from `cost_analysis()`.

    Both are per rank: the program `pf.jit` lowered is one device's. Pass them to `RunMetrics(**...)`.
    """
    if not hasattr(lowered, "cost_analysis"):
        raise TypeError(f"from_lowered takes step.lower(*args) (a Lowered) or its compile(), got "
                        f"{type(lowered).__name__}; e.g. pf.metrics.from_lowered(step.lower(params, opt_state, batch))")
    cost = lowered.cost_analysis()
    return {"flops_per_step": cost["flops"], "comm_bytes_per_step": dict(cost["comm_bytes"])}


def peak_memory_bytes() -> int | None:
    """Peak memory of this process so far: CUDA's `max_memory_allocated` once CUDA is in use, else max RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        import resource
    except ImportError:  # Windows has no `resource`
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024)


class RunMetrics:
    """Per-step metrics of a training run, written as JSONL, TensorBoard events and Prometheus gauges.

    Args:
        log_dir: where `metrics.jsonl` and the TensorBoard event files go; None writes no files.
        flops_per_step: FLOPs of one step on one device (e.g. from `from_lowered`); with `peak_flops`, gives MFU.
        peak_flops: the device's peak FLOP/s (e.g. 989e12 for H100/H200 dense bf16).
        tokens_per_step: tokens one step consumes over all ranks; gives `tokens_per_s`.
        comm_bytes_per_step: collective payload of one step on one device: bytes, or bytes per collective kind.
        jsonl: write `log_dir/metrics.jsonl` (appended to, so a resumed run continues its file; a non-finite
            value is written as null).
        tensorboard: True requires `tensorboard`; "auto" writes event files when it is installed; False never.
        prometheus_port: serve the latest value of every metric as a Prometheus gauge on this port (0 picks a
            free one, see `.prometheus_port`); None (default) imports nothing and serves nothing.
        prometheus_addr: the address the Prometheus server binds.
        rank: which rank this is; default: `dist.get_rank()` in an initialized world, else the launcher's `RANK`
            (torchrun, `pt3func run`), else 0. Only 0 records.
        clock: seconds as a float, for step times; tests inject a fake one.
        window: steps over which `postfix()` takes the median step time (so a compile step soon drops out).
    """

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        tokens_per_step: int | None = None,
        comm_bytes_per_step: int | Mapping[str, int] | None = None,
        jsonl: bool = True,
        tensorboard: bool | str = "auto",
        prometheus_port: int | None = None,
        prometheus_addr: str = "0.0.0.0",
        rank: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        window: int = 10,
    ) -> None:
        if tensorboard not in (True, False, "auto"):
            raise ValueError(f"tensorboard takes True, False or 'auto'; got {tensorboard!r}")
        if rank is None:
            # Before the process group starts (RunMetrics made before pf.make_mesh), the launcher's RANK says.
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
        self.rank = rank
        self.active = rank == 0
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.tokens_per_step = tokens_per_step
        if isinstance(comm_bytes_per_step, Mapping):
            self.comm_bytes_by_kind: dict[str, int] = {k: int(v) for k, v in comm_bytes_per_step.items()}
            self.comm_bytes_per_step: int | None = sum(self.comm_bytes_by_kind.values())
        else:
            self.comm_bytes_by_kind = {}
            self.comm_bytes_per_step = None if comm_bytes_per_step is None else int(comm_bytes_per_step)
        self.latest: dict[str, Any] = {}  # the newest value of every metric, from `step` and `log`
        self.prometheus_port: int | None = None
        self._clock = clock
        self._mark = clock()
        self._last_step: int | None = None
        self._timed: dict[int, float] = {}
        self._recent: deque[float] = deque(maxlen=max(1, window))
        self._user_keys: list[str] = []
        self._jsonl = None
        self._tb = None
        self._prom_server = None
        self._gauges: dict[str, Any] = {}
        if not self.active:
            return
        if self.log_dir is not None and jsonl:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (self.log_dir / JSONL_NAME).open("a")
        if self.log_dir is not None and tensorboard:
            self._tb = _summary_writer(self.log_dir, required=tensorboard is True)
        if prometheus_port is not None:
            self._start_prometheus(prometheus_port, prometheus_addr)

    @property
    def jsonl_path(self) -> Path | None:
        """The JSONL file this run appends to (None when not writing one)."""
        return None if self._jsonl is None else Path(self._jsonl.name)

    def reset_clock(self) -> None:
        """Start the next step's wall-clock time now (e.g. after an evaluation between two steps)."""
        self._mark = self._clock()

    @contextmanager
    def timed(self, step: int) -> Iterator[dict[str, Any]]:
        """Time the block as step `step`, then record it with the scalars the block put in the yielded dict.

        The block must wait for the step (e.g. `float(loss)`) or its time is only the launch's.
        """
        scalars: dict[str, Any] = {}
        start = self._clock()
        yield scalars
        self.step(step, step_time_s=self._clock() - start, **scalars)

    def step(self, step: int, *, step_time_s: float | None = None, **scalars: Any) -> dict[str, Any]:
        """Record step `step` with user `scalars` (loss, skipped steps, ...); returns the row (empty off rank 0).

        The step time is `step_time_s` when given (as `timed` does), else the wall clock since the previous
        call (or construction, or `reset_clock`) divided by the steps since then, so logging every N steps works.
        """
        now = self._clock()
        if step_time_s is None:
            n_steps = step - self._last_step if self._last_step is not None and step > self._last_step else 1
            step_time_s = (now - self._mark) / n_steps
        self._mark, self._last_step = now, step
        if not self.active:
            return {}
        row: dict[str, Any] = {"step": int(step), "time": time.time(), "step_time_s": step_time_s}
        if step_time_s > 0:
            if self.tokens_per_step is not None:
                row["tokens_per_s"] = self.tokens_per_step / step_time_s
            if self.flops_per_step is not None:
                row["flops_per_s"] = self.flops_per_step / step_time_s
                if self.peak_flops:
                    row["mfu"] = self.flops_per_step / step_time_s / self.peak_flops
        if self.comm_bytes_per_step is not None:
            row["comm_bytes"] = self.comm_bytes_per_step
            for kind, nbytes in self.comm_bytes_by_kind.items():
                row[f"comm_bytes/{kind}"] = nbytes
        peak = peak_memory_bytes()
        if peak is not None:
            row["peak_mem_bytes"] = peak
        self._add_scalars(row, scalars)
        self._recent.append(step_time_s)
        self._write(row)
        return row

    def log(self, step: int, **scalars: Any) -> dict[str, Any]:
        """Record more scalars for step `step` (a validation loss after it) without timing anything."""
        if not self.active:
            return {}
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        self._add_scalars(row, scalars)
        self._write(row)
        return row

    def _add_scalars(self, row: dict[str, Any], scalars: dict[str, Any]) -> None:
        for key, value in scalars.items():
            if key in row or key in _COMPUTED:
                raise ValueError(f"RunMetrics: scalar {key!r} clashes with a metric it computes; rename it")
            row[key] = _to_float(key, value)
            if key not in self._user_keys:
                self._user_keys.append(key)
        self.latest.update(row)

    def postfix(self, *keys: str) -> dict[str, str]:
        """A short summary for a progress bar (`tqdm.set_postfix(metrics.postfix())`): the user scalars (or
        `keys`, each its newest value), tokens/s and MFU over the median recent step time, communication per
        step and peak memory."""
        if not self.active or not self._recent:
            return {}
        out = {}
        for key in keys or self._user_keys:
            if key in self.latest:
                out[key] = _short(self.latest[key])
        step_s = statistics.median(self._recent)
        if self.tokens_per_step is not None and step_s > 0:
            out["tok/s"] = _short(self.tokens_per_step / step_s)
        if self.flops_per_step is not None and self.peak_flops and step_s > 0:
            out["mfu"] = f"{self.flops_per_step / step_s / self.peak_flops:.1%}"
        if "tok/s" not in out:
            out["step"] = f"{step_s * 1e3:.0f}ms" if step_s < 10 else f"{step_s:.1f}s"
        if self.comm_bytes_per_step:
            out["comm"] = format_bytes(self.comm_bytes_per_step, sep="")
        if "peak_mem_bytes" in self.latest:
            out["mem"] = f"{self.latest['peak_mem_bytes'] / 2**30:.2f}G"
        return out

    def close(self) -> None:
        """Flush and close the files and stop the Prometheus server; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._prom_server is not None:
            self._prom_server.shutdown()
            self._prom_server.server_close()
            self._prom_server = None

    def __enter__(self) -> RunMetrics:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _write(self, row: dict[str, Any]) -> None:
        if self._jsonl is not None:
            # Strict JSON (jq, other languages) has no NaN or Infinity: a non-finite value is written as null.
            strict = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
            self._jsonl.write(json.dumps(strict) + "\n")
            self._jsonl.flush()  # a crashed or killed run keeps every step it finished
        step = row["step"]
        metrics = {k: v for k, v in row.items() if k not in ("step", "time") and _finite(v)}
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step, walltime=row["time"])
        if self._prom_server is not None:
            # Non-finite values too (Prometheus has NaN and Inf): a diverged run must not show its last good loss.
            numbers = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
            for key, value in {"step": step, **numbers}.items():
                self._gauge(key).set(value)

    def _start_prometheus(self, port: int, addr: str) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ImportError(
                "RunMetrics(prometheus_port=...) needs prometheus-client: pip install 'pt3func[metrics]'"
            ) from exc
        # A registry of its own: two runs in one process (tests, notebooks) must not clash on gauge names.
        self._registry = prometheus_client.CollectorRegistry()
        try:
            self._prom_server, _thread = prometheus_client.start_http_server(port, addr=addr, registry=self._registry)
        except OSError as exc:
            raise OSError(f"RunMetrics: cannot serve Prometheus metrics on {addr}:{port} ({exc.strerror}); pick "
                          "another prometheus_port, or 0 for any free one") from exc
        self.prometheus_port = self._prom_server.server_port

    def _gauge(self, key: str) -> Any:
        gauge = self._gauges.get(key)
        if gauge is None:
            from prometheus_client import Gauge

            name = "pt3func_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            gauge = Gauge(name, f"pt3func run metric {key!r}, latest step", registry=self._registry)
            self._gauges[key] = gauge
        return gauge


def _summary_writer(log_dir: Path, required: bool) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if required:
            raise ImportError(
                "RunMetrics(tensorboard=True) needs tensorboard: pip install 'pt3func[metrics]'"
            ) from exc
        return None
    return SummaryWriter(str(log_dir))


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        placements = getattr(value, "placements", None)
        if placements is not None:
            # Gathering a sharded or partial DTensor is a collective, and only rank 0 records: it would hang.
            if not all(p.is_replicate() for p in placements):
                raise TypeError(
                    f"RunMetrics.step: {key!r} is a DTensor that is not replicated; pass "
                    f"float(pf.device_get(value)) computed on every rank"
                )
            value = value.to_local()
        if value.numel() != 1:
            raise TypeError(f"RunMetrics.step: {key!r} has shape {tuple(value.shape)}; scalars only")
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"RunMetrics.step: {key!r} must be a number or a one-element tensor, got {value!r}") from exc


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _short(value: float) -> str:
    """3 significant digits, with k/M/G for large values: 2.35, 0.0123, 12.3k, 1.23M; nan and inf as such."""
    if not math.isfinite(value):
        return str(value)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if value else "0"

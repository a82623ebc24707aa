"""Helpers shared by the benchmark scripts: timing, JSON output and result tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
_ROOT = Path(__file__).resolve().parent.parent
# The anchor benchmark (shared/bench/anchor_lm_step.py) beside or above the checkout, or carried to the GPU in .whl.
ANCHOR_CANDIDATES = (
    _ROOT / "shared" / "bench" / "anchor_lm_step.py",
    _ROOT.parent / "shared" / "bench" / "anchor_lm_step.py",
    _ROOT / ".whl" / "anchor_lm_step.py",
)


def find_anchor(path: str | None = None) -> Path | None:
    """The anchor script: `path` if given, else the first of ANCHOR_CANDIDATES that exists; None if none does."""
    for candidate in ([Path(path)] if path else ANCHOR_CANDIDATES):
        if candidate.exists():
            return candidate.resolve()
    return None


def environment() -> dict[str, Any]:
    """What the numbers were measured on, so a results file explains itself."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def time_interleaved(
    calls: dict[str, Callable[[], Any]], n: int, repeats: int, warmup: int
) -> dict[str, dict[str, float]]:
    """Per-call wall time in microseconds of each `calls[name]()`: `repeats` batches of `n` calls each.

    Batches of the different callables are interleaved (round robin) so that drift in the machine's state
    (frequency, other processes) spreads over all of them instead of favouring whichever ran first. Each batch
    gives one mean per call (timing one call alone would mostly measure the clock); the median over batches
    is robust to the odd batch hit by a GC pause.
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter_ns()
            for _ in range(n):
                call()
            per_call[name].append((time.perf_counter_ns() - start) / n / 1e3)
    return {
        name: {
            "median_us": statistics.median(times),
            "min_us": min(times),
            "max_us": max(times),
            "calls": n,
            "repeats": repeats,
        }
        for name, times in per_call.items()
    }


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write one JSON document (indented, for reading and diffing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def append_jsonl(path: str | Path, record: dict[str, Any]) -> Path:
    """Append one record as a line, so runs of several configs accumulate in one file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return path


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print rows as a table: with rich when it is installed, else as a Markdown table."""
    cells = [[_fmt(v) for v in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for row in cells:
            print("| " + " | ".join(row) + " |")
        return
    console = Console()
    # Wide enough that long variant names stay on one line even when stdout is a pipe or a narrow terminal.
    console.width = max(console.width, 150)
    table = Table(title=title)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in cells:
        table.add_row(*row)
    console.print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN marks "not measured for this row"
            return "-"
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def arrive_and_wait(barrier: str | None, timeout_s: float = 900.0) -> None:
    """Wait at a barrier of concurrent benchmark runs: `barrier` is "DIR:N:ID"; this run marks DIR/ID and waits
    until N runs have (the parent marks a run that ended early, so a crash does not hold the others).

    Concurrent runs compile in parallel; waiting here until every one has compiled keeps those compiles (CPU
    work) off the host while any run times its steps.
    """
    if not barrier:
        return
    mark_arrived(barrier)
    directory, count, _ = barrier.rsplit(":", 2)
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(directory)) < int(count) and time.monotonic() < deadline:
        time.sleep(0.5)


def mark_arrived(barrier: str) -> None:
    """Count the run of `barrier` ("DIR:N:ID") as arrived (idempotent: the parent marks runs that ended early)."""
    directory, _, me = barrier.rsplit(":", 2)
    Path(directory, me).touch()

"""Where a step's GPU time goes: kernel time by kind, and communication not hidden behind compute.

`profile_steps(step_once, n)` runs `step_once` n times under torch.profiler (CUDA activity) and returns a
summary dict; `format_summary` prints it. Used by `lm_step.py --profile`.

Kinds are read from kernel names (NCCL, GEMM, attention, Triton, other). "Exposed communication" is the time
in which an NCCL kernel runs and no other kernel does, from the kernels' own start/end times: the part of the
exchange that overlap did not hide.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

_KINDS = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm\d\d_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("triton", re.compile(r"^triton", re.I)),
)


def _kind(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _minus_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) minus union(b); both lists merged and sorted."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def profile_steps(step_once: Callable[[], None], n: int = 3, trace_path: str | None = None) -> dict[str, Any]:
    """Profile n calls of `step_once` (which must synchronise the device itself); per-step kernel times in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step_once()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    # Device-side ranges of user annotations (`DistributedDataParallel.forward`, `Optimizer.step#...`) are CUDA
    # events too, but cover idle time as well as kernels: only kernels, copies and memsets are counted.
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    comm, compute = [], []
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        kind = _kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start)
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
        (comm if kind == "nccl" else compute).append((start, end))
    comm_u, compute_u = union_intervals(comm), union_intervals(compute)
    span = (max(e for _, e in comm_u + compute_u) - min(s for s, _ in comm_u + compute_u)) if kernels else 0.0
    busy = union_intervals(comm + compute)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return dict(
        steps=n,
        span_ms=round(span / n / 1e3, 3),
        busy_ms=round(sum(e - s for s, e in busy) / n / 1e3, 3),
        compute_ms=round(sum(e - s for s, e in compute_u) / n / 1e3, 3),
        comm_ms=round(sum(e - s for s, e in comm_u) / n / 1e3, 3),
        exposed_comm_ms=round(_minus_us(comm_u, compute_u) / n / 1e3, 3),
        by_kind_ms={k: round(v / n / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        n_kernels=len(kernels) // max(n, 1),
        top_kernels=[dict(name=name[:110], ms=round(t / n / 1e3, 3), calls=c // n) for name, (t, c) in top],
    )


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"profile over {summary['steps']} steps (per step): span {summary['span_ms']} ms, kernels busy "
        f"{summary['busy_ms']} ms, compute {summary['compute_ms']} ms, NCCL {summary['comm_ms']} ms of which "
        f"exposed {summary['exposed_comm_ms']} ms; {summary['n_kernels']} kernels",
        "by kind (ms): " + ", ".join(f"{k} {v}" for k, v in summary["by_kind_ms"].items()),
    ]
    lines += [f"  {k['ms']:8.3f} ms  x{k['calls']:<4} {k['name']}" for k in summary["top_kernels"]]
    return "\n".join(lines)

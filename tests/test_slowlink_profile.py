"""The slow-link benchmark's profile breakdown (benchmarks/compression.py): profiler events of the timed steps,
sorted into categories, per step, with the rest of the wall time as host overhead."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import compression  # noqa: E402


def test_profile_breakdown_counts_only_the_steps_events_per_step():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    steps, wall = 2, 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            with record_function(compression.STEP_MARK):
                torch.mm(a, b)
                torch.ops._c10d_functional.wait_tensor(torch.ones(3))
                torch.tanh(a)
                time.sleep(0.01)  # host time outside any event
            wall += time.perf_counter() - start
        torch.mm(a, b)  # outside the steps: not counted
    out = compression._profile_breakdown(prof, steps, wall)
    assert out["step"] == pytest.approx(wall * 1e3 / steps)
    mm = [e.self_cpu_time_total / 1e3 for e in prof.events() if e.name == "aten::mm"]
    assert len(mm) == steps + 1 and out["matmul"] == pytest.approx(sum(mm[:steps]) / steps)
    assert out["matmul"] > 0 and out["exchange wait"] > 0 and out["other kernels"] > 0
    assert out["codec kernels"] == 0 and out["collective issue"] == 0
    assert out["host, other"] >= 9.0  # the sleep, per step
    parts = sum(v for k, v in out.items() if k not in ("step", "top_events_ms"))
    assert parts == pytest.approx(out["step"])
    assert "aten::mm" in out["top_events_ms"] and compression.STEP_MARK not in out["top_events_ms"]

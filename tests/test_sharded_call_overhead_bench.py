"""benchmarks/sharded_call_overhead.py runs (a few calls) and reports both variants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_times_both_variants(tmp_path):
    out = tmp_path / "sco.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sharded_call_overhead.py"), "--leaves", "4", "--calls", "2",
         "--repeats", "1", "--warmup", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    timings = json.loads(out.read_text())["timings"]
    assert set(timings) == {"plain tensors", "DTensors (1-rank mesh)"}
    assert all(t["median_us"] > 0 for t in timings.values())

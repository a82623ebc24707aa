"""benchmarks/quant_stream.py on CPU (Triton's interpreter): both dequantise variants checked against the torch
reference and timed against a copy, one record per size and variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pt3func.kernels import triton_available

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_a_record_per_size_and_variant(tmp_path):
    if not triton_available():
        pytest.skip("triton is not importable here (CI installs it with the dev extra)")
    out = tmp_path / "qs.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quant_stream.py"), "--device", "cpu", "--sizes", "small",
         "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    kinds = {(r["size_bytes"], r["kernel"]) for r in records}
    assert len(kinds) == len(records) == 2 * 4  # 2 sizes x (int8, int4) x (plain, streaming)
    assert all(r["median"] > 0 and r["worst"] <= r["median"] for r in records)

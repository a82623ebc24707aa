"""Fault tolerance end to end: examples/train_resilient.py under `pt3func run` (torchrun, gloo, 2 processes).

A run whose rank 1 is SIGKILLed mid-training, and one whose rank 0 dies mid-commit of a save, are restarted
by torchrun (`--max-restarts`), resume from the last committed checkpoint and end with the same params, bit
for bit, as an uninterrupted run. A NaN batch is skipped by `apply_if_finite` on every rank alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pt3func as pf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_resilient.py"

pytestmark = pytest.mark.slow


def train(directory: Path, *flags: str, restarts: int = 0) -> tuple[dict, str]:
    """Run the example on 2 processes; its summary line and the whole output."""
    out = directory.with_suffix(".pt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "pt3func", "run", "-n", "2", "--max-restarts", str(restarts), str(SCRIPT),
           "--dir", str(directory), "--backend", "eager", "--steps", "12", "--save-every", "4", "--out", str(out),
           *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads(next(line for line in output.splitlines() if line.startswith("summary "))[8:])
    return {**summary, "params": torch.load(out)}, output


def assert_same_bits(a: dict, b: dict) -> None:
    for x, y in zip(pf.tree.leaves(a), pf.tree.leaves(b), strict=True):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    summary, _ = train(tmp_path_factory.mktemp("faults") / "clean")
    assert summary["resumed_from"] is None and summary["checkpoints"] == [4, 8, 12]
    return summary


def test_killed_rank_resumes_bit_for_bit(tmp_path: Path, uninterrupted: dict) -> None:
    summary, output = train(tmp_path / "ckpt", "--kill-at-step", "10", "--kill-rank", "1", restarts=2)
    assert "rank 1: SIGKILL" in output
    # Save 8 may still be in flight when rank 1 dies at step 10; save 4 is committed (save 8 waited for it).
    assert summary["resumed_from"] in (4, 8)
    assert summary["ranks_agree"] and summary["checkpoints"] == [4, 8, 12]
    assert_same_bits(summary["params"], uninterrupted["params"])


def test_kill_during_save_resumes_from_previous(tmp_path: Path, uninterrupted: dict) -> None:
    summary, output = train(tmp_path / "ckpt", "--kill-during-save", "8", restarts=2)
    assert "rank 0: SIGKILL (killed-during-save-8)" in output
    assert summary["resumed_from"] == 4  # step 8 was written but never committed
    assert summary["checkpoints"] == [4, 8, 12]
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name]
    assert_same_bits(summary["params"], uninterrupted["params"])


def test_nan_step_is_skipped_on_every_rank(tmp_path: Path, uninterrupted: dict) -> None:
    summary, _ = train(tmp_path / "ckpt", "--nan-at-step", "5")
    assert summary["skipped_steps_per_rank"] == [[5], [5]]
    assert summary["ranks_agree"]
    assert all(torch.isfinite(p).all() for p in pf.tree.leaves(summary["params"]))

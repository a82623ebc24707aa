"""benchmarks/memory.py's verdict over several waves: met only where every wave meets it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import memory  # noqa: E402


def _wave(ours_tokens: float, ours_peak: float, theirs_tokens: float = 100.0) -> list[memory.Run]:
    ours = memory.Run("pt3func, x", "pt3func", [], 16, record={"step_ms": 1e3 / ours_tokens,
                                                                "tokens_per_s": ours_tokens, "peak_mem_gib": ours_peak})
    theirs = memory.Run(memory.TORCH_COMPILE, memory.TORCH_COMPILE, [], 16,
                        record={"step_ms": 1e3 / theirs_tokens, "tokens_per_s": theirs_tokens, "peak_mem_gib": 10.0})
    return [ours, theirs]


def test_met_only_if_every_wave_meets_speed_and_memory():
    met = memory.report_repeats([_wave(101, 8.8), _wave(100, 8.9)])["verdicts"]["pt3func, x"]
    assert met["met"] and met["tokens_per_s_vs_torch_compile"] == [1.01, 1.0]
    slower_once = memory.report_repeats([_wave(101, 8.8), _wave(99, 8.8)])["verdicts"]["pt3func, x"]
    assert not slower_once["met"]
    too_big = memory.report_repeats([_wave(105, 9.5), _wave(105, 8.8)])["verdicts"]["pt3func, x"]
    assert not too_big["met"]

"""benchmarks/ab_step.py: variants take turns in one process, each with its own pf.config, none leaking."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import pt3func as pf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ab_step  # noqa: E402
import lm_step  # noqa: E402

MODEL = "--layers 1 --d 32 --heads 2 --seq 16 --batch 2 --vocab 64"


def _run(monkeypatch, tmp_path, *variants: str) -> dict:
    out = tmp_path / "ab.jsonl"
    argv = ["ab_step.py", "--device", "cpu", "--anchor-impl", "none", "--rounds", "3", "--turn", "2",
            "--model", MODEL, *(f"--variant={v}" for v in variants), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    ab_step.main()
    return json.loads(out.read_text().splitlines()[-1])


def test_turns_timed_after_their_first_step(monkeypatch, tmp_path):
    before = pf.config.loss_chunk_bytes
    record = _run(monkeypatch, tmp_path, "", "--loss-chunk-mib 0.002")
    assert record["reference"] == "pt3func" and record["turn"] == 2
    runs = record["runs"]
    assert list(runs) == ["pt3func", "pt3func --loss-chunk-mib 0.002"]
    assert all(len(r["step_times_ms"]) == 3 for r in runs.values())  # 3 rounds x (2 steps - the untimed first)
    assert runs["pt3func"]["speed_vs_reference"] == 1.0
    assert pf.config.loss_chunk_bytes == before  # a variant's config is set only around its own calls


def test_each_variant_runs_its_own_program():
    a = lm_step.parse_args([*MODEL.split(), "--device", "cpu"])
    chunked = lm_step.parse_args([*MODEL.split(), "--device", "cpu", "--loss-chunk-mib", "0.002"])
    plain_call = ab_step.variant_step(a, torch.device("cpu"), None)
    chunked_call = ab_step.variant_step(chunked, torch.device("cpu"), None)
    plain_call(), chunked_call(), plain_call()

    def log_softmaxes(call) -> int:
        nodes = call.lower().graph_module.graph.nodes
        return sum(n.target is torch.ops.aten._log_softmax.default for n in nodes)

    assert log_softmaxes(plain_call) == 1
    rows_per_chunk = int(0.002 * 2**20) // (64 * 4)  # fp32 logits of 64 classes in 0.002 MiB: 8 of 32 rows
    assert log_softmaxes(chunked_call) == 32 // rows_per_chunk == 4


def test_process_wide_flags_are_refused(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="sdpa_priority"):
        _run(monkeypatch, tmp_path, "--sdpa-priority cudnn")

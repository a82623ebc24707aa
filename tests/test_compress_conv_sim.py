"""benchmarks/compression_sim.py, the one-process stand-in for compression.py's convergence part: its fp32 path
must be the benchmark's training (pf.optim's clipped AdamW on the data-parallel mean gradient), and its
compressed paths must keep error feedback's invariant (what is sent plus what is held = what came in)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import char_lm  # noqa: E402
import compression_sim as sim  # noqa: E402
import data as chardata  # noqa: E402
import gpt  # noqa: E402

import pt3func as pf  # noqa: E402


def test_fp32_path_is_the_benchmarks_training():
    a = sim.parse_args(["--steps", "10", "--d-model", "32"])
    s = sim.Sim(a)
    params = gpt.init_params(s.config, seed=0)
    opt = char_lm.make_optimizer(argparse.Namespace(steps=10, warmup=30, lr=3e-3, clip=1.0, weight_decay=0.1))
    state = opt.init(params)
    train = chardata.batches(s.dataset.train, 32, 64, seed=0)
    for t in range(4):
        batch = next(train)
        s.step(t, batch)
        grads = pf.grad(lambda p, b: gpt.loss_fn(p, b, s.config))(params, batch)
        updates, state = opt.update(grads, state, params)
        params = pf.optim.apply_updates(params, updates)
    for got, want in zip(s.params, pf.tree.leaves(params)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_topk_and_powersgd_exchanges_keep_error_feedbacks_sum():
    for flags in (["--fmt", "topk"], ["--fmt", "topk", "--global-topk", "1"], ["--fmt", "powersgd"]):
        s = sim.Sim(sim.parse_args([*flags, "--d-model", "32", "--ratio", "0.05"]))
        grads = [[torch.randn(sh) for sh in s.shapes] for _ in range(s.world)]
        exact = [torch.zeros(s.shapes[s.wte])]
        held = [[r.clone() for r in rank] for rank in s.residual]
        out = s.exchange(0, grads, exact)
        compressed = [i for i in range(len(s.shapes)) if s.compressed(i)]
        assert compressed
        for i in compressed:
            came_in = sum(grads[r][i] + held[r][i] for r in range(s.world))
            kept = sum(s.residual[r][i] for r in range(s.world))
            torch.testing.assert_close(out[i] * s.world + kept, came_in, rtol=1e-4, atol=1e-4)
            assert kept.norm() > 0.1 * came_in.norm()  # it did compress


def test_global_topk_sends_one_budget_over_all_leaves():
    """Global top-k sends ratio x the compressed leaves' total per rank, wherever the magnitudes are: a leaf
    holding all the large values gets more than its own ratio x size, the others less."""
    s = sim.Sim(sim.parse_args(["--fmt", "topk", "--global-topk", "1", "--d-model", "32", "--ratio", "0.05"]))
    compressed = [i for i in range(len(s.shapes)) if s.compressed(i)]
    loud = compressed[0]
    grads = [[torch.randn(sh) * (100.0 if i == loud else 1.0) for i, sh in enumerate(s.shapes)] for _ in range(s.world)]
    s.exchange(0, grads, [torch.zeros(s.shapes[s.wte])])
    total = sum(s.shapes[i].numel() for i in compressed)
    sent = {i: int((s.residual[0][i] == 0).sum()) for i in compressed}
    assert sum(sent.values()) == math.ceil(0.05 * total)
    assert sent[loud] > 0.05 * s.shapes[loud].numel()

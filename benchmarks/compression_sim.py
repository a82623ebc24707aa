"""A one-process simulation of `compression.py`'s convergence part, for trying exchange ideas in seconds.

    .venv/bin/python benchmarks/compression_sim.py                                   # fp32: val loss 1.6981
    .venv/bin/python benchmarks/compression_sim.py --fmt topk --dense 30 --ramp 60   # the "+warmup" top-k row
    .venv/bin/python benchmarks/compression_sim.py --fmt powersgd --dense 60 --freeze 60
    .venv/bin/python benchmarks/compression_sim.py --smoke                           # a few steps (for a test)

`compression.py` trains the char GPT data-parallel on 4 gloo processes through `pf.jit(grad_exchange=...)`:
~4 minutes per format on 2 cores. This script runs the same training in one process and one thread (~40 s):
the same model, init, batches (rank r gets rows 8r..8r+7 of each 32-row batch), clipping, AdamW and
warmup-cosine schedule, validation batches; each rank's gradient is computed on its own rows and the exchange
is simulated on the host. The tied embedding's lookup gradient is exact, as in the sharded program, where
DTensor all-gathers the output gradient instead of reducing it; only the head's part is compressed. The fp32
run reproduces `compression.py`'s val loss 1.6981 to the printed digits; the warm-up rows land within 1-3% of
the real runs (2.099 vs 2.031 top-k, 1.859 vs 1.843 PowerSGD): good for ranking ideas, not for the table.

Exchanges (`--fmt`): none, topk (per-rank top-k of each 2-D leaf, 1-D leaves dense, error feedback), powersgd
(rank-r power iteration with warm start and error feedback, torch's 2x minimum compression). Options that
`pf.compress` does not have are the ideas tried against issue 6's convergence bound (README, "Compression
benchmarks"):

- `--freeze N`: Adam's second moment frozen after N steps (1-bit Adam, Tang et al. 2021).
- `--onebit 1`: 1-bit Adam's compression stage after the dense steps: each rank compresses its momentum
  b1 m + (1 - b1) g_r (m: the last exchanged momentum) with error feedback, the exchanged mean is the new m and
  the update is m / sqrt(v frozen at the switch); gradients are clipped by the exact global norm first
  (`--onebit-clip exchanged`: what the exchange delivers is clipped instead, as an optimizer would).
- `--ef21 E`: EF21 (Richtarik et al. 2021): each rank compresses the difference between its (E = 1: gradient,
  E < 1: momentum with weight E, EF21-SGDM) and its last sent estimate; the optimizer sees the running mean of
  the estimates.
- `--agree 1|2|3`: top-k indices agreed across ranks (1: a rotating leader's, 2: the union of every rank's,
  3: the top-k of the ranks' mean, an oracle); each selected value is then the exact mean.
- `--selnu B --sel S`: select top-k by |v| / nu^S, nu a rank's EMA (decay B) of its squared gradient.
- `--iters K`: PowerSGD power iterations per step.
- `--only RE` / `--skip RE`: compress only the leaves whose path matches (or does not).
- `--flush N`: every N-th compressed step is dense and also sends every rank's residual (error feedback
  flushed); `--lr-compressed X`: the learning rate times X once compression starts; `--b1`, `--b2`, `--eps`:
  Adam's (session 12; `results/compression_sim_session12.json`).
- `--warm-q 1`: PowerSGD's Q power-iterated on the exact mean during the dense steps (session 16).
- `--rank-for 'RE=R;RE=R'` / `--rank-schedule 'STEP:X,...'`: PowerSGD's rank per leaf, and scaled over time
  (Accordion, Agarwal et al. 2021), to spend rank 4's bytes unevenly (session 13;
  `results/compression_sim_session13.json`). Each result carries `sent_fraction`: elements a rank sends per step
  over the leaves' total, averaged over the run and over its compressed steps.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import data as chardata  # noqa: E402
import gpt  # noqa: E402

import pt3func as pf  # noqa: E402

B1, B2, EPS, WEIGHT_DECAY, CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0  # examples/char_lm.py's make_optimizer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--fmt", choices=("none", "topk", "powersgd"), default="none")
    add("--ratio", type=float, default=0.01, help="top-k: kept fraction per rank and leaf")
    add("--rank", type=int, default=4, help="powersgd: rank")
    add("--iters", type=int, default=1, help="powersgd: power iterations per step")
    add("--warm-q", type=int, default=0,
        help="powersgd: during the dense steps, power-iterate Q on the exchanged mean (no bytes: every rank has it), "
             "so compression starts from the gradient's leading directions instead of a random Q")
    add("--scaled", type=float, default=0.0,
        help="powersgd: approximate D_r^-1 M D_c^-1 instead of M, D the row and column means of a second moment to "
             "this power / 2 (1: Adam's update metric under Adafactor's rank-1 factoring of v; a diagonal scaling "
             "keeps the rank, so the bytes are rank r's; 0: off)")
    add("--scaled-src", choices=("adam", "ema"), default="adam",
        help="--scaled: the optimizer's v (every rank has it), or the exchange's own EMA (decay b2) of the squared "
             "exchanged mean (what a format can keep without the optimizer)")
    add("--dense", type=int, default=0, help="uncompressed first steps")
    add("--ramp", type=int, default=0, help="top-k: DGC's sparsity warm-up (25%%, 6.25%%, ...) over this many steps")
    add("--ef", type=int, default=1, help="error feedback (0: off)")
    add("--freeze", type=int, default=-1, help="freeze Adam's second moment after this many steps (-1: never)")
    add("--onebit", type=int, default=0, help="1-bit Adam's compression stage after --dense steps")
    add("--onebit-clip", choices=("gradient", "exchanged"), default="gradient",
        help="--onebit: clip each rank's gradient by the exact mean's norm (gradient), or clip what the exchange "
             "delivers (momentum of compressed leaves, gradient of the others), as an optimizer after pf.jit's "
             "exchange would")
    add("--ef21", type=float, default=0.0, help="EF21 (1) or EF21-SGDM with this momentum weight (< 1)")
    add("--agree", type=int, default=0, help="top-k indices agreed: 1 rotating leader, 2 union, 3 oracle mean")
    add("--selnu", type=float, default=0.0, help="top-k: select by |v| / nu^sel, nu a local EMA with this decay")
    add("--sel", type=float, default=0.0)
    add("--ef-decay", type=float, default=1.0,
        help="top-k (global): keep this fraction of the unsent residual each step (damped error feedback; 1: plain EF)")
    add("--age-tau", type=float, default=0.0,
        help="top-k (global): select by |v| x (1 + age / tau), age = steps since a coordinate was last sent (0: off)")
    add("--global-topk", type=int, default=0,
        help="top-k: one selection per rank over all compressed leaves at once (k = ratio x their total size)")
    add("--only", default="", help="compress only leaves whose path matches this regex")
    add("--skip", default="", help="leave leaves whose path matches this regex uncompressed")
    add("--flush", type=int, default=0,
        help="every N-th compressed step is dense and also sends every rank's residual (EF flushed; 0: never)")
    add("--lr-compressed", type=float, default=1.0, help="learning rate multiplier from the end of --dense on")
    add("--b1", type=float, default=B1, help="Adam's b1 (the fp32 run's: 0.9)")
    add("--b2", type=float, default=B2, help="Adam's b2 (the fp32 run's: 0.95)")
    add("--eps", type=float, default=EPS, help="Adam's eps (the fp32 run's: 1e-8)")
    add("--rank-for", default="",
        help="powersgd: per-leaf ranks 'REGEX=R;REGEX=R' (first match wins; others --rank), e.g. to spend r4's bytes "
             "unevenly across leaves")
    add("--rank-schedule", default="",
        help="powersgd: 'STEP:X,STEP:X': every leaf's rank times X from STEP on (Accordion, Agarwal et al. 2021: "
             "more rank in the critical regime, less after, at about the same bytes)")
    add("--steps", type=int, default=300)
    add("--seed", type=int, default=0, help="init seed (the batches stay compression.py's)")
    add("--d-model", type=int, default=128)
    add("--lr", type=float, default=3e-3)
    add("--ranks", type=int, default=4)
    add("--smoke", action="store_true", help="5 steps, 2 validation batches")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps = 5
    return a


class Sim:
    """The training run: params as a flat list of leaves, per-rank exchange state, AdamW state."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.world = a.ranks
        self.dataset = chardata.load_dataset(1_000_000)
        self.config = gpt.GPTConfig(vocab=self.dataset.vocab_size, seq=64, d_model=a.d_model, n_layers=2, n_heads=4)
        params = gpt.init_params(self.config, seed=a.seed)
        self.treedef = pf.tree.structure(params)
        self.names = [pf.tree.keystr(path) for path in pf.tree.paths(params)]
        self.params = [x.clone() for x in pf.tree.leaves(params)]
        self.shapes = [x.shape for x in self.params]
        self.wte = self.names.index("['wte']")
        zeros = [torch.zeros(s) for s in self.shapes]
        per_rank = lambda: [[torch.zeros(s) for s in self.shapes] for _ in range(self.world)]  # noqa: E731
        self.residual, self.estimate, self.local_mom, self.local_nu = per_rank(), per_rank(), per_rank(), per_rank()
        self.global_estimate = [z.clone() for z in zeros]
        self.nu = [z.clone() for z in zeros]  # --scaled-src ema: EMA of the squared exchanged mean
        self.m, self.v = [z.clone() for z in zeros], [z.clone() for z in zeros]
        self.v_frozen: list[torch.Tensor] | None = None
        gen = torch.Generator().manual_seed(123)
        self.q = [torch.rand(math.prod(s[1:]), a.rank, generator=gen) - 0.5 if len(s) >= 2 else None
                  for s in self.shapes]
        self.grad_norms: list[float] = []
        self.age: list[torch.Tensor | None] = [None] * self.world  # per rank, global top-k: steps since sent
        self.rank_for = [(re.compile(k), int(v)) for k, v in
                         (item.split("=") for item in a.rank_for.split(";") if item)]
        self.schedule = sorted((int(k), float(v)) for k, v in
                               (item.split(":") for item in a.rank_schedule.split(",") if item))
        self.t = 0
        self.sent: list[float] = []  # per step: elements sent per rank / the leaves' total (fp32 all-reduce: 1)

    # -------------------------------------------------------------------------------------------- model

    def loss(self, leaves: list[torch.Tensor], head: torch.Tensor, batch: Any) -> torch.Tensor:
        """gpt.loss_fn with the tied head's weight passed separately (its gradient is the compressed part)."""
        p = pf.tree.unflatten(self.treedef, leaves)
        inputs, targets = batch
        x = p["wte"][inputs] + p["wpe"][: inputs.shape[1]]
        for block in p["blocks"].values():
            x = x + gpt._attention(gpt._norm(x, block["ln1"]), block["attn"], self.config, True)
            x = x + gpt._mlp(gpt._norm(x, block["ln2"]), block["mlp"], self.config)
        logits = torch.nn.functional.linear(gpt._norm(x, p["ln_f"]), head)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def rank_grads(self, batch: Any) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Per rank: the gradients its reductions send (the head's part for wte); and the exact mean of the rest
        (wte's lookup part)."""
        rows = batch[0].shape[0] // self.world
        out, lookup = [], []
        for r in range(self.world):
            b = (batch[0][r * rows:(r + 1) * rows], batch[1][r * rows:(r + 1) * rows])
            leaves = [x.detach().requires_grad_() for x in self.params]
            head = self.params[self.wte].detach().requires_grad_()
            grads = list(torch.autograd.grad(self.loss(leaves, head, b), [*leaves, head]))
            lookup.append(grads[self.wte])
            grads[self.wte] = grads.pop()
            out.append(grads)
        return out, [sum(lookup) / self.world]

    # ----------------------------------------------------------------------------------------- exchange

    def ratio_at(self, t: int) -> float:
        a = self.a
        ramp, r = [], 0.25
        while a.ramp and r > a.ratio:
            ramp.append(r)
            r /= 4
        ramp.append(a.ratio)
        since = t - a.dense
        return ramp[len(ramp) - 1 if since >= a.ramp else since * (len(ramp) - 1) // a.ramp]

    def matrix(self, i: int) -> tuple[int, int] | None:
        """PowerSGD's view of leaf i, None where it goes uncompressed (1-D, or under 2x compression)."""
        s = self.shapes[i]
        if len(s) < 2:
            return None
        rows, cols, rank = s[0], math.prod(s[1:]), self.leaf_rank(i, self.a.dense)
        if rank >= min(rows, cols) or (rows + cols) * rank * 2 > rows * cols:
            return None
        return rows, cols

    def leaf_rank(self, i: int, t: int) -> int:
        """PowerSGD's rank for leaf i at step t: --rank-for's (else --rank), times --rank-schedule's factor."""
        base = next((r for pattern, r in self.rank_for if pattern.search(self.names[i])), self.a.rank)
        scale = next((x for start, x in reversed(self.schedule) if t >= start), 1.0)
        return max(1, round(base * scale))

    def compressed(self, i: int) -> bool:
        a, name = self.a, self.names[i]
        if (a.only and not re.search(a.only, name)) or (a.skip and re.search(a.skip, name)):
            return False
        return (a.fmt == "topk" and len(self.shapes[i]) >= 2) or (a.fmt == "powersgd" and self.matrix(i) is not None)

    def topk(self, i: int, vs: list[torch.Tensor], t: int, keep_residual: bool) -> tuple[torch.Tensor, list]:
        """Mean of the ranks' top-k of `vs` (flat), and each rank's sent values' (indices, values)."""
        a, n = self.a, vs[0].numel()
        k = max(1, math.ceil(self.ratio_at(t) * n))
        if a.agree == 3:
            idxs = [torch.topk((sum(vs) / self.world).abs(), k, sorted=False).indices] * self.world
        elif a.agree == 2:
            union = torch.zeros(n, dtype=torch.bool)
            for v in vs:
                union[torch.topk(v.abs(), k, sorted=False).indices] = True
            idxs = [union.nonzero().view(-1)] * self.world
        elif a.agree == 1:
            idxs = [torch.topk(vs[t % self.world].abs(), k, sorted=False).indices] * self.world
        elif a.selnu:
            idxs = [torch.topk(v.abs() * (self.local_nu[r][i].reshape(-1) + 1e-30) ** (-a.sel), k,
                               sorted=False).indices for r, v in enumerate(vs)]
        else:
            idxs = [torch.topk(v.abs(), k, sorted=False).indices for v in vs]
        total = torch.zeros(n)
        for r, (v, idx) in enumerate(zip(vs, idxs)):
            total.index_add_(0, idx, v[idx])
            if keep_residual:
                left = v.clone()
                left[idx] = 0
                self.residual[r][i] = left.view(self.shapes[i])
        return total / self.world, list(zip(idxs, [v[idx] for v, idx in zip(vs, idxs)]))

    def powersgd(self, i: int, ms: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(mean approximation, P, each rank's Q) of the ranks' matrices `ms`, warm-started from the last Q."""
        q, rank = self.q[i], self.leaf_rank(i, self.t)
        if q.shape[1] > rank:  # a lower rank from here on: keep the warm start's leading directions
            q = q[:, :rank]
        elif q.shape[1] < rank:  # a higher one: new random directions beside the warm start
            gen = torch.Generator().manual_seed(1000 * i + self.t)
            q = torch.cat([q, torch.rand(q.shape[0], rank - q.shape[1], generator=gen) - 0.5], dim=1)
        for _ in range(self.a.iters):
            p = torch.linalg.qr(sum(m @ q for m in ms)).Q
            q_local = [m.t() @ p for m in ms]
            q = sum(q_local)
        self.q[i] = q
        return p @ q.t() / self.world, p, q_local

    def scaling(self, i: int, rows: int, cols: int) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """--scaled: row and column factors D_r (rows x 1), D_c (1 x cols) of leaf i's second moment (1, 1: off)."""
        if not self.a.scaled:
            return 1.0, 1.0
        v = (self.v[i] if self.a.scaled_src == "adam" else self.nu[i]).reshape(rows, cols)
        floor = float(v.mean()) * 1e-4 + 1e-30  # a row or column that has seen no gradient yet
        d_r = (v.mean(1, keepdim=True) + floor) ** (self.a.scaled / 2)
        d_c = (v.mean(0, keepdim=True) + floor) ** (self.a.scaled / 2)
        return d_r, d_c

    def global_topk(self, t: int, idx_c: list[int], vs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Per rank, one top-k over its vectors `vs[r]` (one per leaf in `idx_c`) laid end to end, with EF (the
        unsent part becomes the residual): the ranks' mean, per leaf (Shi et al. 2019's global top-k)."""
        sizes = [math.prod(self.shapes[i]) for i in idx_c]
        total = torch.zeros(sum(sizes))
        for r in range(self.world):
            v = torch.cat([x.reshape(-1) for x in vs[r]])
            k = max(1, math.ceil(self.ratio_at(t) * v.numel()))
            score = v.abs()
            if self.a.age_tau > 0:
                if self.age[r] is None:
                    self.age[r] = torch.zeros(v.numel())
                score = score * (1 + self.age[r] / self.a.age_tau)
            sel = torch.topk(score, k, sorted=False).indices
            if self.a.age_tau > 0:
                self.age[r] += 1
                self.age[r][sel] = 0
            total.index_add_(0, sel, v[sel])
            left = v.clone()
            left[sel] = 0
            for i, part in zip(idx_c, left.split(sizes)):
                self.residual[r][i] = part.view(self.shapes[i]) * self.a.ef_decay
        return [part.view(self.shapes[i]) for i, part in zip(idx_c, (total / self.world).split(sizes))]

    def exchange_global_topk(self, t: int, grads: list[list[torch.Tensor]], exact: list[torch.Tensor]) -> list:
        """Top-k over the concatenation of every compressed leaf (per rank, with EF): the budget goes where the
        magnitudes are, not ratio x each leaf's size (Shi et al. 2019's global top-k)."""
        world, idx_c = self.world, [i for i in range(len(self.shapes)) if self.compressed(i)]
        out = [sum(grads[r][i] for r in range(world)) / world for i in range(len(self.shapes))]
        if t >= self.a.dense and idx_c:
            vs = [[grads[r][i] + self.residual[r][i] for i in idx_c] for r in range(world)]
            for i, mean in zip(idx_c, self.global_topk(t, idx_c, vs)):
                out[i] = mean
        out[self.wte] = out[self.wte] + exact[0]
        return out

    def flushing(self, t: int) -> bool:
        a = self.a
        return a.flush > 0 and a.fmt != "none" and t >= a.dense and (t - a.dense) % a.flush == a.flush - 1

    def exchange_flush(self, grads: list[list[torch.Tensor]], exact: list[torch.Tensor]) -> list[torch.Tensor]:
        """A dense step that also sends (and so empties) every rank's error-feedback residual."""
        world, out = self.world, []
        for i in range(len(self.shapes)):
            out.append(sum(grads[r][i] + self.residual[r][i] for r in range(world)) / world)
            for r in range(world):
                self.residual[r][i] = torch.zeros_like(self.residual[r][i])
        out[self.wte] = out[self.wte] + exact[0]
        return out

    def exchange(self, t: int, grads: list[list[torch.Tensor]], exact: list[torch.Tensor]) -> list[torch.Tensor]:
        a, world = self.a, self.world
        if self.flushing(t):
            return self.exchange_flush(grads, exact)
        if a.fmt == "topk" and a.global_topk:
            return self.exchange_global_topk(t, grads, exact)
        out = []
        for i, s in enumerate(self.shapes):
            g = [grads[r][i] for r in range(world)]
            if a.selnu:
                for r in range(world):
                    self.local_nu[r][i] = self.local_nu[r][i] * a.selnu + (1 - a.selnu) * g[r] * g[r]
            if not self.compressed(i):
                out.append(sum(g) / world)
                continue
            if a.ef21:
                for r in range(world):
                    self.local_mom[r][i] = torch.lerp(self.local_mom[r][i], g[r], a.ef21)
                if t < a.dense:  # dense: every rank's estimate is what it has
                    for r in range(world):
                        self.estimate[r][i] = self.local_mom[r][i].clone()
                    self.global_estimate[i] = sum(self.estimate[r][i] for r in range(world)) / world
                    out.append(self.global_estimate[i].clone())
                    continue
                diffs = [self.local_mom[r][i] - self.estimate[r][i] for r in range(world)]
            elif t < a.dense:
                out.append(sum(g) / world)
                self.nu[i] = self.nu[i] * a.b2 + (1 - a.b2) * out[-1] * out[-1]
                if a.warm_q and a.fmt == "powersgd":
                    rows, cols = self.matrix(i)
                    self.powersgd(i, [out[-1].reshape(rows, cols)])
                continue
            else:
                diffs = [g[r] + (self.residual[r][i] if a.ef else 0) for r in range(world)]
            keep = bool(a.ef) and not a.ef21
            if a.fmt == "topk":
                mean, sent = self.topk(i, [d.reshape(-1) for d in diffs], t, keep)
                if a.ef21:
                    for r, (idx, vals) in enumerate(sent):
                        self.estimate[r][i].view(-1).index_add_(0, idx, vals)
            else:
                rows, cols = self.matrix(i)
                ms = [d.reshape(rows, cols) for d in diffs]
                d_r, d_c = self.scaling(i, rows, cols)
                mean, p, q_local = self.powersgd(i, [m / d_r / d_c for m in ms])
                mean = mean * d_r * d_c
                for r in range(world):
                    if keep:
                        self.residual[r][i] = (ms[r] - (p @ q_local[r].t()) * d_r * d_c).view(s)
                    if a.ef21:
                        self.estimate[r][i] = self.estimate[r][i] + ((p @ q_local[r].t()) * d_r * d_c).view(s)
            mean = mean.view(s)
            self.nu[i] = self.nu[i] * a.b2 + (1 - a.b2) * mean * mean
            if a.ef21:
                self.global_estimate[i] = self.global_estimate[i] + mean
                mean = self.global_estimate[i].clone()
            out.append(mean)
        out[self.wte] = out[self.wte] + exact[0]
        return out

    # ---------------------------------------------------------------------------------------- optimizer

    def lr(self, t: int) -> float:
        """pf.optim.warmup_cosine_decay as char_lm.make_optimizer builds it, at update count t."""
        a = self.a
        warm = min(30, a.steps // 5)
        if t < warm:
            return a.lr * t / warm
        frac = min(1.0, (t - warm) / max(1, a.steps - warm))
        scale = a.lr_compressed if a.fmt != "none" and t >= a.dense else 1.0
        return scale * (0.1 * a.lr + 0.9 * a.lr * 0.5 * (1 + math.cos(math.pi * frac)))

    def clip(self, grads: list[torch.Tensor]) -> float:
        norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
        self.grad_norms.append(norm)
        return min(1.0, CLIP / norm)

    def apply(self, t: int, updates: list[torch.Tensor]) -> None:
        lr = self.lr(t)
        for i, u in enumerate(updates):
            p = self.params[i]
            if p.ndim >= 2:  # char_lm's mask: norms and biases are not decayed
                p = p * (1 - lr * WEIGHT_DECAY)
            self.params[i] = p - lr * u

    def adamw(self, t: int, grads: list[torch.Tensor]) -> None:
        B1, B2, EPS = self.a.b1, self.a.b2, self.a.eps  # noqa: N806 - the module constants' names
        c, count, frozen = self.clip(grads), t + 1, 0 <= self.a.freeze <= t
        updates = []
        for i, g in enumerate(grads):
            g = g * c
            self.m[i] = torch.lerp(self.m[i], g, 1 - B1)
            if not frozen:
                self.v[i] = self.v[i] * B2 + (1 - B2) * g * g
            bc2 = 1 - B2 ** (self.a.freeze if frozen else count)
            updates.append((self.m[i] / (1 - B1**count)) / (self.v[i].sqrt() / math.sqrt(bc2) + EPS))
        self.apply(t, updates)

    def onebit(self, t: int, grads: list[list[torch.Tensor]], exact: list[torch.Tensor]) -> None:
        """1-bit Adam's compression stage (Tang et al. 2021, Algorithm 1) with this script's compressor."""
        world, (B1, B2, EPS) = self.world, (self.a.b1, self.a.b2, self.a.eps)  # noqa: N806
        if self.v_frozen is None:
            self.v_frozen = [v / (1 - B2**t) for v in self.v]
        mean = [sum(grads[r][i] for r in range(world)) / world for i in range(len(self.shapes))]
        mean[self.wte] = mean[self.wte] + exact[0]
        exchanged = self.a.onebit_clip == "exchanged"
        c = 1.0 if exchanged else self.clip(mean)
        delivered = []
        idx_c = [i for i in range(len(self.shapes)) if self.compressed(i)]
        means: dict[int, torch.Tensor] = {}  # with --global-topk: every compressed leaf's, from one selection
        if self.a.fmt == "topk" and self.a.global_topk and idx_c:
            local = [[B1 * self.m[i] + (1 - B1) * c * grads[r][i] + self.residual[r][i] for i in idx_c]
                     for r in range(world)]
            means = dict(zip(idx_c, self.global_topk(t, idx_c, local)))
        for i, s in enumerate(self.shapes):
            if i in means:
                self.m[i] = means[i]
                if i == self.wte:
                    self.m[i] = self.m[i] + (1 - B1) * c * exact[0]
                delivered.append(None)
            elif not self.compressed(i):
                delivered.append(mean[i])
            else:
                local = [B1 * self.m[i] + (1 - B1) * c * grads[r][i] + self.residual[r][i] for r in range(world)]
                if self.a.fmt == "topk":
                    m, _ = self.topk(i, [x.reshape(-1) for x in local], t, keep_residual=True)
                else:
                    rows, cols = self.matrix(i)
                    ms = [x.reshape(rows, cols) for x in local]
                    m, p, q_local = self.powersgd(i, ms)
                    for r in range(world):
                        self.residual[r][i] = (ms[r] - p @ q_local[r].t()).view(s)
                self.m[i] = m.view(s)
                if i == self.wte:  # the lookup part is exact
                    self.m[i] = self.m[i] + (1 - B1) * c * exact[0]
                delivered.append(None)
        c2 = self.clip([self.m[i] if d is None else d for i, d in enumerate(delivered)]) if exchanged else c
        updates = []
        for i, d in enumerate(delivered):
            if d is not None:  # an uncompressed leaf: Adam's own momentum of its gradient
                self.m[i] = torch.lerp(self.m[i], d * c2, 1 - B1)
                m = self.m[i]
            else:  # clipped here only when the exchanged momentum is clipped (else each gradient was)
                m = self.m[i] * c2 if exchanged else self.m[i]
            updates.append(m / (1 - B1 ** (t + 1)) / (self.v_frozen[i].sqrt() + EPS))
        self.apply(t, updates)

    # ------------------------------------------------------------------------------------------------ run

    def sent_fraction(self, t: int) -> float:
        """Elements each rank sends at step t over the leaves' total (an fp32 all-reduce's: 1)."""
        a, total = self.a, sum(math.prod(s) for s in self.shapes)
        if a.fmt == "none" or t < a.dense or self.flushing(t):
            return 1.0
        sent = 0
        for i, s in enumerate(self.shapes):
            n = math.prod(s)
            if not self.compressed(i):
                sent += n
            elif a.fmt == "topk":
                sent += 2 * max(1, math.ceil(self.ratio_at(t) * n))  # values and indices
            else:
                sent += (s[0] + n // s[0]) * self.leaf_rank(i, t) * a.iters
        return sent / total

    def step(self, t: int, batch: Any) -> None:
        self.t = t
        self.sent.append(self.sent_fraction(t))
        grads, exact = self.rank_grads(batch)
        if self.a.onebit and t >= self.a.dense:
            self.onebit(t, grads, exact)
        else:
            self.adamw(t, self.exchange(t, grads, exact))

    def val_loss(self, batches: list[Any]) -> float:
        with torch.no_grad():
            return float(sum(self.loss(self.params, self.params[self.wte], b) for b in batches) / len(batches))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    torch.set_num_threads(1)
    sim = Sim(a)
    train = chardata.batches(sim.dataset.train, 32, 64, seed=0)
    val_stream = chardata.batches(sim.dataset.val, 32, 64, seed=1)
    val = [next(val_stream) for _ in range(2 if a.smoke else 16)]
    start, curve = time.perf_counter(), []
    for t in range(a.steps):
        sim.step(t, next(train))
        if (t + 1) % 50 == 0:
            curve.append((t + 1, round(sim.val_loss(val[:4]), 4)))
    out = dict(args=vars(a), val_loss=sim.val_loss(val), val_curve=curve, seconds=time.perf_counter() - start,
               sent_fraction=sum(sim.sent) / len(sim.sent),
               sent_fraction_compressed=(sum(sim.sent[a.dense:]) / max(1, len(sim.sent[a.dense:]))),
               grad_norm_by_50=[sum(sim.grad_norms[i:i + 50]) / len(sim.grad_norms[i:i + 50])
                                for i in range(0, len(sim.grad_norms), 50)])
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()

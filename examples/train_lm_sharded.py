"""Train the character-level GPT data- and tensor-parallel on a mesh of ranks.

    pt3func run -n 4 examples/train_lm_sharded.py --mesh 2x2          # 2-way dp x 2-way tp, 4 CPU processes
    pt3func run -n 4 examples/train_lm_sharded.py --mesh 4 --fsdp     # dp only, params and moments sharded
    torchrun --nproc-per-node 2 examples/train_lm_sharded.py --mesh 2 # on 2 GPUs (NCCL)
    python examples/train_lm_sharded.py --mesh 2x2 --virtual          # the same 4 ranks as threads of one process

The script is the same on every rank and in every mode: it says how each value is laid out (`param_specs`,
a batch split over "dp") and `pf.jit` turns the one pure train step into the per-rank program, collectives
included. Rank 0 prints that program's collectives, the loss, and the final validation loss against a
unigram baseline.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import pt3func as pf
from pt3func import P

sys.path.insert(0, str(Path(__file__).resolve().parent))

import char_lm  # noqa: E402
import data as chardata  # noqa: E402
import gpt  # noqa: E402
from arguments import parse_mesh, positive_int  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (defaults: a short run on 4 CPU processes)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--mesh", default="2x2", help="mesh shape: DPxTP (axes dp, tp) or DP (dp only)")
    add("--fsdp", action="store_true", help="also shard params and optimizer state over dp (ZeRO-3)")
    add("--virtual", action="store_true", help="simulate the mesh's ranks as threads of this one process")
    add("--steps", type=positive_int, default=200, help="optimizer steps")
    add("--batch", type=positive_int, default=32, help="sequences per step, over all dp ranks")
    add("--seq", type=positive_int, default=64, help="context length in characters")
    add("--d-model", type=positive_int, default=128)
    add("--layers", type=positive_int, default=2)
    add("--heads", type=positive_int, default=4)
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--warmup", type=int, default=20, help="linear warmup steps (capped at a fifth of --steps)")
    add("--weight-decay", type=float, default=0.1)
    add("--clip", type=float, default=1.0, help="global gradient-norm clip")
    add("--seed", type=int, default=0, help="seeds params and batches (the same on every rank)")
    add("--log-interval", type=positive_int, default=20, help="steps between loss lines")
    add("--eval-batches", type=positive_int, default=4, help="validation batches at the end")
    add("--backend", choices=("inductor", "eager"), default="inductor", help="how pf.jit runs the step")
    add("--max-bytes", type=positive_int, default=1_000_000, help="bytes of stdlib source to read")
    add("--log-dir", default=None, help="write metrics.jsonl and TensorBoard events here (rank 0)")
    add("--peak-tflops", type=float, default=None, help="one device's peak TFLOP/s, for MFU")
    return parser.parse_args(argv)



def add_fsdp(specs: gpt.Params, params: gpt.Params, dp: int) -> gpt.Params:
    """Also split every param over "dp", along its first dim that is not split yet and that dp divides.

    A param with no such dim stays as it was (printed, so nothing is replicated silently).
    """
    def spec(path: tuple, leaf: torch.Tensor, old: P) -> P:
        dims = list(old) + [None] * (leaf.ndim - len(old))
        for d, size in enumerate(leaf.shape):
            if dims[d] is None and size % dp == 0:
                dims[d] = "dp"
                return P(*dims)
        print(f"fsdp: params{pf.tree.keystr(path)} {tuple(leaf.shape)} has no dim divisible by dp={dp}; kept {old}")
        return old

    return pf.tree.map_with_path(spec, params, specs)


def collective_summary(lowered: pf.Lowered, examples: int = 8) -> str:
    """Count and bytes of every collective kind in the per-rank program, then its first COLLECTIVE lines."""
    comm = lowered.cost_analysis()["comm_bytes"]
    lines = [line.strip() for line in lowered.as_text().splitlines() if "COLLECTIVE" in line]
    counts = Counter(kind for line in lines for kind in comm if re.search(rf"\b{re.escape(kind)}\b", line))
    table = [f"  {kind:<24} x{counts[kind]:<4} {nbytes / 1024:10.1f} KiB" for kind, nbytes in sorted(comm.items())]
    total = sum(comm.values()) / 1024
    more = [f"  ... {len(lines) - examples} more (see step.lower(...).as_text())"] if len(lines) > examples else []
    return "\n".join(["collectives per step (per rank):", *table, f"  {'total':<30}{total:10.1f} KiB",
                      *(f"  {line}" for line in lines[:examples]), *more])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train on the mesh; returns what rank 0 printed (losses, validation loss, baseline)."""
    args = parse_args(argv)
    started = time.perf_counter()
    shape, axes = parse_mesh(args.mesh)
    mesh = pf.make_mesh(shape, axes, virtual=args.virtual)
    rank0 = args.virtual or torch.distributed.get_rank() == 0
    say = print if rank0 else lambda *a, **k: None
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    dp = mesh.axis_size("dp")
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by the dp size {dp}")

    dataset = chardata.load_dataset(args.max_bytes)
    baseline = chardata.unigram_baseline(dataset.train, dataset.val, dataset.vocab_size)
    config = gpt.GPTConfig(vocab=dataset.vocab_size, seq=args.seq, d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads)
    opt = char_lm.make_optimizer(args)
    train_batches = chardata.batches(dataset.train, args.batch, args.seq, seed=args.seed)
    val_stream = chardata.batches(dataset.val, args.batch, args.seq, seed=args.seed + 1)
    val_batches = [next(val_stream) for _ in range(args.eval_batches)]

    def to_device(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0].to(device), batch[1].to(device)

    with pf.set_mesh(mesh):
        params = gpt.init_params(config, seed=args.seed, device=device)
        specs = gpt.param_specs(params, tp="tp" if "tp" in axes else None)
        if args.fsdp:
            specs = add_fsdp(specs, params, dp)
        params = pf.device_put(params, specs)
        # Jitted, the init runs where the shards live: each moment gets its param's sharding.
        opt_state = pf.jit(opt.init, backend=args.backend)(params)
        step = pf.jit(char_lm.make_train_step(config, opt), in_shardings=(specs, None, P("dp")),
                      donate_argnums=(0, 1), backend=args.backend)
        eval_step = pf.jit(char_lm.make_eval_step(config), in_shardings=(None, P("dp")), backend=args.backend)
        say(f"mesh {mesh}; {gpt.num_params(params):,} params; {args.batch} x {args.seq} tokens a step; "
            f"backend {args.backend}")

        batch = to_device(next(train_batches))
        lowered = step.lower(params, opt_state, batch)
        say(collective_summary(lowered))
        # Every rank calls it; only rank 0 writes. FLOPs and bytes on the wire come from the program itself.
        run_metrics = pf.metrics.RunMetrics(
            args.log_dir,
            **pf.metrics.from_lowered(lowered),
            tokens_per_step=args.batch * args.seq,
            peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        )
        losses = []
        for i in range(1, args.steps + 1):
            with run_metrics.timed(i) as record:
                params, opt_state, metrics = step(params, opt_state, batch)
                losses.append(float(pf.device_get(metrics["loss"])))  # on every rank: device_get can be collective
                record["loss"] = losses[-1]
            if i % args.log_interval == 0 or i in (1, args.steps):
                rates = "  ".join(f"{k} {v}" for k, v in run_metrics.postfix().items() if k != "loss")
                say(f"step {i:5d}  loss {losses[-1]:.6f}  {rates}")
            batch = to_device(next(train_batches))
        run_metrics.close()
        val_loss = sum(float(pf.device_get(eval_step(params, to_device(b)))) for b in val_batches) / len(val_batches)

    verdict = "beats" if val_loss < baseline else "does NOT beat"
    say(f"final train loss {losses[-1]:.6f}  val loss {val_loss:.6f}  unigram baseline {baseline:.6f} nats/char "
        f"-> model {verdict} it")
    say(f"done in {time.perf_counter() - started:.1f} s")
    return {"losses": losses, "val_loss": val_loss, "baseline": baseline}


if __name__ == "__main__":
    main()

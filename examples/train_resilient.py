"""Train a small MLP data-parallel with checkpoints that survive a killed rank, a crash mid-save and a NaN.

    pt3func run -n 2 examples/train_resilient.py --dir /tmp/ckpt                            # plain run
    pt3func run -n 2 --max-restarts 2 examples/train_resilient.py --dir /tmp/ckpt --kill-at-step 10 --kill-rank 1
    pt3func run -n 2 --max-restarts 2 examples/train_resilient.py --dir /tmp/ckpt --kill-during-save 8
    pt3func run -n 2 examples/train_resilient.py --dir /tmp/ckpt --nan-at-step 5             # that update is skipped

Every `--save-every` steps the whole training state goes into a `pf.checkpointing.CheckpointManager`:
params, optimizer state, the step count, the position in the data and the RNG state (the batches are
augmented with noise from torch's global generator). On start the script restores the latest committed
checkpoint if there is one, so when torchrun restarts the job after a failure (`--max-restarts`) training
resumes where the last checkpoint left it, and ends with the same params, bit for bit, as a run that was
never interrupted. `--kill-at-step S --kill-rank R` makes rank R SIGKILL itself after step S;
`--kill-during-save S` makes rank 0 SIGKILL itself while committing the checkpoint of step S (after every
rank wrote its data, before the manifest). Each fault fires once: a marker file in `--dir` remembers it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.checkpointing import CheckpointManager, rng_state, set_rng_state

sys.path.insert(0, str(Path(__file__).resolve().parent))

from arguments import positive_int  # noqa: E402

DATASET_SIZE = 256


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--dir", required=True, help="checkpoint directory (shared by all ranks)")
    add("--steps", type=int, default=12, help="optimizer steps")
    add("--save-every", type=positive_int, default=4, help="steps between checkpoints")
    add("--batch", type=positive_int, default=16, help="examples per step, over all ranks")
    add("--lr", type=float, default=1e-2)
    add("--seed", type=int, default=0, help="seeds the data, the params and the noise (the same on every rank)")
    add("--backend", choices=("inductor", "eager"), default="inductor", help="how pf.jit runs the step")
    add("--sync-save", action="store_true", help="save synchronously (default: asynchronously)")
    add("--kill-at-step", type=int, help="SIGKILL one rank (--kill-rank) right after this step, once")
    add("--kill-rank", type=int, default=1)
    add("--kill-during-save", type=int, metavar="STEP", help="SIGKILL rank 0 mid-commit of this step's save, once")
    add("--nan-at-step", type=int, help="put a NaN into one example of this step's batch (the last rank's shard)")
    add("--out", help="rank 0 writes the final params (full tensors) here with torch.save")
    return parser.parse_args(argv)


def kill_once(marker: Path) -> None:
    """SIGKILL this process unless `marker` exists; create it first, so the restarted job does not die again."""
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "w") as f:
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"rank {dist.get_rank()}: SIGKILL ({marker.name})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def make_dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: y = tanh(x @ w) + noise, from its own generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(DATASET_SIZE, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 1, generator=g)) + 0.05 * torch.randn(DATASET_SIZE, 1, generator=g)
    return x, y


def get_batch(data: tuple[torch.Tensor, torch.Tensor], position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number `position` (the data cursor), with input noise drawn from torch's global generator."""
    index = (position * size + torch.arange(size)) % DATASET_SIZE
    x, y = data[0][index], data[1][index]
    return x + 0.01 * torch.randn(x.shape), y


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, checkpointing and resuming; returns (and rank 0 prints as JSON) a summary of the run."""
    args = parse_args(argv)
    mesh = pf.make_mesh((int(os.environ.get("WORLD_SIZE", "1")),), ("dp",))
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    directory = Path(args.dir)

    def before_commit(step: int, tmp: Path) -> None:
        if step == args.kill_during_save:
            kill_once(directory / f"killed-during-save-{step}")

    manager = CheckpointManager(directory, max_to_keep=3, async_save=not args.sync_save,
                                before_commit=before_commit)
    opt = pf.optim.apply_if_finite(pf.optim.adamw(args.lr, weight_decay=0.01), max_consecutive_errors=3)

    torch.manual_seed(args.seed)
    params, apply = pf.functionalize(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            return F.mse_loss(apply(params, batch[0]), batch[1])

        loss, grads = pf.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    with pf.set_mesh(mesh):
        params = pf.device_put(params, P())
        opt_state = pf.jit(opt.init, backend=args.backend)(params)
        step_fn = pf.jit(train_step, in_shardings=(P(), None, P("dp")), donate_argnums=(0, 1), backend=args.backend)
        state = {"params": params, "opt_state": opt_state, "step": 0, "data_position": 0, "rng": rng_state()}
        resumed_from = None
        if manager.latest_step() is not None:
            state = manager.restore(target=state, fallback=True)
            set_rng_state(state["rng"])
            resumed_from = state["step"]
            say(f"resumed from step {resumed_from} (data position {state['data_position']})", flush=True)
            if resumed_from > args.steps:
                raise SystemExit(f"train_resilient: the checkpoint in {args.dir} is at step {resumed_from}, past "
                                 f"--steps {args.steps}: nothing to train; raise --steps or use another directory")
        params, opt_state, position = state["params"], state["opt_state"], state["data_position"]

        data = make_dataset(args.seed)
        skipped, losses = [], []
        for i in range(state["step"] + 1, args.steps + 1):
            batch = get_batch(data, position, args.batch)
            if i == args.nan_at_step:
                batch[0][-1, 0] = float("nan")
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            position += 1
            losses.append(float(pf.device_get(metrics["loss"])))
            if int(pf.device_get(opt_state.total_notfinite)) > len(skipped):  # apply_if_finite skipped this one
                skipped.append(i)
            if i == args.kill_at_step and rank == args.kill_rank:
                kill_once(directory / f"killed-at-step-{i}-rank-{rank}")
            if i % args.save_every == 0 or i == args.steps:
                manager.save(i, {"params": params, "opt_state": opt_state, "step": i, "data_position": position,
                                 "rng": rng_state()})
        manager.wait()
        full = pf.device_get(params)

    # Replicated params: every rank's copy must be the same bits, NaN step or not.
    local = torch.cat([leaf.to_local().flatten() for leaf in pf.tree.leaves(params)])
    copies: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(copies, (skipped, local))
    summary = {"resumed_from": resumed_from, "final_step": args.steps, "last_loss": losses[-1] if losses else None,
               "skipped_steps_per_rank": [c[0] for c in copies],
               "ranks_agree": all(torch.equal(c[1], local) for c in copies),
               "checkpoints": manager.all_steps()}
    if rank == 0:
        if args.out:
            torch.save(full, args.out)
        print("summary " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

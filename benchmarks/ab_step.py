"""Speed of pt3func variants against the anchor's torch step, taken in turns, round after round, in one process.

Runs in separate processes one after the other compare badly on an H200: a warm GPU runs slower (single steps
of one run drift from 41 to 47 ms), so the same pair of runs measured in two waves differed by 1-3% in turn
(`results/memory_h200_*.json`), more than the effects being measured. Here the anchor's step (its own script,
run in this process) and every pt3func variant take turns of `--turn` steps, the order rotated every round, so
drift hits all of them alike. A turn's first step is not timed: right after another program it runs on caches
that program left (one step a turn slowed torch.compile's step by 2.2 ms and pt3func's CUDA graph by 1.0-1.4:
session 8, `results/ab_step_h200.jsonl`, the records with turn 1). The verdict: each variant's steps against the
anchor's steps of the same rounds, the anchor's time over the variant's, median. Peak memory is not measured here
(CUDA graphs keep their pools): `memory.py` measures it, a process per run.

    python benchmarks/ab_step.py --variant=--cuda-graphs \\
        --variant "--cuda-graphs --loss-chunk-mib 256 --policy recompute_gelu --remat-blocks 1"
    torchrun --standalone --nproc-per-node 2 benchmarks/ab_step.py --anchor-impl torch-ddp-compile \\
        --variant "--sharding dp"
    python benchmarks/ab_step.py --device cpu --anchor-impl none --rounds 3 \\
        --model "--layers 1 --d 64 --heads 2 --seq 32 --batch 2 --vocab 128" --variant "" \\
        --variant "--loss-chunk-mib 0.01"                         # smoke run: the first variant is the reference

A variant is a string of `lm_step.py` flags; flags that change torch or Inductor process-wide (--inductor-option,
--overlap, --overlap-scheduler, --sdpa-priority) are refused, since they would reach every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from common import RESULTS, append_jsonl, environment, find_anchor, print_table
from gpu_profile import format_summary, profile_steps
from lm_step import build_run, parse_args, pf_config_of

import pt3func as pf

PROCESS_WIDE = ("inductor_option", "overlap", "overlap_scheduler", "sdpa_priority")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[], help="lm_step.py flags of one pt3func variant")
    p.add_argument("--model", default="", help="model flags for every run, the anchor's too (--layers 12 ...)")
    p.add_argument("--anchor-impl", default="torch-compile", help="the anchor's impl, or 'none'")
    p.add_argument("--anchor", default=None, help="the anchor script (default: shared/bench/anchor_lm_step.py)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each before the rounds")
    p.add_argument(
        "--turn",
        type=int,
        default=4,
        help="steps of a run in a row; its first is not timed (1: every step timed, one step a turn)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after the rounds, profile this many steps of each run (a turn, first untimed): kernel time by kind, "
        "NCCL time not hidden behind compute, idle time (CUDA only)",
    )
    p.add_argument("--trace-dir", default=None, help="with --profile: write each run's Chrome trace (.json.gz) here")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not a.variant:
        raise SystemExit("give at least one --variant")
    if a.profile and a.device != "cuda":
        raise SystemExit("--profile reads CUDA kernel times: CUDA only")
    world = int(os.environ.get("WORLD_SIZE", "1"))

    runs: dict[str, Callable[[], Any]] = {}
    if a.anchor_impl != "none":
        runs[a.anchor_impl] = anchor_step(a.anchor_impl, a.model, a.anchor)
    mesh = None
    batch_tokens = 0
    for flags in a.variant:
        v = parse_args([*shlex.split(a.model), *shlex.split(flags), "--device", a.device])
        refused = [name for name in PROCESS_WIDE if getattr(v, name)]
        if refused:
            raise SystemExit(f"--variant {flags!r}: {', '.join(refused)} would change every run of this process")
        if v.sharding != "none" and mesh is None:
            mesh = pf.make_mesh((world,), ("dp",))
        device = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
        name = f"pt3func {flags}".strip()
        runs[name] = variant_step(v, device, mesh if v.sharding != "none" else None)
        batch_tokens = (world if v.sharding != "none" else 1) * v.batch * v.seq
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    for call in runs.values():  # the first call compiles (or captures)
        for _ in range(a.warmup):
            call()
        sync()
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}  # until the call returned (launched, not finished)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no run always follows another
            for k in range(a.turn):
                sync()
                start = time.perf_counter()
                runs[name]()
                returned = time.perf_counter()
                sync()
                if k or a.turn == 1:  # a turn's first step runs on caches the previous run left: not timed
                    times[name].append(time.perf_counter() - start)
                    host[name].append(returned - start)
    profiles = {}
    for i, name in enumerate(names if a.profile else []):
        trace = None
        if a.trace_dir:
            os.makedirs(a.trace_dir, exist_ok=True)
            trace = os.path.join(a.trace_dir, f"run{i}.rank{rank}.json.gz")
        profiles[name] = profile_run(runs[name], a.profile, sync, trace)
    if rank != 0:
        return
    reference = names[0]
    rows, record_runs = [], {}
    for name in names:
        med = statistics.median(times[name])
        # Step i of a run against step i of the reference: the same round (> 1: faster than the reference).
        ratios = [ref / t for ref, t in zip(times[reference], times[name])]
        faster = sum(x > 1 for x in ratios) / len(ratios)
        host_ms = round(statistics.median(host[name]) * 1e3, 2)
        rows.append([name, round(med * 1e3, 2), host_ms, round(batch_tokens / med),
                     round(statistics.median(ratios), 4), f"{faster:.0%}"])
        record_runs[name] = dict(step_ms=round(med * 1e3, 2), tokens_per_s=round(batch_tokens / med),
                                 speed_vs_reference=round(statistics.median(ratios), 4), steps_faster=faster,
                                 host_ms=round(statistics.median(host[name]) * 1e3, 3),
                                 step_times_ms=[round(t * 1e3, 2) for t in times[name]])
        if name in profiles:
            record_runs[name]["profile"] = profiles[name]
    print_table(f"{a.rounds} rounds of {a.turn} steps of each in turn (speed = {reference}'s time / this one's, "
                "step by step, median)", ["run", "step ms", "host ms", "tokens/s", "speed", "steps faster"], rows)
    for name, summary in profiles.items():
        print(f"--- {name}\n{format_summary(summary)}", flush=True)
    record = dict(reference=reference, rounds=a.rounds, turn=a.turn, world=world, model=a.model, runs=record_runs,
                  env=environment())
    out = a.out or RESULTS / f"ab_step_{'cpu' if a.device == 'cpu' else 'gpu'}.jsonl"
    print(f"appended to {append_jsonl(out, record)}", flush=True)
    print(json.dumps({k: v["speed_vs_reference"] for k, v in record_runs.items()}), flush=True)


def profile_run(
    call: Callable[[], Any], steps: int, sync: Callable[[], None], trace: str | None = None
) -> dict[str, Any]:
    """`steps` steps of one run under the profiler, after one untimed step (as a turn's first)."""
    call()
    sync()

    def step_once() -> None:
        call()
        sync()

    summary = profile_steps(step_once, steps, trace)
    summary["idle_ms"] = round(summary["span_ms"] - summary["busy_ms"], 3)
    return summary


def anchor_step(impl: str, model: str, path: str | None) -> Callable[[], Any]:
    """One step of the anchor script's `impl`, built by running the script itself in this process."""
    script = find_anchor(path)
    if script is None:
        raise SystemExit("anchor script not found (--anchor), or run with --anchor-impl none")
    argv = sys.argv
    # The script times 3 + --steps steps, prints its JSON and, on several GPUs, ends its process group, which the
    # rounds still need: keep it.
    sys.argv = [str(script), impl, "--steps", "1", *shlex.split(model)]
    destroy = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda *args, **kwargs: None
    try:
        scope = runpy.run_path(str(script), run_name="anchor")
    finally:
        sys.argv = argv
        torch.distributed.destroy_process_group = destroy
    step, idx, tgt = scope["step"], scope["idx"], scope["tgt"]
    return lambda: step(idx, tgt)


def variant_step(v: argparse.Namespace, device: torch.device, mesh: Any) -> Callable[[], Any]:
    """One step of a pt3func variant: its pf.config fields are set around every call (tracing reads them)."""
    fields = pf_config_of(v)
    with _config(fields):
        step, params, opt_state, idx, tgt, _ = build_run(v, device, mesh)
    state = [params, opt_state]

    def call() -> Any:
        with _config(fields):
            state[0], state[1], loss = step(state[0], state[1], idx, tgt)
        return loss

    def lower() -> pf.Lowered:  # the program the calls run (for tests)
        with _config(fields):
            return step.lower(state[0], state[1], idx, tgt)

    call.lower = lower
    return call


@contextlib.contextmanager
def _config(fields: dict[str, Any]) -> Iterator[None]:
    before = {name: getattr(pf.config, name) for name in fields}
    for name, value in fields.items():
        setattr(pf.config, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(pf.config, name, value)


if __name__ == "__main__":
    main()

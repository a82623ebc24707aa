"""Peak memory and speed of the anchor GPT step under pt3func's memory options, beside torch.compile.

Every number comes from a fresh subprocess: `benchmarks/lm_step.py` for pt3func (same model, step and timing
as the README's LM-step table) and the anchor script (`shared/bench/anchor_lm_step.py torch-compile`) for
torch.compile. Runs start together and compile in parallel (CPU work), then take turns on a lock to run and
time their steps, so no two runs ever time at once; each run's peak is its own process's
`torch.cuda.max_memory_allocated`.

  (a) with donation: pt3func's variants against torch.compile in the same run; the target is a peak at most
      0.9x torch.compile's at equal or better tokens/s (the best pt3func row that meets the speed is shown)
  (b) remat policies, per transformer block (`pf.checkpoint(block, policy)`) or over the whole step
      (`pf.jit(memory_budget=x)`): step ms, tokens/s, peak GiB
  (c) the largest batch that fits in --cap-gib (16) GiB (`torch.cuda.set_per_process_memory_fraction`; an
      OOM is a "does not fit") with full remat (nothing_saveable per block) and with torch.compile: a
      bracketing search, each round's trials in parallel subprocesses, steered by a linear fit of reserved
      memory against batch; stops when the bracket closes or --time-budget runs out

    python benchmarks/memory.py                     # H200, all parts (~8 min); JSON: results/memory_<tag>.json
    python benchmarks/memory.py --parts ab          # (a) and (b) only; --parts c for the batch search
    python benchmarks/memory.py --device cpu        # smoke run (tiny model, eager backend, no torch.compile rows)

On CPU there is no allocator to cap: (c) then compares each trial's `memory_analysis()` peak with the cap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import RESULTS, arrive_and_wait, environment, find_anchor, mark_arrived, print_table, write_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30

# name -> lm_step.py flags. Part (a) compares these with torch.compile; part (b) is the policy table.
PART_A = {
    "pt3func": [],
    "pt3func + CUDA graphs": ["--cuda-graphs"],
    "pt3func, recompute GELU": ["--policy", "recompute_gelu"],
    "pt3func, recompute GELU + CUDA graphs": ["--policy", "recompute_gelu", "--cuda-graphs"],
    "pt3func, recompute LN + GELU": ["--policy", "dots_attn_saveable"],
    # GELU alone recomputed, the bf16 weight casts kept (see lm_step.py's "gelu_only").
    "pt3func, recompute only GELU + CUDA graphs": ["--policy", "gelu_only", "--cuda-graphs"],
    "pt3func, memory_budget 0.9": ["--memory-budget", "0.9"],
    # Inductor's reorder_for_locality off (pf.config.inductor_reorder_for_locality): the recomputed GELU is no
    # longer sunk to the optimizer's update at the end of the step, away from the matmul that reads it.
    "pt3func + CUDA graphs, no locality reorder": ["--cuda-graphs", "--no-locality-reorder"],
    "pt3func, recompute GELU + CUDA graphs, no locality reorder": [
        "--policy", "recompute_gelu", "--cuda-graphs", "--no-locality-reorder"
    ],
    "pt3func, recompute GELU in 6 of 12 blocks + CUDA graphs, no locality reorder": [
        "--policy", "recompute_gelu", "--remat-blocks", "6", "--cuda-graphs", "--no-locality-reorder"
    ],
    # Selective remat: GELU recomputed in only some blocks, trading part of the memory for part of the time.
    **{
        f"pt3func, recompute GELU in {n} of 12 blocks + CUDA graphs": [
            "--policy",
            "recompute_gelu",
            "--remat-blocks",
            str(n),
            "--cuda-graphs",
        ]
        for n in (4, 6, 8)
    },
    # LayerNorm's backward kept in the backward (Inductor otherwise computes its normalised input in fp32 in the
    # forward kernel and keeps it: 64 MiB a LayerNorm at the anchor's size, in place of the bf16 input).
    "pt3func + LN fence + CUDA graphs": ["--fence-backward", "native_layer_norm_backward", "--cuda-graphs"],
    **{
        f"pt3func, LN fence, recompute GELU in {n} of 12 blocks + CUDA graphs": [
            "--fence-backward",
            "native_layer_norm_backward",
            "--policy",
            "recompute_gelu",
            "--remat-blocks",
            str(n),
            "--cuda-graphs",
        ]
        for n in (2, 4)
    },
    "pt3func + all-op fence + CUDA graphs": ["--fence-backward", "all", "--cuda-graphs"],
    # Inductor realises a pointwise value read by several kernels as a buffer once its expression reads more than
    # `realize_reads_threshold` (4) buffers; in the whole-step program that keeps forward values (LayerNorm's
    # normalised input in fp32) alive until the backward. Higher: recomputed inside each reader instead.
    **{
        f"pt3func, realize_reads_threshold {t} + CUDA graphs": [
            "--inductor-option",
            f"realize_reads_threshold={t}",
            "--cuda-graphs",
        ]
        for t in (8, 16)
    },
    "pt3func, realize_reads_threshold 16, recompute GELU in 4 of 12 blocks + CUDA graphs": [
        "--inductor-option",
        "realize_reads_threshold=16",
        "--policy",
        "recompute_gelu",
        "--remat-blocks",
        "4",
        "--cuda-graphs",
    ],
    # The loss head a block of rows at a time (pf.config.loss_chunk_bytes): the 1 GiB of bf16 logits never exist
    # whole. Session 7: each chunk's loss is now summed before the next chunk starts (Inductor had fused every
    # chunk's sum into one kernel at the end, which kept all the chunks' logits alive).
    **{
        f"pt3func, loss in {m} MiB chunks + CUDA graphs": ["--loss-chunk-mib", str(m), "--cuda-graphs"]
        for m in (256, 512)
    },
    **{
        f"pt3func, loss in 256 MiB chunks, recompute GELU in {n} of 12 blocks + CUDA graphs": [
            "--loss-chunk-mib",
            "256",
            "--policy",
            "recompute_gelu",
            "--remat-blocks",
            str(n),
            "--cuda-graphs",
        ]
        for n in (1, 2)
    },
    "pt3func, loss in 256 MiB chunks, LN fence + CUDA graphs": [
        "--loss-chunk-mib",
        "256",
        "--fence-backward",
        "native_layer_norm_backward",
        "--cuda-graphs",
    ],
    # The automatic choice at mild budgets (cost model fixed in session 5: elementwise values go first).
    **{
        f"pt3func, memory_budget {b} + CUDA graphs": ["--memory-budget", str(b), "--cuda-graphs"]
        for b in (0.95, 0.9, 0.85)
    },
}
PART_B = {
    "none": [],
    "dots_saveable": ["--policy", "dots_saveable"],
    "nothing_saveable": ["--policy", "nothing_saveable"],
    "memory_budget 0.25": ["--memory-budget", "0.25"],
    "memory_budget 0.5": ["--memory-budget", "0.5"],
    "memory_budget 0.75": ["--memory-budget", "0.75"],
    "offload (attention output)": ["--policy", "offload"],
}
FULL_REMAT = ["--policy", "nothing_saveable"]
TORCH_COMPILE = "torch.compile"
# The CPU smoke run keeps a few rows (each subprocess costs seconds there).
SMOKE_A = ("pt3func",)
SMOKE_B = ("none", "nothing_saveable")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--parts", default="abc", help="which parts to run: any of a, b, c")
    p.add_argument("--anchor", default=None, help="the anchor script (default: shared/bench/anchor_lm_step.py)")
    p.add_argument("--batch", type=int, default=None, help="batch of parts (a) and (b) (default 16; CPU 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; CPU 1)")
    p.add_argument("--cap-gib", type=float, default=None, help="memory of part (c) (default 16; CPU 0.002)")
    p.add_argument("--jobs", type=int, default=None, help="runs at once (default 8 on a GPU, 2 on CPU)")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds; (c) starts no round after it")
    p.add_argument("--rounds", type=int, default=None, help="most search rounds in (c) (default 4; CPU 2)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run part (a) this many times (fresh processes each time) and give a verdict over all of them",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="only the part (a)/(b) rows whose names contain one of these comma-separated strings",
    )
    p.add_argument("--tag", default=None, help="results/memory_<tag>.json (default: the device name)")
    # Internal: run the anchor script in this process, under the lock and memory cap.
    p.add_argument("--anchor-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--timing-lock", default=None, help=argparse.SUPPRESS)
    p.add_argument("--timing-barrier", default=None, help=argparse.SUPPRESS)
    p.add_argument("anchor_args", nargs="*", help=argparse.SUPPRESS)
    return p.parse_args()


@dataclass
class Run:
    name: str
    kind: str  # "pt3func" (lm_step.py) or "torch.compile" (the anchor script)
    flags: list[str]
    batch: int
    cap_gib: float | None = None
    record: dict[str, Any] = field(default_factory=dict)
    barrier: str | None = None  # "DIR:N:ID" (common.arrive_and_wait), set by Runner.run_all


class Runner:
    """Starts runs as subprocesses, `jobs` at a time, all sharing one timing lock."""

    def __init__(self, a: argparse.Namespace, workdir: Path):
        self.a = a
        self.workdir = workdir
        self.lock = workdir / "timing.lock"
        self.anchor = _find_anchor(a.anchor) if a.device == "cuda" else None
        self.count = 0
        self.done: dict[tuple, dict[str, Any]] = {}  # identical runs (a's and b's baseline) run once
        # Concurrent compiles share the cores instead of each starting a worker per core.
        threads = max(1, (os.cpu_count() or 1) // a.jobs)
        self.env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}

    def model_flags(self) -> list[str]:
        if self.a.device == "cpu":
            # Activations large enough against the weights that the peak grows with the batch.
            return ["--layers", "1", "--d", "32", "--heads", "2", "--seq", "64", "--vocab", "512"]
        return []  # the anchor's defaults

    def command(self, run: Run) -> list[str]:
        common = [*self.model_flags(), "--batch", str(run.batch), "--steps", str(self.a.steps)]
        if run.kind == TORCH_COMPILE:
            cmd = [sys.executable, str(HERE / "memory.py"), "--anchor-child", str(self.anchor)]
            # A capped run (c) only asks "does it fit": it takes no turn on the timing lock.
            cmd += ["--cap-gib", str(run.cap_gib)] if run.cap_gib else ["--timing-lock", str(self.lock)]
            cmd += ["--timing-barrier", run.barrier] if run.barrier else []
            return [*cmd, "--", "torch-compile", *common]
        self.count += 1
        cmd = [sys.executable, str(HERE / "lm_step.py"), *common, *run.flags]
        cmd += ["--out", str(self.workdir / f"run{self.count}.jsonl")]
        if self.a.device == "cpu":
            cmd += ["--device", "cpu", "--threads", "1", "--backend", "eager"]
        cmd += ["--max-memory-gib", str(run.cap_gib)] if run.cap_gib else ["--timing-lock", str(self.lock)]
        cmd += ["--timing-barrier", run.barrier] if run.barrier else []
        return cmd

    def run_all(self, runs: list[Run]) -> None:
        """Run each distinct configuration once (parts share their baseline), all in one pool."""
        runs = [r for r in runs if r.kind != TORCH_COMPILE or self.anchor is not None]
        unique = {_key(r): r for r in reversed(runs) if _key(r) not in self.done}
        # Timed runs that all start at once wait for each other's compiles before timing (a quiet host). With more
        # runs than jobs a barrier would wait for runs that cannot start: those time while others compile.
        timed = [r for r in unique.values() if not r.cap_gib]
        if self.a.device == "cuda" and 1 < len(timed) <= self.a.jobs:
            barrier = tempfile.mkdtemp(dir=self.workdir, prefix="barrier")
            for i, r in enumerate(timed):
                r.barrier = f"{barrier}:{len(timed)}:{i}"
        elif len(timed) > self.a.jobs:
            print(f"  {len(timed)} runs > --jobs {self.a.jobs}: runs time their steps while others compile", flush=True)
        with ThreadPoolExecutor(max_workers=self.a.jobs) as pool:
            list(pool.map(self._run_one, unique.values()))
        for r in runs:
            r.record = dict(self.done[_key(r)])

    def _run_one(self, run: Run) -> None:
        cmd = self.command(run)
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=HERE, env=self.env)
        except subprocess.TimeoutExpired:
            run.record = {"error": "timed out after 600 s"}
            return
        finally:
            if run.barrier:  # a run that ended before the barrier (a crash) must not hold the others
                mark_arrived(run.barrier)
        record: dict[str, Any] = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                record.update(json.loads(line))
        if done.returncode != 0 or not record:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            record = {"error": f"exit {done.returncode}: " + " | ".join(tail)}
        record["wall_s"] = round(time.perf_counter() - start, 1)
        run.record = self.done[_key(run)] = record
        state = "OOM" if record.get("oom") else ("error" if "error" in record else f"{peak_gib(record):.3g} GiB")
        print(f"  {run.name} (batch {run.batch}): {state}, {record['wall_s']} s", flush=True)


def _key(run: Run) -> tuple:
    return (run.kind, tuple(run.flags), run.batch, run.cap_gib)


def _find_anchor(path: str | None) -> Path | None:
    found = find_anchor(path)
    if found is not None:
        return found
    print("anchor script not found (--anchor): torch.compile rows are skipped", flush=True)
    return None


def peak_gib(record: dict[str, Any]) -> float:
    """Measured peak on a GPU; on CPU (smoke runs) the compiled program's memory_analysis() estimate."""
    if record.get("peak_mem_gib") is not None:
        return float(record["peak_mem_gib"])
    if record.get("pf_compiled_peak_bytes") is not None:
        return record["pf_compiled_peak_bytes"] / GIB
    return math.nan


def row(run: Run) -> list[Any]:
    r = run.record
    if "error" in r or r.get("oom"):
        return [run.name, run.batch, math.nan, math.nan, math.nan, math.nan, math.nan, r.get("error", "OOM")[:60]]
    estimate = r.get("pf_compiled_peak_bytes")
    ratio = r.get("pf_compiled_peak_over_measured")
    return [
        run.name,
        run.batch,
        float(r["step_ms"]),
        float(r["tokens_per_s"]),
        peak_gib(r),
        estimate / GIB if estimate is not None else math.nan,
        float(ratio) if ratio is not None else math.nan,
        "",
    ]


# "estimate": Compiled.memory_analysis()'s peak; "est./peak": its ratio to the measured peak (target 0.9-1.1).
COLUMNS = ["run", "batch", "step ms", "tokens/s", "peak GiB", "estimate GiB", "est./peak", "note"]


def _chosen(names: tuple[str, ...], rows: str | None) -> tuple[str, ...]:
    """The names that contain one of `rows`' comma-separated strings (all without --rows)."""
    if not rows:
        return names
    wanted = [w.strip() for w in rows.split(",") if w.strip()]
    return tuple(n for n in names if any(w in n for w in wanted))


def plan_a(batch: int, cpu: bool, rows: str | None = None) -> list[Run]:
    names = _chosen(SMOKE_A if cpu else tuple(PART_A), rows)
    return [*(Run(n, "pt3func", PART_A[n], batch) for n in names), Run(TORCH_COMPILE, TORCH_COMPILE, [], batch)]


def report_a(runs: list[Run]) -> dict[str, Any]:
    print_table("(a) pt3func (donated) vs torch.compile", COLUMNS, [row(r) for r in runs if r.record])
    result: dict[str, Any] = {"rows": {r.name: r.record for r in runs if r.record}}
    base = next((r.record for r in runs if r.kind == TORCH_COMPILE and "step_ms" in r.record), None)
    if base is None:
        result["verdict"] = "no torch.compile row (CPU, or the anchor script failed)"
    else:
        fast = [r for r in runs if r.kind == "pt3func" and r.record.get("tokens_per_s", 0) >= base["tokens_per_s"]]
        best = min(fast, key=lambda r: peak_gib(r.record), default=None)
        target = 0.9 * base["peak_mem_gib"]
        if best is None:
            result["verdict"] = "no pt3func row reached torch.compile's tokens/s"
        else:
            ratio = peak_gib(best.record) / base["peak_mem_gib"]
            met = "met" if peak_gib(best.record) <= target else "not met"
            result["verdict"] = (
                f"{met}: {best.name} peaks at {peak_gib(best.record):.2f} GiB = {ratio:.3f}x torch.compile's "
                f"{base['peak_mem_gib']:.2f} GiB (target <= 0.9x) at {best.record['tokens_per_s']:,} vs "
                f"{base['tokens_per_s']:,} tokens/s"
            )
    print(result["verdict"], flush=True)
    return result


def report_repeats(repeats: list[list[Run]]) -> dict[str, Any]:
    """Part (a) over several waves: per row the median step time and tokens/s, and each pt3func row's tokens/s
    against torch.compile's of the same wave; the target counts as met for a row only if it is met in every wave
    (peak <= 0.9 x torch.compile's and tokens/s >= torch.compile's)."""
    names = [r.name for r in repeats[0]]
    rows, verdicts = [], {}
    for name in names:
        records = [next(r.record for r in wave if r.name == name) for wave in repeats]
        ok = [rec for rec in records if "step_ms" in rec]
        if not ok:
            continue
        step = statistics.median(rec["step_ms"] for rec in ok)
        tokens = statistics.median(rec["tokens_per_s"] for rec in ok)
        rows.append([name, len(ok), step, tokens, max(peak_gib(rec) for rec in ok)])
        if name == TORCH_COMPILE:
            continue
        speed, memory = [], []
        for wave in repeats:
            rec = next(r.record for r in wave if r.name == name)
            base = next((r.record for r in wave if r.kind == TORCH_COMPILE and "step_ms" in r.record), None)
            if base is None or "step_ms" not in rec:
                continue
            speed.append(rec["tokens_per_s"] / base["tokens_per_s"])
            memory.append(peak_gib(rec) / base["peak_mem_gib"])
        if speed:
            met = all(s >= 1.0 for s in speed) and all(m <= 0.9 for m in memory)
            verdicts[name] = {"tokens_per_s_vs_torch_compile": speed, "peak_vs_torch_compile": memory, "met": met}
    print_table(f"(a) over {len(repeats)} waves (medians)", ["run", "waves", "step ms", "tokens/s", "peak GiB"], rows)
    for name, v in verdicts.items():
        speeds = ", ".join(f"{x:.3f}" for x in v["tokens_per_s_vs_torch_compile"])
        print(f"  {name}: tokens/s x torch.compile's per wave {speeds}; peak x {max(v['peak_vs_torch_compile']):.3f}; "
              f"{'met in every wave' if v['met'] else 'not met in every wave'}", flush=True)
    return {"rows": rows, "verdicts": verdicts}


def plan_b(batch: int, cpu: bool, rows: str | None = None) -> list[Run]:
    return [Run(n, "pt3func", PART_B[n], batch) for n in _chosen(SMOKE_B if cpu else tuple(PART_B), rows)]


def report_b(runs: list[Run]) -> dict[str, Any]:
    print_table("(b) remat policies (pt3func, donated)", COLUMNS, [row(r) for r in runs])
    return {"rows": {r.name: r.record for r in runs}}


def part_c(runner: Runner, deadline: float) -> dict[str, Any]:
    """Largest batch within the cap, per implementation: bracket [fits, OOM] narrowed round by round."""
    a = runner.a
    impls = {"pt3func, full remat (nothing_saveable per block)": ("pt3func", FULL_REMAT)}
    if runner.anchor is not None:
        impls["torch.compile (default)"] = (TORCH_COMPILE, [])
    first = (2, 4) if a.device == "cpu" else (8, 16)
    trials: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in impls}
    next_batches = {name: list(first) for name in impls}
    for round_no in range(1, a.rounds + 1):
        if not any(next_batches.values()):
            break
        if round_no > 1 and time.monotonic() > deadline:
            print("(c) time budget spent: stopping the search", flush=True)
            break
        runs = [
            Run(name, impls[name][0], impls[name][1], b, a.cap_gib) for name, bs in next_batches.items() for b in bs
        ]
        print(f"(c) round {round_no}: " + ", ".join(f"{r.name.split(',')[0]} @ {r.batch}" for r in runs), flush=True)
        runner.run_all(runs)
        for r in runs:
            trials[r.name][r.batch] = r.record
        next_batches = {name: _next_candidates(trials[name], a.cap_gib) for name in impls}
    result = {}
    for name in impls:
        fits = sorted(b for b, rec in trials[name].items() if _fits(rec))
        ooms = sorted(b for b, rec in trials[name].items() if rec.get("oom"))
        largest = fits[-1] if fits else 0
        closed = bool(ooms) and ooms[0] == largest + 1
        result[name] = {
            "largest_batch": largest,
            "bracket_closed": closed,
            "smallest_oom": ooms[0] if ooms else None,
            "trials": {str(b): _summary(rec) for b, rec in sorted(trials[name].items())},
        }
    rows = [
        [
            name,
            r["largest_batch"],
            "" if r["bracket_closed"] else "(bracket not closed)",
            r["smallest_oom"] if r["smallest_oom"] is not None else "-",
            peak_gib(trials[name].get(r["largest_batch"], {})),
        ]
        for name, r in result.items()
    ]
    print_table(f"(c) largest batch in {a.cap_gib:g} GiB", ["impl", "largest batch", "", "first OOM", "peak GiB"], rows)
    return {"cap_gib": a.cap_gib, "impls": result}


def _fits(record: dict[str, Any]) -> bool:
    return "step_ms" in record and not record.get("oom")


def _reserved_gib(record: dict[str, Any]) -> float:
    """What the cap limits: the allocator's reserved memory (GPU); the program's estimate on CPU."""
    if record.get("peak_reserved_gib") is not None:
        return float(record["peak_reserved_gib"])
    return peak_gib(record)


def _next_candidates(trials: dict[int, dict[str, Any]], cap: float) -> list[int]:
    """Up to three batches inside the open bracket (largest fit, smallest OOM), near the linear prediction."""
    fits = {b: _reserved_gib(rec) for b, rec in trials.items() if _fits(rec)}
    ooms = [b for b, rec in trials.items() if rec.get("oom")]
    lo = max(fits, default=0)
    hi = min(ooms, default=None)
    if hi is not None and hi <= lo + 1:
        return []
    if not fits and not ooms:
        return []  # every trial failed: nothing to steer by
    # Without an OOM yet, look at most 4x past the largest fit; bisect (geometrically) when nothing better.
    upper = hi - 1 if hi is not None else max(4 * lo, 1)
    guess = round(math.sqrt(max(lo, 1) * (upper + 1)))
    if len(fits) >= 2:
        (b0, m0), (b1, m1) = sorted(fits.items())[-2:]
        slope = (m1 - m0) / (b1 - b0)
        if slope > 0:  # reserved memory grows linearly with the batch: where it meets the cap
            guess = int((cap - m1) / slope) + b1
    guess = min(max(guess, lo + 1), upper)
    inside = [b for b in (guess - 1, guess, guess + 1) if lo < b <= upper and b not in trials]
    return inside or [b for b in range(lo + 1, upper + 1) if b not in trials][:1]


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("oom", "error", "step_ms", "tokens_per_s", "peak_mem_gib", "peak_reserved_gib", "pf_compiled_peak_bytes")
    return {k: record[k] for k in keys if k in record}


def anchor_child(a: argparse.Namespace) -> None:
    """Run the anchor script here, under the timing lock and the memory cap; an OOM prints {"oom": true}."""
    import fcntl
    import runpy

    import torch

    if a.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(a.cap_gib * GIB / total, 1.0))
    arrive_and_wait(a.timing_barrier)  # before the anchor compiles: its timed steps then run on a quiet host
    with open(a.timing_lock or os.devnull, "a") as lock:
        if a.timing_lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        sys.argv = [a.anchor_child, *a.anchor_args]
        try:
            runpy.run_path(a.anchor_child, run_name="__main__")
        except torch.OutOfMemoryError:
            print(json.dumps({"impl": "torch-compile", "oom": True}), flush=True)
            return
    print(json.dumps({"peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2)}), flush=True)


def main() -> None:
    a = parse_args()
    if a.anchor_child:
        anchor_child(a)
        return
    cpu = a.device == "cpu"
    a.batch = a.batch or (2 if cpu else 16)
    a.steps = a.steps or (1 if cpu else 10)
    a.cap_gib = a.cap_gib or (0.002 if cpu else 16.0)
    a.jobs = a.jobs or (2 if cpu else 8)
    a.rounds = a.rounds or (2 if cpu else 4)
    tag = a.tag or ("cpu" if cpu else _gpu_slug())
    start = time.monotonic()
    deadline = start + a.time_budget
    out = RESULTS / f"memory_{tag}.json"
    payload: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(a, Path(tmp))
        payload.update(
            config=dict(batch=a.batch, steps=a.steps, device=a.device, model=runner.model_flags() or "anchor"),
            env=environment(),
        )
        runs_a = plan_a(a.batch, cpu, a.rows) if "a" in a.parts else []
        runs_b = plan_b(a.batch, cpu, a.rows) if "b" in a.parts else []
        runner.run_all(runs_a + runs_b)  # one wave: every run compiles at once
        if runs_a:
            payload["a_vs_torch_compile"] = report_a(runs_a)
            repeats = [runs_a]
            for _ in range(1, a.repeats):  # same rows again, new processes: run-to-run spread
                runner.done.clear()
                repeats.append(plan_a(a.batch, cpu, a.rows))
                runner.run_all(repeats[-1])
                report_a(repeats[-1])
            if a.repeats > 1:
                payload["a_repeats"] = report_repeats(repeats)
        if runs_b:
            payload["b_policies"] = report_b(runs_b)
        write_json(out, payload)  # kept even if a later part is cut short
        if "c" in a.parts:
            a.jobs = min(a.jobs, 7) if not cpu else a.jobs  # 7 x 16 GiB caps fit on one 141 GiB H200
            payload["c_largest_batch"] = part_c(runner, deadline)
    payload["wall_s"] = round(time.monotonic() - start, 1)
    print(f"done in {payload['wall_s']} s; wrote {write_json(out, payload)}")


def _gpu_slug() -> str:
    import torch

    return torch.cuda.get_device_name().lower().replace(" ", "-") if torch.cuda.is_available() else "cuda"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

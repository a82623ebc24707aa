"""`offload_to_host` on the anchor step: step time and peak memory with the copies overlapped and not, and
whether the copies run while kernels do.

Each row is a fresh `lm_step.py` process (clean peak memory):

- `offload`: `--policy offload` (each block's attention output in pinned host memory, the rest recomputed),
  copies on the side stream (the default);
- `offload-no-overlap`: the same program with `PT3FUNC_OFFLOAD_OVERLAP=0`: both copies on the compute stream;
- `attn_saveable`: the same recompute with the attention output kept on the device (what offload saves);
- `none`: no remat.

The two offload rows are profiled (`lm_step.py --profile`); from each chrome trace this script sums the
host<->device copies of at least `--min-copy-mib` and the part of that time during which a kernel runs (on
any stream): with overlap most of it, without it none (one stream runs one thing at a time). From the
program Inductor generated (`--dump-code`) it counts the kernels launched between each value's offload and
release, and between its prefetch and wait: what each copy has to hide behind (0: the ops were moved
together).

    python benchmarks/offload_overlap.py                    # one H200, the anchor config (~5 min)
    python benchmarks/offload_overlap.py --smoke            # CPU: tiny config, plumbing only (offload is a
                                                            #   no-op on CPU values: 0 offloaded), < 2 min
Prints one line per row, the copy overlap per profiled row, and how far the offload rows' losses (after the
timed steps) are from the `attn_saveable` row's: the same values are kept, so on CPU they are equal bit for bit;
on a GPU two runs of one program differ too (cuDNN attention's backward is not deterministic: 2e-4 relative
after 13 steps between identical-math rows on an H200), so there the check allows LOSS_RTOL. Writes
`results/offload_overlap_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, environment
from gpu_profile import union_intervals

HERE = Path(__file__).resolve().parent
SMOKE = ["--device", "cpu", "--layers", "2", "--d", "64", "--heads", "4", "--seq", "32", "--batch", "2",
         "--vocab", "256", "--threads", "1"]
# Losses of offload rows against attn_saveable's on a GPU: run-to-run noise of one program is ~2e-4 there.
LOSS_RTOL = 1e-3
ROWS = {
    "offload": ("offload", "1", True),
    "offload-no-overlap": ("offload", "0", True),
    "attn_saveable": ("attn_saveable", "1", False),
    "none": ("none", "1", False),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: checks the plumbing, measures nothing")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (after 3 warm-up steps)")
    p.add_argument("--min-copy-mib", type=float, default=1.0, help="copies smaller than this are not counted")
    p.add_argument("--trace-dir", default=None, help="keep the chrome traces here (default: a temporary folder)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more lm_step.py flags for every row")
    return p.parse_args()


def _overlap(interval: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in merged if s < end and e > start)


def copy_direction(event: dict[str, Any]) -> str | None:
    """The direction of a `gpu_memcpy` trace event: "DtoH", "HtoD" (or another CUPTI copy kind).

    Kineto names a copy "Memcpy DtoH (Device -> Pinned)"; torch's Python CUPTI monitor (newer torch) names it
    "Memcpy" and gives the kind as `args["copy kind"]`.
    """
    kind = event.get("args", {}).get("copy kind")
    if isinstance(kind, str):
        return kind
    m = re.match(r"Memcpy (\w+)", event.get("name", ""))
    return m.group(1) if m else None


def copy_overlap(trace_path: str, steps: int, min_bytes: int) -> dict[str, Any]:
    """Host<->device copies of at least `min_bytes` in a chrome trace, and how much of their time overlaps kernels."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    copies = [
        e for e in events
        if e.get("cat") == "gpu_memcpy" and e.get("ph") == "X" and copy_direction(e) in ("DtoH", "HtoD")
        and e.get("args", {}).get("bytes", 0) >= min_bytes
    ]
    busy = union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    out: dict[str, Any] = {}
    for direction in ("DtoH", "HtoD"):
        mine = [e for e in copies if copy_direction(e) == direction]
        total = sum(e["dur"] for e in mine)
        hidden = sum(_overlap((e["ts"], e["ts"] + e["dur"]), busy) for e in mine)
        out[direction] = dict(
            copies_per_step=len(mine) / steps,
            mib_per_step=round(sum(e["args"]["bytes"] for e in mine) / steps / 2**20, 1),
            ms_per_step=round(total / steps / 1e3, 3),
            overlapped_with_kernels=round(hidden / total, 3) if total else None,
            streams=sorted({e.get("args", {}).get("stream") for e in mine}),
        )
    out["kernel_streams"] = sorted({e.get("args", {}).get("stream") for e in kernels})
    return out


def op_windows(code: str) -> dict[str, list[int]]:
    """Kernel launches between each value's offload and release ("out") and its prefetch and wait ("back") in
    Inductor's generated program: what each copy can overlap. 0 means the ops ended up side by side."""
    body = code[code.index("def call("):]
    events: list[str | None] = []  # an op's node name, or None for a kernel launch
    node = None
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("# Topologically Sorted Source Nodes: ["):
            node = s.split("[", 1)[1].split("]", 1)[0].split(", ")[-1]
        elif re.match(r"buf\d+ = torch\.ops\.pt3func\.\w+\.default\(", s):
            events.append(node)
        elif re.search(r"\w\.run\(|^extern_kernels\.\w+\(|torch\.ops\.aten\.\w+|^cpp_fused\w*\(", s):
            events.append(None)
    launched, count = [], 0
    for e in events:
        launched.append(count)
        count += e is None
    at = {e: i for i, e in enumerate(events) if e is not None}
    out: dict[str, list[int]] = {"out": [], "back": []}
    for name in at:
        m = re.fullmatch(r"offload_to_host_default(_\d+)?", name)
        if not m:
            continue
        suffix = m.group(1) or ""
        ops = ("offload_release", "reload_prefetch", "reload_wait")
        release, prefetch, wait = (f"{op}_default{suffix}" for op in ops)
        if {release, prefetch, wait} <= at.keys():
            out["out"].append(launched[at[release]] - launched[at[name]])
            out["back"].append(launched[at[wait]] - launched[at[prefetch]])
    return out


def offloaded_values(code: str) -> int:
    """How many values the generated program copies to host (calls of `offload_to_host`)."""
    return len(re.findall(r"torch\.ops\.pt3func\.offload_to_host\.default\(", code))


def run_row(name: str, a: argparse.Namespace, trace_dir: str, out_jsonl: Path) -> dict[str, Any]:
    policy, overlap, profiled = ROWS[name]
    steps = 3 if a.smoke else a.steps
    cmd = [sys.executable, str(HERE / "lm_step.py"), "--policy", policy, "--steps", str(steps), "--out", str(out_jsonl)]
    if a.smoke:
        cmd += SMOKE
    trace = os.path.join(trace_dir, f"{name}.json")
    if profiled and not a.smoke:
        cmd += ["--profile", trace]
    if profiled:
        cmd += ["--dump-code", os.path.join(trace_dir, f"{name}_program.py")]
    cmd += [x for x in a.extra if x != "--"]
    env = dict(os.environ, PT3FUNC_OFFLOAD_OVERLAP=overlap)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    record = json.loads(lines[-1])
    row = dict(row=name, policy=policy, overlap=overlap == "1", step_ms=record["step_ms"],
               tokens_per_s=record["tokens_per_s"], peak_mem_gib=record["peak_mem_gib"], loss=record["loss"],
               pf_compiled_peak_mem_gib=record["pf_compiled_peak_mem_gib"])
    program = os.path.join(trace_dir, f"{name}_program.py")
    if os.path.exists(program):
        code = Path(program).read_text()
        row["offloaded_values"] = offloaded_values(code)
        windows = op_windows(code)
        row["kernels_between"] = {k: dict(n=len(v), min=min(v), median=statistics.median(v)) if v else None
                                  for k, v in windows.items()}
    rank_trace = trace.replace(".json", ".rank0.json")
    if os.path.exists(rank_trace):
        row["copies"] = copy_overlap(rank_trace, record["profile"]["steps"], int(a.min_copy_mib * 2**20))
        row["profile_span_ms"] = record["profile"]["span_ms"]
    return row


def main() -> None:
    a = parse_args()
    names = [n for n in a.rows.split(",") if n]
    unknown = set(names) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {list(ROWS)}")
    device = "cpu" if a.smoke else "cuda"
    out_json = RESULTS / f"offload_overlap_{device}.json"
    out_jsonl = RESULTS / f"offload_overlap_{device}.lm_step.jsonl"
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="offload_traces_")
    os.makedirs(trace_dir, exist_ok=True)
    rows = []
    for name in names:
        row = run_row(name, a, trace_dir, out_jsonl)
        rows.append(row)
        peak = f"{row['peak_mem_gib']} GiB" if row["peak_mem_gib"] is not None else "n/a (CPU)"
        print(f"{name:20s} step {row['step_ms']:9.2f} ms  peak {peak:12s} compiled-program peak "
              f"{row['pf_compiled_peak_mem_gib']} GiB  loss {row['loss']!r}", flush=True)
        if "offloaded_values" in row:
            n = row["offloaded_values"]
            print(f"    offloaded values in the program: {n}", flush=True)
            if n == 0 and device == "cuda":
                print("    WARNING: the policy offloaded nothing: this row measures no offload", flush=True)
        for k, w in (row.get("kernels_between") or {}).items():
            if w:
                what = "offload -> release" if k == "out" else "prefetch -> wait"
                print(f"    {what}: {w['n']} values, kernels launched between: min {w['min']}, median "
                      f"{w['median']}", flush=True)
        for direction, c in row.get("copies", {}).items():
            if direction == "kernel_streams":
                continue
            print(f"    {direction}: {c['copies_per_step']:.0f} copies/step, {c['mib_per_step']} MiB, "
                  f"{c['ms_per_step']} ms/step, {c['overlapped_with_kernels']} of it while kernels run "
                  f"(copy streams {c['streams']}, kernel streams {row['copies']['kernel_streams']})", flush=True)
    by_name = {r["row"]: r for r in rows}
    same = None
    if "attn_saveable" in by_name:
        ref = by_name["attn_saveable"]["loss"]
        rtol = 0.0 if a.smoke else LOSS_RTOL
        worst = max((abs(r["loss"] - ref) / abs(ref) for r in rows if r["policy"] == "offload"), default=0.0)
        same = worst <= rtol
        print(f"offload losses vs attn_saveable's: largest relative difference {worst:.1e} (allowed {rtol:g}): {same}")
    if "offload" in by_name and "offload-no-overlap" in by_name:
        on, off = by_name["offload"], by_name["offload-no-overlap"]
        print(f"overlap saves {off['step_ms'] - on['step_ms']:.2f} ms per step "
              f"({off['step_ms']:.2f} -> {on['step_ms']:.2f})")
    if "offload" in by_name and "attn_saveable" in by_name and by_name["offload"]["peak_mem_gib"] is not None:
        on, kept = by_name["offload"], by_name["attn_saveable"]
        print(f"offload vs attn kept on the device: peak {kept['peak_mem_gib']} -> {on['peak_mem_gib']} GiB, "
              f"step {kept['step_ms']:.2f} -> {on['step_ms']:.2f} ms")
    RESULTS.mkdir(exist_ok=True)
    out_json.write_text(json.dumps(dict(rows=rows, same_losses=same, traces=trace_dir, env=environment()), indent=1))
    print(f"wrote {out_json}; traces in {trace_dir}")


if __name__ == "__main__":
    main()

"""Dequantise with and without streaming stores, against a device-to-device copy, in the same process.

    python benchmarks/quant_stream.py --out benchmarks/results/quant_stream_h200.json   # GPU: 64 MiB, 256 MiB, 1 GiB
    python benchmarks/quant_stream.py --device cpu --sizes small                        # smoke run (interpreter)

`pt3func.kernels.triton_quant.dequantize_blockwise(streaming=...)` stores its output with the `.cs` cache hint
(written once, evicted first) or without it. Each round times the copy and both variants of int8 / int4 dequantise
back to back (the timer of benchmarks/quant_kernels.py: CUDA events over `--calls` calls queued behind a sleep),
`--rounds` times, so that drifts of the GPU's clocks hit all of them alike; the table gives each one's median
ratio to the copy and its worst round. Both variants are checked bit for bit against the torch reference first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available() or "cpu" in sys.argv:
    # Triton has no CPU backend: its interpreter runs the kernels. Must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_json  # noqa: E402
from quant_kernels import SIZES, Timer, bytes_moved, size_label  # noqa: E402

from pt3func.kernels import reference, triton_available  # noqa: E402

KERNELS = {"int8 dequantise": 8, "int4 dequantise": 4}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", choices=sorted(SIZES), default=None, help="gpu (default on cuda) or small")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--rounds", type=int, default=None, help="rounds of (copy, each variant); 7 on GPU")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per measurement; 10 on GPU")
    p.add_argument("--calls", type=int, default=None, help="calls per repetition; 10 on GPU")
    p.add_argument("--out", default=None)
    return p.parse_args()


def main(a: argparse.Namespace) -> dict[str, Any]:
    if not triton_available():
        raise SystemExit("triton is not importable: nothing to benchmark")
    from pt3func.kernels import triton_quant as tq

    gpu = a.device == "cuda"
    sizes = SIZES[a.sizes or ("gpu" if gpu else "small")]
    timer = Timer(a.device, a.repeats or (10 if gpu else 1), a.calls or (10 if gpu else 1), warmup=3 if gpu else 1)
    rounds = a.rounds or (7 if gpu else 1)
    rows, records = [], []
    for size in sizes:
        n = size // 4
        x = torch.randn(n, device=a.device, generator=torch.Generator(a.device).manual_seed(size))
        dst = torch.empty_like(x)
        quantised = {name: reference.quantize_blockwise(x, bits, a.block)[:2] for name, bits in KERNELS.items()}
        calls: dict[str, Any] = {"copy": lambda x=x, dst=dst: dst.copy_(x)}
        nbytes = {"copy": 2 * size}
        for name, bits in KERNELS.items():
            q, s = quantised[name]
            want = reference.dequantize_blockwise(q, s, bits, a.block, n)
            for stream in (False, True):
                label = f"{name}{', streaming stores' if stream else ''}"

                def run(q=q, s=s, bits=bits, n=n, stream=stream):
                    return tq.dequantize_blockwise(q, s, bits, a.block, n, streaming=stream)

                if not torch.equal(run(), want):
                    raise SystemExit(f"{label} at {size_label(size)} differs from the torch reference")
                calls[label], nbytes[label] = run, bytes_moved(name, n, a.block)
        ratios: dict[str, list[float]] = {k: [] for k in calls if k != "copy"}
        for _ in range(rounds):
            copy_gbps = nbytes["copy"] / timer(calls["copy"]) / 1e9
            for label in ratios:
                ratios[label].append(nbytes[label] / timer(calls[label]) / 1e9 / copy_gbps)
        for label, rs in ratios.items():
            rec = {"size_bytes": size, "kernel": label, "ratios_to_copy": rs, "median": statistics.median(rs),
                   "worst": min(rs)}
            records.append(rec)
            rows.append([size_label(size), label, rec["median"], rec["worst"], "yes" if rec["worst"] >= 0.9 else "NO"])
        del x, dst, quantised
    print_table(f"Dequantise, with and without streaming stores ({a.device}, block {a.block}, {rounds} rounds)",
                ["size", "kernel", "x copy (median)", "x copy (worst round)", ">= 0.9 every round"], rows)
    result = {"environment": environment(), "block": a.block, "rounds": rounds, "records": records,
              "default_streaming": tq.STREAMING_STORES}
    out = Path(a.out) if a.out else RESULTS / f"quant_stream_{'cpu' if not gpu else 'gpu'}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(parse_args())

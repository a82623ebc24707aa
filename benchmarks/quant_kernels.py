"""Bandwidth of the blockwise quantisation kernels against a device-to-device copy measured in the same run.

    python benchmarks/quant_kernels.py --out benchmarks/results/quant_kernels_h200.json   # GPU: 64 MiB, 256 MiB, 1 GiB
    python benchmarks/quant_kernels.py --no-compile --kernels int4 --paths pairs          # GPU: a shorter run
    python benchmarks/quant_kernels.py --device cpu --sizes small                         # smoke run, seconds

For each buffer size (fp32 input) and each kernel (int8 / int4 quantise, round-to-nearest or stochastic, with or
without the fused error-feedback update; int8 / int4 dequantise to fp32) it times the Triton kernel with the
launch configuration the custom op uses (`default`), sweeps elements per program x warps for both kernel paths
(`pairs`: words of two elements, `elements`: the element kernel; `best` and its config, and the best of each
path), and times `torch.compile` of the torch reference. It ends with the per-kernel configuration that does
best at every size, as a `_CONFIGS` table for triton_quant.py. GB/s = (bytes read + bytes written) / time;
`x copy` divides by the copy bandwidth (`dst.copy_(src)`, 2 x size bytes). Issue 6's targets: >= 0.9 x copy for
round-to-nearest quantise (with and without error feedback) and dequantise, >= 0.75 x for stochastic rounding.

Before timing, every kernel is checked bit for bit against the eager torch reference on the same device (and
against the CPU reference on a smaller buffer); the table and the JSON say whether it matched.

Timing: CUDA events around `--calls` back-to-back calls, queued behind a `torch.cuda._sleep` so the host's launch
cost is hidden and the GPU's time is what is measured; warm-up, then the median of `--repeats`. On CPU (smoke)
the Triton kernels run under TRITON_INTERPRET=1 and the reference runs eagerly: the numbers mean nothing, the run
checks that the script and the kernels work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES = {"gpu": [64 * 2**20, 256 * 2**20, 2**30], "small": [16 * 2**10, 64 * 2**10]}
# (elements per program, warps): the sweep of the element kernels, besides each kernel's default
# (triton_quant.default_config).
SWEEP = [(1024, 2), (1024, 4), (2048, 1), (2048, 2), (2048, 4), (4096, 2), (4096, 4), (8192, 4)]
# The pair kernels' sweep. In quantise a thread holds runs of min(16, words / threads) contiguous words (Triton
# sizes the tile's layout to the uint8 q store, 16 bytes), so 2048 x 2 and 4096 x 4 give 16 (128 bytes of fp32),
# 2048 x 4 and 1024 x 2 give 8, 512 x 4 and 1024 x 8 give 2; one warp per program (1024 x 1, 2048 x 1) did best
# for the element kernels with stochastic rounding in run 3. Dequantise always stores runs of 2 words.
SWEEP_PAIRS = [(512, 4), (1024, 1), (1024, 2), (1024, 4), (1024, 8), (2048, 1), (2048, 2), (2048, 4), (4096, 2),
               (4096, 4), (4096, 8), (8192, 4), (8192, 8)]
PATHS = {"both": (True, False), "pairs": (True,), "elements": (False,)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--sizes", default=None,
                        help="'gpu' (64 MiB, 256 MiB, 1 GiB), 'small' (16 KiB, 64 KiB) or MiB values: 64,256")
    parser.add_argument("--block", type=int, default=256, help="elements per scale")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (median); 20 on GPU")
    parser.add_argument("--calls", type=int, default=None, help="back-to-back calls per repetition; 10 on GPU")
    parser.add_argument("--no-sweep", action="store_true", help="time the default launch configuration only")
    parser.add_argument("--paths", choices=sorted(PATHS), default="both",
                        help="which kernels the sweep times: the pair kernels, the element kernels or both")
    parser.add_argument("--kernels", default=None, help="comma-separated substrings of kernel names: 'int4'")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--out", default=None, help="JSON path (default results/quant_kernels_<device>.json)")
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sizes is None:
        args.sizes = "gpu" if args.device == "cuda" else "small"
    args.size_bytes = SIZES.get(args.sizes) or [int(float(s) * 2**20) for s in args.sizes.split(",")]
    cpu = args.device == "cpu"
    args.repeats = args.repeats or (2 if cpu else 20)
    args.calls = args.calls or (1 if cpu else 10)
    if cpu:
        # Triton has no CPU backend: its interpreter runs the kernels. Must be set before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.no_compile = True  # Inductor's C++ compile of ten kernels takes minutes on a small CPU
    return args


ARGS = parse_args() if __name__ == "__main__" else None

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, print_table, write_json  # noqa: E402

from pt3func.kernels import reference, triton_available  # noqa: E402

# name: (bits, error feedback, stochastic) for quantise, (bits, None, None) for dequantise.
KERNELS: dict[str, tuple[int, bool | None, bool | None]] = {
    "int8 quantise": (8, False, False),
    "int8 quantise + EF": (8, True, False),
    "int8 stochastic": (8, False, True),
    "int8 stochastic + EF": (8, True, True),
    "int4 quantise": (4, False, False),
    "int4 quantise + EF": (4, True, False),
    "int4 stochastic": (4, False, True),
    "int4 stochastic + EF": (4, True, True),
    "int8 dequantise": (8, None, None),
    "int4 dequantise": (4, None, None),
}


def size_label(size: int) -> str:
    if size >= 2**30:
        return f"{size / 2**30:g} GiB"
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size >> 10} KiB"


def target(name: str) -> float:
    return 0.75 if "stochastic" in name else 0.9


def bytes_moved(name: str, n: int, block: int) -> int:
    """Bytes read + written by one call on `n` fp32 elements (padding ignored: sizes here are multiples of block)."""
    bits, ef, _ = KERNELS[name]
    q_bytes = n if bits == 8 else n // 2
    scale_bytes = 4 * (n // block)
    if ef is None:  # dequantise: read q and scales, write fp32
        return q_bytes + scale_bytes + 4 * n
    return 4 * n + q_bytes + scale_bytes + (8 * n if ef else 0)  # x (+ residual in, residual out), q, scales


class Timer:
    """Seconds per call of `fn`: GPU time from CUDA events, or wall time on CPU."""

    def __init__(self, device: str, repeats: int, calls: int, warmup: int = 3):
        self.cuda = device == "cuda"
        self.repeats, self.calls, self.warmup = repeats, calls, warmup

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work, so the calls below queue up behind it
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.calls):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / self.calls)
            else:
                t0 = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                times.append((time.perf_counter() - t0) / self.calls)
        return statistics.median(times)


def config_label(cfg: tuple[int, int, bool]) -> str:
    return f"{cfg[0]}x{cfg[1]} {'pairs' if cfg[2] else 'elements'}"


def make_calls(name: str, x: torch.Tensor, r: torch.Tensor, seed: torch.Tensor, block: int,
               tq: Any) -> tuple[Callable[..., Any], Callable[[], Any], Callable[[], Any]]:
    """(triton(elems_per_program, warps, pairs), eager reference, function for torch.compile) for kernel `name`
    on these inputs; triton() with no arguments is what the custom op runs."""
    bits, ef, sr = KERNELS[name]
    n = x.numel()
    if ef is None:
        q, s, _ = reference.quantize_blockwise(x, bits, block)

        def run_triton(epp=None, warps=None, pairs=None):
            return tq.dequantize_blockwise(q, s, bits, block, n, elems_per_program=epp, num_warps=warps,
                                           pairs=pairs)

        def run_ref():
            return reference.dequantize_blockwise(q, s, bits, block, n)

        return run_triton, run_ref, run_ref
    res = r if ef else None
    sd = seed if sr else None

    def run_triton(epp=None, warps=None, pairs=None):
        return tq.quantize_blockwise(x, bits, block, res, sr, sd, elems_per_program=epp, num_warps=warps,
                                     pairs=pairs)

    def run_ref():
        return reference.quantize_blockwise(x, bits, block, res, sr, sd)

    return run_triton, run_ref, run_ref


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(same(u, v) for u, v in zip(a, b))
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def check_cpu_reference(name: str, device: str, block: int, tq: Any) -> bool:
    """Triton on `device` (the default kernel, and each path forced) against the CPU reference, on buffers with
    padding and an all-zero block: an odd length (which the pair kernels cannot take) and an even one."""
    ok = True
    for n in (3 * 2**20 + 77, 3 * 2**20 + 78):
        g = torch.Generator().manual_seed(n)
        x, r, seed = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01, torch.tensor(2**33 + 5)
        x[:block] = 0
        run_triton, run_ref, _ = make_calls(name, x.to(device), r.to(device), seed.to(device), block, tq)
        _, run_ref_cpu, _ = make_calls(name, x, r, seed, block, tq)
        try:
            want = run_ref_cpu()
            results = {"eager reference": same(run_ref(), want), "triton default": same(run_triton(), want),
                       "triton elements": same(run_triton(pairs=False), want)}
            if n % 2 == 0:
                results["triton pairs"] = same(run_triton(pairs=True), want)
        except Exception as e:
            print(f"{name}: check against the CPU reference (n={n}) failed: {_error(e)}", flush=True)
            return False
        if not all(results.values()):
            print(f"{name}: differs from the CPU reference (n={n}): "
                  + ", ".join(f"{k} {'ok' if v else 'DIFFERS'}" for k, v in results.items()), flush=True)
            ok = False
    return ok


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def measure(name: str, x: torch.Tensor, r: torch.Tensor, seed: torch.Tensor, block: int, tq: Any, timer: Timer,
            sweep: list[tuple[int, int, bool]], compile_baseline: bool, exact_cpu: bool) -> dict[str, Any]:
    """GB/s of kernel `name` for each launch config (elements per program, warps, pair kernel) and for
    torch.compile of the reference. A failure (a config that does not compile, say) is recorded, not raised, so
    that one GPU run reports everything."""
    nbytes = bytes_moved(name, x.numel(), block)
    bits, ef, sr = KERNELS[name]
    default = tuple(tq.default_config(bits, residual=bool(ef), stochastic=bool(sr), dequantise=ef is None))
    sweep = [default] + [c for c in sweep if c != default]
    rec: dict[str, Any] = {"kernel": name, "bytes_moved": nbytes, "default_config": list(default),
                           "triton_default_gbps": float("nan"), "triton_best_gbps": float("nan"),
                           "best_config": None, "sweep_gbps": {}, "compile_gbps": float("nan"),
                           "target": target(name), "bit_exact": False}
    run_triton, run_ref, to_compile = make_calls(name, x, r, seed, block, tq)
    try:
        want = run_ref()
        rec["bit_exact"] = all(same(run_triton(pairs=p), want) for p in (None, True, False)) and exact_cpu
    except Exception as e:
        rec["error"] = _error(e)
        return rec
    by_config = {}
    for cfg in sweep:
        try:
            by_config[cfg] = nbytes / timer(lambda c=cfg: run_triton(*c)) / 1e9
        except Exception as e:
            rec.setdefault("config_errors", {})[config_label(cfg)] = _error(e)
    rec["sweep_gbps"] = {config_label(c): v for c, v in by_config.items()}
    rec["triton_default_gbps"] = by_config.get(sweep[0], float("nan"))
    if by_config:
        best = max(by_config, key=by_config.get)
        rec["best_config"], rec["triton_best_gbps"] = list(best), by_config[best]
    for path, pairs in (("pairs", True), ("elements", False)):
        on_path = [c for c in by_config if c[2] == pairs]
        if on_path:
            best = max(on_path, key=by_config.get)
            rec[f"best_{path}_config"], rec[f"best_{path}_gbps"] = list(best), by_config[best]
    if compile_baseline:
        try:
            rec["compile_gbps"] = nbytes / timer(torch.compile(to_compile, dynamic=False)) / 1e9
        except Exception as e:
            rec["compile_error"] = _error(e)
        torch._dynamo.reset()
    return rec


def config_key(name: str) -> str:
    """The `triton_quant._CONFIGS` entry kernel `name` launches with (the error-feedback kernels share one)."""
    bits, ef, sr = KERNELS[name]
    if ef is None:
        return f"int{bits} dequantise"
    return f"int{bits} quantise+ef" if ef else f"int{bits} {'stochastic' if sr else 'quantise'}"


def suggest_configs(records: list[dict[str, Any]]) -> dict[str, tuple[tuple[int, int, bool], float]]:
    """Per `_CONFIGS` entry, the swept config with the highest worst ratio to copy over sizes (and kernels sharing
    the entry), and that ratio."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_key.setdefault(config_key(rec["kernel"]), []).append(rec)
    out = {}
    for key, recs in by_key.items():
        labels = set.intersection(*(set(rec["sweep_gbps"]) for rec in recs))
        worst = {label: min(rec["sweep_gbps"][label] / rec["copy_gbps"] for rec in recs) for label in labels}
        if worst:
            label = max(worst, key=worst.get)
            dims, path = label.split()
            epp, warps = (int(v) for v in dims.split("x"))
            out[key] = ((epp, warps, path == "pairs"), worst[label])
    return out


def _at(rec: dict[str, Any], path: str) -> str:
    """'ratio to copy @ config' of the best config of one path."""
    cfg = rec.get(f"best_{path}_config")
    return f"{rec[f'best_{path}_gbps'] / rec['copy_gbps']:.3f} @ {cfg[0]}x{cfg[1]}" if cfg else ""


def main(args: argparse.Namespace) -> None:
    device, block = args.device, args.block
    started = time.perf_counter()
    if not triton_available():
        raise SystemExit("triton is not importable: nothing to benchmark")
    from pt3func.kernels import triton_quant as tq

    kernels = [k for k in KERNELS if not args.kernels or any(s.strip() in k for s in args.kernels.split(","))]
    timer = Timer(device, args.repeats, args.calls, warmup=1 if device == "cpu" else 3)
    # On CPU one config per path besides the defaults, to exercise the sweep: interpreter timings mean nothing.
    sweep = [] if args.no_sweep else [
        (epp, warps, pairs) for pairs in PATHS[args.paths]
        for epp, warps in (SWEEP_PAIRS if pairs else SWEEP)[: None if device == "cuda" else 1]]
    exact_cpu = {name: check_cpu_reference(name, device, block, tq) for name in kernels} if device == "cuda" else {}
    rows, records, copy_gbps = [], [], {}
    for size in args.size_bytes:
        n = size // 4
        g = torch.Generator(device=device).manual_seed(size)
        x = torch.randn(n, device=device, generator=g)
        r = torch.randn(n, device=device, generator=g) * 0.01
        seed = torch.tensor(1234, device=device)
        dst = torch.empty_like(x)
        copy_s = timer(lambda x=x, dst=dst: dst.copy_(x))
        copy_gbps[size] = 2 * size / copy_s / 1e9
        rows.append([size_label(size), "copy (dst.copy_(src))", "", copy_gbps[size], 1.0, "", "", float("nan"),
                     "", "", ""])
        for name in kernels:
            rec = measure(name, x, r, seed, block, tq, timer, sweep, not args.no_compile, exact_cpu.get(name, True))
            rec.update(size_bytes=size, copy_gbps=copy_gbps[size])
            rec["ratio_to_copy"] = rec["triton_default_gbps"] / copy_gbps[size]
            rec["best_ratio_to_copy"] = rec["triton_best_gbps"] / copy_gbps[size]
            records.append(rec)
            ratio = rec["ratio_to_copy"]
            rows.append([size_label(size), name, config_label(tuple(rec["default_config"])),
                         rec["triton_default_gbps"], ratio, _at(rec, "pairs") or rec.get("error", "")[:40],
                         _at(rec, "elements"), rec["compile_gbps"], f">= {target(name)}",
                         "yes" if ratio >= target(name) else "NO", "yes" if rec["bit_exact"] else "NO"])
            print(f"{size_label(size)} {name}: default {config_label(tuple(rec['default_config']))} "
                  f"{rec['triton_default_gbps']:.4g} GB/s = {ratio:.3f} x copy; best pairs {_at(rec, 'pairs')}, "
                  f"best elements {_at(rec, 'elements')}; torch.compile {rec['compile_gbps']:.4g} GB/s; "
                  f"bit-exact {rec['bit_exact']}" + (f", {rec['error']}" if "error" in rec else ""), flush=True)
        del x, r, dst
    print_table(
        f"Blockwise quantisation kernels, {device}, block {block}, fp32 input (GB/s = bytes read + written / time; "
        "x copy = GB/s / copy GB/s; best of each path: x copy @ elems/program x warps)",
        ["size", "kernel", "default config", "triton GB/s", "x copy", "best pairs", "best elements",
         "torch.compile GB/s", "target", "met", "bit-exact"], rows)
    suggested = suggest_configs(records) if sweep else {}
    if suggested:
        print("_CONFIGS for triton_quant.py: per entry the config whose worst ratio to copy over the sizes (and the "
              "kernels sharing the entry) is highest:")
        for key, (cfg, worst) in suggested.items():
            print(f'    "{key}": {cfg},  # worst {worst:.3f} x copy')
    out = Path(args.out or RESULTS / f"quant_kernels_{device}.json")
    write_json(out, {
        "environment": environment(), "triton": __import__("triton").__version__,
        "interpreted": os.environ.get("TRITON_INTERPRET") == "1", "block": block,
        "repeats": args.repeats, "calls_per_repeat": args.calls, "copy_gbps": copy_gbps, "results": records,
        "suggested_configs": {k: {"config": list(cfg), "worst_ratio_to_copy": w} for k, (cfg, w) in suggested.items()},
    })
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main(ARGS)

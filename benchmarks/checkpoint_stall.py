"""How long a checkpoint save stops training: `CheckpointManager.save` with async_save=True against False (CPU).

    python benchmarks/checkpoint_stall.py                 # 256 MiB of params + Adam moments, 5 saves each
    python benchmarks/checkpoint_stall.py --mib 64 --saves 3

The stall is the wall time of the `save(...)` call: what the training loop waits for. Async, that is the
copy of the tensors into memory DCP writes from; sync, the whole write, checksums and commit. `total` adds
`wait()`, i.e. when the checkpoint is committed. Writes JSON to benchmarks/results/checkpoint_stall_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, write_json  # noqa: E402

import pt3func as pf  # noqa: E402
from pt3func.checkpointing import CheckpointManager  # noqa: E402


def make_tree(mib: int) -> dict:
    """Params of `mib` MiB in total (fp32, 16 matrices), with AdamW state (2 more copies)."""
    n = mib * 2**20 // 4 // 16 // 3
    params = {f"layer{i}": torch.randn(n // 1024, 1024) for i in range(16)}
    return {"params": params, "opt_state": pf.optim.adamw(1e-3).init(params), "step": 0}


def measure(tree: dict, async_save: bool, saves: int, directory: Path) -> dict[str, float]:
    manager = CheckpointManager(directory, max_to_keep=2, async_save=async_save)
    stalls, totals = [], []
    for step in range(saves):
        start = time.perf_counter()
        manager.save(step, tree)
        stalls.append(time.perf_counter() - start)
        manager.wait()
        totals.append(time.perf_counter() - start)
    return {"stall_ms_median": 1e3 * statistics.median(stalls), "stall_ms_min": 1e3 * min(stalls),
            "total_ms_median": 1e3 * statistics.median(totals), "saves": saves}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of params + optimizer state, MiB")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "checkpoint_stall_cpu.json"))
    args = parser.parse_args()
    tree = make_tree(args.mib)
    nbytes = sum(x.numel() * x.element_size() for x in pf.tree.leaves(tree) if isinstance(x, torch.Tensor))
    rows = {}
    with tempfile.TemporaryDirectory(prefix="pt3func-ckpt-bench-") as tmp:
        for name, async_save in (("sync", False), ("async", True)):
            rows[name] = measure(tree, async_save, args.saves, Path(tmp) / name)
            print(f"{name:>5}: stall {rows[name]['stall_ms_median']:8.1f} ms   until committed "
                  f"{rows[name]['total_ms_median']:8.1f} ms   ({nbytes / 2**20:.0f} MiB, median of {args.saves})")
    result = {"benchmark": "checkpoint_stall", "bytes": nbytes, "directory": "tempfile (local disk)",
              "results": rows, "stall_ratio_async_over_sync": rows["async"]["stall_ms_median"]
              / rows["sync"]["stall_ms_median"], "env": environment()}
    write_json(Path(args.out), result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Host cost of one cached pf.jit call with many leaves, plain tensors against DTensors (CPU).

    python benchmarks/sharded_call_overhead.py        # writes benchmarks/results/sharded_call_overhead_cpu.json
    torchrun --nproc-per-node 2 benchmarks/sharded_call_overhead.py --out .../sharded_call_overhead_cpu_2ranks.json

A data parallel step's params and optimizer state are DTensors: every call unwraps hundreds of them and wraps as
many outputs again, host work that a step does on top of the plain-tensor case (benchmarks/call_overhead.py).
The step here is `--leaves` small weights (4 x 4) with AdamW, so the arithmetic is negligible and what is timed
is the call around it: once with plain tensors, once with replicated DTensors on a one-rank gloo mesh (no
launcher needed; the program's all-reduces of one rank are part of the time). Variants take turns
(`common.time_interleaved`); median and min over `--repeats` batches of `--calls` calls.

Under torchrun (2 or more gloo ranks) two more variants carry an int8 error-feedback `ExchangeState`: the step
with its own fp32 all-reduce, and the same step with `grad_exchange=int8` whose exchange guard switches it off
(its timer reports compression slower) for that same fp32 program: after the guard's trial calls, a call should
cost what the plain program's does. Rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from common import RESULTS, environment, print_table, time_interleaved, write_json

import pt3func as pf
from pt3func import P


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leaves", type=int, default=150, help="parameter leaves (AdamW adds two state leaves each)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS / "sharded_call_overhead_cpu.json"))
    return p.parse_args()


class Loop:
    """Calls the step on what it returned last; records how long each call took to reach its program (the host
    work a GPU would wait for: everything before the first launch)."""

    def __init__(self, step: Any, params: Any, opt_state: Any, x: torch.Tensor) -> None:
        self.step, self.params, self.opt_state, self.x = step, params, opt_state, x
        self.until_launch_us: list[float] = []
        self._start = 0

    def watch(self) -> None:
        """After the compiling calls: time the entry into the program that runs from now on."""
        compiled = next(iter(self.step._cache.values()))
        if compiled._switch is not None:  # an exchange guard's decided program
            compiled = compiled._switch.program
        run = compiled._runner

        def runner(*inputs: Any) -> Any:
            self.until_launch_us.append((time.perf_counter_ns() - self._start) / 1e3)
            return run(*inputs)

        compiled._runner = runner

    def __call__(self) -> None:
        self._start = time.perf_counter_ns()
        self.params, self.opt_state, _ = self.step(self.params, self.opt_state, self.x)


def main() -> None:
    a = parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(4, 4, generator=g) for i in range(a.leaves)}
    opt = pf.optim.adamw(1e-3)

    def step(p: Any, s: Any, x: torch.Tensor) -> Any:
        loss, grads = pf.value_and_grad(lambda p, x: sum((w * x).sum() for w in p.values()))(p, x)
        updates, s = opt.update(grads, s, p)
        return pf.optim.apply_updates(p, updates), s, loss

    x = torch.randn(4, 4, generator=g)
    plain = pf.tree.map(torch.clone, params)
    loops = {"plain tensors": Loop(pf.jit(step, donate_argnums=(0, 1)), plain, opt.init(plain), x)}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = pf.make_mesh((world,), ("dp",))
    with pf.set_mesh(mesh):
        sharded = pf.device_put(pf.tree.map(torch.clone, params), P())
        state = pf.jit(opt.init, backend="eager")(sharded)
        jitted = pf.jit(step, in_shardings=(None, None, P("dp")), donate_argnums=(0, 1))
        loops[f"DTensors ({world}-rank mesh)"] = Loop(jitted, sharded, state, x)
        # The same step with an int8 exchange that its guard switches off (the timer says it is slower) for the
        # program's own fp32 all-reduce: after the trial calls its calls should cost what the plain one's do.
        int8 = pf.compress.int8()
        guard = pf.compress.Guard(reference=pf.compress.none(), timer=lambda p, run: (run(), 2.0 - (p != "compressed")))

        def with_exchange(p: Any, s: Any, x: torch.Tensor) -> Any:
            inner, ex = s
            p, inner, loss = step(p, inner, x)
            return p, (inner, ex), loss

        # (A one-rank mesh has no gradient reduction to compress: its guard is not built.)
        for name, fmt in [("DTensors + int8 state, fp32 exchange", None),
                          ("DTensors + int8 state, int8 switched off", int8)][: 2 if world > 1 else 0]:
            jitted = pf.jit(with_exchange, in_shardings=(None, None, P("dp")), donate_argnums=(0, 1),
                            grad_exchange=fmt, exchange_guard=guard)
            sharded = pf.device_put(pf.tree.map(torch.clone, params), P())
            state = (pf.jit(opt.init, backend="eager")(sharded), int8.init(sharded, data_axes=("dp",)))
            loops[name] = Loop(jitted, sharded, state, x)
        for name, loop in loops.items():
            for _ in range(2 * (guard.warmup_steps + guard.trial_steps) if "switched" in name else 1):
                loop()  # compile (and the guard's trial calls)
            loop.watch()
        timings = time_interleaved(loops, a.calls, a.repeats, a.warmup)
    for name, loop in loops.items():
        timings[name]["until_launch_median_us"] = statistics.median(loop.until_launch_us)
    if dist.get_rank() != 0:
        return
    rows = [[name, t["median_us"] / 1e3, t["min_us"] / 1e3, round(t["until_launch_median_us"])]
            for name, t in timings.items()]
    print_table(f"Cached pf.jit call, {a.leaves} param leaves + AdamW state (torch {torch.__version__}, 1 thread)",
                ["variant", "median ms", "min ms", "until launch us"], rows)
    write_json(a.out, {"environment": environment(), "leaves": a.leaves, "world": world, "timings": timings})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Cost of one cached call of a tiny training step: pf.jit against eager PyTorch and torch.compile.

The step (a 2-layer MLP, forward, backward and an optimizer update) is so small that its arithmetic takes a
few microseconds; what is measured is everything around it: flattening the pytrees, finding the compiled
program, launching it and rebuilding the outputs. Every variant runs the same math from the same init:

- `torch eager, functional`: the pure `train_step` below, called directly (pf.value_and_grad + pf.optim).
- `torch eager, nn.Module + torch.optim`: the usual PyTorch loop (zero_grad, forward, backward, step).
- `torch.compile, functional`: `torch.compile(train_step, fullgraph=True)`; its `torch.autograd.grad` is
  traced into the graph with `torch._dynamo.config.trace_autograd_ops = True`.
- `torch.compile(model) + torch.optim`: the anchor benchmark's way (compiled module, eager optimizer).
- `pf.jit` with the Inductor and eager backends, with and without donating params and optimizer state.

    python benchmarks/call_overhead.py                 # writes benchmarks/results/call_overhead_cpu.json
    python benchmarks/call_overhead.py --optimizer sgd --profile

Also reported: pf.jit's trace (`lower`) and compile time, and torch.compile's first call, with Inductor's
on-disk caches off so that both are cold compiles.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import RESULTS, environment, print_table, time_interleaved, write_json

import pt3func as pf

Params = dict[str, Any]
CHECK_STEPS = 5  # steps from the same init after which every variant's loss is recorded (same math check)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", type=int, default=32, help="input features")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    p.add_argument("--repeats", type=int, default=7, help="timed batches per variant (median reported)")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls per variant first")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default: the tensors are tiny, and with more threads OpenMP's wake-ups "
        "dominate and swing by 10x when other processes share the cores",
    )
    p.add_argument("--profile", action="store_true", help="cProfile pf.jit's cached call and print the top")
    p.add_argument("--out", default=str(RESULTS / "call_overhead_cpu.json"))
    return p.parse_args()


def init_params(a: argparse.Namespace) -> Params:
    """nn.Linear's layout (out_features, in_features), so the module variant can load the same values."""
    g = torch.Generator().manual_seed(0)
    return {
        "fc1": {"weight": torch.randn(a.hidden, a.features, generator=g) * 0.1, "bias": torch.zeros(a.hidden)},
        "fc2": {"weight": torch.randn(a.classes, a.hidden, generator=g) * 0.1, "bias": torch.zeros(a.classes)},
    }


def loss_fn(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = F.relu(F.linear(x, params["fc1"]["weight"], params["fc1"]["bias"]))
    return F.cross_entropy(F.linear(h, params["fc2"]["weight"], params["fc2"]["bias"]), y)


def make_train_step(opt: pf.optim.GradientTransformation) -> Callable[..., Any]:
    def train_step(params: Params, opt_state: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = batch
        loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss

    return train_step


def make_autograd_train_step(opt: pf.optim.GradientTransformation) -> Callable[..., Any]:
    """`make_train_step`'s math with `torch.autograd.grad` called directly instead of through pf.value_and_grad.

    The fallback for torch.compile when Dynamo cannot trace pf.value_and_grad's own Python (see `main`).
    """

    def train_step(params: Params, opt_state: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = batch
        leaves, treedef = pf.tree.flatten(params)
        with torch.enable_grad():
            leaves = [leaf.detach().requires_grad_() for leaf in leaves]
            loss = loss_fn(pf.tree.unflatten(treedef, leaves), x, y)
            grads = pf.tree.unflatten(treedef, list(torch.autograd.grad(loss, leaves)))
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss.detach()

    return train_step


def clone(tree: Any) -> Any:
    return pf.tree.map(lambda t: t.clone(), tree)


class FunctionalLoop:
    """Holds the state of a functional step between calls: `params, opt_state, loss = step(...)`."""

    def __init__(self, step: Callable[..., Any], params: Params, opt_state: Any, batch: Any):
        self.step, self.params, self.opt_state, self.batch = step, params, opt_state, batch
        self.loss = None

    def __call__(self) -> None:
        self.params, self.opt_state, self.loss = self.step(self.params, self.opt_state, self.batch)


class ModuleLoop:
    """The usual PyTorch step: zero_grad, forward, backward, optimizer step."""

    def __init__(self, a: argparse.Namespace, params: Params, batch: Any, compile_model: bool):
        self.model = nn.Sequential(nn.Linear(a.features, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes))
        with torch.no_grad():
            for layer, name in ((self.model[0], "fc1"), (self.model[2], "fc2")):
                layer.weight.copy_(params[name]["weight"])
                layer.bias.copy_(params[name]["bias"])
        if a.optimizer == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.forward = torch.compile(self.model) if compile_model else self.model
        self.batch = batch
        self.loss = None

    def __call__(self) -> None:
        x, y = self.batch
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.forward(x), y)
        loss.backward()
        self.opt.step()
        self.loss = loss.detach()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def profile_call(loop: Callable[[], None], n: int) -> str:
    """The top of a cProfile of `n` cached calls, sorted by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        loop()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    # Thousands of AdamW steps on one fixed batch drive the gradients towards zero; denormal floats would
    # then make every variant's arithmetic (not its call overhead) 10x slower as the run goes on.
    torch.set_flush_denormal(True)
    # Cold compiles for both pf.jit and torch.compile: a fresh Inductor cache directory, so kernels built by an
    # earlier run are not reused (kernels shared by variants of this run still are, as they would be for a user).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pt3func-bench-inductor-")
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    # Lets Dynamo trace the torch.autograd.grad inside pf.value_and_grad into one graph (fullgraph=True).
    torch._dynamo.config.trace_autograd_ops = True

    opt = pf.optim.adamw(1e-3) if a.optimizer == "adamw" else pf.optim.sgd(1e-2)
    train_step = make_train_step(opt)
    params = init_params(a)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(a.batch, a.features, generator=g), torch.randint(0, a.classes, (a.batch,), generator=g))

    def functional(step: Callable[..., Any]) -> FunctionalLoop:
        p = clone(params)
        return FunctionalLoop(step, p, opt.init(p), batch)

    loops: dict[str, Callable[[], None]] = {}
    compile_info: dict[str, dict[str, float]] = {}
    losses: dict[str, float] = {}

    def add(name: str, loop: Callable[[], None]) -> None:
        """Time the first call (where torch.compile and pf.jit compile), then check the math on a few more."""
        _, first = timed(loop)
        compile_info.setdefault(name, {})["first_call_s"] = first
        for _ in range(CHECK_STEPS - 1):
            loop()
        losses[name] = float(loop.loss)
        loops[name] = loop

    add("torch eager, functional", functional(train_step))
    add("torch eager, nn.Module + torch.optim", ModuleLoop(a, params, batch, compile_model=False))
    compile_name = "torch.compile, functional"
    try:
        add(compile_name, functional(torch.compile(train_step, fullgraph=True)))
    except torch._dynamo.exc.Unsupported as exc:
        # Same math, with the autograd call written out, so the comparison still has a fullgraph baseline.
        lines = [line.strip() for line in str(exc).splitlines()]
        reason = next((line for line in lines if line.startswith("Explanation:")), lines[0])
        print(
            f"torch.compile(fullgraph=True) cannot trace pf.value_and_grad ({reason}); "
            "compiling the same step with torch.autograd.grad called directly"
        )
        torch._dynamo.reset()
        compile_name = "torch.compile, functional (torch.autograd.grad)"
        compile_info[compile_name] = {"note": f"pf.value_and_grad not traceable by Dynamo: {reason}"}
        add(compile_name, functional(torch.compile(make_autograd_train_step(opt), fullgraph=True)))
    add("torch.compile(model) + torch.optim", ModuleLoop(a, params, batch, compile_model=True))
    for backend in ("inductor", "eager"):
        for donate in (True, False):
            name = f"pf.jit {backend}, " + ("donated" if donate else "not donated")
            step = pf.jit(train_step, donate_argnums=(0, 1) if donate else (), backend=backend)
            loop = functional(step)
            lowered, trace_s = timed(lambda s=step, lp=loop: s.lower(lp.params, lp.opt_state, lp.batch))
            _, compile_s = timed(lowered.compile)
            # The first call traces and compiles again (lower() does not fill the cache): that is the cost a
            # user sees, and it should roughly equal trace_s + compile_s.
            compile_info[name] = {"trace_s": trace_s, "compile_s": compile_s}
            add(name, loop)

    timings = time_interleaved(loops, a.calls, a.repeats, a.warmup)

    base = timings[compile_name]["median_us"]
    rows = []
    for name, t in timings.items():
        info = compile_info.get(name, {})
        rows.append(
            [
                name,
                t["median_us"],
                t["min_us"],
                t["median_us"] / base,
                info.get("trace_s", float("nan")),
                info.get("compile_s", float("nan")),
                info.get("first_call_s", float("nan")),
                f"{losses[name]:.6f}",
            ]
        )
    title = (
        f"Cached call of a {a.features}-{a.hidden}-{a.classes} MLP step, batch {a.batch}, {a.optimizer} "
        f"({a.repeats} x {a.calls} calls, torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    columns = ["variant", "median µs", "min µs", "x torch.compile", "trace s", "compile s", "1st call s", "loss@5"]
    print_table(title, columns, rows)

    payload = {
        "benchmark": "call_overhead",
        "config": vars(a),
        "env": environment(),
        "results": {
            name: {**timings[name], **compile_info.get(name, {}), "loss_after_5_steps": losses[name]} for name in loops
        },
    }
    print(f"wrote {write_json(a.out, payload)}")

    if a.profile:
        print(profile_call(loops["pf.jit inductor, donated"], a.calls))


if __name__ == "__main__":
    main()

"""Compressed gradient exchange on real gloo worlds: functions run on every rank (see test_compress.py)."""

from __future__ import annotations

import math

import torch

import pt3func as pf
from pt3func.sharding import P

C = pf.compress

# Layouts: mesh shape, axes, param specs, batch spec, data axes.
LAYOUTS = {
    "dp": ((4,), ("dp",), {"w1": P(), "b1": P(), "w2": P()}, P("dp"), None),
    "fsdp": ((4,), ("dp",), {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}, P("dp"), None),
    "fsdp_tp": ((2, 2), ("dp", "tp"), {"w1": P("dp", "tp"), "b1": P("tp"), "w2": P("tp", "dp")}, P("dp"), "dp"),
    "dp2": ((2,), ("dp",), {"w1": P(), "b1": P(), "w2": P()}, P("dp"), None),
    "fsdp2": ((2,), ("dp",), {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}, P("dp"), None),
}
NAMES = ("w1", "b1", "w2")


def init_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(32, 64, generator=g) * 0.2, "b1": torch.zeros(64),
            "w2": torch.randn(64, 16, generator=g) * 0.2}


def batch(t: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 16, generator=teacher) * 0.3
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 16, generator=g)


def loss_fn(params, x, y):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def grad_step(params, ex, x, y):
    return pf.grad(loss_fn)(params, x, y), ex


def _setup(layout: str):
    shape, axes, specs, batch_spec, data_axes = LAYOUTS[layout]
    mesh = pf.make_mesh(shape, axes)
    return mesh, specs, batch_spec, data_axes


def _full(tree):
    return pf.tree.map(lambda t: t.detach().clone(), pf.device_get(tree))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def one_step_errors(rank: int, world: int, layout: str, formats: dict[str, str]) -> dict:
    """Relative L2 error of each format's reduced gradient against the exact one (first step, zero state),
    plus the program text and comm bytes of each."""
    mesh, specs, batch_spec, data_axes = _setup(layout)
    out = {}
    with pf.set_mesh(mesh):
        params = pf.device_put(init_params(), specs)
        shardings = (specs, None, batch_spec, batch_spec)
        exact_step = pf.jit(grad_step, in_shardings=shardings, backend="eager")
        x, y = batch(0)
        exact = _full(exact_step(params, None, x, y)[0])
        for name, text in formats.items():
            fmt = eval(text, vars(C))  # noqa: S307 - test constants
            ex = fmt.init(params, data_axes=data_axes)
            step = pf.jit(grad_step, in_shardings=shardings, grad_exchange=fmt, backend="eager")
            lowered = step.lower(params, ex, x, y)
            grads, ex2 = step(params, ex, x, y)
            got = _full(grads)
            gm = lowered.graph_module
            out[name] = {
                "rel": {k: _rel(got[k], exact[k]) for k in NAMES},
                "text": lowered.as_text(),
                "comm_bytes": lowered.cost_analysis()["comm_bytes"],
                # (the 0-d all-reduce of FSDP's "every reduced gradient finite" flag carries no gradient)
                "reduced_dtypes": sorted({str(n.args[0].meta["val"].dtype) for n in gm.graph.nodes
                                          if getattr(n.target, "__name__", "").startswith(("all_reduce",
                                                                                          "reduce_scatter"))
                                          and n.args[0].meta["val"].ndim > 0}),
                "step": int(pf.device_get(ex2.step)),
                "world": world,
            }
    return out


def error_feedback_sums(rank: int, world: int, layout: str, formats: dict[str, str], steps: int) -> dict:
    """Run `steps` steps at fixed params; return the summed reduced gradients, the summed exact ones and the
    final residuals (summed over ranks), per format."""
    mesh, specs, batch_spec, data_axes = _setup(layout)
    out = {}
    with pf.set_mesh(mesh):
        params = pf.device_put(init_params(), specs)
        shardings = (specs, None, batch_spec, batch_spec)
        exact_step = pf.jit(grad_step, in_shardings=shardings, backend="eager")
        exact_sum = {k: 0.0 for k in NAMES}
        for t in range(steps):
            g = _full(exact_step(params, None, *batch(t))[0])
            exact_sum = {k: exact_sum[k] + g[k] for k in NAMES}
        for name, text in formats.items():
            fmt = eval(text, vars(C))  # noqa: S307 - test constants
            ex = fmt.init(params, data_axes=data_axes)
            step = pf.jit(grad_step, in_shardings=shardings, grad_exchange=fmt, backend="eager")
            got_sum = {k: 0.0 for k in NAMES}
            for t in range(steps):
                grads, ex = step(params, ex, *batch(t))
                g = _full(grads)
                got_sum = {k: got_sum[k] + g[k] for k in NAMES}
            leaves = _full(ex.leaves)
            held = {}
            for k in NAMES:
                ls = leaves[k]
                total = torch.zeros_like(exact_sum[k])
                if ls.residual is not None:  # (ranks, *grad shape): what each rank still owes
                    total = total + ls.residual.sum(0).view_as(total)
                if ls.server_residual is not None:  # (ranks, chunk): the owner's re-encoding error
                    m = math.ceil(total.numel() / ls.server_residual.shape[0])
                    total = total + ls.server_residual[:, :m].reshape(-1)[:total.numel()].view_as(total)
                held[k] = total
            out[name] = {"got": got_sum, "held": held, "step": int(pf.device_get(ex.step))}
    out["exact"] = exact_sum
    return out


def train(rank: int, world: int, layout: str, formats: dict[str, str], steps: int, optimizer: str = "adam") -> dict:
    """Train the MLP for `steps` steps per format; return the loss curve of each."""
    mesh, specs, batch_spec, data_axes = _setup(layout)
    opt = pf.optim.adam(3e-2) if optimizer == "adam" else pf.optim.sgd(0.3, momentum=0.9)
    out = {}
    with pf.set_mesh(mesh):
        for name, text in formats.items():
            fmt = None if text is None else eval(text, vars(C))  # noqa: S307 - test constants
            params = pf.device_put(init_params(), specs)
            full_opt = opt if fmt is None else C.with_state(opt, fmt, data_axes)
            state = full_opt.init(params)

            def step(params, state, x, y, full_opt=full_opt):
                loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
                updates, state = full_opt.update(grads, state, params)
                return pf.optim.apply_updates(params, updates), state, loss

            jstep = pf.jit(step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                           donate_argnums=(0, 1), backend="eager")
            losses = []
            for t in range(steps):
                params, state, loss = jstep(params, state, *batch(t % 8))
                losses.append(float(pf.device_get(loss)))
            out[name] = losses
    return out


def resume(rank: int, world: int, layout: str, text: str, directory: str, k: int, m: int) -> dict:
    """Train k steps, checkpoint (params, opt state with ExchangeState), train m more; then restore the
    checkpoint into fresh state and train the same m steps again. Returns both end states."""
    mesh, specs, batch_spec, data_axes = _setup(layout)
    fmt = eval(text, vars(C))  # noqa: S307 - test constants
    opt = C.with_state(pf.optim.adam(3e-2), fmt, data_axes)
    with pf.set_mesh(mesh):
        def step(params, state, x, y):
            loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
            updates, state = opt.update(grads, state, params)
            return pf.optim.apply_updates(params, updates), state, loss

        jstep = pf.jit(step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                       donate_argnums=(0, 1), backend="eager")
        params = pf.device_put(init_params(), specs)
        state = opt.init(params)
        for t in range(k):
            params, state, _ = jstep(params, state, *batch(t))
        manager = pf.checkpointing.CheckpointManager(directory, async_save=False)
        manager.save(k, {"params": params, "opt": state})
        saved_residual = _full(state[1].leaves["w1"].residual)
        for t in range(k, k + m):
            params, state, _ = jstep(params, state, *batch(t))
        uninterrupted = _full({"params": params, "ex": state[1].leaves, "step": state[1].step})

        fresh = pf.device_put(init_params(seed=5), specs)
        target = {"params": fresh, "opt": opt.init(fresh)}
        restored = manager.restore(k, target=target)
        params, state = restored["params"], restored["opt"]
        restored_residual = _full(state[1].leaves["w1"].residual)
        for t in range(k, k + m):
            params, state, _ = jstep(params, state, *batch(t))
        resumed = _full({"params": params, "ex": state[1].leaves, "step": state[1].step})
        placements = tuple(str(p) for p in state[1].leaves["w1"].residual.placements)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "saved_residual": saved_residual,
            "restored_residual": restored_residual, "trace_count": jstep.trace_count(), "placements": placements}


def errors(rank: int, world: int) -> dict:
    """The messages of the errors a user gets for missing, unreturned or mismatched state."""
    out = {}
    mesh, specs, batch_spec, _ = _setup("dp")
    with pf.set_mesh(mesh):
        params = pf.device_put(init_params(), specs)
        shardings = (specs, None, batch_spec, batch_spec)
        x, y = batch(0)
        fmt = C.int8()

        def run(fn, *args, **jit_kwargs):
            try:
                pf.jit(fn, in_shardings=shardings, backend="eager", **jit_kwargs).lower(*args)
            except Exception as exc:  # noqa: BLE001 - the message is what is tested
                return f"{type(exc).__name__}: {exc}"
            return None

        out["missing"] = run(grad_step, params, None, x, y, grad_exchange=fmt)

        def not_returned(params, ex, x, y):
            return pf.grad(loss_fn)(params, x, y)

        out["not_returned"] = run(not_returned, params, fmt.init(params), x, y, grad_exchange=fmt)
        out["other_format"] = run(grad_step, params, C.int4().init(params), x, y, grad_exchange=fmt)
        # A stateless format needs no state at all.
        out["bf16_without_state"] = run(grad_step, params, None, x, y, grad_exchange=C.bf16())
    mesh2 = pf.make_mesh((2, 2), ("dp", "tp"))
    with pf.set_mesh(mesh2):
        params2 = pf.device_put(init_params(), LAYOUTS["fsdp_tp"][2])
        for key, axes in (("no_data_axes", None), ("bad_data_axes", "batch")):
            try:
                fmt.init(params2, data_axes=axes)
                out[key] = None
            except ValueError as exc:
                out[key] = str(exc)
        # A state built with the wrong data axis: its residuals do not fit the gradients the program reduces.
        wrong = fmt.init(params2, data_axes="tp")
        step = pf.jit(grad_step, in_shardings=(LAYOUTS["fsdp_tp"][2], None, P("dp"), P("dp")), grad_exchange=fmt,
                      backend="eager")
        try:
            step.lower(params2, wrong, *batch(0))
            out["wrong_data_axes"] = None
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            out["wrong_data_axes"] = f"{type(exc).__name__}: {exc}"
    return out


def adaptive_topk(rank: int, world: int, total_steps: int) -> dict:
    """Adaptive top-k with every slot open (ratio 1, no EF): the reduced gradient must be the sum over ranks of
    each rank's gradient with entries under tau = alpha(t) * ||g||_2 / sqrt(d) zeroed."""
    mesh, specs, batch_spec, _ = _setup("dp")
    fmt = C.topk(1.0, error_feedback=False, adaptive=True, total_steps=total_steps)
    out = {"max_err": [], "dropped": []}
    with pf.set_mesh(mesh):
        params = pf.device_put(init_params(), specs)
        ex = fmt.init(params)
        step = pf.jit(grad_step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                      backend="eager")
        plain = init_params()
        for t in range(total_steps + 2):
            x, y = batch(t)
            grads, ex = step(params, ex, x, y)
            got = _full(grads)
            rows = slice(rank * (x.shape[0] // world), (rank + 1) * (x.shape[0] // world))
            local = {k: v.clone().requires_grad_() for k, v in plain.items()}
            h = torch.tanh(x[rows] @ local["w1"] + local["b1"])
            loss = ((h @ local["w2"] - y[rows]) ** 2).sum() / y.numel()  # this rank's share of the global mean
            local_grads = torch.autograd.grad(loss, [local[k] for k in NAMES])
            alpha = 0.1 + (0.01 - 0.1) * min(t / total_steps, 1.0)
            err, dropped = 0.0, 0
            for k, g in zip(NAMES, local_grads):
                tau = alpha * g.norm() / math.sqrt(g.numel())
                kept = torch.where(g.abs() >= tau, g, torch.zeros_like(g))
                dropped += int((g.abs() < tau).sum())
                parts = [torch.zeros_like(kept) for _ in range(world)]
                torch.distributed.all_gather(parts, kept)
                err = max(err, float((got[k] - sum(parts)).abs().max()))
            out["max_err"].append(err)
            out["dropped"].append(dropped)
    return out


def _jit_kwargs() -> dict:
    """These cases check what a format sends: no exchange guard (it would time steps and may switch it off)."""
    import inspect

    return {"exchange_guard": None} if "exchange_guard" in inspect.signature(pf.jit).parameters else {}


def _local_grads(params: dict, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's share of the gradient of the global mean loss (what its reduction sums)."""
    rows = slice(rank * (x.shape[0] // world), (rank + 1) * (x.shape[0] // world))
    local = {k: v.clone().requires_grad_() for k, v in params.items()}
    h = torch.tanh(x[rows] @ local["w1"] + local["b1"])
    loss = ((h @ local["w2"] - y[rows]) ** 2).sum() / y.numel()
    return list(torch.autograd.grad(loss, [local[k] for k in NAMES]))


def scheduled(rank: int, world: int, formats: dict[str, str], steps: int) -> dict:
    """Per format and step: the comm bytes of the program that step runs, its max error against the exact
    reduced gradient, and the ExchangeState's phase; the number of programs traced."""
    mesh, specs, batch_spec, data_axes = _setup("dp2")
    out = {}
    with pf.set_mesh(mesh):
        params = pf.device_put(init_params(), specs)
        shardings = (specs, None, batch_spec, batch_spec)
        exact_step = pf.jit(grad_step, in_shardings=shardings, backend="eager")
        for name, text in formats.items():
            fmt = eval(text, vars(C))  # noqa: S307 - test constants
            ex = fmt.init(params, data_axes=data_axes)
            step = pf.jit(grad_step, in_shardings=shardings, grad_exchange=fmt, backend="eager", **_jit_kwargs())
            rec = {"comm_bytes": [], "err": [], "phase": [], "residual": []}
            for t in range(steps):
                x, y = batch(t)
                rec["comm_bytes"].append(dict(step.lower(params, ex, x, y).cost_analysis()["comm_bytes"]))
                exact = _full(exact_step(params, None, x, y)[0])
                grads, ex = step(params, ex, x, y)
                got = _full(grads)
                rec["err"].append(max(float((got[k] - exact[k]).abs().max()) for k in NAMES))
                rec["phase"].append(ex.current_phase())
                rec["residual"].append(float(_full(ex.leaves["w1"].residual).abs().sum()))
            rec["programs"] = len(step._cache)
            rec["step"] = int(pf.device_get(ex.step))
            out[name] = rec
    return out


def momentum_correction(rank: int, world: int, ratio: float, momentum: float, steps: int) -> dict:
    """top-k with DGC's momentum correction against a host simulation of it: each rank accumulates
    u = m u + g into its residual v, sends top-k of v, and clears both at the sent entries."""
    mesh, specs, batch_spec, _ = _setup("dp2")
    fmt = C.topk(ratio, momentum=momentum)
    plain = init_params()
    u = [torch.zeros(plain[k].numel()) for k in NAMES]
    v = [torch.zeros(plain[k].numel()) for k in NAMES]
    errs, sent_norms = [], []
    with pf.set_mesh(mesh):
        params = pf.device_put(plain, specs)
        ex = fmt.init(params)
        step = pf.jit(grad_step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                      backend="eager", **_jit_kwargs())
        for t in range(steps):
            x, y = batch(t)
            grads, ex = step(params, ex, x, y)
            got = _full(grads)
            err = 0.0
            for i, (k, g) in enumerate(zip(NAMES, _local_grads(plain, x, y, rank, world))):
                u[i] = momentum * u[i] + g.reshape(-1)
                v[i] = v[i] + u[i]
                idx = torch.topk(v[i].abs(), max(1, math.ceil(ratio * v[i].numel()))).indices
                sent = torch.zeros_like(v[i])
                sent[idx] = v[i][idx]
                v[i][idx] = 0
                u[i][idx] = 0
                parts = [torch.zeros_like(sent) for _ in range(world)]
                torch.distributed.all_gather(parts, sent)
                err = max(err, float((got[k].reshape(-1) - sum(parts)).abs().max()))
                sent_norms.append(float(sum(parts).norm()))
            errs.append(err)
    return {"errs": errs, "sent_norms": sent_norms}


def nan_batch(rank: int, world: int, layout: str, formats: dict[str, str], steps: int, bad: int) -> dict:
    """Per format: train `steps` steps under apply_if_finite with batch `bad` poisoned (a NaN target on rank 0's
    rows), and the same steps without that batch; returns both end states (params, exchange state) and counters."""
    mesh, specs, batch_spec, data_axes = _setup(layout)
    out = {}
    with pf.set_mesh(mesh):
        for name, text in formats.items():
            fmt = eval(text, vars(C))  # noqa: S307 - test constants
            opt = C.with_state(pf.optim.apply_if_finite(pf.optim.adam(3e-2), 3), fmt, data_axes)

            def step(params, state, x, y, opt=opt):
                loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
                updates, state = opt.update(grads, state, params)
                return pf.optim.apply_updates(params, updates), state, loss

            jstep = pf.jit(step, in_shardings=(specs, None, batch_spec, batch_spec), grad_exchange=fmt,
                           donate_argnums=(0, 1), static_argnames="opt", backend="eager")

            def run(batches: list, opt=opt, jstep=jstep) -> dict:
                params = pf.device_put(init_params(), specs)
                state = opt.init(params)
                for x, y in batches:
                    params, state, _ = jstep(params, state, x, y)
                return _full({"params": params, "ex": state[1].leaves, "step": state[1].step,
                              "notfinite": state[0].total_notfinite})

            clean = [batch(t) for t in range(steps)]
            x, y = batch(bad)
            y = y.clone()
            y[0, 0] = float("nan")
            out[name] = {"poisoned": run(clean[:bad] + [(x, y)] + clean[bad:]), "clean": run(clean)}
    return out


def reductions_users_write(rank: int, world: int) -> dict:
    """Gradients whose reduction DTensor once made mid-backward (a tied weight; a data term plus a penalty on
    the weight), gradients of two arguments, and chain(powersgd, codec)'s error feedback. See test_compress.py."""
    mesh = pf.make_mesh((world,), ("dp",))
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(16, 8, generator=g) * 0.3, "w": torch.randn(8, 8, generator=g) * 0.3}
    specs = {k: P() for k in params}
    ids = torch.randint(0, 16, (8,), generator=g)
    tgt = torch.randint(0, 16, (8,), generator=g)

    def tied(p, ids, tgt):
        h = torch.tanh(p["emb"][ids] @ p["w"])
        return torch.nn.functional.cross_entropy(h @ p["emb"].t(), tgt) + 0.01 * (p["w"] ** 2).sum()

    def step(p, ex, ids, tgt):
        return pf.grad(tied)(p, ids, tgt), ex

    def two_args(a, b, ex, ids, tgt):
        ga, gb = pf.grad(lambda a, b: tied({"emb": a["x"], "w": b["x"]}, ids, tgt), argnums=(0, 1))(a, b)
        return ga, gb, ex

    out = {}
    with pf.set_mesh(mesh):
        dp = pf.device_put(params, specs)
        shard = (specs, None, P("dp"), P("dp"))
        exact = pf.device_get(pf.jit(step, in_shardings=shard, backend="eager")(dp, None, ids, tgt)[0])
        fmt = C.int8(block=16)
        jstep = pf.jit(step, in_shardings=shard, grad_exchange=fmt, backend="eager")
        ex = fmt.init(dp)
        out["text"] = jstep.lower(dp, ex, ids, tgt).as_text()
        got, ex = jstep(dp, ex, ids, tgt)
        got = pf.device_get(got)
        out["tied"] = {k: {"rel": _rel(got[k], exact[k]),
                           "residual": float(pf.device_get(ex.leaves[k].residual).abs().max())} for k in params}
        # Two differentiated arguments: the same numbers as one dict of both, state keyed by argument name.
        fmt = C.topk(0.25)
        a, b = {"x": dp["emb"]}, {"x": dp["w"]}
        j2 = pf.jit(two_args, in_shardings=({"x": P()}, {"x": P()}, None, P("dp"), P("dp")), grad_exchange=fmt,
                    backend="eager")
        j1 = pf.jit(step, in_shardings=shard, grad_exchange=fmt, backend="eager")
        ex2, ex1 = fmt.init({"a": a, "b": b}), fmt.init(dp)
        diffs = []
        for _ in range(3):
            ga, gb, ex2 = j2(a, b, ex2, ids, tgt)
            g1, ex1 = j1(dp, ex1, ids, tgt)
            diffs.append(max(float((pf.device_get(ga)["x"] - pf.device_get(g1)["emb"]).abs().max()),
                             float((pf.device_get(gb)["x"] - pf.device_get(g1)["w"]).abs().max())))
        out["two_args_diff"] = max(diffs)
        # chain(powersgd, codec): what was sent plus what is held equals the exact sum (the codec's rounding of Q
        # is fed back too).
        for text in ("chain(powersgd(2), int8(block=16))", "chain(powersgd(2), bf16())"):
            fmt = eval(text, vars(C))  # noqa: S307 - test constants
            jstep = pf.jit(step, in_shardings=shard, grad_exchange=fmt, backend="eager")
            ex = fmt.init(dp)
            sent = {k: torch.zeros_like(v) for k, v in params.items()}
            for _ in range(4):
                got, ex = jstep(dp, ex, ids, tgt)
                for k, v in pf.device_get(got).items():
                    sent[k] += v
            held = {k: pf.device_get(ex.leaves[k].residual).sum(0) for k in params if
                    ex.leaves[k].residual is not None}
            out[text] = max(_rel(sent[k] + held[k], 4 * exact[k]) for k in held)
    return out

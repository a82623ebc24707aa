"""Train a small character-level GPT on Python's standard library source with pt3func.

    python examples/char_lm.py --mesh 2x2 --virtual  # the `make demo` run: a few minutes on 2 CPU cores
    python examples/char_lm.py                       # one device
    python examples/char_lm.py --steps 50 --backend eager
    pt3func run -n 4 examples/char_lm.py --mesh 2x2  # the same 2 x 2 mesh as 4 processes

The whole training step (forward, backward, clipping, AdamW with a warmup-cosine schedule) is one pure
function, traced and compiled once by `pf.jit`; params and optimizer state are plain nested dicts whose
buffers are donated and updated in place. With `--mesh DPxTP` the same step runs data-parallel over
`dp` and Megatron tensor-parallel over `tp`: the params are placed once with `pf.device_put`, the batch
is split over `dp`, and the compiled per-rank program holds the collectives, which are summarised
before training. At the end it compares the validation loss with a unigram baseline and samples text.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import pt3func as pf
from pt3func import P

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data as chardata  # noqa: E402
import gpt  # noqa: E402
from arguments import parse_mesh, positive_int  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (defaults: the `make demo` run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=positive_int, default=None, help="optimizer steps (default 500; 250 on a virtual mesh)")
    add("--batch", type=positive_int, default=32, help="sequences per step")
    add("--seq", type=positive_int, default=128, help="context length in characters")
    add("--d-model", type=positive_int, default=128)
    add("--layers", type=positive_int, default=4)
    add("--heads", type=positive_int, default=4)
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--warmup", type=int, default=50, help="linear warmup steps (capped at a fifth of --steps)")
    add("--weight-decay", type=float, default=0.1)
    add("--clip", type=float, default=1.0, help="global gradient-norm clip")
    add("--seed", type=int, default=0, help="seeds params, batches and sampling")
    add("--eval-interval", type=positive_int, default=100, help="steps between validation losses")
    add("--eval-batches", type=positive_int, default=8, help="validation batches per evaluation")
    add("--mesh", default=None, help="DPxTP (e.g. 2x2) or DP (e.g. 4) ranks; default: one device, no mesh")
    add("--virtual", action="store_true", help="simulate the mesh's ranks as threads of this process")
    add("--log-dir", default=None, help="write metrics.jsonl and TensorBoard events here (plot: scripts/plot_run.py)")
    add("--peak-tflops", type=float, default=None, help="the device's peak TFLOP/s, for MFU in the metrics")
    add(
        "--backend",
        choices=("auto", "inductor", "eager"),
        default="auto",
        help="how pf.jit runs the step; auto: eager on a virtual mesh, else inductor",
    )
    add("--max-bytes", type=positive_int, default=chardata.DEFAULT_MAX_BYTES, help="bytes of stdlib source to read")
    add("--sample-chars", type=int, default=200, help="characters to generate at the end")
    add("--temperature", type=float, default=0.8)
    add("--prompt", default="def ")
    args = parser.parse_args(argv)
    if args.virtual and not args.mesh:
        parser.error("--virtual simulates the ranks of a --mesh: give --mesh too (e.g. --mesh 2x2 --virtual)")
    if args.steps is None:
        # A virtual mesh runs all its ranks on this machine's cores, so each step costs about as much as the
        # whole model on one device plus the collectives: half the steps keep the demo to a few minutes.
        args.steps = 250 if args.mesh and args.virtual else 500
    return args



def backend_for(args: argparse.Namespace) -> str:
    """The `pf.jit` backend `--backend auto` stands for."""
    if args.backend != "auto":
        return args.backend
    # A virtual mesh compiles every rank's program in turn under one lock, so Inductor's compile time is
    # paid once per rank; at this model size that costs more than the fused kernels save.
    return "eager" if args.virtual and args.mesh else "inductor"


def model_config(args: argparse.Namespace, vocab: int) -> gpt.GPTConfig:
    """The GPT shape the flags ask for."""
    return gpt.GPTConfig(vocab=vocab, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)


def make_optimizer(args: argparse.Namespace) -> pf.optim.GradientTransformation:
    """Global-norm clipping, then AdamW on a warmup-cosine schedule; norms and biases are not decayed."""
    warmup = min(args.warmup, args.steps // 5)
    lr = pf.optim.warmup_cosine_decay(
        init_value=0.0,
        peak_value=args.lr,
        warmup_steps=warmup,
        decay_steps=max(args.steps, warmup + 1),
        end_value=0.1 * args.lr,
    )
    return pf.optim.chain(
        pf.optim.clip_by_global_norm(args.clip),
        pf.optim.adamw(
            lr,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=args.weight_decay,
            mask=lambda params: pf.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def make_train_step(config: gpt.GPTConfig, opt: pf.optim.GradientTransformation) -> Callable[..., Any]:
    """The pure `train_step(params, opt_state, batch) -> (params, opt_state, metrics)` to hand to `pf.jit`."""

    def loss_fn(params, batch):
        return gpt.loss_fn(params, batch, config, train=True)

    def train_step(params, opt_state, batch):
        loss, grads = pf.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return train_step


def make_eval_step(config: gpt.GPTConfig) -> Callable[..., Any]:
    """The pure `eval_step(params, batch) -> loss` (no dropout) to hand to `pf.jit`."""

    def eval_step(params, batch):
        return gpt.loss_fn(params, batch, config)

    return eval_step


def evaluate(eval_step: Callable[..., Any], params: gpt.Params, batches: Sequence[Batch]) -> float:
    """Mean loss of `params` over `batches`."""
    return sum(float(eval_step(params, batch)) for batch in batches) / len(batches)


def collective_summary(lowered: pf.Lowered, examples: int = 6) -> str:
    """What one step communicates: calls and bytes per collective kind, then a few annotated program lines."""
    comm_bytes = lowered.cost_analysis()["comm_bytes"]
    lines = [line.strip() for line in lowered.as_text().splitlines() if "# COLLECTIVE " in line]
    kinds = [re.search(r"# COLLECTIVE (\S+)", line)[1] for line in lines]
    if not lines:
        return "collectives per step (one rank's program): none"
    out = ["collectives per step (one rank's program):"]
    for kind, total in sorted(comm_bytes.items(), key=lambda item: -item[1]):
        out.append(f"  {kind:<28} {kinds.count(kind):4d} calls  {total / 2**10:10,.1f} KiB")
    out.append(f"  {'total':<28} {len(kinds):4d} calls  {sum(comm_bytes.values()) / 2**10:10,.1f} KiB")
    # The first line of each (kind, axis): the forward's TP all-reduce, the gradient all-reduce over dp, ...
    firsts: dict[str, str] = {}
    for line in lines:
        firsts.setdefault(re.search(r"# (COLLECTIVE \S+ over \S+)", line)[1], line)
    picked = list(firsts.values())[:examples]
    out.append(f"from lowered.as_text() ({len(picked)} of {len(lines)} collective lines):")
    out += [f"  {line}" for line in picked]
    return "\n".join(out)


@torch.no_grad()
def generate(
    params: gpt.Params, config: gpt.GPTConfig, prompt: torch.Tensor, n_chars: int, temperature: float, seed: int
) -> torch.Tensor:
    """`prompt` (1-D ids) followed by `n_chars` sampled ids; temperature 0 means greedy.

    Runs the model eagerly: each step sees a different context length, and this is not the hot loop.
    """
    generator = torch.Generator().manual_seed(seed)
    ids = prompt
    for _ in range(n_chars):
        logits = gpt.forward(params, ids[-config.seq :][None], config)[0, -1]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        else:
            next_id = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id])
    return ids


def train(
    args: argparse.Namespace,
    step: Callable[..., Any],
    eval_step: Callable[..., Any],
    params: gpt.Params,
    opt_state: Any,
    train_batches: Iterator[Batch],
    val_batches: Sequence[Batch],
    show: bool = True,
    run_metrics: pf.metrics.RunMetrics | None = None,
) -> tuple[gpt.Params, Any, dict[str, Any]]:
    """Run `args.steps` steps with a progress bar (when `show`); returns the final params, state and statistics."""
    tokens_per_step = args.batch * args.seq
    timed_seconds, timed_steps = 0.0, 0
    losses: list[float] = []
    first_step_s = tokens_per_s = float("nan")
    bar = tqdm(range(1, args.steps + 1), desc="train", dynamic_ncols=True, disable=not show)
    for i in bar:
        start = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, next(train_batches))
        losses.append(float(metrics["loss"]))  # waits for the step, so the timing below is honest
        # The first call compiles; counting it would understate the steady-state speed.
        if i == 1:
            first_step_s = time.perf_counter() - start
        else:
            timed_seconds += time.perf_counter() - start
            timed_steps += 1
        tokens_per_s = timed_steps * tokens_per_step / timed_seconds if timed_steps else float("nan")
        if run_metrics is not None and i > 1:  # the first call compiles: not a step time
            run_metrics.step(i, step_time_s=time.perf_counter() - start, loss=losses[-1])
            bar.set_postfix(run_metrics.postfix())  # loss, tokens/s, MFU (with --peak-tflops), comm, memory
        elif timed_steps:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        else:  # the first call compiles: no speed yet
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if i % args.eval_interval == 0 and i != args.steps:
            val_loss = evaluate(eval_step, params, val_batches)  # on every rank: it is collective
            if run_metrics is not None:
                run_metrics.log(i, val_loss=val_loss)
            if show:
                bar.write(f"step {i:5d}  train loss {losses[-1]:.3f}  val loss {val_loss:.3f}")
    bar.close()
    stats = {"train_loss": losses[-1], "losses": losses, "tokens_per_s": tokens_per_s, "first_step_s": first_step_s}
    return params, opt_state, stats


def make_mesh(args: argparse.Namespace) -> pf.Mesh | None:
    """The `--mesh` (virtual with `--virtual`), or None for one device."""
    if args.mesh is None:
        return None
    shape, names = parse_mesh(args.mesh)
    if args.batch % shape[0]:
        raise ValueError(f"--batch {args.batch} does not split over dp={shape[0]} ranks")
    return pf.make_mesh(shape, names, virtual=args.virtual)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, evaluate against the unigram baseline, sample; returns the numbers it printed."""
    args = parse_args(argv)
    started = time.perf_counter()
    mesh = make_mesh(args)
    backend = backend_for(args)
    # In a multi-process run every rank computes, rank 0 reports.
    show = mesh is None or mesh.virtual or torch.distributed.get_rank() == 0
    say = print if show else lambda *_: None

    dataset = chardata.load_dataset(args.max_bytes)
    baseline = chardata.unigram_baseline(dataset.train, dataset.val, dataset.vocab_size)
    config = model_config(args, dataset.vocab_size)
    params = gpt.init_params(config, seed=args.seed)
    opt = make_optimizer(args)
    on_mesh = f"{mesh!r}" if mesh is not None else "one device"
    say(
        f"data: {dataset.train.numel():,} train / {dataset.val.numel():,} val chars, vocab {dataset.vocab_size}; "
        f"model: {gpt.num_params(params):,} params; {on_mesh}; backend: {backend}"
    )

    with pf.set_mesh(mesh):
        if mesh is None:
            opt_state = opt.init(params)
            batch_spec = None
        else:
            # Replicated over dp, Megatron-split over tp; the optimizer state, made where the shards live,
            # takes the same layout.
            tp = "tp" if "tp" in mesh.axis_names else None
            params = pf.device_put(params, gpt.param_specs(params, tp=tp))
            opt_state = pf.jit(opt.init, backend=backend)(params)
            batch_spec = P("dp")
        # Donation lets the compiled step write the new params and moments over the old ones: no second copy.
        step = pf.jit(
            make_train_step(config, opt), in_shardings=(None, None, batch_spec), donate_argnums=(0, 1), backend=backend
        )
        eval_step = pf.jit(make_eval_step(config), in_shardings=(None, batch_spec), backend=backend)
        train_batches = chardata.batches(dataset.train, args.batch, args.seq, seed=args.seed)
        # A fixed validation set, so every evaluation measures the same thing.
        val_stream = chardata.batches(dataset.val, args.batch, args.seq, seed=args.seed + 1)
        val_batches = [next(val_stream) for _ in range(args.eval_batches)]

        # Lowering traces the step (the first call reuses it): look at the program before running it, and
        # take its FLOPs and communication volume for the run metrics.
        first = next(train_batches)
        train_batches = itertools.chain([first], train_batches)
        start = time.perf_counter()
        lowered = step.lower(params, opt_state, first)
        lower_s = time.perf_counter() - start
        if mesh is not None:
            say(collective_summary(lowered))
        run_metrics = pf.metrics.RunMetrics(
            args.log_dir,
            **pf.metrics.from_lowered(lowered),
            tokens_per_step=args.batch * args.seq,
            peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        )

        params, opt_state, stats = train(
            args, step, eval_step, params, opt_state, train_batches, val_batches, show, run_metrics
        )
        run_metrics.close()
        val_loss = evaluate(eval_step, params, val_batches)
        # Sampling is a short eager loop over growing contexts: one device with the full params does it.
        full_params = pf.device_get(params)
    verdict = "beats" if val_loss < baseline else "does NOT beat"
    say(f"unigram baseline {baseline:.3f} nats/char | final val loss {val_loss:.3f} nats/char -> model {verdict} it")
    ids = generate(full_params, config, dataset.encode(args.prompt), args.sample_chars, args.temperature, args.seed)
    sample = dataset.decode(ids)
    say(f"sample (temperature {args.temperature}):\n{'-' * 60}\n{sample}\n{'-' * 60}")
    seconds = time.perf_counter() - started
    say(
        f"done in {seconds:.0f} s: first step (trace + compile) {lower_s + stats['first_step_s']:.1f} s, "
        f"then {stats['tokens_per_s']:,.0f} tokens/s"
    )
    return {"baseline": baseline, "val_loss": val_loss, "sample": sample, "seconds": seconds, **stats}


if __name__ == "__main__":
    main()

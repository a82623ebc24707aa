"""Train a small character-level GPT on Python's standard library source with pt3func.

    python examples/char_lm.py                      # the `make demo` run: a few minutes on 2 CPU cores
    python examples/char_lm.py --steps 50 --backend eager

The whole training step (forward, backward, clipping, AdamW with a warmup-cosine schedule) is one pure
function, traced and compiled once by `pf.jit`; params and optimizer state are plain nested dicts whose
buffers are donated and updated in place. At the end it compares the validation loss with a unigram
baseline and samples some text.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import pt3func as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data as chardata  # noqa: E402
import gpt  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (defaults: the `make demo` run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=int, default=500, help="optimizer steps")
    add("--batch", type=int, default=32, help="sequences per step")
    add("--seq", type=int, default=128, help="context length in characters")
    add("--d-model", type=int, default=128)
    add("--layers", type=int, default=4)
    add("--heads", type=int, default=4)
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--warmup", type=int, default=50, help="linear warmup steps (capped at a fifth of --steps)")
    add("--weight-decay", type=float, default=0.1)
    add("--clip", type=float, default=1.0, help="global gradient-norm clip")
    add("--seed", type=int, default=0, help="seeds params, batches and sampling")
    add("--eval-interval", type=int, default=100, help="steps between validation losses")
    add("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    add("--backend", choices=("inductor", "eager"), default="inductor", help="how pf.jit runs the step")
    add("--max-bytes", type=int, default=chardata.DEFAULT_MAX_BYTES, help="bytes of stdlib source to read")
    add("--sample-chars", type=int, default=200, help="characters to generate at the end")
    add("--temperature", type=float, default=0.8)
    add("--prompt", default="def ")
    return parser.parse_args(argv)


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
) -> tuple[gpt.Params, Any, dict[str, float]]:
    """Run `args.steps` steps with a progress bar; returns the final params, state and statistics."""
    tokens_per_step = args.batch * args.seq
    timed_seconds, timed_steps = 0.0, 0
    loss = first_step_s = float("nan")
    bar = tqdm(range(1, args.steps + 1), desc="train", dynamic_ncols=True)
    for i in bar:
        start = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, next(train_batches))
        loss = float(metrics["loss"])  # waits for the step, so the timing below is honest
        # The first call traces and compiles; counting it would understate the steady-state speed.
        if i == 1:
            first_step_s = time.perf_counter() - start
        else:
            timed_seconds += time.perf_counter() - start
            timed_steps += 1
        tokens_per_s = timed_steps * tokens_per_step / timed_seconds if timed_steps else float("nan")
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        if i % args.eval_interval == 0 and i != args.steps:
            bar.write(f"step {i:5d}  train loss {loss:.3f}  val loss {evaluate(eval_step, params, val_batches):.3f}")
    bar.close()
    return params, opt_state, {"train_loss": loss, "tokens_per_s": tokens_per_s, "first_step_s": first_step_s}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, evaluate against the unigram baseline, sample; returns the numbers it printed."""
    args = parse_args(argv)
    started = time.perf_counter()

    dataset = chardata.load_dataset(args.max_bytes)
    baseline = chardata.unigram_baseline(dataset.train, dataset.val, dataset.vocab_size)
    config = model_config(args, dataset.vocab_size)
    params = gpt.init_params(config, seed=args.seed)
    opt = make_optimizer(args)
    opt_state = opt.init(params)
    print(
        f"data: {dataset.train.numel():,} train / {dataset.val.numel():,} val chars, vocab {dataset.vocab_size}; "
        f"model: {gpt.num_params(params):,} params; backend: {args.backend}"
    )

    # Donation lets the compiled step write the new params and moments over the old ones: no second copy.
    step = pf.jit(make_train_step(config, opt), donate_argnums=(0, 1), backend=args.backend)
    eval_step = pf.jit(make_eval_step(config), backend=args.backend)
    train_batches = chardata.batches(dataset.train, args.batch, args.seq, seed=args.seed)
    # A fixed validation set, so every evaluation measures the same thing.
    val_stream = chardata.batches(dataset.val, args.batch, args.seq, seed=args.seed + 1)
    val_batches = [next(val_stream) for _ in range(args.eval_batches)]

    params, opt_state, stats = train(args, step, eval_step, params, opt_state, train_batches, val_batches)
    val_loss = evaluate(eval_step, params, val_batches)
    verdict = "beats" if val_loss < baseline else "does NOT beat"
    print(f"unigram baseline {baseline:.3f} nats/char | final val loss {val_loss:.3f} nats/char -> model {verdict} it")

    ids = generate(params, config, dataset.encode(args.prompt), args.sample_chars, args.temperature, args.seed)
    sample = dataset.decode(ids)
    print(f"sample (temperature {args.temperature}):\n{'-' * 60}\n{sample}\n{'-' * 60}")
    seconds = time.perf_counter() - started
    print(
        f"done in {seconds:.0f} s: first step (trace + compile) {stats['first_step_s']:.1f} s, "
        f"then {stats['tokens_per_s']:,.0f} tokens/s"
    )
    return {"baseline": baseline, "val_loss": val_loss, "sample": sample, "seconds": seconds, **stats}


if __name__ == "__main__":
    main()

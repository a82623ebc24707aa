"""Smoke tests of the examples: the stdlib dataset, the pure GPT and the char-LM script end to end."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import char_lm  # noqa: E402
import data as chardata  # noqa: E402
import gpt  # noqa: E402

TINY = gpt.GPTConfig(vocab=40, seq=16, d_model=32, n_layers=2, n_heads=2)


@pytest.fixture(scope="module")
def dataset() -> chardata.CharDataset:
    return chardata.load_dataset(max_bytes=200_000)


def test_dataset_is_deterministic(dataset):
    again = chardata.load_dataset(max_bytes=200_000)
    assert torch.equal(dataset.train, again.train) and torch.equal(dataset.val, again.val)
    assert dataset.chars == again.chars
    assert dataset.train.dtype == torch.int64
    assert 180_000 <= dataset.train.numel() + dataset.val.numel() <= 200_000
    assert dataset.val.numel() == pytest.approx(0.1 * (dataset.train.numel() + dataset.val.numel()), abs=2)
    assert dataset.decode(dataset.train[:500]) in chardata.load_text(200_000)


def test_batches_are_reproducible_shifted_windows(dataset):
    first = [next(chardata.batches(dataset.train, 4, 32, seed=7)) for _ in range(2)]
    x, y = first[0]
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, first[1][0]) and torch.equal(y, first[1][1])
    assert torch.equal(x[:, 1:], y[:, :-1])
    other, _ = next(chardata.batches(dataset.train, 4, 32, seed=8))
    assert not torch.equal(x, other)


def test_unigram_baseline(dataset):
    baseline = chardata.unigram_baseline(dataset.train, dataset.val, dataset.vocab_size)
    # Code is far from uniform over its characters, yet no character model of it is nearly free.
    assert 2.0 < baseline < math.log(dataset.vocab_size)
    uniform = torch.arange(10).repeat(100)
    assert chardata.unigram_baseline(uniform, uniform) == pytest.approx(math.log(10))


def test_gpt_forward_shapes_and_dtypes():
    params = gpt.init_params(TINY, seed=0)
    idx = torch.randint(0, TINY.vocab, (3, 10))
    assert gpt.forward(params, idx, TINY).shape == (3, 10, TINY.vocab)
    assert "lm_head" not in params and set(params["blocks"]) == {"0", "1"}
    untied = gpt.GPTConfig(vocab=40, seq=16, d_model=32, n_layers=1, n_heads=2, tie_embeddings=False)
    assert gpt.forward(gpt.init_params(untied), idx, untied).shape == (3, 10, TINY.vocab)
    bf16 = gpt.GPTConfig(vocab=40, seq=16, d_model=32, n_layers=1, n_heads=2, compute_dtype=torch.bfloat16)
    assert gpt.forward(gpt.init_params(bf16), idx, bf16).dtype == torch.float32
    assert torch.equal(gpt.init_params(TINY, seed=0)["wte"], params["wte"])


def test_gpt_traces_with_fake_tensors():
    params = gpt.init_params(TINY, seed=0)
    batch = (torch.randint(0, TINY.vocab, (2, 16)), torch.randint(0, TINY.vocab, (2, 16)))
    loss_and_grad = pf.value_and_grad(functools.partial(gpt.loss_fn, config=TINY))
    graph = make_fx(loss_and_grad, tracing_mode="fake")(params, batch)
    assert "scaled_dot_product" in graph.code


def test_loss_decreases_under_jit():
    args = char_lm.parse_args(["--steps", "30", "--lr", "1e-2", "--warmup", "0"])
    params = gpt.init_params(TINY, seed=0)
    opt = char_lm.make_optimizer(args)
    opt_state = opt.init(params)
    step = pf.jit(char_lm.make_train_step(TINY, opt), donate_argnums=(0, 1), backend="eager")
    eval_step = pf.jit(char_lm.make_eval_step(TINY), backend="eager")
    batch = next(chardata.batches(torch.arange(200) % TINY.vocab, 8, TINY.seq, seed=0))
    before = float(eval_step(params, batch))
    for _ in range(10):
        params, opt_state, metrics = step(params, opt_state, batch)
    assert float(metrics["loss"]) < before - 1.0
    assert float(eval_step(params, batch)) < float(metrics["loss"])


def test_char_lm_main_runs(capsys):
    flags = "--steps 3 --batch 4 --seq 16 --d-model 32 --layers 1 --heads 2 --max-bytes 100000"
    flags += " --eval-interval 2 --eval-batches 1 --sample-chars 20 --backend eager"
    result = char_lm.main(flags.split())
    out = capsys.readouterr().out
    assert "unigram baseline" in out and "final val loss" in out
    assert math.isfinite(result["val_loss"]) and result["baseline"] > 0
    assert result["sample"].startswith("def ") and len(result["sample"]) == 24


TINY_RUN = (
    "--steps 6 --batch 4 --seq 16 --d-model 32 --layers 1 --heads 2 --max-bytes 100000 --lr 1e-2 --warmup 0"
    " --eval-interval 3 --eval-batches 1 --sample-chars 20 --backend eager"
)


def test_char_lm_on_virtual_mesh_matches_one_device(capsys):
    # A virtual mesh takes over its process's torch.distributed world, so it runs in a fresh interpreter.
    flags = TINY_RUN.split() + ["--mesh", "2x2", "--virtual"]
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import char_lm; "
        "r = char_lm.main(sys.argv[2:]); print('RESULT', json.dumps({k: r[k] for k in ('losses', 'val_loss')}))"
    )
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    proc = subprocess.run(
        [sys.executable, "-c", code, examples, *flags], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "collectives per step" in out and "all_reduce" in out and "COLLECTIVE all_reduce over" in out
    assert "unigram baseline" in out and "sample (temperature" in out
    sharded = json.loads(out.split("RESULT ", 1)[1])
    assert sharded["losses"][-1] < sharded["losses"][0] - 0.2

    single = char_lm.main(TINY_RUN.split())
    capsys.readouterr()
    # Same seed, same batches, same math: only the order of floating-point sums differs.
    assert sharded["losses"] == pytest.approx(single["losses"], abs=1e-4)
    assert sharded["val_loss"] == pytest.approx(single["val_loss"], abs=1e-4)

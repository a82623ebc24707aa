"""`chunk_cross_entropy`: the loss head computed a block of rows at a time, with the same numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func.passes.chunked_loss import chunk_cross_entropy

aten = torch.ops.aten
N_TOKENS, VOCAB, D = 24, 40, 16


def _params() -> dict:
    torch.manual_seed(0)
    return {"emb": torch.randn(VOCAB, D) * 0.3, "w": torch.randn(D, D) * 0.3}


def _batch(ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, N_TOKENS // 2))
    tgt = torch.randint(0, VOCAB, (2, N_TOKENS // 2))
    tgt.view(-1)[:ignored] = -100
    return idx, tgt


def _make_step(bf16: bool = False, **ce_kwargs):
    cast = (lambda t: t.to(torch.bfloat16)) if bf16 else (lambda t: t)

    def loss_fn(p, idx, tgt):
        emb = cast(p["emb"])
        h = torch.tanh(F.embedding(idx, emb) @ cast(p["w"]))
        logits = F.linear(h, emb)  # tied unembedding, as a GPT's
        return F.cross_entropy(logits.float().view(-1, VOCAB), tgt.view(-1), **ce_kwargs)

    def step(p, idx, tgt):
        loss, g = pf.value_and_grad(loss_fn)(p, idx, tgt)
        return pf.tree.map(lambda a, b: a - 0.5 * b, p, g), loss

    return step


@pytest.fixture
def small_chunks():
    before = pf.config.loss_chunk_bytes
    pf.config.loss_chunk_bytes = N_TOKENS * VOCAB * 4 // 3  # three chunks of 8 rows
    yield
    pf.config.loss_chunk_bytes = before


def _program(step, *args):
    return pf.jit(step, backend="eager").lower(*args).graph_module


def _count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def test_rewrites_the_loss_head_into_row_chunks(small_chunks):
    gm = _program(_make_step(), _params(), *_batch())
    assert _count(gm, aten._log_softmax.default) == 1
    chunk_cross_entropy(gm)
    assert _count(gm, aten._log_softmax.default) == 3
    assert _count(gm, aten.nll_loss_backward.default) == 3
    for node in gm.graph.nodes:  # no value holds every row's logits (or their gradient) any more
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[-1] == VOCAB and val.shape[0] != D:
            assert val.numel() <= N_TOKENS * VOCAB // 3, node.format_node()


def _ancestors(node) -> set:
    seen, todo = set(), [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_each_chunk_finishes_before_the_next_starts(small_chunks):
    # A chunk's logits may be freed only once its loss is summed and its gradient multiplied out: the next
    # chunk's logits matmul depends on both (Inductor otherwise summed every chunk's loss in one kernel at the
    # end, which kept every chunk's logits alive).
    gm = chunk_cross_entropy(_program(_make_step(), _params(), *_batch()))
    nodes = list(gm.graph.nodes)
    losses = [n for n in nodes if n.target is aten.nll_loss_forward.default]
    logits = [n for n in nodes if n.target is aten.mm.default and n.meta["val"].shape == (N_TOKENS // 3, VOCAB)]
    grads = [n for n in nodes if n.target is torch.ops.pt3func.matmul_accumulate.default]
    assert len(losses) == len(logits) == len(grads) == 3
    for i in (1, 2):
        before = _ancestors(logits[i])
        assert losses[i - 1] in before and grads[i - 1] in before
        assert losses[i] not in before


@pytest.mark.parametrize("ce_kwargs", [{"label_smoothing": 0.1}, {"weight": True}, {"reduction": "none"}])
def test_other_losses_are_left_alone(small_chunks, ce_kwargs):
    def loss_fn(p, idx, tgt):
        logits = F.linear(torch.tanh(F.embedding(idx, p["emb"]) @ p["w"]), p["emb"])
        kwargs = dict(ce_kwargs, weight=p["class_weight"].detach()) if "weight" in ce_kwargs else ce_kwargs
        return F.cross_entropy(logits.view(-1, VOCAB), tgt.view(-1), **kwargs).sum()

    params = dict(_params(), class_weight=torch.rand(VOCAB))
    gm = _program(lambda p, idx, tgt: pf.value_and_grad(loss_fn)(p, idx, tgt), params, *_batch())
    before = gm.code
    chunk_cross_entropy(gm)
    assert gm.code == before


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("ignored", [0, 5])
def test_same_numbers_as_the_whole_loss_under_inductor(small_chunks, bf16, ignored):
    results = []
    for disabled in (("chunk_cross_entropy",), ()):
        pf.config.disabled_passes = frozenset(disabled)
        try:
            jitted = pf.jit(_make_step(bf16))
            params = _params()
            losses = []
            for _ in range(3):
                params, loss = jitted(params, *_batch(ignored))
                losses.append(loss)
            gm = jitted.lower(params, *_batch(ignored)).graph_module
        finally:
            pf.config.disabled_passes = frozenset()
        results.append((params, torch.stack(losses), _count(gm, aten._log_softmax.default)))
    (p_whole, l_whole, n_whole), (p_chunk, l_chunk, n_chunk) = results
    assert (n_whole, n_chunk) == (1, 3)
    # Same per-row arithmetic; only the order of the loss sum and of the weight gradient's accumulation differs
    # (fp32; the bf16 program's gradient is rounded to bf16 once either way).
    tol = dict(rtol=1e-2, atol=1e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_chunk, l_whole, **tol)
    for k in p_whole:
        torch.testing.assert_close(p_chunk[k], p_whole[k], **tol)


def test_off_when_the_chunk_size_is_unset():
    before = pf.config.loss_chunk_bytes
    pf.config.loss_chunk_bytes = None
    try:
        gm = _program(_make_step(), _params(), *_batch())
        chunk_cross_entropy(gm)
        assert _count(gm, aten._log_softmax.default) == 1
    finally:
        pf.config.loss_chunk_bytes = before


def test_matmul_accumulate_op():
    from pt3func.passes.chunked_loss import matmul_accumulate

    a, b, acc = torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, 4)
    torch.library.opcheck(torch.ops.pt3func.matmul_accumulate.default, (acc, a, b))
    torch.library.opcheck(torch.ops.pt3func.matmul_accumulate.default, (None, a, b))
    torch.testing.assert_close(matmul_accumulate(acc, a, b), acc + a.double().mm(b.double()).float())
    assert matmul_accumulate(None, a, b).dtype == torch.float32


def test_accumulate_in_place_rewrites_a_copy_with_the_same_numbers(small_chunks):
    from pt3func.passes.chunked_loss import accumulate_in_place

    params, batch = _params(), _batch()
    gm = chunk_cross_entropy(_program(_make_step(True), params, *batch))
    before = gm.code
    rewritten = accumulate_in_place(gm)
    assert gm.code == before  # the program stays functional; only what Inductor is given changes
    assert _count(rewritten, torch.ops.pt3func.matmul_accumulate_.default) == 2  # chunks 2 and 3 add in place
    assert _count(rewritten, torch.ops.pt3func.matmul_accumulate.default) == 1  # chunk 1 starts the sum
    inputs = pf.tree.leaves((params, *batch))
    for got, want in zip(rewritten(*inputs), gm(*inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inductor_adds_each_chunk_into_one_buffer(small_chunks):
    # Out of place, every chunk's addmm first copied the whole fp32 accumulator (0.45 ms a step on an H200).
    from torch._inductor.utils import run_and_get_code

    step = pf.jit(_make_step(True))
    _, codes = run_and_get_code(lambda: step(_params(), *_batch()))
    calls = [line.strip() for line in codes[-1].splitlines()
             if "torch.ops.pt3func." in line and not line.strip().startswith(("#", "assert"))]
    assert len(calls) == 3, calls
    result, first = calls[0].split(" = ")
    assert first.startswith("torch.ops.pt3func.matmul_accumulate.default(None"), first
    lines = {line.strip() for line in codes[-1].splitlines()}
    for call in calls[1:]:  # into the first chunk's own buffer (or its alias), never a clone of it
        assert call.startswith("torch.ops.pt3func.matmul_accumulate_.default("), call
        accumulator = call.split("(")[1].split(",")[0]
        assert accumulator == result or f"{accumulator} = {result}" in lines, (accumulator, result)

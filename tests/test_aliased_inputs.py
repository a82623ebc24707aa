"""Inputs that share one buffer: a step's outputs split off one flat tensor, fed back as the next call's inputs.

A bucketed step (one `torch.cat` buffer, per-leaf state returned as views into it) hands the caller tensors that
share storage and sit at storage offsets; fed back, they must give the numbers eager gives, and a `[1, n]` row of
a `[1, N]` buffer must not count as a new signature (the stride of a size-1 dim addresses nothing). A retrace
there is not only a second compile: with a compressed exchange it starts a new exchange-guard trial, whose
reference steps leave the error-feedback residuals as they are.
"""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func.trace.signature import leaf_key


def bucket_step(a, b, x):
    """New a and b computed in one flat buffer and returned as views into it (rows `[1, n]` of a `[1, N]`)."""
    ga = a * 0.9 + x.sum() * 0.1
    gb = b * 0.5 - a.sum()
    flat = torch.cat([ga.reshape(1, -1), gb.reshape(1, -1)], 1)
    left, right = flat.split([a.numel(), b.numel()], 1)
    return left.view(a.shape), right.view(b.shape), flat.square().sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 12, generator=g), torch.randn(1, 20, generator=g), torch.randn(7, generator=g)


def _run(backend: str, donate: tuple[int, ...], steps: int = 4):
    step = pf.jit(bucket_step, backend=backend, donate_argnums=donate)
    a, b, x = _inputs()
    history = []
    for _ in range(steps):
        a, b, loss = step(a, b, x)
        history.append((a.clone(), b.clone(), loss.clone()))
    return history, step.trace_count(), (a, b)


@pytest.mark.parametrize("donate", [(), (0,), (1,)])
def test_outputs_sharing_one_buffer_fed_back_equal_eager(donate):
    inductor, traces, (a, b) = _run("inductor", donate)
    eager, _, _ = _run("eager", donate)
    if not donate:  # the case under test: the next call's inputs share one buffer, at storage offsets
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.storage_offset() > 0
    for got, want in zip(inductor, eager):
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert traces == 1


def test_a_size_one_dims_stride_is_not_part_of_the_signature():
    row = torch.randn(1, 40)[:, 8:20]  # stride (40, 1); a fresh [1, 12] has (12, 1)
    assert leaf_key(row) == leaf_key(torch.randn(1, 12))
    assert leaf_key(torch.randn(3, 4).t()) != leaf_key(torch.randn(4, 3))  # a stride that moves addresses still counts


def test_rows_of_one_buffer_reuse_the_program_compiled_for_fresh_inputs():
    # The first call's inputs are fresh [1, n] tensors, the second call's rows of the first call's [1, 32]
    # buffer (strides (32, 1)): the same program serves both.
    step = pf.jit(bucket_step)
    a, b, x = _inputs()
    out1 = step(a, b, x)
    assert out1[1].stride() == (32, 1)
    out2 = step(out1[0], out1[1], x)
    assert step.trace_count() == 1
    want = bucket_step(*bucket_step(a, b, x)[:2], x)
    for got, ref in zip(out2, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

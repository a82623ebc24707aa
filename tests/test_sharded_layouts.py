"""Sharded steps whose layouts DTensor's own rules got wrong silently, each against the single-device value:
a mean cross entropy over a batch split over dp while the classes are split (or pending) over tp, scans with a
negative dim over a split dim, and fills of values made like a pending sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION

# torch 2.11's DTensor has no rule for logcumsumexp nor clamp_min_ (cosine_embedding_loss): a loud error there.
NEEDS_2_13 = pytest.mark.skipif(TORCH_VERSION < (2, 13), reason="an op without a DTensor rule in torch 2.11")

N, C, H = 8, 6, 4


def _data():
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(5, H, generator=g), torch.randn(H, C, generator=g)
    x, y = torch.randn(N, 5, generator=g), torch.randint(0, C, (N,), generator=g)
    y[:3] = -100  # ignored targets, all in the first dp block
    return w1, w2, x, y


@pytest.mark.parametrize("kwargs", [{}, {"weight": torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0, 1.5])},
                                    {"label_smoothing": 0.1}], ids=["ignore_index", "class-weights", "smoothing"])
@pytest.mark.parametrize("head", ["classes-split", "pending-sum"])
def test_mean_cross_entropy_over_dp_with_a_tp_head_equals_one_device(kwargs, head):
    w1, w2, x, y = _data()

    def loss_fn(w1, w2, x, y):
        return F.cross_entropy((x @ w1).tanh() @ w2, y, **kwargs)

    want, want_grads = pf.value_and_grad(loss_fn, argnums=(0, 1))(w1, w2, x, y)
    # classes split: a vocabulary-parallel head; pending: a row-parallel head's logits (a partial sum over tp)
    specs = (P(), P(None, "tp")) if head == "classes-split" else (P(None, "tp"), P("tp"))
    with pf.set_mesh(pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)):
        step = pf.jit(pf.value_and_grad(loss_fn, argnums=(0, 1)), in_shardings=(*specs, P("dp"), P("dp")),
                      backend="eager")
        got, grads = pf.device_get(step(w1, w2, x, y))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # was the average of the dp blocks' means
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["cumsum", "cumprod", pytest.param("logcumsumexp", marks=NEEDS_2_13)])
@pytest.mark.parametrize(("spec", "dim"), [(P(None, "dp"), -1), (P("dp"), -2)], ids=["last", "first"])
def test_scans_with_a_negative_dim_over_a_split_dim_carry_across_blocks(op, spec, dim):
    z = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)) * 0.5

    def f(z):
        return getattr(torch, op)(z, dim)

    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        got = pf.device_get(pf.jit(f, in_shardings=spec, backend="eager")(z))
    torch.testing.assert_close(got, f(z))


@pytest.mark.parametrize("make", ["empty_like", "new_empty"])
def test_a_fill_of_a_value_made_like_a_pending_sum_is_the_fill(make):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)

    def f(a, b):
        s = (a * b).sum(1)  # a pending sum over tp when a and b are split on dim 1
        fresh = torch.empty_like(s) if make == "empty_like" else s.new_empty(8)
        return fresh.fill_(3.0) + s

    with pf.set_mesh(pf.make_mesh((2,), ("tp",), virtual=True)):
        got = pf.device_get(pf.jit(f, in_shardings=(P(None, "tp"), P(None, "tp")), backend="eager")(a, b))
    torch.testing.assert_close(got, f(a, b))  # the fill was counted once per rank


@NEEDS_2_13
def test_cosine_embedding_loss_of_column_parallel_features_equals_one_device():
    g = torch.Generator().manual_seed(3)
    w, x1, x2 = torch.randn(5, 6, generator=g), torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    y = torch.tensor([1, -1, 1, 1, -1, 1, -1, -1])

    def loss_fn(w, x1, x2, y):
        return F.cosine_embedding_loss(x1 @ w, x2 @ w, y)

    want = loss_fn(w, x1, x2, y)
    with pf.set_mesh(pf.make_mesh((2,), ("tp",), virtual=True)):
        got = pf.device_get(pf.jit(loss_fn, in_shardings=(P(None, "tp"), P(), P(), P()), backend="eager")(
            w, x1, x2, y))
    torch.testing.assert_close(got, want)

"""Session 19: `gather` / `take_along_dim` over the dim their input is split along equal one device (DTensor's
masked partial sum lost its mask after a view: Categorical.log_prob on tp-split logits was twice the value on
dp x tp, an IndexError inside DTensor on tp)."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func import P


def _log_prob(logits, a):
    return torch.distributions.Categorical(logits=logits, validate_args=False).log_prob(a).sum()


def _gather_squeezed(logits, a):
    return (logits.gather(-1, a[:, None]).squeeze(-1) * torch.arange(8.0)).sum()


def _take_along(logits, a):
    return torch.take_along_dim(logits.tanh(), a[:, None], dim=1).sum()


def _method(logits, a):
    return logits.exp().gather(1, a[:, None].expand(8, 2)).view(16).square().sum()


@pytest.mark.parametrize("fn", [_log_prob, _gather_squeezed, _take_along, _method])
@pytest.mark.parametrize("shape,names,spec", [((2,), ("tp",), P(None, "tp")), ((2, 2), ("dp", "tp"), P("dp", "tp"))])
def test_gathers_over_a_split_dim_equal_one_device(fn, shape, names, spec):
    torch.manual_seed(0)
    logits, a = torch.randn(8, 6), torch.randint(0, 6, (8,))
    want_loss, want_grad = pf.value_and_grad(fn)(logits, a)
    mesh = pf.make_mesh(shape, names, virtual=True)
    batch = P("dp") if "dp" in names else P()
    with pf.set_mesh(mesh):
        step = pf.jit(pf.value_and_grad(fn), in_shardings=(spec, batch), backend="eager")
        loss, grad = pf.device_get(step(logits, a))
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)

"""Dtype bugs of session 18's hunt, each against eager torch.

- `torch.set_default_dtype` / `torch.set_default_tensor_type` inside a step: the trace recorded factory ops and
  Python-scalar promotions without a dtype, run under the caller's default dtype (float32 where eager gave
  float64); refused now, at the user's line (trace/capture.py).
- `F.cross_entropy` mean of half-precision logits over a split batch: summed, counted and divided in bf16/fp16
  (a loss one ulp off the exact mean's rounding); in float32 now, rounded once (spmd/mean_loss.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.errors import ImpureFunctionError


def _set_f64_with_imported_name():
    from torch import set_default_dtype

    set_default_dtype(torch.float64)


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type")
@pytest.mark.parametrize("set_default", [
    lambda: torch.set_default_dtype(torch.float64),
    lambda: torch.set_default_tensor_type(torch.DoubleTensor),
    lambda: torch.set_default_tensor_type("torch.DoubleTensor"),
    _set_f64_with_imported_name,
], ids=["set_default_dtype", "set_default_tensor_type", "set_default_tensor_type(str)", "imported name"])
def test_changing_the_default_dtype_in_a_step_is_refused(set_default):
    # Eager gives float64 values; the program ran torch.ones / the int-by-float division in float32.
    def step(x):
        old = torch.get_default_dtype()
        set_default()
        try:
            table = torch.arange(4) / 3.0 + torch.ones(4) * 1e-300
        finally:
            torch.set_default_dtype(old)  # a set that changes nothing runs: the refusal above is what is raised
        return x.double() + table

    with pytest.raises(ImpureFunctionError, match=r"test_dtypes_s18\.py:\d+ .*set_default.*inside jitted "
                                                  r"'[^']*step'.*around the call"):
        pf.jit(step, backend="eager")(torch.zeros(4))
    assert torch.get_default_dtype() is torch.float32


def test_setting_the_default_dtype_already_set_in_a_step_is_kept():
    # A library that sets the dtype it expects, already the default: nothing changes, nothing to refuse.
    def step(x):
        torch.set_default_dtype(torch.get_default_dtype())
        return x + torch.ones(3) / 3

    x = torch.zeros(3)
    torch.testing.assert_close(pf.jit(step, backend="eager")(x), step(x), rtol=0, atol=0)


def test_the_default_dtype_set_around_the_call_is_the_programs():
    # What the refusal tells the user to do: the default dtype is part of the step's signature.
    def step(x):
        return x + torch.arange(4) / 3.0

    jitted = pf.jit(step, backend="eager")
    torch.set_default_dtype(torch.float64)
    try:
        want, got = step(torch.zeros(4)), jitted(torch.zeros(4))
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.dtype is torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _split_mean(mesh, loss, z, t):
    with pf.set_mesh(mesh):
        jitted = pf.jit(loss, in_shardings=(P("dp"), P("dp")), backend="eager")
        return pf.device_get(jitted(pf.device_put(z, P("dp")), pf.device_put(t, P("dp"))))


def _mean_of_per_target_losses(z, t, weight=None):
    """Eager's per-target losses summed and divided exactly, rounded once to the logits' dtype (what torch's CUDA
    kernel computes in float32; its CPU kernel adds in the half type)."""
    per_target = F.cross_entropy(z, t, weight=weight, reduction="none").double()
    counted = t != -100
    total = counted.sum().double() if weight is None else weight.double()[t[counted]].sum()
    return (per_target.sum() / total).to(z.dtype)


def test_bf16_cross_entropy_mean_of_a_split_batch_is_rounded_once(mesh):
    # The hunt's case: the count 1714 rounded to 1712 in bf16 and the blocks' sums added in bf16 gave 4.375;
    # one device and the exact mean give 4.40625.
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(2000, 7, generator=g) * 3).bfloat16()
    t = torch.randint(0, 7, (2000,), generator=g)
    t[::7] = -100
    got = _split_mean(mesh, lambda z, t: F.cross_entropy(z, t), z, t)
    assert got.dtype is torch.bfloat16
    assert got.item() == _mean_of_per_target_losses(z, t).item() == F.cross_entropy(z, t).item() == 4.40625


# Batches where the half-precision arithmetic missed the rounded exact mean by one ulp (seeds looked for).
@pytest.mark.parametrize("dtype, weighted, seed", [
    (torch.bfloat16, False, 1), (torch.float16, False, 1), (torch.bfloat16, True, 4), (torch.float16, True, 2),
], ids=["bf16", "fp16", "bf16 class weights", "fp16 class weights"])
def test_half_cross_entropy_mean_of_a_split_batch(mesh, dtype, weighted, seed):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(1200, 9, generator=g) * 3).to(dtype)
    t = torch.randint(0, 9, (1200,), generator=g)
    t[torch.rand(1200, generator=g) < 0.3] = -100
    weight = (torch.rand(9, generator=g) * 2 + 0.1).to(dtype)
    got = _split_mean(mesh, lambda z, t: F.cross_entropy(z, t, weight=weight if weighted else None), z, t)
    assert got.dtype is dtype
    assert got.item() == _mean_of_per_target_losses(z, t, weight if weighted else None).item()


def test_bf16_cross_entropy_gradient_of_a_split_batch(mesh):
    # The float32 sum is reduced before the division: its gradient is each target's 1/count, once (a pending sum
    # turned into a replicated one must not scale it by the number of ranks).
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(64, 5, generator=g) * 2).bfloat16()
    t = torch.randint(0, 5, (64,), generator=g)
    t[:40] = -100  # rank 0's block counts 0 of its 32 targets, rank 1's 24 of 32
    grad = _split_mean(mesh, pf.grad(lambda z, t: F.cross_entropy(z, t)), z, t)
    want = torch.func.grad(lambda z: F.cross_entropy(z.double(), t))(z.double())
    torch.testing.assert_close(grad.double(), want, rtol=2e-2, atol=1e-4)

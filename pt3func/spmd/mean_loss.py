"""`F.cross_entropy` / `F.nll_loss` with a mean over a split batch: the exact mean of the whole batch.

DTensor's rule for `nll_loss_forward` computes a mean over a split batch on each rank's block and averages the
blocks' means. That is the batch's mean only when every block counts the same total weight: not with class weights
(2.814 against 2.637 in a 2-rank test), nor when blocks ignore different numbers of targets (`ignore_index`: a
block that ignores all of its targets made the loss NaN). Its gradient was exact (the backward gets the whole
batch's total weight); the loss value was not. Here the per-target losses (`reduction="none"`, exact row by row)
are summed and divided by the whole batch's total weight (the count of counted targets, or the sum of their class
weights), which DTensor reduces: two scalar all-reduces, as before (the loss's and the total weight's).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from pt3func._compat import is_plain_shard

MEAN_LOSSES = frozenset({F.cross_entropy, F.nll_loss})


@functools.cache
def _signature(func: Callable) -> inspect.Signature:
    return inspect.signature(func)


def exact_mean(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The batch's mean of `func`'s per-target losses, or None where DTensor's result is already exact or the call
    is another form (batch not split, another reduction, soft targets, class weights with label smoothing)."""
    try:
        bound = _signature(func).bind(*args, **kwargs)
    except TypeError:
        return None
    call = dict(bound.arguments)
    x, target, weight = call.get("input"), call.get("target"), call.get("weight")
    smoothing = call.get("label_smoothing", 0.0)
    if (not _split_along_batch(x) or call.get("reduction", "mean") != "mean" or target is None
            or call.get("size_average") is not None or call.get("reduce") is not None
            or not isinstance(target, torch.Tensor) or target.is_floating_point()
            or (weight is not None and smoothing != 0.0)):
        return None
    per_target = func(**dict(call, reduction="none"))
    counted = target != call.get("ignore_index", -100)
    # Half-precision losses are summed and divided in float32 and rounded once, as torch's CUDA kernel does: in
    # bf16 the count itself rounded (1714 -> 1712) and each partial sum lost bits (a loss one bf16 ulp off one
    # device's); in fp16 a block whose losses add up past 65504 gave inf. float32 and float64 keep their dtype.
    acc = torch.promote_types(per_target.dtype, torch.float32)
    if weight is None:
        total = counted.sum().to(acc)
    else:
        total = (weight.to(acc)[torch.where(counted, target, torch.zeros_like(target))] * counted).sum()
    loss_sum = per_target.to(acc).sum()
    if acc != per_target.dtype:
        # DTensor keeps the blocks' sums pending until the output, where they would be rounded to half precision
        # and added in it: added now, in float32 (the same one all-reduce, of 4 bytes).
        loss_sum = loss_sum.redistribute(
            loss_sum.device_mesh, [Replicate() if p.is_partial() else p for p in loss_sum.placements]
        )
    return (loss_sum / total).to(per_target.dtype)


def _split_along_batch(x: Any) -> bool:
    """A DTensor of [batch, classes, ...] split along the batch over some mesh axis, whatever its other axes do:
    classes split (a vocabulary-parallel head) or a pending sum (a row-parallel head) too. DTensor's rule averages
    the batch blocks' means in those layouts as well; the per-target losses are exact in all of them."""
    if not isinstance(x, DTensor) or x.ndim < 2:
        return False  # a 1-D input is one sample's classes: dim 0 is no batch
    return any(is_plain_shard(p) and p.dim == 0 for p in x.placements)

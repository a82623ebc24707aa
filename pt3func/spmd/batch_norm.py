"""Batch and instance normalisation in training mode on sharded values, written out in DTensor ops.

`native_batch_norm` updates `running_mean` / `running_var` in place, and its schema does not say so. DTensor's
rule may hand the kernel split *copies* of the statistics (a dp x tp mesh splits the channels over tp), so the
update lands in copies nobody reads; `F.instance_norm` batch-norms a repeated copy of the statistics and
averages back the original, never-written repeat. The step then returned unchanged statistics with no error.
Written as means and variances, the batch statistics are DTensor reductions (a small all-reduce of per-channel
sums over the axes that split the batch), the running statistics are updated in place in their own layout,
and autograd differentiates the same formula the kernel computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_INSTANCE_NORM = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")
_DEFAULTS = {"weight": None, "bias": None, "training": False, "use_input_stats": True, "momentum": 0.1, "eps": 1e-5,
             "running_mean": None, "running_var": None}


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(zip(names, args))
    for name in names[len(args):]:
        bound[name] = kwargs.get(name, _DEFAULTS.get(name))
    return bound


def _sharded(*values: Any) -> bool:
    return any(isinstance(v, DTensor) for v in values)


def batch_norm_exactly(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`F.batch_norm` in training mode with a DTensor among its tensors; None to leave it to DTensor."""
    b = _bind(_BATCH_NORM, args, kwargs)
    x = b["input"]
    if not b["training"] or not _sharded(x, b["running_mean"], b["running_var"], b["weight"], b["bias"]):
        return None
    dims = [0, *range(2, x.ndim)]
    mean, var = _moments(x, dims)
    out = _normalise(x, mean, var, b["weight"], b["bias"], b["eps"], keep=[1])
    count = math.prod(x.shape[d] for d in dims)
    _update_running(b["running_mean"], b["running_var"], mean, var, count, b["momentum"])
    return out


def instance_norm_exactly(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`F.instance_norm` with the instances' own statistics and a DTensor among its tensors; None otherwise."""
    b = _bind(_INSTANCE_NORM, args, kwargs)
    x = b["input"]
    if not b["use_input_stats"] or not _sharded(x, b["running_mean"], b["running_var"], b["weight"], b["bias"]):
        return None
    dims = list(range(2, x.ndim))
    mean, var = _moments(x, dims, keepdim=True)
    out = _normalise(x, mean, var, b["weight"], b["bias"], b["eps"], keep=[0, 1])
    count = math.prod(x.shape[d] for d in dims)
    # torch updates a statistic per instance from the repeated running one, then averages over the batch
    _update_running(b["running_mean"], b["running_var"], mean.flatten(1).mean(0), var.flatten(1).mean(0), count,
                    b["momentum"])
    return out


def _moments(x: torch.Tensor, dims: list[int], keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance over `dims`, in fp32 for 16-bit inputs (as the kernels accumulate)."""
    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = wide.mean(dim=dims, keepdim=keepdim)
    centred = wide - (mean if keepdim else _along_channels(mean, x.ndim))
    var = (centred * centred).mean(dim=dims, keepdim=keepdim)
    return mean, var


def _along_channels(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (ndim - 2))


def _normalise(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: Any, bias: Any, eps: float,
               keep: list[int]) -> torch.Tensor:
    if keep == [1]:
        mean, var = _along_channels(mean, x.ndim), _along_channels(var, x.ndim)
    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = (wide - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * _along_channels(weight, x.ndim)
    if bias is not None:
        out = out + _along_channels(bias, x.ndim)
    return out.to(x.dtype)


def _update_running(running_mean: Any, running_var: Any, mean: torch.Tensor, var: torch.Tensor, count: int,
                    momentum: float | None) -> None:
    if running_mean is None or running_var is None:
        return
    if momentum is None:  # a cumulative average needs the batch count, which the module folds into momentum
        raise NotImplementedError("batch norm with momentum=None on a mesh: pass a float momentum")
    unbiased = var * (count / max(count - 1, 1))
    with torch.no_grad():
        for running, batch in ((running_mean, mean), (running_var, unbiased)):
            new = running * (1 - momentum) + batch.detach().to(running.dtype) * momentum
            if isinstance(running, DTensor):
                new = new.redistribute(running.device_mesh, running.placements) if isinstance(new, DTensor) else new
            elif isinstance(new, DTensor):
                new = new.full_tensor()
            running.copy_(new)


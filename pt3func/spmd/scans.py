"""Scans (`cumsum`, `cumprod`, `logcumsumexp`, `cummax`, `cummin`) with a negative `dim` over a split dim.

DTensor's scan rule compares the raw `dim` with the placements' (non-negative) dims: `cumsum(x, -1)` of a value
split on its last dim was computed on each block with no carry between blocks, silently (the forward value was
wrong; `dim=1` was right). The dim is made non-negative before DTensor sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

SCANS = frozenset({
    torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod, torch.logcumsumexp,
    torch.Tensor.logcumsumexp, torch.cummax, torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin,
})


def with_dim_normalized(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func` called with a non-negative dim, or None where there is nothing to change."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, DTensor) or not isinstance(dim, int) or dim >= 0 or x.ndim == 0:
        return None
    if not -x.ndim <= dim:
        return None  # out of range: torch's own error
    dim += x.ndim
    if len(args) > 1:
        args = (args[0], dim, *args[2:])
    else:
        kwargs = dict(kwargs, dim=dim)
    return func(*args, **kwargs)



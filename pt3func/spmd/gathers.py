"""`torch.gather` / `take_along_dim` of a value split along the dim they gather over.

DTensor lowers such a gather as a masked partial sum (each rank looks up the indices in its own block, zeroes the
others, the ranks' results summed later), the scheme of a vocabulary-parallel embedding. Its mask did not survive
the views that commonly follow (`gather(-1, idx).squeeze(-1)`, what `Categorical.log_prob` does): the sum
counted the ranks' zeroed lookups as values on a dp x tp mesh (a policy's log-probabilities twice what one device
gives, silently), failed with an IndexError inside DTensor on a tp mesh, or read as data-dependent control flow.
While a sharded step is traced the input is gathered along that dim first (an all-gather), and each rank gathers
from the whole of it: one device's numbers. Splits along other dims are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from pt3func._compat import is_plain_shard, is_strided_shard

GATHERS = frozenset({torch.gather, torch.Tensor.gather, torch.take_along_dim, torch.Tensor.take_along_dim})


def gather_from_whole_dim(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func(input, dim, index)` (gather) or `func(input, indices, dim)` (take_along_dim) with the input whole
    along `dim`, or None where the input is not split along it (DTensor's path is right there)."""
    take_along = func in (torch.take_along_dim, torch.Tensor.take_along_dim)
    names = ("input", "indices", "dim") if take_along else ("input", "dim", "index")
    bound = dict(zip(names, args)) | kwargs
    x, dim = bound.get("input"), bound.get("dim")
    if not isinstance(x, DTensor) or dim is None or not isinstance(dim, int) or x.ndim == 0:
        return None
    dim %= x.ndim
    along = [(is_plain_shard(p) or is_strided_shard(p)) and p.dim == dim for p in x.placements]
    if not any(along):
        return None
    whole = x.redistribute(x.device_mesh, [Replicate() if a else p for a, p in zip(along, x.placements)])
    return func(whole, **{k: v for k, v in bound.items() if k != "input"})

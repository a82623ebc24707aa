"""The one place that knows which torch version is running (pt3func supports torch 2.11 and 2.13).

Everything else imports the version-dependent names from here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol  # importing it registers torch.ops._c10d_functional
from torch.distributed.tensor import Shard

c10d_functional = torch.ops._c10d_functional
"""The functional collective ops (`all_reduce`, `all_gather_into_tensor`, ..., `wait_tensor`)."""

# torch 2.13 renamed funcol's `all_gather_tensor` / `reduce_scatter_tensor` to `*_single` (the old names warn).
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def is_plain_shard(placement: object) -> bool:
    """True for `Shard(d)`, False for `_StridedShard` (a `Shard` subclass in some versions, not in others)."""
    return type(placement) is Shard


def dtensor_from_local(local: torch.Tensor, device_mesh: Any, placements: tuple, shape: torch.Size,
                       stride: tuple[int, ...]) -> Any:
    """A DTensor around `local` with known global shape and stride, without `DTensor.from_local`'s cost.

    `from_local` is an autograd function with checks (hundreds of µs a call on a busy CPU); outside a trace,
    on values the compiled program produced, the plain constructor does the same in a few µs.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)

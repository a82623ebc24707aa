"""Uninitialised values made like a pending sum: `torch.empty_like(s)`, `s.new_empty(n)` of a Partial `s`.

DTensor gives them `s`'s Partial placement, so a later `fill_(v)` wrote `v` on every rank: a value of `v` times
the number of ranks once reduced, silently (`F.cosine_embedding_loss` of features from a column-parallel layer
was off by exactly 1 per positive pair), and random fills of them were refused. Their contents are undefined, so
labelling them replicated instead costs nothing and gives every later write its single-device meaning. Where
the `empty_like` happens inside an op's own decomposition (`F.cosine_embedding_loss`), out of reach of a torch
function, the op runs on inputs split along the batch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from pt3func._compat import is_plain_shard

UNINITIALIZED = frozenset({torch.empty_like, torch.Tensor.new_empty})


def replicated_not_pending(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func`'s result with Partial placements relabelled Replicate, or None where none is Partial."""
    like = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if not isinstance(like, DTensor) or not any(p.is_partial() for p in like.placements):
        return None
    out = func(*args, **kwargs)
    if not isinstance(out, DTensor) or not any(p.is_partial() for p in out.placements):
        return out
    placements = [Replicate() if p.is_partial() else p for p in out.placements]
    return DTensor.from_local(out.to_local(), out.device_mesh, placements, run_check=False, shape=out.shape,
                              stride=out.stride())


# Ops whose own decomposition (below the torch functions pt3func sees) fills an `empty_like` of a pending sum: run
# on inputs split along the batch only (gathered over the others), where nothing in them is pending.
FILLS_LIKE_A_PENDING_SUM = frozenset({F.cosine_embedding_loss})


def on_batch_split_inputs(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func` of its DTensor arguments with every placement but a batch (dim 0) split made whole; None if none."""
    changed = False

    def batch_split_only(x: Any) -> Any:
        nonlocal changed
        if not isinstance(x, DTensor):
            return x
        want = [p if is_plain_shard(p) and p.dim == 0 else Replicate() for p in x.placements]
        if tuple(want) == tuple(x.placements):
            return x
        changed = True
        return x.redistribute(x.device_mesh, want)

    args = tuple(batch_split_only(a) for a in args)
    kwargs = {k: batch_split_only(v) for k, v in kwargs.items()}
    return func(*args, **kwargs) if changed else None

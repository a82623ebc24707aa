"""Torch functions pt3func handles itself while a sharded step is traced (a TorchFunctionMode).

- `F.embedding` into a row-sharded table: lowered explicitly (`vocab_embedding.lookup`). On torch 2.11, whose
  DTensor `index_put` rule fails for a split index, `table[idx]` with a split integer index as well
  (`vocab_embedding.index_as_lookup`).
- `F.batch_norm` / `F.instance_norm` in training mode: written out in DTensor ops, so the running statistics
  are updated where the step reads them (`batch_norm.py`).
- Group normalisation, bilinear layers, embedding bags and recurrent kernels (`nn.RNN` / `nn.GRU` / `nn.LSTM`)
  on batch-sharded inputs: run on each rank's own samples (`per_sample.py`).
- `F.dropout` (and `dropout1d / 2d / 3d`), `torch.rand_like`, `torch.randn_like` and in-place random fills on
  split values: each rank keeps its block of the single-device draw (`random_ops.py`).
- `F.cross_entropy` / `F.nll_loss` with a mean over a split batch: the whole batch's mean (`mean_loss.py`).
- Convolutions (`F.conv*`, `F.conv_transpose*`) of a weight or input split other than along the batch: gathered
  first (`convolution.py`), where DTensor gave wrong numbers.
- `torch.gather` / `take_along_dim` over a dim their input is split along: the input gathered along it first
  (`gathers.py`), where DTensor's masked partial sum gave wrong numbers after a view (`Categorical.log_prob`).
- Scans (`cumsum`, ...) with a negative dim: the dim made non-negative, which DTensor's rule needs (`scans.py`).
- `torch.empty_like` / `new_empty` of a pending sum: labelled replicated, so a later fill means what it does on
  one device (`uninitialized.py`).
- `F.scaled_dot_product_attention` with a plain-tensor `attn_mask` beside DTensor q, k, v: the mask (built
  inside the step, e.g. by Hugging Face models from the batch's global shape) becomes a DTensor split like q on
  the dims it has (batch, heads; a dim of size 1 broadcasts and stays whole). Left as a plain tensor it reached
  the kernel whole beside the local q (a runtime shape error): DTensor takes plain tensors as replicated only
  among an op's positional arguments, and does not redistribute keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from pt3func._compat import DTENSOR_INDEX_PUT_SPLIT_INDEX_BROKEN, is_plain_shard
from pt3func.spmd.batch_norm import batch_norm_exactly, instance_norm_exactly
from pt3func.spmd.convolution import CONVOLUTIONS, convolve_in_supported_layout
from pt3func.spmd.gathers import GATHERS, gather_from_whole_dim
from pt3func.spmd.mean_loss import MEAN_LOSSES, exact_mean
from pt3func.spmd.per_sample import (
    RECURRENT,
    bilinear_locally,
    embedding_bag_locally,
    group_norm_locally,
    run_locally,
)
from pt3func.spmd.random_ops import RANDOM, redraw, warn_uncovered
from pt3func.spmd.scans import SCANS, with_dim_normalized
from pt3func.spmd.uninitialized import (
    FILLS_LIKE_A_PENDING_SUM,
    UNINITIALIZED,
    on_batch_split_inputs,
    replicated_not_pending,
)
from pt3func.spmd.vocab_embedding import index_as_lookup, lookup

# Functions rewritten as `rule(args, kwargs)`, which returns None where DTensor's own path is right.
_RULES: dict[Callable, Callable[[tuple, dict], Any]] = {
    F.embedding_bag: embedding_bag_locally,
    F.batch_norm: batch_norm_exactly,
    F.instance_norm: instance_norm_exactly,
    F.group_norm: group_norm_locally,
    F.bilinear: bilinear_locally,
    F.embedding: lambda args, kwargs: lookup(*args, **kwargs),
}
if DTENSOR_INDEX_PUT_SPLIT_INDEX_BROKEN:
    _RULES[torch.Tensor.__getitem__] = index_as_lookup

# Families of functions rewritten as `rule(func, args, kwargs)`, None likewise where DTensor's path is right.
_FAMILY_RULES: tuple[tuple[frozenset, Callable[[Callable, tuple, dict], Any]], ...] = (
    (RANDOM, redraw),
    (RECURRENT, lambda func, args, kwargs: None if kwargs else run_locally(func, args)),
    (MEAN_LOSSES, exact_mean),
    (SCANS, with_dim_normalized),
    (UNINITIALIZED, replicated_not_pending),
    (FILLS_LIKE_A_PENDING_SUM, on_batch_split_inputs),
    (CONVOLUTIONS, convolve_in_supported_layout),
    (GATHERS, gather_from_whole_dim),
)


class ShardedTraceOverrides(TorchFunctionMode):
    """Active while a sharded step is traced (`jitted._sharded_tracing`); every other function runs as called."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            done = rule(args, kwargs)
            if done is not None:
                return done
        elif func is F.scaled_dot_product_attention:
            warn_uncovered(func, args, kwargs)
            mask = kwargs.get("attn_mask")
            query = args[0] if args else kwargs.get("query")
            if isinstance(query, DTensor) and mask is not None and not isinstance(mask, DTensor):
                kwargs = dict(kwargs, attn_mask=_mask_like(mask, query))
        else:
            for family, family_rule in _FAMILY_RULES:
                if func in family:
                    done = family_rule(func, args, kwargs)
                    if done is not None:
                        return done
                    break
        return func(*args, **kwargs)


def _mask_like(mask: Any, query: DTensor) -> DTensor:
    """`mask` (the global value, the same on every rank) as a DTensor split like `query` (b, h, L, E) on the mask's
    own dims (b, h, L, S aligned from the right)."""
    mesh = query.device_mesh
    offset = query.ndim - mask.ndim
    placements = []
    for p in query.placements:
        dim = p.dim - offset if is_plain_shard(p) else -1
        keep = 0 <= dim < mask.ndim - 2 and mask.shape[dim] == query.shape[p.dim] and mask.shape[dim] > 1
        placements.append(Shard(dim) if keep else Replicate())
    replicated = DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements) if any(isinstance(p, Shard) for p in placements) else replicated


"""Embedding lookups into a table sharded on its rows (vocabulary-parallel embedding), lowered explicitly.

DTensor shards such a lookup with a `_MaskPartial` placement that keeps the out-of-range mask as state on the
placement object; in a traced whole step that state is gone by the time the backward needs it, and the trace
fails deep in DTensor (`AssertionError` in `_MaskPartial._reduce_value`; pytorch/pytorch#130725, #160697). While a
sharded step is traced, pt3func computes these lookups itself, Megatron's way: each rank looks up the indices that
fall in its own rows (the others read row 0 and are zeroed), and the result is a partial sum over the axes that
split the rows, reduced right away as Megatron's VocabParallelEmbedding does: one all-reduce (a reduce-scatter back
onto the batch over an axis that also split the indices). Left pending for DTensor to reduce where it is next used,
the sum went on through a LLaMA's RMSNorm (linear in it once its scale is reduced) into the column-parallel q/k/v
projections, and DTensor gathered their weights whole to multiply it, then reduced it in each of them. The
backward is the local lookup's: each rank's gradient lands in its own rows only. Lookups DTensor handles well
(replicated tables, tables split on the embedding dim) and options this lowering does not cover (`max_norm`,
which writes the table; `scale_grad_by_freq` and `sparse`) are left to DTensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from pt3func._compat import is_plain_shard


def lookup(
    indices: Any, weight: Any, padding_idx: int | None = None, max_norm: float | None = None,
    norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
) -> torch.Tensor | None:
    if not isinstance(weight, DTensor) or max_norm is not None or scale_grad_by_freq or sparse:
        return None
    row_dims = [d for d, p in enumerate(weight.placements) if is_plain_shard(p) and p.dim == 0]
    if not row_dims or any(not is_plain_shard(p) and not p.is_replicate() for p in weight.placements):
        return None  # rows not split, or a placement (partial, strided) this lowering does not reason about
    mesh = weight.device_mesh
    if not isinstance(indices, DTensor):
        indices = DTensor.from_local(indices, mesh, [Replicate()] * mesh.ndim, run_check=False)
    given = tuple(indices.placements)
    # Every rank needs all the indices of its batch block: replicate them over the axes that split the rows.
    wanted = [Replicate() if d in row_dims else p for d, p in enumerate(indices.placements)]
    if any(isinstance(p, Partial) for p in wanted):
        return None
    if tuple(wanted) != tuple(indices.placements):
        indices = indices.redistribute(mesh, wanted)
    # The output's gradient comes back in these placements with a partial sum's as replicated: from_local's
    # default (torch 2.13's normalisation, 2.11's backward redistribution), so no grad_placements (2.11 lacks it).
    out_placements = []
    for d in range(mesh.ndim):
        w, i = weight.placements[d], indices.placements[d]
        if d in row_dims:
            out_placements.append(Partial())
        elif is_plain_shard(i):
            out_placements.append(i)
        elif is_plain_shard(w):  # w.dim == 1: the embedding dim is split, the output's last dim
            out_placements.append(Shard(indices.ndim))
        else:
            out_placements.append(Replicate())
    # The local table's gradient holds only this rank's indices: a partial sum over the axes that split them.
    table_grad = [Partial() if is_plain_shard(i) and w.is_replicate() else w
                  for w, i in zip(weight.placements, indices.placements)]
    table = weight.to_local(grad_placements=table_grad)
    first, rows = _first_row(weight.shape[0], mesh, row_dims), table.shape[0]
    local = indices.to_local()
    inside = (local >= first) & (local < first + rows)
    local_padding = None
    if padding_idx is not None:
        padding = padding_idx % weight.shape[0]
        local_padding = padding - first if first <= padding < first + rows else None
    looked_up = F.embedding(torch.where(inside, local - first, 0), table, padding_idx=local_padding)
    looked_up = looked_up * inside.unsqueeze(-1).to(looked_up.dtype)
    partial = DTensor.from_local(looked_up, mesh, out_placements, run_check=False)
    return partial.redistribute(mesh, _reduced(out_placements, given))


def _reduced(out_placements: list, given: tuple) -> list:
    """Where the lookup's partial sums go: split again like the indices came over an axis that split them (a
    reduce-scatter back onto their dim: the batch stays split), whole over the others (an all-reduce)."""
    return [(given[d] if is_plain_shard(given[d]) else Replicate()) if isinstance(p, Partial) else p
            for d, p in enumerate(out_placements)]


def _first_row(n_rows: int, mesh: Any, row_dims: list[int]) -> int:
    """The global index of this rank's first row: the row blocks of each splitting axis, in mesh order (as
    DTensor nests them), from this rank's mesh coordinate (Python ints: the program is this rank's)."""
    coordinate = mesh.get_coordinate()
    first, size = 0, n_rows
    for d in row_dims:
        chunk = -(-size // mesh.size(d))  # torch.chunk's block size
        start = min(coordinate[d] * chunk, size)
        first, size = first + start, min(chunk, size - start)
    return first


def index_as_lookup(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`table[idx]` with a split integer index, computed as an embedding lookup (`F.embedding`, of a row-split table
    gathered first), whose backward DTensor handles. Used where DTensor's `index_put` rule, the backward of
    `table[idx]`, is broken for a split index (torch 2.11: `_compat.DTENSOR_INDEX_PUT_SPLIT_INDEX_BROKEN`).
    Negative indices count from the end, as indexing does. None (DTensor's own path) for any other index."""
    if kwargs or len(args) != 2:
        return None
    table, index = args
    if not isinstance(table, torch.Tensor) or not isinstance(index, DTensor) or table.ndim == 0:
        return None
    if index.dtype not in (torch.int64, torch.int32) or all(p.is_replicate() for p in index.placements):
        return None
    split_table = isinstance(table, DTensor) and not all(p.is_replicate() for p in table.placements)
    if split_table and table.ndim != 2:
        return None  # the lookup needs a 2-D table; reshaping a split one would move its blocks
    if split_table and any(is_plain_shard(p) and p.dim == 0 for p in table.placements):
        # Rows split (FSDP's layout): gathered first, as FSDP gathers a parameter for its use, rather than
        # `lookup`'s gathering every rank's indices and reducing every rank's rows; the lookup stays split like the
        # batch. (`lookup`'s pending sum, once reduced where DTensor picked, on torch 2.11 a reduce-scatter along
        # the sequence that its view rules then could not flatten for the next `F.linear`.)
        whole_rows = [Replicate() if is_plain_shard(p) and p.dim == 0 else p for p in table.placements]
        table = table.redistribute(table.device_mesh, whole_rows)
    n = table.shape[0]
    index = torch.where(index < 0, index + n, index)
    flat = table if table.ndim == 2 else table.reshape(n, -1)
    out = F.embedding(index, flat)
    return out if table.ndim == 2 else out.reshape(*index.shape, *table.shape[1:])

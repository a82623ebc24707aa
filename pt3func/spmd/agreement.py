"""A sharded step's plain tensor inputs are global values, the same on every rank (as host arrays are in
multi-controller JAX): each rank keeps its own block of its own copy, with no communication. Ranks that pass
different shapes, or different values for an input the step takes replicated, would train silently apart (the
DDP habit of per-rank batches, or unseeded initial weights). This checks it once per input signature of a
process world: one small all-gather of shapes, dtypes and two float64 sums per tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pt3func.errors import ShardingError


def multi_process_world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_ranks_agree(name: str, entries: Sequence[tuple[str, torch.Tensor, bool]]) -> None:
    """Raise ShardingError when the ranks' plain inputs differ: `entries` are (label, tensor, split) for every
    plain tensor the step is given; a split one (each rank keeps a block) must agree in shape and dtype only.

    Every rank calls this at the same point of the same call (the caller checks each input signature once).
    """
    mine = [(label, tuple(x.shape), str(x.dtype), None if split else _digest(x)) for label, x, split in entries]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = _differences(everyone)
    if problems:
        raise ShardingError(
            f"{name}: the ranks pass different plain tensors to a sharded step: {'; '.join(problems[:8])}"
            f"{' ...' if len(problems) > 8 else ''}. A plain tensor given to a sharded step is the global value and "
            "must be the same on every rank (each rank keeps its own block of it): seed the initial weights the "
            "same on every rank, and pass every rank the whole global batch, or build the global array from the "
            "ranks' blocks with pf.make_array_from_process_local_data(sharding, local_block)"
        )


_CHUNK = 1 << 24  # elements converted to float64 at a time: the check's memory stays bounded


def _digest(x: torch.Tensor) -> tuple[str, str]:
    """Two float64 sums of the values (repr'd, so NaN equals NaN): equal tensors give equal digests; the
    position-weighted one also sees values that traded places."""
    flat = x.detach()
    flat = (torch.view_as_real(flat) if flat.is_complex() else flat).reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK].to(torch.float64)
        ramp = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.float64, device=flat.device)
        total += torch.stack([chunk.sum(), (chunk * ramp).sum()])
    sums = total.tolist()
    return repr(sums[0]), repr(sums[1])


def _differences(everyone: list[list[tuple]]) -> list[str]:
    counts = {len(entries) for entries in everyone}
    if len(counts) > 1:
        return [f"the ranks pass {' / '.join(str(len(e)) for e in everyone)} tensors (rank order)"]
    out = []
    for k, first in enumerate(everyone[0]):
        label = first[0]
        column = [entries[k] for entries in everyone]
        shapes = [(shape, dtype) for _, shape, dtype, _ in column]
        if len(set(shapes)) > 1:
            per_rank = ", ".join(f"rank {r} {tuple(s)} {d}" for r, (s, d) in enumerate(shapes))
            out.append(f"{label}: {per_rank}")
        elif first[3] is not None and len({entry[3] for entry in column}) > 1:
            ranks = [r for r, entry in enumerate(column) if entry[3] != first[3]]
            out.append(f"{label} (taken replicated): the values of rank(s) {ranks} differ from rank 0's")
    return out

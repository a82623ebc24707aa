"""Refuse to save a plain leaf whose value differs between ranks: it would come back as one rank's value everywhere.

A DTensor is written shard by shard, each rank its own. A plain leaf (a torch.Tensor that is no DTensor, an int,
a str, any other object) is written once: DCP keeps one rank's copy of each key (`dedup_save_plans`) and the
manifest holds rank 0's values. Restore then hands that one copy to every rank, so a per-rank value (a generator
seeded per rank, a data position per rank) would silently become another rank's. `check_plain_leaves_agree`
compares a cheap fingerprint of every plain leaf across ranks before anything is written.
"""

from __future__ import annotations

import pickle
import zlib
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pt3func.checkpointing.errors import CheckpointError
from pt3func.checkpointing.manifest import JSON_TYPES

Fingerprint = tuple[Any, ...] | None  # None: the leaf is missing on that rank
MAX_LEAVES_NAMED = 8
MAX_VALUE_SHOWN = 40

HOW_TO_KEEP_PER_RANK = (
    "A plain (non-DTensor) leaf is saved once and restored on every rank, so each rank would get one rank's value. "
    "Keep per-rank values per rank: as a DTensor split over the ranks, one row each "
    "(`DTensor.from_local(x[None], mesh.device_mesh, [Shard(0)] * mesh.ndim)`, restored into a target of the "
    "same form: row `.to_local()[0]`), or as one entry per rank in every rank's tree "
    "(`torch.distributed.all_gather_object` them into a list; after restore take entry `rank`). Values equal on "
    "every rank (a shared seed's generator, the step) need nothing."
)


def _tensor_bytes_crc(tensor: torch.Tensor) -> int | None:
    """CRC-32 of the tensor's bytes: one pass, no copy for a contiguous CPU tensor (plain leaves are usually small:
    generator states, counters). None for a layout without plain bytes (sparse, quantized)."""
    try:
        data = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return zlib.crc32(data.view(torch.uint8).numpy())
    except (RuntimeError, TypeError):
        return None  # shape and dtype still compared


def fingerprint(leaf: Any) -> Fingerprint:
    """What is compared across ranks for a plain leaf; small enough to gather (never the data itself)."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape), _tensor_bytes_crc(leaf))
    if type(leaf) in JSON_TYPES:
        text = repr(leaf)  # repr, not ==: nan equals itself here, as it does in the manifest
        shown = text if len(text) <= MAX_VALUE_SHOWN else text[:MAX_VALUE_SHOWN - 3] + "..."
        return ("value", shown, zlib.crc32(text.encode()))
    try:
        return ("object", zlib.crc32(pickle.dumps(leaf)))
    except Exception:  # noqa: BLE001 - DCP reports an object it cannot save; nothing to compare here
        return ("object", None)


def plain_fingerprints(flat: dict[str, Any]) -> dict[str, Fingerprint]:
    """The fingerprint of every leaf of `flat` that is saved once (all but DTensors, which each rank writes)."""
    return {key: fingerprint(leaf) for key, leaf in flat.items() if not isinstance(leaf, DTensor)}


def _show(print_: Fingerprint) -> str:
    if print_ is None:
        return "missing"
    kind, *rest = print_
    if kind == "tensor":
        dtype, shape, crc = rest
        return f"{dtype}{list(shape)}" + ("" if crc is None else f" (crc {crc:08x})")
    if kind == "value":
        return rest[0]
    return "an object" + ("" if rest[0] is None else f" (pickle crc {rest[0]:08x})")


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:4]) + (", ..." if len(ranks) > 4 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def describe(key: str, per_rank: list[Fingerprint]) -> str:
    """`key: A on rank 0, B on ranks 1, 2`."""
    holders: dict[Fingerprint, list[int]] = defaultdict(list)
    for rank, print_ in enumerate(per_rank):
        holders[print_].append(rank)
    return f"{key}: " + ", ".join(f"{_show(p)} on {_rank_list(ranks)}" for p, ranks in holders.items())


def _differing(gathered: list[dict[str, Fingerprint]]) -> dict[str, list[Fingerprint]]:
    """The keys whose fingerprint (or presence) is not the same on every rank, with each rank's fingerprint."""
    keys = list(dict.fromkeys(key for prints in gathered for key in prints))  # rank 0's order first
    per_key = {key: [prints.get(key) for prints in gathered] for key in keys}
    return {key: prints for key, prints in per_key.items() if any(p != prints[0] for p in prints)}


def _same_objects(objects: list[Any]) -> bool:
    """Whether every rank's object equals rank 0's (a set of strs pickles in a per-process order)."""
    try:
        return all(bool(obj == objects[0]) for obj in objects[1:])
    except Exception:  # noqa: BLE001 - no usable ==: the pickles already differ
        return False


def _confirm_objects(differing: dict[str, list[Fingerprint]], flat: dict[str, Any], group: Any,
                     world: int) -> dict[str, list[Fingerprint]]:
    """Drop the objects whose pickles differ but that compare equal; collective only if any pickles differ
    (every rank sees the same `differing`, so all of them gather, or none)."""
    suspects = [key for key, prints in differing.items()
                if all(p is not None and p[0] == "object" for p in prints)]
    if not suspects:
        return differing
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {key: flat[key] for key in suspects}, group=group)
    equal = {key for key in suspects if _same_objects([rank_objects[key] for rank_objects in objects])}
    return {key: prints for key, prints in differing.items() if key not in equal}


def check_plain_leaves_agree(step: int, flat: dict[str, Any], group: Any) -> None:
    """Raise CheckpointError on every rank if a leaf saved once differs between ranks. Collective over `group`
    (one all_gather_object of the fingerprints); call it before anything of the save is written."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, plain_fingerprints(flat), group=group)
    differing = _confirm_objects(_differing(gathered), flat, group, world)
    if not differing:
        return
    lines = [describe(key, prints) for key, prints in list(differing.items())[:MAX_LEAVES_NAMED]]
    more = len(differing) - len(lines)
    if more:
        lines.append(f"... and {more} more")
    raise CheckpointError(f"not saving step {step}: these leaves differ between ranks: " + "; ".join(lines)
                          + ". " + HOW_TO_KEEP_PER_RANK + " Nothing was written.")

"""pf.checkpointing on several ranks: a plain leaf that differs between ranks is refused (it is saved once), and the
two ways the error suggests to keep per-rank values (a DTensor row per rank, a list with one entry per rank) work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import pt3func as pf
from pt3func.checkpointing import CheckpointError, CheckpointManager, rng_state, set_rng_state
from pt3func.checkpointing.per_rank import describe, fingerprint
from tests.dist import run_world


def _seeded_per_rank(rank: int) -> torch.Tensor:
    """Seed this rank's generator apart from the others (per-rank augmentation, the DDP idiom); its state."""
    torch.manual_seed(100 + rank)
    torch.rand(3)
    return rng_state()["cpu"]


def _named_leaves(message: str) -> str:
    """The part of a refusal that names the differing leaves (the advice after it names others)."""
    return message.split(". A plain")[0]


def _refused(manager: CheckpointManager, step: int, tree: dict) -> str:
    with pytest.raises(CheckpointError) as caught:
        manager.save(step, tree)
    return str(caught.value)


def _per_rank_leaves(rank: int, world: int, directory: str) -> dict:
    manager = CheckpointManager(directory)  # async: the check runs before the copy, on every rank
    state = _seeded_per_rank(rank)
    refused = _refused(manager, 1, {"rng": {"cpu": state}, "data_position": 7 + rank, "step": 1, "seed": 0})
    # Sets pickle in insertion order where their entries collide: equal sets must not be refused, unequal ones must.
    equal_sets = {1, 9} if rank == 0 else {9, 1}
    set_refused = _refused(manager, 1, {"tags": {rank}, "same": equal_sets})
    dist.barrier()
    left_behind = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    dist.barrier()  # nobody saves before rank 0 has looked

    expected = torch.rand(3)  # what this rank draws next without a restart
    mesh = pf.make_mesh((world,), ("dp",))
    rows = DTensor.from_local(state[None], mesh.device_mesh, [Shard(0)])
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, (state, 7 + rank))
    manager.save(2, {"rng_rows": rows, "per_rank": every_rank, "same": equal_sets, "step": 2})
    manager.wait()

    target = {"rng_rows": DTensor.from_local(torch.zeros_like(state)[None], mesh.device_mesh, [Shard(0)]),
              "per_rank": [(torch.zeros_like(state), 0)] * world, "same": set(), "step": 0}
    restored = manager.restore(target=target)
    row = restored["rng_rows"].to_local()[0]
    own_state, own_position = restored["per_rank"][rank]
    set_rng_state({"cpu": row})
    from_row = torch.rand(3)
    return {"refused": refused, "set_refused": set_refused, "left_behind": left_behind, "steps": manager.all_steps(),
            "row_resumes": torch.equal(from_row, expected), "entry_is_own": torch.equal(own_state, state),
            "position": own_position, "same": restored["same"]}


def test_per_rank_plain_leaves_are_refused_on_every_rank_and_nothing_is_written(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    results = run_world(2, _per_rank_leaves, str(directory))
    for rank, result in enumerate(results):
        message = result["refused"]
        assert "not saving step 1: these leaves differ between ranks" in message
        assert "data_position: 7 on rank 0, 8 on rank 1" in message
        assert "rng/cpu: uint8[5056]" in message and "on rank 1" in message
        assert "step:" not in _named_leaves(message) and "seed:" not in _named_leaves(message)  # equal on all ranks
        assert "DTensor.from_local" in message and "all_gather_object" in message and "Nothing was written" in message
        assert "tags: an object" in result["set_refused"] and "same:" not in _named_leaves(result["set_refused"])
        # The refusals left no step directory, committed or not; the next save works (no rank was left behind).
        assert results[0]["left_behind"] == []
        assert result["steps"] == [2]
        assert result["row_resumes"] and result["entry_is_own"] and result["position"] == 7 + rank
        assert result["same"] == {1, 9}


def test_fingerprints_tell_apart_what_restore_would_merge() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert fingerprint(x) == fingerprint(x.clone()) == fingerprint(x.t().contiguous().t())  # layout is no value
    assert fingerprint(x) != fingerprint(x.reshape(3, 2))
    assert fingerprint(x) != fingerprint(x.double()) and fingerprint(x) != fingerprint(x + 1e-6)
    assert fingerprint(torch.tensor(float("nan"))) == fingerprint(torch.tensor(float("nan")))
    assert fingerprint(3) != fingerprint(3.0) and fingerprint(float("nan")) == fingerprint(float("nan"))
    assert describe("pos", [fingerprint(1), fingerprint(2), fingerprint(1), None]) == (
        "pos: 1 on ranks 0, 2, 2 on rank 1, missing on rank 3")

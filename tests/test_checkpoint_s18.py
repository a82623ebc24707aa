"""Session 18 fixes of checkpoints and device_get: snapshots that never alias, rank 0's file errors on every rank,
unwaited async saves reported at exit, a crashed re-save recovered, Partial / donated / meta leaves named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial

import pt3func as pf
from pt3func import P
from pt3func.checkpointing import CheckpointError, CheckpointManager
from pt3func.checkpointing import manager as manager_module
from pt3func.checkpointing import manifest as mf
from tests.dist import run_world

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def _double(p: dict) -> dict:
    return {k: v * 2 for k, v in p.items()}


def _snapshot_then_donate(mesh: pf.Mesh) -> dict:
    with pf.set_mesh(mesh):
        step = pf.jit(_double, donate_argnums=(0,), backend="eager")
        p = pf.device_put({"rep": torch.ones(4), "split": torch.ones(4), "s": torch.tensor(1.0)},
                          {"rep": P(), "split": P("dp"), "s": P()})
        snap = pf.device_get(p)
        step(p)
    return {k: v.tolist() for k, v in snap.items()}


def test_device_get_never_aliases_a_replicated_dtensor(world_of_one_mesh: pf.Mesh) -> None:
    assert _snapshot_then_donate(world_of_one_mesh) == {"rep": [1.0] * 4, "split": [1.0] * 4, "s": 1.0}


def test_device_get_never_aliases_on_a_virtual_mesh() -> None:
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    assert _snapshot_then_donate(mesh) == {"rep": [1.0] * 4, "split": [1.0] * 4, "s": 1.0}


def _rank0_failures(rank: int, world: int, directory: str) -> list[str]:
    """Each rank's CheckpointError text for a failure only rank 0's file work meets (the others would hang)."""
    import torch.distributed as dist

    messages = []
    as_file = Path(directory) / "a_file"
    if rank == 0:
        as_file.write_text("not a directory")
    dist.barrier()
    try:
        CheckpointManager(as_file, async_save=False).save(1, {"x": torch.ones(2)})
    except CheckpointError as e:
        messages.append(str(e))
    good = Path(directory) / "ckpt"
    manager = CheckpointManager(good, async_save=False)
    manager.save(1, {"x": torch.ones(2)})
    if rank == 0:  # a manifest of the right format that lacks its checksums: a KeyError in verify, on rank 0 only
        manifest_path = good / "step_1" / mf.MANIFEST
        manifest_path.write_text(manifest_path.read_text().replace('"files"', '"filez"'))
    dist.barrier()
    try:
        manager.restore(1)
    except CheckpointError as e:
        messages.append(str(e))
    return messages


def test_rank0_file_errors_raise_on_every_rank(tmp_path: Path) -> None:
    for messages in run_world(2, _rank0_failures, str(tmp_path)):
        assert len(messages) == 2
        assert "a_file" in messages[0] and "FileExistsError" in messages[0] and "rank 0" in messages[0]
        assert "step_1" in messages[1] and "KeyError" in messages[1]


def test_unwaited_failed_async_save_is_reported_at_exit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def fail(step: int, tmp: Path) -> None:
        raise RuntimeError("the process group is gone")

    manager = CheckpointManager(tmp_path, before_commit=fail)
    manager.save(3, {"x": torch.ones(2)})
    manager._pending[1].exception()  # the background commit has failed; nobody called wait()
    manager_module._report_unwaited()
    err = capsys.readouterr().err
    assert f"step 3 into {tmp_path} did NOT commit" in err and "the process group is gone" in err
    assert "wait()" in err
    manager._pending = None


def test_crash_between_the_renames_of_a_resave_keeps_the_step(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(5, {"w": torch.ones(3)})
    real_rename = os.rename

    def crash_after_moving_the_old_copy_aside(src, dst):
        real_rename(src, dst)
        if "replaced" in str(dst):
            raise KeyboardInterrupt  # stands for the process dying here: nothing after it runs

    monkeypatch.setattr(mf.os, "rename", crash_after_moving_the_old_copy_aside)
    with pytest.raises(KeyboardInterrupt):
        manager.save(5, {"w": torch.full((3,), 2.0)})
    monkeypatch.setattr(mf.os, "rename", real_rename)
    assert not (tmp_path / "step_5").exists()  # both copies complete, under temporary names
    fresh = CheckpointManager(tmp_path, async_save=False)
    assert torch.equal(fresh.restore()["w"], torch.full((3,), 2.0))  # the re-save's copy comes back
    fresh.save(6, {"w": torch.zeros(3)})
    assert fresh.all_steps() == [5, 6]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_reader_never_commits_a_first_save_in_flight(tmp_path: Path, monkeypatch) -> None:
    # A first save whose manifest is written but not yet renamed is no re-save: a reader's restore() leaves it to
    # the writer, whose rename would otherwise fail (and the reader would see a step before it is committed).
    writer = CheckpointManager(tmp_path, async_save=False)
    writer.save(1, {"w": torch.ones(3)})
    real_rename = os.rename
    seen = {}

    def read_before_the_commit(src, dst):
        if str(dst).endswith("step_2"):
            seen["latest"] = CheckpointManager(tmp_path, async_save=False).restore()["w"][0].item()
            seen["steps"] = CheckpointManager(tmp_path, async_save=False).all_steps()
        real_rename(src, dst)

    monkeypatch.setattr(mf.os, "rename", read_before_the_commit)
    writer.save(2, {"w": torch.full((3,), 2.0)})
    assert seen == {"latest": 1.0, "steps": [1]}
    assert writer.all_steps() == [1, 2]


def test_partial_dtensor_is_refused_naming_the_key(world_of_one_mesh: pf.Mesh, tmp_path: Path) -> None:
    part = DTensor.from_local(torch.ones(4), world_of_one_mesh.device_mesh, [Partial()])
    with pytest.raises(CheckpointError, match=r"'model/part' is a DTensor with a Partial .*redistribute.*device_get"):
        CheckpointManager(tmp_path, async_save=False).save(1, {"model": {"part": part}})
    assert not list(tmp_path.iterdir())


def test_donated_leaves_are_named_and_a_meta_target_restores(tmp_path: Path) -> None:
    step = pf.jit(_double, donate_argnums=(0,), backend="eager")
    state = {"w": torch.randn(4, 2), "n": torch.tensor(3)}
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(0, state)
    new = step(state)
    with pytest.raises(CheckpointError, match=r"cannot save the leaf 'n': it was donated to jitted '_double'"):
        manager.save(1, state)
    with pytest.raises(CheckpointError, match=r"cannot restore into the leaf 'n': it was donated"):
        manager.restore(target=state)
    meta = pf.tree.map(lambda t: torch.empty_like(t, device="meta"), new)
    restored = manager.restore(target=meta)  # a shape-only target: the values come back on the CPU
    assert restored["w"].device.type == "cpu" and torch.equal(restored["n"], torch.tensor(3))

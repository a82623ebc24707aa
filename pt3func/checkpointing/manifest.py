"""The on-disk layout around DCP's files: `step_N/` directories, their JSON manifest and its checksums.

    directory/
      step_100/                  committed: DCP's files (`.metadata`, `__0_0.distcp`, ...) + manifest.json
      step_200.tmp-<uuid>/       being written, or left by a crash: ignored, removed by the next save

A step directory counts only once it is named `step_N` and holds `manifest.json`: the manifest is written
(and fsynced) last, and the rename from the temporary name is the commit. A temporary copy whose manifest is
there and whose files pass their checksums is complete: where `step_N` is missing (a crash between the renames of
a re-save), `recover` renames it back before the next save cleans up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pt3func.checkpointing.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "pt3func-checkpoint/1"
CHECKSUM = "sha256"
STEP_DIR = re.compile(r"step_(\d+)")
TMP_MARK = ".tmp-"
_OURS_TMP = re.compile(r"step_\d+" + re.escape(TMP_MARK))  # only the manager's own: a user's `x.tmp-1` stays
JSON_TYPES = (bool, int, float, str)  # non-tensor leaves of these types go into the manifest itself


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step}"


def committed_steps(directory: Path) -> list[int]:
    """The steps in `directory` with a committed manifest, ascending."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and (entry / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def tmp_dirs(directory: Path) -> list[Path]:
    """Directories of unfinished saves (or of deletions a crash interrupted)."""
    if not directory.is_dir():
        return []
    return [entry for entry in directory.iterdir() if _OURS_TMP.match(entry.name) and entry.is_dir()]


def recover(directory: Path) -> list[int]:
    """Rename back to `step_N` each complete temporary copy of a step `N` that has no `step_N`; the steps recovered.

    Re-saving a step renames the committed `step_N` aside (`step_N.tmp-replaced-*`) and then the new copy to
    `step_N`; a crash between the two renames leaves both, complete, under temporary names. A copy counts when its
    manifest is of step N and every file passes its checksum; of several, the newest manifest wins (the re-save).
    Copies being deleted (pruned steps) never come back, nor a first save's copy that is not yet renamed.
    """
    candidates: dict[int, list[tuple[float, Path]]] = {}
    # Only steps a re-save was committing (one renamed aside): a complete copy without one is a first save not yet
    # renamed, which a reader's `restore()` must not commit under the writer (whose own rename would then fail).
    resaved = {tmp.name.partition(TMP_MARK)[0] for tmp in tmp_dirs(directory)
               if tmp.name.partition(TMP_MARK)[2].startswith("replaced-")}
    for tmp in tmp_dirs(directory):
        if tmp.name.partition(TMP_MARK)[0] not in resaved:
            continue
        name, _, kind = tmp.name.partition(TMP_MARK)
        step = int(name.removeprefix("step_"))
        if kind.startswith("deleting-") or step_dir(directory, step).exists() or not (tmp / MANIFEST).is_file():
            continue
        try:
            manifest = read_manifest(tmp)
            if manifest.get("step") != step:
                continue
            verify(tmp, manifest)
        except (CheckpointError, OSError, KeyError, TypeError, ValueError):
            continue  # not a complete copy: the next save deletes it
        candidates.setdefault(step, []).append((float(manifest.get("time") or 0.0), tmp))
    for step, copies in candidates.items():
        os.rename(max(copies)[1], step_dir(directory, step))
    if candidates:
        _fsync(directory)
    return sorted(candidates)


def _versions() -> dict[str, str]:
    try:
        ours = version("pt3func")
    except PackageNotFoundError:
        ours = "unknown"
    return {"pt3func": ours, "torch": torch.__version__}


def describe_leaf(leaf: Any) -> dict[str, Any]:
    """What the manifest records of a tensor leaf: shape, dtype and, for a DTensor, its mesh and placements."""
    info: dict[str, Any] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype).replace("torch.", "")}
    if isinstance(leaf, DTensor):
        mesh = leaf.device_mesh
        info["mesh"] = {"shape": list(mesh.mesh.shape), "axes": list(mesh.mesh_dim_names or ())}
        info["placements"] = [repr(p) for p in leaf.placements]
    return info


def new_manifest(step: int, structure: Any, flat: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The manifest of a save of `flat` (checksums are added at commit, once the files exist)."""
    tensors = {key: describe_leaf(leaf) for key, leaf in flat.items() if isinstance(leaf, torch.Tensor)}
    values = {key: leaf for key, leaf in flat.items() if type(leaf) in JSON_TYPES}
    objects = [key for key in flat if key not in tensors and key not in values]
    return {"format": FORMAT, "step": step, "time": None, "world_size": world_size, "versions": _versions(),
            "structure": structure, "tensors": tensors, "values": values, "objects": objects,
            "checksum": CHECKSUM, "files": {}}


def _digest(path: Path) -> str:
    h = hashlib.new(CHECKSUM)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(tmp: Path, manifest: dict[str, Any]) -> None:
    """Checksum every file DCP wrote into `tmp`, then write the manifest there and fsync it and the directory."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {**manifest, "time": time.time(),
                "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, CHECKSUM: _digest(p)} for p in files}}
    path = tmp / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final` (the commit); an existing `final` is replaced."""
    old = None
    if final.exists():
        # Renamed aside first, so a crash between the two renames never leaves a half-deleted committed step.
        old = final.with_name(f"{final.name}{TMP_MARK}replaced-{os.getpid()}")
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except FileNotFoundError:
        # Between the two renames another process's `recover` (a reader's restore()) committed this very copy,
        # the newest of the step's complete copies: done.
        if not (final / MANIFEST).is_file():
            raise
    _fsync(final.parent)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Delete a step directory: renamed to a temporary name first, so a crash midway leaves no broken step."""
    import shutil

    if TMP_MARK not in path.name:
        doomed = path.with_name(f"{path.name}{TMP_MARK}deleting-{os.getpid()}")
        os.rename(path, doomed)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a committed step directory; CheckpointError if it is missing or unreadable."""
    path = directory / MANIFEST
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: {directory} is not a committed checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable or corrupt: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest")
    return manifest


def verify(directory: Path, manifest: dict[str, Any]) -> None:
    """Check that every file the manifest lists exists with its size and checksum; CheckpointError naming the file."""
    algorithm = manifest.get("checksum", CHECKSUM)
    for name, info in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (listed in {directory / MANIFEST})")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, the manifest says {info['bytes']} "
                                  f"(truncated or overwritten)")
        if algorithm != CHECKSUM or _digest(path) != info[CHECKSUM]:
            raise CheckpointError(f"checkpoint file {path} fails its {algorithm} checksum (corrupt)")

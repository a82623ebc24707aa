"""`CheckpointManager`: asynchronous, atomic, resharding checkpoints of any pytree, on torch.distributed.checkpoint."""

from __future__ import annotations

import atexit
import operator
import os
import sys
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from pt3func.checkpointing import keys
from pt3func.checkpointing import manifest as mf
from pt3func.checkpointing.errors import CheckpointError
from pt3func.checkpointing.per_rank import check_plain_leaves_agree
from pt3func.runtime.donated import donated_to, is_donated
from pt3func.tree import NAMESPACE, PyTree

# DCP warns on every single-process save and load; saving without a process group is what we mean there.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming",
                        category=UserWarning)


# The async saves no wait() has collected yet: {their commit's future: (step, directory)}. At exit, one that failed
# is reported on stderr (`_report_unwaited`): an async save left in flight while the process group is destroyed
# fails in the background thread, and nothing else would ever say so.
_UNWAITED: dict[Future, tuple[int, Path]] = {}


def _report_unwaited() -> None:
    """At interpreter exit (after the writer threads are joined): name every async save that never committed."""
    for future, (step, directory) in list(_UNWAITED.items()):
        error = future.exception()  # done by now: the executor's threads are joined before atexit runs
        if error is not None:
            sys.stderr.write(
                f"pt3func: the async checkpoint save of step {step} into {directory} did NOT commit: "
                f"{type(error).__name__}: {error}\n  Call CheckpointManager.wait() before exiting and before "
                f"torch.distributed.destroy_process_group(): the save's write runs in the background on that "
                f"process group.\n")
    _UNWAITED.clear()


atexit.register(_report_unwaited)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _virtual_mesh(leaves: Any) -> Any:
    """The virtual mesh whose arrays are among `leaves`, or None (plain tensors, DTensors of a real world)."""
    from pt3func.runtime.virtual import VirtualArray

    return next((leaf.mesh for leaf in leaves if isinstance(leaf, VirtualArray)), None)


class CheckpointManager:
    """Numbered checkpoints of a pytree in `directory/step_N/`, written by DCP, committed atomically.

    `save(step, tree)` writes every tensor leaf (plain or DTensor: each rank writes its own shards) with
    `torch.distributed.checkpoint`; other leaves (ints, floats, strings) go into the step's `manifest.json`,
    anything else into DCP's object storage. With `async_save=True` a save copies the tensors to memory and
    returns; the write, the checksums and the commit run in a background thread, so training goes on
    (call `wait()` before exiting). One save is in flight at a time: the next `save` first waits for it.
    `max_to_keep` committed steps are kept (None: all).

    Save, restore and wait are collective on a multi-rank job (every rank calls them, in the same order);
    they use a process group of their own, so a background write never interleaves with training's
    collectives. `directory` must be one directory all ranks see (rank 0 commits).

    `before_commit(step, tmp_dir)`, if given, runs on rank 0 after every rank's data is written and before
    the manifest and the rename: a hook for fault drills (kill the process there) and tests.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, async_save: bool = True, *,
                 before_commit: Callable[[int, Path], None] | None = None) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 (or None to keep every step), got {max_to_keep}")
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self._before_commit = before_commit
        self._group: dist.ProcessGroup | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pt3func-checkpoint")
        self._pending: tuple[int, Future] | None = None
        self._virtual: tuple[Any, list[CheckpointManager]] | None = None  # a virtual mesh, its rank threads' managers

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
                f"async_save={self.async_save})")

    def __copy__(self) -> CheckpointManager:
        # The manager itself: it is a handle on its directory, whose saves it orders (one in flight at a time)
        # and prunes; a second manager of the same directory would race the first. `copy.deepcopy` of a trainer
        # holding one (a snapshot, an EMA copy) then shares it, rather than failing on its background thread.
        return self

    def __deepcopy__(self, memo: dict) -> CheckpointManager:
        return self  # see __copy__

    def __reduce__(self) -> tuple:
        # Pickle would fail on "cannot pickle '_queue.SimpleQueue'" (its background thread), naming nothing of ours.
        raise TypeError(f"{self!r} cannot be pickled: it owns a background writer thread and a process group of "
                        f"this process; make a new one where it is needed: CheckpointManager({str(self.directory)!r}, "
                        f"max_to_keep={self.max_to_keep}, async_save={self.async_save})")

    def _rank_managers(self, mesh: Any) -> list[CheckpointManager]:
        """One synchronous manager of this directory per rank thread of a virtual mesh (made in that thread, so
        its process group is of that rank's world)."""
        self.wait()
        if self._virtual is None or self._virtual[0] is not mesh:
            self._virtual = (mesh, mesh.run(lambda rank: CheckpointManager(
                self.directory, self.max_to_keep, async_save=False, before_commit=self._before_commit)))
        return self._virtual[1]

    # -- queries (local: no collective) --

    def all_steps(self) -> list[int]:
        """The committed steps, ascending (unfinished or crashed saves are not among them)."""
        return mf.committed_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save --

    def save(self, step: int, tree: PyTree) -> None:
        """Checkpoint `tree` as `step`; returns once the tensors are copied (async) or committed (sync).

        A tree of a virtual mesh's arrays is saved by every rank thread, each writing its own shards, as the
        processes of a real world do; such a save is synchronous (the rank threads' worlds do not reach a
        background thread).
        """
        original = step
        try:
            step = -1 if isinstance(step, bool) else operator.index(step)  # an int, numpy's included
        except TypeError:
            step = -1
        if step < 0:
            raise CheckpointError(f"a checkpoint step is an int >= 0, got {original!r}")
        flat, structure = keys.flatten(tree)
        mesh = _virtual_mesh(flat.values())
        if mesh is not None:
            from pt3func.runtime.virtual import scatter_tree

            ranks = self._rank_managers(mesh)
            mesh.run(lambda rank: ranks[rank].save(step, scatter_tree(tree, rank)))
            return
        self.wait()
        _check_storable(flat)
        latest = self._rank0(self._scan, f"reading {self.directory}")  # rank 0's disk decides
        if latest is not None and step < latest:
            # Steps are ordered by number (latest_step, restore(), max_to_keep): an older one saved after a newer
            # one would be pruned at once or shadowed by the newer one.
            raise CheckpointError(
                f"step {step} is older than the latest committed step {latest} in {self.directory}; delete the "
                f"newer steps' directories (step_N) first, or save into another directory"
            )
        world = dist.get_world_size() if _distributed() else 1
        if world > 1:  # plain leaves are written once: refuse per-rank values before anything is written
            check_plain_leaves_agree(step, flat, self._ckpt_group())
        manifest = mf.new_manifest(int(step), structure, flat, world)
        state_dict = {key: _unshared_scalar(leaf) for key, leaf in flat.items() if key not in manifest["values"]}
        token = self._rank0(self._prepare, f"preparing {self.directory} for step {step}")  # one temp dir for all
        tmp = self.directory / f"step_{step}{mf.TMP_MARK}{token}"
        options: dict[str, Any] = {"storage_writer": dcp.FileSystemWriter(tmp), "process_group": self._ckpt_group(),
                                   "no_dist": not _distributed()}
        if self.async_save:
            try:
                written = dcp.async_save(state_dict, **options)  # stages (copies) the tensors before it returns
            except _FAILURES as e:  # a staging failure: raised by wait() as a CheckpointError, as a sync save's is
                failed: Future = Future()
                failed.set_exception(e)
                self._pending = (int(step), failed)
                self.wait()
            else:
                self._pending = (int(step), self._executor.submit(self._commit, written, tmp, manifest))
                _UNWAITED[self._pending[1]] = (int(step), self.directory)
        else:
            done: Future = Future()
            try:
                dcp.save(state_dict, **options)
                self._commit(None, tmp, manifest)
                done.set_result(None)
            except _FAILURES as e:  # raised by wait(), the same way on every rank
                done.set_exception(e)
            self._pending = (int(step), done)
            self.wait()

    def _scan(self) -> int | None:
        """Rank 0, no save in flight: bring back a step a crash left only as a complete temporary directory, then
        the latest committed step."""
        mf.recover(self.directory)
        return self.latest_step()

    def _prepare(self) -> str:
        """Rank 0, no save in flight: make the directory, delete what crashed saves left; the new save's token."""
        self.directory.mkdir(parents=True, exist_ok=True)
        # No recover() here: `_scan`, run just before in the same save, brought back any complete copy a crashed
        # re-save left, so what is left to delete is only what crashed saves left unfinished.
        for stale in mf.tmp_dirs(self.directory):
            mf.remove(stale)
        return uuid.uuid4().hex

    def _commit(self, written: Future | None, tmp: Path, manifest: dict[str, Any]) -> None:
        """Runs once this rank's write finished; on rank 0 (whose write finishes last: DCP gathers every
        rank's results there before writing its metadata) checksum, write the manifest, rename, prune."""
        if written is not None:
            written.result()
        if self._rank() != 0:
            return
        step = manifest["step"]
        if self._before_commit is not None:
            self._before_commit(step, tmp)
        mf.write_manifest(tmp, manifest)
        mf.commit(tmp, mf.step_dir(self.directory, step))
        if self.max_to_keep is not None:
            for old in self.all_steps()[:-self.max_to_keep]:
                mf.remove(mf.step_dir(self.directory, old))

    def wait(self) -> None:
        """Block until the save in flight is committed on every rank; raise CheckpointError if it failed."""
        if self._pending is None:
            return
        step, pending = self._pending
        self._pending = None
        _UNWAITED.pop(pending, None)
        try:
            pending.result()
            error = None
        except _FAILURES as e:  # noqa: BLE001 - reported to every rank below
            error = f"rank {self._rank()}: {type(e).__name__}: {e}"
        errors = [error]
        if _distributed():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error, group=self._ckpt_group())
        failed = [e for e in errors if e is not None]
        if failed:
            raise CheckpointError(f"saving step {step} into {self.directory} failed ({'; '.join(failed)}); the "
                                  f"previous checkpoint ({self.latest_step()}) is untouched")

    # -- restore --

    def restore(self, step: int | None = None, target: PyTree = None, *, fallback: bool = False,
                verify: bool = True) -> PyTree:
        """Load a committed step (default: the latest) as a pytree.

        With `target`, the result has the target's structure and each tensor the target leaf's layout:
        a DTensor leaf gives a DTensor of its mesh and placements (DCP reshards from whatever layout and
        world size wrote it), a plain tensor gives the full value (on every rank). Only the target's keys
        are read, so a target may be a part of the saved tree. Without `target`, the saved structure comes
        back (namedtuples by their class, when it still imports) with every tensor full and plain on CPU.

        `verify` checks every file against the manifest's checksums first (CheckpointError naming the
        file); with `fallback` and `step=None`, a step that fails is skipped with a warning for the one
        before it. Collective on a multi-rank job. A target of a virtual mesh's arrays is restored by every rank
        thread into its own shards, and comes back as virtual arrays.
        """
        mesh = None if target is None else _virtual_mesh(keys.flatten(target)[0].values())
        if mesh is not None:
            from pt3func.runtime.virtual import VirtualArray, scatter_tree

            ranks = self._rank_managers(mesh)
            per_rank = mesh.run(lambda rank: ranks[rank].restore(
                step, scatter_tree(target, rank), fallback=fallback, verify=verify))
            # Only the target's virtual arrays come back as virtual arrays; a plain tensor stays plain (rank 0's;
            # every rank restored the same full value), as each process of a real world gets one.
            virtual_at = [isinstance(leaf, VirtualArray) for leaf in _leaves(target)]
            leaves, spec = optree.tree_flatten(per_rank[0], none_is_leaf=False, namespace=NAMESPACE)
            per_rank_leaves = [_leaves(tree) for tree in per_rank]
            return optree.tree_unflatten(spec, [
                VirtualArray(mesh, [rank_leaves[i] for rank_leaves in per_rank_leaves]) if virtual else leaf
                for i, (leaf, virtual) in enumerate(zip(leaves, virtual_at, strict=True))
            ])
        self.wait()
        choice = self._rank0(lambda: self._choose(step, fallback, verify),
                             f"choosing the checkpoint to restore from {self.directory}")
        if isinstance(choice, str):
            raise CheckpointError(choice)
        chosen, manifest = choice
        directory = mf.step_dir(self.directory, chosen)
        tensors, values = manifest["tensors"], manifest["values"]
        if target is None:
            wanted = list(tensors) + list(manifest["objects"])
            state_dict = {key: _empty(tensors[key]) if key in tensors else None for key in wanted}
        else:
            wanted, spec = keys.keys_and_spec(target)
            state_dict = {key: self._target_slot(key, leaf, manifest, directory)
                          for key, leaf in zip(wanted, optree.tree_leaves(target, none_is_leaf=False,
                                                                          namespace=NAMESPACE))
                          if key not in values}
        try:
            dcp.load(state_dict, storage_reader=dcp.FileSystemReader(directory), process_group=self._ckpt_group(),
                     no_dist=not _distributed())
        except _FAILURES as e:
            raise CheckpointError(f"loading {directory} failed: {type(e).__name__}: {e}") from e
        loaded = {**values, **state_dict}
        if target is None:
            return keys.unflatten(manifest["structure"], loaded)
        return optree.tree_unflatten(spec, [loaded[key] for key in wanted])

    @staticmethod
    def _target_slot(key: str, leaf: Any, manifest: dict[str, Any], directory: Path) -> Any:
        """What DCP loads `key` into: a tensor laid out like the target leaf, or a placeholder for an object."""
        if key in manifest["objects"]:
            return None
        info = manifest["tensors"].get(key)
        if info is None:
            held = ", ".join(sorted(manifest["tensors"]) + sorted(manifest["values"]))
            raise CheckpointError(f"the target's leaf {key!r} is not in checkpoint {directory} (it holds: {held})")
        if not isinstance(leaf, torch.Tensor):
            return _empty(info)
        _refuse_donated(key, leaf, "restore into")
        if list(leaf.shape) != info["shape"]:
            raise CheckpointError(f"the target's leaf {key!r} has shape {tuple(leaf.shape)} but checkpoint "
                                  f"{directory} saved {tuple(info['shape'])}")
        dtype = str(leaf.dtype).removeprefix("torch.")
        if dtype != info["dtype"]:  # DCP would cast silently (float -> int truncates, int64 -> float32 rounds)
            raise CheckpointError(f"the target's leaf {key!r} is {dtype} but checkpoint {directory} saved "
                                  f"{info['dtype']}; restore without a target (or with one of that dtype) and cast")
        if leaf.is_meta:
            if isinstance(leaf, DTensor):
                raise CheckpointError(f"the target's leaf {key!r} is a DTensor on the meta device (no data): DCP "
                                      f"cannot load its shards there; make the target's DTensors on the mesh's device")
            # A shape-only target (made on the meta device, as jax.eval_shape's): the value comes back on the CPU.
            return _empty(info)
        return torch.empty_like(leaf)  # a DTensor stays a DTensor of the same mesh and placements

    def _choose(self, step: int | None, fallback: bool, verify: bool) -> tuple[int, dict[str, Any]] | str:
        """Rank 0's pick of the step to load and its manifest, or the message of why there is none."""
        mf.recover(self.directory)
        steps = self.all_steps()
        if step is not None and step not in steps:
            return f"no committed checkpoint for step {step} in {self.directory} (committed: {steps})"
        candidates = [step] if step is not None else steps[::-1]
        if not candidates:
            return f"no committed checkpoint in {self.directory}"
        for candidate in candidates:
            directory = mf.step_dir(self.directory, candidate)
            try:
                manifest = mf.read_manifest(directory)
                if verify:
                    mf.verify(directory, manifest)
                return candidate, manifest
            except (CheckpointError, OSError, KeyError, TypeError, ValueError) as e:
                # A manifest of the right format but missing fields, or a file that cannot be read: this step's fault.
                why = str(e) if isinstance(e, CheckpointError) else f"{directory}: {type(e).__name__}: {e}"
                if step is not None or not fallback:
                    return why
                warnings.warn(f"skipping checkpoint step {candidate}: {why}", stacklevel=5)
        return f"no loadable checkpoint in {self.directory}: every committed step failed its checks"

    # -- process group --

    def _rank(self) -> int:
        return dist.get_rank() if _distributed() else 0

    def _ckpt_group(self) -> dist.ProcessGroup | None:
        # A gloo group of our own: DCP's background thread runs collectives on it while the training thread
        # runs its own on the default group; sharing one group would interleave them differently per rank.
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _rank0(self, section: Callable[[], Any], doing: str) -> Any:
        """`section()` run on rank 0 (its file work), its result on every rank.

        If it raises (a directory path that is a file, permission denied, a full disk), every rank raises a
        CheckpointError naming `doing` and the cause: the other ranks wait in the broadcast that follows, and would
        otherwise sit there until the collective timeout while rank 0 alone reports the error.
        """
        outcome: tuple[bool, Any] | None = None
        cause = None
        if self._rank() == 0:
            try:
                outcome = (True, section())
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                cause = e
                outcome = (False, f"{doing} failed on rank 0: {type(e).__name__}: {e}")
        ok, value = self._broadcast(outcome)
        if not ok:
            raise CheckpointError(value) from cause
        return value

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not _distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ckpt_group())
        return box[0]


# DCP raises its CheckpointException, a BaseException (not an Exception), for a failure on any rank.
_FAILURES = (Exception, CheckpointException)


def _leaves(tree: PyTree) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=False, namespace=NAMESPACE)


def _check_storable(flat: dict[str, Any]) -> None:
    """Refuse, naming the key, tensors DCP cannot write (it fails while staging them, naming nothing)."""
    for key, leaf in flat.items():
        if not isinstance(leaf, torch.Tensor):
            continue
        _refuse_donated(key, leaf, "save")
        if isinstance(leaf, DTensor) and any(p.is_partial() for p in leaf.placements):
            raise CheckpointError(
                f"the leaf {key!r} is a DTensor with a Partial placement ({list(leaf.placements)}): its value is a sum "
                f"of the ranks' pending parts, which a checkpoint cannot hold; save x.redistribute(placements="
                f"[Replicate() or Shard(d) per axis]) or pf.device_get(x) instead"
            )
        if leaf.layout != torch.strided or leaf.is_meta:
            what = "a meta tensor (no data)" if leaf.is_meta else f"a {leaf.layout} tensor"
            hint = "" if leaf.is_meta else "; save x.to_dense() (or its indices and values) instead"
            raise CheckpointError(f"the leaf {key!r} is {what}, which a checkpoint cannot hold{hint}")


def _refuse_donated(key: str, leaf: torch.Tensor, doing: str) -> None:
    if is_donated(leaf):
        raise CheckpointError(
            f"cannot {doing} the leaf {key!r}: it was donated to {donated_to(leaf)}, whose outputs now fill its "
            f"buffer; {doing} the tree of values the step returned instead (e.g. `params, opt_state = step(...)`)"
        )


def _unshared_scalar(leaf: Any) -> Any:
    # DCP's stager copies every tensor but the 0-d ones, which reach the background writer as they are
    # (torch 2.13, `_state_dict_utils`): a donated step would overwrite them mid-write. Copy them here.
    return leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.ndim == 0 else leaf


def _empty(info: dict[str, Any]) -> torch.Tensor:
    return torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))

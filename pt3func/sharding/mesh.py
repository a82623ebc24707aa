"""`Mesh`: named axes over the torch.distributed world (a `DeviceMesh` plus the groups pf.lax needs)."""

from __future__ import annotations

import atexit
import itertools
import math
import os
import threading
import weakref
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pt3func.errors import ShardingError

AxisNames = str | tuple[str, ...]


class Mesh:
    """Named axes over every rank of the world: `Mesh(dp=2, tp=4)` is a 2 x 4 grid of ranks, row-major.

    Wraps a torch `DeviceMesh` (`.device_mesh`). A tuple of axis names, e.g. `("dp", "tp")`, stands for
    the axes flattened together in mesh order (one group spanning both).
    """

    def __init__(self, device_mesh: DeviceMesh, *, virtual: bool = False) -> None:
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ShardingError(f"a pt3func Mesh needs named axes; {device_mesh} has none")
        self.device_mesh = device_mesh
        self.axis_names: tuple[str, ...] = tuple(names)
        self.shape: tuple[int, ...] = tuple(device_mesh.mesh.shape)
        self.device_type: str = device_mesh.device_type
        self.virtual = virtual
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._world = dist.group.WORLD  # a cached mesh is stale once its world is destroyed
        # make_mesh's meshes are arange(world) reshaped: the world group lists their ranks in mesh order.
        self._is_world = device_mesh.mesh.flatten().tolist() == list(range(dist.get_world_size()))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        axes = ", ".join(f"{name}={size}" for name, size in zip(self.axis_names, self.shape))
        virtual = ", virtual=True" if self.virtual else ""
        return f"Mesh({axes}, device_type={self.device_type!r}{virtual})"

    def __copy__(self) -> Mesh:
        # The mesh itself: a copy would hold the same process groups under another identity, and shardings
        # compare their meshes by identity (a NamedSharding on the copy would not equal one on the original).
        return self

    def __deepcopy__(self, memo: dict) -> Mesh:
        # As __copy__: copy.deepcopy of a model or trainer holding a mesh (or a NamedSharding) keeps the mesh;
        # its process groups cannot be copied anyway.
        return self

    def __reduce__(self) -> tuple:
        # Without this, pickle fails deep inside on "cannot pickle 'ProcessGroup'", naming no pt3func object.
        if self.virtual:
            raise TypeError(f"{self!r} cannot be pickled: its ranks are threads of this process; make it again "
                            "with pf.make_mesh(..., virtual=True) where it is needed")
        raise TypeError(f"{self!r} cannot be pickled: it holds this process's process groups, which exist only in "
                        "this process and its world; rebuild it with pf.make_mesh(shape, axis_names) where it is "
                        "needed (copy.copy / copy.deepcopy return the mesh itself)")

    def axes(self, axis_name: AxisNames) -> tuple[str, ...]:
        """`axis_name` as a tuple of known, distinct axis names (in the order given)."""
        names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        for name in names:
            if name not in self.axis_names:
                raise ShardingError(f"unknown mesh axis {name!r}; {self!r} has axes {self.axis_names}")
        if len(set(names)) != len(names):
            raise ShardingError(f"axis names {names} repeat an axis")
        return names

    def in_mesh_order(self, axis_name: AxisNames) -> tuple[str, ...]:
        """The named axes sorted into mesh order."""
        names = self.axes(axis_name)
        return tuple(name for name in self.axis_names if name in names)

    def axis_size(self, axis_name: AxisNames) -> int:
        """Number of ranks along the axis (the product of the sizes for a tuple of axes)."""
        return math.prod(self.shape[self.axis_names.index(name)] for name in self.axes(axis_name))

    def axis_index(self, axis_name: AxisNames) -> int:
        """This rank's coordinate along the axis; for a tuple, row-major over the axes in the order given."""
        index = 0
        for name in self.axes(axis_name):
            index = index * self.axis_size(name) + self.device_mesh.get_local_rank(name)
        return index

    def group(self, axis_name: AxisNames) -> dist.ProcessGroup:
        """The process group of this rank's line (plane, ...) along the axes; group rank = mesh-order index."""
        names = self.in_mesh_order(axis_name)
        if len(names) == 1:
            return self.device_mesh.get_group(names[0])
        if names == self.axis_names and self._is_world:
            return dist.group.WORLD
        if names not in self._groups:
            self._groups[names] = self._new_group(names)
        return self._groups[names]

    def group_name(self, axis_name: AxisNames) -> str:
        """The name of `group(axis_name)`, as the `_c10d_functional` ops take it."""
        return self.group(axis_name).group_name

    def _new_group(self, names: tuple[str, ...]) -> dist.ProcessGroup:
        # Collective over the whole world: every rank creates every group of the partition.
        dims = [self.axis_names.index(name) for name in names]
        others = [d for d in range(self.ndim) if d not in dims]
        ranks = self.device_mesh.mesh.permute(*others, *dims).reshape(-1, self.axis_size(names))
        group, _ = dist.new_subgroups_by_enumeration(ranks.tolist())
        return group

    def create_groups(self) -> None:
        """Create the groups of every multi-axis tuple now (collective), so later use needs no collective.

        Runs of adjacent axes are also flattened in DTensor's own registry (`DeviceMesh._flatten`): DTensor then
        reduces a value pending over several axes (the gradient of a parameter replicated over dp and tp) with
        one collective over the flattened axes instead of one per axis (torch 2.13; 2.11 ignores them)."""
        for count in range(2, self.ndim):
            for names in itertools.combinations(self.axis_names, count):
                self.group(names)
        for start in range(self.ndim - 1):
            for stop in range(start + 2, self.ndim + 1):
                names = self.axis_names[start:stop]
                self.device_mesh[names]._flatten("+".join(names))


_MESHES: weakref.WeakValueDictionary[int, Mesh] = weakref.WeakValueDictionary()
_MAKE_MESH_CACHE: dict[tuple, Mesh] = {}


def known_meshes() -> list[Mesh]:
    """Every Mesh alive in this process (made by `make_mesh` or wrapping a DeviceMesh), each once."""
    return list({id(m): m for m in [*_MESHES.values(), *_MAKE_MESH_CACHE.values()]}.values())


def mesh_of(device_mesh: DeviceMesh) -> Mesh:
    """The `Mesh` wrapping `device_mesh` (the one `make_mesh` built, or a new wrapper for a foreign one)."""
    mesh = _MESHES.get(id(device_mesh))
    if mesh is None or mesh.device_mesh is not device_mesh:
        mesh = Mesh(device_mesh)
        _MESHES[id(device_mesh)] = mesh
    return mesh


def _backend_for(device_type: str | None) -> str:
    """gloo for a CPU mesh, else NCCL where CUDA is available. A local rank without a GPU of its own is refused:
    torch's "invalid device ordinal" names neither the cause nor the way out."""
    if device_type == "cpu" or not torch.cuda.is_available():
        return "gloo"
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:
        raise ShardingError(
            f"local rank {local_rank} has no GPU of its own: torch sees {gpus} CUDA device(s) on this node. "
            f"Launch at most {gpus} process(es) per node, or run on the CPU with gloo: "
            f"make_mesh(..., device_type='cpu') (or CUDA_VISIBLE_DEVICES= for the whole job)")
    return "nccl"


def _as_timedelta(timeout: Any) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise ShardingError(f"make_mesh: timeout must be a datetime.timedelta or a number of seconds > 0, got "
                        f"{timeout!r}")


def _ensure_world(timeout: timedelta | None, device_type: str | None = None) -> None:
    """Start the default process group if nobody has: from torchrun variables, else a world of one.

    `timeout=None` leaves torch's own default (30 min for gloo, 10 min for NCCL): a shorter one kills a job whose
    ranks legitimately wait for one another, e.g. for rank 0's evaluation between two steps.
    """
    if dist.is_initialized():
        return
    backend = _backend_for(device_type)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # No launcher: a single rank needs no rendezvous, so an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # pt3func started the world, so it ends it: left to interpreter teardown, gloo's worker threads can still
    # hold work objects whose destruction aborts the process ("terminate called without an active exception",
    # pytorch/pytorch#190489), seen as a rare exit status -6 of a finished 2-rank run.
    atexit.register(_shutdown_world)


def _shutdown_world() -> None:
    """Destroy the default process group at exit if it is still there (a no-op after the user's own call).

    On gloo every rank first waits for the others (a monitored barrier: its 60 s bound holds on rank 0 only, torch's
    other ranks wait for rank 0 as long as the group's timeout, so a rank still inside a collective keeps its peers
    here that long): a rank that tears its connections down while a peer still completes the last collective makes that
    peer's gloo thread abort the process. Not after an uncaught exception: the peers may be stuck elsewhere.
    """
    import sys

    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1 and getattr(sys, "last_value", None) is None:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        except RuntimeError:
            pass  # a peer did not arrive: tear down anyway
    dist.destroy_process_group()


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() and "nccl" in str(dist.get_backend()) else "cpu"


def make_mesh(
    shape: tuple[int, ...],
    axis_names: AxisNames,
    *,
    device_type: str | None = None,
    virtual: bool = False,
    timeout: timedelta | float | None = None,
) -> Mesh:
    """A mesh of `shape` with named axes over the torch.distributed world.

    Starts the default process group when none is running: from torchrun's variables (RANK, WORLD_SIZE,
    MASTER_ADDR, ...), NCCL if CUDA is available (one GPU per local rank) else gloo, gloo for
    `device_type='cpu'`; without a launcher, a world of one. `timeout` is that
    group's collective timeout (None: torch's default, 30 min for gloo, 10 min for NCCL); it has no effect on a
    world that is already running. On a virtual mesh it bounds how long ranks may still run once another rank has
    finished a job (None: no bound); an error on one rank stops the others at once either way. The mesh must cover
    the world exactly. Collective: every rank calls it with the same arguments. Calling it again with the same
    arguments returns the same `Mesh`.
    `axis_names` is a tuple of names, one per axis; a single str names the one axis of a 1-D mesh. `timeout` is
    a `timedelta` or a number of seconds.
    """
    timeout = _as_timedelta(timeout)
    shape = tuple(int(s) for s in shape)
    axis_names = _axis_name_tuple(shape, axis_names)
    if len(shape) != len(axis_names):
        raise ShardingError(f"mesh shape {shape} has {len(shape)} axes but axis_names {axis_names} name "
                            f"{len(axis_names)}")
    if len(set(axis_names)) != len(axis_names) or not all(isinstance(n, str) for n in axis_names):
        raise ShardingError(f"axis_names {axis_names} must be distinct strings")
    if any(s < 1 for s in shape):
        raise ShardingError(f"mesh shape {shape} must be positive")
    if virtual:
        from pt3func.runtime.virtual import VirtualMesh, in_rank_thread

        if not in_rank_thread():
            return VirtualMesh(shape, axis_names, device_type or "cpu", timeout)
        virtual = False
    _ensure_world(timeout, device_type)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ShardingError(f"mesh shape {shape} has {math.prod(shape)} devices but the world has {world} "
                            f"ranks; launch {math.prod(shape)} processes (`pt3func run -n {math.prod(shape)}`) "
                            f"or pick a mesh of size {world}")
    device_type = device_type or _default_device_type()
    key = (shape, axis_names, device_type, virtual)
    cached = _MAKE_MESH_CACHE.get(key)
    if cached is not None and cached._world is dist.group.WORLD:
        return cached
    mesh = Mesh(init_device_mesh(device_type, shape, mesh_dim_names=axis_names), virtual=virtual)
    mesh.create_groups()
    _MESHES[id(mesh.device_mesh)] = mesh
    _MAKE_MESH_CACHE[key] = mesh
    return mesh


def _axis_name_tuple(shape: tuple[int, ...], axis_names: AxisNames) -> tuple[str, ...]:
    """`axis_names` as a tuple; a str is one axis's name, never a sequence of one-letter names."""
    if not isinstance(axis_names, str):
        return tuple(axis_names)
    if len(shape) != 1:
        # tuple("dp") would be ("d", "p"): a 2-D mesh with axes nobody named.
        raise ShardingError(f"axis_names {axis_names!r} is a single str, which names one axis, but mesh shape {shape} "
                            f"has {len(shape)}; pass a tuple of {len(shape)} names, one per axis")
    return (axis_names,)


# The current mesh: each thread's (and asyncio task's) own, in a ContextVar, set by `pf.set_mesh` in either form.
# A thread that never set one follows the main thread's current mesh: `pf.set_mesh(m)` and then a step called from a
# thread pool or a DataLoader thread sees `m` (a new thread starts with an empty context). Only the main thread
# writes that fallback, so threads entering and leaving their own `with pf.set_mesh(...)` blocks cannot change
# it, nor another thread's mesh (a process-wide default that every `set_mesh` call wrote, with `__enter__` undoing
# it for the `with` form, let overlapping `with` blocks of two threads leave the default on a wrong mesh for good).
_UNSET = object()
_CURRENT: ContextVar = ContextVar("pt3func_mesh", default=_UNSET)
_MAIN_THREADS_MESH: Mesh | None = None


class set_mesh:  # noqa: N801 - used like a function
    """Make `mesh` the current mesh of this thread. Works as a setter (`pf.set_mesh(m)`) and as a context manager
    (`with pf.set_mesh(m): ...` restores the previous mesh on exit). Threads that set no mesh of their own (a thread
    pool's, a DataLoader's) use the main thread's current mesh."""

    def __init__(self, mesh: Mesh | None) -> None:
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"set_mesh expects a pf.Mesh (from pf.make_mesh), got {type(mesh).__name__}")
        self._mesh = mesh
        self._token = _CURRENT.set(mesh)
        _publish_main_threads_mesh()

    def __enter__(self) -> Mesh | None:
        return self._mesh

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)
        _publish_main_threads_mesh()


def _publish_main_threads_mesh() -> None:
    global _MAIN_THREADS_MESH
    if threading.current_thread() is threading.main_thread():
        mesh = _CURRENT.get()
        _MAIN_THREADS_MESH = None if mesh is _UNSET else mesh


def get_mesh() -> Mesh | None:
    """The current mesh (from `set_mesh`) of this thread, else the main thread's, else None."""
    mesh = _CURRENT.get()
    return _MAIN_THREADS_MESH if mesh is _UNSET else mesh

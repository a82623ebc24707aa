"""The virtual mesh: every rank of a mesh simulated inside one process, with real collective semantics.

Each rank is a worker thread with its own torch.distributed world, joined through torch's threaded
process group (the one torch's own DTensor tests use). A rank thread runs exactly the code a process of
a multi-process world runs — device_put, the traced per-rank program, its collectives — so a virtual
run equals a multi-process run. Values live in the rank threads: the main thread holds `VirtualArray`
handles (one DTensor per rank) and `device_get` gathers them into full tensors.

A process that uses a virtual mesh cannot also join a real torch.distributed world.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import numbers
import operator
import os
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pt3func import tree
from pt3func.errors import ShardingError
from pt3func.runtime.rank_generators import RankGenerators, drawing_as_rank
from pt3func.sharding.mesh import Mesh

# In a rank thread: .rank; while it runs a job, .world (the VirtualWorld it belongs to) and .mesh (the VirtualMesh)
_LOCAL = threading.local()


# One job at a time, over every virtual world of the process. Two threads running jobs on one world at once would
# take each other's results from its results queue (and interleave their collectives); on two worlds at once their
# collectives would meet: torch's threaded process groups pair a collective's ranks by group name in one registry
# of the process (`ProcessLocalGroup._cur_coll_on_pgs`), and every world names its groups alike ("0", "1", ...).
_RUN_LOCK = threading.Lock()
_CALLER = threading.local()  # .running: this thread holds _RUN_LOCK


class VirtualWorld:
    """N rank threads, each in a threaded torch.distributed world of size N.

    The rank threads hold only their queues, never the world itself: once nothing refers to the world (its mesh,
    the arrays on it, the steps compiled for it), a finalizer stops them, and each tears down its process groups,
    so a dropped virtual mesh frees its threads and what they held."""

    _installed = False
    # Set in a forked child (`_after_fork`): the rank threads are the parent's, and a job would wait for them forever.
    _forked = False

    def __init__(self, size: int, timeout: timedelta | None = None) -> None:
        _install()
        self.size = size
        # make_mesh's collective timeout: how long the ranks still running may take once another rank is done
        # (see `_wait`). None: no limit, as before.
        self.timeout = timeout
        self._generators = RankGenerators(size)
        self._store = dist.HashStore()
        self._jobs: list[queue.Queue] = [queue.Queue() for _ in range(size)]
        self._threads = [
            threading.Thread(
                target=_serve, args=(rank, self._jobs[rank]), name=f"pt3func-virtual-rank{rank}", daemon=True,
            )
            for rank in range(size)
        ]
        # Not at interpreter exit: the daemon threads die with the process, and tearing down process groups while
        # the interpreter shuts down could fail in ways nobody can act on.
        weakref.finalize(self, _stop, self._jobs, self._threads).atexit = False
        _WORLDS.add(self)
        # Each rank's init_process_group wraps the process's sys.excepthook to prefix "[rankN]:" to tracebacks;
        # in one process that stacks N prefixes per virtual mesh on every later uncaught error. Keep the user's.
        excepthook = sys.excepthook
        store = self._store
        try:
            for t in self._threads:
                t.start()
            # Joined as a job, so under _RUN_LOCK: no other world's collectives run meanwhile.
            extra = {} if timeout is None else {"timeout": timeout}
            self.run(lambda rank: dist.init_process_group("threaded", rank=rank, world_size=size, store=store, **extra))
        finally:
            sys.excepthook = excepthook

    def run(self, job: Callable[[int], Any]) -> list[Any]:
        """Run `job(rank)` on every rank thread at once; return the results in rank order.

        An exception on any rank is raised here (the lowest rank's): ranks run the same program, so an error
        in tracing or sharding is raised by all of them alike; an error on one rank only stops the others (see
        `_wait`). Callers are served one at a time (see _RUN_LOCK).
        """
        if self._forked:
            raise ShardingError(_forked_message(f"a virtual mesh of {self.size} ranks"))
        if in_rank_thread() or getattr(_CALLER, "running", False):
            # A rank thread: its world's job is running (this thread is part of it), so waiting for that world
            # would hang, and another world's collectives would meet its own. The caller's thread, re-entered
            # while it waits for the ranks (a finalizer): it would read the first job's results as its own.
            raise ShardingError(
                f"a virtual world of {self.size} ranks was asked to run a job while a virtual job is running on this "
                "thread; virtual ranks run one job at a time. Gather the value first (pf.device_get) in the thread "
                "that calls the step"
            )
        job = _in_callers_modes(job)

        def in_world(rank: int) -> Any:
            # Named for the job only: a rank thread that kept its world in thread-local storage would keep it alive.
            _LOCAL.world = self
            try:
                with self._generators.of_rank(rank):
                    return job(rank)
            finally:
                _LOCAL.world = None

        with _RUN_LOCK:
            _CALLER.running = True
            try:
                _finish_abandoned()
                # The call's own queue: a rank still running the job of an interrupted caller (Ctrl-C while waiting)
                # replies there, never to the next caller's queue.
                replies: queue.Queue = queue.Queue()
                # Ranks 1..n-1 draw from copies of the caller's generator, rank 0 from the process's, as every
                # process of a real world seeded alike draws from its own (`rank_generators`).
                self._generators.reseed()
                return self._wait(in_world, replies)
            finally:
                _CALLER.running = False

    def _wait(self, job: Callable[[int], Any], replies: queue.Queue) -> list[Any]:
        """Hand `job` to every rank and wait for their replies; see `run`.

        An error on one rank only (a bad token id in that rank's part of the batch, rank-dependent code) leaves the
        other ranks waiting in a collective that rank never joins. So on the first error, or when ranks are still
        running `self.timeout` after another rank finished (a collective not every rank reached), every waiting
        collective is stopped (torch's threaded process group raises SystemExit in it), the ranks' replies are
        drained and the collectives' state is cleared, so that the mesh serves the next job.
        """
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException] = {}
        running: set[int] = set()
        stopped = False  # the ranks' collectives were told to stop: a SystemExit now is that, not the job's own
        timed_out: list[int] = []  # ranks still running at the deadline
        cut: list[int] = []  # ranks whose job the stop ended
        deadline: float | None = None
        try:
            for rank, q in enumerate(self._jobs):
                q.put((job, replies))
                running.add(rank)
            del job  # the rank threads hold the only references now: the arguments die with the job
            while running:
                if deadline is None:
                    rank, ok, value = replies.get()
                else:
                    try:
                        rank, ok, value = replies.get(timeout=max(deadline - time.monotonic(), 0.0))
                    except queue.Empty:
                        timed_out = sorted(running)
                        _stop_collectives()
                        stopped, deadline = True, None
                        continue
                running.discard(rank)
                if ok:
                    results[rank] = value
                elif stopped and isinstance(value, SystemExit):
                    cut.append(rank)
                else:
                    errors[rank] = value
                    if not stopped:
                        _stop_collectives()
                        stopped, deadline = True, None
                if deadline is None and not stopped and self.timeout is not None:
                    deadline = time.monotonic() + self.timeout.total_seconds()
        except BaseException:
            # The caller stops waiting (Ctrl-C): the ranks stop too, as every process of a real world would. The next
            # job waits for them to reply before it starts (`_finish_abandoned`).
            if running:
                if not stopped:
                    _stop_collectives()
                _ABANDONED.append((replies, running))
            elif stopped:
                _clear_stop()
            raise
        if stopped:
            _clear_stop()  # every rank of the job has replied: none is in a collective any more
        if errors:
            first = min(errors)
            error = errors[first]
            # Not every rank raised: name the one that did (Python >= 3.11). An error raised again (a cached one)
            # keeps one note.
            stops = f"; ranks {sorted(cut)} were stopped" if cut else ""
            note = f"(raised on virtual rank {first} of {self.size}{stops})"
            if len(errors) < self.size and hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):
                error.add_note(note)
            raise error
        if cut:  # (ranks the deadline stopped that then finished anyway have their results)
            raise TimeoutError(
                f"virtual ranks {timed_out} of {self.size} were still running {self.timeout} (make_mesh's timeout) "
                "after the other ranks had finished the job: a collective that not every rank reached (code that "
                "differs by rank?), or a rank much slower than the others (raise make_mesh's timeout)"
            )
        return results


def _forked_message(what: str) -> str:
    return (
        f"{what} was made before this process was forked (multiprocessing's 'fork' start method, a DataLoader "
        "worker): its ranks are threads of the parent process, which a forked child does not have, so it cannot run "
        "here. Make the mesh in the child (pf.make_mesh(..., virtual=True)), or start the child with the 'spawn' "
        "method (multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn'))"
    )


# Every virtual world of the process, for `_after_fork`.
_WORLDS: weakref.WeakSet[VirtualWorld] = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child: the virtual worlds made before the fork cannot run (their rank threads are the parent's), so
    using them raises, where it waited forever; the run lock (held by a parent thread that waited for a job?) and the
    threaded process groups' collectives (half-joined by the parent's ranks?) are made fresh, so that the child can
    make a virtual mesh of its own."""
    for world in list(_WORLDS):
        world._forked = True
    if getattr(_CALLER, "running", False) or in_rank_thread():
        return  # forked from inside a job: this thread holds the lock, and the collectives are its world's
    _RUN_LOCK._at_fork_reinit()
    _ABANDONED.clear()
    _ENDING.clear()
    if VirtualWorld._installed:
        from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

        ProcessLocalGroup._coll_lock = threading.Lock()
        ProcessLocalGroup._cur_coll_on_pgs = {}
        ProcessLocalGroup._terminate = threading.Event()


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(after_in_child=_after_fork)


# Jobs whose caller stopped waiting after telling their ranks to stop: (replies queue, ranks still running). torch's
# threaded process group has one stop signal for the process, so the next job of any world first waits for these
# ranks to reply, then clears it (`_finish_abandoned`).
_ABANDONED: list[tuple[queue.Queue, set[int]]] = []


def _stop_collectives() -> None:
    """Make every collective of torch's threaded process groups that waits now, or starts before `reset`, raise
    SystemExit in its rank thread. Under the lock that guards the registry of collectives, which
    `exception_handle` iterates (a rank starting a collective meanwhile would change it)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    with ProcessLocalGroup._coll_lock:
        ProcessLocalGroup.exception_handle(None)


def _clear_stop() -> None:
    """Undo `_stop_collectives` once no rank runs a stopped job: forget the collectives the stopped ranks left
    half-joined (the next collective of a group name must not meet them) and clear the stop signal."""
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    ProcessLocalGroup.reset()


def _finish_abandoned() -> None:
    """Wait for the ranks of interrupted jobs to reply (each stops at its next collective), then clear the stop signal.
    An interrupt here leaves the rest for the next job."""
    if not _ABANDONED:
        return
    while _ABANDONED:
        replies, running = _ABANDONED[0]
        while running:
            running.discard(replies.get()[0])
        _ABANDONED.pop(0)
    _clear_stop()


def _serve(rank: int, jobs: queue.Queue) -> None:
    """A rank thread: run jobs until the stop signal (None), then leave the world (the first job joined it)."""
    _LOCAL.rank = rank
    torch.set_num_threads(1)
    while True:
        item = jobs.get()
        if item is None:
            break
        job, replies = item
        try:
            replies.put((rank, True, job(rank)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            replies.put((rank, False, exc))
        # Not kept until the next job: the job closes over the call's arguments (a step's parameters, a batch).
        item = job = replies = None
    # As torch's own threaded-world tests end each rank thread; under _RUN_LOCK, so no other world's collective runs
    # meanwhile. Nothing waits on this thread any more: a failure here is reported, never raised.
    with _RUN_LOCK:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"pt3func: tearing down virtual rank {rank}'s process groups failed: {exc!r}", stacklevel=1)
    _ENDING.discard(threading.current_thread())


# Rank threads told to end, until they have: the interpreter waits for them at exit (`_join_ending`). A daemon thread
# still tearing down its process groups when the interpreter finalizes is stopped inside C++ (a process group's
# destructor) and the process aborts ("terminate called without an active exception").
_ENDING: set[threading.Thread] = set()


def _stop(jobs: list[queue.Queue], threads: list[threading.Thread]) -> None:
    """The finalizer of a dropped VirtualWorld: every rank thread ends (it holds nothing of the world but these)."""
    from pt3func._compat import VIRTUAL_RANK_THREADS_CAN_END

    if not VIRTUAL_RANK_THREADS_CAN_END:
        return
    _ENDING.update(t for t in threads if t.is_alive())
    for q in jobs:
        q.put(None)


@atexit.register
def _join_ending() -> None:
    for t in list(_ENDING):
        t.join(timeout=10)


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _in_callers_modes(job: Callable[[int], Any]) -> Callable[[int], Any]:
    """`job` made to run under the calling thread's grad mode, inference mode and autocast.

    These modes are per thread, and rank threads do not inherit them: without this a step called under
    `torch.autocast` (or `torch.no_grad`) would run without it on a virtual mesh, unlike one device or a
    process of a real world, where the caller's thread is the one that runs the rank's program.
    """
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocasts = [
        (device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    ]

    def in_modes(rank: int) -> Any:
        with contextlib.ExitStack() as modes:
            if inference:
                modes.enter_context(torch.inference_mode())
            modes.enter_context(torch.set_grad_enabled(grad))
            for device, dtype, cache in autocasts:
                modes.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
            return job(rank)

    return in_modes


def _install() -> None:
    if VirtualWorld._installed:
        return
    if dist.is_initialized():
        raise ShardingError(
            "a virtual mesh simulates its own world of ranks, but this process already belongs to a "
            "torch.distributed world; use pf.make_mesh(...) without virtual=True here"
        )
    from pt3func._compat import install_threaded_world

    install_threaded_world()
    # Group names are registered per thread, so every rank thread can own groups named alike.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    VirtualWorld._installed = True


def in_rank_thread() -> bool:
    return getattr(_LOCAL, "world", None) is not None


class VirtualMesh(Mesh):
    """A mesh whose ranks are threads of this process (see module docstring). Use it like any Mesh."""

    def __init__(
        self, shape: tuple[int, ...], axis_names: tuple[str, ...], device_type: str, timeout: timedelta | None = None,
    ) -> None:
        self.axis_names = tuple(axis_names)
        self.shape = tuple(shape)
        self.device_type = device_type
        self.virtual = True
        self._groups = {}
        self.world = VirtualWorld(math.prod(shape), timeout)
        from pt3func.sharding.mesh import make_mesh

        self._rank_meshes: list[Mesh] = self.world.run(
            lambda rank: make_mesh(shape, axis_names, device_type=device_type)
        )

    def rank_mesh(self) -> Mesh:
        """The real Mesh of the rank thread this is called from."""
        if not in_rank_thread():
            raise ShardingError(
                f"{self!r} is virtual: its ranks are threads, so rank-local operations (device_mesh, groups, "
                "axis_index) exist only inside them; jitted steps, device_put and device_get dispatch there. A "
                "jitted step whose arguments are all plain tensors finds the mesh through pf.set_mesh(mesh)"
            )
        if _LOCAL.world is not self.world:
            # A rank thread of another virtual mesh: rank r of this mesh's groups is not this thread, so a
            # collective here would wait forever, or pair with the wrong ranks.
            running = getattr(_LOCAL, "mesh", None)
            raise ShardingError(
                f"{self!r} is used on a rank of another virtual mesh ({running!r}): a step runs on the mesh of its "
                f"arguments, and its shardings must name that mesh. Move the values first with "
                f"pf.device_put(value, pf.NamedSharding({self!r}, spec))"
            )
        return self._rank_meshes[_LOCAL.rank]

    @property
    def device_mesh(self) -> Any:  # type: ignore[override]
        return self.rank_mesh().device_mesh

    def axis_index(self, axis_name: Any) -> int:
        return self.rank_mesh().axis_index(axis_name)

    def group(self, axis_name: Any) -> Any:
        return self.rank_mesh().group(axis_name)

    def group_name(self, axis_name: Any) -> str:
        return self.rank_mesh().group_name(axis_name)

    def run(self, job: Callable[[int], Any]) -> list[Any]:
        """Run `job(rank)` in every rank thread, with this mesh as the current mesh there."""
        from pt3func.sharding.mesh import set_mesh

        if self.world._forked:
            raise ShardingError(_forked_message(repr(self)))

        def with_mesh(rank: int) -> Any:
            _LOCAL.mesh = self  # named by rank_mesh's error when another virtual mesh is used here
            try:
                with set_mesh(self):
                    return job(rank)
            finally:
                _LOCAL.mesh = None  # a rank thread that kept the mesh would keep it alive

        return self.world.run(with_mesh)

    def __deepcopy__(self, memo: dict) -> VirtualMesh:
        # The mesh itself, as a copied DTensor keeps its DeviceMesh's place: a copy would be another world of
        # threads (and cannot be made: its store and process groups cannot be copied).
        return self


class VirtualArray:
    """A global array on a virtual mesh: one DTensor per rank thread. `pf.device_get` makes it a tensor."""

    __slots__ = ("mesh", "locals")

    def __init__(self, mesh: VirtualMesh, per_rank: list[Any]) -> None:
        self.mesh = mesh
        self.locals = per_rank

    @property
    def shape(self) -> torch.Size:
        return self.locals[0].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.locals[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def placements(self) -> tuple:
        """DTensor placements; () for a plain per-rank tensor (a value each rank computed for itself)."""
        return tuple(getattr(self.locals[0], "placements", ()))

    def numel(self) -> int:
        return self.locals[0].numel()

    def full(self) -> torch.Tensor:
        """The whole array as a plain tensor (gathered from the ranks)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(self.locals[0], DTensor):
            return self.locals[0]
        return self.mesh.run(lambda rank: self.locals[rank].full_tensor())[0]

    def item(self) -> Any:
        return self.full().item()

    # Python conversions, as torch's for the global array. Without them `bool(x)` was an object's (always True: `if
    # ms.has_updated(state):` always taken, `not x` always False) and `int(x)` raised, where every process of a real
    # world converts its DTensor's value.

    def _scalar(self, convert: Callable[[torch.Tensor], Any]) -> Any:
        """`convert(full tensor)` (bool, int, float, ...): one element is gathered. An array of any other size gets
        torch's own error (more than one value, or none) from a meta tensor of its shape, never gathered."""
        if self.numel() != 1:
            convert(torch.empty(self.shape, dtype=self.dtype, device="meta"))
        return convert(self.full())

    def __bool__(self) -> bool:
        return self._scalar(bool)

    def __int__(self) -> int:
        return self._scalar(int)

    def __index__(self) -> int:  # integer and bool dtypes only, as torch's
        return self._scalar(operator.index)

    def __float__(self) -> float:
        return self._scalar(float)

    def __complex__(self) -> complex:
        return self._scalar(complex)

    def __format__(self, spec: str) -> str:
        # A format spec on a 0-d array formats its number, as a plain tensor's (f"{loss:.4f}"; a DTensor's raises).
        # Without one it prints as str() does: the handle, never gathered (a donated array prints too).
        if spec and self.ndim == 0:
            return format(self.item(), spec)
        return object.__format__(self, spec)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """The gathered array for numpy (`np.asarray(x)`, plotting a list of losses): with `__len__` and
        `__getitem__` numpy would otherwise build an object array of one virtual array per element."""
        import numpy as np

        return np.asarray(self.full().detach().cpu().numpy(), dtype=dtype)

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self) -> Any:
        # The rows in one job (Python's fallback through __getitem__ costs one per row, and iterates a 0-d array as
        # empty). By indexing, which a split first dimension allows, where DTensor's own __iter__ (unbind) refuses.
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(_on_every_rank(lambda value: tuple(value[i] for i in range(value.shape[0])), (self,), {}))

    def __reversed__(self) -> Any:
        return self if self.ndim == 0 else _on_every_rank(lambda value: value.flip(0), (self,), {})

    def __contains__(self, element: Any) -> bool:
        # torch's test on the global array: a DTensor's own (`element in x`) answers for its rank's shard only.
        if not isinstance(element, (torch.Tensor, VirtualArray, numbers.Number)):
            raise RuntimeError(
                f"Tensor.__contains__ only supports Tensor or scalar, but you passed in a {type(element)}."
            )
        return bool((self == element).any())

    def __deepcopy__(self, memo: dict) -> VirtualArray:
        """A copy with each rank's value copied in its own rank thread, on the same mesh (`copy.deepcopy(params)`)."""
        return VirtualArray(self.mesh, self.mesh.run(lambda rank: _copy_tensor(self.locals[rank])))

    def __repr__(self) -> str:
        from pt3func.runtime.donated import donated_to, is_donated

        # Donated to a step: printing it (a params dict in a notebook) must not raise, as a donated tensor's repr
        # does not; every rank's value was donated by the one call.
        if is_donated(self.locals[0]):
            return f"VirtualArray(<donated to {donated_to(self.locals[0])}>)"
        return f"VirtualArray(shape={tuple(self.shape)}, dtype={self.dtype}, placements={self.placements})"

    def __copy__(self) -> VirtualArray:
        # copy.copy would otherwise go through `__reduce__`, which refuses: a new handle on the same per-rank values.
        return VirtualArray(self.mesh, list(self.locals))

    def __reduce__(self) -> Any:
        # Refused, naming the array: pickling the values of the rank threads failed inside the mesh (its HashStore),
        # naming no pt3func object. Not pickled as its gathered full tensor: a load would give a plain tensor where a
        # sharded array was saved (the whole of it in one process, however large), where torch.save on a real world
        # saves each rank's own shard, and pf.checkpointing saves a virtual mesh's arrays per rank.
        import pickle

        raise pickle.PicklingError(
            f"{self!r} lives in the rank threads of a virtual mesh ({self.mesh!r}) and cannot be pickled "
            "(torch.save, pickle, multiprocessing). Gather it into a plain tensor first with pf.device_get(tree), "
            "or save the sharded tree with pf.checkpointing.CheckpointManager(directory).save(step, tree)"
        )

    # Eager ops. Code written for a real world applies torch to its DTensors outside any jitted step
    # (`opt.init(params)`, `params["w"] * 2`, `x.float()`); each process runs that op on its own DTensor. Here every
    # rank thread does: torch functions (`__torch_function__`, which torch honours for any argument type), tensor
    # methods and attributes, operators and indexing run on each rank's value, and tensors come back as virtual
    # arrays (anything else as rank 0's).

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _on_every_rank(func, args, kwargs or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private and special names are the handle's own, never a rank's tensor's
            raise AttributeError(name)
        attribute = getattr(self.locals[0], name)  # raises torch's own AttributeError for an unknown name
        if not callable(attribute):
            return _on_every_rank(getattr, (self, name), {})
        return lambda *args, **kwargs: _on_every_rank(
            lambda value, *a, **k: getattr(value, name)(*a, **k), (self, *args), kwargs
        )

    def __getitem__(self, index: Any) -> Any:
        return _on_every_rank(lambda value, i: value[i], (self, index), {})


def _copy_tensor(x: torch.Tensor) -> torch.Tensor:
    """`copy.deepcopy(x)` but on x's own DeviceMesh: deepcopy of a DTensor would deep-copy its DeviceMesh too, a new
    mesh object (a new jit signature, `trace/signature.py` keys meshes by identity) of no world."""
    y = x.detach().clone()  # a DTensor's clone is its local tensor's, placements and mesh kept
    if x.requires_grad:
        y.requires_grad_(True)
    if x.is_leaf and x.grad is not None:  # (reading a non-leaf's .grad warns)
        y.grad = x.grad.detach().clone()
    return y


def _binary(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[[Any, Any], Any]:
    if reflected:
        return lambda self, other: _on_every_rank(lambda a, b: op(b, a), (self, other), {})
    return lambda self, other: _on_every_rank(op, (self, other), {})


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda self: _on_every_rank(op, (self,), {})


def _in_place(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`x += y` as torch's: every rank's value is changed in place and `x` stays the same handle, so another name
    for the array (a params dict holding it) sees the change; Python's fallback to `x = x + y` rebound `x` only."""

    def apply(self: VirtualArray, other: Any) -> VirtualArray:
        self.locals = _on_every_rank(op, (self, other), {}).locals  # (the same tensors, changed in place)
        return self

    return apply


# `x << n` and `x >> n` as torch.bitwise_left/right_shift: DTensor's own operators (aten.__lshift__/__rshift__) return
# x unshifted (torch 2.13, on a real world too).
_SHIFTS = {"lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift}
_IN_PLACE_SHIFTS = {"lshift": torch.Tensor.bitwise_left_shift_, "rshift": torch.Tensor.bitwise_right_shift_}
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", *_SHIFTS):
    _op = _SHIFTS.get(_name) or getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    setattr(VirtualArray, f"__{_name}__", _binary(_op))
    setattr(VirtualArray, f"__r{_name}__", _binary(_op, reflected=True))
    if _name != "matmul":  # (torch has no in-place matmul: `x @= y` is `x = x @ y`, as for a tensor)
        setattr(VirtualArray, f"__i{_name}__", _in_place(_IN_PLACE_SHIFTS.get(_name) or getattr(operator, f"i{_name}")))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(VirtualArray, f"__{_name}__", _binary(getattr(operator, _name)))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(VirtualArray, f"__{_name}__", _unary(getattr(operator, _name)))
VirtualArray.__hash__ = object.__hash__  # defining __eq__ would otherwise make virtual arrays unhashable


def _on_every_rank(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` in every rank thread of the virtual arrays' mesh, each on its own values."""
    leaves = [x for x in tree.leaves((args, kwargs), is_leaf=is_virtual_leaf) if isinstance(x, VirtualArray)]
    meshes = {id(x.mesh): x.mesh for x in leaves}
    if len(meshes) != 1:
        raise ShardingError(f"an op on virtual arrays of {len(meshes)} different virtual meshes: {fn!r}")
    mesh = next(iter(meshes.values()))

    def on_rank(rank: int) -> Any:
        with drawing_as_rank():
            return fn(*scatter_tree(args, rank), **scatter_tree(kwargs, rank))

    return gather_trees(mesh, mesh.run(on_rank))


def is_virtual_leaf(x: Any) -> bool:
    return isinstance(x, VirtualArray)


def scatter_tree(tree_: Any, rank: int) -> Any:
    """Rank `rank`'s view of a tree: each VirtualArray replaced by that rank's DTensor, and each plain tensor
    by a copy of its own.

    The copy matters: ranks of a real world never share memory, but threads would. A replicated shard built
    from one shared tensor would be one buffer for every rank, and a donated step writing its new values
    into it would race with the ranks still reading the old ones.
    """

    def local(x: Any) -> Any:
        if isinstance(x, VirtualArray):
            return x.locals[rank]
        if isinstance(x, torch.Tensor):
            # A leaf of its own, as each process of a real world holds: a plain clone of a tensor that requires grad
            # would be a non-leaf, which distribute_tensor refuses.
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return tree.map(local, tree_, is_leaf=is_virtual_leaf)


def gather_trees(mesh: VirtualMesh, per_rank: list[Any]) -> Any:
    """One tree from the ranks' trees: tensors become VirtualArrays (each rank keeps its own), anything else
    is rank 0's."""
    leaves0, structure = tree.flatten(per_rank[0])
    per_rank_leaves = [tree.leaves(t) for t in per_rank]
    out = [
        VirtualArray(mesh, [leaves[i] for leaves in per_rank_leaves]) if isinstance(leaf, torch.Tensor) else leaf
        for i, leaf in enumerate(leaves0)
    ]
    return tree.unflatten(structure, out)


def mesh_of_arrays(*trees: Any) -> VirtualMesh | None:
    """The virtual mesh of the first VirtualArray in `trees`."""
    for t in trees:
        for leaf in tree.leaves(t, is_leaf=is_virtual_leaf):
            if isinstance(leaf, VirtualArray):
                return leaf.mesh
    return None


def find_mesh(*trees: Any) -> VirtualMesh | None:
    """The virtual mesh of the first VirtualArray in `trees`, or the current mesh if it is virtual."""
    from pt3func.sharding.mesh import get_mesh

    found = mesh_of_arrays(*trees)
    if found is not None:
        return found
    mesh = get_mesh()
    return mesh if isinstance(mesh, VirtualMesh) else None


def mesh_of_shardings(*shardings: Any) -> VirtualMesh | None:
    """The virtual mesh of the first NamedSharding in `shardings` (a jit's in/out_shardings) on one."""
    from pt3func.sharding.spec import NamedSharding

    for s in shardings:
        for leaf in tree.leaves(s, is_leaf=lambda x: isinstance(x, NamedSharding)):
            if isinstance(leaf, NamedSharding) and isinstance(leaf.mesh, VirtualMesh):
                return leaf.mesh
    return None


def _foreign_arrays(mesh: VirtualMesh, tree_: Any) -> list[tuple[str, VirtualArray]]:
    """(path, array) of every VirtualArray of `tree_` that lives on another virtual mesh than `mesh`."""
    paths, leaves = tree.paths(tree_, is_leaf=is_virtual_leaf), tree.leaves(tree_, is_leaf=is_virtual_leaf)
    return [(tree.keystr(path), x) for path, x in zip(paths, leaves, strict=True)
            if isinstance(x, VirtualArray) and x.mesh is not mesh]


def device_put(mesh: VirtualMesh, tree_: Any, shardings: Any) -> Any:
    from pt3func.sharding.put import device_put as put

    tree_ = _gather_foreign(mesh, tree_)
    return gather_trees(mesh, mesh.run(lambda rank: put(scatter_tree(tree_, rank), shardings)))


def device_get(mesh: VirtualMesh, tree_: Any) -> Any:
    from pt3func.sharding.put import device_get as get
    from pt3func.sharding.put import unaliased

    # An array of another mesh is gathered there; replicated, its full value is that mesh's rank 0 buffer, which a
    # donated step on that mesh would overwrite under the caller's snapshot.
    tree_ = tree.map(lambda x: unaliased(x.full(), x.locals[0]) if isinstance(x, VirtualArray) and x.mesh is not mesh
                     else x, tree_, is_leaf=is_virtual_leaf)
    return mesh.run(lambda rank: get(scatter_tree(tree_, rank)))[0]


def _gather_foreign(mesh: VirtualMesh, tree_: Any) -> Any:
    """`tree_` with each array of another virtual mesh than `mesh` replaced by its full value (gathered on its own
    mesh): its rank values live in that mesh's threads, and reading them from `mesh`'s ranks (a collective of the
    other world) would hang."""
    if not _foreign_arrays(mesh, tree_):
        return tree_
    return tree.map(lambda x: x.full() if isinstance(x, VirtualArray) and x.mesh is not mesh else x, tree_,
                    is_leaf=is_virtual_leaf)


def call(mesh: VirtualMesh, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Call `fn` (a jitted step) on every rank with its local view of the arguments; gather the outputs."""
    foreign = [(f"args{path}", a) for path, a in _foreign_arrays(mesh, args)]
    foreign += [(f"kwargs{path}", a) for path, a in _foreign_arrays(mesh, kwargs)]
    if foreign:
        path, array = foreign[0]
        raise ShardingError(
            f"argument {path} lives on {array.mesh!r}, but the step runs on {mesh!r}: a step's arrays share "
            "one mesh. Move it first with pf.device_put(value, pf.NamedSharding(mesh, spec))"
        )
    per_rank = mesh.run(lambda rank: fn(*scatter_tree(args, rank), **scatter_tree(kwargs, rank)))
    return gather_trees(mesh, per_rank)

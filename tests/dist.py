"""Multi-process test harness: run a function on every rank of a fresh gloo world.

`run_world(nprocs, fn, *args)` spawns `nprocs` processes, starts a gloo process group in each (a FileStore
in a temporary directory, so no port is ever picked), calls `fn(rank, world_size, *args)` and returns the
list of each rank's return value. A failure in any rank is raised here with that rank's traceback.
`fn` must be a top-level function of an importable module (the children import it by name).
Spawning costs ~1-3 s per world: group many checks into one call.

A world whose child is killed by a signal (SIGABRT, SIGSEGV, SIGBUS: a crash in native code, no Python
exception) is run once more, with a warning that carries the signal. Once in CI (session 12) a gloo child
aborted with glibc's "malloc(): unaligned tcache chunk detected" in a test that had passed every run before and
passed 40 runs after it, alone and three at a time on 2 loaded cores (an eager-backend step: torch's own kernels,
gloo and DCP run, no code of ours is native). A failure that comes back on the second run still fails the test;
`faulthandler` in each child prints every thread's Python stack when it crashes, for the next one.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=60)


def _child(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a native crash prints where each thread was
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(workdir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        # Nobody leaves while a peer may still be inside a collective with it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


# The fork server imports these once; every world forks from it instead of importing them again (seconds each).
mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed.tensor", "torch.fx.experimental.proxy_tensor",
                           "pytest", "pt3func"])


_NATIVE_CRASHES = {"SIGABRT", "SIGSEGV", "SIGBUS"}


def run_world(nprocs: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `fn(rank, nprocs, *args)` on `nprocs` fresh gloo ranks; return the ranks' results in rank order."""
    try:
        return _run_world_once(nprocs, fn, *args)
    except mp.ProcessExitedException as exc:
        if exc.signal_name not in _NATIVE_CRASHES:
            raise
        warnings.warn(f"run_world({fn.__name__}): rank {exc.error_index} crashed in native code ({exc.signal_name}); "
                      "running the world once more", RuntimeWarning, stacklevel=2)
        return _run_world_once(nprocs, fn, *args)


def _run_world_once(nprocs: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    # Children inherit the environment at spawn: one thread each, since ranks share a couple of cores.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with tempfile.TemporaryDirectory(prefix="pt3func-world-") as workdir:
            mp.start_processes(_child, args=(nprocs, workdir, fn, args), nprocs=nprocs, join=True,
                               start_method="forkserver")
            results = []
            for rank in range(nprocs):
                with open(os.path.join(workdir, f"result{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved

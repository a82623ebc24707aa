"""Multi-process test harness: run a function on every rank of a fresh gloo world.

`run_world(nprocs, fn, *args)` spawns `nprocs` processes, starts a gloo process group in each (a FileStore
in a temporary directory, so no port is ever picked), calls `fn(rank, world_size, *args)` and returns the
list of each rank's return value. A failure in any rank is raised here with that rank's traceback.
`fn` must be a top-level function of an importable module (the children import it by name).
Spawning costs ~1-3 s per world: group many checks into one call.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=60)


def _child(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

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


def run_world(nprocs: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `fn(rank, nprocs, *args)` on `nprocs` fresh gloo ranks; return the ranks' results in rank order."""
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

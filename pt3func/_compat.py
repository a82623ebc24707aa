"""The one place that knows which torch version is running (pt3func supports torch 2.11 and 2.13).

Everything else imports the version-dependent names from here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol  # importing it registers torch.ops._c10d_functional
from torch.distributed.tensor import Shard

c10d_functional = torch.ops._c10d_functional
"""The functional collective ops (`all_reduce`, `all_gather_into_tensor`, ..., `wait_tensor`)."""

# torch 2.13 renamed funcol's `all_gather_tensor` / `reduce_scatter_tensor` to `*_single` (the old names warn).
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

# torch 2.11's DTensor `index_put` rule (the backward of `table[idx]`) fails or gives local shapes that do not
# broadcast when the index is split; 2.13's is right.
DTENSOR_INDEX_PUT_SPLIT_INDEX_BROKEN = TORCH_VERSION < (2, 13)

# torch 2.11's threaded process-group world: once a virtual mesh's rank threads ended, tracing a step on the next
# virtual mesh crashed the process (a segmentation fault in FakeTensorMode, with or without tearing down the ended
# threads' process groups). There a dropped mesh's threads stay, idle, holding nothing of it; 2.13 ends them.
VIRTUAL_RANK_THREADS_CAN_END = TORCH_VERSION >= (2, 13)

# torch 2.11's FX cannot record a torch.Generator argument ("NotImplementedError: argument of type: <class
# 'torch._C.Generator'>"): random ops given generator= fail to trace there (exponential_ / geometric_ / cauchy_ /
# log_normal_ excepted: pt3func traces them as its own fill op).
FX_RECORDS_GENERATORS = TORCH_VERSION >= (2, 13)


def outside_functorch_levels() -> contextlib.AbstractContextManager:
    """A block run outside torch.func's transforms (vmap, grad): torch's private
    `temporarily_clear_interpreter_stack`, the same on torch 2.11 and 2.13 (used where DTensor's to_local, which
    has no vmap rule, must see an unbatched value)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def is_plain_shard(placement: object) -> bool:
    """True for `Shard(d)`, False for `_StridedShard` (a `Shard` subclass in some versions, not in others)."""
    return type(placement) is Shard


def is_strided_shard(placement: object) -> bool:
    """True for a `_StridedShard` (private to torch; a `Shard` subclass in some versions, not in others)."""
    return type(placement).__name__ == "_StridedShard"


def dtensor_spec(device_mesh: Any, placements: tuple, shape: torch.Size, stride: tuple[int, ...],
                 dtype: torch.dtype) -> Any:
    """The DTensorSpec of a DTensor with this layout (build once, share between DTensors: specs are immutable,
    and building one costs tens of µs in torch 2.13, most of a cheap DTensor's construction)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(device_mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, dtype))


def dtensor_with_spec(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor around `local` with a prebuilt `spec` (see `dtensor_spec`)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


_output_code_sink = threading.local()


def _dispatch_output_code(code: str) -> None:
    sink = getattr(_output_code_sink, "sources", None)
    if sink is not None:
        sink.append(code)
    previous = _dispatch_output_code.previous  # type: ignore[attr-defined]
    if previous is not None:
        previous(code)


_dispatch_output_code.previous = None  # type: ignore[attr-defined]


@contextlib.contextmanager
def inductor_output_code() -> Iterator[list[str]]:
    """Collect the Python wrapper source of every program Inductor compiles (or loads from its cache) inside.

    Uses `GraphLowering.save_output_code`, the hook behind `torch._inductor.utils.run_and_get_code`, which both
    a fresh compile and an FX-graph-cache hit call. Sources are collected per thread (rank threads of a
    virtual mesh compile their own programs).
    """
    from torch._inductor.graph import GraphLowering

    current = GraphLowering.save_output_code
    if current is not _dispatch_output_code:  # (re)install: a test's run_and_get_code may have replaced it
        _dispatch_output_code.previous = current  # type: ignore[attr-defined]
        GraphLowering.save_output_code = _dispatch_output_code
    outer = getattr(_output_code_sink, "sources", None)
    sources: list[str] = []
    _output_code_sink.sources = sources
    try:
        yield sources
    finally:
        _output_code_sink.sources = outer


def guard_inductor_cpu_loop_split() -> None:
    """Keep Inductor's C++ backend from miscompiling loops whose length is not a multiple of a divisor they index by.

    `CppScheduling.try_loop_split` (torch 2.11-2.13) turns an index `x // d` (d > 8) into a loop nest of
    `size // d` by `d` without checking that `d` divides `size`, so the last `size % d` elements are never
    computed: `torch.compile(lambda a, s: (a.view(-1, 256) * s[:, None]).reshape(-1)[:1000] * 3)` returns wrong
    values for the last 232. Blockwise (de)quantisation lowered on CPU (pt3func.kernels.ops) makes exactly these
    indices, so this skips the split for a fused group whenever some such index's loop length is not a known
    multiple of its divisor (the loop then runs unsplit: correct, slightly less vectorised). Idempotent.
    """
    import sympy
    from torch._inductor.codegen import cpp
    from torch.utils._sympy.functions import FloorDiv

    scheduling = getattr(cpp, "CppScheduling", None)
    original = getattr(scheduling, "try_loop_split", None)
    if original is None or getattr(original, "pt3func_guarded", False):
        return

    def uneven(nodes: list[Any]) -> bool:
        for node in nodes:
            (sizes, _), body, _ = node.node.get_default_sizes_body()
            ranges = dict(zip(body.iter_vars, sizes))
            for expr in body.indexing_exprs.values():
                if not isinstance(expr, sympy.Expr):
                    continue
                for div in expr.find(FloorDiv):
                    var, divisor = div.args
                    if var in ranges and (sympy.Mod(ranges[var], divisor) != 0):
                        return True
        return False

    def try_loop_split(self: Any, nodes: list[Any]) -> list[Any]:
        return nodes if uneven(nodes) else original(self, nodes)

    try_loop_split.pt3func_guarded = True  # type: ignore[attr-defined]
    scheduling.try_loop_split = try_loop_split


# Inductor's FX passes that merge collectives into buckets (one launch per bucket instead of one per tensor).
_COLLECTIVE_BUCKETING = {
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "bucket_all_reduces_fx": "all",
}


def inductor_collective_bucketing() -> dict[str, Any]:
    """The Inductor config entries that turn on its collective bucketing passes, as far as this torch version has
    them (all three exist in 2.11 and 2.13; an entry a later version drops is left out, not an error)."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    return {name: value for name, value in _COLLECTIVE_BUCKETING.items() if name in known}


_strategy_selection_wrapped = False
_strategy_selection_lock = threading.Lock()


def wrap_dtensor_strategy_selection(select: Any) -> bool:
    """Route DTensor's choice among an op's sharding strategies through `select(original, strategy, op_schema)`.

    Installed once per process; `select` decides per call whether to change anything (pt3func's does only inside
    its sharded traces). torch 2.11 and 2.13 both choose in `_sharding_prop._select_min_cost_strategy(strategy,
    op_schema)`; where that function is missing, nothing is wrapped and False is returned.
    """
    global _strategy_selection_wrapped
    with _strategy_selection_lock:
        if _strategy_selection_wrapped:
            return True
        from torch.distributed.tensor import _sharding_prop

        original = getattr(_sharding_prop, "_select_min_cost_strategy", None)
        if original is None:
            return False

        def selected(strategy: Any, op_schema: Any = None) -> Any:
            return select(original, strategy, op_schema)

        _sharding_prop._select_min_cost_strategy = selected
        _strategy_selection_wrapped = True
        return True


def install_threaded_world() -> None:
    """torch's threaded process-group world (the virtual mesh's ranks are threads). torch 2.11's `ThreadLocalWorld`
    has no `comms`, which its `destroy_process_group` reads: once a virtual mesh had run, destroying a real
    process group in the same process raised AttributeError. An empty per-world list is what a world without
    NCCL communicators holds."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld, _install_threaded_pg

    _install_threaded_pg()
    if not hasattr(ThreadLocalWorld, "comms"):
        ThreadLocalWorld.comms = property(lambda self: self.__dict__.setdefault("_pt3func_comms", []))

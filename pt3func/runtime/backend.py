"""Turn a traced program into something callable: Inductor, or the FX graph as is."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import fx

from pt3func._compat import guard_inductor_cpu_loop_split, inductor_collective_bucketing
from pt3func.config import config
from pt3func.passes.chunked_loss import accumulate_in_place
from pt3func.passes.eager_views import reshape_unwritten_views
from pt3func.passes.random_fills import fill_fresh_buffers_in_one_op
from pt3func.passes.remat import is_random
from pt3func.passes.scaled_add import scale_products_before_adding
from pt3func.runtime.virtual import in_rank_thread
from pt3func.trace.capture import TRACE_LOCK

aten = torch.ops.aten

BACKENDS = ("inductor", "eager")


def compile_program(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], backend: str
) -> Callable[..., Sequence]:
    """Return `run(*flat_inputs) -> flat outputs` for `gm` with the chosen backend."""
    if backend == "eager" or (backend == "inductor" and _only_meta(example_inputs)):
        # A program over meta tensors (a shape-only dry run) computes nothing, so compiling it buys nothing, and
        # Inductor's constant folding fails on meta values (an FX "used before defined" error; `torch.compile`
        # too): it runs as the eager backend's program.
        return reshape_unwritten_views(gm)
    if backend == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # fallback_random: Inductor's own RNG would draw different numbers than eager torch; the contract
        # is that a jitted step sees the same random numbers as the same code run eagerly.
        options = {
            "fallback_random": True,
            "reorder_for_locality": reorder_for_locality(gm),
            "allow_buffer_reuse": reuse_buffers(gm),
            **(inductor_collective_bucketing() if bucket_collectives(gm) else {}),
        }
        gm = scale_products_before_adding(fill_fresh_buffers_in_one_op(zeros_for_efficient_zeros(gm)))
        if "accumulate_in_place" not in config.disabled_passes:
            gm = accumulate_in_place(gm)  # mutation only here: the passes before Inductor reorder by data flow
        decompositions = _decompositions(gm, example_inputs)
        # Before every compile, not only a quantising program's: Inductor's C++ loop split miscompiles any program
        # that indexes by `i // d` over a loop d does not divide (NaN for `(a.view(-1, 256) * s[:, None])
        # .reshape(-1)[:1000]`), and since the FX graph cache serves programs, one compiled unguarded earlier in
        # this process (or another) would be served to a guarded one. Idempotent.
        guard_inductor_cpu_loop_split()
        with TRACE_LOCK, inductor_config.patch(options), _cacheable_compile():
            return compile_fx(gm, list(example_inputs), decompositions=decompositions, ignore_shape_env=True)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def _only_meta(example_inputs: Sequence[torch.Tensor]) -> bool:
    """A dry run: some input is a meta tensor (the others can only be CPU scalars, which mix with meta ones, e.g. a
    0-d learning rate), so the program computes no values."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in example_inputs)


def zeros_for_efficient_zeros(gm: fx.GraphModule) -> fx.GraphModule:
    """Each `aten._efficientzerotensor` (the zero tangents forward-over-reverse AD makes, e.g. `torch.func.hessian`)
    becomes `aten.zeros` of the same size and options. Inductor (torch 2.13, CPU) treated the storage-less zero
    tensor's buffer as free to reuse and wrote a fused kernel's output into it: the step died with SIGSEGV. Same
    schema, same values; a real buffer costs its size in memory."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten._efficientzerotensor.default:
            node.target = aten.zeros.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def reorder_for_locality(gm: fx.GraphModule) -> bool:
    """Inductor's `reorder_for_locality` pass (`pf.config.inductor_reorder_for_locality`), except for a program that
    draws random numbers twice or more. The pass sinks each op to just before its first user, which can swap two
    draws: on an H200 (session 10) a `uniform_` whose result was used first moved ahead of a dropout, each then
    took the other's numbers from the generator, and the step's losses left eager torch's (they came back with
    the pass off). Draws must happen in the order the step makes them, as `fallback_random` promises."""
    if not config.inductor_reorder_for_locality:
        return False
    return sum(1 for node in gm.graph.nodes if is_random(node)) < 2


# Ops Inductor runs as fallback kernels that write into a buffer it allocated: with buffer reuse, Inductor (torch
# 2.13, CPU) gave a message-passing step (`scatter_reduce("amax")` into a `cat`, then its backward) NaN gradients:
# it handed the `cat` buffer to a backward matmul while the scatter's view into it was still read.
_REDUCING_SCATTERS = frozenset({"scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_"})


def reuse_buffers(gm: fx.GraphModule) -> bool:
    """Inductor's `allow_buffer_reuse`, except for a program with a reducing scatter (see `_REDUCING_SCATTERS`)."""
    return not any(
        node.op == "call_function" and getattr(getattr(node.target, "_overloadpacket", None), "__name__", None)
        in _REDUCING_SCATTERS
        for node in gm.graph.nodes
    )


_BUCKETED_BY_AUTO = ("all_gather_into_tensor", "reduce_scatter_tensor")
BUCKET_COLLECTIVES = ("auto", "on", "off")


def bucket_collectives(gm: fx.GraphModule) -> bool:
    """Whether `gm` is compiled with Inductor's collective bucketing (`pf.config.bucket_collectives`)."""
    setting = config.bucket_collectives
    if setting not in BUCKET_COLLECTIVES:
        raise ValueError(f"pf.config.bucket_collectives = {setting!r}: choose one of {BUCKET_COLLECTIVES}")
    if in_rank_thread():
        # A virtual mesh's threaded process group has no `out=` collectives, which bucketed programs call.
        return False
    if setting != "auto":
        return setting == "on"
    on_cuda = sharded = False
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cuda":
            on_cuda = True
        target = getattr(node.target, "__name__", "")  # e.g. "all_gather_into_tensor.default"
        sharded = sharded or (node.op == "call_function" and target.split(".")[0] in _BUCKETED_BY_AUTO)
    return on_cuda and sharded


@contextlib.contextmanager
def _cacheable_compile() -> Iterator[None]:
    """Let Inductor's FX graph cache serve `compile_fx` called outside Dynamo.

    The cache refuses a graph compiled without a tracing context whose fake mode has a `ShapeEnv` ("No shape
    env"), which is how pt3func calls Inductor: every program compiled from scratch, in every process and on each
    rank thread of a virtual mesh (four times over for a 2 x 2 mesh, though the ranks' programs are the same). So
    the compile runs in a fresh context with an empty `ShapeEnv`; `compile_fx(ignore_shape_env=True)` keeps the
    inputs' shapes static (as without it), so the env never gains a symbol or a guard. The cache key is the
    graph after pt3func's passes, its inputs' metadata, Inductor's config and torch's version, so a hit is the
    program a compile would have made."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    context = torch._guards.TracingContext(FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        yield


def _decompositions(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> dict | None:
    """Inductor's decompositions, plus pt3func's quantisation ops lowered to aten for a program on the CPU that
    calls them (fused C++ instead of an op-by-op reference); None (Inductor's default table) for any other
    program: a table of our own makes Inductor's FX graph cache refuse the program (it cannot key the table)."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(x.device.type != "cpu" for x in tensors):
        return None
    if not any(getattr(node.target, "namespace", None) == "pt3func" for node in gm.graph.nodes):
        return None
    from torch._inductor.decomposition import select_decomp_table

    from pt3func.kernels.ops import cpu_decompositions

    return {**select_decomp_table(), **cpu_decompositions()}

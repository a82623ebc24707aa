"""`shard_map`: run a function on each rank's local blocks, with pf.lax collectives between them."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from pt3func.errors import ShardingError
from pt3func.sharding.mesh import Mesh, get_mesh
from pt3func.sharding.put import broadcast_shardings
from pt3func.sharding.spec import PartitionSpec, placements_for
from pt3func.spmd.collectives import bind_axes
from pt3func.tree import PyTree, keystr


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the cotangent by `scale` (see the gradient convention in collectives)."""

    @staticmethod
    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _spec(spec: Any, path: tuple) -> PartitionSpec:
    if spec is None:
        return PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise ShardingError(f"at {keystr(path) or 'the root'}: shard_map specs are P(...), got {spec!r}")
    return spec


def _to_local(x: Any, spec: Any, mesh: Mesh, path: tuple) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    placements = placements_for(_spec(spec, path), mesh, tuple(x.shape), path)
    if isinstance(x, DTensor):
        if x.device_mesh is not mesh.device_mesh:
            raise ShardingError(f"at {keystr(path) or 'the root'}: the input lives on {x.device_mesh}, not on "
                                f"the shard_map mesh {mesh!r}")
    else:
        # A plain tensor is the full value, the same on every rank.
        x = DTensor.from_local(x, mesh.device_mesh, [Replicate()] * mesh.ndim, run_check=False)
    x = x.redistribute(mesh.device_mesh, placements)
    # Cotangents of replicated blocks come back unreduced: Partial makes autograd sum them.
    grad_placements = [Partial() if isinstance(p, Replicate) else p for p in placements]
    return x.to_local(grad_placements=grad_placements)


def _from_local(y: Any, spec: Any, mesh: Mesh, path: tuple) -> Any:
    if not isinstance(y, torch.Tensor):
        return y
    spec = _spec(spec, path)
    if y.ndim == 0 and not y.requires_grad and all(d is None for d in spec):
        # A replicated 0-d value nothing differentiates (an optimizer's step counter) stays a plain tensor, as the
        # plain sharded jit keeps it: fed back into the next call it must not change the step's signature.
        return y
    if len(spec) > y.ndim:
        raise ShardingError(f"shard_map out_specs at {keystr(path) or 'the root'}: spec {spec} is longer than the "
                            f"rank of the output block, shape {tuple(y.shape)}; give it P() once it is the same on "
                            "every rank (psum / pmean it), or return a block with a dim to concatenate")
    try:
        placements = placements_for(spec, mesh, path=path)
    except ShardingError as e:
        raise ShardingError(f"shard_map out_specs: {e} (the output block has shape {tuple(y.shape)})") from None
    shape = list(y.shape)
    for axis, p in zip(mesh.axis_names, placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh.axis_size(axis)
    replicas = math.prod(mesh.axis_size(a) for a, p in zip(mesh.axis_names, placements) if isinstance(p, Replicate))
    if replicas > 1:
        y = _ScaleGrad.apply(y, 1.0 / replicas)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(y, mesh.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _refuse_vmap(f: Callable[..., Any]) -> None:
    """shard_map's boundary (DTensor.from_local / to_local) has no batching rule: under pf.vmap it failed inside
    torch. Mapping inside the shard_map is the same computation, and supported."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    if any(interpreter.key() == torch._C._functorch.TransformType.Vmap for interpreter in stack):
        raise ShardingError(f"pf.vmap over pf.shard_map({getattr(f, '__name__', f)!r}) is not supported: write "
                            "pf.shard_map(pf.vmap(f), ...), with the batch dim added to in_specs / out_specs "
                            "(P(None, *spec)); collectives inside are mapped by pf.vmap")


def _specs_of(which: str, what: str, value: Any, specs: PyTree, *, scalars_whole: bool = True) -> tuple:
    """broadcast_shardings, with an error that says which specs do not fit what (shapes, not traced values)."""
    try:
        return broadcast_shardings(value, specs, scalars_whole=scalars_whole)
    except ShardingError:
        structure = optree.tree_map(lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else x, value,
                                    none_is_leaf=True)
        raise ShardingError(f"shard_map {which} {specs!r} is not a pytree prefix of {what}, {structure!r} "
                            "(tensors shown by shape)") from None


def shard_map(f: Callable[..., Any], mesh: Mesh | None = None, in_specs: PyTree = None,
              out_specs: PyTree = None, check_rep: bool = False) -> Callable[..., Any]:
    """`f` on each rank's local blocks: SPMD code with explicit collectives (`pf.lax.*`).

    `in_specs` is a pytree prefix of the positional arguments (a tuple), `out_specs` one of `f`'s output;
    leaves are `P(...)` (None means `P()`). Each input (a DTensor, or a plain tensor taken as the full value
    held by every rank) is redistributed to its spec and `f` gets its local block. Each output block is
    wrapped as a DTensor: an axis named in its spec concatenates the blocks along that dim; over axes not
    named the output is taken as replicated (not checked: `check_rep=True` is not supported). A split spec
    reaching a 0-d output, at its own path or through a prefix, is refused.
    Differentiable end to end; see `pt3func.spmd.collectives` for the gradient convention (JAX's
    `check_rep=False`: a replicated input's gradient inside `f` is this rank's local piece).
    Not under `pf.vmap`: write `shard_map(vmap(f))`.
    """
    if check_rep:
        raise NotImplementedError("shard_map(check_rep=True) is not supported: replication is not checked")

    @functools.wraps(f)
    def wrapped(*args: Any) -> Any:
        _refuse_vmap(f)
        m = mesh or get_mesh()
        if m is None:
            raise ShardingError("shard_map needs a mesh: pass mesh= or call pf.set_mesh(mesh)")
        paths, leaves, specs, treedef = _specs_of("in_specs", "the arguments", args, in_specs)
        local = optree.tree_unflatten(treedef, [_to_local(x, s, m, p) for p, x, s in zip(paths, leaves, specs)])
        with bind_axes(m):
            out = f(*local)
        # A split spec that a prefix gives a 0-d output is refused (in `_from_local`), not taken as replicated: each
        # rank's 0-d block may differ (a per-rank loss), and there is no dim to concatenate them along.
        paths, leaves, specs, treedef = _specs_of("out_specs", "the output", out, out_specs, scalars_whole=False)
        return optree.tree_unflatten(treedef, [_from_local(y, s, m, p) for p, y, s in zip(paths, leaves, specs)])

    return wrapped

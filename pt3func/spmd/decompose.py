"""Ops DTensor has no rule of its own for: run their decomposition over the DTensors instead.

DTensor propagates shardings op by op. For an aten op without a rule of its own, torch 2.11 raises
(`binary_cross_entropy_with_logits`, `log_sigmoid_forward`, `multi_margin_loss` ... on a batch-sharded value),
and torch 2.13 derives a rule by tracing the op's decomposition on a mesh of one, then runs the op itself on
each rank's block. That is wrong wherever the op's arithmetic depends on the global shape: `mse_loss_backward`
with a mean divides by the block's element count, so a data-parallel step's gradient came out world-size times
too large (also `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy`, `soft_margin_loss`), with the right loss
value.

While a sharded step is traced, such ops run their decomposition (`torch._decomp`) with the DTensors themselves:
every op of it goes through DTensor's own rules and sees global shapes, so a mean divides by the global count
and a sum over a split dim becomes a partial sum that is reduced where it must be. The numbers are the
decomposition's, equal to the fused kernel's up to rounding. `weight_norm`'s backward, which `torch._decomp` lacks,
runs pt3func's own (`_weight_norm_interface_backward`).

The same block also takes `argmax()` / `argmin()` without a dim over a split value (see
`_flat_argminmax_of_the_whole`).

An op with neither a rule nor a decomposition (`tril_` of `parametrizations.orthogonal`, `_embedding_bag` with
offsets, ...) whose DTensor operands are all replicated on one mesh runs on the local tensors, its outputs
replicated: every rank computes what one device does (`_replicated_fallback`). Pending sums among the operands
are reduced first. In-place and `out=` ops write into their operand and give it back; a written pending sum stays
one (the result on one rank, zeros on the others), so views of it, which keep its placements, read the result.
Any other such op (a split operand, say) is refused with a `ShardingError` naming the op, its operands'
placements and the user's line, which DTensor's own error did not name. Random ops (each rank would draw its own
numbers) are refused too; ops whose output shape depends on values keep DTensor's error, which
`trace/capture.py` turns into a data-dependent one.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from pt3func.errors import ShardingError
from pt3func.spmd.lower import on_whole_values
from pt3func.trace.source import describe, is_user_file

aten = torch.ops.aten


def _has_rule(op: torch._ops.OpOverload) -> bool:
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = (prop.op_strategy_funcs, prop.op_to_rules, getattr(prop, "op_single_dim_strategy_funcs", {}),
              DTensor._op_dispatcher._custom_op_handlers)
    return any(op in table for table in tables)


def _decomposable(op: object) -> bool:
    if not isinstance(op, torch._ops.OpOverload) or _has_rule(op):
        return False
    schema = op._schema
    returns_tensors = bool(schema.returns) and all(
        isinstance(r.type, torch.TensorType) and r.alias_info is None for r in schema.returns
    )
    # In-place and view ops must keep their aliasing, random ops their draws (`random_ops.py`): leave them.
    return returns_tensors and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in op.tags


@functools.cache
def decomposed_ops() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """Op -> DTensor handler for every op this module decomposes (computed once, after DTensor's rules exist)."""
    import torch._prims as prims
    import torch.distributed.tensor._ops  # noqa: F401  (registers DTensor's rules)

    ops = [op for op in decomposition_table if _decomposable(op)]
    handlers: dict[torch._ops.OpOverload, Callable[..., Any]] = {op: _run_decomposition for op in ops}
    handlers.update(_WHERE_WITH_SCALARS)
    if _decomposable(aten._weight_norm_interface_backward.default):
        handlers[aten._weight_norm_interface_backward.default] = _weight_norm_interface_backward
    # Some decompositions are torch._refs written with prims (`prims.where`), which DTensor has no rules for:
    # each prim runs its aten implementation over the DTensors.
    for prim in vars(prims).values():
        if isinstance(prim, torch._ops.OpOverload) and hasattr(prim, "impl_aten") and _decomposable(prim):
            handlers[prim] = _run_prim
    return handlers


def _run_decomposition(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    return decomposition_table[op](*args, **kwargs)


def _weight_norm_interface_backward(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """`weight_norm`'s backward (`nn.utils.parametrizations.weight_norm`, `nn.utils.weight_norm`), which
    `torch._decomp` has no decomposition for (it has the forward's): aten's own differentiable formula
    (`_weight_norm_differentiable_backward`, WeightNorm.cpp) written with sums over the kept dims."""
    bound = {**dict(zip([a.name for a in op._schema.arguments], args)), **kwargs}
    grad_w, v, g, norms = bound["grad_w"], bound["saved_v"], bound["saved_g"], bound["saved_norms"]
    dim = bound["dim"] % v.dim()
    norms = norms.to(g.dtype)  # float32 beside a bfloat16 g (the forward keeps the norm in float32)
    per_dim_sums = (grad_w * v).sum([d for d in range(v.dim()) if d != dim], keepdim=True)
    grad_v = (g / norms) * (grad_w - v * (per_dim_sums / (norms * norms)))
    return grad_v, per_dim_sums / norms


def _where_with_scalars(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """`torch.where` with a Python number on either side, as `where.self` with 0-d tensors (whose dtype is the one
    the number gets beside the other side). Its decomposition is `prims.where`, whose aten implementation is
    `torch.where` again: decomposing it would never end."""
    cond, a, b = args
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        dtype = torch.result_type(torch.tensor(a), torch.tensor(b))
        a, b = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
    elif not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=b.dtype)
    elif not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype)
    return aten.where.self(cond, a, b, **kwargs)


_WHERE_WITH_SCALARS = {
    op: _where_with_scalars for op in (aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
}


def _run_prim(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    return op.impl_aten(*args, **kwargs)


@contextlib.contextmanager
def decomposing_ops_without_rules() -> Iterator[None]:
    """Within this block, DTensor runs `decomposed_ops()` through their decompositions (see the module doc)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers  # read by DTensor's C++ dispatch: change it in place
    added = {op: fn for op, fn in decomposed_ops().items() if op not in handlers}
    replaced = {op: handlers[op] for op in (aten.argmax.default, aten.argmin.default) if op in handlers}
    handlers.update(added)
    handlers.update({op: functools.partial(_flat_argminmax_of_the_whole, fn) for op, fn in replaced.items()})
    dispatcher = DTensor._op_dispatcher
    # torch >= 2.12 dispatches in C++ and calls back here when sharding propagation misses its cache; the C++ side
    # looks the method up on the dispatcher object each time, so an instance attribute takes effect.
    slow_path = "_propagate_op_sharding_dispatch_slow_path"
    patched = hasattr(dispatcher, slow_path) and slow_path not in vars(dispatcher)
    if patched:
        setattr(dispatcher, slow_path, functools.partial(_replicated_fallback, getattr(dispatcher, slow_path)))
    try:
        yield
    finally:
        if patched:
            delattr(dispatcher, slow_path)
        for op in added:
            handlers.pop(op, None)
        handlers.update(replaced)


_NO_RULE = "does not have a sharding strategy registered"


def _replicated_fallback(original: Callable[..., Any], op_call: torch._ops.OpOverload, args: tuple, kwargs: dict,
                         op_info: Any, *rest: Any) -> Any:
    """DTensor's sharding propagation for `op_call`; where the op has no rule: run it on the local tensors if every
    DTensor operand is replicated on one mesh, else a `ShardingError` (see the module doc)."""
    try:
        return original(op_call, args, kwargs, op_info, *rest)
    except NotImplementedError as exc:
        value_shaped = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output} & set(op_call.tags)
        if _NO_RULE not in str(exc) or value_shaped:
            raise
        dtensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
        meshes = {d.device_mesh for d in dtensors}
        random = torch.Tag.nondeterministic_seeded in op_call.tags
        if random or len(meshes) != 1 or not all(_whole_or_pending(d) for d in dtensors):
            raise ShardingError(_refusal(op_call, args, kwargs, random)) from None
    return _run_on_local_tensors(op_call, args, kwargs, meshes.pop())


def _written_operands(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[frozenset, Any]:
    """The operands `op` writes (in-place, `out=`), by alias set."""
    bound = {**dict(zip([a.name for a in op._schema.arguments], args)), **kwargs}
    return {frozenset(a.alias_info.before_set): bound.get(a.name) for a in op._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write}


def _whole_or_pending(d: DTensor) -> bool:
    """Replicated, or a pending sum, which can be reduced first."""
    return all(p.is_replicate() or p.is_partial() for p in d.placements)


def _run_on_local_tensors(op: torch._ops.OpOverload, args: tuple, kwargs: dict, mesh: Any) -> Any:
    """`op` of replicated operands (pending sums reduced first) on each rank's local copies, its new outputs
    replicated DTensors."""
    whole = [Replicate()] * mesh.ndim
    written = _written_operands(op, args, kwargs)
    written_ids = {id(d) for d in written.values()}
    write_back: list[tuple[DTensor, DTensor]] = []

    def reduced(d: DTensor) -> DTensor:
        if all(p.is_replicate() for p in d.placements):
            return d
        r = d.redistribute(mesh, whole)
        if id(d) in written_ids:
            write_back.append((d, r))
        return r

    reduced_args, reduced_kwargs = pytree.tree_map_only(DTensor, reduced, (args, kwargs))
    unwrap = functools.partial(pytree.tree_map_only, DTensor, lambda d: d._local_tensor)
    out = op(*unwrap(reduced_args), **unwrap(reduced_kwargs))
    for d, r in write_back:
        # A written pending sum stays one, holding the result (on one rank, zeros on the others for a sum), so views
        # sharing its local tensor, which keep its placements, read the result too.
        # (DTensor's `redistribute` refuses Replicate -> Partial to users: each placement's own partition here.)
        # Of a sum, the whole value on the ranks at coordinate 0 of each pending axis and zeros on the others (not
        # DTensor's value / n on every rank, which truncates integers and rounds floats); of a mean, max or min, the
        # value on every rank.
        local = r._local_tensor
        for axis, p in enumerate(d.placements):
            if p.is_partial():
                reduce_op = getattr(p, "reduce_op", "sum")
                if reduce_op == "sum":
                    if mesh.get_local_rank(axis) != 0:
                        local = torch.zeros_like(local)
                elif reduce_op not in ("avg", "max", "min"):
                    local = p._partition_value(local, mesh, axis)
        d._local_tensor.copy_(local)
    outs = out if isinstance(out, tuple) else (out,)
    wrapped = []
    for ret, value in zip(op._schema.returns, outs):
        # An output that aliases a written operand (in-place, out=) is that operand, as DTensor gives it back.
        key = ret.alias_info is not None and frozenset(ret.alias_info.before_set)
        if key in written and isinstance(written[key], DTensor):
            wrapped.append(written[key])
        else:
            wrapped.append(pytree.tree_map_only(torch.Tensor, lambda t: DTensor.from_local(
                t, mesh, whole, run_check=False), value))
    return tuple(wrapped) if isinstance(out, tuple) else wrapped[0]


def _refusal(op: torch._ops.OpOverload, args: tuple, kwargs: dict, random: bool) -> str:
    bound = {**dict(zip([a.name for a in op._schema.arguments], args)), **kwargs}
    operands = ", ".join(f"{name}: {tuple(v.placements)} on mesh {v.device_mesh.mesh_dim_names}"
                         for name, v in bound.items() if isinstance(v, DTensor))
    node = torch._C._current_autograd_node()
    where = f"in the backward of {node.name()}" if node is not None else f"at {_user_line()}"
    why = ("it draws random numbers: each rank would draw its own" if random else
           "DTensor has no sharding rule for it, and pt3func runs such an op itself only where every operand is "
           "replicated on one mesh")
    return (f"{op} {where} cannot run on these operands ({operands}): {why}. Replicate its operands first "
            "(pf.with_sharding_constraint(x, P()) before the call), or keep the step unsharded there.")


def _user_line() -> str:
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return "an unknown line" if frame is None else describe(frame.f_code.co_filename, frame.f_lineno)


def _flat_argminmax_of_the_whole(original: Callable[..., Any], op: torch._ops.OpOverload, args: tuple,
                                 kwargs: dict) -> Any:
    """`argmax()` / `argmin()` without a dim: of the gathered value, on every rank (torch 2.11's handler reads a
    value's flat index as data inside the trace, even for a whole value). With a dim, DTensor's own handler."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is not None or not isinstance(x, DTensor):
        return original(op, args, kwargs)
    return on_whole_values(op, args, kwargs, x.device_mesh)

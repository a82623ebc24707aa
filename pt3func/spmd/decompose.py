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
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch.distributed.tensor import DTensor

from pt3func.spmd.lower import on_whole_values

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
    try:
        yield
    finally:
        for op in added:
            handlers.pop(op, None)
        handlers.update(replaced)


def _flat_argminmax_of_the_whole(original: Callable[..., Any], op: torch._ops.OpOverload, args: tuple,
                                 kwargs: dict) -> Any:
    """`argmax()` / `argmin()` without a dim: of the gathered value, on every rank (torch 2.11's handler reads a
    value's flat index as data inside the trace, even for a whole value). With a dim, DTensor's own handler."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is not None or not isinstance(x, DTensor):
        return original(op, args, kwargs)
    return on_whole_values(op, args, kwargs, x.device_mesh)

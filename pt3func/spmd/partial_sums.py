"""Where a pending sum meets a whole value in an addition, reduce the sum (while a sharded step is traced).

DTensor keeps a partial sum (`Partial`: each rank holds a term) pending for as long as the ops it meets are linear,
and to add a replicated value to it, it makes that value partial too (the value on one rank, zero on the others),
which needs no communication. In a transformer whose output projections are row-parallel this keeps the whole
residual stream partial: a hand-written RMSNorm (`x * rsqrt(mean(x**2))`) is linear in `x` once its scale is
reduced, so its output stays partial, and the next column-parallel matmul must then multiply a partial input by a
*whole* weight: DTensor all-gathers the weight, and before the activation function all-reduces the activations
(a Hugging Face Llama on a tensor parallel mesh: every q/k/v/gate/up weight gathered, forward and backward, the
tensor parallel layout undone). Megatron and GSPMD reduce the row-parallel output where it joins the residual.
That is the rule here: for `add` / `sub` with a partial and a whole operand, DTensor chooses among the strategies
that keep the whole operand as it is and reduce the partial one into its layout (an all-reduce; failing that,
among those that at least make no operand partial), so the sum leaves the addition whole. Left to itself on a
dp x tp mesh, even without the partial option, DTensor preferred a reduce-scatter onto the batch dim and then
all-gathered the activations again before every matmul that read them. The backward's gradient accumulation (an `add`
of a residual gradient and a partial one) follows the same rule: one reduction per block there too, as in
Megatron. Sums of partial values (`Partial + Partial`) stay pending.

A pending sum is also never reduce-scattered onto a dim that does not split evenly over the mesh axis (in any
op: `square` of a tp-pending sum of 3 rows per dp rank was reduce-scattered 2/1 over tp): DTensor pads such blocks,
and its gather of a dim split over two axes unevenly (one flattened all-gather over dp+tp, then `[:rows]`) kept a
pad row and dropped a real one, a wrong loss with no error. Strategies that would lay an operand out unevenly are
set aside while another remains (the all-reduce, i.e. Replicate), as pt3func's own `device_put` refuses uneven
splits. That is a matter of correctness, not of layout, so it holds with "reduce_partial_sums" disabled too.

A matrix product of a pending sum and a split operand (a weight split by tensor parallelism) reduces the pending
sum and keeps the split operand as it is (`mm`, `addmm`, `bmm`, `baddbmm`). DTensor's cost model gathered the weight
whole instead: behind a vocabulary-parallel head the gradient of the head's input is a pending sum, stays pending
through the final norm's backward and every residual addition, and each block's backward gathered its row-parallel
weights (and reduce-scattered their gradients) to multiply it. Megatron all-reduces that gradient instead; here
each product that reads it reduces it, which moves activations (batch x features) rather than weights, and leaves
every weight and its gradient split. Off with "reduce_partial_sums" too.

Applied only inside `reducing_partial_sums()` (pt3func's sharded traces), per thread: DTensor used eagerly
elsewhere in the process keeps its own choices (DTensor does not cache its choices while tracing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from pt3func._compat import is_plain_shard, is_strided_shard, wrap_dtensor_strategy_selection
from pt3func.config import config

aten = torch.ops.aten
_ADDITIONS = frozenset({aten.add.Tensor, aten.sub.Tensor})
_PRODUCTS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
_state = threading.local()


@contextlib.contextmanager
def reducing_partial_sums() -> Iterator[None]:
    """While active (in this thread), DTensor reduces a partial sum where an addition meets a whole value.

    Off with "reduce_partial_sums" in `pf.config.disabled_passes` (DTensor's own choices for additions; operands
    are still never laid out unevenly, see the module's docstring).
    """
    wrap_dtensor_strategy_selection(_select)
    previous = getattr(_state, "additions", False), getattr(_state, "depth", 0)
    _state.additions = "reduce_partial_sums" not in config.disabled_passes
    _state.depth = previous[1] + 1
    try:
        yield
    finally:
        _state.additions, _state.depth = previous


def _select(original: Any, strategy: Any, op_schema: Any = None) -> Any:
    """DTensor's choice of strategy, among those that lay no operand out unevenly (while one does not); for an
    addition, among those that reduce its partial operand and leave the whole operands as they are (else among
    those that at least make no operand partial)."""
    if not getattr(_state, "depth", 0) or op_schema is None:
        return original(strategy, op_schema)
    even = [spec for spec in strategy.strategies if not _splits_an_operand_unevenly(spec, op_schema)]
    if even and len(even) < len(strategy.strategies):
        strategy = type(strategy)(even)
    if getattr(_state, "additions", False) and op_schema.op in _PRODUCTS and _meets_a_split_operand(op_schema):
        kept = [spec for spec in strategy.strategies if _reduces_into_whole_operand(spec, op_schema)]
        if kept and len(kept) < len(strategy.strategies):
            strategy = type(strategy)(kept)
    if getattr(_state, "additions", False) and op_schema.op in _ADDITIONS and _mixes_partial_and_whole(op_schema):
        if _accumulates_a_gradient(op_schema):
            return _keeping_the_sum_pending(strategy, op_schema) or original(strategy, op_schema)
        for keep in (_reduces_into_whole_operand, _makes_no_operand_partial):
            kept = [spec for spec in strategy.strategies if keep(spec, op_schema)]
            if kept:
                if len(kept) < len(strategy.strategies):
                    strategy = type(strategy)(kept)
                break
    return original(strategy, op_schema)


@contextlib.contextmanager
def gradients_of(shapes: set[tuple[int, ...]]) -> Iterator[None]:
    """While a backward computes the gradients of parameters of these (global) shapes: an addition of such a
    shape is taken to accumulate a parameter's gradient (a tied weight's two uses; a data term's partial
    gradient plus a penalty's whole one) and leaves the sum pending (`_keeping_the_sum_pending`), so the
    gradient is reduced once, at the end, where pf.jit(grad_exchange=...) compresses it. Reduced here, mid
    backward, it went over uncompressed."""
    previous = getattr(_state, "gradient_shapes", frozenset())
    _state.gradient_shapes = previous | frozenset(shapes)
    try:
        yield
    finally:
        _state.gradient_shapes = previous


def _keeping_the_sum_pending(strategy: Any, op_schema: Any) -> Any:
    """For a gradient's accumulation: DTensor's strategy that leaves the sum pending if it offers one (torch 2.13
    does, making the whole term partial: it lands on one rank, no communication); else (torch 2.11 offers only
    "reduce the partial term") that strategy built here. None where the operands do not allow it (the whole terms
    laid out otherwise than the partial one, partial sums of other kinds): DTensor's own choice then."""
    target = next(spec.placements for spec in op_schema.args_spec if any(p.is_partial() for p in spec.placements))
    for spec in strategy.strategies:
        if spec.output_spec.placements == target:
            return None  # DTensor's choice among its own strategies (it picks this one: no communication)
    dtypes = {spec.tensor_meta.dtype for spec in op_schema.args_spec}
    for spec in op_schema.args_spec:
        for have, want in zip(spec.placements, target):
            if have != want and not (have.is_replicate() and want.is_partial() and want.reduce_op == "sum"):
                return None
    if len(dtypes) != 1:
        return None
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec

    first = op_schema.args_spec[0]
    specs = [DTensorSpec(spec.mesh, tuple(target), tensor_meta=spec.tensor_meta) for spec in op_schema.args_spec]
    return OpSpec(
        output_specs=DTensorSpec(first.mesh, tuple(target), tensor_meta=first.tensor_meta),
        input_specs=specs,
        redistribute_cost=[[0.0] for _ in specs],
    )


def _accumulates_a_gradient(op_schema: Any) -> bool:
    shapes = getattr(_state, "gradient_shapes", frozenset())
    if not shapes:
        return False
    meta = getattr(op_schema.args_spec[0], "tensor_meta", None)
    return meta is not None and tuple(meta.shape) in shapes and \
        all(getattr(spec, "tensor_meta", None) is not None and spec.tensor_meta.shape == meta.shape
            for spec in op_schema.args_spec)


def _mixes_partial_and_whole(op_schema: Any) -> bool:
    partial = [any(p.is_partial() for p in spec.placements) for spec in op_schema.args_spec]
    return any(partial) and not all(partial)


def _meets_a_split_operand(op_schema: Any) -> bool:
    """A pending sum beside an operand split along some mesh axis (and pending on none)."""
    placements = [spec.placements for spec in op_schema.args_spec]
    return any(any(p.is_partial() for p in ps) for ps in placements) and \
        any(any(p.is_shard() for p in ps) and not any(p.is_partial() for p in ps) for ps in placements)


def _desired(spec: Any, op_schema: Any) -> list:
    return [spec.output_spec if spec.input_specs is None else spec.input_specs[i]
            for i in range(len(op_schema.args_spec))]


def _makes_no_operand_partial(spec: Any, op_schema: Any) -> bool:
    return not any(want.is_partial() and not have.is_partial()
                   for current, desired in zip(op_schema.args_spec, _desired(spec, op_schema))
                   for have, want in zip(current.placements, desired.placements))


def _reduces_into_whole_operand(spec: Any, op_schema: Any) -> bool:
    # A whole operand keeps its layout (Megatron's replicated residual stream; on dp x tp still split over dp):
    # the partial one is reduced into that layout (one all-reduce), not both moved to a layout of DTensor's.
    whole_kept = all(current.placements == desired.placements
                     for current, desired in zip(op_schema.args_spec, _desired(spec, op_schema))
                     if not any(p.is_partial() for p in current.placements))
    return whole_kept and _makes_no_operand_partial(spec, op_schema)


def _splits_an_operand_unevenly(spec: Any, op_schema: Any) -> bool:
    """True if this strategy moves an operand into a layout that splits a dim unevenly over a mesh axis (a
    reduce-scatter of a pending sum onto 3 rows over 2 ranks), a layout the operand is not in already."""
    for current, desired in zip(op_schema.args_spec, _desired(spec, op_schema)):
        meta = getattr(current, "tensor_meta", None)
        if meta is not None and current.placements != desired.placements \
                and _uneven(desired.placements, tuple(meta.shape), desired.mesh):
            return True
    return False


def _uneven(placements: tuple, shape: tuple, mesh: Any) -> bool:
    """True if some mesh axis splits a dim whose size there (after the axes before it) it does not divide.
    Sizes not known while tracing count as even (DTensor's choice then)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    sizes = list(shape)
    for axis, placement in enumerate(placements):
        if not (is_plain_shard(placement) or is_strided_shard(placement)):
            continue
        dim, ranks = placement.dim, mesh.size(axis)
        if dim >= len(sizes) or guard_or_false(sizes[dim] % ranks != 0):
            return dim < len(sizes)
        sizes[dim] = sizes[dim] // ranks
    return False

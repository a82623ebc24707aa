"""Whether a donated input's new value reads the input at other positions than it is written to.

The donation pass writes a step's new value into its donated input (`copy_(input, new)`), and Inductor fuses that
store with the ops computing `new`: a kernel that loads the input at permuted positions while storing into it reads
elements it already overwrote (`a.t().reshape(-1)`, einops `rearrange`; torch.compile of `x.copy_(f(x))` does the
same). `reordered_read` walks, from the input, the ops a compiler may fuse, following how far each element moved.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
from torch import fx

aten = torch.ops.aten


# Views whose element i is the input's element i in row-major order: reading through them reads the same
# position of the donated buffer as the copy writes.
_SAME_ORDER_VIEWS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.flatten.using_ints,
    aten.unflatten.int,
})
# Copies that keep every element where it is.
_SAME_ORDER_COPIES = frozenset({
    aten._to_copy.default, aten.clone.default, aten.lift_fresh_copy.default, aten.view_copy.default,
})
# Ops a compiler lowers to loads at computed indices (gathers, scans, row-wise normalisations), which it may fuse
# into the kernel that stores the donated buffer. Ops in neither set (matmuls, convolutions, collectives, fused
# backward kernels, ...) run as kernels of their own that finish reading before a later kernel writes.
_REORDERING_OPS = frozenset({
    aten.flip.default, aten.roll.default, aten.cat.default, aten.stack.default, aten.constant_pad_nd.default,
    aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_select.default, aten.gather.default,
    aten.embedding.default, aten.repeat.default, aten.tril.default, aten.triu.default, aten.select_scatter.default,
    aten.slice_scatter.default, aten.diagonal_scatter.default, aten.as_strided_scatter.default,
    aten.index_put.default, aten._unsafe_index_put.default, aten.scatter.src, aten.scatter.value,
    aten.scatter_add.default, aten.masked_scatter.default, aten.narrow_copy.default, aten.pixel_shuffle.default,
    aten.pixel_unshuffle.default, aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default,
    aten.sort.default, aten._softmax.default, aten._log_softmax.default, aten.native_layer_norm.default,
})

# Ops that write some positions of a copy of their first operand (`self`): out[i] is self[i] wherever nothing is
# written, so `self` is read where it is stored (a KV cache's `index_put`/`scatter`/`index_copy` of the new
# entries); only their index and value operands are read at other positions.
_KEEPS_SELF_POSITIONS = frozenset({
    aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default, aten.scatter.src,
    aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_add.default,
    aten.scatter_reduce.two, aten.index_copy.default, aten.index_add.default, aten.index_fill.int_Scalar,
    aten.index_fill.int_Tensor,
})


def _only_as_self(src: fx.Node, user: fx.Node) -> bool:
    """Whether `user` takes `src` as its first operand and as no other (`scatter(x, 0, i, x)` gathers `x` too)."""
    if not user.args or user.args[0] is not src:
        return False
    others = [*user.args[1:], *user.kwargs.values()]
    flat = [a for o in others for a in (o if isinstance(o, (list, tuple)) else [o])]
    return all(a is not src for a in flat)


def _aliases_input(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _view_shift(base: fx.Node, view: fx.Node, shift: int) -> int | None:
    """`shift` through a view that is one run of its base's elements (a row range, a split piece), else None."""
    vb, vv = _val(base), _val(view)
    if vb is None or vv is None or not (vb.is_contiguous() and vv.is_contiguous()):
        return None
    return shift - (vv.storage_offset() - vb.storage_offset())


def _cat_shift(src: fx.Node, cat: fx.Node, shift: int) -> int | None:
    """`shift` through a concatenation that lays its inputs one after the other (`torch.cat` of flat buckets)."""
    parts = list(cat.args[0])
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    vals = [_val(n) for n in parts]
    out = _val(cat)
    if parts.count(src) != 1 or out is None or any(v is None for v in vals):
        return None
    if math.prod(out.shape[: dim % out.ndim]) != 1:
        return None
    return shift + sum(v.numel() for v in vals[: parts.index(src)])


# Where a value's elements sit relative to the donated input: an int k (element i is the input's element i - k
# in row-major order, through reshapes, flat buckets and their pieces), or (ref, dims) after a broadcast (the
# input reshaped to `ref`; dim d of the value indexes dim dims[d] of ref, or none of it): a bias added to every
# row and summed back over the rows (its gradient) reads each element where it is written.
_Pos: TypeAlias = "int | tuple[tuple[int, ...], tuple[int | None, ...]]"


def _arg(node: fx.Node, name: str) -> Any:
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, arg.default_value)
    return None


def _dims_of(pos: _Pos, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int | None, ...]] | None:
    if isinstance(pos, tuple):
        return pos
    return (tuple(shape), tuple(range(len(shape)))) if pos == 0 else None


def _settled(ref: tuple[int, ...], dims: tuple[int | None, ...], shape: Sequence[int]) -> _Pos:
    """(ref, dims) as 0 when it is the input itself again."""
    if tuple(shape) == ref and all(d == k or ref[k] == 1 for k, d in enumerate(dims)):
        return 0
    return ref, dims


def _broadcast(pos: _Pos, src: torch.Tensor, out: torch.Tensor) -> _Pos | None:
    """The position of `out`'s elements where a pointwise op reads `src` (at `pos`) broadcast to its shape."""
    if src.shape == out.shape:
        return pos
    state = _dims_of(pos, src.shape)
    if state is None:
        return None
    ref, dims = state
    lead = out.ndim - src.ndim
    new = (None,) * lead + tuple(
        None if s == 1 and o != 1 else d for s, o, d in zip(src.shape, out.shape[lead:], dims)
    )
    return _settled(ref, new, out.shape)


def _unit_dims_changed(
    pos: tuple[tuple[int, ...], tuple[int | None, ...]], src: torch.Tensor, out: torch.Tensor
) -> _Pos | None:
    """The position through a reshape that only adds or drops dims of size one (a keepdim sum viewed flat)."""
    ref, dims = pos
    kept = [d for n, d in zip(src.shape, dims) if n != 1]
    if [n for n in src.shape if n != 1] != [n for n in out.shape if n != 1]:
        return None
    it = iter(kept)
    return _settled(ref, tuple(None if n == 1 else next(it) for n in out.shape), out.shape)


def _reduced(pos: _Pos, node: fx.Node, src: torch.Tensor, out: torch.Tensor) -> _Pos | None:
    """The position of a reduction's elements: defined when it sums over broadcast dims only."""
    state = _dims_of(pos, src.shape)
    dim, keepdim = _arg(node, "dim"), bool(_arg(node, "keepdim"))
    if state is None or src.ndim == 0:
        return None
    ref, dims = state
    dim = [dim] if isinstance(dim, int) else dim
    over = {d % src.ndim for d in dim} if dim else set(range(src.ndim))
    if any(dims[d] is not None and ref[dims[d]] != 1 for d in over):
        return None
    new = tuple(None if k in over else d for k, d in enumerate(dims)) if keepdim else tuple(
        d for k, d in enumerate(dims) if k not in over
    )
    return _settled(ref, new, out.shape)


def _next_pos(src: fx.Node, user: fx.Node, pos: _Pos) -> _Pos | str | None:
    """Where `user` reads `src`, whose elements sit at `pos`: the position of `user`'s elements; or the name of
    the op when it reads at other positions; or None when `user` runs as a kernel of its own (a matmul, a
    collective, a fused backward), finished before a later kernel writes."""
    target = user.target
    name = getattr(target, "__name__", str(target))
    tags = getattr(target, "tags", ())
    vs, vu = _val(src), _val(user)
    moved: _Pos | None = None
    if target in _KEEPS_SELF_POSITIONS and _only_as_self(src, user):
        return pos
    if target is operator.getitem:
        if not _aliases_input(src.target):
            return pos  # a result of var_mean, max.dim: as its op, already judged
        if isinstance(pos, int):  # a piece of split/unbind/chunk
            moved = _view_shift(src.args[0], user, pos)
    elif target in _SAME_ORDER_COPIES:
        return pos
    elif target in _SAME_ORDER_VIEWS:
        if isinstance(pos, int):
            return pos
        if vs is not None and vu is not None:
            moved = _unit_dims_changed(pos, vs, vu)
    elif _aliases_input(target):  # t, permute, slice, expand, select, ...
        if isinstance(target._schema.returns[0].type, torch.ListType):
            return pos  # split/unbind: each piece is judged at its getitem
        if isinstance(pos, int):
            moved = _view_shift(src, user, pos)
    elif target is aten.cat.default:
        if isinstance(pos, int):
            moved = _cat_shift(src, user, pos)
    elif torch.Tag.pointwise in tags:
        if vs is not None and vu is not None:
            moved = _broadcast(pos, vs, vu)
    elif torch.Tag.reduction in tags:
        # A reduction to one element reads everything before anything is written (one program, or kernels of
        # its own); a partial one may be fused with the store: over broadcast dims only, it reads in place.
        if vu is not None and vu.numel() == 1:
            return None
        if vs is not None and vu is not None:
            moved = _reduced(pos, user, vs, vu)
    elif torch.Tag.view_copy not in tags and target not in _REORDERING_OPS:
        return None
    return name if moved is None else moved


def reordered_read(placeholder: fx.Node, out: fx.Node) -> str | None:
    """The op through which `out` reads `placeholder` at other positions than its own, if any.

    Inductor fuses the donation's `copy_(input, out)` with the ops computing `out`: a kernel that loads the
    input at permuted positions while storing into it reads values it already overwrote (`a.t().reshape(-1)`,
    einops `rearrange`). Walks the ops a compiler may fuse, from the input down, following how far each
    element moved: concatenating into a flat bucket and splitting it back moves nothing, nor does broadcasting
    over rows and summing back over them; any other reordering op on the way counts, even one whose permutation
    a later op undoes (conservative).
    """
    stack: list[tuple[fx.Node, _Pos | str]] = [(placeholder, 0)]
    seen: set[tuple[fx.Node, _Pos | str]] = set()
    while stack:
        node, shift = stack.pop()
        if node is out and shift != 0:
            if isinstance(shift, str):
                return shift
            return f"a shift by {shift} elements" if isinstance(shift, int) else "a broadcast"
        for user in node.users:
            if user.op != "call_function":
                continue
            moved = _next_pos(node, user, 0 if isinstance(shift, str) else shift)
            if moved is None:
                continue
            if isinstance(shift, str):
                moved = shift  # once moved, always moved: the first culprit names it
            if (user, moved) not in seen:
                seen.add((user, moved))
                stack.append((user, moved))
    return None

"""Donation pass: write chosen outputs into the buffers of donated inputs.

`plan_donation` pairs donated inputs with outputs of the same shape, dtype and device (preferring the
output at the same pytree path, as `params -> new params`); `apply_donation` rewrites the graph so each
paired output is `copy_`-ed into its input at the end of the program and dropped from the graph's
outputs. Inductor turns such copies into in-place stores: no second copy of the state is held and no
copy-back epilogue runs. The runtime then returns the input's own storage as that output.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import fx

from pt3func.trace.capture import storage_root

aten = torch.ops.aten


@dataclass(frozen=True)
class LeafMeta:
    """What the donation planner needs to know about one flat input or output."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layout: Any = None  # (device mesh, placements) of a sharded value; None for a plain tensor


@dataclass
class DonationPlan:
    """Which input buffer each output reuses, and why the others could not be reused."""

    aliases: dict[int, int] = field(default_factory=dict)  # output index -> input index
    unused: dict[int, str] = field(default_factory=dict)  # donated input index -> reason

    @property
    def donated_inputs(self) -> set[int]:
        return set(self.aliases.values())


def _fits(a: LeafMeta, b: LeafMeta) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.layout == b.layout


def plan_donation(
    inputs: Sequence[LeafMeta],
    outputs: Sequence[LeafMeta | None],
    donated: Sequence[int],
    preferred: dict[int, int] | None = None,
) -> DonationPlan:
    """Pair each donated input with a distinct output that can live in its buffer.

    `outputs[j]` is None for outputs that are not tensors. `preferred` maps an input index to the output
    it naturally becomes (input `params['w']` -> output `new_params['w']`); that output is tried first,
    then the first free output of the same shape, dtype and device (as JAX does).
    """
    plan = DonationPlan()
    taken: set[int] = set()
    preferred = preferred or {}
    for i in donated:
        j = preferred.get(i)
        if j is None or j in taken or outputs[j] is None or not _fits(inputs[i], outputs[j]):
            j = next(
                (k for k, o in enumerate(outputs) if o is not None and k not in taken and _fits(inputs[i], o)),
                None,
            )
        if j is None:
            meta = inputs[i]
            plan.unused[i] = (
                f"no output left with shape {tuple(meta.shape)}, dtype {meta.dtype} and device {meta.device}"
                + (f" and placements {meta.layout[1]}" if meta.layout is not None else "")
            )
            continue
        taken.add(j)
        plan.aliases[j] = i
    return plan


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


def _reordered_read(placeholder: fx.Node, out: fx.Node) -> str | None:
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


def apply_donation(gm: fx.GraphModule, plan: DonationPlan) -> fx.GraphModule:
    """Rewrite `gm` in place: copy each aliased output into its donated input and drop it from the outputs.

    A donation is refused (moved to `plan.unused`) when another output, or the value written into a
    different donated input, is a view of the donated input: overwriting it would change that value; and
    when the value written reads the input at other positions than it is written to (a transpose of it).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output_node.args[0])
    donated_nodes = {placeholders[i]: i for i in plan.aliases.values()}
    for j, out in enumerate(outs):
        if not isinstance(out, fx.Node):
            continue
        root = storage_root(out)
        i = donated_nodes.get(root)
        if i is None or (plan.aliases.get(j) == i and out is root):
            continue
        # Output j reads donated input i's memory (itself or through a view): overwriting it would corrupt j.
        for k in [k for k, src in plan.aliases.items() if src == i]:
            del plan.aliases[k]
        plan.unused[i] = f"output {j} reads this input's memory (it is the input or a view of it)"
    for j, i in list(plan.aliases.items()):
        culprit = _reordered_read(placeholders[i], outs[j])
        if culprit is not None:
            del plan.aliases[j]
            plan.unused[i] = (
                f"output {j} reads this input at other positions than it would write them (through `{culprit}`): "
                "computed in place, it would read elements already overwritten"
            )
    with gm.graph.inserting_before(output_node):
        for j, i in plan.aliases.items():
            if outs[j] is not placeholders[i]:
                gm.graph.call_function(torch.ops.aten.copy_.default, (placeholders[i], outs[j]))
    output_node.args = (tuple(o for j, o in enumerate(outs) if j not in plan.aliases),)
    gm.graph.lint()
    gm.recompile()
    return gm

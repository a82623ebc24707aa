"""`pf.lax`: collectives over named mesh axes, on the local blocks a `shard_map`'ed function sees.

Each is a `torch.autograd.Function` whose forward and backward call one `_c10d_functional` op plus
`wait_tensor`, so it traces into FX graphs as an explicit collective and differentiates under both
`torch.autograd.grad` and `torch.func.grad`; a vmap rule each lets `pf.vmap` map over them.

Gradient convention (JAX's `shard_map` with `check_rep=False`): the cotangent of a value that is the
same on every rank of an axis is held *unreduced*: the true cotangent is the sum of the ranks' pieces.
So each collective transposes to its linear transpose: psum <-> psum, all_gather <-> psum_scatter,
all_to_all <-> all_to_all with split/concat swapped, ppermute <-> ppermute with the inverse
permutation. `shard_map` keeps the convention at its boundary: the cotangent of an output replicated
over N ranks is divided by N on the way in, and the cotangents of a replicated input are summed over
its ranks on the way out.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from pt3func import tree
from pt3func._compat import c10d_functional as ops
from pt3func.errors import ShardingError
from pt3func.sharding.mesh import AxisNames, Mesh
from pt3func.spmd.lower import reason
from pt3func.tree import PyTree

_BOUND: ContextVar[Mesh | None] = ContextVar("pt3func_axis_env", default=None)


@contextmanager
def bind_axes(mesh: Mesh) -> Iterator[Mesh]:
    """Within the block, pf.lax resolves axis names against `mesh` (what `shard_map` does around `f`)."""
    token = _BOUND.set(mesh)
    try:
        yield mesh
    finally:
        _BOUND.reset(token)


@dataclass(frozen=True)
class _Axes:
    group_name: str
    size: int
    index: int  # this rank's position in the group


def _bound_mesh(axis_name: AxisNames) -> Mesh:
    mesh = _BOUND.get()
    if mesh is None:
        raise ShardingError(f"axis name {axis_name!r} is not bound: pf.lax collectives run inside "
                            f"pf.shard_map, on the local blocks it passes to the function")
    return mesh


def _resolve(axis_name: AxisNames, *, ordered: bool) -> _Axes:
    """The group of `axis_name` on the bound mesh; `ordered` ops need the axes listed in mesh order."""
    mesh = _bound_mesh(axis_name)
    names = mesh.axes(axis_name)
    if ordered and names != mesh.in_mesh_order(names):
        raise ShardingError(f"axes {names} must be listed in mesh order {mesh.in_mesh_order(names)} here: "
                            f"the result's block order follows the mesh")
    return _Axes(mesh.group_name(names), mesh.axis_size(names), mesh.axis_index(names))


def _dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ShardingError(f"{what}: dim {dim} is out of range for a tensor of rank {ndim}")
    return dim % ndim


def _check_divisible(x: torch.Tensor, dim: int, axes: _Axes, what: str) -> None:
    if x.shape[dim] % axes.size:
        raise ShardingError(f"{what}: dim {dim} of shape {tuple(x.shape)} is not divisible by the axis "
                            f"size {axes.size}")


# Raw collectives: no autograd, one functional op + wait each.

def _all_reduce(x: torch.Tensor, axes: _Axes) -> torch.Tensor:
    with torch.no_grad():
        return ops.wait_tensor(ops.all_reduce(x.contiguous(), "sum", axes.group_name))


def _all_gather(x: torch.Tensor, dim: int, axes: _Axes) -> torch.Tensor:
    with torch.no_grad():
        y = ops.wait_tensor(ops.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), axes.size,
                                                       axes.group_name))
        return y.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, axes: _Axes) -> torch.Tensor:
    with torch.no_grad():
        y = ops.wait_tensor(ops.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", axes.size,
                                                      axes.group_name))
        return y.movedim(0, dim)


def _all_to_all(x: torch.Tensor, split: int, concat: int, axes: _Axes) -> torch.Tensor:
    """Block j of dim `split` goes to rank j; the blocks received are concatenated along `concat`."""
    with torch.no_grad():
        moved = x.movedim(split, 0)
        rows = moved.shape[0] // axes.size
        sizes = [rows] * axes.size
        y = ops.wait_tensor(ops.all_to_all_single(moved.contiguous(), sizes, sizes, axes.group_name))
        pieces = y.view(axes.size, rows, *moved.shape[1:]).movedim(1, split + 1)  # [source rank, *piece]
        piece = pieces.shape[1:]
        return pieces.movedim(0, concat).reshape(*piece[:concat], axes.size * piece[concat], *piece[concat + 1:])


def _ppermute(x: torch.Tensor, perm: Sequence[tuple[int, int]], axes: _Axes) -> torch.Tensor:
    """An all_to_all_single with one non-empty split: each rank sends (and receives) exactly one block."""
    with torch.no_grad():
        flat = x.reshape(-1).contiguous()
        send = [0] * axes.size
        recv = [0] * axes.size
        dst = dict(perm).get(axes.index)
        src = {d: s for s, d in perm}.get(axes.index)
        if dst is not None:
            send[dst] = flat.numel()
        if src is not None:
            recv[src] = flat.numel()
        y = ops.wait_tensor(ops.all_to_all_single(flat if dst is not None else flat[:0], recv, send,
                                                  axes.group_name))
        return y.view(x.shape) if src is not None else torch.zeros_like(x)


# Differentiable collectives. Each backward applies the transposed collective (so a gradient of a gradient
# goes through it too), and each has a vmap rule (pf.vmap inside shard_map, per-example gradients included): a
# collective of a batch of blocks is the same collective on the whole batched block, its dims shifted past the
# batch dim, once for all the examples.

def _batch_first(x: torch.Tensor, batch_dim: int | None) -> torch.Tensor:
    return x if batch_dim is None else x.movedim(batch_dim, 0)


def _shifted(dim: int, batch_dim: int | None) -> int:
    """`dim` of one example as a dim of the batched block whose batch dim is first (`_batch_first`)."""
    return dim if batch_dim is None else dim + 1


def _out_dim(batch_dim: int | None) -> int | None:
    return None if batch_dim is None else 0


class _Psum(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, axes: _Axes) -> torch.Tensor:
        return _all_reduce(x, axes)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.axes = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Psum.apply(grad, ctx.axes), None

    @staticmethod
    def vmap(info, in_dims, x: torch.Tensor, axes: _Axes):
        return _Psum.apply(x, axes), in_dims[0]  # elementwise over the block: any batch dim stays where it is


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, axes: _Axes) -> torch.Tensor:
        return _all_gather(x, dim, axes)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.dim, ctx.axes = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _PsumScatter.apply(grad, ctx.dim, ctx.axes), None, None

    @staticmethod
    def vmap(info, in_dims, x: torch.Tensor, dim: int, axes: _Axes):
        b = in_dims[0]
        return _AllGather.apply(_batch_first(x, b), _shifted(dim, b), axes), _out_dim(b)


class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, axes: _Axes) -> torch.Tensor:
        return _reduce_scatter(x, dim, axes)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.dim, ctx.axes = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllGather.apply(grad, ctx.dim, ctx.axes), None, None

    @staticmethod
    def vmap(info, in_dims, x: torch.Tensor, dim: int, axes: _Axes):
        b = in_dims[0]
        return _PsumScatter.apply(_batch_first(x, b), _shifted(dim, b), axes), _out_dim(b)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, split: int, concat: int, axes: _Axes) -> torch.Tensor:
        return _all_to_all(x, split, concat, axes)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.split, ctx.concat, ctx.axes = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.concat, ctx.split, ctx.axes), None, None, None

    @staticmethod
    def vmap(info, in_dims, x: torch.Tensor, split: int, concat: int, axes: _Axes):
        b = in_dims[0]
        return _AllToAll.apply(_batch_first(x, b), _shifted(split, b), _shifted(concat, b), axes), _out_dim(b)


class _Ppermute(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, perm: tuple[tuple[int, int], ...], axes: _Axes) -> torch.Tensor:
        return _ppermute(x, perm, axes)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.perm, ctx.axes = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Ppermute.apply(grad, tuple((d, s) for s, d in ctx.perm), ctx.axes), None, None

    @staticmethod
    def vmap(info, in_dims, x: torch.Tensor, perm: tuple[tuple[int, int], ...], axes: _Axes):
        return _Ppermute.apply(x, perm, axes), in_dims[0]  # moves whole blocks: any batch dim stays where it is


# Public API. Each takes a pytree and applies itself to every tensor leaf (as JAX's collectives do); the autograd
# Functions run under the op's name, which `as_text()` shows beside the collective (its transpose's too).

def _named(op: str, fn: Callable[..., Any], *args: Any) -> Any:
    with reason(f"pf.lax.{op}"):
        return fn(*args)


def _summable(x: torch.Tensor) -> torch.Tensor:
    """Bools are counted, as JAX sums them (as int32): a sum of bools is no logical OR."""
    return x.to(torch.int32) if x.dtype == torch.bool else x


def _number(x: Any) -> torch.Tensor:
    """A Python number as the 0-d tensor it is summed as: it may differ between ranks (`axis_index`)."""
    dtype = torch.int32 if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.get_default_dtype()
    return torch.full((), x, dtype=dtype)


def psum(x: PyTree, axis_name: AxisNames) -> PyTree:
    """Sum of each leaf of `x` over the ranks of the axis (or axes); every rank gets the sum. Bools are counted
    (int32, as in JAX). A Python number is summed as a 0-d tensor (JAX's `psum(1, axis)` is a constant: here a
    number may be this rank's own, `axis_index`); for the number of ranks use `axis_size`."""
    return _sum_over(x, axis_name, "psum")


def _sum_over(x: PyTree, axis_name: AxisNames, op: str) -> PyTree:
    """`psum`, under the name of the public collective that asked for it (`op`): what `as_text()` and errors show."""
    axes = _resolve(axis_name, ordered=False)

    def one(leaf: Any) -> Any:
        if isinstance(leaf, numbers.Number):
            leaf = _number(leaf)
        if not isinstance(leaf, torch.Tensor):
            raise ShardingError(f"{op}: a leaf is {type(leaf).__name__} {leaf!r}, not a tensor or a number")
        return _named(op, _Psum.apply, _summable(leaf), axes)

    return tree.map(one, x)


def pmean(x: PyTree, axis_name: AxisNames) -> PyTree:
    """Mean of each leaf of `x` over the ranks of the axis (or axes): `psum / axis_size` (bools and integers
    give floating-point means). Its all-reduce is named `pf.lax.pmean` in `as_text()`."""
    size = axis_size(axis_name)
    return tree.map(lambda leaf: leaf / size, _sum_over(x, axis_name, "pmean"))


def all_gather(x: PyTree, axis_name: AxisNames, *, axis: int = 0, tiled: bool = True) -> PyTree:
    """The blocks of all ranks, in rank order: concatenated along `axis` (tiled), else stacked on a new
    `axis`. (JAX's default is tiled=False.) Transpose: `psum_scatter`."""
    axes = _resolve(axis_name, ordered=True)

    def one(leaf: torch.Tensor) -> torch.Tensor:
        if not tiled:
            dim = _dim(axis, leaf.ndim + 1, "all_gather(tiled=False)")
            return _named("all_gather", _AllGather.apply, leaf.unsqueeze(dim), dim, axes)
        if leaf.ndim == 0:
            raise ShardingError("all_gather(tiled=True) of a 0-d value: there is no dim to concatenate along; pass "
                                "tiled=False to stack the values on a new dim")
        return _named("all_gather", _AllGather.apply, leaf, _dim(axis, leaf.ndim, "all_gather"), axes)

    return tree.map(one, x)


def psum_scatter(x: PyTree, axis_name: AxisNames, *, scatter_dimension: int = 0,
                 tiled: bool = True) -> PyTree:
    """Sum over the ranks, of which rank i keeps block i of `scatter_dimension` (tiled), else index i of a
    dim of size axis_size, which is removed. Bools are counted (int32), as by `psum`. (JAX's default is
    tiled=False.) Transpose: `all_gather`."""
    axes = _resolve(axis_name, ordered=True)

    def one(leaf: torch.Tensor) -> torch.Tensor:
        what = "psum_scatter" if tiled else "psum_scatter(tiled=False)"
        dim = _dim(scatter_dimension, leaf.ndim, what)
        leaf = _summable(leaf)
        if tiled:
            _check_divisible(leaf, dim, axes, what)
            return _named("psum_scatter", _PsumScatter.apply, leaf, dim, axes)
        if leaf.shape[dim] != axes.size:
            raise ShardingError(f"{what}: dim {dim} of shape {tuple(leaf.shape)} must equal the axis size "
                                f"{axes.size}")
        return _named("psum_scatter", _PsumScatter.apply, leaf, dim, axes).squeeze(dim)

    return tree.map(one, x)


def all_to_all(x: PyTree, axis_name: AxisNames, split_axis: int, concat_axis: int, *,
               tiled: bool = True) -> PyTree:
    """Split `split_axis` into axis_size blocks, send block j to rank j, concatenate what arrives along
    `concat_axis` in rank order (tiled). With tiled=False (JAX's default), `split_axis` must have size
    axis_size; it is removed and the received blocks are stacked on a new `concat_axis`.
    Transpose: all_to_all with the two axes swapped."""
    axes = _resolve(axis_name, ordered=True)

    def one(leaf: torch.Tensor) -> torch.Tensor:
        what = "all_to_all" if tiled else "all_to_all(tiled=False)"
        split = _dim(split_axis, leaf.ndim, what)
        concat = _dim(concat_axis, leaf.ndim, what)
        if tiled:
            _check_divisible(leaf, split, axes, what)
            return _named("all_to_all", _AllToAll.apply, leaf, split, concat, axes)
        if leaf.shape[split] != axes.size:
            raise ShardingError(f"{what}: dim {split} of shape {tuple(leaf.shape)} must equal the axis size "
                                f"{axes.size}")
        # Exchanging along `split` leaves the source rank at `split`; then it moves to `concat_axis`.
        return _named("all_to_all", _AllToAll.apply, leaf, split, split, axes).movedim(split, concat)

    return tree.map(one, x)


def ppermute(x: PyTree, axis_name: AxisNames, perm: Sequence[tuple[int, int]]) -> PyTree:
    """Send `x` from rank `src` to rank `dst` for each `(src, dst)` of `perm` (positions along the axis);
    a rank nobody sends to gets zeros. One `all_to_all_single` with a single non-empty split per rank:
    each rank moves exactly its own block. Transpose: the inverse permutation."""
    axes = _resolve(axis_name, ordered=True)
    perm = tuple((int(s), int(d)) for s, d in perm)
    sources, dests = [s for s, _ in perm], [d for _, d in perm]
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ShardingError(f"ppermute: perm {perm} sends from or to a rank twice")
    if not all(0 <= r < axes.size for r in sources + dests):
        raise ShardingError(f"ppermute: perm {perm} names a rank outside the axis size {axes.size}")
    return tree.map(lambda leaf: _named("ppermute", _Ppermute.apply, leaf, perm, axes), x)


def axis_index(axis_name: AxisNames) -> int:
    """This rank's position along the axis (row-major over a tuple of axes, in the order given): a Python int,
    as each rank traces its own program (JAX returns a traced value). It differs between ranks: `psum` of it (or
    of any number) is a real sum."""
    return _bound_mesh(axis_name).axis_index(axis_name)


def axis_size(axis_name: AxisNames) -> int:
    """Number of ranks along the axis (product over a tuple of axes)."""
    return _bound_mesh(axis_name).axis_size(axis_name)

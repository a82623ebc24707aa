"""Random draws on sharded values: each rank keeps its block of the draw one device would make.

DTensor runs a random op on each rank's local block with that rank's generator. On a CPU mesh nothing sets the
ranks apart, so ranks seeded alike draw the same numbers for different blocks: every rank of a data parallel
step drops the same positions of its own examples, and the step is not the single-device step (on CUDA DTensor's
RNG tracker sets ranks apart by Philox offsets, its own scheme rather than one device's draw). While a sharded
step is traced (`spmd/overrides.py`) the draws below are made over the value's global shape instead, from the
rank's own generator, exactly as one device would make them, and each rank keeps its block:

- `F.dropout` (so `nn.Dropout`), the channel dropouts `F.dropout1d / 2d / 3d`, and `torch.dropout` /
  `torch.feature_dropout` (what they call) in training. Each multiplies its input by scaled Bernoulli noise, so
  the function applied to ones of the whole value's shape is that noise, broadcast, and each rank multiplies its
  block by the noise's block (the same products as one device's). Where
  torch's `F.dropout` takes the fused kernel (CUDA, 0 < p < 1) the mask comes from `native_dropout` and the
  output from `native_dropout_backward(x, mask, 1 / (1 - p))`, that kernel's own arithmetic.
- `torch.rand_like` / `torch.randn_like`, and the in-place fills `uniform_`, `normal_`, `bernoulli_(p)` (a number
  p), `exponential_`, `geometric_`, `cauchy_`, `log_normal_`, `random_` (`torch.empty_like(h).uniform_(-1, 1)`):
  the fill of an empty tensor of the whole shape, the rank's block copied in, from the user's `generator=`
  where one is given.

The whole tensor is laid out as one device's (`x.t()` of a split `x`: column by column), since a draw fills its
buffer in memory order.

Every rank draws the whole value's numbers (N times its own block's, transiently), so that the random streams of
all ranks stay in step with the single-device run's: every rank's generator advances as one device's does. Ranks
must be seeded alike (`torch.manual_seed` with one seed everywhere), as for any replicated draw. A value split in
strides (`_StridedShard`: a sequence split flattened into (batch * seq, d)) keeps its rows of the whole draw. A
pending sum (after a row-parallel matmul) is dropped out term by term with the whole mask, which is exact since
dropout scales by numbers >= 0. Values that are replicated or split unevenly, and pending sums outside dropout,
keep DTensor's own behaviour.

Other random functions on a split value (`UNCOVERED`, attention's own dropout) run as DTensor runs them, and
`warn_uncovered` says so once per function and source line: their numbers are not the single-device run's.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from pt3func._compat import is_plain_shard, is_strided_shard
from pt3func.trace.source import describe, is_user_file

_FUSED_DROPOUT_DEVICES = ("cuda", "xpu")  # where torch's dropout takes native_dropout (at::dropout)


Block = Callable[[torch.Tensor], torch.Tensor]


def _block(t: DTensor, partial_ok: bool = False) -> Block | None:
    """The function taking, from a tensor of `t`'s global shape, the block that `t`'s rank holds; None where
    pt3func leaves the draw to DTensor. With `partial_ok`, a pending sum's mesh dims take the whole value (each
    rank holds a term of all of it)."""
    placements = t.placements
    if not any(isinstance(p, Shard) or is_strided_shard(p) or (partial_ok and p.is_partial()) for p in placements):
        return None  # replicated: every rank draws the whole value already
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    # Plain ints from the mesh (DTensor's compute_local_shape_and_global_offset computes with tensors, which a
    # trace cannot specialise). Mesh dims split in order, each one the block the earlier ones left.
    size, offset = list(t.shape), [0] * t.ndim
    strided: list[tuple[int, int, int, int]] = []  # (tensor dim, split factor, ranks, this rank's index)
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate() or (partial_ok and p.is_partial()):
            continue
        n = mesh.size(mesh_dim)
        if is_strided_shard(p):
            # The dim seen as (split_factor, n, rest): the rank holds index `coordinate` of the middle, for each
            # of the split_factor chunks (a sequence split flattened into (batch * seq, d)).
            factor = int(p.split_factor)
            if sum(getattr(q, "dim", None) == p.dim for q in placements if not q.is_replicate()) > 1:
                return None  # strided and other splits of one dim: left to DTensor
            if size[p.dim] % (factor * n):
                return None
            size[p.dim] //= n
            strided.append((p.dim, factor, n, coordinate[mesh_dim]))
        elif is_plain_shard(p):
            if size[p.dim] % n:
                return None  # uneven (pt3func refuses such specs; DTensor's own layout otherwise)
            size[p.dim] //= n
            offset[p.dim] += coordinate[mesh_dim] * size[p.dim]
        else:
            return None  # partial sums (outside dropout), placements torch adds later
    if size != list(t._local_tensor.shape):
        return None
    strided_dims = {dim for dim, *_ in strided}  # (taken below, after the plain splits' slices)
    slices = tuple(slice(None) if d in strided_dims else slice(o, o + n) for d, (o, n) in enumerate(zip(offset, size)))

    def take(whole: torch.Tensor) -> torch.Tensor:
        block = whole[slices]
        for dim, factor, n, index in strided:
            block = block.unflatten(dim, (factor, n, -1)).select(dim + 1, index).flatten(dim, dim + 1)
        return block

    return take


def _like(t: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _strides_of_empty_like(shape: torch.Size, stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides `torch.empty_like` gives a tensor of this layout (preserve_format): the same where it is dense,
    else dense strides in the same order of dims (row-major where a dim is broadcast: stride 0). A draw fills its
    buffer in memory order, so the whole value's buffer must be laid out as one device's (`x.t()` of a split `x`:
    column by column)."""
    if any(st == 0 and n != 1 for n, st in zip(shape, stride)):
        order = list(reversed(range(len(shape))))
    else:
        order = sorted(range(len(shape)), key=lambda d: (stride[d], -d))  # innermost first
    dense, step = [0] * len(shape), 1
    for d in order:
        dense[d] = step
        step *= max(shape[d], 1)
    if all(stride[d] == dense[d] for d in order if shape[d] != 1):
        return tuple(stride)
    return tuple(dense)


def _empty_whole(t: DTensor, stride: tuple[int, ...] | None = None, **options: Any) -> torch.Tensor:
    """An uninitialised tensor of `t`'s global shape, laid out as `torch.empty_like(t)` (or with `stride`)."""
    local = t._local_tensor
    options = {"dtype": local.dtype, "device": local.device} | options
    return torch.empty_strided(t.shape, stride or _strides_of_empty_like(t.shape, t.stride()), **options)


# torch.dropout / torch.feature_dropout are what F.dropout / F.dropout2d call (`train` for `training`).
DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout, torch.feature_dropout)
_FUSABLE = (F.dropout, torch.dropout)  # where torch takes native_dropout on CUDA


def dropout(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func(input, p, training, inplace)`, one of `DROPOUTS`, on a split DTensor or a pending sum, or None (not
    one: run as called)."""
    names = ("input", "p", "training", "inplace")
    bound = dict(zip(names, args)) | kwargs
    x, p = bound.get("input"), float(bound.get("p", 0.5))
    training, inplace = bound.get("training", bound.get("train", True)), bound.get("inplace", False)
    if not isinstance(x, DTensor) or not training or p == 0.0 or x.numel() == 0:
        return None
    # A pending sum (after a row-parallel matmul) too: every rank draws the same whole mask, and dropout scales
    # each element by a number >= 0, so scaling each rank's term is scaling their sum (or mean, max, min).
    block = _block(x, partial_ok=True)
    if block is None:
        return None
    local = x.to_local()
    whole = _empty_whole(x).fill_(1)
    if func in _FUSABLE and local.device.type in _FUSED_DROPOUT_DEVICES and 0.0 < p < 1.0:
        _, mask = torch.native_dropout(whole, p, True)
        out = torch.ops.aten.native_dropout_backward(local, block(mask), 1.0 / (1.0 - p))
    else:
        out = local * block(func(whole, p, True))
    result = _like(x, out)
    return x.copy_(result) if inplace else result


def random_like(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`torch.rand_like(x, ...)` / `torch.randn_like(x, ...)` on a split DTensor, or None."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DTensor) or kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None
    block = _block(x)
    if block is None:
        return None
    options = {k: v for k, v in kwargs.items() if k in ("dtype", "layout", "device", "requires_grad", "generator")}
    return _like(x, block(func(_empty_whole(x), **options)))


RANDOM_LIKE = (torch.rand_like, torch.randn_like)

_T = torch.Tensor
FILLS = frozenset({
    _T.uniform_, _T.normal_, _T.bernoulli_, _T.exponential_, _T.geometric_, _T.cauchy_, _T.log_normal_, _T.random_,
})


def fill(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`x.uniform_(...)` and the other in-place `FILLS` on a split DTensor, with numbers (not tensors) for their
    parameters, or None."""
    x = args[0] if args else None
    if not isinstance(x, DTensor) or any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
        return None
    block = _block(x)
    if block is None:
        return None
    whole = _empty_whole(x, stride=x.stride())  # filled in `x`'s own memory order, as one device fills it
    func(whole, *args[1:], **kwargs)
    return x.copy_(_like(x, block(whole)))


# Draws whose numbers depend on their input's values (a probability per element or per row): the whole input is
# gathered (an all-gather of it), drawn over as one device draws, and each rank keeps its block of the result.
VALUE_DRAWS = frozenset({torch.multinomial, _T.multinomial, torch.bernoulli, _T.bernoulli, torch.poisson})


def value_draw(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`torch.multinomial(probs, n)`, `torch.bernoulli(p)`, `torch.poisson(rates)` on a split DTensor, or None."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DTensor) or any(p.is_partial() for p in x.placements):
        return None
    block = _block(x)
    if block is None:
        return None
    rest = {k: v for k, v in kwargs.items() if k != "input"}
    whole = func(x.full_tensor(), *args[1:], **rest)  # the input whole on every rank: one device's draw
    if func not in (torch.multinomial, _T.multinomial):
        return _like(x, block(whole))  # elementwise: the output is laid out as the input
    # A row of categories per example: the output keeps the splits of the rows, not of the categories (its last dim
    # is the samples).
    if any(is_strided_shard(p) for p in x.placements):
        return None
    last = x.ndim - 1
    placements = [Replicate() if is_plain_shard(p) and p.dim == last else p for p in x.placements]
    return distribute_tensor(whole, x.device_mesh, placements, src_data_rank=None)


UNCOVERED = frozenset({
    torch.randint_like, torch.normal, torch.rrelu, torch.rrelu_, F.rrelu, F.alpha_dropout, F.feature_alpha_dropout,
    torch.alpha_dropout, torch.feature_alpha_dropout, torch.native_dropout,
    torch.dropout_, torch.feature_dropout_, torch.alpha_dropout_, torch.feature_alpha_dropout_,
})
_warned: set[tuple[str, str]] = set()


def warn_uncovered(func: Callable, args: tuple, kwargs: dict) -> None:
    """Warn (once per function and source line) where a random function pt3func does not redraw meets a split
    value: every rank draws its block's numbers alone, and ranks seeded alike draw the same ones."""
    name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
    if name.startswith("_VariableFunctionsClass."):  # torch.alpha_dropout and the other builtins
        name = f"torch.{func.__name__}"
    if func is F.scaled_dot_product_attention:
        dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if not dropout_p:
            return
        name = f"scaled_dot_product_attention(dropout_p={dropout_p})"
    elif func not in UNCOVERED and func not in FILLS and func not in VALUE_DRAWS:  # (not redrawn: see their rules)
        return
    first = args[0] if args else next(iter(kwargs.values()), None)
    if not (isinstance(first, DTensor) and _block(first) is not None):
        return
    where = _user_line()
    if (name, where) in _warned:
        return
    _warned.add((name, where))
    warnings.warn(
        f"{name} on a value split over the mesh ({where}, placements {tuple(first.placements)}): pt3func does not "
        "redraw it over the whole value, so every rank draws its own block's numbers and ranks seeded alike draw "
        "the same ones; the step's numbers differ from one device's. Covered: F.dropout, F.dropout1d / 2d / 3d, "
        "torch.dropout, torch.feature_dropout, torch.rand_like, torch.randn_like, in-place fills with number "
        "parameters, torch.multinomial / bernoulli / poisson (README, 'Random draws on split values').",
        stacklevel=2,
    )


def _user_line() -> str:
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return "unknown line" if frame is None else describe(frame.f_code.co_filename, frame.f_lineno)


RANDOM = frozenset(DROPOUTS) | frozenset(RANDOM_LIKE) | FILLS | VALUE_DRAWS | UNCOVERED


def redraw(func: Callable, args: tuple, kwargs: dict) -> Any:
    """A random function of `RANDOM` called while a sharded step is traced: its result drawn over the whole value
    where `func` is covered and its input split, else None (run as called), with a warning where a split value
    meets a random function that is not redrawn."""
    if func in DROPOUTS:
        drawn = dropout(func, args, kwargs)
    elif func in RANDOM_LIKE:
        drawn = random_like(func, args, kwargs)
    elif func in FILLS:
        drawn = fill(func, args, kwargs)
    elif func in VALUE_DRAWS:
        drawn = value_draw(func, args, kwargs)
    else:
        drawn = None
    if drawn is None:
        warn_uncovered(func, args, kwargs)
    return drawn

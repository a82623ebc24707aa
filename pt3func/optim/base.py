"""The core of `pf.optim`: `GradientTransformation`, `chain`, `apply_updates` and shared helpers.

A gradient transformation is a pair of pure functions, in the shape of optax:

- `init(params) -> state` builds the state (a pytree) from the parameters;
- `update(grads, state, params=None) -> (updates, new_state)` maps gradients to updates.

Nothing is mutated: every call returns new tensors and a new state, so a whole train step, optimizer
included, traces into one static program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch.distributed.tensor import DTensor, Replicate

from pt3func import tree as pftree

PyTree = Any
Schedule = Callable[[Any], torch.Tensor]
"""A function `count -> value`; `count` is a 0-d tensor or a Python int, the value a 0-d float tensor (float64 for
the built-in schedules)."""

ScalarOrSchedule = float | Schedule


class TransformInitFn(Protocol):
    def __call__(self, params: PyTree) -> PyTree: ...


class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: PyTree, state: PyTree, params: PyTree | None = None
    ) -> tuple[PyTree, PyTree]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer (or a piece of one): `init(params) -> state` and
    `update(grads, state, params=None) -> (updates, new_state)`.

    Updates are added to the parameters with `apply_updates`; compose transformations with `chain`.
    """

    init: TransformInitFn
    update: TransformUpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def identity() -> GradientTransformation:
    """The transformation that returns the gradients unchanged.

    Returns:
        A `GradientTransformation` with an `EmptyState`.
    """

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return updates, state

    return GradientTransformation(init_fn, update_fn)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations: the updates of each are the gradients of the next.

    Args:
        *transforms: the transformations, applied in order: `GradientTransformation`s or any objects with `.init`
            and `.update` methods of that signature (`MultiSteps`, an optax-style class).

    Returns:
        A `GradientTransformation` whose state is the tuple of the states of `transforms`.
    """
    # By attribute, not by unpacking: a class with init/update methods (MultiSteps) is no (init, update) pair. A
    # plain (init, update) pair of functions is still taken, as it always was.
    pairs = []
    for i, t in enumerate(transforms):
        if callable(getattr(t, "init", None)) and callable(getattr(t, "update", None)):
            pairs.append((t.init, t.update))
        elif isinstance(t, (tuple, list)) and len(t) == 2 and all(map(callable, t)):
            pairs.append(tuple(t))
        else:
            raise TypeError(
                f"chain: argument {i} is a {type(t).__name__}, not a gradient transformation (an object with "
                "`init(params)` and `update(updates, state, params)` methods, as pf.optim's optimizers return)"
            )
    init_fns = tuple(init for init, _ in pairs)
    update_fns = tuple(update for _, update in pairs)

    def init_fn(params):
        return tuple(fn(params) for fn in init_fns)

    def update_fn(updates, state, params=None):
        if params is not None:
            check_shapes_match(updates, params)
        if len(state) != len(update_fns):
            raise ValueError(
                f"chain of {len(update_fns)} transformations got a state of {len(state)} parts; "
                "build the state with the same chain's init"
            )
        new_state = []
        for fn, s in zip(update_fns, state, strict=True):
            updates, s = fn(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init_fn, update_fn)


def check_shapes_match(updates: PyTree, params: PyTree) -> None:
    """Raise naming the first leaf whose update (gradient) has another shape than its parameter.

    A broadcastable mismatch (a (4, 4) gradient for a (4,) parameter) would otherwise reshape the parameter and
    the optimizer state silently. Trees of other structures are left to the transformations (a state may be
    built from more leaves than are updated). Skipped under `torch.compile` (Dynamo), which cannot trace the
    comparison of two tree structures on torch 2.11 (a recursion through its polyfills): a user's
    `torch.compile` of an optimizer update failed there; `pf.jit` traces without Dynamo and keeps the check."""
    if torch.compiler.is_compiling():
        return
    u_leaves, u_spec = pftree.flatten(updates)
    p_leaves, p_spec = pftree.flatten(params)
    if u_spec != p_spec:
        return
    for i, (u, p) in enumerate(zip(u_leaves, p_leaves)):
        if isinstance(u, torch.Tensor) and isinstance(p, torch.Tensor) and u.shape != p.shape:
            path = pftree.keystr(pftree.paths(params)[i])
            raise ValueError(f"optimizer update: the gradient at {path or '<root>'} has shape {tuple(u.shape)}, its "
                             f"parameter {tuple(p.shape)}; the gradients must have the parameters' shapes")


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Return `params + updates`, leaf by leaf, each result in the dtype of its parameter.

    Args:
        params: the parameters, a pytree of tensors.
        updates: a pytree of the same structure (what an `update` returned).

    Returns:
        The new parameters (new tensors; `params` is not modified).
    """
    check_shapes_match(updates, params)
    return pftree.map(lambda p, u: (p + u).to(p.dtype), params, updates)


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all the leaves of `tree` taken as one vector, as a 0-d tensor.

    A complex element counts as its two real parts (as `torch.nn.utils.clip_grad_norm_` does). The norm is
    taken in the widest real dtype of the leaves, at least float32: float32 for float16/bfloat16/float32 and
    complex64 leaves, float64 as soon as one leaf is float64 or complex128 (a float32 norm would cost a float64
    step its precision)."""
    leaves = pftree.leaves(tree)
    dtype = torch.float32
    for x in leaves:
        real = x.dtype.to_real()  # complex128 -> float64; real dtypes unchanged
        if real.is_floating_point:
            dtype = torch.promote_types(dtype, real)
    if not leaves:
        return torch.zeros((), dtype=dtype)

    def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
        if x.is_complex():
            # `x.to(float32)` would drop the imaginary part; view it as (..., 2) reals instead.
            x = torch.view_as_real(x)
        return torch.sum(torch.square(x.to(dtype)))

    return torch.sqrt(torch.stack([sum_of_squares(x) for x in leaves]).sum())


def all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-d bool tensor: whether every element of every leaf of `tree` is finite (no NaN, no Inf).

    With DTensor leaves it is a replicated DTensor (on the leaves' mesh). Leaves of one layout are counted
    together first, so a tree of split and replicated leaves costs one small reduction per layout, not per leaf
    (and DTensor's `isfinite(x).all()` of a split leaf, a pending product, cannot be stacked with a whole one's)."""
    leaves = pftree.leaves(tree)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    if any(_is_array_like(x) for x in leaves):
        # Virtual arrays: counted on each rank, whose values say their layouts.
        return torch.overrides.handle_torch_function(all_finite, [x for x in leaves if _is_array_like(x)], tree)
    counts: dict[Any, torch.Tensor] = {}  # non-finite elements per layout: pending sums for split leaves
    for x in leaves:
        layout = (id(x.device_mesh), tuple(x.placements)) if isinstance(x, DTensor) else None
        bad = torch.isfinite(x).logical_not().sum()
        counts[layout] = bad if layout not in counts else counts[layout] + bad
    total = None
    for count in counts.values():
        if isinstance(count, DTensor):
            count = count.redistribute(count.device_mesh, [Replicate()] * count.device_mesh.ndim)
        total = count if total is None else total + count
    return total == 0


def _device_of(tree: PyTree) -> torch.device:
    """The device of the first tensor leaf of `tree` (CPU if there is none); 0-d state lives there."""
    for leaf in pftree.leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _zero_count(params: PyTree) -> torch.Tensor:
    """A 0-d int32 step counter on the parameters' device."""
    return torch.zeros((), dtype=torch.int32, device=_device_of(params))


def _is_array_like(x: Any) -> bool:
    """Whether `x` is an array that is not a torch.Tensor but takes torch functions (`__torch_function__`), as the
    virtual mesh's eager arrays do: each holds one value per rank thread and runs a torch function on each."""
    return not isinstance(x, torch.Tensor) and hasattr(type(x), "__torch_function__")


def _per_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, run on each rank's values when an argument is an array-like (a virtual array): `fn` looks at
    whether a value is a DTensor or a plain tensor, which only a rank's own value says."""
    if any(_is_array_like(a) for a in args):
        return torch.overrides.handle_torch_function(fn, [a for a in args if _is_array_like(a)], *args)
    return fn(*args)


def _local_flag(flag: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor flag as the plain tensor every rank holds (itself when plain)."""

    def local(flag):
        if isinstance(flag, DTensor) and all(p.is_replicate() for p in flag.placements):
            return flag.to_local()
        return flag

    return _per_rank(local, flag)


def _in_form_of(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A 0-d `flag` (the same on every rank) in the form of `like`: a replicated DTensor on `like`'s mesh when `like`
    is a DTensor, a plain tensor when it is plain. A state leaf must come back in the form it came in (a plain
    counter beside DTensor params, a replicated one in a ZeRO state), or the next call is another signature and a
    donated buffer has no output of its sharding to go to."""

    def convert(flag, like):
        if isinstance(like, DTensor):
            if isinstance(flag, DTensor):
                return flag
            mesh = like.device_mesh
            return DTensor.from_local(flag, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return _local_flag(flag)

    return _per_rank(convert, flag, like)


def _where(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.where(pred, a, b)` for a 0-d `pred`, taken in `a`'s form (see `_in_form_of`): the result is a DTensor
    exactly when `a` is one. DTensor's `torch.where` takes no plain condition outside `pf.jit`, and a replicated
    condition would turn a plain leaf into a DTensor."""
    return _per_rank(lambda pred, a, b: torch.where(_in_form_of(pred, a), a, b), pred, a, b)


def _safe_increment(count: torch.Tensor) -> torch.Tensor:
    """`count + 1`, saturating at the largest int32 instead of wrapping around."""
    return torch.where(count < torch.iinfo(torch.int32).max, count + 1, count)


def _select_tree(pred: torch.Tensor, on_true: PyTree, on_false: PyTree) -> PyTree:
    """`torch.where(pred, a, b)` leaf by leaf (`_where`: each leaf keeps its form); a traceable stand-in for
    `if pred: ... else: ...`. Leaves that are arrays (tensors, DTensors, virtual arrays) are selected; anything else
    (a Python number in a state) is `on_true`'s."""

    def select(a, b):
        if a is b:  # a leaf both branches pass through (an ExchangeState `with_state` returns) stays that object
            return a
        if isinstance(a, torch.Tensor) or _is_array_like(a):
            return _where(pred, a, b)
        return a

    return pftree.map(select, on_true, on_false)

"""The building blocks of optimizers: each closes over its hyper-parameters and returns a
`GradientTransformation`. The aliases in `alias.py` chain them into `sgd`, `adam`, `adamw`, `lion`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from pt3func import tree as pftree
from pt3func.optim.base import (
    EmptyState,
    GradientTransformation,
    PyTree,
    ScalarOrSchedule,
    Schedule,
    _safe_increment,
    _zero_count,
    global_norm,
)

MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None


def _moments_like(params: PyTree, dtype: torch.dtype | None) -> PyTree:
    return pftree.map(lambda p: torch.zeros_like(p, dtype=dtype), params)


def _as_real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (a last dim of 2): torch.optim treats a complex parameter
    as two real ones, so Adam's second moment is of each part (not the complex square) and Lion's sign each part's."""
    return torch.view_as_real(x) if x.is_complex() else x


def _like(real: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`real` (computed on `_as_real` views) back as a complex tensor where `ref` is complex."""
    return torch.view_as_complex(real) if ref.is_complex() else real


def _compute_dtype(m: torch.Tensor, g: torch.Tensor) -> torch.dtype:
    """The dtype a moment of dtype `m.dtype` is updated in from a gradient `g`: the wider of the two, at least
    float32. In float16 `g * g` overflows for |g| > 256 (Adam's second moment stayed inf for good); in bfloat16
    each op rounds, where Inductor rounds once at the end, so eager and compiled steps disagreed. float32 and
    float64 moments are computed as before."""
    return torch.promote_types(torch.promote_types(m.dtype, g.dtype), torch.float32)


def _as_real_in(m: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`m` and `g` as real views, both in `_compute_dtype(m, g)`."""
    dtype = _compute_dtype(m, g)
    return _as_real(m.to(dtype)), _as_real(g.to(dtype))


def _moment_update(m: torch.Tensor, g: torch.Tensor, decay: float) -> torch.Tensor:
    """`decay * m + (1 - decay) * g` in `_compute_dtype(m, g)`, returned in `m`'s dtype (one rounding)."""
    dtype = _compute_dtype(m, g)
    return (decay * m.to(dtype) + (1.0 - decay) * g.to(dtype)).to(m.dtype)


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant.

    Args:
        step_size: the factor.

    Returns:
        A stateless `GradientTransformation`.
    """

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return pftree.map(lambda g: (g * step_size).to(g.dtype), updates), state

    return GradientTransformation(init_fn, update_fn)


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor
    """0-d int32: the number of updates done so far (the schedule's argument)."""


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply the updates by `step_size_fn(count)`, where `count` is the number of earlier updates.

    Args:
        step_size_fn: a schedule `count -> factor` (see `pf.optim.schedules`).

    Returns:
        A `GradientTransformation` with a `ScaleByScheduleState`.
    """

    def init_fn(params):
        return ScaleByScheduleState(count=_zero_count(params))

    def update_fn(updates, state, params=None):
        del params
        step_size = step_size_fn(state.count)
        updates = pftree.map(lambda g: (g * step_size).to(g.dtype), updates)
        return updates, ScaleByScheduleState(count=_safe_increment(state.count))

    return GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply the updates by the learning rate, negated by default (updates are added to params).

    Args:
        learning_rate: a float or a schedule `count -> lr`.
        flip_sign: multiply by `-learning_rate` (descent) rather than `learning_rate`.

    Returns:
        A `GradientTransformation`.
    """
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


class TraceState(NamedTuple):
    trace: PyTree
    """The momentum buffer, one per parameter, in the parameter's dtype."""


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Heavy-ball momentum: `t = decay * t + g`, the update is `t` (or `g + decay * t` with Nesterov).

    This is `torch.optim.SGD`'s momentum with `dampening=0` (Polyak 1964; Nesterov momentum in the form
    of Sutskever et al. 2013).

    Args:
        decay: the momentum coefficient.
        nesterov: use Nesterov momentum.

    Returns:
        A `GradientTransformation` with a `TraceState`.
    """

    def init_fn(params):
        return TraceState(trace=_moments_like(params, None))

    def update_fn(updates, state, params=None):
        del params
        # In `_compute_dtype` (at least float32), each result cast once: the update to the gradient's dtype, the
        # trace to its own (in bfloat16 each op rounded, where Inductor rounds once: eager and compiled disagreed).
        wide = pftree.map(lambda g, t: g.to(_compute_dtype(t, g)) + decay * t.to(_compute_dtype(t, g)),
                          updates, state.trace)
        if nesterov:
            updates = pftree.map(lambda g, w: (g.to(w.dtype) + decay * w).to(g.dtype), updates, wide)
        else:
            updates = pftree.map(lambda g, w: w.to(g.dtype), updates, wide)
        new_trace = pftree.map(lambda w, t: w.to(t.dtype), wide, state.trace)
        return updates, TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


def _one_minus_pow(base: float, t: torch.Tensor) -> torch.Tensor:
    """`1 - base ** t` for `0 <= base < 1`, accurate in float32.

    `1 - 0.999 ** t` in float32 loses about 4 digits to cancellation (and to rounding 0.999 itself);
    `-expm1(t * log(base))`, with the log taken in double precision, does not.
    """
    if base == 0.0:
        return torch.ones_like(t)
    return -torch.expm1(t * math.log(base))


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor
    """0-d int32: the number of updates done so far."""
    mu: PyTree
    """First moment estimate, one per parameter."""
    nu: PyTree
    """Second (uncentred) moment estimate, one per parameter."""


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Rescale the updates by Adam's bias-corrected moment estimates.

    `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`, the update is
    `(m / (1 - b1^t)) / (sqrt(v / (1 - b2^t) + eps_root) + eps)`; with `eps_root = 0` these are
    `torch.optim.Adam`'s formulas (Kingma & Ba 2015, https://arxiv.org/abs/1412.6980). A complex parameter is two
    real ones, as in torch.optim: `v` holds the second moments of its real and imaginary parts.

    Args:
        b1: decay rate of the first moment.
        b2: decay rate of the second moment.
        eps: added to the denominator, outside the square root.
        eps_root: added inside the square root (useful when differentiating through the update).
        mu_dtype: dtype the first moment is stored in; the parameter's dtype if `None`. It is updated, and the
            update computed from it, in the wider of this and the gradient's dtype (as in optax).

    Returns:
        A `GradientTransformation` with a `ScaleByAdamState`.
    """

    def init_fn(params):
        return ScaleByAdamState(
            count=_zero_count(params), mu=_moments_like(params, mu_dtype), nu=_moments_like(params, None)
        )

    def update_fn(updates, state, params=None):
        del params
        # Both moments are computed in `_compute_dtype` (the wider of their dtype and the gradient's, at least
        # float32), the update taken from those values and cast once to the gradient's dtype, and only what is
        # stored is cast to the moments' dtypes (as optax does for the first moment). Computed in bfloat16 instead
        # (`m / bias_correction1` stays bfloat16 in eager: a 0-d float32 tensor does not promote it), Inductor
        # skipped those intermediate roundings and gave other numbers than eager; in float16, `g * g` overflowed.
        mu = pftree.map(lambda g, m: _like(torch.lerp(*_as_real_in(m, g), 1.0 - b1), m), updates, state.mu)

        def second_moment(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            v_wide, g_wide = _as_real_in(v, g)
            return _like(v_wide * b2 + (1.0 - b2) * (g_wide * g_wide), v)

        nu = pftree.map(second_moment, updates, state.nu)
        count = _safe_increment(state.count)
        corrections = {}

        def bias_corrections(dtype):
            # At least float32, so that t is exact and 1 - b ** t accurate even for bfloat16 moments.
            dtype = torch.promote_types(dtype, torch.float32)
            if dtype not in corrections:
                t = count.to(dtype)
                bias_correction2 = _one_minus_pow(b2, t)
                corrections[dtype] = (_one_minus_pow(b1, t), bias_correction2, torch.sqrt(bias_correction2))
            return corrections[dtype]

        def step(g, m, v):
            m_real, v_real = _as_real(m), _as_real(v)
            bias_correction1, bias_correction2, bias_correction2_sqrt = bias_corrections(v_real.dtype)
            if eps_root:
                denom = torch.sqrt(v_real / bias_correction2 + eps_root) + eps
            else:
                # torch.optim.Adam's order of operations, so that the two agree to rounding.
                denom = torch.sqrt(v_real) / bias_correction2_sqrt + eps
            return _like((m_real / bias_correction1) / denom, m).to(g.dtype)

        updates = pftree.map(step, updates, mu, nu)
        mu = pftree.map(lambda m, m_old: m.to(m_old.dtype), mu, state.mu)
        nu = pftree.map(lambda v, v_old: v.to(v_old.dtype), nu, state.nu)
        return updates, ScaleByAdamState(count=count, mu=mu, nu=nu)

    return GradientTransformation(init_fn, update_fn)


class ScaleByLionState(NamedTuple):
    count: torch.Tensor
    """0-d int32: the number of updates done so far."""
    mu: PyTree
    """The momentum, one per parameter."""


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Lion's update direction: `sign(b1 m + (1 - b1) g)`, then `m = b2 m + (1 - b2) g`.

    Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", https://arxiv.org/abs/2302.06675.
    A complex parameter is two real ones: the sign is taken of its real and imaginary parts.

    Args:
        b1: interpolation factor of the update direction.
        b2: decay rate of the momentum.
        mu_dtype: dtype the momentum is stored in; the parameter's dtype if `None`. It is updated in the wider
            of this and the gradient's dtype (as in optax).

    Returns:
        A `GradientTransformation` with a `ScaleByLionState`.
    """

    def init_fn(params):
        return ScaleByLionState(count=_zero_count(params), mu=_moments_like(params, mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        def direction(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            # In the wider dtype, as optax: bf16 params with an fp32 moment rounded the moment to bf16 first,
            # which flipped the sign of near-cancelling sums.
            m_wide, g_wide = _as_real_in(m, g)
            return _like(torch.sign((1.0 - b1) * g_wide + b1 * m_wide).to(_as_real(g).dtype), g)

        directions = pftree.map(direction, updates, state.mu)
        # In the wider of the two dtypes, cast once to `mu_dtype` (as optax does): computed in bfloat16, each
        # product rounded, Inductor skipped those roundings and gave other numbers than eager.
        mu = pftree.map(lambda g, m: _moment_update(m, g, b2), updates, state.mu)
        return directions, ScaleByLionState(count=_safe_increment(state.count), mu=mu)

    return GradientTransformation(init_fn, update_fn)


def _resolve_mask(mask: MaskOrFn, params: PyTree) -> PyTree | None:
    """The mask with the params' structure; a prefix of it (`{"dense": True, "norm": False}`) covers every leaf
    below each of its entries, as in optax."""
    resolved = mask(params) if callable(mask) else mask
    if resolved is None:
        return None
    try:
        per_leaf = pftree.broadcast_prefix(resolved, params)  # dicts by key: a plain-dict mask over a state_dict
    except pftree.PrefixError as e:
        raise ValueError(f"the weight-decay mask is not a pytree prefix of the params: {e}") from None
    return pftree.unflatten(pftree.structure(params), per_leaf)


def add_decayed_weights(weight_decay: float = 0.0, mask: MaskOrFn = None) -> GradientTransformation:
    """Add `weight_decay * param` to the updates.

    Before `scale_by_learning_rate` and after an adaptive rescaling, this is decoupled weight decay
    (AdamW, Loshchilov & Hutter 2019, https://arxiv.org/abs/1711.05101); before any rescaling it is
    L2 regularisation (as in `torch.optim.SGD(weight_decay=...)`).

    Args:
        weight_decay: the coefficient.
        mask: a pytree of Python bools with the params' structure or a prefix of it (or a function
            `params -> mask`); only the parameters marked `True` are decayed. `None` decays all of them.

    Returns:
        A stateless `GradientTransformation`; its `update` needs `params`.
    """

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights needs the params: call update(grads, state, params)")
        if weight_decay == 0.0:
            return updates, state
        resolved = _resolve_mask(mask, params)
        if resolved is None:
            updates = pftree.map(lambda g, p: g + weight_decay * p.to(g.dtype), updates, params)
        else:
            updates = pftree.map(
                lambda g, p, m: g + weight_decay * p.to(g.dtype) if m else g, updates, params, resolved
            )
        return updates, state

    return GradientTransformation(init_fn, update_fn)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Rescale the updates so that their global L2 norm is at most `max_norm`.

    If `||g|| > max_norm` every leaf is multiplied by `max_norm / ||g||`, where `||g||` is the norm of
    all leaves taken as one vector (Pascanu et al. 2013, https://arxiv.org/abs/1211.5063).

    Args:
        max_norm: the largest global norm let through; must be positive.

    Returns:
        A stateless `GradientTransformation`.
    """
    if max_norm <= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be positive, got {max_norm}")

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        norm = global_norm(updates)
        factor = max_norm / torch.clamp(norm, min=max_norm)
        return pftree.map(lambda g: (g * factor).to(g.dtype), updates), state

    return GradientTransformation(init_fn, update_fn)


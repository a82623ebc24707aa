"""Transformations that wrap another: skip non-finite steps, accumulate gradients over micro-steps.

Both decide per step with `torch.where`, never with a Python `if` on a tensor, so the step stays one
static program: the inner update is always computed and then kept or discarded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pt3func import tree as pftree
from pt3func.optim.base import (
    GradientTransformation,
    PyTree,
    _device_of,
    _in_form_of,
    _local_flag,
    _safe_increment,
    _select_tree,
    _where,
    _zero_count,
    all_finite,
)


class ApplyIfFiniteState(NamedTuple):
    notfinite_count: torch.Tensor
    """0-d int32: consecutive steps with non-finite gradients, up to and including the last one."""
    last_finite: torch.Tensor
    """0-d bool: whether the last step's gradients were all finite."""
    total_notfinite: torch.Tensor
    """0-d int32: steps with non-finite gradients since `init`."""
    inner_state: PyTree
    """The state of the wrapped transformation."""


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Skip the steps whose gradients hold a NaN or an Inf.

    On such a step the updates are zeros (so the params do not move) and the inner state is left as it
    was; the step is counted in `notfinite_count` and `total_notfinite`. After more than
    `max_consecutive_errors` bad steps in a row the inner update is applied anyway, so a run that has
    diverged does not silently stand still. Typical use: mixed-precision training with loss scaling.

    Args:
        inner: the transformation to protect, e.g. `adamw(...)`.
        max_consecutive_errors: how many consecutive non-finite steps are skipped.

    Returns:
        A `GradientTransformation` with an `ApplyIfFiniteState`.
    """

    def init_fn(params):
        return ApplyIfFiniteState(
            notfinite_count=_zero_count(params),
            last_finite=torch.ones((), dtype=torch.bool, device=_device_of(params)),
            total_notfinite=_zero_count(params),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None):
        # Every state leaf comes back in the form it came in (`_where`, `_in_form_of`): plain 0-d counters beside
        # DTensor params, replicated DTensors in a ZeRO state (placed with `P("dp")` over the whole state).
        finite = _local_flag(all_finite(updates))
        notfinite_count = _where(
            finite, torch.zeros_like(state.notfinite_count), _safe_increment(state.notfinite_count)
        )
        total_notfinite = _where(finite, state.total_notfinite, _safe_increment(state.total_notfinite))
        apply = finite | (_local_flag(notfinite_count) > max_consecutive_errors)
        new_updates, new_inner_state = inner.update(updates, state.inner_state, params)
        new_updates = _select_tree(apply, new_updates, pftree.map(torch.zeros_like, new_updates))
        inner_state = _select_tree(apply, new_inner_state, state.inner_state)
        return new_updates, ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=_in_form_of(finite, state.last_finite),
            total_notfinite=total_notfinite,
            inner_state=inner_state,
        )

    return GradientTransformation(init_fn, update_fn)


class MultiStepsState(NamedTuple):
    mini_step: torch.Tensor
    """0-d int32: micro-steps accumulated since the last inner update."""
    gradient_step: torch.Tensor
    """0-d int32: inner updates done so far."""
    inner_opt_state: PyTree
    """The state of the wrapped optimizer."""
    acc_grads: PyTree
    """The sum of the gradients of the current window, one per parameter."""


class MultiSteps:
    """Gradient accumulation: apply `inner` once every `k` micro-steps, to the mean of their gradients.

    On the first `k - 1` micro-steps of a window the updates are zeros and the gradients are summed
    into the state; on the `k`-th, `inner` is applied to their mean (their sum with
    `use_grad_mean=False`) and the accumulator is reset. With equal micro-batches this equals one
    step on the whole batch. Because the step is one static program, the inner update is computed on
    every micro-step and discarded on all but the last.

    Use `.init`/`.update` directly or `.gradient_transformation()` to get a `GradientTransformation`.

    Args:
        inner: the optimizer to apply, e.g. `adamw(...)`.
        every_k_schedule: `k`, or a function `gradient_step -> k` (an int or a 0-d int tensor).
        use_grad_mean: pass the mean of the accumulated gradients (default) rather than their sum.
    """

    def __init__(
        self,
        inner: GradientTransformation,
        every_k_schedule: int | Callable[[torch.Tensor], int | torch.Tensor],
        use_grad_mean: bool = True,
    ):
        if not callable(every_k_schedule) and every_k_schedule < 1:
            raise ValueError(f"MultiSteps: every_k_schedule must be >= 1, got {every_k_schedule}")
        self.inner = inner
        self.every_k_schedule = every_k_schedule
        self.use_grad_mean = use_grad_mean

    def _every_k(self, gradient_step: torch.Tensor) -> int | torch.Tensor:
        if callable(self.every_k_schedule):
            return self.every_k_schedule(gradient_step)
        return self.every_k_schedule

    def init(self, params: PyTree) -> MultiStepsState:
        """The initial state: counters at zero, the inner state, a zero accumulator per parameter."""
        return MultiStepsState(
            mini_step=_zero_count(params),
            gradient_step=_zero_count(params),
            inner_opt_state=self.inner.init(params),
            acc_grads=pftree.map(torch.zeros_like, params),
        )

    def update(
        self, updates: PyTree, state: MultiStepsState, params: PyTree | None = None
    ) -> tuple[PyTree, MultiStepsState]:
        """Accumulate `updates`; on the last micro-step of a window, return the inner update."""
        k = self._every_k(state.gradient_step)
        acc_grads = pftree.map(lambda a, g: a + g.to(a.dtype), state.acc_grads, updates)
        emit = state.mini_step + 1 >= k
        grads = pftree.map(lambda a: a / k, acc_grads) if self.use_grad_mean else acc_grads
        new_updates, new_inner_state = self.inner.update(grads, state.inner_opt_state, params)
        new_updates = pftree.map(lambda u: _where(emit, u, torch.zeros_like(u)), new_updates)
        return new_updates, MultiStepsState(
            mini_step=_where(emit, torch.zeros_like(state.mini_step), state.mini_step + 1),
            gradient_step=_where(emit, _safe_increment(state.gradient_step), state.gradient_step),
            inner_opt_state=_select_tree(emit, new_inner_state, state.inner_opt_state),
            acc_grads=pftree.map(lambda a: _where(emit, torch.zeros_like(a), a), acc_grads),
        )

    def has_updated(self, state: MultiStepsState) -> torch.Tensor:
        """A 0-d bool tensor: whether the step that produced `state` applied the inner update."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        """This accumulator as a `GradientTransformation` (composable with `chain`)."""
        return GradientTransformation(self.init, self.update)

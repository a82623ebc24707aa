"""Learning-rate schedules: functions `count -> value`.

A schedule takes the step count, a 0-d tensor (what optimizer states hold) or a Python int, and returns
a 0-d float64 tensor computed with torch ops only, so it traces into a static program. float64, like the
Python floats of `torch.optim.lr_scheduler`: a float64 step keeps its precision, and a float32 (or lower) update
`g * lr` rounds the value to its own dtype once (a 0-d tensor does not promote the update's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pt3func.optim.base import Schedule, _is_array_like


def _as_float(count) -> torch.Tensor:
    """The step count as float64: a tensor, DTensor or array (a virtual mesh's array, from an optimizer state placed
    with `pf.device_put`) cast in its own form, a Python number as a 0-d tensor."""
    if isinstance(count, torch.Tensor) or _is_array_like(count):
        return count.to(torch.float64)
    try:
        return torch.as_tensor(count, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"a schedule got the step count {count!r} (a {type(count).__name__}); it takes a 0-d tensor or a Python "
            "number: the `count` of a state built by the optimizer's own init"
        ) from e


def constant_schedule(value: float) -> Schedule:
    """A schedule that is `value` at every step.

    Args:
        value: the value.

    Returns:
        A schedule `count -> value`.
    """

    def schedule(count):
        return torch.full_like(_as_float(count), value)

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """A schedule that goes linearly from `init_value` to `end_value`.

    It is `init_value` until `transition_begin`, reaches `end_value` `transition_steps` steps later
    and stays there.

    Args:
        init_value: the value up to `transition_begin`.
        end_value: the value from `transition_begin + transition_steps` on.
        transition_steps: the length of the ramp; if it is not positive the schedule is `init_value`.
        transition_begin: the step the ramp starts at.

    Returns:
        A schedule `count -> value`.
    """
    if transition_steps <= 0:
        return constant_schedule(init_value)
    if transition_begin < 0:
        raise ValueError(f"linear_schedule: transition_begin must be >= 0, got {transition_begin}")

    def schedule(count):
        steps = torch.clamp(_as_float(count) - transition_begin, 0, transition_steps)
        return (end_value - init_value) * (steps / transition_steps) + init_value

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """A cosine decay from `init_value` to `alpha * init_value` over `decay_steps` steps.

    `value(t) = init_value * ((1 - alpha) * c(t) ** exponent + alpha)` with
    `c(t) = (1 + cos(pi * min(t, decay_steps) / decay_steps)) / 2`
    (SGDR, Loshchilov & Hutter 2017, https://arxiv.org/abs/1608.03983).

    Args:
        init_value: the value at step 0.
        decay_steps: the number of steps to decay over; the value is constant afterwards.
        alpha: the final value as a fraction of `init_value`.
        exponent: the power the cosine factor is raised to.

    Returns:
        A schedule `count -> value`.
    """
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps must be positive, got {decay_steps}")
    return _cosine(init_value, init_value * alpha, decay_steps, exponent)


def _cosine(start: float, end: float, steps: int, exponent: float) -> Schedule:
    def schedule(count):
        t = torch.clamp(_as_float(count), 0, steps)
        factor = 0.5 * (1.0 + torch.cos(t * (math.pi / steps)))
        if exponent != 1.0:
            factor = factor**exponent
        return (start - end) * factor + end

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run `schedules` one after the other, switching at `boundaries`.

    Schedule `i + 1` starts at step `boundaries[i]` and sees the count relative to it.

    Args:
        schedules: the schedules, in order.
        boundaries: the steps at which to switch; one fewer than `schedules`, increasing.

    Returns:
        A schedule `count -> value`.
    """
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
            f"got {len(boundaries)}"
        )

    def schedule(count):
        count = _as_float(count)
        value = schedules[0](count)
        for boundary, next_schedule in zip(boundaries, schedules[1:], strict=True):
            value = torch.where(count < boundary, value, next_schedule(count - boundary))
        return value

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """A linear warmup from `init_value` to `peak_value`, then a cosine decay to `end_value`.

    Args:
        init_value: the value at step 0.
        peak_value: the value at the end of the warmup.
        warmup_steps: the length of the warmup.
        decay_steps: the total length, warmup included; the value is `end_value` from then on.
        end_value: the final value.
        exponent: the power the cosine factor is raised to.

    Returns:
        A schedule `count -> value`.
    """
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: decay_steps ({decay_steps}) must exceed warmup_steps "
            f"({warmup_steps}); decay_steps counts the warmup too"
        )
    decay = _cosine(peak_value, end_value, decay_steps - warmup_steps, exponent)
    if warmup_steps <= 0:
        return decay
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    return join_schedules([warmup, decay], [warmup_steps])


constant = constant_schedule
linear = linear_schedule
cosine_decay = cosine_decay_schedule
warmup_cosine_decay = warmup_cosine_decay_schedule

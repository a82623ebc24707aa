"""`pf.optim`: pure, composable optimizers in the shape of optax.

An optimizer is a `GradientTransformation(init, update)`; its state is a pytree whose per-parameter
parts have the structure of the params. Everything traces into one static program.

    opt = pf.optim.chain(pf.optim.clip_by_global_norm(1.0), pf.optim.adamw(3e-4))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = pf.optim.apply_updates(params, updates)
"""

import torch

from pt3func.optim import schedules
from pt3func.optim.alias import adam, adamw, lion, sgd
from pt3func.optim.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    all_finite,
    apply_updates,
    chain,
    global_norm,
    identity,
)
from pt3func.optim.schedules import (
    constant,
    constant_schedule,
    cosine_decay,
    cosine_decay_schedule,
    join_schedules,
    linear,
    linear_schedule,
    warmup_cosine_decay,
    warmup_cosine_decay_schedule,
)
from pt3func.optim.transform import (
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_schedule,
    trace,
)
from pt3func.optim.wrappers import ApplyIfFiniteState, MultiSteps, MultiStepsState, apply_if_finite

# The optimizer states are plain data (NamedTuples of tensors, ints and pytrees): allowed for torch.load's default
# weights_only=True (torch >= 2.6), else `torch.load` of a `torch.save`d state fails naming an "unsupported global".
torch.serialization.add_safe_globals([
    EmptyState, ScaleByAdamState, ScaleByLionState, ScaleByScheduleState, TraceState, ApplyIfFiniteState,
    MultiStepsState,
])

__all__ = [
    "ApplyIfFiniteState",
    "EmptyState",
    "GradientTransformation",
    "MultiSteps",
    "MultiStepsState",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "constant_schedule",
    "cosine_decay",
    "cosine_decay_schedule",
    "global_norm",
    "identity",
    "join_schedules",
    "linear",
    "linear_schedule",
    "lion",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_schedule",
    "schedules",
    "sgd",
    "trace",
    "warmup_cosine_decay",
    "warmup_cosine_decay_schedule",
]

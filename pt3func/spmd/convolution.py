"""Convolutions of split values, in the layouts DTensor computes correctly.

DTensor's convolution rule handles one layout: the input split along its batch dim (or whole) and a whole
weight. Given anything else it gave wrong numbers without an error: a weight split over out-channels (tensor
parallel) came back as a "replicated" output with half the channels, an input split along a spatial dim as a
"replicated" output of half the width, and a weight split over in-channels failed inside the kernel.

So before `F.conv*` / `F.conv_transpose*` runs on DTensors, the weight and bias are gathered whole and the input
keeps only a split of its batch dim (other splits are gathered). The result is the single-device one; the
gathers are the price (tensor-parallel and spatially split convolutions are not made efficient, only right).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from pt3func._compat import is_plain_shard
from pt3func.spmd import lower
from pt3func.spmd.per_sample import _batch_axes, _local_weight

CONVOLUTIONS = frozenset({F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d})
_OPERANDS = ("input", "weight", "bias")


def convolve_in_supported_layout(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run `func` with its operands redistributed as the module docstring says, or None where nothing needs to
    change (no DTensor operand, or already a supported layout)."""
    args, kwargs = list(args), dict(kwargs)
    operands = {}
    for i, name in enumerate(_OPERANDS):
        if i < len(args):
            operands[name] = (args, i)
        elif name in kwargs:
            operands[name] = (kwargs, name)
    values = {name: where[key] for name, (where, key) in operands.items()}
    x, weight = values.get("input"), values.get("weight")
    if not any(isinstance(v, DTensor) for v in values.values()):
        return None
    # A batched input has as many dims as the weight (N, C, *spatial vs out, in, *kernel); only its dim 0 may
    # stay split.
    batched = isinstance(x, DTensor) and weight is not None and x.ndim == weight.ndim
    changed = False
    for name, value in values.items():
        if not isinstance(value, DTensor):
            continue
        keep = [p if (name == "input" and batched and is_plain_shard(p) and p.dim == 0) else Replicate()
                for p in value.placements]
        if tuple(keep) != tuple(value.placements):
            with lower.reason(f"{func.__name__}: {name} gathered (DTensor convolves batch-split inputs only)"):
                value = value.redistribute(value.device_mesh, keep)
            where, key = operands[name]
            where[key] = value
            values[name] = value
            changed = True
    x = values.get("input")
    if batched and len(_batch_axes(x, 0)) > 1:
        return _convolve_each_ranks_samples(func, args, kwargs, operands, values)
    if not changed:
        return None
    dtensors = [v for v in values.values() if isinstance(v, DTensor)]
    if all(isinstance(p, Replicate) for v in dtensors for p in v.placements):
        # Every operand whole: convolve the local values. torch 2.11's rule takes the weight's gradient of a
        # replicated convolution as a partial sum, which made it world-size times too large.
        return lower.on_whole_values(func, args, kwargs, dtensors[0].device_mesh)
    return func(*args, **kwargs)


def _convolve_each_ranks_samples(func: Callable, args: list, kwargs: dict, operands: dict, values: dict) -> Any:
    """A batch split over several mesh axes (`P(("dp", "tp"))`), which DTensor's rule refuses: each rank convolves
    its own samples with the whole weight, whose gradient is then a partial sum over those axes."""
    x = values["input"]
    mesh, axes = x.device_mesh, _batch_axes(x, 0)
    for name, value in values.items():
        if name == "input" or value is None:
            continue
        if not isinstance(value, DTensor):  # made in the step: the global value, the same on every rank
            value = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
        where, key = operands[name]
        where[key] = _local_weight(value, axes)
    where, key = operands["input"]
    where[key] = x.to_local()
    return DTensor.from_local(func(*args, **kwargs), mesh, x.placements, run_check=False)

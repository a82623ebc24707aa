"""Layers that never mix a batch's samples, on batch-sharded inputs: run on each rank's own samples.

Where the input is split only along its batch dim and the weights are replicated, each rank running the layer
on its own samples gives exactly the global result, split the same way, and each weight's gradient is a partial
sum over the batch's mesh axes (each rank's samples contribute theirs), reduced like any other gradient.

Group normalisation (`F.group_norm`): DTensor shards its forward, but its backward
(`native_group_norm_backward`) keeps the global batch size among its arguments and fails on the local shard
("Expect input to have ... elements").

Bags of embeddings (`F.embedding_bag` over 2-D indices, a bag per row): DTensor has no rule for
`aten._embedding_bag`.

Bilinear layers (`F.bilinear`, `nn.Bilinear`): DTensor has no rule for `aten._trilinear`, forward or backward.
Both inputs must be split alike along a dim other than the features (the last).

Recurrent layers (`nn.RNN`, `nn.GRU`, `nn.LSTM`): DTensor cannot run them: their CPU kernels transpose in
place (`aten.transpose_`), which has no sharding rule (it would change the tensor's placements). Outputs are
split along the batch dim, the final hidden (and cell) states along theirs (dim 1). A whole initial state (made
inside the step, as `nn.GRU` makes one when given none, or replicated) is split like the input first.

Not handled (DTensor's path, and its error, as before): group norm over a sharded channel or spatial dim;
embedding bags over 1-D indices with offsets, or with `max_norm`;
recurrent layers with packed sequences, unbatched (2-D) inputs, inputs split along time or features, sharded
weights, or dropout between layers while training (each rank would draw its own mask, unlike one device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from pt3func._compat import is_plain_shard
from pt3func.trace.capture import RECURRENT_KERNELS

RECURRENT = RECURRENT_KERNELS


def group_norm_locally(args: tuple, kwargs: dict) -> Any:
    """`F.group_norm(input, num_groups, weight, bias, eps)` on each rank's samples; None where not exact."""
    names = ("input", "num_groups", "weight", "bias", "eps")
    bound = dict(zip(names, args), **kwargs)
    inp, weights = bound.get("input"), [bound.get(k) for k in ("weight", "bias") if bound.get(k) is not None]
    if not isinstance(inp, DTensor) or inp.ndim < 2:
        return None
    axes = _batch_axes(inp, 0)
    if not axes or not all(_replicated(w, inp.device_mesh) for w in weights):
        return None
    local = dict(bound, input=inp.to_local())
    for k in ("weight", "bias"):
        if local.get(k) is not None:
            local[k] = _local_weight(local[k], axes)
    out = torch.nn.functional.group_norm(**local)
    return DTensor.from_local(out, inp.device_mesh, inp.placements, run_check=False)


_EMBEDDING_BAG_ARGS = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse",
                       "per_sample_weights", "include_last_offset", "padding_idx")


def embedding_bag_locally(args: tuple, kwargs: dict) -> Any:
    """`F.embedding_bag` over 2-D indices (one bag a row) on each rank's rows; None where not exact."""
    bound = dict(zip(_EMBEDDING_BAG_ARGS, args), **kwargs)
    inp, weight, per_sample = bound.get("input"), bound.get("weight"), bound.get("per_sample_weights")
    if (not isinstance(inp, DTensor) or inp.ndim != 2 or bound.get("offsets") is not None
            or bound.get("max_norm") is not None or not _replicated(weight, inp.device_mesh)):
        return None  # 1-D indices with offsets: bags are not aligned with the split; max_norm writes the table
    axes = _batch_axes(inp, 0)
    if not axes or (per_sample is not None and (not isinstance(per_sample, DTensor)
                                                or tuple(per_sample.placements) != tuple(inp.placements))):
        return None
    local = dict(bound, input=inp.to_local(), weight=_local_weight(weight, axes))
    if per_sample is not None:
        local["per_sample_weights"] = per_sample.to_local()
    out = torch.nn.functional.embedding_bag(**local)
    return DTensor.from_local(out, inp.device_mesh, inp.placements, run_check=False)


def bilinear_locally(args: tuple, kwargs: dict) -> Any:
    """`F.bilinear(input1, input2, weight, bias)` on each rank's samples; None where not exact."""
    bound = dict(zip(("input1", "input2", "weight", "bias"), args), **kwargs)
    x1, x2, weight, bias = (bound.get(k) for k in ("input1", "input2", "weight", "bias"))
    if not isinstance(x1, DTensor) or not isinstance(x2, DTensor) or x1.ndim < 2 or x1.ndim != x2.ndim:
        return None
    if tuple(x1.placements) != tuple(x2.placements) or x1.device_mesh != x2.device_mesh:
        return None
    weights = [weight] + ([bias] if bias is not None else [])
    split = {p.dim for p in x1.placements if is_plain_shard(p)}
    if len(split) != 1 or not all(_replicated(w, x1.device_mesh) for w in weights):
        return None
    axes = _batch_axes(x1, split.pop())
    if not axes or x1.placements[min(axes)].dim == x1.ndim - 1:  # split along the features: mixes them
        return None
    out = torch.nn.functional.bilinear(x1.to_local(), x2.to_local(), _local_weight(weight, axes),
                                       None if bias is None else _local_weight(bias, axes))
    return DTensor.from_local(out, x1.device_mesh, x1.placements, run_check=False)


def run_locally(func: Callable, args: tuple) -> Any:
    """`func(*args)` (a recurrent kernel, unpacked signature) on each rank's sequences; None where not exact."""
    if len(args) != 9 or not isinstance(args[2], (list, tuple)):
        return None  # the packed-sequence signature (data, batch_sizes, hx, params, ...)
    inp, hx, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if not isinstance(inp, DTensor) or inp.ndim != 3 or (dropout and train):
        return None
    batch_dim = 0 if batch_first else 1
    mesh = inp.device_mesh
    axes = _batch_axes(inp, batch_dim)
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if not axes or not all(_replicated(w, mesh) for w in weights):
        return None
    state_placements = [Shard(1) if a in axes else Replicate() for a in range(mesh.ndim)]
    local_states = []
    for state in states:
        if not isinstance(state, DTensor):  # made in the step (the global value): replicated
            state = DTensor.from_local(state, mesh, [Replicate()] * mesh.ndim, run_check=False)
        if state.device_mesh != mesh:
            return None
        if tuple(state.placements) != tuple(state_placements):
            if not all(p.is_replicate() for p in state.placements):
                return None
            state = state.redistribute(mesh, state_placements)  # this rank's sequences' rows: no communication
        local_states.append(state.to_local())
    local_weights = [_local_weight(w, axes) for w in weights]
    local_hx = tuple(local_states) if isinstance(hx, (list, tuple)) else local_states[0]
    outs = func(inp.to_local(), local_hx, local_weights, has_biases, num_layers, dropout, train, bidirectional,
                batch_first)
    out_placements = [Shard(batch_dim) if a in axes else Replicate() for a in range(mesh.ndim)]
    wrapped = [DTensor.from_local(outs[0], mesh, out_placements, run_check=False)]
    wrapped += [DTensor.from_local(t, mesh, state_placements, run_check=False) for t in outs[1:]]
    return tuple(wrapped)


def _batch_axes(inp: DTensor, batch_dim: int) -> set[int]:
    """The mesh axes splitting `inp` along `batch_dim`; empty if it is split otherwise (or a pending sum)."""
    axes = set()
    for axis, p in enumerate(inp.placements):
        if is_plain_shard(p) and p.dim == batch_dim:
            axes.add(axis)
        elif not p.is_replicate():
            return set()
    return axes


def _local_weight(weight: DTensor, axes: set[int]) -> torch.Tensor:
    # Each rank's samples give a part of the weight's gradient: a partial sum over the batch's axes.
    partial = [Partial() if a in axes else Replicate() for a in range(weight.device_mesh.ndim)]
    return weight.to_local(grad_placements=partial)


def _replicated(t: Any, mesh: Any) -> bool:
    # A plain weight would get each rank's partial gradient as if it were the whole one: DTensors only.
    return isinstance(t, DTensor) and t.device_mesh == mesh and all(p.is_replicate() for p in t.placements)

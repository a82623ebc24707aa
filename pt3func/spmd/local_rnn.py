"""Recurrent layers (`nn.RNN`, `nn.GRU`, `nn.LSTM`) on batch-sharded inputs: run on each rank's own sequences.

DTensor cannot run them: their CPU kernels transpose in place (`aten.transpose_`), which has no sharding rule
(it would change the tensor's placements). A recurrence never mixes sequences of a batch, so where the input is
split only along its batch dim and the weights are replicated, each rank runs the layer on its own sequences and
the result is exactly the global one, split the same way: outputs along the batch dim, the final hidden (and
cell) states along theirs (dim 1), and each weight's gradient a partial sum over the batch's mesh axes (each
rank's sequences contribute theirs), reduced like any other gradient. A whole initial state (made inside the
step, as `nn.GRU` makes one when given none, or replicated) is split like the input first.

Not handled (DTensor's path, and its error, as before): packed sequences, unbatched (2-D) inputs, inputs split
along time or features, sharded weights, and dropout between layers while training (each rank would draw its
own mask, unlike one device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from pt3func._compat import is_plain_shard

_VF = torch._C._VariableFunctions
RECURRENT = frozenset({_VF.rnn_tanh, _VF.rnn_relu, _VF.gru, _VF.lstm})


def run_locally(func: Callable, args: tuple) -> Any:
    """`func(*args)` (a recurrent kernel, unpacked signature) on each rank's sequences; None where not exact."""
    if len(args) != 9 or not isinstance(args[2], (list, tuple)):
        return None  # the packed-sequence signature (data, batch_sizes, hx, params, ...)
    inp, hx, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if not isinstance(inp, DTensor) or inp.ndim != 3 or (dropout and train):
        return None
    batch_dim = 0 if batch_first else 1
    mesh = inp.device_mesh
    axes = set()
    for axis, p in enumerate(inp.placements):
        if is_plain_shard(p) and p.dim == batch_dim:
            axes.add(axis)
        elif not p.is_replicate():
            return None  # split along time or features, or a pending sum
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
    partial = [Partial() if a in axes else Replicate() for a in range(mesh.ndim)]
    local_weights = [w.to_local(grad_placements=partial) for w in weights]
    local_hx = tuple(local_states) if isinstance(hx, (list, tuple)) else local_states[0]
    outs = func(inp.to_local(), local_hx, local_weights, has_biases, num_layers, dropout, train, bidirectional,
                batch_first)
    out_placements = [Shard(batch_dim) if a in axes else Replicate() for a in range(mesh.ndim)]
    wrapped = [DTensor.from_local(outs[0], mesh, out_placements, run_check=False)]
    wrapped += [DTensor.from_local(t, mesh, state_placements, run_check=False) for t in outs[1:]]
    return tuple(wrapped)


def _replicated(t: Any, mesh: Any) -> bool:
    # A plain weight would get each rank's partial gradient as if it were the whole one: DTensors only.
    return isinstance(t, DTensor) and t.device_mesh == mesh and all(p.is_replicate() for p in t.placements)

"""Graph -> Graph, for the eager backend: `view` becomes `reshape` where nothing writes the memory it views.

The trace records `view` wherever the fake tensors' strides allowed one. A few ops' fake (meta) kernels give
other strides than their real kernels (`mse_loss_backward` of a transposed prediction, as `nn.MultiheadAttention
(batch_first=True)` returns), so a `view` that was valid in the trace fails on the real tensor ("view size is not
compatible with input tensor's size and stride"). Inductor plans its own layouts and is not affected; the eager
backend runs the graph as recorded. Where no op of the program writes into the storage, a `reshape` (a view when
the strides allow it, else a copy) cannot be told apart from the `view`.
"""

from __future__ import annotations

import torch
from torch import fx

from pt3func.trace.capture import mutated_args, storage_root

aten = torch.ops.aten


def reshape_unwritten_views(gm: fx.GraphModule) -> fx.GraphModule:
    written = {storage_root(target) for node in gm.graph.nodes if node.op == "call_function"
               for target in mutated_args(node)}
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default and storage_root(node) not in written:
            node.target = aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm

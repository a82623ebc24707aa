"""Keep the backward's elementwise work in the backward (Graph -> Graph).

pf.jit compiles forward, backward and optimizer as one program, so Inductor sees a backward op's inputs long
before the backward runs. A composite backward op (LayerNorm's, GELU's, log-softmax's) decomposes into pieces, and
the pieces that read only forward values, such as LayerNorm's normalised input `(x - mean) * rstd` in fp32, get
fused into the forward kernel that reads the same `x`: computed there, and kept as a new buffer until the
backward. For the anchor GPT step on an H200 that was 13 fp32 buffers of 64 MiB each at the memory peak, held in
place of the bf16 inputs the backward needs anyway (and written, then read back: more traffic, not less).
`torch.compile` does not do this: its partitioner cuts the graph in two, so no backward piece runs early.

This pass ties such an op to the backward: its activation-sized forward input is read through
`where(never, 0, x)`, where `never` is `isnan(g) & isinf(g)` of one element of the op's own incoming gradient
`g` (always False, and no compiler folds it). Every piece of the decomposed op now depends on `g`, so none can
run before it; the select fuses into the op's kernels as one scalar load. Values are passed bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import fx
from torch._ops import OpOverload

from pt3func.passes.fence import never_after, read_after
from pt3func.passes.remat import alias_root, is_backward

aten = torch.ops.aten

# Backward ops that Inductor decomposes into pointwise ops and reductions (not extern kernels such as matmuls,
# which read their inputs as they are), and whose decomposition has pieces that read forward values only.
_DECOMPOSED_BACKWARD = {
    getattr(aten, name).default
    for name in (
        "native_layer_norm_backward",
        "native_group_norm_backward",
        "native_batch_norm_backward",
        "_fused_rms_norm_backward",
        "_log_softmax_backward_data",
        "_softmax_backward_data",
        "gelu_backward",
        "silu_backward",
        "sigmoid_backward",
        "tanh_backward",
        "threshold_backward",
        "hardswish_backward",
        "hardsigmoid_backward",
        "elu_backward",
        "leaky_relu_backward",
        "softplus_backward",
        "mish_backward",
    )
    if hasattr(aten, name)
}


def backward_op(name: str) -> OpOverload:
    """The decomposed backward op called `name` ("native_layer_norm_backward"); a clear error for any other."""
    op = next((o for o in _DECOMPOSED_BACKWARD if o.name() in (name, f"aten::{name}")), None)
    if op is None:
        known = ", ".join(sorted(o.name().removeprefix("aten::") for o in _DECOMPOSED_BACKWARD))
        raise ValueError(f"fence_backward_ops: {name!r} is not a decomposed backward op this pass fences ({known})")
    return op


def keep_backward_in_backward(gm: fx.GraphModule, ops: Collection[OpOverload] | None = None) -> fx.GraphModule:
    """Fence the forward inputs of decomposed backward ops (`ops`, default all of them) behind their incoming
    gradient (in place)."""
    targets = _DECOMPOSED_BACKWARD if ops is None else frozenset(ops)
    graph = gm.graph
    never_of: dict[fx.Node, fx.Node] = {}  # gradient -> its `never` flag (one per gradient)
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets or not is_backward(node):
            continue
        tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        # A forward value may reach the op through a view or detach recorded in the backward: judge by its storage.
        gradient = next((a for a in tensors if is_backward(alias_root(a)) and a.meta["val"].numel() > 0), None)
        if gradient is None:
            continue
        device = gradient.meta["val"].device
        forward = [a for a in tensors if not is_backward(alias_root(a)) and a.meta["val"].device == device]
        if not forward:
            continue
        # Only activation-sized inputs: statistics (mean, rstd) and weights are small, pieces reading only them
        # cost little to keep.
        largest = max(a.meta["val"].numel() for a in forward)
        for value in dict.fromkeys(a for a in forward if a.meta["val"].numel() == largest):
            with graph.inserting_before(node):
                if gradient not in never_of:
                    never_of[gradient] = never_after(graph, gradient, node)
                fenced = read_after(graph, never_of[gradient], value, node)
            node.replace_input_with(value, fenced)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm

"""Keep a gradient matmul where autograd put it, not where its sum is taken (Graph -> Graph).

A weight used twice, such as a GPT's token embedding tied to its output head, gets two gradient contributions,
and autograd adds them when the second arrives: `add(t(t(mm(t(dlogits), h))), embedding_grad)`, at the very end
of the backward, while the matmul runs right after the loss. Inductor rewrites `add(mm(a, b), c)` into
`addmm(c, a, b)` at the add's place (its post-grad `addmm` pattern; on CUDA it keeps the two apart only when
every reader of the sum is pointwise), which moves the matmul to the end too: its inputs stay alive through the
whole backward. For a tied head those are the logits' gradient, vocab x tokens (on CPU, for the example GPT,
the largest buffer at the program's peak; 1 GiB for the anchor GPT step).

This pass reads such a matmul's result through `where(never, 0, x)` (pt3func/passes/fence.py; `never` is
computed from one element of the matmul's own result) at the add, so the pattern no longer matches. The select
fuses into the add's kernel as one scalar load; the values are passed bit for bit. It applies where the matmul
reads more bytes than it writes (a weight gradient reducing over tokens; moving it would keep the larger side
alive) and is not the add's immediate neighbour. Inductor only: an op-by-op run frees the inputs after the
matmul anyway.
"""

from __future__ import annotations

import torch
from torch import fx

from pt3func.passes.fence import never_after, read_after
from pt3func.passes.remat import is_backward, is_view

aten = torch.ops.aten


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _matmul_behind_views(node: fx.Node) -> fx.Node | None:
    """The `aten.mm` that `node` is, or is a chain of single-reader views of; None otherwise."""
    while node.op == "call_function" and node.target is not aten.mm.default:
        if not is_view(node) or len(node.users) != 1 or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
        if len(node.users) != 1:
            return None
    return node if node.op == "call_function" and node.target is aten.mm.default else None


def keep_gradient_matmuls_early(gm: fx.GraphModule) -> fx.GraphModule:
    """Fence the result of every reducing backward matmul that reaches a later add only through views (in
    place; returns `gm`)."""
    graph = gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    changed = False
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target is not aten.add.Tensor or not is_backward(add):
            continue
        for operand in [a for a in add.args if isinstance(a, fx.Node)]:
            mm = _matmul_behind_views(operand)
            if mm is None or position[add] - position[mm] <= 1 + (position[operand] - position[mm]):
                continue  # the add follows the matmul (and its views) directly: fusing it moves nothing
            if sum(_bytes(a) for a in mm.all_input_nodes) <= _bytes(mm):
                continue
            with graph.inserting_before(add):
                fenced = read_after(graph, never_after(graph, mm, add), operand, add)
            add.replace_input_with(operand, fenced)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm

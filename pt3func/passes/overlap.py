"""Overlap pass: let collectives run while compute continues.

A functional collective is asynchronous until its `wait_tensor`; the trace puts each wait right after its
collective (that is where DTensor hands the value on), which serialises communication and compute.
`sink_waits` moves every wait to just before the first op that reads its result, so the collective is in
flight while the ops between them run (gradient all-reduces behind the rest of the backward, FSDP
all-gathers behind the forward of earlier layers). Data dependencies are unchanged.

Only for programs a compiler (Inductor) runs: it keeps a collective's buffers alive until the wait. Run op by op,
Python would free an input after its last use while the collective may still read it.
"""

from __future__ import annotations

import torch
from torch import fx

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each `wait_tensor` down to its first user (Graph -> Graph, in place); returns `gm`."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    moved = False
    for node in list(gm.graph.nodes):
        if node.target is not _WAIT or not node.users:
            continue
        first_user = min(node.users, key=order.__getitem__)
        if first_user.op == "output" or order[first_user] == order[node] + 1:
            continue
        first_user.prepend(node)
        moved = True
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm

"""Overlap passes: let collectives run while compute continues.

A functional collective is asynchronous until its `wait_tensor`. Three reorderings, each `Graph -> Graph`
with data dependencies unchanged:

- `issue_collectives_early` moves every collective up to just after the last of its inputs is computed. The
  trace records a collective where autograd happens to run its hook, which for an FSDP parameter is the
  backward of its all-gather, created before the forward and so run after the whole backward: without this
  pass every reduce-scatter of an FSDP step waits for the end of the backward.
- `sink_waits` moves every wait to just before the first op that reads its result, so the collective is in
  flight while the ops between them run (gradient reductions behind the rest of the backward, FSDP
  all-gathers behind the forward of earlier layers).
- `order_by_readiness` reorders the tail of the program (after the last collective is issued: the optimizer)
  so that work on values whose collectives were issued first runs first: the update of the last layer's
  parameters runs while the first layer's gradients are still being reduced.

Only for programs a compiler (Inductor) runs: it keeps a collective's buffers alive until the wait. Run op by op,
Python would free an input after its last use while the collective may still read it.
"""

from __future__ import annotations

import torch
from torch import fx

from pt3func.analysis import is_collective
from pt3func.trace.capture import storage_root

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_COPY = torch.ops.aten.copy_.default


def issue_collectives_early(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each collective to just after its last input (Graph -> Graph, in place); returns `gm`.

    The order collectives are issued in may change, but the same way on every rank: each rank runs the same
    program through the same deterministic pass, which is all NCCL and gloo need.
    """
    moved = False
    for node in list(gm.graph.nodes):
        if not is_collective(node):
            continue
        inputs = set(node.all_input_nodes)
        last = node.prev
        while inputs and last not in inputs:  # walk up to the nearest input: the last one computed
            last = last.prev
        if inputs and last.next is not node:
            last.append(node)
            moved = True
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm


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


def order_by_readiness(gm: fx.GraphModule) -> fx.GraphModule:
    """Reorder the nodes after the last collective by which collective they wait for (Graph -> Graph, in place).

    Each node of that tail gets the issue index of the latest collective it depends on; a node that depends on
    none takes the smallest index among its users, so it runs just before them rather than all at the front.
    A stable sort on that index keeps the graph topologically ordered: a node's index is never below its
    inputs', and ties keep the traced order.
    """
    nodes = list(gm.graph.nodes)
    issued = [i for i, n in enumerate(nodes) if is_collective(n)]
    if not issued:
        return gm
    tail = [n for n in nodes[issued[-1] + 1 :] if n.op not in ("output", "placeholder")]
    if len(tail) < 2:
        return gm
    issue_index = {nodes[i]: k for k, i in enumerate(issued)}
    in_tail = set(tail)
    ready: dict[fx.Node, int] = {}
    for node in nodes:
        if node in issue_index:
            ready[node] = issue_index[node]
        else:
            ready[node] = max((ready[a] for a in node.all_input_nodes), default=-1)
    key: dict[fx.Node, int] = {}
    for node in reversed(tail):
        if ready[node] >= 0:
            key[node] = ready[node]
        else:
            users = [key[u] for u in node.users if u in in_tail]
            key[node] = min(users, default=-1)
    # Tail nodes by the storage they read: a read through a view (made anywhere, even before the last
    # collective: `params.view(...)` at the top of the step) reads the viewed input's memory too.
    readers_of: dict[fx.Node, list[fx.Node]] = {}
    for node in tail:
        for root in {storage_root(a) for a in node.all_input_nodes}:
            readers_of.setdefault(root, []).append(node)
    for node in tail:
        if node.target is _COPY and isinstance(node.args[0], fx.Node):
            # An in-place write (donation's copy_ into an input) must stay after every read of the old value.
            readers = [key[u] for u in readers_of.get(storage_root(node.args[0]), []) if u is not node]
            key[node] = max([key[node], *readers])
        # Never before an input: holds by construction except after the raise above.
        key[node] = max([key[node], *(key[a] for a in node.all_input_nodes if a in in_tail)])
    position = {n: i for i, n in enumerate(tail)}
    new_order = sorted(tail, key=lambda n: (key[n], position[n]))
    if new_order == tail:
        return gm
    anchor = nodes[issued[-1]]
    for node in new_order:
        anchor.append(node)
        anchor = node
    gm.graph.lint()
    gm.recompile()
    return gm

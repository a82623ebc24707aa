"""`jit(memory_budget=x)`: choose which saved activations to recompute so they fit in `x` of what no remat keeps.

The same formulation as AOTAutograd's partitioner (`torch/_functorch/partitioners.py`, with
`activation_memory_budget`), on pt3func's whole-step graph:

1. The forward values the backward reads are the *saved activations*; their bytes with no remat are the
   reference. Graph inputs cost nothing (they are alive anyway).
2. Which of them to keep is a 0/1 knapsack (torch's `dp_knapsack`): weight = bytes, value = the cost of
   recomputing the op (FLOPs, plus bytes written for memory-bound ops), capacity = `x` times the reference
   less what cannot be recomputed at all (random ops, collectives, in-place writes).
3. A min-cut over the forward graph (networkx, as torch does) then finds the cheapest set of values to keep
   from which everything not kept can be recomputed: capacity of a node = its bytes, infinite for values the
   knapsack dropped and for views (a view is never worth keeping: its base is), zero for graph inputs and
   for the values the knapsack kept (already paid for); non-recomputable nodes hang off the source.
   If what the cut adds overshoots the budget, the knapsack runs again with less room.

`x = 1` changes nothing; `x = 0` is the min-cut alone: the fewest bytes from which the backward can
recompute everything it needs (typically the graph inputs and the random masks).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from pt3func.analysis import flop_formula, nbytes
from pt3func.passes.remat import (
    Recomputability,
    RematPlan,
    alias_root,
    apply_remat,
    is_backward,
    is_view,
    needed_by_backward,
)

# Bytes moved cost about this many FLOPs (an H100/H200 does ~1e15 bf16 FLOP/s against ~4e12 B/s).
_FLOPS_PER_BYTE = 250.0


def _free(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def _multi_output(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def recompute_cost(node: fx.Node) -> float:
    """Estimated cost of running `node` again: FLOPs (torch's flop formulas) or bytes written, whichever dominates.

    An output of a multi-output op (`getitem`) costs what its op does: recomputing one output runs the whole op
    (at 0 the knapsack dropped every LayerNorm and attention output first, and attention ran twice).
    """
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return recompute_cost(node.args[0])
    if node.op != "call_function" or is_view(node):
        return 0.0
    return max(_flops(node), _FLOPS_PER_BYTE * nbytes(node.meta.get("val")))


def compute_bound(node: fx.Node) -> bool:
    """Whether recomputing `node` costs more in FLOPs than in bytes written (matmuls, attention): such ops are
    recomputed only where the budget cannot be met otherwise, as torch's partitioner bans them by default."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return compute_bound(node.args[0])
    if node.op != "call_function" or is_view(node):
        return False
    return _flops(node) > _FLOPS_PER_BYTE * nbytes(node.meta.get("val"))


def _flops(node: fx.Node) -> float:
    # torch's formulas and pt3func's for the ops torch has none for: CPU attention at 0 FLOPs was dropped first
    formula = flop_formula(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
    if formula is None:
        return 0.0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        # The registry's formulas take the values (its wrapper reads their shapes) and `out_val`.
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that wants more than this: the bytes estimate decides
        return 0.0


def saved_bytes(graph: fx.Graph) -> int:
    """Bytes of the forward values the backward reads, each storage counted once, graph inputs not counted."""
    owners = {alias_root(n) for n in needed_by_backward(graph)}
    return sum(nbytes(n.meta.get("val")) for n in owners if not _free(n))


def plan_budget(gm: fx.GraphModule, budget: float) -> RematPlan:
    """The recompute set that fits the saved activations of `gm` in `budget` (0..1) of their bytes now."""
    graph = gm.graph
    total = saved_bytes(graph)
    if budget >= 1.0 or total == 0:
        return RematPlan(set(), set())
    can = Recomputability(graph)
    roots = needed_by_backward(graph)
    forward = _ancestors(roots)
    owners = sorted({alias_root(n) for n in roots if not _free(alias_root(n))}, key=_position(graph))
    fixed = [o for o in owners if not can(o) or _multi_output(o)]
    candidates = [o for o in owners if o not in fixed]
    fixed_bytes = sum(nbytes(o.meta.get("val")) for o in fixed)
    target = budget * total
    best: tuple[int, set[fx.Node]] | None = None
    heavy = {n for n in forward if compute_bound(n)}
    # First with long recompute chains and compute-bound ops the knapsack kept banned (better peak, no matmul run
    # twice to save the bytes of a cheap value after it); if that cannot meet the budget, without.
    for ban_long in (budget > 0, False):
        room = target - fixed_bytes
        for _ in range(8):
            keep = _knapsack(candidates, room) if room > 0 and budget > 0 else []
            dropped = set(candidates) - set(keep)
            long = _long_chains(graph, forward, can, set(keep)) | (heavy - dropped) if ban_long else set()
            dropped -= long
            recompute, cut_bytes = _min_cut(forward, roots, can, set(keep), dropped, long)
            if not keep and dropped:
                # Nothing kept: the cut alone is the least that can be saved. Forcing every candidate to be
                # recomputed can only cost more, e.g. saving a random op's fp32 draw instead of its bool mask.
                alone, alone_bytes = _min_cut(forward, roots, can, set(), set(), long)
                if alone_bytes < cut_bytes:
                    recompute, cut_bytes = alone, alone_bytes
            kept_bytes = cut_bytes + sum(nbytes(k.meta.get("val")) for k in keep)
            if best is None or kept_bytes < best[0]:
                best = (kept_bytes, recompute)
            if kept_bytes <= target:
                return RematPlan(recompute, set())
            if not keep:
                break
            room -= kept_bytes - target  # what the cut added beyond the budget comes out of the knapsack
        if not ban_long:
            break
    return RematPlan(best[1], set())


def fit_memory_budget(gm: fx.GraphModule, budget: float) -> fx.GraphModule:
    """The pass `jit(memory_budget=...)` runs (Graph -> Graph, in place)."""
    return apply_remat(gm, plan_budget(gm, budget))


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen or is_backward(n):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _knapsack(candidates: list[fx.Node], room: float) -> list[fx.Node]:
    """The candidates to keep: most recompute cost saved within `room` bytes (torch's knapsack solvers)."""
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack, greedy_knapsack

    if not candidates:
        return []
    sizes = [float(nbytes(c.meta.get("val"))) for c in candidates]
    scale = sum(sizes)
    memory = [s / scale for s in sizes]
    runtime = [recompute_cost(c) for c in candidates]
    solve = dp_knapsack if len(candidates) <= 2000 else greedy_knapsack
    _, keep, _ = solve(memory, runtime, min(room / scale, 1.0))
    return [candidates[i] for i in keep]


def _long_chains(graph: fx.Graph, forward: set[fx.Node], can: Recomputability, kept: set[fx.Node]) -> set[fx.Node]:
    """Values whose recomputation would reach far back through the forward: keep them instead.

    Recomputing a value whose chain reaches back a long way (a residual stream back to the embedding) brings
    all of that chain's values to life at the start of the backward, where they stay until their own
    backward use, so the peak does not fall. As torch's partitioner bans recomputing long fusible chains,
    a value whose recompute chain (through values not kept) spans more than an eighth of the forward is kept.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = sorted(forward, key=order.__getitem__)
    width = max(64, len(nodes) // 8)
    reach: dict[fx.Node, int] = {}
    long: set[fx.Node] = set()
    for n in nodes:
        start = order[n]
        if can(n) and not _free(n) and n not in kept:
            for m in n.all_input_nodes:
                if m in reach:
                    start = min(start, reach[m])
            if order[n] - start > width:
                long.add(n)
                start = order[n]
        reach[n] = start if can(n) and not _free(n) and n not in kept else order[n]
    return long


def _min_cut(
    forward: set[fx.Node],
    roots: list[fx.Node],
    can: Recomputability,
    kept: set[fx.Node],
    dropped: set[fx.Node],
    banned: set[fx.Node] = frozenset(),
) -> tuple[set[fx.Node], int]:
    """Min-cut of the forward graph: (nodes to recompute, bytes of what it keeps beyond `kept`).

    `dropped` must be recomputed if needed; `banned` must not be (kept if needed)."""
    import networkx as nx

    g = nx.DiGraph()
    order = {n: i for i, n in enumerate(next(iter(forward)).graph.nodes)} if forward else {}
    span = max(len(order), 1)
    for n in forward:
        size = nbytes(n.meta.get("val"))
        if _free(n) or n in kept:
            capacity = 0.0
        elif not can(n) or n in banned:
            capacity = float(size)
        elif n in dropped or is_view(n) or _multi_output(n):
            capacity = math.inf  # keep the getitems of a multi-output op, not its tuple
        else:
            # Ties (same bytes before and after a cheap op) go to the later value: less to recompute.
            capacity = size * (1.0 + 1e-3 * (1.0 - order[n] / span))
        g.add_edge(("in", n), ("out", n), capacity=capacity)
        if _free(n) or n in kept or not can(n) or n in banned:
            g.add_edge("source", ("in", n), capacity=math.inf)
        for inp in n.all_input_nodes:
            if inp in forward:
                g.add_edge(("out", inp), ("in", n), capacity=math.inf)
    for r in roots:
        g.add_edge(("out", r), "sink", capacity=math.inf)
    _, (reachable, _) = nx.minimum_cut(g, "source", "sink")
    recompute = {n for n in forward if ("in", n) not in reachable and can(n) and n not in banned}
    kept_now = {n for n in forward if ("in", n) in reachable and ("out", n) not in reachable}
    extra = {alias_root(n) for n in kept_now} - kept
    return recompute, sum(nbytes(n.meta.get("val")) for n in extra if not _free(n))

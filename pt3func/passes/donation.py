"""Donation pass: write chosen outputs into the buffers of donated inputs.

`plan_donation` pairs donated inputs with outputs of the same shape, dtype and device (preferring the
output at the same pytree path, as `params -> new params`); `apply_donation` rewrites the graph so each
paired output is `copy_`-ed into its input at the end of the program and dropped from the graph's
outputs. Inductor turns such copies into in-place stores: no second copy of the state is held and no
copy-back epilogue runs. The runtime then returns the input's own storage as that output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from pt3func.passes.reordered_reads import reordered_read
from pt3func.trace.capture import storage_root


@dataclass(frozen=True)
class LeafMeta:
    """What the donation planner needs to know about one flat input or output."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layout: Any = None  # (device mesh, placements) of a sharded value; None for a plain tensor


@dataclass
class DonationPlan:
    """Which input buffer each output reuses, and why the others could not be reused."""

    aliases: dict[int, int] = field(default_factory=dict)  # output index -> input index
    unused: dict[int, str] = field(default_factory=dict)  # donated input index -> reason

    @property
    def donated_inputs(self) -> set[int]:
        return set(self.aliases.values())


def _fits(a: LeafMeta, b: LeafMeta) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and _same_layout(a.layout, b.layout)


def _same_layout(a: Any, b: Any) -> bool:
    """Equal layouts; a plain tensor (None) also matches a value replicated over its whole mesh: both hold every
    element on every rank (a plain input left `None` in in_shardings becomes a replicated output)."""
    if a == b:
        return True
    if (a is None) == (b is None):
        return False
    _mesh, placements = a if a is not None else b
    return all(p.is_replicate() for p in placements)


def plan_donation(
    inputs: Sequence[LeafMeta],
    outputs: Sequence[LeafMeta | None],
    donated: Sequence[int],
    preferred: dict[int, int] | None = None,
) -> DonationPlan:
    """Pair each donated input with a distinct output that can live in its buffer.

    `outputs[j]` is None for outputs that are not tensors. `preferred` maps an input index to the output
    it naturally becomes (input `params['w']` -> output `new_params['w']`); those pairs are made first, for
    every donated input, then each input left takes the first free output of the same shape, dtype and
    device (as JAX does). In one pass, an input whose own output no longer fits (a dtype change) took the
    output another donated input becomes, which then found none: a needless copy, blamed on the wrong leaf.
    """
    plan = DonationPlan()
    taken: set[int] = set()
    preferred = preferred or {}
    paired: dict[int, int] = {}  # donated input -> its output
    for i in donated:
        j = preferred.get(i)
        if j is not None and j not in taken and outputs[j] is not None and _fits(inputs[i], outputs[j]):
            paired[i] = j
            taken.add(j)
    for i in donated:
        j = paired.get(i)
        if j is None:
            j = next(
                (k for k, o in enumerate(outputs) if o is not None and k not in taken and _fits(inputs[i], o)),
                None,
            )
        if j is None:
            meta = inputs[i]
            plan.unused[i] = (
                f"no output left with shape {tuple(meta.shape)}, dtype {meta.dtype} and device {meta.device}"
                + (f" and placements {meta.layout[1]}" if meta.layout is not None else "")
            )
            continue
        taken.add(j)
        plan.aliases[j] = i
    return plan


def apply_donation(gm: fx.GraphModule, plan: DonationPlan) -> fx.GraphModule:
    """Rewrite `gm` in place: copy each aliased output into its donated input and drop it from the outputs.

    A donation is refused (moved to `plan.unused`) when another output, or the value written into a
    different donated input, is a view of the donated input: overwriting it would change that value; and
    when the value written reads the input at other positions than it is written to (a transpose of it).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    # An output that is its input seen whole through views (a sharded step wraps a passed-through value in
    # `view(x, x.shape)`) is that input: it needs no copy, and it is not "another output reading the input".
    outs = [_unviewed(out) for out in output_node.args[0]]
    donated_nodes = {placeholders[i]: i for i in plan.aliases.values()}
    for j, out in enumerate(outs):
        if not isinstance(out, fx.Node):
            continue
        root = storage_root(out)
        i = donated_nodes.get(root)
        if i is None or (plan.aliases.get(j) == i and out is root):
            continue
        # Output j reads donated input i's memory (itself or through a view): overwriting it would corrupt j.
        for k in [k for k, src in plan.aliases.items() if src == i]:
            del plan.aliases[k]
        plan.unused[i] = f"output {j} reads this input's memory (it is the input or a view of it)"
    for j, i in list(plan.aliases.items()):
        culprit = reordered_read(placeholders[i], outs[j])
        if culprit is not None:
            del plan.aliases[j]
            plan.unused[i] = (
                f"output {j} reads this input at other positions than it would write them (through `{culprit}`): "
                "computed in place, it would read elements already overwritten"
            )
    with gm.graph.inserting_before(output_node):
        donated_roots = {storage_root(outs[j]) for j in plan.aliases if isinstance(outs[j], fx.Node)}
        for k, out in enumerate(outs):
            if k not in plan.aliases and isinstance(out, fx.Node):
                outs[k] = _own_copy(gm.graph, out, donated_roots)
        for j, i in plan.aliases.items():
            if outs[j] is not placeholders[i]:
                gm.graph.call_function(torch.ops.aten.copy_.default, (placeholders[i], outs[j]))
    output_node.args = (tuple(o for j, o in enumerate(outs) if j not in plan.aliases),)
    gm.graph.lint()
    gm.recompile()
    return gm


def _unviewed(out: Any) -> Any:
    """`out`'s storage root when `out` views all of it as it is (same shape, strides, offset and dtype), else out."""
    if not isinstance(out, fx.Node):
        return out
    root = storage_root(out)
    if root is out or root.op != "placeholder":
        return out
    a, b = out.meta.get("val"), root.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return out
    same = (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype)
    return root if same else out


def _own_copy(graph: fx.Graph, out: fx.Node, donated_roots: set[fx.Node]) -> fx.Node:
    """`out`, or a copy of it when it is a donated output or a view of one (`return n, {"row": n[0]}`).

    Inductor computes a donated output in place in its input (`copy_(x, index_copy(x, ...))` becomes
    `x.index_copy_(...)`), so such an output would share the donated buffer and the next call would overwrite
    the value the caller kept. `prims.clone`, not `aten.clone`: Inductor drops the latter as a no-op when its
    source is an intermediate, before it moves that intermediate into the donated input.
    """
    if storage_root(out) not in donated_roots:
        return out
    clone = graph.call_function(torch.ops.prims.clone.default, (out,))
    val = out.meta.get("val")
    if isinstance(val, torch.Tensor) and getattr(val, "fake_mode", None) is not None:
        with val.fake_mode:
            clone.meta["val"] = torch.ops.prims.clone.default(val)
    return clone

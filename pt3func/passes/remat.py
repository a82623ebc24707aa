"""Rematerialisation pass: recompute saved activations in the backward instead of keeping them.

The traced step is one graph holding forward, backward and optimizer. Backward nodes carry
`meta["custom"]["pt3func"]` starting "backward of" / "grad of"; a *saved activation* is a forward value read
by a backward node, and it stays alive from the forward until that read. `pf.checkpoint` marks the nodes of
its region at trace time (`REGION_KEY`, `POLICY_KEY` in `meta["custom"]`) and `pf.checkpoint_name` tags the
node producing a value (`NAME_KEY`). This pass turns those marks into a *recompute set*; `apply_remat`
copies, for each backward read of a recomputed value, the chain of forward ops that produce it from values
that are kept (region inputs, values the policy saves, values that cannot be recomputed) and inserts the
copies just before the first backward read, so the forward value dies as soon as the forward is done with it.

Never recomputed (always kept when the backward needs them):
- random ops (`torch.Tag.nondeterministic_seeded`: the dropout mask): the backward sees the same random
  numbers as without remat, and no RNG state has to be replayed;
- collectives and their waits, unless the region asked for it (`recompute_collectives=True`);
- ops that write in place, ops reading a buffer that some op writes after them (their inputs change), and
  ops whose own buffer some op writes after them (an `empty_like` that `rrelu_with_noise` fills with noise);
- graph inputs and constants (alive anyway).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from pt3func.passes.fence import never_after, read_after
from pt3func.trace.capture import eliminate_dead_code, mutated_args

REGION_KEY = "pt3func_remat"  # "3" or "1/3" (nested): the checkpoint region a forward node was recorded in
POLICY_KEY = "pt3func_remat_policy"  # Policy.as_meta() of that (innermost) region
NAME_KEY = "pt3func_names"  # names given by pf.checkpoint_name to the value this node produces
COLLECTIVES_KEY = "pt3func_remat_collectives"  # the region lets its collectives be recomputed

SAVE, RECOMPUTE, OFFLOAD = "save", "recompute", "offload"

_BACKWARD_PREFIXES = ("backward of", "grad of", "remat of", "reload of")

# Matrix products: what `dots_saveable` keeps (JAX's dot_general).
DOTS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten._scaled_mm.default,
    }
)

# Ops that read only their input's shape and dtype: a backward use by them keeps no value alive.
_METADATA_ONLY = {
    torch.ops.aten.ones_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default,
}

_C10D = "_c10d_functional"

# The copies of `offload_to_host` (passes/remat_offload.py): they start and wait for copies, never run twice.
_OFFLOAD_OPS = frozenset(
    f"pt3func::{op}" for op in ("offload_to_host", "offload_release", "reload_prefetch", "reload_wait")
)


@dataclass(frozen=True)
class Policy:
    """What a checkpoint region keeps for the backward; the rest of the region is recomputed.

    kind: "everything_saveable" | "nothing_saveable" | "dots_saveable" | "save_only_these_names" |
    "offload_to_host"; `names` for the last two. Build them through `pf.checkpoint_policies`.
    """

    kind: str
    names: tuple[str, ...] = ()

    KINDS = ("everything_saveable", "nothing_saveable", "dots_saveable", "save_only_these_names", "offload_to_host")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown checkpoint policy {self.kind!r}; choose one of {self.KINDS}")
        for name in self.names:
            if not isinstance(name, str):
                raise TypeError(f"checkpoint policy {self.kind}: names must be strings, got {name!r}")

    def __repr__(self) -> str:
        named = self.kind in ("save_only_these_names", "offload_to_host")
        args = f"({', '.join(map(repr, self.names))})" if named else ""
        return f"checkpoint_policies.{self.kind}{args}"

    def as_meta(self) -> tuple:
        return (self.kind, self.names)

    @classmethod
    def from_meta(cls, meta: tuple) -> Policy:
        kind, names = meta
        return cls(kind, tuple(names))

    def decide(self, node: fx.Node) -> str:
        """SAVE, RECOMPUTE or OFFLOAD for a forward node of the region (before recomputability is checked)."""
        if self.kind == "everything_saveable":
            return SAVE
        if self.kind == "nothing_saveable":
            return RECOMPUTE
        if self.kind == "dots_saveable":
            return SAVE if _producer(node).target in DOTS else RECOMPUTE
        named = bool(set(names_of(node)) & set(self.names))
        if self.kind == "save_only_these_names":
            return SAVE if named else RECOMPUTE
        return OFFLOAD if named else RECOMPUTE  # offload_to_host: named values go to host, the rest is recomputed


def custom(node: fx.Node) -> dict:
    return node.meta.get("custom") or {}


def is_backward(node: fx.Node) -> bool:
    return str(custom(node).get("pt3func", "")).startswith(_BACKWARD_PREFIXES)


def names_of(node: fx.Node) -> tuple[str, ...]:
    return tuple(custom(node).get(NAME_KEY, ()))


def add_name(node: fx.Node, name: str) -> None:
    """Tag `node` with a checkpoint name (copy-on-write: nodes of one trace region share their custom dict)."""
    meta = dict(custom(node))
    meta[NAME_KEY] = tuple(dict.fromkeys((*meta.get(NAME_KEY, ()), name)))
    node.meta["custom"] = meta


def region_of(node: fx.Node) -> str | None:
    return custom(node).get(REGION_KEY)


def policy_of(node: fx.Node) -> Policy | None:
    meta = custom(node).get(POLICY_KEY)
    return Policy.from_meta(meta) if meta is not None else None


def _producer(node: fx.Node) -> fx.Node:
    """The op behind a `getitem` of a multi-output op (its decision is the op's)."""
    return node.args[0] if node.op == "call_function" and node.target is operator.getitem else node


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def _aliases_input(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        # An element of a view op's list (`unbind`, `split`: q, k, v of one qkv buffer) is a view of its input.
        source = node.args[0] if node.args else None
        return isinstance(source, fx.Node) and source.op == "call_function" and _aliases_input(source)
    if node.target is _UNSAFE_VIEW:
        # A reshape of a fresh value (a matmul's 2-D result back to 3-D): declared as a new tensor, but Inductor
        # reinterprets the buffer; counting it as a value of its own priced a matmul's output as a cheap copy.
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def alias_root(node: fx.Node) -> fx.Node:
    """The node owning the storage `node` reads: through views and in-place ops."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and _aliases_input(node):
        node = node.args[0]
    return node


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and _aliases_input(node) and not mutated_args(node)


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == _C10D


def is_random(node: fx.Node) -> bool:
    """An op that draws random numbers. Attention kernels carry the tag for their dropout; with
    `dropout_p=0` they draw nothing and recompute exactly."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return value != 0
    return True


class Recomputability:
    """Which forward nodes may be computed a second time with the same result."""

    def __init__(self, graph: fx.Graph, allow_collectives: bool | Iterable[fx.Node] = False):
        nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        # Last in-place write into each storage: a node reading that storage before the write would read
        # another value when recomputed after it.
        self.last_write: dict[fx.Node, int] = {}
        for n in nodes:
            if n.op == "call_function":
                for target in mutated_args(n):
                    root = alias_root(target)
                    self.last_write[root] = max(self.last_write.get(root, -1), self.order[n])
        self.allow_collectives = allow_collectives
        self._cache: dict[fx.Node, bool] = {}

    def collectives_allowed(self, node: fx.Node) -> bool:
        allowed = self.allow_collectives
        if isinstance(allowed, bool):
            return allowed
        return node in allowed

    def __call__(self, node: fx.Node) -> bool:
        hit = self._cache.get(node)
        if hit is None:
            hit = self._cache[node] = self._check(node)
        return hit

    def _check(self, node: fx.Node) -> bool:
        if node.op != "call_function":
            return False  # placeholders and constants are alive anyway
        if node.target is operator.getitem:
            return isinstance(node.args[0], fx.Node) and self(node.args[0])
        if not isinstance(node.target, torch._ops.OpOverload) or _is_offload_op(node):
            return False
        if is_random(node) or mutated_args(node):
            return False
        if is_collective(node) and not self.collectives_allowed(node):
            return False
        if torch.Tag.nondeterministic_bitwise in node.target.tags and not is_collective(node):
            return False  # e.g. index_add with atomics: a second run may differ in the last bits
        position = self.order[node]
        if self.last_write.get(alias_root(node), -1) > position:
            # Its own storage is filled later (rrelu's noise buffer, an `empty_like` that rrelu_with_noise
            # writes): a copy would be the bare buffer, never filled.
            return False
        reads = list(node.all_input_nodes)
        for inp in reads:
            if self.last_write.get(alias_root(inp), -1) > position:
                return False
        return True


def needed_by_backward(graph: fx.Graph) -> list[fx.Node]:
    """Forward nodes a backward node reads (other than for its shape), in graph order."""
    out = []
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function", "get_attr") or is_backward(node):
            continue
        if any(is_backward(u) and u.target not in _METADATA_ONLY for u in node.users):
            out.append(node)
    return out


@dataclass
class RematPlan:
    """Forward nodes to recompute in the backward, and forward nodes to keep on the host meanwhile."""

    recompute: set[fx.Node]
    offload: set[fx.Node]

    def __bool__(self) -> bool:
        return bool(self.recompute or self.offload)


def _outer(region: str | None) -> str | None:
    return region.split("/")[0] if region else None


def plan_from_policies(gm: fx.GraphModule) -> RematPlan:
    """The recompute (and offload) set the `pf.checkpoint` regions of `gm` ask for.

    A region's inputs (values from outside it) are always kept, as in JAX: the chain that recomputes a
    value stops at them, so consecutive checkpointed blocks each recompute only themselves.
    """
    graph = gm.graph
    if not any(region_of(n) for n in graph.nodes):
        return RematPlan(set(), set())
    roots = needed_by_backward(graph)
    flagged = any(custom(n).get(COLLECTIVES_KEY) for n in graph.nodes)
    gathered = _gathered_inputs(graph) if flagged else set()
    allowed = {n for n in graph.nodes if is_collective(n) and custom(n).get(COLLECTIVES_KEY)}
    can = Recomputability(graph, allowed | {n for n in gathered if is_collective(n)})
    # A region's outputs (values the forward reads outside it) are never recomputed, as in JAX (offloaded where
    # the policy names them): recomputing the last block's output for the final LayerNorm's backward ran that
    # block's last matmul again.
    outputs = {
        n
        for n in graph.nodes
        if region_of(n) is not None
        and any(not is_backward(u) and _outer(region_of(u)) != _outer(region_of(n)) for u in n.users)
    }

    def decision(node: fx.Node) -> str:
        policy = policy_of(node)
        if policy is None or region_of(node) is None or is_backward(node):
            return SAVE
        if node.target is operator.getitem and not names_of(node):
            parent = _producer(node)
            choice = policy.decide(parent) if policy_of(parent) == policy else SAVE
            # An op whose named output is kept keeps its other outputs too (attention's logsumexp beside
            # its output): recomputing them would run the op again.
            siblings = [u for u in parent.users if u is not node and u.target is operator.getitem and names_of(u)]
            if any(policy.decide(u) != RECOMPUTE for u in siblings):
                choice = SAVE
        else:
            choice = policy.decide(node)
        if choice == RECOMPUTE and (not can(node) or node in outputs):
            return SAVE
        if choice == OFFLOAD and not _on_accelerator(node):
            return SAVE  # host memory is where it already is
        return choice

    pinned: set[fx.Node] = set()
    while True:
        recompute: set[fx.Node] = set()
        boundary: set[fx.Node] = set()
        stack = [n for n in roots if n not in pinned and decision(n) == RECOMPUTE]
        # FSDP with recompute_collectives: a gathered parameter the backward reads is gathered again there.
        stack += [n for n in roots if n in gathered and can(n) and _feeds_flagged(n, gathered)]
        while stack:
            node = stack.pop()
            if node in recompute:
                continue
            recompute.add(node)
            for inp in node.all_input_nodes:
                if inp in recompute or inp in pinned:
                    continue
                if inp in gathered and (custom(node).get(COLLECTIVES_KEY) or node in gathered) and can(inp):
                    stack.append(inp)  # FSDP: gather the parameter again rather than keep it gathered
                    continue
                if decision(inp) != RECOMPUTE:
                    continue
                if _outer(region_of(inp)) != _outer(region_of(node)):
                    boundary.add(inp)  # an input of this region: kept, not recomputed
                else:
                    stack.append(inp)
        # A value recomputed for its own region's backward that is also another region's input would be
        # held and recomputed: keep it instead, and recompute from it.
        new_pins = boundary & recompute
        if not new_pins:
            break
        pinned |= new_pins
    # A named value can reach the backward only through ops recomputed from it: autograd saves an op's
    # output (attention's, for its backward) as a `detach` of it, and that alias, not the named node, is what
    # the backward reads. The named value is what goes to host; the alias is recomputed from the reloaded copy.
    read = set(roots) | {i for n in recompute for i in n.all_input_nodes}
    offload = {n for n in read if n not in recompute and decision(n) == OFFLOAD}
    return RematPlan(recompute, offload)


def _gathered_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Forward values outside any region computed from graph inputs through a collective (FSDP's gathered params).

    Views and casts after the gather count too; a region with `recompute_collectives=True` recomputes them
    from the local shard instead of keeping the gathered value.
    """
    out: set[fx.Node] = set()
    inputs: set[fx.Node] = set()  # graph inputs and views of them (free to read again)
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            inputs.add(n)
            continue
        if n.op != "call_function" or region_of(n) or is_backward(n) or is_random(n) or mutated_args(n):
            continue
        ins = n.all_input_nodes
        if not ins or not all(i in inputs or i in out for i in ins):
            continue
        if is_collective(n) or any(i in out for i in ins):
            out.add(n)
        elif is_view(n):
            inputs.add(n)
    return out


def _feeds_flagged(node: fx.Node, gathered: set[fx.Node]) -> bool:
    """Whether a region with `recompute_collectives=True` reads `node` (directly or through gathered values)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen or is_backward(u):
                continue
            seen.add(u)
            if custom(u).get(COLLECTIVES_KEY):
                return True
            if u in gathered:
                stack.append(u)
    return False


def _on_accelerator(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta")


def apply_remat(gm: fx.GraphModule, plan: RematPlan) -> fx.GraphModule:
    """Recompute `plan.recompute` (and reload `plan.offload`) right before their first backward read (in place).

    Each recomputed value is copied once; every backward read of it reads the copy. Copies keep the
    original's meta (stack trace, annotations) with `custom["pt3func"] = "remat of %name"`. An offloaded
    value is copied to host from right after the forward produces it, and back for its first backward read,
    each copy overlapping compute (`remat_offload.py`: where the copies start and end).
    """
    if not plan:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    wanted = plan.recompute | plan.offload
    copies: dict[fx.Node, fx.Node] = {}
    for node in [n for n in graph.nodes if is_backward(n)]:
        if node.target in _METADATA_ONLY:
            continue
        reads = [a for a in node.all_input_nodes if a in wanted and a not in copies]
        if reads:
            # Everything these reads need that is recomputed and not yet copied, in forward order.
            needed: set[fx.Node] = set()
            stack = list(reads)
            while stack:
                n = stack.pop()
                if n in needed or n in copies:
                    continue
                needed.add(n)
                if n in plan.recompute:
                    stack.extend(i for i in n.all_input_nodes if i in wanted)
            with graph.inserting_before(node):
                for n in sorted(needed, key=order.__getitem__):
                    copies[n] = _reload(graph, n) if n not in plan.recompute else _recompute(graph, n, copies)
        for inp in list(node.all_input_nodes):
            if inp in copies:
                node.replace_input_with(inp, copies[inp])
    if plan.offload:
        from pt3func.passes.remat_offload import place_offload_ops

        place_offload_ops(graph)  # release and prefetch: one region after / before, for overlap
    eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return gm


def _recompute(graph: fx.Graph, node: fx.Node, copies: dict[fx.Node, fx.Node]) -> fx.Node:
    dup = graph.node_copy(node, lambda a: copies.get(a, a))
    dup.meta = {**node.meta, "custom": {**custom(node), "pt3func": f"remat of %{node.name}"}}
    return dup


def _reload(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """Offload `node` to host after the forward makes it; its reloaded value here (the graph's insert point)."""
    from pt3func.passes.remat_offload import insert_offload

    return insert_offload(graph, node)


def rematerialize(gm: fx.GraphModule) -> fx.GraphModule:
    """The pass `pf.jit` runs: apply what the `pf.checkpoint` regions of the traced step ask for."""
    return apply_remat(gm, plan_from_policies(gm))


def remat_notes(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """For `as_text()`: which nodes are recomputed, offloaded or reloaded copies."""
    notes = {}
    for node in gm.graph.nodes:
        why = str(custom(node).get("pt3func", ""))
        if why.startswith(("remat of", "reload of", "offload of", "release of", "prefetch of")):
            notes[node] = why.upper().split(" ", 1)[0] + " " + why.split(" ", 1)[1]
    return notes


def _is_offload_op(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.name() in _OFFLOAD_OPS


# Ops Inductor runs as library kernels (cuBLAS, cuDNN, NCCL, oneDNN): no pointwise work is fused into them.
_OPAQUE_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_mm",
        "aten::convolution",
        "aten::convolution_backward",
        "aten::_scaled_dot_product_flash_attention_backward",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "aten::_scaled_dot_product_cudnn_attention_backward",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "aten::_flash_attention_backward",
        "aten::_efficient_attention_backward",
        "_c10d_functional::wait_tensor",
    }
)


def _made_by_opaque_kernel(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:  # one output of a multi-output kernel (attention's backward)
        target = node.args[0].target if isinstance(node.args[0], fx.Node) else None
    return isinstance(target, torch._ops.OpOverload) and target.name() in _OPAQUE_OPS


def _is_copy(node: fx.Node) -> bool:
    return str(custom(node).get("pt3func", "")).startswith(("remat of", "reload of"))


def fence_recomputation(gm: fx.GraphModule) -> fx.GraphModule:
    """Keep a compiler from hoisting recomputation back into the forward (Graph -> Graph, in place).

    Inductor fuses a consumer into its producer kernel whatever the distance between them: a recomputed
    `layer_norm(x)` would be computed with the forward's `x` kernel and kept until the backward, undoing
    remat. A copy reading only forward values reads one of them through `where(never, 0, value)`,
    with `never` derived from a backward value computed before the group (`isnan(t) & isinf(t)` of one
    element of it: always False, which no compiler folds): the copies now depend on the backward, so they
    cannot run earlier, and the select fuses into their first kernel (no copy) for pointwise/reduction
    consumers. The value is passed through bit for bit.

    The token is the latest backward value before the group that an opaque kernel made (a matmul, attention,
    a collective's wait) from no recomputed value, the latest backward value of any kind only where there is
    none. A recomputed GELU fenced on the value before it, its block's weight gradient matmul (which read it),
    ran in a kernel of its own (0.09 ms a block on an H200); fenced on an earlier matmul it can fuse with the
    GELU backward that reads the same input (one kernel, as in torch.compile's own remat).
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    fenced = False
    last_backward: fx.Node | None = None
    # The latest backward value made by a kernel Inductor fuses nothing into, and reading no copy: a token that
    # reads a copy chains the next group after the first one's consumer (copy -> matmul -> token -> copy), and
    # Inductor cannot fuse the first copy with a kernel after that chain.
    last_opaque: fx.Node | None = None
    copy_values: set[fx.Node] = set()  # copies and views of them
    groups: dict[fx.Node, fx.Node] = {}  # first copy of a group -> the backward token before it
    previous_copy = False
    for node in nodes:
        copy = _is_copy(node)
        if copy or (is_view(node) and any(inp in copy_values for inp in node.all_input_nodes)):
            copy_values.add(node)
        if copy and not previous_copy and last_backward is not None:
            groups[node] = last_opaque or last_backward
        if not copy and is_backward(node) and isinstance(node.meta.get("val"), torch.Tensor):
            if node.meta["val"].numel() > 0:
                last_backward = node
                if _made_by_opaque_kernel(node) and not any(inp in copy_values for inp in node.all_input_nodes):
                    last_opaque = node
        previous_copy = copy
    token: fx.Node | None = None
    never: fx.Node | None = None
    fences: dict[fx.Node, fx.Node] = {}
    after_fence: set[fx.Node] = set()  # copies that already depend on a fence (or are opaque backward calls)
    for node in nodes:
        if node in groups:
            token, never, fences = groups[node], None, {}
        if not _is_copy(node) or token is None:
            continue
        if _is_offload_op(node) or any(inp in after_fence for inp in node.all_input_nodes):
            after_fence.add(node)  # an offload op is an opaque call Inductor cannot fuse into the forward
            continue
        if is_view(node):
            # A view computes nothing, so running it early costs nothing; fenced, it would be materialised for a
            # reader that is an extern kernel (attention's backward reading a kept output's recomputed detach:
            # one extra copy per block). Its readers are fenced themselves.
            continue
        device = token.meta["val"].device
        reads = [
            inp
            for inp in node.all_input_nodes
            if inp.op != "get_attr" and isinstance(inp.meta.get("val"), torch.Tensor)
            and inp.meta["val"].device == device
        ]
        if not reads:
            continue
        # One fenced input orders the copy after the backward; prefer an activation to a parameter (a fenced
        # value read by a matmul is materialised), and the smallest.
        inp = min(reads, key=lambda r: (r.op == "placeholder", r.meta["val"].numel()))
        if inp not in fences:
            with graph.inserting_before(node):
                if never is None:
                    never = never_after(graph, token, node, _remat_tag)
                fences[inp] = read_after(graph, never, inp, node, _remat_tag)
            fenced = True
        node.replace_input_with(inp, fences[inp])
        after_fence.add(node)
    if fenced:
        graph.lint()
        gm.recompile()
    return gm


def _remat_tag(like: fx.Node) -> str:
    return f"remat of %{like.name} (fence)"

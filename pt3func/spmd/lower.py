"""Sharded lowering: DTensor inputs in, one local program with explicit collectives out.

DTensors are never traced as inputs (make_fx would bake a constant into the collective, DESIGN.md):
each DTensor argument enters the program as its local shard and is wrapped back into a DTensor inside
the trace. DTensor's per-op rules then propagate shardings and emit `_c10d_functional` collectives,
which make_fx records as explicit nodes. Two rules give the textbook programs rather than whatever
per-op propagation finds first:

- the gradient of a leaf is redistributed to the leaf's own placements (all-reduce for a replicated
  parameter, reduce-scatter for a sharded one);
- a parameter sharded over a mesh axis that also splits the data (FSDP / ZeRO-3) is all-gathered
  before the loss uses it, so the backward reduce-scatters its gradient.

Every collective carries the reason that produced it in `node.meta["custom"]["pt3func"]`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from pt3func import analysis
from pt3func._compat import dtensor_spec, dtensor_with_spec, is_plain_shard, is_strided_shard
from pt3func.spmd.agreement import check_ranks_agree, multi_process_world
from pt3func.trace.source import node_location

# A process global, not a ContextVar: on CUDA the autograd engine runs the backward, and so the gradient hooks
# that emit (and name) the reductions, on a device thread of its own, which sees none of the tracing thread's
# context variables (their reductions then lost their "grad of ..." tags, and grad_exchange found nothing to
# rewrite). Traces hold capture.TRACE_LOCK, so at most one lowering is active at a time.
_ACTIVE: LoweringContext | None = None


@dataclass(frozen=True)
class DTensorMeta:
    """What is needed to rebuild a DTensor around a local shard."""

    device_mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]
    # The order in which the mesh axes split each dim, and how DTensor reads a _StridedShard (DTensorSpec's
    # `shard_order` and `use_strided_shard_as_shard_order`): the placements alone do not say where each value
    # is (a view's _StridedShard means a strided split, the same placements rebuilt mean a shard order).
    # None where this torch has no such fields (rebuild then builds the spec from the placements alone).
    shard_order: Any = None
    strided_as_order: bool | None = None
    _specs: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # dtype -> DTensorSpec

    @classmethod
    def of(cls, x: DTensor) -> DTensorMeta:
        spec = getattr(x, "_spec", None)
        return cls(x.device_mesh, tuple(x.placements), x.shape, tuple(x.stride()),
                   getattr(spec, "shard_order", None), getattr(spec, "use_strided_shard_as_shard_order", None))

    def wrap(self, local: torch.Tensor) -> DTensor:
        """Inside a trace: a differentiable wrap that make_fx records."""
        return DTensor.from_local(
            local, self.device_mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def rebuild(self, local: torch.Tensor) -> DTensor:
        """At run time, around a compiled program's output: the same DTensor, built cheaply (its spec built on
        the first call and shared by every later one: a step's outputs keep their layout)."""
        spec = self._specs.get(local.dtype)
        if spec is None:
            spec = dtensor_spec(self.device_mesh, self.placements, self.shape, self.stride, local.dtype)
            order = (getattr(spec, "shard_order", None), getattr(spec, "use_strided_shard_as_shard_order", None))
            if self.strided_as_order is not None and order != (self.shard_order, self.strided_as_order):
                spec = dataclasses.replace(
                    spec, shard_order=self.shard_order, use_strided_shard_as_shard_order=self.strided_as_order
                )
            self._specs[local.dtype] = spec
        return dtensor_with_spec(local, spec)


class LoweringContext:
    """State of one sharded trace: names of the wrapped inputs, for errors and collective reasons."""

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}

    def label(self, x: Any) -> str | None:
        return self.labels.get(id(x))


@contextlib.contextmanager
def lowering() -> Iterator[LoweringContext]:
    """Active while a jitted step is traced; also keeps node meta (reasons) on the recorded nodes."""
    global _ACTIVE
    ctx, previous = LoweringContext(), _ACTIVE
    _ACTIVE = ctx
    try:
        with fx_traceback.preserve_node_meta():
            yield ctx
    finally:
        _ACTIVE = previous


def current() -> LoweringContext | None:
    # Under torch.compile (Dynamo) there is no pt3func lowering.
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE


# `node.meta["custom"][GRAD_OF]` names the leaf a gradient reduction is for (the grad_exchange pass reads it).
GRAD_OF = "pt3func_grad_of"


@contextlib.contextmanager
def reason(text: str, **extra: Any) -> Iterator[None]:
    """Tag every node recorded inside with why it exists (shown beside collectives in `as_text()`)."""
    if current() is None:
        yield
        return
    with fx_traceback.annotate({"pt3func": text, **extra}):
        yield


def wrap_input(local: torch.Tensor, meta: DTensorMeta, label: str) -> DTensor:
    x = meta.wrap(local)
    ctx = current()
    if ctx is not None:
        ctx.labels[id(x)] = label
    return x


def copy_labels(sources: Sequence[Any], targets: Sequence[Any]) -> None:
    """Let `targets[i]` (a detached copy, say) be named like `sources[i]` in collective reasons."""
    ctx = current()
    if ctx is None:
        return
    for src, dst in zip(sources, targets):
        label = ctx.labels.get(id(src))
        if label is not None:
            ctx.labels[id(dst)] = label


def _axis_name(mesh: Any, dim: int) -> str:
    names = mesh.mesh_dim_names
    return names[dim] if names else str(dim)


def gather_sharded_params(leaves: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """All-gather each DTensor leaf over the mesh axes that also shard the data (the FSDP rule).

    `others` are the non-differentiated arguments (the batch): an axis splitting one of them is a data
    axis, and a parameter split over a data axis is stored sharded but used whole.
    """
    data_dims: dict[Any, set[int]] = {}
    for other in others:
        if isinstance(other, DTensor):
            dims = data_dims.setdefault(id(other.device_mesh), set())
            dims.update(i for i, p in enumerate(other.placements) if isinstance(p, Shard))
    out = []
    for leaf in leaves:
        dims = data_dims.get(id(leaf.device_mesh)) if isinstance(leaf, DTensor) else None
        if not dims or not any(isinstance(leaf.placements[d], Shard) for d in dims):
            out.append(leaf)
            continue
        target = tuple(Replicate() if d in dims and isinstance(p, Shard) else p for d, p in enumerate(leaf.placements))
        label = (current().label(leaf) if current() else None) or "a parameter"
        axes = ", ".join(_axis_name(leaf.device_mesh, d) for d in sorted(dims))
        with reason(f"FSDP: gather {label} over {axes} for the forward"):
            gathered = leaf.redistribute(leaf.device_mesh, target)
        if gathered.requires_grad:
            # The backward of this gather is the gradient's reduce-scatter: reduce it here, under the
            # gradient's own reason, so the gather's backward finds it already in the leaf's placements.
            gathered.register_hook(functools.partial(reduce_gradient, like=leaf))
        out.append(gathered)
    return out


def reduce_gradient(grad: Any, like: Any) -> Any:
    """Bring a gradient to its parameter's placements: pending sums become all-reduce or reduce-scatter."""
    if not isinstance(grad, DTensor) or not isinstance(like, DTensor):
        return grad
    if tuple(grad.placements) == tuple(like.placements):
        return grad
    label = (current().label(like) if current() else None) or "a parameter"
    with reason(f"grad of {label}", **{GRAD_OF: label}):
        return grad.redistribute(like.device_mesh, like.placements)


def resolve_partial(x: DTensor) -> tuple:
    """Output placements when none are asked for: pending reductions are carried out (Partial -> Replicate), and
    a strided split (`_StridedShard`, the layout of a view such as `x.t().reshape(-1)`) is gathered over its axis
    (-> Replicate), or kept as the plain `Shard` it is when nothing split the dim before it (split factor 1).

    Every output then has a PartitionSpec (as every jitted output in JAX has a NamedSharding): a _StridedShard has
    none, so `pf.sharding_of`, `visualize_sharding` and checkpoints could not handle it.
    """
    strided = [p.dim for p in x.placements if is_strided_shard(p)]
    if len(strided) != len(set(strided)):
        # One dim strided over several axes: torch's redistribute cannot gather it (it asserts "no flattened
        # transforms"; gathered one axis at a time, the values come out wrong), as eager DTensor cannot: the
        # output keeps eager's layout (DTensorMeta keeps its shard order), values right, but no PartitionSpec.
        return tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    out = []
    for p in x.placements:
        if isinstance(p, Replicate) or is_plain_shard(p):
            out.append(p)
        elif isinstance(p, Partial):
            out.append(Replicate())
        elif is_strided_shard(p) and p.split_factor == 1:
            out.append(Shard(p.dim))
        else:
            out.append(Replicate())
    return tuple(out)


def on_whole_values(func: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh: Any) -> DTensor:
    """`func` of every DTensor operand gathered whole, run on each rank's local copy; the result replicated.

    For ops whose DTensor handling is wrong or untraceable even when every operand is whole (torch 2.11's
    convolution rule, its flat argmax handler): the local op on whole values is the single-device op."""
    whole = [Replicate()] * mesh.ndim

    def local(v: Any) -> Any:
        return v.redistribute(v.device_mesh, whole).to_local() if isinstance(v, DTensor) else v

    out = func(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})
    return DTensor.from_local(out, mesh, whole, run_check=False)


def collective_notes(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """For each collective node: kind, mesh axis, payload bytes and reason, as shown in `as_text()`."""
    names = _group_axis_names()
    notes = {}
    for node in gm.graph.nodes:
        if not analysis.is_collective(node):
            continue
        group = next((a for a in reversed(node.args) if isinstance(a, str) and a in names), None)
        axis = names.get(group, group or "?")
        why = (node.meta.get("custom") or {}).get("pt3func") or "sharding propagation"
        where = node_location(node)
        if where and why == "sharding propagation":
            why = f"{why} at {where}"
        size = analysis.format_bytes(analysis.collective_bytes(node))
        notes[node] = f"COLLECTIVE {analysis.collective_kind(node)} over {axis!r}, {size}: {why}"
    return notes


def _group_axis_names() -> dict[str, str]:
    """group name -> mesh axis name (or 'a+b' for flattened axes) for every mesh made so far."""
    from pt3func.sharding import mesh as mesh_module

    out = {}
    world = dist.group.WORLD if dist.is_initialized() else None
    for mesh in list(mesh_module._MESHES.values()) + list(mesh_module._MAKE_MESH_CACHE.values()):
        if world is not None and getattr(mesh, "_world", world) is not world:
            continue  # another world's mesh (an earlier virtual mesh): its group names are reused by this one
        try:
            for i, name in enumerate(mesh.axis_names):
                out[mesh.device_mesh.get_group(i).group_name] = name
            for names, group in mesh._groups.items():
                out[group.group_name] = "+".join(names)
            for name, flat in getattr(mesh.device_mesh, "_flatten_mapping", {}).items():
                out[flat.get_group(0).group_name] = name
        except Exception:  # a mesh whose world is gone names no groups
            continue
    return out


def apply_in_shardings(
    args: tuple[Any, ...],
    in_shardings: Any,
    static_argnums: frozenset[int],
    labels: Sequence[str] = (),
    agreed: tuple[str, set] | None = None,
    replaced: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[Any, ...]:
    """Place positional arguments as `in_shardings` asks (a per-argument pytree prefix; None keeps as is).

    Leaves already placed as asked are passed through untouched (same object), so donation still
    invalidates the caller's tensors. `agreed` is (the step's name, the input signatures already checked): in
    a world of processes the ranks' plain tensors are first checked to be the same global values. Each tensor
    replaced by a placed copy is appended to `replaced` as (caller's tensor, placed copy): a donation of the
    copy must invalidate the caller's tensor too (`invalidate_donated_originals`).
    """
    from pt3func.errors import ShardingError
    from pt3func.sharding.put import broadcast_shardings, put_leaf
    from pt3func.sharding.spec import NamedSharding, PartitionSpec
    from pt3func.tree import keystr, unflatten

    if isinstance(in_shardings, (PartitionSpec, NamedSharding)):
        # One sharding is a pytree prefix of the whole argument tuple (as in JAX): every argument gets it, except
        # a 0-d tensor argument, which has no dim to split (a learning rate, a step counter) and stays whole.
        shardings = tuple(None if _zero_dim(a) else in_shardings for a in args)
    elif isinstance(in_shardings, (tuple, list)):
        shardings = in_shardings
    else:
        shardings = (in_shardings,)
    if len(shardings) > len(args):
        raise ShardingError(
            f"in_shardings has {len(shardings)} entries but the call passes {len(args)} arguments (counting keyword "
            "arguments at their parameter's position)"
        )
    from pt3func.runtime.virtual import in_rank_thread

    if agreed is not None and multi_process_world() and not in_rank_thread():
        _check_plain_inputs_agree(args, shardings, static_argnums, labels, agreed)
    out = list(args)
    for i, sharding in enumerate(shardings):
        if sharding is None or i in static_argnums:
            continue
        try:
            paths, leaves, per_leaf, treedef = broadcast_shardings(args[i], sharding)
        except ShardingError as exc:  # "not a pytree prefix ... at the root": name the argument it is the root of
            label = labels[i] if labels and i < len(labels) else f"args[{i}]"
            raise ShardingError(f"in_shardings of {label}: {exc}") from None
        placed = []
        for path, leaf, s in zip(paths, leaves, per_leaf):
            if s is None or not isinstance(leaf, torch.Tensor):
                if not path and _zero_dim(leaf) and _splits(s):  # a number given a split spec of its own
                    label = labels[i] if labels and i < len(labels) else f"args[{i}]"
                    raise ShardingError(f"in_shardings of {label}: spec {s} splits a Python number ({leaf!r}), "
                                        "which has no dim to split; give it None or P()")
                placed.append(leaf)
                continue
            try:
                # A plain tensor is the global value every rank holds (as a host array in multi-controller
                # JAX): each rank keeps its own block, no communication per call.
                put = leaf if _already_placed(leaf, s, path) else put_leaf(leaf, s, path, src_data_rank=None)
            except ShardingError as exc:
                label = labels[i] if labels and i < len(labels) else f"args[{i}]"
                raise ShardingError(f"in_shardings of {label}{keystr(path)}: {exc}") from None
            if replaced is not None and put is not leaf:
                replaced.append((leaf, put))
            placed.append(put)
        out[i] = unflatten(treedef, placed)
    return tuple(out)


def apply_in_shardings_to_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_shardings: Any,
    static_argnums: frozenset[int],
    static_argnames: frozenset[str],
    labels: Sequence[str],
    agreed: tuple[str, set] | None = None,
    replaced: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`apply_in_shardings` for a call with keyword arguments: each keyword naming a positional parameter is placed
    as the entry at that parameter's position (JAX refuses keyword arguments when in_shardings is given; binding
    them is friendlier, and a keyword argument is never silently left replicated). A keyword-only argument gets a
    bare spec; under a per-argument tuple it has no entry, a missing prefix: kept as it is, as a short tuple
    keeps the last positional arguments."""
    from pt3func.sharding.spec import NamedSharding, PartitionSpec
    from pt3func.tree import leaves

    if not kwargs:
        return apply_in_shardings(args, in_shardings, static_argnums, labels, agreed, replaced), kwargs
    positions = {name: i for i, name in enumerate(labels)}
    bound: dict[int, str] = {}
    rest: list[str] = []
    for name in kwargs:
        if name in static_argnames:
            continue
        i = positions.get(name)
        if i is not None:
            if i >= len(args):  # (else also given by position: the call itself raises Python's TypeError)
                bound[i] = name
        elif any(isinstance(x, torch.Tensor) for x in leaves(kwargs[name])):
            rest.append(name)
    if not isinstance(in_shardings, (PartitionSpec, NamedSharding)):
        rest = []  # a per-argument tuple has no entry for them: a missing prefix, kept as they are (API.md)
    n = max(len(args), max(bound, default=-1) + 1)
    full = list(args) + [None] * (n - len(args))  # a parameter not passed (its default) stays as it is
    for i, name in bound.items():
        full[i] = kwargs[name]
    placed = apply_in_shardings(tuple(full), in_shardings, static_argnums, labels, agreed, replaced)
    new_kwargs = dict(kwargs)
    for i, name in bound.items():
        new_kwargs[name] = placed[i]
    if rest:
        extra = apply_in_shardings(
            tuple(kwargs[name] for name in rest), in_shardings, frozenset(), rest, replaced=replaced
        )
        new_kwargs.update(zip(rest, extra))
    return placed[: len(args)], new_kwargs


def invalidate_donated_originals(
    replaced: Sequence[tuple[torch.Tensor, torch.Tensor]], call: Any = None
) -> dict[int, str]:
    """After a call: invalidate each caller's tensor whose placed copy (from `apply_in_shardings(replaced=...)`)
    the call donated.

    In a world of processes the caller's plain tensor may share its storage with the placed replicated copy (it
    then holds the new values); elsewhere it holds the old ones. Either way, read after a donation it would
    silently be wrong. Returns {index among the leaves of `call` (the (args, kwargs) placed): the program's
    name} for those tensors, for `invalidate_call_leaves`.
    """
    from pt3func.runtime.donated import donated_to, invalidate, is_donated
    from pt3func.runtime.virtual import is_virtual_leaf
    from pt3func.tree import leaves

    donated = [(original, put) for original, put in replaced if is_donated(put) and not is_donated(original)]
    if not donated:  # the common case (a placed batch is not donated): no walk over the call's arguments
        return {}
    index: dict[int, int] = {}
    for k, leaf in enumerate(leaves(call, is_leaf=is_virtual_leaf) if call is not None else ()):
        index.setdefault(id(leaf), k)
    done: dict[int, str] = {}
    for original, put in donated:
        where = donated_to(put)
        invalidate(original, where)
        if id(original) in index:
            done[index[id(original)]] = where
    return done


def invalidate_call_leaves(call: Any, donated: dict[int, str]) -> None:
    """On a virtual mesh, in the caller's thread: invalidate the caller's tensors at the leaf indices a rank
    thread's `invalidate_donated_originals` returned (each rank placed and donated a copy of its own)."""
    from pt3func.runtime.donated import invalidate, is_donated
    from pt3func.runtime.virtual import is_virtual_leaf
    from pt3func.tree import leaves

    flat = leaves(call, is_leaf=is_virtual_leaf)
    for k, where in donated.items():
        if k < len(flat) and isinstance(flat[k], torch.Tensor) and not is_donated(flat[k]):
            invalidate(flat[k], where)


def _zero_dim(x: Any) -> bool:
    """A 0-d tensor or a Python number: nothing to split."""
    return (isinstance(x, torch.Tensor) and x.ndim == 0) or isinstance(x, (bool, int, float, complex))


def _splits(sharding: Any) -> bool:
    from pt3func.sharding.spec import NamedSharding

    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    return isinstance(spec, tuple) and any(d is not None for d in spec)


def _check_plain_inputs_agree(
    args: tuple, shardings: Sequence[Any], static_argnums: frozenset[int], labels: Sequence[str], agreed: tuple
) -> None:
    """Every plain tensor argument of the step, split (shapes must agree) or replicated (values too)."""
    from pt3func.errors import ShardingError
    from pt3func.sharding.put import broadcast_shardings
    from pt3func.sharding.spec import NamedSharding
    from pt3func.tree import keystr, leaves

    name, checked = agreed
    # Cheap, on every call: the plain tensors' shapes and dtypes (a signature seen before was checked then).
    signature = tuple((tuple(x.shape), x.dtype) for i, arg in enumerate(args) if i not in static_argnums
                      for x in leaves(arg) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor))
    if signature in checked:
        return
    entries = []
    for i, arg in enumerate(args):
        if i in static_argnums:
            continue
        sharding = shardings[i] if i < len(shardings) else None
        label = labels[i] if labels and i < len(labels) else f"args[{i}]"
        try:
            paths, leaves, per_leaf, _ = broadcast_shardings(arg, sharding)
        except ShardingError as exc:  # "not a pytree prefix ... at the root": name the argument it is the root of
            raise ShardingError(f"in_shardings of {label}: {exc}") from None
        for path, leaf, s in zip(paths, leaves, per_leaf):
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
                spec = s.spec if isinstance(s, NamedSharding) else s
                entries.append((f"{label}{keystr(path)}", leaf, spec is not None and any(d is not None for d in spec)))
    check_ranks_agree(name, entries)
    checked.add(signature)


def _already_placed(leaf: torch.Tensor, sharding: Any, path: tuple) -> bool:
    from pt3func.sharding.mesh import get_mesh
    from pt3func.sharding.spec import NamedSharding, placements_for

    if not isinstance(leaf, DTensor):
        return False
    mesh, spec = (sharding.mesh, sharding.spec) if isinstance(sharding, NamedSharding) else (get_mesh(), sharding)
    if mesh is None or mesh.device_mesh is not leaf.device_mesh:
        return False
    return tuple(placements_for(spec, mesh, tuple(leaf.shape), path)) == tuple(leaf.placements)


def plain_output_sharding(x: torch.Tensor, sharding: Any, path: tuple) -> tuple[Any, tuple]:
    """`(NamedSharding, path)` for a plain output (the same value on every rank) that `out_shardings` places.

    Raises ShardingError naming the output when there is no mesh for a P or the spec does not fit its shape.
    """
    from pt3func.errors import ShardingError
    from pt3func.sharding.mesh import get_mesh
    from pt3func.sharding.spec import NamedSharding, placements_for
    from pt3func.tree import keystr

    where = f"out_shardings of out{keystr(path)}"
    if isinstance(sharding, NamedSharding):
        named = sharding
    elif get_mesh() is None:
        raise ShardingError(f"{where}: spec {sharding} needs a mesh; call pf.set_mesh(mesh) or pass "
                            "pf.NamedSharding(mesh, spec)")
    else:
        named = NamedSharding(get_mesh(), sharding)
    try:
        placements_for(named.spec, named.mesh, tuple(x.shape), ())  # `where` names the output
    except ShardingError as exc:
        raise ShardingError(f"{where}: {exc}") from None
    return named, path


def place_plain_output(x: torch.Tensor, sharding: Any, path: tuple) -> Any:
    """A plain output placed as out_shardings asks: every rank keeps its own block, no communication."""
    from pt3func.runtime.virtual import in_rank_thread
    from pt3func.sharding.put import device_put, put_leaf

    if sharding.mesh.virtual and not in_rank_thread():  # all ranks' blocks, made in this thread
        return device_put(x, sharding)
    return put_leaf(x, sharding, path, src_data_rank=None)


def output_placements(x: DTensor, sharding: Any, path: tuple) -> tuple:
    """Placements for an output given its `out_shardings` entry (NamedSharding or P).

    Raises ShardingError naming the output (`out_shardings of out...`) when the spec does not fit its shape, or
    when the sharding's mesh is not the one the output is on: the placements are applied on the output's own mesh,
    so another mesh's would give a layout nobody asked for (moving a value between meshes is `pf.device_put`'s).
    """
    from pt3func.errors import ShardingError
    from pt3func.sharding.mesh import get_mesh, mesh_of
    from pt3func.sharding.spec import NamedSharding, placements_for
    from pt3func.tree import keystr

    where = f"out_shardings of out{keystr(path)}"
    if isinstance(sharding, NamedSharding):
        mesh, spec, named = sharding.mesh, sharding.spec, f"{sharding!r}"
    else:
        mesh, spec = get_mesh() or mesh_of(x.device_mesh), sharding
        named = f"spec {sharding} on the current mesh {mesh!r} (pf.set_mesh)"
    if not _is_mesh_of(mesh, x.device_mesh):
        raise ShardingError(
            f"{where}: {named} names another mesh than the output's, {_value_mesh(x.device_mesh)!r}; out_shardings "
            f"places an output on the mesh of the step's values. Ask for a spec on that mesh and move the result "
            f"after the call with pf.device_put(out, pf.NamedSharding({mesh!r}, spec))"
        )
    try:
        return tuple(placements_for(spec, mesh, tuple(x.shape), ()))  # `where` names the output
    except ShardingError as exc:
        raise ShardingError(f"{where}: {exc}") from None


def _is_mesh_of(mesh: Any, device_mesh: Any) -> bool:
    """Whether `mesh` (a pf.Mesh) is `device_mesh`'s mesh: the same DeviceMesh, or an equal one (same ranks,
    layout and axis names)."""
    from pt3func.errors import ShardingError

    try:
        own = mesh.device_mesh
    except ShardingError:  # a virtual mesh used in a rank thread of another virtual mesh
        return False
    return own is device_mesh or own == device_mesh


def _value_mesh(device_mesh: Any) -> Any:
    """The pf.Mesh to name for a value's `device_mesh`: in a rank thread, the virtual mesh running there."""
    from pt3func.runtime import virtual
    from pt3func.sharding.mesh import mesh_of

    running = getattr(virtual._LOCAL, "mesh", None) if virtual.in_rank_thread() else None
    return running if running is not None else mesh_of(device_mesh)

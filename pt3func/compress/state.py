"""The state of a compressed gradient exchange: error-feedback residuals, PowerSGD's Q and a step counter.

`ExchangeState` is an explicit pytree the step takes and returns (with the optimizer state, say), never
hidden in the program: it is donated, checkpointed and restored like any other state. Residuals are per-rank
values (each rank's own compression error), so each is stored as a DTensor of global shape
`(ranks of the mesh, *local gradient shape before the reduction)` sharded `Shard(0)` over every mesh axis:
each rank holds exactly its own row, and a DCP checkpoint (`pf.checkpointing`) saves every rank's row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from pt3func import tree
from pt3func.compress.formats import Format, exchange_shape, leaf_seed


class LeafState(NamedTuple):
    """Per-leaf state; fields a format does not use are None (and are not pytree leaves)."""

    residual: Any = None  # EF: what compression left out, fp32, the local gradient's shape
    server_residual: Any = None  # EF of a two-phase all-reduce: the re-encoding error of this rank's chunk
    q: Any = None  # PowerSGD's warm-start Q, (cols, rank)
    velocity: Any = None  # top-k's momentum correction (DGC): the accumulated velocity, the gradient's shape


class ExchangeState:
    """Error-feedback residuals (and PowerSGD factors) per differentiated leaf, and a step counter.

    Build it with `fmt.init(params)`; pass it into the jitted step and return it unchanged (the program
    writes the new values). `leaves` has the structure of the parameters with a `LeafState` per leaf.

    `phase` is the start of the format's current phase (0, or a value of `format.schedule()`: a dense warm-up
    ends there, say). It is part of the pytree's static structure, so `jit` compiles one program per phase;
    while the last phase is not reached it is read off the step counter whenever the state is flattened (a
    host read of one integer; on a GPU a sync, for the warm-up steps only). Once in the last phase the states a
    step returns carry it and the counter is no longer read.
    """

    __slots__ = ("step", "leaves", "format", "data_axes", "phase")

    def __init__(
        self, step: Any, leaves: Any, format: Format, data_axes: tuple[str, ...] | None, phase: int = 0  # noqa: A002
    ) -> None:
        self.step = step
        self.leaves = leaves
        self.format = format
        self.data_axes = data_axes
        self.phase = phase

    def current_phase(self) -> int:
        """The phase the step counter is in (the largest value of `format.schedule()` <= step, or 0)."""
        marks = self.format.schedule()
        if not marks or self.phase == marks[-1]:
            return self.phase
        step = host_step(self.step)
        if step is None:  # a traced value (inside jit): the phase the program is compiled for
            return self.phase
        return max((m for m in marks if m <= step), default=0)

    def with_step(self, step: int) -> ExchangeState:
        """This state with its step counter set to `step` (residuals shared): e.g. `lower` a step with it to see
        the program of a later phase."""
        if isinstance(self.step, DTensor):
            local = torch.full_like(self.step._local_tensor, step)
            counter = DTensor.from_local(local, self.step.device_mesh, self.step.placements, run_check=False)
        else:
            counter = torch.full_like(self.step, step)
        return ExchangeState(counter, self.leaves, self.format, self.data_axes)

    def __repr__(self) -> str:
        n = sum(1 for _ in tree.leaves(self.leaves))
        phase = f", phase from step {self.phase}" if self.format.schedule() else ""
        return f"ExchangeState({self.format.describe()}, {n} state tensors, data_axes={self.data_axes}{phase})"


def host_step(step: Any) -> int | None:
    """The value of a step counter (tensor or DTensor) on the host; None for a traced (fake) one, or one donated
    to an earlier call (jit then says which argument it was)."""
    from torch._subclasses.fake_tensor import is_fake

    from pt3func.runtime.donated import is_donated

    if not isinstance(step, torch.Tensor) or is_donated(step) or is_fake(step):
        return None
    local = step._local_tensor if isinstance(step, DTensor) else step
    if is_donated(local) or is_fake(local) or local.device.type == "meta":
        return None
    return int(local.item())


tree.register_node(
    ExchangeState,
    lambda s: ((s.step, s.leaves), (s.format, s.data_axes, s.current_phase()), ("step", "leaves")),
    lambda aux, children: ExchangeState(children[0], children[1], *aux),
)


def is_state(x: Any) -> bool:
    return isinstance(x, ExchangeState)


def is_leaf_state(x: Any) -> bool:
    return isinstance(x, LeafState)


def _data_dims(mesh: Any, data_axes: str | Sequence[str] | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    names = tuple(mesh.mesh_dim_names or (str(i) for i in range(mesh.ndim)))
    if data_axes is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"grad_exchange state: the mesh has {mesh.ndim} axes {names}; say which of them split the data "
                f"(the axes gradients are reduced over), e.g. init(params, data_axes=({names[0]!r},))"
            )
        return (0,), names
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    unknown = [a for a in axes if a not in names]
    if unknown or not axes:
        raise ValueError(f"grad_exchange state: data_axes={axes} names no axis of the mesh, whose axes are {names}")
    return tuple(names.index(a) for a in axes), axes


def local_grad_shape(leaf: DTensor, data_dims: Sequence[int]) -> tuple[int, ...]:
    """The shape of this rank's gradient of `leaf` before it is reduced over the data axes.

    Dims sharded over a non-data axis (tensor parallel) are split; dims sharded over a data axis (FSDP) are
    whole, since a reduce-scatter reduces the whole gradient into the shards. A reduce-scatter onto dim d > 0
    (torch's `reduce_scatter_single`) reduces the d-chunks stacked along dim 0, which is the shape returned.
    """
    shape = list(leaf.shape)
    mesh = leaf.device_mesh
    for mesh_dim, placement in enumerate(leaf.placements):
        if isinstance(placement, Shard):
            size = mesh.size(mesh_dim)
            if shape[placement.dim] % size:
                raise ValueError(
                    f"dim {placement.dim} of size {shape[placement.dim]} does not split evenly over mesh axis "
                    f"{mesh_dim} of size {size}; compressed exchange needs even shards"
                )
            if mesh_dim not in data_dims:
                shape[placement.dim] //= size
    for mesh_dim, placement in enumerate(leaf.placements):
        if isinstance(placement, Shard) and mesh_dim in data_dims and placement.dim != 0:
            size = mesh.size(mesh_dim)
            shape[0] *= size
            shape[placement.dim] //= size
    return tuple(shape)


def first_reduction(leaf: DTensor, data_dims: Sequence[int]) -> tuple[str, int]:
    """(kind, group size) of the first reduction of `leaf`'s gradient over the data axes: the one the exchange
    compresses when it keeps state (later reductions of the leaf stay exact, see the grad_exchange pass).

    DTensor reduces a pending sum one mesh axis at a time, in mesh order (merging neighbouring axes of one kind
    into one collective): on an HSDP mesh ("dp", "fsdp") with the parameter sharded over "fsdp" that is an
    all-reduce over "dp", then a reduce-scatter over "fsdp"; on ("fsdp", "dp") a reduce-scatter first.
    """
    mesh = leaf.device_mesh
    ordered = sorted(data_dims)
    sharding = [d for d in ordered if isinstance(leaf.placements[d], Shard)]
    if not sharding:
        return "all_reduce", math.prod(mesh.size(d) for d in ordered)
    leading = [d for d in ordered if d < sharding[0]]
    if not leading:
        return "reduce_scatter", math.prod(mesh.size(d) for d in sharding)
    return "all_reduce", math.prod(mesh.size(d) for d in leading)


def _per_rank(local: torch.Tensor, mesh: Any) -> DTensor:
    """`local` as this rank's row of a (ranks, *shape) DTensor sharded over every mesh axis."""
    shape = (mesh.size(), *local.shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(
        local.unsqueeze(0), mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=torch.Size(shape), stride=stride
    )


def init(fmt: Format, params: Any, data_axes: str | Sequence[str] | None = None) -> ExchangeState:
    """The zero state of `fmt` for `params` (a pytree of tensors or DTensors, as the step differentiates).

    Args:
        fmt: the format given to `pf.jit(grad_exchange=...)`.
        params: the differentiated parameters (their structure and shardings decide the state).
        data_axes: the mesh axes that split the data (gradients are reduced over them). Default: the only
            axis of a 1-D mesh; required on a mesh of several axes.

    Returns:
        An `ExchangeState`. Plain (unsharded) parameters have no gradient reductions, so their state is empty.
    """
    from pt3func.runtime.virtual import find_mesh, gather_trees, in_rank_thread, scatter_tree

    vmesh = None if in_rank_thread() else find_mesh(params)
    if vmesh is not None:  # the shards live in the rank threads: build each rank's state there
        return gather_trees(vmesh, vmesh.run(lambda rank: init(fmt, scatter_tree(params, rank), data_axes)))
    paths = tree.paths(params)
    leaves = tree.leaves(params)
    meshes = {id(x.device_mesh): x.device_mesh for x in leaves if isinstance(x, DTensor)}
    if len(meshes) > 1:
        raise ValueError("grad_exchange state: the parameters live on more than one mesh")
    mesh = next(iter(meshes.values()), None)
    device = next((getattr(x, "_local_tensor", x).device for x in leaves if isinstance(x, torch.Tensor)), None)
    step = torch.zeros((), dtype=torch.int64, device=device)
    if mesh is None:
        empty = [LeafState() for _ in leaves]
        return ExchangeState(step, tree.unflatten(tree.structure(params), empty), fmt, None)
    dims, axes = _data_dims(mesh, data_axes)
    step = DTensor.from_local(step, mesh, [Replicate()] * mesh.ndim, run_check=False)
    states = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, DTensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            states.append(LeafState())
            continue
        label = tree.keystr(path)
        try:
            shape = exchange_shape(local_grad_shape(leaf, dims), leaf.dtype)
        except ValueError as exc:
            raise ValueError(f"grad_exchange state of {label}: {exc}") from None
        leaf_fmt = fmt.resolve(label, shape)
        if leaf_fmt is None:
            states.append(LeafState())
            continue
        kind, group_size = first_reduction(leaf, dims)
        fields = {
            name: _per_rank(leaf_fmt.initial_state(name, s, leaf_seed(label), device), mesh)
            for name, s in leaf_fmt.state_shapes(shape, kind, group_size).items()
        }
        states.append(LeafState(**fields))
    return ExchangeState(step, tree.unflatten(tree.structure(params), states), fmt, axes)

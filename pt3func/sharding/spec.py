"""`P` (PartitionSpec), `NamedSharding`, and their translation to and from DTensor placements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from pt3func._compat import is_plain_shard
from pt3func.errors import ShardingError
from pt3func.sharding.mesh import Mesh
from pt3func.tree import keystr

SpecEntry = None | str | tuple[str, ...]


class PartitionSpec(tuple):
    """How each tensor dim is split over mesh axes: `P("dp", None)`, `P(None, "tp")`, `P(("dp", "tp"))`.

    One entry per leading tensor dim: None (not split), an axis name, or a tuple of axis names (split over
    those axes together, the first one outermost). Missing trailing entries mean None.
    """

    def __new__(cls, *dims: SpecEntry) -> PartitionSpec:
        for dim in dims:
            ok = dim is None or isinstance(dim, str) or (
                isinstance(dim, tuple) and all(isinstance(name, str) for name in dim))
            if not ok:
                raise ShardingError(f"P entries are None, an axis name or a tuple of axis names; got {dim!r}")
        return super().__new__(cls, dims)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(dim) for dim in self) + ")"

    def __getnewargs__(self) -> tuple[SpecEntry, ...]:
        return tuple(self)

    def normalized(self) -> PartitionSpec:
        """The canonical form: 1-tuples unwrapped, empty tuples as None, trailing Nones dropped."""
        dims = [dim if not isinstance(dim, tuple) else (dim[0] if len(dim) == 1 else dim or None)
                for dim in self]
        while dims and dims[-1] is None:
            dims.pop()
        return PartitionSpec(*dims)


P = PartitionSpec


def _names(dim: SpecEntry) -> tuple[str, ...]:
    if dim is None:
        return ()
    return (dim,) if isinstance(dim, str) else dim


def placements_for(spec: PartitionSpec, mesh: Mesh, shape: Sequence[int] | None = None,
                   path: tuple[Any, ...] = ()) -> tuple[Placement, ...]:
    """The DTensor placements (one per mesh axis) of `spec` on `mesh`, checked against `shape` if given.

    A tensor dim split over several axes gives `Shard(d)` on each of them; the axes must be listed in mesh
    order (DTensor splits the outer mesh axis first). Raises `ShardingError` naming the pytree `path`,
    the shape, the spec and the axis sizes for: an unknown axis, an axis used twice, a spec longer than
    the tensor's rank, a dim the axes do not divide.
    """
    spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
    where = f"at {keystr(path)}: " if path else ""
    shape_text = f"shape {tuple(shape)}" if shape is not None else "a tensor"
    placements: list[Placement] = [Replicate()] * mesh.ndim
    used: dict[str, int] = {}
    if shape is not None and len(spec) > len(shape):
        raise ShardingError(f"{where}spec {spec} has {len(spec)} entries but the value has {shape_text} "
                            f"(rank {len(shape)})")
    for dim, entry in enumerate(spec):
        names = _names(entry)
        for name in names:
            if name not in mesh.axis_names:
                raise ShardingError(f"{where}spec {spec} for {shape_text} names axis {name!r}, which is not "
                                    f"an axis of {mesh!r}")
            if name in used:
                raise ShardingError(f"{where}spec {spec} for {shape_text} uses axis {name!r} twice "
                                    f"(dims {used[name]} and {dim}); an axis can split only one dim")
            used[name] = dim
        if names != mesh.in_mesh_order(names):
            raise ShardingError(f"{where}spec {spec} for {shape_text} splits dim {dim} over {names}, against "
                                f"the mesh order {mesh.axis_names}; write {mesh.in_mesh_order(names)}")
        if names and shape is not None:
            size = mesh.axis_size(names)
            if shape[dim] % size:
                sizes = " x ".join(f"{name}={mesh.axis_size(name)}" for name in names)
                raise ShardingError(f"{where}dim {dim} of shape {tuple(shape)} (size {shape[dim]}) is not "
                                    f"divisible by the axis size {size} ({sizes}) in spec {spec}; pad the "
                                    f"tensor or change the spec (pt3func never replicates silently)")
        for name in names:
            placements[mesh.axis_names.index(name)] = Shard(dim)
    return tuple(placements)


def spec_from_placements(placements: Sequence[Placement], mesh: Mesh, ndim: int) -> PartitionSpec:
    """The (normalized) spec of a tensor of rank `ndim` with these placements; `Partial` has no spec."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for name, placement in zip(mesh.axis_names, placements):
        if isinstance(placement, Partial):
            raise ShardingError(f"placements {tuple(placements)} hold a pending reduction ({placement}) over "
                                f"axis {name!r}, which no PartitionSpec expresses; redistribute first")
        if is_plain_shard(placement):
            dims[placement.dim].append(name)
        elif not isinstance(placement, Replicate):
            raise ShardingError(f"placement {placement} over axis {name!r} has no PartitionSpec")
    return PartitionSpec(*(tuple(names) if names else None for names in dims)).normalized()


@dataclass(frozen=True, eq=False)
class NamedSharding:
    """A `PartitionSpec` bound to a `Mesh`. Equal when the mesh is the same and the specs normalize equal."""

    mesh: Mesh
    spec: PartitionSpec

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"NamedSharding expects a pf.Mesh, got {type(self.mesh).__name__}")
        spec = self.spec if isinstance(self.spec, PartitionSpec) else PartitionSpec(*self.spec)
        object.__setattr__(self, "spec", spec)
        placements_for(spec, self.mesh)  # names and order, before any shape is known

    def placements(self, shape: Sequence[int] | None = None, path: tuple[Any, ...] = ()) -> tuple[Placement, ...]:
        """DTensor placements of this sharding, checked against `shape` if given (see `placements_for`)."""
        return placements_for(self.spec, self.mesh, shape, path)

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one rank's block of a tensor of global `shape`."""
        self.placements(shape)
        spec = list(self.spec) + [None] * (len(shape) - len(self.spec))
        return tuple(size // self.mesh.axis_size(_names(entry)) for size, entry in zip(shape, spec))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, NamedSharding) and self.mesh is other.mesh
                and self.spec.normalized() == other.spec.normalized())

    def __hash__(self) -> int:
        return hash((id(self.mesh), self.spec.normalized()))

    def __repr__(self) -> str:
        return f"NamedSharding({self.mesh!r}, {self.spec!r})"

"""Moving pytrees onto a mesh and back: `device_put`, `device_get`, `sharding_of`, `with_sharding_constraint`,
`make_array_from_process_local_data`."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pt3func.errors import ShardingError
from pt3func.sharding.mesh import Mesh, get_mesh, mesh_of
from pt3func.sharding.spec import NamedSharding, PartitionSpec, placements_for, spec_from_placements
from pt3func.tree import NAMESPACE, PrefixError, PyTree, broadcast_prefix, keystr

Sharding = NamedSharding | PartitionSpec | None


def _virtual_mesh(tree: PyTree, shardings: PyTree) -> Any:
    """The virtual mesh this call must be dispatched to (from the main thread), or None."""
    from pt3func.runtime import virtual

    if not virtual.VirtualWorld._installed or virtual.in_rank_thread():
        return None
    for s in optree.tree_leaves(shardings, is_leaf=_is_sharding, none_is_leaf=True, namespace=NAMESPACE):
        if isinstance(s, NamedSharding) and isinstance(s.mesh, virtual.VirtualMesh):
            return s.mesh
    return virtual.find_mesh(tree)


def _is_sharding(x: Any) -> bool:
    return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def broadcast_shardings(
    tree: PyTree, shardings: PyTree, *, scalars_whole: bool = True
) -> tuple[list[tuple], list[Any], list[Sharding], optree.PyTreeSpec]:
    """Paths, leaves and the sharding of every leaf of `tree` (`shardings` is a pytree prefix of it).

    `scalars_whole`: a 0-d leaf that a prefix gives a split spec is kept whole (`_scalars_whole`); without it the
    split spec reaches the leaf, for the caller to refuse (shard_map's out_specs: a per-rank 0-d output)."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, is_leaf=_is_sharding, none_is_leaf=True,
                                                           namespace=NAMESPACE)
    try:
        per_leaf = broadcast_prefix(shardings, tree, is_leaf=_is_sharding, none_is_leaf=True)
    except PrefixError as e:
        raise ShardingError(f"the shardings are not a pytree prefix of the value: {e}") from None
    if scalars_whole:
        per_leaf = _scalars_whole(paths, leaves, per_leaf, shardings)
    return paths, leaves, per_leaf, treedef


def _scalars_whole(paths: list[tuple], leaves: list[Any], per_leaf: list[Any], shardings: PyTree) -> list[Any]:
    """A 0-d tensor that gets a split spec from a prefix (`P("dp")` over a whole optimizer state: ZeRO) is kept
    whole: it has no dim to split (an optimizer's step counter). Given at its own path, the spec still raises."""
    given = {tuple(path) for path in optree.tree_paths(shardings, is_leaf=_is_sharding, none_is_leaf=True,
                                                       namespace=NAMESPACE)}
    out = list(per_leaf)
    for k, (path, leaf, sharding) in enumerate(zip(paths, leaves, per_leaf)):
        if not (isinstance(leaf, torch.Tensor) and leaf.ndim == 0) or tuple(path) in given:
            continue
        if isinstance(sharding, NamedSharding) and any(d is not None for d in sharding.spec):
            out[k] = NamedSharding(sharding.mesh, PartitionSpec())
        elif isinstance(sharding, PartitionSpec) and any(d is not None for d in sharding):
            out[k] = PartitionSpec()
    return out


def _resolve(sharding: Sharding, path: tuple) -> tuple[Mesh, PartitionSpec] | None:
    """The mesh and spec of `sharding` (a P takes the current mesh); None when there is no mesh at all."""
    if isinstance(sharding, NamedSharding):
        return sharding.mesh, sharding.spec
    if sharding is not None and not isinstance(sharding, PartitionSpec):
        hint = f"; write P({sharding!r})" if isinstance(sharding, str) else ""
        raise ShardingError(f"at {keystr(path) or 'the root'}: a sharding is P(...), pf.NamedSharding or None, got "
                            f"{type(sharding).__name__} {sharding!r}{hint}")
    mesh = get_mesh()
    if mesh is None:
        if sharding is None:
            return None
        raise ShardingError(f"at {keystr(path) or 'the root'}: spec {sharding} needs a mesh; call "
                            f"pf.set_mesh(mesh) or pass pf.NamedSharding(mesh, spec)")
    return mesh, sharding if sharding is not None else PartitionSpec()


def put_leaf(x: Any, sharding: Sharding, path: tuple, src_data_rank: int | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    resolved = _resolve(sharding, path)
    if resolved is None:
        return x
    mesh, spec = resolved
    placements = placements_for(spec, mesh, tuple(x.shape), path)
    device_mesh = mesh.device_mesh
    if isinstance(x, DTensor):
        if x.device_mesh is device_mesh:
            return x.redistribute(device_mesh, placements)
        x = x.full_tensor()
    if x.grad_fn is not None:
        # torch's distribute_tensor refuses a tensor with a graph behind it (`w * 2`). It is split locally, as if
        # every rank held the value (no communication: a scatter from one rank inside a traced step waited
        # forever), and the placement stays differentiable, as with_sharding_constraint must be under pf.grad and
        # as jax.device_put is.
        whole = DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
        return whole.redistribute(device_mesh, placements)
    return distribute_tensor(x, device_mesh, placements, src_data_rank=src_data_rank)


def device_put(tree: PyTree, shardings: PyTree = None) -> PyTree:
    """Place every tensor of `tree` on a mesh as a DTensor.

    `shardings` is a pytree prefix of `tree` whose leaves are `NamedSharding`, `P` (on the current mesh,
    see `set_mesh`) or None (replicated on the current mesh; left as is when no mesh is set).
    A plain tensor is the full value: rank 0's copy is the one scattered (ranks should hold the same value).
    A DTensor is redistributed. Non-tensor leaves pass through.
    """
    vmesh = _virtual_mesh(tree, shardings)
    if vmesh is not None:
        from pt3func.runtime import virtual

        return virtual.device_put(vmesh, tree, shardings)
    paths, leaves, per_leaf, treedef = broadcast_shardings(tree, shardings)
    out = [put_leaf(x, s, path, src_data_rank=0) for path, x, s in zip(paths, leaves, per_leaf)]
    return optree.tree_unflatten(treedef, out)


def make_array_from_process_local_data(
    sharding: Sharding, local_data: torch.Tensor, global_shape: Sequence[int] | None = None
) -> DTensor:
    """The global array whose block on this process is `local_data` (jax.make_array_from_process_local_data).

    For per-rank data in a world of processes (each rank loading its own rows, the DDP habit): every rank
    passes its own block of the array `sharding` describes (a `NamedSharding`, or a `P` on the current mesh);
    ranks whose mesh coordinates give the same block pass the same values. A plain tensor given to a sharded
    step is instead the global value, the same on every rank. On a virtual mesh all ranks are this one process:
    use `pf.device_put` with the global value.

    No communication (it is called per batch, often from a data-loading thread, where a collective would race the
    step's own). The global shape is `global_shape` (as JAX takes it), and then each rank checks its own block
    against it: a rank whose block differs (a smaller last batch on one rank) gets a `ShardingError` naming both
    shapes. Without it, the global shape is the block's times the sizes of the axes that split each dim, which
    assumes every rank's block has the same shape: ranks whose blocks differ would each build a different global
    array, unnoticed. Pass `global_shape` where batches may differ.
    """
    if not isinstance(local_data, torch.Tensor) or isinstance(local_data, DTensor):
        raise ShardingError(f"make_array_from_process_local_data: local_data must be a plain tensor, got "
                            f"{type(local_data).__name__}")
    resolved = _resolve(sharding if sharding is not None else PartitionSpec(), ())
    if resolved is None:
        raise ShardingError("make_array_from_process_local_data needs a mesh: call pf.set_mesh(mesh) or pass "
                            "pf.NamedSharding(mesh, spec)")
    mesh, spec = resolved
    if mesh.virtual:
        raise ShardingError(f"make_array_from_process_local_data: {mesh!r} is virtual (every rank is this "
                            "process): pass the global value to pf.device_put instead")
    spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
    if len(spec) > local_data.ndim:
        raise ShardingError(f"make_array_from_process_local_data: spec {spec} has {len(spec)} entries but the "
                            f"local block has shape {tuple(local_data.shape)}")
    if global_shape is None:
        shape = list(local_data.shape)
        for dim, entry in enumerate(spec):
            if entry is not None:
                shape[dim] *= mesh.axis_size(entry)
    else:
        shape = _checked_global_shape(global_shape, local_data, spec, mesh)
    placements = placements_for(spec, mesh, tuple(shape))
    if global_shape is not None:
        block = compute_local_shape_and_global_offset(shape, mesh.device_mesh, placements)[0]
        if tuple(block) != tuple(local_data.shape):
            raise ShardingError(
                f"make_array_from_process_local_data: global_shape {tuple(shape)} split by {spec} gives this rank "
                f"(rank {dist.get_rank() if dist.is_initialized() else 0}) a block of shape {tuple(block)}, but "
                f"local_data has shape {tuple(local_data.shape)}")
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_data, mesh.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _checked_global_shape(global_shape: Sequence[int], local_data: torch.Tensor, spec: PartitionSpec,
                          mesh: Mesh) -> list[int]:
    try:
        shape = [operator.index(n) for n in global_shape]
    except TypeError:
        raise ShardingError(f"make_array_from_process_local_data: global_shape must be a sequence of ints, got "
                            f"{global_shape!r}") from None
    if len(shape) != local_data.ndim or any(n < 0 for n in shape):
        raise ShardingError(f"make_array_from_process_local_data: global_shape {tuple(shape)} does not fit a local "
                            f"block of shape {tuple(local_data.shape)} (one size >= 0 per dim)")
    return shape


def device_get(tree: PyTree) -> PyTree:
    """Every DTensor of `tree` as its full plain tensor (collective); everything else unchanged.

    The full tensors never share memory with the DTensors' buffers: they keep their values when those are donated
    to a jitted step or changed in place.
    """
    vmesh = _virtual_mesh(tree, None)
    if vmesh is not None:
        from pt3func.runtime import virtual

        return virtual.device_get(vmesh, tree)
    return optree.tree_map(lambda x: unaliased(x.full_tensor(), x) if isinstance(x, DTensor) else x, tree,
                           none_is_leaf=True, namespace=NAMESPACE)


def unaliased(full: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`full` (the gathered value of `source`), copied if it shares `source`'s buffer.

    A DTensor replicated over every mesh axis gathers to its own local tensor: handed out as is, a snapshot taken
    before a donated step would change under the caller when the step writes its outputs into that buffer. A gather
    that made a new tensor is returned without a second copy.
    """
    local = source.to_local() if isinstance(source, DTensor) else source
    if full.numel() and full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return full.clone()
    return full


def sharding_of(x: Any) -> NamedSharding | None:
    """The NamedSharding of a DTensor (or of a virtual mesh's array, on that mesh), None for anything else."""
    from pt3func.runtime.virtual import VirtualArray

    if isinstance(x, VirtualArray):
        placements = x.placements
        return NamedSharding(x.mesh, spec_from_placements(placements, x.mesh, x.ndim)) if placements else None
    if not isinstance(x, DTensor):
        return None
    mesh: Mesh = mesh_of(x.device_mesh)
    return NamedSharding(mesh, spec_from_placements(x.placements, mesh, x.ndim))


def with_sharding_constraint(tree: PyTree, shardings: PyTree) -> PyTree:
    """Make every tensor of `tree` have the given sharding (a pytree prefix, as in `device_put`).

    DTensors are redistributed (inside `jit` this is where the collective goes). Plain tensors are taken
    as the same full value on every rank and split locally, with no communication; None leaves a leaf as is.
    """
    paths, leaves, per_leaf, treedef = broadcast_shardings(tree, shardings)
    out = [x if s is None else put_leaf(x, s, path, src_data_rank=None)
           for path, x, s in zip(paths, leaves, per_leaf)]
    return optree.tree_unflatten(treedef, out)

"""`visualize_sharding`: a table of which rank holds which block of a tensor."""

from __future__ import annotations

import io
import itertools
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from rich.text import Text
from torch.distributed.tensor import DTensor, Partial

from pt3func._compat import is_plain_shard, is_strided_shard
from pt3func.errors import ShardingError
from pt3func.sharding.mesh import mesh_of
from pt3func.sharding.spec import spec_from_placements

# Per tensor dim, the (start, stop) ranges of it a block covers: one range, except across a dim a `_StridedShard`
# splits (an eager reshape of a 2-D split array), where a rank holds every split_factor-th piece. A dim whose strided
# positions could not be read is `((-1, size, k),)`: `size` elements (-1: unknown), the k-th block of the ranks
# splitting it.
Runs = tuple[tuple[int, ...], ...]
Block = tuple[Runs, ...]


def _blocks(x: DTensor) -> dict[Block, list[int]]:
    """Every distinct block and the ranks that hold it, as DTensor lays `x` out: its own local shape and offset per
    mesh coordinate (uneven splits as torch.chunk makes them: 5 rows over 2 ranks are 3 and 2, the last ranks'
    possibly empty), and for a dim a `_StridedShard` splits, the indices its own split takes."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh_shape = tuple(x.device_mesh.mesh.shape)
    shape = tuple(x.shape)
    strided_dims = {p.dim for p in x.placements if is_strided_shard(p)}
    held: dict[Block, list[int]] = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        try:
            # (global shape, mesh shape, coordinate, placements): the same four first arguments in torch 2.11 and
            # 2.13 (the public function takes this rank's coordinate only)
            size, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), x.placements)
        except (RuntimeError, NotImplementedError, AssertionError):  # a torch whose rules refuse a strided layout
            size = offset = None
        block = []
        for d in range(len(shape)):
            runs = _split_runs(x, mesh_shape, coord, d) if d in strided_dims or size is None else None
            if size is not None and (runs is None or not _agree(runs, int(size[d]), int(offset[d]))):
                # DTensor's own range; a strided dim whose split disagrees with it (another torch's rules) is named
                # by its size and block, not located
                start, stop = int(offset[d]), int(offset[d]) + int(size[d])
                runs = ((start, stop),) if d not in strided_dims else ((-1, stop - start, _block_index(x, coord, d)),)
            block.append(runs or ((-1, -1, _block_index(x, coord, d)),))  # (neither could say: position unknown)
        held.setdefault(tuple(block), []).append(int(x.device_mesh.mesh[coord]))
    return held


def _splits(x: DTensor, dim: int) -> list[tuple[int, Any]]:
    """(mesh dim, placement) of each placement that splits `dim`, in mesh order."""
    return [(m, p) for m, p in enumerate(x.placements)
            if getattr(p, "dim", None) == dim and (is_plain_shard(p) or is_strided_shard(p))]


def _block_index(x: DTensor, coord: tuple[int, ...], dim: int) -> int:
    """Which block of `dim` the rank at `coord` holds, counting over the mesh dims that split it (outer first)."""
    mesh_shape = x.device_mesh.mesh.shape
    k = 0
    for mesh_dim, _ in _splits(x, dim):
        k = k * mesh_shape[mesh_dim] + coord[mesh_dim]
    return k


def _split_runs(x: DTensor, mesh_shape: tuple[int, ...], coord: tuple[int, ...], dim: int) -> Runs | None:
    """The ranges of `dim` that the rank at `coord` holds: an index vector split by each placement of the dim in mesh
    order, with the placement's own split (what `distribute_tensor` applies); None where a placement cannot split."""
    index = torch.arange(x.shape[dim]).reshape((1,) * dim + (-1,))
    try:
        for mesh_dim, placement in _splits(x, dim):
            index = placement._split_tensor(index, mesh_shape[mesh_dim], with_padding=False)[0][coord[mesh_dim]]
    except (AttributeError, TypeError, RuntimeError, IndexError):  # a torch without this private split
        return None
    runs: list[tuple[int, int]] = []
    for i in index.flatten().tolist():
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def _agree(runs: Runs, size: int, offset: int) -> bool:
    """Whether `runs` hold `size` elements from `offset` on, as DTensor's local shape and offset say."""
    if sum(stop - start for start, stop in runs) != size:
        return False
    return size == 0 or runs[0][0] == offset


def _grid_key(block: Block) -> tuple[tuple[int, int], tuple[int, int]]:
    """(row, column) of a block in the drawing: dims 0 and 1; a 1-D tensor is drawn as one row."""
    whole = (0, 0)
    if len(block) == 1:
        return whole, block[0]
    return (block[0], block[1]) if block else (whole, whole)


def _runs_text(runs: Runs) -> str:
    """`0:4` for one range; `{0:2, 4:6, 8:10}` for a strided dim's (the first and last two past 6 of them)."""
    if len(runs[0]) == 3:
        _, size, block = runs[0]
        return f"strided: {size} elements, block {block}" if size >= 0 else f"block {block}, position unknown"
    texts = [f"{run[0]}:{run[1]}" for run in runs]
    if len(texts) == 1:
        return texts[0]
    if len(texts) > 6:
        texts = [*texts[:2], f"... {len(texts) - 4} more ...", *texts[-2:]]
    return "{" + ", ".join(texts) + "}"


def _range_text(block: Block) -> str:
    return "[" + ", ".join(_runs_text(runs) for runs in block) + "]"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in sorted(ranks))


def visualize_sharding(x: torch.Tensor, *, width: int = 100) -> str:
    """Draw the blocks of `x` as a grid over its first two dims, each cell naming the ranks holding it.

    Cells show the index range of the block in every dim (for more than two dims, one line per block).
    Printed on rank 0 only; the drawing is returned as a string on every rank.
    """
    from pt3func.runtime.virtual import VirtualArray

    if isinstance(x, VirtualArray):
        return x.mesh.run(lambda rank: visualize_sharding(x.locals[rank], width=width))[0]
    if isinstance(x, DTensor):
        held = _blocks(x)
        mesh = mesh_of(x.device_mesh)
        partial = [name for name, p in zip(mesh.axis_names, x.placements) if isinstance(p, Partial)]
        strided = [name for name, p in zip(mesh.axis_names, x.placements) if is_strided_shard(p)]
        if partial:
            title = (f"{tuple(x.shape)} {tuple(x.placements)} on {mesh!r}\n"
                     f"(pending sum over {', '.join(partial)}: each rank holds a partial value)")
        elif strided:
            title = (f"{tuple(x.shape)} {tuple(x.placements)} on {mesh!r}\n"
                     f"(strided over {', '.join(strided)}: a rank's block is several ranges of a dim; no PartitionSpec "
                     f"expresses this layout)")
        else:
            title = f"{tuple(x.shape)} {_spec_text(x, mesh)} on {mesh!r}"
    else:
        world = dist.get_world_size() if dist.is_initialized() else 1
        held = {tuple(((0, n),) for n in x.shape): list(range(world))}
        title = f"{tuple(x.shape)} plain tensor (not sharded)"
    rows = sorted({_grid_key(block)[0] for block in held})
    cols = sorted({_grid_key(block)[1] for block in held})
    cells: dict[tuple[int, int], list[str]] = {}
    for block, ranks in sorted(held.items()):
        row, col = _grid_key(block)
        cells.setdefault((rows.index(row), cols.index(col)), []).append(
            f"{_ranks_text(ranks)}\n{_range_text(block)}" if x.ndim <= 2
            else f"{_range_text(block)}: {_ranks_text(ranks)}")
    table = Table(show_header=False, show_lines=True)
    for _ in cols:
        table.add_column(justify="center")
    for r in range(len(rows)):
        # Text, not markup: `[strided: 8 elements, block 0]` would read as a rich tag and vanish.
        table.add_row(*(Text("\n".join(cells.get((r, c), [])), justify="center") for c in range(len(cols))))
    buffer = io.StringIO()
    # force_jupyter=False: in a notebook rich would display this buffer console too (and leave it empty).
    consoles = [Console(file=buffer, width=width, color_system=None, force_jupyter=False)]
    if not dist.is_initialized() or dist.get_rank() == 0:
        consoles.append(Console(width=width))
    for console in consoles:
        console.print(title, markup=False, highlight=False)
        console.print(table)
    return buffer.getvalue()


def _spec_text(x: DTensor, mesh: Any) -> str:
    """The PartitionSpec of `x`, or its placements where none expresses them (a placement torch adds later)."""
    try:
        return repr(spec_from_placements(x.placements, mesh, x.ndim))
    except ShardingError:
        return repr(tuple(x.placements))

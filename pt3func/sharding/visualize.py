"""`visualize_sharding`: a table of which rank holds which block of a tensor."""

from __future__ import annotations

import io
import itertools

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor, Partial

from pt3func._compat import is_plain_shard
from pt3func.sharding.mesh import mesh_of
from pt3func.sharding.spec import spec_from_placements

Block = tuple[tuple[int, int], ...]


def _blocks(x: DTensor) -> dict[Block, list[int]]:
    """Every distinct block (a (start, stop) range per dim) and the ranks that hold it."""
    mesh = x.device_mesh
    shape = tuple(x.shape)
    split_by = [[m for m, p in enumerate(x.placements) if is_plain_shard(p) and p.dim == d] for d in range(len(shape))]
    held: dict[Block, list[int]] = {}
    for coord in itertools.product(*(range(n) for n in mesh.mesh.shape)):
        block = []
        for size, mesh_dims in zip(shape, split_by):
            index, count = 0, 1
            for m in mesh_dims:  # row-major over the splitting axes, outer axis first (DTensor's order)
                index, count = index * mesh.mesh.shape[m] + coord[m], count * mesh.mesh.shape[m]
            chunk = size // count
            block.append((index * chunk, (index + 1) * chunk))
        held.setdefault(tuple(block), []).append(int(mesh.mesh[coord]))
    return held


def _grid_key(block: Block) -> tuple[tuple[int, int], tuple[int, int]]:
    """(row, column) of a block in the drawing: dims 0 and 1; a 1-D tensor is drawn as one row."""
    whole = (0, 0)
    if len(block) == 1:
        return whole, block[0]
    return (block[0], block[1]) if block else (whole, whole)


def _range_text(block: Block) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in block) + "]"


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
        if partial:
            title = (f"{tuple(x.shape)} {tuple(x.placements)} on {mesh!r}\n"
                     f"(pending sum over {', '.join(partial)}: each rank holds a partial value)")
        else:
            title = f"{tuple(x.shape)} {spec_from_placements(x.placements, mesh, x.ndim)} on {mesh!r}"
    else:
        world = dist.get_world_size() if dist.is_initialized() else 1
        held = {tuple((0, n) for n in x.shape): list(range(world))}
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
        table.add_row(*("\n".join(cells.get((r, c), [])) for c in range(len(cols))))
    buffer = io.StringIO()
    # force_jupyter=False: in a notebook rich would display this buffer console too (and leave it empty).
    consoles = [Console(file=buffer, width=width, color_system=None, force_jupyter=False)]
    if not dist.is_initialized() or dist.get_rank() == 0:
        consoles.append(Console(width=width))
    for console in consoles:
        console.print(title, markup=False, highlight=False)
        console.print(table)
    return buffer.getvalue()

"""Cast before gathering: all-gather FSDP shards in the dtype the program uses them in (Graph -> Graph).

FSDP gathers each parameter where the step first needs it whole. A mixed-precision step keeps fp32 master
weights and casts them to bf16 for its matmuls, so the traced program gathers fp32 and casts the gathered
tensor: twice the bytes the matmul needs. Where every use of a gathered tensor is a cast to one smaller
floating dtype, this pass casts the local shard instead and gathers that. The values are identical (a cast
is elementwise, a gather only moves elements); the gather moves half the bytes, and the gathered tensor the
program keeps for the backward is half the size.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode

from pt3func.analysis import is_collective

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_TO_COPY = torch.ops.aten._to_copy.default
_CONVERT = torch.ops.prims.convert_element_type.default


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype `node` casts its input to, if it is a plain dtype cast (same device, layout, format)."""
    if node.target is _CONVERT:
        return node.args[1]
    if node.target is _TO_COPY and len(node.args) == 1:
        extra = set(node.kwargs) - {"dtype", "layout", "device"}
        source = node.args[0].meta.get("val")
        same_place = node.kwargs.get("device") in (None, getattr(source, "device", None))
        if not extra and same_place and node.kwargs.get("layout") in (None, torch.strided):
            return node.kwargs.get("dtype")
    return None


def cast_before_gather(gm: fx.GraphModule) -> fx.GraphModule:
    """Gather `x.to(low)` instead of casting the gathered `x`, where only casts read it (in place); returns `gm`."""
    graph = gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    changed = False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for gather in list(graph.nodes):
        if gather.target is not _GATHER or not is_collective(gather):
            continue
        users = list(gather.users)
        if len(users) != 1 or users[0].target is not _WAIT:
            continue
        wait, source = users[0], gather.args[0]
        casts = list(wait.users)
        dtypes = {_cast_dtype(c) for c in casts}
        if not casts or len(dtypes) != 1:
            continue
        (low,) = dtypes
        high = source.meta["val"].dtype
        if low is None or not (low.is_floating_point and high.is_floating_point) or low.itemsize >= high.itemsize:
            continue
        # Right where the shard exists (after the last input, for an input), so the gather can be issued early.
        anchor = placeholders[-1] if source.op == "placeholder" else source
        with graph.inserting_after(anchor):
            cast = graph.call_function(_CONVERT, (source, low))
        with fake_mode:
            cast.meta["val"] = source.meta["val"].to(low)
        cast.meta["stack_trace"] = casts[0].meta.get("stack_trace")
        gather.replace_input_with(source, cast)
        gather.meta["val"] = _as(fake_mode, gather, low)
        wait.meta["val"] = _as(fake_mode, wait, low)
        for c in casts:
            c.replace_all_uses_with(wait)
            graph.erase_node(c)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _as(fake_mode, node: fx.Node, dtype: torch.dtype) -> torch.Tensor:
    with fake_mode:
        return node.meta["val"].to(dtype)

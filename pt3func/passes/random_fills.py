"""Graph -> Graph: each random fill of a fresh buffer becomes one op that makes and fills the buffer.

A traced CPU dropout is `noise = empty_like(x); noise.bernoulli_(1 - p); noise.div_(1 - p); x * noise` (eager
torch's own steps), and `torch.empty_like(h).uniform_(-1, 1)` is the same shape of graph. Handed to Inductor
with `fallback_random`, that in-place fill misbehaves twice:

- with two or more draws in a step (Inductor's `reorder_for_locality` off, `runtime/backend.py`), a fused kernel
  read the noise buffer before the `bernoulli_` call that fills it: NaN losses for any step with two dropouts and
  a backward pass (every `nn.TransformerEncoderLayer` with dropout);
- Inductor picks the fresh buffer's layout itself (contiguous), while eager's `empty_like` keeps the input's
  strides; a fill walks memory in order, so a dropout of a non-contiguous value drew a different mask.

`pt3func::random_fill` makes the buffer with the strides the trace recorded (eager's) and fills it inside one
opaque op: Inductor sees a kernel that returns a new tensor, which it cannot read before it runs. The draws are
eager torch's: the same fill of the same-strided buffer from the global generator.

`torch.bernoulli(p)` (`aten.bernoulli.default`) becomes the same op: eager torch runs it as a fresh (contiguous)
buffer filled by `bernoulli_(p)`, while Inductor decomposes it into `rand(...) < p` even with `fallback_random`,
which draws float32 numbers where eager draws doubles for a float64 `p` (other masks, and the generator left
elsewhere).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

# In-place fills whose parameters are numbers (plus `bernoulli_` with a tensor of probabilities).
_FILLS = {
    aten.bernoulli_.float: "bernoulli_",
    aten.bernoulli_.Tensor: "bernoulli_",
    aten.uniform_.default: "uniform_",
    aten.normal_.default: "normal_",
    aten.exponential_.default: "exponential_",
    aten.geometric_.default: "geometric_",
    aten.cauchy_.default: "cauchy_",
    aten.log_normal_.default: "log_normal_",
}
_FRESH = {aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
          aten.new_empty_strided.default}


@torch.library.custom_op("pt3func::random_fill", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def random_fill(
    size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device, fill: str, numbers: list[float],
    probabilities: torch.Tensor | None = None,
) -> torch.Tensor:
    """A new `size`/`stride` tensor filled in place by `Tensor.<fill>(*numbers)` (or `bernoulli_(probabilities)`)
    from the global generator."""
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    if probabilities is not None:
        return out.bernoulli_(probabilities)
    return getattr(out, fill)(*numbers)


@random_fill.register_fake
def _(size, stride, dtype, device, fill, numbers, probabilities=None):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def fill_fresh_buffers_in_one_op(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite `fill_(fresh_buffer, ...)` into `pt3func::random_fill(...)` where the buffer is made in the program
    and read by nothing else, the fill takes numbers (or a probability tensor) and the global generator; and
    `bernoulli(p)` (global generator) into the same op."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.bernoulli.default:
            changed |= _bernoulli_in_one_op(gm, node)
            continue
        fill = _FILLS.get(node.target) if node.op == "call_function" else None
        if fill is None or not node.args:
            continue
        buffer = node.args[0]
        if not (isinstance(buffer, fx.Node) and buffer.op == "call_function" and buffer.target in _FRESH
                and len(buffer.users) == 1 and set(node.kwargs) <= {"generator"}
                and node.kwargs.get("generator") is None):
            continue
        val = node.meta.get("val")
        params = list(node.args[1:])
        probabilities = params.pop(0) if node.target is aten.bernoulli_.Tensor else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(p, (int, float)) for p in params):
            continue
        numbers = [float(p) for p in params]  # trailing defaults the trace left out stay the fill's defaults
        with gm.graph.inserting_before(node):
            made = gm.graph.call_function(
                torch.ops.pt3func.random_fill.default,
                (list(val.shape), list(val.stride()), val.dtype, val.device, fill, numbers, probabilities),
            )
        made.meta.update(node.meta)
        node.replace_all_uses_with(made)
        gm.graph.erase_node(node)
        gm.graph.erase_node(buffer)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _bernoulli_in_one_op(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Rewrite `bernoulli(p)` into `random_fill(..., probabilities=p)` with the output's traced (eager) strides;
    whether it was rewritten."""
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and len(node.args) == 1 and isinstance(node.args[0], fx.Node)
            and set(node.kwargs) <= {"generator"} and node.kwargs.get("generator") is None):
        return False
    with gm.graph.inserting_before(node):
        made = gm.graph.call_function(
            torch.ops.pt3func.random_fill.default,
            (list(val.shape), list(val.stride()), val.dtype, val.device, "bernoulli_", [], node.args[0]),
        )
    made.meta.update(node.meta)
    node.replace_all_uses_with(made)
    gm.graph.erase_node(node)
    return True

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

A fill given a user's `torch.Generator` becomes the same op with that generator (Inductor's `bernoulli_` lowering
takes none, and failed). An op's arguments cannot hold a generator, so the op names it by a key into
`_GENERATORS`, which keeps each such generator alive as the program's graph kept it; the trace (`capture.py`)
writes the fills torch's fake tensors cannot take a generator for (`exponential_`, `geometric_`, `cauchy_`,
`log_normal_`) as this op too.
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
_GENERATORS: dict[int, torch.Generator] = {}


def generator_key(generator: torch.Generator | None) -> int:
    """The key `random_fill` reads `generator` by (-1: the global generator)."""
    if generator is None:
        return -1
    _GENERATORS[id(generator)] = generator  # held: a live key is never another generator's id
    return id(generator)


_FRESH = {aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
          aten.new_empty_strided.default}


@torch.library.custom_op("pt3func::random_fill", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def random_fill(
    size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device, fill: str, numbers: list[float],
    probabilities: torch.Tensor | None = None, generator: int = -1,
) -> torch.Tensor:
    """A new `size`/`stride` tensor filled in place by `Tensor.<fill>(*numbers)` (or `bernoulli_(probabilities)`)
    from the global generator, or the one `generator` is the key of (`generator_key`)."""
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    drawn_by = _GENERATORS[generator] if generator != -1 else None
    if probabilities is not None:
        return out.bernoulli_(probabilities, generator=drawn_by)
    return getattr(out, fill)(*numbers, generator=drawn_by)


@random_fill.register_fake
def _(size, stride, dtype, device, fill, numbers, probabilities=None, generator=-1):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def fill_fresh_buffers_in_one_op(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite `fill_(fresh_buffer, ...)` into `pt3func::random_fill(...)` where the buffer is made in the program
    and read by nothing else and the fill takes numbers (or a probability tensor); and `bernoulli(p)` into the
    same op."""
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
                and len(buffer.users) == 1 and set(node.kwargs) <= {"generator"}):
            continue
        key = _generator_key_of(gm, node)
        if key is None:
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
                (list(val.shape), list(val.stride()), val.dtype, val.device, fill, numbers, probabilities, key),
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
    key = _generator_key_of(gm, node)
    if not (isinstance(val, torch.Tensor) and len(node.args) == 1 and isinstance(node.args[0], fx.Node)
            and set(node.kwargs) <= {"generator"} and key is not None):
        return False
    with gm.graph.inserting_before(node):
        made = gm.graph.call_function(
            torch.ops.pt3func.random_fill.default,
            (list(val.shape), list(val.stride()), val.dtype, val.device, "bernoulli_", [], node.args[0], key),
        )
    made.meta.update(node.meta)
    node.replace_all_uses_with(made)
    gm.graph.erase_node(node)
    return True


def _generator_key_of(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """`generator_key` of the generator `node` draws from (a constant of the graph: `get_attr`); None where it is
    not one."""
    generator = node.kwargs.get("generator")
    if isinstance(generator, fx.Node):
        generator = getattr(gm, str(generator.target), None) if generator.op == "get_attr" else None
        if not isinstance(generator, torch.Generator):
            return None
    return generator_key(generator)

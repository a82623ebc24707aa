"""Read a traced program: its text, FLOPs, communication volume and memory footprint."""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import (
    FlopCounterMode,
    bmm_flop,
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from pt3func.trace.capture import storage_root
from pt3func.trace.source import node_location

_DTYPE_ABBR = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}

# Collectives whose payload is their output (what every rank ends up holding); the rest count the input.
_OUTPUT_SIZED = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced"}


def format_bytes(n: float, sep: str = " ") -> str:
    """Bytes in the largest binary unit that keeps a leading digit: 43.0 KiB, 1.5 MiB (not 0.0 MiB)."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f}{sep}{unit}"
    return f"{n:.0f}{sep}B"


def type_str(val: Any) -> str:
    """`f32[4, 8]` for a tensor value, a tuple of those for multi-output ops."""
    if isinstance(val, torch.Tensor):
        return f"{_DTYPE_ABBR.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{', '.join(map(str, val.shape))}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(type_str(v) for v in val) + ")"
    return type(val).__name__


def nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


def op_name(target: Any) -> str:
    """`aten.mm` for `torch.ops.aten.mm.default`, `aten.add.Tensor` for non-default overloads."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


def is_collective(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and getattr(node.target, "namespace", None) == "_c10d_functional"
        and (node.target._schema.name.split("::")[-1] != "wait_tensor")
    )


def collective_kind(node: fx.Node) -> str:
    return node.target._schema.name.split("::")[-1]


def collective_bytes(node: fx.Node) -> int:
    """Payload of one collective, as nccl-tests counts it: the output for all-gather, else the input."""
    if collective_kind(node) in _OUTPUT_SIZED:
        return nbytes(node.meta.get("val"))
    first = node.args[0]
    vals = [
        a.meta.get("val") for a in (first if isinstance(first, (list, tuple)) else [first]) if isinstance(a, fx.Node)
    ]
    return sum(nbytes(v) for v in vals)


def _arg_str(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg_str(a) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return _DTYPE_ABBR.get(arg, str(arg))
    return repr(arg)


def program_text(
    gm: fx.GraphModule,
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    donated: dict[int, str] | None = None,
    annotations: dict[fx.Node, str] | None = None,
) -> str:
    """Render the program one op a line: `%y: f32[4, 8] = aten.mm(%x, %w)   # file.py:12`.

    `donated` maps input index -> text shown beside donated inputs; `annotations` maps node -> a note
    (used for collectives: kind, mesh axis, bytes and why it is there).
    """
    donated = donated or {}
    annotations = annotations or {}
    lines = [f"def {name}("]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        label = input_names[i] if i < len(input_names) else node.name
        extra = f"  [{donated[i]}]" if i in donated else ""
        lines.append(f"    %{node.name}: {type_str(node.meta.get('val'))},  # {label}{extra}")
    lines.append("):")
    body: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            text = f"%{node.name}: {type_str(node.meta.get('val'))} = constant {node.target}"
        else:
            args = [_arg_str(a) for a in node.args] + [f"{k}={_arg_str(v)}" for k, v in node.kwargs.items()]
            text = f"%{node.name}: {type_str(node.meta.get('val'))} = {op_name(node.target)}({', '.join(args)})"
        note = annotations.get(node)
        where = node_location(node)
        comment = "  ".join(c for c in (note, where) if c)
        body.append((text, comment))
    width = min(max((len(t) for t, _ in body), default=0), 100)
    for text, comment in body:
        lines.append(f"    {text:<{width}}  # {comment}" if comment else f"    {text}")
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output_node.args[0])
    for j, out in enumerate(outs):
        label = output_names[j] if j < len(output_names) else f"out{j}"
        lines.append(f"    return[{j}] {label} = {_arg_str(out)}")
    return "\n".join(lines)


# FLOP formulas for ops torch's FlopCounterMode has none for (it counts them as 0). On CPU,
# F.scaled_dot_product_attention runs as `_scaled_dot_product_flash_attention_for_cpu`: without these the attention
# of a transformer step (a third or more of its FLOPs) is missing from `cost_analysis()` and MFU. Same convention as
# torch's: 2 FLOPs per multiply-add, attention without a causal discount. Each takes shapes, as torch's do.


def _heads_of_query(query: Any, kv: Any) -> tuple[int, ...]:
    """Key / value shape with the query's heads: grouped-query attention counted as each query head does its own
    products (as torch 2.13's formulas do; older ones refuse fewer key heads)."""
    return (kv[0], query[1], *kv[2:])


def _sdpa_cpu_flop(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, _heads_of_query(query, key), _heads_of_query(query, value))


def _sdpa_cpu_backward_flop(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, _heads_of_query(query, key), _heads_of_query(query, value))


def _mv_flop(matrix: Any, vector: Any, *args: Any, **kwargs: Any) -> int:
    m, n = matrix
    return 2 * m * n


def _addmv_flop(bias: Any, matrix: Any, vector: Any, *args: Any, **kwargs: Any) -> int:
    return _mv_flop(matrix, vector)


def _dot_flop(a: Any, b: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * a[0]


def _addbmm_flop(bias: Any, batch1: Any, batch2: Any, *args: Any, **kwargs: Any) -> int:
    return bmm_flop(batch1, batch2)


def _addr_flop(bias: Any, u: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * u[0] * v[0]  # the outer product and the add


def _trilinear_flop(
    i1: Any, i2: Any, i3: Any, expand1: Sequence[int], expand2: Sequence[int], expand3: Sequence[int],
    sumdim: Sequence[int], *args: Any, **kwargs: Any,
) -> int:
    """`F.bilinear`'s op: 2 FLOPs per term of the sum over the broadcast index space (x1 [N, I], W [O, I, J],
    x2 [N, J] -> 2 * N * O * I * J, a bilinear layer's multiply-adds as a linear layer's are counted)."""
    sizes = []
    for shape, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        full = list(shape)
        for d in sorted(expand):
            full.insert(d, 1)
        sizes.append(full)
    return 2 * math.prod(max(dims) for dims in zip(*sizes))


def _conv_backward_flop(
    grad_out: Any, x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: bool,
    output_padding: Any, groups: int, output_mask: Sequence[bool], *args: Any, **kwargs: Any,
) -> int:
    """`convolution_backward`: the input gradient as a convolution of the output gradient with the weight, the
    weight gradient as one of the input with the output gradient, each as many FLOPs as the forward.

    Groups: `w` holds in_channels / groups (out_channels / groups when transposed) per output, which the input
    gradient's count reads from `w` as the forward's does; the weight gradient's (torch's formula, as of 2.13) counts
    every channel of the input against every one of the output gradient, `groups` times the true count (64 times
    over for a 64-channel depthwise conv, ConvNeXt's): divided by `groups` here."""

    def t(shape: Any) -> list[int]:  # batch and channel dims swapped: the weight gradient's convolution
        return [shape[1], shape[0], *shape[2:]]

    flop = 0
    if output_mask[0]:
        flop += conv_flop_count(list(grad_out), list(w), list(x), transposed=not transposed)
    if output_mask[1]:
        if transposed:
            flop += conv_flop_count(t(grad_out), t(x), t(w), transposed=False) // groups
        else:
            flop += conv_flop_count(t(x), t(grad_out), t(w), transposed=False) // groups
    return flop


def _shapes(formula: Callable[..., int]) -> Callable[..., int]:
    """`formula` over shapes, callable with the op's values and `out_val` (torch's registry convention). Marked raw,
    so FlopCounterMode does not wrap it again (where it did, the shapes would pass through unchanged)."""

    def on_values(*args: Any, **kwargs: Any) -> int:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("out_val", "out_shape")}
        args, kwargs = torch.utils._pytree.tree_map(
            lambda v: v.shape if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
        return formula(*args, **kwargs)

    on_values._get_raw = True  # type: ignore[attr-defined]
    return on_values


def _extra_flop_formulas() -> dict[Any, Callable[..., int]]:
    """Op packet -> formula, for the ops above that exist in this torch and have no formula of torch's own (a later
    torch that registers one keeps its own)."""
    formulas = {
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu_flop,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward_flop,
        "mv": _mv_flop,
        "addmv": _addmv_flop,
        "dot": _dot_flop,
        "vdot": _dot_flop,
        "addbmm": _addbmm_flop,
        "addr": _addr_flop,
        "_trilinear": _trilinear_flop,
    }
    out = {}
    for name, formula in formulas.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and packet not in flop_registry:
            out[packet] = _shapes(formula)
    return out


_EXTRA_FLOPS = _extra_flop_formulas()

# Formulas of pt3func's that replace torch's own (whose count is wrong for some arguments): used by `flops` and by
# every `flop_formula` caller (the memory-budget planner) alike.
_OVERRIDES: dict[Any, Callable[..., int]] = {torch.ops.aten.convolution_backward: _shapes(_conv_backward_flop)}
_FORMULAS = {**_EXTRA_FLOPS, **_OVERRIDES}


def flop_formula(target: Any) -> Callable[..., int] | None:
    """The FLOP formula of an op (pt3func's where torch has none or a wrong one, else torch's): called with the op's
    argument values and `out_val=`; None for ops counted as 0."""
    packet = getattr(target, "overloadpacket", target)
    return _OVERRIDES.get(packet) or flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)


def flops(gm: fx.GraphModule) -> int:
    """FLOPs of one run of `gm`, counted by torch's FlopCounterMode over fake inputs (no real compute), with
    pt3func's formulas for the ops torch has none for (CPU attention, matrix-vector products, bilinear) or a wrong
    one for (grouped convolutions' backward)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    # The trace's fake mode, from any value: a program without tensor inputs (a static size, closure weights) has
    # none among its placeholders, yet computes.
    fake_mode = detect_fake_mode(vals) or detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    if fake_mode is None:  # no tensor anywhere: nothing computed
        return 0
    with fake_mode, FlopCounterMode(display=False, custom_mapping=_FORMULAS) as counter:
        gm(*[v.clone() if isinstance(v, torch.Tensor) else v for v in vals])
    return int(counter.get_total_flops())


def comm_bytes(gm: fx.GraphModule) -> dict[str, int]:
    """Bytes of collective payload per collective kind (see `collective_bytes`)."""
    out: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        if is_collective(node):
            out[collective_kind(node)] += collective_bytes(node)
    return dict(out)


def held_bytes(vals: Sequence[Any]) -> int:
    """Bytes of memory the tensors in `vals` occupy: each storage once, over the span its tensors reach.

    Not numel * itemsize: a broadcast argument (`row.expand(1024, 1024)`, stride 0) holds one row, and a tensor
    passed twice (or with a view of it) is one buffer. The span of a tensor runs from its first element to its last
    one, `(sum((size - 1) * stride) + 1) * itemsize` (0 when empty).
    """
    spans: dict[Any, tuple[int, int]] = {}
    total = 0
    for v in vals:
        if not isinstance(v, torch.Tensor):
            continue
        if v.numel() == 0:
            continue
        start = v.storage_offset() * v.element_size()
        end = start + (sum((size - 1) * stride for size, stride in zip(v.shape, v.stride())) + 1) * v.element_size()
        try:
            ref = StorageWeakRef(v.untyped_storage())
        except (NotImplementedError, RuntimeError):  # a tensor without a storage of its own: its extent alone
            total += end - start
            continue
        lo, hi = spans.get(ref, (start, end))
        spans[ref] = (min(lo, start), max(hi, end))
    return total + sum(hi - lo for lo, hi in spans.values())


def _owner(node: fx.Node) -> fx.Node:
    if node.op == "call_function" and node.target is operator.getitem:
        return _owner(node.args[0])
    root = storage_root(node)
    return root if root is node else _owner(root)


def _output_storage(node: fx.Node) -> fx.Node:
    """The node whose value is the storage `node` lives in, as `_owner`, except that one output of a multi-output
    op (`getitem`) is a storage of its own: a loss returned without `nll_loss_forward`'s total weight is 4 bytes."""
    root = storage_root(node)
    if root.op == "call_function" and root.target is operator.getitem and isinstance(root.args[0], fx.Node):
        source = root.args[0]
        base = storage_root(source)
        return root if base is source else _output_storage(base)  # an output of a view op (split) is its input's
    return root


def constant_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the program's constants: the tensors a step captured (a closure's model weights, a global), which
    the program reads from its `get_attr` nodes at every call. They are held for the whole call, as the arguments
    are (and beyond it: the step's closure keeps them), each storage once."""
    return held_bytes([n.meta.get("val") for n in gm.graph.nodes if n.op == "get_attr"])


def memory_analysis(gm: fx.GraphModule, aliased_inputs: Sequence[int] = ()) -> dict[str, int]:
    """Bytes of arguments, constants, outputs, donated (aliased) buffers, temporaries and the peak, by liveness.

    This is the program as traced, before a compiler fuses ops away, so it is an upper bound on what a
    fused (Inductor) program needs; `peak_bytes` counts arguments and constants (captured tensors, resident for the
    whole call) plus everything live at the worst op.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = nodes[-1]
    outs = [o for o in output_node.args[0] if isinstance(o, fx.Node)]
    argument_bytes = held_bytes([p.meta.get("val") for p in placeholders])
    resident_bytes = constant_bytes(gm)
    aliased_bytes = sum(nbytes(placeholders[i].meta.get("val")) for i in aliased_inputs)
    # One buffer returned twice, or with views of it ((y, y[:128], y.t())), is one storage: counted once, as the
    # compiled program's figure does; an output that is an argument or a constant (or a view of one) holds no new
    # memory.
    out_owners = {_output_storage(o) for o in outs}
    output_bytes = (
        sum(nbytes(o.meta.get("val")) for o in out_owners if o.op not in ("placeholder", "get_attr")) + aliased_bytes
    )
    last_use: dict[fx.Node, int] = {}
    for idx, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[_owner(used)] = idx
    kept = {_owner(o) for o in outs}
    live = 0
    peak = 0
    frees: dict[int, list[fx.Node]] = defaultdict(list)
    for owner, idx in last_use.items():
        if owner.op == "call_function" and owner not in kept:
            frees[idx].append(owner)
    for idx, node in enumerate(nodes):
        # (constants are resident from the start: `resident_bytes`, not allocated here)
        if node.op == "call_function" and _owner(node) is node and node.target is not torch.ops.aten.copy_.default:
            live += nbytes(node.meta.get("val"))
        peak = max(peak, live)
        for dead in frees.get(idx, ()):
            live -= nbytes(dead.meta.get("val"))
    peak_bytes = argument_bytes + resident_bytes + peak
    temp_bytes = max(peak - (output_bytes - aliased_bytes), 0)
    return {
        "peak_bytes": peak_bytes,
        "argument_bytes": argument_bytes,
        "constant_bytes": resident_bytes,
        "output_bytes": output_bytes,
        "aliased_bytes": aliased_bytes,
        "temp_bytes": temp_bytes,
    }


def compiled_memory_analysis(
    gm: fx.GraphModule, aliased_inputs: Sequence[int], wrapper_source: str
) -> dict[str, int] | None:
    """`memory_analysis` of the program Inductor generated for `gm` (its Python wrapper `wrapper_source`).

    Arguments are held by the caller for the whole call, and the constants (captured tensors, which Inductor takes
    as inputs it never allocates) by the step; on top of them the peak is what the compiled program allocates at
    its worst point, replayed from its own allocations and frees (see `runtime.inductor_memory`). None when the
    wrapper cannot be read.
    """
    from pt3func.runtime.inductor_memory import wrapper_memory

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    replay = wrapper_memory(wrapper_source, device_type, [v.dtype for v in tensors])
    if replay is None:
        return None
    argument_bytes = held_bytes(vals)
    resident_bytes = constant_bytes(gm)
    aliased_bytes = sum(nbytes(vals[i]) for i in aliased_inputs)
    peak_bytes = argument_bytes + resident_bytes + replay.peak_bytes
    return {
        "peak_bytes": peak_bytes,
        "argument_bytes": argument_bytes,
        "constant_bytes": resident_bytes,
        "output_bytes": replay.output_bytes + aliased_bytes,
        "aliased_bytes": aliased_bytes,
        "temp_bytes": max(replay.peak_bytes - replay.output_bytes, 0),
    }


# Ops that read only their input's shape and dtype: a backward use by them keeps no value alive.
_METADATA_ONLY = {
    torch.ops.aten.ones_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default,
}


def _in_backward(node: fx.Node) -> bool:
    why = (node.meta.get("custom") or {}).get("pt3func", "")
    # "remat of" / "reload of": copies the remat pass puts into the backward (passes/remat.py).
    return why.startswith(("backward of", "grad of", "remat of", "reload of"))


def saved_activations(gm: fx.GraphModule, input_names: Sequence[str]) -> list[dict[str, Any]]:
    """Values the forward computes (or receives) that the backward reads, like JAX's `print_saved_residuals`.

    A node counts as backward when it was recorded inside `pf.grad` / `pf.value_and_grad`'s
    `torch.autograd.grad` call; every forward value with a backward user is kept alive until then.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders, input_names))
    rows: dict[fx.Node, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function") or _in_backward(node):
            continue
        if not any(_in_backward(user) and user.target not in _METADATA_ONLY for user in node.users):
            continue
        # Autograd saves views (detach) of forward values: report the value that owns the memory, once.
        owner = _owner(node)
        if owner in rows:
            continue
        val = owner.meta.get("val")
        rows[owner] = {
            "name": owner.name,
            "type": type_str(val),
            "bytes": nbytes(val),
            "what": f"argument {names[owner]}" if owner.op == "placeholder" else op_name(owner.target),
            "where": node_location(owner),
        }
    return list(rows.values())

"""Chunk the loss head: never hold a whole batch's logits, or their gradient (Graph -> Graph).

A language model ends in `cross_entropy(h @ W.T, targets)`. Traced, its forward and backward are

    M = mm(h, Wt)                       (N, V) logits, then casts/views to X
    LS = _log_softmax(X, 1)             loss = nll_loss_forward(LS, T)[0]
    G = ones_like(loss) ...             the seed gradient (a constant)
    D = _log_softmax_backward_data(nll_loss_backward(G, LS, T), LS)   (N, V), then casts/views
    mm(D, Y)      -> grad of h          mm(t(D), Z)  -> grad of Wt (Z is h)

With N = batch x sequence tokens and V the vocabulary (16384 x 32768 in the anchor GPT), the logits and their
gradient are the largest values of the whole step (1 GiB each in bf16, 2 GiB in fp32), and they are alive at the
step's memory peak, where the backward starts. Because pf.jit holds forward and backward in one program and the
seed gradient of the loss is a constant, the backward of the loss head can run right after its forward, a block of
rows at a time: for each chunk of rows, logits, log-softmax, loss sum, gradient and both gradient matmuls, then the
next chunk. Only one chunk's logits exist at once (Liger-Kernel's fused linear cross-entropy does the same by hand;
here it is a rewrite of any program whose loss head has this shape).

Numbers: each row's log-softmax and gradient are computed exactly as before; the loss is a sum of per-chunk sums,
and the weight gradient a sum of per-chunk matmuls accumulated in fp32 (on CUDA with `addmm` writing fp32 from bf16
operands) and rounded once to its dtype: equal to the unchunked program up to summation order.

Matched only where nothing else reads the intermediate values: no class weights, reduction "mean" or "sum", the
logits produced by one `mm`, and every reader of the gradient an `mm` (row-chunked) or the `mm` of its transpose
(accumulated). Anything else is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from pt3func.config import config
from pt3func.passes.fence import never_after, read_after

log = logging.getLogger("pt3func.jit")
aten = torch.ops.aten
_MEAN, _SUM = 1, 2
# Ops a value passes through between the logits' matmul and the log-softmax (and from the log-softmax's gradient
# to its matmuls) without changing which row is which.
_ROWWISE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
            torch.ops.prims.convert_element_type.default, aten.detach.default, aten.alias.default}
_METADATA_ONLY = {aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default}
_VIEW_OPS = {aten.t.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
             aten.permute.default, aten.transpose.int, aten.detach.default, aten.alias.default,
             aten.expand.default, aten.slice.Tensor}


@dataclass
class _LossHead:
    matmul: fx.Node  # M = mm(h, Wt)
    log_softmax: fx.Node
    loss_forward: fx.Node  # nll_loss_forward
    loss_backward: fx.Node  # nll_loss_backward
    softmax_backward: fx.Node  # _log_softmax_backward_data
    gradient: fx.Node  # D: (N, V), what the gradient matmuls read
    row_users: list[fx.Node] = field(default_factory=list)  # mm(D, Y)
    transposed_users: list[fx.Node] = field(default_factory=list)  # mm(t(D), Z)
    dead: list[fx.Node] = field(default_factory=list)  # everything the rewrite replaces
    loss_views: list[fx.Node] = field(default_factory=list)  # detach/alias of the loss, moved after the new one


def chunk_cross_entropy(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every matching loss head into row chunks of at most `pf.config.loss_chunk_bytes` fp32 logits."""
    chunk_bytes = config.loss_chunk_bytes
    if not chunk_bytes:
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._log_softmax.default:
            head = _match(node)
            if head is None:
                continue
            n, v = head.gradient.meta["val"].shape
            chunks = min(n, math.ceil(n * v * 4 / chunk_bytes))
            if chunks > 1 and _rewrite(gm.graph, head, chunks):
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _rowwise(node: fx.Node, n: int, v: int) -> bool:
    val = node.meta.get("val")
    if node.target not in _ROWWISE or not isinstance(val, torch.Tensor) or val.numel() != n * v:
        return False
    if node.target is aten._to_copy.default:  # a dtype cast only: same device, strided
        source = node.args[0].meta.get("val")
        if set(node.kwargs) - {"dtype", "layout", "device"} or node.kwargs.get("layout") not in (None, torch.strided):
            return False
        if node.kwargs.get("device") not in (None, getattr(source, "device", None)):
            return False
    return val.dim() >= 1 and val.shape[-1] == v


def _match(ls: fx.Node) -> _LossHead | None:
    x = ls.args[0]
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or ls.args[1] not in (1, -1) or ls.args[2]:
        return None
    n, v = val.shape
    dead = [ls]
    # Up: X <- casts/views <- M = mm(h, Wt), each read by the next only.
    up = x
    while up.target is not aten.mm.default:
        if not _rowwise(up, n, v) or len(up.users) != 1:
            return None
        dead.append(up)
        up = up.args[0]
    if len(up.users) != 1 or tuple(up.meta["val"].shape) != (n, v):
        return None
    matmul = up
    dead.append(matmul)
    # Readers of the log-softmax (through detach/alias views): the loss, its backward, the softmax backward.
    readers: list[fx.Node] = []
    todo = [ls]
    while todo:
        for user in todo.pop().users:
            if user.target in (aten.detach.default, aten.alias.default):
                dead.append(user)
                todo.append(user)
            else:
                readers.append(user)
    by_target = {r.target: r for r in readers}
    if len(readers) != 3 or set(by_target) != {aten.nll_loss_forward.default, aten.nll_loss_backward.default,
                                               aten._log_softmax_backward_data.default}:
        return None
    fwd, bwd = by_target[aten.nll_loss_forward.default], by_target[aten.nll_loss_backward.default]
    sbw = by_target[aten._log_softmax_backward_data.default]
    target, weight, reduction, ignore = fwd.args[1], fwd.args[2], fwd.args[3], fwd.args[4]
    if weight is not None or reduction not in (_MEAN, _SUM) or fwd.args[0] is not ls:
        return None
    if bwd.args[2] is not target or bwd.args[3] is not None or tuple(bwd.args[4:6]) != (reduction, ignore):
        return None
    if list(bwd.users) != [sbw] or sbw.args[0] is not bwd or sbw.args[2] not in (1, -1):
        return None
    if not isinstance(bwd.args[0], fx.Node) or bwd.args[0].meta["val"].dim() != 0:
        return None
    # The loss is read only by the program's output and by ops that read its shape (the seed gradient); the
    # total weight only by the backward.
    loss_views: list[fx.Node] = []
    for item in fwd.users:
        if item.target is not operator.getitem:
            return None
        if item.args[1] == 0:
            views = _loss_views(item)
            if views is None:
                return None
            loss_views += views
        elif list(item.users) != [bwd]:
            return None
        dead.append(item)
    dead += [fwd, bwd, sbw]
    # Down: the gradient through casts/views to D, read only by matmuls.
    d = sbw
    while True:
        nxt = _single_user(d)
        if nxt is None or not _rowwise(nxt, n, v):
            break
        dead.append(nxt)
        d = nxt
    if tuple(d.meta["val"].shape) != (n, v):
        return None
    head = _LossHead(matmul, ls, fwd, bwd, sbw, d, dead=dead, loss_views=loss_views)
    for user in d.users:
        if user.target is aten.mm.default and user.args[0] is d and user.args[1] is not d:
            head.row_users.append(user)
        elif user.target is aten.t.default and all(
            u.target is aten.mm.default and u.args[0] is user and u.args[1] is not user for u in user.users
        ):
            head.transposed_users += list(user.users)
            dead.append(user)
        else:
            return None
    if not head.row_users and not head.transposed_users:
        return None
    dead += head.row_users + head.transposed_users
    return head


def _loss_views(node: fx.Node) -> list[fx.Node] | None:
    """The detach/alias nodes between the loss and the program's output, in order; None if anything else
    (other than ops reading only its shape) reads the loss."""
    views: list[fx.Node] = []
    for user in node.users:
        if user.op == "output" or user.target in _METADATA_ONLY:
            continue
        if user.target not in (aten.detach.default, aten.alias.default):
            return None
        more = _loss_views(user)
        if more is None:
            return None
        views += [user, *more]
    return views


class _Builder:
    """Adds nodes before `at`, computing each one's fake value and copying tags from a node it stands for."""

    def __init__(self, graph: fx.Graph, at: fx.Node):
        self.graph, self.at = graph, at
        vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.mode = detect_fake_mode(vals)

    def __call__(self, target: Callable, args: tuple, like: fx.Node, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(target, args, kwargs)
        fake = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.mode if self.mode is not None else contextlib.nullcontext():
            node.meta["val"] = target(*fake[0], **fake[1])
        for key in ("custom", "stack_trace", "nn_module_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        return node

    def can_reach(self, node: fx.Node, order: dict[fx.Node, int]) -> bool:
        """Whether `available` can give `node` here: defined before `at`, or a view chain of such a value."""
        while order[node] >= order[self.at]:
            if node.target not in _VIEW_OPS or not isinstance(node.args[0], fx.Node):
                return False
            node = node.args[0]
        return True

    def available(self, node: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
        """`node` as a value defined before `at` (see `can_reach`): a view chain defined later is re-created here."""
        if order[node] < order[self.at]:
            return node
        base = self.available(node.args[0], order)
        return self(node.target, (base, *node.args[1:]), node, **node.kwargs)


def _rewrite(graph: fx.Graph, head: _LossHead, chunks: int) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    at = head.loss_backward  # the seed gradient, targets, h and Wt all exist here
    b = _Builder(graph, at)
    h, wt = head.matmul.args
    target, ignore, reduction = head.loss_forward.args[1], head.loss_forward.args[4], head.loss_forward.args[3]
    seed = head.loss_backward.args[0]
    operands = [u.args[1] for u in head.row_users + head.transposed_users]
    if not all(b.can_reach(x, order) for x in operands):
        return False  # checked before any node is added: an unmatched head leaves the graph as it was
    row_operands = [b.available(u.args[1], order) for u in head.row_users]
    col_operands = [b.available(u.args[1], order) for u in head.transposed_users]
    # The seed gradient was read off the loss (ones_like(loss)): read it off an empty tensor of the loss's
    # shape instead, so that it does not wait for the loss this rewrite computes only afterwards.
    loss_item = next(u for u in head.loss_forward.users if u.args[1] == 0)
    for user in list(loss_item.users):
        if user.target in _METADATA_ONLY:
            val = loss_item.meta["val"]
            shape = _Builder(graph, user)(aten.empty.memory_format, (list(val.shape),), user, dtype=val.dtype,
                                          device=val.device)
            user.replace_input_with(loss_item, shape)
    ls_val = head.log_softmax.meta["val"]
    fwd_like, bwd_like = head.log_softmax, head.softmax_backward
    total = b(aten.sum.default, (b(aten.ne.Scalar, (target, ignore), fwd_like),), fwd_like, dtype=ls_val.dtype)
    n = head.gradient.meta["val"].shape[0]
    bounds = [n * c // chunks for c in range(chunks + 1)]
    loss: fx.Node | None = None  # the running sum of the chunks' losses
    rows: list[list[fx.Node]] = [[] for _ in head.row_users]
    acc: list[fx.Node | None] = [None for _ in head.transposed_users]
    last: list[fx.Node] = []  # the previous chunk's last values
    for lo, hi in zip(bounds, bounds[1:]):
        h_c = b(aten.slice.Tensor, (h, 0, lo, hi), fwd_like)
        for token in last:
            # Chunks are independent, so a compiler may run all the logits matmuls first (Inductor does), which
            # keeps every chunk's logits alive. Reading h through the previous chunk's results orders them.
            with graph.inserting_before(at):
                h_c = read_after(graph, never_after(graph, token, at), h_c, at)
        logits = b(aten.mm.default, (h_c, wt), head.matmul)
        if logits.meta["val"].dtype != ls_val.dtype:
            logits = b(aten._to_copy.default, (logits,), fwd_like, dtype=ls_val.dtype)
        t_c = b(aten.slice.Tensor, (target, 0, lo, hi), fwd_like)
        ls = b(aten._log_softmax.default, (logits, 1, False), fwd_like)
        loss_c = b(aten.nll_loss_forward.default, (ls, t_c, None, _SUM, ignore), head.loss_forward)
        loss_sum = b(operator.getitem, (loss_c, 0), head.loss_forward)
        loss = loss_sum if loss is None else b(aten.add.Tensor, (loss, loss_sum), head.loss_forward)
        g = b(aten.nll_loss_backward.default, (seed, ls, t_c, None, reduction, ignore, total), head.loss_backward)
        g = b(aten._log_softmax_backward_data.default, (g, ls, 1, head.softmax_backward.args[3]), bwd_like)
        d_dtype = head.gradient.meta["val"].dtype
        if g.meta["val"].dtype != d_dtype:
            g = b(aten._to_copy.default, (g,), bwd_like, dtype=d_dtype)
        for k, (user, y) in enumerate(zip(head.row_users, row_operands)):
            rows[k].append(b(aten.mm.default, (g, y), user))
        g_t = b(aten.t.default, (g,), bwd_like)
        for k, (user, z) in enumerate(zip(head.transposed_users, col_operands)):
            z_c = b(aten.slice.Tensor, (z, 0, lo, hi), user)
            acc[k] = _accumulate(b, acc[k], g_t, z_c, user)
        # The running loss is a token too: a loss summed only after the last chunk reads every chunk's logits
        # (Inductor fused all the chunks' sums into one kernel at the end, which kept all the logits alive).
        last = [acc[-1] if acc else rows[-1][-1], loss]
    assert loss is not None
    if reduction == _MEAN:
        loss = b(aten.div.Tensor, (loss, total), head.loss_forward)
    replacements = {loss_item: loss}
    for user, parts in zip(head.row_users, rows):
        replacements[user] = b(aten.cat.default, (parts, 0), user)
    for user, total_grad in zip(head.transposed_users, acc):
        out_dtype = user.meta["val"].dtype
        replacements[user] = (total_grad if total_grad.meta["val"].dtype == out_dtype
                              else b(aten._to_copy.default, (total_grad,), user, dtype=out_dtype))
    for old, new in replacements.items():
        old.replace_all_uses_with(new)
    for view in head.loss_views:  # they now read the new loss: move them after it
        at.prepend(view)
    for node in reversed(list(graph.nodes)):
        if node in head.dead and not node.users:
            graph.erase_node(node)
    return True


def _accumulate(b: _Builder, acc: fx.Node | None, g_t: fx.Node, z: fx.Node, like: fx.Node) -> fx.Node:
    """acc + g_t @ z, in fp32."""
    return b(torch.ops.pt3func.matmul_accumulate.default, (acc, g_t, z), like)


@torch.library.custom_op("pt3func::matmul_accumulate", mutates_args=())
def matmul_accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc + a @ b` in fp32 (acc None: `a @ b`), for operands of any float dtype.

    On CUDA, bf16/fp16 operands are multiplied by cuBLAS writing fp32 (the `out_dtype` overloads of mm/addmm);
    elsewhere the operands are upcast, which is exact. A custom op because torch 2.11's fake-tensor rule for
    `addmm.dtype` is broken (it runs the plain addmm decomposition), and so that Inductor calls it as it is.
    """
    if _cublas_writes_fp32(a):
        if acc is None:
            return torch.ops.aten.mm.dtype(a, b, torch.float32)
        return torch.ops.aten.addmm.dtype(acc, a, b, torch.float32)
    product = a.float() @ b.float()
    return product if acc is None else acc + product


@matmul_accumulate.register_fake
def _(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


@torch.library.custom_op("pt3func::matmul_accumulate_", mutates_args=("acc",))
def matmul_accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b` in fp32, in place (`acc` fp32): the in-place form `accumulate_in_place` gives Inductor."""
    if _cublas_writes_fp32(a):
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    else:
        acc.add_(a.float() @ b.float())


@matmul_accumulate_.register_fake
def _(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


def accumulate_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` in which each chunk's weight gradient is added into the running sum in place.

    `matmul_accumulate(acc, a, b)` is functional, so every chunk's addmm first copies the whole accumulator
    (128 MiB in fp32 for the anchor GPT's tied head, 7 copies a step: 0.45 ms on an H200). Where the running sum
    has no other reader, the in-place op takes its place; Inductor's functionalisation turns it into
    `auto_functionalized` and its reinplacing pass writes into the accumulator's own buffer. Run last, right
    before Inductor: the passes before it reorder nodes by data flow, which a mutation would not survive. The
    program `gm` (what `as_text`, the analyses and the eager backend see) stays functional.
    """
    target = torch.ops.pt3func.matmul_accumulate.default
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # A running sum made by the previous chunk, read elsewhere only before this chunk adds to it (the chunks'
    # ordering tokens read it): after the rewrite, a reader placed later would see the new sum.
    candidates = [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is target and isinstance(n.args[0], fx.Node)
        and n.args[0].op == "call_function" and n.args[0].target is target
        and all(order[u] < order[n] for u in n.args[0].users if u is not n)
    ]
    if not candidates:
        return gm
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, remap)
    graph.output(output)
    for old in candidates:
        node = remap[old]
        acc, a, b = node.args
        with graph.inserting_before(node):
            graph.call_function(torch.ops.pt3func.matmul_accumulate_.default, (acc, a, b)).meta.update(
                {k: v for k, v in node.meta.items() if k != "val"}
            )
        node.replace_all_uses_with(acc)
        graph.erase_node(node)
    graph.lint()
    return fx.GraphModule(gm, graph)


def _cublas_writes_fp32(a: torch.Tensor) -> bool:
    """Whether a matmul of `a` (and a like operand) can write fp32 directly (else: upcast operands, exact)."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _fp32_output_matmul(a.dtype)


@functools.cache
def _fp32_output_matmul(dtype: torch.dtype) -> bool:
    """Whether this torch's CUDA matmuls can write fp32 from `dtype` operands (the `out_dtype` overloads)."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device="cuda")
        out = torch.ops.aten.addmm.dtype(torch.ops.aten.mm.dtype(a, a, torch.float32), a, a, torch.float32)
        torch.ops.aten.addmm.dtype_out(out, a, a, torch.float32, out=out)
        return out.dtype == torch.float32 and bool((out == 6).all())
    except (RuntimeError, NotImplementedError):
        log.warning("CUDA matmuls cannot write fp32 from %s operands in this torch: the chunked loss head "
                    "multiplies upcast operands instead (slower)", dtype)
        return False

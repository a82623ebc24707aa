"""The copies behind `offload_to_host`, overlapped with compute, and where the remat pass puts them.

An offloaded value `v` (forward) becomes four opaque ops chained by tokens (one-element int64 CPU tensors):

    t1 = offload_to_host(v)                 # right after v: the copy to pinned host memory starts
    t2 = offload_release(v, t1)             # forward, one region later: the compute stream waits for that copy;
                                            #   v's last reader, so v's memory is freed here
    t3 = reload_prefetch(t2, dev)           # backward, one region early: the copy back starts
    v2 = reload_wait(t3, size, stride, ...) # at v's first backward use: the compute stream waits for it

On CUDA both copies run on a side stream (one per device, created on first use), each after the side stream
waits for the compute stream, so they run while the kernels issued after them do; the compute stream waits
for a copy only where its end is needed. With `PT3FUNC_OFFLOAD_OVERLAP=0` both copies run on the compute
stream where they start (the copy back at the wait): no overlap, to measure what overlap gains. On other
devices every op is a plain copy.

Why a release op rather than `v.record_stream(side)`: the caching allocator honours `record_stream`, but
Inductor reuses a dead buffer's storage itself (`buf7 = buf3; del buf3  # reuse` in its wrapper) without the
allocator, so a kernel could overwrite `v` while the side stream still reads it. The release op is `v`'s last
reader (Inductor frees `v` after it) and orders what follows behind the copy, as Inductor keeps an out-of-place
collective's input alive until its `wait_tensor`.

Why tokens: a custom op may not return an alias of its input, and what the graph passes between the ops is
what Inductor's peak-memory reordering counts (a host copy passed along counted as device memory, and the
offload was moved to the end of the forward). The host copy, the events and the device buffer wait in
registries under the token's id. `reload_prefetch` allocates the device buffer on the compute stream (so the
caching allocator hands it out in that stream's order) before the side stream waits for it and copies.

Placement (`place_offload_ops`), by outer `pf.checkpoint` region (a transformer block when each block is
checkpointed): the release goes right after the forward's last node of the region after `v`'s (`v`'s own for
the last region), so the copy has the rest of its block and the next one to finish; the prefetch goes right
before the backward of the region whose backward runs just before that of `v`'s region (the start of the
backward if none), so the copy has that block's backward to finish. With B the offloaded bytes of one region,
about 2 B are on the device for this at any time. Where no matrix product would run between release and
prefetch (the last region, when the backward starts right after it) the value stays on the device: the round
trip would free nothing. Inductor orders opaque ops only by data dependencies (its peak-memory reordering
otherwise ran a release right after its offload, and prefetches in the forward), so release, prefetch and wait
also read (`after=`, not used) the last matrix product before their place: a buffer anyway, no extra kernel.

CUDA graphs: refused before compiling (`runtime/cudagraphs.check_capturable`), and the ops raise under
capture: host copies are allocated on every call, so a replay would copy into memory freed since.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading

import torch
from torch import fx

from pt3func.passes.remat import DOTS, _outer, custom, is_backward, region_of

_TOKEN = torch.int64
_ids = itertools.count()
_lock = threading.Lock()
_side_streams: dict[int, torch.cuda.Stream] = {}
_hosts: dict[int, torch.Tensor] = {}  # token -> host copy, from offload_to_host to reload_prefetch
_d2h_events: dict[int, torch.cuda.Event] = {}  # token -> end of the host copy, until offload_release
# token -> (device copy, its event, host copy when overlap is off), from reload_prefetch to reload_wait
_h2d: dict[int, tuple[torch.Tensor | None, torch.cuda.Event | None, torch.Tensor | None]] = {}

OVERLAP_ENV = "PT3FUNC_OFFLOAD_OVERLAP"
"""Set to "0" to run the offload copies on the compute stream (no overlap): for measuring what overlap gains."""


def overlap_enabled() -> bool:
    return os.environ.get(OVERLAP_ENV, "1") != "0"


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream offload copies run on for `device` (one per device, created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


def _token(ticket: int) -> torch.Tensor:
    return torch.tensor([ticket], dtype=_TOKEN)


def _refuse_capture(op: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"pt3func::{op} cannot run inside a CUDA graph capture (offload_to_host allocates host buffers on "
            "every call); drop cuda_graphs=True or use another checkpoint policy"
        )


def _like(x: torch.Tensor, device: torch.device | str, pin_memory: bool = False) -> torch.Tensor:
    """An empty tensor with `x`'s shape and (when dense) strides: the copy is then one contiguous memcpy."""
    if _dense(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device, pin_memory=pin_memory)
    return torch.empty(x.shape, dtype=x.dtype, device=device, pin_memory=pin_memory)


def _dense(x: torch.Tensor) -> bool:
    """Whether `x`'s elements fill its storage span exactly once, in some order of its dims."""
    if x.numel() == 0:
        return True
    expected = 1
    for d in sorted(range(x.dim()), key=lambda d: (x.stride(d), x.shape[d])):
        if x.shape[d] == 1:
            continue
        if x.stride(d) != expected:
            return False
        expected *= x.shape[d]
    return True


@torch.library.custom_op("pt3func::offload_to_host", mutates_args=())
def offload_to_host(x: torch.Tensor) -> torch.Tensor:
    """Start copying `x` to pinned host memory (on the side stream on CUDA); a token for the copy."""
    ticket = next(_ids)
    if x.device.type != "cuda":
        _hosts[ticket] = _like(x, "cpu").copy_(x)
        return _token(ticket)
    _refuse_capture("offload_to_host")
    host = _like(x, "cpu", pin_memory=True)
    if not overlap_enabled():
        host.copy_(x, non_blocking=True)
    else:
        current, side = torch.cuda.current_stream(x.device), side_stream(x.device)
        side.wait_stream(current)  # x is computed
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        _d2h_events[ticket] = event
    _hosts[ticket] = host
    return _token(ticket)


@offload_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=_TOKEN)


@torch.library.custom_op("pt3func::offload_release", mutates_args=())
def offload_release(x: torch.Tensor, token: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    """The compute stream waits for `x`'s host copy; `x`'s last reader, so its memory is reused only after."""
    ticket = int(token.item())
    event = _d2h_events.pop(ticket, None)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)
    return _token(ticket)


@offload_release.register_fake
def _(x: torch.Tensor, token: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty(1, dtype=_TOKEN)


@torch.library.custom_op("pt3func::reload_prefetch", mutates_args=())
def reload_prefetch(token: torch.Tensor, device: str, after: torch.Tensor | None = None) -> torch.Tensor:
    """Start copying the token's host copy to `device` (on the side stream on CUDA); a token for `reload_wait`."""
    ticket = int(token.item())
    host = _hosts.pop(ticket)
    target = torch.device(device)
    if target.type != "cuda":
        _h2d[ticket] = (_like(host, target).copy_(host), None, None)
        return _token(ticket)
    _refuse_capture("reload_prefetch")
    if not overlap_enabled():
        _h2d[ticket] = (None, None, host)  # copied at the wait, on the compute stream
        return _token(ticket)
    buffer = _like(host, target)  # allocated in the compute stream's order
    current, side = torch.cuda.current_stream(target), side_stream(target)
    # The buffer may be memory that kernels queued on the compute stream still use; the host copy was
    # made on the side stream, so it is ahead of this in that stream's order.
    side.wait_stream(current)
    with torch.cuda.stream(side):
        buffer.copy_(host, non_blocking=True)  # the pinned allocator keeps `host` until this copy is done
        event = torch.cuda.Event()
        event.record(side)
    _h2d[ticket] = (buffer, event, None)
    return _token(ticket)


@reload_prefetch.register_fake
def _(token: torch.Tensor, device: str, after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty(1, dtype=_TOKEN)


@torch.library.custom_op("pt3func::reload_wait", mutates_args=())
def reload_wait(
    token: torch.Tensor,
    size: list[int],
    stride: list[int],
    dtype: torch.dtype,
    device: str,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """The device copy `reload_prefetch` started, once the compute stream has waited for it.

    `size`, `stride`, `dtype` and `device` describe the result (the offloaded value's) for tracing.
    """
    buffer, event, host = _h2d.pop(int(token.item()))
    if buffer is None:
        return host.to(device, non_blocking=True, copy=True)
    if event is not None:
        torch.cuda.current_stream(buffer.device).wait_event(event)
    return buffer


@reload_wait.register_fake
def _(
    token: torch.Tensor,
    size: list[int],
    stride: list[int],
    dtype: torch.dtype,
    device: str,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


OFFLOAD = torch.ops.pt3func.offload_to_host.default
RELEASE = torch.ops.pt3func.offload_release.default
PREFETCH = torch.ops.pt3func.reload_prefetch.default
RELOAD = torch.ops.pt3func.reload_wait.default
OPS = (OFFLOAD, RELEASE, PREFETCH, RELOAD)

_OWN = ("offload of", "release of", "prefetch of")  # custom["pt3func"] of the nodes below, but the wait's


def insert_offload(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """Offload `node`'s value: the copy to host right after it, the four ops chained; the wait (returned) at
    the graph's insert point. Release and prefetch start next to their neighbours: `place_offload_ops` moves them.
    """
    val = node.meta["val"]
    device = str(val.device)
    with _fake_mode(val):
        token_val = torch.empty(1, dtype=_TOKEN)
        reload_val = _like(val, device)

    def meta(n: fx.Node, what: str, v: torch.Tensor) -> fx.Node:
        n.meta = {**node.meta, "custom": {**custom(node), "pt3func": f"{what} of %{node.name}"}, "val": v}
        return n

    prefetch = meta(graph.call_function(PREFETCH, (None, device)), "prefetch", token_val)
    layout = (list(reload_val.shape), list(reload_val.stride()), reload_val.dtype, device)
    wait = meta(graph.call_function(RELOAD, (prefetch, *layout)), "reload", reload_val)
    with graph.inserting_after(node):
        start = meta(graph.call_function(OFFLOAD, (node,)), "offload", token_val)
    with graph.inserting_after(start):
        release = meta(graph.call_function(RELEASE, (node, start)), "release", token_val)
    prefetch.args = (release, device)
    return wait


def place_offload_ops(graph: fx.Graph) -> None:
    """Move each release and prefetch to where the module docstring says, and tie each op of the chain to the
    matrix product computed last before its place (in place).

    Regions are outer `pf.checkpoint` regions. Forward: a region spans its forward nodes; the release of a
    value of region R goes after the last forward node of the region following R (of R if none follows). Backward:
    a region starts at its first recomputed or reloaded copy; the prefetch of a value of R goes before the start
    of the region whose backward starts last before R's (before the first backward node if none).
    """
    nodes = list(graph.nodes)
    forward_first: dict[str, int] = {}
    forward_last: dict[str, int] = {}
    backward_first: dict[str, fx.Node] = {}
    first_backward: fx.Node | None = None
    for i, n in enumerate(nodes):
        region = _outer(region_of(n))
        why = str(custom(n).get("pt3func", ""))
        if is_backward(n):
            first_backward = first_backward or n
            if region is not None and why.startswith(("remat of", "reload of")):
                backward_first.setdefault(region, n)
        elif region is not None and not why.startswith(_OWN):
            forward_first.setdefault(region, i)
            forward_last[region] = i
    order = sorted(forward_first, key=forward_first.__getitem__)
    for release in [n for n in nodes if n.target is RELEASE]:
        region = _outer(region_of(release.args[0]))
        if region not in forward_last:
            continue
        k = order.index(region)
        at = nodes[forward_last[order[min(k + 1, len(order) - 1)]]]
        if nodes.index(at) > nodes.index(release):
            at.append(release)
    position = {n: i for i, n in enumerate(graph.nodes)}
    starts = sorted(backward_first.values(), key=position.__getitem__)
    for prefetch in [n for n in graph.nodes if n.target is PREFETCH]:
        own = backward_first.get(_outer(region_of(prefetch)))
        before = [s for s in starts if own is not None and position[s] < position[own]]
        target = before[-1] if before else first_backward
        wait = next(iter(prefetch.users))
        if target is not None and position[prefetch.args[0]] < position[target] <= position[wait]:
            target.prepend(prefetch)
    for release in [n for n in graph.nodes if n.target is RELEASE]:
        (prefetch,) = release.users
        if not any(n.target in DOTS for n in _between(release, prefetch)):
            _undo(release)
    for node in list(graph.nodes):
        if node.target in (RELEASE, PREFETCH, RELOAD):
            _tie(node)


def _between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
    out, node = [], a.next
    while node is not b and node.op != "root":
        out.append(node)
        node = node.next
    return out


def _undo(release: fx.Node) -> None:
    """Keep the value on the device: its readers in the backward read it again, the four ops go."""
    value, start = release.args[0], release.args[1]
    (prefetch,) = release.users
    (wait,) = prefetch.users
    wait.replace_all_uses_with(value)
    for node in (wait, prefetch, release, start):
        node.graph.erase_node(node)


def _tie(op: fx.Node) -> None:
    """Give `op` the last matrix product before it as `after=`, if one comes after the op's token.

    Inductor orders opaque calls only by their data dependencies (its peak-memory reordering moved a release
    right after its offload, and a prefetch into the forward); a matmul's output is a buffer anyway, so reading
    it costs no extra kernel, and the op cannot run before it.
    """
    token = op.args[1] if op.target is RELEASE else op.args[0]
    node = op.prev
    while node.op != "root" and node is not token:
        if node.op == "call_function" and node.target in DOTS:
            op.kwargs = {**op.kwargs, "after": node}
            return
        node = node.prev


def _fake_mode(val: torch.Tensor) -> contextlib.AbstractContextManager:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([val])
    return mode if mode is not None else contextlib.nullcontext()

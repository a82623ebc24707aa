"""`offload_to_host`: the graph rewrite (copy, release, prefetch, wait: where each goes), the ops, numbers equal
to no remat (eager and Inductor), Inductor keeping the ops where the pass put them, refusal under CUDA graphs.

On CPU the policy keeps values where they are (host memory); the tests that run the rewrite on CPU force it
(`force_offload`): the same graph as on a GPU, each op a plain copy.
"""

from __future__ import annotations

import functools
import operator
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import pt3func as pf
from pt3func.passes import remat
from pt3func.passes import remat_offload as ro
from pt3func.passes.remat import DOTS, NAME_KEY, POLICY_KEY, REGION_KEY, fence_recomputation, rematerialize

CP = pf.checkpoint_policies
D, FF, N_BLOCKS = 16, 32, 3
aten = torch.ops.aten


@pytest.fixture
def force_offload(monkeypatch):
    """Offload CPU values too (the policy's device check is the only difference from a GPU program)."""
    monkeypatch.setattr(remat, "_on_accelerator", lambda node: isinstance(node.meta.get("val"), torch.Tensor))


def block(x: torch.Tensor, p: dict) -> torch.Tensor:
    # The offloaded value is a transposed view: the copies must keep its strides (no copy to another layout).
    h = pf.checkpoint_name((F.layer_norm(x, (D,), p["ln"]) @ p["fc"]).transpose(1, 2), "mlp_in")
    return x + F.gelu(h).transpose(1, 2) @ p["out"]


def init_params() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"ln": torch.ones(D), "fc": torch.randn(D, FF, generator=g) * 0.2, "out": torch.randn(FF, D, generator=g) * 0.2}
        for _ in range(N_BLOCKS)
    ]


def attn_block(x: torch.Tensor, p: dict) -> torch.Tensor:
    # The named value is attention's output, which autograd saves for attention's backward: the backward
    # reads a `detach` of it, not the named node (as in benchmarks/lm_step.py's blocks).
    b, s, _ = x.shape
    q, k = (x @ p["fc"]).view(b, s, 2, 2, D // 2).permute(2, 0, 3, 1, 4)
    y = pf.checkpoint_name(F.scaled_dot_product_attention(q, k, k, is_causal=True), "attn")
    return x + y.transpose(1, 2).reshape(b, s, D) @ p["out"][:D]


def make_step(policy, head: bool = True, blk=block):
    """An AdamW step over checkpointed blocks; `head`: matmuls after the last block (as a language model's)."""
    opt = pf.optim.adamw(1e-2)
    run = blk if policy is None else pf.checkpoint(blk, policy)

    def loss_fn(params, x, y):
        for p in params:
            x = run(x, p)
        if head:
            x = x @ params[0]["fc"] @ params[0]["out"]
        return F.mse_loss(x, y)

    def step(params, opt_state, x, y):
        loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss

    return step, opt


def train(policy, backend: str, steps: int = 2, head: bool = True, blk=block):
    step_fn, opt = make_step(policy, head, blk)
    params = init_params()
    opt_state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 8, D, generator=g), torch.randn(2, 8, D, generator=g)
    step = pf.jit(step_fn, backend=backend)
    lowered = step.lower(params, opt_state, x, y)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    return (torch.stack(losses) if losses else None), params, lowered


def assert_same(a, b):
    for u, v in zip(pf.tree.leaves(a), pf.tree.leaves(b)):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def why(node: fx.Node) -> str:
    return str((node.meta.get("custom") or {}).get("pt3func", ""))


# --- the rewrite on a traced step ---------------------------------------------------------------------------


def test_chain_and_placement(force_offload):
    _, _, lowered = train(CP.offload_to_host("mlp_in"), "eager", steps=0)
    nodes = list(lowered.graph_module.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    of = {op: [n for n in nodes if n.target is op] for op in ro.OPS}
    assert all(len(v) == N_BLOCKS for v in of.values())
    first_backward = next(n for n in nodes if remat.is_backward(n))
    regions = sorted({remat.region_of(n) for n in nodes if remat.region_of(n) and not remat.is_backward(n)},
                     key=lambda r: min(at[n] for n in nodes if remat.region_of(n) == r))
    forward_last = {r: max(at[n] for n in nodes if remat.region_of(n) == r and not remat.is_backward(n)
                           and not why(n).startswith(("offload of", "release of", "prefetch of"))) for r in regions}
    backward_first = {r: min(at[n] for n in nodes if remat.region_of(n) == r and why(n).startswith(("remat of",
                                                                                                  "reload of")))
                      for r in regions}
    for start in of[ro.OFFLOAD]:
        value = start.args[0]
        (release,) = [u for u in start.users if u.target is ro.RELEASE]
        (prefetch,) = release.users
        (wait,) = prefetch.users
        k = regions.index(remat.region_of(value))
        # the copy to host starts right after the value is made
        assert at[start] == at[value] + 1 and "mlp_in" in remat.names_of(value)
        # released once the forward has run the next block (its own, for the last block)
        nxt = regions[min(k + 1, len(regions) - 1)]
        assert at[release] > forward_last[nxt]
        assert all(n.target is ro.RELEASE for n in nodes[forward_last[nxt] + 1 : at[release]])  # releases only
        assert release.args[0] is value
        # prefetched when the backward starts the block after it (whose backward runs just before); the last
        # block's at the start of the backward
        following = first_backward if k == len(regions) - 1 else nodes[backward_first[regions[k + 1]]]
        assert at[prefetch] < at[following]
        assert all(n.target is ro.PREFETCH for n in nodes[at[prefetch] : at[following]])
        # waited for at the first backward use, and only the backward reads the reloaded copy
        readers = sorted(wait.users, key=at.__getitem__)
        assert all(remat.is_backward(u) for u in readers)
        assert not any(remat.is_backward(u) for u in value.users)  # the forward value is not read by the backward
        assert at[start] < at[release] < at[first_backward] <= at[prefetch] + 1 and at[prefetch] < at[wait]
        assert wait.args[1:5] == (list(value.meta["val"].shape), list(value.meta["val"].stride()),
                                  value.meta["val"].dtype, "cpu")
        # each op after the start is tied to the last matmul before it (if one comes after the op's token)
        for token, op in ((start, release), (release, prefetch), (prefetch, wait)):
            matmuls = [n for n in nodes[at[token] + 1 : at[op]] if n.target in DOTS]
            assert op.kwargs.get("after") is (matmuls[-1] if matmuls else None)
        assert release.kwargs["after"] is not None and prefetch.kwargs["after"] is not None
    text = lowered.as_text()
    for what in ("OFFLOAD", "RELEASE", "PREFETCH", "RELOAD"):
        assert text.count(f"# {what} of %") == N_BLOCKS, what


def test_last_blocks_kept_when_the_backward_follows_them(force_offload):
    """Without matmuls after the last block, the last two blocks' values would be released at the end of the
    forward and prefetched at the start of the backward: a round trip that frees nothing. They stay."""
    _, _, lowered = train(CP.offload_to_host("mlp_in"), "eager", steps=0, head=False)
    nodes = list(lowered.graph_module.graph.nodes)
    starts = [n for n in nodes if n.target is ro.OFFLOAD]
    assert len(starts) == N_BLOCKS - 2
    named = [n for n in nodes if "mlp_in" in remat.names_of(n) and not remat.is_backward(n)
             and not why(n).startswith(("offload of", "release of", "prefetch of"))]
    assert [s.args[0] for s in starts] == named[:-2]
    assert all(any(remat.is_backward(u) for u in n.users) for n in named[-2:])  # read by the backward directly
    for node in nodes:
        if node.target in (ro.OFFLOAD, ro.RELEASE, ro.PREFETCH):  # only tokens link the ops
            assert node.meta["val"].shape == (1,) and node.meta["val"].dtype == torch.int64


def _read_by_backward(value: fx.Node) -> list[fx.Node]:
    """Backward nodes (recomputed copies and the Inductor fence included) reading `value` or a view of it."""
    out, stack = [], [value]
    while stack:
        node = stack.pop()
        for user in node.users:
            if remat.is_backward(user):
                out.append(user)
            elif remat.alias_root(user) is value:
                stack.append(user)
    return out


def test_saved_output_offloaded(force_offload):
    """A named value the backward reads only through an alias (autograd saves attention's output as a
    `detach` of it) goes to host; the alias is recomputed from the reloaded copy. It stayed on the device."""
    losses, params, lowered = train(CP.offload_to_host("attn"), "eager", blk=attn_block)
    nodes = list(lowered.graph_module.graph.nodes)
    named = [n for n in nodes if "attn" in remat.names_of(n) and n.target is operator.getitem]
    assert len(named) == N_BLOCKS
    starts = [n for n in nodes if n.target is ro.OFFLOAD]
    assert [s.args[0] for s in starts] == named
    for value in named:
        assert not _read_by_backward(value)  # the backward reads the reloaded copy only
    (wait,) = [n for n in nodes if n.target is ro.RELOAD and n.args[0].args[0].args[0] is named[0]]
    assert any(u.target is aten.detach.default for u in wait.users)
    ref_losses, ref_params, _ = train(CP.save_only_these_names("attn"), "eager", blk=attn_block)
    assert_same((losses, params), (ref_losses, ref_params))
    assert not ro._hosts and not ro._h2d and not ro._d2h_events


def test_benchmark_program_offloads_every_block(force_offload):
    """benchmarks/lm_step.py --policy offload: each block's attention output goes to host (the H200 run of
    benchmarks/offload_overlap.py found no copies: the policy had offloaded nothing)."""
    import argparse

    _benchmark()  # benchmarks/ on sys.path
    import lm_step

    a = argparse.Namespace(layers=2, d=32, heads=2, seq=16, batch=2, vocab=64, precision="bf16", policy="offload")
    step_fn, opt = lm_step.make_train_step(a, "cpu")
    params = lm_step.init_params(a, torch.device("cpu"))
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
    lowered = pf.jit(step_fn).lower(params, opt.init(params), tokens, tokens)
    nodes = list(lowered.graph_module.graph.nodes)
    named = [n for n in nodes if "attn" in remat.names_of(n) and n.target is operator.getitem]
    assert len(named) == a.layers
    assert sorted(n.args[0].name for n in nodes if n.target is ro.OFFLOAD) == sorted(n.name for n in named)
    assert all(sum(n.target is op for n in nodes) == a.layers for op in ro.OPS)
    assert not any(_read_by_backward(n) for n in named)


# --- numbers --------------------------------------------------------------------------------------------------


@functools.cache
def reference(backend: str):
    return train(None, backend)


def test_same_numbers_eager(force_offload):
    losses, params, _ = train(CP.offload_to_host("mlp_in"), "eager")
    ref_losses, ref_params, _ = reference("eager")
    assert_same((losses, params), (ref_losses, ref_params))
    assert not ro._hosts and not ro._h2d and not ro._d2h_events  # every copy was taken back


def _fused_ops(kernels: list[str]) -> set[str]:
    """The op names in fused kernels' names (`cpp_fused__unsafe_view_gelu_gelu_backward_7`), as words."""
    return {w for k in kernels if "fused" in k for w in k.split("_")[2:-1] if w and not w.isdigit()}


def _kernels(code: str) -> list[str]:
    """Calls in Inductor's `call()`, in order: kernel names, `mm`, and pt3func op names with their node."""
    body = code[code.index("def call("):]
    out = []
    for line in body.splitlines():
        line = line.strip()
        m = re.match(r"buf\d+ = torch\.ops\.pt3func\.(\w+)\.default\(", line)
        if m:
            out.append(m.group(1))
        elif re.match(r"extern_kernels\.\w+\(", line) or re.match(r"\w*(cpp_fused|triton)\w*(\.run)?\(", line):
            out.append(line.split("(")[0])
    return out


def _sources(code: str) -> list[tuple[str, str]]:
    """(node name, call) for every `# Topologically Sorted Source Nodes` comment: the last node is the op's."""
    body = code[code.index("def call("):]
    out = []
    for m in re.finditer(r"# Topologically Sorted Source Nodes: \[([^\]]*)\][^\n]*\n\s*([^\n]*)", body):
        out.append((m.group(1).split(", ")[-1], m.group(2)))
    return out


def test_same_numbers_and_order_under_inductor(force_offload):
    from torch._inductor.utils import run_and_get_code

    (losses, params, lowered), codes = run_and_get_code(lambda: train(CP.offload_to_host("mlp_in"), "inductor"))
    (ref_losses, ref_params, _), ref_codes = run_and_get_code(
        lambda: train(CP.save_only_these_names("mlp_in"), "inductor"))
    assert_same((losses, params), (ref_losses, ref_params))  # same values kept, same recompute: bit for bit
    none_losses, none_params, _ = reference("inductor")
    for u, v in zip(pf.tree.leaves((losses, params)), pf.tree.leaves((none_losses, none_params))):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)  # recompute fuses differently from the forward
    code = next(c for c in codes if "pt3func.offload_to_host" in c)
    ref_code = next(c for c in ref_codes if "def call(" in c)
    # No copies added: the same library calls as keeping the values on the device, plus the four ops per value,
    # and fused kernels of the same ops (how the CPU backend groups pointwise work into loops varies with the
    # recomputation's fences, which differ: the reloaded value needs none).
    calls, ref_calls = _kernels(code), _kernels(ref_code)
    ours = [c for c in calls if c in {op._opname for op in ro.OPS}]
    assert len(ours) == 4 * N_BLOCKS
    rest = [c for c in calls if c not in ours]
    assert [c for c in rest if c.startswith("extern")] == [c for c in ref_calls if c.startswith("extern")]
    assert _fused_ops(rest) <= _fused_ops(ref_calls) and "clone" not in _fused_ops(rest)
    assert len(rest) <= len(ref_calls) + 1
    assert not re.search(r"\.copy_\(|\.clone\(|aten\.copy|aten\.clone", code[code.index("def call("):])
    # The benchmark's reading of the program: every copy has kernels to run behind.
    assert _benchmark().offloaded_values(code) == N_BLOCKS
    windows = _benchmark().op_windows(code)
    assert len(windows["out"]) == len(windows["back"]) == N_BLOCKS and min(windows["out"] + windows["back"]) > 0
    # Inductor keeps the ops where the pass put them: same order among themselves, each after its anchor,
    # and none later than a matmul that follows it in the graph.
    graph = [n for n in lowered.graph_module.graph.nodes if n.op == "call_function"]
    position = {n.name: i for i, n in enumerate(graph)}
    run_order = [name for name, _ in _sources(code) if name in position]
    ran = {name: i for i, name in enumerate(run_order)}
    mine = [n.name for n in graph if n.target in ro.OPS]
    assert [name for name in run_order if name in set(mine)] == mine
    matmuls = [n.name for n in graph if n.target in DOTS and n.name in ran]
    for n in graph:
        if n.target not in ro.OPS:
            continue
        anchor = n.kwargs.get("after")
        if anchor is not None:
            assert ran[anchor.name] < ran[n.name]
        later = [m for m in matmuls if position[m] > position[n.name]]
        assert all(ran[m] > ran[n.name] for m in later), n.name


# --- the ops ----------------------------------------------------------------------------------------------------


def test_ops_round_trip_keeps_strides_and_copies():
    x = torch.randn(4, 6).t()  # transposed: the copies keep its layout
    token = torch.ops.pt3func.offload_to_host(x)
    token = torch.ops.pt3func.offload_release(x, token)
    token = torch.ops.pt3func.reload_prefetch(token, "cpu")
    back = torch.ops.pt3func.reload_wait(token, list(x.shape), list(x.stride()), x.dtype, "cpu")
    assert back.stride() == x.stride() and back.data_ptr() != x.data_ptr()
    assert_same(back, x)
    assert not ro._hosts and not ro._h2d


def test_overlap_switch(monkeypatch):
    assert ro.overlap_enabled()
    monkeypatch.setenv(ro.OVERLAP_ENV, "0")
    assert not ro.overlap_enabled()


def _hand_graph(device: str):
    """x -> mm -> relu (named, offloaded) in one region, -> mm -> sum; a backward that reads relu (fake values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        xv, wv = torch.empty(4, 4, device=device), torch.empty(4, 4, device=device)
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = xv, wv
    region = {REGION_KEY: "1", POLICY_KEY: CP.offload_to_host("act").as_meta()}

    def op(target, *args, custom=None):
        node = g.call_function(target, args)
        with mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        node.meta["custom"] = dict(region if custom is None else custom)
        return node

    mm = op(aten.mm.default, x, w)
    relu = op(aten.relu.default, mm)
    relu.meta["custom"][NAME_KEY] = ("act",)
    head = op(aten.mm.default, relu, w, custom={})  # a matmul between the region and the backward
    loss = op(aten.sum.default, head, custom={})
    bwd = {"pt3func": "backward of value_and_grad(f)"}
    grad = op(aten.ones_like.default, relu, custom=bwd)
    g1 = op(aten.mm.default, grad, w, custom=bwd)
    g2 = op(aten.threshold_backward.default, g1, relu, 0, custom=bwd)
    g.output((loss, g2))
    return fx.GraphModule(torch.nn.Module(), g)


def test_rewrite_on_fake_cuda_values():
    gm = rematerialize(_hand_graph("cuda"))
    nodes = list(gm.graph.nodes)
    targets = [n.target for n in nodes]
    assert [t for t in targets if t in ro.OPS] == [ro.OFFLOAD, ro.RELEASE, ro.PREFETCH, ro.RELOAD]
    start, release, prefetch, wait = (nodes[targets.index(op)] for op in ro.OPS)
    relu = start.args[0]
    assert relu.target is aten.relu.default and nodes.index(start) == nodes.index(relu) + 1
    assert release.args[:2] == (relu, start) and nodes.index(release) == nodes.index(start) + 1  # one region
    assert prefetch.args[0] is release and torch.device(prefetch.args[1]).type == "cuda"
    assert nodes[nodes.index(prefetch) + 1].target is aten.ones_like.default  # the start of the backward
    assert wait.meta["val"].device.type == "cuda" and wait.args[4] == prefetch.args[1]
    assert all(n.meta["val"].device.type == "cpu" for n in (start, release, prefetch))  # tokens
    threshold = next(n for n in nodes if n.target is aten.threshold_backward.default)
    assert threshold.args[1] is wait and nodes.index(wait) < nodes.index(threshold)
    assert wait.kwargs["after"].target is aten.mm.default  # the backward's matmul just before
    # the Inductor fence leaves the offload ops alone (their inputs are tokens and host-side state)
    fence_recomputation(gm)
    assert not any(n.target is aten.where.ScalarSelf and n.users and next(iter(n.users)).target in ro.OPS
                   for n in gm.graph.nodes)


def test_not_recomputed_by_a_memory_budget():
    """The budget pass runs after remat: it must never copy an offload op into the backward."""
    gm = rematerialize(_hand_graph("cuda"))
    can = remat.Recomputability(gm.graph)
    assert not any(can(n) for n in gm.graph.nodes if n.target in ro.OPS)


def test_cpu_values_are_kept_where_they_are():
    gm = rematerialize(_hand_graph("cpu"))
    assert not any(n.target in ro.OPS for n in gm.graph.nodes)


def test_cuda_graphs_refused_before_compiling():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pt3func.runtime.cudagraphs import check_capturable

    gm = rematerialize(_hand_graph("cuda"))
    with FakeTensorMode():
        args = [torch.empty(4, 4, device="cuda"), torch.empty(4, 4, device="cuda")]
    with pytest.raises(pf.TracingError, match=r"cuda_graphs=True cannot capture checkpoint_policies.offload_to_host"):
        check_capturable("step", gm, args, ["x", "w"], [])


# --- on a GPU -----------------------------------------------------------------------------------------------------


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="offload_to_host moves CUDA values to host memory")


@cuda
@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("overlap", ["1", "0"])
def test_cuda_same_numbers(backend, overlap, monkeypatch):
    monkeypatch.setenv(ro.OVERLAP_ENV, overlap)
    runs = []
    for policy in (CP.offload_to_host("mlp_in"), CP.save_only_these_names("mlp_in")):
        step_fn, opt = make_step(policy)
        params = pf.tree.map(lambda t: t.cuda(), init_params())
        opt_state = opt.init(params)
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randn(2, 8, D, generator=g).cuda() for _ in range(2))
        step = pf.jit(step_fn, backend=backend)
        losses = []
        for _ in range(3):
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(loss)
        runs.append((torch.stack(losses), params))
    if backend == "eager":
        assert_same(runs[0], runs[1])
    else:  # the same kernels on CPU (test above); on the GPU allow last-bit differences of another fusion
        for u, v in zip(pf.tree.leaves(runs[0]), pf.tree.leaves(runs[1])):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    assert not ro._hosts and not ro._h2d and not ro._d2h_events


@cuda
def test_cuda_copies_run_on_the_side_stream():
    x = torch.randn(256, 256, device="cuda")
    token = torch.ops.pt3func.offload_to_host(x)
    token = torch.ops.pt3func.offload_release(x, token)
    token = torch.ops.pt3func.reload_prefetch(token, "cuda")
    back = torch.ops.pt3func.reload_wait(token, [256, 256], [256, 1], x.dtype, "cuda")
    assert ro.side_stream(x.device) != torch.cuda.current_stream()
    assert_same(back, x)


# --- the GPU benchmark's trace reading (benchmarks/offload_overlap.py) -----------------------------------------


def _benchmark():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import offload_overlap

    return offload_overlap


def test_benchmark_counts_copy_time_under_kernels(tmp_path):
    import json

    offload_overlap = _benchmark()

    def event(cat, name, ts, dur, stream, nbytes=0):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": nbytes}}

    mib = 2**20
    events = [
        event("kernel", "gemm", 0, 100, 7),
        event("kernel", "triton_", 150, 50, 7),
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 100, 13, 4 * mib),  # half under kernels
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 160, 20, 13, 4 * mib),  # all under a kernel
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 300, 10, 7, 4),  # too small: not counted
        event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 400, 10, 7, 4 * mib),  # not host<->device
    ]
    # torch's Python CUPTI monitor: the direction in args only
    events.append({**event("gpu_memcpy", "Memcpy", 500, 10, 13, 4 * mib), "ph": "X"})
    events[-1]["args"]["copy kind"] = "HtoD"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = offload_overlap.copy_overlap(str(path), steps=1, min_bytes=mib)
    assert out["DtoH"] == dict(copies_per_step=1, mib_per_step=4.0, ms_per_step=0.1, overlapped_with_kernels=0.5,
                               streams=[13])
    assert out["HtoD"]["copies_per_step"] == 2 and out["HtoD"]["mib_per_step"] == 8.0
    assert out["HtoD"]["overlapped_with_kernels"] == round(20 / 30, 3) and out["kernel_streams"] == [7]


@cuda
@pytest.mark.parametrize("overlap", ["1", "0"])
def test_cuda_copies_leave_the_compute_stream(overlap, monkeypatch, tmp_path):
    """With overlap the copies run on a stream no kernel runs on; without, on the kernels' stream."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv(ro.OVERLAP_ENV, overlap)
    step_fn, opt = make_step(CP.offload_to_host("mlp_in"))
    params = pf.tree.map(lambda t: t.cuda(), init_params())
    opt_state = opt.init(params)
    x, y = torch.randn(2, 8, D, device="cuda"), torch.randn(2, 8, D, device="cuda")
    step = pf.jit(step_fn, backend="eager")
    params, opt_state, _ = step(params, opt_state, x, y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(params, opt_state, x, y)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    value_bytes = 2 * 8 * FF * 4
    copies = _benchmark().copy_overlap(str(trace), steps=1, min_bytes=value_bytes)
    kernel_streams = set(copies["kernel_streams"])
    for direction in ("DtoH", "HtoD"):
        assert copies[direction]["copies_per_step"] == N_BLOCKS
        streams = set(copies[direction]["streams"])
        assert streams.isdisjoint(kernel_streams) if overlap == "1" else streams <= kernel_streams, copies

"""memory_analysis: the Inductor wrapper replay (exact on hand-written wrappers) and a compiled step against the
allocations the CPU allocator reports while it runs."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import pt3func as pf
from pt3func.runtime.inductor_memory import wrapper_memory

KEYS = {"peak_bytes", "argument_bytes", "output_bytes", "aliased_bytes", "temp_bytes"}


def _wrapper(body: str) -> str:
    return "import torch\n\nclass Runner:\n    def call(self, args):\n" + textwrap.indent(
        textwrap.dedent(body).strip("\n"), " " * 8
    ) + "\n\ndef other():\n    buf99 = empty_strided_cpu((1000, ), (1, ), torch.float32)\n"


def test_allocations_frees_reuse_and_views():
    src = _wrapper(
        """
        arg0_1, arg1_1 = args
        args.clear()
        buf0 = empty_strided_cpu((10, 10), (10, 1), torch.float32)  # 400
        buf1 = empty_strided_cpu((100, ), (1, ), torch.bfloat16)  # 200
        kernel_0(arg0_1, buf0, buf1)
        buf2 = buf0; del buf0  # reuse
        buf3 = reinterpret_tensor(buf1, (10, 10), (10, 1), 0)  # alias
        del buf1
        buf4 = empty_strided_cpu((5, 4), (1, 5), torch.float64)  # 160
        del buf3
        buf5 = empty_strided_cpu((0, 4), (4, 1), torch.float32)
        return (buf2, buf4, )
        """
    )
    m = wrapper_memory(src, "cpu")
    assert m.peak_bytes == 400 + 200 + 160  # buf1 lives on through its view buf3 until `del buf3`
    assert m.output_bytes == 400 + 160
    assert m.peak_statement.startswith("buf4 =")
    assert m.unsized == []


def test_strided_storage_and_cuda_rounding():
    src = _wrapper(
        """
        buf0 = empty_strided_cuda((4, 3), (1, 8), torch.float16)
        return (buf0, )
        """
    )
    # Storage spans 1 + 3*1 + 2*8 = 20 elements = 40 bytes; the caching allocator hands out 512.
    assert wrapper_memory(src, "cuda").peak_bytes == 512
    assert wrapper_memory(src.replace("empty_strided_cuda", "empty_strided_cpu"), "cpu").peak_bytes == 40


def test_fallback_kernel_outputs_sized_by_their_assertions():
    src = _wrapper(
        """
        arg0_1, = args
        buf0 = torch.ops.aten._scaled_dot_product_flash_attention.default(arg0_1, arg0_1, arg0_1)
        buf1 = buf0[0]
        assert_size_stride(buf1, (2, 4, 8, 16), (512, 16, 64, 1), 'op')
        buf2 = buf0[1]
        assert_size_stride(buf2, (2, 4, 8), (32, 8, 1), 'op')
        del buf0
        buf3 = torch.ops.aten.foo.default(buf1)
        assert_size_stride(buf3, (10, ), (1, ), 'op')
        del buf1
        buf4 = torch.ops.aten.bar.default(buf2)
        del buf2
        return (buf3, buf4, )
        """
    )
    m = wrapper_memory(src, "cpu", [torch.bfloat16])
    out, lse, foo = 2 * 4 * 8 * 16 * 2, 2 * 4 * 8 * 4, 10 * 2  # bf16 like the input; statistics in fp32
    assert m.peak_bytes == out + lse + foo
    assert m.output_bytes == foo
    assert m.unsized == ["buf4"]


def test_no_call_function():
    assert wrapper_memory("def f(args):\n    pass\n", "cpu") is None


def _mlp_step(params, opt_state, x, y):
    def loss_fn(p):
        h = F.gelu(x @ p["w1"] + p["b1"])
        return F.cross_entropy(h @ p["w2"], y)

    loss, grads = pf.value_and_grad(loss_fn)(params)
    updates, opt_state = _OPT.update(grads, opt_state, params)
    return pf.optim.apply_updates(params, updates), opt_state, loss


_OPT = pf.optim.adamw(1e-3)


def _measured_peak(fn, *args) -> tuple[int, object]:
    """Most bytes held at once by allocations made while `fn(*args)` runs, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, out


def test_compiled_estimate_matches_the_cpu_allocator():
    torch.manual_seed(0)
    d, h, n, classes = 64, 512, 256, 32
    params = {"w1": torch.randn(d, h) * 0.1, "b1": torch.zeros(h), "w2": torch.randn(h, classes) * 0.1}
    opt_state = _OPT.init(params)
    x, y = torch.randn(n, d), torch.randint(0, classes, (n,))
    step = pf.jit(_mlp_step, donate_argnums=(0, 1))
    params, opt_state, _ = step(params, opt_state, x, y)  # compile and run once

    lowered = step.lower(params, opt_state, x, y)
    compiled = lowered.compile()  # the program the call above compiled: not compiled again
    assert compiled is step._cache[next(iter(step._cache))]
    before, after = lowered.memory_analysis(), compiled.memory_analysis()
    assert set(after) >= KEYS and set(before) >= KEYS
    for key in ("argument_bytes", "aliased_bytes", "output_bytes"):
        assert after[key] == before[key], key
    assert after["aliased_bytes"] == sum(t.numel() * 4 for t in pf.tree.leaves((params, opt_state)))
    # Fusion: the compiled program holds less than the traced one's liveness bound.
    assert after["peak_bytes"] < before["peak_bytes"]

    measured, _ = _measured_peak(compiled, params, opt_state, x, y)
    estimated = after["peak_bytes"] - after["argument_bytes"]
    # The allocator also sees kernels' own scratch buffers (matmul packing), which the wrapper does not show.
    assert 0.9 * measured <= estimated <= 1.02 * measured, (estimated, measured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_estimate_matches_the_cuda_allocator():
    torch.manual_seed(0)
    d, h, n, classes = 512, 4096, 8192, 2048
    params = {
        "w1": torch.randn(d, h, device="cuda") * 0.02,
        "b1": torch.zeros(h, device="cuda"),
        "w2": torch.randn(h, classes, device="cuda") * 0.02,
    }
    opt_state = _OPT.init(params)
    x, y = torch.randn(n, d, device="cuda"), torch.randint(0, classes, (n,), device="cuda")
    step = pf.jit(_mlp_step, donate_argnums=(0, 1))
    for _ in range(2):  # compile, then one more call (library workspaces are allocated once, by the first)
        params, opt_state, loss = step(params, opt_state, x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    params, opt_state, loss = step(params, opt_state, x, y)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    memory = step.lower(params, opt_state, x, y).compile().memory_analysis()
    estimated = memory["peak_bytes"] - memory["argument_bytes"]
    assert 0.9 * measured <= estimated <= 1.02 * measured, (estimated, measured)

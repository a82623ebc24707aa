"""Quantisation kernels: the torch reference's format and statistics, the custom ops under make_fx / Inductor /
pf.jit, and the Triton kernels against the reference under TRITON_INTERPRET=1 (in a child process, so the
interpreter setting cannot leak into other tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func.kernels import dequantize_blockwise, quantize_blockwise, reference, triton_available

# ---------------------------------------------------------------------------------------------------------------
# Triton interpreter cases: (name, kwargs). Small sizes: the interpreter runs numpy per program.


def _case_input(n: int, dtype: torch.dtype, special: str = "") -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    x[: min(n, 40)] = 0.0  # the first block is all zero (scale 0) in every case with blocks <= 40
    if special == "tiny":
        x[40:80] = 1e-38  # qmax / absmax overflows fp32: the FLT_MAX clamp keeps q finite
    if special == "overshoot":
        # y * RN(qmax / y) rounds to qmax + 1 ulp for this y (int8 and int4), and seed 93 gives element 335 the
        # largest dither, 1/2 - 2**-17: the sum is exactly 127.5 for int8 (a clamp must catch it), < 7.5 for int4.
        return torch.full((n,), 4.976205348968506).to(dtype)
    if special == "non-finite":
        x[50], x[130], x[131] = float("nan"), float("inf"), -float("inf")
    if special.startswith("ties"):  # absmax qmax: scale 1, so the half-integers are exact ties
        qmax = float(special.removeprefix("ties"))
        x[80:160] = (torch.arange(80, dtype=torch.float32) * 0.5 - 20.0).clamp(-qmax, qmax)
        x[80] = qmax
    return x.to(dtype)


INTERPRETER_CASES = {
    f"{bits}bit-{name}": dict(bits=bits, **kw)
    for bits in (8, 4)
    for name, kw in {
        "fp32": dict(n=1000, block=64),
        "fp32-ef": dict(n=1000, block=64, residual=True),
        "bf16-ef-odd-numel-block100": dict(n=999 if bits == 8 else 998, block=100, dtype="bfloat16", residual=True),
        "fp16-block32-small-programs": dict(n=333, block=32, dtype="float16", elems_per_program=64),
        "tiny-absmax": dict(n=300, block=40, special="tiny"),
        "ties": dict(n=300, block=80, special=f"ties{reference.QMAX[bits]}"),
        "non-finite-ef": dict(n=300, block=40, special="non-finite", residual=True),
        "stochastic": dict(n=1000, block=64, stochastic=True, seed=123456789012),
        "stochastic-ef-bf16": dict(n=555, block=50, dtype="bfloat16", residual=True, stochastic=True, seed=-7),
        "block-1-int8-or-2-int4": dict(n=37, block=1 if bits == 8 else 2, elems_per_program=16),
        "stochastic-odd-block-int8": dict(n=500, block=37 if bits == 8 else 38, stochastic=True, seed=99),
        "overshoot-stochastic": dict(n=512, block=64, special="overshoot", stochastic=True, seed=93),
        "even-tiles-ef": dict(n=2048, block=64, residual=True, elems_per_program=512),  # unmasked kernels
        "even-tiles-stochastic-ef": dict(n=2048, block=64, residual=True, stochastic=True, seed=5,
                                         elems_per_program=256),
    }.items()
}

# The pair kernels (words of two elements; the default for int4) and the element kernels (the default for int8)
# each on the other width too, with `pairs` forced: both must give the reference's bits wherever they run.
# "misaligned" views start at an odd element (`offset`), where the default must fall back to the element kernel.
INTERPRETER_CASES.update({
    f"{bits}bit-pairs-{name}": dict(bits=bits, pairs=True, **kw)
    for bits in (8, 4)
    for name, kw in {
        "fp32-padded": dict(n=1000, block=64),
        "fp32-ef-block100": dict(n=1000, block=100, residual=True),  # HALF 64 words, 50 in the block: masks
        "bf16-ef": dict(n=998, block=100, dtype="bfloat16", residual=True),
        "fp16-stochastic-small-programs": dict(n=334, block=32, dtype="float16", stochastic=True, seed=77,
                                               elems_per_program=64),
        "even-tiles": dict(n=2048, block=64, elems_per_program=512),
        "even-tiles-stochastic-ef": dict(n=2048, block=64, residual=True, stochastic=True, seed=5,
                                         elems_per_program=256),
        "even-tiles-bf16-stochastic": dict(n=4096, block=128, dtype="bfloat16", stochastic=True, seed=3,
                                           elems_per_program=1024),
        "even-tiles-fp16-ef": dict(n=1024, block=256, dtype="float16", residual=True, elems_per_program=512),
        "block-2": dict(n=100, block=2, elems_per_program=16),  # one word per block (elements 40+ non-zero)
        "non-finite-ef": dict(n=300, block=40, special="non-finite", residual=True),
        "non-finite-stochastic-ef": dict(n=300, block=40, special="non-finite", residual=True, stochastic=True,
                                         seed=4),
        "ties": dict(n=300, block=80, special=f"ties{reference.QMAX[bits]}"),
        "tiny-absmax": dict(n=300, block=40, special="tiny"),
        "overshoot-stochastic": dict(n=512, block=64, special="overshoot", stochastic=True, seed=93),
    }.items()
})
INTERPRETER_CASES.update({
    f"4bit-elements-{name}": dict(bits=4, pairs=False, **kw)
    for name, kw in {
        "fp32-padded": dict(n=1000, block=64),
        "fp32-ef": dict(n=1000, block=64, residual=True),
        "bf16-ef-block100": dict(n=998, block=100, dtype="bfloat16", residual=True),
        "stochastic": dict(n=1000, block=64, stochastic=True, seed=123456789012),
        "even-tiles-stochastic-ef": dict(n=2048, block=64, residual=True, stochastic=True, seed=5,
                                         elems_per_program=256),
        "non-finite-ef": dict(n=300, block=40, special="non-finite", residual=True),
        "non-finite-stochastic-ef": dict(n=300, block=40, special="non-finite", residual=True, stochastic=True,
                                         seed=4),
        "ties": dict(n=300, block=80, special="ties7"),
    }.items()
})
INTERPRETER_CASES["8bit-non-finite-stochastic-ef"] = dict(bits=8, n=301, block=40, special="non-finite",
                                                          residual=True, stochastic=True, seed=4)
INTERPRETER_CASES.update({
    f"{bits}bit-misaligned-{name}": dict(bits=bits, **kw)
    for bits in (8, 4)
    for name, kw in {
        "x": dict(n=640, block=64, offset=1, stochastic=True, seed=8),
        "bf16-x-ef": dict(n=640, block=64, dtype="bfloat16", offset=1, residual=True),
        "residual": dict(n=640, block=64, residual=True, residual_offset=1),
    }.items()
})


def _same(w: torch.Tensor, g: torch.Tensor) -> bool:
    """Equal dtype, shape and values, NaN matching NaN (a NaN's sign and payload differ between CPUs and GPUs)."""
    if w.dtype != g.dtype or w.shape != g.shape:
        return False
    return torch.equal(w, g) or (w.is_floating_point() and bool(((w == g) | (w.isnan() & g.isnan())).all()))


def _interpreter_case(bits: int, n: int, block: int, dtype: str = "float32", residual: bool = False,
                      stochastic: bool = False, seed: int = 0, special: str = "",
                      elems_per_program: int | None = None, pairs: bool | None = None, offset: int = 0,
                      residual_offset: int = 0, device: str = "cpu") -> str:
    """Empty string if the Triton kernels on `device` reproduce the CPU reference exactly, else what differs.
    `pairs` picks the kernel (None: the default); `offset` / `residual_offset` make x / the residual views
    starting that many elements into a larger buffer."""
    from pt3func.kernels import triton_quant

    def view_at(t: torch.Tensor, at: int) -> torch.Tensor:
        return torch.cat([t.new_zeros(at), t]).to(device)[at:] if at else t.to(device)

    x = _case_input(n, getattr(torch, dtype), special)
    r = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.05 if residual else None
    s = torch.tensor(seed) if stochastic else None
    want = reference.quantize_blockwise(x, bits, block, r, stochastic, s)
    got = triton_quant.quantize_blockwise(view_at(x, offset), bits, block,
                                          None if r is None else view_at(r, residual_offset), stochastic,
                                          None if s is None else s.to(device), elems_per_program=elems_per_program,
                                          pairs=pairs)
    errors = []
    for name, w, g in zip(("q", "scales", "new_residual"), want, got):
        if (w is None) != (g is None) or (w is not None and not _same(w, g.cpu())):
            errors.append(f"{name} differs")
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = reference.dequantize_blockwise(want[0], want[1], bits, block, n, out_dtype)
        for streaming in (False, True):  # the store's cache hint must not change a value
            g = triton_quant.dequantize_blockwise(want[0].to(device), want[1].to(device), bits, block, n, out_dtype,
                                                  elems_per_program=elems_per_program, pairs=pairs,
                                                  streaming=streaming)
            if not _same(w, g.cpu()):
                errors.append(f"dequantised {out_dtype} (streaming stores {streaming}) differs")
    return "; ".join(errors)


def _interpreter_main() -> None:
    import warnings

    warnings.simplefilter("ignore")  # numpy warns on the all-zero block's qmax / 0 (clamped to FLT_MAX)
    results = {}
    for name, kw in INTERPRETER_CASES.items():
        try:
            results[name] = _interpreter_case(**kw)
        except Exception as e:  # one case failing must not hide the others
            results[name] = f"raised {type(e).__name__}: {e}"
    results["pair kernel refusals"] = _pair_refusals()
    print("RESULTS " + json.dumps(results))


def _pair_refusals() -> str:
    """The buffers `pairs=True` must refuse with a ValueError (the default falls back on them): which it did not."""
    from pt3func.kernels import triton_quant

    q, s, _ = reference.quantize_blockwise(torch.randn(64), 4, 64)
    q8, s8, _ = reference.quantize_blockwise(torch.randn(128), 8, 64)
    cases = {
        "x at an odd offset": lambda: triton_quant.quantize_blockwise(torch.randn(129)[1:], 4, 64, pairs=True),
        "residual at an odd offset": lambda: triton_quant.quantize_blockwise(
            torch.randn(128), 4, 64, torch.randn(129)[1:], pairs=True),
        "odd length": lambda: triton_quant.quantize_blockwise(torch.randn(127), 4, 64, pairs=True),
        "odd block": lambda: triton_quant.quantize_blockwise(torch.randn(74), 8, 37, pairs=True),
        "float64 input": lambda: triton_quant.quantize_blockwise(torch.randn(64, dtype=torch.float64), 4, 64,
                                                                 pairs=True),
        "dequantise to an odd length": lambda: triton_quant.dequantize_blockwise(q, s, 4, 64, 63, pairs=True),
        "int8 q at an odd offset": lambda: triton_quant.dequantize_blockwise(
            torch.cat([q8.new_zeros(1), q8])[1:], s8, 8, 64, 128, pairs=True),
    }
    missed = []
    for name, call in cases.items():
        try:
            call()
            missed.append(name)
        except ValueError:
            pass
    return "; ".join(missed)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    if not triton_available():
        pytest.skip("triton is not importable here (CI installs it with the dev extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, "--interpret"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_triton_kernels_match_reference_bit_for_bit(interpreter_results, case):
    assert interpreter_results[case] == ""


def test_pair_kernels_refuse_buffers_they_cannot_read(interpreter_results):
    assert interpreter_results["pair kernel refusals"] == ""


@pytest.mark.skipif(not triton_available(), reason="triton is not importable here")
def test_default_kernel_choice(monkeypatch):
    """int4 takes the pair kernels unless the buffers forbid them, int8 the element kernels (the defaults), and
    `pairs=` overrides: recorded by stand-in launchers, so nothing runs (the interpreter cases check the bits)."""
    from pt3func.kernels import triton_quant

    launched = []

    class Launcher:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(self.name)

    for name in ("_quantize_kernel", "_quantize_pairs_kernel", "_dequantize_kernel", "_dequantize_pairs_kernel"):
        monkeypatch.setattr(triton_quant, name, Launcher("pairs" if "pairs" in name else "elements"))

    def quantize(x, bits, **kw):
        launched.clear()
        triton_quant.quantize_blockwise(x, bits, 64, **kw)
        return launched[0]

    def dequantize(bits, numel, **kw):
        launched.clear()
        triton_quant.dequantize_blockwise(torch.zeros(128 if bits == 8 else 64, dtype=torch.uint8), torch.zeros(2),
                                          bits, 64, numel, **kw)
        return launched[0]

    x = torch.randn(129)
    assert quantize(x[:128], 4) == "pairs" and quantize(x[:128].bfloat16(), 4) == "pairs"
    assert quantize(x[1:], 4) == "elements"  # a view at an odd element
    assert quantize(x[:127], 4) == "elements"  # odd length
    assert quantize(x[:128].double(), 4) == "elements"
    assert quantize(x[:128], 4, residual=x[1:]) == "elements" and quantize(x[:128], 4, residual=x[:128]) == "pairs"
    assert quantize(x[:128], 4, pairs=False) == "elements"
    assert quantize(x[:128], 8) == "elements" and quantize(x[:128], 8, pairs=True) == "pairs"
    assert dequantize(4, 128) == "pairs" and dequantize(4, 127) == "elements"
    assert dequantize(8, 128) == "elements" and dequantize(8, 128, pairs=True) == "pairs"


# The interpreter cases that depend on how the hardware treats NaN, ties, subnormals and alignment: on a GPU
# NaN + 1.5 * 2**23 is the canonical NaN (low byte 0xFF, where numpy keeps 0x7FC00000), fmin / fmax drop NaN
# (numpy propagates it), and misaligned views are real addresses.
CUDA_CASES = [name for name in INTERPRETER_CASES
              if any(k in name for k in ("non-finite", "ties", "tiny", "overshoot", "misaligned", "bf16", "fp16"))]


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", CUDA_CASES)
def test_cuda_kernels_match_the_cpu_reference_on_interpreter_cases(case):
    assert _interpreter_case(**INTERPRETER_CASES[case], device="cuda") == ""


# ---------------------------------------------------------------------------------------------------------------
# The format, on the reference


def test_int8_values_round_half_to_even_and_padding():
    x = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 1.5, 0.0])  # first block: absmax 127 -> scale 1, x is q
    q, scales, residual = quantize_blockwise(x, bits=8, block=4)
    assert q.dtype == torch.int8 and q.shape == (8,)  # 7 elements padded to 2 blocks of 4
    assert q.tolist() == [127, 2, 4, -2, -42, 127, 0, 0]  # -0.5 * 127 / 1.5 = -42.3
    assert torch.equal(scales, torch.tensor([127.0, 1.5]) / torch.tensor(127.0)) and residual is None


def test_int4_packs_two_offset_binary_values_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 0.0, 3.5])  # absmax 7 -> scale 1; 3.5 rounds to 4
    q, scales, _ = quantize_blockwise(x, bits=4, block=4)
    assert q.dtype == torch.uint8 and scales.tolist() == [1.0]
    assert q.tolist() == [(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((4 + 8) << 4)]
    d = dequantize_blockwise(q, scales, bits=4, block=4, numel=4)
    assert d.tolist() == [7.0, -7.0, 0.0, 4.0]


def test_all_zero_block_has_zero_scale_and_no_nan():
    x = torch.zeros(64)
    x[32:] = torch.randn(32)
    q, scales, res = quantize_blockwise(x, bits=4, block=32, residual=torch.zeros(64))
    assert scales[0] == 0 and (q[:16] == 0x88).all()  # value 0 is nibble 8
    d = dequantize_blockwise(q, scales, bits=4, block=32, numel=64)
    assert torch.isfinite(d).all() and torch.isfinite(res).all() and (d[:32] == 0).all()


def test_non_finite_input_gives_non_finite_block():
    x = torch.randn(96)
    x[3] = float("nan")
    x[40] = float("inf")
    q, scales, _ = quantize_blockwise(x, bits=8, block=32)
    assert scales[:2].isinf().all() and (q[:64] == 0).all() and scales[2].isfinite()
    d = dequantize_blockwise(q, scales, bits=8, block=32, numel=96)
    assert not torch.isfinite(d[:64]).any() and torch.isfinite(d[64:]).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(bits, dtype):
    x = (torch.randn(5000) * torch.logspace(-3, 2, 5000)).to(dtype)  # blocks of very different magnitudes
    block = 128
    q, scales, _ = quantize_blockwise(x, bits=bits, block=block)
    d = dequantize_blockwise(q, scales, bits=bits, block=block, numel=x.numel(), shape=x.shape, dtype=dtype)
    assert d.dtype == dtype and d.shape == x.shape
    step = scales.repeat_interleave(block)[: x.numel()]
    err = (x.float() - d.float()).abs()
    slack = 1e-6 if dtype == torch.float32 else 2**-8  # bf16 output rounds once more
    assert (err <= step / 2 * (1 + 1e-5) + slack * x.float().abs()).all()
    assert (err > step / 4).any()  # the bound is not vacuous


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True])
def test_error_feedback_residual_is_exactly_what_was_lost(bits, stochastic):
    x, r = torch.randn(3, 100), torch.randn(300) * 0.1
    seed = torch.tensor(5) if stochastic else None
    q, scales, new_r = quantize_blockwise(x, bits=bits, block=64, residual=r, stochastic=stochastic, seed=seed)
    d = dequantize_blockwise(q, scales, bits=bits, block=64, numel=300)
    assert new_r.shape == r.shape and new_r.dtype == torch.float32
    assert torch.equal(new_r, (x.reshape(-1) + r) - d)


def test_error_feedback_accumulates_nothing_over_steps():
    """Sum of dequantised values over k steps = k * x minus the last residual: EF loses nothing in the long run."""
    x, r = torch.randn(256), torch.zeros(256)
    total = torch.zeros(256)
    for step in range(20):
        q, s, r = quantize_blockwise(x, bits=4, block=64, residual=r, stochastic=True, seed=torch.tensor(step))
        total += dequantize_blockwise(q, s, bits=4, block=64, numel=256)
    torch.testing.assert_close(total + r, 20 * x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    x = torch.randn(512)
    block, seeds = 64, 1000
    mean = torch.zeros(512)
    for seed in range(seeds):
        q, s, _ = quantize_blockwise(x, bits=bits, block=block, stochastic=True, seed=torch.tensor(seed))
        mean += dequantize_blockwise(q, s, bits=bits, block=block, numel=512) / seeds
    step = s.repeat_interleave(block)
    q, s, _ = quantize_blockwise(x, bits=bits, block=block)
    rtn_bias = (dequantize_blockwise(q, s, bits=bits, block=block, numel=512) - x).abs() / step
    sr_bias = (mean - x).abs() / step
    # Per element the mean of 1000 draws has std <= 0.5 / sqrt(1000) = 0.016 steps; RTN is off by ~0.25 on average.
    assert sr_bias.max() < 0.08 and sr_bias.mean() < 0.02
    assert rtn_bias.mean() > 0.15


def lowbias32(h: int) -> int:
    """The reference's 32-bit hash in plain Python integers, to check the tensor version against."""
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * reference.MIX1) & m
    h ^= h >> 15
    h = (h * reference.MIX2) & m
    return h ^ (h >> 16)


def test_hash_matches_plain_python_and_is_uniform():
    seed = 2**40 + 12345  # only the low 32 bits count
    u = reference.uniform_hash(torch.tensor(seed), 1 << 16)
    sh = lowbias32(seed & 0xFFFFFFFF)
    for i in (0, 1, 2, 1000, 65535):
        assert u[i].item() == (lowbias32((i * reference.GOLDEN + sh) & 0xFFFFFFFF) >> 8) * 2.0**-24
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.005
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.02  # neighbours independent
    other = reference.uniform_hash(torch.tensor(seed + 1), 1 << 16)
    assert (other != u).float().mean() > 0.99


def test_dither_matches_plain_python_and_is_symmetric():
    seed = -3  # two's complement: low 32 bits
    w = reference.dither(torch.tensor(seed), 1 << 16)
    sh = lowbias32(seed & 0xFFFFFFFF)
    for i in (0, 1, 2, 3, 1001, 65535):
        h = lowbias32(((i >> 1) * reference.GOLDEN + sh) & 0xFFFFFFFF)
        b = (h >> 16) if i % 2 else (h & 0xFFFF)
        assert w[i].item() == (b + 0.5) * 2.0**-16 - 0.5
    assert -0.5 < w.min() and w.max() < 0.5 and abs(w.mean().item()) < 0.005
    assert abs(torch.corrcoef(torch.stack([w[0::2], w[1::2]]))[0, 1].item()) < 0.02  # the two halves of a hash


def test_bad_arguments_raise():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(x, bits=2, block=4)
    with pytest.raises(ValueError, match="even"):
        quantize_blockwise(x, bits=4, block=5)
    with pytest.raises(ValueError, match="seed"):
        quantize_blockwise(x, bits=8, block=4, stochastic=True)
    with pytest.raises(ValueError, match="residual"):
        quantize_blockwise(x, bits=8, block=4, residual=torch.zeros(9))


# ---------------------------------------------------------------------------------------------------------------
# The custom ops in traced programs


def _ef_step(x, r, seed):
    q, s, new_r = quantize_blockwise(x, bits=4, block=32, residual=r, stochastic=True, seed=seed)
    return dequantize_blockwise(q, s, bits=4, block=32, numel=x.numel(), shape=x.shape), new_r


def _ef_args():
    return torch.randn(10, 7), torch.randn(70) * 0.01, torch.tensor(3)


def test_ops_pass_opcheck():
    x, r, seed = _ef_args()
    torch.library.opcheck(torch.ops.pt3func.quantize_blockwise.default, (x, 8, 32, r, True, seed))
    torch.library.opcheck(torch.ops.pt3func.quantize_blockwise.default, (x.bfloat16(), 4, 16, None, False, None))
    q, s, _ = quantize_blockwise(x, bits=4, block=32)
    torch.library.opcheck(torch.ops.pt3func.dequantize_blockwise.default, (q, s, 4, 32, 70, torch.bfloat16))


def test_make_fx_records_one_node_per_call():
    gm = make_fx(_ef_step, tracing_mode="fake")(*_ef_args())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.pt3func.quantize_blockwise.default) == 1
    assert targets.count(torch.ops.pt3func.dequantize_blockwise.default) == 1
    assert not [t for t in targets if "aten" in str(t) and "view" not in str(t)]  # nothing of the reference leaks


def test_inductor_compiles_a_graph_with_the_ops():
    from torch._inductor.compile_fx import compile_fx

    args = _ef_args()
    gm = make_fx(_ef_step)(*args)
    compiled = compile_fx(gm, list(args))
    for got, want in zip(compiled(*args), _ef_step(*args)):
        assert torch.equal(got, want)


# Interpreter cases the Inductor test compiles (one program holding all of them; each case adds C++ kernels to
# build): both widths, rounding to nearest and stochastic, error feedback, odd lengths and blocks, bf16 input,
# non-finite values, ties.
INDUCTOR_CASES = ["8bit-bf16-ef-odd-numel-block100", "8bit-non-finite-ef", "8bit-overshoot-stochastic",
                  "4bit-stochastic-ef-bf16", "4bit-stochastic-odd-block-int8", "4bit-ties"]


def _inductor_cases() -> tuple[list[tuple], list[torch.Tensor]]:
    """The `INDUCTOR_CASES` as (bits, block, numel, stochastic, has residual, dtype) plus their flat inputs."""
    statics, inputs = [], []
    for name in INDUCTOR_CASES:
        kw = INTERPRETER_CASES[name]
        n, dtype = kw["n"], getattr(torch, kw.get("dtype", "float32"))
        x = _case_input(n, dtype, kw.get("special", ""))
        r = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.05 if kw.get("residual") else None
        seed = torch.tensor(kw.get("seed", 0)) if kw.get("stochastic") else None
        statics.append((kw["bits"], kw["block"], n, bool(kw.get("stochastic")), r is not None, dtype))
        inputs += [x] + [t for t in (r, seed) if t is not None]
    return statics, inputs


def test_inductor_cpu_path_is_the_reference_bit_for_bit():
    """On CPU Inductor lowers the ops through the reference's aten ops (fused C++ loops, no fast-math, no FMA
    contraction): quantised and dequantised values (to fp32 and to the input's dtype), residuals, and values
    computed from a slice of them (which Inductor fuses into one loop indexed by `i // block`, the loop split
    `guard_inductor_cpu_loop_split` fixes) must match the reference exactly, and the compiled code must not call
    the opaque ops."""
    from pt3func._compat import inductor_output_code
    from pt3func.runtime.backend import compile_program

    statics, inputs = _inductor_cases()

    def run_all(quantize, dequantize, *flat):
        it, outs = iter(flat), []
        for bits, block, n, stochastic, has_res, dtype in statics:
            x = next(it)
            r = next(it) if has_res else None
            seed = next(it) if stochastic else None
            q, s, new_r = quantize(x, bits, block, r, stochastic, seed)
            d = dequantize(q, s, bits, block, n, torch.float32)
            outs += [q, s, d, dequantize(q, s, bits, block, n, dtype), d[: n - 7] * 3]
            outs += [new_r, new_r[3:] * 3] if has_res else []
        return outs

    want = run_all(reference.quantize_blockwise, reference.dequantize_blockwise, *inputs)
    ops = torch.ops.pt3func
    gm = make_fx(lambda *flat: run_all(ops.quantize_blockwise, ops.dequantize_blockwise, *flat))(*inputs)
    with inductor_output_code() as sources:
        compiled = compile_program(gm, inputs, "inductor")  # what pf.jit compiles a CPU program with
    got = compiled(*inputs)
    assert len(got) == len(want)
    bad = [i for i, (w, g) in enumerate(zip(want, got)) if not _same(w, g)]
    assert not bad, f"outputs {bad} differ from the reference"
    assert sources and not any("pt3func.quantize_blockwise" in s or "pt3func.dequantize_blockwise" in s
                               for s in sources)

def test_ops_inside_pf_jit_match_the_reference():
    step = pf.jit(_ef_step)
    x, r, _ = _ef_args()
    for seed in (1, 2):
        d, new_r = step(x, r, torch.tensor(seed))
        q, s, want_r = reference.quantize_blockwise(x, 4, 32, r, True, torch.tensor(seed))
        assert torch.equal(new_r, want_r)
        assert torch.equal(d, reference.dequantize_blockwise(q, s, 4, 32, 70).view(10, 7))
    assert step.trace_count() == 1  # the seed is an input: a new seed is not a new program
    assert "pt3func.quantize_blockwise" in step.lower(x, r, torch.tensor(1)).as_text()


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_ops_match_the_cpu_reference(bits):
    x, r = torch.randn(100_003), torch.randn(100_003) * 0.01
    for stochastic in (False, True):
        seed = torch.tensor(11)
        want = reference.quantize_blockwise(x, bits, 256, r, stochastic, seed)
        got = quantize_blockwise(x.cuda(), bits=bits, block=256, residual=r.cuda(), stochastic=stochastic,
                                 seed=seed.cuda())
        for w, g in zip(want, got):
            assert torch.equal(w, g.cpu())
        d = dequantize_blockwise(got[0], got[1], bits=bits, block=256, numel=x.numel(), dtype=torch.bfloat16)
        assert torch.equal(d.cpu(), reference.dequantize_blockwise(want[0], want[1], bits, 256, x.numel(),
                                                                   torch.bfloat16))


def test_cpu_lowering_is_not_in_inductors_global_table():
    """A CUDA program makes the ops Inductor fallbacks (the Triton launchers), which Inductor refuses for an op
    that also has a global decomposition ("both a fallback and a decomp for same op", seen on the H200): the
    CPU lowering is passed per program instead."""
    from torch._inductor.decomposition import decompositions

    from pt3func.runtime.backend import _decompositions

    ops = torch.ops.pt3func
    assert ops.quantize_blockwise.default not in decompositions
    assert ops.dequantize_blockwise.default not in decompositions
    quantising, plain = torch.fx.Graph(), torch.fx.Graph()
    x = quantising.placeholder("x")
    quantising.output(quantising.call_function(ops.quantize_blockwise.default, (x, 8, 256, None, False, 0)))
    y = plain.placeholder("y")
    plain.output(plain.call_function(torch.ops.aten.neg.default, (y,)))
    quantising, plain = (torch.fx.GraphModule(torch.nn.Module(), g) for g in (quantising, plain))
    assert _decompositions(quantising, [torch.empty(3)])[ops.quantize_blockwise.default] is not None
    # A program without the ops gets Inductor's default table, which its FX graph cache can key.
    assert _decompositions(plain, [torch.empty(3)]) is None
    with torch.device("meta"):
        assert _decompositions(quantising, [torch.empty(3)]) is None  # not a CPU program: Inductor's default table



def _linear_loss(params, x):
    # The gradient of params[k] is x[k] itself (one row per rank), so eager and Inductor feed the exchange the same
    # values bit for bit and any difference is the exchange's.
    return sum((params[k] * x[k]).sum() for k in params)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8(block=48)", "int4(block=48, stochastic_rounding=True)"])
def test_compressed_exchange_compiled_on_cpu_equals_eager(fmt):
    """The whole two-phase exchange (payload layout, all-to-all, sum, re-quantise, all-gather, the chunks' padding
    sliced off) compiled by Inductor on CPU, where the quantisation ops fuse with the code around them, gives the
    eager program's gradients and residuals bit for bit. Block 48 leaves every rank's chunk a partial block."""
    exchange = eval(fmt, vars(pf.compress))  # noqa: S307 - test constants
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    shapes = {"w": (40, 30), "b": (70,)}
    params = {k: torch.zeros(shape) for k, shape in shapes.items()}
    specs = {k: pf.P() for k in shapes}
    g = torch.Generator().manual_seed(0)
    batches = [{k: torch.randn(2, *shape, generator=g) for k, shape in shapes.items()} for _ in range(2)]

    def grad_step(params, ex, x):
        return pf.grad(_linear_loss)(params, x), ex

    results = {}
    with pf.set_mesh(mesh):
        params = pf.device_put(params, specs)
        for backend in ("eager", "inductor"):
            step = pf.jit(grad_step, in_shardings=(specs, None, {k: pf.P("dp") for k in shapes}),
                          grad_exchange=exchange, backend=backend)
            ex = exchange.init(params)
            for x in batches:
                grads, ex = step(params, ex, x)
            results[backend] = pf.tree.leaves(pf.device_get((grads, ex.leaves)))
    assert len(results["eager"]) == len(results["inductor"]) >= 6  # 2 gradients, their residuals and server's
    for want, got in zip(results["eager"], results["inductor"]):
        assert torch.equal(want, got)


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpreter_main()

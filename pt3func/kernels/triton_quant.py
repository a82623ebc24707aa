"""Triton kernels for blockwise int8 / int4 quantisation, bit-exact to `reference.py`.

One program handles `BPP` consecutive blocks as a `(BPP, WIDTH)` tile (WIDTH: the block rounded up to a power of
two; contiguous rows, so loads vectorise). Quantise reads `x` (and the residual) once and writes `q`, the scales and
the new residual in the same pass. Two kernels do this:
- the pair kernels (`_quantize_pairs_kernel`, `_dequantize_pairs_kernel`; even blocks and lengths, word-aligned
  buffers) read and write words holding two neighbouring elements (fp32 pairs as int64, bf16 / fp16 pairs as
  int32), so an int4 byte, a dither hash and a word are the same tile element: `(BPP, WIDTH // 2)` words, no
  reshape, split or join (which cost shared-memory round trips on sm_90). The default for int4;
- the element kernels (`_quantize_kernel`, `_dequantize_kernel`) take everything else (odd blocks or lengths,
  views at an odd offset, other input dtypes) and are the default for int8, where pairs save nothing; int4 pairs
  there by viewing the tile as `(BPP, WIDTH // 2, 2)`.

Bit-exactness with the reference rests on doing the same IEEE fp32 operations in the same order:
- the two divisions per block use `div_rn` (Triton's `/` is an approximate division on NVIDIA GPUs);
- kernels are launched with `enable_fp_fusion=False`, so `y * inv + c` and `y - q * scale` are not contracted
  into FMAs (one rounding instead of the reference's two);
- round half to even is `t + 1.5 * 2**23`, exact for |t| < 2**22 (here |t| <= 127.5), which also leaves q in the
  low mantissa bits (no float-to-int conversion); int4 nibbles become floats the same way in reverse.

The kernels are bound by instructions per element rather than by memory once the stored format is small (int4, or
stochastic rounding), so they avoid masks when the tiles cover the buffer exactly, hash once per pair of elements
for the dither, and use bit tricks instead of conversions.

Import this module only when triton is importable (`pt3func.kernels.triton_available()`). It runs on CPU
tensors under `TRITON_INTERPRET=1` (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pt3func.kernels import reference

_MIX1 = tl.constexpr(reference.MIX1)
_MIX2 = tl.constexpr(reference.MIX2)
_GOLDEN = tl.constexpr(reference.GOLDEN)
_FLT_MAX = tl.constexpr(reference.FLT_MAX)
_DITHER_SHIFT = tl.constexpr(1.5 - 2.0**-17)  # (1 + b * 2**-16) - this = (b + 1/2) * 2**-16 - 1/2, exactly

# (elements per program, warps, pair kernel) when the caller does not pick, per kernel: the config with the best
# worst-case ratio to a device copy over 64 MiB - 1 GiB in benchmarks/quant_kernels.py's sweep on an H200. int8
# (element kernels): results/quant_kernels_h200_run2.json. int4 (pair kernels): run 4
# (results/quant_kernels_h200_run4.json, worst ratios quantise 0.945, + EF 1.020, stochastic 0.867, dequantise
# 0.904); the configs first chosen from the sm_90 code (2048 x 2) measured 0.757 / 0.707 / 0.859 at 64 MiB there.
# Dequantise stores its (8x or 4x larger) output with the streaming hint: written once, read by the next kernel
# from HBM anyway. Set from results/quant_kernels_h200_s6.json (see benchmarks/quant_stream.py).
STREAMING_STORES = True

_CONFIGS = {
    "int8 quantise+ef": (1024, 2, False),
    "int4 quantise+ef": (1024, 8, True),
    "int8 quantise": (1024, 4, False),
    "int8 stochastic": (8192, 4, False),
    "int4 quantise": (1024, 4, True),
    "int4 stochastic": (4096, 8, True),
    "int8 dequantise": (1024, 4, False),
    "int4 dequantise": (1024, 1, True),
}


def default_config(bits: int, *, residual: bool = False, stochastic: bool = False,
                   dequantise: bool = False) -> tuple[int, int, bool]:
    """The (elements per program, num_warps, pair kernel) a call uses unless it passes its own; the pair kernel
    only where the buffers allow it (see `quantize_blockwise`)."""
    if dequantise:
        return _CONFIGS[f"int{bits} dequantise"]
    if residual:
        return _CONFIGS[f"int{bits} quantise+ef"]
    return _CONFIGS[f"int{bits} {'stochastic' if stochastic else 'quantise'}"]


@triton.jit
def _lowbias32(h):
    h = h ^ (h >> 16)
    h = h * _MIX1
    h = h ^ (h >> 15)
    h = h * _MIX2
    return h ^ (h >> 16)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 rounding to nearest even, in integer ops (the interpreter's float cast rounds differently):
    the bf16 bit pattern in the low 16 bits of a uint32."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = tl.where(v != v, 0x7FC00000, bits)  # keep NaN a NaN (the carry could turn it into inf)
    return bits >> 16


@triton.jit
def _to_bf16(v):
    return _bf16_bits(v).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile(pid, BLOCK: tl.constexpr, WIDTH: tl.constexpr, BPP: tl.constexpr, WIDE: tl.constexpr):
    """This program's `BPP` block indices, the `(BPP, WIDTH)` element offsets (WIDTH = block rounded up to a power
    of two), and which columns lie inside a block."""
    rows = pid * BPP + tl.arange(0, BPP)
    if WIDE:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, WIDTH)[None, :]
    return rows, rows[:, None] * BLOCK + cols, cols < BLOCK


@triton.jit
def _dither_pairs(pair, seed_h):
    """`reference.dither` of elements 2p and 2p + 1 for pair indices p: one hash, 16 bits each."""
    h = _lowbias32(pair.to(tl.uint32) * _GOLDEN + seed_h)
    lo = (((h << 7) & 0x7FFF80) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + b * 2**-16, b = h & 0xFFFF
    hi = (((h >> 9) & 0x7FFF80) | 0x3F800000).to(tl.float32, bitcast=True)  # b = h >> 16
    return lo - _DITHER_SHIFT, hi - _DITHER_SHIFT


@triton.jit
def _dither_elements(offs, seed_h):
    """`reference.dither` per element (blocks of odd length, whose pairs straddle tile rows)."""
    h = _lowbias32((offs >> 1).to(tl.uint32) * _GOLDEN + seed_h)
    b = h >> ((offs & 1) * 16).to(tl.uint32)
    return (((b << 7) & 0x7FFF80) | 0x3F800000).to(tl.float32, bitcast=True) - _DITHER_SHIFT


@triton.jit
def _quantize_kernel(
    x_ptr, r_ptr, seed_ptr, q_ptr, s_ptr, nr_ptr, numel, nblocks,
    BLOCK: tl.constexpr, WIDTH: tl.constexpr, BPP: tl.constexpr, QMAX: tl.constexpr,
    INT4: tl.constexpr, HAS_RES: tl.constexpr, STOCH: tl.constexpr, WIDE: tl.constexpr, EVEN: tl.constexpr,
    MAGIC: tl.constexpr,
):
    rows, offs, in_block = _tile(tl.program_id(0), BLOCK, WIDTH, BPP, WIDE)
    if STOCH:  # first, so that the seed's load latency overlaps the tile's (the compiler keeps the order)
        seed = tl.load(seed_ptr)
    if EVEN:  # whole blocks of a power-of-two length, whole programs: no masks (fewer instructions per element)
        y = tl.load(x_ptr + offs).to(tl.float32)
        if HAS_RES:
            y = y + tl.load(r_ptr + offs)
    else:
        valid = in_block & (offs < numel)
        y = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        if HAS_RES:
            y = y + tl.load(r_ptr + offs, mask=valid, other=0.0)
    # NaN counts as inf (tl.max would skip it), so a block with a non-finite value gets scale inf, q 0 and
    # dequantises to non-finite values, the same on every backend.
    absmax = tl.max(tl.where(y == y, tl.abs(y), float("inf")), axis=1)
    qm = tl.full([BPP], QMAX, tl.float32)
    scale = tl.math.div_rn(absmax, qm)
    inv = tl.minimum(tl.math.div_rn(qm, absmax), _FLT_MAX)
    t = y * inv[:, None]
    # The reference sets NaN t to 0. t is NaN only for the non-finite elements of a block whose absmax is inf
    # (inv is 0 there and finite elsewhere, where |y * inv| <= qmax (1 + 2**-23)). In such a block every q must
    # be 0 and every new residual is NaN either way (y - q * inf, with q 0 or NaN), so one select per row (`bad`)
    # on the stored q replaces the reference's select per element. Only int8's stochastic clamp needs t cleaned
    # first: GPU fmin / fmax turn NaN into +-qmax, which would make those residuals +-inf instead of NaN.
    bad = absmax == float("inf")
    # No clamp is needed (the reference's is a no-op here): |t| <= qmax + ulp(qmax) since inv <= (qmax / absmax)
    # (1 + 2**-24), which rounds to at most qmax, and for int4 stays below 7.5 after adding the dither
    # (|w| <= 1/2 - 2**-17). Only int8's dither can reach 127 + 2**-17 + 1/2 - 2**-17, a tie that rounds to 128.
    if STOCH:
        if not INT4:
            t = tl.minimum(tl.maximum(tl.where(t == t, t, 0.0), -QMAX), QMAX)
        seed_h = _lowbias32(seed.to(tl.uint32))
        if BLOCK % 2 == 0:
            pair = rows[:, None] * (BLOCK // 2) + tl.arange(0, WIDTH // 2)[None, :]
            w_lo, w_hi = _dither_pairs(pair, seed_h)
            t = t + tl.reshape(tl.join(w_lo, w_hi), (BPP, WIDTH))
        else:
            t = t + _dither_elements(offs, seed_h)
    # Adding MAGIC (1.5 * 2**23, + 8 for int4) rounds half to even and leaves the integer in the low mantissa bits:
    # for int8 the low byte is q in two's complement; for int4 the low nibble is q + 8.
    r = t + MAGIC
    qbits = r.to(tl.uint32, bitcast=True)
    if HAS_RES:
        new_res = y - (r - MAGIC) * scale[:, None]
        if EVEN:
            tl.store(nr_ptr + offs, new_res)
        else:
            tl.store(nr_ptr + offs, new_res, mask=valid)
    if EVEN:
        tl.store(s_ptr + rows, scale)
    else:
        tl.store(s_ptr + rows, scale, mask=rows < nblocks)
    if INT4:
        # Neighbouring elements (2j, 2j + 1) -> low and high nibble of byte j.
        lo, hi = tl.split(tl.reshape(qbits & 0xF, (BPP, WIDTH // 2, 2)))
        byte = tl.where(bad[:, None], 0x88, lo | (hi << 4)).to(tl.uint8)
        bcols = tl.arange(0, WIDTH // 2)[None, :]
        bptr = q_ptr + rows[:, None] * (BLOCK // 2) + bcols
        if EVEN:
            tl.store(bptr, byte)
        else:
            tl.store(bptr, byte, mask=(rows < nblocks)[:, None] & (bcols < BLOCK // 2))
    else:
        if not STOCH:  # (stochastic: t was cleaned before the clamp, q is 0 already)
            qbits = tl.where(bad[:, None], 0, qbits)
        q = qbits.to(tl.int8)  # truncation keeps the low byte
        if EVEN:
            tl.store(q_ptr + offs, q)
        else:
            tl.store(q_ptr + offs, q, mask=(rows < nblocks)[:, None] & in_block)


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, numel, nblocks,
    BLOCK: tl.constexpr, WIDTH: tl.constexpr, BPP: tl.constexpr, INT4: tl.constexpr, WIDE: tl.constexpr,
    BF16: tl.constexpr, EVEN: tl.constexpr, STREAM: tl.constexpr,
):
    rows, offs, in_block = _tile(tl.program_id(0), BLOCK, WIDTH, BPP, WIDE)
    row_ok = rows < nblocks
    valid = in_block & (offs < numel)
    if EVEN:
        scale = tl.load(s_ptr + rows)
    else:
        scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if INT4:
        bcols = tl.arange(0, WIDTH // 2)[None, :]
        bptr = q_ptr + rows[:, None] * (BLOCK // 2) + bcols
        if EVEN:
            b = tl.load(bptr).to(tl.uint32)
        else:
            b = tl.load(bptr, mask=row_ok[:, None] & (bcols < BLOCK // 2), other=0).to(tl.uint32)
        # A nibble n as float: the bits of 2**23 + n, minus 2**23 + 8 (exact, and no int-to-float conversion).
        lo = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        qf = tl.reshape(tl.join(lo, hi), (BPP, WIDTH))
    elif EVEN:
        qf = tl.load(q_ptr + offs).to(tl.float32)
    else:
        qf = tl.load(q_ptr + offs, mask=valid, other=0).to(tl.float32)
    out = qf * scale[:, None]
    if BF16:
        out = _to_bf16(out)
    if EVEN:
        tl.store(out_ptr + offs, out, cache_modifier=STREAM)
    else:
        tl.store(out_ptr + offs, out, mask=valid, cache_modifier=STREAM)


# The pair kernels: the same computation on words that each hold two neighbouring elements (2j, 2j + 1), the
# int4 nibble pair (and the dither pair) of byte j. The wrappers view fp32 buffers as int64 and bf16 / fp16 ones as
# int32, so no kernel reshapes, splits or joins a tile: on sm_90 those became shared-memory round trips with
# barriers (the layout of the (rows, pairs, 2) view differs from that of the loads). Here a tile is
# (BPP, WIDTH // 2) words, one row per block; every load and store is a contiguous run of words and the even / odd
# elements are the low / high halves of a word (register moves, no shuffles).


@triton.jit
def _unpack_words(w, XKIND: tl.constexpr):
    """The (even, odd) elements of words `w` as fp32: int64 words of two fp32 (XKIND 0), int32 words of two bf16
    (1) or two fp16 (2). All exact (bf16 -> fp32 is a shift, fp16 -> fp32 a conversion without rounding)."""
    if XKIND == 0:
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)  # int64 -> int32 keeps the low word
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif XKIND == 1:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack_fp32(lo, hi):
    """Two fp32 tensors as int64 words, `lo` in the low half (the little-endian layout of fp32 pairs)."""
    return (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _quantize_pairs_kernel(
    xw_ptr, rw_ptr, seed_ptr, q_ptr, s_ptr, nrw_ptr, nwords, nblocks,
    BLOCK: tl.constexpr, HALF: tl.constexpr, BPP: tl.constexpr, QMAX: tl.constexpr,
    INT4: tl.constexpr, HAS_RES: tl.constexpr, STOCH: tl.constexpr, WIDE: tl.constexpr, EVEN: tl.constexpr,
    MAGIC: tl.constexpr, XKIND: tl.constexpr,
):
    """`_quantize_kernel` on words of two elements (see above): x as words of XKIND, residual and new residual as
    int64 words of two fp32, q as one uint8 (int4) or int16 (int8: two int8) per word; BLOCK is even and
    HALF = next_power_of_2(BLOCK) // 2. The IEEE operations per element are those of `_quantize_kernel`."""
    rows, offs, in_block = _tile(tl.program_id(0), BLOCK // 2, HALF, BPP, WIDE)  # offs: word = pair index
    if STOCH:  # first, as in `_quantize_kernel`
        seed = tl.load(seed_ptr)
    if EVEN:
        x_lo, x_hi = _unpack_words(tl.load(xw_ptr + offs), XKIND)
        if HAS_RES:
            r_lo, r_hi = _unpack_words(tl.load(rw_ptr + offs), 0)
    else:
        valid = in_block & (offs < nwords)
        x_lo, x_hi = _unpack_words(tl.load(xw_ptr + offs, mask=valid, other=0), XKIND)
        if HAS_RES:
            r_lo, r_hi = _unpack_words(tl.load(rw_ptr + offs, mask=valid, other=0), 0)
    if HAS_RES:
        x_lo = x_lo + r_lo
        x_hi = x_hi + r_hi
    absmax = tl.maximum(tl.max(tl.where(x_lo == x_lo, tl.abs(x_lo), float("inf")), axis=1),
                        tl.max(tl.where(x_hi == x_hi, tl.abs(x_hi), float("inf")), axis=1))
    bad = absmax == float("inf")  # see `_quantize_kernel`
    qm = tl.full([BPP], QMAX, tl.float32)
    scale = tl.math.div_rn(absmax, qm)
    inv = tl.minimum(tl.math.div_rn(qm, absmax), _FLT_MAX)
    t_lo = x_lo * inv[:, None]
    t_hi = x_hi * inv[:, None]
    if STOCH:  # the NaN select, clamp and dither as in `_quantize_kernel`; a word's pair index is its offset
        if not INT4:
            t_lo = tl.minimum(tl.maximum(tl.where(t_lo == t_lo, t_lo, 0.0), -QMAX), QMAX)
            t_hi = tl.minimum(tl.maximum(tl.where(t_hi == t_hi, t_hi, 0.0), -QMAX), QMAX)
        w_lo, w_hi = _dither_pairs(offs, _lowbias32(seed.to(tl.uint32)))
        t_lo = t_lo + w_lo
        t_hi = t_hi + w_hi
    m_lo = t_lo + MAGIC
    m_hi = t_hi + MAGIC
    if HAS_RES:
        new_res = _pack_fp32(x_lo - (m_lo - MAGIC) * scale[:, None], x_hi - (m_hi - MAGIC) * scale[:, None])
        if EVEN:
            tl.store(nrw_ptr + offs, new_res)
        else:
            tl.store(nrw_ptr + offs, new_res, mask=valid)
    if EVEN:
        tl.store(s_ptr + rows, scale)
    else:
        tl.store(s_ptr + rows, scale, mask=rows < nblocks)
    q_lo = m_lo.to(tl.uint32, bitcast=True)
    q_hi = m_hi.to(tl.uint32, bitcast=True)
    if INT4:
        q = tl.where(bad[:, None], 0x88, (q_lo & 0xF) | ((q_hi & 0xF) << 4)).to(tl.uint8)
    else:
        q = (q_lo & 0xFF) | ((q_hi & 0xFF) << 8)
        if not STOCH:
            q = tl.where(bad[:, None], 0, q)
        q = q.to(tl.uint16).to(tl.int16, bitcast=True)
    if EVEN:
        tl.store(q_ptr + offs, q)
    else:  # the padding's words are stored too (zeros quantise to q 0)
        tl.store(q_ptr + offs, q, mask=(rows < nblocks)[:, None] & in_block)


@triton.jit
def _dequantize_pairs_kernel(
    q_ptr, s_ptr, outw_ptr, nwords, nblocks,
    BLOCK: tl.constexpr, HALF: tl.constexpr, BPP: tl.constexpr, INT4: tl.constexpr, WIDE: tl.constexpr,
    BF16: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr, STREAM: tl.constexpr,
):
    """`_dequantize_kernel` on words of two elements: q as uint8 (int4) or int16 (int8) per pair, the output as
    int64 words of two fp32 or int32 words of two bf16. VEC = min(2, HALF)."""
    rows, offs, in_block = _tile(tl.program_id(0), BLOCK // 2, HALF, BPP, WIDE)
    valid = in_block & (offs < nwords)
    # Triton gives each memory access of a tile the widest per-thread run its type allows (16 q bytes, 2 int64
    # output words) and converts between the layouts through shared memory. Telling it that q is contiguous only
    # in runs of 2 (true, and all it can use: a thread stores 2 words) gives the q loads the layout of the stores.
    q_ptrs = tl.max_contiguous(q_ptr + offs, [1, VEC])
    if EVEN:
        scale = tl.load(s_ptr + rows)
        b = tl.load(q_ptrs)
    else:
        scale = tl.load(s_ptr + rows, mask=rows < nblocks, other=0.0)
        b = tl.load(q_ptrs, mask=valid, other=0)
    if INT4:  # nibble n as float: the bits of 2**23 + n, minus 2**23 + 8 (as `_dequantize_kernel`)
        b = b.to(tl.uint32)
        lo = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    else:
        lo = b.to(tl.int8).to(tl.float32)  # int16 -> int8 keeps the low byte
        hi = (b >> 8).to(tl.int8).to(tl.float32)
    out_lo = lo * scale[:, None]
    out_hi = hi * scale[:, None]
    if BF16:
        out = (_bf16_bits(out_lo) | (_bf16_bits(out_hi) << 16)).to(tl.int32, bitcast=True)
    else:
        out = _pack_fp32(out_lo, out_hi)
    if EVEN:
        tl.store(outw_ptr + offs, out, cache_modifier=STREAM)
    else:
        tl.store(outw_ptr + offs, out, mask=valid, cache_modifier=STREAM)


def _launch_shape(block: int, numel: int, padded: int, elems_per_program: int | None) -> dict[str, int]:
    """WIDTH (at least 2, so int4's pairs exist even for tiny blocks), blocks per program, programs, and whether
    the tiles cover the elements exactly (no masks needed)."""
    width = max(2, triton.next_power_of_2(block))
    bpp = triton.next_power_of_2(max(1, elems_per_program // width))
    grid = triton.cdiv(padded // block, bpp)
    return dict(WIDTH=width, BPP=bpp, grid=grid, EVEN=width == block and numel % (bpp * block) == 0,
                WIDE=grid * bpp * block >= 2**31)


# Input dtypes the pair kernels read, as (word dtype, XKIND of `_unpack_words`).
_WORDS = {torch.float32: (torch.int64, 0), torch.bfloat16: (torch.int32, 1), torch.float16: (torch.int32, 2)}


def _as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Flat `t` viewed as words of two elements each, or None where it cannot be: an odd length, or a buffer not
    aligned to the word (a view starting at an odd element)."""
    if t.numel() % 2 or not t.is_contiguous() or t.storage_offset() % 2 or t.data_ptr() % dtype.itemsize:
        return None
    return t.view(dtype)


def _pairs_shape(shape: dict[str, int]) -> dict[str, int]:
    """`_launch_shape` for the pair kernels: the same tiles, as words (HALF = WIDTH // 2 words per row)."""
    shape = dict(shape)
    shape["HALF"] = shape.pop("WIDTH") // 2
    return shape


def quantize_blockwise(
    x: torch.Tensor,
    bits: int,
    block: int,
    residual: torch.Tensor | None = None,
    stochastic: bool = False,
    seed: torch.Tensor | None = None,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
    pairs: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as `reference.quantize_blockwise`; `elems_per_program` / `num_warps` tune the launch.

    `pairs`: which kernel (both give the same bits): True the pair kernel, which needs an even block and length,
    fp32 / bf16 / fp16 input and word-aligned buffers (ValueError otherwise); False the element kernel (any
    input); None (default) the kernel's default (`default_config`), falling back to the element kernel where
    the buffers do not allow pairs.
    """
    reference.check_format(bits, block)
    if stochastic and seed is None:
        raise ValueError("stochastic rounding needs a seed (a 0-d integer tensor, new every step)")
    n = x.numel()
    padded = reference.padded_numel(n, bits, block)
    xf = x.reshape(-1)
    q = torch.empty(padded if bits == 8 else padded // 2, dtype=torch.int8 if bits == 8 else torch.uint8,
                    device=x.device)
    scales = torch.empty(padded // block, dtype=torch.float32, device=x.device)
    rf = residual.reshape(-1).to(torch.float32) if residual is not None else None
    new_residual = torch.empty(n, dtype=torch.float32, device=x.device) if residual is not None else None
    if padded == 0:
        return q, scales, (new_residual.view(residual.shape) if residual is not None else None)
    seed_t = seed.reshape(()).to(device=x.device, dtype=torch.int64) if stochastic else scales
    epp, warps, use_pairs = default_config(bits, residual=residual is not None, stochastic=stochastic)
    shape = _launch_shape(block, n, padded, elems_per_program or epp)
    xw = rw = None
    if (use_pairs if pairs is None else pairs) and block % 2 == 0 and x.dtype in _WORDS:
        xw = _as_words(xf, _WORDS[x.dtype][0])
        rw = _as_words(rf, torch.int64) if rf is not None else None
    if xw is not None and (rf is None or rw is not None):
        qw = q.view(torch.int16) if bits == 8 else q
        nrw = new_residual.view(torch.int64) if new_residual is not None else xw
        shape = _pairs_shape(shape)
        _quantize_pairs_kernel[(shape.pop("grid"),)](
            xw, rw if rw is not None else xw, seed_t, qw, scales, nrw, n // 2, padded // block,
            BLOCK=block, QMAX=reference.QMAX[bits], INT4=bits == 4, HAS_RES=residual is not None,
            STOCH=stochastic, MAGIC=1.5 * 2**23 + (8.0 if bits == 4 else 0.0), XKIND=_WORDS[x.dtype][1], **shape,
            num_warps=num_warps or warps, enable_fp_fusion=False,
        )
    elif pairs:
        raise ValueError("the pair kernel needs an even block and length, fp32 / bf16 / fp16 input and "
                         "word-aligned buffers")
    else:
        _quantize_kernel[(shape.pop("grid"),)](
            xf, rf if rf is not None else xf, seed_t, q, scales, new_residual if new_residual is not None else xf,
            n, padded // block,
            BLOCK=block, QMAX=reference.QMAX[bits], INT4=bits == 4, HAS_RES=residual is not None, STOCH=stochastic,
            MAGIC=1.5 * 2**23 + (8.0 if bits == 4 else 0.0), **shape,
            num_warps=num_warps or warps, enable_fp_fusion=False,
        )
    return q, scales, (new_residual.view(residual.shape) if residual is not None else None)


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
    pairs: bool | None = None,
    streaming: bool | None = None,
) -> torch.Tensor:
    """Same contract as `reference.dequantize_blockwise`; `pairs` as in `quantize_blockwise` (the pair kernel
    needs an even block and an even `numel`; for int8 also a 2-byte aligned `q`). `streaming`: store the output
    with the streaming cache hint (`st.global.cs`: written once, not kept in L2; default `STREAMING_STORES`).

    The kernel writes fp32 or bf16; other dtypes (fp16) are cast from fp32 by torch afterwards.
    """
    reference.check_format(bits, block)
    if dtype not in (torch.float32, torch.bfloat16):
        return dequantize_blockwise(q, scales, bits, block, numel, torch.float32, elems_per_program=elems_per_program,
                                    num_warps=num_warps, pairs=pairs, streaming=streaming).to(dtype)
    out = torch.empty(numel, dtype=dtype, device=q.device)
    padded = scales.numel() * block
    if numel == 0:
        return out
    epp, warps, use_pairs = default_config(bits, dequantise=True)
    stream = ".cs" if (STREAMING_STORES if streaming is None else streaming) else ""
    shape = _launch_shape(block, numel, padded, elems_per_program or epp)
    qw = None
    if (use_pairs if pairs is None else pairs) and block % 2 == 0 and numel % 2 == 0:
        qw = _as_words(q.reshape(-1), torch.int16) if bits == 8 else q
    if qw is not None:
        shape = _pairs_shape(shape)
        _dequantize_pairs_kernel[(shape.pop("grid"),)](
            qw, scales, out.view(torch.int64 if dtype == torch.float32 else torch.int32), numel // 2, scales.numel(),
            BLOCK=block, INT4=bits == 4, BF16=dtype == torch.bfloat16, VEC=min(2, shape["HALF"]), STREAM=stream,
            **shape, num_warps=num_warps or warps, enable_fp_fusion=False,
        )
    elif pairs:
        raise ValueError("the pair kernel needs an even block and an even numel")
    else:
        _dequantize_kernel[(shape.pop("grid"),)](
            q, scales, out, numel, scales.numel(),
            BLOCK=block, INT4=bits == 4, BF16=dtype == torch.bfloat16, STREAM=stream, **shape,
            num_warps=num_warps or warps, enable_fp_fusion=False,
        )
    return out

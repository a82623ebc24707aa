"""Blockwise int8 / int4 quantisation in plain torch: the definition the Triton kernels must match bit for bit.

Format (see README, "Quantisation kernels"):
- `x` is flattened and zero-padded to `padded_numel(numel, bits, block)`; block `i` is elements
  `[i * block, (i + 1) * block)` of the padded buffer.
- `scales[i] = absmax_i / qmax` (fp32, IEEE division), `qmax = 127` for int8 and `7` for int4 (symmetric).
- `q = round(clamp(y * inv_i, -qmax, qmax) [+ w])`, rounded half to even; `w` is the stochastic-rounding dither
  (`dither` below; absent for round-to-nearest),
  with `inv_i = min(qmax / absmax_i, FLT_MAX)` (one IEEE division per block, then a multiply per element; the
  `min` makes an all-zero block, and blocks so tiny that `qmax / absmax` overflows, quantise to finite values).
- A block holding a NaN or inf gets `absmax = inf` (NaN counts as inf), so scale inf and q 0 for every element:
  it dequantises to non-finite values (a step with non-finite gradients stays visible) and its new residual is
  NaN.
- int8: `q` is int8, one value per element. int4: `q` is uint8, two values per byte, element `2j` in the low
  nibble and `2j + 1` in the high nibble, each stored offset binary as `value + 8` (so -7..7 -> 1..15).
- Dequantised value: `q * scales[i]` in fp32, cast to the requested dtype.

Everything is shape-static (no `.item()`, no data-dependent shapes), so these functions trace under `make_fx`
in fake mode and compile with Inductor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = {8: 127, 4: 7}
FLT_MAX = torch.finfo(torch.float32).max

# Counter-based random numbers for stochastic rounding. The dither of an element depends only on the seed and the
# element's index in the padded buffer, so the torch reference and the Triton kernel (triton_quant.py imports these
# constants) draw the same bits whatever the kernel's tiling, at a few integer ops per element instead of Philox's
# rounds (tl.rand made stochastic rounding 4x slower than round-to-nearest on an H200). The mixer is Chris
# Wellons' "lowbias32" (a bijection on 32-bit words with low avalanche bias):
#   h ^= h >> 16; h *= MIX1; h ^= h >> 15; h *= MIX2; h ^= h >> 16
# One hash serves a pair of neighbouring elements (16 bits each; the kernels are bound by instructions per element,
# not by memory, once rounding is stochastic): for element i, h = lowbias32((i >> 1) * GOLDEN + lowbias32(seed))
# (mod 2**32), b = the low 16 bits of h for even i, the high 16 bits for odd i, and the dither is
# w = (b + 1/2) * 2**-16 - 1/2, in (-1/2, 1/2), symmetric about 0 and never exactly +-1/2.
# Stochastic rounding is then round-half-even(v + w), which is unbiased: E[round(v + w)] = v.
MIX1 = 0x7FEB352D
MIX2 = 0x846CA68B
GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


def padded_numel(numel: int, bits: int, block: int) -> int:
    """Length of the zero-padded flat buffer that `numel` elements are quantised in (a multiple of `block`)."""
    check_format(bits, block)
    return -(-numel // block) * block


def check_format(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if bits == 4 and block % 2:
        raise ValueError(f"int4 packs two values per byte, so block must be even, got {block}")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`x * c mod 2**32` for int64 `x` in [0, 2**32): split `c` in 16-bit halves so no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit integer mixer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def uniform_hash(seed: torch.Tensor, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`n` fp32 values in [0, 1) (24 random bits each) for element indices 0..n-1 under `seed` (0-d int tensor)."""
    seed = seed.to(device=device, dtype=torch.int64) & _MASK32
    index = torch.arange(n, dtype=torch.int64, device=device)
    key = (_mul32(index, GOLDEN) + lowbias32(seed)) & _MASK32
    return (lowbias32(key) >> 8).to(torch.float32) * (2.0**-24)


def dither(seed: torch.Tensor, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The stochastic-rounding offsets `w` in (-1/2, 1/2) of elements 0..n-1 under `seed` (0-d int tensor)."""
    seed = seed.to(device=device, dtype=torch.int64) & _MASK32
    index = torch.arange(n, dtype=torch.int64, device=device)
    h = lowbias32((_mul32(index >> 1, GOLDEN) + lowbias32(seed)) & _MASK32)
    b = (h >> ((index & 1) * 16)) & 0xFFFF
    return b.to(torch.float32) * 2.0**-16 + (2.0**-17 - 0.5)  # exact: every value lies on the 2**-17 grid


def quantize_blockwise(
    x: torch.Tensor,
    bits: int,
    block: int,
    residual: torch.Tensor | None = None,
    stochastic: bool = False,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference quantiser: `(q, scales, new_residual)`; see the module docstring for the format."""
    check_format(bits, block)
    if stochastic and seed is None:
        raise ValueError("stochastic rounding needs a seed (a 0-d integer tensor, new every step)")
    qmax = QMAX[bits]
    n = x.numel()
    padded = padded_numel(n, bits, block)
    y = x.reshape(-1).to(torch.float32)
    if residual is not None:
        y = y + residual.reshape(-1).to(torch.float32)
    yb = F.pad(y, (0, padded - n)).view(-1, block)
    absmax = torch.where(yb == yb, yb.abs(), torch.inf).amax(dim=1)
    # Tensor / tensor keeps both divisions IEEE on every device (CUDA turns division by a Python scalar into a
    # multiply by its reciprocal, which the Triton kernel would not reproduce).
    qm = torch.full((), float(qmax), dtype=torch.float32, device=x.device)
    scales = absmax / qm
    inv = torch.clamp(qm / absmax, max=FLT_MAX)
    t = yb * inv[:, None]
    # |t| <= qmax (1 + 2**-23) already, so for round-to-nearest the clamp only documents the range; for stochastic
    # rounding it keeps t + w inside (-qmax - 1/2, qmax + 1/2).
    t = torch.clamp(torch.where(t == t, t, 0.0), -qmax, qmax)
    if stochastic:
        t = t + dither(seed, padded, x.device).view(-1, block)
    t = torch.round(t)  # half to even
    new_residual = None
    if residual is not None:
        new_residual = (yb - t * scales[:, None]).reshape(-1)[:n].view(residual.shape)
    if bits == 8:
        q = t.to(torch.int8).reshape(-1)
    else:
        nib = (t + 8).to(torch.uint8).view(-1, 2)
        q = nib[:, 0] | (nib[:, 1] << 4)
    return q, scales, new_residual


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference dequantiser: the first `numel` values of `q * scales` as a flat tensor of `dtype`."""
    check_format(bits, block)
    if bits == 8:
        qf = q.to(torch.float32)
    else:
        b = q.to(torch.int32)
        qf = torch.stack([(b & 15) - 8, (b >> 4) - 8], dim=-1).to(torch.float32)
    out = qf.view(-1, block) * scales[:, None]
    return out.reshape(-1)[:numel].to(dtype)

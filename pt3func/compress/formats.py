"""Gradient exchange formats: what a gradient reduction sends instead of fp32, and how it is summed.

A format is a small frozen object built by a function (`bf16()`, `int8(block=256)`, `topk(0.01)`, ...), in the
shape of an optax transformation: hashable (it is part of the compile-cache key), composable (`chain`,
`skip_small`, `per_leaf`), with no hidden state. `pf.jit(step, grad_exchange=fmt)` hands it to the
`grad_exchange` pass (pt3func/passes/grad_exchange.py), which traces `fmt.reduce` in place of every gradient
all-reduce / reduce-scatter of the program.

Two kinds of leaf formats:

- codecs (`bf16`, `fp16`, `int8`, `int4`) encode a dense buffer; the reduction is two-phase so that encoded
  values are never summed: encode -> all-to-all (each rank receives every rank's copy of its own chunk) ->
  decode and sum in fp32 -> (all-reduce only) encode the sum -> all-gather -> decode.
- `topk` and `powersgd` shrink the gradient first (values + indices, or rank-r factors); a codec chained after
  them (`chain(topk(0.01), bf16())`) encodes what they send.

Error feedback (EF) keeps, per rank and per leaf, what compression dropped and adds it back next step
(Seide et al. 2014 "1-bit SGD"; Karimireddy et al. 2019 "EF-SGD"; Tang et al. 2021 "1-bit Adam" for the second,
server-side residual of a two-phase all-reduce). The residuals live in an explicit `ExchangeState`
(pt3func/compress/state.py) that the step takes and returns.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

_C = torch.ops._c10d_functional

# --------------------------------------------------------------------------------------------- collectives


def _as_bytes(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x`'s bytes as `rows` rows. The dtype view is taken of a 1-D tensor: Inductor (torch 2.11) may give a size-1
    last dim stride 0, and then refuses to view it as another element size."""
    return x.contiguous().reshape(-1).view(torch.uint8).view(rows, -1)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """The inverse of `_as_bytes`: `rows` rows of `dtype` values."""
    return b.contiguous().reshape(-1).view(dtype).view(rows, -1)


@dataclass(frozen=True)
class Reduction:
    """One gradient reduction of the per-device program, as constants of that program."""

    kind: str  # "all_reduce" (data parallel) or "reduce_scatter" (FSDP: dim-0 shards of the result)
    op: str  # "sum" or "avg"
    group_name: str
    world: int  # ranks in the group
    rank: int  # this device's rank in the group
    out_shape: tuple[int, ...]  # shape of the reduction's result on this device
    seed: int = 0  # distinguishes leaves in random streams (stochastic rounding, PowerSGD's fresh Q)


def _all_to_all(rows: torch.Tensor, r: Reduction) -> torch.Tensor:
    """Row i goes to rank i; row i of the result came from rank i."""
    splits = [1] * r.world
    return _C.wait_tensor(_C.all_to_all_single(rows.contiguous(), splits, splits, r.group_name))


def _all_gather(rows: torch.Tensor, r: Reduction) -> torch.Tensor:
    return _C.wait_tensor(_C.all_gather_into_tensor(rows.contiguous(), r.world, r.group_name))


def _all_reduce(x: torch.Tensor, r: Reduction) -> torch.Tensor:
    return _C.wait_tensor(_C.all_reduce(x.contiguous(), "sum", r.group_name))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _chunk(n: int, world: int, align: int) -> tuple[int, int]:
    """(elements per rank's chunk, padded to `align`) for a flat buffer of `n` split over `world` ranks."""
    m = -(-n // world)
    return m, _round_up(m, align)


def _rows(flat: torch.Tensor, world: int, m: int, c: int) -> torch.Tensor:
    """`flat` as `world` contiguous chunks of `m`, each zero-padded to `c`: chunk i is rank i's shard."""
    if world * m != flat.numel():
        flat = F.pad(flat, (0, world * m - flat.numel()))
    rows = flat.view(world, m)
    return rows if c == m else F.pad(rows, (0, c - m))


def _unrows(rows: torch.Tensor, m: int, n: int) -> torch.Tensor:
    if rows.shape[1] != m:
        rows = rows[:, :m]
    flat = rows.reshape(-1)
    return flat if flat.numel() == n else flat[:n]


def _seed(step: torch.Tensor | None, r: Reduction, phase: int) -> torch.Tensor | None:
    """A 0-d int64 seed, new for every step, rank, leaf and phase (stochastic rounding draws from it)."""
    if step is None:
        return None
    return (step.to(torch.int64) * 1_000_003 + (r.seed * 31 + r.rank) * 7 + phase) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------ formats


class Format:
    """Base of every format; see the module docstring. Build formats with the functions of `pf.compress`."""

    #: whether `reduce` reads the step counter of the state (EF does not, schedules and random streams do)
    needs_step: bool = False

    def resolve(self, path: str, shape: tuple[int, ...]) -> Format | None:
        """The leaf format used for the leaf at `path` (e.g. "['fc1']['w']") whose gradient has `shape`
        before the reduction; None sends it uncompressed."""
        return self

    def describe(self) -> str:
        raise NotImplementedError

    def schedule(self) -> tuple[int, ...]:
        """The steps at which this format's program changes (e.g. where a dense warm-up ends), ascending.

        A traced program is static, so a format that sends something else from step N on (uncompressed
        warm-up, a sparsity ramp) is a sequence of programs: `jit` compiles one per phase, chosen on the host
        from the `ExchangeState`'s step counter (see `pt3func.compress.state`). Empty: one program.
        """
        return ()

    def at(self, step: int) -> Format | None:
        """The leaf format in effect from `step` (0 or a value of `schedule()`) until the next change;
        None: the reduction stays uncompressed in that phase."""
        return self

    def state_shapes(self, shape: tuple[int, ...], kind: str, world: int) -> dict[str, tuple[int, ...]]:
        """The per-rank state tensors this leaf needs (names of `LeafState` fields -> local shapes)."""
        return {}

    def initial_state(self, name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
        """The value of state tensor `name` before the first step (zeros unless a format says otherwise)."""
        return torch.zeros(shape, dtype=torch.float32, device=device)

    def reduce(
        self, x: torch.Tensor, state: dict[str, torch.Tensor], step: torch.Tensor | None, r: Reduction
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The compressed reduction of this device's gradient `x`: `(result, new state)` (traced, never run
        eagerly by pt3func itself)."""
        raise NotImplementedError

    def init(self, params: Any, data_axes: str | tuple[str, ...] | None = None) -> Any:
        """The `ExchangeState` of this format for `params` (see `pt3func.compress.state.init`)."""
        from pt3func.compress.state import init

        return init(self, params, data_axes)

    @property
    def needs_state(self) -> bool:
        return self.needs_step

    def __str__(self) -> str:
        return self.describe()


class Codec(Format):
    """A dense encoding: `encode` rows of fp32 into one payload row each, `decode` back to fp32."""

    align: int = 1
    error_feedback: bool = False

    def encode(
        self, rows: torch.Tensor, residual: torch.Tensor | None, seed: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, cols: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def needs_state(self) -> bool:
        return self.error_feedback or self.needs_step

    def state_shapes(self, shape: tuple[int, ...], kind: str, world: int) -> dict[str, tuple[int, ...]]:
        if not self.error_feedback:
            return {}
        out = {"residual": tuple(shape)}
        if kind == "all_reduce":  # the owner of a chunk re-encodes the sum: its own error, its own residual
            out["server_residual"] = (_chunk(math.prod(shape), world, self.align)[1],)
        return out

    def reduce(self, x, state, step, r):
        (out,), (new,) = self.reduce_bucket([x], [state], step, [r])
        return out, new

    def reduce_bucket(
        self,
        xs: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
        step: torch.Tensor | None,
        rs: Sequence[Reduction],
    ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """`reduce` of several leaves at once, through one buffer and one pair of collectives (the grad_exchange
        pass's buckets): `(results, new states)`, one of each per leaf. `rs` are the leaves' reductions, all of
        one kind, op and group. Each leaf's values and state are those `reduce` gives it alone (see
        `two_phase`), but for stochastic rounding, whose stream is the first leaf's, over bucket positions."""
        outs, residuals, servers = two_phase_bucket(
            self, xs, [s.get("residual") for s in states], [s.get("server_residual") for s in states], step, rs
        )
        news = [{k: v for k, v in (("residual", res), ("server_residual", server)) if v is not None}
                for res, server in zip(residuals, servers)]
        return outs, news


def two_phase(
    codec: Codec,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    server: torch.Tensor | None,
    step: torch.Tensor | None,
    r: Reduction,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """All-reduce or reduce-scatter `x` through `codec`, summing in fp32 only: `(result, residual, server)`.

    Chunking the flat buffer into `world` contiguous chunks is the dim-0 sharding of a reduce-scatter; each
    chunk is padded to the codec's block so no block straddles two ranks.
    """
    (out,), (new_res,), (new_server,) = two_phase_bucket(codec, [x], [residual], [server], step, [r])
    return out, new_res, new_server


def two_phase_bucket(
    codec: Codec,
    xs: Sequence[torch.Tensor],
    residuals: Sequence[torch.Tensor | None],
    servers: Sequence[torch.Tensor | None],
    step: torch.Tensor | None,
    rs: Sequence[Reduction],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor | None]]:
    """`two_phase` of several leaves through one buffer: one encode and one collective per phase for all of
    them; lists of `(result, residual, server)`, one entry per leaf (residuals and servers all tensors or all
    None; `rs` of one kind, op and group).

    The buffer lays out, for every rank, that rank's chunk of each leaf in turn, each padded to the block
    (row i = [leaf 0's chunk i | leaf 1's chunk i | ...]): rank i receives exactly its chunk of every leaf (the
    [rank][leaf chunk] layout a bucketed reduce-scatter needs), no block straddles two leaves, and every value,
    scale and residual is the one `two_phase` gives the leaf alone. Only stochastic rounding differs: it draws
    from the first leaf's stream, at bucket positions.
    """
    r, world = rs[0], rs[0].world
    sizes = [x.numel() for x in xs]
    chunks = [_chunk(n, world, codec.align) for n in sizes]  # (m, c) per leaf
    widths = [c for _, c in chunks]
    cols = sum(widths)
    rows = _cat([_rows(x.reshape(-1).to(torch.float32), world, m, c) for x, (m, c) in zip(xs, chunks)], 1)
    res_rows = None
    if residuals[0] is not None:
        res_rows = _cat([_rows(res.reshape(-1), world, m, c) for res, (m, c) in zip(residuals, chunks)], 1)
    payload, new_res_rows = codec.encode(rows, res_rows, _seed(step, r, 0))
    mine = codec.decode(_all_to_all(payload, r), cols).sum(0)  # every rank's copy of my chunks, summed in fp32
    if r.op == "avg":
        mine = mine / world
    # Each leaf's results get buffers of their own (`own`). Added when per-leaf state came back wrong after views
    # of one bucket buffer were fed back; that turned out to be a retrace (a size-1 dim's stride in the cache key,
    # since fixed) whose new exchange-guard trial passed the state through, not a miscompile
    # (tests/test_aliased_inputs.py). Views would now do and save a copy per leaf; kept until measured on a GPU.
    own = _apart if len(xs) > 1 else lambda t, view=True: t
    new_res = [None] * len(xs)
    if new_res_rows is not None:
        new_res = [own(_unrows(part, m, n), world == 1).view(res.shape)
                   for part, (m, _), n, res in zip(_split(new_res_rows, widths, 1), chunks, sizes, residuals)]
    if r.kind == "reduce_scatter":
        outs = [own(part[:m]).view(ri.out_shape).to(x.dtype)
                for part, (m, _), ri, x in zip(_split(mine, widths, 0), chunks, rs, xs)]
        return outs, new_res, [None] * len(xs)
    server_rows = None if servers[0] is None else _cat([s.reshape(1, c) for s, c in zip(servers, widths)], 1)
    payload2, new_server = codec.encode(mine.view(1, cols), server_rows, _seed(step, r, 1))
    full = codec.decode(_all_gather(payload2, r), cols)
    outs = [own(_unrows(part, m, n), world == 1).view(ri.out_shape).to(x.dtype)
            for part, (m, _), n, ri, x in zip(_split(full, widths, 1), chunks, sizes, rs, xs)]
    new_servers = [None] * len(xs)
    if new_server is not None:
        new_servers = [own(part).view(s.shape) for part, s in zip(_split(new_server, widths, 1), servers)]
    return outs, new_res, new_servers


def _apart(t: torch.Tensor, view: bool = True) -> torch.Tensor:
    """`t` in a buffer of its own where it is a view of a bucket's buffer (`view`); else `t`, already a copy."""
    return t.clone(memory_format=torch.contiguous_format) if view else t


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _split(t: torch.Tensor, widths: list[int], dim: int) -> list[torch.Tensor]:
    return [t] if len(widths) == 1 else list(t.split(widths, dim))


@dataclass(frozen=True)
class Cast(Codec):
    """Send values in a 16-bit float type; sums are in fp32 (each rank sums its chunk, then all-gathers)."""

    dtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def encode(self, rows, residual, seed):
        y = rows if residual is None else rows + residual
        q = y.to(self.dtype)
        return q, None if residual is None else y - q.to(torch.float32)

    def decode(self, payload, cols):
        # Not a bare dtype cast, so a pass that moves casts above all-gathers (to gather fewer bytes) cannot
        # widen this payload back to fp32 before it is sent.
        return payload.to(torch.float32, memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class Quantize(Codec):
    """Blockwise symmetric int8 / int4 with one fp32 scale per block (kernels in `pt3func.kernels`)."""

    bits: int = 8
    block: int = 256
    error_feedback: bool = True
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        from pt3func.kernels.reference import check_format

        check_format(self.bits, self.block)

    @property
    def align(self) -> int:  # type: ignore[override]
        return self.block

    @property
    def needs_step(self) -> bool:  # type: ignore[override]
        return self.stochastic_rounding

    def describe(self) -> str:
        parts = [f"int{self.bits}", f"block {self.block}"]
        if self.stochastic_rounding:
            parts.append("stochastic rounding")
        if self.error_feedback:
            parts.append("EF")
        return ", ".join(parts)

    def _qbytes(self, cols: int) -> int:
        return cols if self.bits == 8 else cols // 2

    def encode(self, rows, residual, seed):
        from pt3func.kernels import quantize_blockwise

        n_rows = rows.shape[0]
        q, scales, new_res = quantize_blockwise(
            rows, bits=self.bits, block=self.block, residual=residual,
            stochastic=self.stochastic_rounding, seed=seed if self.stochastic_rounding else None,
        )
        # One payload row per rank: its quantised values, then its scales' bytes (one collective, not two).
        q_bytes, s_bytes = _as_bytes(q, n_rows), _as_bytes(scales, n_rows)
        return torch.cat([q_bytes, s_bytes], dim=1), new_res

    def decode(self, payload, cols):
        from pt3func.kernels import dequantize_blockwise

        n_rows, qb = payload.shape[0], self._qbytes(cols)
        q = payload[:, :qb].contiguous().view(-1)
        if self.bits == 8:
            q = q.view(torch.int8)
        scales = _from_bytes(payload[:, qb:], torch.float32, 1).view(-1)
        out = dequantize_blockwise(q, scales, bits=self.bits, block=self.block, numel=n_rows * cols)
        return out.view(n_rows, cols)


@dataclass(frozen=True)
class TopK(Format):
    """Send the k = ceil(ratio * n) largest-magnitude entries (values and indices) of each rank's gradient."""

    ratio: float = 0.01
    error_feedback: bool = True
    adaptive: bool = False
    total_steps: int | None = None
    alpha: tuple[float, float] = (0.1, 0.01)
    codec: Codec | None = None
    dense_steps: int = 0
    warmup_steps: int = 0
    momentum: float = 0.0
    bucketed: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"topk: ratio must be in (0, 1], got {self.ratio}")
        if self.adaptive and (self.total_steps is None or self.total_steps <= 0):
            raise ValueError("topk(adaptive=True) decays its threshold over a schedule: pass total_steps=N (> 0)")
        if self.dense_steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"topk: dense_steps and warmup_steps must be >= 0, got {self.dense_steps}, "
                             f"{self.warmup_steps}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"topk: momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and not self.error_feedback:
            raise ValueError("topk: momentum correction accumulates velocities in the residual: needs error_feedback")

    @property
    def needs_step(self) -> bool:  # type: ignore[override]
        return self.adaptive or (self.codec is not None and self.codec.needs_step)

    @property
    def needs_state(self) -> bool:
        return self.error_feedback or self.needs_step or bool(self.schedule())

    def describe(self) -> str:
        parts = [f"top-k {self.ratio:g}"]
        if self.dense_steps:
            parts.append(f"dense for {self.dense_steps} steps")
        if self.warmup_steps:
            parts.append(f"sparsity warm-up {'->'.join(f'{r:g}' for r in self.ramp())} over {self.warmup_steps}")
        if self.adaptive:
            parts.append(f"adaptive threshold alpha {self.alpha[0]:g}->{self.alpha[1]:g} over {self.total_steps}")
        if self.codec is not None:
            parts.append(f"values {self.codec.describe()}")
        if self.momentum:
            parts.append(f"momentum correction {self.momentum:g}")
        if self.bucketed:
            parts.append("one selection per bucket")
        if self.error_feedback:
            parts.append("EF")
        return ", ".join(parts)

    def ramp(self) -> tuple[float, ...]:
        """DGC's sparsity warm-up (Lin et al. 2018, section 3.3): the kept ratio starts at 25% and shrinks 4x per
        stage (75%, 93.75%, 98.4%, ... sparsity) while it is above `ratio`; then `ratio` itself."""
        ratios, r = [], 0.25
        while r > self.ratio and self.warmup_steps:
            ratios.append(r)
            r /= 4
        return (*ratios, self.ratio)

    def schedule(self) -> tuple[int, ...]:
        ramp = self.ramp()
        stages = len(ramp) - 1
        marks = [self.dense_steps] if self.dense_steps else []
        marks += [self.dense_steps + (j * self.warmup_steps) // stages for j in range(1, stages + 1)]
        return tuple(sorted(set(m for m in marks if m > 0)))

    def at(self, step: int) -> Format | None:
        if step < self.dense_steps:
            return None
        ramp = self.ramp()
        since = step - self.dense_steps
        stage = len(ramp) - 1 if since >= self.warmup_steps else since * (len(ramp) - 1) // self.warmup_steps
        return replace(self, ratio=ramp[stage], dense_steps=0, warmup_steps=0)

    def k(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.ratio * n)))

    def state_shapes(self, shape, kind, world):
        out = {"residual": tuple(shape)} if self.error_feedback else {}
        if self.momentum:
            out["velocity"] = tuple(shape)
        return out

    def threshold(self, v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """tau = alpha(step) * ||v||_2 / sqrt(d), alpha linear from alpha[0] to alpha[1] over total_steps."""
        return adaptive_alpha(step, self.total_steps, *self.alpha) * torch.linalg.vector_norm(v) / math.sqrt(v.numel())

    def reduce(self, x, state, step, r):
        n = x.numel()
        v = x.reshape(-1).to(torch.float32)
        residual, velocity = state.get("residual"), state.get("velocity")
        if velocity is not None:
            # DGC's momentum correction: accumulate the velocity u = m u + g, not the gradient, so what is sent
            # late is what momentum SGD would have applied meanwhile.
            v = self.momentum * velocity.reshape(-1) + v
            u = v
        if residual is not None:
            v = v + residual.reshape(-1)
        k = self.k(n)
        idx = torch.topk(v.abs(), k, sorted=False).indices
        vals = v.gather(0, idx)
        if self.adaptive:
            # Static shapes: k slots are always sent; entries under the threshold are sent as zeros and stay
            # in the residual.
            vals = torch.where(vals.abs() >= self.threshold(v, step), vals, torch.zeros_like(vals))
        if self.codec is None:
            payload = vals.view(1, k)
        else:
            cols = _round_up(k, self.codec.align)
            payload, _ = self.codec.encode(F.pad(vals, (0, cols - k)).view(1, cols), None, _seed(step, r, 0))
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        value_bytes = _as_bytes(payload, 1)
        packed = torch.cat([value_bytes, _as_bytes(idx.to(index_dtype), 1)], dim=1)
        got = _all_gather(packed, r)  # [world, value bytes + index bytes]
        vb = value_bytes.shape[1]
        got_vals = _from_bytes(got[:, :vb], payload.dtype, r.world)
        if self.codec is not None:
            got_vals = self.codec.decode(got_vals, cols)
        got_idx = _from_bytes(got[:, vb:], index_dtype, r.world)
        new = {}
        # The new state is v less what this rank sent, read back from its own row of the all-gather (the values
        # the other ranks read, bit for bit): a dense tensor, zero off the sent entries, subtracted elementwise.
        # So the state's donated buffer can take its new value: a value read from it at other positions (the
        # gathered top-k entries) must not flow into it except through a kernel of its own (the collective).
        sent = torch.zeros_like(v).scatter(0, got_idx[r.rank].to(torch.int64), got_vals[r.rank, :k])
        if residual is not None:
            new["residual"] = (v - sent).view(residual.shape)
        if velocity is not None:
            # Momentum factor masking (DGC): a sent entry's momentum is dropped with it, else it keeps pushing an
            # already applied direction from a stale value. (Entries sent as zeros, under the adaptive threshold
            # or rounded to zero by a codec, keep theirs, as the residual keeps their whole value.)
            new["velocity"] = torch.where(sent != 0, 0.0, u).view(velocity.shape)
        dense = torch.zeros(n, dtype=torch.float32, device=x.device)
        # One rank at a time: within a rank the indices are distinct, so no two atomic adds race and every rank
        # sums in the same order (replicas of a data-parallel parameter stay bit-identical on GPUs too).
        for i in range(r.world):
            dense = dense.index_add(0, got_idx[i].to(torch.int64), got_vals[i, :k])
        if r.op == "avg":
            dense = dense / r.world
        if r.kind == "reduce_scatter":
            dense = dense.view(r.world, n // r.world)[r.rank]
        return dense.view(r.out_shape).to(x.dtype), new

    def reduce_bucket(
        self,
        xs: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
        step: torch.Tensor | None,
        rs: Sequence[Reduction],
    ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """`bucketed=True`: one selection over the bucket's leaves laid end to end (k = ratio x their total), one
        all-gather; each leaf gets its part of the sum (its rank's shard for a reduce-scatter) and of the state."""
        sizes = [x.numel() for x in xs]
        flat = torch.cat([x.reshape(-1).to(torch.float32) for x in xs])
        state = {name: torch.cat([s[name].reshape(-1) for s in states]) for name in states[0]}
        dense, new = self.reduce(flat, state, step, replace(rs[0], kind="all_reduce", out_shape=(flat.numel(),)))
        outs = []
        for part, x, r in zip(dense.split(sizes), xs, rs):
            if r.kind == "reduce_scatter":
                part = part.view(r.world, -1)[r.rank]
            outs.append(part.reshape(r.out_shape).to(x.dtype))
        news: list[dict[str, torch.Tensor]] = [{} for _ in xs]
        for name, value in new.items():
            for i, part in enumerate(value.split(sizes)):
                news[i][name] = part.view(states[i][name].shape)
        return outs, news


def adaptive_alpha(step: torch.Tensor, total_steps: int, start: float = 0.1, end: float = 0.01) -> torch.Tensor:
    """alpha at `step`: linear from `start` (step 0) to `end` (step >= total_steps), as a 0-d fp32 tensor."""
    frac = torch.clamp(step.to(torch.float32) / total_steps, 0.0, 1.0)
    return start + (end - start) * frac


@dataclass(frozen=True)
class PowerSGD(Format):
    """Rank-r approximation of the gradient as a matrix (shape[0], rest): all-reduce P = M Q, orthogonalise,
    all-reduce Q = M^T P, result P Q^T (Vogels et al. 2019)."""

    rank: int = 4
    error_feedback: bool = True
    warm_start: bool = True
    codec: Codec | None = None
    dense_steps: int = 0
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"powersgd: rank must be at least 1, got {self.rank}")
        if self.dense_steps < 0:
            raise ValueError(f"powersgd: dense_steps must be >= 0, got {self.dense_steps}")
        if self.min_compression_rate < 1.0:
            raise ValueError(f"powersgd: min_compression_rate must be >= 1, got {self.min_compression_rate}")

    @property
    def needs_step(self) -> bool:  # type: ignore[override]
        return not self.warm_start or (self.codec is not None and self.codec.needs_step)

    @property
    def needs_state(self) -> bool:
        return True  # Q (warm start) or the step (a fresh Q each step)

    def describe(self) -> str:
        parts = [f"PowerSGD rank {self.rank}", "warm start" if self.warm_start else "fresh Q each step"]
        if self.dense_steps:
            parts.append(f"dense for {self.dense_steps} steps")
        if self.codec is not None:
            parts.append(f"factors {self.codec.describe()}")
        if self.error_feedback:
            parts.append("EF")
        return ", ".join(parts)

    def resolve(self, path, shape):
        # Vectors, and matrices whose factors are not `min_compression_rate` times smaller than they are, go
        # uncompressed (torch's PowerSGD hook and the authors' code: rate 2 by default).
        if len(shape) < 2:
            return None
        a, b = shape[0], math.prod(shape[1:])
        if self.rank >= min(a, b) or (a + b) * self.rank * self.min_compression_rate > a * b:
            return None
        return self

    def schedule(self) -> tuple[int, ...]:
        return (self.dense_steps,) if self.dense_steps else ()

    def at(self, step: int) -> Format | None:
        return None if step < self.dense_steps else replace(self, dense_steps=0)

    def state_shapes(self, shape, kind, world):
        out = {"residual": tuple(shape)} if self.error_feedback else {}
        if self.warm_start:
            out["q"] = (math.prod(shape[1:]), self.rank)
        return out

    def initial_state(self, name, shape, seed, device):
        if name != "q":
            return super().initial_state(name, shape, seed, device)
        # The same on every rank (the sum of M_i Q needs one Q), drawn from a fixed per-leaf seed.
        return _uniform_matrix(torch.full((), seed, dtype=torch.int64, device=device), shape)

    def reduce(self, x, state, step, r):
        a = x.shape[0]
        m = x.reshape(a, -1).to(torch.float32)
        residual = state.get("residual")
        if residual is not None:
            m = m + residual.reshape(a, -1)
        if self.warm_start:
            q = state["q"]
        else:
            q = _uniform_matrix(_seed(step, replace(r, rank=0), 2), (m.shape[1], self.rank))
        p = self._sum(m @ q, step, r, 0)
        p = torch.linalg.qr(p).Q  # every rank orthogonalises the same summed P
        q_local = m.t() @ p
        if residual is not None and self.codec is not None:
            q_sum, q_sent = self._sum_sent(q_local, step, r)
        else:
            q_sum, q_sent = self._sum(q_local, step, r, 1), q_local
        approx = p @ q_sum.t()
        new = {}
        if residual is not None:
            new["residual"] = (m - p @ q_sent.t()).view(residual.shape)
        if self.warm_start:
            new["q"] = q_sum
        if r.op == "avg":
            approx = approx / r.world
        flat = approx.reshape(-1)
        if r.kind == "reduce_scatter":
            flat = flat.view(r.world, -1)[r.rank]
        return flat.view(r.out_shape).to(x.dtype), new

    def _sum_sent(self, q: torch.Tensor, step: torch.Tensor | None, r: Reduction) -> tuple[torch.Tensor, torch.Tensor]:
        """Q's sum through the codec, and the part of it this rank is answerable for: its own Q less its rounding
        error, less the error of re-encoding the chunk of the sum it owns (the delivered sum is the ranks' parts
        summed). Error feedback keeps `m - p @ part.t()`, so the codec's rounding is fed back as well."""
        rq = replace(r, kind="all_reduce", op="sum", out_shape=tuple(q.shape), seed=r.seed * 3 + 1)
        m, c = _chunk(q.numel(), r.world, self.codec.align)
        summed, error, server = two_phase(self.codec, q, torch.zeros_like(q), q.new_zeros(c), step, rq)
        owned = q.new_zeros(r.world, c)
        owned[r.rank] = server.reshape(-1)
        return summed, q - error - _unrows(owned, m, q.numel()).view(q.shape)

    def _sum(self, factor: torch.Tensor, step: torch.Tensor | None, r: Reduction, phase: int) -> torch.Tensor:
        if self.codec is None:
            return _all_reduce(factor, r)
        summed, _, _ = two_phase(
            self.codec, factor, None, None, step,
            replace(r, kind="all_reduce", op="sum", out_shape=tuple(factor.shape), seed=r.seed * 3 + phase),
        )
        return summed


def _uniform_matrix(seed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    from pt3func.kernels.reference import uniform_hash

    return (uniform_hash(seed, math.prod(shape), seed.device) - 0.5).view(shape)


@dataclass(frozen=True)
class SkipSmall(Format):
    """`fmt` for leaves of at least `min_numel` elements; smaller ones (biases, norms) go uncompressed."""

    inner: Format
    min_numel: int

    def resolve(self, path, shape):
        return None if math.prod(shape) < self.min_numel else self.inner.resolve(path, shape)

    def schedule(self) -> tuple[int, ...]:
        return self.inner.schedule()

    def describe(self) -> str:
        return f"{self.inner.describe()} (leaves of {self.min_numel}+ elements)"


@dataclass(frozen=True)
class PerLeaf(Format):
    """The format `select(path, shape)` returns for each leaf (None: uncompressed)."""

    select: Callable[[str, tuple[int, ...]], Format | None]

    def resolve(self, path, shape):
        chosen = self.select(path, tuple(shape))
        return None if chosen is None else chosen.resolve(path, shape)

    def describe(self) -> str:
        return f"per leaf ({getattr(self.select, '__name__', 'select')})"


@dataclass(frozen=True)
class NoCompression(Format):
    """Every gradient reduction stays as traced (fp32 or the gradient's dtype)."""

    def resolve(self, path, shape):
        return None

    def describe(self) -> str:
        return "uncompressed"


def exchange_shape(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    """The shape a format sees for a gradient of `shape` and `dtype`: a complex gradient is exchanged as its real
    view (`torch.view_as_real`, shape `(*shape, 2)`), so every format sends, sums and error-corrects its real and
    imaginary parts alike (formats compute in fp32 and would otherwise drop the imaginary part)."""
    return (*shape, 2) if dtype.is_complex else tuple(shape)


def leaf_seed(path: str) -> int:
    """A stable per-leaf integer (the same in every process, unlike `hash`)."""
    return zlib.crc32(path.encode()) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------ builders


def bf16() -> Format:
    """Send gradients as bfloat16: 2 bytes per element; each rank sums its chunk in fp32.

    Two-phase (all-to-all of bf16, fp32 sum, all-gather of the bf16 sum), so no value is ever summed in
    bf16. For reduce-scatter (FSDP) the fp32 sum of the own chunk is the result.
    """
    return Cast(torch.bfloat16)


def fp16() -> Format:
    """Send gradients as float16 (2 bytes per element, finer mantissa than bf16, overflows past 65504);
    same two-phase scheme as `bf16`."""
    return Cast(torch.float16)


def int8(block: int = 256, error_feedback: bool = True, stochastic_rounding: bool = False) -> Format:
    """Blockwise int8 with an fp32 scale per `block` elements: 1 + 4/block bytes per element.

    The quantised gradient reduction of ZeRO++ (qgZ, Wang et al. 2023): quantise -> all-to-all -> dequantise
    and sum in fp32 -> (all-reduce) re-quantise -> all-gather -> dequantise; quantised values are never
    summed. `error_feedback` keeps what rounding dropped and adds it back next step (EF-SGD, Karimireddy et
    al. 2019; both the sender's and the chunk owner's error, as 1-bit Adam, Tang et al. 2021).
    `stochastic_rounding` rounds up or down at random, unbiased, from a counter-based hash of the step.
    """
    return Quantize(8, block, error_feedback, stochastic_rounding)


def int4(block: int = 128, error_feedback: bool = True, stochastic_rounding: bool = False) -> Format:
    """Blockwise int4 (two values per byte) with an fp32 scale per `block` elements: 0.5 + 4/block bytes per
    element. Same scheme and references as `int8`; 15 levels per block make error feedback all but required."""
    return Quantize(4, block, error_feedback, stochastic_rounding)


def topk(
    ratio: float = 0.01,
    error_feedback: bool = True,
    adaptive: bool = False,
    total_steps: int | None = None,
    *,
    dense_steps: int = 0,
    warmup_steps: int = 0,
    momentum: float = 0.0,
    bucketed: bool = False,
) -> Format:
    """Top-k sparsification: each rank sends its k = ceil(ratio * n) largest |values| and their int32 indices
    (8k bytes, all-gathered), the receivers scatter-add them into a dense fp32 sum.

    `bucketed=True` selects over a whole bucket of leaves at once (`pf.config.grad_exchange_bucket_bytes`, the
    leaves reduced together over one group; a small model is one bucket): k = ratio x the bucket's elements go
    where the largest magnitudes are, not ratio x each leaf (global top-k, Shi et al. 2019), in one
    all-gather per bucket instead of one per leaf.

    Deep Gradient Compression (Lin et al. 2018) with error feedback (the unsent entries accumulate in the
    residual). `adaptive=True` adds the seed document's threshold (section 3.3): tau = alpha * ||v||_2 /
    sqrt(d) over the vector being compressed (gradient + residual), alpha decaying linearly from 0.1 to 0.01
    over `total_steps`; the k slots stay (static shapes), entries under tau are sent as zeros and kept in
    the residual.

    DGC's remedies for early training and momentum, each off by default:

    - `dense_steps=N`: the first N steps all-reduce the gradient uncompressed (fp32), as PowerSGD's
      `start_powerSGD_iter`; the residual starts accumulating at step N.
    - `warmup_steps=W`: DGC's sparsity warm-up: after the dense steps, the kept ratio starts at 25% and shrinks
      4x per stage (25%, 6.25%, 1.56%, ...) down to `ratio`, in equal stages over W steps.
    - `momentum=m`: DGC's momentum correction and momentum factor masking: each rank accumulates the velocity
      u = m u + g instead of g, and an entry's velocity is cleared when it is sent. Meant for an optimizer
      without momentum of its own (DGC replaces momentum SGD's momentum by it).

    Phases (dense, each warm-up stage, then `ratio`) are separate static programs: `jit` picks one per step
    from the `ExchangeState`'s step counter, so `comm_bytes` / `as_text()` of a step show what it sends.
    """
    return TopK(ratio, error_feedback, adaptive, total_steps, dense_steps=dense_steps, warmup_steps=warmup_steps,
                momentum=momentum, bucketed=bucketed)


def powersgd(
    rank: int = 4,
    error_feedback: bool = True,
    warm_start: bool = True,
    *,
    dense_steps: int = 0,
    min_compression_rate: float = 2.0,
) -> Format:
    """PowerSGD (Vogels et al., NeurIPS 2019): one power-iteration step per reduction on the gradient as a
    matrix M (shape[0], rest): P = M Q, all-reduce P, orthogonalise, Q = M^T P, all-reduce Q, result P Q^T.

    Sends (rows + cols) * rank fp32 values instead of rows * cols. With `warm_start` the summed Q is kept in
    the state for the next step. 1-D leaves, and matrices whose factors are not at least
    `min_compression_rate` times smaller than they are, go uncompressed (torch's PowerSGD hook and the
    authors' code use 2). `dense_steps=N` all-reduces every gradient uncompressed for the first N steps
    (torch's `start_powerSGD_iter`: "the beginning of training is usually very sensitive to inaccurate
    gradients"); from step N on the program is PowerSGD's (jit compiles both, and picks one per step from
    the `ExchangeState`'s step counter).

    For a byte budget, a higher rank with int8 factors usually beats rank r in fp32: `chain(powersgd(14),
    int8())` sends about rank 4's bytes, and in README's char-GPT benchmark it came within 2% of fp32's loss
    where rank 4 was 8-10% behind.
    """
    return PowerSGD(rank, error_feedback, warm_start, dense_steps=dense_steps,
                    min_compression_rate=min_compression_rate)


def chain(first: Format, codec: Format) -> Format:
    """`first` (topk or powersgd) with what it sends encoded by `codec` (bf16, fp16, int8, int4).

    `chain(topk(0.01), bf16())` sends top-k values as bf16 (6 bytes per kept entry with its index);
    `chain(powersgd(4), bf16())` all-reduces the factors through bf16. Error feedback is `first`'s: it keeps
    the codec's rounding error too (the codec's own `error_feedback` flag is not used here).
    """
    if not isinstance(first, (TopK, PowerSGD)):
        raise TypeError(f"chain(first, codec): first must be topk(...) or powersgd(...), got {first.describe()}")
    if not isinstance(codec, Codec):
        raise TypeError(f"chain(first, codec): codec must be bf16(), fp16(), int8() or int4(), got {codec}")
    return replace(first, codec=replace(codec, error_feedback=False) if isinstance(codec, Quantize) else codec)


def skip_small(fmt: Format, min_numel: int = 4096) -> Format:
    """`fmt` for every leaf of at least `min_numel` elements; smaller leaves (biases, norm scales) are sent
    uncompressed, where compression saves little and costs accuracy and latency."""
    return SkipSmall(fmt, min_numel)


def per_leaf(select: Callable[[str, tuple[int, ...]], Format | None]) -> Format:
    """Choose a format per leaf: `select(path, shape)` gets the leaf's path inside the parameters (as
    `"['fc1']['w']"`) and its gradient's shape, and returns a format or None (uncompressed). `select` must be
    a function of its arguments only (the choice is made once per traced program)."""
    return PerLeaf(select)


def none() -> Format:
    """No compression: `pf.jit(grad_exchange=pf.compress.none())` is the same program as without it."""
    return NoCompression()

"""Peak memory of an Inductor-compiled program, read from the Python wrapper Inductor generated for it.

The wrapper's `call(args)` is the program as it runs: every buffer it allocates (`empty_strided_*`), every
buffer an extern or fallback kernel returns (sized by the `assert_size_stride` that follows it), every reuse
(`bufB = bufA; del bufA  # reuse`), view (`reinterpret_tensor`) and free (`del buf`). Replaying those
statements over storage sizes gives the bytes the program holds at each point, after fusion (a pointwise op
fused into its consumer allocates nothing) and after Inductor's buffer reuse, which is what the caching
allocator sees. Not seen: workspaces that kernels allocate inside themselves (cuBLAS, flash-attention
backward), a few MiB each.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; the CPU allocator does not round.
_ROUND = {"cuda": 512}

_ASSIGN = re.compile(r"^(\w+) = (.*)$")
_EMPTY = re.compile(r"^(?:torch\.)?empty_strided(?:_(\w+))?\(\(([^()]*)\), \(([^()]*)\), torch\.(\w+)")
_REINTERPRET = re.compile(r"^reinterpret_tensor\((\w+),")
_GETITEM = re.compile(r"^(\w+)\[(\d+)\]$")
_NAME = re.compile(r"^\w+$")
_ASSERT = re.compile(r"^assert_size_stride\((\w+), \(([^()]*)\), \(([^()]*)\)")
_OP_CALL = re.compile(r"^((?:torch\.ops|extern_kernels|aten)\.[\w.]+)\((.*)$")
_FIRST_TENSOR = re.compile(r"(?:reinterpret_tensor\()?\b(buf\w+|arg\w+|primals_\w+|workspace\w*)\b")

# Outputs of fallback kernels whose dtype is not their first input's (attention statistics are fp32).
_FP32_OUTPUTS = {
    "_scaled_dot_product_flash_attention": {1},
    "_scaled_dot_product_efficient_attention": {1},
    "_scaled_dot_product_cudnn_attention": {1},
    "_scaled_dot_product_flash_attention_for_cpu": {1},
    "_flash_attention_forward": {1},
    "_efficient_attention_forward": {1},
}


@dataclass
class WrapperMemory:
    """What replaying the wrapper found: bytes beyond the program's arguments."""

    peak_bytes: int  # most bytes the program itself held at once (temporaries and new outputs)
    output_bytes: int  # bytes of the new (not input-aliased) storages it returns
    peak_statement: str  # the statement at which the peak was reached
    unsized: list[str] = field(default_factory=list)  # buffers returned by kernels with no size assertion
    # (buffer name, bytes) of every storage the program holds at its peak, largest first: what to attack
    live_at_peak: list[tuple[str, int]] = field(default_factory=list)


def wrapper_memory(
    source: str, device_type: str, input_dtypes: Sequence[torch.dtype] = ()
) -> WrapperMemory | None:
    """Replay the allocations of the generated wrapper `source`; None when it has no `call(args)` to read.

    `device_type` ("cuda", "cpu") decides the allocator's rounding. `input_dtypes` maps the wrapper's
    `input_dtypes` are the program's inputs' dtypes, in order: a kernel's output is taken to have its first
    tensor argument's dtype when the wrapper does not say (fallback kernels).
    """
    body = _call_body(source)
    if body is None:
        return None
    statements = [s for line in body for s in _statements(line)]
    sizes: dict[str, tuple[list[int], list[int]]] = {}
    elements: dict[str, list[tuple[str, int]]] = {}
    for stmt in statements:
        m = _ASSERT.match(stmt)
        if m and m.group(1) not in sizes:
            parsed = _ints(m.group(2)), _ints(m.group(3))
            if parsed[0] is not None and parsed[1] is not None:
                sizes[m.group(1)] = parsed  # type: ignore[assignment]
        m = _ASSIGN.match(stmt)
        if m:
            g = _GETITEM.match(m.group(2))
            if g:
                elements.setdefault(g.group(1), []).append((m.group(1), int(g.group(2))))

    dtypes: dict[str, torch.dtype] = {}
    unpack = next((s for s in statements if s.endswith("= args")), None)
    if unpack is not None:
        dtypes.update(zip(re.findall(r"\w+", unpack[: -len("= args")]), input_dtypes))
    names: dict[str, list[int]] = {}  # name -> storage ids it keeps alive
    refs: dict[int, int] = {}  # storage id -> number of names holding it
    nbytes: dict[int, int] = {}
    first_name: dict[int, str] = {}  # storage id -> the name it was allocated under
    live = peak = 0
    live_at_peak: list[tuple[str, int]] = []
    peak_stmt = ""
    unsized: list[str] = []
    returned: set[int] = set()
    element_storage: dict[str, int] = {}  # tuple element name -> its storage, allocated with the tuple
    round_to = _ROUND.get(device_type, 1)

    def allocate(size: int, name: str) -> int:
        nonlocal live
        sid = len(nbytes)
        nbytes[sid] = size
        first_name[sid] = name
        refs[sid] = 0
        live += size
        return sid

    def bind(name: str, sids: list[int]) -> None:
        release(name)
        names[name] = sids
        for sid in sids:
            refs[sid] += 1

    def release(name: str) -> None:
        nonlocal live
        for sid in names.pop(name, ()):
            refs[sid] -= 1
            if refs[sid] == 0:
                live -= nbytes[sid]

    for stmt in statements:
        if stmt.startswith("del "):
            for name in stmt[4:].split(","):
                release(name.strip())
            continue
        if stmt.startswith("return"):
            for name in re.findall(r"\w+", stmt[len("return") :]):
                returned.update(names.get(name, ()))
            continue
        m = _ASSIGN.match(stmt)
        if not m:
            continue
        target, value = m.groups()
        if (e := _EMPTY.match(value)) is not None:
            device, shape, stride, dtype_name = e.groups()
            dtype = getattr(torch, dtype_name)
            dtypes[target] = dtype
            storage = _storage_bytes(_ints(shape), _ints(stride), dtype, _ROUND.get(device or device_type, 1))
            if storage is None:
                unsized.append(target)
                storage = 0
            bind(target, [allocate(storage, target)])
        elif (r := _REINTERPRET.match(value)) is not None or _NAME.match(value):
            source_name = r.group(1) if r else value
            if source_name in names:
                dtypes.setdefault(target, dtypes.get(source_name, torch.float32))
                bind(target, list(names[source_name]))
        elif _GETITEM.match(value) is not None:
            if target in element_storage:
                bind(target, [element_storage[target]])
        elif (op := _OP_CALL.match(value)) is not None:
            if "wait_tensor" in op.group(1):  # returns its argument
                arg = _FIRST_TENSOR.search(op.group(2))
                if arg and arg.group(1) in names:
                    bind(target, list(names[arg.group(1)]))
                continue
            first = _FIRST_TENSOR.search(op.group(2))
            dtype = dtypes.get(first.group(1), torch.float32) if first else torch.float32
            outs = elements.get(target)
            if outs is None:  # one tensor
                storage = _storage_for(target, sizes, dtype, round_to, unsized)
                dtypes[target] = dtype
                bind(target, [allocate(storage, target)])
            else:  # a tuple: allocate each element the wrapper takes out of it, here, where the kernel runs
                fp32 = _FP32_OUTPUTS.get(op.group(1).split(".")[-2], set())
                sids = []
                for name, index in outs:
                    edtype = torch.float32 if index in fp32 else dtype
                    dtypes[name] = edtype
                    element_storage[name] = allocate(_storage_for(name, sizes, edtype, round_to, unsized), name)
                    sids.append(element_storage[name])
                bind(target, sids)
        else:
            continue
        if live > peak:
            peak, peak_stmt = live, stmt
            live_at_peak = [(first_name[sid], nbytes[sid]) for sid, count in refs.items() if count > 0]
    output_bytes = sum(nbytes[sid] for sid in returned)
    live_at_peak.sort(key=lambda item: -item[1])
    return WrapperMemory(peak, output_bytes, peak_stmt, unsized, live_at_peak)


def _call_body(source: str) -> list[str] | None:
    lines = source.splitlines()
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith(("def call(args)", "def call(self, args)")):
            indent = len(line) - len(stripped)
            body = []
            for inner in lines[i + 1 :]:
                text = inner.strip()
                if text and len(inner) - len(inner.lstrip()) <= indent:
                    break
                if text and not text.startswith("#"):
                    body.append(text)
            return body
    return None


def _statements(line: str) -> list[str]:
    # Inductor's trailing comments are `  # reuse`, `  # alias`; kernel arguments carry no '#'.
    code = line.split("  #", 1)[0]
    return [s.strip() for s in code.split("; ") if s.strip()]


def _ints(text: str) -> list[int] | None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return [int(p) for p in parts]
    except ValueError:  # a symbolic size (dynamic shapes)
        return None


def _storage_bytes(shape: list[int] | None, stride: list[int] | None, dtype: torch.dtype, round_to: int) -> int | None:
    if shape is None or stride is None:
        return None
    if any(s == 0 for s in shape):
        return 0
    elements = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return math.ceil(elements * dtype.itemsize / round_to) * round_to


def _storage_for(
    name: str, sizes: dict[str, tuple[list[int], list[int]]], dtype: torch.dtype, round_to: int, unsized: list[str]
) -> int:
    if name not in sizes:
        unsized.append(name)
        return 0
    shape, stride = sizes[name]
    return _storage_bytes(shape, stride, dtype, round_to) or 0

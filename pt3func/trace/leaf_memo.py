"""The signature of a call whose DTensor leaves the previous call returned, without reading each one again.

A cached call must know its signature (every leaf's shape, dtype, layout, placements) before it launches
anything, and on a GPU that host work is time the device sits idle: for a data parallel step's ~300 DTensor
leaves, reading them cost ~0.5 ms a call, about 1% of the anchor step. But a training loop passes back what the
last call returned (`params, opt_state = step(params, opt_state, batch)`), and the program that made those
values knows their signature already. So each call remembers, by object identity, the key of every DTensor it
returned and of every DTensor input it left valid (a batch passed again); the next call takes those objects'
keys from the memo and computes only the others. When the keys are those of the previous call, that call's
program is reused without hashing the signature.

A remembered key is used only for the same object (a weak reference: ids are reused once an object is gone),
of the same class (a leaf donated to any program changes class) and with the same `DTensorSpec` object: DTensor
has no in-place op that changes a tensor's shape, stride or placements (`t_`, `unsqueeze_`, `resize_` have no
sharding rule), and any op that changes its layout installs a new spec. Plain tensors can change their shape in
place (`t_()`), so their keys are always read.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

Key = Any


class LastCall(NamedTuple):
    """The previous call's signature and a weak reference to the program it ran (held strongly, a thread's last
    call kept a dropped program, and the parameters it captured, alive)."""

    treedef: Any
    static: tuple
    leaf_keys: tuple
    key: Any
    compiled: Any  # weakref.ref to the Compiled


class LeafKeyMemo:
    """Per-thread memory of leaf keys (rank threads of a virtual mesh each keep their own)."""

    def __init__(self, leaf_key: Callable[[Any], Key]):
        self._leaf_key = leaf_key
        self._local = threading.local()

    def keys(self, leaves: Sequence[Any]) -> list[Key]:
        """Each leaf's key: remembered for a DTensor the last call returned or kept, else read."""
        known = getattr(self._local, "known", None) or {}
        keys = []
        read = self._leaf_key
        for leaf in leaves:
            if type(leaf) is torch.Tensor:  # never remembered (see the module's note)
                keys.append(read(leaf))
                continue
            hit = known.get(id(leaf))
            if hit is not None and hit[0]() is leaf and type(leaf) is hit[1] and leaf._spec is hit[2]:
                keys.append(hit[3])
            else:
                keys.append(read(leaf))
        return keys

    def last(self) -> LastCall | None:
        """What `remember` was last given as `last`."""
        return getattr(self._local, "last", None)

    def remember(
        self,
        leaves: Sequence[Any],
        keys: Sequence[Key],
        still_valid: Callable[[int], bool],
        outputs: Sequence[Any],
        output_keys: Sequence[Key],
        last: LastCall,
    ) -> None:
        """After a call: the inputs it left valid and the tensors it returned, with their keys."""
        old = getattr(self._local, "known", None) or {}
        known: dict[int, tuple[weakref.ref, type, Any, Key]] = {}
        for i, (leaf, key) in enumerate(zip(leaves, keys)):
            if isinstance(leaf, DTensor) and still_valid(i):
                hit = old.get(id(leaf))
                fresh = hit is None or hit[0]() is not leaf or hit[3] is not key
                known[id(leaf)] = (weakref.ref(leaf), type(leaf), leaf._spec, key) if fresh else hit
        for out, key in zip(outputs, output_keys):
            if isinstance(out, DTensor) and key is not None:
                known[id(out)] = (weakref.ref(out), type(out), out._spec, key)
        self._local.known = known
        self._local.last = last

    def forget(self) -> None:
        self._local.known = {}
        self._local.last = None

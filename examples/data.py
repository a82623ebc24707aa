"""Character-level text from the source of Python's own standard library.

Every machine that runs Python has this corpus on disk, so the examples train on real text offline and
get the same bytes on every run with the same Python version.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4_000_000

# Third-party code, test suites and machine-generated tables (codec maps, pydoc's topic dump, build-time
# sysconfig data) are not the hand-written Python we want the model to learn.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
)
_EXCLUDED_PREFIXES = ("_sysconfigdata",)

OOV = "\x00"
"""Stands for every character the training text does not contain (id 0)."""


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's hand-written `.py` files under `root` (default: this Python's), sorted."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages, which can be far bigger than the stdlib.
        subdirs[:] = [name for name in subdirs if name not in _EXCLUDED_DIRS]
        files += [
            Path(directory, name) for name in names if name.endswith(".py") and not name.startswith(_EXCLUDED_PREFIXES)
        ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_text(max_bytes: int = DEFAULT_MAX_BYTES, root: str | Path | None = None) -> str:
    """The first `max_bytes` bytes of the standard library's source, files concatenated in sorted order."""
    chunks: list[bytes] = []
    size = 0
    for path in stdlib_files(root):
        if size >= max_bytes:
            break
        chunks.append(path.read_bytes())
        size += len(chunks[-1]) + 1
    if not chunks:
        raise FileNotFoundError(f"no standard-library .py files found under {root or sysconfig.get_paths()['stdlib']}")
    # A cut through a multi-byte character leaves an undecodable tail: drop it.
    return b"\n".join(chunks)[:max_bytes].decode("utf-8", errors="ignore")


@dataclass(frozen=True)
class CharDataset:
    """Train/validation token ids (int64, 1-D) and the character vocabulary that maps them to text."""

    train: torch.Tensor
    val: torch.Tensor
    chars: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of `text`; characters outside the vocabulary become the OOV id 0."""
        index = {ch: i for i, ch in enumerate(self.chars)}
        return torch.tensor([index.get(ch, 0) for ch in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text that `ids` stand for (OOV shows as U+FFFD)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join("\ufffd" if i == 0 else self.chars[i] for i in ids)


def load_dataset(
    max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1, root: str | Path | None = None
) -> CharDataset:
    """Standard-library source as character ids: the last `val_fraction` of the text is validation.

    The vocabulary is every character of the training text, plus the OOV id 0 for characters that only
    the validation text contains.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    text = load_text(max_bytes, root)
    split = int(len(text) * (1.0 - val_fraction))
    train_text, val_text = text[:split], text[split:]
    chars = (OOV, *sorted(set(train_text) - {OOV}))
    lookup = torch.zeros(max(map(ord, text)) + 1, dtype=torch.int64)
    lookup[torch.tensor([ord(ch) for ch in chars[1:]], dtype=torch.int64)] = torch.arange(1, len(chars))

    def to_ids(part: str) -> torch.Tensor:
        codepoints = torch.frombuffer(bytearray(part.encode("utf-32-le")), dtype=torch.int32).long()
        return lookup[codepoints]

    return CharDataset(train=to_ids(train_text), val=to_ids(val_text), chars=chars)


def get_batch(
    data: torch.Tensor, batch: int, seq: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random windows: inputs `x` and next-character targets `y`, both int64 (batch, seq)."""
    if data.numel() <= seq:
        raise ValueError(f"need more than seq={seq} tokens, the split has {data.numel()}")
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def batches(data: torch.Tensor, batch: int, seq: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless, reproducible stream of `get_batch` draws: the same `seed` gives the same batches."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield get_batch(data, batch, seq, generator)


def unigram_baseline(train: torch.Tensor, val: torch.Tensor, vocab_size: int | None = None) -> float:
    """Cross-entropy (nats/char) of `val` under add-one-smoothed character frequencies of `train`.

    A model that ignores context entirely can reach this; a language model has to beat it.
    """
    vocab_size = vocab_size or int(max(train.max(), val.max())) + 1
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    log_probs = counts.log() - math.log(float(counts.sum()))
    return float(-log_probs[val].mean())

"""Command-line value types the examples share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type for counts that must be at least 1 (steps, batch sizes, intervals)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`"2x2"` -> ((2, 2), ("dp", "tp")); `"4"` -> ((4,), ("dp",))."""
    try:
        shape = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise ValueError(f"--mesh takes DPxTP or DP, e.g. 2x2 or 4; got {text!r}")
    return shape, ("dp", "tp")[: len(shape)]

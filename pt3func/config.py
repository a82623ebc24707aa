"""Process-wide switches (`pf.config.explain_cache_misses = True`, ...)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Config:
    explain_cache_misses: bool = False
    """Log, at WARNING on logger `pt3func.jit`, why a jitted call traced again."""

    strict_donation: bool = False
    """Raise `DonationError` instead of warning when a donated buffer cannot be reused."""


config = Config()

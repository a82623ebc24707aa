"""pt3func: JAX-style functional training for PyTorch."""

from pt3func import tree
from pt3func.config import config
from pt3func.errors import (
    DataDependentControlFlowError,
    DonationError,
    ImpureFunctionError,
    ShardingError,
    TracingError,
)

__all__ = [
    "DataDependentControlFlowError",
    "DonationError",
    "ImpureFunctionError",
    "ShardingError",
    "TracingError",
    "config",
    "tree",
]

"""Checkpoints: `CheckpointManager` saves and restores any pytree (params, optimizer state, step, RNG, data
position) with torch.distributed.checkpoint, asynchronously and atomically, and reshards on restore.
"""

from pt3func.checkpointing.errors import CheckpointError
from pt3func.checkpointing.manager import CheckpointManager
from pt3func.checkpointing.rng import rng_state, set_rng_state

__all__ = ["CheckpointError", "CheckpointManager", "rng_state", "set_rng_state"]

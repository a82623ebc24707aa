"""SPMD programming: `shard_map` and the `lax` collectives it runs."""

from pt3func.spmd import collectives as lax
from pt3func.spmd.shard_map import shard_map

__all__ = ["lax", "shard_map"]

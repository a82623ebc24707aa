"""Meshes, partition specs and placing pytrees on a mesh."""

from pt3func.sharding import op_rules  # noqa: F401  (registers sharding rules DTensor lacks)
from pt3func.sharding.mesh import Mesh, get_mesh, make_mesh, set_mesh
from pt3func.sharding.put import (
    device_get,
    device_put,
    make_array_from_process_local_data,
    sharding_of,
    with_sharding_constraint,
)
from pt3func.sharding.spec import NamedSharding, P, PartitionSpec, placements_for, spec_from_placements
from pt3func.sharding.visualize import visualize_sharding

__all__ = [
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "device_get",
    "device_put",
    "get_mesh",
    "make_array_from_process_local_data",
    "make_mesh",
    "placements_for",
    "set_mesh",
    "sharding_of",
    "spec_from_placements",
    "visualize_sharding",
    "with_sharding_constraint",
]

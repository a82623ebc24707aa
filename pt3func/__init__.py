"""pt3func: JAX-style functional training for PyTorch.

Write a pure `train_step(params, opt_state, batch)` over pytrees of tensors; `pf.jit` traces the whole
step (forward, backward, optimizer) into one static program, compiles it once per signature and runs it
with donated buffers updated in place.
"""

from pt3func import checkpointing, compress, metrics, optim, tree
from pt3func.config import config
from pt3func.errors import (
    DataDependentControlFlowError,
    DonationError,
    ImpureFunctionError,
    ShardingError,
    TracingError,
)
from pt3func.jitted import Jitted, jit
from pt3func.module import Apply, functionalize
from pt3func.remat import checkpoint, checkpoint_name, checkpoint_policies, remat
from pt3func.sharding import (
    Mesh,
    NamedSharding,
    P,
    PartitionSpec,
    device_get,
    device_put,
    get_mesh,
    make_array_from_process_local_data,
    make_mesh,
    set_mesh,
    sharding_of,
    visualize_sharding,
    with_sharding_constraint,
)
from pt3func.spmd import lax, shard_map
from pt3func.stages import Compiled, Lowered
from pt3func.transforms import grad, value_and_grad, vmap

__all__ = [
    "Apply",
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "device_get",
    "device_put",
    "make_array_from_process_local_data",
    "get_mesh",
    "lax",
    "make_mesh",
    "metrics",
    "set_mesh",
    "shard_map",
    "sharding_of",
    "visualize_sharding",
    "with_sharding_constraint",
    "Compiled",
    "DataDependentControlFlowError",
    "DonationError",
    "ImpureFunctionError",
    "Jitted",
    "Lowered",
    "ShardingError",
    "TracingError",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_policies",
    "checkpointing",
    "compress",
    "remat",
    "config",
    "functionalize",
    "grad",
    "jit",
    "optim",
    "tree",
    "value_and_grad",
    "vmap",
]

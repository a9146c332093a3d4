"""Placement of JAX partitions on one device or a ``jax.sharding.Mesh``.

    mesh = jax.make_mesh((8,), ("data",))
    torch.compile(model, backend="dynajax", options={"mesh": mesh,
                  "sharding": dynajax.ShardingRules.fsdp()})

rules.py (which spec each parameter gets, how inputs are split), names.py (which graph
inputs are which parameters), placement.py (the per-input ``Sharding`` of a partition,
its converters and the resident copies they share; ``place`` for ``jax_function``'s
state), report.py (the report's lines, with bytes measured per device).
"""

from dynajax.sharding.names import StateName, dynamo_input_names, source_state_name
from dynajax.sharding.placement import (
    InputDecision,
    PartitionPlacement,
    Placement,
    auto_axes,
    describe_mesh,
    per_device_bytes,
    place,
    shardings,
)
from dynajax.sharding.report import GraphSharding, StateInfo
from dynajax.sharding.rules import ShardingRules

__all__ = [
    "GraphSharding",
    "InputDecision",
    "PartitionPlacement",
    "Placement",
    "ShardingRules",
    "StateInfo",
    "StateName",
    "auto_axes",
    "describe_mesh",
    "dynamo_input_names",
    "per_device_bytes",
    "place",
    "shardings",
    "source_state_name",
]

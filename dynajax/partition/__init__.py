"""The partition stage: the partition decision (recorded in node.meta), fusing each
partition into a ``jax_<n>`` submodule, and the stitched callable."""

from dynajax.partition.partitioner import (
    PARTITION_KEY,
    PREFIX,
    Proposal,
    VerdictSupport,
    assign_partitions,
    compute_op_count,
    fuse_partitions,
    propose_partitions,
)
from dynajax.partition.stitch import PartitionModule, stitched_callable

__all__ = [
    "PARTITION_KEY",
    "PREFIX",
    "PartitionModule",
    "Proposal",
    "VerdictSupport",
    "assign_partitions",
    "compute_op_count",
    "fuse_partitions",
    "propose_partitions",
    "stitched_callable",
]

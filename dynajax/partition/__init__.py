"""Capability-based partitioning into JAX submodules."""

from dynajax.partition.partitioner import PREFIX, compute_op_count, partition

__all__ = ["PREFIX", "compute_op_count", "partition"]

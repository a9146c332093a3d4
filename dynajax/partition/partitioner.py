"""Groups supported nodes into the largest JAX partitions, applies the block-size
policy, and fuses each partition into a submodule ``jax_<n>``.

    before:  x -> sin -> custom_op -> cos -> add -> out
    after:   x -> jax_0(sin) -> custom_op -> jax_1(cos, add) -> out

Nodes left outside every partition run in eager PyTorch from the outer graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from dynajax.capability import META_KEY, Reason, Unsupported, VerdictSupport, target_name
from dynajax.capability.verdict import source_line

PREFIX = "jax_"


def compute_op_count(nodes: object) -> int:
    """ATen ops in a set of nodes (getitem is bookkeeping, not an op)."""
    return sum(1 for n in nodes if n.op == "call_function" and n.target is not operator.getitem)


def partition(gm: torch.fx.GraphModule, min_block_size: int = 1) -> torch.fx.GraphModule:
    """Fuses the supported nodes of ``gm`` (verdicts in node.meta) into ``jax_<n>``.

    Partitions with fewer than ``min_block_size`` ATen ops are dissolved and their
    nodes' verdicts become BLOCK_TOO_SMALL. Returns ``gm``, modified in place.
    """
    partitioner = CapabilityBasedPartitioner(
        gm, VerdictSupport(), allows_single_node_partition=True
    )
    proposed: list[Partition] = partitioner.propose_partitions()
    kept = []
    for p in proposed:
        ops = compute_op_count(p.nodes)
        if ops == 0:
            continue
        if ops < min_block_size:
            for n in p.nodes:
                if n.meta.get(META_KEY) is not None:
                    n.meta[META_KEY] = Unsupported(
                        Reason.BLOCK_TOO_SMALL,
                        n.name,
                        target_name(n),
                        f"partition of {ops} op(s) < min_block_size={min_block_size}",
                        source_line(n),
                    )
            continue
        kept.append(p)
    # Deterministic submodule names, in graph order.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    kept.sort(key=lambda p: min(order[n] for n in p.nodes))
    if not kept:
        return gm
    return fuse_by_partitions(
        gm,
        [dict.fromkeys(sorted(p.nodes, key=order.__getitem__)) for p in kept],
        prefix=PREFIX,
        always_return_tuple=True,
    )

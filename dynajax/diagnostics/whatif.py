"""What-if: which missing rules would merge the most JAX partitions if they were added.

Computed honestly: the partitioner is re-run on a copy of the graph taken before
partitioning, once per missing op, with that op's nodes marked supported, and the
partitions that survive ``min_block_size`` are counted.

    graph:     x -> sin -> sort -> cos -> custom -> exp -> out
    today:     jax_0(sin)  sort  jax_1(cos)  custom  jax_2(exp)       3 partitions
    + sort:    jax_0(sin, sort, cos)  custom  jax_1(exp)              2 partitions
    + custom:  jax_0(sin)  sort  jax_1(cos, custom, exp)              2 partitions
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from dynajax.capability import META_KEY, Reason, target_name
from dynajax.partition import compute_op_count


def snapshot_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """A copy of ``gm``'s graph (nodes, names, verdicts; meta shallow-copied).

    Taken after capability and before partitioning fuses the nodes away; it is what the
    what-if list and the graph picture are computed from.
    """
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return graph


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """The effect of adding a rule for ``op`` on one graph (or the sum over graphs).

    Attributes:
        op: the op without a rule, e.g. ``aten.sort.default``.
        nodes: how many nodes of the graph call it.
        partitions_before: JAX partitions today.
        partitions_after: JAX partitions if ``op`` had a rule.
        jax_ops_before: ATen ops in JAX today.
        jax_ops_after: ATen ops in JAX if ``op`` had a rule.
    """

    op: str
    nodes: int
    partitions_before: int
    partitions_after: int
    jax_ops_before: int
    jax_ops_after: int

    @property
    def merged(self) -> int:
        """Partitions merged away (negative when the rule would add an island)."""
        return self.partitions_before - self.partitions_after

    @property
    def ops_gained(self) -> int:
        return self.jax_ops_after - self.jax_ops_before

    def __add__(self, other: WhatIf) -> WhatIf:
        return WhatIf(
            self.op,
            self.nodes + other.nodes,
            self.partitions_before + other.partitions_before,
            self.partitions_after + other.partitions_after,
            self.jax_ops_before + other.jax_ops_before,
            self.jax_ops_after + other.jax_ops_after,
        )

    def describe(self) -> str:
        plural = "s" if self.nodes != 1 else ""
        return (
            f"{self.partitions_before} -> {self.partitions_after} partitions "
            f"(merges {self.merged}), +{self.ops_gained} ops in JAX "
            f"({self.nodes} node{plural})"
        )


class _Hypothesis(OperatorSupportBase):
    """Supported iff the stored verdict is, or the node (or its getitem's producer)
    calls one of ``extra``."""

    def __init__(self, extra: frozenset[str]) -> None:
        self.extra = extra

    def is_node_supported(
        self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node
    ) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            producer = node.args[0]
            if producer.op == "call_function" and target_name(producer) in self.extra:
                return True
        elif target_name(node) in self.extra:
            return True
        verdict = node.meta.get(META_KEY)
        return verdict is not None and verdict.supported


def propose(
    graph: torch.fx.Graph, min_block_size: int, extra: frozenset[str] = frozenset()
) -> list[list[torch.fx.Node]]:
    """The JAX partitions the partitioner forms on ``graph``, in graph order.

    Mirrors ``dynajax.partition.partition`` without fusing: CapabilityBasedPartitioner
    with single-node partitions allowed, partitions of fewer than ``min_block_size``
    ATen ops dropped. ``extra`` names ops to treat as supported.
    """
    root = {
        n.target: torch.empty(0) for n in graph.nodes if n.op == "get_attr"
    }  # get_attr values are never read by the partitioner
    gm = torch.fx.GraphModule(root, graph)
    partitioner = CapabilityBasedPartitioner(
        gm, _Hypothesis(extra), allows_single_node_partition=True
    )
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept = []
    for p in partitioner.propose_partitions():
        ops = compute_op_count(p.nodes)
        if ops == 0 or ops < min_block_size:
            continue
        kept.append(sorted(p.nodes, key=order.__getitem__))
    kept.sort(key=lambda nodes: order[nodes[0]])
    return kept


def missing_rules(graph: torch.fx.Graph) -> dict[str, int]:
    """Ops of ``graph`` kept out of JAX only because they have no rule, with node counts."""
    counts: dict[str, int] = {}
    for n in graph.nodes:
        v = n.meta.get(META_KEY)
        if (
            n.op == "call_function"
            and n.target is not operator.getitem
            and isinstance(n.target, torch._ops.OpOverload)
            and v is not None
            and not v.supported
            and v.reason is Reason.NO_LOWERING
        ):
            name = target_name(n)
            counts[name] = counts.get(name, 0) + 1
    return counts


def what_if(graph: torch.fx.Graph, min_block_size: int) -> list[WhatIf]:
    """One WhatIf per missing rule of ``graph``, most partitions merged first."""
    base = propose(graph, min_block_size)
    base_ops = sum(compute_op_count(p) for p in base)
    results = []
    for op, count in missing_rules(graph).items():
        after = propose(graph, min_block_size, frozenset({op}))
        results.append(
            WhatIf(
                op,
                count,
                len(base),
                len(after),
                base_ops,
                sum(compute_op_count(p) for p in after),
            )
        )
    return rank(results)


def rank(results: list[WhatIf]) -> list[WhatIf]:
    key: Callable[[WhatIf], tuple[int, int, str]] = lambda w: (-w.merged, -w.ops_gained, w.op)
    return sorted(results, key=key)

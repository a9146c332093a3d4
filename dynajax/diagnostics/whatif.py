"""What-if: which missing rules would merge the most JAX partitions if they were added.

Computed honestly: today's partitions are read from the graph (``node.meta``, where the
partition stage recorded them), and the partition stage's own ``propose_partitions`` is
re-run on that graph once per missing op, with that op's nodes assumed supported.

    graph:     x -> sin -> sort -> cos -> custom -> exp -> out
    today:     jax_0(sin)  sort  jax_1(cos)  custom  jax_2(exp)       3 partitions
    + sort:    jax_0(sin, sort, cos)  custom  jax_1(exp)              2 partitions
    + custom:  jax_0(sin)  sort  jax_1(cos, custom, exp)              2 partitions
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx

from dynajax.capability import META_KEY, Reason, target_name
from dynajax.partition import (
    PARTITION_KEY,
    VerdictSupport,
    compute_op_count,
    propose_partitions,
)


def snapshot_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """A copy of ``gm``'s graph (nodes, names, verdicts; meta shallow-copied).

    Taken after the partition decision (verdicts and ``PARTITION_KEY`` in each node's
    meta) and before fusing takes the nodes away; the what-if list and the graph
    picture are computed from it.
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


def current_partitions(graph: torch.fx.Graph) -> dict[str, list[torch.fx.Node]]:
    """The partitions the backend chose for ``graph``, read from ``node.meta``
    (``PARTITION_KEY``), as ``{"jax_<n>": nodes}``."""
    parts: dict[str, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        name = n.meta.get(PARTITION_KEY)
        if name is not None:
            parts.setdefault(name, []).append(n)
    return parts


def what_if(graph: torch.fx.Graph, min_block_size: int) -> list[WhatIf]:
    """One WhatIf per missing rule of ``graph``, most partitions merged first.

    Today's partitions are the ones recorded in the graph; each alternative is proposed
    by the same function that made them (``partition.propose_partitions``).
    """
    base = current_partitions(graph)
    base_ops = sum(compute_op_count(p) for p in base.values())
    results = []
    for op, count in missing_rules(graph).items():
        support = VerdictSupport(assume_supported=frozenset({op}))
        after = propose_partitions(graph, min_block_size, support)
        results.append(WhatIf(op, count, len(base), len(after.kept), base_ops, after.jax_ops))
    return rank(results)


def rank(results: list[WhatIf]) -> list[WhatIf]:
    key: Callable[[WhatIf], tuple[int, int, str]] = lambda w: (-w.merged, -w.ops_gained, w.op)
    return sorted(results, key=key)

"""Report: what ran in JAX, what stayed in PyTorch, and why."""

from __future__ import annotations

import collections
import dataclasses
import operator

import torch.fx

from dynajax.capability import Unsupported, verdict_of
from dynajax.partition import PREFIX, compute_op_count


@dataclasses.dataclass(frozen=True)
class PartitionInfo:
    """One JAX partition: its name, op count, and op histogram."""

    name: str
    op_count: int
    ops: dict[str, int]


@dataclasses.dataclass
class GraphReport:
    """One ATen graph the backend compiled.

    Attributes:
        kind: ``inference``, ``forward`` or ``backward``.
        index: the graph's number in compilation order.
        graph_module: the stitched graph (JAX partitions as ``jax_<n>`` submodules).
        partitions: the JAX partitions.
        fallbacks: the verdict of every ATen node kept in PyTorch.
        aten_ops: ATen ops in the graph before partitioning.
    """

    kind: str
    index: int
    graph_module: torch.fx.GraphModule
    partitions: list[PartitionInfo]
    fallbacks: list[Unsupported]
    aten_ops: int

    @property
    def jax_ops(self) -> int:
        return sum(p.op_count for p in self.partitions)


def graph_report(
    kind: str,
    index: int,
    annotated: list[torch.fx.Node],
    stitched: torch.fx.GraphModule,
) -> GraphReport:
    """Builds the report of one graph from its annotated nodes and stitched module."""
    fallbacks = []
    aten_ops = 0
    for node in annotated:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        aten_ops += 1
        v = verdict_of(node)
        if v is not None and not v.supported:
            fallbacks.append(v)
    partitions = []
    for name, sub in stitched.named_children():
        if not name.startswith(PREFIX):
            continue
        g = sub.graph_module.graph.nodes
        hist = collections.Counter(
            str(n.target) for n in g if n.op == "call_function" and n.target is not operator.getitem
        )
        partitions.append(PartitionInfo(name, compute_op_count(g), dict(hist)))
    return GraphReport(kind, index, stitched, partitions, fallbacks, aten_ops)


@dataclasses.dataclass
class Report:
    """Everything dynajax compiled for one function: see ``str(report)``."""

    graphs: list[GraphReport]

    @property
    def aten_ops(self) -> int:
        return sum(g.aten_ops for g in self.graphs)

    @property
    def jax_ops(self) -> int:
        return sum(g.jax_ops for g in self.graphs)

    @property
    def fraction_in_jax(self) -> float:
        """Share of ATen ops that ran in JAX (1.0 for a graph with no ops)."""
        return self.jax_ops / self.aten_ops if self.aten_ops else 1.0

    @property
    def fallbacks(self) -> list[Unsupported]:
        return [f for g in self.graphs for f in g.fallbacks]

    @property
    def partitions(self) -> list[PartitionInfo]:
        return [p for g in self.graphs for p in g.partitions]

    def __str__(self) -> str:
        lines = [
            f"dynajax report: {len(self.graphs)} graph(s), {self.jax_ops}/{self.aten_ops} "
            f"ATen ops in JAX ({100 * self.fraction_in_jax:.1f}%)"
        ]
        for g in self.graphs:
            lines.append("")
            lines.append(
                f"graph {g.index} ({g.kind}): {g.aten_ops} ATen ops, {len(g.partitions)} JAX "
                f"partition(s), {len(g.fallbacks)} op(s) in PyTorch"
            )
            for p in g.partitions:
                top = ", ".join(
                    f"{k.removeprefix('aten.')} x{n}"
                    for k, n in sorted(p.ops.items(), key=lambda kv: -kv[1])[:6]
                )
                lines.append(f"  {p.name:<8} {p.op_count:>5} ops   {top}")
            if g.fallbacks:
                lines.append("  kept in PyTorch:")
                width = max(len(f.target) for f in g.fallbacks)
                for f in g.fallbacks:
                    detail = f" ({f.detail})" if f.detail else ""
                    lines.append(
                        f"    {f.target:<{width}}  {f.node:<16} {f.reason.name}{detail}"
                    )
                    if f.source_line:
                        lines.append(f"    {'':<{width}}  at {f.source_line}")
        return "\n".join(lines)

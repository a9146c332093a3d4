"""Report: what ran in JAX, what stayed in PyTorch, why, and which rules to add next."""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import os
import textwrap
from collections.abc import Callable

import torch.fx

from dynajax.capability import Reason, Unsupported, verdict_of
from dynajax.capability.cost import COST_KEY, CostChoice, Unmeasured
from dynajax.diagnostics.breaks import GraphBreak, short_location
from dynajax.diagnostics.profile import GraphTimes
from dynajax.diagnostics.recompiles import DynamoCompile
from dynajax.diagnostics.recompiles import lines as recompile_lines
from dynajax.diagnostics.whatif import WhatIf, current_partitions, rank, what_if
from dynajax.partition import PREFIX, PartitionModule, compute_op_count
from dynajax.passes.regions import REGION_KEY
from dynajax.passes.user import RewriteRecord
from dynajax.runtime import omp
from dynajax.runtime.cache import CompileStats, stats_of
from dynajax.sharding.report import GraphSharding

# The report's width: a terminal of 100 columns.
WIDTH = 100


class _Text:
    """A report's text: its ``lines()``, wrapped at ``WIDTH`` columns by ``str()``."""

    def lines(self) -> list[str]:
        raise NotImplementedError

    def text(self, width: int | None = WIDTH) -> str:
        """The report as text, its lines wrapped at ``width`` columns (None: unwrapped,
        one line per item, for a log or a search)."""
        return fitted(self.lines(), width)

    def __str__(self) -> str:
        return self.text()


@dataclasses.dataclass(frozen=True)
class PartitionInfo:
    """One JAX partition: its name, op count, and op histogram."""

    name: str
    op_count: int
    ops: dict[str, int]


@dataclasses.dataclass
class GraphReport(_Text):
    """One ATen graph the backend compiled.

    Attributes:
        kind: ``inference``, ``forward`` or ``backward``.
        index: the graph's number in compilation order.
        graph_module: the stitched graph (JAX partitions as ``jax_<n>`` submodules).
        partitions: the JAX partitions.
        fallbacks: the verdict of every ATen node kept in PyTorch.
        aten_ops: ATen ops in the graph before partitioning (host-scalar bookkeeping and
            getitem not counted).
        host_scalars: verdicts of the nodes that compute sizes and assertions on the
            host (``sym_size``, ``_assert_scalar``); they are not fallbacks.
        snapshot: the graph as it was before partitioning, with its verdicts, for the
            what-if list and the picture; None when not recorded.
        min_block_size: the policy the partitions were formed under.
        compile_stats: XLA compiles, persistent-cache hits and misses (with reasons) and
            shape buckets of this graph's partitions, counted live as they compile (at
            their first calls, and at each new shape under dynamic shapes).
        sharding: where the partitions placed their state (``device=``/``mesh=``): the
            mesh, each parameter's and buffer's spec, and the bytes each device holds,
            measured from the placed arrays when the report is read; None without a
            placement.
        rewrites: what the user's rewrites (option ``rewrites``) did to the Dynamo
            graph this graph came from: each pattern, its matches and their source
            lines (on the inference or forward graph; a backward graph repeats none).
        aot: how the graph was made: ``traced`` by aot_autograd, ``loaded from the
            cache``, or traced and stored, with the reason of a miss or of not storing
            it (``aot/cache.py``).
        times: with the ``profile`` option, the graph's calls and its partitions',
            timed (``diagnostics/profile.py``); None without it.
        dynamo: Dynamo's compile that produced the graph: its compile id and, for a
            recompile, the guard failures that caused it (``diagnostics/recompiles.py``);
            None when not compiled under Dynamo.
        cost_choices: the nodes whose place (XLA or a PyTorch kernel) was measured on
            this machine (option ``measure_costs``): both times and the choice; or,
            where measuring raised, the error and the default taken (``Unmeasured``).
        kernels: the nodes whose partition runs PyTorch's own kernel for them inside
            the XLA program (``dynajax/ffi``), each with the refusal it stands in for
            (no rule, a rule refusing the arguments, PyTorch's kernel measured faster).
        regions: the regions traced once (``torch.compiler.nested_compile_region``)
            whose calls were inlined (``passes/regions.py``): identifier -> calls.
    """

    kind: str
    index: int
    graph_module: torch.fx.GraphModule
    partitions: list[PartitionInfo]
    fallbacks: list[Unsupported]
    aten_ops: int
    host_scalars: list[Unsupported] = dataclasses.field(default_factory=list)
    snapshot: torch.fx.Graph | None = dataclasses.field(default=None, repr=False)
    min_block_size: int = 1
    compile_stats: CompileStats | None = None
    sharding: GraphSharding | None = None
    rewrites: list[RewriteRecord] = dataclasses.field(default_factory=list)
    aot: str = "traced"
    times: GraphTimes | None = None
    dynamo: DynamoCompile | None = None
    cost_choices: list[CostChoice | Unmeasured] = dataclasses.field(default_factory=list)
    kernels: list[Unsupported] = dataclasses.field(default_factory=list)
    regions: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def jax_ops(self) -> int:
        return sum(p.op_count for p in self.partitions)

    @functools.cached_property
    def what_if(self) -> list[WhatIf]:
        """Missing rules, most partitions merged first (empty without a snapshot)."""
        if self.snapshot is None:
            return []
        return what_if(self.snapshot, self.min_block_size)

    @functools.cached_property
    def node_partition(self) -> dict[str, str]:
        """Node name (in ``snapshot``) -> ``jax_<n>`` of the partition it ran in, as the
        partition stage recorded it."""
        if self.snapshot is None:
            return {}
        parts = current_partitions(self.snapshot)
        return {n.name: name for name, nodes in parts.items() for n in nodes}

    def lines(self) -> list[str]:
        host = f" (+{len(self.host_scalars)} host-scalar node(s))" if self.host_scalars else ""
        out = [
            f"graph {self.index} ({self.kind}): {self.aten_ops} ATen ops, "
            f"{len(self.partitions)} JAX partition(s), {len(self.fallbacks)} op(s) in "
            f"PyTorch{host}"
        ]
        if self.dynamo is not None and self.dynamo.graph_break and self.kind != "backward":
            reason, _, where = self.dynamo.graph_break.rpartition(" at ")
            out.append(
                f"  ends at a graph break at {short_location(where)}: {reason}; what follows "
                "ran in Python until the next graph"
            )
        if self.rewrites:
            out.append("  rewrites (option rewrites, on Dynamo's graph before aot_autograd):")
            for r in self.rewrites:
                out.extend(r.lines("    "))
        for p in self.partitions:
            top = ", ".join(
                f"{k.removeprefix('aten.')} x{n}"
                for k, n in sorted(p.ops.items(), key=lambda kv: (-kv[1], kv[0]))[:6]
            )
            more = ", ..." if len(p.ops) > 6 else ""
            out.append(f"  {p.name:<8} {p.op_count:>5} ops   {top}{more}")
        if self.regions:
            calls = ", ".join(f"{name} x{n}" for name, n in self.regions.items())
            out.append(
                "  regions traced once (torch.compiler.nested_compile_region), each call's "
                f"ops inlined: {calls}"
            )
        if self.kernels:
            out.append("  PyTorch's kernels inside the XLA program (XLA FFI):")
            out.extend(_verdict_lines(self.kernels))
        if self.fallbacks:
            out.append("  kept in PyTorch:")
            out.extend(_verdict_lines(self.fallbacks))
        if self.cost_choices:
            out.append("  measured on this machine (option measure_costs):")
            width = max(len(c.op) for c in self.cost_choices)
            for c in self.cost_choices:
                out.append(f"    {c.op:<{width}}  {c.node}  {c.describe()}")
        if self.what_if:
            out.append("  what-if (a rule for this op would give):")
            width = max(len(w.op) for w in self.what_if)
            for w in self.what_if:
                out.append(f"    {w.op:<{width}}  {w.describe()}")
        if self.compile_stats is not None:
            out.extend(_stats_lines(self.compile_stats, "  "))
        out.extend(recompile_lines(self.dynamo, self.compile_stats, "  "))
        if self.aot != "traced":
            out.append(f"  aot_autograd: {self.aot}")
        if self.times is not None:
            out.extend(self.times.lines("  "))
        if self.sharding is not None:
            out.extend(self.sharding.lines("  ", eager_ops=len(self.fallbacks)))
        if self.host_scalars:
            names = ", ".join(h.node for h in self.host_scalars[:8])
            more = ", ..." if len(self.host_scalars) > 8 else ""
            out.append(f"  host-scalar bookkeeping, not fallbacks: {names}{more}")
        return out


def _verdict_lines(verdicts: list[Unsupported]) -> list[str]:
    """One line per verdict (op, node, reason), and its source line under it."""
    out = []
    width = max(len(f.target) for f in verdicts)
    nwidth = max(len(f.node) for f in verdicts)
    for f in verdicts:
        detail = f": {f.detail}" if f.detail else ""
        out.append(f"    {f.target:<{width}}  {f.node:<{nwidth}}  {f.reason.name}{detail}")
        if f.source_line:
            out.append(f"    {'':<{width}}  at {short_location(f.source_line)}")
    return out


def _stats_lines(stats: CompileStats, indent: str) -> list[str]:
    out = [f"{indent}compiles: {stats.line()}"]
    for b in stats.buckets:
        out.append(f"{indent}  padded to buckets: {b}")
    for e in stats.exact:
        out.append(f"{indent}  not padded: {e}")
    return out


def graph_report(
    kind: str,
    index: int,
    annotated: list[torch.fx.Node],
    stitched: torch.fx.GraphModule,
    snapshot: torch.fx.Graph | None = None,
    min_block_size: int = 1,
) -> GraphReport:
    """Builds the report of one graph from its annotated nodes and stitched module."""
    fallbacks: list[Unsupported] = []
    kernels: list[Unsupported] = []
    host: list[Unsupported] = []
    costs: list[CostChoice | Unmeasured] = []
    regions: dict[str, set[int]] = {}
    aten_ops = 0
    for node in annotated:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if REGION_KEY in node.meta:
            name, call = node.meta[REGION_KEY]
            regions.setdefault(name, set()).add(call)
        if COST_KEY in node.meta:
            costs.append(node.meta[COST_KEY])
        v = verdict_of(node)
        if isinstance(v, Unsupported) and v.reason is Reason.HOST_SCALAR:
            host.append(v)
            continue
        aten_ops += 1
        if isinstance(v, Unsupported):
            fallbacks.append(v)
        elif v is not None and v.kernel is not None:
            kernels.append(v.kernel)
    partitions = []
    for name, sub in stitched.named_children():
        if not name.startswith(PREFIX) or not isinstance(sub, PartitionModule):
            continue
        g = sub.graph_module.graph.nodes
        hist = collections.Counter(
            str(n.target) for n in g if n.op == "call_function" and n.target is not operator.getitem
        )
        partitions.append(PartitionInfo(name, compute_op_count(g), dict(hist)))
    return GraphReport(
        kind,
        index,
        stitched,
        partitions,
        fallbacks,
        aten_ops,
        host,
        snapshot,
        min_block_size,
        cost_choices=costs,
        kernels=kernels,
        regions={name: len(calls) for name, calls in regions.items()},
    )


@dataclasses.dataclass
class Report(_Text):
    """Everything dynajax compiled for one function: see ``str(report)``.

    ``to_dot()`` draws it (nodes coloured by partition, fallbacks marked);
    ``save_svg(path)`` renders that with Graphviz (``pip install dynajax[viz]``).
    """

    graphs: list[GraphReport]
    # What ``dynajax.explain`` adds, from its measured call of the whole program:
    breaks: list[GraphBreak] | None = None  # where Dynamo stopped capturing
    outside_ops: int | None = None  # ATen ops that ran outside any graph
    graph_calls: dict[int, int] | None = None  # calls of each graph (by index)
    call_s: float | None = None  # seconds of one call of the compiled program (median)
    eager_s: float | None = None  # seconds of one eager call (median, interleaved)
    call_range: tuple[float, float] | None = None  # the fastest and slowest compiled call
    eager_range: tuple[float, float] | None = None  # the same of eager's

    @property
    def aten_ops(self) -> int:
        """ATen ops of dynajax's graphs (each graph once)."""
        return sum(g.aten_ops for g in self.graphs)

    @property
    def jax_ops(self) -> int:
        """ATen ops of dynajax's graphs that run in JAX (each graph once)."""
        return sum(g.jax_ops for g in self.graphs)

    def _per_call(self, ops: Callable[[GraphReport], int]) -> int:
        calls = self.graph_calls or {}
        return sum(calls.get(g.index, 0) * ops(g) for g in self.graphs)

    @property
    def graph_breaks(self) -> int:
        """Dynamo graphs that ended at a graph break (counted once per Dynamo compile)."""
        return len(
            {
                g.dynamo.compile_id
                for g in self.graphs
                if g.dynamo is not None and g.dynamo.graph_break
            }
        )

    @property
    def program_ops(self) -> int | None:
        """ATen ops of one call of the whole program (``dynajax.explain``'s measured
        call): those of the graphs it called, as often as it called them, and those run
        outside any graph. None where unknown (a report built from a backend's graphs)."""
        if self.outside_ops is None:
            return None
        return self._per_call(lambda g: g.aten_ops) + self.outside_ops

    @property
    def fraction_in_jax(self) -> float:
        """Share of ATen ops that ran in JAX: of the whole program's where known
        (``program_ops``), else of dynajax's graphs' (1.0 for no ops at all)."""
        total = self.program_ops
        if total is not None:
            return self._per_call(lambda g: g.jax_ops) / total if total else 1.0
        return self.jax_ops / self.aten_ops if self.aten_ops else 1.0

    @property
    def fallbacks(self) -> list[Unsupported]:
        return [f for g in self.graphs for f in g.fallbacks]

    @property
    def kernels(self) -> list[Unsupported]:
        """The nodes that run PyTorch's kernel inside an XLA program (``GraphReport.kernels``)."""
        return [k for g in self.graphs for k in g.kernels]

    @property
    def cost_choices(self) -> list[CostChoice | Unmeasured]:
        """The choices between XLA and a PyTorch kernel timed at the compiles."""
        return [c for g in self.graphs for c in g.cost_choices]

    @property
    def compile_stats(self) -> CompileStats:
        """XLA compiles and persistent-cache hits/misses summed over the graphs."""
        return stats_of(g.compile_stats for g in self.graphs if g.compile_stats is not None)

    @property
    def partitions(self) -> list[PartitionInfo]:
        return [p for g in self.graphs for p in g.partitions]

    def what_if(self) -> list[WhatIf]:
        """Missing rules summed over every graph, most partitions merged first."""
        total: dict[str, WhatIf] = {}
        for g in self.graphs:
            for w in g.what_if:
                total[w.op] = total[w.op] + w if w.op in total else w
        return rank(list(total.values()))

    def to_dot(self) -> str:
        """The graphs in Graphviz DOT: JAX nodes filled by partition, fallbacks red
        with their reason, host-scalar bookkeeping grey. Needs no extra package."""
        from dynajax.diagnostics.dot import report_to_dot

        return report_to_dot(self)

    def save_svg(self, path: str | os.PathLike[str]) -> None:
        """Renders ``to_dot()`` to an SVG file (needs ``pip install dynajax[viz]`` and
        Graphviz's ``dot`` program)."""
        from dynajax.diagnostics.dot import render

        render(self.to_dot(), path, "svg")

    def save_png(self, path: str | os.PathLike[str]) -> None:
        """Like ``save_svg``, as PNG."""
        from dynajax.diagnostics.dot import render

        render(self.to_dot(), path, "png")

    def lines(self) -> list[str]:
        """The report's lines, unwrapped."""
        total = self.program_ops
        if total is None:
            lines = [
                f"dynajax report: {len(self.graphs)} graph(s), {self.jax_ops}/{self.aten_ops} "
                f"ATen ops in JAX ({100 * self.fraction_in_jax:.1f}%)"
            ]
            breaks = self.graph_breaks
            if breaks:
                lines[0] += (
                    f" of its graphs; Dynamo broke the program at {breaks} place(s), the ops "
                    "after a break ran in eager PyTorch (dynajax.explain counts them)"
                )
        else:
            inside = self._per_call(lambda g: g.aten_ops)
            lines = [
                f"dynajax report: {len(self.graphs)} graph(s), "
                f"{self._per_call(lambda g: g.jax_ops)}/{total} of the program's ATen ops in "
                f"JAX ({100 * self.fraction_in_jax:.1f}%): {inside} in dynajax's graphs, "
                f"{self.outside_ops} outside any graph"
            ]
        if self.call_s is not None:
            graphs_ms = sum(
                (g.times.graph.mean_ms(g.times.graph.total_s) if g.times is not None else 0.0)
                * (self.graph_calls or {}).get(g.index, 0)
                for g in self.graphs
            )
            eager = (
                f"; eager PyTorch {1e3 * self.eager_s:.3f} ms{_spread(self.eager_range)}, "
                f"{self.eager_s / self.call_s:.2f}x the compiled program's time"
                if self.eager_s is not None
                else ""
            )
            lines.append(
                f"time per call: {1e3 * self.call_s:.3f} ms{_spread(self.call_range)}{eager}; "
                f"timed phase by phase (each partition waited for, below), dynajax's graphs "
                f"{graphs_ms:.3f} ms"
            )
        if self.breaks:
            lines.append(
                f"Dynamo left {len(self.breaks)} place(s) to Python (its ops ran in eager "
                "PyTorch, outside any graph):"
            )
            for b in self.breaks:
                lines.extend(b.lines("  "))
        elif self.breaks is not None:
            lines.append("Dynamo captured the whole program: no graph breaks.")
        if any(g.compile_stats is not None for g in self.graphs):
            lines.append(f"compiles: {self.compile_stats.line()}")
        for g in self.graphs:
            lines.append("")
            lines.extend(g.lines())
        if len(self.graphs) > 1 and self.what_if():
            lines.append("")
            lines.append("what-if over all graphs (a rule for this op would give):")
            width = max(len(w.op) for w in self.what_if())
            for w in self.what_if():
                lines.append(f"  {w.op:<{width}}  {w.describe()}")
        said = omp.advice() if self._runs_on_cpu() else None
        if said is not None:
            lines.extend(["", f"note: {said}"])
        return lines

    def _runs_on_cpu(self) -> bool:
        """Whether a partition of these graphs runs on the CPU (where PyTorch's OpenMP
        threads and XLA's share the cores)."""
        return any(
            getattr(sub, "device_type", None) == "cpu"
            for g in self.graphs
            for sub in g.graph_module.children()
        )


def _spread(seconds: tuple[float, float] | None) -> str:
    """`` (0.41-0.47)``: the fastest and slowest of the timed calls, in ms."""
    return "" if seconds is None else f" ({1e3 * seconds[0]:.3f}-{1e3 * seconds[1]:.3f})"


def fitted(lines: list[str], width: int | None = WIDTH) -> str:
    """``lines`` as text no wider than ``width`` (None: as they are): a longer line wraps
    at spaces, its continuation indented two past the line's own indent (a word longer
    than the width, a path, stays whole)."""
    out = []
    for line in lines:
        if width is None or len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        out.extend(
            textwrap.wrap(
                line,
                width,
                subsequent_indent=indent,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(out)

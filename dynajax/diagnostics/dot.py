"""Graph pictures: a Report as Graphviz DOT text, and its rendering to SVG/PNG.

DOT text is written here directly, so ``Report.to_dot()`` needs no extra package;
rendering goes through pydot (``pip install dynajax[viz]``) and Graphviz's ``dot``.
"""

from __future__ import annotations

import operator
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch.fx

from dynajax.capability import META_KEY, Reason, Unsupported, target_name
from dynajax.errors import DynajaxError


# What the drawing reads of a report (``diagnostics/report.py``'s Report, GraphReport
# and PartitionInfo have these), so that this module does not import that one.
class _Partition(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def op_count(self) -> int: ...


class _Graph(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def partitions(self) -> Sequence[_Partition]: ...
    @property
    def fallbacks(self) -> Sequence[Unsupported]: ...
    @property
    def host_scalars(self) -> Sequence[Unsupported]: ...
    @property
    def snapshot(self) -> torch.fx.Graph | None: ...
    @property
    def node_partition(self) -> Mapping[str, str]: ...


class _Report(Protocol):
    @property
    def graphs(self) -> Sequence[_Graph]: ...


# Fill colours of partitions jax_0, jax_1, ... (cycled), readable on white.
PALETTE = (
    "#a6cee3",
    "#b2df8a",
    "#fdbf6f",
    "#cab2d6",
    "#ffff99",
    "#8dd3c7",
    "#bebada",
    "#80b1d3",
    "#fccde5",
    "#d9d9d9",
)
FALLBACK_FILL = "#fb9a99"
FALLBACK_BORDER = "#e31a1c"
HOST_FILL = "#eeeeee"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _short_target(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        return target_name(node).removeprefix("aten.")
    return node.op


def _node_attrs(
    node: torch.fx.Node,
    partition: str | None,
    fallback: Unsupported | None,
    colors: dict[str, str],
) -> dict[str, str]:
    label = f"{node.name}\n{_short_target(node)}"
    if node.op in ("placeholder", "get_attr"):
        return {"label": node.name, "shape": "ellipse"}
    if node.op == "output":
        return {"label": "output", "shape": "doublecircle"}
    if partition is not None:
        return {
            "label": f"{label}\n[{partition}]",
            "shape": "box",
            "style": "filled,rounded",
            "fillcolor": colors[partition],
        }
    if fallback is not None and fallback.reason is Reason.HOST_SCALAR:
        return {
            "label": label,
            "shape": "box",
            "style": "filled,dashed",
            "fillcolor": HOST_FILL,
            "fontcolor": "#666666",
        }
    reason = fallback.reason.name if fallback is not None else "PyTorch"
    attrs = {
        "label": f"{label}\n{reason}",
        "shape": "octagon",
        "style": "filled,bold",
        "fillcolor": FALLBACK_FILL,
        "color": FALLBACK_BORDER,
    }
    if fallback is not None:
        tip = fallback.detail or fallback.reason.value
        if fallback.source_line:
            tip += f"\n{fallback.source_line}"
        attrs["tooltip"] = tip
    return attrs


def graph_to_dot_lines(g: _Graph, cluster: int) -> list[str]:
    """The DOT lines of one GraphReport, as a cluster with node ids prefixed ``g<n>_``."""
    snapshot = g.snapshot
    title = f"graph {g.index} ({g.kind})"
    lines = [f"  subgraph cluster_{cluster} {{", f"    label={_quote(title)};"]
    if snapshot is None:
        lines.append(f"    g{cluster}_none [label={_quote('not recorded')}, shape=plaintext];")
        lines.append("  }")
        return lines
    where = g.node_partition
    partitions = sorted(set(where.values()), key=lambda p: int(p.rsplit("_", 1)[1]))
    colors = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(partitions)}
    by_name = {f.node: f for f in (*g.fallbacks, *g.host_scalars)}

    def nid(n: torch.fx.Node) -> str:
        return f"g{cluster}_{n.name}"

    for n in snapshot.nodes:
        stored = n.meta.get(META_KEY)
        fallback = by_name.get(n.name)
        if fallback is None and isinstance(stored, Unsupported):
            fallback = stored
        attrs = _node_attrs(n, where.get(n.name), fallback, colors)
        body = ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items())
        lines.append(f"    {nid(n)} [{body}];")
    for n in snapshot.nodes:
        for src in n.all_input_nodes:
            style = ' [style="dashed"]' if n.target is operator.getitem else ""
            lines.append(f"    {nid(src)} -> {nid(n)}{style};")
    # Legend: one swatch per partition with its op count, and the fallback style.
    counts = {p.name: p.op_count for p in g.partitions}
    lines.append(f"    subgraph cluster_{cluster}_legend {{")
    lines.append('      label="legend"; style="dashed"; rank=same;')
    for p in partitions:
        text = f"{p}: {counts.get(p, '?')} ops in JAX"
        lines.append(
            f"      g{cluster}_legend_{p} [label={_quote(text)}, shape=box, "
            f'style="filled,rounded", fillcolor={_quote(colors[p])}];'
        )
    lines.append(
        f'      g{cluster}_legend_fallback [label="runs in PyTorch\\nREASON", '
        f'shape=octagon, style="filled,bold", fillcolor="{FALLBACK_FILL}", '
        f'color="{FALLBACK_BORDER}"];'
    )
    lines.append("    }")
    lines.append("  }")
    return lines


def report_to_dot(report: _Report) -> str:
    """DOT text of every graph of ``report``, one cluster each."""
    lines = [
        "digraph dynajax {",
        "  rankdir=TB;",
        '  node [fontname="Helvetica", fontsize=10];',
        "  compound=true;",
    ]
    for i, g in enumerate(report.graphs):
        lines.extend(graph_to_dot_lines(g, i))
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(dot_text: str, path: str | os.PathLike[str], fmt: str) -> None:
    """Writes ``dot_text`` rendered as ``fmt`` (svg, png) to ``path``."""
    try:
        import pydot
    except ImportError:
        raise DynajaxError(
            "drawing a report needs pydot: pip install dynajax[viz] "
            "(Report.to_dot() gives the DOT text without it)."
        ) from None
    if shutil.which("dot") is None:
        raise DynajaxError(
            "drawing a report needs Graphviz's `dot` program, which is not on PATH: "
            "install Graphviz (apt-get install graphviz, brew install graphviz or "
            "conda install graphviz), or render Report.to_dot() elsewhere."
        )
    # Hand pydot the text as written (parsing it back would only re-serialize it).
    out = os.path.abspath(os.fspath(path))
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "report.dot")
        with open(source, "w", encoding="utf-8") as f:
            f.write(dot_text)
        _, stderr, process = pydot.call_graphviz("dot", [f"-T{fmt}", "-o", out, source], tmp)
    if process.returncode != 0:
        raise DynajaxError(f"Graphviz's dot failed to render {out}: {stderr.strip()}")

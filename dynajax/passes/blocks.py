"""The repeated blocks of an ATen graph: the calls of one region marked with
``torch.compiler.nested_compile_region`` (``REGION_KEY``, left by ``InlineRegions``),
or the layers of one ``ModuleList`` (a transformer's decoder layers, a ResNet stage's
blocks: submodules named ``<list>.<i>`` of one class, from the ``nn_module_stack``
Dynamo records on each node, or in a backward graph the forward's, which aot_autograd
copies to each gradient's nodes), whose ops are alike: the same ops, in the same order, on
the same shapes, dtypes and arguments, each reading the block's own values where the
first reads its own (``repeated_blocks``).

What is alike in one block is alike in all, so the first can stand for them: the
backend times its cost choice on it (``capability/in_graph.py``), a graph of its own
(``block_graph``), the same at any depth.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from dynajax.passes.regions import REGION_KEY

_LAYER = re.compile(r"^(?P<list>.*)\.(?P<index>\d+)$")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Alike blocks of a graph.

    Attributes:
        name: what they are (``"transformer.h.* (GPT2Block)"``, ``"region <id>"``).
        members: each block's nodes in graph order, the first block first.
    """

    name: str
    members: list[list[torch.fx.Node]]

    def __len__(self) -> int:
        return len(self.members)


def repeated_blocks(gm: torch.fx.GraphModule) -> Blocks | None:
    """The graph's largest group of alike blocks (by their nodes), at least two: those
    of a marked region, else of one ``ModuleList``'s layers alike to its first (None
    where there are none)."""
    groups: dict[tuple[str, Any], dict[Any, list[torch.fx.Node]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = _block_of(node)
        if found is not None:
            group, member = found
            groups[group][member].append(node)
    best: Blocks | None = None
    for (kind, name), members in groups.items():
        ordered = list(members.values())
        first = _signature(ordered[0])
        alike = [m for m in ordered if _signature(m) == first]
        if len(alike) < 2:
            continue
        size = sum(len(m) for m in alike)
        if best is None or size > sum(len(m) for m in best.members):
            best = Blocks(f"region {name}" if kind == "region" else name, alike)
    return best


def block_graph(
    gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]
) -> tuple[torch.fx.GraphModule, list[Any], dict[torch.fx.Node, torch.fx.Node]]:
    """``nodes`` (one block, in graph order) as a graph of their own over ``gm``'s
    attributes: a placeholder for each value they read from outside (its example
    value, ``meta["val"]``, in the list returned), and as outputs the values read
    outside the block; their meta copied (verdicts included). Returns the graph, the
    example values of its inputs and the map of ``nodes`` to their copies."""
    inside = set(nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    examples: list[Any] = []

    def outside(value: torch.fx.Node) -> torch.fx.Node:
        if value not in env:
            if value.op == "get_attr":
                env[value] = graph.get_attr(str(value.target))
            else:
                env[value] = graph.placeholder(value.name)
                examples.append(value.meta.get("val"))
            env[value].meta = dict(value.meta)
        return env[value]

    copies = {}
    for node in nodes:
        copies[node] = env[node] = graph.node_copy(
            node, lambda a: env[a] if a in inside else outside(a)
        )
    results = [copies[n] for n in nodes if any(u not in inside for u in n.users)]
    graph.output(tuple(results))
    return _LazyGraphModule(gm, graph), examples, copies


def _block_of(node: torch.fx.Node) -> tuple[tuple[str, Any], Any] | None:
    """The group of blocks ``node`` is in and its block there: its marked region's
    call, else the outermost layer of a ``ModuleList`` in its module stack."""
    region = node.meta.get(REGION_KEY)
    if region is not None:
        return ("region", region[0]), region[1]
    # (a backward graph's nodes carry the module stack of the forward node they are the
    # gradient of)
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, cls in stack.values():
        # (``h[0]`` and ``_modules['h']._modules['0']`` as ``h.0``: torch's spellings)
        path = re.sub(r"\._modules\['([^']+)'\]", r".\1", str(path))
        match = _LAYER.match(re.sub(r"\[(\d+)\]", r".\1", path))
        if match is not None:
            name = re.sub(r"^L\['[^']*'\]\.?", "", match["list"])
            kind = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1]
            return ("layers", f"{name}.* ({kind})"), match["index"]
    return None


def _signature(nodes: Sequence[torch.fx.Node]) -> tuple[Any, ...]:
    """What makes two blocks alike: each node's op, its arguments (a value of the
    block by its position there, one from outside by its shape and dtype, others as
    they are) and its value's shape and dtype."""
    where = {n: i for i, n in enumerate(nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("in", where[a]) if a in where else ("out", _meta(a))
        if isinstance(a, list | tuple):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        return a if isinstance(a, bool | int | float | str | type(None)) else repr(a)

    return tuple((n.target, arg(n.args), arg(n.kwargs), _meta(n), len(n.users) > 0) for n in nodes)


def _meta(node: torch.fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val.dtype, tuple(val.shape), val.stride())
    if isinstance(val, list | tuple):
        return tuple(
            (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else repr(v) for v in val
        )
    return repr(val)

"""Keeps what ``torch.utils.checkpoint`` recomputes recomputed once XLA compiles it.

A graph traced through the backward as one program (``train_step``; torch's backward
in ``jax_function``) holds each checkpointed region twice: the forward's ops, and the
same ops again where the backward needs their values (the checkpoint's recomputation,
which its saved-tensor hooks run inside the backward, just before the first backward
op that reads them). XLA would merge the two copies (common-subexpression elimination)
and keep the forward's values alive until the backward: the memory checkpointing is
for. Each region's inputs therefore go through one ``dynajax::recompute_barrier``
(``dynajax/lowering/barriers.py``), tied to the backward value computed just before
the region:

    before:  x -> mm -> relu -> (forward)      x -> mm' -> relu' -> (backward)
    after:   x -> mm -> relu -> (forward)      [x], g -> recompute_barrier -> mm' -> ...

An op that repeats an earlier op on the same arguments (the earlier repeats read as
what they repeat) is a recomputed op, and connected recomputed ops form a region. A
region is a checkpoint's recomputation only if it repeats a product or a convolution:
torch's derivative formulas recompute elementwise values of the forward (a loss's
difference, an activation's input) but never a product, so those small repeats are
left for XLA to merge, as they should be.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

BARRIER = torch.ops.dynajax.recompute_barrier.default
aten = torch.ops.aten

# Ops whose repeat marks a region as a checkpoint's recomputation.
PRODUCTS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
    }
)


def _pure(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target is BARRIER or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not target._schema.is_mutable


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def repeats(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each node that repeats an earlier one on the same arguments -> the earlier one."""
    first: dict[Any, torch.fx.Node] = {}
    same: dict[torch.fx.Node, torch.fx.Node] = {}

    def canonical(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", same.get(a, a).name)
        if isinstance(a, (list, tuple)):
            return tuple(canonical(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, canonical(v)) for k, v in a.items()))
        return (type(a).__name__, repr(a))

    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            # An output of a repeated op with several repeats the same output of the op
            # it repeats.
            src, index = node.args
            if isinstance(src, torch.fx.Node) and src in same:
                for user in same[src].users:
                    if user.target is operator.getitem and user.args[1] == index:
                        same[node] = user
            continue
        if not _pure(node):
            continue
        key = (node.target, canonical(node.args), canonical(node.kwargs))
        if key in first:
            same[node] = first[key]
        else:
            first[key] = node
    return same


def regions(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """``nodes`` grouped where one reads another (union-find), each in graph order."""
    parent = {n: n for n in nodes}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in parent:
                parent[root(a)] = root(n)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        groups.setdefault(root(n), []).append(n)
    return list(groups.values())


def recomputed_regions(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The regions of ``graph`` that a checkpoint recomputes: connected repeats of
    earlier ops, each repeating a product or a convolution (graph order)."""
    same = repeats(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return [
        region
        for region in regions(sorted(same, key=order.__getitem__))
        if any(n.target in PRODUCTS for n in region)
    ]


class KeepRecomputation(PassBase):
    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        nodes = list(graph.nodes)
        modified = False
        for region in recomputed_regions(graph):
            members = set(region)
            outside = [
                a
                for a in dict.fromkeys(a for n in region for a in n.all_input_nodes)
                if a not in members and _is_tensor(a)
            ]
            # The forward's values the region reads (the block's input); where it reads
            # the program's inputs alone (the first block reads the batch), those.
            computed = [a for a in outside if a.op != "placeholder"]
            opaque = computed or outside
            after = _backward_value_before(nodes, order[region[0]], members)
            if not opaque or after is None:
                continue
            put_behind_barrier(graph, opaque, [after], region)
            modified = True
        return PassResult(graph_module, modified)  # (run_pass_list lints, recompiles)


def put_behind_barrier(
    graph: torch.fx.Graph,
    values: list[torch.fx.Node],
    after: list[torch.fx.Node],
    readers: list[torch.fx.Node],
) -> torch.fx.Node:
    """Inserts ``recompute_barrier(values, after)`` before the first of ``readers`` (in
    graph order) and makes the readers read its outputs instead of ``values``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(readers, key=order.__getitem__)):
        barrier = graph.call_function(BARRIER, (values, after))
        barrier.meta["val"] = [a.meta["val"] for a in values]
        kept = {}
        for i, a in enumerate(values):
            kept[a] = graph.call_function(operator.getitem, (barrier, i))
            kept[a].meta["val"] = a.meta["val"]
    for n in readers:
        for a, b in kept.items():
            n.replace_input_with(a, b)
    return barrier


def _backward_value_before(
    nodes: list[torch.fx.Node], start: int, region: set[torch.fx.Node]
) -> torch.fx.Node | None:
    """The last tensor with elements computed before ``nodes[start]`` outside the
    region: in a trace through the backward, the backward's value whose use triggered
    the recomputation (or one just before it)."""
    for node in reversed(nodes[:start]):
        if node in region or node.op != "call_function" or not _is_tensor(node):
            continue
        if node.meta["val"].numel() > 0:
            return node
    return None

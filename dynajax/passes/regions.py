"""InlineRegions: a region called through ``invoke_subgraph`` becomes its ops.

    before:  x -> invoke_subgraph(subgraph_0, x, w0) -> getitem[0] -> ...
    after:   x -> t(w0) -> mm(x, t) -> ...          (subgraph_0's ops, meta kept)

``torch.compiler.nested_compile_region`` (a function or a layer's ``forward`` the user
marked) reaches the backend as calls of torch's ``invoke_subgraph`` higher-order op:
Dynamo and aot_autograd traced the region once, and every call (its forward, and in the
backward graph its backward) names that one ATen subgraph. The table has rules for
ATen's operators, not for a call of a graph, so each call is replaced by the
subgraph's own nodes, which are then decided, partitioned and lowered one by one like
every other op: the region runs in JAX, inside the partition around it, and an op of
it with no rule is the only part kept in PyTorch. A region inside a region is inlined
with it. Each copied node notes its region and call (``REGION_KEY``: the identifier and
the call's index), which the report counts. (Each call is then lowered and compiled as
its own ops: the region is traced once by torch, not yet by JAX or XLA.)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

REGION_KEY = "dynajax_region"  # node.meta: (the region's identifier, its call's index)


def is_region_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a traced region (torch's ``invoke_subgraph``)."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    return node.op == "call_function" and hop is not None and node.target is hop


def _inline_calls(gm: torch.fx.GraphModule) -> bool:
    """Inlines every region call of ``gm`` (and of the regions it calls). Returns
    whether the graph changed."""
    graph = gm.graph
    found = [n for n in graph.nodes if is_region_call(n)]
    holders = {n.args[0] for n in found}
    calls: dict[str, int] = {}
    for node in found:
        identifier = str(node.args[1])
        calls[identifier] = calls.get(identifier, 0) + 1
        _inline_call(gm, node, calls[identifier] - 1)
    for holder in holders:
        assert isinstance(holder, torch.fx.Node) and holder.op == "get_attr"
        if not holder.users:
            graph.erase_node(holder)
    for name in {str(h.target) for h in holders} - {
        str(n.target) for n in graph.nodes if n.op == "get_attr"
    }:
        delattr(gm, name)
    return bool(found)


def _inline_call(gm: torch.fx.GraphModule, node: torch.fx.Node, index: int) -> None:
    """Replaces the region call ``node`` (its region's call ``index``) by a copy of its
    subgraph's nodes."""
    graph = gm.graph
    holder, identifier, *operands = node.args
    assert isinstance(holder, torch.fx.Node) and holder.op == "get_attr"
    sub = getattr(gm, str(holder.target))
    assert isinstance(sub, torch.fx.GraphModule)
    _inline_calls(sub)  # (its own regions first)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise ValueError(
            f"invoke_subgraph {identifier!r} passes {len(operands)} operand(s) to a "
            f"subgraph of {len(placeholders)} input(s)"
        )
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op in ("placeholder", "output"):
                continue
            copied = graph.node_copy(inner, env.__getitem__)  # (meta kept)
            copied.meta[REGION_KEY] = (str(identifier), index)
            if inner.op == "get_attr":  # (a constant of the region's)
                copied.target = _attribute(gm, sub, str(inner.target))
            env[inner] = copied
    output = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    results = torch.fx.node.map_arg(output.args[0], env.__getitem__)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise ValueError(f"invoke_subgraph {identifier!r} is read other than by index")
    graph.erase_node(node)


def _attribute(gm: torch.fx.GraphModule, sub: torch.fx.GraphModule, target: str) -> str:
    """``sub``'s attribute ``target`` registered on ``gm`` (a free name), for a node
    copied from ``sub`` into ``gm``."""
    value = getattr(sub, target)
    name, i = target, 0
    while hasattr(gm, name) and getattr(gm, name) is not value:
        i += 1
        name = f"{target}_{i}"
    if not hasattr(gm, name):
        setattr(gm, name, value)  # (a Module is registered as a submodule)
    return name


class InlineRegions(PassBase):
    """Replaces each call of a traced region by the region's ops (module doc)."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        return PassResult(graph_module, _inline_calls(graph_module))

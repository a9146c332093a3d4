"""compute_sizes_from_inputs: symbolic sizes read off the graph's inputs, not its intermediates.

    before:  jax_0 -> cat -> sym_size(cat, 2) -> jax_1(..., size)
    after:   s2 -> add(s2, 1) -> jax(..., size)          (one partition)

Under dynamic shapes the ATen graph asks for sizes on the host (``sym_size.int``), and
some of them are sizes of intermediate tensors: a KV cache after ``cat`` in a decoder
step, for instance. Such a node needs the tensor on the host, so the partitioner has to
end the JAX partition that produces it and start another after it: three partitions
(and three XLA compiles per new length) for a 2-layer LLaMA step. The size itself is
known without the tensor: fake-tensor propagation gave it a symbolic expression in the
sizes of the graph's inputs (``s2 + 1``). This pass rebuilds that expression from the
inputs' sizes with host arithmetic (``operator.add``/``mul``), so nothing on the host
waits for a JAX result and the partition stays whole. Sizes whose expression uses
anything but sums and products of input sizes and integers are left as they are.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

aten = torch.ops.aten


class ComputeSizesFromInputs(PassBase):
    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        sources = _input_sizes(graph)
        if not sources:
            return PassResult(graph_module, False)
        modified = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.sym_size.int:
                continue
            tensor = node.args[0]
            val = node.meta.get("val")
            if not isinstance(tensor, torch.fx.Node) or tensor.op == "placeholder":
                continue
            if not isinstance(val, torch.SymInt):
                continue
            with graph.inserting_before(node):
                built = _build(graph, val.node.expr, sources)
            if not isinstance(built, torch.fx.Node):  # None, or a constant (left as is)
                continue
            node.replace_all_uses_with(built)
            graph.erase_node(node)
            modified = True
        return PassResult(graph_module, modified)


def _input_sizes(graph: torch.fx.Graph) -> dict[sympy.Symbol, tuple[Any, ...]]:
    """Each size symbol that is exactly an input's size: (placeholder, dim, SymInt), or
    (placeholder, None, SymInt) for a SymInt input."""
    sources: dict[sympy.Symbol, tuple[Any, ...]] = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = val.node.expr
            if isinstance(expr, sympy.Symbol):
                sources.setdefault(expr, (node, None, val))
        elif isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, (node, dim, size))
    return sources


def _build(
    graph: torch.fx.Graph,
    expr: sympy.Expr,
    sources: dict[sympy.Symbol, tuple[Any, ...]],
) -> Any:
    """Nodes (or an int) computing ``expr`` from the inputs' sizes; None if it cannot
    (nodes already made for a part of it are left to dead-code elimination)."""
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        found = sources.get(expr)
        if found is None:
            return None
        placeholder, dim, size = found
        if dim is None:
            return placeholder
        node = graph.call_function(aten.sym_size.int, (placeholder, dim))
        node.meta["val"] = size
        return node
    if isinstance(expr, sympy.Add | sympy.Mul):
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
        terms = [_build(graph, arg, sources) for arg in expr.args]
        if any(t is None for t in terms):
            return None
        result, result_val = terms[0], _value(terms[0])
        for term in terms[1:]:
            result_val = op(result_val, _value(term))
            node = graph.call_function(op, (result, term))
            node.meta["val"] = result_val
            result = node
        return result
    return None


def _value(term: Any) -> Any:
    return term.meta["val"] if isinstance(term, torch.fx.Node) else term

"""Runs the elementwise updates of a step's convolution weights on flat arrays.

XLA's CPU compiler emits an elementwise fusion as loops over its output's shape, the
innermost over the last dimension. For a convolution's weight (out, in, 3, 3) that loop
runs 3 iterations and is not vectorized, so an update with a square root and divisions
(Adam's) costs several times what it costs on the same numbers laid out flat: ResNet-18's
AdamW update, 21 weights of 11.7M elements, took 19.6 ms in 4-D and 8.8 ms flat, the
whole step's largest gap to eager's fused kernel (``benchmarks/README.md``).

``train_step`` therefore keeps such arrays flat at its program's boundary (on a CPU; the
program reshapes them to their shapes where it reads them, which XLA makes a bitcast),
and this pass makes the math that computes their new values flat as well: from each
output it names, it takes the elementwise ops of the output's shape that compute it
(``torch.Tag.pointwise``, every tensor operand of that shape or a scalar), and runs them
on ``view(x, [-1])`` of their operands, viewing back to the shape what other ops read:

    before:  p, m, g (out, in, 3, 3) -> lerp -> mul -> ... -> sub -> (new p, new m)
    after:   view(p|m|g, [-1]) -> lerp -> mul -> ... -> sub -> view(., shape) -> (new p, m)

XLA cancels the views against the boundary's reshapes, so each fusion writes a flat
output. The values are the same: the same ops on the same elements in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

aten = torch.ops.aten


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(d) for d in val.shape)
    except TypeError:  # symbolic sizes
        return None


def _elementwise_of(node: torch.fx.Node, shape: tuple[int, ...]) -> bool:
    """Whether ``node`` is an elementwise op giving ``shape`` from operands of that
    shape and scalars (0-d tensors, Python numbers)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise not in target.tags or target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if _shape(node) != shape or not node.meta["val"].is_contiguous():
        return False
    for a in [*node.args, *node.kwargs.values()]:
        if isinstance(a, torch.fx.Node):
            s = _shape(a)
            if s is None or (s != shape and s != ()):
                return False
            # (a flat view of a strided operand is no view: such an op stays as it is)
            if s == shape and not a.meta["val"].is_contiguous():
                return False
        elif isinstance(a, (list, tuple)):
            return False
    return True


class FlattenUpdates(PassBase):
    """Args:
    outputs: indices of the graph's outputs whose elementwise computation runs flat.
    """

    def __init__(self, outputs: Sequence[int]) -> None:
        self.outputs = list(outputs)

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        values: Any = graph.output_node().args[0]
        region: dict[torch.fx.Node, tuple[int, ...]] = {}
        for j in self.outputs:
            new = values[j]
            shape = _shape(new)
            if shape is None or len(shape) < 2:
                continue
            stack: list[torch.fx.Node] = [new]
            while stack:
                n = stack.pop()
                if n in region or not _elementwise_of(n, shape):
                    continue
                region[n] = shape
                stack.extend(a for a in n.all_input_nodes if _shape(a) == shape)
        if not region:
            return PassResult(graph_module, False)
        flat: dict[torch.fx.Node, torch.fx.Node] = {}  # a node -> its flat value

        body = next(n for n in graph.nodes if n.op != "placeholder")

        def flat_of(a: Any) -> Any:
            if not isinstance(a, torch.fx.Node) or _shape(a) == ():
                return a
            if a not in flat:
                # (right where the operand is defined: other passes may read the view
                # before the update's first op)
                where = graph.inserting_before(body) if a.op == "placeholder" else None
                with where or graph.inserting_after(a):
                    flat[a] = graph.call_function(aten.view.default, (a, [-1]))
                flat[a].meta["val"] = a.meta["val"].reshape(-1)
            return flat[a]

        for n in [n for n in graph.nodes if n in region]:
            args = tuple(flat_of(a) for a in n.args)
            kwargs = {k: flat_of(v) for k, v in n.kwargs.items()}
            with graph.inserting_before(n):
                f = graph.call_function(n.target, args, kwargs)
            f.meta["val"] = n.meta["val"].reshape(-1)
            with graph.inserting_after(n):
                back = graph.call_function(aten.view.default, (f, list(region[n])))
            back.meta["val"] = n.meta["val"]
            n.replace_all_uses_with(back)
            flat[n] = f
        for n in reversed([n for n in graph.nodes if n in region]):
            graph.erase_node(n)
        # A view back that only the flat ops read is dead.
        for n in reversed(list(graph.nodes)):
            if n.op == "call_function" and n.target is aten.view.default and not n.users:
                graph.erase_node(n)
        return PassResult(graph_module, True)  # (run_pass_list lints, recompiles)

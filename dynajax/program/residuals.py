"""A joint graph split into a forward that saves what its backward reads, and that
backward, as aot_autograd's partitioner splits its joint graph.

torch's backward of a ``jax_function`` is traced as one graph (``interop/autograd.py``):

    (primals..., tangents...) -> (forward outputs..., gradients...)

where the forward's ops come first and the backward's read the tangents. Run whole as
the VJP, that graph computes the forward a second time after the program's own forward
(XLA shares only the ops it finds identical in both). ``split_joint`` cuts it by
dataflow: the nodes that do not depend on a tangent are the forward, which returns its
outputs and the values the backward reads (the residuals, saved as aot_autograd's
default partition saves them); the rest is the backward, which takes those values and
the tangents. Tensor constants are read where they are used, not saved.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.fx


@dataclasses.dataclass
class Split:
    """``forward``: ``(primals...) -> (outputs..., saved...)``; ``backward``:
    ``(saved..., tangents...) -> (gradients...)``; ``n_saved`` residuals."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    n_saved: int


def split_joint(gm: torch.fx.GraphModule, n_primals: int, n_outputs: int) -> Split | None:
    """``gm`` (placeholders: ``n_primals`` primals, then the tangents; outputs: the
    forward's ``n_outputs``, then the gradients) as a forward and a backward; None where
    it cannot be split (a forward output that reads a tangent, a residual that is not a
    tensor)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tangents = placeholders[n_primals:]
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = list(output.args[0])
    outputs, grads = results[:n_outputs], results[n_outputs:]
    backward: set[torch.fx.Node] = set(tangents)
    for node in graph.nodes:
        if node.op == "call_function" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    if any(isinstance(o, torch.fx.Node) and o in backward for o in outputs):
        return None

    def forward_value(a: Any) -> bool:
        return isinstance(a, torch.fx.Node) and a not in backward and a.op != "get_attr"

    # The forward's values the backward reads, or returns as a gradient, in graph order.
    read = {a for n in backward for a in n.all_input_nodes if forward_value(a)}
    read |= {g for g in grads if forward_value(g)}
    saved = [n for n in graph.nodes if n in read]
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in saved):
        return None

    fw = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op != "output" and node not in backward:
            env[node] = fw.node_copy(node, lambda a: env[a])
    fw.output(tuple([_mapped(o, env) for o in outputs] + [env[n] for n in saved]))

    bw = torch.fx.Graph()
    benv: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in saved:
        benv[n] = bw.placeholder(f"saved_{n.name}")
        benv[n].meta = copy.copy(n.meta)
    for t in tangents:
        benv[t] = bw.node_copy(t)

    def bw_arg(a: torch.fx.Node) -> torch.fx.Node:
        if a not in benv:  # a tensor constant (get_attr), read here too
            benv[a] = bw.node_copy(a)
        return benv[a]

    for node in graph.nodes:
        if node in backward and node.op != "placeholder":
            benv[node] = bw.node_copy(node, bw_arg)
    bw.output(tuple(_mapped(g, benv) for g in grads))
    forward, backward_gm = torch.fx.GraphModule(gm, fw), torch.fx.GraphModule(gm, bw)
    for part in (forward, backward_gm):
        part.graph.eliminate_dead_code()
        part.graph.lint()
        part.recompile()
    return Split(forward, backward_gm, len(saved))


def _mapped(value: Any, env: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    return env[value] if isinstance(value, torch.fx.Node) else value

"""remove_noop_ops: drops ops that are the identity in a functional graph.

    before:  x -> alias -> sin -> out
    after:   x -> sin -> out

``alias``/``detach`` only matter for autograd and aliasing, which aot_autograd has
already resolved; a node feeding the graph output is kept so the output's aliasing
relation (seen by aot_autograd's runtime wrappers) is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

aten = torch.ops.aten

NOOP_OPS = frozenset({aten.alias.default, aten.detach.default})


class RemoveNoopOps(PassBase):
    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function" or node.target not in NOOP_OPS:
                continue
            if any(user.op == "output" for user in node.users):
                continue
            node.replace_all_uses_with(node.args[0])
            graph_module.graph.erase_node(node)
            modified = True
        return PassResult(graph_module, modified)


class EliminateDeadCode(PassBase):
    """Removes nodes whose values nobody uses (side-effecting ops are kept)."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        return PassResult(graph_module, graph_module.graph.eliminate_dead_code())

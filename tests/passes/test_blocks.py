"""The repeated blocks of a graph (``passes/blocks.py``): the alike layers of one
ModuleList, from the module stack Dynamo records on each node, in each of torch's
spellings of a layer's path; a layer that differs is not one of them; the first block
as a graph of its own computes what it computes in the graph."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from dynajax.passes.blocks import block_graph, repeated_blocks

SPELLINGS = {
    "dotted": lambda i: f"L['self'].layers.{i}",
    "indexed": lambda i: f"L['self'].layers[{i}]",
    "modules": lambda i: f"L['self']._modules['layers']._modules['{i}']",
}


class _Layer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, hidden), nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(h) for h in hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _graph(hidden: list[int], spelling: str) -> torch.fx.GraphModule:
    """The stack traced to calls of functions (as Dynamo's graphs are), each node with
    its value (``meta["val"]``) and the module stack Dynamo would record."""
    model = _Stack(hidden)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return False

    tracer = Tracer()
    graph = tracer.trace(model)
    gm = torch.fx.GraphModule(model, graph)
    ShapeProp(gm).propagate(torch.randn(4, 8))
    path = SPELLINGS[spelling]
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        node.meta["val"] = torch.empty(meta.shape) if meta is not None else None
        stack = node.meta.get("nn_module_stack")  # FX's own record: "layers.0", "layers.0.up"
        if stack:
            spelled = {}
            for key, (module, cls) in stack.items():
                match = re.match(r"layers\.(\d+)(.*)", module)
                assert match is not None, module
                spelled[key] = (path(int(match[1])) + match[2], cls)
            node.meta["nn_module_stack"] = spelled
    return gm


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_the_alike_layers_of_a_module_list_are_found(spelling: str) -> None:
    gm = _graph([16, 16, 16], spelling)
    blocks = repeated_blocks(gm)
    assert blocks is not None and len(blocks) == 3
    assert blocks.name == "layers.* (_Layer)"
    assert all(len(m) == len(blocks.members[0]) for m in blocks.members)


def test_a_layer_that_differs_is_not_one_of_them() -> None:
    gm = _graph([16, 32, 16, 16], "dotted")
    blocks = repeated_blocks(gm)
    assert blocks is not None and len(blocks) == 3  # layers 0, 2 and 3
    widths = {n.meta["val"].shape[-1] for m in blocks.members for n in m if "relu" in n.name}
    assert widths == {16}
    assert repeated_blocks(_graph([16, 32, 64], "dotted")) is None


def test_the_first_block_as_a_graph_computes_what_it_computes_in_the_graph() -> None:
    gm = _graph([16, 16], "dotted")
    blocks = repeated_blocks(gm)
    assert blocks is not None
    sub, examples, copies = block_graph(gm, blocks.members[0])
    assert set(copies) == set(blocks.members[0])
    [x] = [e for e in examples if e is not None]  # (the layer's input; its weights are attributes)
    assert x.shape == (4, 8)
    values: dict[str, torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            values[n.name] = out
            return out

    inp = torch.randn(4, 8)
    Recorder(gm).run(inp)
    first_input = next(p for p in sub.graph.nodes if p.op == "placeholder")
    (out,) = sub(values[first_input.target])
    last = [n for n in blocks.members[0] if any(u not in copies for u in n.users)]
    assert len(last) == 1
    torch.testing.assert_close(out, values[last[0].name], rtol=0, atol=0)

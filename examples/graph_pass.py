"""A graph pass of your own: the option ``passes``.

    python examples/graph_pass.py

A pass is a ``torch.fx`` ``PassBase`` (or a function of a ``GraphModule``) that the
backend runs at a stage you name: ``pre_aot`` (Dynamo's torch-level graph),
``post_aot`` (each ATen graph, forward and backward, before dynajax's own passes) or
``post_passes`` (after them, before dynajax decides what runs in JAX). The ATen stages
run in dynajax's own ``PassManager``, which lints the graph after every pass.

Here a ``pre_aot`` pass switches every exact (erf) GELU to its tanh approximation, a
change of numerics the user chooses. It runs before aot_autograd, so the backward is
the derivative of the changed forward; a ``post_aot`` pass would see the forward and
the backward graphs one at a time (the backward's GELU derivative is already
decomposed into ``erf`` and ``exp`` there). A second pass counts the ops each ATen
graph holds after dynajax's passes.
"""

from __future__ import annotations

import collections
import copy

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import dynajax


class UseTanhGelu(PassBase):
    """``F.gelu(x)`` -> ``F.gelu(x, approximate="tanh")`` in Dynamo's graph."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target is torch.nn.functional.gelu:
                node.update_kwarg("approximate", "tanh")
                modified = True
        return PassResult(graph_module, modified)


OPS_SEEN: list[collections.Counter[str]] = []


def count_ops(gm: torch.fx.GraphModule) -> None:
    """A plain function works too: it changes the graph in place (here: not at all)."""
    OPS_SEEN.append(
        collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    )


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    reference = copy.deepcopy(model)
    reference[1] = torch.nn.GELU(approximate="tanh")
    x = torch.randn(4, 8)

    backend = dynajax.Backend(passes={"pre_aot": [UseTanhGelu()], "post_passes": count_ops})
    out = torch.compile(model, backend=backend)(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()

    print(dynajax.Report(backend.graphs))
    for counts in OPS_SEEN:
        print("post_passes saw:", dict(counts))
    grad_err = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    print(f"\noutput vs eager tanh-GELU model: {float((out - expected).abs().max().detach()):.1e}")
    print(f"gradients within {grad_err:.1e}")
    assert torch.allclose(out, expected, atol=1e-6) and grad_err < 1e-6
    # The forward keeps gelu (now with approximate="tanh"); the backward differentiates
    # it, in sigmoid form (dynajax/aot/table.py writes tanh-GELU's gradient without tanh).
    assert len(OPS_SEEN) == 2 and OPS_SEEN[0]["aten.gelu.default"] == 1
    assert OPS_SEEN[1]["aten.sigmoid.default"] == 2


if __name__ == "__main__":
    main()

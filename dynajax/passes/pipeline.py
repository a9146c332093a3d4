"""The pass pipeline run on every ATen graph before capability and partitioning."""

from __future__ import annotations

import torch.fx
from torch.fx.passes.infra.pass_manager import PassManager

from dynajax.passes.noop import EliminateDeadCode, RemoveNoopOps
from dynajax.passes.sizes import ComputeSizesFromInputs
from dynajax.passes.unused_vectors import DropUnusedVectors


def _graph_is_valid(module: torch.nn.Module) -> None:
    if isinstance(module, torch.fx.GraphModule):
        module.graph.lint()


def run_passes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Runs every pass in order, linting the graph after each; returns the new module."""
    manager = PassManager(
        passes=[
            RemoveNoopOps(),
            ComputeSizesFromInputs(),
            EliminateDeadCode(),
            DropUnusedVectors(),
        ],
        run_checks_after_each_pass=True,
    )
    manager.add_checks(_graph_is_valid)
    result = manager(gm)
    if result.modified:
        result.graph_module.recompile()
    return result.graph_module

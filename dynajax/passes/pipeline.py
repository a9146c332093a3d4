"""The pass pipeline run on every ATen graph before capability and partitioning."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_manager import PassManager

from dynajax.passes.noop import EliminateDeadCode, RemoveNoopOps
from dynajax.passes.sizes import ComputeSizesFromInputs
from dynajax.passes.unused_vectors import DropUnusedVectors


def _graph_is_valid(module: torch.nn.Module) -> None:
    if isinstance(module, torch.fx.GraphModule):
        module.graph.lint()


def run_passes(
    gm: torch.fx.GraphModule, before: Sequence[PassBase] = (), after: Sequence[PassBase] = ()
) -> torch.fx.GraphModule:
    """Runs every pass in order, linting the graph after each; returns the new module.

    ``before`` and ``after``: the user's passes (option ``passes``, stages ``post_aot``
    and ``post_passes``), run by the same manager before and after dynajax's own.
    """
    manager = PassManager(
        passes=[
            *before,
            RemoveNoopOps(),
            ComputeSizesFromInputs(),
            EliminateDeadCode(),
            DropUnusedVectors(),
            *after,
        ],
        run_checks_after_each_pass=True,
    )
    manager.add_checks(_graph_is_valid)
    result = manager(gm)
    if result.modified:
        result.graph_module.recompile()
    return result.graph_module

"""The pass pipeline run on every ATen graph before capability and partitioning: every
pass either driver runs, in one list (``run_passes``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_manager import PassManager

from dynajax.passes.flat_updates import FlattenUpdates
from dynajax.passes.inplace import OrderInPlaceUpdates
from dynajax.passes.noop import EliminateDeadCode, RemoveNoopOps
from dynajax.passes.recompute import KeepRecomputation
from dynajax.passes.sizes import ComputeSizesFromInputs
from dynajax.passes.unused_vectors import DropUnusedVectors


def _graph_is_valid(module: torch.nn.Module) -> None:
    if isinstance(module, torch.fx.GraphModule):
        module.graph.lint()


def run_passes(
    gm: torch.fx.GraphModule,
    before: Sequence[PassBase] = (),
    after: Sequence[PassBase] = (),
    *,
    keep_recomputation: bool = False,
    flatten: tuple[int, ...] = (),
    donated: tuple[tuple[int, int], ...] = (),
) -> torch.fx.GraphModule:
    """Runs every pass in order, linting the graph after each; returns the new module.

    The order, for both drivers:

        before                 the user's passes at stage ``post_aot`` (option
                               ``passes``; ``jax_function(passes=...)``)
        RemoveNoopOps          ops that return their input unchanged
        ComputeSizesFromInputs symbolic sizes read off the graph's inputs, not its
                               intermediates
        EliminateDeadCode      nodes nothing reads (and no side effect)
        DropUnusedVectors      SVD and eigh asked for values only where nothing
                               reads their vectors
        KeepRecomputation      ``keep_recomputation`` (the whole-graph driver, for a
                               backward): each region ``torch.utils.checkpoint``
                               recomputes starts behind a barrier
        FlattenUpdates         ``flatten``: those outputs' elementwise computation on
                               flat arrays
        OrderInPlaceUpdates    ``donated`` (input, output) pairs: each update after
                               its input's other readers, so XLA writes it in place
        after                  the user's passes at stage ``post_passes``

    (The aot stage rewrites in-place writes, ``passes/writes.py``, inside
    aot_autograd's trace, before any of these.)
    """
    own: list[PassBase] = [
        RemoveNoopOps(),
        ComputeSizesFromInputs(),
        EliminateDeadCode(),
        DropUnusedVectors(),
    ]
    if keep_recomputation:
        own.append(KeepRecomputation())
    if flatten:
        own.append(FlattenUpdates(flatten))
    if donated:
        own.append(OrderInPlaceUpdates(donated))
    manager = PassManager(passes=[*before, *own, *after], run_checks_after_each_pass=True)
    manager.add_checks(_graph_is_valid)
    result = manager(gm)
    if result.modified:
        result.graph_module.recompile()
    return result.graph_module

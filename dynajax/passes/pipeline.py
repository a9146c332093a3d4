"""The pass pipeline run on every ATen graph before capability and partitioning: every
pass either driver runs, in one list (``run_passes``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase

from dynajax.passes.flat_updates import FlattenUpdates
from dynajax.passes.inplace import OrderInPlaceUpdates
from dynajax.passes.noop import EliminateDeadCode, RemoveNoopOps
from dynajax.passes.recompute import KeepRecomputation
from dynajax.passes.regions import InlineRegions
from dynajax.passes.sizes import ComputeSizesFromInputs
from dynajax.passes.unused_vectors import DropUnusedVectors


def run_pass_list(
    gm: torch.fx.GraphModule,
    passes: Sequence[Callable[[torch.fx.GraphModule], Any]],
    *,
    own: Sequence[PassBase] = (),
) -> torch.fx.GraphModule:
    """Runs ``passes`` in order, linting the graph before them and after each, as
    torch.fx's ``PassManager`` does (and with its error, which names the pass that
    raised and those before it); returns the module.

    Unlike the PassManager, the module's Python code is made once, at the end
    (``GraphModule.recompile``: 0.17 s on a GPT-2 training step of 8 layers, 5,800 nodes,
    which the PassManager paid after every pass). Only a pass not in ``own`` (the
    user's, which may call the module) gets it fresh before it runs; dynajax's passes
    read the graph only.
    """
    if not passes:
        return gm
    gm.graph.lint()  # the graph as it comes, before any pass
    ours = {id(p) for p in own}
    stale = changed = False
    for i, fn in enumerate(passes):
        name = fn.__name__ if inspect.isfunction(fn) else type(fn).__name__
        if stale and id(fn) not in ours:
            gm.recompile()
            stale = False
        try:
            result = fn(gm)
            if not hasattr(result, "graph_module"):
                raise TypeError(
                    f"The result of the pass {name} should be type PassResult. Please wrap "
                    "it with pass_result_wrapper()"
                )
            gm = result.graph_module
            gm.graph.lint()
        except Exception as e:
            before = [f.__name__ if inspect.isfunction(f) else type(f).__name__ for f in passes[:i]]
            raise Exception(
                f"An error occurred when running the '{name}' pass after the following "
                f"passes: {before}"
            ) from e
        if result.modified or id(fn) not in ours:  # (a user's pass may not say)
            stale = changed = True
    if changed:
        gm.recompile()
    return gm


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

        InlineRegions          each call of a region traced once
                               (``torch.compiler.nested_compile_region``) by
                               the region's ops
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
    regions = InlineRegions()
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
    return run_pass_list(gm, [regions, *before, *own, *after], own=[regions, *own])

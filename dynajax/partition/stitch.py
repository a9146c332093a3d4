"""The stitched graph as the callable handed back to aot_autograd.

After partitioning and compilation, the outer graph calls each ``jax_<n>`` submodule
and runs the nodes left in PyTorch between them. ``stitched_callable`` wraps it in
aot_autograd's boxed calling convention, and skips the GraphModule entirely when the
graph is one partition between its inputs and outputs:

    placeholders -> jax_0 -> getitem* -> output        (called as jax_0.run(args))

Its ``unboxed(first, around)`` is the same graph as a plain ``fn(*inputs)``, which
``aot/compile.py`` hands Dynamo instead of aot_autograd's runtime wrapper where that wrapper
would do nothing but write inputs back (``around`` does that): Dynamo's compiled frame
then calls the partition with no layer between.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.fx

from dynajax.partition.partitioner import PREFIX


@runtime_checkable
class PartitionModule(Protocol):
    """What the stitched graph needs of a compiled ``jax_<n>`` submodule."""

    graph_module: torch.fx.GraphModule  # the ATen graph it computes

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors in (the submodule's placeholders, in order), its outputs out."""
        ...


def stitched_callable(gm: torch.fx.GraphModule) -> Callable[[list[Any]], Any]:
    """The compiled callable for a stitched graph, in aot_autograd's boxed convention.

    aot_autograd calls it with one list of inputs, which the callee clears so inputs can
    be freed as soon as they are used. When the graph is a single JAX partition between
    its inputs and outputs (the common case), the partition is called directly, without
    the GraphModule and its nn.Module machinery; otherwise the GraphModule's generated
    ``forward`` runs (eager fallback ops between partitions). ``run.unboxed(first,
    around)`` makes the unboxed callable (``_first_then``), for Dynamo only: a single partition is
    called through ``run_guarded``, which relies on Dynamo's guards.
    """
    found = _single_partition(gm)
    unboxed: Callable[..., Any]
    if found is not None:
        run, unboxed = found
    else:
        forward = gm.forward

        def run(args: list[Any]) -> Any:
            inputs = tuple(args)
            args.clear()
            return forward(*inputs)

        def unboxed(args: tuple[Any, ...]) -> Any:
            return forward(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.graph_module = gm  # type: ignore[attr-defined]
    run.unboxed = functools.partial(_first_then, then=unboxed)  # type: ignore[attr-defined]
    return run


def _first_then(
    first: Callable[..., Any] | None,
    around: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    *,
    then: Callable[..., Any],
) -> Callable[..., Any]:
    """The unboxed callable ``fn(*inputs) -> outputs`` of a stitched graph, for a caller
    that hands Dynamo the graph's callable without aot_autograd's runtime wrapper
    (``aot.aot_compile``, where that wrapper would do nothing but write inputs back):
    the first call goes to ``first`` (aot_autograd's wrapper, which checks custom ops
    on first calls; None for a graph loaded from the cache, which has none), the rest
    straight to ``then``, which takes the tuple of inputs (a single partition's ``run``
    itself: one Python frame between Dynamo and the partition), or to ``around(then)``
    (the caller's own write-back of inputs)."""
    if around is not None:
        then = around(then)
    if first is None:
        hot = then

        def direct(*args: Any) -> Any:
            return hot(args)

        return direct
    pending = [first]

    def call(*args: Any) -> Any:
        if pending:  # two threads may both take it: both calls are correct
            once = pending[0]
            pending.clear()
            return once(*args)
        return then(args)

    return call


def _single_partition(
    gm: torch.fx.GraphModule,
) -> tuple[Callable[[list[Any]], Any], Callable[..., Any]] | None:
    """A direct call of the graph's only partition, boxed and unboxed, or None if the
    graph has more."""
    placeholders: dict[torch.fx.Node, int] = {}
    call = None
    getitems: dict[torch.fx.Node, int] = {}
    output = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders[node] = len(placeholders)
        elif node.op == "call_module" and call is None and not node.kwargs:
            sub = getattr(gm, str(node.target), None)
            if not str(node.target).startswith(PREFIX) or not isinstance(sub, PartitionModule):
                return None
            call = node
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and call is not None
            and node.args[0] is call
            and isinstance(node.args[1], int)
        ):
            getitems[node] = node.args[1]
        elif node.op == "output":
            output = node
        else:
            return None
    if call is None or output is None or not isinstance(output.args[0], list | tuple):
        return None
    if not all(a in placeholders for a in call.args):
        return None
    part: PartitionModule = getattr(gm, str(call.target))
    in_idx = [placeholders[a] for a in call.args]  # type: ignore[index]
    plan: list[tuple[int, Any]] = []  # (0, k): partition output k; (1, j): input j; (2, v)
    for o in output.args[0]:
        if o in getitems:
            plan.append((0, getitems[o]))  # type: ignore[index]
        elif o in placeholders:
            plan.append((1, placeholders[o]))  # type: ignore[index]
        elif o is None:
            plan.append((2, None))
        else:
            return None
    n_out = _n_outputs(part)
    identity_in = in_idx == list(range(len(placeholders)))
    identity_out = plan == [(0, k) for k in range(n_out)]
    call_part = part.run
    # The unboxed callable is only handed to Dynamo, whose guards have just fixed every
    # graph input's sizes and strides (``CompiledPartition.run_guarded``).
    call_guarded = getattr(part, "run_guarded", call_part)

    if identity_in and identity_out:

        def run(args: list[Any]) -> list[torch.Tensor]:
            outs = call_part(args)
            args.clear()
            return outs

        return run, call_guarded

    def run_mapped(args: list[Any]) -> list[Any]:
        outs = call_part([args[i] for i in in_idx])
        result = [outs[v] if kind == 0 else args[v] if kind == 1 else v for kind, v in plan]
        args.clear()
        return result

    def run_mapped_tuple(args: tuple[Any, ...]) -> list[Any]:
        outs = call_guarded([args[i] for i in in_idx])
        return [outs[v] if kind == 0 else args[v] if kind == 1 else v for kind, v in plan]

    return run_mapped, run_mapped_tuple


def _n_outputs(part: PartitionModule) -> int:
    for node in part.graph_module.graph.nodes:
        if node.op == "output":
            out = node.args[0]
            return len(out) if isinstance(out, list | tuple) else 1
    return -1

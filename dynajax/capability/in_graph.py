"""Cost choices timed in their graph: the whole graph run both ways.

Timed alone, an op's two paths can rank one way and the graph they sit in the other:
with PyTorch's kernel, the JAX partition around the op is cut in two, the tensors
between XLA's work and the kernel are made and crossed, XLA's fusions around the op are
lost, and the two runtimes hand their threads over twice. On the benchmark's
``attention-512`` row the attention alone took 14.8 ms in PyTorch and 16.1 ms in XLA,
yet the block ran 3-6% faster all in JAX (``benchmarks/RECORD.md``, 2026-11-29).

So where it can, the backend times the choice in place (``choose``): it partitions the
graph twice, once with every measured candidate (``cost._MEASURED``) in PyTorch and
once with them all in JAX, builds both, runs each on random inputs of the graph's
shapes and dtypes (blocks of calls, alternating, medians: ``time_both``), and keeps the
faster, whose partitions go on to run. A graph of repeated blocks (``passes/blocks.py``:
a transformer's layers, the calls of a marked region) is timed on its first block, a
graph of its own built both ways, and the faster way placed on every candidate of the
whole graph, built once (``_timed_part``). The times are remembered with the abstract
evaluations (``memo.py``), keyed by the machine and the graph (its code, the shapes of
its inputs, every node's verdict), so a later process builds only the winner.

A graph is not timed in place (an attention or encoder layer is then timed alone,
``cost.measure``; convolutions take the default, XLA) where running it on made-up
inputs is not safe or not possible: an input with a symbolic size, or not a CPU tensor
or a plain number; inputs over ``MAX_INPUT_BYTES`` (the random inputs would copy a large
model's weights); an op kept in PyTorch that is not ATen's own (a user's custom op may
have effects). The stand-in inputs keep the real ones' layouts (an expanded timestep,
a transposed weight: ``stand_in``). An error in any stage of the timing (building the
stand-ins, building or compiling either graph, running it on them) is not the
compile's: every candidate takes its default, and the report names the op and the
error (``cost.Unmeasured``). PyTorch's random generator is put back as it was, so
measuring draws nothing from the user's stream.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils._python_dispatch import _disable_current_modes

from dynajax.capability import cost
from dynajax.capability.verdict import verdict_of
from dynajax.passes.blocks import block_graph, repeated_blocks

log = logging.getLogger("dynajax.capability")

T = TypeVar("T")

# Each build is timed in _ROUNDS blocks of _ROUNDS calls, alternating (each block after
# an untimed call: as a program runs when called again and again; alternating call by
# call, PyTorch's OpenMP workers spinning after one build's kernel slowed the other's
# XLA programs, and the choice went against what the row ran). A graph whose call takes
# longer than _LONG_CALL_S (after its first, compiling, call) is timed in _FEW_ROUNDS
# blocks of _FEW_ROUNDS: measuring must not cost the first compile many times the graph.
_ROUNDS = 3
_LONG_CALL_S = 0.05
_FEW_ROUNDS = 2
# Timing in place makes random inputs of the graph's inputs (parameters included): a
# graph with more than this many bytes of inputs is not timed so (a copy of a large
# model's weights at its compile).
MAX_INPUT_BYTES = 1 << 30
# A graph of repeated blocks (passes/blocks.py: a ModuleList's layers, a marked region's
# calls) is timed on its first block, alone, where the blocks hold at least this share
# of its candidates: what one block's kernels gain or lose, each block gains or loses.
# The block's graph is the same at any depth: timing costs what one block costs, and
# its times, remembered by its fingerprint, serve a model of another depth.
_BLOCK_SHARE = 0.75


class NotTimed(Exception):
    """Why a graph cannot be timed in place."""


def concrete_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Random tensors (zeros for integers and booleans) of the example inputs' shapes,
    strides and dtypes (``stand_in``); plain numbers as they are. Raises NotTimed where
    the graph must not be run on them."""
    size = 0
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise NotTimed(f"an input on {x.device}")
            if not all(isinstance(d, int) for d in (*x.shape, *x.stride())):
                raise NotTimed("an input with a symbolic size")
            size += x.numel() * x.element_size()
        elif not isinstance(x, bool | int | float) or isinstance(x, torch.SymInt):
            raise NotTimed(f"an input of type {type(x).__name__}")
    if size > MAX_INPUT_BYTES:
        raise NotTimed(f"its inputs hold {size >> 20} MiB: a copy of them to time it")
    gen = torch.Generator().manual_seed(0)
    return [stand_in(x, gen) if isinstance(x, torch.Tensor) else x for x in example_inputs]


def stand_in(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fresh tensor of ``x``'s shape, strides, storage offset and dtype, its values
    random (``cost.random_tensor``): a view into new storage, filled whole before the
    view is taken, so that an expanded (stride 0) or overlapping layout is kept and
    never written through."""
    extent = 0
    if x.numel():
        extent = 1 + sum((d - 1) * s for d, s in zip(x.shape, x.stride(), strict=True))
    storage = cost.random_tensor((x.storage_offset() + extent,), x.dtype, gen)
    return storage.as_strided(x.shape, x.stride(), x.storage_offset())


def copy_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict[Any, Any]]:
    """A copy of ``gm`` over the same attributes, its nodes' meta shallow-copied (so
    verdicts set on the copy leave ``gm``'s alone); and the map of old nodes to new."""
    graph = torch.fx.Graph()
    nodes: dict[Any, Any] = {}
    out = graph.graph_copy(gm.graph, nodes)
    graph.output(out)
    graph._codegen = gm.graph._codegen
    return _LazyGraphModule(gm, graph), nodes  # (its code made only if it is called)


def fingerprint(gm: torch.fx.GraphModule) -> str:
    """What the graph's two timings depend on besides the machine: its code, the shapes,
    strides and dtypes of its inputs and constants, and every node's verdict."""
    parts = [str(gm.graph)]
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor):
            parts.append(f"{n.name}:{v.dtype}{tuple(v.shape)}{v.stride()}")
        verdict = verdict_of(n)
        if verdict is not None:
            parts.append(f"{n.name}:{verdict.supported}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# Modules of the Python functions a graph may call in PyTorch that have no effects
# (arithmetic on sizes, getitem).
_PURE_MODULES = ("_operator", "operator", "math", "builtins", "torch")


def not_timed(gm: torch.fx.GraphModule) -> str | None:
    """Why ``gm`` must not run on made-up inputs, or None: an op it runs in PyTorch
    that is not ATen's own (a user's op, a higher-order op around one: either may have
    effects)."""
    for n in gm.graph.nodes:
        verdict = verdict_of(n)
        if n.op != "call_function" or verdict is None or verdict.supported:
            continue
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            if target.namespace in ("aten", "prims"):
                continue
        elif getattr(target, "__module__", None) in _PURE_MODULES:
            continue
        return f"{target} runs in PyTorch (not one of ATen's own ops)"
    return None


def time_both(
    runs: Sequence[Callable[[list[Any]], Any]], inputs: list[Any]
) -> tuple[list[float], float]:
    """The median time of each boxed graph callable on ``inputs`` (each called once
    first: its partitions compile), timed in alternating blocks of calls, and what it
    all took. PyTorch's random generator is left as it was."""
    start = time.perf_counter()
    rng = torch.random.get_rng_state()
    try:
        with _disable_current_modes(), torch.no_grad():
            calls = [(lambda run=run: run(list(inputs))) for run in runs]
            for call in calls:
                call()
            t = time.perf_counter()
            calls[0]()
            long = time.perf_counter() - t >= _LONG_CALL_S
            times = cost.median_times(
                *calls,
                rounds=_FEW_ROUNDS if long else _ROUNDS,
                untimed_first=False,
                block=_FEW_ROUNDS if long else _ROUNDS,
            )
    finally:
        torch.random.set_rng_state(rng)
    return times, time.perf_counter() - start


def choose(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    candidates: Sequence[torch.fx.Node],
    place: Callable[[torch.fx.Node, bool, str], None],
    build: Callable[[torch.fx.GraphModule], T],
    run_of: Callable[[T], Callable[[list[Any]], Any]],
    remembered: Callable[[str, Callable[[], tuple[float, float, float]]], Any],
) -> T:
    """Builds ``gm`` with its ``candidates`` in PyTorch and in JAX (``place(node,
    in_pytorch, why)`` on a copy's node sets its verdict), times both (or its first
    repeated block both ways, ``_timed_part``) unless ``remembered`` (keyed by the
    fingerprint of what is timed) knows the times, and returns the faster's build of
    ``gm``, its first candidate carrying the ``CostChoice``. Raises NotTimed where the
    graph must not be timed so, ``cost.MeasureFailed`` where a stage of the timing
    raised."""
    why = not_timed(gm)
    if why is not None:
        raise NotTimed(why)
    timed, timed_candidates, inputs, block = _timed_part(gm, example_inputs, candidates)
    built: dict[tuple[int, bool], T] = {}
    copies: dict[tuple[int, bool], dict[Any, Any]] = {}

    def variant(graph: torch.fx.GraphModule, nodes: Sequence[Any], in_pytorch: bool) -> T:
        key = (id(graph), in_pytorch)
        if key not in built:
            copy, copies[key] = copy_graph(graph)
            for node in nodes:
                place(copies[key][node], in_pytorch, "timed in its graph")
            built[key] = build(copy)
        return built[key]

    def measure() -> tuple[float, float, float]:
        start = time.perf_counter()  # (the builds, their compiles and the timing)
        with cost.stage("building its partitions both ways"):
            runs = [run_of(variant(timed, timed_candidates, p)) for p in (True, False)]
        with cost.stage("compiling and timing both builds on the stand-in inputs"):
            (pytorch_s, xla_s), _ = time_both(runs, inputs)
        return (*cost.reported(pytorch_s, xla_s), time.perf_counter() - start)

    with cost.stage("remembering the times"):
        key = fingerprint(timed)
    pytorch_s, xla_s, measure_s = remembered(key, measure)
    choice = cost.CostChoice(
        ", ".join(sorted({str(n.target) for n in candidates})),
        _names(candidates),
        pytorch_s,
        xla_s,
        measure_s,
        scope="block" if block else "graph",
        block=block,
    )
    with cost.stage("building its partitions"):  # (a build whose times were remembered)
        result = variant(gm, candidates, choice.in_pytorch)
    nodes = [copies[(id(gm), choice.in_pytorch)][n] for n in candidates]
    for node in nodes:  # the verdicts the report shows, with the times
        place(node, choice.in_pytorch, choice.why())
    nodes[0].meta[cost.COST_KEY] = choice
    return result


def _timed_part(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], candidates: Sequence[torch.fx.Node]
) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], list[Any], str]:
    """What is timed for ``gm``'s choice: the first of its repeated blocks, where the
    blocks hold at least ``_BLOCK_SHARE`` of the candidates and the first holds some
    (``passes/blocks.py``; its candidates, stand-in inputs, and the blocks' name and
    count), else the whole graph (its candidates and stand-in inputs, and "")."""
    blocks = repeated_blocks(gm)
    if blocks is not None:
        inside = {n for member in blocks.members for n in member}
        first = set(blocks.members[0])
        in_first = [c for c in candidates if c in first]
        if in_first and sum(c in inside for c in candidates) >= _BLOCK_SHARE * len(candidates):
            with cost.stage("making its first block a graph"):
                sub, examples, copied = block_graph(gm, blocks.members[0])
            try:
                with _disable_current_modes():
                    inputs = concrete_inputs(examples)
                name = f"{len(blocks)} alike blocks, {blocks.name}"
                return sub, [copied[c] for c in in_first], inputs, name
            except NotTimed as e:
                log.info("the first block of %s is not timed (%s): the whole graph", blocks.name, e)
    with cost.stage("building the stand-in inputs", passing=(NotTimed,)), _disable_current_modes():
        inputs = concrete_inputs(example_inputs)  # real tensors, outside the fake mode
    return gm, list(candidates), inputs, ""


def _names(nodes: Sequence[torch.fx.Node], shown: int = 3) -> str:
    """The nodes' names, the first few of many and their count."""
    names = [n.name for n in nodes]
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])}, ... ({len(names)} nodes)"

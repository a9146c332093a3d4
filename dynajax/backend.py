"""The TorchDynamo entry point.

    torch.compile(model, backend="dynajax")                      # entry point
    torch.compile(model, backend="dynajax", options={"strict": True})
    torch.compile(model, backend=dynajax.Backend(min_block_size=3))

Dynamo's FX graph goes through the aot stage (``dynajax.aot``: functionalization,
decomposition to core ATen, forward/backward split), then each ATen graph through
``compile_aten_graph``: passes -> capability verdicts -> partitions -> JAX lowering
and ``jax.jit`` -> the stitched callable.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from dynajax.aot import cache as aot_cache
from dynajax.aot.compile import aot_compile
from dynajax.capability import CapabilityChecker, strict_objections
from dynajax.capability.kernels import kernel_verdicts
from dynajax.capability.memo import Evaluations
from dynajax.config import Options
from dynajax.diagnostics import GraphReport, graph_report, snapshot_graph
from dynajax.diagnostics.logs import log_fallbacks_once, trace_artifact
from dynajax.diagnostics.profile import (
    GraphTimes,
    ProfiledPartition,
    RangedPartition,
    profiled_graph,
    ranged_when_recording,
    wrapped_copy,
)
from dynajax.diagnostics.recompiles import DynamoCompile, dynamo_compile
from dynajax.errors import OptionsError, UnsupportedNodesError
from dynajax.lowering.interpreter import lower_partition
from dynajax.partition import PREFIX, assign_partitions, fuse_partitions, stitched_callable
from dynajax.passes import run_passes
from dynajax.passes.pipeline import run_pass_list
from dynajax.passes.user import RewriteRecord, apply_rewrites, passes_at
from dynajax.runtime import cpu_client, omp
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.compiled import CompiledPartition
from dynajax.sharding import GraphSharding, Placement, StateName, dynamo_input_names
from dynajax.sharding.names import aten_input_names, partition_input_names
from dynajax.sharding.placement import crossing

log = logging.getLogger("dynajax.backend")


class Backend:
    """A configured dynajax backend; pass it as ``torch.compile(..., backend=...)``.

    Args:
        **options: the fields of ``dynajax.config.Options``; unset ones come from
            ``DYNAJAX_*`` environment variables, then defaults.

    Attributes:
        options: the resolved options.
        graphs: a ``GraphReport`` for every ATen graph compiled so far.
        partition_hook: None, or a function ``hook(report, name, partition) -> module``
            called for each JAX partition (``jax_<n>``, a ``CompiledPartition``) of every
            graph compiled from then on; the module it returns (a ``PartitionModule``)
            replaces the partition in the stitched graph. ``dynajax.debug`` records the
            partitions' calls this way. None (the default) leaves the per-call path as
            it is.
    """

    # The name torch.compile reports, and the backend PyTorch's minifier scripts use
    # (torch._dynamo.config.repro_after="dynamo"): they call backend="dynajax", whose
    # options come from DYNAJAX_* variables, since a script cannot hold this object.
    compiler_name = "dynajax"

    def __init__(self, **options: Any) -> None:
        self.options = Options.resolve(options)
        self.graphs: list[GraphReport] = []
        self.cache = ExecutableCache.from_option(
            self.options.cache_dir, self.options.cache_max_bytes
        )
        # Where partitions run when not where the tensors are: one device or a mesh.
        o = self.options
        self.placement: Placement | None = (
            Placement(mesh=o.mesh, rules=o.sharding)
            if o.mesh is not None
            else Placement(device=o.device)
            if o.device is not None
            else None
        )
        self.partition_hook: (
            Callable[[GraphReport, str, torch.nn.Module], torch.nn.Module] | None
        ) = None
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"dynajax.Backend({self.options})"

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
    ) -> Callable[..., Any]:
        if kwargs:
            raise OptionsError(
                f"dynajax.Backend takes its options when constructed; got {sorted(kwargs)} "
                "at compile time. Use torch.compile(m, backend=dynajax.Backend(**options)) "
                'or torch.compile(m, backend="dynajax", options={...}).'
            )
        cpu_client.explain_once()
        omp.explain_once()
        compile_aten_graph: Callable[..., Any] = self.compile_aten_graph
        # The user's rewrites and pre_aot passes change Dynamo's torch-level graph.
        rewrites = apply_rewrites(gm, self.options.rewrites)
        gm = run_pass_list(gm, passes_at(self.options.passes, "pre_aot"))
        if rewrites:
            compile_aten_graph = functools.partial(compile_aten_graph, rewrites=rewrites)
        if self.placement is not None:
            # Parameter and buffer names, by Dynamo input, for the sharding rules.
            names = dynamo_input_names(gm)
            compile_aten_graph = functools.partial(compile_aten_graph, input_names=names)
        # Dynamo's compile id and, for a recompile, the guard failures that caused it:
        # every graph of this Dynamo graph (forward, backward) reports them.
        dynamo = dynamo_compile(self.options, gm)
        if dynamo is not None:
            compile_aten_graph = functools.partial(compile_aten_graph, dynamo=dynamo)
        compiled = aot_compile(gm, example_inputs, compile_aten_graph, self.cache)
        # Dynamo calls what a backend returns unboxed, f(*inputs). aot_autograd's
        # forward is such a function, but it copies the ``_boxed_call`` flag of the boxed
        # function it wraps (functools.wraps copies __dict__), and PyTorch's accuracy
        # minifier (torch._dynamo.debug_utils.run_fwd_maybe_bwd, repro_level=4) trusts
        # the flag, calls it with one list, fails and skips the graph as "not a bug".
        getattr(compiled, "__dict__", {}).pop("_boxed_call", None)
        return compiled

    def compile_aten_graph(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        kind: str,
        input_names: Sequence[StateName | None] = (),
        rewrites: Sequence[RewriteRecord] = (),
        aot: str | aot_cache.Lookup = "traced",
        dynamo: DynamoCompile | None = None,
    ) -> Callable[..., Any]:
        """Compiles one ATen graph: JAX partitions for what JAX can run, eager for the rest.

        ``input_names``: the parameter or buffer each input of Dynamo's graph is (None
        for other inputs), which the sharding rules match. ``rewrites``: what the
        user's rewrites did to Dynamo's graph (shown by the forward's report). ``aot``:
        whether aot_autograd traced the graph or it was loaded from the cache, for the
        report: a string, or the graph's ``aot_cache.Lookup``, whose status the report
        follows (a training graph's entry is stored after its forward compiled).
        ``dynamo``: the Dynamo compile the graph comes from, with the guard failures of
        a recompile (the report's ``recompiles``).
        """
        gm = run_passes(
            gm,
            before=passes_at(self.options.passes, "post_aot"),
            after=passes_at(self.options.passes, "post_passes"),
        )
        checker = CapabilityChecker(
            self.options.fallback_ops,
            Evaluations(self.cache),
            # Ops measured faster in PyTorch stay there where the partitions run where the
            # tensors are; a device or mesh asks for the work on JAX's devices.
            perf=self.options.perf_fallbacks and self.placement is None,
            measure=self.options.measure_costs,
            # An op without a rule, or measured faster in PyTorch, runs PyTorch's kernel
            # inside its partition (dynajax/ffi) where the partition runs on the CPU.
            torch_kernels=self.placement is None,
        )
        refused = checker.annotate(gm)
        if self.options.strict:
            unwanted = strict_objections([*refused, *kernel_verdicts(gm)])
            if unwanted:
                raise UnsupportedNodesError(unwanted, graph=f"{kind} graph")

        def build(gm: torch.fx.GraphModule) -> _Built:
            return self._partitioned(gm, kind, input_names)

        built = None
        if checker.candidates:
            # A choice between XLA and a PyTorch kernel: the whole graph timed both
            # ways where it can be, else the op alone.
            built = checker.measure_in_graph(
                gm, example_inputs, build, lambda b: stitched_callable(b.gm)
            )
            if built is None:
                checker.measure_alone()
        if built is None:
            built = build(gm)
        gm = built.gm
        with self._lock:
            report = graph_report(
                kind,
                next(self._counter),
                built.annotated,
                gm,
                built.snapshot,
                self.options.min_block_size,
            )
            report.compile_stats = built.stats
            if isinstance(aot, aot_cache.Lookup):
                aot.follow(report)  # its status may change after this graph compiled
            else:
                report.aot = aot
            report.sharding = built.sharding
            report.dynamo = dynamo
            if kind != "backward":  # (the forward's report shows its Dynamo graph's rewrites)
                report.rewrites = list(rewrites)
            self.graphs.append(report)
        log_fallbacks_once(report.fallbacks)
        trace_artifact(report.__str__)
        hook = self.partition_hook
        if hook is not None:
            for p in report.partitions:
                setattr(gm, p.name, hook(report, p.name, getattr(gm, p.name)))
        # Named in a profiler that records, with no option (the graph run then: a copy
        # whose partitions open their ranges); one check per call otherwise.
        label = f"dynajax/graph{report.index}"
        names = [p.name for p in report.partitions]

        def ranged() -> Callable[..., Any]:
            return stitched_callable(
                wrapped_copy(gm, names, lambda n, part: RangedPartition(f"{label}/{n}", part))
            )

        run = ranged_when_recording(stitched_callable(gm), ranged, label)
        if not self.options.profile:
            return run
        # Timed: a copy of the graph whose partitions time their phases (XLA's run
        # waited for), while ``times.timing``; the regular ``run`` otherwise.
        times = report.times = GraphTimes(label)
        timed = wrapped_copy(gm, names, lambda name, part: ProfiledPartition(times, name, part))
        return profiled_graph(stitched_callable(timed), times, run)

    def _partitioned(
        self,
        gm: torch.fx.GraphModule,
        kind: str,
        input_names: Sequence[StateName | None],
    ) -> _Built:
        """``gm`` (annotated) cut into JAX partitions, each a compiled partition
        (compiled at its first call); ``input_names`` as in ``compile_aten_graph``."""
        annotated = list(gm.graph.nodes)
        proposal = assign_partitions(
            gm, self.options.min_block_size, output_aliases=kind == "inference"
        )
        snapshot = snapshot_graph(gm)  # verdicts and partitions, before fusing
        gm = fuse_partitions(gm, proposal)
        stats = CompileStats()  # filled as the partitions compile, at their first calls
        placement = self.placement
        sharding = GraphSharding(placement) if placement is not None else None
        names = (
            partition_input_names(gm, aten_input_names(gm, input_names))
            if placement is not None
            else {}
        )
        for name, sub in list(gm.named_children()):
            if name.startswith(PREFIX) and isinstance(sub, torch.fx.GraphModule):
                lowered = lower_partition(name, sub, value_checks=self.options.checks)
                part = CompiledPartition(
                    lowered,
                    cache=self.cache,
                    stats=stats,
                    max_executables=self.options.max_executables,
                    pad_to_buckets=self.options.pad_to_buckets,
                    crossing=crossing(lowered, placement, names.get(name, [])),
                )
                if sharding is not None:
                    sharding.add(part)
                setattr(gm, name, part)
        gm.recompile()
        return _Built(annotated, snapshot, gm, stats, sharding)


@dataclasses.dataclass
class _Built:
    """One graph partitioned and its partitions made (``Backend._partitioned``)."""

    annotated: list[torch.fx.Node]  # its nodes before fusing, with their verdicts
    snapshot: torch.fx.Graph  # their copy (verdicts and partitions)
    gm: torch.fx.GraphModule  # the stitched graph: partitions and eager ops
    stats: CompileStats
    sharding: GraphSharding | None


def dynajax_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The function registered as ``backend="dynajax"`` (entry point ``torch_dynamo_backends``).

    ``options`` are those of ``Backend``; ``mode`` is accepted for torch.compile
    compatibility and must be None or "default".
    """
    if mode not in (None, "default"):
        raise OptionsError(
            f"dynajax has no compile mode {mode!r}; leave mode unset and pass "
            "options={...} instead (valid options: " + ", ".join(Options.names()) + ")."
        )
    return Backend(**(options or {}))(gm, example_inputs)


def register_name() -> None:
    """Make ``backend="dynajax"`` work once dynajax is imported, installed or not.

    An installed dynajax is found through its ``torch_dynamo_backends`` entry point,
    which Dynamo loads (importing dynajax) and registers itself. A checkout on
    ``PYTHONPATH`` has no entry point, and Dynamo would answer ``InvalidBackend``: there
    the name is registered here. Never both: Dynamo refuses a name registered twice.
    """
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import register_backend

    if entry_points(group="torch_dynamo_backends", name="dynajax"):
        return
    try:
        register_backend(dynajax_backend, name="dynajax")
    except AssertionError:  # "duplicate name": registered already
        pass

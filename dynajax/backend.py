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

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from dynajax.aot import aot_compile
from dynajax.capability import CapabilityChecker
from dynajax.config import Options
from dynajax.diagnostics import GraphReport, graph_report, snapshot_graph
from dynajax.diagnostics.logs import log_fallbacks_once, trace_artifact
from dynajax.errors import OptionsError, UnsupportedNodesError
from dynajax.partition import PREFIX, assign_partitions, fuse_partitions, stitched_callable
from dynajax.passes import run_passes
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.compiled import compile_partition

log = logging.getLogger("dynajax.backend")


class Backend:
    """A configured dynajax backend; pass it as ``torch.compile(..., backend=...)``.

    Args:
        **options: the fields of ``dynajax.config.Options``; unset ones come from
            ``DYNAJAX_*`` environment variables, then defaults.

    Attributes:
        options: the resolved options.
        graphs: a ``GraphReport`` for every ATen graph compiled so far.
    """

    def __init__(self, **options: Any) -> None:
        self.options = Options.resolve(options)
        self.graphs: list[GraphReport] = []
        self.cache = ExecutableCache.from_option(self.options.cache_dir)
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
        return aot_compile(gm, example_inputs, self.compile_aten_graph)

    def compile_aten_graph(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, kind: str
    ) -> Callable[..., Any]:
        """Compiles one ATen graph: JAX partitions for what JAX can run, eager for the rest."""
        gm = run_passes(gm)
        checker = CapabilityChecker(self.options.fallback_ops)
        refused = checker.annotate(gm)
        if self.options.strict:
            # fallback_ops are the user's own choice; strict objects to the rest.
            unwanted = [v for v in refused if not v.reason.is_choice]
            if unwanted:
                raise UnsupportedNodesError(unwanted, graph=f"{kind} graph")
        annotated = list(gm.graph.nodes)
        proposal = assign_partitions(gm, self.options.min_block_size)
        snapshot = snapshot_graph(gm)  # verdicts and partitions, before fusing
        gm = fuse_partitions(gm, proposal)
        stats = CompileStats()  # filled as the partitions compile, at their first calls
        for name, sub in list(gm.named_children()):
            if name.startswith(PREFIX) and isinstance(sub, torch.fx.GraphModule):
                part = compile_partition(
                    name,
                    sub,
                    cache=self.cache,
                    stats=stats,
                    max_executables=self.options.max_executables,
                    pad_to_buckets=self.options.pad_to_buckets,
                    device=self.options.device,
                )
                setattr(gm, name, part)
        gm.recompile()
        with self._lock:
            report = graph_report(
                kind,
                next(self._counter),
                annotated,
                gm,
                snapshot,
                self.options.min_block_size,
            )
            report.compile_stats = stats
            self.graphs.append(report)
        log_fallbacks_once(report.fallbacks)
        trace_artifact(report.__str__)
        return stitched_callable(gm)


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

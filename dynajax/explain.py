"""explain(): compile a function with dynajax, run it, report what ran where and for
how long, and what Dynamo left out.

A driver of the backend (beside ``backend.py``, above ``diagnostics/``, whose reports
it returns): diagnostics never import the backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dynajax.backend import Backend
from dynajax.diagnostics.breaks import watch_breaks
from dynajax.diagnostics.profile import count_ops
from dynajax.diagnostics.report import Report

# Calls timed after the counted one (the report's times are their mean).
TIMED_CALLS = 3


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Compiles ``fn`` (a function or nn.Module) with dynajax and returns the Report of
    the whole program: every graph compiled, where Dynamo stopped capturing (graph
    breaks, skipped frames: their ops ran in eager PyTorch, outside any graph), the
    share of the program's ATen ops that ran in JAX, and the time of each graph and
    partition (the ``profile`` option).

    It calls ``fn(*args, **kwargs)`` compiled six times: once to compile (graph breaks
    are recorded), once under ``torch.profiler`` to count the ATen ops that ran
    outside dynajax's graphs, once more untimed, and ``TIMED_CALLS`` times for the
    times; then
    ``TIMED_CALLS`` times eagerly, for eager's time beside them. A function with side
    effects (a BatchNorm's running statistics in training mode, an optimizer step) has
    them each time.

    The options come from ``DYNAJAX_*`` environment variables, with ``profile=True``; to
    explain with explicit options, compile with ``b = dynajax.Backend(...)`` and read
    ``dynajax.Report(b.graphs)`` (the graphs only: no graph breaks or ops outside them).
    """
    backend = Backend(profile=True)
    compiled = torch.compile(fn, backend=backend)
    with watch_breaks() as breaks:
        compiled(*args, **kwargs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*args, **kwargs)
    outside, calls = count_ops(prof.events())
    compiled(*args, **kwargs)  # the first call after the profiler's pays for its exit
    for g in backend.graphs:
        if g.times is not None:
            g.times.restart()  # the profiler's call is slower than the program's
    seconds = _timed(compiled, args, kwargs)
    eager_s = _timed(fn, args, kwargs)
    graph_calls = {g.index: calls.get(f"dynajax/graph{g.index}", 0) for g in backend.graphs}
    return Report(list(backend.graphs), breaks, outside, graph_calls, seconds, eager_s)


def _timed(fn: Callable[..., Any], args: Any, kwargs: Any) -> float:
    """Mean seconds of ``TIMED_CALLS`` calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(TIMED_CALLS):
        fn(*args, **kwargs)
    return (time.perf_counter() - start) / TIMED_CALLS

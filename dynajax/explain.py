"""explain(): compile a function with dynajax, run it, report what ran where and for
how long, and what Dynamo left out.

A driver of the backend (beside ``backend.py``, above ``diagnostics/``, whose reports
it returns): diagnostics never import the backend."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dynajax.backend import Backend
from dynajax.diagnostics.breaks import watch_breaks
from dynajax.diagnostics.profile import count_ops
from dynajax.diagnostics.report import Report

# Rounds of the timing: each times one call compiled and one eager, interleaved, so that
# both see the same machine (its load, its clock); the report gives the medians.
ROUNDS = 7


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Compiles ``fn`` (a function or nn.Module) with dynajax and returns the Report of
    the whole program: every graph compiled, where Dynamo stopped capturing (graph
    breaks, skipped frames: their ops ran in eager PyTorch, outside any graph), the
    share of the program's ATen ops that ran in JAX, and the time of each graph and
    partition (the ``profile`` option).

    It calls ``fn(*args, **kwargs)`` compiled ``3 + 2 * ROUNDS`` times: once to compile
    (graph breaks are recorded), once under ``torch.profiler`` to count the ATen ops
    that ran outside dynajax's graphs, once more untimed, ``ROUNDS`` times with each
    partition's phases timed (XLA's run waited for), then ``ROUNDS`` times as the
    program runs without the option (nothing waits inside it), each beside one eager
    call (after one untimed eager call): the report gives both medians and their spread.
    A function with side effects (a BatchNorm's running statistics in training mode, an
    optimizer step) has them each time.

    The options come from ``DYNAJAX_*`` environment variables, with ``profile=True``; to
    explain with explicit options, compile with ``b = dynajax.Backend(...)`` and read
    ``dynajax.Report(b.graphs)`` (the graphs only: no graph breaks or ops outside them).
    A function compiled before with another backend is compiled again (Dynamo's
    backend guard): the report says that compile was explain's own.
    """
    backend = Backend(profile=True)
    compiled = torch.compile(fn, backend=backend)
    with watch_breaks() as breaks:
        compiled(*args, **kwargs)
    _own_recompiles(backend)
    with (
        _quiet_native_stderr(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        compiled(*args, **kwargs)
    outside, calls = count_ops(prof.events())
    compiled(*args, **kwargs)  # the first call after the profiler's pays for its exit
    timed = [g.times for g in backend.graphs if g.times is not None]
    for times in timed:
        times.restart()  # the profiler's call is slower than the program's
    for _ in range(ROUNDS):
        compiled(*args, **kwargs)  # each partition's phases
    for times in timed:
        times.timing = False
    try:
        compiled(*args, **kwargs)  # (the regular path's first call after the timed ones)
        fn(*args, **kwargs)  # eager's first call (its allocations, its kernels' first use)
        ours, eager = _interleaved(compiled, fn, args, kwargs)
    finally:
        for times in timed:
            times.timing = True
    graph_calls = {g.index: calls.get(f"dynajax/graph{g.index}", 0) for g in backend.graphs}
    return Report(
        list(backend.graphs),
        breaks,
        outside,
        graph_calls,
        statistics.median(ours),
        statistics.median(eager),
        (min(ours), max(ours)),
        (min(eager), max(eager)),
    )


def _interleaved(
    compiled: Callable[..., Any], fn: Callable[..., Any], args: Any, kwargs: Any
) -> tuple[list[float], list[float]]:
    """Seconds of ``ROUNDS`` calls of ``compiled`` and of ``fn``, one of each per round."""
    ours, eager = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        compiled(*args, **kwargs)
        between = time.perf_counter()
        fn(*args, **kwargs)
        ours.append(between - start)
        eager.append(time.perf_counter() - between)
    return ours, eager


def _own_recompiles(backend: Backend) -> None:
    """Names explain's own compile where ``fn`` was compiled before with another backend
    (Dynamo's backend guard failed because explain's backend is a new one)."""
    for g in backend.graphs:
        if g.dynamo is not None and g.dynamo.backends:
            own = dict.fromkeys(g.dynamo.backends, "dynajax.explain's own, with profile=True")
            g.dynamo = dataclasses.replace(g.dynamo, backends=own)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Drops the lines PyTorch's profiler writes to the process's stderr (file
    descriptor 2) as it starts and stops (``USDT: ... profiler_start``): they say
    nothing to the user of explain. Anything else written there meanwhile is passed on."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to redirect
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                if not line.startswith("USDT:")
            ]
            if kept:
                sys.stderr.write("".join(kept))

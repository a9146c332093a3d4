"""explain(): compile a function with dynajax, run it once, report what ran where.

A driver of the backend (beside ``backend.py``, above ``diagnostics/``, whose reports
it returns): diagnostics never import the backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dynajax.backend import Backend
from dynajax.diagnostics.report import Report


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Compiles ``fn`` (a function or nn.Module) with dynajax, calls it once on
    ``args``/``kwargs``, and returns the Report of every graph compiled.

    The options come from ``DYNAJAX_*`` environment variables; to explain with explicit
    options, compile with ``b = dynajax.Backend(...)`` and read ``dynajax.Report(b.graphs)``.
    """
    backend = Backend()
    compiled = torch.compile(fn, backend=backend)
    compiled(*args, **kwargs)
    return Report(list(backend.graphs))

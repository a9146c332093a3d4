"""Where reports go besides ``str(report)``: the ``dynajax.capability`` logger (each
distinct fallback once per process) and PyTorch's structured trace (TORCH_TRACE /
tlparse), as an artifact named ``dynajax_report``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch._logging

from dynajax.capability import Reason, Unsupported

log = logging.getLogger("dynajax.capability")

ARTIFACT_NAME = "dynajax_report"

_lock = threading.Lock()
_logged: set[tuple[str, str, str]] = set()


def log_fallbacks_once(fallbacks: list[Unsupported]) -> None:
    """Logs each distinct (op, reason) at INFO, the first time it is seen.

    For CHECK_REFUSED and DTYPE the detail is part of what is distinct (a rule may
    refuse an op for several reasons); elsewhere it names per-graph things (``u0``,
    partition sizes) that would defeat the once-only rule.
    """
    for f in fallbacks:
        detail = f.detail if f.reason in (Reason.CHECK_REFUSED, Reason.DTYPE) else ""
        key = (f.target, f.reason.name, detail)
        with _lock:
            if key in _logged:
                continue
            _logged.add(key)
        log.info(
            "%s; it runs in eager PyTorch (%s). Further nodes with this reason are not "
            "logged; dynajax.explain() lists them all.",
            f.describe(),
            f.reason.value,
        )


def forget_logged_fallbacks() -> None:
    """Makes every fallback loggable again (for tests and long-lived processes)."""
    with _lock:
        _logged.clear()


def trace_artifact(text_fn: Callable[[], str]) -> None:
    """Emits the report text as a structured-trace artifact (evaluated only when a trace
    is being recorded, e.g. under ``TORCH_TRACE=/tmp/trace``)."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": ARTIFACT_NAME, "encoding": "string"},
        payload_fn=text_fn,
    )

"""How JAX's CPU client runs dynajax's executables: inline, on the calling thread.

JAX's CPU client dispatches each execution to a worker thread by default
(``jax_cpu_enable_async_dispatch``), so that Python can run ahead of XLA. dynajax never
runs ahead: every partition's outputs become PyTorch tensors, which PyTorch reads at
once, so each call waits for the worker thread anyway, and that hand-off costs a thread
wake-up both ways. On the project's 2-core machine an executable over a 32,768-element
tensor took 74 µs dispatched against 5 µs inline, one over 131,072 elements 80 µs
against 40-45 µs; a one-element one costs the same both ways (4 µs: JAX already runs
those inline). ``python -m benchmarks.run`` measures the model rows both ways with
``DYNAJAX_CPU_ASYNC_DISPATCH``.

The setting belongs to the CPU client, which JAX creates once, at its first use in the
process: ``prefer_inline()`` sets it when dynajax is imported before that. A process
that used JAX before importing dynajax keeps JAX's default (logged once at the first
compile); ``DYNAJAX_CPU_ASYNC_DISPATCH=1`` keeps JAX's default on purpose, for a
process whose own JAX code wants to run ahead of its CPU computations. Results are the
same either way; only where the waiting happens changes. GPU and TPU clients are not
affected.
"""

from __future__ import annotations

import logging
import os

import jax

from dynajax.runtime.jax_internals import backends_started

log = logging.getLogger("dynajax.runtime")

ENV = "DYNAJAX_CPU_ASYNC_DISPATCH"
_FLAG = "jax_cpu_enable_async_dispatch"

# None: not decided yet; True: dynajax set inline execution before the client started;
# False: it could not (the client had started) or was told not to.
_applied: bool | None = None


def prefer_inline() -> bool:
    """Make JAX's CPU client, if not started yet, execute on the calling thread.

    Returns whether JAX's CPU executions will run inline because of this call (False
    where the environment opts out, the client already started, or this JAX release
    has no such setting).
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    if backends_started() is not False:
        return False
    try:
        jax.config.update(_FLAG, False)
    except (AttributeError, KeyError, ValueError):  # a JAX release without the setting
        return False
    _applied = True
    return True


_explained = False


def explain_once() -> None:
    """At the first compile: say so on the ``dynajax.runtime`` logger if JAX's CPU
    client dispatches asynchronously because it started before dynajax was imported."""
    global _explained
    if _explained:
        return
    _explained = True
    if _applied or os.environ.get(ENV):
        return
    try:
        inline = not jax.config.read(_FLAG)
    except (AttributeError, KeyError):
        return
    if not inline:
        log.info(
            "JAX's CPU client started before dynajax was imported and dispatches each "
            "execution to a worker thread (jax_cpu_enable_async_dispatch), which costs "
            "a thread hand-off per partition call (tens of µs on a few cores). Import "
            "dynajax before using JAX, or call jax.config.update(%r, False) before it.",
            _FLAG,
        )

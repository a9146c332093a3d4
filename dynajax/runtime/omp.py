"""PyTorch's OpenMP threads and XLA's on the same cores: a short spin for libgomp.

After each parallel region, libgomp (the OpenMP runtime of PyTorch's CPU builds) keeps
its threads spinning for work, by default for ~10 ms of CPU on this project's machine
(``python -m benchmarks.pools``: 9.8 ms of the 20 ms after an eager MLP call; XLA's
pool: 0.1 ms). In a program that interleaves eager PyTorch with compiled calls
(``generate``, an eager optimizer, a fallback op between partitions) that spinning
thread holds a core XLA's next call needs: the MLP's dynajax call went from 1.90 ms
alone to 3.42 ms after an eager call. With ``GOMP_SPINCOUNT=10000`` the threads sleep
after ~0.1 ms: 2.42 ms, while eager alone (1.81 against 1.83 ms) and inductor alone
(1.88 against 1.94 ms) kept their speed. ``OMP_WAIT_POLICY=PASSIVE`` (no spin) made
eager itself slower (2.01 ms).

libgomp reads the setting once, when PyTorch loads it, so ``shorten_spin()`` can only
set it before ``import torch``: where dynajax is imported first. It leaves the
environment alone where the user set ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``, and
``DYNAJAX_GOMP_SPINCOUNT`` picks another count (``off``: libgomp's default). Where
torch came first, ``advice()`` says how to get it: logged at the first compile
(``explain_once()``), and printed by a Report of CPU partitions.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("dynajax.runtime")

ENV = "DYNAJAX_GOMP_SPINCOUNT"
DEFAULT = "10000"
_USER = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

# None: not decided yet; True: set before torch loaded libgomp; False: not set.
_applied: bool | None = None
_explained = False


def _count() -> str | None:
    """The spin count to set, or None (``off``, or not a count)."""
    value = os.environ.get(ENV, DEFAULT).strip()
    return value if value.isdigit() else None


def _user_chose() -> bool:
    """Whether the environment sets libgomp's spin or wait policy itself."""
    return any(name in os.environ for name in _USER)


def shorten_spin() -> bool:
    """Sets ``GOMP_SPINCOUNT`` for the libgomp PyTorch will load, if torch is not
    imported yet and the user set neither it nor ``OMP_WAIT_POLICY``; whether it did."""
    global _applied
    if _applied is not None:
        return _applied
    count = _count()
    _applied = count is not None and "torch" not in sys.modules and not _user_chose()
    if _applied:
        assert count is not None
        os.environ["GOMP_SPINCOUNT"] = count
    return _applied


def advice() -> str | None:
    """What to do where the spin could not be shortened (torch imported first, and the
    user set neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` nor turned it ``off``);
    None elsewhere. The first compile logs it, and a Report of CPU partitions prints it."""
    count = _count()
    if _applied or count is None or _user_chose():
        return None
    return (
        "torch was imported before dynajax, so PyTorch's OpenMP threads keep libgomp's "
        "default spin after each eager op (~10 ms of a core), which slows a compiled call "
        "that follows eager work (an MLP: 1.9 -> 3.4 ms; an MLP training step whose SGD "
        "step runs eagerly: 7.5-8.2 -> 8.7-10.2 ms). Start Python with "
        f"GOMP_SPINCOUNT={count} (or import dynajax before torch) to shorten it."
    )


def explain_once() -> None:
    """At the first compile, on the ``dynajax.runtime`` logger: where torch was imported
    before dynajax, how to shorten libgomp's spin."""
    global _explained
    if _explained:
        return
    _explained = True
    said = advice()
    if said is not None:
        log.info("%s", said)

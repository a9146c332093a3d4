"""GPU memory shared with PyTorch: JAX allocates on demand, not 75% up front.

JAX's GPU client reserves 75% of the GPU's memory the first time it is used
(``XLA_PYTHON_CLIENT_PREALLOCATE``), for its own allocator. Under dynajax, PyTorch and
JAX share one process and one GPU: PyTorch holds the model's parameters and runs every
op dynajax keeps in eager, and with JAX's reservation made it would run out of memory
at a quarter of the card. ``share_with_torch()``, called when dynajax is imported,
turns the reservation off where JAX's backends have not started yet and the
environment does not say otherwise: JAX then grows its pool as it needs (its BFC
allocator either way). Set ``XLA_PYTHON_CLIENT_PREALLOCATE=true`` (or
``XLA_PYTHON_CLIENT_MEM_FRACTION``) before importing dynajax to keep JAX's default. A
process that used JAX before importing dynajax keeps whatever its client started with.
No effect on CPU.
"""

from __future__ import annotations

import os

from dynajax.runtime.jax_internals import backends_started

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_USER_SETTINGS = (PREALLOCATE, "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def share_with_torch() -> bool:
    """Turn JAX's up-front GPU reservation off; returns whether this call did."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if backends_started() is not False:
        return False
    os.environ[PREALLOCATE] = "false"
    return True

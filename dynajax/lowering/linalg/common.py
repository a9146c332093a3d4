"""Helpers that more than one linear algebra family uses.

Public (no leading underscore) because they are shared: a family module imports them
from here rather than another family's private names.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def lapack_dtype_check(A, *args, **kwargs) -> str | None:
    """Refuses the dtypes PyTorch's CPU LAPACK calls reject (they raise in eager).

    Usable directly as a rule's ``check``: only the first argument, the matrix, is read.

    Args:
        A: the matrix (a ``jax.ShapeDtypeStruct`` or an array).
        *args: the rest of the op's arguments, ignored.
        **kwargs: likewise.

    Returns:
        None for float32/64 and complex64/128, else why the op cannot be lowered.
    """
    if not (jnp.issubdtype(A.dtype, jnp.floating) or jnp.issubdtype(A.dtype, jnp.complexfloating)):
        return f"linear algebra on {np.dtype(A.dtype).name} (PyTorch takes float and complex)"
    if np.dtype(A.dtype) in (np.float16, jnp.bfloat16):
        return f"linear algebra on {np.dtype(A.dtype).name} (PyTorch's CPU LAPACK has none)"
    return None


def conj_transpose(x):
    """The conjugate transpose of a batch of matrices (the transpose for real ones)."""
    return jnp.conj(jnp.swapaxes(x, -1, -2))

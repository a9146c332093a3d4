"""Interoperation with JAX programs: a torch model as a JAX function (``jax_function``).

The names are imported on first use (PEP 562), so that importing a submodule of this
package (the lowering table imports ``dynajax.interop.call_jax``) never pulls in the
capability and lowering stages that ``jax_function`` builds on: they import the
lowering table themselves, which would be a cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynajax.interop.checked import ValueCheckResult
    from dynajax.interop.function import (
        BufferUpdatesDiscardedWarning,
        CheckedJaxFunction,
        InputUpdatesDiscardedWarning,
        JaxFunction,
        jax_function,
    )
    from dynajax.interop.trees import jax_values
    from dynajax.program.callbacks import CallbackOp

# public name -> the submodule that defines it
_LAZY = {
    "BufferUpdatesDiscardedWarning": "dynajax.interop.function",
    "CallbackOp": "dynajax.program.callbacks",
    "CheckedJaxFunction": "dynajax.interop.function",
    "InputUpdatesDiscardedWarning": "dynajax.interop.function",
    "JaxFunction": "dynajax.interop.function",
    "ValueCheckResult": "dynajax.interop.checked",
    "jax_function": "dynajax.interop.function",
    "jax_values": "dynajax.interop.trees",
}

__all__ = [
    "BufferUpdatesDiscardedWarning",
    "CallbackOp",
    "CheckedJaxFunction",
    "InputUpdatesDiscardedWarning",
    "JaxFunction",
    "ValueCheckResult",
    "jax_function",
    "jax_values",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dynajax.interop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

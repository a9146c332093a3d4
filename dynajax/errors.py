"""Exception types. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class DynajaxError(RuntimeError):
    """Base class of every error dynajax raises on purpose."""


class OptionsError(DynajaxError, ValueError):
    """An option name or value is not valid."""


class UnsupportedNodesError(DynajaxError):
    """Raised in strict mode when a graph has nodes that cannot run in JAX.

    Attributes:
        verdicts: the ``Unsupported`` verdicts of every node kept out of JAX.
    """

    def __init__(self, verdicts: list) -> None:
        self.verdicts = list(verdicts)
        lines = [f"  {v.describe()}" for v in self.verdicts]
        super().__init__(
            f"strict mode: {len(self.verdicts)} node(s) cannot run in JAX:\n"
            + "\n".join(lines)
            + "\nUnset strict (or DYNAJAX_STRICT=0) to run these nodes in eager PyTorch instead."
        )


class ConversionError(DynajaxError, TypeError):
    """A value cannot cross the torch/JAX boundary."""

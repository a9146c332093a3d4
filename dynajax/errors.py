"""Exception types. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class DynajaxError(RuntimeError):
    """Base class of every error dynajax raises on purpose."""


class OptionsError(DynajaxError, ValueError):
    """An option name or value is not valid."""


class UnsupportedNodesError(DynajaxError):
    """Raised in strict mode when a graph has nodes that cannot run in JAX.

    One error lists every such node of the graph, with its reason and source line.
    torch.compile wraps it in ``torch._dynamo.exc.BackendCompilerFailed``; the original
    is that exception's ``inner_exception``.

    Attributes:
        verdicts: the ``Unsupported`` verdicts of every node kept out of JAX.
    """

    def __init__(self, verdicts: list, graph: str = "graph") -> None:
        self.verdicts = list(verdicts)
        lines = [f"  - {v.describe()}" for v in self.verdicts]
        ops = sorted({v.target for v in self.verdicts})
        super().__init__(
            f"strict mode: {len(self.verdicts)} node(s) of the {graph} cannot run in JAX:\n"
            + "\n".join(lines)
            + "\nTo run them in eager PyTorch instead, unset strict (DYNAJAX_STRICT=0), or "
            f"keep strict and accept these ops explicitly with fallback_ops={ops!r}."
        )


class ConversionError(DynajaxError, TypeError):
    """A value cannot cross the torch/JAX boundary."""

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


class JaxFunctionError(DynajaxError, TypeError):
    """A model cannot become a JAX function, or its JAX function was called with
    arguments it cannot take (a missing PRNG key, missing or extra state entries,
    inputs of another structure, dtype or static size)."""


class CallbackOpsError(UnsupportedNodesError):
    """Raised by ``jax_function(..., strict=True)`` when ops of the model cannot run in JAX.

    Without ``strict`` those ops run in eager PyTorch through host callbacks; with it,
    one error lists every such op, with its reason and source line.

    Attributes:
        verdicts: the ``Unsupported`` verdicts of every op that would need a callback.
    """

    # The message: HEAD (formatted with the op count), one line per op, then TAIL.
    HEAD = (
        "strict=True: {n} op(s) of the exported graph cannot run in JAX (no rule, or the "
        "rule refuses these arguments) and would run in eager PyTorch through a host "
        "callback:"
    )
    TAIL = (
        "To run them through host callbacks (the eager answer, slower, not exportable "
        "with jax.export), call jax_function without strict=True, or list them in "
        "fallback_ops; to run them in JAX, write or extend a rule for each op "
        "(dynajax/lowering/)."
    )

    def __init__(self, verdicts: list) -> None:
        self.verdicts = list(verdicts)
        lines = [f"  - {v.describe()}" for v in self.verdicts]
        DynajaxError.__init__(
            self, "\n".join([self.HEAD.format(n=len(self.verdicts)), *lines, self.TAIL])
        )


class CallJaxError(DynajaxError):
    """The JAX function given to ``dynajax.call_jax`` failed on the inputs it was given,
    or returned values that cannot come back as tensors. The message names the function,
    the shapes and dtypes it was called with, and its static arguments; the original
    exception is the ``__cause__``."""


class ExportError(DynajaxError):
    """``dynajax.export`` cannot turn the model into a serializable JAX program (random
    ops or buffer updates of a model in train mode, inputs that are not tensors, an
    unknown ``weights=`` choice, a file name that would clash)."""


class ExportOpsError(CallbackOpsError, ExportError):
    """Raised by ``dynajax.export`` when ops of the model have no JAX rule.

    ``jax_function`` would run them in eager PyTorch through host callbacks, but an
    exported StableHLO program cannot call PyTorch, so export needs every op in JAX.
    One error lists every such op, with its reason and source line.

    Attributes:
        verdicts: the ``Unsupported`` verdicts of every op without a JAX rule.
    """

    HEAD = (
        "dynajax.export: {n} op(s) of the model cannot run in JAX (no rule, or the rule "
        "refuses these arguments), and an exported StableHLO program cannot call PyTorch "
        "for them:"
    )
    TAIL = (
        "To export this model, write or extend a JAX rule for each op (dynajax/lowering/), "
        "or change the model code at these lines to use ops that have one "
        "(dynajax.supported_ops()). dynajax.jax_function runs the model as it is, calling "
        "PyTorch for these ops, but cannot be exported."
    )


class ShardingError(DynajaxError, ValueError):
    """A sharding rule cannot lay out the tensor it matched on the mesh (a sharded
    dimension not divisible by its mesh axes' size, or more spec entries than the tensor
    has dimensions). Raised when a graph is compiled; torch.compile wraps it in
    ``torch._dynamo.exc.BackendCompilerFailed`` (the original is its
    ``inner_exception``)."""


class TrainStepError(DynajaxError, ValueError):
    """``dynajax.train_step`` cannot compile or run this step: an optimizer it cannot
    trace (one whose ``step`` needs a closure, or keeps non-tensor state), a loss that
    is not one floating element, a loss under float16 autocast (which eager trains with
    a ``GradScaler``), a model or loss that branches on a tensor's value, or a batch
    the step cannot take. The training state keeps its last good values. (A batch
    whose values eager refuses, such as a class index out of range, raises eager's own
    error instead, with the state likewise kept.)"""

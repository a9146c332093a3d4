"""Which traced values are transposes or batch broadcasts of another, so that products
read them in place.

``linear`` reaches the lowering as ``mm(x, t(w))`` and a weight gradient as
``mm(t(g), x)``. Traced as written, JAX's program is a ``transpose`` and a ``dot``, and
XLA's CPU compiler does not fold the one into the other: it copies the transposed
operand into a new layout and, where the product is small, fuses that copy and the dot
into one loop nest, which it runs as scalar code. A matrix-vector product (a decode
step's linear layers: one token, so M = 1) then took 48-50 µs where the same product
with the transpose folded into the dot's dimensions takes 17 µs (256 x 1024 weights;
``python -m benchmarks.matmul``, its decode rows); matrix-matrix products change
within noise.

So while a partition traces, the interpreter notes every ``aten.t``, ``aten.transpose``
and ``aten.permute`` node whose result swaps its input's last two dimensions
(``note``), follows such a transpose through the ops that commute with the swap
(attention's ``k.transpose(-2, -1)`` reaches its ``bmm`` through a scale, an expand
and a view), and the product rules ask ``source`` for an operand's untransposed value,
contracting it along the other dimension (``linalg.products.product``). Values are
known by identity: a note keeps the value alive for the trace, so its ``id`` stays its
own. Outside a trace (a rule called alone, abstract evaluation), nothing is noted and
the products are the plain ones; both compute the same product.

Batch broadcasts are the other operand a product should not materialize. ``x @ w`` with
a 3-D ``x`` that is not contiguous (``x.transpose(0, 1) @ w``, ``nn.MultiheadAttention``
without ``batch_first``, what ``torch.export`` makes of a linear layer on a permuted
input) reaches the lowering as ``bmm(x, expand(w, [B, K, N]))``: traced as written, XLA
broadcasts the weight into a (B, K, N) array and runs B small products, one thread
(``x.transpose(0, 1) @ w`` of (8, 128, 256) by (256, 768): 43 ms against eager's 1.4
ms). So ``note`` also records every ``expand`` that copies one matrix along new leading
dimensions (``broadcast``), through the views and copies that keep it one, and the
product contracts the batch of matrices with the one matrix, a single dot with no batch
dimension.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import torch

aten = torch.ops.aten

# Ops after which a noted transpose is still one, of a value derived from its source.
_COPIES = frozenset({aten.clone.default, aten.alias.default})
_LEADING_RESHAPES = frozenset(
    {aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default}
)
# With a Python scalar as the other operand (the ``Tensor`` overloads take one too).
_SCALAR_ELEMENTWISE = frozenset(
    {aten.mul.Scalar, aten.div.Scalar, aten.mul.Tensor, aten.div.Tensor}
)


@dataclasses.dataclass
class _Notes:
    """One trace's notes, each keyed by ``id(value)`` and holding the value (alive for
    the trace, so that its id stays its own)."""

    # id -> (value, its source): values known to be transposes.
    transposes: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # id -> (value, matrix, transposed): every matrix of the value's last two
    # dimensions is ``matrix`` (2-D), or its transpose where ``transposed``.
    broadcasts: dict[int, tuple[Any, Any, bool]] = dataclasses.field(default_factory=dict)


_NOTES: contextvars.ContextVar[_Notes | None] = contextvars.ContextVar(
    "dynajax_transposes", default=None
)


def _entry(table: dict[int, Any], x: Any) -> Any:
    """``x``'s entry in ``table``, or None (an id reused by another value is not it)."""
    entry = table.get(id(x))
    return entry if entry is not None and entry[0] is x else None


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Within: ``note`` records transposes and broadcasts, ``source`` and ``broadcast``
    find them (one trace)."""
    token = _NOTES.set(_Notes())
    try:
        yield
    finally:
        _NOTES.reset(token)


def note(target: Any, args: tuple[Any, ...], result: Any, rule: Any = None) -> None:
    """Records ``result`` as a transpose (its last two dimensions swapped) of some value,
    when the node ``target(*args)`` makes it one: a swap (``aten.t``, ``aten.transpose``
    or ``aten.permute``) of its input, or one of the ops that commute with a swap applied
    to a noted transpose: a copy (``clone``), an expand or view that changes only the
    leading dimensions, an elementwise op with a Python scalar (``rule``, the node's
    rule, applied to the source instead)."""
    notes = _NOTES.get()
    if notes is None or not args or not hasattr(args[0], "ndim") or args[0].ndim < 2:
        return
    _note_broadcast(notes.broadcasts, target, args[0], result)
    noted = notes.transposes
    x, n = args[0], args[0].ndim
    if target is aten.t.default:
        swap = n == 2
    elif target is aten.transpose.int:
        swap = {args[1] % n, args[2] % n} == {n - 2, n - 1}
    elif target is aten.permute.default:
        swap = [d % n for d in args[1]] == [*range(n - 2), n - 1, n - 2]
    else:
        swap = False
    if swap:
        if result is not x:  # a rule may hand back its input for a no-op
            noted[id(result)] = (result, x)
        return
    entry = _entry(noted, x)
    if entry is None or not hasattr(result, "shape"):
        return
    src = entry[1]
    if target in _COPIES:
        noted[id(result)] = (result, src)
    elif target in _LEADING_RESHAPES:
        if result.ndim >= 2 and tuple(result.shape[-2:]) == tuple(x.shape[-2:]):
            lead = tuple(result.shape[:-2]) + tuple(src.shape[-2:])
            if target is aten.expand.default:
                noted[id(result)] = (result, jnp.broadcast_to(src, lead))
            else:
                noted[id(result)] = (result, jnp.reshape(src, lead))
    elif target in _SCALAR_ELEMENTWISE and rule is not None:
        # Floating only: an integer division's rule states a value check, which the
        # source's copy of the op would state twice.
        floating = jnp.issubdtype(result.dtype, jnp.floating)
        if floating and all(not hasattr(a, "shape") for a in args[1:]):
            noted[id(result)] = (result, rule(src, *args[1:]))


def _note_broadcast(
    broadcasts: dict[int, tuple[Any, Any, bool]], target: Any, x: Any, result: Any
) -> None:
    """Records ``result`` as a batch of one matrix when ``target(x, ...)`` makes it one:
    an ``expand`` of a matrix (or of a batch of it whose leading sizes are all 1) to
    new leading dimensions, or a copy, or a view that changes only the leading
    dimensions, of a recorded batch."""
    if (
        result is x
        or not hasattr(result, "ndim")
        or result.ndim < 3
        or tuple(result.shape[-2:]) != tuple(x.shape[-2:])
    ):
        return
    entry = _entry(broadcasts, x)
    if entry is not None:
        if target in _COPIES or target in _LEADING_RESHAPES:
            broadcasts[id(result)] = (result, entry[1], entry[2])
        return
    if target is aten.expand.default and all(d == 1 for d in x.shape[:-2]):
        matrix, transposed = source(x)
        matrix = jnp.reshape(matrix, matrix.shape[-2:])
        broadcasts[id(result)] = (result, matrix, transposed)


def broadcast(x: Any) -> tuple[Any, bool] | None:
    """``(matrix, transposed)`` where every matrix of ``x``'s last two dimensions is
    ``matrix`` (or its transpose, where ``transposed``), else None."""
    notes = _NOTES.get()
    entry = _entry(notes.broadcasts, x) if notes is not None else None
    return None if entry is None else (entry[1], entry[2])


def source(x: Any) -> tuple[Any, bool]:
    """``(s, True)`` where ``x`` is ``s`` with its last two dimensions swapped, else
    ``(x, False)``."""
    notes = _NOTES.get()
    entry = _entry(notes.transposes, x) if notes is not None else None
    return (x, False) if entry is None else (entry[1], True)

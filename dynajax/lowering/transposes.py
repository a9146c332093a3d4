"""Which traced values are transposes of another, so that products read them in place.

``linear`` reaches the lowering as ``mm(x, t(w))`` and a weight gradient as
``mm(t(g), x)``. Traced as written, JAX's program is a ``transpose`` and a ``dot``, and
XLA's CPU compiler does not fold the one into the other: it copies the transposed
operand into a new layout and, where the product is small, fuses that copy and the dot
into one loop nest, which it runs as scalar code. A matrix-vector product (a decode
step's linear layers: one token, so M = 1) then took 40-55 µs where the same product
with the transpose folded into the dot's dimensions takes 17 µs (256 x 1024 weights;
``python -m benchmarks.matmul``, its decode rows), and weight gradients of a batch of
64 took 8-14% longer.

So while a partition traces, the interpreter notes every ``aten.t``, ``aten.transpose``
and ``aten.permute`` node whose result swaps its input's last two dimensions
(``note``), and the product rules ask ``source`` for an operand's untransposed value,
contracting it along the other dimension (``linalg.products.product``). Values are
known by identity: a note keeps the value alive for the trace, so its ``id`` stays its
own. Outside a trace (a rule called alone, abstract evaluation), nothing is noted and
the products are the plain ones; both compute the same product.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

aten = torch.ops.aten

# id(value) -> (value, its source): the values of one trace known to be transposes.
_NOTED: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "dynajax_transposes", default=None
)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Within: ``note`` records transposes, ``source`` finds them (one trace)."""
    token = _NOTED.set({})
    try:
        yield
    finally:
        _NOTED.reset(token)


def note(target: Any, args: tuple[Any, ...], result: Any) -> None:
    """Records ``result`` as ``args[0]`` with its last two dimensions swapped when the
    node ``target(*args)`` is such a swap."""
    noted = _NOTED.get()
    if noted is None or not args or not hasattr(args[0], "ndim") or args[0].ndim < 2:
        return
    n = args[0].ndim
    if target is aten.t.default:
        swap = n == 2
    elif target is aten.transpose.int:
        swap = {args[1] % n, args[2] % n} == {n - 2, n - 1}
    elif target is aten.permute.default:
        swap = [d % n for d in args[1]] == [*range(n - 2), n - 1, n - 2]
    else:
        return
    if swap:
        noted[id(result)] = (result, args[0])


def source(x: Any) -> tuple[Any, bool]:
    """``(s, True)`` where ``x`` is ``s`` with its last two dimensions swapped, else
    ``(x, False)``."""
    noted = _NOTED.get()
    entry = noted.get(id(x)) if noted is not None else None
    if entry is not None and entry[0] is x:
        return entry[1], True
    return x, False

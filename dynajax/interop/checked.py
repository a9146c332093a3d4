"""Value checks of a JAX function as a value: ``outputs, err = fn.checked(state, x)``.

Eager PyTorch raises on invalid argument values (an embedding index past the table,
a gather index out of bounds, an integer division by zero); JAX clamps or fills them.
The backend computes eager's checks inside the XLA program and raises on the host
after the call (``lowering/checks.py``). A JAX function cannot raise from inside
``jax.jit``, ``jax.vmap``, ``jax.grad`` or ``jax.lax.scan``: their programs return
values only. So ``jax_function`` returns the result of the checks as a value, as
``jax.experimental.checkify`` does: a ``ValueCheckResult``, a pytree holding the int
vector ``[code, *payload]`` the rules' checks compute (code 0: every check passed;
else the first failing check, in graph order), with the checks themselves (eager's
exception types and message templates) as static data. It passes through every JAX
transformation like any output (under ``vmap`` and ``scan`` it gains leading axes), and
``.throw()`` raises eager's exception, with eager's message, outside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from dynajax.lowering import checks as value_checks
from dynajax.lowering.checks import Check


@jax.tree_util.register_pytree_node_class
class ValueCheckResult:
    """The outcome of eager's value checks in one (possibly batched) call of a JAX function.

    Attributes:
        vector: the int array ``[..., 1 + width]``: per call, the code of the first
            failing check (0: none failed) and its payload (the failing value and the
            sizes for eager's message). Leading axes come from ``vmap`` and ``scan``.
        checks: the checks the function's trace recorded, in graph order (static).
    """

    def __init__(self, vector: Any, checks: Sequence[Check]) -> None:
        self.vector = vector
        self.checks = tuple(checks)

    def tree_flatten(self) -> tuple[tuple[Any], tuple[Check, ...]]:
        return (self.vector,), self.checks

    @classmethod
    def tree_unflatten(cls, checks: tuple[Check, ...], children: Sequence[Any]) -> ValueCheckResult:
        return cls(children[0], checks)

    def failed(self) -> bool:
        """Whether some check failed (in any element of a batched result)."""
        return value_checks.failed(self.vector)

    def exception(self) -> Exception | None:
        """Eager's exception for the first failing call (row-major over the leading
        axes), or None when every check passed."""
        return value_checks.error(
            self.checks,
            self.vector,
            "a jax_function",
            "jax_function(..., checks=False) turns the checks of direct calls off",
        )

    def get(self) -> str | None:
        """Eager's message for the first failure, or None (as checkify's ``Error.get``)."""
        exc = self.exception()
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def throw(self) -> None:
        """Raises eager's exception if some check failed; otherwise does nothing."""
        exc = self.exception()
        if exc is not None:
            raise exc

    def __repr__(self) -> str:
        try:
            message = self.get()
        except (TypeError, jax.errors.ConcretizationTypeError):  # a tracer
            return f"ValueCheckResult(traced, {len(self.checks)} check(s))"
        return f"ValueCheckResult({message or 'passed'}, {len(self.checks)} check(s))"

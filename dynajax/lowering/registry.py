"""The lowering table: one rule per exact ATen ``OpOverload``.

A rule is a pure function of JAX values and Python literals (torch dtypes in the graph
arrive already translated to numpy dtypes). A ``check`` sees the same arguments, with
tensors replaced by ``jax.ShapeDtypeStruct``, and returns None when it accepts the node
or a short reason string when it refuses it.

    aten = torch.ops.aten

    @lower(aten.sin.default)
    def _sin(x):
        return jnp.sin(x)

This module is a leaf: it imports nothing from dynajax. The family modules import it
to register their rules, and the package ``dynajax.lowering`` imports every family
module, so any import from the package (this module included) fills the table.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch

Check = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A JAX implementation of one ATen overload.

    Attributes:
        op: the exact overload lowered.
        fn: the JAX implementation; returns a JAX array or a tuple of them.
        check: optional validator of argument values; None means "accept all".
        needs_key: the rule takes a ``key=`` keyword with a fresh JAX PRNG key.
        needs_layout: the rule and its check take a ``layout=`` keyword, a
            ``NodeLayout`` with eager PyTorch's memory layout of the node's first
            argument and of its output (ops that address storage, like as_strided).
        where: ``file:line`` of the ``lower(...)`` call that registered the rule, so
            that an error about the rule (a second registration) can say where it is.
    """

    op: torch._ops.OpOverload
    fn: Callable[..., Any]
    check: Check | None = None
    needs_key: bool = False
    needs_layout: bool = False
    where: str = ""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where eager PyTorch keeps a tensor's elements in its storage.

    Attributes:
        stride: the stride of each dim, in elements.
        storage_offset: the storage position of element ``[0, ..., 0]``.
        unknown: None when eager's layout is known to be this one, else why it is not
            (the fake tensor's strides may not be what the eager kernel makes).
    """

    stride: tuple[int, ...]
    storage_offset: int
    unknown: str | None = None


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The layouts a ``needs_layout`` rule sees: its first argument's and its output's."""

    input: Layout
    output: Layout


# node.meta key of the NodeLayout the capability pass decided (read again by lowering).
LAYOUT_KEY = "dynajax_layout"


_TABLE: dict[torch._ops.OpOverload, Rule] = {}


def lower(
    *ops: torch._ops.OpOverload,
    check: Check | None = None,
    needs_key: bool = False,
    needs_layout: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as the JAX rule of each of ``ops``.

    Each overload is named in full at the call (``aten.sin.default``, not built from a
    string), so that searching the source for an overload finds its rule.

    Raises:
        TypeError: an argument is not an exact ``OpOverload``.
        ValueError: an overload already has a rule; the message names both places.
    """
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"lower() takes exact OpOverloads (aten.add.Tensor), got {op!r}")
    caller = sys._getframe(1)
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if op in _TABLE:
                first = _TABLE[op]
                raise ValueError(
                    f"{op} has two JAX rules: {first.fn.__qualname__} registered at "
                    f"{first.where or '(unknown)'} and {fn.__qualname__} registered at {where}"
                )
        for op in ops:
            _TABLE[op] = Rule(op, fn, check, needs_key, needs_layout, where)
        return fn

    return register


def get_rule(op: Any) -> Rule | None:
    """The rule for ``op``, or None when the table has none."""
    return _TABLE.get(op)


def supported_ops() -> frozenset[torch._ops.OpOverload]:
    """Every OpOverload that has a JAX rule."""
    return frozenset(_TABLE)


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Names a function that a factory made, so that errors and reports name it.

    A closure that a factory builds (``_float_unary(jnp.sin)``) is otherwise called
    ``_float_unary.<locals>.rule``, whichever op it lowers.

    Args:
        fn: the closure: a rule, or a kernel that a rule wraps.
        name: its name, e.g. ``"_sin"``.

    Returns:
        ``fn`` itself, with ``__name__`` and ``__qualname__`` set to ``name``.
    """
    fn.__name__ = name
    fn.__qualname__ = name
    return fn

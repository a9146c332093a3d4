"""The lowering table: one rule per exact ATen ``OpOverload``.

A rule is a pure function of JAX values and Python literals (torch dtypes in the graph
arrive already translated to numpy dtypes). A ``check`` sees the same arguments, with
tensors replaced by ``jax.ShapeDtypeStruct``, and returns None when it accepts the node
or a short reason string when it refuses it.

    aten = torch.ops.aten

    @lower(aten.sin.default)
    def _sin(x):
        return jnp.sin(x)
"""

from __future__ import annotations

import dataclasses
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
    """

    op: torch._ops.OpOverload
    fn: Callable[..., Any]
    check: Check | None = None
    needs_key: bool = False
    needs_layout: bool = False


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
    """Registers the decorated function as the JAX rule of each of ``ops``."""
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"lower() takes exact OpOverloads (aten.add.Tensor), got {op!r}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if op in _TABLE:
                raise ValueError(f"{op} already has a JAX rule ({_TABLE[op].fn.__qualname__})")
            _TABLE[op] = Rule(op, fn, check, needs_key, needs_layout)
        return fn

    return register


def get_rule(op: Any) -> Rule | None:
    """The rule for ``op``, or None when the table has none."""
    _ensure_loaded()
    return _TABLE.get(op)


def supported_ops() -> frozenset[torch._ops.OpOverload]:
    """Every OpOverload that has a JAX rule."""
    _ensure_loaded()
    return frozenset(_TABLE)


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        import dynajax.lowering.families  # noqa: F401  (registers every rule)

        _loaded = True

"""The lowering table: one rule per exact ATen ``OpOverload``.

A rule is a pure function of JAX values and Python literals (torch dtypes in the graph
arrive already translated to numpy dtypes). A ``check`` sees the same arguments, with
tensors replaced by ``jax.ShapeDtypeStruct``, and returns None when it accepts the node
or a short reason string when it refuses it.

    aten = torch.ops.aten

    @lower(aten.sin.default)
    def _sin(x):
        return jnp.sin(x)

Users register rules for their own ops through ``dynajax.register_rule``
(``dynajax/extending/rules.py``), which lands in the same table (``register_user_rule``):
a user rule may replace a built-in one only when asked to, with a warning, and
``remove_user_rule`` puts back what it replaced. Rules for ops of third-party libraries
that may be loaded after dynajax (``transformers``) are registered by name
(``lower_when_defined``) and bound to the op when it is first looked up.

This module is a leaf: it imports nothing from dynajax. The family modules import it
to register their rules, and the package ``dynajax.lowering`` imports every family
module, so any import from the package (this module included) fills the table.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
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
        user: registered by the user (``dynajax.register_rule``), not shipped with
            dynajax.
    """

    op: torch._ops.OpOverload
    fn: Callable[..., Any]
    check: Check | None = None
    needs_key: bool = False
    needs_layout: bool = False
    where: str = ""
    user: bool = False

    def over(
        self, args: Any, kwargs: dict[str, Any], is_array: Callable[[Any], bool]
    ) -> tuple[Callable[..., Any], list[Any]]:
        """The rule as a function of the leaves of ``(args, kwargs)`` that ``is_array``
        picks (the others, literals, closed over), and those leaves, in order; a rule
        that draws random numbers gets a fixed key. For ``jax.eval_shape`` of abstract
        arguments and ``jax.jit`` of concrete ones."""
        import jax  # the table is filled before JAX is needed

        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_array)
        positions = [i for i, leaf in enumerate(leaves) if is_array(leaf)]

        def run(*arrays: Any) -> Any:
            filled = list(leaves)
            for i, a in zip(positions, arrays, strict=True):
                filled[i] = a
            a, k = jax.tree_util.tree_unflatten(treedef, filled)
            if self.needs_key:
                k = dict(k, key=jax.random.key(0))
            return self.fn(*a, **k)

        return run, [leaves[i] for i in positions]


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

# node.meta key set (True) by the capability stage on a node whose JAX partition runs
# PyTorch's own kernel for it, inside the XLA program (dynajax/ffi): lowering calls it
# instead of a rule.
KERNEL_KEY = "dynajax_kernel"


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
    rule = _TABLE.get(op)
    if rule is None and _PENDING and isinstance(op, torch._ops.OpOverload):
        rule = _bind_pending(op)
    return rule


def supported_ops() -> frozenset[torch._ops.OpOverload]:
    """Every OpOverload that has a JAX rule (rules by name whose op is now defined included)."""
    for name in list(_PENDING):
        op = lookup_overload(name)
        if op is not None:
            _bind_pending(op)
    return frozenset(_TABLE)


# -- rules by name, for ops of libraries loaded after dynajax ------------------------------


@dataclasses.dataclass(frozen=True)
class _Pending:
    fn: Callable[..., Any]
    check: Check | None
    where: str


# "namespace::name.overload" -> the rule waiting for that op to be defined.
_PENDING: dict[str, _Pending] = {}


def overload_name(op: torch._ops.OpOverload) -> str:
    """``"namespace::name.overload"`` (``"transformers::grouped_mm_fallback.default"``)."""
    return f"{op.namespace}::{op._opname}.{op._overloadname}"


def lookup_overload(name: str) -> torch._ops.OpOverload | None:
    """The OpOverload named ``"namespace::name.overload"``, or None while it is not defined."""
    namespace, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), opname)
        found = getattr(packet, overload or "default")
    except AttributeError:  # torch.ops' answer for an op or overload not (yet) defined
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


def lower_when_defined(
    *names: str, check: Check | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as the rule of each overload named
    ``"namespace::name.overload"``, bound when that op is first looked up.

    For ops of third-party libraries (``transformers``) that dynajax must not import and
    that the user may import after dynajax: the rule joins the table the first time a
    graph (or ``supported_ops()``) asks for the op. Such rules are built-in rules.
    """
    caller = sys._getframe(1)
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    for name in names:
        if "::" not in name or "." not in name.partition("::")[2]:
            raise ValueError(f"lower_when_defined takes 'namespace::name.overload', got {name!r}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            if name in _PENDING:
                raise ValueError(f"{name} has two JAX rules: at {_PENDING[name].where} and {where}")
            _PENDING[name] = _Pending(fn, check, where)
        return fn

    return register


def _bind_pending(op: torch._ops.OpOverload) -> Rule | None:
    pending = _PENDING.pop(overload_name(op), None)
    if pending is None:
        return None
    rule = _TABLE.get(op)
    if rule is None:  # (a user rule registered meanwhile stays; it replaced this one)
        rule = _TABLE[op] = Rule(op, pending.fn, pending.check, where=pending.where)
    elif rule.user and op not in _REPLACED_BY_USER:
        _REPLACED_BY_USER[op] = Rule(op, pending.fn, pending.check, where=pending.where)
    return rule


# -- users' rules ------------------------------------------------------------------------

# For each op with a user rule: the rule it replaced (None: the op had none).
_REPLACED_BY_USER: dict[torch._ops.OpOverload, Rule | None] = {}


class RuleOverrideWarning(UserWarning):
    """A user rule replaced one that ships with dynajax (``override=True``)."""


def check_user_rule(op: torch._ops.OpOverload, where: str, override: bool) -> Rule | None:
    """The rule a user rule for ``op`` would replace; raises if it may not.

    Raises:
        ValueError: ``op`` has a rule and ``override`` is False; the message names it.
    """
    existing = get_rule(op)
    if existing is not None and not override:
        kind = "a rule registered by dynajax.register_rule" if existing.user else "a built-in rule"
        raise ValueError(
            f"{op} already has {kind} ({existing.fn.__qualname__} at "
            f"{existing.where or '(unknown)'}), so the rule at {where} was not registered. "
            f"Pass override=True to replace it (dynajax.unregister_rule({str(op)!r}) puts "
            "the replaced rule back), or register the rule for another op."
        )
    return existing


def register_user_rule(
    op: torch._ops.OpOverload, fn: Callable[..., Any], check: Check | None, where: str
) -> None:
    """Puts a user rule for ``op`` in the table (after ``check_user_rule``), warning
    when it replaces a rule that ships with dynajax."""
    existing = get_rule(op)
    if op not in _REPLACED_BY_USER:
        _REPLACED_BY_USER[op] = existing
    if existing is not None and not existing.user:
        warnings.warn(
            f"the JAX rule {fn.__qualname__} at {where} replaces dynajax's built-in rule for "
            f"{op} ({existing.fn.__qualname__} at {existing.where or '(unknown)'}); "
            f"dynajax.unregister_rule({str(op)!r}) puts it back.",
            RuleOverrideWarning,
            stacklevel=4,
        )
    _TABLE[op] = Rule(op, fn, check, where=where, user=True)


def remove_user_rule(op: torch._ops.OpOverload) -> None:
    """Removes the user rule of ``op`` and puts back the rule it replaced, if any.

    Raises:
        ValueError: ``op`` has no user rule.
    """
    rule = _TABLE.get(op)
    if rule is None or not rule.user:
        raise ValueError(
            f"{op} has no rule registered by dynajax.register_rule, so there is nothing "
            "to unregister."
        )
    replaced = _REPLACED_BY_USER.pop(op, None)
    if replaced is None:
        del _TABLE[op]
    else:
        _TABLE[op] = replaced


def user_rule_ops() -> list[torch._ops.OpOverload]:
    """The ops that have a user rule now."""
    return [op for op, rule in _TABLE.items() if rule.user]


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

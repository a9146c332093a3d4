"""JAX rules for users' own ops: ``dynajax.register_rule`` and ``dynajax.unregister_rule``.

    @torch.library.custom_op("mylib::soft_clip", mutates_args=())
    def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
        return limit * torch.tanh(x / limit)

    @soft_clip.register_fake
    def _(x, limit):
        return torch.empty_like(x)

    @dynajax.register_rule("mylib::soft_clip")
    def _soft_clip(x, limit):
        return limit * jnp.tanh(x / limit)

The rule joins the one lowering table (``lowering/registry.py``) that built-in rules are
in, so a node of the op is decided like any ATen node (its ``check``, then abstract
evaluation of the rule against the op's fake implementation) and runs inside the JAX
partition around it.

Which ops a key names: an ``OpOverload`` names itself; an ``OpOverloadPacket``
(``torch.ops.mylib.soft_clip``) or a name without an overload (``"mylib::soft_clip"``,
``"mylib.soft_clip"``) names every overload the op has when ``register_rule`` runs (as
``fallback_ops`` reads ``"aten.sort"``); ``"mylib::soft_clip.default"`` names one.

Gradients. aot_autograd differentiates in PyTorch, so it needs an autograd formula for
the op to trace a backward graph. When the op has none (a ``custom_op`` without
``register_autograd``), ``register_rule`` installs one: its backward is
``dynajax.call_jax`` of ``jax.vjp`` of the rule, so the backward graph holds one
``dynajax.call_jax`` node that the backward's JAX partition lowers (and eager PyTorch
runs the same VJP through JAX). When the op has its own formula (``register_autograd``,
as transformers' grouped matmul has), that formula is kept: register a rule for every
op its backward calls too. ``unregister_rule`` removes an installed formula again.

Ops whose nodes never reach the table are refused by ``register_rule``, naming the
reason: ops PyTorch decomposes before dynajax sees them (a ``CompositeImplicitAutograd``
kernel), and ops that mutate or alias their arguments (aot_autograd wraps them in
``auto_functionalized``): rules are for functional ops.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._library import custom_ops
from torch._library import utils as library_utils

from dynajax.lowering import registry
from dynajax.lowering.interpreter import jax_literal

F = TypeVar("F", bound=Callable[..., Any])

OpKey = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket


def register_rule(
    op: OpKey, check: Callable[..., str | None] | None = None, override: bool = False
) -> Callable[[F], F]:
    """Registers the decorated JAX function as the rule of ``op`` (a decorator).

    The rule takes the op's arguments as the graph has them: tensors as JAX arrays (of
    the same shapes and dtypes; 64-bit types stay 64-bit), everything else as Python
    values (a ``torch.dtype`` as the NumPy dtype JAX uses). It returns an array, or a
    tuple or list of them, of exactly the shapes and dtypes of the op's fake
    implementation; a rule that does not is refused (the node runs in PyTorch and the
    report says why).

    Args:
        op: an ``OpOverload`` (``torch.ops.mylib.soft_clip.default``), an
            ``OpOverloadPacket`` or a ``torch.library`` name (``"mylib::soft_clip"``,
            ``"mylib.soft_clip"``, ``"torch.ops.mylib.soft_clip"``), which name every
            overload of the op, or a name with an overload
            (``"mylib::soft_clip.default"``). The op must be defined already.
        check: optional, called with the node's arguments (tensors as
            ``jax.ShapeDtypeStruct``) before the rule; returns None to accept the node,
            or a short reason to leave it in PyTorch (as built-in rules' checks do).
        override: replace a rule the op already has (a built-in one, or one registered
            before); warns (``RuleOverrideWarning``) when it replaces a built-in rule.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: no such op; the op already has a rule and ``override`` is False; the
            op is decomposed by PyTorch before dynajax sees it, or mutates its arguments.
        TypeError: ``op`` is neither an op nor a name, or ``check`` is not callable.
    """
    overloads = resolve_ops(op)
    if check is not None and not callable(check):
        raise TypeError(f"register_rule: check must be a function or None, got {check!r}")
    for overload in overloads:
        _refuse_unreachable(overload)
    caller = sys._getframe(1)
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    def register(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register_rule decorates a JAX function, got {fn!r}")
        for overload in overloads:  # all refusals before any change
            registry.check_user_rule(overload, where, override)
        for overload in overloads:
            registry.register_user_rule(overload, fn, check, where)
            _install_autograd(overload, fn)
        return fn

    return register


def unregister_rule(op: OpKey) -> None:
    """Removes the rules ``register_rule`` registered for ``op`` (resolved as there),
    putting back the rules they replaced and removing the autograd formulas that
    ``register_rule`` installed. Graphs compiled before keep the rule they were
    compiled with (``torch._dynamo.reset()`` compiles them again).

    Raises:
        ValueError: ``op`` has no rule registered by ``register_rule``.
    """
    overloads = [o for o in resolve_ops(op) if _is_user_rule(o)]
    if not overloads:
        raise ValueError(
            f"{op} has no rule registered by dynajax.register_rule, so there is nothing "
            "to unregister."
        )
    for overload in overloads:
        registry.remove_user_rule(overload)
        _remove_autograd(overload)


def _is_user_rule(op: torch._ops.OpOverload) -> bool:
    rule = registry.get_rule(op)
    return rule is not None and rule.user


def resolve_ops(op: OpKey) -> list[torch._ops.OpOverload]:
    """The overloads a ``register_rule`` key names (see the module docstring)."""
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if not isinstance(op, str):
        raise TypeError(
            f"register_rule takes an op (torch.ops.mylib.soft_clip.default) or its name "
            f"('mylib::soft_clip'), got {op!r}"
        )
    name = op.strip().removeprefix("torch.ops.")
    if "::" in name:
        namespace, _, rest = name.partition("::")
    else:
        namespace, _, rest = name.partition(".")
    opname, _, overload = rest.partition(".")
    if not namespace or not opname:
        raise ValueError(
            f"register_rule: {op!r} is not an op name; use 'mylib::soft_clip' (every "
            "overload) or 'mylib::soft_clip.default' (one overload)."
        )
    packet = getattr(getattr(torch.ops, namespace), opname, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise ValueError(
            f"register_rule: there is no op {namespace}::{opname}. Define it first "
            "(torch.library.custom_op or torch.library.define), or import the library "
            "that defines it before registering its rule."
        )
    if not overload:
        return [getattr(packet, name) for name in packet.overloads()]
    if overload not in packet.overloads():
        valid = ", ".join(repr(f"{namespace}::{opname}.{o}") for o in packet.overloads())
        raise ValueError(
            f"register_rule: {namespace}::{opname} has no overload {overload!r}; "
            f"it has {valid} (or name '{namespace}::{opname}' for all of them)."
        )
    return [getattr(packet, overload)]


def _refuse_unreachable(op: torch._ops.OpOverload) -> None:
    """Raises for an op whose nodes never reach the table (an op that has a rule
    already reaches some graph, and is not refused)."""
    if registry.get_rule(op) is not None:
        return
    if not library_utils.is_functional_schema(op._schema):
        raise ValueError(
            f"register_rule: {op} mutates or aliases its arguments ({op._schema}); "
            "aot_autograd functionalizes it into an auto_functionalized node, which "
            "stays in PyTorch, so a rule for it would never be used. Define a functional "
            "op (mutates_args=(), returning new tensors) and register its rule."
        )
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        raise ValueError(
            f"register_rule: {op} has a CompositeImplicitAutograd kernel, so PyTorch "
            "decomposes it into the ops it calls before dynajax sees the graph, and a "
            "rule for it would never be used. Register its kernel for the CPU (or "
            "CompositeExplicitAutograd) key instead, as torch.library.custom_op does."
        )


# -- autograd formulas installed for ops without one ---------------------------------------


@dataclasses.dataclass
class _Installed:
    """An autograd formula register_rule installed (to remove it again)."""

    library: torch.library.Library | None  # None: a custom_op's own formula slot


_INSTALLED: dict[torch._ops.OpOverload, _Installed] = {}


def _has_autograd(op: torch._ops.OpOverload) -> bool:
    """Whether PyTorch can already differentiate ``op``."""
    opdef = custom_ops.OPDEFS.get(f"{op.namespace}::{op._opname}")
    if opdef is not None:
        return opdef._backward_fn is not None
    return any(
        torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
        for key in ("Autograd", "AutogradCPU", "CompositeImplicitAutograd")
    )


def _differentiable(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    return (
        library_utils.is_functional_schema(schema)
        and not library_utils.has_kwarg_only_tensors(schema)
        and any(
            library_utils.is_tensorlist_like_type(a.type)
            or a.type.isSubtypeOf(torch._C.TensorType.get())
            for a in schema.arguments
        )
        and not library_utils.is_out(op)
    )


def _install_autograd(op: torch._ops.OpOverload, rule: Callable[..., Any]) -> None:
    """Gives ``op`` a backward (``jax.vjp`` of ``rule``, through ``call_jax``) if it has
    none; replaces the one installed for an earlier rule."""
    if op in _INSTALLED:
        _remove_autograd(op)
    if op.namespace in ("aten", "prims") or _has_autograd(op) or not _differentiable(op):
        return
    backward, setup_context = _vjp_formula(rule)
    opdef = custom_ops.OPDEFS.get(f"{op.namespace}::{op._opname}")
    if opdef is not None:
        opdef.register_autograd(backward, setup_context=setup_context)
        _INSTALLED[op] = _Installed(None)
        return
    library = torch.library.Library(op.namespace, "FRAGMENT")
    torch.library.register_autograd(op, backward, setup_context=setup_context, lib=library)
    _INSTALLED[op] = _Installed(library)


def _remove_autograd(op: torch._ops.OpOverload) -> None:
    installed = _INSTALLED.pop(op, None)
    if installed is None:
        return
    if installed.library is not None:
        installed.library._destroy()
        return
    opdef = custom_ops.OPDEFS.get(f"{op.namespace}::{op._opname}")
    if opdef is not None:
        opdef._backward_fn = None
        opdef._setup_context_fn = None


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the i-th tensor argument goes in a rule's arguments (hashable, static)."""

    index: int


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a ``_Slot`` (appended to ``tensors``) and
    each torch literal by the rule's (``jax_literal``); lists stay lists."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, list | tuple):
        return type(value)(_split(v, tensors) for v in value)
    return jax_literal(value)


def _fill(spec: Any, arrays: Sequence[Any]) -> Any:
    if isinstance(spec, _Slot):
        return arrays[spec.index]
    if isinstance(spec, list | tuple):
        return type(spec)(_fill(s, arrays) for s in spec)
    if isinstance(spec, dict):
        return {k: _fill(v, arrays) for k, v in spec.items()}
    return spec


def _vjp_formula(rule: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(backward, setup_context)`` for ``torch.library.register_autograd``."""

    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: Any, keyword_only_inputs: Any = None
    ) -> None:
        tensors: list[torch.Tensor] = []
        ctx.spec = (_split(list(inputs), tensors), _split(dict(keyword_only_inputs or {}), tensors))
        ctx.save_for_backward(*tensors)
        outputs = [
            o
            for item in (output if isinstance(output, tuple) else (output,))
            for o in (item if isinstance(item, list) else [item])
        ]
        ctx.outputs = [(o.shape, o.dtype, o.device) for o in outputs]

    def backward(ctx: Any, *grads: Any) -> Any:
        # Imported here: dynajax.interop imports the capability stage, which imports
        # the lowering package this module's import fills.
        from dynajax.interop.call_jax import call_jax

        primals = list(ctx.saved_tensors)
        args_spec = ctx.spec[0]
        flat_grads = (
            list(grads[0])
            if len(grads) == 1 and isinstance(grads[0], list | tuple)
            else list(grads)
        )
        cotangents = [
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(flat_grads, ctx.outputs, strict=True)
        ]
        needs = _needs_grad(args_spec, ctx.needs_input_grad, len(primals))
        wrt = tuple(
            i
            for i, p in enumerate(primals)
            if needs[i] and (p.is_floating_point() or p.is_complex())
        )
        result: list[Any] = [None] * len(primals)
        if wrt:
            grads_wrt = call_jax(_rule_vjp, primals, cotangents, rule=rule, spec=ctx.spec, wrt=wrt)
            for i, g in zip(wrt, grads_wrt, strict=True):
                result[i] = g
        return _per_input(args_spec, result)

    return backward, setup_context


def _needs_grad(args_spec: list[Any], needs_input_grad: Sequence[bool], n: int) -> list[bool]:
    """Per tensor slot, whether its input needs a gradient (a list argument: all of it)."""
    needs = [False] * n
    for spec, need in zip(args_spec, needs_input_grad, strict=False):
        for slot in _slots(spec):
            needs[slot.index] = bool(need)
    return needs


def _slots(spec: Any) -> list[_Slot]:
    if isinstance(spec, _Slot):
        return [spec]
    if isinstance(spec, list | tuple):
        return [s for v in spec for s in _slots(v)]
    return []


def _per_input(args_spec: list[Any], grads: list[Any]) -> tuple[Any, ...]:
    """One gradient per positional input: a tensor (or None), a list for a list input."""
    out: list[Any] = []
    for spec in args_spec:
        if isinstance(spec, _Slot):
            out.append(grads[spec.index])
        elif isinstance(spec, list | tuple) and any(isinstance(s, _Slot) for s in spec):
            out.append([grads[s.index] if isinstance(s, _Slot) else None for s in spec])
        else:
            out.append(None)
    return tuple(out)


def _rule_vjp(
    primals: list[Any],
    cotangents: list[Any],
    *,
    rule: Callable[..., Any],
    spec: tuple[Any, Any],
    wrt: tuple[int, ...],
) -> tuple[Any, ...]:
    """The gradients of ``rule`` with respect to tensor slots ``wrt``, in PyTorch's
    convention (as ``call_jax``'s own VJP: the conjugate of JAX's VJP of the conjugate
    cotangent for complex values; integer and boolean outputs get ``float0`` zeros)."""
    args_spec, kwargs_spec = spec

    def of_wrt(*chosen: Any) -> Any:
        full = list(primals)
        for i, value in zip(wrt, chosen, strict=True):
            full[i] = value
        return rule(*_fill(args_spec, full), **_fill(kwargs_spec, full))

    outputs, pullback = jax.vjp(of_wrt, *(primals[i] for i in wrt))
    leaves, treedef = jax.tree_util.tree_flatten(outputs)
    cts = [_cotangent(c, o) for c, o in zip(cotangents, leaves, strict=True)]
    grads = pullback(jax.tree_util.tree_unflatten(treedef, cts))
    return tuple(jnp.conj(g) if jnp.iscomplexobj(g) else g for g in grads)


def _cotangent(ct: Any, output: Any) -> Any:
    if jnp.issubdtype(output.dtype, jnp.inexact):
        ct = ct.astype(output.dtype)
        return jnp.conj(ct) if jnp.iscomplexobj(ct) else ct
    return np.zeros(output.shape, dtype=jax.dtypes.float0)

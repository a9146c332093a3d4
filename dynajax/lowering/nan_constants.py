"""NaNs that XLA knows at compile time, and the guard XLA's CPU ``exp`` needs for them.

XLA's CPU compiler emits ``exp`` (and what it builds on it: ``exp2``, ``sinh``,
``cosh``; in bfloat16 also ``expm1``, ``logistic``, ``erfc`` and the bessel functions,
measured through ``gelu``, ``sigmoid``, ``i0``) as a polynomial
whose range reduction converts its argument to an integer. When that argument is a NaN
the compiler knows while it compiles (a NaN literal, ``x + nan``, the mean of an empty
tensor, fused with what reads it), LLVM folds the conversion to poison and the kernel
stores whatever the registers hold: ``exp(x + nan)`` gave ``-5.29, 4.6e-41, 0.0, ...``
where eager gives NaN (jaxlib 0.10.2, float32, float16 and bfloat16; float64 is
right; fuzz seed 7, program 4156). A NaN that arrives only at run time is fine.

So this module finds the nodes of a partition through which such a NaN can reach
XLA's fused code (``carrying_nan_constants``), and the interpreter runs their rules
with each of those primitives guarded (``guarded``): ``where(isnan(x), x, exp(x))``,
which LLVM folds to the NaN itself. The guard is a select per element, and it costs
more than that (a float32 softmax over (8, 4, 128, 128): 585 µs guarded, 321 µs
not), so it is only where a graph can carry such a NaN, which no benchmark model does.

A value XLA knows is one that depends on no input data: made by creation ops, or
computed from an empty input (a reduction over no elements is a constant). Such a value
can be NaN when it is a float computed by arithmetic (``0 / 0``, ``inf - inf``, the mean
of nothing) or written from a NaN argument; copies, views, conversions and selections of
NaN-free known values stay NaN-free. Whatever reads a value that can carry a known NaN
can carry it too, to the end of the partition (XLA's fusions decide what LLVM sees
together, and they are not known here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.fx
from jax.extend import core as jax_core

from dynajax.lowering import checks

aten = torch.ops.aten

# XLA CPU primitives that return garbage for a compile-time NaN (measured, jaxlib 0.10.2,
# by each primitive over a constant NaN fused with a parameter, in every float dtype).
GUARDED_PRIMITIVES = frozenset(
    {
        jax.lax.exp_p,
        jax.lax.exp2_p,
        jax.lax.expm1_p,
        jax.lax.logistic_p,
        jax.lax.sinh_p,
        jax.lax.cosh_p,
        jax.lax.erf_p,
        jax.lax.erfc_p,
        jax.lax.bessel_i0e_p,
        jax.lax.bessel_i1e_p,
    }
)

# Ops whose output values are copies, rearrangements or selections of their inputs'
# values (or booleans, or integers): a known output of known NaN-free inputs is NaN-free.
_VALUE_PRESERVING = frozenset(
    {
        "_to_copy",
        "_unsafe_view",
        "alias",
        "as_strided",
        "cat",
        "clamp",
        "clone",
        "constant_pad_nd",
        "copy",
        "diagonal",
        "eq",
        "expand",
        "flip",
        "gather",
        "ge",
        "gt",
        "index",
        "index_select",
        "le",
        "lift_fresh_copy",
        "logical_and",
        "logical_not",
        "logical_or",
        "lt",
        "masked_fill",
        "maximum",
        "minimum",
        "ne",
        "neg",
        "abs",
        "permute",
        "repeat",
        "roll",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "stack",
        "t",
        "transpose",
        "tril",
        "triu",
        "unbind",
        "unsqueeze",
        "view",
        "where",
    }
)

# Ops whose value depends only on their inputs' shapes and dtypes, never their data.
_SHAPE_ONLY = frozenset(
    {
        "empty_like",
        "full_like",
        "new_empty",
        "new_empty_strided",
        "new_full",
        "new_ones",
        "new_zeros",
        "ones_like",
        "zeros_like",
    }
)


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, complex):
        return math.isnan(value.real) or math.isnan(value.imag)
    if isinstance(value, list | tuple):
        return any(_has_nan(v) for v in value)
    return False


def _name(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", str(target)).rstrip("_")


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, list | tuple) else [val]
    return any(
        isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)
        for v in vals
    )


def _is_empty_input(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() == 0


def carrying_nan_constants(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The call nodes of ``graph`` whose code can hold a NaN that XLA knows when it
    compiles: their rules must guard ``GUARDED_PRIMITIVES`` (``guarded``)."""
    known: set[torch.fx.Node] = set()  # values that depend on no input data
    carrying: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if _is_empty_input(node):
                known.add(node)
            continue
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if all(n in known for n in inputs) or _name(node) in _SHAPE_ONLY:
            known.add(node)
        nan_argument = _has_nan(list(node.args)) or _has_nan(list(node.kwargs.values()))
        computed_known_float = (
            node in known
            and _is_float(node)
            and any(n in known for n in inputs)
            and _name(node) not in _VALUE_PRESERVING
        )
        if nan_argument or computed_known_float or any(n in carrying for n in inputs):
            carrying.add(node)
    return carrying


def guarded(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` (a rule), with every ``GUARDED_PRIMITIVES`` application in
    it, and in the calls it makes, returning its argument where that is NaN."""
    leaves, tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
    is_array = [isinstance(leaf, jax.Array) for leaf in leaves]
    arrays = [leaf for leaf, a in zip(leaves, is_array, strict=True) if a]
    outer = checks.active()
    found: list[checks.Check] = []

    def flat(*values: Any) -> Any:
        it = iter(values)
        full = [next(it) if a else leaf for leaf, a in zip(leaves, is_array, strict=True)]
        call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, full)
        if outer is None:
            return fn(*call_args, **call_kwargs), []
        with checks.collecting(like=outer) as inner:  # the rule's value checks, as outputs
            out = fn(*call_args, **call_kwargs)
        found.extend(inner.checks)
        return out, [[f, *p] for f, p in zip(inner.failed, inner.payloads, strict=True)]

    closed, shapes = jax.make_jaxpr(flat, return_shape=True)(*arrays)
    flat_out = _evaluate(closed.jaxpr, closed.consts, arrays)
    out, check_values = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), flat_out)
    if outer is not None:
        for check, (failed, *payload) in zip(found, check_values, strict=True):
            outer.add(check, failed, list(payload))
    return out


# Call-like primitives whose one sub-jaxpr takes the equation's operands: evaluated in
# line, so that the primitives inside are guarded too.
_CALL_PARAMS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jax_core.Literal) else env[v]

    for v, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args), strict=True):
        env[v] = value
    for eqn in jaxpr.eqns:
        operands = [read(v) for v in eqn.invars]
        param = _CALL_PARAMS.get(eqn.primitive.name)
        sub = eqn.params.get(param) if param else None
        if isinstance(sub, jax_core.ClosedJaxpr) and len(sub.jaxpr.invars) == len(operands):
            results = _evaluate(sub.jaxpr, sub.consts, operands)
        else:
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(eqn.params))
            results = list(out) if eqn.primitive.multiple_results else [out]
            if eqn.primitive in GUARDED_PRIMITIVES:
                x = operands[0]
                results = [jnp.where(jnp.isnan(x), x.astype(results[0].dtype), results[0])]
        for v, value in zip(eqn.outvars, results, strict=True):
            if not isinstance(v, jax_core.DropVar):
                env[v] = value
    return [read(v) for v in jaxpr.outvars]

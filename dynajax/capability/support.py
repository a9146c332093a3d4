"""Per-node verdicts, decided before any real data runs.

A node is supported when the table has a rule for its exact overload, every tensor it
touches has a dtype JAX has, its output shape is known before running, the rule's
``check`` accepts the arguments, and abstract evaluation of the rule
(``jax.eval_shape`` on the node's fake-tensor shapes and dtypes) produces exactly the
shapes and dtypes PyTorch's meta kernels recorded in ``node.meta["val"]``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable
from typing import Any

import jax
import torch
import torch.fx

from dynajax.capability.verdict import (
    META_KEY,
    Reason,
    Supported,
    Unsupported,
    Verdict,
    source_line,
    target_name,
)
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.lowering.interpreter import jax_literal
from dynajax.lowering.registry import Rule, get_rule

log = logging.getLogger("dynajax.capability")

# Exceptions through which JAX's abstract evaluation reports that a rule cannot take
# these arguments (shape and dtype errors), and the one a rule raises to refuse.
_ABSTRACT_EVAL_ERRORS = (TypeError, ValueError, NotImplementedError, IndexError)


class _DataDependent(Exception):
    pass


def _concrete(size: Any) -> int:
    if isinstance(size, int):
        return size
    hint = size.node.hint if isinstance(size, torch.SymInt) else None
    if hint is None:
        raise _DataDependent
    return int(hint)


def _abstract(value: Any) -> Any:
    """FakeTensor -> ShapeDtypeStruct, recursively; literals translated."""
    if isinstance(value, torch.fx.Node):
        return _abstract(value.meta.get("val"))
    if isinstance(value, torch.Tensor):
        shape = tuple(_concrete(s) for s in value.shape)
        return jax.ShapeDtypeStruct(shape, TORCH_TO_JAX[value.dtype])
    if isinstance(value, tuple):
        return tuple(_abstract(v) for v in value)
    if isinstance(value, list):
        return [_abstract(v) for v in value]
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise _DataDependent
    return jax_literal(value)


def _freeze(value: Any) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct):
        return ("T", value.shape, str(value.dtype))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(_freeze(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float) and value != value:
        return ("nan",)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return (type(value).__name__, value)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _node_values(args: Iterable[Any]) -> Iterable[Any]:
    for a in args:
        if isinstance(a, torch.fx.Node):
            yield a.meta.get("val")
        elif isinstance(a, list | tuple):
            yield from _node_values(a)


def _describe_aval(a: Any) -> str:
    return f"{a.dtype}{list(a.shape)}"


class CapabilityChecker:
    """Decides verdicts; caches abstract evaluations by (op, argument signature)."""

    def __init__(self, fallback_ops: Iterable[str] = ()) -> None:
        self.fallback_ops = frozenset(fallback_ops)
        self._cache: dict[Any, tuple[Reason, str] | None] = {}

    def annotate(self, gm: torch.fx.GraphModule) -> list[Unsupported]:
        """Stores a verdict in ``node.meta`` for every call_function node of ``gm``."""
        refused = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            verdict = self.decide(node)
            node.meta[META_KEY] = verdict
            if not verdict.supported:
                refused.append(verdict)
        return refused

    def decide(self, node: torch.fx.Node) -> Verdict:
        name = target_name(node)
        if node.target is operator.getitem:
            producer = node.args[0]
            pv = producer.meta.get(META_KEY) if isinstance(producer, torch.fx.Node) else None
            if pv is not None and pv.supported:
                return Supported(name)
            return self._refuse(node, Reason.NO_LOWERING, "getitem of a value kept in PyTorch")
        if not isinstance(node.target, torch._ops.OpOverload):
            return self._refuse(node, Reason.NO_LOWERING, "not an ATen operator")
        packet = name.rsplit(".", 1)[0]
        if name in self.fallback_ops or packet in self.fallback_ops:
            return self._refuse(node, Reason.USER_FALLBACK, "")
        rule = get_rule(node.target)
        if rule is None:
            return self._refuse(node, Reason.NO_LOWERING, "")
        tags = node.target.tags
        if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
            return self._refuse(
                node, Reason.DATA_DEPENDENT_SHAPE, "the op's output depends on tensor values"
            )
        out = node.meta.get("val")
        for t in (*_tensors(out), *_tensors(list(_node_values(node.args)))):
            if t.dtype not in TORCH_TO_JAX:
                return self._refuse(node, Reason.DTYPE, f"{t.dtype} has no JAX equivalent")
        for v in (*_node_values(node.args), *_node_values(node.kwargs.values())):
            if v is not None and not isinstance(v, torch.Tensor | list | tuple):
                return self._refuse(
                    node, Reason.CHECK_REFUSED, f"symbolic scalar argument {v!r}"
                )
        # A multi-output op may return None for an output it was asked not to compute
        # (convolution_backward's output_mask); the rule returns None there too.
        outs = _flatten(out)
        if out is None or not all(isinstance(t, torch.Tensor) or t is None for t in outs):
            return self._refuse(node, Reason.CHECK_REFUSED, "output is not a tensor")
        try:
            args = _abstract(node.args)
            kwargs = {k: _abstract(v) for k, v in node.kwargs.items()}
            expected = _abstract(out)
        except _DataDependent:
            return self._refuse(
                node, Reason.DATA_DEPENDENT_SHAPE, "a size depends on tensor values"
            )
        key = (node.target, _freeze(args), _freeze(kwargs), _freeze(expected))
        if key not in self._cache:
            self._cache[key] = _evaluate(rule, args, kwargs, expected)
        found = self._cache[key]
        if found is None:
            return Supported(name)
        return self._refuse(node, *found)

    def _refuse(self, node: torch.fx.Node, reason: Reason, detail: str) -> Unsupported:
        return Unsupported(reason, node.name, target_name(node), detail, source_line(node))


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _is_aval(value: Any) -> bool:
    return isinstance(value, jax.ShapeDtypeStruct)


def _evaluate(
    rule: Rule, args: Any, kwargs: dict[str, Any], expected: Any
) -> tuple[Reason, str] | None:
    """None if the rule accepts the abstract arguments and reproduces ``expected``."""
    if rule.check is not None:
        refusal = rule.check(*args, **kwargs)
        if refusal is not None:
            return Reason.CHECK_REFUSED, refusal

    # Only the tensors are abstract; literals stay Python values closed over.
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_aval)
    positions = [i for i, leaf in enumerate(leaves) if _is_aval(leaf)]

    def run(*avals: Any) -> Any:
        filled = list(leaves)
        for i, a in zip(positions, avals, strict=True):
            filled[i] = a
        a, k = jax.tree_util.tree_unflatten(treedef, filled)
        if rule.needs_key:
            k = dict(k, key=jax.random.key(0))
        return rule.fn(*a, **k)

    try:
        with jax.enable_x64(True):
            got = jax.eval_shape(run, *(leaves[i] for i in positions))
    except _ABSTRACT_EVAL_ERRORS as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Reason.CHECK_REFUSED, f"abstract evaluation failed: {msg[:200]}"
    got_flat, want_flat = _flatten(got), _flatten(expected)
    if len(got_flat) != len(want_flat):
        return Reason.CHECK_REFUSED, (
            f"rule returns {len(got_flat)} value(s), PyTorch returns {len(want_flat)}"
        )
    for g, w in zip(got_flat, want_flat, strict=True):
        if g is None or w is None:
            if g is not w:
                return Reason.CHECK_REFUSED, "rule and PyTorch disagree on which outputs are None"
            continue
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            return Reason.CHECK_REFUSED, (
                f"rule gives {_describe_aval(g)} where PyTorch gives {_describe_aval(w)}"
            )
    return None

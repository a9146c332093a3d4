"""Whether eager PyTorch's CPU kernel refuses an op's dtypes, asked of the kernel itself.

Dynamo and aot_autograd trace with fake tensors, which run PyTorch's *meta* kernels.
A meta kernel checks shapes and promotes dtypes, but many CPU kernels accept fewer
dtypes than their meta kernels: ``abs`` and ``floor`` refuse bool, ``softplus``,
``silu`` and ``frac`` refuse integers, ``mm`` refuses bool (the dispatch macros raise
``NotImplementedError: "abs_cpu" not implemented for 'Bool'``), and a few check a dtype
by hand (``relu``, ``sub`` and ``argmin`` of bool raise RuntimeError). A JAX rule
computes a value for those dtypes where eager raises. Such a node must run in eager
PyTorch, which then raises its own error.

No table of dtypes is kept (it would drift from the kernels): the kernel is asked. The
probe calls the op on real CPU tensors of zeros with the node's dtypes, cached per
signature. A pointwise op (``torch.Tag.pointwise``) gets one-element tensors (every size
shrunk to 1, 0 stays 0: its kernel broadcasts and checks them). Any other op gets the
node's own sizes, because some CPU kernels trust sizes their meta kernels checked and
read out of bounds on others (``embedding_bag`` with shrunk offsets crashed the
process); such an op with an input or output of more than ``_EXACT_LIMIT`` elements,
or outputs unknown, is not probed (its dtypes are taken as accepted: a bool ``mm`` of
two 100x100 matrices still computes a value where eager raises). The aot stage, which
has no node outputs yet, sizes them with the meta kernel.

    eager kernel -> succeeds                       accepted
                 -> raises NotImplementedError     refused (a dispatch macro's "not
                                                   implemented for", or no CPU kernel)
                 -> raises anything else, and
                    the same call with its bool
                    tensors as uint8 and bool
                    scalars as ints succeeds,      refused (a hand-written check of
                    or with its floating tensors   bool: relu, sub, rsub(x, True),
                    in one dtype                   argmin; of matching dtypes:
                                                   huber_loss_backward of float32 and
                                                   float16)
                 -> otherwise                      accepted (the error is about sizes or
                                                   values, not dtypes)

Ops outside the ``aten`` namespace are not probed (a custom op may have effects),
nor calls without tensor arguments. Seeded random ops run under ``fork_rng``, so the
probe leaves the user's random stream as it was.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

# The most elements a tensor of a probe that is not pointwise may have (32 KiB of
# float64): such a probe runs at the node's own sizes.
_EXACT_LIMIT = 4096

# The exception types PyTorch's C++ errors become in Python (c10::Error and its
# subclasses; NotImplementedError is apart: it always means refused).
_EAGER_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)


def eager_refusal(op: Any, args: Any, kwargs: dict[str, Any], out: Any = None) -> str | None:
    """Eager's error (``Type: message``) if its CPU kernel refuses these dtypes, else None.

    Args:
        op: the ATen overload.
        args, kwargs: its arguments, tensors as fake (or real) tensors or as FX nodes
            whose ``meta["val"]`` holds one; sizes may be backed SymInts.
        out: the node's output (fake tensors; None: asked of the meta kernel). An op
            that is not pointwise is probed only when its outputs are small too
            (``x.repeat(1000, 1000)`` would allocate its real output).
    """
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    flat, spec = tree_flatten((args, kwargs))
    leaves: list[Any] = []
    for leaf in flat:
        value = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            if value.node.hint is None:
                return None  # an unbacked size: nothing to probe with
            value = type(value.node.hint)(value.node.hint)
        leaves.append(value)
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not tensors:
        return None
    shapes: dict[int, list[int]] = {}
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            hints = [_hint(s) for s in v.shape]
            if None in hints:
                return None  # an unbacked size
            shapes[i] = [h for h in hints if h is not None]
    shrink = torch.Tag.pointwise in op.tags
    if not shrink and any(math.prod(shape) > _EXACT_LIMIT for shape in shapes.values()):
        return None  # not probed: see the module's docstring
    signature = []
    for i, v in enumerate(leaves):
        if i in shapes:
            shape = [min(s, 1) for s in shapes[i]] if shrink else shapes[i]
            signature.append(_TensorSpec(tuple(shape), v.dtype))
        else:
            signature.append(_hashable(v))
    try:
        key = (op, tuple(signature), spec)
        hash(key)
    except TypeError:
        return None  # an argument we cannot key a cache on (nothing seen so far)
    if not shrink:
        sizes = _output_sizes(out) if out is not None else _meta_output_sizes(*key)
        if sizes is None or any(math.prod(shape) > _EXACT_LIMIT for shape in sizes):
            return None  # outputs unknown or large (x.repeat(1000, 1000))
    return _probe(*key)


def _output_sizes(out: Any) -> list[list[int]] | None:
    """The sizes of the tensors of ``out`` (fake tensors), None if unknown or unbacked."""
    sizes = []
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            hints = [_hint(s) for s in t.shape]
            if None in hints:
                return None
            sizes.append([h for h in hints if h is not None])
    return sizes or None


@functools.lru_cache(maxsize=4096)
def _meta_output_sizes(
    op: torch._ops.OpOverload, signature: tuple[Any, ...], spec: Any
) -> list[list[int]] | None:
    """The output sizes of the call by its meta kernel (for the aot stage, which has no
    node outputs yet); None where the meta kernel raises."""
    leaves = [
        torch.empty(s.shape, dtype=s.dtype, device="meta")
        if isinstance(s, _TensorSpec)
        else _unhashable(s)
        for s in signature
    ]
    args, kwargs = tree_unflatten(leaves, spec)
    with _disable_current_modes(), torch.no_grad():
        try:
            return _output_sizes(op(*args, **kwargs))
        except (*_EAGER_ERRORS, NotImplementedError):
            return None


def _hint(size: Any) -> int | None:
    """A size as an int: a backed SymInt at its hint (no guard), None if unbacked."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size)


class _TensorSpec(NamedTuple):
    """A probe tensor: its sizes (the node's, or shrunk to 1 for a pointwise op) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


_SCALARS = (bool, int, float, complex)
_SCALAR_NAMES = frozenset(t.__name__ for t in _SCALARS)


def _hashable(value: Any) -> Any:
    """A cache key for an argument. Python scalars are keyed with their type: ``True``,
    ``1`` and ``1.0`` are equal keys to a dict, but not to eager's kernels
    (``sub(x, True)`` raises where ``sub(x, 1)`` does not)."""
    if isinstance(value, list):
        return ("list", *(_hashable(v) for v in value))
    if isinstance(value, float) and value != value:
        return ("nan",)
    if type(value) in _SCALARS:
        return (type(value).__name__, value)
    return value


@functools.lru_cache(maxsize=4096)
def _probe(op: torch._ops.OpOverload, signature: tuple[Any, ...], spec: Any) -> str | None:
    floats = {
        s.dtype for s in signature if isinstance(s, _TensorSpec) and s.dtype.is_floating_point
    }
    common = functools.reduce(torch.promote_types, floats) if len(floats) > 1 else None

    def call(plain: bool = False, one_float: bool = False) -> None:
        # plain: bool tensors as uint8 and Python bools as ints; one_float: every
        # floating tensor in the floating tensors' promoted dtype.
        leaves: list[Any] = []
        for s in signature:
            if isinstance(s, _TensorSpec):
                dtype = torch.uint8 if plain and s.dtype == torch.bool else s.dtype
                if one_float and s.dtype.is_floating_point and common is not None:
                    dtype = common
                leaves.append(torch.zeros(s.shape, dtype=dtype))
                continue
            value = _unhashable(s)
            leaves.append(int(value) if isinstance(value, bool) and plain else value)
        args, kwargs = tree_unflatten(leaves, spec)
        op(*args, **kwargs)

    with _disable_current_modes(), torch.no_grad(), _keep_rng(op):
        try:
            call()
            return None
        except NotImplementedError as e:
            return _describe(e)
        except _EAGER_ERRORS as e:
            error: Exception = e
        bools = any(
            isinstance(_unhashable(s), bool)
            or (isinstance(s, _TensorSpec) and s.dtype == torch.bool)
            for s in signature
        )
        retries = [{"plain": True}] if bools else []
        if common is not None:
            retries.append({"one_float": True})
        for retry in retries:
            try:
                call(**retry)
            except (*_EAGER_ERRORS, NotImplementedError):
                continue  # raised with these dtypes too
            return _describe(error)  # a hand-written check of the dtypes
        return None  # not a dtype's error: the sizes, or a value


def _unhashable(s: Any) -> Any:
    if isinstance(s, tuple) and s and s[0] == "list":
        return [_unhashable(v) for v in s[1:]]
    if s == ("nan",):
        return float("nan")
    if isinstance(s, tuple) and len(s) == 2 and s[0] in _SCALAR_NAMES:
        return s[1]
    return s


def _keep_rng(op: torch._ops.OpOverload) -> contextlib.AbstractContextManager[Any]:
    if torch.Tag.nondeterministic_seeded in op.tags:
        return torch.random.fork_rng(devices=[])
    return contextlib.nullcontext()


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}".rstrip(": ")


__all__ = ["eager_refusal"]

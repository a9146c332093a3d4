"""Padding dynamic dimensions up to buckets, only where padding cannot leak.

With ``pad_to_buckets``, a partition whose inputs have a symbolic size ``s0`` (a batch
of 5) runs the executable of the next power of two (8): inputs are zero-padded along
every dimension of size ``s0``, ``s0`` itself is passed as 8 where the graph takes it
as a value (``4*s0`` as 4 times 8), and every output dimension of size ``s0`` is sliced
back to 5. Batch sizes 1..64 then need 7 executables instead of 64.

That is only correct when the real rows never read the padded ones. Whether they do
is decided on the traced JAX program, not on a list of torch ops: the partition is
traced twice with two different values of the symbol, and every dimension whose size
follows the symbol is tracked through every equation (sub-jaxprs included):

    elementwise ops, transpose, broadcast           rows stay rows             safe
    dot_general / conv with s0 as batch or free dim rows stay rows             safe
    reduce_*, argmax, cumsum (reversed), sort, ...   over s0                   refused
    dot_general contracting over s0                  padded rows summed in     refused
    reshape [s0, 4, 7] <-> [4*s0, 7] (s0 outermost)  rows stay blocks          safe
    reshape [4, s0] -> [4*s0]                        rows interleave           refused
    a size s0+1 anywhere, or 4*s0 in an output       cannot be sliced back     refused
    any other primitive touching s0 (gather of s0-indexed tables, random bits, ...)
                                                                              refused

A refused symbol compiles per exact size (the reason is logged on ``dynajax.shapes``
and listed in the Report). Dynamo's guards on the symbol (``s0 <= 256``) are checked at
the padded size; a bucket that would violate one runs at the exact size instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import sympy
import torch

from dynajax.lowering import checks
from dynajax.lowering.dtypes import TORCH_TO_JAX

log = logging.getLogger("dynajax.shapes")


def next_bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for 0 and 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _expr(size: Any) -> sympy.Expr | int:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return int(size)


def _is_symbol(size: Any, sym: sympy.Symbol) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr == sym


def _multiple(size: Any, sym: sympy.Symbol) -> int | None:
    """k where ``size`` is the SymInt ``k * sym`` (``4*s0``: batch times heads), else None."""
    if not isinstance(size, torch.SymInt):
        return None
    ratio = sympy.simplify(size.node.expr / sym)
    return int(ratio) if ratio.is_Integer and ratio > 0 else None


def _mentions(size: Any, sym: sympy.Symbol) -> bool:
    if isinstance(size, torch.SymInt | torch.SymBool):
        return sym in size.node.expr.free_symbols
    return False


def free_symbols(values: Sequence[Any]) -> set[sympy.Symbol]:
    """The symbols in the shapes of the tensors and in the symbolic scalars of ``values``."""
    out: set[sympy.Symbol] = set()
    for v in values:
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        for s in sizes:
            if isinstance(s, torch.SymInt | torch.SymBool):
                out |= s.node.expr.free_symbols
    return out


@dataclasses.dataclass(frozen=True)
class SymbolPlan:
    """Where one bucketed symbol occurs: input dims, static inputs, output dims."""

    symbol: sympy.Symbol
    in_dims: tuple[tuple[int, int], ...]  # (input position, dim)
    statics: tuple[tuple[int, int], ...]  # (input position, k): its value is k * symbol
    out_dims: tuple[tuple[int, int], ...]  # (output index, dim)
    guards: tuple[sympy.Basic, ...]  # Dynamo's guards on this symbol alone

    def size(self, args: Sequence[Any]) -> int:
        if self.in_dims:
            pos, dim = self.in_dims[0]
            return args[pos].shape[dim]
        pos, k = self.statics[0]
        return int(args[pos]) // k

    def allows(self, padded: int) -> bool:
        sub = {self.symbol: padded}
        return all(bool(g.xreplace(sub)) for g in self.guards)


def occurrences(
    sym: sympy.Symbol, inputs: Sequence[Any], outputs: Sequence[Any]
) -> SymbolPlan | str:
    """The places ``sym`` occurs, or why it cannot be padded (a compound size)."""
    in_dims, statics, out_dims = [], [], []
    for i, v in enumerate(inputs):
        if isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if _is_symbol(s, sym):
                    in_dims.append((i, d))
                elif _mentions(s, sym):
                    return f"input {i} has size {s} (not {sym} itself)"
        elif (k := _multiple(v, sym)) is not None:
            statics.append((i, k))
        elif _mentions(v, sym):
            return f"input {i} is the value {v} (not {sym} itself)"
    for k, v in enumerate(outputs):
        if isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if _is_symbol(s, sym):
                    out_dims.append((k, d))
                elif _mentions(s, sym):
                    return f"output {k} has size {s} (not {sym} itself)"
        elif v is not None and _mentions(v, sym):
            return f"output {k} is the value {v}"
    if not in_dims and not statics:
        return f"{sym} is not an input size"
    return SymbolPlan(sym, tuple(in_dims), tuple(statics), tuple(out_dims), _guards(sym, inputs))


def _guards(sym: sympy.Symbol, inputs: Sequence[Any]) -> tuple[sympy.Basic, ...]:
    for v in inputs:
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        for s in sizes:
            if isinstance(s, torch.SymInt) and sym in s.node.expr.free_symbols:
                env = s.node.shape_env
                found = []
                for g in getattr(env, "guards", ()):
                    expr = getattr(g, "expr", None)
                    if expr is not None and expr.free_symbols == {sym}:
                        found.append(expr)
                return tuple(found)
    return ()


# -- the check on the traced program ----------------------------------------------------

_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy copy_p
    cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not
    optimization_barrier or polygamma population_count pow real reduce_precision rem
    round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin
    sinh sqrt square stop_gradient sub tan tanh xor zeta""".split()
)
_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor "
    "argmax argmin".split()
)
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class _Leak(Exception):
    """The padded rows could reach real ones (the message says where)."""


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _dims(va: Any, vb: Any, a: int, b: int) -> set[int]:
    """Dims of a var whose size is ``k * symbol`` (k >= 1: the symbol, or the symbol
    merged with inner dims, ``B*H`` in attention; rows stay contiguous blocks there,
    which ``_check_reshape`` keeps true). Raises on a dim that follows the symbol in any
    other way (``s0 + 1``)."""
    sa, sb = _shape(va), _shape(vb)
    if len(sa) != len(sb):
        raise _Leak("the two traces differ in rank")
    out = set()
    for d, (x, y) in enumerate(zip(sa, sb, strict=True)):
        if x == y:
            continue
        if x % a == 0 and y % b == 0 and x // a == y // b:
            out.add(d)
        else:
            raise _Leak(f"a dimension of size {x} follows the symbol as other than a multiple")
    return out


def _prefix(shape: tuple[int, ...], d: int) -> int:
    p = 1
    for s in shape[:d]:
        p *= s
    return p


def _check_reshape(eqn: Any, ins: list[set[int]], outs: list[set[int]]) -> None:
    """Row-major reshapes keep each row a contiguous block; the blocks of input and
    output coincide exactly when the dims before the padded one have the same product
    (``[s, 4, 7] -> [4s, 7]`` keeps rows, ``[4, s] -> [4s]`` interleaves them)."""
    src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    din, dout = ins[0], outs[0]
    if sorted(_prefix(src, d) for d in din) != sorted(_prefix(dst, e) for e in dout):
        raise _Leak(f"{eqn.primitive.name} interleaves rows of the padded dimension")


def _check_eqn(eqn: Any, ins: list[set[int]], outs: list[set[int]]) -> None:
    name = eqn.primitive.name
    p = eqn.params
    touched = set().union(*ins) if ins else set()
    if name in _ELEMENTWISE or name in ("transpose", "iota", "broadcast_in_dim"):
        return
    if name in ("reshape", "squeeze", "expand_dims"):
        return _check_reshape(eqn, ins, outs)
    if name in _REDUCTIONS:
        if touched & set(p["axes"]):
            raise _Leak(f"{name} reduces over the padded dimension")
        return
    if name in _CUMULATIVE:
        if p["axis"] in touched and p.get("reverse", False):
            raise _Leak(f"{name} runs backwards over the padded dimension")
        return
    if name == "dot_general":
        (lc, rc), _ = p["dimension_numbers"]
        if ins[0] & set(lc) or ins[1] & set(rc):
            raise _Leak("dot_general contracts over the padded dimension")
        return
    if name == "conv_general_dilated":
        lhs_spec = p["dimension_numbers"].lhs_spec
        if ins[1] or ins[0] - {lhs_spec[0]} or p.get("batch_group_count", 1) != 1:
            raise _Leak("convolution over the padded dimension")
        return
    if name in ("sort", "split", "concatenate", "top_k"):
        axis = p.get("dimension", p.get("axis", len(_shape(eqn.invars[0])) - 1))
        if axis in touched:
            raise _Leak(f"{name} along the padded dimension")
        return
    if name == "rev":
        if touched & set(p["dimensions"]):
            raise _Leak("rev along the padded dimension")
        return
    if name == "slice":
        shape = _shape(eqn.invars[0])
        strides = p.get("strides") or (1,) * len(shape)
        for d in touched:
            if p["start_indices"][d] != 0 or p["limit_indices"][d] != shape[d] or strides[d] != 1:
                raise _Leak("slice along the padded dimension")
        return
    if name == "pad":
        for d in touched:
            if tuple(p["padding_config"][d]) != (0, 0, 0):
                raise _Leak("pad along the padded dimension")
        return
    if name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min"):
        for d in touched:
            if (
                p["window_dimensions"][d] != 1
                or p["window_strides"][d] != 1
                or tuple(p["padding"][d]) != (0, 0)
            ):
                raise _Leak(f"{name} windows over the padded dimension")
        return
    if name == "gather":
        # Row-wise lookups into a table that is not itself padded (embeddings).
        dn = p["dimension_numbers"]
        rank_i = len(_shape(eqn.invars[1]))
        if ins[0] or (rank_i - 1) in ins[1] or dn.start_indices_batching_dims:
            raise _Leak("gather indexes along the padded dimension")
        out_rank = len(_shape(eqn.outvars[0]))
        batch = [d for d in range(out_rank) if d not in dn.offset_dims]
        if {batch[i] for i in ins[1]} != outs[0]:
            raise _Leak("gather moves the padded dimension")
        return
    raise _Leak(f"{name} is not known to keep rows of the padded dimension apart")


def _equal(x: Any, y: Any) -> bool:
    try:
        if hasattr(x, "shape") or isinstance(x, float):  # NaN fill values are equal
            return bool(np.array_equal(x, y, equal_nan=True))
        return bool(x == y)
    except (TypeError, ValueError):
        return x is y


def _is_function(key: str, value: Any) -> bool:
    return (
        callable(value)
        or hasattr(value, "eqns")
        or hasattr(value, "jaxpr")
        or any(part in key for part in ("jaxpr", "fun", "thunk"))
    )


def _same_values(ea: Any, eb: Any, a: int, b: int) -> None:
    """Raises where the symbol's *value* (not a size) reaches the computation.

    A size the graph takes as a value (``x * x.shape[0]``) is a literal or a parameter
    that differs between the two traces; padded, it would be the bucket's size. Shape
    parameters may differ exactly where they are the symbol (``reshape`` to ``[s0, -1]``).
    """
    for x, y in zip(ea.invars, eb.invars, strict=True):
        if hasattr(x, "val") and hasattr(y, "val") and not _equal(x.val, y.val):
            raise _Leak(f"{ea.primitive.name} uses the symbol's value as data")
    for key, va in ea.params.items():
        vb = eb.params.get(key)
        if key in _CALLS or _is_function(key, va) or _equal(va, vb):
            continue  # sub-programs are walked on their own; jvp/vjp rules never run here
        if (
            isinstance(va, tuple)
            and isinstance(vb, tuple)
            and len(va) == len(vb)
            and all(
                p == q or (isinstance(p, int) and isinstance(q, int) and p * b == q * a)
                for p, q in zip(va, vb, strict=True)
            )
        ):
            continue  # a shape parameter, a multiple of the symbol where it differs
        raise _Leak(f"{ea.primitive.name} takes the symbol's value in its {key!r}")


def _walk(ja: Any, jb: Any, a: int, b: int) -> list[set[int]]:
    """Checks a pair of jaxprs; returns the symbol dims of their outputs."""
    if len(ja.eqns) != len(jb.eqns):
        raise _Leak("the program's structure depends on the symbol's value")
    for va, vb in zip([*ja.constvars, *ja.invars], [*jb.constvars, *jb.invars], strict=True):
        _dims(va, vb, a, b)
    for ea, eb in zip(ja.eqns, jb.eqns, strict=True):
        if ea.primitive is not eb.primitive:
            raise _Leak("the program's structure depends on the symbol's value")
        _same_values(ea, eb, a, b)
        ins = [_dims(x, y, a, b) for x, y in zip(ea.invars, eb.invars, strict=True)]
        outs = [_dims(x, y, a, b) for x, y in zip(ea.outvars, eb.outvars, strict=True)]
        if not any(ins) and not any(outs):
            continue
        sub = next((k for k in _CALLS if k in ea.params), None)
        if sub is not None:
            inner_a, inner_b = ea.params[sub], eb.params[sub]
            inner_a = getattr(inner_a, "jaxpr", inner_a)
            inner_b = getattr(inner_b, "jaxpr", inner_b)
            got = _walk(inner_a, inner_b, a, b)
            if got != outs:
                raise _Leak(f"{ea.primitive.name} call moves the padded dimension")
            continue
        _check_eqn(ea, ins, outs)
    return [_dims(x, y, a, b) for x, y in zip(ja.outvars, jb.outvars, strict=True)]


def check_padding(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    plan: SymbolPlan,
    *,
    seed: bool,
    out_present: Sequence[bool],
) -> str | None:
    """None when padding ``plan.symbol`` cannot reach real rows of ``fn``'s outputs.

    ``inputs`` are the placeholder values (fake tensors, SymInts); ``fn`` takes
    ``[seed,] *inputs`` with the static ones as Python ints. Call with x64 on.
    """
    sym = plan.symbol
    hint = _hint(sym, inputs)
    a, b = max(hint, 2), max(hint, 2) + 1

    def trace(value: int) -> Any:
        def concrete(size: Any) -> Any:
            if isinstance(size, torch.SymInt | torch.SymBool):
                expr = size.node.expr
                subs = {s: value if s == sym else _hint(s, inputs) for s in expr.free_symbols}
                got = expr.xreplace(subs)
                return bool(got) if isinstance(size, torch.SymBool) else int(got)
            return size

        args: list[Any] = []
        statics: dict[int, Any] = {}
        for i, v in enumerate(inputs):
            if isinstance(v, torch.Tensor):
                args.append(
                    jax.ShapeDtypeStruct(tuple(map(concrete, v.shape)), TORCH_TO_JAX[v.dtype])
                )
            else:
                statics[i] = concrete(v)
        if seed:
            args.insert(0, jax.ShapeDtypeStruct((), jax.numpy.int64))
        # The proof is about the outputs PyTorch sees: value checks, which read the
        # padded rows too, are left out (a check that fails on them runs the call again
        # at its exact size: CompiledPartition._run_exact).
        with checks.suspended():
            return jax.make_jaxpr(_with_statics(fn, len(inputs), statics, seed))(*args)

    try:
        ja, jb = trace(a), trace(b)
    except Exception as e:  # noqa: BLE001 - a trace at another size may fail on a
        # guard-like assertion in a rule; that only means: do not pad this symbol.
        return f"tracing at another size of {sym} failed ({type(e).__name__})"
    try:
        if len(ja.consts) != len(jb.consts) or not all(
            _equal(x, y) for x, y in zip(ja.consts, jb.consts, strict=True)
        ):
            raise _Leak("a constant of the program depends on the symbol")
        outs = _walk(ja.jaxpr, jb.jaxpr, a, b)
    except _Leak as e:
        return str(e)
    want: list[set[int]] = [set() for _ in out_present]
    for k, d in plan.out_dims:
        want[k].add(d)
    want = [w for w, present in zip(want, out_present, strict=True) if present]
    plain = all(
        _shape(v)[d] == a for v, dims in zip(ja.jaxpr.outvars, outs, strict=True) for d in dims
    )
    if outs != want or not plain:
        return "the outputs' padded dimensions differ from PyTorch's"
    return None


def _hint(sym: sympy.Symbol, inputs: Sequence[Any]) -> int:
    for v in inputs:
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        for s in sizes:
            if isinstance(s, torch.SymInt) and sym in s.node.expr.free_symbols:
                env = s.node.shape_env
                values = getattr(env, "backed_var_to_val", None) or env.var_to_val
                return int(values[sym])
    raise KeyError(sym)


def _with_statics(
    fn: Callable[..., Any], n: int, statics: dict[int, Any], seed: bool
) -> Callable[..., Any]:
    """``fn`` taking only its array arguments, the static ones bound."""
    if not statics:
        return fn
    slots = [i for i in range(n) if i not in statics]

    def bound(*arrays: Any) -> Any:
        full: list[Any] = [None] * n
        for i, v in statics.items():
            full[i] = v
        rest = arrays[1:] if seed else arrays
        for i, x in zip(slots, rest, strict=True):
            full[i] = x
        return fn(*arrays[:1], *full) if seed else fn(*full)

    return bound


with_statics = _with_statics

"""The op catalog: every kind of op record, how it renders and how it is generated.

An ``OpKind`` renders a record to one line of Python (``render``) and proposes a record
for the program being generated (``gen``: the value ids it reads and its literal
parameters, chosen from the values the program has so far, or None when it cannot
apply). The generator (``fuzz.generate``) runs each proposal eagerly, so a gen need not
be exact about validity: eager PyTorch decides, and a proposal that raises is either
dropped or kept as the program's last op (the programs where eager raises).

Flags describe what an op does to the comparison, so that the programs avoid the
differences the README accepts (see ``fuzz.generate`` for how they are used):

``exact``: with bit-equal floating inputs, dynajax's result is bit-equal to eager's
(views, copies, ``+ - * /``, comparisons, max/min, casts). Reductions, products and
transcendentals are not: they differ by reassociation and by an ulp.
``disc``: the result is a discontinuous function of its floating inputs (comparisons,
floor, argmax, float-to-int casts, sort indices), so an ulp of difference upstream
becomes a different integer or boolean. Such ops only read exact values.
``nonfinite``: may turn finite values into inf or NaN (exp, log, division).
``signed``: reads the sign bit of its floating inputs (``copysign``, ``signbit``), which
for a NaN is unspecified (x86 makes -NaN, XLA +NaN): such ops only read finite values.
``large``: its result may hold more than ``fuzz.generate.MAX_NUMEL`` elements (the
large attention, which dynajax keeps whole and measures against PyTorch's kernel).
``writes``: also writes ``args[0]`` while it defines a value (``F.embedding`` with
``max_norm`` renormalizes the weight's rows in place).

Besides the elementwise, reduction, view and indexing ops, the catalog holds every op
whose placement (XLA or PyTorch's kernel) the backend measures at the first compile
(``dynajax/capability/cost.py``: ``aten.convolution`` and its backward, from
``F.conv*`` and ``F.conv_transpose*``; a large ``F.scaled_dot_product_attention``,
which ``dynajax.lowering.attention.whole`` keeps whole; the fused encoder layer,
``torch._transformer_encoder_layer_fwd``, the one op ``nn.TransformerEncoderLayer``
runs in eval mode under no_grad) and every op with a value check
(``dynajax/lowering/checks.py``), whose index inputs are now and then out of range
(``TensorInput.bad``): then eager's error is the answer.

Excluded on purpose: random ops (JAX's generator is not PyTorch's), ops whose result
depends on tie-breaking left open by PyTorch (``topk``, ``kthvalue``, ``mode``, unstable
``sort``; ``sort`` and ``argsort`` run with ``stable=True``), ``scatter`` and
``index_put`` without accumulation over duplicate indices (inputs of kind ``unique``
make them defined), and ``empty``-like ops (undefined values).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from fuzz.program import (
    CONTIGUOUS,
    EXPANDED,
    FLOAT_DTYPES,
    INDEX,
    INT_DTYPES,
    OFFSET,
    PERMUTED,
    PROBABILITY,
    SIGNED_INDEX,
    STEPPED,
    UNIQUE,
    OpRecord,
    TensorInput,
    layout_fits,
    name,
)


class GenState(Protocol):
    """What an op's gen reads and adds: the program being generated, its values on the
    first call's inputs (``fuzz.generate.GenState`` is the one)."""

    rng: random.Random
    grad: bool
    inputs: list[TensorInput]
    order: list[int]
    out_base: int

    def tensor(self, v: int) -> torch.Tensor: ...
    def shape(self, v: int) -> tuple[int, ...]: ...
    def ndim(self, v: int) -> int: ...
    def dtype(self, v: int) -> str: ...
    def is_float(self, v: int) -> bool: ...
    def exact(self, v: int) -> bool: ...
    def finite(self, v: int) -> bool: ...
    def root(self, v: int) -> int: ...
    def pick(self, pred: Callable[[int], bool] | None = None) -> int | None: ...
    def random_dtype(self) -> str: ...
    def new_input(
        self,
        shape: tuple[int, ...],
        dtype: str,
        *,
        kind: str = ...,
        high: int = ...,
        requires_grad: bool | None = ...,
        layout: str | None = ...,
        scale: float | None = ...,
        bad: bool = ...,
        specials: bool | None = ...,
    ) -> int: ...


Params = dict[str, Any]
Proposal = tuple[Sequence[int], Params] | None
Gen = Callable[[GenState], Proposal]
Render = Callable[[list[str], Params], str]


@dataclasses.dataclass(frozen=True)
class OpKind:
    """One kind of op record.

    Attributes:
        name: the catalog key, the name a record and a failure signature use.
        render: ``(argument names, params) -> Python expression or statement``.
        gen: proposes ``(argument ids, params)`` for the program being generated.
        weight: relative frequency in generated programs.
        exact: bit-equal to eager on bit-equal inputs (see the module docstring).
        disc: discontinuous in its floating arguments, which must then be exact.
        nonfinite: may make inf or NaN of finite values.
        signed: reads the sign bit of its floating arguments, which must be finite.
        view: the result aliases ``args[0]`` (a view, or what a view may be).
        inplace: writes ``args[0]`` and defines no value.
        large: the result may exceed ``fuzz.generate.MAX_NUMEL`` elements.
        writes: writes ``args[0]`` and defines a value too.
        functional: for an in-place kind, the out-of-place kind with the same
            arguments and parameters (the shrinker's simplification).
    """

    name: str
    render: Render
    gen: Gen
    weight: float = 1.0
    exact: bool = False
    disc: bool = False
    nonfinite: bool = False
    signed: bool = False
    view: bool = False
    inplace: bool = False
    large: bool = False
    writes: bool = False
    functional: str | None = None


KINDS: dict[str, OpKind] = {}


_FLAGS = ("exact", "disc", "nonfinite", "signed", "view", "inplace", "large", "writes")


def _add(
    kind_name: str,
    render: Render,
    gen: Gen,
    weight: float = 1.0,
    flags: str = "",
    functional: str | None = None,
) -> OpKind:
    """Registers a kind; ``flags`` names its true flags, space separated."""
    assert kind_name not in KINDS, kind_name
    assert set(flags.split()) <= set(_FLAGS), flags
    kind = OpKind(
        kind_name,
        render,
        gen,
        weight,
        functional=functional,
        **{f: f in flags.split() for f in _FLAGS},
    )
    KINDS[kind_name] = kind
    return kind


def render(rec: OpRecord, *, upcast: bool = False) -> str:
    """The line of Python for ``rec``; with ``upcast``, floating dtypes named by its
    parameters become float64 (the float64 reference of a program)."""
    params = rec.p
    if upcast:
        params = {
            k: "float64" if isinstance(v, str) and v in FLOAT_DTYPES else v
            for k, v in params.items()
        }
    text = KINDS[rec.kind].render([name(a) for a in rec.args], params)
    return text if rec.out is None else f"{name(rec.out)} = {text}"


# ---------------------------------------------------------------------------------
# Small helpers of the gens
# ---------------------------------------------------------------------------------


def _dim(g: GenState, v: int) -> int:
    """A valid dim of value ``v`` (0-dim tensors accept 0 and -1), maybe negative."""
    n = max(g.ndim(v), 1)
    return g.rng.randrange(-n, n)


def _dims(g: GenState, v: int) -> int | tuple[int, ...] | None:
    """None (all dims), one dim, or a tuple of distinct dims of ``v``."""
    n = g.ndim(v)
    r = g.rng.random()
    if r < 0.2 or n == 0:
        return None if r < 0.2 else g.rng.choice([0, -1])
    if r < 0.65:
        return _dim(g, v)
    k = g.rng.randint(1, n)
    return tuple(sorted(g.rng.sample(range(n), k)))


def _kw(params: Params, *names: str) -> str:
    """``, name=value`` for each of ``names`` present in ``params``."""
    out = ""
    for key in names:
        if key in params:
            value = params[key]
            out += f", {key}={_lit(value)}"
    return out


def _lit(value: Any) -> str:
    """A parameter as Python source: dtype names as ``torch.<name>``."""
    if isinstance(value, str) and value in (*FLOAT_DTYPES, *INT_DTYPES, "bool"):
        return f"torch.{value}"
    return repr(value)


def _float_or_any(g: GenState, p_float: float = 0.8, exact: bool = False) -> int | None:
    """A value, floating with probability ``p_float`` (exact ones only with ``exact``)."""

    def ok(v: int) -> bool:
        return not exact or g.exact(v)

    if g.rng.random() < p_float:
        v = g.pick(lambda u: g.is_float(u) and ok(u))
        if v is not None:
            return v
    return g.pick(ok)


def _scalar(g: GenState, v: int | None = None) -> int | float | bool:
    """A Python scalar operand: a float, an int or (rarely) a bool; mostly of the kind
    that keeps ``v``'s dtype."""
    r = g.rng.random()
    is_float = v is not None and g.is_float(v)
    if r < 0.05:
        return g.rng.choice([True, False])
    if (is_float and r < 0.8) or (not is_float and r > 0.85):
        return g.rng.choice([0.5, -1.5, 2.0, 3.0, -0.25, 1.0, 0.75])
    return g.rng.choice([2, -3, 1, 3, -1, 0] if r < 0.97 else [0])


def _broadcast_shape_for(g: GenState, shape: tuple[int, ...], into: bool) -> tuple[int, ...]:
    """A random shape that broadcasts with ``shape`` (``into``: to exactly ``shape``)."""
    rng = g.rng
    dims = list(shape)
    if dims and rng.random() < 0.3:
        dims = dims[rng.randint(1, len(dims)) :]
    dims = [1 if rng.random() < 0.3 else d for d in dims]
    if not into:
        dims = [rng.choice([2, 3]) if d == 1 and rng.random() < 0.2 else d for d in dims]
        if rng.random() < 0.1:
            dims = [rng.choice([1, 2]), *dims]
    return tuple(dims)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...], into: bool) -> bool:
    try:
        out = torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return tuple(out) == a if into else True


def partner(
    g: GenState, v: int, *, into: bool = False, dtype: str | None = None, exact: bool = False
) -> int:
    """A second operand for ``v``: an existing value or a new input whose shape
    broadcasts with ``v``'s (``into``: to ``v``'s shape, for in-place ops); of ``v``'s
    dtype mostly, else of ``dtype`` or a random one. Rarely any value at all (an eager
    error, kept now and then)."""
    rng = g.rng
    shape = g.shape(v)
    want = dtype or (g.dtype(v) if rng.random() < 0.75 else g.random_dtype())
    if rng.random() < 0.03:
        u = g.pick()
        if u is not None:
            return u
    if rng.random() < 0.55:
        u = g.pick(
            lambda c: (
                _broadcasts(shape, g.shape(c), into)
                and (not exact or g.exact(c))
                and (g.dtype(c) == want or rng.random() < 0.2)
            )
        )
        if u is not None:
            return u
    return g.new_input(_broadcast_shape_for(g, shape, into), want)


# How often an index input of an op with a value check may hold an index out of range
# (``TensorInput.bad``; then on 60% of the calls' values).
P_BAD_INDEX = 0.12


def _index_input(g: GenState, high: int, shape: tuple[int, ...], kind: str = INDEX) -> int:
    bad = g.rng.random() < P_BAD_INDEX
    return g.new_input(shape, "int64", kind=kind, high=high, bad=bad)


def _float_dtype(g: GenState) -> str:
    """A floating dtype, float32 mostly."""
    return g.rng.choices(FLOAT_DTYPES, [0.6, 0.15, 0.15, 0.1])[0]


def _small_shape(g: GenState, ndim: int | None = None) -> tuple[int, ...]:
    n = g.rng.choice([0, 1, 1, 2]) if ndim is None else ndim
    return tuple(g.rng.choice([1, 2, 3, 4]) for _ in range(n))


# ---------------------------------------------------------------------------------
# Elementwise: unary, with a scalar, binary, ternary
# ---------------------------------------------------------------------------------


def _unary_gen(exact: bool, p_float: float = 0.8) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = _float_or_any(g, p_float, exact=exact)
        return None if v is None else ([v], {})

    return gen


def _fn_render(fn: str, extra: str = "") -> Render:
    return lambda a, p: f"{fn}({a[0]}{extra})"


for _fn in ("torch.neg", "torch.abs", "torch.relu", "torch.square", "torch.clone"):
    _add(_fn, _fn_render(_fn), _unary_gen(False, 0.6), 0.5, "exact")
_add("Tensor.contiguous", lambda a, p: f"{a[0]}.contiguous()", _unary_gen(False), 0.5, "exact")
_add("torch.reciprocal", _fn_render("torch.reciprocal"), _unary_gen(False), 0.3, "exact nonfinite")
_add("torch.nan_to_num", _fn_render("torch.nan_to_num"), _unary_gen(False), 0.3, "exact")
_add("F.hardtanh", _fn_render("F.hardtanh"), _unary_gen(False), 0.3, "exact")
for _fn in (
    "torch.floor torch.ceil torch.round torch.trunc torch.sign torch.frac torch.isnan "
    "torch.isinf torch.isfinite torch.logical_not torch.bitwise_not"
).split():
    _add(_fn, _fn_render(_fn), _unary_gen(True, 0.6), 0.3, "exact disc")
_add("torch.signbit", _fn_render("torch.signbit"), _unary_gen(True, 0.6), 0.3, "exact disc signed")
for _fn in (
    "torch.exp torch.exp2 torch.expm1 torch.log torch.log2 torch.log1p torch.sqrt "
    "torch.rsqrt torch.tan torch.sinh torch.cosh torch.atanh torch.acosh torch.lgamma "
    "torch.digamma torch.erfinv torch.asin torch.acos"
).split():
    _add(_fn, _fn_render(_fn), _unary_gen(False), 0.25, "nonfinite")
for _fn in (
    "torch.sin torch.cos torch.tanh torch.sigmoid torch.erf torch.erfc torch.atan "
    "torch.asinh torch.sinc F.silu F.softplus F.elu F.selu F.mish F.logsigmoid "
    "F.hardswish F.hardsigmoid F.gelu"
).split():
    _add(_fn, _fn_render(_fn), _unary_gen(False), 0.25)
_add("F.gelu(tanh)", _fn_render("F.gelu", ", approximate='tanh'"), _unary_gen(False), 0.3)


def _scalar_render(fn: str, extra: str = "") -> Render:
    return lambda a, p: f"{fn}({a[0]}, {p['s']!r}{extra})"


def _scalar_gen(exact: bool = False, nonzero: bool = False) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = _float_or_any(g, 0.6, exact=exact)
        if v is None:
            return None
        s = _scalar(g, v)
        if nonzero and s == 0 and g.rng.random() < 0.8:
            s = 2
        return [v], {"s": s}

    return gen


def _alpha_scalar_gen(g: GenState) -> Proposal:
    proposal = _scalar_gen()(g)
    if proposal is not None and g.rng.random() < 0.3:
        proposal[1]["alpha"] = g.rng.choice([2, -1, 0.5])
    return proposal


_add(
    "torch.add(scalar)",
    lambda a, p: f"torch.add({a[0]}, {p['s']!r}{_kw(p, 'alpha')})",
    _alpha_scalar_gen,
    0.6,
    "exact",
)
_add(
    "torch.sub(scalar)", lambda a, p: f"torch.sub({a[0]}, {p['s']!r})", _scalar_gen(), 0.4, "exact"
)
_add(
    "torch.rsub(scalar)",
    lambda a, p: f"torch.rsub({a[0]}, {p['s']!r})",
    _scalar_gen(),
    0.3,
    "exact",
)
_add(
    "torch.mul(scalar)", lambda a, p: f"torch.mul({a[0]}, {p['s']!r})", _scalar_gen(), 0.6, "exact"
)
_add(
    "torch.div(scalar)",
    lambda a, p: f"torch.div({a[0]}, {p['s']!r})",
    _scalar_gen(nonzero=True),
    0.5,
    "exact nonfinite",
)
for _mode in ("floor", "trunc"):
    _add(
        f"torch.div(scalar,{_mode})",
        _scalar_render("torch.div", f", rounding_mode={_mode!r}"),
        _scalar_gen(True, nonzero=True),
        0.3,
        "exact disc",
    )
for _fn in ("torch.remainder", "torch.fmod"):
    _add(
        f"{_fn}(scalar)",
        _scalar_render(_fn),
        _scalar_gen(True, nonzero=True),
        0.3,
        "exact disc",
    )
for _fn in ("torch.gt", "torch.le", "torch.eq", "torch.ne"):
    _add(
        f"{_fn}(scalar)",
        _scalar_render(_fn),
        _scalar_gen(True),
        0.3,
        "exact disc",
    )


def _pow_gen(g: GenState) -> Proposal:
    v = _float_or_any(g, 0.85)
    return None if v is None else ([v], {"e": g.rng.choice([2, 3, 0.5, -1, -2, 1.5])})


_add("torch.pow(scalar)", lambda a, p: f"torch.pow({a[0]}, {p['e']!r})", _pow_gen, 0.4, "nonfinite")


def _clamp_gen(g: GenState) -> Proposal:
    v = _float_or_any(g, 0.7)
    if v is None:
        return None
    lo, hi = sorted(g.rng.sample([-2, -1, -0.5, 0, 0.5, 1, 2], 2))
    r = g.rng.random()
    params: Params = {"min": lo, "max": hi} if r < 0.5 else {"min": lo} if r < 0.75 else {"max": hi}
    if not g.is_float(v):
        params = {k: int(x) for k, x in params.items()}
    return [v], params


_add(
    "torch.clamp",
    lambda a, p: f"torch.clamp({a[0]}{_kw(p, 'min', 'max')})",
    _clamp_gen,
    0.5,
    "exact",
)


def _leaky_gen(g: GenState) -> Proposal:
    v = _float_or_any(g, 1.0)
    return None if v is None else ([v], {"slope": g.rng.choice([0.01, 0.2, 2.0])})


_add("F.leaky_relu", lambda a, p: f"F.leaky_relu({a[0]}, {p['slope']!r})", _leaky_gen, 0.3)


def _binary_gen(exact: bool = False, p_float: float = 0.7, alpha: bool = False) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = _float_or_any(g, p_float, exact=exact)
        if v is None:
            return None
        u = partner(g, v, exact=exact)
        if g.rng.random() < 0.5:
            v, u = u, v
        params: Params = {}
        if alpha and g.rng.random() < 0.3:
            params["alpha"] = g.rng.choice([2, -1, 0.5])
        return [v, u], params

    return gen


def _binary(fn: str, weight: float, mode: str | None = None, flags: str = "") -> None:
    extra = f", rounding_mode={mode!r}" if mode else ""
    kind_name = f"{fn}({mode})" if mode else fn
    alpha = fn in ("torch.add", "torch.sub")
    _add(
        kind_name,
        lambda a, p: f"{fn}({a[0]}, {a[1]}{extra}{_kw(p, 'alpha')})",
        _binary_gen("disc" in flags, alpha=alpha),
        weight,
        flags,
    )


for _fn in ("torch.add", "torch.sub", "torch.mul"):
    _binary(_fn, 1.0, flags="exact")
_binary("torch.div", 0.7, flags="exact nonfinite")
_binary("torch.div", 0.3, "floor", "exact disc nonfinite")
_binary("torch.div", 0.3, "trunc", "exact disc nonfinite")
for _fn in ("torch.maximum", "torch.minimum", "torch.fmax", "torch.fmin"):
    _binary(_fn, 0.3, flags="exact")
_binary("torch.copysign", 0.3, flags="exact signed")
for _fn in ("torch.pow", "torch.atan2", "torch.hypot", "torch.xlogy", "torch.logaddexp"):
    _binary(_fn, 0.25, flags="nonfinite")
for _fn in ("torch.remainder", "torch.fmod"):
    _binary(_fn, 0.25, flags="exact disc nonfinite")
for _fn in ("torch.eq", "torch.ne", "torch.lt", "torch.le", "torch.gt", "torch.ge"):
    _binary(_fn, 0.25, flags="exact disc")
for _fn in ("torch.logical_and", "torch.logical_or", "torch.logical_xor"):
    _binary(_fn, 0.2, flags="exact disc")
for _fn in ("torch.bitwise_and", "torch.bitwise_or", "torch.bitwise_xor"):
    _binary(_fn, 0.2, flags="exact disc")


def _where_gen(g: GenState) -> Proposal:
    a = _float_or_any(g, 0.7)
    if a is None:
        return None
    shape = g.shape(a)
    c = g.pick(lambda u: g.dtype(u) == "bool" and _broadcasts(shape, g.shape(u), False))
    if c is None or g.rng.random() < 0.3:
        c = g.new_input(_broadcast_shape_for(g, shape, False), "bool")
    if g.rng.random() < 0.3:
        return [c, a], {"s": _scalar(g, a)}
    return [c, a, partner(g, a)], {}


_add(
    "torch.where",
    lambda a, p: f"torch.where({a[0]}, {a[1]}, {a[2] if len(a) > 2 else repr(p['s'])})",
    _where_gen,
    0.8,
    "exact",
)


def _masked_fill_gen(g: GenState) -> Proposal:
    a = _float_or_any(g, 0.7)
    if a is None:
        return None
    shape = g.shape(a)
    m = g.pick(lambda u: g.dtype(u) == "bool" and _broadcasts(shape, g.shape(u), True))
    if m is None or g.rng.random() < 0.3:
        m = g.new_input(_broadcast_shape_for(g, shape, True), "bool")
    return [a, m], {"s": _scalar(g, a)}


_add(
    "torch.masked_fill",
    lambda a, p: f"torch.masked_fill({a[0]}, {a[1]}, {p['s']!r})",
    _masked_fill_gen,
    0.5,
    "exact",
)


def _ternary_gen(g: GenState) -> Proposal:
    a = _float_or_any(g, 0.9)
    if a is None:
        return None
    return [a, partner(g, a), partner(g, a)], {"value": g.rng.choice([1, 0.5, -2])}


_add(
    "torch.addcmul",
    lambda a, p: f"torch.addcmul({a[0]}, {a[1]}, {a[2]}, value={p['value']!r})",
    _ternary_gen,
    0.3,
)
_add(
    "torch.addcdiv",
    lambda a, p: f"torch.addcdiv({a[0]}, {a[1]}, {a[2]}, value={p['value']!r})",
    _ternary_gen,
    0.3,
    "nonfinite",
)


def _lerp_gen(g: GenState) -> Proposal:
    a = _float_or_any(g, 0.95)
    if a is None:
        return None
    return [a, partner(g, a)], {"w": g.rng.choice([0.25, 0.5, 0.75, 1.5])}


_add("torch.lerp", lambda a, p: f"torch.lerp({a[0]}, {a[1]}, {p['w']!r})", _lerp_gen, 0.3)


def _to_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    target = g.random_dtype()
    if g.is_float(v) and target not in FLOAT_DTYPES and not (g.exact(v) and g.finite(v)):
        return None  # the integer part or the truth of an inexact float is not defined
    return [v], {"dtype": target}


_add("Tensor.to", lambda a, p: f"{a[0]}.to({_lit(p['dtype'])})", _to_gen, 1.5, "exact")

# ---------------------------------------------------------------------------------
# Reductions and scans
# ---------------------------------------------------------------------------------


def _reduction_gen(
    mode: str,
    extra: Callable[[GenState, int], Params] | None = None,
    exact: bool = False,
    p_float: float = 0.75,
) -> Gen:
    """``mode``: ``dims`` (None, an int or a tuple), ``dim`` (an int), ``dim?`` (an int
    or None)."""

    def gen(g: GenState) -> Proposal:
        v = _float_or_any(g, p_float, exact=exact)
        if v is None:
            return None
        params: Params = {}
        if mode == "dims":
            params["dim"] = _dims(g, v)
        elif mode == "dim" or g.rng.random() < 0.75:
            params["dim"] = _dim(g, v)
        if "dim" in params and params["dim"] is None:
            del params["dim"]
        elif "dim" in params and g.rng.random() < 0.5:
            params["keepdim"] = True
        if extra is not None:
            params.update(extra(g, v))
        return [v], params

    return gen


def _reduction(
    fn: str,
    mode: str,
    weight: float,
    suffix: str = "",
    keep: bool = True,
    extra: Callable[[GenState, int], Params] | None = None,
    flags: str = "",
) -> None:
    names = ("dim", "keepdim", "correction", "ord", "dtype") if keep else ("dim",)

    def rend(a: list[str], p: Params) -> str:
        return f"{fn}({a[0]}{_kw(p, *names)}){suffix}"

    gen = _reduction_gen(mode, extra, exact="disc" in flags)
    if not keep:
        base = gen

        def gen(g: GenState) -> Proposal:
            proposal = base(g)
            if proposal is not None:
                proposal[1].pop("keepdim", None)
            return proposal

    _add(fn + suffix, rend, gen, weight, flags)


def _sum_dtype(g: GenState, v: int) -> Params:
    return {"dtype": g.rng.choice(["float64", "float32", "int64"])} if g.rng.random() < 0.1 else {}


_reduction("torch.sum", "dims", 1.0, extra=_sum_dtype)
_reduction("torch.mean", "dims", 0.7)
_reduction("torch.nansum", "dims", 0.2)
_reduction("torch.prod", "dim?", 0.3)
_reduction("torch.amax", "dims", 0.4, flags="exact")
_reduction("torch.amin", "dims", 0.3, flags="exact")
_reduction("torch.max", "dim", 0.3, ".values", flags="exact")
_reduction("torch.min", "dim", 0.3, ".values", flags="exact")
_reduction("torch.max", "dim", 0.2, ".indices", flags="exact disc")
_reduction("torch.argmax", "dim?", 0.3, flags="exact disc")
_reduction("torch.argmin", "dim?", 0.2, flags="exact disc")
_reduction("torch.any", "dim?", 0.2, flags="exact disc")
_reduction("torch.all", "dim?", 0.2, flags="exact disc")
_reduction("torch.count_nonzero", "dims", 0.2, keep=False, flags="exact disc")
_reduction("torch.median", "dim", 0.2, ".values", flags="exact")
_reduction("torch.std", "dims", 0.3, extra=lambda g, v: {"correction": g.rng.choice([0, 1])})
_reduction("torch.var", "dims", 0.3, extra=lambda g, v: {"correction": g.rng.choice([0, 1, 2])})
_reduction("torch.logsumexp", "dim", 0.3)
_reduction(
    "torch.linalg.vector_norm",
    "dims",
    0.3,
    extra=lambda g, v: {"ord": g.rng.choice([2, 1, float("inf"), 3])},
)
_reduction("torch.cumsum", "dim", 0.5, keep=False)
_reduction("torch.cumprod", "dim", 0.2, keep=False)
_reduction("torch.logcumsumexp", "dim", 0.2, keep=False)
_reduction("torch.cummax", "dim", 0.2, ".values", keep=False, flags="exact")
_reduction("torch.softmax", "dim", 0.6, keep=False)
_reduction("torch.log_softmax", "dim", 0.4, keep=False)
_reduction("torch.diff", "dim", 0.2, keep=False, flags="exact")


def _softmax_dtype_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.dtype(u) in ("float16", "bfloat16"))
    return None if v is None else ([v], {"dim": _dim(g, v), "dtype": "float32"})


_add(
    "torch.softmax(dtype)",
    lambda a, p: f"torch.softmax({a[0]}, {p['dim']}, dtype={_lit(p['dtype'])})",
    _softmax_dtype_gen,
    0.2,
)


def _sort_render(suffix: str) -> Render:
    return lambda a, p: (
        f"torch.sort({a[0]}, dim={p['dim']}, descending={p['descending']}, stable=True){suffix}"
    )


def _sort_gen(g: GenState) -> Proposal:
    v = _float_or_any(g, 0.7, exact=True)
    if v is None:
        return None
    return [v], {"dim": _dim(g, v), "descending": g.rng.random() < 0.5}


for _suffix in (".values", ".indices"):
    _add(
        f"torch.sort{_suffix}",
        _sort_render(_suffix),
        _sort_gen,
        0.2,
        "exact disc",
    )
_add(
    "torch.argsort",
    lambda a, p: (
        f"torch.argsort({a[0]}, dim={p['dim']}, descending={p['descending']}, stable=True)"
    ),
    _sort_gen,
    0.2,
    "exact disc",
)

# ---------------------------------------------------------------------------------
# Products
# ---------------------------------------------------------------------------------


def _matmul_gen(g: GenState) -> Proposal:
    a = _float_or_any(g, 0.85)
    if a is None or g.ndim(a) == 0:
        return None
    k = g.shape(a)[-1]
    n = g.rng.choice([1, 2, 3, 5])
    form = g.rng.random()
    if form < 0.25:
        shape: tuple[int, ...] = (k,)
    elif form < 0.8 or g.ndim(a) < 2:
        shape = (k, n)
    else:
        shape = (*g.shape(a)[:-2][-1:], k, n)
    b = g.new_input(shape, g.dtype(a))
    return ([a, b] if g.rng.random() < 0.85 else [b, a]), {}


_add("torch.matmul", lambda a, p: f"torch.matmul({a[0]}, {a[1]})", _matmul_gen, 1.0)


def _mm_gen(batched: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        a = g.pick(lambda u: g.ndim(u) == (3 if batched else 2))
        if a is None:
            return None
        shape = g.shape(a)
        n = g.rng.choice([1, 2, 4])
        b = g.new_input((*shape[:-2], shape[-1], n), g.dtype(a))
        return [a, b], {}

    return gen


_add("torch.mm", lambda a, p: f"torch.mm({a[0]}, {a[1]})", _mm_gen(False), 0.4)
_add("torch.bmm", lambda a, p: f"torch.bmm({a[0]}, {a[1]})", _mm_gen(True), 0.3)


def _linear_gen(g: GenState) -> Proposal:
    a = _float_or_any(g, 0.95)
    if a is None or g.ndim(a) == 0:
        return None
    k, n = g.shape(a)[-1], g.rng.choice([1, 3, 4])
    args = [a, g.new_input((n, k), g.dtype(a))]
    if g.rng.random() < 0.6:
        args.append(g.new_input((n,), g.dtype(a)))
    return args, {}


_add("F.linear", lambda a, p: f"F.linear({', '.join(a)})", _linear_gen, 0.8)


def _addmm_gen(g: GenState) -> Proposal:
    a = g.pick(lambda u: g.ndim(u) == 2)
    if a is None:
        return None
    m, k = g.shape(a)
    n = g.rng.choice([1, 2, 3])
    bias = g.new_input(g.rng.choice([(n,), (m, n), (1, n)]), g.dtype(a))
    params = {"beta": g.rng.choice([1, 0.5]), "alpha": g.rng.choice([1, 2])}
    return [bias, a, g.new_input((k, n), g.dtype(a))], params


_add(
    "torch.addmm",
    lambda a, p: f"torch.addmm({a[0]}, {a[1]}, {a[2]}, beta={p['beta']!r}, alpha={p['alpha']!r})",
    _addmm_gen,
    0.3,
)


def _outer_gen(g: GenState) -> Proposal:
    a = g.pick(lambda u: g.ndim(u) == 1)
    if a is None:
        return None
    return [a, g.new_input((g.rng.choice([1, 2, 3]),), g.dtype(a))], {}


_add("torch.outer", lambda a, p: f"torch.outer({a[0]}, {a[1]})", _outer_gen, 0.2)

# ---------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else [1]


def _new_shape(g: GenState, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape with as many elements as ``shape`` (a flatten, a merge, a split, a new
    1, one size as -1)."""
    rng, dims = g.rng, list(shape)
    r = rng.random()
    if r < 0.15 or not dims:
        return (-1,) if r < 0.1 or not dims else (*dims, 1)
    i = rng.randrange(len(dims))
    if r < 0.4 and len(dims) >= 2:
        i = min(i, len(dims) - 2)
        return (*dims[:i], dims[i] * dims[i + 1], *dims[i + 2 :])
    if r < 0.75:
        f = rng.choice(_divisors(dims[i]))
        return (*dims[:i], f, dims[i] // f if f else 0, *dims[i + 1 :])
    if r < 0.85:
        return (*dims[:i], 1, *dims[i:])
    dims[i] = -1
    return tuple(dims)


def _view_gen(g: GenState) -> Proposal:
    v = g.pick()
    return None if v is None else ([v], {"shape": _new_shape(g, g.shape(v))})


_add("Tensor.view", lambda a, p: f"{a[0]}.view({p['shape']!r})", _view_gen, 0.8, "exact view")
_add("Tensor.reshape", lambda a, p: f"{a[0]}.reshape({p['shape']!r})", _view_gen, 0.8, "exact view")


def _permute_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 2)
    if v is None:
        return None
    perm = list(range(g.ndim(v)))
    g.rng.shuffle(perm)
    return [v], {"dims": tuple(perm)}


_add(
    "Tensor.permute", lambda a, p: f"{a[0]}.permute({p['dims']!r})", _permute_gen, 0.6, "exact view"
)


def _transpose_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    return [v], {"d0": _dim(g, v), "d1": _dim(g, v)}


_add(
    "torch.transpose",
    lambda a, p: f"torch.transpose({a[0]}, {p['d0']}, {p['d1']})",
    _transpose_gen,
    0.6,
    "exact view",
)
_add("Tensor.t", lambda a, p: f"{a[0]}.t()", lambda g: _pick_ndim(g, 0, 2), 0.3, "exact view")
_add("Tensor.mT", lambda a, p: f"{a[0]}.mT", lambda g: _pick_ndim(g, 2, 9), 0.3, "exact view")


def _pick_ndim(g: GenState, low: int, high: int) -> Proposal:
    v = g.pick(lambda u: low <= g.ndim(u) <= high)
    return None if v is None else ([v], {})


def _narrow_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    size = g.shape(v)[d]
    start = g.rng.randint(0, size)
    return [v], {"dim": d, "start": start, "length": g.rng.randint(0, size - start)}


_add(
    "torch.narrow",
    lambda a, p: f"torch.narrow({a[0]}, {p['dim']}, {p['start']}, {p['length']})",
    _narrow_gen,
    0.5,
    "exact view",
)


def _index_item(g: GenState, size: int) -> str:
    rng = g.rng
    r = rng.random()
    if r < 0.15 and size > 0:
        return str(rng.randrange(-size, size))
    if r < 0.22:
        return "None"
    start = rng.choice(["", "", str(rng.randint(-size - 1, size + 1))])
    stop = rng.choice(["", str(rng.randint(-size - 1, size + 1))])
    step = rng.choice(["", "", ":2", ":3"])
    return f"{start}:{stop}{step}"


def _slice_index(g: GenState, shape: tuple[int, ...]) -> str:
    """A basic index of a tensor of ``shape``: slices, ints, None and maybe ``...``."""
    k = g.rng.randint(1, len(shape))
    items = [_index_item(g, shape[i]) for i in range(k)]
    if g.rng.random() < 0.2:
        items = ["...", *items[-1:]]
    return ", ".join(items)


def _slice_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    return None if v is None else ([v], {"index": _slice_index(g, g.shape(v))})


_add(
    "Tensor.__getitem__(slices)",
    lambda a, p: f"{a[0]}[{p['index']}]",
    _slice_gen,
    1.0,
    "exact view",
)


def _select_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    size = max(g.shape(v)[d], 1)
    return [v], {"dim": d, "index": g.rng.randrange(-size, size)}


_add(
    "torch.select",
    lambda a, p: f"torch.select({a[0]}, {p['dim']}, {p['index']})",
    _select_gen,
    0.4,
    "exact view",
)


def _unsqueeze_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    n = g.ndim(v) + 1
    return [v], {"dim": g.rng.randrange(-n, n)}


_add(
    "torch.unsqueeze",
    lambda a, p: f"torch.unsqueeze({a[0]}, {p['dim']})",
    _unsqueeze_gen,
    0.5,
    "exact view",
)


def _squeeze_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    ones = [i for i, s in enumerate(g.shape(v)) if s == 1]
    if g.rng.random() < 0.3:
        return [v], {}
    return [v], {"dim": g.rng.choice(ones) if ones and g.rng.random() < 0.7 else _dim(g, v)}


_add(
    "torch.squeeze",
    lambda a, p: f"torch.squeeze({a[0]}{_kw(p, 'dim')})",
    _squeeze_gen,
    0.4,
    "exact view",
)


def _expand_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    sizes = [g.rng.choice([2, 3]) if s == 1 and g.rng.random() < 0.6 else -1 for s in g.shape(v)]
    if not sizes or g.rng.random() < 0.3:
        sizes = [g.rng.choice([1, 2, 3]), *sizes]
    return [v], {"sizes": tuple(sizes)}


_add("Tensor.expand", lambda a, p: f"{a[0]}.expand({p['sizes']!r})", _expand_gen, 0.5, "exact view")


def _flatten_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    n = max(g.ndim(v), 1)
    start = g.rng.randrange(n)
    return [v], {"start": start, "end": g.rng.randrange(start, n)}


_add(
    "torch.flatten",
    lambda a, p: f"torch.flatten({a[0]}, {p['start']}, {p['end']})",
    _flatten_gen,
    0.4,
    "exact view",
)


def _unflatten_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    f = g.rng.choice(_divisors(g.shape(v)[d]))
    return [v], {"dim": d, "sizes": (f, -1)}


_add(
    "torch.unflatten",
    lambda a, p: f"torch.unflatten({a[0]}, {p['dim']}, {p['sizes']!r})",
    _unflatten_gen,
    0.3,
    "exact view",
)


def _movedim_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 2)
    return None if v is None else ([v], {"src": _dim(g, v), "dst": _dim(g, v)})


_add(
    "torch.movedim",
    lambda a, p: f"torch.movedim({a[0]}, {p['src']}, {p['dst']})",
    _movedim_gen,
    0.3,
    "exact view",
)


def _diagonal_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 2)
    if v is None:
        return None
    d1 = _dim(g, v)
    d2 = g.rng.choice([d for d in range(g.ndim(v)) if d % g.ndim(v) != d1 % g.ndim(v)])
    return [v], {"offset": g.rng.choice([0, 0, 1, -1, 2]), "d1": d1, "d2": d2}


_add(
    "torch.diagonal",
    lambda a, p: f"torch.diagonal({a[0]}, {p['offset']}, {p['d1']}, {p['d2']})",
    _diagonal_gen,
    0.3,
    "exact view",
)


def _unfold_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    size = g.rng.randint(1, max(g.shape(v)[d], 1))
    return [v], {"dim": d, "size": size, "step": g.rng.choice([1, 1, 2])}


_add(
    "Tensor.unfold",
    lambda a, p: f"{a[0]}.unfold({p['dim']}, {p['size']}, {p['step']})",
    _unfold_gen,
    0.3,
    "exact view",
)


def _chunk_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d, n = _dim(g, v), g.rng.choice([2, 3])
    count = len(torch.chunk(g.tensor(v), n, d))
    if count == 0:
        return None
    return [v], {"chunks": n, "dim": d, "k": g.rng.randrange(count)}


_add(
    "torch.chunk",
    lambda a, p: f"torch.chunk({a[0]}, {p['chunks']}, {p['dim']})[{p['k']}]",
    _chunk_gen,
    0.3,
    "exact view",
)


def _split_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d, n = _dim(g, v), g.rng.choice([1, 2, 3])
    count = len(torch.split(g.tensor(v), n, d))
    if count == 0:
        return None
    return [v], {"size": n, "dim": d, "k": g.rng.randrange(-count, count)}


_add(
    "torch.split",
    lambda a, p: f"torch.split({a[0]}, {p['size']}, {p['dim']})[{p['k']}]",
    _split_gen,
    0.3,
    "exact view",
)


def _unbind_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1 and 0 not in g.shape(u))
    if v is None:
        return None
    d = _dim(g, v)
    return [v], {"dim": d, "k": g.rng.randrange(g.shape(v)[d])}


_add(
    "torch.unbind",
    lambda a, p: f"torch.unbind({a[0]}, {p['dim']})[{p['k']}]",
    _unbind_gen,
    0.2,
    "exact view",
)


def _bitcast_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.dtype(u) in ("float32", "float64") and g.exact(u))
    if v is None:
        return None
    return [v], {"dtype": {"float32": "int32", "float64": "int64"}[g.dtype(v)]}


_add(
    "Tensor.view(dtype)",
    lambda a, p: f"{a[0]}.view({_lit(p['dtype'])})",
    _bitcast_gen,
    0.1,
    "exact disc view",
)


def _as_strided_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.tensor(u).numel() > 0)
    if v is None:
        return None
    t = g.tensor(v)
    room = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    size = _small_shape(g, g.rng.choice([1, 2]))
    stride = tuple(g.rng.choice([0, 1, 2, 3]) for _ in size)
    if sum((s - 1) * st for s, st in zip(size, stride, strict=True)) >= room:
        return None
    return [v], {"size": size, "stride": stride}


_add(
    "torch.as_strided",
    lambda a, p: f"torch.as_strided({a[0]}, {p['size']!r}, {p['stride']!r})",
    _as_strided_gen,
    0.2,
    "exact view",
)

# ---------------------------------------------------------------------------------
# Indexing with tensors, cat and stack, copies that reorder
# ---------------------------------------------------------------------------------


def _advanced_index_gen(form: str) -> Gen:
    def gen(g: GenState) -> Proposal:
        need = 2 if form in ("dim1", "pair") else 1
        v = g.pick(lambda u: g.ndim(u) >= need and 0 not in g.shape(u)[:need])
        if v is None:
            return None
        shape = _small_shape(g)
        if form == "pair":
            i = _index_input(g, g.shape(v)[0], shape, SIGNED_INDEX)
            j = _index_input(g, g.shape(v)[1], shape, SIGNED_INDEX)
            return [v, i, j], {}
        dim = 1 if form == "dim1" else 0
        return [v, _index_input(g, g.shape(v)[dim], shape, SIGNED_INDEX)], {}

    return gen


_add(
    "Tensor.__getitem__(tensor)",
    lambda a, p: f"{a[0]}[{a[1]}]",
    _advanced_index_gen("dim0"),
    0.5,
    "exact",
)
_add(
    "Tensor.__getitem__(:,tensor)",
    lambda a, p: f"{a[0]}[:, {a[1]}]",
    _advanced_index_gen("dim1"),
    0.3,
    "exact",
)
_add(
    "Tensor.__getitem__(tensor,tensor)",
    lambda a, p: f"{a[0]}[{a[1]}, {a[2]}]",
    _advanced_index_gen("pair"),
    0.2,
    "exact",
)


def _mask_index_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    k = g.rng.randint(1, g.ndim(v))
    return [v, g.new_input(g.shape(v)[:k], "bool")], {}


_add("Tensor.__getitem__(mask)", lambda a, p: f"{a[0]}[{a[1]}]", _mask_index_gen, 0.15, "exact")


def _index_select_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    idx = _index_input(g, g.shape(v)[d], (g.rng.choice([0, 1, 2, 3, 5]),))
    return [v, idx], {"dim": d}


_add(
    "torch.index_select",
    lambda a, p: f"torch.index_select({a[0]}, {p['dim']}, {a[1]})",
    _index_select_gen,
    0.4,
    "exact",
)


def _gather_shape(g: GenState, shape: tuple[int, ...], d: int) -> tuple[int, ...]:
    return tuple(
        g.rng.choice([1, 2, 3]) if i == d % len(shape) else g.rng.randint(min(s, 1), s)
        for i, s in enumerate(shape)
    )


def _gather_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    idx = _index_input(g, g.shape(v)[d], _gather_shape(g, g.shape(v), d))
    return [v, idx], {"dim": d}


_add(
    "torch.gather",
    lambda a, p: f"torch.gather({a[0]}, {p['dim']}, {a[1]})",
    _gather_gen,
    0.4,
    "exact",
)


def _scatter_gen(unique: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = g.pick(lambda u: g.ndim(u) >= 1)
        if v is None:
            return None
        shape = g.shape(v)
        if unique:  # distinct along the last dim, the dim scattered into
            d = len(shape) - 1
            k = g.rng.randint(0, shape[d])
            index_shape = (*(g.rng.randint(min(s, 1), s) for s in shape[:-1]), k)
            idx = _index_input(g, shape[d], index_shape, UNIQUE)
        else:
            d = _dim(g, v) % len(shape)
            index_shape = _gather_shape(g, shape, d)
            idx = _index_input(g, shape[d], index_shape)
        src = g.new_input(index_shape, g.dtype(v))
        return [v, idx, src], {"dim": d}

    return gen


_add(
    "torch.scatter",
    lambda a, p: f"torch.scatter({a[0]}, {p['dim']}, {a[1]}, {a[2]})",
    _scatter_gen(True),
    0.3,
    "exact",
)
_add(
    "torch.scatter_add",
    lambda a, p: f"torch.scatter_add({a[0]}, {p['dim']}, {a[1]}, {a[2]})",
    _scatter_gen(False),
    0.3,
)


def _scatter_reduce_gen(g: GenState) -> Proposal:
    proposal = _scatter_gen(False)(g)
    if proposal is not None:
        proposal[1]["reduce"] = g.rng.choice(["sum", "prod", "mean", "amax", "amin"])
        proposal[1]["include_self"] = g.rng.random() < 0.5
    return proposal


_add(
    "torch.scatter_reduce",
    lambda a, p: (
        f"torch.scatter_reduce({a[0]}, {p['dim']}, {a[1]}, {a[2]}, "
        f"{p['reduce']!r}, include_self={p['include_self']})"
    ),
    _scatter_reduce_gen,
    0.3,
)


def _index_add_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    shape = g.shape(v)
    d = _dim(g, v) % len(shape)
    n = g.rng.choice([1, 2, 4])
    idx = _index_input(g, shape[d], (n,))
    src = g.new_input(tuple(n if i == d else s for i, s in enumerate(shape)), g.dtype(v))
    return [v, idx, src], {"dim": d, "alpha": g.rng.choice([1, 1, 2])}


_add(
    "torch.index_add",
    lambda a, p: f"torch.index_add({a[0]}, {p['dim']}, {a[1]}, {a[2]}, alpha={p['alpha']})",
    _index_add_gen,
    0.3,
)


def _index_fill_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    d = _dim(g, v)
    idx = _index_input(g, g.shape(v)[d], (g.rng.choice([1, 2, 3]),))
    return [v, idx], {"dim": d, "s": _scalar(g, v)}


_add(
    "torch.index_fill",
    lambda a, p: f"torch.index_fill({a[0]}, {p['dim']}, {a[1]}, {p['s']!r})",
    _index_fill_gen,
    0.2,
    "exact",
)


def _index_put_gen(accumulate: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = g.pick(lambda u: g.ndim(u) >= 1)
        if v is None:
            return None
        shape = g.shape(v)
        if accumulate:
            idx = _index_input(g, shape[0], (g.rng.choice([1, 2, 4]),))
        else:
            idx = _index_input(g, shape[0], (g.rng.randint(0, shape[0]),), UNIQUE)
        rows = g.shape(idx)[0]
        values = g.new_input(_broadcast_shape_for(g, (rows, *shape[1:]), True), g.dtype(v))
        return [v, idx, values], {"accumulate": accumulate}

    return gen


_add(
    "torch.index_put",
    lambda a, p: f"torch.index_put({a[0]}, ({a[1]},), {a[2]}, accumulate={p['accumulate']})",
    _index_put_gen(False),
    0.3,
    "exact",
)
_add(
    "torch.index_put(accumulate)",
    lambda a, p: f"torch.index_put({a[0]}, ({a[1]},), {a[2]}, accumulate={p['accumulate']})",
    _index_put_gen(True),
    0.2,
)


def _embedding_gen(g: GenState) -> Proposal:
    w = g.pick(lambda u: g.ndim(u) == 2 and g.shape(u)[0] > 0 and g.is_float(u))
    if w is None:
        return None
    return [_index_input(g, g.shape(w)[0], _small_shape(g)), w], {}


_add("F.embedding", lambda a, p: f"F.embedding({a[0]}, {a[1]})", _embedding_gen, 0.3, "exact")


def _one_hot_gen(g: GenState) -> Proposal:
    n = g.rng.choice([1, 3, 5])
    return [_index_input(g, n, _small_shape(g))], {"n": n}


_add("F.one_hot", lambda a, p: f"F.one_hot({a[0]}, {p['n']})", _one_hot_gen, 0.1, "exact")


def _cat_gen(stack: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = g.pick()
        if v is None:
            return None
        shape = g.shape(v)
        if stack:
            d = g.rng.randrange(-len(shape) - 1, len(shape) + 1)
        else:
            if not shape:
                return None
            d = _dim(g, v)

        def fits(u: int) -> bool:
            s = g.shape(u)
            if stack:
                return s == shape
            return len(s) == len(shape) and all(
                a == b for i, (a, b) in enumerate(zip(s, shape, strict=True)) if i != d % len(s)
            )

        others = []
        for _ in range(g.rng.choice([1, 1, 2])):
            u = g.pick(fits)
            others.append(v if u is None else u)
        if not stack and g.rng.random() < 0.3:
            grown = tuple(
                g.rng.choice([0, 1, 2]) if i == d % len(shape) else s for i, s in enumerate(shape)
            )
            others.append(g.new_input(grown, g.dtype(v)))
        return [v, *others], {"dim": d}

    return gen


_add(
    "torch.cat",
    lambda a, p: f"torch.cat([{', '.join(a)}], {p['dim']})",
    _cat_gen(False),
    0.7,
    "exact",
)
_add(
    "torch.stack",
    lambda a, p: f"torch.stack([{', '.join(a)}], {p['dim']})",
    _cat_gen(True),
    0.4,
    "exact",
)


def _flip_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    return [v], {"dims": tuple(g.rng.sample(range(g.ndim(v)), g.rng.randint(1, g.ndim(v))))}


_add("torch.flip", lambda a, p: f"torch.flip({a[0]}, {p['dims']!r})", _flip_gen, 0.3, "exact")


def _roll_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    return [v], {"shifts": g.rng.choice([1, -2, 3]), "dims": _dim(g, v)}


_add(
    "torch.roll",
    lambda a, p: f"torch.roll({a[0]}, {p['shifts']}, {p['dims']})",
    _roll_gen,
    0.3,
    "exact",
)


def _repeat_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    reps = tuple(g.rng.choice([1, 1, 2, 3]) for _ in range(g.ndim(v) + g.rng.choice([0, 0, 1])))
    return [v], {"reps": reps or (2,)}


_add("Tensor.repeat", lambda a, p: f"{a[0]}.repeat({p['reps']!r})", _repeat_gen, 0.3, "exact")


def _tri_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 2)
    return None if v is None else ([v], {"k": g.rng.choice([0, 0, 1, -1, 2])})


_add("torch.tril", lambda a, p: f"torch.tril({a[0]}, {p['k']})", _tri_gen, 0.2, "exact")
_add("torch.triu", lambda a, p: f"torch.triu({a[0]}, {p['k']})", _tri_gen, 0.2, "exact")


def _pad_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    n = g.rng.randint(1, min(g.ndim(v), 2))
    pad = tuple(g.rng.choice([0, 1, 2, -1]) for _ in range(2 * n))
    mode = g.rng.choice(["constant", "constant", "reflect", "replicate", "circular"])
    params: Params = {"pad": pad, "mode": mode}
    if mode == "constant":
        params["value"] = g.rng.choice([0.0, 1.5, -2.0])
    return [v], params


_add(
    "F.pad",
    lambda a, p: f"F.pad({a[0]}, {p['pad']!r}, {p['mode']!r}{_kw(p, 'value')})",
    _pad_gen,
    0.3,
    "exact",
)

# ---------------------------------------------------------------------------------
# Creation (no tensor arguments, or only for the shape)
# ---------------------------------------------------------------------------------


def _like_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    params: Params = {"s": _scalar(g, v)}
    if g.rng.random() < 0.3:
        params["dtype"] = g.random_dtype()
    return [v], params


_add(
    "torch.full_like",
    lambda a, p: f"torch.full_like({a[0]}, {p['s']!r}{_kw(p, 'dtype')})",
    _like_gen,
    0.2,
    "exact",
)
_add(
    "torch.zeros_like",
    lambda a, p: f"torch.zeros_like({a[0]}{_kw(p, 'dtype')})",
    _like_gen,
    0.2,
    "exact",
)


def _arange_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    n = g.shape(v)[-1] if v is not None else g.rng.choice([0, 1, 4])
    return [], {"n": n, "dtype": g.rng.choice(["int64", "float32", "float64", "int32"])}


_add(
    "torch.arange",
    lambda a, p: f"torch.arange({p['n']}, dtype={_lit(p['dtype'])})",
    _arange_gen,
    0.3,
    "exact",
)


def _full_gen(g: GenState) -> Proposal:
    return [], {"shape": _small_shape(g), "s": _scalar(g), "dtype": g.random_dtype()}


_add(
    "torch.full",
    lambda a, p: f"torch.full({p['shape']!r}, {p['s']!r}, dtype={_lit(p['dtype'])})",
    _full_gen,
    0.2,
    "exact",
)

# ---------------------------------------------------------------------------------
# Normalizations, losses, convolution and pooling
# ---------------------------------------------------------------------------------


def _norm_shape(g: GenState, v: int) -> tuple[int, ...]:
    shape = g.shape(v)
    return shape[len(shape) - g.rng.randint(1, min(len(shape), 2)) :]


def _enough_to_normalize(g: GenState, group: int) -> bool:
    """Whether a normalization over groups of ``group`` elements may be generated: in
    gradient programs, not below 4 elements (``_spread``)."""
    return not g.grad or group >= 4


def _spread(t: torch.Tensor, groups: torch.Tensor | None = None) -> bool:
    """Whether every group of ``t`` (rows of ``groups``, a view of ``t`` with one group
    per row; all of ``t`` if None) varies: variance at least 1e-3 on the first call's
    values. A normalization of a (nearly) constant group is ill-conditioned: its output
    and gradient are a cancellation scaled by rsqrt(var + eps) (316 for var 0 and eps
    1e-5), where the rounding of the mean decides the result: batch_norm of six equal
    float32 values gives 0 in eager and 7.5e-5 in dynajax (the float64 result is 0),
    group_norm's gradient over single elements 4e-6 in eager, 1.2e-4 in PyTorch's own
    decomposition and 6e-5 in dynajax where it is 0. Programs stay out of that regime,
    as they stay away from subnormals."""
    rows = (t if groups is None else groups).detach().to(torch.float64)
    if rows.numel() == 0:
        return True
    rows = rows.reshape(rows.shape[0], -1) if groups is not None else rows.reshape(1, -1)
    if rows.shape[1] == 0:
        return True
    return not bool((rows.var(dim=1, correction=0) < 1e-3).any())


def _layer_norm_gen(rms: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = g.pick(lambda u: g.is_float(u) and g.ndim(u) >= 1)
        if v is None:
            return None
        shape = _norm_shape(g, v)
        t = g.tensor(v)
        rows = t.reshape(-1, math.prod(shape)) if t.numel() else None
        if not _enough_to_normalize(g, math.prod(shape)) or (
            rows is not None and not _spread(t, rows) and not rms
        ):
            return None
        args = [v]
        params: Params = {"shape": shape, "eps": g.rng.choice([1e-5, 1e-3])}
        if g.rng.random() < 0.6:
            args.append(g.new_input(shape, g.dtype(v)))
            if not rms and g.rng.random() < 0.7:
                args.append(g.new_input(shape, g.dtype(v)))
        return args, params

    return gen


def _layer_norm_render(fn: str) -> Render:
    def rend(a: list[str], p: Params) -> str:
        extra = "".join(f", {x}" for x in a[1:])
        return f"{fn}({a[0]}, {p['shape']!r}{extra}, eps={p['eps']!r})"

    return rend


_add("F.layer_norm", _layer_norm_render("F.layer_norm"), _layer_norm_gen(False), 0.5)
_add("F.rms_norm", _layer_norm_render("F.rms_norm"), _layer_norm_gen(True), 0.3)


def _group_norm_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) >= 2)
    if v is None:
        return None
    c = g.shape(v)[1]
    groups = g.rng.choice(_divisors(c))
    t = g.tensor(v)
    if not _enough_to_normalize(g, c // groups * math.prod(g.shape(v)[2:])):
        return None
    if t.numel() and not _spread(t, t.reshape(t.shape[0] * groups, -1)):
        return None
    args = [v]
    if g.rng.random() < 0.6:
        args += [g.new_input((c,), g.dtype(v)), g.new_input((c,), g.dtype(v))]
    return args, {"groups": groups}


_add(
    "F.group_norm",
    lambda a, p: f"F.group_norm({a[0]}, {p['groups']}{''.join(', ' + x for x in a[1:])})",
    _group_norm_gen,
    0.2,
)


def _batch_norm_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) >= 2)
    if v is None:
        return None
    c, dtype = g.shape(v)[1], g.dtype(v)
    if not _enough_to_normalize(g, g.shape(v)[0] * math.prod(g.shape(v)[2:])):
        return None
    t = g.tensor(v)
    if t.numel() and not _spread(t, t.transpose(0, 1).reshape(c, -1)):
        return None
    mean = g.new_input((c,), dtype, requires_grad=False)
    var = g.new_input((c,), dtype, kind=PROBABILITY, requires_grad=False)
    args = [v, mean, var]
    if g.rng.random() < 0.5:
        # Contiguous: eager's CPU backward of a 2-D batch norm reads a strided weight
        # as if it were contiguous (torch 2.13; a wrong gradient, not dynajax's).
        args += [g.new_input((c,), dtype, layout=CONTIGUOUS) for _ in range(2)]
    return args, {"training": g.rng.random() < 0.6}


def _batch_norm_render(a: list[str], p: Params) -> str:
    affine = f", {a[3]}, {a[4]}" if len(a) > 3 else ""
    return f"F.batch_norm({a[0]}, {a[1]}, {a[2]}{affine}, training={p['training']})"


_add("F.batch_norm", _batch_norm_render, _batch_norm_gen, 0.3)


def _normalize_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) >= 1)
    return None if v is None else ([v], {"dim": _dim(g, v), "p": g.rng.choice([2.0, 1.0])})


_add(
    "F.normalize",
    lambda a, p: f"F.normalize({a[0]}, p={p['p']!r}, dim={p['dim']})",
    _normalize_gen,
    0.3,
)


def _cross_entropy_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) in (1, 2) and g.shape(u)[-1] > 0)
    if v is None:
        return None
    shape = g.shape(v)
    target = _index_input(g, shape[-1], shape[:-1])
    params = {
        "reduction": g.rng.choice(["mean", "sum", "none"]),
        "label_smoothing": g.rng.choice([0.0, 0.0, 0.1]),
    }
    return [v, target], params


_add(
    "F.cross_entropy",
    lambda a, p: (
        f"F.cross_entropy({a[0]}, {a[1]}, reduction={p['reduction']!r}, "
        f"label_smoothing={p['label_smoothing']!r})"
    ),
    _cross_entropy_gen,
    0.3,
)


def _loss_render(fn: str) -> Render:
    return lambda a, p: f"{fn}({a[0]}, {a[1]}, reduction={p['reduction']!r})"


def _pair_loss_gen(target_kind: str | None) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = g.pick(lambda u: g.is_float(u))
        if v is None:
            return None
        if target_kind is None:
            t = partner(g, v, into=True, dtype=g.dtype(v))
        else:
            t = g.new_input(g.shape(v), g.dtype(v), kind=target_kind)
        return [v, t], {"reduction": g.rng.choice(["mean", "sum", "none"])}

    return gen


for _fn in ("F.mse_loss", "F.l1_loss", "F.smooth_l1_loss", "F.huber_loss"):
    _add(
        _fn,
        _loss_render(_fn),
        _pair_loss_gen(None),
        0.15,
    )
_add(
    "F.binary_cross_entropy_with_logits",
    lambda a, p: (
        f"F.binary_cross_entropy_with_logits({a[0]}, {a[1]}, reduction={p['reduction']!r})"
    ),
    _pair_loss_gen(PROBABILITY),
    0.2,
)


def _conv_input(g: GenState, spatial: int) -> int | None:
    """A floating value to convolve: an existing one, or (a third of the time, or if
    none fits) a new input of a batch of images, in a random layout (channels_last
    among them), now and then with no samples."""
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) in (spatial + 1, spatial + 2))
    if v is None or g.rng.random() < 0.35:
        n = g.rng.choices([0, 1, 2], [0.05, 0.45, 0.5])[0]
        shape = (n, g.rng.randint(1, 4), *(g.rng.randint(3, 8) for _ in range(spatial)))
        v = g.new_input(shape, _float_dtype(g))
    return v


def _conv_gen(spatial: int, transposed: bool = False) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = _conv_input(g, spatial)
        if v is None:
            return None
        shape = g.shape(v)
        c = shape[-spatial - 1]
        groups = g.rng.choice([1, 1, c]) if c > 0 else 1
        out = groups * g.rng.choice([1, 2])
        kernel = tuple(g.rng.randint(1, max(1, min(3, s))) for s in shape[-spatial:])
        if transposed:  # (in, out / groups, *kernel)
            w = g.new_input((c, out // max(groups, 1), *kernel), g.dtype(v))
        else:
            w = g.new_input((out, c // max(groups, 1), *kernel), g.dtype(v))
        args = [v, w]
        if g.rng.random() < 0.5:
            args.append(g.new_input((out,), g.dtype(v)))
        params = {
            "stride": g.rng.choice([1, 1, 2]),
            "padding": g.rng.choice([0, 0, 1]),
            "dilation": g.rng.choice([1, 1, 2]),
            "groups": groups,
        }
        if transposed:
            params["output_padding"] = g.rng.choice([0, 0, 1])
        return args, params

    return gen


def _conv_render(fn: str) -> Render:
    def rend(a: list[str], p: Params) -> str:
        bias = a[2] if len(a) > 2 else "None"
        extra = f"output_padding={p['output_padding']}, " if "output_padding" in p else ""
        return (
            f"{fn}({a[0]}, {a[1]}, {bias}, stride={p['stride']}, padding={p['padding']}, "
            f"{extra}dilation={p['dilation']}, groups={p['groups']})"
        )

    return rend


_add("F.conv1d", _conv_render("F.conv1d"), _conv_gen(1), 0.3)
_add("F.conv2d", _conv_render("F.conv2d"), _conv_gen(2), 0.4)
_add("F.conv_transpose1d", _conv_render("F.conv_transpose1d"), _conv_gen(1, True), 0.1)
_add("F.conv_transpose2d", _conv_render("F.conv_transpose2d"), _conv_gen(2, True), 0.15)


def _pool_gen(spatial: int, avg: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        v = g.pick(lambda u: g.is_float(u) and g.ndim(u) in (spatial + 1, spatial + 2))
        if v is None:
            return None
        k = g.rng.randint(1, max(1, min(3, *g.shape(v)[-spatial:])))
        params: Params = {
            "k": k,
            "stride": g.rng.choice([1, 2, k]),
            "padding": g.rng.randint(0, k // 2),
            "ceil_mode": g.rng.random() < 0.3,
        }
        if avg:
            params["count_include_pad"] = g.rng.random() < 0.5
        return [v], params

    return gen


def _pool_render(fn: str) -> Render:
    def rend(a: list[str], p: Params) -> str:
        return (
            f"{fn}({a[0]}, {p['k']}, stride={p['stride']}, padding={p['padding']}, "
            f"ceil_mode={p['ceil_mode']}{_kw(p, 'count_include_pad')})"
        )

    return rend


for _sp in (1, 2):
    _add(
        f"F.max_pool{_sp}d", _pool_render(f"F.max_pool{_sp}d"), _pool_gen(_sp, False), 0.2, "exact"
    )
    _add(f"F.avg_pool{_sp}d", _pool_render(f"F.avg_pool{_sp}d"), _pool_gen(_sp, True), 0.2)


def _adaptive_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) in (2, 3))
    return None if v is None else ([v], {"size": g.rng.choice([1, 2, 3])})


_add(
    "F.adaptive_avg_pool1d",
    lambda a, p: f"F.adaptive_avg_pool1d({a[0]}, {p['size']})",
    _adaptive_gen,
    0.15,
)

# ---------------------------------------------------------------------------------
# Attention and the fused encoder layer
# ---------------------------------------------------------------------------------


def _attention_params(g: GenState) -> Params:
    params: Params = {"causal": g.rng.random() < 0.3}
    if g.rng.random() < 0.2:
        params["scale"] = g.rng.choice([0.125, 1.0])
    return params


def _attention_render(a: list[str], p: Params) -> str:
    """The attention, where its keys and values have one length (else a 0-dim zero):
    eager's CPU kernel does not check that, and its backward corrupts the heap on other
    lengths (``F.scaled_dot_product_attention`` of keys of 1 and values of 256, a shrunk
    program of seed 105, aborted the process in eager). The shapes are static, so the
    condition is Python's, not the graph's."""
    mask = f", attn_mask={a[3]}" if len(a) > 3 else ""
    return (
        f"F.scaled_dot_product_attention({a[0]}, {a[1]}, {a[2]}{mask}, "
        f"is_causal={p['causal']}{_kw(p, 'scale')}) "
        f"if {a[1]}.shape[-2] == {a[2]}.shape[-2] else torch.zeros(())"
    )


def _attention_gen(g: GenState) -> Proposal:
    """A small attention (decomposed into JAX ops): queries an existing 3-D or 4-D
    floating value or a new input, keys and values new inputs; a boolean or additive
    mask now and then."""
    q = g.pick(lambda u: g.is_float(u) and g.ndim(u) in (3, 4))
    if q is None or g.rng.random() < 0.5:
        shape = (g.rng.choice([1, 2]), g.rng.choice([1, 2]), g.rng.choice([1, 3, 5]))
        q = g.new_input((*shape, g.rng.choice([2, 4, 8])), _float_dtype(g))
    *batch, length, e = g.shape(q)
    source = g.rng.choice([length, 1, 4])
    k = g.new_input((*batch, source, e), g.dtype(q))
    v = g.new_input((*batch, source, g.rng.choice([e, 3])), g.dtype(q))
    args = [q, k, v]
    params = _attention_params(g)
    if not params["causal"] and g.rng.random() < 0.3:
        mask_dtype = "bool" if g.rng.random() < 0.5 else g.dtype(q)
        args.append(g.new_input((length, source), mask_dtype))
    return args, params


# Shapes (N, H, L, S, E) of a large attention: 4 N H L S E = 2^27 flops in its two
# products, the least that ``dynajax.lowering.attention.whole`` keeps whole (the backend
# then measures it against PyTorch's fused kernel at the first compile).
LARGE_ATTENTION_SHAPES = ((2, 4, 256, 256, 64), (1, 4, 512, 256, 64), (1, 2, 256, 512, 128))


# Layouts of a large attention's inputs that PyTorch's dispatch takes to the fused CPU
# kernel (the last dim's stride 1; others take its math path, decomposed): the heads'
# transposition, ``(N, L, H, E).transpose(1, 2)``, above all.
_FUSED_LAYOUTS = (CONTIGUOUS, PERMUTED, PERMUTED, PERMUTED, OFFSET, STEPPED, EXPANDED)


def _large_attention_gen(g: GenState) -> Proposal:
    if any(g.tensor(u).numel() > MAX_LARGE // 4 for u in g.order):
        return None  # one large attention a program
    n, h, length, source, e = g.rng.choice(LARGE_ATTENTION_SHAPES)
    dtype = g.rng.choices(["float32", "float64"], [0.85, 0.15])[0]

    def new(shape: tuple[int, ...], scale: float, specials: bool | None = None) -> int:
        layout = g.rng.choice(_FUSED_LAYOUTS) if g.rng.random() < 0.85 else None
        if layout is not None and not layout_fits(layout, shape):
            layout = CONTIGUOUS
        return g.new_input(shape, dtype, scale=scale, layout=layout, specials=specials)

    q = new((n, h, length, e), 0.5)
    k = new((n, h, source, e), 0.5)
    # No NaN or inf among the values: where the causal mask hides such a row, eager's
    # answer depends on which of its kernels runs and on its blocks (its math kernel
    # multiplies every hidden row by 0, NaN for NaN; its fused kernel the rows of the
    # blocks it computes; fuzz seed 106, program 135), and so does the rule's.
    v = new((n, h, source, e), 2.0, specials=False)
    return [q, k, v], _attention_params(g)


MAX_LARGE = 1 << 18  # the most elements of a large op's result


_add("F.scaled_dot_product_attention", _attention_render, _attention_gen, 0.3)
_add(
    "F.scaled_dot_product_attention(large)",
    _attention_render,
    _large_attention_gen,
    0.4,
    "large",
)


def _encoder_gen(g: GenState) -> Proposal:
    """The fused encoder layer (``nn.TransformerEncoderLayer``'s fast path in eval mode
    under no_grad: this one op, over the layer's twelve weights, here inputs, or the
    module program's parameters) on an existing or new ``(N, L, E)`` value."""
    if len(g.inputs) > 4:
        return None  # its twelve weights

    def fits(u: int) -> bool:
        t = g.tensor(u)
        return g.dtype(u) in ("float32", "float64") and t.dim() == 3 and not t.requires_grad

    src = g.pick(lambda u: fits(u) and g.shape(u)[-1] in (4, 8, 12))
    if src is None or g.rng.random() < 0.5:
        shape = (g.rng.choice([1, 2]), g.rng.choice([1, 3, 5]), g.rng.choice([4, 8]))
        dtype = g.rng.choices(["float32", "float64"], [0.85, 0.15])[0]
        src = g.new_input(shape, dtype, requires_grad=False)
    e, dtype = g.shape(src)[-1], g.dtype(src)
    ff = g.rng.choice([8, 16])
    shapes = [
        (3 * e, e), (3 * e,), (e, e), (e,),  # attention: in and out projections
        (e,), (e,), (e,), (e,),  # two layer norms
        (ff, e), (ff,), (e, ff), (e,),  # feed-forward
    ]  # fmt: skip
    weights = [g.new_input(s, dtype, requires_grad=False, scale=0.3) for s in shapes]
    params = {
        "dim": e,
        "heads": g.rng.choice([h for h in (2, 4) if e % h == 0]),
        "gelu": g.rng.random() < 0.5,
        "norm_first": g.rng.random() < 0.5,
        "eps": g.rng.choice([1e-5, 1e-3]),
    }
    return [src, *weights], params


def _encoder_render(a: list[str], p: Params) -> str:
    w = a[1:]
    return (
        f"torch._transformer_encoder_layer_fwd({a[0]}, {p['dim']}, {p['heads']}, "
        f"{', '.join(w[:4])}, {p['gelu']}, {p['norm_first']}, {p['eps']!r}, "
        f"{', '.join(w[4:])})"
    )


_add("torch._transformer_encoder_layer_fwd", _encoder_render, _encoder_gen, 0.3)

# ---------------------------------------------------------------------------------
# More ops with value checks (and the indexing ops above): take, put, index_copy,
# index_reduce, masked_scatter, embedding_bag, embedding's renorm, nll_loss, histc
# ---------------------------------------------------------------------------------


def _take_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    return [v, _index_input(g, g.tensor(v).numel(), _small_shape(g), SIGNED_INDEX)], {}


_add("torch.take", lambda a, p: f"torch.take({a[0]}, {a[1]})", _take_gen, 0.25, "exact")


def _put_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.tensor(u).numel() > 0)
    if v is None:
        return None
    n = g.tensor(v).numel()
    accumulate = g.rng.random() < 0.4
    k = g.rng.randint(0, min(n, 4))
    kind = INDEX if accumulate else UNIQUE  # distinct where the last write would win
    idx = _index_input(g, n, (k,), kind)
    return [v, idx, g.new_input((k,), g.dtype(v))], {"accumulate": accumulate}


_add(
    "Tensor.put",
    lambda a, p: f"{a[0]}.put({a[1]}, {a[2]}, accumulate={p['accumulate']})",
    _put_gen,
    0.2,
)


def _index_copy_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.ndim(u) >= 1)
    if v is None:
        return None
    shape = g.shape(v)
    d = _dim(g, v) % len(shape)
    k = g.rng.randint(0, shape[d])
    idx = _index_input(g, shape[d], (k,), UNIQUE)
    src = g.new_input(tuple(k if i == d else s for i, s in enumerate(shape)), g.dtype(v))
    return [v, idx, src], {"dim": d}


_add(
    "torch.index_copy",
    lambda a, p: f"torch.index_copy({a[0]}, {p['dim']}, {a[1]}, {a[2]})",
    _index_copy_gen,
    0.25,
    "exact",
)


def _index_reduce_gen(g: GenState) -> Proposal:
    proposal = _index_add_gen(g)
    if proposal is None:
        return None
    args, params = proposal
    del params["alpha"]
    params["reduce"] = g.rng.choice(["prod", "mean", "amax", "amin"])
    params["include_self"] = g.rng.random() < 0.5
    return args, params


_add(
    "torch.index_reduce",
    lambda a, p: (
        f"torch.index_reduce({a[0]}, {p['dim']}, {a[1]}, {a[2]}, {p['reduce']!r}, "
        f"include_self={p['include_self']})"
    ),
    _index_reduce_gen,
    0.2,
)


def _masked_scatter_gen(g: GenState) -> Proposal:
    v = g.pick()
    if v is None:
        return None
    mask = g.new_input(_broadcast_shape_for(g, g.shape(v), True), "bool")
    n = g.tensor(v).numel()
    src = g.new_input((g.rng.randint(0, n),), g.dtype(v))  # too few now and then
    return [v, mask, src], {}


_add(
    "torch.masked_scatter",
    lambda a, p: f"torch.masked_scatter({a[0]}, {a[1]}, {a[2]})",
    _masked_scatter_gen,
    0.2,
    "exact",
)


def _embedding_bag_gen(g: GenState) -> Proposal:
    w = g.pick(lambda u: g.ndim(u) == 2 and g.shape(u)[0] > 0 and g.is_float(u))
    if w is None:
        return None
    idx = _index_input(g, g.shape(w)[0], (g.rng.choice([1, 2, 3]), g.rng.choice([1, 2, 4])))
    return [idx, w], {"mode": g.rng.choice(["sum", "mean", "max"])}


_add(
    "F.embedding_bag",
    lambda a, p: f"F.embedding_bag({a[0]}, {a[1]}, mode={p['mode']!r})",
    _embedding_bag_gen,
    0.2,
)


def _embedding_renorm_gen(g: GenState) -> Proposal:
    w = g.pick(lambda u: g.ndim(u) == 2 and g.shape(u)[0] > 0 and g.is_float(u))
    if w is None:
        return None
    idx = _index_input(g, g.shape(w)[0], _small_shape(g))
    return [w, idx], {"max_norm": g.rng.choice([1.0, 3.0])}


_add(
    "F.embedding(max_norm)",
    lambda a, p: f"F.embedding({a[1]}, {a[0]}, max_norm={p['max_norm']!r})",
    _embedding_renorm_gen,
    0.15,
    "writes",
)


def _nll_loss_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.ndim(u) in (2, 4) and g.shape(u)[1] > 0)
    if v is None:
        return None
    shape = g.shape(v)
    target = _index_input(g, shape[1], (shape[0], *shape[2:]))
    return [v, target], {"reduction": g.rng.choice(["mean", "sum", "none"])}


_add(
    "F.nll_loss",
    lambda a, p: f"F.nll_loss({a[0]}, {a[1]}, reduction={p['reduction']!r})",
    _nll_loss_gen,
    0.2,
)


def _histc_gen(g: GenState) -> Proposal:
    v = g.pick(lambda u: g.is_float(u) and g.exact(u))
    if v is None:
        return None
    lo, hi = g.rng.choice([(0, 0), (0, 0), (-1.0, 1.0), (-3.0, 2.0)])
    return [v], {"bins": g.rng.choice([1, 4, 7]), "min": lo, "max": hi}


_add(
    "torch.histc",
    lambda a, p: f"torch.histc({a[0]}, bins={p['bins']}, min={p['min']!r}, max={p['max']!r})",
    _histc_gen,
    0.15,
    "disc",
)

# ---------------------------------------------------------------------------------
# In-place updates (of inputs, of intermediates, of views of either)
# ---------------------------------------------------------------------------------


def _target(g: GenState) -> int | None:
    """The value an in-place op writes: half the time an input or a view of one."""
    if g.rng.random() < 0.5:
        v = g.pick(lambda u: g.root(u) < g.out_base)
        if v is not None:
            return v
    return g.pick()


def _inplace_binary_gen(scalar: bool) -> Gen:
    def gen(g: GenState) -> Proposal:
        t = _target(g)
        if t is None:
            return None
        if scalar:
            return [t], {"s": _scalar(g, t)}
        return [t, partner(g, t, into=True)], {}

    return gen


def _inplace(method: str, functional: str, weight: float, scalar: bool, flags: str = "") -> None:
    if scalar:
        rend: Render = lambda a, p: f"{a[0]}.{method}({p['s']!r})"  # noqa: E731
        fn_rend: Render = lambda a, p: f"{functional}({a[0]}, {p['s']!r})"  # noqa: E731
        kind_name, fn_name = f"Tensor.{method}(scalar)", f"{functional}(scalar)"
    else:
        rend = lambda a, p: f"{a[0]}.{method}({a[1]})"  # noqa: E731
        fn_rend = lambda a, p: f"{functional}({a[0]}, {a[1]})"  # noqa: E731
        kind_name, fn_name = f"Tensor.{method}", functional
    if fn_name not in KINDS:  # a functional kind of its own, for the shrinker only
        _add(fn_name, fn_rend, lambda g: None, 0.0, flags)
    gen = _inplace_binary_gen(scalar)
    _add(kind_name, rend, gen, weight, f"{flags} inplace", functional=fn_name)


_inplace("add_", "torch.add", 0.8, False, "exact")
_inplace("sub_", "torch.sub", 0.3, False, "exact")
_inplace("mul_", "torch.mul", 0.6, False, "exact")
_inplace("div_", "torch.div", 0.3, False, "exact nonfinite")
_inplace("copy_", "Tensor.copy", 0.7, False, "exact")
_inplace("add_", "torch.add", 0.4, True, "exact")
_inplace("mul_", "torch.mul", 0.4, True, "exact")
_inplace("fill_", "torch.fill", 0.2, True, "exact")


def _copy_render(a: list[str], p: Params) -> str:
    return f"{a[1]}.expand_as({a[0]}).to({a[0]}.dtype, copy=True)"


def _copy_gen(g: GenState) -> Proposal:
    """``copy_`` casts its source to the target's dtype: a float source into an integer
    or boolean target is a float-to-int cast, defined only for exact finite values (as
    ``Tensor.to``; NaN to int32 is INT_MIN on x86 and 0 in XLA, both undefined)."""
    proposal = _inplace_binary_gen(False)(g)
    if proposal is None:
        return None
    (t, src), _ = proposal
    if g.is_float(src) and not g.is_float(t) and not (g.exact(src) and g.finite(src)):
        return None
    return proposal


KINDS["Tensor.copy_"] = dataclasses.replace(KINDS["Tensor.copy_"], gen=_copy_gen)
KINDS["Tensor.copy"] = dataclasses.replace(KINDS["Tensor.copy"], render=_copy_render)


def _setitem_gen(g: GenState) -> Proposal:
    t = _target(g)
    if t is None or g.ndim(t) == 0:
        return None
    index = _slice_index(g, g.shape(t)) if g.rng.random() < 0.8 else "..."
    try:
        shape = tuple(eval(f"_t[{index}]", {"_t": g.tensor(t)}).shape)
    except Exception:
        return None
    if g.rng.random() < 0.3:
        return [t], {"index": index, "s": _scalar(g, t)}
    src = g.new_input(_broadcast_shape_for(g, shape, True), g.dtype(t))
    return [t, src], {"index": index}


def _setitem_render(a: list[str], p: Params) -> str:
    return f"{a[0]}[{p['index']}] = {a[1] if len(a) > 1 else repr(p['s'])}"


_add("Tensor.__setitem__(slices)", _setitem_render, _setitem_gen, 0.6, "exact inplace")


def _index_put_inplace_gen(g: GenState) -> Proposal:
    t = _target(g)
    if t is None or g.ndim(t) == 0:
        return None
    shape = g.shape(t)
    idx = _index_input(g, shape[0], (g.rng.randint(0, shape[0]),), UNIQUE)
    values = g.new_input(_broadcast_shape_for(g, (g.shape(idx)[0], *shape[1:]), True), g.dtype(t))
    return [t, idx, values], {}


_add(
    "Tensor.__setitem__(tensor)",
    lambda a, p: f"{a[0]}[{a[1]}] = {a[2]}",
    _index_put_inplace_gen,
    0.3,
    "exact inplace",
)


def _masked_fill_inplace_gen(g: GenState) -> Proposal:
    t = _target(g)
    if t is None:
        return None
    m = g.new_input(_broadcast_shape_for(g, g.shape(t), True), "bool")
    return [t, m], {"s": _scalar(g, t)}


_add(
    "Tensor.masked_fill_",
    lambda a, p: f"{a[0]}.masked_fill_({a[1]}, {p['s']!r})",
    _masked_fill_inplace_gen,
    0.3,
    "exact inplace",
    functional="torch.masked_fill",
)


def _unary_inplace(method: str, functional: str, weight: float, flags: str = "") -> None:
    def gen(g: GenState) -> Proposal:
        t = _target(g)
        return None if t is None else ([t], {})

    rend: Render = lambda a, p: f"{a[0]}.{method}()"  # noqa: E731
    _add(f"Tensor.{method}", rend, gen, weight, f"{flags} inplace", functional=functional)


_unary_inplace("relu_", "torch.relu", 0.2, "exact")
_unary_inplace("neg_", "torch.neg", 0.2, "exact")
_unary_inplace("zero_", "torch.zeros_like", 0.2, "exact")
_unary_inplace("exp_", "torch.exp", 0.15, "nonfinite")
_unary_inplace("sin_", "torch.sin", 0.15)


def _clamp_inplace_gen(g: GenState) -> Proposal:
    t = _target(g)
    if t is None:
        return None
    lo, hi = sorted(g.rng.sample([-2, -1, 0, 1, 2], 2))
    return [t], {"min": lo, "max": hi}


_add(
    "Tensor.clamp_",
    lambda a, p: f"{a[0]}.clamp_({p['min']}, {p['max']})",
    _clamp_inplace_gen,
    0.2,
    "exact inplace",
    functional="torch.clamp",
)


def _index_add_inplace_gen(g: GenState) -> Proposal:
    t = _target(g)
    if t is None or g.ndim(t) == 0:
        return None
    shape = g.shape(t)
    d = _dim(g, t) % len(shape)
    n = g.rng.choice([1, 2, 4])
    idx = _index_input(g, shape[d], (n,))
    src = g.new_input(tuple(n if i == d else s for i, s in enumerate(shape)), g.dtype(t))
    return [t, idx, src], {"dim": d, "alpha": 1}


_add(
    "Tensor.index_add_",
    lambda a, p: f"{a[0]}.index_add_({p['dim']}, {a[1]}, {a[2]})",
    _index_add_inplace_gen,
    0.2,
    "inplace",
    functional="torch.index_add",
)


def functional_of(kind: OpKind) -> OpKind | None:
    """The out-of-place kind of an in-place kind (the shrinker's simplification)."""
    return KINDS.get(kind.functional) if kind.functional else None


def check_catalog() -> None:
    """Each in-place kind's functional kind exists and reads the same arguments."""
    for kind in KINDS.values():
        if kind.inplace and kind.functional is not None:
            assert kind.functional in KINDS, f"{kind.name}: no kind {kind.functional}"


check_catalog()

"""Elementwise ops: unary math, binary arithmetic, comparisons, logic, where, clamp.

Every rule follows PyTorch's type promotion (``dtypes.result_type``) rather than
JAX's, and integer semantics (floor division, remainder signs) follow PyTorch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._inductor import inductor_prims  # noqa: F401  (defines prims.fma)

from dynajax.lowering import checks
from dynajax.lowering.dtypes import (
    as_dtype,
    divide,
    float_result_type,
    is_complex,
    is_floating,
    is_integral,
    opmath,
    promote,
    result_type,
)
from dynajax.lowering.registry import lower, named

aten = torch.ops.aten
prims = torch.ops.prims


def _name_of(fn) -> str:
    """``_sin`` for ``jnp.sin`` (and for a module's ``_sin``): the name of a rule that a
    factory here builds around ``fn``."""
    return "_" + fn.__name__.lstrip("_")


# ---------------------------------------------------------------------------------
# Unary ops whose integer inputs produce the default float dtype
# ---------------------------------------------------------------------------------


def _rsqrt(x):
    # PyTorch's kernel: 1 / sqrt(x), each rounded to float32 (the opmath type of the
    # half types, rounded to them at the end).
    if x.dtype in (np.float16, jnp.bfloat16, np.float32):
        root = jnp.sqrt(x.astype(np.float32))
        return divide(jnp.ones_like(root), root).astype(x.dtype)
    return jax.lax.rsqrt(x)


def _exp2(x):
    # PyTorch computes half types in float32 and rounds once; XLA's exp2 of bfloat16 is
    # exp(x * ln2) with the product rounded to bfloat16 (exp2(10) = 1000, not 1024).
    if x.dtype in (np.float16, jnp.bfloat16):
        return jnp.exp2(x.astype(np.float32)).astype(x.dtype)
    return jnp.exp2(x)


def _digamma(x):
    # PyTorch: digamma(+-0) = -+inf (jax gives NaN); NaN at negative integers as jax.
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jax.scipy.special.digamma(x))


def _float_unary(fn):
    """A unary rule: ``fn`` of x in PyTorch's float result type (integers and bools go
    to the default float dtype)."""

    def rule(x):
        return fn(as_dtype(x, float_result_type(x)))

    return named(rule, _name_of(fn))


lower(aten.sin.default)(_float_unary(jnp.sin))
lower(aten.cos.default)(_float_unary(jnp.cos))
lower(aten.tan.default)(_float_unary(jnp.tan))
lower(aten.asin.default)(_float_unary(jnp.arcsin))
lower(aten.acos.default)(_float_unary(jnp.arccos))
lower(aten.atan.default)(_float_unary(jnp.arctan))
lower(aten.sinh.default)(_float_unary(jnp.sinh))
lower(aten.cosh.default)(_float_unary(jnp.cosh))
lower(aten.tanh.default)(_float_unary(jnp.tanh))
lower(aten.asinh.default)(_float_unary(jnp.arcsinh))
lower(aten.acosh.default)(_float_unary(jnp.arccosh))
lower(aten.atanh.default)(_float_unary(jnp.arctanh))
lower(aten.exp.default)(_float_unary(jnp.exp))
lower(aten.exp2.default)(_float_unary(_exp2))
lower(aten.expm1.default)(_float_unary(jnp.expm1))
lower(aten.log.default)(_float_unary(jnp.log))
lower(aten.log2.default)(_float_unary(jnp.log2))
lower(aten.log10.default)(_float_unary(jnp.log10))
lower(aten.log1p.default)(_float_unary(jnp.log1p))
lower(aten.sqrt.default)(_float_unary(jnp.sqrt))
lower(aten.rsqrt.default)(_float_unary(_rsqrt))
lower(aten.sigmoid.default)(_float_unary(jax.nn.sigmoid))
lower(aten.erf.default)(_float_unary(jax.scipy.special.erf))
lower(aten.erfc.default)(_float_unary(jax.scipy.special.erfc))
lower(aten.erfinv.default)(_float_unary(jax.scipy.special.erfinv))
lower(aten.reciprocal.default)(_float_unary(jnp.reciprocal))
lower(aten.digamma.default)(_float_unary(_digamma))
lower(aten.lgamma.default)(_float_unary(jax.scipy.special.gammaln))
lower(aten.i0.default)(_float_unary(jax.scipy.special.i0))

# ---------------------------------------------------------------------------------
# Unary ops that keep the input dtype
# ---------------------------------------------------------------------------------


@lower(aten.neg.default)
def _neg(x):
    return jnp.negative(x)


@lower(aten.abs.default)
def _abs(x):
    return jnp.abs(x)


@lower(aten.sign.default)
def _sign(x):
    if x.dtype == np.bool_:
        return x  # sign of a bool is itself
    if is_floating(x.dtype):
        # Eager's kernel: (0 < x) - (x < 0), so 0 for NaN and +0 for -0 (jnp.sign: NaN, -0).
        return (0 < x).astype(x.dtype) - (x < 0).astype(x.dtype)
    return jnp.sign(x)


@lower(aten.sgn.default)
def _sgn(x):
    if is_complex(x.dtype):
        mag = jnp.abs(x)
        return jnp.where(mag == 0, 0, x / jnp.where(mag == 0, 1, mag)).astype(x.dtype)
    return _sign(x)


def _integral_identity(fn):
    """A unary rule: integers and bools unchanged, ``fn`` of anything else."""

    def rule(x):
        return x if is_integral(x.dtype) else fn(x)

    return named(rule, _name_of(fn))


lower(aten.floor.default)(_integral_identity(jnp.floor))
lower(aten.ceil.default)(_integral_identity(jnp.ceil))
lower(aten.trunc.default)(_integral_identity(jnp.trunc))


@lower(aten.frac.default)
def _frac(x):
    return x - jnp.trunc(x)


@lower(aten.round.default)
def _round(x):
    # Both round half to even.
    return x if is_integral(x.dtype) else jnp.round(x)


@lower(aten.round.decimals)
def _round_decimals(x, *, decimals=0):
    # PyTorch's kernel, in its opmath type (float32 for half types): multiply by 10**d
    # for d >= 0, divide by 10**-d otherwise (0.001 is inexact: 2500 * 0.001 != 2.5).
    dt = opmath(x.dtype)
    xf = x.astype(dt)
    if decimals >= 0:
        ten = jnp.asarray(10.0**decimals, dt)
        return divide(jnp.round(xf * ten), ten).astype(x.dtype)
    ten = jnp.asarray(10.0**-decimals, dt)
    return (jnp.round(divide(xf, ten)) * ten).astype(x.dtype)


@lower(aten.bitwise_not.default)
def _bitwise_not(x):
    return jnp.logical_not(x) if x.dtype == np.bool_ else jnp.bitwise_not(x)


@lower(aten.logical_not.default)
def _logical_not(x):
    return jnp.logical_not(x)


@lower(aten.isnan.default)
def _isnan(x):
    return jnp.isnan(x)


@lower(aten.isinf.default)
def _isinf(x):
    return jnp.isinf(x)


@lower(aten.isfinite.default)
def _isfinite(x):
    return jnp.isfinite(x)


@lower(aten.relu.default)
def _relu(x):
    return eager_maximum(x, jnp.zeros((), x.dtype)) if x.dtype != np.bool_ else x


@lower(aten.clone.default)
def _clone(x, *, memory_format=None):
    return x


@lower(aten.alias.default)
def _alias(x):
    return x


@lower(aten.detach.default)
def _detach(x):
    return x


# ---------------------------------------------------------------------------------
# Binary arithmetic
# ---------------------------------------------------------------------------------


def _scaled(other, alpha):
    # alpha arrives as an array (a tracer under jit: no Python comparisons on it);
    # callers already skip alpha == 1.
    return other * alpha


@lower(aten.add.Tensor, aten.add.Scalar)
def _add(x, other, *, alpha=1):
    dt = result_type(x, other)
    a, b = promote(x, other, dtype=dt)
    if dt == np.bool_:
        return jnp.logical_or(a, b) if alpha else a
    return a + _scaled(b, as_dtype(alpha, dt)) if alpha != 1 else a + b


@lower(aten.sub.Tensor, aten.sub.Scalar)
def _sub(x, other, *, alpha=1):
    dt = result_type(x, other)
    a, b = promote(x, other, dtype=dt)
    return a - _scaled(b, as_dtype(alpha, dt)) if alpha != 1 else a - b


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(x, other, *, alpha=1):
    dt = result_type(x, other)
    a, b = promote(x, other, dtype=dt)
    return b - _scaled(a, as_dtype(alpha, dt)) if alpha != 1 else b - a


# Dynamo traces ``addcmul_``/``addcdiv_`` with a ``value`` (every Adam step) to
# prims.fma (an OpOverload defined, and registered on import, by inductor_prims).
@lower(prims.fma.default)
def _fma(a, b, c):
    dt = result_type(a, b, c)
    a, b, c = promote(a, b, c, dtype=dt)
    return a * b + c


def _opmath_operands(x, other, dt):
    """The operands of PyTorch's CPU mul and div kernels for a result of dtype ``dt``,
    and how each step of a longer formula rounds. A half-precision result is computed
    in float32: with a scalar second operand (a Python number or a 0-dim tensor) the
    kernel takes the scalar's own value in float32, not first rounded to the half type
    (``x * 0.1`` in float16 differed from eager in a third of the elements), and rounds
    once at the end; between two tensors it rounds every step to the half type."""
    compute = opmath(dt)
    if compute == dt:
        return *promote(x, other, dtype=dt), _exact
    a = as_dtype(as_dtype(x, dt), compute)
    if isinstance(other, bool | int | float) or getattr(other, "ndim", None) == 0:
        return a, as_dtype(other, compute), _exact
    info = jnp.finfo(dt)
    step = functools.partial(
        jax.lax.reduce_precision, exponent_bits=info.nexp, mantissa_bits=info.nmant
    )
    return a, as_dtype(as_dtype(other, dt), compute), step


def _exact(v):
    return v


@lower(aten.mul.Tensor, aten.mul.Scalar)
def _mul(x, other):
    dt = result_type(x, other)
    if dt == np.bool_:
        return jnp.logical_and(*promote(x, other, dtype=dt))
    a, b, _ = _opmath_operands(x, other, dt)
    return (a * b).astype(dt)


def _true_div(x, other):
    dt = float_result_type(x, other)
    a, b, _ = _opmath_operands(x, other, dt)
    return divide(a, b).astype(dt)


def _floor_div(x, other):
    dt = result_type(x, other)
    if is_integral(dt):
        return jnp.floor_divide(*promote(x, other, dtype=dt))
    # PyTorch: floor(a / b) adjusted like Python's divmod for floats.
    a, b, r = _opmath_operands(x, other, dt)
    mod = jnp.fmod(a, b)  # exact
    div = r(divide(r(a - mod), b))
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), r(div - 1), div)
    floordiv = jnp.floor(div)
    floordiv = jnp.where(r(div - floordiv) > 0.5, r(floordiv + 1), floordiv)
    quotient = r(divide(a, b))
    signed_zero = jnp.copysign(0.0, quotient)
    return jnp.where(b == 0, quotient, jnp.where(div == 0, signed_zero, floordiv)).astype(dt)


def _trunc_div(x, other):
    dt = result_type(x, other)
    if is_integral(dt):
        a, b = jnp.broadcast_arrays(*promote(x, other, dtype=dt))  # lax.div: no broadcast
        return jax.lax.div(a, b)  # C-style truncation
    a, b, r = _opmath_operands(x, other, dt)
    return jnp.trunc(r(divide(a, b))).astype(dt)


@lower(aten.div.Tensor, aten.div.Scalar)
def _div(x, other):
    return _true_div(x, other)


def _check_int_division(x, other):
    """Eager raises on an integer division or remainder by zero (XLA defines it), as
    its kernel meets the zero: never where the result has no elements (an empty
    tensor divided by 0 is empty; found by the fuzzer, seed 4409)."""
    if not is_integral(result_type(x, other)):
        return
    shape = jnp.broadcast_shapes(jnp.shape(x), jnp.shape(other))
    if any(isinstance(d, int) and d == 0 for d in shape):
        return
    checks.fail_if(jnp.asarray(other) == 0, RuntimeError, "ZeroDivisionError")


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(x, other, *, rounding_mode=None):
    if rounding_mode is None:
        return _true_div(x, other)
    _check_int_division(x, other)
    if rounding_mode == "floor":
        return _floor_div(x, other)
    return _trunc_div(x, other)


def _int_zero_division_check(x, other, **_):
    # PyTorch raises on integer division by zero; XLA returns garbage. Only the
    # eager kernel can reproduce the error, and only literal zeros are visible here.
    if isinstance(other, int) and not isinstance(other, bool) and other == 0:
        if is_integral(x.dtype):
            return "integer division by a literal zero (PyTorch raises)"
    return None


@lower(aten.remainder.Tensor, aten.remainder.Scalar, check=_int_zero_division_check)
def _remainder(x, other):
    _check_int_division(x, other)
    a, b = promote(x, other)
    return jnp.remainder(a, b)


@lower(aten.fmod.Tensor, aten.fmod.Scalar, check=_int_zero_division_check)
def _fmod(x, other):
    _check_int_division(x, other)
    a, b = promote(x, other)
    return jnp.fmod(a, b)


def _pow_check(x, exponent):
    if (
        isinstance(exponent, int)
        and not isinstance(exponent, bool)
        and exponent < 0
        and is_integral(x.dtype)
    ):
        return "integer tensor to a negative integer power (PyTorch raises)"
    return None


# The dtypes for which eager's pow(x, 0.5) and pow(x, -0.5) are its sqrt and rsqrt
# kernels (pow_tensor_scalar_kernel, PowKernel.cpp); float16 goes through std::pow.
_POW_AS_ROOT = (np.float32, np.float64, jnp.bfloat16, np.complex64, np.complex128)


@lower(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, check=_pow_check)
def _pow(x, exponent):
    dt = result_type(x, exponent)
    if isinstance(exponent, float) and exponent in (0.5, -0.5) and dt in _POW_AS_ROOT:
        # sqrt and rsqrt differ from pow at -inf (NaN, not inf) and -0. (-0. and -inf).
        v = as_dtype(x, dt)
        if exponent > 0:
            return jnp.sqrt(v)
        return 1 / jnp.sqrt(v) if is_complex(dt) else _rsqrt(v)
    if isinstance(exponent, int) and not is_complex(dt):
        if exponent == 2:
            return as_dtype(x, dt) * as_dtype(x, dt)
        if exponent >= 0 and is_integral(dt):
            return jax.lax.integer_pow(as_dtype(x, dt), exponent)
    a, b = promote(x, exponent, dtype=dt)
    return _int_pow(a, b) if is_integral(dt, include_bool=False) else _float_pow(a, b)


def _float_pow(a, b):
    """IEEE ``pow`` for real floats, computed as a power of ``|a|`` and a sign.

    XLA's algebraic simplifier rewrites ``log(pow(a, b))`` as ``b * log(|a|)``, which is
    finite where ``a`` is negative and the power is NaN (a non-integer ``b``) or
    negative (an odd ``b``): eager's ``log2(pow(-0.98, -3.06))`` is NaN. Here the power
    is always of ``|a|``, for which that rewrite is exact, and a negative base gets
    pow's sign (negative for an odd integer ``b``, -0. included) and NaN (a finite
    negative base to a non-integer power) by selects: the values are IEEE pow's,
    infinities and signed zeros included."""
    if is_complex(a.dtype):
        return jnp.power(a, b)
    p = jnp.power(jnp.abs(a), b)
    odd = jnp.abs(jnp.fmod(b, 2)) == 1
    signed = jnp.where(jnp.signbit(a) & odd, -p, p)
    undefined = (a < 0) & jnp.isfinite(a) & (b != jnp.floor(b))
    return jnp.where(undefined, jnp.nan, signed).astype(p.dtype)


def _int_pow(a, b):
    # PyTorch's integer pow with a negative exponent is 1 / a**-b truncated: 1 for a == 1,
    # +-1 for a == -1, else 0. XLA's integer power leaves it undefined.
    pos = _powi(a, jnp.maximum(b, 0))
    minus_one = jnp.where(b % 2 == 0, 1, -1).astype(a.dtype)
    neg = jnp.where(a == 1, 1, jnp.where(a == -1, minus_one, 0)).astype(a.dtype)
    return jnp.where(b < 0, neg, pos)


def _powi(a, b):
    """``a ** b`` for integers ``b >= 0``, wrapping as eager's ``powi``: square and
    multiply over every bit of ``b``. jnp.power stops after 6 bits of the exponent (a
    larger power overflows), but eager's products wrap: 3 ** 64 is a nonzero int64 and
    2 ** 64 is 0, where jnp.power gives 1 for both."""
    acc = jnp.ones_like(a)
    for _ in range(np.iinfo(b.dtype).bits):
        acc = jnp.where((b & 1) == 1, acc * a, acc)
        a = a * a
        b = jax.lax.shift_right_logical(b, jnp.ones_like(b))
    return acc


@lower(aten.pow.Scalar)
def _pow_scalar(base, exponent):
    dt = result_type(base, exponent)
    a, b = promote(base, exponent, dtype=dt)
    return _int_pow(a, b) if is_integral(dt, include_bool=False) else _float_pow(a, b)


@lower(aten.atan2.default)
def _atan2(x, other):
    a, b = promote(x, other, dtype=float_result_type(x, other))
    return jnp.arctan2(a, b)


def _promoted(fn):
    """A binary rule: promote both operands to PyTorch's result type, then apply fn."""

    def rule(x, other):
        a, b = promote(x, other)
        return fn(a, b)

    return named(rule, _name_of(fn))


lower(aten.hypot.default)(_promoted(jnp.hypot))


@lower(aten.copysign.Tensor, aten.copysign.Scalar)
def _copysign(x, other):
    a, b = promote(x, other, dtype=float_result_type(x, other))
    return jnp.copysign(a, b)


def eager_maximum(a, b):
    """PyTorch's CPU ``max(a, b)``: NaN if either is NaN; ``a`` where they compare equal,
    so a signed zero keeps ``a``'s sign (``maximum(-0.0, 0.0)`` is -0.0, and
    ``relu(-0.0)`` too). XLA's ``max`` returns +0.0 there, and ``1 / relu(x)`` became
    +inf where eager's is -inf (fuzz seed 4, program 4369)."""
    return _first_unless(a, b, b > a)


def eager_minimum(a, b):
    """PyTorch's CPU ``min(a, b)``: as ``eager_maximum``, with ``b`` taken where smaller."""
    return _first_unless(a, b, b < a)


def _first_unless(a, b, b_wins):
    """``b`` where ``b_wins`` or ``b`` is NaN, else ``a`` (NaN ``a`` included)."""
    if is_floating(a.dtype):
        b_wins = b_wins | jnp.isnan(b)
    return jnp.where(b_wins, b, a)


lower(aten.maximum.default)(_promoted(eager_maximum))
lower(aten.minimum.default)(_promoted(eager_minimum))
lower(aten.fmax.default)(_promoted(jnp.fmax))
lower(aten.fmin.default)(_promoted(jnp.fmin))


# ---------------------------------------------------------------------------------
# Bitwise and logical
# ---------------------------------------------------------------------------------


lower(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar)(_promoted(jnp.bitwise_and))
lower(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar)(_promoted(jnp.bitwise_or))
lower(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar)(_promoted(jnp.bitwise_xor))


def _logical(fn):
    """A binary rule: ``fn`` of both operands as bools."""

    def rule(x, other):
        return fn(x.astype(bool), jnp.asarray(other).astype(bool))

    return named(rule, _name_of(fn))


lower(aten.logical_and.default)(_logical(jnp.logical_and))
lower(aten.logical_or.default)(_logical(jnp.logical_or))
lower(aten.logical_xor.default)(_logical(jnp.logical_xor))

# ---------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------


lower(aten.eq.Tensor, aten.eq.Scalar)(_promoted(jnp.equal))
lower(aten.ne.Tensor, aten.ne.Scalar)(_promoted(jnp.not_equal))
lower(aten.lt.Tensor, aten.lt.Scalar)(_promoted(jnp.less))
lower(aten.le.Tensor, aten.le.Scalar)(_promoted(jnp.less_equal))
lower(aten.gt.Tensor, aten.gt.Scalar)(_promoted(jnp.greater))
lower(aten.ge.Tensor, aten.ge.Scalar)(_promoted(jnp.greater_equal))

# ---------------------------------------------------------------------------------
# Selection and clamping
# ---------------------------------------------------------------------------------


@lower(aten.where.self)
def _where(condition, x, other):
    a, b = promote(x, other)
    return jnp.where(condition, a, b)


@lower(aten.where.ScalarSelf)
def _where_scalar_self(condition, x, other):
    a, b = promote(x, other)
    return jnp.where(condition, a, b)


@lower(aten.where.ScalarOther)
def _where_scalar_other(condition, x, other):
    a, b = promote(x, other)
    return jnp.where(condition, a, b)


@lower(aten.clamp.default, aten.clamp.Tensor)
def _clamp(x, min=None, max=None):
    dt = result_type(x, *(v for v in (min, max) if v is not None))
    out = as_dtype(x, dt)
    # PyTorch applies min then max (max wins when min > max), propagates NaN, and keeps
    # x where it equals a bound (clamp_min(-0.0, 0.0) is -0.0).
    if min is not None:
        out = eager_maximum(out, as_dtype(min, dt))
    if max is not None:
        out = eager_minimum(out, as_dtype(max, dt))
    return out


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(x, min):
    return _clamp(x, min, None)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(x, max):
    return _clamp(x, None, max)


# ---------------------------------------------------------------------------------
# Dtype conversion
# ---------------------------------------------------------------------------------


def _to_copy_check(
    x,
    *,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    if device is not None and getattr(device, "type", "cpu") not in ("cpu", "cuda"):
        return f"copy to device {device}"
    return None


@lower(aten._to_copy.default, check=_to_copy_check)
def _to_copy(
    x,
    *,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    if dtype is None or dtype == x.dtype:
        return x
    if is_complex(x.dtype) and not is_complex(dtype):
        x = jnp.real(x)
    # bool -> float as a select, float -> int as eager converts (see as_dtype)
    return as_dtype(x, dtype)


@lower(prims.convert_element_type.default)
def _convert_element_type(x, dtype):
    # Left in the graph by some of PyTorch's decompositions (renorm in half precision).
    return _to_copy(x, dtype=dtype)


# ---------------------------------------------------------------------------------
# Complex numbers
# ---------------------------------------------------------------------------------


@lower(aten.complex.default)
def _complex(real, imag):
    re, im = jnp.broadcast_arrays(*promote(real, imag))
    return jax.lax.complex(re, im)


@lower(aten.polar.default)
def _polar(abs, angle):
    a, t = promote(abs, angle)
    return jax.lax.complex(a * jnp.cos(t), a * jnp.sin(t))


@lower(aten.view_as_real.default, aten.view_as_real_copy.default)
def _view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@lower(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def _view_as_complex(x):
    return jax.lax.complex(x[..., 0], x[..., 1])


@lower(
    aten.conj_physical.default,
    aten._conj_physical.default,
    aten._conj.default,
    aten._conj_copy.default,
)
def _conj_physical(x):
    return jnp.conj(x) if is_complex(x.dtype) else x


@lower(aten.angle.default)
def _angle(x):
    if is_complex(x.dtype):
        return jnp.angle(x)
    # Real inputs: pi for negatives, 0 otherwise, NaN kept; integers give floats.
    x = as_dtype(x, float_result_type(x))
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


# ---------------------------------------------------------------------------------
# Special functions and bit-level arithmetic
# ---------------------------------------------------------------------------------

lower(aten.special_i0e.default)(_float_unary(jax.scipy.special.i0e))
lower(aten.special_i1.default)(_float_unary(jax.scipy.special.i1))
lower(aten.special_i1e.default)(_float_unary(jax.scipy.special.i1e))
lower(aten.special_ndtri.default)(_float_unary(jax.scipy.special.ndtri))
lower(aten.special_erfcx.default)(_float_unary(jax.scipy.special.erfcx))


def _float_binary(fn):
    """A binary rule: ``fn`` of both operands promoted to PyTorch's float result type."""

    def rule(x, other):
        a, b = promote(x, other, dtype=float_result_type(x, other))
        return fn(a, b)

    return named(rule, _name_of(fn))


def _hurwitz_zeta(s, q):
    """zeta(s, q) for any q, as Cephes (PyTorch) computes it: the terms (q + k)^-s of
    negative q are summed directly (JAX's series is only accurate for q >= 0)."""

    def shifting(carry):
        q, _ = carry
        return jnp.any(jnp.isfinite(q) & (q < 0))

    def shift(carry):
        q, acc = carry
        neg = jnp.isfinite(q) & (q < 0)
        return jnp.where(neg, q + 1, q), acc + jnp.where(neg, q ** (-s), 0)

    s, q = jnp.broadcast_arrays(s, q)
    pole = (q <= 0) & (q == jnp.floor(q))  # Cephes: zeta(s, q) = inf there
    q, acc = jax.lax.while_loop(shifting, shift, (q, jnp.zeros_like(q)))
    out = jnp.where(pole, jnp.inf, acc + jax.scipy.special.zeta(s, q))
    return jnp.where(s < 1, jnp.nan, out)  # Cephes: s < 1 is a domain error before poles


lower(aten.special_zeta.default, aten.special_zeta.other_scalar, aten.special_zeta.self_scalar)(
    _float_binary(_hurwitz_zeta)
)
lower(aten.igamma.default)(_float_binary(jax.scipy.special.gammainc))
lower(aten.igammac.default)(_float_binary(jax.scipy.special.gammaincc))


@lower(aten.polygamma.default)
def _polygamma(n, x):
    x = as_dtype(x, float_result_type(x))
    wide = opmath(x.dtype)  # (float16/bfloat16: PyTorch computes in float32, rounds once)
    if n == 0:
        return jax.scipy.special.digamma(x.astype(wide)).astype(x.dtype)
    if n == 1:
        return _trigamma(x.astype(wide)).astype(x.dtype)
    # PyTorch: (-1)^(n+1) n! zeta(n + 1, x). Near the poles (negative integers) the
    # series cancels badly, so single and half precision are summed in double.
    scale = (1.0 if n % 2 else -1.0) * float(np.prod(np.arange(1, n + 1, dtype=np.float64)))
    acc = x if x.dtype == np.float64 else x.astype(np.float64)
    return (scale * _hurwitz_zeta(jnp.asarray(n + 1, acc.dtype), acc)).astype(x.dtype)


def _trigamma(x):
    """Eager's trigamma (``calc_trigamma``), in ``x``'s dtype: below 0.5 the reflection
    ``-pi^2 / sin(pi x)^2`` with ``x -> 1 - x``, then six steps of the recurrence and the
    asymptotic series. At a negative integer ``sin(pi x)`` is not 0 in floating point,
    so eager's answer is large and finite (1.3e15 in float32 at x = -1), where the
    Hurwitz zeta series gives inf; the digamma gradient reads it."""
    pi = np.asarray(np.pi, x.dtype)
    reflected = x < 0.5
    sin_pi_x = jnp.sin(pi * x)
    result = jnp.where(reflected, -(pi * pi) / (sin_pi_x * sin_pi_x), jnp.zeros_like(x))
    x = jnp.where(reflected, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    c = [np.asarray(v, x.dtype) for v in (1 / 6, 1 / 30, 1 / 42)]
    result = result + (1 + 1 / (2 * x) + ixx * (c[0] - ixx * (c[1] - ixx * c[2]))) / x
    return jnp.where(reflected, -result, result)


@lower(aten.signbit.default)
def _signbit(x):
    if x.dtype == np.bool_ or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return jnp.zeros(x.shape, bool)
    return jnp.signbit(x) if is_floating(x.dtype) else x < 0


@lower(aten.frexp.Tensor)
def _frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa.astype(x.dtype), exponent.astype(np.int32)


@lower(aten.ldexp.Tensor)
def _ldexp(x, other):
    # PyTorch: x * pow(2, other), the power rounded to the dtype first; XLA's
    # half-precision exp2 is less accurate than that rounding, so take it in float32.
    dt = float_result_type(x, other)
    a, b = promote(x, other, dtype=dt)
    wide = np.float32 if np.dtype(dt).itemsize == 2 and not is_complex(dt) else dt
    return a * jnp.exp2(b.astype(wide)).astype(dt)


lower(aten.nextafter.default)(_promoted(jnp.nextafter))
lower(aten.gcd.default)(_promoted(jnp.gcd))
lower(aten.lcm.default)(_promoted(jnp.lcm))


def _shift(left):
    """The rule of ``bitwise_left_shift`` (``left``) or ``bitwise_right_shift``."""

    def rule(x, other):
        a, b = promote(x, other)
        bits = np.dtype(a.dtype).itemsize * 8
        # PyTorch: a shift by a negative amount or by the width or more gives 0 (or -1
        # for a right shift of a negative signed value).
        out_of_range = (b < 0) | (b >= bits)
        safe = jnp.where(out_of_range, 0, b)
        if left:
            return jnp.where(out_of_range, 0, jnp.left_shift(a, safe))
        signed = jnp.issubdtype(a.dtype, jnp.signedinteger)
        fill = jnp.where(a < 0, -1, 0).astype(a.dtype) if signed else 0
        return jnp.where(out_of_range, fill, jnp.right_shift(a, safe))

    return named(rule, "_bitwise_left_shift" if left else "_bitwise_right_shift")


lower(
    aten.bitwise_left_shift.Tensor,
    aten.bitwise_left_shift.Tensor_Scalar,
    aten.bitwise_left_shift.Scalar_Tensor,
)(_shift(True))
lower(
    aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar,
    aten.bitwise_right_shift.Scalar_Tensor,
)(_shift(False))

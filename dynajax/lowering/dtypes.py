"""dtype helpers shared by every rule: the torch<->JAX dtype map and PyTorch's type
promotion (dimensioned tensors > 0-dim tensors > Python scalars, by category).

PyTorch's own promotion lattice (``torch.promote_types``) is consulted on dtypes only,
at trace time, so our promotion can never drift from the installed torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import platform
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.custom_derivatives import SymbolicZero

TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(jnp.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
JAX_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in TORCH_TO_JAX.items()}


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    return TORCH_TO_JAX[dtype]


def to_torch_dtype(dtype: Any) -> torch.dtype:
    return JAX_TO_TORCH[np.dtype(dtype)]


def is_floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_complex(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def is_integral(dtype: Any, include_bool: bool = True) -> bool:
    d = np.dtype(dtype)
    return jnp.issubdtype(d, jnp.integer) or (include_bool and d == np.bool_)


DEFAULT_FLOAT = np.dtype(np.float32)


def default_float() -> np.dtype:
    """torch's default dtype (the dtype of float Python scalars and int->float ops)."""
    return TORCH_TO_JAX[torch.get_default_dtype()]


def _category(dtype: np.dtype | None) -> int:
    if dtype is None:
        return -1
    if dtype == np.bool_:
        return 0
    if is_integral(dtype):
        return 1
    if is_floating(dtype):
        return 2
    return 3


@functools.cache
def promote_types(a: np.dtype, b: np.dtype) -> np.dtype:
    """torch.promote_types on numpy dtypes."""
    return TORCH_TO_JAX[torch.promote_types(JAX_TO_TORCH[a], JAX_TO_TORCH[b])]


def _combine(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    # c10's combine_categories: the higher-priority group wins unless the lower one is of
    # a higher category.
    if higher is None:
        return lower
    if lower is None:
        return higher
    if is_complex(higher):
        return higher
    if is_complex(lower):
        if is_floating(higher):
            return promote_types(higher, np.dtype(np.complex64))
        return lower
    if is_floating(higher):
        return higher
    if higher == np.bool_ or is_floating(lower):
        return promote_types(higher, lower)
    return higher


def _scalar_dtype(value: Any) -> np.dtype:
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    if isinstance(value, complex):
        return promote_types(default_float(), np.dtype(np.complex64))
    return default_float()


def result_type(*args: Any) -> np.dtype:
    """torch.result_type over JAX arrays (0-dim ones count as 0-dim tensors) and scalars."""
    groups: list[np.dtype | None] = [None, None, None]  # dimensioned, 0-dim, scalar
    for a in args:
        if a is None:
            continue
        if isinstance(a, bool | int | float | complex):
            idx, dt = 2, _scalar_dtype(a)
        else:
            idx, dt = (1 if a.ndim == 0 else 0), np.dtype(a.dtype)
        groups[idx] = dt if groups[idx] is None else promote_types(groups[idx], dt)
    out = _combine(groups[0], _combine(groups[1], groups[2]))
    if out is None:
        raise TypeError("result_type() needs at least one tensor or scalar")
    return out


def float_result_type(*args: Any) -> np.dtype:
    """Result dtype of ops that always produce floats (int/bool inputs -> default dtype)."""
    dt = result_type(*args)
    return dt if (is_floating(dt) or is_complex(dt)) else default_float()


# Whether eager computes the graph being lowered on a CUDA device (set per compile by
# runtime/executables.py from the partition's tensors, and per node by the capability
# checker): a float's conversion to an integer depends on the processor that converts
# it (``float_to_int``), and a few kernels' outputs differ in shape (batch norm's saved
# statistics, lowering/nn.py).
_EAGER_ON_CUDA: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dynajax_eager_on_cuda", default=False
)
# x86's truncating conversions (cvttss2si, cvttsd2si and their vector forms) give the
# "integer indefinite", the type's minimum, for NaN and out-of-range values.
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@contextlib.contextmanager
def eager_on_cuda(on_cuda: bool) -> Iterator[None]:
    """Rules lowered inside follow eager's arithmetic on CUDA (``on_cuda``) or the CPU."""
    token = _EAGER_ON_CUDA.set(on_cuda)
    try:
        yield
    finally:
        _EAGER_ON_CUDA.reset(token)


def eager_is_on_cuda() -> bool:
    """Whether the rule being lowered (or abstractly evaluated) stands for eager's CUDA
    kernel rather than its CPU kernel (``eager_on_cuda``)."""
    return _EAGER_ON_CUDA.get()


def float_to_int(x: jax.Array, dtype: Any) -> jax.Array:
    """A floating array converted to an integer dtype as eager converts it.

    Toward zero, as everywhere; to a type narrower than int32 through int32, wrapping
    (-1.7 -> uint8 255, 300.5 -> int8 44), where XLA would saturate. NaN and values
    outside the int32 (int64 for int64) range are where processors differ: eager's CPU
    kernels on x86 give the type's minimum (x86's "integer indefinite": NaN, inf and 1e20
    -> int64 -9223372036854775808, and through int32 -2147483648, so 0 in int8), where
    XLA saturates and takes NaN to 0, as ARM processors and CUDA do. Found by the fuzzer
    (``sum(acos(x), dtype=int64)`` of an x past 1).
    """
    dtype = np.dtype(dtype)
    # With JAX's 64-bit mode off int64 is int32, and so is its minimum.
    wide = np.dtype(jax.dtypes.canonicalize_dtype(np.int64 if dtype.itemsize == 8 else np.int32))
    x = jnp.trunc(x)
    out = x.astype(wide)
    if _X86 and not eager_is_on_cuda():
        low = np.iinfo(wide).min
        if float(jnp.finfo(x.dtype).max) < -float(low):  # float16: only inf and NaN
            inside = jnp.isfinite(x)
        else:  # -2**63 and -2**31 are powers of two, exact in the float dtype
            bound = jnp.asarray(-float(low), x.dtype)
            inside = (x >= -bound) & (x < bound)  # NaN is outside
        out = jnp.where(inside, out, jnp.asarray(low, wide))
    return out if wide == dtype else out.astype(dtype)


def as_dtype(x: Any, dtype: Any) -> jax.Array:
    """``x`` (array or scalar) as a JAX array of ``dtype``; no-op when already so.

    A bool array becomes a floating one through a select, not a convert: XLA's
    algebraic simplifier rewrites ``A * convert(pred)`` into ``select(pred, A, 0)``,
    which is 0 where A is inf or NaN (eager's ``inf * 0.`` is NaN); it leaves
    ``A * select(pred, 1, 0)`` a multiply."""
    if isinstance(x, bool | int | float | complex):
        return jnp.asarray(x, dtype=dtype)
    if x.dtype == dtype:
        return x
    if x.dtype == np.bool_ and (is_floating(dtype) or is_complex(dtype)):
        return jnp.where(x, jnp.ones((), dtype), jnp.zeros((), dtype))
    if is_floating(x.dtype) and is_integral(dtype, include_bool=False):
        return float_to_int(x, dtype)
    return x.astype(dtype)


def promote(*args: Any, dtype: Any = None) -> list[jax.Array]:
    """Casts every argument to ``dtype`` (default: their torch result type)."""
    dt = result_type(*args) if dtype is None else dtype
    return [as_dtype(a, dt) for a in args]


def opmath(dtype: Any) -> np.dtype:
    """The type PyTorch's CPU kernels compute half-precision values in: float32 for
    float16 and bfloat16, the dtype itself otherwise."""
    half = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
    return np.dtype(np.float32) if np.dtype(dtype) in half else np.dtype(dtype)


_EXACT_IN_FLOAT64 = (np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32))


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` of two floating arrays of one dtype, rounded once as PyTorch divides.

    XLA's algebraic simplifier rewrites divisions where it sees them: ``x / c`` (a
    constant or any broadcast divisor) as ``x * (1 / c)``, an ulp off in about a third
    of the elements; ``(a / b) / c`` as ``a / (b * c)``, where ``b * c`` can overflow
    (float16 ``(x / 300) / 300`` came out 0); ``a / sqrt(b)`` as ``a * rsqrt(b)``.

    float16, bfloat16 and float32 divide in float64 and round once: whatever XLA does
    to a float64 division (a reciprocal and a product, each rounded to 53 bits) stays
    within 2**-52 of the quotient, closer than any 24-bit quotient of two 24-bit
    numbers comes to a rounding boundary, so the result is the correctly rounded one;
    and the conversions hide the division from the patterns above. float64 and complex
    have no wider type: their operands go behind an optimization barrier, which the
    simplifier does not see through (at the cost of materializing a broadcast divisor).
    """
    if a.dtype in _EXACT_IN_FLOAT64:
        return (a.astype(np.float64) / b.astype(np.float64)).astype(a.dtype)
    return _divide_behind_barrier(a, b)


@jax.custom_jvp
def _divide_behind_barrier(a: jax.Array, b: jax.Array) -> jax.Array:
    b = jnp.broadcast_to(b, jnp.broadcast_shapes(a.shape, b.shape))
    a, b = jax.lax.optimization_barrier((a, b))
    return a / b


def _divide_jvp(primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    """torch's forward-mode derivative of ``a / b``, ``(a_t - b_t * out) / b``, with a
    tangent that is zero left out: ``optimization_barrier``'s own JVP makes a zero
    tangent a zero array, and ``0 / b`` is NaN where ``b`` is 0 (the second derivative of
    ``sqrt`` at 0, torch's ``-inf``, came out NaN under ``jax.hessian``)."""
    a, b = primals
    a_t, b_t = (None if isinstance(t, SymbolicZero) else t for t in tangents)
    out = _divide_behind_barrier(a, b)
    numerator = a_t
    if b_t is not None:
        numerator = -(b_t * out) if numerator is None else numerator - b_t * out
    assert numerator is not None  # JAX calls the rule only with a nonzero tangent
    return out, jnp.broadcast_to(numerator / b, out.shape).astype(out.dtype)


_divide_behind_barrier.defjvp(_divide_jvp, symbolic_zeros=True)

"""``torch.special`` functions JAX lacks: Bessel J, Y and K of orders 0 and 1, Airy Ai,
the spherical Bessel j0, and the classical orthogonal polynomials.

The functions of one argument are evaluated in float64 (a float32 input is rounded to
float32 first, as PyTorch does, then widened, and the result rounded back), each from
methods that are accurate over their whole range:

    J0, J1, Y0, Y1   power series (x <= 8), Miller's backward recurrence with Neumann's
                     series for Y (8 < x <= 25), Hankel's asymptotic expansion (x > 25)
    K0, K1           power series (x <= 2), the integral of exp(-x cosh t) cosh(nu t)
                     by the trapezoidal rule after s = sqrt(2x) sinh(t/2) (x > 2)
    Ai               Taylor series of y'' = x y about the nearest integer in [-10, 10],
                     from tabulated Ai, Ai' there (|x| < 10.5); asymptotic beyond
    I0, I1           jax.scipy.special

Where PyTorch's own answer hinges on a rounding it makes in the input dtype (the phase
``x - pi/4`` of the large-argument Bessel forms, ``2/3 (-x)^(3/2) + pi/4`` for Airy),
the same rounding is made here in the same dtype, so results agree at large |x| even in
float32, where that phase is only good to a fraction of a radian. In float64 PyTorch's
J, Y and Ai kernels are themselves off by up to 3e-6 in narrow windows (see
``_float32_check``), so those three families run in JAX for float32 only.

The polynomials take a per-element degree ``n`` and follow PyTorch's kernels step by step
in the result dtype: the degree is truncated to int64 (NaN, inf and |n| >= 2^63 become
INT64_MIN, as x86's conversion gives, so the result is 0), negative degrees give 0,
|x| == 1 and the other special points give their closed values, some large degrees
switch to trigonometric closed forms, and the rest runs the three-term recurrence in a
``lax.while_loop`` bounded by the largest degree that still iterates. One difference is
deliberate: for x = NaN and n >= 2, PyTorch's U, V, W, Legendre, Laguerre and shifted
kernels return an uninitialised value (whatever the previous element left); here NaN.
Known limits: the trigonometric closed forms take acos, cos, sin correctly rounded, while
glibc before 2.41 has float32 acosf an ulp off for ~8% of arguments, an error that the
degree multiplies: float32 Chebyshev values of degree n > ~40 with |x| < 1 can differ
from eager beyond tolerance (float64 agrees). And, as in PyTorch, the loop runs n - 1
steps for Laguerre/Legendre inside (-1, 1), so a huge degree takes as long as eager's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import as_dtype, divide, float_result_type
from dynajax.lowering.registry import lower, named

aten = torch.ops.aten

_F64 = np.dtype(np.float64)
_KERNEL_DTYPES = (np.dtype(np.float32), _F64)
_EULER_GAMMA = 0.57721566490153286061
_TWO_OVER_PI = 2.0 / math.pi


def _dtype_check(*args, **kwargs):
    dt = float_result_type(*args)
    if dt not in _KERNEL_DTYPES:
        return f"PyTorch's CPU kernel takes float32/float64 only, not {dt.name} (it raises)"
    return None


def _unary(fn: Callable[[jax.Array, jax.Array], jax.Array]):
    """A rule computing ``fn(x as float64, x in the result dtype)`` in float64."""

    def rule(x):
        xt = as_dtype(x, float_result_type(x))
        return fn(xt.astype(_F64), xt).astype(xt.dtype)

    return named(rule, fn.__name__)


def _divide(a, b):
    return divide(a, jnp.asarray(b, a.dtype))  # correctly rounded, as PyTorch divides


def _horner(coefs, w):
    acc = jnp.full_like(w, coefs[-1])
    for c in coefs[-2::-1]:
        acc = acc * w + c
    return acc


# ---------------------------------------------------------------------------------
# Bessel functions of the first and second kind, orders 0 and 1
# ---------------------------------------------------------------------------------

_SERIES_MAX = 8.0  # series below, recurrence above
_HANKEL_MIN = 25.0  # Hankel's expansion above: its error there is below 1e-17
_MILLER_TOP = 80  # start index of the backward recurrence; J_80(25) ~ 1e-31


def _hankel_coefs(nu: int, terms: int) -> tuple[list[float], list[float]]:
    """Coefficients of Hankel's P and Q in powers of 1/x^2: a_k(nu) = prod_{j<=k}
    (4 nu^2 - (2j - 1)^2) / (k! 8^k), P = sum (-1)^k a_2k / x^2k, Q = x sum (-1)^k
    a_2k+1 / x^(2k+1)."""
    a, acc = [], Fraction(1)
    for k in range(2 * terms):
        a.append(acc)
        acc = acc * (4 * nu * nu - (2 * k + 1) ** 2) / ((k + 1) * 8)
    p = [float((-1) ** k * a[2 * k]) for k in range(terms)]
    q = [float((-1) ** k * a[2 * k + 1]) for k in range(terms)]
    return p, q


_HANKEL = {nu: _hankel_coefs(nu, 12) for nu in (0, 1)}


def _hankel(nu, x, phase):
    """J_nu and Y_nu for large x; ``phase`` is x - (nu/2 + 1/4) pi."""
    p_coefs, q_coefs = _HANKEL[nu]
    w = 1.0 / (x * x)
    p = _horner(p_coefs, w)
    q = _horner(q_coefs, w) / x
    amp = jnp.sqrt(_TWO_OVER_PI / x)
    c, s = jnp.cos(phase), jnp.sin(phase)
    return amp * (p * c - q * s), amp * (p * s + q * c)


def _series01(x):
    """J0, J1, Y0, Y1 from their power series (x > 0; accurate to ~1e-14 for x <= 8)."""
    t = x * x / 4
    term0 = j0 = jnp.ones_like(x)  # (-t)^k / k!^2
    term1 = j1 = jnp.ones_like(x)  # (-t)^k / (k! (k+1)!)
    y0_sum = jnp.zeros_like(x)
    y1_sum = (1 - 2 * _EULER_GAMMA) * term1  # psi(1) + psi(2) at k = 0
    harmonic = 0.0
    for k in range(1, 27):
        term0 = term0 * (-t) / (k * k)
        term1 = term1 * (-t) / (k * (k + 1))
        harmonic_next = harmonic + 1.0 / k
        j0 = j0 + term0
        j1 = j1 + term1
        y0_sum = y0_sum - harmonic_next * term0
        # psi(k + 1) + psi(k + 2) = H_k + H_{k+1} - 2 gamma
        y1_sum = y1_sum + (harmonic_next + harmonic_next + 1.0 / (k + 1) - 2 * _EULER_GAMMA) * term1
        harmonic = harmonic_next
    j1 = j1 * (x / 2)
    y0 = _TWO_OVER_PI * ((jnp.log(x / 2) + _EULER_GAMMA) * j0 + y0_sum)
    y1 = -_TWO_OVER_PI / x + _TWO_OVER_PI * jnp.log(x / 2) * j1 - (x / 2) / math.pi * y1_sum
    return j0, j1, y0, y1


def _miller_weights() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-index weights of J_i in: the normalisation J0 + 2 sum J_2k = 1, Neumann's
    N0 = sum (-1)^k J_2k / k, and N1 = sum (-1)^k (J_2k-1 - J_2k+1) / k."""
    top = _MILLER_TOP
    norm, n0, n1 = np.zeros(top + 2), np.zeros(top + 2), np.zeros(top + 2)
    norm[0] = 1.0
    for k in range(1, top // 2 + 1):
        norm[2 * k] = 2.0
        n0[2 * k] = (-1) ** k / k
    for k in range(1, top // 2 + 1):
        n1[2 * k - 1] += (-1) ** k / k
        n1[2 * k + 1] -= (-1) ** k / k
    return norm, n0, n1


_MILLER = _miller_weights()


def _miller01(x):
    """J0, J1, Y0, Y1 by the backward recurrence J_{m-1} = (2m/x) J_m - J_{m+1} from
    m = 80, normalised by J0 + 2 sum J_2k = 1, with Y from Neumann's series:
    Y0 = 2/pi (log(x/2) + gamma) J0 - 4/pi sum (-1)^k J_2k / k and its derivative."""
    norm, n0, n1 = (jnp.asarray(w) for w in _MILLER)
    top = _MILLER_TOP
    two_over_x = 2.0 / x

    def step(i, carry):
        upper, cur, s, a0, a1 = carry  # J_{m+1}, J_m (unnormalised), sums so far
        m = top - i
        lower = (m * two_over_x) * cur - upper
        return cur, lower, s + norm[m - 1] * lower, a0 + n0[m - 1] * lower, a1 + n1[m - 1] * lower

    start = jnp.full_like(x, 1e-30)
    zero = jnp.zeros_like(x)
    carry = (zero, start, norm[top] * start, n0[top] * start, n1[top] * start)
    j1, j0, s, a0, a1 = jax.lax.fori_loop(0, top, step, carry)
    j0, j1 = j0 / s, j1 / s
    log_term = jnp.log(x / 2) + _EULER_GAMMA
    y0 = _TWO_OVER_PI * (log_term * j0 - 2 * a0 / s)
    y1 = _TWO_OVER_PI * (log_term * j1 - j0 / x + a1 / s)
    return j0, j1, y0, y1


def _bessel01(ax, phase0, phase1):
    """(J0, J1, Y0, Y1) at ax >= 0 (any value: the regions are chosen per element)."""
    small = ax <= _SERIES_MAX
    large = ax > _HANKEL_MIN
    safe_small = jnp.where(small & (ax > 0), ax, 1.0)
    safe_mid = jnp.where(small | large, 16.0, ax)
    safe_large = jnp.where(large, ax, 100.0)
    s = _series01(safe_small)
    m = _miller01(safe_mid)
    j0_h, y0_h = _hankel(0, safe_large, jnp.where(large, phase0, 0.0))
    j1_h, y1_h = _hankel(1, safe_large, jnp.where(large, phase1, 0.0))
    h = (j0_h, j1_h, y0_h, y1_h)
    return tuple(
        jnp.where(small, a, jnp.where(large, c, b)) for a, b, c in zip(s, m, h, strict=True)
    )


def _phase(xt, shift: float):
    """x - shift rounded in x's dtype, as PyTorch forms it, then widened."""
    return (xt - jnp.asarray(shift, xt.dtype)).astype(_F64)


_QUARTER_PI = 0.785398163397448309615660845819875721
_THREE_QUARTER_PI = 2.356194490192344928846982537459627163


def _bessel_j0(x, xt):
    ax, axt = jnp.abs(x), jnp.abs(xt)
    j0 = _bessel01(ax, _phase(axt, _QUARTER_PI), _phase(axt, _THREE_QUARTER_PI))[0]
    return jnp.where(ax == 0, 1.0, j0)


def _bessel_j1(x, xt):
    ax, axt = jnp.abs(x), jnp.abs(xt)
    j1 = _bessel01(ax, _phase(axt, _QUARTER_PI), _phase(axt, _THREE_QUARTER_PI))[1]
    return jnp.where(ax == 0, x, jnp.where(x < 0, -j1, j1))


def _bessel_y(order: int):
    """Y0 or Y1 (``order``), with ``_unary``'s arguments."""

    def fn(x, xt):
        y = _bessel01(x, _phase(xt, _QUARTER_PI), _phase(xt, _THREE_QUARTER_PI))[2 + order]
        return jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, y))

    return named(fn, f"_bessel_y{order}")


# ---------------------------------------------------------------------------------
# Modified Bessel functions
# ---------------------------------------------------------------------------------


def _modified_i(fn):
    """I0 or I1 from JAX's ``fn``, with ``_unary``'s arguments and PyTorch's overflow."""

    def f(x, xt):
        # PyTorch forms exp(|x|) in the input dtype first: once that overflows the result
        # is +-inf, even where I(x) itself (~ exp(x) / sqrt(2 pi x)) is still finite.
        overflow = jnp.isinf(jnp.exp(jnp.abs(x)).astype(xt.dtype)) & jnp.isfinite(x)
        return jnp.where(overflow, jnp.copysign(jnp.inf, fn(x)), fn(x))

    return named(f, f"_modified_bessel_{fn.__name__}")


_K_SERIES_MAX = 2.0
_K_STEP = 0.25  # trapezoidal step in s; the error is ~exp(-2 pi sqrt(2x) / step)
_K_NODES = np.arange(0, 27) * _K_STEP  # s in [0, 6.5]: exp(-s^2) < 1e-18 beyond
_K_WEIGHTS = np.where(_K_NODES == 0, 1.0, 2.0) * _K_STEP * np.exp(-(_K_NODES**2))


def _k_series(x):
    """K0 and K1 for 0 < x <= 2 from their power series about 0."""
    t = x * x / 4
    log_half = jnp.log(x / 2)
    term0 = jnp.ones_like(x)  # t^k / k!^2
    term1 = jnp.ones_like(x)  # t^k / (k! (k+1)!)
    i0, i1 = term0, term1
    k0_sum = jnp.zeros_like(x)
    k1_sum = (1 - 2 * _EULER_GAMMA) * term1  # psi(1) + psi(2)
    harmonic = 0.0
    for k in range(1, 18):
        term0 = term0 * t / (k * k)
        term1 = term1 * t / (k * (k + 1))
        harmonic += 1.0 / k
        i0 = i0 + term0
        i1 = i1 + term1
        k0_sum = k0_sum + harmonic * term0
        k1_sum = k1_sum + (2 * harmonic + 1.0 / (k + 1) - 2 * _EULER_GAMMA) * term1
    i1 = i1 * (x / 2)
    k0 = -(log_half + _EULER_GAMMA) * i0 + k0_sum
    k1 = 1 / x + log_half * i1 - (x / 4) * k1_sum
    return k0, k1


def _k_scaled_quadrature(x):
    """exp(x) K0(x) and exp(x) K1(x) for x > 2: with s = sqrt(2x) sinh(t/2),
    exp(x) K_nu(x) = integral over the real line of exp(-s^2) cosh(nu t) / sqrt(2x + s^2),
    where cosh t = 1 + s^2 / x; the trapezoidal rule converges geometrically."""
    s2 = jnp.asarray(_K_NODES**2)
    w = jnp.asarray(_K_WEIGHTS)
    xe = x[..., None]
    base = w / jnp.sqrt(2 * xe + s2)
    return jnp.sum(base, axis=-1), jnp.sum(base * (1 + s2 / xe), axis=-1)


def _modified_k(order: int, scaled: bool):
    """K0 or K1 (``order``), times exp(x) when ``scaled``, with ``_unary``'s arguments."""

    def fn(x, xt):
        small = x <= _K_SERIES_MAX
        series = _k_series(jnp.where(small & (x > 0), x, 1.0))[order]
        quad = _k_scaled_quadrature(jnp.where(small, 4.0, x))[order]
        if scaled:
            out = jnp.where(small, series * jnp.exp(x), quad)
        else:
            out = jnp.where(small, series, quad * jnp.exp(-x))
        return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, out))

    return named(fn, f"_{'scaled_' if scaled else ''}modified_bessel_k{order}")


# ---------------------------------------------------------------------------------
# Airy Ai and the spherical Bessel j0
# ---------------------------------------------------------------------------------

# (Ai(x0), Ai'(x0)) at x0 = -10, ..., 10, evaluated with mpmath at 40 digits.
_AIRY_ANCHORS = np.array(
    [
        (0.04024123848644319, 0.99626504413279),
        (-0.022133721547341403, -0.9756639809263316),
        (-0.0527050503563862, 0.9355609381983065),
        (0.18428083525050565, -0.7710081684101265),
        (-0.3291451736298231, 0.3459354872813429),
        (0.35076100902411433, 0.32719281855444315),
        (-0.07026553294928951, -0.7906285753685813),
        (-0.37881429367765806, 0.3145837692165988),
        (0.22740742820168558, 0.618259020741691),
        (0.5355608832923521, -0.01016056711664521),
        (0.3550280538878172, -0.2588194037928068),
        (0.13529241631288141, -0.1591474412967932),
        (0.03492413042327438, -0.05309038443365363),
        (0.006591139357460719, -0.011912976705951319),
        (0.0009515638512048018, -0.001958640950204179),
        (0.00010834442813607442, -0.0002474138908684625),
        (9.947694360252889e-06, -2.4765200397034955e-05),
        (7.492128863997167e-07, -2.008150894738792e-06),
        (4.6922076160992316e-08, -1.3414392979067865e-07),
        (2.47116843087249e-09, -7.480641389658946e-09),
        (1.1047532552898686e-10, -3.5206336767389237e-10),
    ]
)
_AIRY_TAYLOR_MAX = 10.5
_AIRY_ZERO_ABOVE = 103.892  # PyTorch returns 0 above (Ai underflows there anyway)


def _airy_u(terms: int) -> list[float]:
    """u_k = Gamma(3k + 1/2) / (54^k k! Gamma(k + 1/2)) of Ai's asymptotic expansions."""
    out, acc = [], Fraction(1)
    for k in range(terms):
        out.append(float(acc))
        # u_{k+1} / u_k = (6k+1)(6k+3)(6k+5) / (216 (k+1) (2k+1))
        acc = acc * (6 * k + 1) * (6 * k + 3) * (6 * k + 5) / (216 * (k + 1) * (2 * k + 1))
    return out


_AIRY_U = _airy_u(24)


def _airy_taylor(x):
    """Ai from its Taylor series about the nearest integer x0 in [-10, 10]: the
    coefficients follow from y'' = x y, a_{k+2} = (x0 a_k + a_{k-1}) / ((k+1)(k+2))."""
    x0 = jnp.clip(jnp.round(x), -10, 10)
    h = x - x0
    anchors = jnp.asarray(_AIRY_ANCHORS)[(x0 + 10).astype(jnp.int32)]
    prev, a, b = jnp.zeros_like(x), anchors[..., 0], anchors[..., 1]  # a_{k-1}, a_k, a_{k+1}
    total, power = a, jnp.ones_like(x)
    for k in range(30):
        power = power * h
        total = total + b * power
        prev, a, b = a, b, (x0 * a + prev) / ((k + 1) * (k + 2))
    return total


def _airy_ai(x, xt):
    taylor = jnp.abs(x) < _AIRY_TAYLOR_MAX
    pos = jnp.where(x >= _AIRY_TAYLOR_MAX, x, 20.0)
    neg = jnp.where(x <= -_AIRY_TAYLOR_MAX, x, -20.0)
    # x > 0: Ai = exp(-zeta) / (2 sqrt(pi) x^(1/4)) sum (-1)^k u_k zeta^-k
    zeta = 2.0 / 3.0 * pos * jnp.sqrt(pos)
    series = _horner([(-1) ** k * u for k, u in enumerate(_AIRY_U)], 1 / zeta)
    ai_pos = jnp.exp(-zeta) / (2 * math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(pos))) * series
    # x < 0: Ai = (sin(t) P - cos(t) Q) / (sqrt(pi) |x|^(1/4)), t = zeta + pi/4, with the
    # phase rounded as PyTorch rounds it in the input dtype.
    zeta = 2.0 / 3.0 * -neg * jnp.sqrt(-neg)
    w = 1 / (zeta * zeta)
    p = _horner([(-1) ** k * u for k, u in enumerate(_AIRY_U[0::2])], w)
    q = _horner([(-1) ** k * u for k, u in enumerate(_AIRY_U[1::2])], w) / zeta
    xn = jnp.where(x <= -_AIRY_TAYLOR_MAX, xt, -20.0)
    dt = xt.dtype
    t = _divide(jnp.asarray(-2.0, dt) * xn * jnp.sqrt(-xn), 3.0)
    t = (t + jnp.asarray(0.25, dt) * jnp.asarray(math.pi, dt)).astype(_F64)
    ai_neg = (jnp.sin(t) * p - jnp.cos(t) * q) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(-neg)))
    out = jnp.where(
        taylor, _airy_taylor(jnp.where(taylor, x, 0.0)), jnp.where(x > 0, ai_pos, ai_neg)
    )
    out = jnp.where(x > _AIRY_ZERO_ABOVE, 0.0, out)
    return jnp.where(jnp.isinf(x) | jnp.isnan(x), jnp.nan, out)


def _spherical_bessel_j0(x, xt):
    # sin(x)/x, and its Taylor polynomial below 0.5 (as PyTorch); 0 at +-inf.
    x2 = x * x
    coefs = [1.0] + [(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 7)]
    small = jnp.abs(x) < 0.5
    out = jnp.where(small, _horner(coefs, x2), jnp.sin(x) / jnp.where(small, 1.0, x))
    return jnp.where(jnp.isinf(x), 0.0, out)


def _float32_check(x):
    """The check of J, Y and Ai: ``_dtype_check``, and float64 refused too.

    PyTorch's float64 kernels of these are off by up to 3e-6 just past where they switch
    to their large-argument forms (5 < |x| < 6.1 for J and Y, -2.6 < x < -2.09 for Ai):
    far beyond float64's tolerance, and not reproducible without PyTorch's own
    coefficients.
    """
    if float_result_type(x) == _F64:
        return (
            "float64: PyTorch's kernel is off by up to 3e-6 near the switch to its "
            "asymptotic form (|x| just above 5 for J/Y, -2.6 < x < -2.09 for Ai), "
            "beyond float64 tolerance"
        )
    return _dtype_check(x)


lower(aten.special_airy_ai.default, check=_float32_check)(_unary(_airy_ai))
lower(aten.special_bessel_j0.default, check=_float32_check)(_unary(_bessel_j0))
lower(aten.special_bessel_j1.default, check=_float32_check)(_unary(_bessel_j1))
lower(aten.special_bessel_y0.default, check=_float32_check)(_unary(_bessel_y(0)))
lower(aten.special_bessel_y1.default, check=_float32_check)(_unary(_bessel_y(1)))
lower(aten.special_modified_bessel_i0.default, check=_dtype_check)(
    _unary(_modified_i(jax.scipy.special.i0))
)
lower(aten.special_modified_bessel_i1.default, check=_dtype_check)(
    _unary(_modified_i(jax.scipy.special.i1))
)
lower(aten.special_modified_bessel_k0.default, check=_dtype_check)(
    _unary(_modified_k(0, scaled=False))
)
lower(aten.special_modified_bessel_k1.default, check=_dtype_check)(
    _unary(_modified_k(1, scaled=False))
)
lower(aten.special_scaled_modified_bessel_k0.default, check=_dtype_check)(
    _unary(_modified_k(0, scaled=True))
)
lower(aten.special_scaled_modified_bessel_k1.default, check=_dtype_check)(
    _unary(_modified_k(1, scaled=True))
)
lower(aten.special_spherical_bessel_j0.default, check=_dtype_check)(_unary(_spherical_bessel_j0))


# ---------------------------------------------------------------------------------
# Orthogonal polynomials of a per-element degree
# ---------------------------------------------------------------------------------

_INT64_MIN = np.iinfo(np.int64).min
_HERMITE_LIMIT = {np.dtype(np.float32): 128, _F64: 512}  # above: NaN (PyTorch)


def _degree(n):
    """static_cast<int64_t>(n) as x86 does it: truncation, and INT64_MIN for NaN, +-inf
    and values out of int64's range."""
    ok = jnp.abs(n) < 2.0**63  # False for NaN
    return jnp.where(ok, jnp.trunc(jnp.where(ok, n, 0)).astype(jnp.int64), _INT64_MIN)


def _recurrence(step, p, q, n, run, *, stop_on_nan: bool = True):
    """PyTorch's loop ``for i in 1 .. n-1: r = step(i, p, q); p, q = q, r`` on the
    elements where ``run``, each stopping when its q turns NaN (``!isnan(q)`` in the
    loop condition) unless ``stop_on_nan`` is False. Returns the last r, or q where no
    step ran. The loop runs as long as any element still iterates."""

    def active(i, q):
        a = run & (i < n)
        return a & ~jnp.isnan(q) if stop_on_nan else a

    def cond(state):
        i, _, q = state
        return jnp.any(active(i, q))

    def body(state):
        i, p, q = state
        a = active(i, q)
        r = step(i.astype(q.dtype), p, q)
        return i + 1, jnp.where(a, q, p), jnp.where(a, r, q)

    return jax.lax.while_loop(cond, body, (jnp.asarray(1, jnp.int64), p, q))[2]


def _widened(fn):
    # float32 trigonometry as libm's: XLA's own float32 cos/sin lose accuracy for large
    # arguments (n * acos(x) here), so evaluate in float64 and round once.
    return lambda v: fn(v.astype(_F64)).astype(v.dtype)


_acos, _cos, _sin = _widened(jnp.arccos), _widened(jnp.cos), _widened(jnp.sin)


def _parity(k, even, odd):
    return jnp.where(k % 2 == 0, even, odd)


def _chebyshev(kind: str, shifted: bool):
    """Chebyshev T, U, V, W of x, or of y = 2x - 1 for the shifted ones."""
    # PyTorch switches to the closed form for degrees above these (inside (-1, 1)).
    degrees = {"T": 6, "U": 6, "V": 6, "W": 4} if shifted else {"T": 6, "U": 8, "V": 8, "W": 8}
    closed_above = degrees[kind]

    def poly(x, k):
        one = jnp.ones_like(x)
        y = x + x - 1 if shifted else x
        ay = jnp.abs(y)
        nt, n1, n21 = k.astype(x.dtype), (k + 1).astype(x.dtype), (k + k + 1).astype(x.dtype)
        # Values at the ends of [-1, 1]: x == 1 / x == 0 for the shifted polynomials.
        top = (x == 1) if shifted else (ay == 1) & (x > 0)
        bottom = (x == 0) if shifted else (ay == 1) & (x < 0)
        at_top = {"T": one, "U": n1, "V": one, "W": n21}[kind]
        at_bottom = {
            "T": _parity(k, one, -one),
            "U": _parity(k, n1, -n1),
            "V": _parity(k, n21, -n21),
            "W": _parity(k, one, -one),
        }[kind]
        closed = (k > closed_above) & (ay < 1)
        theta = _acos(jnp.where(closed, y, 0))
        if kind == "T":
            closed_value = _cos(nt * theta)
        elif kind == "U":
            s = _sin(theta)
            closed_value = jnp.where(
                s != 0,
                _sin(n1 * theta) / jnp.where(s != 0, s, 1),
                n1 * _cos(n1 * theta) / y,
            )
        elif kind == "V":
            half = theta / 2
            closed_value = jnp.where(
                _sin(half) != 1, _cos((nt + 0.5) * theta) / _cos(half), at_bottom
            )
        else:
            half = theta / 2
            ends = jnp.where(y > 0, n21, at_bottom) if not shifted else at_bottom
            closed_value = jnp.where(
                _cos(half) != 1,
                _sin((nt + 0.5) * theta) / jnp.where(_cos(half) != 1, _sin(half), 1),
                ends,
            )
        first = {"T": y, "U": y + y, "V": y + y - 1, "W": y + y + 1}[kind]
        run = (k >= 2) & ~top & ~bottom & ~closed
        rec = _recurrence(lambda i, p, q: (y + y) * q - p, one, first, k, run)
        out = jnp.where(k == 1, first, jnp.where(k == 0, one, rec))
        out = jnp.where(closed, closed_value, out)
        out = jnp.where(top, at_top, jnp.where(bottom, at_bottom, out))
        return jnp.where(k < 0, 0, out)

    return named(poly, f"_{'shifted_' if shifted else ''}chebyshev_{kind.lower()}")


def _hermite_h(x, k):
    one = jnp.ones_like(x)
    limit = _HERMITE_LIMIT[np.dtype(x.dtype)]
    run = (k >= 2) & (k <= limit)
    rec = _recurrence(
        lambda i, p, q: (x + x) * q - (i + i) * p, one, x + x, k, run, stop_on_nan=False
    )
    out = jnp.where(k > limit, jnp.nan, rec)
    out = jnp.where(k == 1, x + x, jnp.where(k == 0, one, out))
    return jnp.where(k < 0, 0, out)


def _hermite_he(x, k):
    one = jnp.ones_like(x)
    limit = _HERMITE_LIMIT[np.dtype(x.dtype)]
    run = (k >= 2) & (k <= limit)
    rec = _recurrence(lambda i, p, q: x * q - i * p, one, x, k, run, stop_on_nan=False)
    out = jnp.where(k > limit, jnp.nan, rec)
    out = jnp.where(k == 1, x, jnp.where(k == 0, one, out))
    return jnp.where(k < 0, 0, out)


def _laguerre_l(x, k):
    one = jnp.ones_like(x)
    run = (k >= 2) & (x != 0)
    step = lambda i, p, q: _divide((i + i + (1 - x)) * q - i * p, i + 1)  # noqa: E731
    rec = _recurrence(step, one, 1 - x, k, run)
    out = jnp.where(k == 1, 1 - x, jnp.where(k == 0, one, rec))
    return jnp.where(k < 0, 0, jnp.where(x == 0, one, out))


def _legendre_p(x, k):
    one = jnp.ones_like(x)
    ends = jnp.abs(x) == 1
    run = (k >= 2) & ~ends
    step = lambda i, p, q: _divide((i + i + 1) * x * q - i * p, i + 1)  # noqa: E731
    rec = _recurrence(step, one, x, k, run)
    out = jnp.where(k == 1, x, jnp.where(k == 0, one, rec))
    out = jnp.where(ends, jnp.where((x > 0) | (k % 2 == 0), one, -one), out)
    return jnp.where(k < 0, 0, out)


def _polynomial(fn):
    """A rule computing ``fn(x, degree)`` in the result dtype, both broadcast."""

    def rule(x, n):
        dt = float_result_type(x, n)
        x, n = jnp.broadcast_arrays(as_dtype(x, dt), as_dtype(n, dt))
        return fn(x, _degree(n)).astype(dt)

    return named(rule, fn.__name__)


lower(
    aten.special_chebyshev_polynomial_t.default,
    aten.special_chebyshev_polynomial_t.x_scalar,
    aten.special_chebyshev_polynomial_t.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("T", shifted=False)))

lower(
    aten.special_chebyshev_polynomial_u.default,
    aten.special_chebyshev_polynomial_u.x_scalar,
    aten.special_chebyshev_polynomial_u.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("U", shifted=False)))

lower(
    aten.special_chebyshev_polynomial_v.default,
    aten.special_chebyshev_polynomial_v.x_scalar,
    aten.special_chebyshev_polynomial_v.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("V", shifted=False)))

lower(
    aten.special_chebyshev_polynomial_w.default,
    aten.special_chebyshev_polynomial_w.x_scalar,
    aten.special_chebyshev_polynomial_w.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("W", shifted=False)))

lower(
    aten.special_shifted_chebyshev_polynomial_t.default,
    aten.special_shifted_chebyshev_polynomial_t.x_scalar,
    aten.special_shifted_chebyshev_polynomial_t.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("T", shifted=True)))

lower(
    aten.special_shifted_chebyshev_polynomial_u.default,
    aten.special_shifted_chebyshev_polynomial_u.x_scalar,
    aten.special_shifted_chebyshev_polynomial_u.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("U", shifted=True)))

lower(
    aten.special_shifted_chebyshev_polynomial_v.default,
    aten.special_shifted_chebyshev_polynomial_v.x_scalar,
    aten.special_shifted_chebyshev_polynomial_v.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("V", shifted=True)))

lower(
    aten.special_shifted_chebyshev_polynomial_w.default,
    aten.special_shifted_chebyshev_polynomial_w.x_scalar,
    aten.special_shifted_chebyshev_polynomial_w.n_scalar,
    check=_dtype_check,
)(_polynomial(_chebyshev("W", shifted=True)))

lower(
    aten.special_hermite_polynomial_h.default,
    aten.special_hermite_polynomial_h.x_scalar,
    aten.special_hermite_polynomial_h.n_scalar,
    check=_dtype_check,
)(_polynomial(_hermite_h))

lower(
    aten.special_hermite_polynomial_he.default,
    aten.special_hermite_polynomial_he.x_scalar,
    aten.special_hermite_polynomial_he.n_scalar,
    check=_dtype_check,
)(_polynomial(_hermite_he))

lower(
    aten.special_laguerre_polynomial_l.default,
    aten.special_laguerre_polynomial_l.x_scalar,
    aten.special_laguerre_polynomial_l.n_scalar,
    check=_dtype_check,
)(_polynomial(_laguerre_l))

lower(
    aten.special_legendre_polynomial_p.default,
    aten.special_legendre_polynomial_p.x_scalar,
    aten.special_legendre_polynomial_p.n_scalar,
    check=_dtype_check,
)(_polynomial(_legendre_p))

"""Random ops, drawn from JAX's counter-based PRNG with keys seeded by PyTorch's RNG.

Design:

- A JAX partition that contains random ops takes a leading int64 seed. The runtime
  (``runtime/compiled.py``) draws that seed from PyTorch's default CPU generator on
  every call (one ``torch.randint``), so ``torch.manual_seed(s)`` makes a compiled
  program reproducible run after run, and successive calls draw different numbers.
- Inside the partition every random node gets its own key,
  ``fold_in(key(seed), node_index)`` (``lowering/interpreter.py``); each rule here is a
  pure function of that ``key`` and its arguments.
- The numbers are **not** bitwise those of eager PyTorch: PyTorch's CPU generator is a
  Mersenne Twister consumed element by element, JAX's is threefry. Distributions are
  the same (uniform on [from, to), standard normal, Bernoulli(p), dropout keeping each
  element with probability 1-p and scaling it by 1/(1-p)), the streams are not. A
  compiled model with dropout therefore matches eager in distribution, not in value;
  compare such models with p=0 (exact) or statistically (p>0).
- Each call advances PyTorch's generator by one draw per random partition, not by the
  number of random elements eager would have consumed, so eager code that runs after a
  compiled call sees a different (but still seeded, deterministic) stream than it would
  after the eager call.
- Training: aot_autograd saves the forward's dropout mask for the backward graph
  (``native_dropout_backward`` decomposes to ``grad * mask * scale``), so the backward
  never draws random numbers and always uses the forward's mask.
- Bits come from threefry in its sequential (non-"partitionable") form, set per rule
  with ``jax.threefry_partitionable(False)`` while tracing (no global JAX setting
  changes). On CPU a compiled dropout of 2M elements measured 1.2-1.5x faster than
  with the partitionable form (noisy shared machine); single-device partitions do
  not need the shardable variant.
- Explicit ``torch.Generator`` arguments stay with PyTorch: Dynamo breaks the graph
  at them today (the op runs eagerly with that generator), and should such a node
  reach us, its rule's check refuses it, since only the default generator seeds keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import checks
from dynajax.lowering.dtypes import default_float, is_complex, is_floating
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _generator_check(*args, generator=None, **kwargs):
    if generator is not None:
        return "an explicit torch.Generator (dynajax seeds from the default generator only)"
    return None


def _kind(dtype) -> str:
    d = np.dtype(dtype)
    if d == np.bool_:
        return "bool"
    return "complex" if is_complex(d) else "float" if is_floating(d) else "int"


def _kinds_check(*kinds: str):
    """A check accepting tensors of the given kinds (float, complex, int, bool) only:
    eager raises for the others (exponential_ of an int tensor, bernoulli_ of a complex
    one), and so must the compiled program. Explicit generators are refused too."""

    def check(x, *args, generator=None, **kwargs):
        if generator is not None or any(isinstance(a, torch.Generator) for a in args):
            return _generator_check(generator=True)
        kind = _kind(x.dtype)
        if kind not in kinds:
            return f"a {np.dtype(x.dtype).name} tensor (eager raises)"
        return None

    return check


_FLOAT_OR_COMPLEX = _kinds_check("float", "complex")
_FLOAT = _kinds_check("float")


def _float_dtype(dtype, like=None):
    if dtype is not None:
        return dtype
    return like.dtype if like is not None else default_float()


def _sequential():
    return jax.threefry_partitionable(False)


def _real_part_dtype(dtype):
    return np.dtype(np.float64) if dtype == np.complex128 else np.dtype(np.float32)


def _uniform(key, shape, dtype, low=0.0, high=1.0):
    # Sample in at least float32 so half-precision results have full resolution, then
    # clamp below ``high`` (rounding to half precision could otherwise reach it).
    if is_complex(dtype):  # as PyTorch: real and imaginary parts each uniform
        u = _uniform(key, (*shape, 2), _real_part_dtype(dtype), low, high)
        return jax.lax.complex(u[..., 0], u[..., 1]).astype(dtype)
    wide = np.float64 if dtype == np.float64 else np.float32
    with _sequential():
        u = jax.random.uniform(key, tuple(shape), wide, low, high)
    out = u.astype(dtype)
    return jnp.where(out >= jnp.asarray(high, dtype), jnp.asarray(low, dtype), out)


def _normal(key, shape, dtype):
    if is_complex(dtype):  # as PyTorch: unit variance, each part N(0, 1/2)
        z = _normal(key, (*shape, 2), _real_part_dtype(dtype)) * np.sqrt(0.5)
        return jax.lax.complex(z[..., 0], z[..., 1]).astype(dtype)
    wide = np.float64 if dtype == np.float64 else np.float32
    with _sequential():
        return jax.random.normal(key, tuple(shape), wide).astype(dtype)


# ---------------------------------------------------------------------------------
# Factories: rand, randn, randint, randperm (and their _like forms)
# ---------------------------------------------------------------------------------


@lower(aten.rand.default, needs_key=True)
def _rand(size, *, dtype=None, layout=None, device=None, pin_memory=None, key):
    return _uniform(key, size, _float_dtype(dtype))


@lower(aten.randn.default, needs_key=True)
def _randn(size, *, dtype=None, layout=None, device=None, pin_memory=None, key):
    return _normal(key, size, _float_dtype(dtype))


@lower(aten.rand_like.default, needs_key=True)
def _rand_like(
    x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key
):
    return _uniform(key, x.shape, _float_dtype(dtype, x))


@lower(aten.randn_like.default, needs_key=True)
def _randn_like(
    x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key
):
    return _normal(key, x.shape, _float_dtype(dtype, x))


def _randint(key, low, high, shape, dtype):
    draw = np.int32 if dtype == np.bool_ else np.int64 if is_floating(dtype) else dtype
    with _sequential():
        return jax.random.randint(key, tuple(shape), low, high, draw).astype(dtype)


@lower(aten.randint.default, needs_key=True)
def _randint_high(high, size, *, dtype=np.int64, layout=None, device=None, pin_memory=None, key):
    return _randint(key, 0, high, size, np.int64 if dtype is None else dtype)


@lower(aten.randint.low, needs_key=True)
def _randint_low(
    low, high, size, *, dtype=np.int64, layout=None, device=None, pin_memory=None, key
):
    return _randint(key, low, high, size, np.int64 if dtype is None else dtype)


@lower(aten.randint_like.default, needs_key=True)
def _randint_like(
    x, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key
):
    return _randint(key, 0, high, x.shape, x.dtype if dtype is None else dtype)


@lower(aten.randint_like.low_dtype, needs_key=True)
def _randint_like_low(
    x, low, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key
):
    return _randint(key, low, high, x.shape, x.dtype if dtype is None else dtype)


@lower(aten.randperm.default, needs_key=True)
def _randperm(n, *, dtype=np.int64, layout=None, device=None, pin_memory=None, key):
    with _sequential():
        perm = jax.random.permutation(key, n)
    return perm.astype(np.int64 if dtype is None else dtype)


# ---------------------------------------------------------------------------------
# Distributions of a given shape: uniform, normal, bernoulli, exponential
# ---------------------------------------------------------------------------------


@lower(aten.uniform.default, check=_FLOAT_OR_COMPLEX, needs_key=True)
def _uniform_op(x, low=0.0, high=1.0, *, generator=None, key):
    checks.fail_if(
        low > high,
        RuntimeError,
        "uniform_ expects to return a [from, to) range, but found from={low} > to={high}",
        low=float(low),
        high=float(high),
    )
    return _uniform(key, x.shape, x.dtype, low, high)


@lower(aten.normal_functional.default, check=_FLOAT_OR_COMPLEX, needs_key=True)
def _normal_functional(x, mean=0.0, std=1.0, *, generator=None, key):
    # A complex tensor gets N(mean, std^2 / 2) in each part (PyTorch fills its real view
    # with std / sqrt(2)): the mean shifts the imaginary part too.
    shift = complex(mean, mean) if is_complex(x.dtype) else mean
    return (
        _normal(key, x.shape, x.dtype) * jnp.asarray(std, x.dtype) + jnp.asarray(shift, x.dtype)
    ).astype(x.dtype)


@lower(aten.normal.Tensor_float, check=_FLOAT_OR_COMPLEX, needs_key=True)
def _normal_tensor_float(mean, std=1.0, *, generator=None, key):
    return (mean + _normal(key, mean.shape, mean.dtype) * jnp.asarray(std, mean.dtype)).astype(
        mean.dtype
    )


def _check_std(std):
    checks.fail_if(~(std >= 0), RuntimeError, "normal expects all elements of std >= 0.0")


@lower(aten.normal.float_Tensor, check=_generator_check, needs_key=True)
def _normal_float_tensor(mean, std, *, generator=None, key):
    _check_std(std)
    return (_normal(key, std.shape, std.dtype) * std + jnp.asarray(mean, std.dtype)).astype(
        std.dtype
    )


@lower(aten.normal.Tensor_Tensor, check=_FLOAT_OR_COMPLEX, needs_key=True)
def _normal_tensor_tensor(mean, std, *, generator=None, key):
    _check_std(std)
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    dtype = jnp.result_type(mean.dtype, std.dtype)
    return (mean + _normal(key, shape, dtype) * std).astype(dtype)


@lower(aten.normal.float_float, check=_generator_check, needs_key=True)
def _normal_float_float(
    mean, std, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key
):
    dtype = _float_dtype(dtype)
    return (_normal(key, size, dtype) * jnp.asarray(std, dtype) + jnp.asarray(mean, dtype)).astype(
        dtype
    )


@lower(aten.bernoulli.p, check=_kinds_check("float", "int", "bool"), needs_key=True)
def _bernoulli_p(x, p=0.5, *, generator=None, key):
    checks.fail_if(
        not 0 <= p <= 1,
        RuntimeError,
        "bernoulli_ expects p to be in [0, 1], but got p={p}",
        p=float(p),
    )
    return (_uniform(key, x.shape, np.float32) < p).astype(x.dtype)


def _check_probability(p):
    checks.fail_if(
        ~((p >= 0) & (p <= 1)),
        RuntimeError,
        "Expected p_in >= 0 && p_in <= 1 to be true, but got false.  (Could this error "
        "message be improved?  If so, please report an enhancement request to PyTorch.)",
    )


# Kept whole by the aot stage (aot.table.CHECKED_KERNELS), for this check.
@lower(aten.bernoulli.default, check=_FLOAT, needs_key=True)
def _bernoulli(x, *, generator=None, key):
    _check_probability(x)
    wide = np.float64 if x.dtype == np.float64 else np.float32
    return (_uniform(key, x.shape, wide) < x.astype(wide)).astype(x.dtype)


@lower(aten.bernoulli.Tensor, check=_kinds_check("float", "int", "bool"), needs_key=True)
def _bernoulli_tensor(x, p, *, generator=None, key):
    _check_probability(p)
    wide = np.float64 if p.dtype == np.float64 else np.float32
    u = _uniform(key, x.shape, wide)
    return (u < jnp.broadcast_to(p, x.shape).astype(wide)).astype(x.dtype)


@lower(aten.log_normal.default, check=_FLOAT, needs_key=True)
def _log_normal(x, mean=1.0, std=2.0, *, generator=None, key):
    wide = np.float64 if x.dtype == np.float64 else np.float32
    return jnp.exp(_normal(key, x.shape, wide) * std + mean).astype(x.dtype)


@lower(aten.cauchy.default, check=_FLOAT, needs_key=True)
def _cauchy(x, median=0.0, sigma=1.0, *, generator=None, key):
    wide = np.float64 if x.dtype == np.float64 else np.float32
    u = _uniform(key, x.shape, wide)
    return (median + sigma * jnp.tan(np.pi * (u - 0.5))).astype(x.dtype)


@lower(aten.geometric.default, check=_kinds_check("float", "int"), needs_key=True)
def _geometric(x, p, *, generator=None, key):
    # Trials up to and including the first success: ceil(log(u) / log(1 - p)), u in (0, 1].
    wide = np.float64 if x.dtype == np.float64 else np.float32
    u = 1 - _uniform(key, x.shape, wide)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p)).astype(x.dtype)


@lower(aten.poisson.default, check=_FLOAT, needs_key=True)
def _poisson(rates, generator=None, *, key):
    checks.fail_if(
        ~(rates >= 0), RuntimeError, "invalid Poisson rate, expected rate to be non-negative"
    )
    with _sequential():
        counts = jax.random.poisson(key, rates, rates.shape, np.int64)
    return counts.astype(rates.dtype)


@lower(aten.exponential.default, check=_FLOAT, needs_key=True)
def _exponential(x, lambd=1.0, *, generator=None, key):
    wide = np.float64 if x.dtype == np.float64 else np.float32
    u = _uniform(key, x.shape, wide)
    return (-jnp.log1p(-u) / lambd).astype(x.dtype)


# ---------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------


def _dropout_check(x, p, train):
    if train and p not in (0, 1) and not is_floating(x.dtype):
        return "dropout of a non-floating tensor"
    return None


@lower(aten.native_dropout.default, check=_dropout_check, needs_key=True)
def _native_dropout(x, p, train, *, key):
    """Keeps each element with probability 1-p, scaled by 1/(1-p); returns the mask too.

    The mask is what the backward graph multiplies the gradient by (aot_autograd saves
    it), so forward and backward always agree.
    """
    if not train or p == 0:
        return x, jnp.ones(x.shape, np.bool_)
    if p == 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, np.bool_)
    keep = _uniform(key, x.shape, np.float32) >= p
    # PyTorch's order (input * mask) * scale, so dropped infinities give NaN as in eager.
    return (x * keep.astype(x.dtype)) * jnp.asarray(1.0 / (1.0 - p), x.dtype), keep


# ---------------------------------------------------------------------------------
# Sampling from given weights: multinomial
# ---------------------------------------------------------------------------------


def _multinomial_check(probs, num_samples, replacement=False, *, generator=None):
    if generator is not None:
        return _generator_check(generator=generator)
    if not is_floating(probs.dtype):
        return f"multinomial of {np.dtype(probs.dtype).name} weights (eager raises)"
    if probs.ndim not in (1, 2):
        return "multinomial of weights that are not 1-D or 2-D (eager raises)"
    if num_samples <= 0:
        return "multinomial of num_samples <= 0 (eager raises)"
    if not replacement and num_samples > probs.shape[-1]:
        return "multinomial without replacement of more samples than categories (eager raises)"
    return None


_INVALID = "invalid multinomial distribution"


def _check_weights(rows, *, sampled_whole):
    """Eager's checks of multinomial's weights (rows of a 2-D array), in its order.

    Drawing one sample, or without replacement, eager checks the whole tensor first
    (no NaN, inf or negative weight), then that no row sums to zero. Drawing several
    with replacement, its kernel walks row by row, weight by weight: the first weight
    that is negative or NaN, or else infinite, or else a row that sums to zero, raises
    its own message. Here each row gets the code of its first failure (1, 2, 3), and
    the first failing row's code picks the message.
    """
    if not sampled_whole:
        checks.fail_if(
            ~jnp.isfinite(rows) | (rows < 0),
            RuntimeError,
            "probability tensor contains either `inf`, `nan` or element < 0",
        )
        checks.fail_if(
            jnp.sum(rows, axis=-1) <= 0, RuntimeError, f"{_INVALID} (sum of probabilities <= 0)"
        )
        return
    each = jnp.where(~(rows >= 0), 1, jnp.where(~jnp.isfinite(rows), 2, 0))
    first = jnp.take_along_axis(each, jnp.argmax(each != 0, axis=-1)[:, None], -1)[:, 0]
    row = jnp.where(first != 0, first, jnp.where(jnp.sum(rows, axis=-1) <= 0, 3, 0))
    code = row[jnp.argmax(row != 0)] if row.size else jnp.zeros((), row.dtype)
    checks.fail_if(code == 1, RuntimeError, f"{_INVALID} (encountering probability entry < 0)")
    checks.fail_if(
        code == 2, RuntimeError, f"{_INVALID} (encountering probability entry = infinity or NaN)"
    )
    checks.fail_if(code == 3, RuntimeError, f"{_INVALID} (sum of probabilities <= 0)")


@lower(aten.multinomial.default, check=_multinomial_check, needs_key=True)
def _multinomial(probs, num_samples, replacement=False, *, generator=None, key):
    """Category indices drawn in proportion to each row's (unnormalized) weights.

    Gumbel-max: argmax(log w + g) with g standard Gumbel is category i with probability
    w_i / sum(w); the top k of the same perturbed logits are k draws without
    replacement (PyTorch's CPU kernel uses the equivalent exponential race,
    top k of w / q with q ~ Exp(1)). Zero weights are never drawn. Weights that are
    negative, infinite or NaN, and rows that sum to zero, raise eager's errors (value
    checks, in eager's order).
    """
    wide = np.float64 if probs.dtype == np.float64 else np.float32
    rows = probs.reshape(-1, probs.shape[-1]).astype(wide)
    if checks.checking():
        _check_weights(rows, sampled_whole=replacement and num_samples > 1)
    logits = jnp.log(rows)
    with _sequential():
        if replacement:
            shape = (rows.shape[0], num_samples, rows.shape[1])
            g = jax.random.gumbel(key, shape, wide)
            idx = jnp.argmax(logits[:, None, :] + g, axis=-1)
        else:
            g = jax.random.gumbel(key, rows.shape, wide)
            _, idx = jax.lax.top_k(logits + g, num_samples)
    return idx.astype(np.int64).reshape(*probs.shape[:-1], num_samples)


# ---------------------------------------------------------------------------------
# Randomized leaky ReLU
# ---------------------------------------------------------------------------------


@lower(aten.rrelu_with_noise_functional.default, check=_generator_check, needs_key=True)
def _rrelu_with_noise_functional(
    x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key
):
    """(output, noise): the functional form of rrelu_with_noise_.

    Training, as PyTorch's CPU kernel: each element x <= 0 gets its own slope drawn
    uniformly from [lower, upper] (output x * slope, noise slope); the others pass
    through (noise 1; NaN compares false, so NaN passes through too). Evaluation: a
    leaky ReLU with the mean slope, noise returned untouched.
    """
    if not training:
        slope = jnp.asarray((lower + upper) / 2, x.dtype)
        return jnp.where(x > 0, x, x * slope), noise
    wide = np.float64 if x.dtype == np.float64 else np.float32
    with _sequential():
        r = jax.random.uniform(key, x.shape, wide, lower, upper).astype(x.dtype)
    neg = x <= 0
    return jnp.where(neg, x * r, x), jnp.where(neg, r, jnp.ones_like(r)).astype(noise.dtype)

"""Neural-network ops: normalization, activations, embedding, losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import checks
from dynajax.lowering.dtypes import as_dtype, eager_is_on_cuda, opmath
from dynajax.lowering.elementwise import eager_maximum, eager_minimum
from dynajax.lowering.linalg.products import pnorm
from dynajax.lowering.registry import lower

aten = torch.ops.aten

# ---------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------


@lower(aten.gelu.default)
def _gelu(x, *, approximate="none"):
    if approximate != "tanh":
        return jax.nn.gelu(x, approximate=False)
    # 0.5 * x * (1 + tanh(z)) as x * sigmoid(2z): the same function, without the
    # cancellation of 1 + tanh(z) for negative x, where XLA's tanh lost up to 1% of the
    # value (x = -4.38) and gave 0 where eager gives -3e-7 (x = -5). Half types are
    # computed in float32, as eager's kernel does.
    xf = x.astype(_stat_dtype(x))
    z = _GELU_K * (xf + 0.044715 * xf * xf * xf)
    return (xf * jax.nn.sigmoid(2 * z)).astype(x.dtype)


_GELU_K = float(np.sqrt(2 / np.pi))


@lower(aten.silu.default)
def _silu(x):
    return jax.nn.silu(x)


@lower(aten.elu.default)
def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    neg = alpha * jnp.expm1(x * input_scale)
    return (jnp.where(x > 0, x, neg) * scale).astype(x.dtype)


@lower(aten.leaky_relu.default)
def _leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * as_dtype(negative_slope, x.dtype))


@lower(aten.hardtanh.default)
def _hardtanh(x, min_val=-1.0, max_val=1.0):
    # Eager's clamp: x kept where it equals a bound (hardtanh(-0.0, 0.0, 6.0) is -0.0).
    lo = eager_maximum(x, as_dtype(min_val, x.dtype))
    return eager_minimum(lo, as_dtype(max_val, x.dtype))


@lower(aten.softplus.default)
def _softplus(x, beta=1, threshold=20):
    bx = x * beta
    return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta).astype(x.dtype)


# ---------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------


def _stat_dtype(x):
    # PyTorch keeps statistics of half-precision inputs in float32.
    return np.float32 if x.dtype in (np.float16, jnp.bfloat16) else x.dtype


def _shifted_mean(x, axis):
    """The mean over ``axis`` of ``x`` shifted by one of its own elements per row.

    Summing values far from zero relative to their spread (a row of 2 +- 0.05) loses the
    spread's low bits; eager's row-wise moments (Welford, in cascades) keep them, and a
    layer norm multiplies that error by ``rstd`` and the weight (5e-4 in float32 at
    weight 100 where eager was exact to 1e-6). Shifted by the row's first element the
    summands are the spread itself, and the shift is added back exactly once.
    """
    if any(x.shape[d] == 0 for d in axis):
        return jnp.mean(x, axis=axis, keepdims=True)
    first = x[tuple(slice(0, 1) if d in axis else slice(None) for d in range(x.ndim))]
    finite = jnp.isfinite(first)
    shift = jnp.where(finite, first, jnp.zeros_like(first))
    return shift + jnp.mean(x - shift, axis=axis, keepdims=True)


@lower(aten.native_layer_norm.default)
def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    axis = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(_stat_dtype(x))
    mean = _shifted_mean(xf, axis)
    var = jnp.mean(jnp.square(xf - mean), axis=axis, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = (xf - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


def _channel_shape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _bn_apply(x, mean, invstd, weight, bias):
    """As eager's CPU kernel: ``x * alpha + beta`` per channel, with ``alpha = invstd *
    weight`` and ``beta = bias - mean * alpha``. ``(x - mean) * invstd * weight + bias``
    rounds otherwise (half the elements an ulp apart), and differs on infinities: with a
    weight of -inf, eager's ``x * alpha + beta`` is NaN where ``x * alpha`` is +inf."""
    shape = _channel_shape(x)
    wide = opmath(jnp.result_type(x, mean, invstd))  # (float32 for half types, as eager)
    alpha = invstd.astype(wide) if weight is None else invstd.astype(wide) * weight.astype(wide)
    beta = -mean.astype(wide) * alpha
    if bias is not None:
        beta = bias.astype(wide) + beta
    out = x.astype(wide) * alpha.reshape(shape) + beta.reshape(shape)
    return out.astype(x.dtype)


def _running_invstd(running_var, eps):
    # Eager's: 1 / sqrt(var + eps) in the opmath type (rsqrt is an ulp off on some).
    return 1 / jnp.sqrt(running_var.astype(opmath(running_var.dtype)) + eps)


@lower(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    invstd = _running_invstd(running_var, eps)
    out = _bn_apply(x, running_mean, invstd, weight, bias)
    return out, *_saved_stats(x, None, None, False, (running_mean, invstd))


def _saved_stats(x, mean, invstd, training, running=None):
    """The saved mean/invstd as eager's kernel for the device returns them. The CPU's:
    in the input's dtype, and empty (shape (0,)) in evaluation mode. CUDA's: in float32
    for half-precision inputs, and in evaluation mode one per channel too (``running``:
    the running mean and its invstd, which is what PyTorch's decomposition gives; the
    kernel leaves them unwritten, and nothing reads them)."""
    if eager_is_on_cuda():
        if not training:
            mean, invstd = running
        return mean.astype(_stat_dtype(x)), invstd.astype(_stat_dtype(x))
    if not training:
        return jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype)
    return mean.astype(x.dtype), invstd.astype(x.dtype)


def _running_dtype(x, running):
    # PyTorch's meta kernel computes updated running stats of a half-precision input in
    # float32 and returns them so; the graph around this node was traced with that.
    return np.dtype(np.float32) if x.dtype in (np.float16, jnp.bfloat16) else running.dtype


def _batch_stats(x, eps):
    axis = (0, *range(2, x.ndim))
    xf = x.astype(_stat_dtype(x))
    mean = jnp.mean(xf, axis=axis)
    var = jnp.var(xf, axis=axis)
    n = x.size // x.shape[1]
    return mean, var, jax.lax.rsqrt(var + eps), n


def _bn_inplace_check(x, weight, bias, running_mean, running_var, training, *_):
    if training and running_mean is not None:
        return (
            "training mode updates running stats in place "
            "(functional graphs use the _functional variant)"
        )
    return None


@lower(aten._native_batch_norm_legit.default, check=_bn_inplace_check)
def _batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    mean, var, invstd, n = _batch_stats(x, eps)
    if not training:
        invstd_r = _running_invstd(running_var, eps)
        out = _bn_apply(x, running_mean, invstd_r, weight, bias)
        return out, *_saved_stats(x, mean, invstd, training, (running_mean, invstd_r))
    return _bn_apply(x, mean, invstd, weight, bias), *_saved_stats(x, mean, invstd, training)


@lower(aten._native_batch_norm_legit_functional.default)
def _batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    mean, var, invstd, n = _batch_stats(x, eps)
    rd = _running_dtype(x, running_mean)
    if not training:
        invstd_r = _running_invstd(running_var, eps)
        out = _bn_apply(x, running_mean, invstd_r, weight, bias)
        saved = _saved_stats(x, mean, invstd, training, (running_mean, invstd_r))
        return out, *saved, running_mean.astype(rd), running_var.astype(rd)
    out = _bn_apply(x, mean, invstd, weight, bias)
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean.astype(rd) + momentum * mean.astype(rd)
    new_var = (1 - momentum) * running_var.astype(rd) + momentum * unbiased.astype(rd)
    saved = _saved_stats(x, mean, invstd, training)
    return out, *saved, new_mean.astype(rd), new_var.astype(rd)


@lower(aten._batch_norm_with_update_functional.default)
def _batch_norm_with_update_functional(x, weight, bias, running_mean, running_var, momentum, eps):
    """Training-mode batch norm (the functional form of _batch_norm_with_update):
    (out, save_mean, save_invstd, reserve, new running_mean, new running_var). The
    reserve is the CPU kernel's empty uint8 buffer (only cuDNN fills one)."""
    out = _batch_norm_functional(x, weight, bias, running_mean, running_var, True, momentum, eps)
    reserve = jnp.zeros((0,), np.uint8)
    return *out[:3], reserve, *out[3:]


@lower(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    mean, var, invstd, n = _batch_stats(x, eps)
    return _bn_apply(x, mean, invstd, weight, bias), *_saved_stats(x, mean, invstd, True)


@lower(aten.native_group_norm.default)
def _native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    """As eager's CPU kernel: per sample and group, ``rstd = 1 / sqrt(var + eps)``; then
    per sample and channel ``x * alpha + beta``, ``alpha = rstd * weight``, ``beta =
    bias - alpha * mean``. ``(x - mean) * rstd * weight + bias`` rounded otherwise (478
    of 840 float32 elements an ulp apart; 331 now, whose mean and variance are summed in
    another order), and with a weight of -inf gave +inf where eager's ``x * alpha +
    beta`` is NaN (fuzz seed 9)."""
    wide = _stat_dtype(x)
    # Explicit sizes: with N == 0 a -1 in the reshape would be ambiguous.
    xf = x.astype(wide).reshape(N, group, (C // group) * HxW)
    mean = jnp.mean(xf, axis=-1)
    var = jnp.var(xf, axis=-1)
    rstd = 1 / jnp.sqrt(var + eps)
    alpha = jnp.repeat(rstd, C // group, axis=1)  # (N, C)
    if weight is not None:
        alpha = alpha * weight.astype(wide)
    beta = -alpha * jnp.repeat(mean, C // group, axis=1)
    if bias is not None:
        beta = beta + bias.astype(wide)
    out = x.astype(wide).reshape(N, C, HxW) * alpha[..., None] + beta[..., None]
    return out.reshape(x.shape).astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


# ---------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------


@lower(aten.embedding.default)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    checks.fail_if_out_of_bounds(
        indices, weight.shape[0], IndexError, "index out of range in self", negative=False
    )
    return jnp.take(weight, indices, axis=0)


@lower(aten.embedding_renorm.default)
def _embedding_renorm(weight, indices, max_norm, norm_type):
    # ``embedding(..., max_norm=)``: each row the indices reference whose p-norm exceeds
    # max_norm is scaled by max_norm / (norm + 1e-7). The kernel takes the row's norm
    # in the weight's dtype (computed in float32 for the half types) as a double,
    # computes the scale in double, rounds it to the weight's dtype and multiplies.
    if checks.checking():
        # Eager selects the rows in ascending order of index (negative ones wrap): the
        # smallest index out of range is the one it reports.
        bad = checks.out_of_bounds(indices, weight.shape[0], negative=True)
        big = np.iinfo(indices.dtype).max
        checks.fail_if(
            bad,
            IndexError,
            "select(): index {value} out of range for tensor of size [{rows}, {cols}] "
            "at dimension 0",
            value=jnp.min(jnp.where(bad, indices, big), initial=big),
            rows=weight.shape[0],
            cols=weight.shape[1],
        )
    dtype = weight.dtype
    compute = opmath(dtype)
    rows = weight.astype(compute)
    norm = pnorm(rows, norm_type, axis=-1).astype(dtype).astype(np.float64)
    hit = jnp.zeros(weight.shape[:1], bool).at[indices.reshape(-1)].set(True)
    scale = (max_norm / (norm + 1e-7)).astype(dtype).astype(compute)
    scaled = (rows * scale[:, None]).astype(dtype)
    return jnp.where((hit & (norm > max_norm))[:, None], scaled, weight)


_MODE_SUM, _MODE_MEAN, _MODE_MAX = 0, 1, 2


def _embedding_bag_check(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    if indices.ndim != 1 or offsets.ndim != 1:
        return "embedding_bag with indices or offsets that are not 1-D"
    return None


def _check_embedding_bag(weight, indices, offsets, mode, padding_idx):
    """Eager's checks of embedding_bag's offsets and indices, in its order; the index
    message is that of the kernel eager picks (its fast path, or the generic one)."""
    if not checks.checking():
        return
    tensor = "LongTensor" if offsets.dtype == np.int64 else "IntTensor"
    n = indices.shape[0]
    none = offsets.shape[0] == 0
    first = jnp.zeros((), offsets.dtype) if none else offsets[0]
    last = jnp.zeros((), offsets.dtype) if none else offsets[-1]
    checks.fail_if(
        first != 0,
        RuntimeError,
        "offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start "
        "from position 0. However, got {value}\n[ torch." + tensor + "{{}} ]",
        value=first,
    )
    checks.fail_if(
        last > n,
        RuntimeError,
        "offsets[-1] can not be greater than input's length {length} but got offsets[-1] "
        "of {value}",
        length=n,
        value=last,
    )
    bad = checks.out_of_bounds(indices, weight.shape[0], negative=False)
    if mode != _MODE_MAX and padding_idx < 0 and weight.dtype in _FAST_DTYPES:
        checks.fail_if(
            bad,
            RuntimeError,
            "Index {pos} of input takes value {value} which is not in the valid range [0, {size})",
            pos=jnp.arange(n, dtype=np.int64),
            value=indices,
            size=weight.shape[0],
        )
    else:
        checks.fail_if(
            bad,
            RuntimeError,
            "embedding_bag: Expected idx >= 0 && idx < num_embeddings but found idx to be {value}",
            value=indices,
        )


# The weight dtypes of eager's fast sum/mean kernel (index_select_add/scale_add).
_FAST_DTYPES = (np.float32, np.float16, jnp.bfloat16)


def _embedding_bag(
    weight,
    indices,
    offsets,
    mode,
    per_sample_weights,
    include_last_offset,
    padding_idx,
    bag_size_len,
):
    """(output, offset2bag, bag_size, max_indices) with the values of PyTorch's CPU kernel.

    With include_last_offset, entries past the final offset (malformed input) belong to
    the last bag, except in the output of the fast sum/mean kernel (float32/16 without
    padding_idx), as in PyTorch. Padding entries count in no bag. Only the backward reads the
    three bookkeeping outputs: the sum kernel leaves bag_size and max_indices zero, and
    mean reports bag_size as max_indices.
    """
    n = indices.shape[0]
    num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    itype = offsets.dtype
    bag = jnp.searchsorted(offsets[:num_bags], jnp.arange(n, dtype=offsets.dtype), side="right")
    bag = jnp.clip(bag - 1, 0, max(num_bags - 1, 0))
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones((n,), bool)
    rows = jnp.take(weight, indices, axis=0)
    if rows.dtype in (np.float16, jnp.bfloat16):  # the CPU kernel accumulates in float32
        rows = rows.astype(np.float32)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    counts = jax.ops.segment_sum(valid.astype(itype), bag, num_segments=num_bags)
    zeros = jnp.zeros((num_bags,), itype)

    def pad(v):  # bag_size of _embedding_bag_forward_only has one entry per offset
        return jnp.concatenate([v, jnp.zeros((bag_size_len - num_bags,), itype)])

    if mode == _MODE_MAX:
        # The kernel keeps a running maximum from each bag's first entry, updated where
        # an entry is greater (">"): a NaN is skipped, unless it is the first, which
        # then stays (fuzz seed 110, program 244). So: the maximum of the entries that
        # are not NaN, or NaN where the first is.
        lowest = jnp.asarray(-jnp.inf, rows.dtype)
        masked = jnp.where(valid[:, None] & ~jnp.isnan(rows), rows, lowest)
        out = jax.ops.segment_max(masked, bag, num_segments=num_bags)
        at = jnp.arange(n)
        start = jax.ops.segment_min(jnp.where(valid, at, n), bag, num_segments=num_bags)
        start = jnp.minimum(start, max(n - 1, 0))  # (a bag with no entries: counts 0)
        first_nan = jnp.isnan(rows[start]) if n else jnp.zeros_like(out, bool)
        out = jnp.where(first_nan, rows[start] if n else out, out)
        out = jnp.where(counts[:, None] > 0, out, 0).astype(weight.dtype)
        # The first entry of each bag holding the maximum (the kernel updates on ">").
        hit = valid[:, None] & (rows == out[bag])
        pos = jnp.where(hit, at[:, None], n)
        first = jax.ops.segment_min(pos, bag, num_segments=num_bags)
        first = jnp.where(first_nan, start[:, None], first)
        max_indices = jnp.where(counts[:, None] > 0, indices[jnp.minimum(first, n - 1)], 0)
        return out, bag.astype(itype), pad(counts), max_indices.astype(itype)
    fast_path = weight.dtype in (np.float32, np.float16) and padding_idx < 0
    summed_entries = valid
    if fast_path and include_last_offset:
        # The fast sum/mean kernel does stop the last bag at the final offset.
        summed_entries = valid & (jnp.arange(n) < offsets[-1])
    summed = jax.ops.segment_sum(
        jnp.where(summed_entries[:, None], rows, 0), bag, num_segments=num_bags
    )
    if mode == _MODE_MEAN:
        out = summed / jnp.maximum(counts, 1)[:, None].astype(summed.dtype)
        return out.astype(weight.dtype), bag.astype(itype), pad(counts), counts
    offset2bag = jnp.zeros((0,), itype) if fast_path else bag.astype(itype)
    return summed.astype(weight.dtype), offset2bag, pad(zeros), zeros


@lower(aten._embedding_bag.default, check=_embedding_bag_check)
def _embedding_bag_rule(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    _check_embedding_bag(weight, indices, offsets, mode, padding_idx)
    return _embedding_bag(
        weight,
        indices,
        offsets,
        mode,
        per_sample_weights,
        include_last_offset,
        padding_idx,
        num_bags,
    )


@lower(aten._embedding_bag_forward_only.default, check=_embedding_bag_check)
def _embedding_bag_forward_only(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    _check_embedding_bag(weight, indices, offsets, mode, padding_idx)
    return _embedding_bag(
        weight,
        indices,
        offsets,
        mode,
        per_sample_weights,
        include_last_offset,
        padding_idx,
        offsets.shape[0],
    )


def _embedding_bag_backward_check(grad, indices, *args, **kwargs):
    sparse = args[7] if len(args) > 7 else kwargs.get("sparse", False)
    if sparse is True:
        return "sparse embedding_bag gradient (a sparse tensor)"
    return None


def _embedding_bag_grad(
    grad,
    indices,
    bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx,
):
    n = indices.shape[0]
    dim = grad.shape[-1]
    out = jnp.zeros((num_weights, dim), grad.dtype)
    if mode == _MODE_MAX:
        # Each (bag, column) sends its gradient to the row that held the maximum;
        # empty bags send nothing.
        nonempty = (bag_size > 0)[:, None]
        cols = jnp.broadcast_to(jnp.arange(dim), maximum_indices.shape)
        return out.at[maximum_indices, cols].add(jnp.where(nonempty, grad, 0))
    rows = grad[bag]
    if mode == _MODE_MEAN:
        rows = rows / jnp.maximum(bag_size[bag], 1)[:, None].astype(grad.dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(grad.dtype)
    keep = indices != padding_idx if padding_idx >= 0 else jnp.ones((n,), bool)
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), grad.dtype).at[indices].add(1)
        rows = rows / freq[indices][:, None]
    return out.at[indices].add(jnp.where(keep[:, None], rows, 0))


@lower(aten._embedding_bag_backward.default, check=_embedding_bag_backward_check)
def _embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    if offset2bag.shape[0] == indices.shape[0]:
        bag = offset2bag
    else:  # the fast sum kernel returns no offset2bag: rebuild it from the offsets
        positions = jnp.arange(indices.shape[0], dtype=offsets.dtype)
        bag = jnp.searchsorted(offsets, positions, side="right") - 1
        bag = jnp.clip(bag, 0, max(grad.shape[0] - 1, 0))
    return _embedding_bag_grad(
        grad,
        indices,
        bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )


@lower(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    return _embedding_bag_grad(
        grad,
        indices,
        offset2bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )


@lower(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(
    grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1
):
    # d out[bag(i)] / d psw[i] = weight[indices[i]]; padding entries get zero.
    if offset2bag.shape[0] == indices.shape[0]:
        bag = offset2bag
    else:
        positions = jnp.arange(indices.shape[0], dtype=offsets.dtype)
        bag = jnp.clip(
            jnp.searchsorted(offsets, positions, side="right") - 1, 0, max(grad.shape[0] - 1, 0)
        )
    out = jnp.sum(grad[bag] * jnp.take(weight, indices, axis=0).astype(grad.dtype), axis=-1)
    if padding_idx >= 0:
        out = jnp.where(indices != padding_idx, out, 0)
    return out


# ---------------------------------------------------------------------------------
# Randomized leaky ReLU: the backward (the forward draws slopes: random.py)
# ---------------------------------------------------------------------------------


@lower(aten.rrelu_with_noise_backward.default)
def _rrelu_with_noise_backward(grad, x, noise, lower, upper, training, self_is_result):
    if training and upper - lower > 1e-6:
        return grad * noise.astype(grad.dtype)  # noise holds each element's slope
    slope = as_dtype((lower + upper) / 2, grad.dtype)
    return jnp.where(x > 0, grad, grad * slope)

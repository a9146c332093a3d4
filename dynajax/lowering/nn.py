"""Neural-network ops: normalization, activations, embedding, losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.dtypes import as_dtype
from dynajax.lowering.registry import lower

aten = torch.ops.aten

# ---------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------


@lower(aten.gelu.default)
def _gelu(x, *, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


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
    return jnp.clip(x, as_dtype(min_val, x.dtype), as_dtype(max_val, x.dtype))


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


@lower(aten.native_layer_norm.default)
def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    axis = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(_stat_dtype(x))
    mean = jnp.mean(xf, axis=axis, keepdims=True)
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
    shape = _channel_shape(x)
    out = (x - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(x.dtype)


@lower(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    invstd = jax.lax.rsqrt(running_var + eps)
    empty = jnp.zeros((0,), x.dtype)
    return _bn_apply(x, running_mean, invstd, weight, bias), empty, empty


def _batch_stats(x, eps):
    axis = (0, *range(2, x.ndim))
    xf = x.astype(_stat_dtype(x))
    mean = jnp.mean(xf, axis=axis)
    var = jnp.var(xf, axis=axis)
    n = x.size // x.shape[1]
    return mean, var, jax.lax.rsqrt(var + eps), n


def _bn_inplace_check(x, weight, bias, running_mean, running_var, training, *_):
    if training and running_mean is not None:
        return "training mode updates running stats in place (functional graphs use the _functional variant)"
    return None


@lower(aten._native_batch_norm_legit.default, check=_bn_inplace_check)
def _batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    mean, var, invstd, n = _batch_stats(x, eps)
    if not training:
        return _bn_apply(x, running_mean, jax.lax.rsqrt(running_var + eps), weight, bias), mean, invstd
    return _bn_apply(x, mean, invstd, weight, bias), mean, invstd


@lower(aten._native_batch_norm_legit_functional.default)
def _batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    mean, var, invstd, n = _batch_stats(x, eps)
    if not training:
        invstd_r = jax.lax.rsqrt(running_var + eps)
        out = _bn_apply(x, running_mean, invstd_r, weight, bias)
        return out, mean, invstd, running_mean, running_var
    out = _bn_apply(x, mean, invstd, weight, bias)
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
    new_var = (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype)
    return out, mean, invstd, new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)


@lower(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    mean, var, invstd, n = _batch_stats(x, eps)
    return _bn_apply(x, mean, invstd, weight, bias), mean, invstd


@lower(aten.native_group_norm.default)
def _native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    xf = x.astype(_stat_dtype(x)).reshape(N, group, -1)
    mean = jnp.mean(xf, axis=-1)
    var = jnp.var(xf, axis=-1)
    rstd = jax.lax.rsqrt(var + eps)
    out = ((xf - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    shape = _channel_shape(x)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


# ---------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------


@lower(aten.embedding.default)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)

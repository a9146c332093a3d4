"""Fused attention and transformer fast paths.

``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` take a fused "fast path"
in eval mode under no_grad; these ops have no decomposition, so they get rules here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _layer_norm(x, weight, bias, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def _linear(x, weight, bias):
    return x @ weight.T + bias


def _self_attention(x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias):
    b, n, e = x.shape
    d = e // num_heads
    q, k, v = jnp.split(_linear(x, qkv_weight, qkv_bias), 3, axis=-1)

    def heads(t):
        return t.reshape(b, n, num_heads, d).transpose(0, 2, 1, 3)

    scores = (heads(q) / jnp.sqrt(jnp.asarray(d, x.dtype))) @ heads(k).transpose(0, 1, 3, 2)
    out = jax.nn.softmax(scores, axis=-1) @ heads(v)
    return _linear(out.transpose(0, 2, 1, 3).reshape(b, n, e), proj_weight, proj_bias)


def _encoder_layer_check(src, embed_dim, num_heads, *args, mask=None, mask_type=None):
    if mask is not None:
        return "attention masks on the fused encoder fast path"
    if src.ndim != 3:
        return "unbatched or nested input"
    return None


@lower(aten._transformer_encoder_layer_fwd.default, check=_encoder_layer_check)
def _transformer_encoder_layer_fwd(
    src,
    embed_dim,
    num_heads,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    use_gelu,
    norm_first,
    eps,
    norm_weight_1,
    norm_bias_1,
    norm_weight_2,
    norm_bias_2,
    ffn_weight_1,
    ffn_bias_1,
    ffn_weight_2,
    ffn_bias_2,
    mask=None,
    mask_type=None,
):
    x = _layer_norm(src, norm_weight_1, norm_bias_1, eps) if norm_first else src
    x = src + _self_attention(x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias)
    if not norm_first:
        x = _layer_norm(x, norm_weight_1, norm_bias_1, eps)
    residual = x
    if norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    h = _linear(x, ffn_weight_1, ffn_bias_1)
    h = jax.nn.gelu(h, approximate=False) if use_gelu else jax.nn.relu(h)
    x = residual + _linear(h, ffn_weight_2, ffn_bias_2)
    if not norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    return x.astype(src.dtype)

"""Fused attention and transformer fast paths.

``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` take a fused "fast path"
in eval mode under no_grad; these ops have no decomposition, so they get rules here.

``F.scaled_dot_product_attention`` on the CPU is ``_scaled_dot_product_flash_attention_-
for_cpu``. Small ones (a decode step, the test models) are decomposed by aot_autograd
into PyTorch's math attention, as before; large ones (``whole``) are kept whole and get
the rule below. The decomposition cost 2.9x eager's fused kernel on a causal attention
of 8 x 4 heads x 512 tokens x 64 (``benchmarks`` row ``attention-512``): XLA's CPU
runtime runs each batched product on one thread, and the decomposition's softmax makes
several passes over the (N, H, L, S) scores for its fully-masked-row handling and its
eager-order sums. The rule computes the attention one (batch, head) at a time, in a
loop per CPU, with one softmax pass, a causal one in blocks of queries over the keys
each block sees, and gives a row whose scores are all -inf (fully masked) zeros. PyTorch's
own kernel is still faster on the CPU (1.5-2x at that size), so the backend keeps
large ones there by default
(``capability/cost.py``, reason PERF); the rule is what ``perf_fallbacks=False``,
``device=``, ``mesh=`` and ``jax_function`` (which keeps large ones whole too) run. The
fused encoder layer stays in PyTorch from ``cost.ENCODER_LAYER_FLOPS`` likewise.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.registry import lower

aten = torch.ops.aten

# An attention is kept whole (and sliced) from this many floating-point operations in
# its two products: below, one slice's thread hand-off costs more than it saves.
WHOLE_FLOPS = 1 << 27


def cpus() -> int:
    """The CPUs this process may run on: the attention rule's loops (the persistent
    cache's program key includes it, ``runtime/cache.py``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def whole(query: Any, key: Any, dropout_p: float) -> bool:
    """Whether the fused CPU attention of ``query`` (N, H, L, E) over ``key`` is kept
    whole for ``_flash_attention_for_cpu`` (else decomposed): float32 or float64,
    static sizes, no dropout, and at least ``WHOLE_FLOPS`` of work in its products."""
    sizes = (*query.shape, key.shape[-2])
    if dropout_p != 0.0 or not all(isinstance(d, int) for d in sizes):
        return False
    if query.dtype not in (torch.float32, torch.float64) or query.dim() != 4:
        return False
    n, h, length, e, source = sizes
    return 4 * n * h * length * source * e >= WHOLE_FLOPS


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


def _flash_check(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p != 0.0:
        return "dropout in the fused CPU attention (eager's kernel refuses it too)"
    if query.ndim != 4 or query.shape[1] % key.shape[1]:
        return "not (batch, heads, tokens, dim) with key heads dividing query heads"
    return None


@lower(aten._scaled_dot_product_flash_attention_for_cpu.default, check=_flash_check)
def _flash_attention_for_cpu(
    query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    """``softmax(q k^T * scale + mask) v`` and the log-sum-exp of each row's scores, one
    (batch, head) at a time in a loop per CPU. As eager's kernel: the scale (``1/sqrt(E)``
    unless given) multiplies the queries, ``is_causal`` keeps key ``j`` for query ``i``
    where ``j <= i``, a boolean mask keeps where True, a float mask is added, a row with
    every key masked gives zeros and a log-sum-exp of 0, and grouped queries share their
    key and value heads.

    One head's scores (L x S) stay in the CPU's cache where the whole batch's did not:
    on 8 x 4 heads x 512 x 64 (2 CPUs; ms, median of 8 rounds) the attention took 37.1
    in one chain per slice of the batch, 20.2 this way; causal (in blocks of queries,
    ``_causal_blocks``) 21.7 and 16.2. XLA runs a loop's iterations one after the
    other, so there is one loop per CPU over its share of the heads. On other platforms
    (a ``device=`` GPU), where nothing here was measured, one batched program."""
    scale = float(1.0 / np.sqrt(query.shape[-1]) if scale is None else scale)  # weak type
    mask = attn_mask
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    # The loops are a CPU strategy; elsewhere (a GPU device) one batched program.
    return jax.lax.platform_dependent(
        query,
        key,
        value,
        mask,
        cpu=lambda *a: _per_head(*a, is_causal, scale),
        default=lambda *a: _batched(*a, is_causal, scale),
    )


def _per_head(query, key, value, mask, is_causal, scale):
    """The attention one (batch, head) at a time, in a loop per CPU over its share."""
    n, heads, length, e = query.shape
    groups = heads // key.shape[1]

    def one_head(i):
        b, h = i // heads, i % heads

        def pick(t, head):  # t[b, head] as (1, 1, ...), b and head broadcast where t's is 1
            rows = b if t.shape[0] > 1 else 0
            cols = head if t.shape[1] > 1 else 0
            return jax.lax.dynamic_slice(t, (rows, cols, 0, 0), (1, 1, *t.shape[2:]))

        kv = h // groups
        head_mask = None if mask is None else pick(mask, h)
        out, lse = _causal_blocks(
            pick(query, h), pick(key, kv), pick(value, kv), head_mask, is_causal, scale
        )
        return out[0, 0], lse[0, 0]

    pieces = max(1, min(cpus(), n * heads))
    bounds = np.linspace(0, n * heads, pieces + 1).astype(int)
    parts = [
        jax.lax.map(one_head, jnp.arange(lo, hi))
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    out = jnp.concatenate([o for o, _ in parts], axis=0).reshape(n, heads, length, e)
    lse = jnp.concatenate([s for _, s in parts], axis=0).reshape(n, heads, length)
    return out, lse


def _batched(query, key, value, mask, is_causal, scale):
    """The attention of the whole batch in one chain of batched products (key and value
    heads repeated for grouped queries)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = jnp.repeat(key, groups, axis=1), jnp.repeat(value, groups, axis=1)
    return _causal_blocks(query, key, value, mask, is_causal, scale)


# Causal attentions run in blocks of this many queries, each over the keys it can see.
CAUSAL_BLOCK = 128


def _causal_blocks(q, k, v, mask, is_causal, scale):
    """The attention of ``q`` in blocks of ``CAUSAL_BLOCK`` queries where it is causal:
    query ``i`` sees keys ``j <= i``, so a block ending at query ``e`` needs only keys
    ``[0, e)``: at 512 tokens 5/8 of the products' work, and scores a quarter the size
    per block."""
    length = q.shape[-2]
    if not is_causal or length < 2 * CAUSAL_BLOCK:
        return _attention(q, k, v, mask, is_causal, scale)
    outs, lses = [], []
    for start in range(0, length, CAUSAL_BLOCK):
        end = min(length, start + CAUSAL_BLOCK)
        seen = min(end, k.shape[-2])
        block_mask = mask
        if mask is not None:
            rows = mask.shape[-2] > 1  # else broadcast over queries (masks are 2-D and up)
            block_mask = mask[..., start:end, :seen] if rows else mask[..., :seen]
        out, lse = _attention(
            q[..., start:end, :], k[..., :seen, :], v[..., :seen, :], block_mask, True, scale, start
        )
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=-2), jnp.concatenate(lses, axis=-1)


def _attention(q, k, v, mask, is_causal, scale, offset=0):
    # The scale on the queries (L x E products, not L x S; XLA made the latter a
    # broadcast operand of its dot fusion).
    scores = jnp.einsum("nhle,nhse->nhls", q * jnp.asarray(scale, q.dtype), k)
    length, source = scores.shape[-2:]
    if is_causal:
        keep = jnp.arange(source)[None, :] <= jnp.arange(offset, offset + length)[:, None]
        scores = jnp.where(keep, scores, -jnp.inf)
    if mask is not None:
        if mask.dtype == jnp.bool_:
            scores = jnp.where(mask, scores, -jnp.inf)
        else:
            scores = scores + mask.astype(scores.dtype)
    # A row whose every score is -inf (every key masked, or the keys it sees infinite:
    # is_causal alone, or no mask at all) gives zeros and a log-sum-exp of 0, as eager's
    # kernel does: max 0, weights 0, total 1 (fuzz seed 104, program 298).
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    total = jnp.where(total == 0, 1.0, total)  # so its output is 0, its lse 0 + log(1)
    out = jnp.einsum("nhls,nhse->nhle", weights, v) / total
    lse = top + jnp.log(total)
    return out.astype(q.dtype), lse[..., 0].astype(q.dtype)

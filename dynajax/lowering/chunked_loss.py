"""The chunked linear + cross-entropy of ``torch.nn.functional.linear_cross_entropy``
(its ``options``): PyTorch's ``torch_nn`` custom ops, lowered whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

# The chunked path is a pair of custom ops, defined when torch.nn's module is imported
# (torch 2.13 on; lowering/__init__.py imports this module only where it exists).
from torch.nn.modules import linear_cross_entropy as _lce  # noqa: F401

from dynajax.lowering import checks
from dynajax.lowering.dtypes import is_floating
from dynajax.lowering.registry import lower

torch_nn = torch.ops.torch_nn


def _lce_row_weights(target, weight, ignore_index, num_classes, wide):
    """(each row's class weight, 0 where ignored, and the target with ignored rows
    pointing at class 0), as the chunked kernel's neg_weight_target before signs."""
    ignored = target == ignore_index
    safe = jnp.where(ignored, 0, target)
    w = jnp.ones(target.shape, wide) if weight is None else weight.astype(wide)[safe]
    return jnp.where(ignored, jnp.zeros((), wide), w), safe


def _check_targets(target, ignore_index, num_classes):
    """Eager's check: the op gathers each chunk's logits at the targets not ignored, and
    gather raises on a target out of range (in row order: chunks run in order)."""
    if checks.checking():
        checks.fail_if(
            (target != ignore_index) & checks.out_of_bounds(target, num_classes, negative=False),
            RuntimeError,
            "index {value} is out of bounds for dimension 1 with size {size}",
            value=target,
            size=num_classes,
        )


def _lce_check(x, linear_weight, target, linear_bias, weight, *args):
    if x.ndim != 2 or linear_weight.ndim != 2:
        return "chunked linear_cross_entropy of inputs that are not 2-D"
    if not is_floating(x.dtype):
        return "chunked linear_cross_entropy of a non-floating input"
    return None


@lower(torch_nn._linear_cross_entropy_batch_chunked.default, check=_lce_check)
def _linear_cross_entropy_batch_chunked(
    x,
    linear_weight,
    target,
    linear_bias,
    weight,
    reduction,
    ignore_index,
    label_smoothing,
    batch_chunk_size,
    acc_policy,
    acc_dtype,
    allow_retain_graph,
    compute_input_grad,
    compute_linear_weight_grad,
    compute_linear_bias_grad,
):
    """(loss, d loss/d input, d loss/d linear_weight, d loss/d linear_bias).

    The op computes its gradients in the forward (its backward only scales them), so
    here they come from ``jax.value_and_grad`` of the same loss, in one XLA program
    instead of PyTorch's batch-chunk loop; gradients not asked for are empty, as in
    the op. The loss is -sum(w_n * log_softmax(x W^T + b)[n, t_n]) over rows not
    ignored, divided by sum(w_n) for "mean" (NaN when that is zero). Half-precision
    inputs compute in float32 (the op's acc_dtype). Targets out of range (not the
    ignore index) raise eager's error (a value check).
    """
    _check_targets(target, ignore_index, linear_weight.shape[0])
    dtype = x.dtype
    wide = np.float64 if dtype == np.float64 else np.float32
    row_w, safe = _lce_row_weights(target, weight, ignore_index, linear_weight.shape[0], wide)
    if reduction == "mean":
        total = jnp.sum(row_w)
        row_w = row_w / jnp.where(total == 0, jnp.nan, total)

    def loss(x_, lw, b):
        logits = x_.astype(wide) @ lw.astype(wide).T
        if b is not None:
            logits = logits + b.astype(wide)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(row_w * jnp.take_along_axis(logp, safe[:, None], axis=1)[:, 0])

    value, (gx, gw, gb) = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, linear_weight, linear_bias)
    gx = gx.astype(dtype) if compute_input_grad else jnp.zeros((0, 0), dtype)
    gw = gw.astype(dtype) if compute_linear_weight_grad else jnp.zeros((0, 0), dtype)
    if compute_linear_bias_grad and linear_bias is not None:
        gb = gb.astype(dtype)
    else:
        gb = jnp.zeros((0,), dtype)
    return value.astype(dtype), gx, gw, gb


@lower(torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default, check=_lce_check)
def _linear_cross_entropy_batch_chunked_no_reduction(
    x,
    linear_weight,
    target,
    linear_bias,
    weight,
    ignore_index,
    batch_chunk_size,
    acc_policy,
    acc_dtype,
):
    """Per-row loss -w_n * log_softmax(x W^T + b)[n, t_n], 0 on ignored rows."""
    _check_targets(target, ignore_index, linear_weight.shape[0])
    wide = np.float64 if x.dtype == np.float64 else np.float32
    row_w, safe = _lce_row_weights(target, weight, ignore_index, linear_weight.shape[0], wide)
    logits = x.astype(wide) @ linear_weight.astype(wide).T
    if linear_bias is not None:
        logits = logits + linear_bias.astype(wide)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return (-row_w * jnp.take_along_axis(logp, safe[:, None], axis=1)[:, 0]).astype(x.dtype)

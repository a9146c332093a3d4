"""Matrix products, pairwise distances, and the matrix exponential.

The products (mm, bmm, matmul, dot, addmm and its batched forms, trilinear) follow
PyTorch's CPU accumulation: integers in their own dtype, half precision in float32 and
rounded where the eager kernel rounds. The distances (cdist, pdist) and the matrix
exponential are built from them. ``pnorm`` is public: ``nn``'s ``embedding_renorm``
takes its row norms with it too.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import transposes
from dynajax.lowering.dtypes import as_dtype, is_integral, result_type
from dynajax.lowering.reductions import as_eager_sum, static_size
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _zero_sums_positive(r, a, b):
    """A product's zero sums with eager's sign. XLA turns a product over one element
    (K = 1) into a multiply, whose ``0 * -1`` is -0.0; eager's CPU kernels give +0.0
    there (a sum that starts at +0.0: ``1 / linear(0, w)`` was +inf where eager's is
    -inf; fuzz seed 4, program 3313), except MKL's float32/float64 matrix-matrix product
    of at least 2 rows and 2 columns, whose sign is the multiply's (measured:
    ``mm`` of (2, 1) and (1, 2) zeros by -1 is -0.0; of (1, 1) and (1, 2), +0.0)."""
    if a.ndim == b.ndim == 2 and a.dtype in (np.float32, np.float64):
        rows, cols = a.shape[0], b.shape[1]
        if not (static_size(rows) and static_size(cols)) or (rows >= 2 and cols >= 2):
            return r  # MKL's sign, or symbolic sizes: left as XLA gives it
    return as_eager_sum(r, a, [a.ndim - 1])


def product(a, b, **kwargs):
    """``jnp.matmul(a, b, **kwargs)``, reading an operand that is a transpose of another
    value (``transposes.source``) in place: the transpose is folded into the product's
    contracting dimension instead of being copied (about 3x faster for a matrix-vector
    product with a transposed weight on XLA's CPU; ``lowering/transposes.py``). A batch
    operand that repeats one matrix (``transposes.broadcast``) is read as that matrix:
    one dot without batch dimensions, not B small ones on a broadcast copy."""
    src_a, trans_a = transposes.source(a)
    src_b, trans_b = transposes.source(b)
    n = a.ndim
    same_batch = n == b.ndim and a.shape[:-2] == b.shape[:-2] and a.dtype == b.dtype
    if not same_batch:
        return jnp.matmul(a, b, **kwargs)
    # K's dimension in each operand as it is stored.
    k_a, k_b = n - 2 if trans_a else n - 1, n - 1 if trans_b else n - 2
    matrix_a, matrix_b = transposes.broadcast(a), transposes.broadcast(b)  # 3-D and up
    no_batch = ((), ())
    if matrix_b is not None and matrix_a is None:  # a batch times one matrix
        w, w_trans = matrix_b
        k_w = 1 if w_trans else 0
        return jax.lax.dot_general(src_a, w, (((k_a,), (k_w,)), no_batch), **kwargs)
    if matrix_a is not None and matrix_b is None:  # one matrix times a batch
        w, w_trans = matrix_a
        k_w = 0 if w_trans else 1
        out = jax.lax.dot_general(w, src_b, (((k_w,), (k_b,)), no_batch), **kwargs)
        return jnp.moveaxis(out, 0, n - 2)  # (M, *batch, N) -> (*batch, M, N)
    if not (trans_a or trans_b):
        return jnp.matmul(a, b, **kwargs)
    batch = tuple(range(n - 2))
    return jax.lax.dot_general(src_a, src_b, (((k_a,), (k_b,)), (batch, batch)), **kwargs)


def _matmul(a, b, **kwargs):
    # Integer matmuls accumulate in their own dtype, like PyTorch.
    if is_integral(a.dtype):
        return product(a, b, preferred_element_type=a.dtype)
    return _zero_sums_positive(product(a, b, **kwargs), a, b)


@lower(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(a, b):
    return _matmul(a, b)


@lower(aten.dot.default)
def _dot(a, b):
    return _zero_sums_positive(jnp.dot(a, b), a, b)


@lower(aten.vdot.default)
def _vdot(a, b):
    return jnp.vdot(a, b)  # conjugates ``a``, as torch.vdot does


@lower(aten.mv.default)
def _mv(a, v):
    return _matmul(a, v)


def _scale(x, s):
    return x if s == 1 else x * as_dtype(s, x.dtype)


@lower(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(bias, a, b, *, beta=1, alpha=1):
    dtype = result_type(bias, a)
    if np.dtype(dtype) in (np.float16, jnp.bfloat16):
        # PyTorch's CPU kernels (oneDNN) accumulate half-precision products in float32
        # and add the scaled bias before the one rounding to the half dtype.
        acc = _scale(_matmul(a, b, preferred_element_type=np.float32), alpha)
        if beta != 0:
            acc = acc + _scale(bias.astype(np.float32), beta)
        return acc.astype(dtype)
    prod = _scale(_matmul(a, b), alpha)
    if beta == 0:  # PyTorch ignores bias (even NaN) when beta == 0
        return jnp.broadcast_to(prod, prod.shape).astype(dtype)
    return (_scale(bias, beta) + prod).astype(dtype)


@lower(aten.addbmm.default)
def _addbmm(bias, b1, b2, *, beta=1, alpha=1):
    # beta * bias + alpha * sum_b b1[b] @ b2[b]. PyTorch's kernel runs one addmm per
    # batch into the result; half precision rounds the result after each of them
    # (accumulating in float32 within each), which is reproduced step by step.
    dtype = result_type(bias, b1)
    out = jnp.broadcast_to(bias, (b1.shape[1], b2.shape[2])).astype(dtype)
    if np.dtype(dtype) in (np.float16, jnp.bfloat16):
        acc = jnp.zeros(out.shape, np.float32) if beta == 0 else out.astype(np.float32) * beta
        for i in range(b1.shape[0]):
            prod = _matmul(b1[i], b2[i], preferred_element_type=np.float32)
            acc = (acc + prod * alpha).astype(dtype).astype(np.float32)
        return acc.astype(dtype)
    out = jnp.zeros_like(out) if beta == 0 else _scale(out, beta)
    if b1.shape[0] == 0:
        return out
    prod = jnp.sum(_matmul(b1, b2), axis=0, dtype=dtype)
    return (out + _scale(prod, alpha)).astype(dtype)


# ---------------------------------------------------------------------------------
# Pairwise distances
# ---------------------------------------------------------------------------------


def pnorm(diff, p, axis=-1):
    """The p-norm of ``diff`` along ``axis`` (p = 0 counts the nonzeros, p = inf is the
    largest magnitude), as PyTorch's distance kernels compute it."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum(a != 0, axis=axis).astype(diff.dtype)
    if p == float("inf"):
        return jnp.max(a, axis=axis, initial=0)  # |d| >= 0, so 0 is the identity
    if p == 1:
        return jnp.sum(a, axis=axis)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis))
    return jnp.sum(a**p, axis=axis) ** (1 / p)


def _euclidean_mm(x1, x2):
    # PyTorch's _euclidean_dist: one matmul of norm-augmented operands.
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    a = jnp.concatenate([x1 * -2, n1, jnp.ones_like(n1)], axis=-1)
    b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
    return jnp.sqrt(jnp.maximum(a @ jnp.swapaxes(b, -1, -2), 0))


def _cdist_check(x1, x2, p, compute_mode):
    if not jnp.issubdtype(x1.dtype, jnp.floating) or x1.dtype in (jnp.float16, jnp.bfloat16):
        return f"cdist of {x1.dtype} (PyTorch's CPU kernel takes float32/64 only)"
    return None


@lower(aten._cdist_forward.default, check=_cdist_check)
def _cdist_forward(x1, x2, p, compute_mode):
    # compute_mode None/0: the matmul form when either side has more than 25 rows;
    # 1: always; 2: never. Only p == 2 has a matmul form.
    rows = max(x1.shape[-2], x2.shape[-2])
    use_mm = p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and rows > 25))
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    if use_mm:
        return _euclidean_mm(x1, x2)
    return pnorm(x1[..., :, None, :] - x2[..., None, :, :], p)


@lower(aten._pdist_forward.default, check=lambda x, p=2.0: _cdist_check(x, x, p, None))
def _pdist_forward(x, p=2.0):
    # Distances of rows i < j, in row-major order of (i, j).
    i, j = np.triu_indices(x.shape[0], 1)
    return pnorm(x[i] - x[j], p)


def _contract(x, x_dims, y, y_dims, out_dims, accumulate):
    """sum of x * y over the dims of either operand missing from ``out_dims`` (dims
    numbered in a shared space), as one matmul accumulating in ``accumulate``."""
    letters = string.ascii_letters
    spec = "".join(letters[d] for d in x_dims) + "," + "".join(letters[d] for d in y_dims)
    spec += "->" + "".join(letters[d] for d in out_dims)
    return jnp.einsum(spec, x, y, preferred_element_type=accumulate).astype(x.dtype)


@lower(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    # sum over sumdim of unsqueeze(i1, expand1) * unsqueeze(i2, expand2) * ... (F.bilinear's
    # kernel), contracted as PyTorch does: i1 with i2 over the summed dims i3 lacks, then
    # with i3 over the others, each a matmul rounded to the dtype (accumulating in
    # float32 for the half types); a summed unroll_dim adds its slices one at a time.
    total = i1.ndim + len(expand1)
    accumulate = np.float32 if i1.dtype in (np.float16, jnp.bfloat16) else None
    present = [[d for d in range(total) if d not in e] for e in (expand1, expand2, expand3)]
    summed = set(sumdim)
    s12 = {d for d in summed if d in expand3 and d != unroll_dim}
    s23 = {d for d in summed if d not in expand3 and d != unroll_dim}
    d12 = [d for d in range(total) if (d in present[0] or d in present[1]) and d not in s12]
    out_dims = [d for d in range(total) if (d in d12 or d in present[2]) and d not in s23]
    if 0 in (i1.size, i2.size, i3.size):
        operands = zip((i1, i2, i3), present, strict=True)
        shape = {d: n for x, ds in operands for d, n in zip(ds, x.shape, strict=True)}
        out = jnp.zeros([shape[d] for d in out_dims], i1.dtype)
    else:
        out = _contract(i1, present[0], i2, present[1], d12, accumulate)
        out = _contract(out, d12, i3, present[2], out_dims, accumulate)
    if unroll_dim in summed and unroll_dim in out_dims:
        axis = out_dims.index(unroll_dim)
        slices = jnp.moveaxis(out, axis, 0)
        out = jax.lax.fori_loop(
            0, slices.shape[0], lambda k, acc: acc + slices[k], jnp.zeros_like(slices[0])
        )
        out_dims = [d for d in out_dims if d != unroll_dim]
    kept = [d for d in range(total) if d not in summed]
    return out.reshape([out.shape[out_dims.index(d)] if d in out_dims else 1 for d in kept])


# ---------------------------------------------------------------------------------
# Matrix exponential
# ---------------------------------------------------------------------------------


def _matrix_exp_check(A):
    dtype = np.dtype(A.dtype)
    if dtype in (np.float64, np.complex128):
        return None
    if dtype in (np.float32, np.complex64):
        return (
            f"matrix_exp in {dtype.name}: XLA's Pade approximant and PyTorch's degree-18 "
            "Taylor scheme round differently, and scaling and squaring amplifies that past "
            "the dtype's precision for matrices of large norm (float64 is lowered)"
        )
    return f"matrix_exp of {dtype.name}"


@lower(aten.linalg_matrix_exp.default, check=_matrix_exp_check)
def _linalg_matrix_exp(A):
    if A.size == 0:
        return A
    # In float64 both approximations are accurate to a few ulps, and scaling and
    # squaring keeps them within the test tolerance of each other.
    return jax.scipy.linalg.expm(A)

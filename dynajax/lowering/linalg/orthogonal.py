"""QR, Householder products, singular value and eigen decompositions, pseudo-inverse.

Why "orthogonal": LAPACK computes every one of these by orthogonal (unitary, for
complex) transformations, Householder reflections and Givens rotations: QR directly;
SVD by reduction to bidiagonal form, then QR iterations; eig by reduction to Hessenberg
form, then the QR algorithm; eigh by reduction to tridiagonal form, then QR or
divide-and-conquer; the pseudo-inverse through the SVD. That is also why their vectors
depend on each library's sign conventions, below. (Not "decompositions": in dynajax
that word means aot_autograd's decomposition table.)

PyTorch's CPU build calls MKL's LAPACK; XLA's CPU kernels call the LAPACK that SciPy
ships (reference LAPACK on OpenBLAS). Unique results (singular values, eigenvalues,
the pseudo-inverse, ranks) agree to rounding whatever the routine. Vectors are defined
only up to sign (or phase), and there the two libraries were compared sample by sample
(every OpInfo sample, and random matrices up to 40x40):

- Householder QR (geqrf, orgqr, ormqr): the same reflector convention in both, so Q, R
  and the reflectors agree; lowered in every dtype.
- Complex ``eig`` (geev, each eigenvector scaled so that its largest component is real
  and positive, which makes it unique): the same in both; lowered.
- Real SVD vectors, real ``eig`` vectors and all ``eigh`` vectors: the two libraries
  pick different signs (MKL keeps LAPACK's older Givens rotation sign convention,
  which the rotations of the bidiagonal/tridiagonal QR iterations and geev's
  normalization of complex pairs inherit). Refused, with that reason; values-only calls
  (``compute_uv=False``, ``compute_v=False``: svdvals, eigvalsh, matrix_rank, cond,
  nuclear norm) are lowered.
- Complex SVD vectors: nothing normalizes their phases, and the two libraries agree on
  most matrices but not all (a random full-rank complex128 25x25 matrix had two columns
  of U off by 0.66, in about 1 of 500 random matrices tried). Refused too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.linalg.common import conj_transpose, lapack_dtype_check
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def _real_dtype(dtype):
    return jnp.finfo(dtype).dtype


def _eye(batch, m, n, dtype):
    return jnp.broadcast_to(jnp.eye(m, n, dtype=dtype), (*batch, m, n))


# ---------------------------------------------------------------------------------
# Householder QR
# ---------------------------------------------------------------------------------


def _geqrf(A):
    """LAPACK's geqrf: R above the diagonal, the reflectors below it, and their taus."""
    m, n = A.shape[-2:]
    if m == 0 or n == 0:
        return A, jnp.zeros((*A.shape[:-2], 0), A.dtype)
    h, tau = jnp.linalg.qr(A, mode="raw")  # h is the transpose of geqrf's matrix
    return jnp.swapaxes(h, -1, -2), tau


def _orgqr(a, tau):
    """The m x n matrix of the first n columns of H_1 ... H_k (LAPACK's orgqr)."""
    m, n = a.shape[-2:]
    if n == 0 or tau.shape[-1] == 0:
        return _eye(a.shape[:-2], m, n, a.dtype)
    return jax.lax.linalg.householder_product(a, tau)


@lower(aten.geqrf.default, check=lapack_dtype_check)
def _geqrf_rule(A):
    return _geqrf(A)


@lower(aten.linalg_householder_product.default, check=lambda A, tau: lapack_dtype_check(A))
def _linalg_householder_product(A, tau):
    return _orgqr(A, tau)


def _ormqr_check(A, tau, C, left=True, transpose=False):
    return lapack_dtype_check(A)


@lower(aten.ormqr.default, check=_ormqr_check)
def _ormqr(A, tau, C, left=True, transpose=False):
    if tau.shape[-1] == 0 or C.size == 0:
        return C
    return jax.lax.linalg.ormqr(A, tau, C, left=left, transpose=transpose)


def _qr_check(A, mode="reduced"):
    if mode not in ("reduced", "complete", "r"):
        return f"linalg_qr mode {mode!r}"
    return lapack_dtype_check(A)


@lower(aten.linalg_qr.default, check=_qr_check)
def _linalg_qr(A, mode="reduced"):
    # PyTorch's QR: geqrf, then orgqr on the first k (reduced) or all m (complete)
    # columns of the reflectors.
    m, n = A.shape[-2:]
    k = min(m, n)
    a, tau = _geqrf(A)
    rows = m if mode == "complete" else k
    R = jnp.triu(a[..., :rows, :])
    if mode == "r":
        return jnp.zeros((0,), A.dtype), R
    cols = m if mode == "complete" else k
    if cols > n:  # complete Q of a tall matrix: orgqr on zero-padded columns
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, cols - n)])
    return _orgqr(a[..., :, :cols], tau), R


# ---------------------------------------------------------------------------------
# Singular value decomposition
# ---------------------------------------------------------------------------------


def _svd_check(A, full_matrices=False, compute_uv=True, *, driver=None):
    if driver is not None:
        return f"linalg.svd driver={driver!r} (PyTorch takes a driver on CUDA only)"
    if reason := lapack_dtype_check(A):
        return reason
    if compute_uv and not _is_complex(A.dtype):
        return (
            "real singular vectors: their signs differ between PyTorch's MKL gesdd and "
            "XLA's LAPACK gesdd (singular values alone agree)"
        )
    if compute_uv:
        return (
            "complex singular vectors: their phases differ between PyTorch's MKL gesdd "
            "and XLA's LAPACK gesdd on some matrices (singular values alone agree)"
        )
    return None


@lower(aten._linalg_svd.default, check=_svd_check)
def _linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    batch, (m, n) = A.shape[:-2], A.shape[-2:]
    k = min(m, n)
    real = _real_dtype(A.dtype)
    if k == 0:
        S = jnp.zeros((*batch, 0), real)
        if not compute_uv:
            return jnp.zeros((0,), A.dtype), S, jnp.zeros((0,), A.dtype)
        mu, nv = (m, n) if full_matrices else (k, k)
        return _eye(batch, m, mu, A.dtype), S, _eye(batch, nv, n, A.dtype)
    if not compute_uv:
        S = jax.lax.linalg.svd(A, full_matrices=False, compute_uv=False)
        return jnp.zeros((0,), A.dtype), S, jnp.zeros((0,), A.dtype)
    U, S, Vh = jax.lax.linalg.svd(A, full_matrices=full_matrices, compute_uv=True)
    return U, S, Vh


# ---------------------------------------------------------------------------------
# Eigen decompositions
# ---------------------------------------------------------------------------------


def _eigh_check(A, UPLO="L", compute_v=True):
    if reason := lapack_dtype_check(A):
        return reason
    if compute_v:
        return (
            "eigenvectors of eigh: their signs differ between PyTorch's MKL syevd and "
            "XLA's LAPACK syevd (eigenvalues alone agree)"
        )
    return None


@lower(aten._linalg_eigh.default, check=_eigh_check)
def _linalg_eigh(A, UPLO="L", compute_v=True):
    # Only the UPLO triangle is read, as in LAPACK.
    n = A.shape[-1]
    real = _real_dtype(A.dtype)
    if n == 0:
        return jnp.zeros(A.shape[:-1], real), jnp.zeros((0,), A.dtype)
    _, w = jax.lax.linalg.eigh(A, lower=UPLO.upper() == "L", symmetrize_input=False)
    return w.astype(real), jnp.zeros((0,), A.dtype)


def _eig_check(A):
    if reason := lapack_dtype_check(A):
        return reason
    if not _is_complex(A.dtype):
        return (
            "eig of a real matrix: the eigenvectors of complex-conjugate pairs differ in "
            "sign between PyTorch's MKL geev and XLA's LAPACK geev (complex inputs agree)"
        )
    return None


@lower(aten.linalg_eig.default, check=_eig_check)
def _linalg_eig(A):
    n = A.shape[-1]
    if n == 0:
        return jnp.zeros(A.shape[:-1], A.dtype), jnp.zeros(A.shape, A.dtype)
    w, v = jax.lax.linalg.eig(A, compute_left_eigenvectors=False)
    return w, v


# ---------------------------------------------------------------------------------
# Pseudo-inverse
# ---------------------------------------------------------------------------------


def _pinv_check(A, *, atol=None, rtol=None, hermitian=False):
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if tol is not None and _is_complex(tol.dtype):
            return f"linalg.pinv with a complex {name}"
    return lapack_dtype_check(A)


@lower(aten.linalg_pinv.atol_rtol_tensor, check=_pinv_check)
def _linalg_pinv(A, *, atol=None, rtol=None, hermitian=False):
    # PyTorch's formula: singular values (|eigenvalues| when hermitian) at most
    # max(atol, rtol * largest) count as zero. The result does not depend on the signs
    # of the singular vectors, so any SVD gives PyTorch's answer.
    batch, (m, n) = A.shape[:-2], A.shape[-2:]
    real = _real_dtype(A.dtype)
    if A.size == 0:
        return jnp.zeros((*batch, n, m), A.dtype)
    # The default tolerances are float64 tensors, as in PyTorch.
    atol_t = jnp.zeros((), np.float64) if atol is None else atol
    if rtol is None:
        default = jnp.asarray(float(jnp.finfo(real).eps) * max(m, n), np.float64)
        rtol = default if atol is None else jnp.where(atol > 0, 0.0, default)
    if hermitian:
        S, U = jax.lax.linalg.eigh(A, lower=True, symmetrize_input=False)[::-1]
        S = S.astype(real)
        mag = jnp.abs(S)
        largest = jnp.max(mag, axis=-1, keepdims=True)
        tol = jnp.maximum(atol_t[..., None], rtol[..., None] * largest)
        inv = jnp.where(mag > tol, 1 / S, 0).astype(A.dtype)
        return (U * inv[..., None, :]) @ conj_transpose(U)
    U, S, Vh = jax.lax.linalg.svd(A, full_matrices=False)
    tol = jnp.maximum(atol_t[..., None], rtol[..., None] * S[..., :1])
    inv = jnp.where(S > tol, 1 / S, 0).astype(A.dtype)
    return (conj_transpose(Vh) * inv[..., None, :]) @ conj_transpose(U)

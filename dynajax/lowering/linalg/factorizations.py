"""Dense factorizations and solvers: LU (det, slogdet, solve, inverse, linalg.lu),
Cholesky (and its inverse), triangular solves.

Only the factorizations whose results are unique are lowered. LU with partial
pivoting is (up to exact ties between pivot candidates) the same algorithm in LAPACK
and XLA, so the ``LU`` and ``pivots`` outputs that PyTorch saves for the backward match
too; pivots are converted to LAPACK's 1-based convention. ``info`` follows LAPACK: the
1-based index of the first zero pivot (getrf) or of the first leading minor that is
not positive definite (potrf), 0 on success.

QR, singular value and eigen decompositions, whose vectors are defined only up to
sign, live in ``orthogonal.py``; LDL in ``ldl.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering import checks
from dynajax.lowering.linalg.common import conj_transpose, lapack_dtype_check
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _lu(A):
    """(LU, 1-based int32 pivots, row permutation, info) of a batch of square matrices."""
    lu, pivots, perm = jax.lax.linalg.lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    if diag.shape[-1] == 0:  # empty matrices: nothing can fail
        return lu, pivots.astype(np.int32) + 1, perm, jnp.zeros(diag.shape[:-1], np.int32)
    zero = diag == 0
    info = jnp.where(jnp.any(zero, -1), jnp.argmax(zero, -1) + 1, 0).astype(np.int32)
    return lu, pivots.astype(np.int32) + 1, perm, info


def _parity(pivots):
    n = pivots.shape[-1]
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=pivots.dtype), axis=-1)
    return 1 - 2 * (swaps % 2)


def _lu_solve(lu, perm, B):
    """Solves A X = B from A's LU factors; B is (..., n, k)."""
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    pb = jnp.take_along_axis(B, perm[..., None], axis=-2)
    y = jax.lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
    return jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)


@lower(aten.linalg_lu_factor_ex.default, check=lapack_dtype_check)
def _linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    lu, pivots, _, info = _lu(A)
    return lu, pivots, info


def _det_lu(A):
    # PyTorch's det/slogdet factor the transpose of a real matrix (the LU then lies in
    # the memory order LAPACK wants), and the saved LU and pivots are those of A^T;
    # complex matrices are factored as they are. det(A^T) = det(A).
    if jnp.issubdtype(A.dtype, jnp.complexfloating):
        return _lu(A)
    return _lu(jnp.swapaxes(A, -1, -2))


@lower(aten._linalg_det.default, check=lapack_dtype_check)
def _linalg_det(A):
    lu, pivots, _, _ = _det_lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    det = jnp.prod(diag, axis=-1) * _parity(pivots).astype(A.dtype)
    return det, lu, pivots


@lower(aten._linalg_slogdet.default, check=lapack_dtype_check)
def _linalg_slogdet(A):
    lu, pivots, _, _ = _det_lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    mag = jnp.abs(diag)
    unit = jnp.where(mag == 0, 0, diag / jnp.where(mag == 0, 1, mag))
    sign = jnp.prod(unit, axis=-1) * _parity(pivots).astype(A.dtype)
    logabsdet = jnp.sum(jnp.log(mag), axis=-1)
    return sign.astype(A.dtype), logabsdet, lu, pivots


def _solve_check(A, B, *, left=True, check_errors=False):
    if not left:
        return "linalg.solve with left=False"
    return lapack_dtype_check(A)


def _is_vector_rhs(A, B):
    # PyTorch: B is a batch of vectors when B.ndim == 1, or when it has A's batch
    # shape plus one dimension.
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lower(aten._linalg_solve_ex.default, check=_solve_check)
def _linalg_solve_ex(A, B, *, left=True, check_errors=False):
    lu, pivots, perm, info = _lu(A)
    vector = _is_vector_rhs(A, B)
    x = _lu_solve(lu, perm, B[..., None] if vector else B)
    return (x[..., 0] if vector else x), lu, pivots, info


@lower(aten.linalg_inv_ex.default, check=lapack_dtype_check)
def _linalg_inv_ex(A, *, check_errors=False):
    lu, _, perm, info = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, perm, eye), info


def _permutation(pivots, m):
    """Row permutation ``perm`` (A[perm] = L U) from LAPACK's 1-based pivots."""
    return jax.lax.linalg.lu_pivots_to_permutation(pivots - 1, m)


def _lu_solve_op(lu, perm, B, adjoint):
    """op(A)^-1 B with op = identity or conjugate transpose, from A's LU factors."""
    if not adjoint:
        return _lu_solve(lu, perm, B)
    # A = P^T L U, so A^H X = B is U^H L^H (P X) = B.
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    y = jax.lax.linalg.triangular_solve(
        lu, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True
    )
    z = jax.lax.linalg.triangular_solve(
        lu, y, left_side=True, lower=True, unit_diagonal=True, transpose_a=True, conjugate_a=True
    )
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inverse[..., None], axis=-2)


@lower(aten.linalg_lu_solve.default, check=lapack_dtype_check)
def _linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    perm = _permutation(pivots, LU.shape[-1])
    if left:
        return _lu_solve_op(LU, perm, B, adjoint)
    # X op(A) = B  <=>  op(A)^H X^H = B^H.
    return conj_transpose(_lu_solve_op(LU, perm, conj_transpose(B), not adjoint))


@lower(aten.lu_unpack.default)
def _lu_unpack(LU, pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU.shape[-2:]
    k = min(m, n)
    if unpack_pivots:
        checks.fail_if(
            (pivots < 1) | (pivots > m),
            RuntimeError,
            "pivots passed to lu_unpack must be between 1 and LU.size(-2) inclusive."
            "Did you properly pass the result of lu_factor?",
        )
        perm = _permutation(pivots, m)
        # A = P L U with row perm[c] of A being row c of L U: P[perm[c], c] = 1.
        P = (perm[..., None, :] == jnp.arange(m)[:, None]).astype(LU.dtype)
    else:
        P = jnp.zeros((0,), LU.dtype)
    if unpack_data:
        L = jnp.tril(LU[..., :, :k], -1) + jnp.eye(m, k, dtype=LU.dtype)
        U = jnp.triu(LU[..., :k, :])
    else:
        L = U = jnp.zeros((0,), LU.dtype)
    return P, L, U


# ---------------------------------------------------------------------------------
# Triangular solves and Cholesky
# ---------------------------------------------------------------------------------


def _broadcast_batch(A, B):
    batch = jnp.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    return jnp.broadcast_to(A, batch + A.shape[-2:]), jnp.broadcast_to(B, batch + B.shape[-2:])


@lower(aten.linalg_solve_triangular.default, check=lapack_dtype_check)
def _linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False):
    A, B = _broadcast_batch(A, B)
    return jax.lax.linalg.triangular_solve(
        A, B, left_side=left, lower=not upper, unit_diagonal=unitriangular
    )


@lower(aten.triangular_solve.default, check=lambda B, A, *a, **k: lapack_dtype_check(A))
def _triangular_solve(B, A, upper=True, transpose=False, unitriangular=False):
    A, B = _broadcast_batch(A, B)
    x = jax.lax.linalg.triangular_solve(
        A, B, left_side=True, lower=not upper, transpose_a=transpose, unit_diagonal=unitriangular
    )
    return x, A


@lower(aten.cholesky_solve.default, check=lambda B, L, *a, **k: lapack_dtype_check(L))
def _cholesky_solve(B, L, upper=False):
    # A = L L^H (or U^H U): two triangular solves.
    L, B = _broadcast_batch(L, B)
    if upper:
        y = jax.lax.linalg.triangular_solve(
            L, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True
        )
        return jax.lax.linalg.triangular_solve(L, y, left_side=True, lower=False)
    y = jax.lax.linalg.triangular_solve(L, B, left_side=True, lower=True)
    return jax.lax.linalg.triangular_solve(
        L, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True
    )


def _cholesky_info(A):
    """potrf's info: 1 + the first j whose pivot A_jj - sum_k L_jk^2 is not positive
    (an unblocked Cholesky, run only to find where the factorization stops)."""
    n = A.shape[-1]
    if n == 0:
        return jnp.zeros(A.shape[:-2], np.int32)

    def step(j, carry):
        L, info = carry
        row = jnp.take(L, j, axis=-2)  # (..., n), entries < j are final
        mask = jnp.arange(n) < j
        d = jnp.real(jnp.take(jnp.take(A, j, axis=-2), j, axis=-1)) - jnp.sum(
            jnp.where(mask, jnp.abs(row) ** 2, 0), axis=-1
        )
        bad = ~(d > 0)
        info = jnp.where((info == 0) & bad, j + 1, info)
        ljj = jnp.sqrt(jnp.where(bad, 1, d))
        col = (
            jnp.take(A, j, axis=-1)
            - jnp.einsum(
                "...ik,...k->...i", jnp.where(mask, L, 0), jnp.conj(jnp.where(mask, row, 0))
            )
        ) / ljj[..., None]
        col = jnp.where(jnp.arange(n) > j, col, jnp.where(jnp.arange(n) == j, ljj[..., None], 0))
        L = L + jnp.where(jnp.arange(n)[None, :] == j, col[..., :, None], 0).astype(L.dtype)
        return L, info

    info0 = jnp.zeros(A.shape[:-2], np.int32)
    _, info = jax.lax.fori_loop(0, n, step, (jnp.zeros_like(A), info0))
    return info


@lower(aten.linalg_cholesky_ex.default, check=lapack_dtype_check)
def _linalg_cholesky_ex(A, *, upper=False, check_errors=False):
    # Only one triangle is read, as in LAPACK: the lower one, or for upper=True the
    # upper one (the lower triangle of A^H). When A is not positive definite, info is
    # exact but L holds NaN where LAPACK leaves a partial factorization.
    if upper:
        A = jnp.conj(jnp.swapaxes(A, -1, -2))
    L = jax.lax.linalg.cholesky(A, symmetrize_input=False)
    ok = jnp.all(jnp.isfinite(L), axis=(-2, -1))
    info = jnp.where(ok, 0, _cholesky_info(A)).astype(np.int32)
    return (jnp.conj(jnp.swapaxes(L, -1, -2)) if upper else L), info


# aten.cholesky has no rule: it raises on a matrix that is not positive definite, which
# XLA cannot; dynajax/aot/table.py rewrites it to linalg_cholesky_ex plus the
# host error check.


@lower(aten.cholesky_inverse.default, check=lapack_dtype_check)
def _cholesky_inverse(L, upper=False):
    # (L L^H)^-1 = L^-H L^-1, or (U^H U)^-1 = U^-1 U^-H; LAPACK's potri reads only the
    # factor's triangle.
    n = L.shape[-1]
    if n == 0:
        return L
    eye = jnp.broadcast_to(jnp.eye(n, dtype=L.dtype), L.shape)
    inv = jax.lax.linalg.triangular_solve(L, eye, left_side=True, lower=not upper)
    if upper:
        return inv @ conj_transpose(inv)
    return conj_transpose(inv) @ inv


def _lu_check(A, *, pivot=True):
    if not pivot:
        return "linalg.lu with pivot=False (PyTorch's CPU kernel has no unpivoted LU)"
    return lapack_dtype_check(A)


@lower(aten.linalg_lu.default, check=_lu_check)
def _linalg_lu(A, *, pivot=True):
    m, n = A.shape[-2:]
    k = min(m, n)
    if k == 0:
        P = jnp.broadcast_to(jnp.eye(m, dtype=A.dtype), (*A.shape[:-2], m, m))
        return (
            P,
            jnp.zeros((*A.shape[:-2], m, 0), A.dtype),
            jnp.zeros((*A.shape[:-2], 0, n), A.dtype),
        )
    lu, pivots, _, _ = _lu(A)
    return _lu_unpack(lu, pivots)

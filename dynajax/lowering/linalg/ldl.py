"""Symmetric indefinite factorization: ``linalg.ldl_factor_ex`` and ``linalg.ldl_solve``.

PyTorch calls LAPACK's ``sytrf`` (``hetrf`` for ``hermitian=True`` complex input): the
Bunch-Kaufman factorization A = P L D L^T P^T of the lower triangle, with D made of 1x1
and 2x2 blocks. Unlike LU or Cholesky, XLA has no such factorization, and the result is
not unique: it depends on every pivoting decision. So the rule below is LAPACK's own
unblocked algorithm (``sytf2``/``hetf2``, what ``sytrf`` runs for matrices below its
block size), step by step, in the same storage: the same pivot tests (``alpha`` =
(1 + sqrt(17)) / 8, ``|re| + |im|`` magnitudes for complex), the same interchanges
confined to the trailing submatrix, the multipliers scaled and stored where LAPACK
stores them, the upper triangle left zero as PyTorch returns it. Its pivots are
LAPACK's exactly (1-based, negative for a 2x2 block), on every matrix tried up to
130x130 (MKL blocks from 64 on); ``LD`` agrees within rounding (float32: ~1e-6
relative; a NumPy transcription of the same steps is bit-exact with MKL, XLA's compiled
arithmetic differs in the last bits).

Each step is a masked update of the whole matrix inside ``lax.while_loop`` (a step is
one or two columns, a data-dependent choice), vmapped over the batch: O(n^3) work, as
LAPACK's, with n small in practice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.lowering.linalg.common import lapack_dtype_check
from dynajax.lowering.registry import lower

aten = torch.ops.aten


def _alpha(real_dtype):
    """Bunch-Kaufman's growth bound (1 + sqrt(17)) / 8, computed in the working
    precision as LAPACK computes it."""
    t = np.dtype(real_dtype).type
    return (t(1) + np.sqrt(t(17))) / t(8)


def _magnitude(x):
    """LAPACK's pivot magnitude: |x| for real, |re| + |im| (``cabs1``) for complex."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.abs(jnp.real(x)) + jnp.abs(jnp.imag(x))
    return jnp.abs(x)


def _batched(fn, *arrays):
    """``fn`` over the leading batch dimensions of ``arrays`` (already broadcast)."""
    batch = arrays[0].shape[:-2] if arrays[0].ndim >= 2 else ()
    for _ in batch:
        fn = jax.vmap(fn)
    return fn(*arrays)


def _factor(A, hermitian):
    """(LD, pivots, info) of one n x n matrix, as LAPACK's sytf2/hetf2 with uplo='L'."""
    n = A.shape[-1]
    dtype = A.dtype
    herm = hermitian and jnp.issubdtype(dtype, jnp.complexfloating)
    conj = jnp.conj if herm else (lambda v: v)
    idx = jnp.arange(n)
    rows, cols = idx[:, None], idx[None, :]
    lower_tri = rows >= cols
    alpha = _alpha(jnp.real(jnp.zeros((), dtype)).dtype)

    def diag_magnitude(v):
        return jnp.abs(jnp.real(v)) if herm else _magnitude(v)

    def real_diagonal(M):
        return jnp.where(rows == cols, jnp.real(M).astype(dtype), M) if herm else M

    def step(state):
        A, ipiv, info, k = state
        absakk = diag_magnitude(A[k, k])
        below = idx > k
        col = jnp.where(below, _magnitude(A[:, k]), -1)
        imax = jnp.argmax(col)  # the first largest, as LAPACK's i?amax
        colmax = jnp.maximum(col[imax], 0)
        # The largest off-diagonal magnitude in row/column imax of the trailing matrix.
        in_row = (idx >= k) & (idx < imax)
        in_col = idx > imax
        rowmax = jnp.max(
            jnp.where(in_row, _magnitude(A[imax, :]), jnp.where(in_col, _magnitude(A[:, imax]), 0))
        )
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        keep = zero | (absakk >= alpha * colmax) | (absakk >= alpha * colmax * (colmax / rowmax))
        one_by_one = keep | (diag_magnitude(A[imax, imax]) >= alpha * rowmax)
        kp = jnp.where(keep, k, imax)
        kstep = jnp.where(one_by_one, 1, 2)
        kk = k + kstep - 1

        # Interchange rows and columns kk and kp of the trailing submatrix A[k:, k:]:
        # a symmetric permutation of the matrix its lower triangle stands for.
        full = jnp.where(lower_tri, A, conj(A.T))
        perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
        trailing = lower_tri & (rows >= k) & (cols >= k)
        A = real_diagonal(jnp.where(trailing, full[perm][:, perm], A))

        # One column eliminated (a 1x1 pivot): A22 -= x d11 x^H, then x *= d11.
        akk = jnp.real(A[k, k]).astype(dtype) if herm else A[k, k]
        r1 = 1 / jnp.where(zero, 1, akk)
        x = jnp.where(below, A[:, k], 0)
        update = A + x[:, None] * ((-r1) * conj(x)[None, :])
        keep_update = lower_tri & (rows > k) & (cols > k) & (x[None, :] != 0)
        A1 = jnp.where(keep_update, update, A)
        A1 = real_diagonal(jnp.where(below[:, None] & (cols == k), r1 * x[:, None], A1))

        # Two columns eliminated (a 2x2 pivot), as sytf2/hetf2 write it. (k + 1 is
        # clamped for the 1x1 case, whose result this is not.)
        k1 = jnp.minimum(k + 1, n - 1)
        a_k, a_k1 = A[:, k], A[:, k1]
        d21 = A[k1, k]
        if herm:
            d = jnp.abs(d21)
            d = jnp.where(d == 0, 1, d)
            d11 = jnp.real(A[k1, k1]) / d
            d22 = jnp.real(A[k, k]) / d
            tt = 1 / (d11 * d22 - 1)
            unit = d21 / d
            scale = tt / d
            wk = scale * (d11 * a_k - unit * a_k1)
            wkp1 = scale * (d22 * a_k1 - jnp.conj(unit) * a_k)
        else:
            d21 = jnp.where(d21 == 0, 1, d21)
            d11 = A[k1, k1] / d21
            d22 = A[k, k] / d21
            t = 1 / (d11 * d22 - 1)
            scale = t / d21
            wk = scale * (d11 * a_k - a_k1)
            wkp1 = scale * (d22 * a_k1 - a_k)
        past = idx > k + 1
        wk, wkp1 = jnp.where(past, wk, 0), jnp.where(past, wkp1, 0)
        update2 = A - a_k[:, None] * conj(wk)[None, :] - a_k1[:, None] * conj(wkp1)[None, :]
        A2 = jnp.where(lower_tri & (rows > k + 1) & (cols > k + 1), update2, A)
        A2 = jnp.where(past[:, None] & (cols == k), wk[:, None], A2)
        A2 = real_diagonal(jnp.where(past[:, None] & (cols == k + 1), wkp1[:, None], A2))

        A = jnp.where(zero, A, jnp.where(kstep == 1, A1, A2))
        pivot = (kp + 1).astype(np.int32)
        ipiv = jnp.where(kstep == 1, ipiv.at[k].set(pivot), ipiv.at[k].set(-pivot))
        ipiv = jnp.where(kstep == 2, ipiv.at[k1].set(-pivot), ipiv)
        info = jnp.where(zero & (info == 0), (k + 1).astype(np.int32), info)
        return A, ipiv, info, k + kstep

    A = real_diagonal(jnp.tril(A))
    state = (A, jnp.zeros(n, np.int32), jnp.zeros((), np.int32), jnp.zeros((), np.int32))
    A, ipiv, info, _ = jax.lax.while_loop(lambda s: s[3] < n, step, state)
    return A, ipiv, info


def _ldl_factor_check(A, *, hermitian=False, check_errors=False):
    return lapack_dtype_check(A)


@lower(aten.linalg_ldl_factor_ex.default, check=_ldl_factor_check)
def _linalg_ldl_factor_ex(A, *, hermitian=False, check_errors=False):
    # check_errors=True raises in eager; the host-side check stays with PyTorch (the
    # info output is exact), as for the other *_ex factorizations.
    n = A.shape[-1]
    if n == 0:
        batch = A.shape[:-2]
        return A, jnp.zeros((*batch, 0), np.int32), jnp.zeros(batch, np.int32)
    return _batched(lambda a: _factor(a, hermitian), A)


def _solve(LD, ipiv, B, hermitian):
    """X with A X = B, from one matrix's sytf2/hetf2 factors (LAPACK's sytrs/hetrs)."""
    n = LD.shape[-1]
    herm = hermitian and jnp.issubdtype(LD.dtype, jnp.complexfloating)
    conj = jnp.conj if herm else (lambda v: v)
    idx = jnp.arange(n)

    def swap(B, i, j):
        perm = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
        return B[perm]

    def at(i):
        return jnp.clip(i, 0, n - 1)

    # L D Y = B, k going up.
    def forward(state):
        B, k = state
        block = ipiv[k] < 0
        second = at(k + 1)
        kp = jnp.where(block, -ipiv[k], ipiv[k]) - 1
        B = swap(B, jnp.where(block, second, k), kp)
        # Multiply by inv(L(k)): the multipliers below the pivot block.
        # (Products are masked after they are formed: 0 * inf must not turn into NaN
        # where LAPACK does not multiply at all.)
        past = jnp.where(block, idx > k + 1, idx > k)[:, None]
        B = jnp.where(past, B + LD[:, k, None] * (-B[k])[None, :], B)
        B = jnp.where(past & block, B + LD[:, second, None] * (-B[second])[None, :], B)
        # Multiply by inv(D(k)).
        if herm:
            one = B.at[k].multiply(1 / jnp.real(LD[k, k]))
        else:
            one = B.at[k].multiply(1 / LD[k, k])
        akm1k = jnp.where(block, LD[second, k], 1)
        akm1 = LD[k, k] / (jnp.conj(akm1k) if herm else akm1k)
        ak = LD[second, second] / akm1k
        denom = akm1 * ak - 1
        bkm1 = B[k] / (jnp.conj(akm1k) if herm else akm1k)
        bk = B[second] / akm1k
        two = B.at[k].set((ak * bkm1 - bk) / denom).at[second].set((akm1 * bk - bkm1) / denom)
        return jnp.where(block, two, one), k + jnp.where(block, 2, 1)

    # L^T X = Y (L^H for hermitian), k going down.
    def backward(state):
        B, k = state
        block = ipiv[k] < 0
        first = at(k - 1)
        tail = (idx > k)[:, None]

        def dot(j):  # L[k+1:, j]^T B[k+1:] (^H for hermitian)
            return jnp.sum(jnp.where(tail, conj(LD[:, j, None]) * B, 0), axis=0)

        B = B.at[k].add(-dot(k))
        rest = B.at[first].add(-dot(first))
        B = jnp.where(block, rest, B)
        kp = jnp.where(block, -ipiv[k], ipiv[k]) - 1
        return swap(B, k, kp), k - jnp.where(block, 2, 1)

    B, _ = jax.lax.while_loop(lambda s: s[1] < n, forward, (B, jnp.zeros((), np.int32)))
    B, _ = jax.lax.while_loop(lambda s: s[1] >= 0, backward, (B, jnp.asarray(n - 1, np.int32)))
    return B


def _ldl_solve_check(LD, pivots, B, *, hermitian=False):
    return lapack_dtype_check(LD)


@lower(aten.linalg_ldl_solve.default, check=_ldl_solve_check)
def _linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    n = LD.shape[-1]
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    LD = jnp.broadcast_to(LD, batch + LD.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:]).astype(np.int32)
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    if n == 0 or B.shape[-1] == 0:
        return B
    return _batched(lambda a, p, b: _solve(a, p, b, hermitian), LD, pivots, B)

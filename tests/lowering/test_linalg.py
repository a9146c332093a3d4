"""Linear algebra (QR, SVD, eigen, LU, Cholesky, LDL, pseudo-inverse) against eager PyTorch:
the rules of ``dynajax/lowering/linalg/`` (``factorizations``, ``orthogonal``, ``ldl``).

Each case compiles one small function with dynajax, compares it with eager
(``tests.tolerances.assert_same``: vectors included, so a sign convention that differs
from PyTorch's MKL fails), and checks that the op ran in a JAX partition. The refused
cases check that the node falls back with its reason instead.

    pytest -q tests/lowering/test_linalg.py -k qr
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dynajax
from tests.helpers import Case, case_params, randn, run_case
from tests.tolerances import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated:UserWarning")


def spd(*shape, dtype=torch.float64):
    """Hermitian positive definite matrices."""
    a = torch.randn(*shape, dtype=dtype)
    return a @ a.mH + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def hermitian(*shape, dtype=torch.float64):
    a = torch.randn(*shape, dtype=dtype)
    return a + a.mH


def symmetric(*shape, dtype=torch.float64):
    a = torch.randn(*shape, dtype=dtype)
    return a + a.mT


def zero_diagonal(n, dtype=torch.float32):
    """Symmetric with a zero diagonal: Bunch-Kaufman must take 2x2 pivots."""
    a = symmetric(n, n, dtype=dtype)
    return a - torch.diag(torch.diagonal(a))


def _complex_svd_counterexample() -> torch.Tensor:
    """A full-rank complex128 matrix whose U differs between MKL's gesdd and XLA's
    (columns 22 and 24 by 0.66 and 0.59, on this project's machine)."""
    rng = np.random.default_rng(1)
    for shape in [(3, 2)] * 8 + [(6, 4)] * 8 + [(25, 25)] * 3:
        a = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    return torch.from_numpy(a)


def low_rank(m, n, r, dtype=torch.float64):
    return torch.randn(m, r, dtype=dtype) @ torch.randn(r, n, dtype=dtype)


def hermitian_low_rank(n, r, dtype=torch.float64):
    x = torch.randn(n, r, dtype=dtype)
    return x @ x.mH


C64, F64 = torch.complex64, torch.float64
QR = "aten.linalg_qr.default"
SVD = "aten._linalg_svd.default"
EIGH = "aten._linalg_eigh.default"
LDL = "aten.linalg_ldl_factor_ex.default"

CASES = [
    # QR and Householder reflectors
    Case("qr-reduced-tall-float32", torch.linalg.qr, lambda: (randn(6, 4),), (QR,)),
    Case("qr-reduced-wide-float64", torch.linalg.qr, lambda: (randn(3, 5, dtype=F64),), (QR,)),
    Case(
        "qr-complete-tall-batched-complex64",
        lambda a: torch.linalg.qr(a, mode="complete"),
        lambda: (randn(2, 5, 3, dtype=C64),),
        (QR,),
    ),
    Case("qr-r-float32", lambda a: torch.linalg.qr(a, mode="r")[1], lambda: (randn(4, 4),), (QR,)),
    Case(
        "qr-complete-empty-columns-float32",
        lambda a: torch.linalg.qr(a, mode="complete"),
        lambda: (randn(3, 0),),
        (QR,),
    ),
    Case(
        "geqrf-wide-float64",
        torch.geqrf,
        lambda: (randn(2, 3, 5, dtype=F64),),
        ("aten.geqrf.default",),
    ),
    Case(
        "householder_product-complex64",
        lambda a: torch.linalg.householder_product(*torch.geqrf(a)),
        lambda: (randn(5, 3, dtype=C64),),
        ("aten.linalg_householder_product.default",),
    ),
    Case(
        "ormqr-left-transpose-float64",
        lambda a, c: torch.ormqr(*torch.geqrf(a), c, left=True, transpose=True),
        lambda: (randn(5, 3, dtype=F64), randn(5, 2, dtype=F64)),
        ("aten.ormqr.default",),
    ),
    Case(
        "ormqr-right-complex64",
        lambda a, c: torch.ormqr(*torch.geqrf(a), c, left=False),
        lambda: (randn(2, 4, 4, dtype=C64), randn(2, 3, 4, dtype=C64)),
        ("aten.ormqr.default",),
    ),
    # Singular values (values only, whatever the dtype)
    Case("svdvals-batched-float32", torch.linalg.svdvals, lambda: (randn(3, 4, 6),), (SVD,)),
    Case(
        "svdvals-empty-float64", torch.linalg.svdvals, lambda: (randn(2, 0, 3, dtype=F64),), (SVD,)
    ),
    Case(
        "svdvals-complex64",
        torch.linalg.svdvals,
        lambda: (randn(2, 3, 5, dtype=C64),),
        (SVD,),
    ),
    Case("matrix_rank-float64", torch.linalg.matrix_rank, lambda: (low_rank(5, 6, 2),), (SVD,)),
    Case(
        "matrix_rank-atol-float32",
        lambda a: torch.linalg.matrix_rank(a, atol=1.0),
        lambda: (randn(4, 4),),
        (SVD,),
    ),
    Case("cond-float32", torch.linalg.cond, lambda: (randn(2, 4, 4),), (SVD,)),
    Case(
        "nuclear-norm-float64",
        lambda a: torch.linalg.matrix_norm(a, "nuc"),
        lambda: (randn(5, 3, dtype=F64),),
        (SVD,),
    ),
    # Eigenvalues
    Case(
        "eigvalsh-lower-float32",
        torch.linalg.eigvalsh,
        lambda: (hermitian(3, 4, 4, dtype=torch.float32),),
        (EIGH,),
    ),
    Case(
        "eigvalsh-upper-reads-upper-triangle-complex64",
        lambda a: torch.linalg.eigvalsh(a, UPLO="U"),
        lambda: (randn(4, 4, dtype=C64),),
        (EIGH,),
    ),
    Case(
        "matrix_rank-hermitian-float64",
        lambda a: torch.linalg.matrix_rank(a, hermitian=True),
        lambda: (hermitian_low_rank(5, 2),),
        (EIGH,),
    ),
    Case(
        "eig-complex64",
        torch.linalg.eig,
        lambda: (randn(2, 5, 5, dtype=C64),),
        ("aten.linalg_eig.default",),
    ),
    Case(
        "eigvals-complex64",
        torch.linalg.eigvals,
        lambda: (randn(4, 4, dtype=C64),),
        ("aten.linalg_eig.default",),
    ),
    # Pseudo-inverse (independent of the vectors' signs)
    Case(
        "pinv-wide-float32",
        torch.linalg.pinv,
        lambda: (randn(3, 5),),
        ("aten.linalg_pinv.atol_rtol_tensor",),
    ),
    Case(
        "pinv-singular-rtol-float64",
        lambda a: torch.linalg.pinv(a, rtol=1e-3),
        lambda: (low_rank(5, 5, 3),),
        ("aten.linalg_pinv.atol_rtol_tensor",),
    ),
    Case(
        "pinv-hermitian-atol-float64",
        lambda a: torch.linalg.pinv(a, atol=0.5, hermitian=True),
        lambda: (hermitian(2, 4, 4),),
        ("aten.linalg_pinv.atol_rtol_tensor",),
    ),
    Case("pinverse-empty-float32", torch.pinverse, lambda: (randn(0, 3),), ()),
    # LU, Cholesky
    Case(
        "lu-tall-batched-float64",
        torch.linalg.lu,
        lambda: (randn(2, 5, 3, dtype=F64),),
        ("aten.linalg_lu.default",),
    ),
    Case(
        "lu-wide-complex64",
        torch.linalg.lu,
        lambda: (randn(3, 5, dtype=C64),),
        ("aten.linalg_lu.default",),
    ),
    Case(
        "cholesky-lower-float64",
        torch.cholesky,
        lambda: (spd(2, 4, 4),),
        ("aten.linalg_cholesky_ex.default",),  # torch.cholesky, rewritten (passes)
    ),
    Case(
        "cholesky-upper-complex64",
        lambda a: torch.cholesky(a, upper=True),
        lambda: (spd(4, 4, dtype=C64),),
        ("aten.linalg_cholesky_ex.default",),  # torch.cholesky, rewritten (passes)
    ),
    Case(
        "cholesky_inverse-lower-float64",
        torch.cholesky_inverse,
        lambda: (torch.linalg.cholesky(spd(4, 4)),),
        ("aten.cholesky_inverse.default",),
    ),
    Case(
        "cholesky_inverse-upper-reads-triangle-complex64",
        lambda u: torch.cholesky_inverse(u, upper=True),
        lambda: (
            torch.linalg.cholesky(spd(3, 3, dtype=C64), upper=True)
            + torch.tril(randn(3, 3, dtype=C64), -1),
        ),
        ("aten.cholesky_inverse.default",),
    ),
    # LDL^T (Bunch-Kaufman): pivots exact, 1x1 and 2x2 blocks
    Case(
        "ldl_factor_ex-indefinite-batched-float64",
        torch.linalg.ldl_factor_ex,
        lambda: (hermitian(3, 6, 6),),
        (LDL,),
    ),
    Case(
        "ldl_factor_ex-zero-diagonal-2x2-pivots-float32",
        torch.linalg.ldl_factor_ex,
        lambda: (zero_diagonal(5),),
        (LDL,),
    ),
    Case(
        "ldl_factor_ex-singular-info-float64",
        torch.linalg.ldl_factor_ex,
        lambda: (torch.zeros(2, 3, 3, dtype=F64),),
        (LDL,),
    ),
    Case(
        "ldl_factor_ex-hermitian-complex64",
        lambda a: torch.linalg.ldl_factor_ex(a, hermitian=True),
        lambda: (hermitian(2, 5, 5, dtype=C64),),
        (LDL,),
    ),
    Case(
        "ldl_factor_ex-complex-symmetric-complex128",
        torch.linalg.ldl_factor_ex,
        lambda: (symmetric(4, 4, dtype=torch.complex128),),
        (LDL,),
    ),
    Case(
        "ldl_factor_ex-past-lapack-block-size-float64",
        torch.linalg.ldl_factor_ex,
        lambda: (hermitian(70, 70),),
        (LDL,),
    ),
    Case(
        "ldl_factor-float64",
        torch.linalg.ldl_factor,
        lambda: (hermitian(4, 4),),
        (LDL,),
    ),
    Case(
        "ldl_solve-broadcast-float64",
        torch.linalg.ldl_solve,
        lambda: (*torch.linalg.ldl_factor(zero_diagonal(5, dtype=F64)), randn(3, 5, 2, dtype=F64)),
        ("aten.linalg_ldl_solve.default",),
    ),
    Case(
        "ldl_solve-hermitian-complex64",
        lambda ld, piv, b: torch.linalg.ldl_solve(ld, piv, b, hermitian=True),
        lambda: (
            *torch.linalg.ldl_factor(hermitian(2, 4, 4, dtype=C64), hermitian=True),
            randn(2, 4, 3, dtype=C64),
        ),
        ("aten.linalg_ldl_solve.default",),
    ),
    Case(
        "ldl_factor-then-solve-float32",
        lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), b),
        lambda: (zero_diagonal(6) + torch.eye(6), randn(6, 1)),
        (LDL, "aten.linalg_ldl_solve.default"),
    ),
    # matrix exponential (float64; float32 is refused, below)
    Case(
        "matrix_exp-large-norm-float64",
        torch.linalg.matrix_exp,
        lambda: (
            randn(3, 5, 5, dtype=F64) * torch.tensor([0.01, 2.0, 30.0], dtype=F64)[:, None, None],
        ),
        ("aten.linalg_matrix_exp.default",),
    ),
    Case(
        "matrix_exp-complex128",
        torch.matrix_exp,
        lambda: (randn(4, 4, dtype=torch.complex128) * 3,),
        ("aten.linalg_matrix_exp.default",),
    ),
    Case(
        "matrix_exp-empty-float64",
        torch.linalg.matrix_exp,
        lambda: (randn(2, 0, 0, dtype=F64),),
        ("aten.linalg_matrix_exp.default",),
    ),
    # addbmm
    Case(
        "addbmm-beta0-ignores-nan-float32",
        lambda b, x, y: torch.addbmm(b, x, y, beta=0, alpha=2),
        lambda: (torch.full((3, 4), float("nan")), randn(5, 3, 2), randn(5, 2, 4)),
        ("aten.addbmm.default",),
    ),
    Case(
        "addbmm-broadcast-bias-float64",
        lambda b, x, y: torch.addbmm(b, x, y, beta=0.5, alpha=-1.5),
        lambda: (randn(4, dtype=F64), randn(3, 2, 6, dtype=F64), randn(3, 6, 4, dtype=F64)),
        ("aten.addbmm.default",),
    ),
    Case(
        "addbmm-float16",
        lambda b, x, y: torch.addbmm(b, x, y, alpha=0.5),
        lambda: tuple(randn(*s).half() for s in ((3, 4), (6, 3, 5), (6, 5, 4))),
        ("aten.addbmm.default",),
    ),
    Case(
        "addbmm-int64",
        lambda b, x, y: torch.addbmm(b, x, y, beta=2, alpha=3),
        lambda: tuple(torch.randint(-5, 5, s) for s in ((2, 3), (4, 2, 5), (4, 5, 3))),
        ("aten.addbmm.default",),
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_decomposition(case: Case):
    run_case(case)


# ---------------------------------------------------------------------------------
# Refused: the vectors' signs differ between PyTorch's MKL and XLA's LAPACK
# ---------------------------------------------------------------------------------

REFUSED = [
    ("svd-vectors-float32", torch.linalg.svd, lambda: (randn(3, 5),), SVD, "real singular vectors"),
    (
        "svd-vectors-complex128",
        lambda a: torch.linalg.svd(a, full_matrices=False),
        lambda: (_complex_svd_counterexample(),),
        SVD,
        "complex singular vectors",
    ),
    (
        "eigh-vectors-complex64",
        torch.linalg.eigh,
        lambda: (hermitian(4, 4, dtype=C64),),
        EIGH,
        "eigenvectors",
    ),
    (
        "eig-real-float64",
        torch.linalg.eig,
        lambda: (randn(4, 4, dtype=F64),),
        "aten.linalg_eig.default",
        "real",
    ),
    (
        "matrix_exp-float32",
        torch.linalg.matrix_exp,
        lambda: (randn(4, 4) * 20,),
        "aten.linalg_matrix_exp.default",
        "Taylor",
    ),
    (
        "svd-driver-float32",
        lambda a: torch.linalg.svd(a, driver="gesvd"),
        lambda: (randn(3, 3, dtype=C64),),
        SVD,
        "driver",
    ),
]


@pytest.mark.parametrize(
    "fn,inputs,op,reason", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refused(fn, inputs, op, reason):
    torch.manual_seed(0)
    args = inputs()
    backend = dynajax.Backend()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    try:
        expected = fn(*args)
    except RuntimeError:  # eager rejects it too (driver= on CPU)
        with pytest.raises(RuntimeError):
            compiled(*args)
        return
    assert_same(compiled(*args), expected)
    refused = [f for f in dynajax.Report(backend.graphs).fallbacks if str(f.target) == op]
    assert refused, f"{op} was not refused"
    assert all(reason in f.detail for f in refused)


def test_cholesky_of_a_matrix_that_is_not_positive_definite_raises_eagers_error() -> None:
    compiled = torch.compile(torch.cholesky, backend=dynajax.Backend())
    bad = -torch.eye(3)
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        torch.cholesky(bad)
    with pytest.raises(torch.linalg.LinAlgError) as got:
        compiled(bad)
    assert str(got.value) == str(eager.value)

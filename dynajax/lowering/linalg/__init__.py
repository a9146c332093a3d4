"""Linear algebra rules, one module per family.

- ``products``: matrix products (mm, bmm, matmul, addmm, trilinear), the pairwise
  distances built on them (cdist, pdist) and the matrix exponential.
- ``factorizations``: LU and Cholesky with the determinants, inverses and solves built
  on them, and triangular solves: the factorizations whose results are unique.
- ``orthogonal``: QR, SVD, eigendecompositions and the pseudo-inverse, computed by
  orthogonal (unitary) transformations; their vectors are unique only up to sign (or
  phase).
- ``ldl``: the Bunch-Kaufman symmetric indefinite factorization and its solve.
- ``common``: the dtype check and helpers the families share.

``dynajax.lowering`` imports the family modules (this package imports none of them), so
that one place lists every family.
"""

"""Imports every op-family module so that their rules register in the table."""

from dynajax.lowering import (  # noqa: F401
    attention,
    conv_pool,
    creation,
    decompositions,
    elementwise,
    factorizations,
    fft,
    fused,
    indexing,
    linalg,
    nn,
    random,
    reductions,
    resample,
    shape,
    sorting,
    special,
)

"""Imports every op-family module so that their rules register in the table."""

from dynajax.lowering import (  # noqa: F401
    conv_pool,
    creation,
    elementwise,
    indexing,
    linalg,
    nn,
    random,
    reductions,
    shape,
)

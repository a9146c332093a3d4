"""Imports every op-family module so that their rules register in the table."""

import importlib.util

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
    ldl,
    linalg,
    nn,
    random,
    reductions,
    resample,
    shape,
    sorting,
    special,
)

# Ops that only some torch releases define.
if importlib.util.find_spec("torch.nn.modules.linear_cross_entropy") is not None:
    from dynajax.lowering import chunked_loss  # noqa: F401

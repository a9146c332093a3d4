"""ATen to JAX: the table of rules (``registry``), the modules that fill it, one per op
family, the interpreter that runs a graph through it (``interpreter``), and the value
checks rules record while traced (``checks``: eager's errors on argument values).

This package owns the list of family modules: importing anything from it (``registry``
included, since Python imports a package before its modules) imports every family, so
the table is full before anyone reads it. ``registry`` itself imports nothing from
dynajax, and no family module is imported by it, so there is no import circle.
"""

from __future__ import annotations

import importlib.util

from dynajax.lowering import (  # noqa: F401  (each registers its rules on import)
    attention,
    barriers,
    conv_pool,
    creation,
    elementwise,
    fft,
    fused,
    indexing,
    interop,
    nn,
    random,
    reductions,
    resample,
    shape,
    sorting,
    special,
    transformers_ops,
)
from dynajax.lowering.linalg import (  # noqa: F401
    factorizations,
    ldl,
    orthogonal,
    products,
)

# Ops that only some torch releases define (torch 2.13 on).
if importlib.util.find_spec("torch.nn.modules.linear_cross_entropy") is not None:
    from dynajax.lowering import chunked_loss  # noqa: F401

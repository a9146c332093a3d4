"""The aot stage: how aot_autograd turns Dynamo's graph into ATen graphs for dynajax.

aot_autograd functionalizes Dynamo's FX graph, decomposes it to ATen with the table
``decompositions()`` and, for training, splits it into forward and backward graphs;
each ATen graph then goes to ``Backend.compile_aten_graph``. The modules:

* ``table.py``: the decomposition table and its corrections (every decision
  about that table).
* ``tracing.py``: the traces of whole programs, decomposed with that table, for the
  whole-graph callers (``train_step``, ``jax_function``'s gradients):
  ``functional_graph``, ``joint_graph``, ``functionalized``, ``compiling``.
* ``compile.py``: the backend's adapter (``aot_compile``): aot_autograd run on
  Dynamo's graph, each ATen graph handed to the backend's compiler.
* ``cache.py``: aot_autograd's result cached across processes.
* ``rebuild.py``: a training graph's autograd wrapper, recorded while aot_autograd
  traces it and rebuilt from the cache.

This package re-exports the names other packages use; its modules import each other
by their full module paths.
"""

from __future__ import annotations

from dynajax.aot.compile import aot_compile
from dynajax.aot.table import (
    causal_math_attention,
    corrections,
    decompositions,
    eager_aware,
)
from dynajax.aot.tracing import compiling, functional_graph, functionalized, joint_graph

__all__ = [
    "aot_compile",
    "causal_math_attention",
    "compiling",
    "corrections",
    "decompositions",
    "eager_aware",
    "functional_graph",
    "functionalized",
    "joint_graph",
]

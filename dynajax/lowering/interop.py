"""dynajax's own custom op ``dynajax::call_jax``: its schema and its rule.

``dynajax.call_jax(jax_fn, *tensors)`` is one node of the graph, which names the JAX
function by a registry key (``dynajax/interop/call_jax.py``). Its rule traces that
function into the partition being lowered, so XLA compiles it with the nodes around it.
The backward of a ``call_jax`` is a ``call_jax`` of the function's VJP (a derived
registry entry), so this one rule also lowers the backward graph.

The schema is declared here and the implementations (eager, fake, autograd) register
against it in ``dynajax.interop.call_jax``: the table must name the overload while this
package is imported, and the ``dynajax.interop`` package cannot be imported from here
then (it imports ``dynajax.capability``, which imports this package). The rule reaches
the registry at lowering time, when every module is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from dynajax.lowering.registry import lower

torch.library.define("dynajax::call_jax", "(str key, Tensor[] args) -> Tensor[]")


@lower(torch.ops.dynajax.call_jax.default)
def _call_jax(key: str, args: list[Any]) -> list[Any]:
    # Imported here, not at the top: see the module docstring.
    from dynajax.interop.call_jax import jax_call

    return jax_call(key, args)

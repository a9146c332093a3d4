"""``dynajax::recompute_barrier``: values made opaque to XLA and available only once
other values are.

``recompute_barrier(xs, after)`` is ``xs`` in value. In eager PyTorch (where nothing
merges or reorders ops) it copies them. In JAX each is ``where(p, x, 0)`` with ``p`` a
predicate XLA cannot evaluate before it runs (true for every value of an element of
each tensor of ``after``: ``s == s or s != s``), so that

* XLA's common-subexpression elimination cannot merge the ops that follow with the
  same ops on ``xs`` (a ``jax.lax.optimization_barrier`` would do that on a GPU; XLA's
  CPU compiler expands barriers away before it eliminates common subexpressions), and
* nothing that follows can run before ``after`` exists.

``dynajax.passes.recompute`` puts one in front of each region of a whole-step graph
that ``torch.utils.checkpoint`` runs again in the backward, with ``after`` a value of
the backward computed just before the region is needed: XLA then recomputes the region
there, instead of keeping the forward's values alive until then.
``dynajax.passes.inplace`` puts one in front of the update of each donated input, with
``after`` the input's other readers, so that XLA writes the update into the input's
buffer instead of copying it first.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch

from dynajax.lowering.registry import lower


@torch.library.custom_op("dynajax::recompute_barrier", mutates_args=())
def recompute_barrier(xs: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@recompute_barrier.register_fake
def _recompute_barrier_fake(
    xs: list[torch.Tensor], after: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


@lower(torch.ops.dynajax.recompute_barrier.default)
def _recompute_barrier(xs: list[Any], after: list[Any]) -> list[Any]:
    p = jnp.bool_(True)
    for a in after:
        s = jnp.ravel(a)[0] if a.size else jnp.zeros((), a.dtype)
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            s = s.astype(jnp.float32)
        # True for every s (NaN included); XLA does not know it, so it cannot fold it.
        p = p & ((s == s) | (s != s))
    return [jnp.where(p, x, jnp.zeros((), x.dtype)) for x in xs]

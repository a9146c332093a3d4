"""Torch values and structures as a JAX function takes and returns them.

``jax_values(tree)``: tensors as ``jax.Array`` (zero-copy where the device allows),
transformers caches as their dicts; ``jax_tree(spec, leaves)``: a torch pytree's
structure with containers JAX can trace. ``jax_function`` and ``export`` (stablehlo/)
use both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from dynajax.interop import kv_caches as caches
from dynajax.runtime.conversion import to_jax


def jax_values(tree: Any) -> Any:
    """Torch values as a JAX function takes them: tensors as ``jax.Array`` (zero-copy
    where the device allows), transformers caches as their dicts, containers as
    ``jax_tree`` gives them."""
    leaves, spec = pytree.tree_flatten(tree)
    return jax_tree(spec, iter(to_jax(v) if isinstance(v, torch.Tensor) else v for v in leaves))


def jax_tree(spec: pytree.TreeSpec, leaves: Any) -> Any:
    """The torch output structure, with containers JAX can trace: tuples, lists,
    namedtuples and dicts as themselves, any other container with keys (a
    ``transformers`` ModelOutput) as a dict of its fields, the rest as tuples."""
    if spec.is_leaf():
        return next(leaves)
    children = [jax_tree(c, leaves) for c in spec.children()]
    kind = spec.type
    if caches.is_cache(kind):  # a transformers cache: a dict of its arrays (interop/kv_caches.py)
        return dict(zip(caches.keys(spec), children, strict=True))
    if kind in (tuple, list):
        return kind(children)
    if isinstance(spec.context, type) and issubclass(spec.context, tuple):  # namedtuple
        return spec.context(*children)
    context = spec.context
    if isinstance(context, list | tuple) and len(context) == len(children):
        return dict(zip(context, children, strict=True))
    return tuple(children)

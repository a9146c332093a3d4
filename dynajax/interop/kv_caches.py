"""``transformers``' KV caches as pytrees, in and out of ``jax_function`` and ``export``.

Causal LMs with their default config (``use_cache=True``) return a ``DynamicCache``,
encoder-decoders an ``EncoderDecoderCache``, and a decode step that JAX can compile
once takes and returns a ``StaticCache``. torch.export needs each as a pytree node;
``register()`` makes them so, once, and only where ``transformers`` is imported (a
class the user or transformers registered first keeps that registration).

On the JAX side a cache is a dict of its arrays, the shape ``fn`` returns and takes:

* ``DynamicCache``: ``{"key_cache": [k0, k1, ...], "value_cache": [v0, v1, ...]}``;
* ``StaticCache``: the same plus ``"cumulative_length": [n0, n1, ...]`` (each layer's
  token count, a 0-d int64 array: where the next token is written);
* ``EncoderDecoderCache``: ``{"self_attention_cache": {...}, "cross_attention_cache":
  {...}}``, each a ``DynamicCache``'s dict.

So ``out["cache"]`` of one call is the cache argument of the next, as in torch.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from dynajax.errors import JaxFunctionError


def is_cache(kind: Any) -> bool:
    """Whether a pytree node type is one of transformers' cache classes."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return cache is not None and isinstance(kind, type) and issubclass(kind, cache)


def keys(spec: pytree.TreeSpec) -> list[str]:
    """The dict keys of a cache node's JAX value, in its children's order (each
    registration's context starts with them)."""
    return list(spec.context[0])


def register() -> None:
    """The cache classes as torch pytree nodes, where transformers is imported (a
    model that returns one was built with it)."""
    if "transformers" in sys.modules:
        _register()


@functools.cache
def _register() -> None:
    try:
        from transformers import cache_utils
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:  # another transformers version: the model's export says what fails
        return
    if cache_utils.DynamicCache not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(
            cache_utils.DynamicCache,
            _flatten_dynamic,
            _unflatten_dynamic,
            serialized_type_name="transformers.cache_utils.DynamicCache",
            flatten_with_keys_fn=_with_keys(_flatten_dynamic),
        )
    register_dynamic_cache_export_support()  # its torch.fx flatten spec; its node if first
    for kind, flatten, unflatten in (
        (cache_utils.EncoderDecoderCache, _flatten_encoder_decoder, _unflatten_encoder_decoder),
        (cache_utils.StaticCache, _flatten_static, _unflatten_static),
    ):
        if kind in pytree.SUPPORTED_NODES:  # registered by the user or a later transformers
            continue
        pytree.register_pytree_node(
            kind,
            flatten,
            unflatten,
            serialized_type_name=f"{kind.__module__}.{kind.__name__}",
            flatten_with_keys_fn=_with_keys(flatten),
        )


def _with_keys(flatten: Any) -> Any:
    """A flatten_with_keys function (torch.export names inputs by key path): each
    child keyed by its dict key, the first entry of every context here."""

    def flatten_with_keys(cache: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, context = flatten(cache)
        return [
            (pytree.MappingKey(k), c) for k, c in zip(context[0], children, strict=True)
        ], context

    return flatten_with_keys


_KV = ["key_cache", "value_cache"]


def _flatten_dynamic(cache: Any) -> tuple[list[Any], Any]:
    """transformers' own flattening of a ``DynamicCache`` (the same children and
    context: the initialized layers' keys and values, and each layer's sliding window
    or None)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for i, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise JaxFunctionError(
                f"layer {i} of this DynamicCache is a {type(layer).__name__}; jax_function "
                "and export take DynamicCache layers of full or sliding-window attention."
            )
    ready = [layer for layer in cache.layers if layer.is_initialized]
    children = [[layer.keys for layer in ready], [layer.values for layer in ready]]
    return children, [_KV, [getattr(layer, "sliding_window", None) for layer in cache.layers]]


def _unflatten_dynamic(children: Any, context: Any) -> Any:
    """A ``DynamicCache`` holding ``children``'s tensors, its layers built directly:
    transformers' own unflattening makes each layer through ``update``, whose fresh
    tensors become lifted constants that ``run_decompositions`` loses when it retraces
    a program taking a cache (pytorch/pytorch#164461)."""
    from transformers.cache_utils import (
        Cache,
        DynamicCache,
        DynamicLayer,
        DynamicSlidingWindowLayer,
    )

    key_cache, value_cache = children
    layers: list[Any] = []
    for i, window in enumerate(context[1]):
        if window is None:
            layer = DynamicLayer()
        else:  # its __init__ makes a tensor of the window (a lifted constant): not used here
            layer = DynamicSlidingWindowLayer.__new__(DynamicSlidingWindowLayer)
            DynamicLayer.__init__(layer)
            layer.sliding_window, layer.record_past = window, False
            layer._sliding_window_tensor = None  # type: ignore[assignment]
            layer.cumulative_length = 0
        if i < len(key_cache):
            k, v = key_cache[i], value_cache[i]
            if window is not None:
                if k.shape[-2] >= window - 1:
                    raise JaxFunctionError(
                        f"layer {i} of this DynamicCache holds {k.shape[-2]} tokens, its whole "
                        f"sliding window ({window}): how many it has dropped is a Python int "
                        "of the cache that its arrays do not carry. Pass a cache shorter "
                        "than the window (or a config without sliding_window)."
                    )
                layer.cumulative_length = k.shape[-2]
            layer.keys, layer.values, layer.device = k, v, k.device
            layer.is_initialized = True
        layers.append(layer)
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layers=layers)
    return cache


_PAIR = ["self_attention_cache", "cross_attention_cache"]


def _flatten_encoder_decoder(cache: Any) -> tuple[list[Any], Any]:
    return [cache.self_attention_cache, cache.cross_attention_cache], [_PAIR, None]


def _unflatten_encoder_decoder(children: Any, context: Any) -> Any:
    from transformers.cache_utils import EncoderDecoderCache

    return EncoderDecoderCache(*children)


_STATIC = ["key_cache", "value_cache", "cumulative_length"]


def _flatten_static(cache: Any) -> tuple[list[Any], Any]:
    from transformers.cache_utils import StaticLayer

    for i, layer in enumerate(cache.layers):
        if type(layer) is not StaticLayer:
            raise JaxFunctionError(
                f"layer {i} of this StaticCache is a {type(layer).__name__}; jax_function and "
                "export take static caches of full-attention layers (StaticLayer) only: a "
                "sliding window keeps its length in a Python int, which a compiled program "
                "cannot carry from step to step."
            )
        if not layer.is_initialized:
            raise JaxFunctionError(
                "this StaticCache is not initialized: its arrays are made on the first "
                "update, which torch.export cannot see. Call cache.early_initialization("
                "batch_size, num_heads, head_dim, dtype, device) before passing it."
            )
    layers = cache.layers
    children = [
        [layer.keys for layer in layers],
        [layer.values for layer in layers],
        [layer.cumulative_length for layer in layers],
    ]
    return children, [_STATIC, [layer.max_cache_len for layer in layers]]


def _unflatten_static(children: Any, context: Any) -> Any:
    from transformers.cache_utils import Cache, StaticCache, StaticLayer

    key_cache, value_cache, lengths = children
    layers: list[Any] = []
    for size, k, v, n in zip(context[1], key_cache, value_cache, lengths, strict=True):
        layer = StaticLayer(max_cache_len=size)
        layer.keys, layer.values, layer.cumulative_length = k, v, n
        layer.device = k.device
        layer.batch_size, layer.num_heads = k.shape[:2]
        layer.k_head_dim, layer.v_head_dim = k.shape[-1], v.shape[-1]
        layer.is_initialized = True
        layers.append(layer)
    cache = StaticCache.__new__(StaticCache)
    Cache.__init__(cache, layers=layers)
    return cache


def _holds_cache(spec: pytree.TreeSpec | None) -> bool:
    pending = [spec]
    while pending:
        node = pending.pop()
        if node is None or node.is_leaf():
            continue
        if is_cache(node.type):
            return True
        pending.extend(node.children())
    return False


def run_decompositions(ep: ExportedProgram, table: dict[Any, Any]) -> ExportedProgram:
    """``ep.run_decompositions(table)``, also where the program returns a cache.

    ``run_decompositions`` retraces ``ep.module()``, whose last step builds the output
    pytree. Where transformers' own ``DynamicCache`` registration is the one in force
    (the user's, made before dynajax's), the cache made there makes its layer tensors
    during the trace, lifted as constants the new program does not hold ("Constant
    tensor lifted_tensor_0 is not in the constants dictionary", pytorch/pytorch#164461).
    The retrace therefore runs with the outputs as a flat tuple, and the decomposed
    program gets the original structure back. (Inputs keep their structure: the
    retrace binds them to the forward's parameters; dynajax's own unflattening, above,
    makes no tensors.)
    """
    signature = ep.module_call_graph[0].signature if ep.module_call_graph else None
    if signature is None or not _holds_cache(signature.out_spec):
        return _decomposed(ep, table)
    out_spec = signature.out_spec
    signature.out_spec = pytree.tree_structure(tuple(range(out_spec.num_leaves)))
    try:
        decomposed = _decomposed(ep, table)
    finally:
        signature.out_spec = out_spec
    decomposed.module_call_graph[0].signature.out_spec = out_spec
    return decomposed


# torch 2.13's own deprecation, raised by its copy of a tree spec inside
# ``run_decompositions``: nothing the user (or dynajax) can change.
_LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def _decomposed(ep: ExportedProgram, table: dict[Any, Any]) -> ExportedProgram:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _LEAF_SPEC_WARNING, FutureWarning)
        return ep.run_decompositions(table)


def jax_spec(spec: pytree.TreeSpec, unflatten: Any) -> pytree.TreeSpec:
    """The structure of the JAX values for torch's ``spec`` (caches as dicts), given
    the function that builds them from leaves."""
    return pytree.tree_structure(unflatten(spec, iter(range(spec.num_leaves))))


def flatten_as(
    tree: Any, spec: pytree.TreeSpec, jax_spec: pytree.TreeSpec
) -> tuple[list[Any], pytree.TreeSpec]:
    """``tree``'s leaves in the order of torch's ``spec``, and the structure to rebuild
    it with: ``tree`` nested as the example arguments were, or as their JAX values
    (``jax_spec``: a cache as its dict), whose dicts may come in another key order
    (``jax.jit`` sorts them).

    Raises:
        JaxFunctionError: ``tree`` is nested otherwise.
    """
    leaves, got = pytree.tree_flatten(tree)
    if got in (spec, jax_spec):
        return leaves, got
    if _unordered(got) == _unordered(jax_spec):
        return list(fx_pytree.tree_flatten_spec(tree, jax_spec)), jax_spec
    raise JaxFunctionError(
        "fn takes its arguments nested as the example arguments were (a transformers "
        f"cache as the dict fn returns for it): {jax_spec}; got {got}."
    )


def _unordered(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` with every dict's entries in key order."""
    if spec.is_leaf():
        return spec
    children = [_unordered(c) for c in spec.children()]
    if spec.type is not dict:
        return pytree.TreeSpec(spec.type, spec.context, children)
    order = sorted(range(len(children)), key=lambda i: repr(spec.context[i]))
    return pytree.TreeSpec(dict, [spec.context[i] for i in order], [children[i] for i in order])

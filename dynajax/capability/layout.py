"""Eager PyTorch's memory layouts, for rules that address storage (``as_strided``).

A JAX value has no storage: a rule sees the logical, row-major value of a tensor. Ops
like ``as_strided`` read the tensor's *storage* through strides and an offset, so their
rules also need to know where eager PyTorch keeps each logical element. The fake
tensors in ``node.meta["val"]`` record strides and storage offsets, but they are eager's
only where something guarantees it:

- a graph input (``primals``, parameters, buffers): Dynamo guards its sizes, strides
  and storage offset, so every call that reaches this graph has exactly this layout;
- a view (``permute``, ``slice``, ``as_strided`` ...) of a tensor whose layout is
  known: view strides are pure arithmetic on the base's, the same in fake and eager;
- a fresh, contiguous tensor with storage offset 0 (the layout almost every kernel
  allocates), where its storage is its row-major value.

Anything else (a computed tensor the fake kernel says is non-contiguous, a saved
activation or tangent of a backward graph that is not contiguous, symbolic strides
under dynamic shapes) is marked unknown, with the reason; rules refuse it.

    x (input, stride (3, 1))  -> permute -> as_strided     layout known (view of input)
    x -> mul (stride (1, 3))  -> as_strided                unknown: 'mul' not contiguous
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from dynajax.lowering.registry import Layout, NodeLayout

# aot_autograd's descriptors of graph inputs that are the user's own tensors, whose
# layout Dynamo guards (node.meta["desc"] of a placeholder).
_GUARDED_INPUTS = frozenset({"PlainAOTInput", "ParamAOTInput", "BufferAOTInput"})


def node_layout(node: torch.fx.Node) -> NodeLayout:
    """The layouts of ``node``'s first argument and of its (first) output."""
    arg = node.args[0] if node.args else None
    source = arg if isinstance(arg, torch.fx.Node) else None
    unknown = _why_unknown(source) if source is not None else "first argument is not a tensor"
    inp = _layout(source.meta.get("val") if source is not None else None, unknown)
    # An op's output layout follows from its input's by the op's meta kernel (a clone
    # keeps dense strides): known exactly when the input's is.
    out = _layout(node.meta.get("val"), unknown)
    return NodeLayout(inp, out)


def _layout(value: Any, unknown: str | None) -> Layout:
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    if not isinstance(value, torch.Tensor):
        return Layout((), 0, "not a tensor")
    stride, offset = tuple(value.stride()), value.storage_offset()
    if not all(is_concrete_int(s) for s in (*stride, offset)):
        return Layout((), 0, "symbolic strides or storage offset (dynamic shapes)")
    return Layout(tuple(int(s) for s in stride), int(offset), unknown)


def _is_view(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _why_unknown(node: torch.fx.Node) -> str | None:
    """None when ``node``'s fake-tensor layout is eager's, else why it may not be."""
    while True:
        if node.op == "placeholder":
            if type(node.meta.get("desc")).__name__ in _GUARDED_INPUTS:
                return None
            break
        producer = node
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            producer = node.args[0]  # an output of split / unbind
        base = producer.args[0] if producer.args else None
        if producer.op == "call_function" and _is_view(producer.target):
            if isinstance(base, torch.fx.Node):
                node = base
                continue
        break
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and _dense_row_major(val):
        return None
    return (
        f"its storage layout comes from '{node.name}', whose eager strides are not "
        "guaranteed to be its fake tensor's (only graph inputs, their views, and "
        "contiguous tensors are)"
    )


def _dense_row_major(t: torch.Tensor) -> bool:
    """Contiguous with storage offset 0, decided on concrete sizes only (no guards)."""
    dims = (*t.shape, *t.stride(), t.storage_offset())
    if not all(is_concrete_int(d) for d in dims):
        return False
    if int(t.storage_offset()) != 0:
        return False
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride(), strict=True))):
        if int(size) != 1 and int(stride) != expected:
            return False
        expected *= int(size)
    return True

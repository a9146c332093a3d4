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

When such an op runs in eager PyTorch instead (refused, or listed in ``fallback_ops``),
its argument must reach it in eager's storage too, while a JAX result is a fresh
row-major array and a view computed in JAX is a compact copy. ``keep_eager_storage``
keeps the views between the op and the tensor that owns the storage in eager PyTorch,
so that they alias it, and copies that tensor into the strides of its fake tensor when
it is not a graph input and not row-major:

    x -> jax(mul) -> as_strided          (reads mul's row-major JAX result: wrong)
    x -> jax(mul) -> empty_strided(1, 3) + copy -> as_strided           (eager's storage)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from dynajax.capability.verdict import META_KEY, Reason, Unsupported
from dynajax.lowering.registry import Layout, NodeLayout, get_rule

aten = torch.ops.aten

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


def _reads_storage(node: torch.fx.Node) -> bool:
    """An op that addresses its first argument's storage, kept in eager PyTorch."""
    verdict = node.meta.get(META_KEY)
    if node.op != "call_function" or verdict is None or verdict.supported:
        return False
    rule = get_rule(node.target)
    return rule is not None and rule.needs_layout


def _storage_chain(node: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """The views (and getitems of multi-output views) from ``node``'s first argument
    back to the tensor that owns their storage, and that tensor."""
    chain: list[torch.fx.Node] = []
    cur = node.args[0] if node.args else None
    while isinstance(cur, torch.fx.Node) and cur.op == "call_function":
        producer = cur
        if cur.target is operator.getitem and isinstance(cur.args[0], torch.fx.Node):
            producer = cur.args[0]
        if not _is_view(producer.target) or not isinstance(producer.args[0], torch.fx.Node):
            break
        chain += [cur] if producer is cur else [cur, producer]
        cur = producer.args[0]
    return chain, cur if isinstance(cur, torch.fx.Node) else None


def _needs_restride(val: Any) -> bool:
    """Whether a fresh row-major tensor would not have ``val``'s layout, and a copy
    into ``empty_strided(val.shape, val.stride())`` would (dense, concrete, offset 0)."""
    if not isinstance(val, torch.Tensor) or _dense_row_major(val):
        return False
    dims = (*val.shape, *val.stride(), val.storage_offset())
    if not all(is_concrete_int(d) for d in dims) or int(val.storage_offset()) != 0:
        return False
    # Non-overlapping and dense: some permutation of the dims is row-major.
    expected = 1
    for size, stride in sorted(
        ((int(n), int(st)) for n, st in zip(val.shape, val.stride(), strict=True) if n != 1),
        key=lambda d: d[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def keep_eager_storage(
    gm: torch.fx.GraphModule, refuse: Callable[[torch.fx.Node, Reason, str], Unsupported]
) -> list[Unsupported]:
    """Gives each eager op that reads storage (see the module docstring) its argument
    in eager's storage layout; returns the verdicts of the nodes it kept in eager."""
    refused: list[Unsupported] = []
    for node in list(gm.graph.nodes):
        if not _reads_storage(node):
            continue
        chain, owner = _storage_chain(node)
        for view in chain:
            if view.meta[META_KEY].supported:
                view.meta[META_KEY] = refuse(
                    view,
                    Reason.EAGER_STORAGE,
                    f"a view of the storage that '{node.name}' reads in PyTorch",
                )
                refused.append(view.meta[META_KEY])
        if owner is None or owner.op == "placeholder":
            continue
        val = owner.meta.get("val")
        if not isinstance(val, FakeTensor) or not _needs_restride(val):
            continue
        user = chain[-1] if chain else node
        with gm.graph.inserting_after(owner):
            empty = gm.graph.call_function(
                aten.empty_strided.default,
                (list(val.shape), list(val.stride())),
                {"dtype": val.dtype, "device": val.device},
            )
        with gm.graph.inserting_after(empty):
            copy = gm.graph.call_function(aten.copy.default, (empty, owner))
        with val.fake_mode:
            empty.meta["val"] = torch.empty_strided(
                val.shape, val.stride(), dtype=val.dtype, device=val.device
            )
            copy.meta["val"] = aten.copy.default(empty.meta["val"], val)
        for new in (empty, copy):
            new.meta["stack_trace"] = owner.meta.get("stack_trace")
            new.meta[META_KEY] = refuse(
                new,
                Reason.EAGER_STORAGE,
                f"'{owner.name}' in eager's strides {tuple(val.stride())} for '{node.name}'",
            )
            refused.append(new.meta[META_KEY])
        user.replace_input_with(owner, copy)
    if refused:
        gm.graph.lint()
        gm.recompile()
    return refused

"""Writing mutated inputs back: only the elements an indexed update changed.

An inference graph that updates an input in place (a KV cache: ``cache.index_copy_(2,
pos, k)``, ``cache[:, :, pos] = k``) reaches dynajax functionalized: the graph computes
the input's whole new value (``index_put(cache, [None, None, pos], k)``) and returns it,
and the write-back copies it into the input (``writing_back`` below, as aot_autograd's
runtime wrapper would). For a decode step that is every cache, whole, twice per token:
XLA writes a new buffer of each (it cannot update torch's memory in place), then
``copy_`` copies it back, though one row changed.

When the new value of a mutated input is an indexed update of that input as the graph
received it, the graph returns what the update wrote instead (the values, and the
index tensors the graph computed), and the write-back applies the same update in place
with eager's own kernel:

    before: outputs (index_put(cache, [None, None, pos], k), ...)
            write-back: cache.copy_(out[0])
    after:  outputs (k, ...)              (pos is an input: read from the call's inputs)
            write-back: cache.index_put_([None, None, pos], k)

The graph's other uses of the new value (attention reading the updated cache) are
untouched, so XLA no longer materializes the new cache as an output buffer.
Recognized updates: ``index_put`` (``index_copy_`` and ``cache[:, :, pos] = k``
decompose to it) and ``slice_scatter`` (``cache[:, :, 3:4] = k``). Anything else is
copied whole, as before (a row assignment ``buf[2] = y`` decomposes to a ``where`` over
the whole input).

The result is the eager answer: the write-back runs after the whole graph (a value
check that raises leaves every input as it was), and only inputs that no other input
aliases reach here (``aot.compile._runtime_wrapper_plan``). An index out of range raises
eager's error from eager's kernel, where the functional update in XLA could not.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Write:
    """How one mutated input (``input``, its position among the graph's inputs) gets its
    new value from the graph's outputs: ``kind`` ``copy`` (the whole value, one output),
    ``index_put`` (``indices``: per index, None, ``("in", j)`` the graph's input j, or
    ``("out", k)`` output k; the values are the next output), ``index_copy`` (the same
    with one index, at dim ``args[0]``), ``slice`` (``args``: the dim, start, end and
    step; the values are one output)."""

    input: int
    kind: str
    indices: tuple[tuple[str, int] | None, ...] = ()
    args: tuple[Any, ...] = ()
    n_outputs: int = 1


def rewrite_writes(gm: torch.fx.GraphModule, mutated: Sequence[int]) -> list[Write]:
    """Makes the graph return indexed updates' values where its first ``len(mutated)``
    outputs are the new values of the inputs at ``mutated``; returns how to write each
    input back (``apply``). The graph is changed in place (and recompiled)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    position = {node: i for i, node in enumerate(placeholders)}
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    head: list[Any] = []
    writes: list[Write] = []
    for k, i in enumerate(mutated):
        new = outs[k]
        write, returned = _indexed_update(new, placeholders[i], position)
        if write is None:
            writes.append(Write(i, "copy"))
            head.append(new)
            continue
        writes.append(dataclasses.replace(write, input=i, n_outputs=len(returned)))
        head.extend(returned)
    if all(w.kind == "copy" for w in writes):
        return writes
    output.args = (tuple(head + outs[len(mutated) :]),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return writes


def _indexed_update(
    node: Any, original: torch.fx.Node, position: dict[torch.fx.Node, int]
) -> tuple[Write | None, list[torch.fx.Node]]:
    """(the write, the nodes the graph returns for it) if ``node`` updates ``original``
    (the input as the graph received it) at an index or a slice, else (None, [])."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None, []
    args: tuple[Any, ...] = tuple(node.args)
    kwargs: dict[str, Any] = dict(node.kwargs)
    if not args or args[0] is not original:
        return None, []
    if node.target is aten.index_put.default:
        _, indices, values, *rest = args
        accumulate = bool(rest[0]) if rest else bool(kwargs.get("accumulate", False))
        if accumulate or not isinstance(values, torch.fx.Node):
            return None, []
        spec: list[tuple[str, int] | None] = []
        returned: list[torch.fx.Node] = []
        for index in indices:
            if index is None:
                spec.append(None)
            elif isinstance(index, torch.fx.Node) and index in position:
                spec.append(("in", position[index]))  # an input: read from the call's inputs
            elif isinstance(index, torch.fx.Node):
                spec.append(("out", len(returned)))
                returned.append(index)
            else:
                return None, []
        dim = len(spec) - 1
        if _is_index_copy(original, indices, values):
            # index_copy_ is the same write, through a leaner kernel call (2 µs, against
            # 4 µs for index_put_ by its op overload: 8 caches per decode step)
            return Write(-1, "index_copy", indices=(spec[dim],), args=(dim,)), [*returned, values]
        return Write(-1, "index_put", indices=tuple(spec)), [*returned, values]
    if node.target is aten.slice_scatter.default:
        _, values, *bounds = args
        dim, start, end, step = (*bounds, *(None,) * (4 - len(bounds)))[:4]
        dim = kwargs.get("dim", 0 if dim is None else dim)
        start = kwargs.get("start", start)
        end = kwargs.get("end", end)
        step = kwargs.get("step", 1 if step is None else step)
        literal = all(v is None or type(v) is int for v in (dim, start, end, step))
        if not literal or not isinstance(values, torch.fx.Node):
            return None, []
        return Write(-1, "slice", args=(dim, start, end, step)), [values]
    return None, []


def _is_index_copy(target: torch.fx.Node, indices: Sequence[Any], values: torch.fx.Node) -> bool:
    """Whether ``index_put(target, indices, values)`` is ``index_copy(target, dim, index,
    values)``: one 1-D int64 index after ``dim`` Nones, values of the target's shape but
    for ``len(index)`` at ``dim`` (no broadcasting, which index_copy_ does not do)."""
    *leading, index = indices
    if any(i is not None for i in leading) or not isinstance(index, torch.fx.Node):
        return False
    t, i, v = (n.meta.get("val") for n in (target, index, values))
    if not (isinstance(t, torch.Tensor) and isinstance(i, torch.Tensor)):
        return False
    if not isinstance(v, torch.Tensor):
        return False
    dim = len(leading)
    if i.dtype != torch.int64 or i.dim() != 1 or v.dtype != t.dtype:
        return False
    want = list(t.shape)
    want[dim] = i.shape[0]
    return list(v.shape) == want


def writing_back(writes: list[Write]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wraps ``call(inputs)`` (the tuple of a stitched graph's inputs), whose first
    outputs carry the inputs' writes (``rewrite_writes``), as aot_autograd's runtime
    wrapper would call it: each input is written (after the whole graph ran, so a value
    check that raises leaves every input as it was), and the rest of the outputs are
    returned."""

    def around(call: Callable[..., Any]) -> Callable[..., Any]:
        if not writes:
            return call
        if all(w.kind == "copy" for w in writes):
            n = len(writes)
            pairs = [(k, w.input) for k, w in enumerate(writes)]

            def copy_all(args: tuple[Any, ...]) -> Any:
                outs = call(args)
                for k, i in pairs:
                    args[i].copy_(outs[k])
                return outs[n:]

            return copy_all
        n = sum(w.n_outputs for w in writes)

        def run(args: tuple[Any, ...]) -> Any:
            outs = call(args)
            apply(writes, args, outs)
            return outs[n:]

        return run

    return around


def apply(writes: Sequence[Write], inputs: Sequence[Any], outs: Sequence[Any]) -> None:
    """Writes each input in place from the outputs that carry its write."""
    _each(writes, inputs, outs, in_place=True)


def new_values(writes: Sequence[Write], inputs: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """The inputs' whole new values (without writing them), what the graph returned
    before ``rewrite_writes``: for a caller that copies them itself (aot_autograd's
    runtime wrapper, at a graph's first call)."""
    return _each(writes, inputs, outs, in_place=False)


def _each(
    writes: Sequence[Write], inputs: Sequence[Any], outs: Sequence[Any], *, in_place: bool
) -> list[Any]:
    done = []
    k = 0
    for w in writes:
        target, value = inputs[w.input], outs[k + w.n_outputs - 1]
        if w.kind == "copy":
            done.append(target.copy_(value) if in_place else value)
        elif w.kind == "index_copy":
            (index,) = _indices(w, inputs, outs, k)
            update = target.index_copy_ if in_place else target.index_copy
            done.append(update(w.args[0], index, value))
        elif w.kind == "index_put":
            put = aten.index_put_ if in_place else aten.index_put
            done.append(put.default(target, _indices(w, inputs, outs, k), value))
        else:
            dim, start, end, step = w.args
            if in_place:
                done.append(aten.slice.Tensor(target, dim, start, end, step).copy_(value))
            else:
                done.append(target.slice_scatter(value, dim, start, end, step))
        k += w.n_outputs
    return done


def _indices(w: Write, inputs: Sequence[Any], outs: Sequence[Any], k: int) -> list[Any]:
    return list(
        None if s is None else inputs[s[1]] if s[0] == "in" else outs[k + s[1]] for s in w.indices
    )


def written_outputs(writes: Sequence[Write]) -> int:
    """How many of the graph's first outputs carry the writes."""
    return sum(map(operator.attrgetter("n_outputs"), writes))

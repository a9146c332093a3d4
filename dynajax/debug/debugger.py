"""``dynajax.debug.compare``: which op makes a compiled model drift from eager.

    report = dynajax.debug.compare(model, x)                  # forward
    report = dynajax.debug.compare(model, x, backward=True)   # and the backward graphs
    print(report)
    report.first.op, report.first.source_line                 # the rule to look at

It compiles the model with a backend in recording mode (``recording.Recorder``: every
JAX partition's inputs and outputs, copied at each call), runs it once, and runs the
model in eager PyTorch for the answer to compare with. Then, for each partition call in
the order they ran:

1. ``torch.fx.Interpreter`` runs the partition's ATen graph in eager PyTorch on the
   recorded inputs: the eager value of every node, and the partition's outputs, which
   are compared with what the XLA executable returned.
2. Each node's JAX rule runs on the *eager* values of its inputs and is compared with
   the eager node's value, so that differences do not accumulate: a node whose rule
   leaves the tolerance disagrees with eager on its own inputs.
3. Such a node runs once more in eager PyTorch in float64 (``accuracy.as_accurate``): a
   rule at least as close to the float64 answer as eager rounds differently
   (``Finding.ROUNDING``); one that is farther is wrong (``Finding.WRONG``).

The report's ``first`` is the first node, in the order the graphs ran and then in graph
order, whose rule is wrong (or cannot be cleared: ``Finding.UNDECIDED``), with its op,
partition, inputs, error and the user's source line.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import torch
import torch.fx
import torch.utils._pytree as pytree

from dynajax.backend import Backend
from dynajax.capability.verdict import source_line
from dynajax.debug.accuracy import Error, as_accurate, distance, error, float64
from dynajax.debug.recording import PartitionCall, Recorder
from dynajax.diagnostics import Report
from dynajax.diagnostics.breaks import short_location
from dynajax.lowering.interpreter import jax_literal
from dynajax.lowering.registry import LAYOUT_KEY, get_rule
from dynajax.runtime.conversion import cpu_to_torch, quiet_readonly_warning, to_jax
from dynajax.runtime.jax_internals import X64


class Finding(enum.Enum):
    """What a node whose rule leaves the tolerance is."""

    WRONG = "the rule is wrong: farther from the float64 answer than eager"
    ROUNDING = "XLA rounds differently: as close to the float64 answer as eager"
    UNDECIDED = "no float64 reference (the op refuses float64 inputs)"


@dataclasses.dataclass(frozen=True)
class NodeMismatch:
    """A node whose JAX rule, on the eager values of its inputs, leaves the tolerance.

    Attributes:
        graph: the graph's number in compilation order (``GraphReport.index``).
        kind: ``inference``, ``forward`` or ``backward``.
        partition: the JAX partition (``jax_0``).
        node: the node's name in the partition's graph.
        op: the node's ``OpOverload``.
        inputs: the tensor inputs as ``float32[2, 8, 64]`` (other arguments as written).
        error: the rule's output against eager's (the worst output of a multi-output op).
        finding: whether the rule is wrong or only rounds differently.
        distance_rule: max distance of the rule's output from the float64 answer (None
            without a float64 reference).
        distance_eager: the same for eager's output.
        source_line: ``file:line (code)`` of the user's code that made the node (for a
            backward node: the forward op it differentiates).
    """

    graph: int
    kind: str
    partition: str
    node: str
    op: Any
    inputs: list[str]
    error: Error
    finding: Finding
    distance_rule: float | None
    distance_eager: float | None
    source_line: str

    @property
    def where(self) -> str:
        """``graph 0 (forward) jax_0``."""
        return f"graph {self.graph} ({self.kind}) {self.partition}"

    def lines(self) -> list[str]:
        op = self.op if isinstance(self.op, str) else _op_name(self.op)
        out = [
            f"{op} (node '{self.node}') in {self.where}",
            f"  inputs: {', '.join(self.inputs)}",
            f"  error: {self.error.describe()}",
        ]
        if self.distance_rule is not None:
            out.append(
                f"  float64 reference: the rule's result is {self.distance_rule:.3g} from "
                f"it, eager's {self.distance_eager:.3g}: {self.finding.value}"
            )
        else:
            out.append(f"  {self.finding.value}")
        if self.source_line:
            out.append(f"  at {short_location(self.source_line)}")
        return out


@dataclasses.dataclass(frozen=True)
class PartitionCheck:
    """One call of one JAX partition, re-run in eager PyTorch.

    Attributes:
        graph: the graph's number; kind: its kind; partition: ``jax_<n>``.
        nodes: how many nodes' rules were compared with eager.
        random_nodes: nodes not compared: random ops draw other numbers than eager's.
        outputs: the partition's outputs (XLA's executable) against the eager graph's,
            the worst output.
    """

    graph: int
    kind: str
    partition: str
    nodes: int
    random_nodes: list[str]
    outputs: Error | None

    @property
    def where(self) -> str:
        return f"graph {self.graph} ({self.kind}) {self.partition}"


@dataclasses.dataclass
class AccuracyReport:
    """What ``compare`` found; ``str(report)`` says it in words.

    Attributes:
        outputs: the compiled model's outputs against eager's (the worst tensor), under
            the whole-model tolerance; None when the outputs hold no tensor.
        gradients: with ``backward=True``: each gradient against eager's, by
            parameter name (``input[0]`` for inputs that require grad).
        partitions: every partition call, in the order they ran.
        mismatches: every node whose rule leaves the tolerance, in that order and then
            in graph order, rounding differences included.
        report: what dynajax compiled (partitions, fallbacks), as ``explain`` gives it.
    """

    outputs: Error | None
    gradients: dict[str, Error]
    partitions: list[PartitionCheck]
    mismatches: list[NodeMismatch]
    report: Report

    @property
    def first(self) -> NodeMismatch | None:
        """The first node whose rule is wrong (or cannot be cleared), None if none is."""
        return next((m for m in self.mismatches if m.finding is not Finding.ROUNDING), None)

    @property
    def rounding(self) -> list[NodeMismatch]:
        """The nodes that leave the tolerance only because XLA rounds differently."""
        return [m for m in self.mismatches if m.finding is Finding.ROUNDING]

    @property
    def drifting_partitions(self) -> list[PartitionCheck]:
        """The partition calls whose outputs leave the tolerance of one op."""
        return [p for p in self.partitions if p.outputs is not None and not p.outputs.within]

    @property
    def clean(self) -> bool:
        """Outputs and gradients within tolerance, and no rule found wrong."""
        return (
            (self.outputs is None or self.outputs.within)
            and all(g.within for g in self.gradients.values())
            and self.first is None
        )

    def lines(self) -> list[str]:
        verdict = "matches eager" if self.clean else "DIFFERS from eager"
        out = [f"dynajax.debug.compare: the compiled model {verdict}"]
        if self.outputs is not None:
            state = "within tolerance" if self.outputs.within else "OUT OF TOLERANCE"
            out.append(f"  outputs: {state}: {self.outputs.describe()}")
        if self.gradients:
            bad = {k: g for k, g in self.gradients.items() if not g.within}
            out.append(
                f"  gradients: {len(self.gradients) - len(bad)}/{len(self.gradients)} "
                "within tolerance"
            )
            for name, g in list(bad.items())[:8]:
                out.append(f"    {name}: {g.describe()}")
            if len(bad) > 8:
                out.append(f"    ... and {len(bad) - 8} more")
        first = self.first
        if first is not None:
            out.append("first node whose JAX rule disagrees with eager on the same inputs:")
            out.extend("  " + line for line in first.lines())
        elif self.rounding:
            out.append(
                f"no rule is wrong: {len(self.rounding)} node(s) leave the tolerance only "
                "because they round differently from eager (as close to the float64 answer "
                "as eager, listed below)"
            )
        elif self.drifting_partitions:
            out.append(
                "no rule disagrees with eager on its own inputs: the partitions' outputs "
                "drift by rounding, accumulated over the graph"
            )
        elif not self.clean:
            out.append(
                "no rule disagrees with eager on its own inputs and every partition matches "
                "eager on its inputs: the difference comes from outside the partitions' "
                "rules (a graph pass, a decomposition, an op kept in PyTorch)"
            )
        else:
            out.append("no rule disagrees with eager on its own inputs")
        out.append(f"partitions checked ({len(self.partitions)} call(s)):")
        for p in self.partitions:
            state = (
                "no outputs"
                if p.outputs is None
                else ("outputs within tolerance" if p.outputs.within else "outputs DRIFT")
            )
            desc = f": {p.outputs.describe()}" if p.outputs is not None else ""
            rand = f", {len(p.random_nodes)} random node(s) not compared" if p.random_nodes else ""
            out.append(f"  {p.where}: {p.nodes} node(s){rand}; {state}{desc}")
        others = [m for m in self.mismatches if m is not first]
        if others:
            key = (
                f"; ROUNDING: {Finding.ROUNDING.value}"
                if any(m.finding is Finding.ROUNDING for m in others)
                else ""
            )
            out.append(f"other nodes out of tolerance ({len(others)}{key}):")
            for m in others[:10]:
                op = _op_name(m.op)
                out.append(
                    f"  {op} (node '{m.node}') in {m.where}: {m.finding.name}, "
                    f"max abs {m.error.max_abs:.3g}"
                )
            if len(others) > 10:
                out.append(f"  ... and {len(others) - 10} more")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def compare(
    model: Callable[..., Any],
    *args: Any,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> AccuracyReport:
    """Runs ``model`` compiled by dynajax and in eager PyTorch, and names the op whose
    JAX rule makes the answers differ.

    Args:
        model: an ``nn.Module`` or a function.
        *args: the model's positional arguments.
        backward: also differentiate: ``loss(outputs)`` (default: the sum of every
            floating output that requires grad) is differentiated with respect to the
            parameters and the inputs that require grad, compiled and eager, and the
            backward graphs' partitions are checked like the forward ones.
        loss: the scalar to differentiate, from the model's outputs (with ``backward``).
        options: ``dynajax.Backend`` options for the compiled run.
        **kwargs: the model's keyword arguments.

    Returns:
        An ``AccuracyReport``: the outputs' and gradients' errors, every partition call
        re-run in eager PyTorch, and every node whose rule leaves the tolerance;
        ``report.first`` is the first whose rule is wrong.

    Random ops (dropout) draw other numbers under dynajax than in eager PyTorch: put
    the model in ``eval()`` mode (or seed nothing random) for the outputs to compare;
    random nodes are not compared one by one.
    """
    if loss is not None and not backward:
        raise TypeError("compare(loss=...) needs backward=True: the loss is what it differentiates")
    backend = Backend(**(options or {}))
    recorder = Recorder()
    backend.partition_hook = recorder.wrap
    compiled = torch.compile(model, backend=backend)
    wrt = _differentiable(model, args, kwargs) if backward else {}
    if backward and not wrt:
        raise ValueError(
            "compare(backward=True) found nothing to differentiate: the model has no "
            "parameter that requires grad and no input requires grad"
        )
    buffers = _buffers(model)
    saved = [b.detach().clone() for b in buffers]
    expected, expected_grads = _run(model, args, kwargs, wrt, loss)
    with torch.no_grad():  # the compiled run starts from the state eager started from
        for b, s in zip(buffers, saved, strict=True):
            b.copy_(s)
    actual, actual_grads = _run(compiled, args, kwargs, wrt, loss)
    outputs = _worst(list(_errors(actual, expected)))
    gradients = {
        name: _grad_error(actual_grads[name], expected_grads[name]) for name in expected_grads
    }
    partitions: list[PartitionCheck] = []
    mismatches: list[NodeMismatch] = []
    for call in recorder.calls:
        check, found = check_partition(call)
        partitions.append(check)
        mismatches.extend(found)
    return AccuracyReport(outputs, gradients, partitions, mismatches, Report(list(backend.graphs)))


def check_partition(call: PartitionCall) -> tuple[PartitionCheck, list[NodeMismatch]]:
    """Re-runs one partition call in eager PyTorch, and each node's rule on eager values.

    Returns:
        The partition's check (its outputs against the eager graph's) and the nodes
        whose rules leave the tolerance, in graph order.
    """
    gm = call.graph_module
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        eager_outputs = interpreter.run(*call.inputs)
    env = interpreter.env
    outputs = _worst(list(_errors(call.outputs, list(eager_outputs), model=False)))
    found: list[NodeMismatch] = []
    random: list[str] = []
    checked: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        rule = get_rule(node.target)
        if rule is None:  # the capability pass let no such node into a partition
            raise AssertionError(f"{node.target} ran in {call.name} without a rule")
        if rule.needs_key:
            random.append(node.name)
        else:
            checked.append(node)
    quiet_readonly_warning()
    results = run_rules(checked, env)
    for node, ours in zip(checked, results, strict=True):
        expected = env[node]
        errors = list(_errors(ours, expected, model=False))
        if all(e.within for e in errors):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        found.append(_mismatch(call, node, args, kwargs, ours, expected, errors))
    check = PartitionCheck(
        call.report.index, call.report.kind, call.name, len(checked), random, outputs
    )
    return check, found


def run_rules(nodes: list[torch.fx.Node], env: dict[torch.fx.Node, Any]) -> list[Any]:
    """Each node's JAX rule on the eager values of its inputs (``env``), as torch values.

    The rules run op by op (JAX's eager dispatch, no ``jax.jit`` around them): no node
    reads another node's JAX result, so differences do not accumulate, and JAX caches
    each primitive's executable by shape, so the nodes of the backward graph and of later
    calls mostly reuse what the first partition compiled (a tiny GPT-2's forward: ~9 s
    the first time, ~0.1 s after; one ``jax.jit`` of all its rules: ~4 s every time).
    """

    def value(n: torch.fx.Node) -> Any:
        v = env[n]
        return jnp.asarray(to_jax(v)) if isinstance(v, torch.Tensor) else v

    results = []
    token = X64.enable()  # int64 and float64 stay 64-bit, as in the partition
    try:
        for node in nodes:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            args, kwargs = jax_literal(args), {k: jax_literal(v) for k, v in kwargs.items()}
            rule = get_rule(node.target)
            assert rule is not None  # check_partition looked it up
            if rule.needs_layout:  # decided by the capability pass (capability/layout.py)
                kwargs["layout"] = node.meta[LAYOUT_KEY]
            results.append(_to_torch(rule.fn(*args, **kwargs)))
    finally:
        X64.restore(token)
    return results


def _to_torch(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return type(value)(_to_torch(v) for v in value)
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # a jax.Array or NumPy array
        # (a copy: the view of JAX's buffer would not outlive the array)
        return cpu_to_torch(cast(jax.Array, value)).clone()
    return value


def _mismatch(
    call: PartitionCall,
    node: torch.fx.Node,
    args: Any,
    kwargs: dict[str, Any],
    ours: Any,
    expected: Any,
    errors: list[Error],
) -> NodeMismatch:
    """The record of a node whose rule leaves the tolerance, judged in float64."""
    reference = _float64_reference(node, args, kwargs)
    worst = _worst(errors)
    assert worst is not None  # errors holds at least one out-of-tolerance value
    if reference is None:
        finding, d_rule, d_eager = Finding.UNDECIDED, None, None
    else:
        pairs = list(_tensor_pairs(ours, expected, reference))
        accurate = all(as_accurate(o, e, r) for o, e, r in pairs)
        finding = Finding.ROUNDING if accurate else Finding.WRONG
        d_rule = max((_ref_distance(o, r) for o, _, r in pairs), default=0.0)
        d_eager = max((_ref_distance(e, r) for _, e, r in pairs), default=0.0)
    inputs = [_describe(a) for a in (*args, *kwargs.values()) if _describe(a)]
    return NodeMismatch(
        call.report.index,
        call.report.kind,
        call.name,
        node.name,
        node.target,
        inputs,
        worst,
        finding,
        d_rule,
        d_eager,
        source_line(node),
    )


def _float64_reference(node: torch.fx.Node, args: Any, kwargs: dict[str, Any]) -> Any:
    """The eager op on the same values in float64 (complex128), None if it refuses them."""
    op = cast(Callable[..., Any], node.target)
    try:
        with torch.no_grad():
            return op(*float64(args), **float64(kwargs))
    except (RuntimeError, TypeError, NotImplementedError):  # an op without float64 kernels
        return None


def _ref_distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not (ref.is_floating_point() or ref.is_complex()) or x.shape != ref.shape:
        return 0.0 if torch.equal(x, ref.to(x.dtype)) else float("inf")
    wide = torch.complex128 if ref.is_complex() else torch.float64
    return distance(x, ref.detach().to(wide))


def _tensor_pairs(ours: Any, expected: Any, reference: Any) -> Iterator[tuple[Any, Any, Any]]:
    if isinstance(expected, torch.Tensor):
        yield ours, expected, reference
    elif isinstance(expected, list | tuple):
        for o, e, r in zip(ours, expected, reference, strict=True):
            yield from _tensor_pairs(o, e, r)


def _errors(actual: Any, expected: Any, *, model: bool = True) -> Iterator[Error]:
    """The error of each tensor of ``actual`` against ``expected`` (same structure)."""
    a_leaves = pytree.tree_leaves(actual)
    e_leaves = pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        yield Error(
            float("inf"),
            float("inf"),
            0.0,
            0.0,
            False,
            f"{len(a_leaves)} values where eager has {len(e_leaves)}",
        )
        return
    for a, e in zip(a_leaves, e_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                yield Error(float("inf"), float("inf"), 0.0, 0.0, False, f"{a!r} for a tensor")
            else:
                yield error(a, e, model=model)
        elif isinstance(e, int | float | bool | str | type(None)) and not (
            a == e or (a != a and e != e)
        ):  # (other objects, a transformers cache, hold the tensors compared above)
            yield Error(float("inf"), float("inf"), 0.0, 0.0, False, f"{a!r} != eager's {e!r}")


def _worst(errors: list[Error]) -> Error | None:
    """The error out of tolerance with the largest max abs, else the largest of all."""
    if not errors:
        return None
    out = [e for e in errors if not e.within]
    return max(out or errors, key=lambda e: (e.max_abs, e.max_rel))


def _grad_error(actual: torch.Tensor | None, expected: torch.Tensor | None) -> Error:
    if actual is None or expected is None:
        same = actual is None and expected is None
        detail = "" if same else "None where the other side has a gradient"
        return Error(0.0 if same else float("inf"), 0.0, 0.0, 0.0, same, detail)
    return error(actual, expected, model=True)


def _differentiable(model: Any, args: Any, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors to differentiate with respect to, by name."""
    wrt: dict[str, torch.Tensor] = {}
    if isinstance(model, torch.nn.Module):
        wrt.update((n, p) for n, p in model.named_parameters() if p.requires_grad)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            wrt[f"input[{i}]"] = a
    for k, a in kwargs.items():
        if isinstance(a, torch.Tensor) and a.requires_grad:
            wrt[f"input[{k!r}]"] = a
    return wrt


def _buffers(model: Any) -> list[torch.Tensor]:
    return list(model.buffers()) if isinstance(model, torch.nn.Module) else []


def _run(
    fn: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any],
    wrt: dict[str, torch.Tensor],
    loss: Callable[[Any], torch.Tensor] | None,
) -> tuple[Any, dict[str, torch.Tensor | None]]:
    """The outputs of one run and, when ``wrt`` is given, the gradients of the loss."""
    if not wrt:
        with torch.no_grad():
            return fn(*args, **kwargs), {}
    out = fn(*args, **kwargs)
    if loss is not None:
        value = loss(out)
    else:
        leaves = [
            t
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
        ]
        if not leaves:
            raise ValueError(
                "compare(backward=True): no floating output requires grad; pass loss=..."
            )
        value = torch.stack([t.sum() for t in leaves]).sum()
    grads = torch.autograd.grad(value, list(wrt.values()), allow_unused=True)
    return out, dict(zip(wrt, grads, strict=True))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join(_describe(v) or repr(v) for v in value) + "]"
    return ""


def _op_name(op: Any) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    return str(op)

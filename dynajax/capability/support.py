"""Per-node verdicts, decided before any real data runs.

A node is supported when no size it makes or takes depends on tensor values, every
tensor and dtype it touches exists in JAX, the table has a rule for its exact overload,
the rule's ``check`` accepts the arguments, and abstract evaluation of the rule
(``jax.eval_shape`` on the node's fake-tensor shapes and dtypes) produces exactly the
shapes and dtypes PyTorch's meta kernels recorded in ``node.meta["val"]``, and eager's
CPU kernel takes its dtypes (which meta kernels do not check: ``eager_kernel``, the one
place that runs an op, on small tensors of zeros). No exception at call time decides
support.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dynajax.capability import cost, in_graph, kernels
from dynajax.capability.cost import Measure, faster_in_pytorch
from dynajax.capability.eager_kernel import eager_refusal
from dynajax.capability.layout import keep_eager_storage, node_layout
from dynajax.capability.memo import Evaluations
from dynajax.capability.verdict import (
    META_KEY,
    Reason,
    Supported,
    Unsupported,
    Verdict,
    source_line,
    target_name,
    verdict_of,
)
from dynajax.lowering.dtypes import TORCH_TO_JAX, eager_on_cuda
from dynajax.lowering.interpreter import jax_literal
from dynajax.lowering.registry import KERNEL_KEY, LAYOUT_KEY, Rule, get_rule

log = logging.getLogger("dynajax.capability")

# Exceptions through which JAX's abstract evaluation reports that a rule cannot take
# these arguments (shape and dtype errors), and the one a rule raises to refuse.
_ABSTRACT_EVAL_ERRORS = (TypeError, ValueError, NotImplementedError, IndexError)

# Where JAX's (and NumPy's) own code lives: an error raised there is JAX rejecting the
# abstract values; one raised elsewhere (the rule's own lines) is more likely a bug.
_JAX_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, np) if m.__file__
)


T = TypeVar("T")


class _Candidate(NamedTuple):
    """A node whose choice is measured, with its evaluation key and rule."""

    node: torch.fx.Node
    key: Any
    rule: Rule


class _NoHint(Exception):
    """A symbolic size with no hint: only known after running an earlier op."""


def _concrete(size: Any) -> int:
    # Backed symbolic sizes (dynamic shapes) evaluate at their hint. Unbacked ones are
    # mostly refused first (DATA_DEPENDENT_SHAPE); one that torch.export refined into
    # an expression its symbol check does not see (a view of a boolean-mask index) has
    # no hint either, and is refused the same way.
    if isinstance(size, torch.SymInt):
        if size.node.hint is None:
            raise _NoHint(str(size))
        return int(size.node.hint)
    return int(size)


def _abstract(value: Any) -> Any:
    """FakeTensor -> ShapeDtypeStruct, recursively; literals translated."""
    if isinstance(value, torch.fx.Node):
        return _abstract(value.meta.get("val"))
    if isinstance(value, torch.Tensor):
        shape = tuple(_concrete(s) for s in value.shape)
        return jax.ShapeDtypeStruct(shape, TORCH_TO_JAX[value.dtype])
    if isinstance(value, tuple):
        return tuple(_abstract(v) for v in value)
    if isinstance(value, list):
        return [_abstract(v) for v in value]
    if isinstance(value, torch.SymInt):
        return _concrete(value)
    if isinstance(value, torch.SymBool):
        return bool(value.node.hint)
    return jax_literal(value)


def _freeze(value: Any) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct):
        return ("T", value.shape, str(value.dtype))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(_freeze(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float) and value != value:
        return ("nan",)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return (type(value).__name__, value)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _node_values(args: Iterable[Any]) -> Iterable[Any]:
    for a in args:
        if isinstance(a, torch.fx.Node):
            yield a.meta.get("val")
        elif isinstance(a, list | tuple):
            yield from _node_values(a)


def _describe_aval(a: Any) -> str:
    return f"{a.dtype}{list(a.shape)}"


class CapabilityChecker:
    """Decides verdicts; remembers abstract evaluations by (op, argument signature).

    The questions, in order (the first that refuses gives the reason):

    1. Did the user list the op in ``fallback_ops``?  -> USER_FALLBACK
    2. Does the node create a size or scalar known only by reading tensor data
       (``nonzero``, ``unique``, ``.item()``: an unbacked SymInt in its output)?
       -> DATA_DEPENDENT_SHAPE
    3. Does it compute only Python scalars or nothing (``sym_size``, ``_assert_scalar``,
       ``operator.ge`` on sizes)?  -> HOST_SCALAR (bookkeeping, not a fallback)
    4. Does it take such a size (a tensor of size ``u0``, an argument ``u0``)?
       -> DATA_DEPENDENT_SHAPE
    5. Does every tensor and dtype it touches exist in JAX?  -> DTYPE
       Does eager's CPU kernel take these dtypes (``eager_kernel.eager_refusal``: the
       kernel is asked on small tensors of zeros)?  -> EAGER_REFUSES
    6. Does the table have a rule for its exact overload?  -> NO_LOWERING
    7. Does the rule's ``check`` accept the arguments, and does ``jax.eval_shape`` of the
       rule on the node's fake-tensor shapes reproduce PyTorch's output shapes and
       dtypes?  -> CHECK_REFUSED, with the detail
    8. With ``perf``: was PyTorch's kernel measured faster for these arguments
       (``cost.faster_in_pytorch``)?  -> PERF, with the measurement

    With ``torch_kernels`` (the backend's), a node refused at 6-8 may run PyTorch's
    kernel inside its partition instead (``kernels.inside``).

    Data-dependence and dtypes come before the table: a rule for ``nonzero``, for an
    op on complex32 tensors or for ``abs`` of bool (eager raises) could not help, so
    the what-if list must not suggest one.
    """

    def __init__(
        self,
        fallback_ops: Iterable[str] = (),
        evaluations: Evaluations | None = None,
        *,
        perf: bool = False,
        measure: bool = False,
        torch_kernels: bool = False,
    ) -> None:
        self.fallback_ops = frozenset(fallback_ops)
        self.torch_kernels = torch_kernels  # (see the class doc)
        # Whether ops measured faster in PyTorch (cost.py) stay there, reason PERF.
        self.perf = perf
        # With perf: whether the choices cost.py lists are measured on this machine.
        self.measure = measure
        # Abstract evaluations by (op, argument signature), shared by every graph of
        # the process and, given a persistent cache, by later processes (memo.py).
        self._evaluations = evaluations if evaluations is not None else Evaluations()
        # With measure: the nodes whose choice is measured (cost.is_measured), placed by
        # the defaults until measured.
        self.candidates: list[_Candidate] = []

    def annotate(self, gm: torch.fx.GraphModule) -> list[Unsupported]:
        """Stores a verdict in ``node.meta`` for every call_function node of ``gm``
        (and, for ops kept in eager that read storage, adds the nodes that give them
        eager's storage: ``layout.keep_eager_storage``).

        Returns the Unsupported verdicts of the nodes that are fallbacks (tensor work
        kept in PyTorch; HOST_SCALAR bookkeeping is left out).
        """
        refused = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            verdict = self.decide(node)
            if self.torch_kernels:
                verdict = kernels.inside(node, verdict)
            node.meta[META_KEY] = verdict
            if isinstance(verdict, Unsupported) and verdict.reason.is_fallback:
                refused.append(verdict)
        # Eager ops that read storage (as_strided) get it as eager would have it.
        refused += keep_eager_storage(gm, self._refuse)
        self._evaluations.save()
        return refused

    def decide(self, node: torch.fx.Node) -> Verdict:
        """The verdict of one call_function node, from its metadata alone."""
        name = target_name(node)
        if node.target is operator.getitem:
            return self._decide_getitem(node, name)
        packet = name.rsplit(".", 1)[0]
        if name in self.fallback_ops or packet in self.fallback_ops:
            return self._refuse(node, Reason.USER_FALLBACK, "")
        out = node.meta.get("val")
        inputs = [*_node_values(node.args), *_node_values(node.kwargs.values())]
        created, taken = _unbacked_symbols(out, inputs)
        if created:
            return self._refuse(
                node,
                Reason.DATA_DEPENDENT_SHAPE,
                f"output size or value {created} is only known after running the op",
            )
        if _is_host_scalar(node, out):
            return self._refuse(node, Reason.HOST_SCALAR, "")
        if "val" not in node.meta:
            return self._refuse(
                node, Reason.CHECK_REFUSED, "no fake-tensor metadata (node.meta['val'])"
            )
        if taken:
            return self._refuse(
                node,
                Reason.DATA_DEPENDENT_SHAPE,
                f"takes {taken}, a size or scalar only known after running an earlier op",
            )
        # Before the table: a rule could not help a dtype JAX lacks.
        bad_dtype = _unsupported_dtype(out, inputs, node)
        if bad_dtype is not None:
            return self._refuse(node, Reason.DTYPE, f"{bad_dtype} has no JAX equivalent")
        # Also before the table: where eager's CPU kernel refuses the dtypes its meta
        # kernel accepted, the program must raise eager's error, which no rule gives.
        refusal = eager_refusal(node.target, node.args, node.kwargs, out)
        if refusal is not None:
            return self._refuse(node, Reason.EAGER_REFUSES, refusal)
        if not isinstance(node.target, torch._ops.OpOverload):
            return self._refuse(node, Reason.NO_LOWERING, "not an ATen operator")
        rule = get_rule(node.target)
        if rule is None:
            return self._refuse(node, Reason.NO_LOWERING, "")
        for v in inputs:
            # Backed SymInts/SymBools (sizes under dynamic shapes) enter a partition as
            # static Python values, one executable per value (runtime/executables.py);
            # they are evaluated here at their hint. A SymFloat would recompile per value.
            if isinstance(v, torch.SymFloat):
                return self._refuse(
                    node,
                    Reason.CHECK_REFUSED,
                    f"symbolic float argument {v}; JAX partitions take sizes and flags "
                    "as static values, and a float would recompile for every value",
                )
        # A multi-output op may return None for an output it was asked not to compute
        # (convolution_backward's output_mask); the rule returns None there too.
        if not all(isinstance(t, torch.Tensor) or t is None for t in _flatten(out)):
            return self._refuse(node, Reason.CHECK_REFUSED, "output is not a tensor")
        try:
            args = _abstract(node.args)
            kwargs = {k: _abstract(v) for k, v in node.kwargs.items()}
            expected = _abstract(out)
        except _NoHint as e:
            return self._refuse(
                node,
                Reason.DATA_DEPENDENT_SHAPE,
                f"takes or makes {e}, a size only known after running an earlier op",
            )
        if rule.needs_layout:
            # Rules that address storage see eager's layout; lowering reads it back.
            node.meta[LAYOUT_KEY] = kwargs["layout"] = node_layout(node)
        # A few kernels differ by device (dtypes.eager_on_cuda): the rule is evaluated
        # as the one for the device the node's outputs are on.
        on_cuda = any(t.device.type == "cuda" for t in _tensors(out))
        key = (node.target, _freeze(args), _freeze(kwargs), _freeze(expected), on_cuda)

        def evaluate() -> tuple[Reason, str] | None:
            with eager_on_cuda(on_cuda):
                return _evaluate(rule, args, kwargs, expected)

        found = self._evaluations.get(key, rule, evaluate)
        if found is not None:
            return self._refuse(node, *found)
        faster = None
        if self.perf:
            if self.measure and cost.is_measured(node):
                # Placed by the defaults until measured (``measure_in_graph``, else
                # ``measure_alone``).
                self.candidates.append(_Candidate(node, key, rule))
            faster = faster_in_pytorch(node)
        if faster is not None:
            return self._refuse(node, Reason.PERF, faster)
        return Supported(name)

    def place(self, node: torch.fx.Node, in_pytorch: bool, why: str) -> None:
        """Sets the verdict of a candidate whose choice was measured (PERF with ``why``,
        or supported), and of the getitems that pick its outputs."""
        node.meta.pop(KERNEL_KEY, None)
        verdict: Verdict = Supported(target_name(node))
        if in_pytorch:
            verdict = self._refuse(node, Reason.PERF, why)
        node.meta[META_KEY] = kernels.inside(node, verdict) if self.torch_kernels else verdict
        for user in node.users:
            if user.target is operator.getitem:
                user.meta[META_KEY] = self._decide_getitem(user, target_name(user))

    def measure_alone(self, *, one_program: bool = False) -> None:
        """Places each candidate whose choice is not made yet by timing its op alone
        (``cost.measure``); ``one_program`` as in ``cost.faster_in_pytorch``."""
        for c in self.candidates:
            if cost.COST_KEY in c.node.meta:
                continue  # (decided, or its measuring failed: measure_in_graph)
            try:
                measure = self._measure(c.key, c.rule)
                faster = faster_in_pytorch(c.node, measure, one_program=one_program)
            except Exception as e:  # noqa: BLE001 - measuring must not fail the compile
                self._unmeasured([c.node], e, "op")
                continue
            self.place(c.node, faster is not None, faster or "")
        self._save()

    def measure_in_graph(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        build: Callable[[torch.fx.GraphModule], T],
        run_of: Callable[[T], Callable[[list[Any]], Any]],
    ) -> T | None:
        """``in_graph.choose`` of the candidates of ``gm`` (annotated): the build of
        ``gm`` with them where its whole graph ran faster; None (``gm`` untouched) where
        the graph cannot be timed in place, or where timing it failed (the candidates
        keep their defaults, each carrying its ``cost.Unmeasured``)."""
        rule = self.candidates[0].rule

        def remembered(
            fingerprint: str, timing: Callable[[], tuple[float, float, float]]
        ) -> tuple[float, float, float]:
            key = ("measured in its graph", cost.times_key(), fingerprint)
            times = self._remembered(key, rule, timing)
            assert times is not None
            return times

        nodes = [c.node for c in self.candidates]
        try:
            return in_graph.choose(gm, example_inputs, nodes, self.place, build, run_of, remembered)
        except in_graph.NotTimed as e:
            log.info("cost choice not timed in its graph (%s): the op alone, or the default", e)
            return None
        except Exception as e:  # noqa: BLE001 - measuring must not fail the compile
            self._unmeasured(nodes, e, "graph")
            return None
        finally:
            self._save()

    def _unmeasured(self, nodes: Sequence[torch.fx.Node], error: Exception, scope: str) -> None:
        """Measuring ``nodes``' choice raised ``error``: they keep the verdicts of the
        defaults, and each carries the failure (``cost.Unmeasured``) for the report."""
        if not isinstance(error, cost.MeasureFailed):
            error = cost.MeasureFailed("measuring", error)
        log.warning(
            "dynajax: measuring where %s runs failed (%s); it takes the default",
            ", ".join(sorted({str(n.target) for n in nodes})),
            error,
        )
        for node in nodes:
            node.meta[cost.COST_KEY] = cost.Unmeasured(
                str(node.target),
                node.name,
                str(error),
                isinstance(verdict_of(node), Unsupported),
                scope,
            )

    def _save(self) -> None:
        """Stores what was measured (best effort: a cache that cannot be written
        loses only the times)."""
        try:
            self._evaluations.save()
        except Exception as e:  # noqa: BLE001 - measuring must not fail the compile
            log.warning("dynajax: the measured times could not be stored (%s)", e)

    def _measure(self, key: Any, rule: Rule) -> Measure:
        """cost.measure of a node with this evaluation key, remembered beside the
        evaluations (per machine)."""
        return lambda node: self._remembered(
            ("measured", cost.times_key(), key), rule, lambda: cost.measure(node, rule)
        )

    def _remembered(
        self,
        key: Any,
        rule: Rule,
        timing: Callable[[], tuple[float, float, float] | None],
    ) -> tuple[float, float, float] | None:
        """``timing()``, remembered beside the evaluations under ``key``; remembered
        times took no time to measure now."""
        fresh = []

        def evaluate() -> tuple[Reason, str] | None:
            fresh.append(True)
            times = timing()
            return None if times is None else (Reason.PERF, cost.result_of(times))

        found = self._evaluations.get(key, rule, evaluate)
        times = cost.times_of(found[1] if found is not None else None)
        if times is not None and not fresh:
            times = (times[0], times[1], 0.0)
        return times

    def _decide_getitem(self, node: torch.fx.Node, name: str) -> Verdict:
        # getitem picks an output of a multi-output node: it goes where its producer goes.
        producer = node.args[0]
        if not isinstance(producer, torch.fx.Node):
            return self._refuse(node, Reason.NO_LOWERING, "getitem of a value kept in PyTorch")
        pv = producer.meta.get(META_KEY)
        if isinstance(pv, Supported):
            return Supported(name)
        if isinstance(pv, Unsupported):
            return self._refuse(node, pv.reason, f"output of '{producer.name}'")
        return self._refuse(node, Reason.NO_LOWERING, "getitem of a value kept in PyTorch")

    def _refuse(self, node: torch.fx.Node, reason: Reason, detail: str) -> Unsupported:
        return Unsupported(reason, node.name, target_name(node), detail, source_line(node))


def _sizes_and_scalars(value: Any) -> list[Any]:
    """The sizes of every tensor in ``value`` and its symbolic scalars, flattened."""
    out: list[Any] = []
    for v in _flatten(value):
        if isinstance(v, torch.Tensor):
            out.extend(v.shape)
        elif isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            out.append(v)
    return out


def _unbacked_symbols(out: Any, inputs: list[Any]) -> tuple[str, str]:
    """The unbacked symbols a node creates, and those it takes (comma-joined names).

    Unbacked symbols (``u0``) are the sizes and scalars fake tensors could not know: a
    node whose output has one its inputs lack created it by reading tensor data; a node
    whose inputs have one needs an earlier node's data to know its own shapes.
    """
    produced = free_unbacked_symbols(_sizes_and_scalars(out))
    taken = free_unbacked_symbols(_sizes_and_scalars(inputs))
    created = sorted(str(s) for s in produced - taken)
    return ", ".join(created), ", ".join(sorted(str(s) for s in taken))


_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_host_scalar(node: torch.fx.Node, out: Any) -> bool:
    """Whether the node computes Python scalars or nothing (sizes, assertions)."""
    if node.target is torch.ops.higher_order.with_effects:
        # An effectful op threaded through an effect token: an error check such as
        # ``_linalg_check_errors(info)`` after a JAX linalg partition. When the op
        # returns nothing it only reads values on the host (to raise eager's own error
        # message), so it stays in PyTorch without splitting tensor work away from JAX.
        schema = getattr(node.args[1], "_schema", None) if len(node.args) > 1 else None
        return schema is not None and len(schema.returns) == 0
    if "val" not in node.meta and node.op == "call_function":
        # No metadata: only ops whose schema returns nothing (_assert_scalar) qualify.
        schema = getattr(node.target, "_schema", None)
        return schema is not None and len(schema.returns) == 0
    values = _flatten(out)
    return all(v is None or isinstance(v, _SCALARS) for v in values) and not (
        isinstance(out, list | tuple) and any(v is None for v in values)
    )


def _unsupported_dtype(out: Any, inputs: list[Any], node: torch.fx.Node) -> torch.dtype | None:
    """A dtype among the node's tensors or literal dtype arguments that JAX lacks."""
    for t in (*_tensors(out), *_tensors(inputs)):
        if t.dtype not in TORCH_TO_JAX:
            return t.dtype
    for v in _flatten([*node.args, *node.kwargs.values()]):
        if isinstance(v, torch.dtype) and v not in TORCH_TO_JAX:
            return v
    return None


def _raised_in_jax(error: BaseException) -> bool:
    tb = error.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and os.path.abspath(last).startswith(_JAX_DIRS)


def _refusal_detail(rule: Rule, error: BaseException) -> str:
    """The CHECK_REFUSED detail of an abstract evaluation that raised ``error``.

    An error raised inside JAX (incompatible shapes, a value needed concretely) or a
    NotImplementedError is the rule declining these arguments. Any other error is
    still a refusal, so the user's program runs, but it is logged as a warning: it
    points at a rule that is probably wrong.
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    summary = f"{type(error).__name__}: {text[:200]}".rstrip(": ")
    if isinstance(error, NotImplementedError) or _raised_in_jax(error):
        log.debug("abstract evaluation of %s refused", rule.op, exc_info=error)
        return f"abstract evaluation raised {summary}"
    log.warning(
        "the JAX rule of %s raised %s outside JAX during abstract evaluation; the node "
        "runs in eager PyTorch, but the rule is probably wrong",
        rule.op,
        summary,
        exc_info=error,
    )
    return f"the rule itself raised {summary} (likely a bug in the rule)"


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _is_aval(value: Any) -> bool:
    return isinstance(value, jax.ShapeDtypeStruct)


def _evaluate(
    rule: Rule, args: Any, kwargs: dict[str, Any], expected: Any
) -> tuple[Reason, str] | None:
    """None if the rule accepts the abstract arguments and reproduces ``expected``."""
    if rule.check is not None:
        refusal = rule.check(*args, **kwargs)
        if refusal is not None:
            return Reason.CHECK_REFUSED, refusal

    # Only the tensors are abstract; literals stay Python values closed over.
    run, avals = rule.over(args, kwargs, _is_aval)
    try:
        with jax.enable_x64(True):
            got = jax.eval_shape(run, *avals)
    except _ABSTRACT_EVAL_ERRORS as e:
        # JAX reports shape and dtype errors of abstract evaluation with these types;
        # anything else (a rule's AttributeError, KeyError) is a bug and propagates.
        return Reason.CHECK_REFUSED, _refusal_detail(rule, e)
    got_flat, want_flat = _flatten(got), _flatten(expected)
    if len(got_flat) != len(want_flat):
        return Reason.CHECK_REFUSED, (
            f"rule returns {len(got_flat)} value(s), PyTorch returns {len(want_flat)}"
        )
    for g, w in zip(got_flat, want_flat, strict=True):
        if g is None or w is None:
            if g is not w:
                return Reason.CHECK_REFUSED, "rule and PyTorch disagree on which outputs are None"
            continue
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            return Reason.CHECK_REFUSED, (
                f"rule gives {_describe_aval(g)} where PyTorch gives {_describe_aval(w)}"
            )
    return None

"""The whole-graph driver: one ATen graph as one JAX program, under its caller's policy.

dynajax has two drivers. ``backend.py`` partitions a graph and runs each piece where
it belongs. This module lowers a whole graph as one program, with host callbacks for
the ops that have no rule; ``jax_function`` (``interop/function.py``), ``export``
(through ``jax_function``), torch's backward in JAX (``interop/autograd.py``) and
``train_step`` (``training/step.py``) call it, each with a ``Policy``. The stages, in
order, each owned here once:

    passes                  run_passes, with the user's passes at their two stages
    capability verdicts     CapabilityChecker(policy.fallback_ops).annotate
    what cannot be in one   the verdicts in policy.impossible, and control-flow
      program               submodules: policy.error, one line per op
    strict                  callbacks that are no choice: CallbackOpsError
    host callbacks          every other Unsupported node but HOST_SCALAR (evaluated
                            while tracing) and a getitem of a callback's output
    eager's value checks    Program.run(..., check=True): the rules' checks as an
                            int vector ``[code, *payload]`` (lowering/checks.py)
    eager's precision       Program.run traces under eager's float32 matmul and
                            convolution precision and its CUDA kernels' dtype rules
                            where the graph's tensors are CUDA tensors
                            (lowering/precision.py, as the backend's partitions)

Where callers differ, the difference is a field of ``Policy``:

    field        jax_function           torch's backward     train_step
    error        JaxFunctionError       JaxFunctionError     TrainStepError
    impossible   data-dependent sizes,  the same             the same, and ops eager
                 dtypes JAX lacks                            refuses (EAGER_REFUSES)
    strict       the user's             the function's       the user's
    passes       the user's, two stages none                 none
    checks       the user's (direct     none (a VJP returns  on unless checks=False
                 calls, fn.checked)     gradients only)
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase

from dynajax.capability import (
    META_KEY,
    CapabilityChecker,
    Reason,
    Unsupported,
    kernels,
    strict_objections,
    target_name,
    verdict_of,
)
from dynajax.capability.verdict import source_line
from dynajax.errors import CallbackOpsError, DynajaxError
from dynajax.lowering import checks as value_checks
from dynajax.lowering.checks import Check
from dynajax.lowering.dtypes import eager_on_cuda
from dynajax.lowering.interpreter import random_nodes
from dynajax.lowering.precision import eager_precision
from dynajax.passes import run_passes
from dynajax.program.callbacks import CallbackOp, flat_outputs
from dynajax.program.interpreter import (
    TRUNCATION_WARNING,
    ExportInterpreter,
    SizeBindings,
    graph_constants,
)

# What no JAX program can hold: sizes known only from data, dtypes JAX lacks.
NEVER = frozenset({Reason.DATA_DEPENDENT_SHAPE, Reason.DTYPE})


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a caller of the whole-graph driver decides.

    Attributes:
        error: the caller's exception type for a graph that cannot be one program.
        refusal: the first line of that error, before the list of ops.
        impossible: the verdict reasons that make the graph impossible as one program.
        fallback_ops: ops to run through host callbacks even where a rule exists.
        strict: raise ``CallbackOpsError`` for callbacks that are not a choice.
        before: the user's passes before dynajax's own (``post_aot``).
        after: the user's passes after them (``post_passes``).
        keep_recomputation: the graph runs a backward, where ``torch.utils.checkpoint``
            recomputes its regions: each recomputation starts behind a barrier XLA does
            not merge across (``dynajax.passes.recompute``).
        donated: (input index, output index) pairs: the input's buffer is donated to
            that output; each update is ordered after the input's other readers, so
            that XLA writes it in place (``dynajax.passes.inplace``).
        flatten: the outputs whose elementwise computation runs on flat arrays
            (``dynajax.passes.flat_updates``).
    """

    error: type[DynajaxError]
    refusal: str
    impossible: frozenset[Reason] = NEVER
    fallback_ops: tuple[str, ...] = ()
    strict: bool = False
    before: Sequence[PassBase] = ()
    after: Sequence[PassBase] = ()
    keep_recomputation: bool = False
    donated: tuple[tuple[int, int], ...] = ()
    flatten: tuple[int, ...] = ()
    measure_costs: bool = False


@dataclasses.dataclass
class Program:
    """A graph lowered as one program.

    Attributes:
        gm: the graph after the passes, each node annotated with its verdict.
        callbacks: the nodes that run in eager PyTorch through host callbacks, in
            graph order.
        random_ops: the ops whose rules draw random numbers from the program's key,
            each with the model's line (``aten.bernoulli.p at model.py:12 (...)``).
        constants: the arrays of the graph's ``get_attr`` tensors.
        on_cuda: whether the graph's tensors are CUDA tensors (eager computes with
            CUDA's kernels: cuDNN's TF32 convolutions, CUDA's conversions).
    """

    gm: torch.fx.GraphModule
    callbacks: tuple[CallbackOp, ...]
    random_ops: tuple[str, ...]
    constants: dict[str, Any]
    on_cuda: bool = False

    @property
    def random(self) -> bool:
        """Whether the program takes a key (some rule draws random numbers)."""
        return bool(self.random_ops)

    def run(
        self,
        arrays: Sequence[Any],
        *,
        key: Any = None,
        sizes: SizeBindings | None = None,
        check: bool = False,
        unless_failed: Mapping[int, int] | None = None,
    ) -> tuple[list[Any], Any, list[Check]]:
        """``run_graph`` of this program's graph, under eager's precision and the
        dtype rules of eager's kernels (CUDA's where its tensors are CUDA tensors)."""
        with eager_precision(self.on_cuda), eager_on_cuda(self.on_cuda):
            return run_graph(
                self.gm,
                arrays,
                key=key,
                sizes=sizes,
                check=check,
                constants=self.constants,
                unless_failed=unless_failed,
            )


def run_graph(
    gm: torch.fx.GraphModule,
    arrays: Sequence[Any],
    *,
    key: Any = None,
    sizes: SizeBindings | None = None,
    check: bool = False,
    constants: dict[str, Any] | None = None,
    unless_failed: Mapping[int, int] | None = None,
) -> tuple[list[Any], Any, list[Check]]:
    """The outputs of ``gm`` (lowered by ``lower``) on ``arrays`` (traced or concrete),
    the value checks' vector (``[code, *payload]``; code 0: all passed) and the checks
    recorded, in graph order (none without ``check``, the vector then ``[0]``).

    ``unless_failed`` (with ``check``): output index -> input index, the outputs that
    are their input's value where a check failed (``train_step``'s state: where eager
    raises, the step changes nothing). Each is selected where the graph computes it,
    on the checks recorded before it, so that the nodes reading it read the selected
    value and the input has no reader after the update: XLA updates a donated input in
    place. Selected at the end instead, the input would be read after its update, and
    XLA copies it (GPT-2 small's step: 945 MiB of optimizer state copied). An output
    with checks recorded after it is selected again at the end on all of them."""
    interpreter = ExportInterpreter(gm, key, sizes or SizeBindings(), constants)
    with warnings.catch_warnings():
        # Rules ask for int64/float64 by name; with JAX's 64-bit mode off, JAX warns that
        # it gives 32 bits, which is that mode's documented behaviour.
        warnings.filterwarnings("ignore", TRUNCATION_WARNING, UserWarning)
        if not check:
            return list(interpreter.run(*arrays)), jnp.zeros((1,), np.int64), []
        with value_checks.collecting() as found:
            selected = _select_where_computed(interpreter, gm, unless_failed or {}, found)
            outputs = list(interpreter.run(*arrays))
    if found.checks:
        # What no earlier selection covered: outputs computed before a later check.
        bad = found.any_failed()
        for k, i in (unless_failed or {}).items():
            if selected.get(k, -1) < len(found.checks):
                outputs[k] = jnp.where(bad, arrays[i], outputs[k])
    return outputs, found.result(), list(found.checks)


def _select_where_computed(
    interpreter: ExportInterpreter,
    gm: torch.fx.GraphModule,
    unless_failed: Mapping[int, int],
    found: value_checks.Collector,
) -> dict[int, int]:
    """Makes ``interpreter`` select each ``unless_failed`` output where its node is
    computed (``run_graph``); returns, filled as it runs, for each output so selected
    the number of checks its selection covered."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (out,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    outs = list(out) if isinstance(out, list | tuple) else [out]
    inputs: dict[torch.fx.Node, list[tuple[int, torch.fx.Node]]] = {}
    for k, i in unless_failed.items():
        node = outs[k]
        if isinstance(node, torch.fx.Node) and node is not placeholders[i]:
            inputs.setdefault(node, []).append((k, placeholders[i]))
    # A node that is two outputs (of two inputs, or another output too) is selected
    # at the end only.
    inputs = {n: pairs for n, pairs in inputs.items() if outs.count(n) == 1}
    selected: dict[int, int] = {}
    flags: dict[int, Any] = {}  # the failure flag over the first N checks, by N

    def select(n: torch.fx.Node, value: Any) -> Any:
        pairs = inputs.get(n)
        count = len(found.checks)
        if not pairs or not count or not hasattr(value, "shape"):
            return value
        ((k, placeholder),) = pairs
        selected[k] = count
        if count not in flags:
            flags[count] = found.any_failed()
        return jnp.where(flags[count], interpreter.env[placeholder], value)

    interpreter.after_node = select
    return selected


def lower(gm: torch.fx.GraphModule, policy: Policy) -> Program:
    """``gm`` as one program under ``policy``: passes, verdicts, what cannot be in it,
    strict, host callbacks (see the module doc)."""
    gm = run_passes(
        gm,
        before=list(policy.before),
        after=list(policy.after),
        keep_recomputation=policy.keep_recomputation,
        flatten=policy.flatten,
        donated=policy.donated,
    )
    checker = CapabilityChecker(
        policy.fallback_ops, perf=policy.measure_costs, measure=policy.measure_costs
    )
    refused = checker.annotate(gm)
    if checker.candidates:
        # PyTorch's kernel or XLA's, each op timed alone on this machine (the whole
        # program built twice would double its compile); the faster runs inside.
        checker.measure_alone(one_program=True)
        refused = [
            v
            for n in gm.graph.nodes
            if isinstance(v := n.meta.get(META_KEY), Unsupported) and v.reason.is_fallback
        ]
    impossible = [v for v in refused if v.reason in policy.impossible]
    if impossible:
        raise policy.error(
            policy.refusal + "\n" + "\n".join(f"  - {v.describe()}" for v in impossible)
        )
    attrs = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    others = [t for t, a in attrs.items() if not isinstance(a, torch.nn.Module | torch.Tensor)]
    if others:
        kinds = ", ".join(sorted({type(attrs[t]).__name__ for t in others}))
        raise policy.error(
            f"the graph reads attributes that are neither tensors nor submodules "
            f"({', '.join(others)}: {kinds}), which one JAX program cannot hold; keep "
            "such values out of the traced code."
        )
    submodules = [t for t, a in attrs.items() if isinstance(a, torch.nn.Module)]
    if submodules:
        raise policy.error(
            "the graph has submodules (torch.cond, torch.while_loop or other control-flow "
            f"operators: {', '.join(submodules)}), which one JAX program does not lower yet."
        )
    nodes = {n.name: n for n in gm.graph.nodes}
    # (``annotate`` returns fallbacks only: host-scalar nodes are evaluated while
    # tracing.) A getitem picking an output of a callback is no callback of its own.
    refused = [v for v in refused if nodes[v.node].target is not operator.getitem]
    unwanted = strict_objections(refused)
    if policy.strict and unwanted:
        raise CallbackOpsError(unwanted)
    callbacks = tuple(
        CallbackOp.from_verdict(v, _differentiable(nodes[v.node]), _in_kernel(nodes[v.node], v))
        for v in refused
    )
    return Program(gm, callbacks, random_ops(gm), graph_constants(gm), on_cuda(gm))


def random_ops(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The nodes JAX runs whose rules draw random numbers (a callback draws from
    torch's generator instead), each named with the model's line."""
    found = []
    for n in random_nodes(gm):
        verdict = verdict_of(n)
        if verdict is None or verdict.supported:
            where = source_line(n)
            found.append(target_name(n) + (f" at {where}" if where else ""))
    return tuple(found)


# The callbacks whose op can run as PyTorch's kernel inside the program: the user's
# fallback_ops too, which ask for PyTorch's kernel, not for a Python callback (not one
# that reads eager's storage, which the kernel's dense view of XLA's buffer lacks).
_KERNEL_CALLBACKS = kernels.KERNEL_REASONS | {Reason.USER_FALLBACK}


def _in_kernel(n: torch.fx.Node, verdict: Unsupported) -> bool:
    """Whether the callback node ``n`` runs PyTorch's kernel inside the program rather
    than a Python host callback (``kernels.mark``: the interpreter reads its mark; sizes
    resolved against the traced shapes)."""
    return kernels.mark(n, verdict, _KERNEL_CALLBACKS, static=False)


def _differentiable(n: torch.fx.Node) -> bool:
    """Whether gradients flow through a callback node: it takes and returns floating
    (or complex) tensors."""

    def inexact(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())

    ins = [a.meta.get("val") for a in n.all_input_nodes]
    return any(inexact(t) for t in ins) and any(inexact(t) for t in flat_outputs(n.meta.get("val")))


def on_cuda(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph's inputs are CUDA tensors (eager computes with CUDA's kernels)."""
    return any(
        isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
        for n in gm.graph.nodes
        if n.op == "placeholder"
    )

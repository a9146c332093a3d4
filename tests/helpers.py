"""Helpers shared by the test files: conformance cases, compiling with a fresh backend,
what ran in JAX, gradients to compare, and the op counts of FX graphs (for the passes).

The tolerance table and ``assert_same`` live in ``tests/tolerances.py``; tiny models and
``transformers`` configurations in ``tests/models.py``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import dynajax
from dynajax.capability import cost
from tests.tolerances import assert_same, tolerance

# ---------------------------------------------------------------------------------
# Compiling with a fresh backend, and what it did
# ---------------------------------------------------------------------------------


class HasGraphs(Protocol):
    """A ``dynajax.Backend`` or a ``dynajax.Report``: both list their graph reports."""

    graphs: list[Any]


def compile_with(
    fn: Callable[..., Any], *, dynamic: bool | None = None, fullgraph: bool = False, **options: Any
) -> tuple[Callable[..., Any], dynajax.Backend]:
    """``fn`` compiled by a fresh ``dynajax.Backend(**options)``, and that backend."""
    backend = dynajax.Backend(**options)
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph), backend


def compare_with_eager(
    fn: Callable[..., Any], *args: Any, fullgraph: bool = False, **options: Any
) -> dynajax.Report:
    """Compiles ``fn`` with a fresh ``dynajax.Backend(**options)``, asserts that it gives
    eager's answer on ``args`` (``assert_same``), and returns what dynajax compiled."""
    compiled, backend = compile_with(fn, fullgraph=fullgraph, **options)
    assert_same(compiled(*args), fn(*args))
    return report_of(backend)


def assert_greedy_choices(logits: torch.Tensor, chosen: torch.Tensor) -> None:
    """Each of ``chosen`` (..., tokens) is a largest of ``logits`` (..., tokens, vocab),
    eager's, to within float32's model tolerance: where two logits are that close, the
    rounding of the program computing them (the CPU's kernels, the thread count, JAX's
    or eager's) may make either the larger, so a greedy choice between them is a tie."""
    rtol, atol = tolerance(torch.float32, model=True)
    logits = logits.detach().float()
    best = logits.max(-1).values
    short = best - logits.gather(-1, chosen[..., None])[..., 0]
    bad = short > atol + rtol * best.abs()
    assert not bool(bad.any()), (
        f"{int(bad.sum())} token(s) not eager's greedy choice: short of the best logit by "
        f"up to {float(short.max()):.3g} (logits up to {float(best.abs().max()):.3g})"
    )


def assert_greedy_decode(
    eager_logits: Callable[[torch.Tensor], torch.Tensor],
    actual: torch.Tensor,
    expected: torch.Tensor,
    prompt: int,
    eos: int | None = None,
) -> None:
    """``actual``, the tokens of a compiled model's greedy decode, are eager's:
    ``expected`` (eager's own decode of the same prompt), or where the two part, each
    token of ``actual`` after the ``prompt`` is eager's greedy choice after its prefix
    (``eager_logits`` of the sequences, (batch, length, vocab), read at the token
    before: ``assert_greedy_choices``), up to an ``eos`` (padding after it)."""
    assert actual.shape[0] == expected.shape[0], (actual.shape, expected.shape)
    assert torch.equal(actual[:, :prompt], expected[:, :prompt])
    if torch.equal(actual, expected):
        return
    new = actual[:, prompt:]
    with torch.no_grad():
        logits = eager_logits(actual)[:, prompt - 1 : -1]
    if eos is not None:  # keep the eos itself, not the padding after it
        after = (new == eos).long().cumsum(-1) - (new == eos).long() > 0
        new, logits = new[~after], logits[~after]
    assert_greedy_choices(logits, new)


def report_of(source: HasGraphs) -> dynajax.Report:
    """The report of every graph a backend compiled (a report is returned as it is)."""
    return source if isinstance(source, dynajax.Report) else dynajax.Report(source.graphs)


def partition_ops(source: HasGraphs) -> set[str]:
    """The ATen overloads that ran in a JAX partition of any graph of a backend or report."""
    return {op for g in source.graphs for p in g.partitions for op in p.ops}


def assert_no_fallbacks(source: HasGraphs) -> None:
    """Nothing of any graph of ``source`` stayed in PyTorch."""
    report = report_of(source)
    assert report.fallbacks == [], report.text(width=None)


def assert_ops_in_jax(source: HasGraphs, *ops: str) -> None:
    """Nothing of any graph of ``source`` stayed in PyTorch, and each of ``ops`` ran in
    a JAX partition."""
    assert_no_fallbacks(source)
    present = partition_ops(source)
    missing = set(ops) - present
    assert not missing, f"{sorted(missing)} did not run in a JAX partition ({sorted(present)})"


# ---------------------------------------------------------------------------------
# Inputs and gradients
# ---------------------------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.randn`` of ``shape`` in ``dtype`` (float32 by default)."""
    return torch.randn(*shape, dtype=dtype)


def clone_inputs(inputs: Iterable[Any]) -> tuple[Any, ...]:
    """Detached copies of the tensors among ``inputs`` (same ``requires_grad``), for the
    eager run, so that in-place updates of one run never reach the other."""
    return tuple(
        t.clone().detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in inputs
    )


def input_grads(out: Any, inputs: Iterable[Any]) -> list[torch.Tensor | None]:
    """Gradients of the inputs that require grad, of a loss that weighs every output
    element by a fixed, non-uniform cotangent (so each element's gradient matters)."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if o.requires_grad]
    loss = sum(
        (o * torch.linspace(-1, 2, o.numel(), dtype=o.dtype).reshape(o.shape)).sum() for o in outs
    )
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def param_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of each parameter's gradient, by parameter name (None where it has none)."""
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------
# Rule conformance cases
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One function compiled with dynajax and compared with eager PyTorch (``run_case``).

    Attributes:
        id: the pytest id (``pytest -k`` selects by it).
        fn: the function under test.
        inputs: builds its arguments (called after ``torch.manual_seed(0)``).
        ops: ATen overloads that must run in a JAX partition (a single name is allowed).
        grad: also compare input gradients (``input_grads``): True for every
            floating-point input, or the positions of the inputs to differentiate.
        xfail: a known gap, with its reason: the test must fail (``case_params``).
        refused: instead of running in JAX, ``ops`` (one overload) must fall back with
            this text in the reason's detail.
        perf_fallbacks: the backend's option; False runs in JAX the ops measured faster
            in PyTorch (``capability/cost.py``), so that their rules are what is tested.
    """

    id: str
    fn: Callable[..., Any]
    inputs: Callable[[], tuple[Any, ...]]
    ops: tuple[str, ...]
    grad: bool | tuple[int, ...] = False
    xfail: str | None = None
    refused: str | None = None
    perf_fallbacks: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))


def case_params(cases: Iterable[Case]) -> list[Any]:
    """``pytest.param``s of ``cases``, with their ids and strict xfail marks."""
    return [
        pytest.param(
            c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
        )
        for c in cases
    ]


def _with_grad(case: Case, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    if case.grad is False or case.grad == ():
        return inputs

    def wanted(i: int, t: torch.Tensor) -> bool:
        return t.is_floating_point() if case.grad is True else i in case.grad

    return tuple(
        t.detach().requires_grad_(wanted(i, t)) if isinstance(t, torch.Tensor) else t
        for i, t in enumerate(inputs)
    )


@contextlib.contextmanager
def measured_faster(where: str) -> Iterator[None]:
    """Inside, measured cost choices come out with ``where`` (``"xla"`` or
    ``"pytorch"``) faster: the test seam's fixed times (``cost.fixed_times``). The
    measuring still runs: stand-in inputs built, both builds compiled and called."""
    saved = cost.fixed_times
    cost.fixed_times = (2e-3, 1e-3) if where == "xla" else (1e-3, 2e-3)
    try:
        yield
    finally:
        cost.fixed_times = saved


def run_case(case: Case, *, fullgraph: bool = True) -> None:
    """``_run_case``, with measured cost choices coming out XLA-faster (a rule's case
    is about the rule: a convolution timed faster in oneDNN would leave it)."""
    with measured_faster("xla"):
        _run_case(case, fullgraph)


def _run_case(case: Case, fullgraph: bool) -> None:
    """Runs ``case`` eagerly (on copies of its inputs) and compiled by a fresh backend;
    asserts the same outputs, the same inputs after (in-place updates), the same input
    gradients (``case.grad``), and that ``case.ops`` ran in JAX with nothing left in
    PyTorch (or, with ``case.refused``, that the one op fell back for that reason)."""
    torch.manual_seed(0)
    inputs = _with_grad(case, case.inputs())
    eager_inputs = clone_inputs(inputs)
    expected = case.fn(*eager_inputs)
    compiled, backend = compile_with(
        case.fn, fullgraph=fullgraph, perf_fallbacks=case.perf_fallbacks
    )
    actual = compiled(*inputs)
    assert_same(actual, expected)
    assert_same(
        [t for t in inputs if isinstance(t, torch.Tensor)],
        [t for t in eager_inputs if isinstance(t, torch.Tensor)],
        path="inputs",
    )
    if case.grad:
        assert_same(input_grads(actual, inputs), input_grads(expected, eager_inputs), path="grad")
    fallbacks = report_of(backend).fallbacks
    if case.refused is not None:
        assert [str(f.target) for f in fallbacks] == list(case.ops), fallbacks
        assert case.refused in fallbacks[0].detail
    else:
        assert_ops_in_jax(backend, *case.ops)


# ---------------------------------------------------------------------------------
# FX graphs (the passes of dynajax/passes)
# ---------------------------------------------------------------------------------


def target_name(target: Any) -> str:
    """``aten.sin.default`` for an ATen overload, ``operator.add`` for a function."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = {"_operator": "operator"}.get(target.__module__, target.__module__)
    return f"{module}.{target.__name__}"


def op_counts(gm: torch.fx.GraphModule, names: Iterable[str] | None = None) -> dict[str, int]:
    """How many ``call_function`` nodes of each target (``target_name``) the graph has;
    with ``names``, of those targets only (0 for one the graph lacks)."""
    counts = collections.Counter(
        target_name(n.target) for n in gm.graph.nodes if n.op == "call_function"
    )
    return dict(counts) if names is None else {name: counts[name] for name in names}


def run_graph(gm: torch.fx.GraphModule, inputs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """For each argument tuple of ``inputs``: what ``gm`` returns, and the arguments after
    the call (the tensors are copies, so in-place ops of the graph show there and never
    change the caller's)."""
    results = []
    for args in inputs:
        args = clone_inputs(args)
        results.append((gm(*args), args))
    return results


@dataclasses.dataclass(frozen=True)
class GraphCase:
    """A function traced by ``make_fx`` into an ATen graph, and what a pass makes of it
    (``check_pass``).

    Attributes:
        id: the pytest id.
        fn: the function traced.
        inputs: argument tuples; the graph is traced on the first, and must compute the
            same values on each before and after the pass.
        before: node counts (by ``target_name``) of the traced graph; ops not named
            are not counted.
        after: node counts after the pass (None: the same as ``before``).
        modified: whether the pass must report a change (for ``run_passes``, which
            returns the module: whether its code changes).
        tracing_mode: ``make_fx``'s: "real", "fake", or "symbolic" (sizes as SymInts).
    """

    id: str
    fn: Callable[..., Any]
    inputs: Callable[[], Sequence[tuple[Any, ...]]]
    before: dict[str, int]
    after: dict[str, int] | None = None
    modified: bool = False
    tracing_mode: str = "real"

    def __post_init__(self) -> None:
        if self.after is None:
            object.__setattr__(self, "after", self.before)


def draws(make: Callable[[], tuple[Any, ...]], n: int = 2) -> Callable[[], list[tuple[Any, ...]]]:
    """``GraphCase.inputs`` of ``n`` draws of the arguments ``make`` builds."""
    return lambda: [make() for _ in range(n)]


def trace(case: GraphCase) -> tuple[torch.fx.GraphModule, Sequence[tuple[Any, ...]]]:
    """``case.fn`` traced into an ATen graph (seeded), and the inputs it was traced on."""
    torch.manual_seed(0)
    inputs = case.inputs()
    return make_fx(case.fn, tracing_mode=case.tracing_mode)(*inputs[0]), inputs


def check_pass(
    pass_: Callable[[torch.fx.GraphModule], Any],
    case: GraphCase,
    prepare: Callable[[torch.fx.GraphModule], Any] | None = None,
) -> torch.fx.GraphModule:
    """Traces ``case``, runs ``prepare`` on the graph (if given), then the pass; asserts
    the node counts before and after, the pass's ``modified``, that the graph lints and
    that the recompiled module computes what it did before, on every input. Returns the
    module after the pass."""
    gm, inputs = trace(case)
    if prepare is not None:
        prepare(gm)
        gm.recompile()
    assert op_counts(gm, case.before) == case.before, gm.graph
    expected = run_graph(gm, inputs)
    result = pass_(gm)
    assert result.modified is case.modified
    gm = result.graph_module
    gm.graph.lint()
    gm.recompile()
    assert op_counts(gm, case.after) == case.after, gm.graph
    assert_same(run_graph(gm, inputs), expected)
    return gm


# ---------------------------------------------------------------------------------
# Workers in a subprocess (several JAX devices, a fresh process)
# ---------------------------------------------------------------------------------


def run_python(
    *args: str, timeout: float = 600, unset: tuple[str, ...] = (), **environ: str
) -> str:
    """Runs ``python *args`` from the repository root (with this process's environment,
    less ``unset``, plus ``environ``) and returns the last line it printed; fails the
    test with its stderr if it fails."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(environ, PYTHONPATH=str(root))
    out = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def run_worker(module: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Runs ``python -m module *args`` from the repository root and returns the JSON
    object it printed last (workers print facts; tests assert on them)."""
    return json.loads(run_python("-m", module, *args, timeout=timeout))


# ---------------------------------------------------------------------------------
# Counting calls
# ---------------------------------------------------------------------------------


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Replaces ``owner.name`` (for the test) by a wrapper that counts its calls; the
    count is the returned list's one element."""
    count = [0]
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return count


def count_recompiles(monkeypatch: Any) -> dict[str, int]:
    """From now on in the test, ``counts["recompiles"]``: the calls of
    ``torch.fx.GraphModule.recompile`` that make a module's Python code (torch's lazy
    modules only mark theirs as due, and are not counted until they make it)."""
    counts = {"recompiles": 0}
    original = torch.fx.GraphModule.recompile

    def counted(self: torch.fx.GraphModule) -> Any:
        counts["recompiles"] += 1
        return original(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    return counts

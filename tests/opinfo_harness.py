"""Runs PyTorch's OpInfo database through dynajax and classifies every sample.

Shared by the CI test (``tests/test_opinfo.py``, a deterministic subset) and the
whole-database run (``python -m tests.opinfo_full``). For one OpInfo, one dtype and one
of its CPU sample inputs, ``run_sample`` compiles ``lambda *a, **k: op(*a, **k)`` with a
fresh ``dynajax.Backend`` (``dynamic=False``) and compares it with eager PyTorch:

    jax       the compiled call matches eager and no node fell back
    fallback  it matches eager, and some node ran in eager PyTorch for a recorded
              reason (a dynajax verdict, or a Dynamo graph break)
    failing   a crash, or a result that differs from eager

"Matches" means within the tolerance table of ``tests/tolerances.py``, or one of the
two differences that ``tests/opinfo_accuracy.py`` accepts and records apart: a valid
index among tied values where PyTorch leaves the choice open, or a floating result at
least as close to the float64 result as eager's own. A sample on which eager raises
matches when the compiled call raises too (any type).
Samples whose eager result depends on the random seed (random ops), or that return
uninitialized memory (``empty*``), are compared by structure, dtype and shape only.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import time
import unittest.mock
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch._dynamo

import dynajax
from tests.helpers import measured_faster
from tests.opinfo_accuracy import accept_difference, input_tensors
from tests.tolerances import assert_same, assert_same_layout

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.bfloat16,
    torch.float16,
    torch.complex64,
)

# Ops whose result is uninitialized memory: PyTorch's own OpInfo tests skip their
# values too ("empty is not comparable").
UNINITIALIZED = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
)

# Ops whose values depend on the generator by construction, but so weakly on small
# samples that two eager seeds can agree (fractional pooling's window offsets take a
# few values; a few draws without replacement from few categories): compared by
# structure always, since the compiled program draws from another stream. Their
# statistics are tested in tests/training/test_random.py.
RANDOM_BY_DESIGN = frozenset(
    {"nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "multinomial"}
)


def _random_by_design(op: Any, sample: Any) -> bool:
    """Whether the sample's values depend on the generator by construction (see
    RANDOM_BY_DESIGN); multi-head attention samples in training mode with dropout
    drop attention weights whose softmax is nearly one-hot, so seeds often agree."""
    if op.name in RANDOM_BY_DESIGN:
        return True
    if op.name == "nn.functional.multi_head_attention_forward":
        dropout_p = sample.args[9] if len(sample.args) > 9 else sample.kwargs.get("dropout_p", 0)
        return bool(sample.kwargs.get("training", True)) and dropout_p > 0
    return False


JAX, FALLBACK, FAILING = "jax", "fallback", "failing"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def op_db() -> list[Any]:
    """The OpInfo database (importing it takes seconds, so only on first use)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as db
    return list(db)


def op_id(op: Any) -> str:
    """``op`` or ``op.variant``: OpInfo's own unique test name."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@dataclasses.dataclass
class Outcome:
    """How one sample ended.

    Attributes:
        status: ``jax``, ``fallback`` or ``failing``.
        detail: the fallback reasons, or what failed (first line of the error).
        eager_error: the exception type eager raised (the compiled call raised too).
        shape_only: values were not compared (random or uninitialized output).
        accuracy: "" when the values match eager within the tolerance table, else how
            the difference was accepted (``tests/opinfo_accuracy.py``): ``ties`` (a
            valid index among tied values) or ``float64`` (at least as close to the
            float64 result as eager).
        seconds: wall time of the compiled call, compilation included.
    """

    status: str
    detail: str = ""
    eager_error: str = ""
    shape_only: bool = False
    accuracy: str = ""
    seconds: float = 0.0


def samples(op: Any, dtype: torch.dtype) -> Iterator[Any]:
    """The op's CPU sample inputs for ``dtype`` (without gradients), in OpInfo's order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield from op.sample_inputs("cpu", dtype, requires_grad=False)


def _clone(value: Any) -> Any:
    """A deep copy that keeps tensor strides (non-contiguous samples stay so)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.requires_grad:
            return value.clone()
        out = torch.empty(0, dtype=value.dtype, device=value.device)
        out.set_(
            value.untyped_storage().clone(), value.storage_offset(), value.size(), value.stride()
        )
        if value.is_conj():
            out = out.conj()  # the storage holds the unconjugated data
        if value.is_neg():
            out = out._neg_view()
        return out
    if isinstance(value, list | tuple):
        items = [_clone(v) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else copy.copy(value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _arguments(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_clone(sample.input), *_clone(tuple(sample.args))), _clone(dict(sample.kwargs))


def _call_eager(op: Any, sample: Any, seed: int) -> tuple[Any, BaseException | None, Any]:
    """(result, exception, the arguments after the call: ops may write to them)."""
    args, kwargs = _arguments(sample)
    torch.manual_seed(seed)
    try:
        return op.op(*args, **kwargs), None, (args, kwargs)
    except Exception as e:  # eager's own error is part of the expected behavior
        return None, e, (args, kwargs)


def _differs(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return True
    return False


def _structure(actual: Any, expected: Any, path: str = "out") -> None:
    """Same nesting, tensor dtypes and shapes; values ignored."""
    if isinstance(expected, torch.Tensor):
        assert_same_layout(actual, expected, path)
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple), f"{path}: expected a sequence"
        assert len(actual) == len(expected), f"{path}: {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _structure(a, e, f"{path}[{i}]")


def _one_line(text: str, lines: int = 1) -> str:
    return " ".join(x.strip() for x in text.strip().splitlines()[:lines])


def _first_line(e: BaseException) -> str:
    inner = getattr(e, "inner_exception", None)  # Dynamo's BackendCompilerFailed
    if isinstance(inner, BaseException):
        e = inner
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}"[:300]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silences the warnings and logs of eager kernels and Dynamo for one sample."""
    loggers = [
        logging.getLogger(n)
        for n in ("torch._dynamo", "torch._inductor", "torch._subclasses", "dynajax")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Our own warnings stay errors, as everywhere in the test suite.
            warnings.filterwarnings("error", module=r"dynajax(\.|$)")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _graph_breaks() -> collections.Counter[str]:
    return collections.Counter(torch._dynamo.utils.counters["graph_break"])


def _call_unseeded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


@contextlib.contextmanager
def _unseeded_random_ops() -> Iterator[None]:
    """The database calls its random ops through ``wrapper_set_seed``, which reseeds
    PyTorch's generator inside a ``freeze_rng_state`` that Dynamo cannot trace (a graph
    break: the whole op would run eagerly). As PyTorch's own Inductor OpInfo test does,
    call them directly instead; the harness seeds every call itself, and compares
    random results by structure only."""
    import torch.testing._internal.common_methods_invocations as cmi

    with unittest.mock.patch.object(cmi, "wrapper_set_seed", _call_unseeded):
        yield


def run_sample(op: Any, sample: Any) -> Outcome:
    """Compiles one OpInfo sample with dynajax, runs it, and compares it with eager
    (the measured cost choices come out XLA-faster: the sample is about the rule)."""
    with _quiet(), _unseeded_random_ops(), measured_faster("xla"):
        return _run_sample(op, sample)


def run_samples(op: Any, batch: list[Any]) -> list[Outcome]:
    """The outcomes of several samples of one op, as ``run_sample`` would give them.

    A fast path for the whole-database run: the samples that eager runs without an
    error are first compiled together, as one function calling the op once per sample
    (one Dynamo trace, one XLA program, instead of one of each per sample). When that
    batch is wholly clean (no graph break, no fallback, no error, every output and
    mutated input matching eager) every sample in it ran in JAX and matched, and that
    is its outcome. Otherwise each sample runs again on its own, so that every
    fallback reason and failure is the one of that sample alone.
    """
    with _quiet(), _unseeded_random_ops(), measured_faster("xla"):
        eager = [_eager_reference(op, s) for s in batch]
        clean = [i for i, e in enumerate(eager) if e[1] is None]
        outcomes: dict[int, Outcome] = {}
        if len(clean) > 1:
            outcomes.update(
                _run_batch(op, [batch[i] for i in clean], [eager[i] for i in clean], clean)
            )
        return [outcomes.get(i) or _run_sample(op, s) for i, s in enumerate(batch)]


def _run_batch(
    op: Any, batch: list[Any], eager: list[tuple[Any, Any, Any, bool]], ids: list[int]
) -> dict[int, Outcome]:
    """{sample index: outcome} when the batch compiled together is clean, else {}."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = dynajax.Backend()
    compiled = torch.compile(
        lambda calls: [op.op(*a, **k) for a, k in calls], backend=backend, dynamic=False
    )
    calls = [_arguments(s) for s in batch]
    start = time.perf_counter()
    torch.manual_seed(0)
    try:
        actual = compiled(calls)
    except Exception:
        return {}
    seconds = (time.perf_counter() - start) / len(batch)
    if _graph_breaks() or dynajax.Report(backend.graphs).fallbacks:
        return {}
    out = {}
    for i, got, call, (expected, _, eager_inputs, shape_only) in zip(
        ids, actual, calls, eager, strict=True
    ):
        try:
            if shape_only:
                _structure(got, expected)
            else:
                assert_same(got, expected)
                assert_same(input_tensors(call), input_tensors(eager_inputs), path="inputs")
        except AssertionError:
            return {}
        out[i] = Outcome(JAX, shape_only=shape_only, seconds=seconds)
    return out


def _eager_reference(op: Any, sample: Any) -> tuple[Any, BaseException | None, Any, bool]:
    """(result, exception, inputs after the call, compare by structure only)."""
    expected, eager_error, eager_inputs = _call_eager(op, sample, seed=0)
    shape_only = op.name in UNINITIALIZED or _random_by_design(op, sample)
    if eager_error is None and not shape_only:
        # A result that changes with the seed (or between two identical calls) is
        # random: another suite checks its statistics; here only its structure.
        again, _, _ = _call_eager(op, sample, seed=1)
        shape_only = _differs(again, expected)
    return expected, eager_error, eager_inputs, shape_only


def _run_sample(op: Any, sample: Any) -> Outcome:
    expected, eager_error, eager_inputs, shape_only = _eager_reference(op, sample)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = dynajax.Backend()
    compiled = torch.compile(lambda *a, **k: op.op(*a, **k), backend=backend, dynamic=False)
    args, kwargs = _arguments(sample)
    start = time.perf_counter()
    torch.manual_seed(0)
    try:
        actual = compiled(*args, **kwargs)
        error = None
    except Exception as e:
        actual, error = None, e
    seconds = time.perf_counter() - start

    if eager_error is not None:
        if error is None:
            return Outcome(
                FAILING,
                f"eager raised {_first_line(eager_error)}; compiled did not",
                seconds=seconds,
            )
        return _classify(
            backend, Outcome(JAX, eager_error=type(eager_error).__name__, seconds=seconds)
        )
    if error is not None:
        return Outcome(FAILING, f"compiled raised {_first_line(error)}", seconds=seconds)
    accuracy = ""
    try:
        if shape_only:
            _structure(actual, expected)
        else:
            inputs, expected_inputs = input_tensors((args, kwargs)), input_tensors(eager_inputs)
            try:
                assert_same(actual, expected)
                # Inputs the op writes to must end the same as in eager.
                assert_same(inputs, expected_inputs, path="inputs")
            except AssertionError as e:
                try:
                    accuracy = accept_difference(
                        op, sample, actual, expected, inputs, expected_inputs
                    )
                except AssertionError as why_not:
                    raise AssertionError(f"{_one_line(str(e), 4)} [{why_not}]") from None
    except AssertionError as e:
        return Outcome(
            FAILING,
            f"mismatch: {_one_line(str(e), 4)[:500]}",
            shape_only=shape_only,
            seconds=seconds,
        )
    return _classify(
        backend, Outcome(JAX, shape_only=shape_only, accuracy=accuracy, seconds=seconds)
    )


def _classify(backend: dynajax.Backend, outcome: Outcome) -> Outcome:
    reasons = [
        f"{f.target}: {f.reason.name}" + (f" ({f.detail})" if f.detail else "")
        for f in dynajax.Report(backend.graphs).fallbacks
    ]
    reasons += [f"dynamo graph break: {_one_line(r, 2)}" for r in _graph_breaks()]
    if reasons:
        outcome.status = FALLBACK
        outcome.detail = "; ".join(dict.fromkeys(reasons))[:500]
    return outcome


def expected_failure(key: tuple[str, str, str]) -> str | None:
    from tests.opinfo_expected_failures import EXPECTED_FAILURES

    return EXPECTED_FAILURES.get(key)


# The CI subset: the first sample of every op in float32 (~680 samples), and the first
# sample of every op in one other dtype, cycling through them (op k in dtype k mod 7),
# ~490 samples: about 5 minutes on two cores. Deterministic: the database's order
# decides. ``python -m tests.opinfo_full --ci`` runs the same subset with the table.
CI_SAMPLES = 1
CI_OTHER_DTYPE_STRIDE = 1  # every op; raise it to take every n-th op only


def ci_selection() -> list[tuple[Any, torch.dtype, int]]:
    """(op, dtype, number of leading samples) of the CI subset, in database order."""
    others = DTYPES[1:]
    out = []
    for k, op in enumerate(op_db()):
        supported = op.supported_dtypes("cpu")
        if torch.float32 in supported:
            out.append((op, torch.float32, CI_SAMPLES))
        other = others[k % len(others)]
        if (k // len(others)) % CI_OTHER_DTYPE_STRIDE == 0 and other in supported:
            out.append((op, other, CI_SAMPLES))
    return out

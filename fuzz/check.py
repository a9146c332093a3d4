"""Running a program eagerly and compiled by dynajax, and comparing the two.

The comparison is the test suite's (``tests.tolerances.assert_same``): the same
outputs (count, dtype, shape, ``requires_grad``), values within the tolerance table
(exact for integers and booleans, NaN where eager has NaN), the inputs after the call
(in-place updates; a module program's parameters and buffers are inputs too), the
elements of each input's storage outside its view (an input that is a view into a
larger storage: they must be untouched, bit for bit, as eager leaves them), the input
gradients of a scalar loss of the outputs, and, where
eager raises, an exception of the same type (the compiled one may be a subclass:
Dynamo's ``TorchRuntimeError`` is a ``RuntimeError``). Each program runs twice, on two
sets of input values, through the same compiled function (the second call runs the
cached executables).

A floating value that differs beyond the table is still accepted in three cases, the
differences the README documents and their consequences (and an integer output that
is a float's bits, ``Tensor.view(torch.int32)``, where both are NaNs: ``nan bits``, a
NaN's sign and payload, which eager's own kernels set by an element's position):

``subnormal``
    It equals eager's value computed with subnormals flushed to zero
    (``torch.set_flush_denormal(True)``), which is what XLA's CPU runtime does.
``float64``
    It is at least as close to the program's float64 result as eager's value is (every
    floating input and dtype of the program in float64), plus an atol: two roundings of
    the same computation (the criterion of ``tests/opinfo_accuracy.py``, PyTorch's own
    for reference implementations); or, element by element, at least as close as eager's
    plus the table's tolerance of the float64 value (the whole-tensor criterion weighs a
    large value's rounding with the atol alone). The atol is the largest of the value's
    dtype and the floating dtypes the program computes in (a float64 gradient of a float32
    computation carries float32 roundings).
``amplified``
    Every op of the program, compiled alone on eager's values of its arguments, agrees
    with eager within the table or one of the two allowances above, and at least one op
    alone differs at all: the program's difference is those accepted per-op
    differences grown by the ops after them (an ulp of a bfloat16 ``exp`` is several
    ulps after another ``exp``). A wrong op shows alone; an error that only arises
    between ops (excess precision, where every op alone is bit-equal to eager) is not
    accepted. For a gradient, every op's gradient alone must agree as well: its
    vector-Jacobian product, compiled alone on eager's values of its arguments and
    eager's gradient at its output (an ulp of ``softmax`` near 1 is a large change of
    ``atanh``'s gradient there; ``atanh``'s own gradient is right). Programs that write
    in place into a value the gradient flows through are not judged so (a write into an
    integer or a constant only changes what later ops read).

Every other difference is a failure. A failure is classified ``upstream``, not dynajax's,
when its program differs from eager the same way under ``backend="aot_eager"`` (no
dynajax: Dynamo and aot_autograd only), so it belongs to ``torch.compile``, or its
gradient differs where ``aot_eager`` raises in the backward (aot_autograd's backward
graph, which dynajax compiles, is broken there); or when
eager's own answer changes if the same input values come contiguous and dynajax's
answer is eager's on those contiguous copies: then a PyTorch kernel misreads its
input's strides (``median`` along a dim of stride 0 reads past the element); or when
eager's own answer changes once PyTorch fills the memory it allocates before use: then
a PyTorch kernel reads memory it never wrote, and its answer is undefined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import dynajax
from dynajax.capability.cost import Unmeasured
from fuzz import through_jax
from fuzz.ops import render
from fuzz.program import CONTIGUOUS, FLOAT_DTYPES, OpRecord, Program, make_inputs, name
from fuzz.rendering import ModuleProgram, forget_function, function_of, op_index, to_function
from tests.opinfo_accuracy import distance
from tests.tolerances import assert_same, tolerance

OK, RAISED, FAIL, UPSTREAM = "ok", "raised", "fail", "upstream"
# Through jax_function only: the program has an op a JAX function cannot hold (an output
# size that depends on the data, as boolean-mask indexing makes), refused at build with
# an error naming it, as documented; not a different answer (also where eager raises at
# a later op: the refusal comes first, when the function is built). Or eager refuses the
# program for a reason of autograd's own, not of its values: it writes in place into an
# input that requires grad (a leaf, or a view of one), or into one of several views an op
# returned (chunk, split, unbind) of a value that requires grad. A JAX function takes
# values, with no leaves and no autograd views, so eager has no answer to compare with
# (through the backend, dynajax raises eager's error: torch.compile keeps autograd's
# checks).
REFUSED = "refused"
_REFUSAL = "cannot be part of a JAX function"
# The same limit where torch.export meets it first, in a decomposition that reads a
# value, before dynajax sees the graph to name the op: torch's own errors for a guard or
# size on a tensor's value.
_DATA_DEPENDENT = (
    "GuardOnDataDependentSymNode",
    "PendingUnbackedSymbolNotFound",
    "DataDependentOutputException",
)
_AUTOGRAD_REFUSALS = (
    "leaf Variable that requires grad is being used in an in-place operation",
    "is a view and is being modified inplace",
)
SUBNORMAL, FLOAT64, AMPLIFIED = "subnormal", "float64", "amplified"
NAN_BITS = "nan bits"
CALLS = (0, 1)

Backend = Callable[[], Any] | str


def dynajax_backend() -> Any:
    """A fresh dynajax backend with the default options (``python -m fuzz`` keeps the
    persistent cache in a temporary home of its run)."""
    return dynajax.Backend()


@dataclasses.dataclass
class Run:
    """One call of a program: what it returned or raised, and its inputs after."""

    outputs: list[Any] | None
    inputs: list[torch.Tensor]
    grads: list[torch.Tensor | None] | None = None
    error: BaseException | None = None
    stage: str = ""
    error_op: int | None = None
    outside: list[torch.Tensor | None] | None = None


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """How a compiled call differs from eager's.

    Attributes:
        kind: ``raises`` (eager raised, dynajax did not raise that type), ``crash``
            (dynajax raised, eager did not), ``structure``, ``dtype``, ``shape``,
            ``requires_grad``, ``value`` (an output), ``inputs`` (an input after the
            call, or its storage outside its view), ``grad`` (an input gradient).
        where: the value: ``out[1]``, ``inputs[0]``, ``storage[0]``, ``grad[2]``, or the
            op that raised.
        dtype: the dtype of eager's value, or the exception types ``Eager->Compiled``.
        detail: the message.
        call: which call of the program (0 or 1) differed.
    """

    kind: str
    where: str
    dtype: str
    detail: str
    call: int = 0

    @property
    def key(self) -> str:
        """What a shrunk program must keep to fail "the same way"."""
        if self.kind in ("raises", "crash"):
            return f"{self.kind}:{self.dtype}:{_normalize(self.detail)[:40]}"
        return f"{self.kind}:{self.dtype}"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The verdict on a program.

    Attributes:
        status: ``ok``; ``raised`` (eager raised and dynajax raised the same type);
            ``fail``; ``upstream`` (fails the same way under ``aot_eager``, or eager
            misreads its inputs' strides: ``eager_misreads_strides``); through
            ``jax_function``, ``refused`` (see ``REFUSED``).
        mismatch: the first difference, for ``fail`` and ``upstream``; for
            ``refused``, jax_function's refusal or eager's error.
        accepted: the allowances some value needed (``subnormal``, ``float64``).
        signature: ``kind:op:detail``, what known bugs and de-duplication key on (the op
            from the shortest prefix of the program that fails the same way).
        verdict: the comparison with eager (and how many ops ran in JAX).
    """

    status: str
    mismatch: Mismatch | None = None
    accepted: tuple[str, ...] = ()
    signature: str = ""
    verdict: Verdict | None = None


def _normalize(text: str) -> str:
    """The first line of a message with numbers and names of values blanked, so that
    the same bug on other shapes reads the same."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"\b[xv]\d+\b", "v", line)
    return re.sub(r"\d+", "N", line)


def error_text(error: BaseException) -> str:
    """``Type: message`` of an exception, through Dynamo's wrapper of backend errors."""
    inner = getattr(error, "inner_exception", None)
    if isinstance(inner, BaseException):
        error = inner
    return f"{type(error).__name__}: {error}"


class _Collect(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def quiet(collect: _Collect | None = None) -> Iterator[None]:
    """Warnings off and torch's error logging of failed fake-tensor calls muted (eager
    errors are expected here), dynajax's warnings sent to ``collect`` instead of the
    console; restored after."""
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    own = logging.getLogger("dynajax")
    handler = collect or _Collect()
    own.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        own.removeHandler(handler)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def loss_grads(outputs: Any, leaves: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
    """Gradients of the leaves, of a loss that weighs every element of every output that
    requires grad by a fixed, non-uniform weight (``tests.helpers.input_grads``); None
    when no output requires grad."""
    outs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves or not outs:
        return None
    loss = torch.stack(
        [
            (o * torch.linspace(-1, 2, o.numel(), dtype=torch.float64).to(o.dtype).view(o.shape))
            .sum()
            .to(torch.float64)
            for o in outs
        ]
    ).sum()
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def execute(
    fn: Callable[..., Any],
    program: Program,
    call: int,
    *,
    upcast: bool = False,
    flush: bool = False,
    contiguous: bool = False,
    fill_uninitialized: bool = False,
) -> Run:
    """Calls ``fn`` on fresh inputs of ``program`` (call ``call``; with ``contiguous``,
    contiguous copies of them, in storage of their own; a module program's state loaded
    into its module first),
    then the gradients of the loss (``loss_grads``) when the program compares them. With
    ``fill_uninitialized``, PyTorch fills the memory it allocates (NaN, or the largest
    integer) before its kernels write it."""
    inputs = make_inputs(program, call, upcast)
    if contiguous:  # fresh storage: a view from an offset is contiguous, its storage larger
        inputs = [
            t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)
            for t in inputs
        ]
    if isinstance(fn, ModuleProgram):
        inputs = fn.load(inputs)
    leaves = [t for t in inputs if t.requires_grad]
    stage = "forward"
    try:
        with _flushing(flush), _default_float64(upcast), _filling(fill_uninitialized):
            outputs = fn(*inputs)
            stage = "backward"
            grads = loss_grads(outputs, leaves) if program.grad else None
    except Exception as e:
        return Run(None, inputs, None, e, stage, _error_op(e, fn), _outsides(inputs))
    return Run(list(outputs), inputs, grads, outside=_outsides(inputs))


def _outsides(inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per input, the elements of its storage outside its view, flat, in storage
    order (None for an input whose view is its whole storage)."""
    out: list[torch.Tensor | None] = []
    for t in inputs:
        t = t.detach()
        size = t.untyped_storage().nbytes() // max(t.element_size(), 1)
        if t.storage_offset() == 0 and size == t.numel() and t.is_contiguous():
            out.append(None)
            continue
        flat = t.as_strided((size,), (1,), 0)
        inside = torch.zeros(size, dtype=torch.bool)
        if t.numel():
            positions = torch.arange(size).as_strided(t.shape, t.stride(), t.storage_offset())
            inside[positions.reshape(-1)] = True
        out.append(flat[~inside].clone())
    return out


@contextlib.contextmanager
def _flushing(on: bool) -> Iterator[None]:
    """Subnormals flushed to zero by eager's CPU kernels inside (if ``on``)."""
    previous = torch.set_flush_denormal(True) if on else False
    try:
        yield
    finally:
        if previous:
            torch.set_flush_denormal(False)


@contextlib.contextmanager
def _filling(on: bool) -> Iterator[None]:
    """New tensors' memory filled before use inside (if ``on``): PyTorch does that
    under ``use_deterministic_algorithms`` (``warn_only``: nothing else changes)."""
    if not on:
        yield
        return
    mode, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        (torch.is_deterministic_algorithms_warn_only_enabled()),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


@contextlib.contextmanager
def _default_float64(on: bool) -> Iterator[None]:
    """float64 as the default dtype inside (if ``on``), so that the float64 reference
    promotes integers to float64 where the program promotes them to float32."""
    previous = torch.get_default_dtype()
    if on:
        torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _error_op(error: BaseException, fn: Callable[..., Any]) -> int | None:
    """The index of the op of ``fn``'s program on whose line ``error`` was raised."""
    code = function_of(fn).__code__
    line = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame.f_code
        if frame.co_filename == code.co_filename and frame.co_name == code.co_name:
            line = tb.tb_lineno
        tb = tb.tb_next
    return None if line is None else op_index(line)


def _close(actual: Any, expected: Any) -> str | None:
    """None if ``assert_same`` accepts ``actual``, else its message."""
    try:
        assert_same(actual, expected)
    except AssertionError as e:
        return str(e)
    return None


class _References:
    """The runs an allowance compares with, made on first use."""

    def __init__(
        self, program: Program, fn: Callable[..., Any], call: int, backend: Backend | str
    ) -> None:
        self.program, self.fn, self.call, self.backend = program, fn, call, backend
        self._flushed: Run | None = None
        self._float64: Run | None = None
        self._amplified: dict[bool, bool] = {}

    def flushed(self) -> Run:
        if self._flushed is None:
            self._flushed = execute(self.fn, self.program, self.call, flush=True)
        return self._flushed

    def float64(self) -> Run:
        if self._float64 is None:
            fn64 = to_function(self.program, upcast=True)
            self._float64 = execute(fn64, self.program, self.call, upcast=True)
            forget_function(fn64)
        return self._float64

    def weakest_atol(self) -> float:
        """The largest absolute tolerance of a floating dtype the program computes in
        (its inputs' and the dtypes its ops name): a float64 value computed from float32
        ones (a float64 scalar's gradient through a float32 tensor, 0-dim tensors not
        promoting) carries float32 roundings, so its distance from the float64 answer is
        weighed with float32's tolerance."""
        names = {spec.dtype for spec in self.program.inputs}
        names |= {v for r in self.program.ops for k, v in r.params if k == "dtype"}
        floats = [getattr(torch, n) for n in names if n in FLOAT_DTYPES]
        return max((tolerance(d)[1] for d in floats), default=0.0)

    def amplified(self, grads: bool = False) -> bool:
        if grads not in self._amplified:
            self._amplified[grads] = amplified(self.program, self.call, self.backend, grads)
        return self._amplified[grads]


def _op_function(rec: OpRecord, params: list[int], upcast: bool) -> Callable[..., Any]:
    """Op ``rec`` alone as a function of its distinct arguments, returning what it
    defines (or, in place, what it writes)."""
    out = name(rec.out if rec.out is not None else rec.args[0])
    text = (
        f"def op({', '.join(name(a) for a in params)}):\n"
        f"    {render(rec, upcast=upcast)}\n    return ({out},)\n"
    )
    namespace: dict[str, Any] = {"torch": torch, "F": F}
    exec(compile(text, f"<fuzz op {rec.kind}>", "exec"), namespace)
    fn: Callable[..., Any] = namespace["op"]
    return fn


def _op_alone(
    rec: OpRecord, values: dict[int, torch.Tensor], backend: Backend | str
) -> bool | None:
    """Op ``rec`` compiled alone on eager's values of its arguments: None if it differs
    from eager beyond the table and the subnormal and float64 allowances, else whether
    it differs at all."""
    params = list(dict.fromkeys(rec.args))

    def args(upcast: bool = False) -> list[torch.Tensor]:
        return [
            values[a].to(torch.float64) if upcast and values[a].is_floating_point()
            else values[a].clone()
            for a in params
        ]  # fmt: skip

    fn = _op_function(rec, params, upcast=False)
    expected = fn(*args())
    torch._dynamo.reset()
    try:
        actual = compiled(fn, backend)(*args())
    except Exception:
        return None

    def flushed() -> Any:
        with _flushing(True):
            return fn(*args())

    def reference() -> Any:
        with _default_float64(True):
            return _op_function(rec, params, upcast=True)(*args(upcast=True))

    return _alone_verdict(actual, expected, flushed, reference)


def _alone_verdict(
    actual: Any, expected: Any, flushed: Callable[[], Any], reference: Callable[[], Any]
) -> bool | None:
    """None if ``actual`` differs from ``expected`` (eager's) beyond the table and the
    subnormal (``flushed()``: eager's values with subnormals flushed) and float64
    (``reference()``: the float64 values) allowances, else whether it differs at all."""
    if _close(actual, expected) is None:
        try:
            torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return True
        return False
    if _close(actual, flushed()) is None:
        return True
    for a, e, r in zip(actual, expected, reference(), strict=True):
        if not isinstance(e, torch.Tensor) or not e.is_floating_point() or r.shape != e.shape:
            if _close(a, e) is not None:
                return None
            continue
        ref = r.detach().to(torch.float64)
        if distance(a, ref) > distance(e, ref) + tolerance(e.dtype)[1]:
            return None
    return True


def _vjp_alone(
    rec: OpRecord,
    values: dict[int, torch.Tensor],
    cotangent: torch.Tensor,
    backend: Backend | str,
) -> bool | None:
    """The gradient of op ``rec`` (its vector-Jacobian product with ``cotangent``, eager's
    gradient of the program's loss at the op's output) with respect to its arguments
    that require grad, compiled alone on eager's values of its arguments: as
    ``_op_alone``."""
    params = list(dict.fromkeys(rec.args))
    fn = _op_function(rec, params, upcast=False)

    def vjp(function: Callable[..., Any], upcast: bool = False) -> list[torch.Tensor | None]:
        args = [
            values[a].detach().to(torch.float64 if upcast else values[a].dtype)
            .requires_grad_(values[a].requires_grad)
            if values[a].is_floating_point()
            else values[a].detach().clone()
            for a in params
        ]  # fmt: skip
        leaves = [a for a in args if a.requires_grad]
        (out,) = function(*args)
        cot = cotangent.to(torch.float64) if upcast else cotangent
        grads = torch.autograd.grad(out, leaves, cot, allow_unused=True)
        pairs = zip(grads, leaves, strict=True)
        return [g if g is not None else torch.zeros_like(a) for g, a in pairs]

    expected = vjp(fn)
    torch._dynamo.reset()
    try:
        actual = vjp(compiled(fn, backend))
    except Exception:
        return None

    def flushed() -> Any:
        with _flushing(True):
            return vjp(fn)

    def reference() -> Any:
        with _default_float64(True):
            return vjp(_op_function(rec, params, upcast=True), upcast=True)

    return _alone_verdict(actual, expected, flushed, reference)


def amplified(program: Program, call: int, backend: Backend | str, grads: bool = False) -> bool:
    """Whether every op of ``program``, compiled alone on eager's values of its
    arguments (on call ``call``'s inputs), agrees with eager within the table or an
    allowance, and at least one differs at all: then a larger difference of the whole
    program is those accepted differences amplified by the ops after them.

    With ``grads``, the gradients too: every op's gradient alone (``_vjp_alone``, on
    eager's values and eager's gradient at its output) agrees as well. Programs that
    write in place into a value the gradient flows through are not judged so (False)."""
    namespace = _namespace([t.detach() for t in make_inputs(program, call)])
    differs = False
    for rec in program.ops:
        values = {a: namespace[name(a)].detach().clone() for a in rec.args}
        try:
            exec(render(rec), namespace)
            alone = _op_alone(rec, values, backend)
        except Exception:
            return False
        if alone is None:
            return False
        differs |= alone
    if grads:
        alone_grads = _vjps_alone(program, call, backend)
        if alone_grads is None:
            return False
        differs |= alone_grads
    return differs


def _namespace(inputs: list[torch.Tensor]) -> dict[str, Any]:
    """The names a program's rendered ops run in: ``torch``, ``F`` and its inputs."""
    namespace: dict[str, Any] = {"torch": torch, "F": F}
    namespace.update({name(i): t for i, t in enumerate(inputs)})
    return namespace


def _vjps_alone(program: Program, call: int, backend: Backend | str) -> bool | None:
    """``_vjp_alone`` of every op of ``program`` whose output the loss's gradient
    reaches (each on a copy of its arguments as they were when it ran): None if one
    differs beyond the allowances (or the program writes in place into a value the
    gradient flows through), else whether any differs at all. An in-place write into
    a value that requires no grad after it (an integer, a constant) is off the
    gradient's path: it only changes what later ops read."""
    namespace = _namespace(make_inputs(program, call))
    arguments: list[dict[int, tuple[torch.Tensor, bool]]] = []
    outs: list[Any] = []
    try:
        for rec in program.ops:
            values = {a: namespace[name(a)] for a in rec.args}
            arguments.append({a: (v.detach().clone(), v.requires_grad) for a, v in values.items()})
            exec(render(rec), namespace)
            if rec.out is None:
                if namespace[name(rec.args[0])].requires_grad:
                    return None
                outs.append(None)
            else:
                outs.append(namespace[name(rec.out)])
        reached = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        cotangents = loss_grads([namespace[name(o)] for o in program.outputs], reached)
    except Exception:
        return None
    if cotangents is None:
        return False
    by_output = {id(o): c for o, c in zip(reached, cotangents, strict=True)}
    differs = False
    for rec, args, out in zip(program.ops, arguments, outs, strict=True):
        cot = by_output.get(id(out)) if out is not None else None
        if cot is None or not any(grad for _, grad in args.values()):
            continue
        values = {
            a: v.requires_grad_(grad and v.is_floating_point()) for a, (v, grad) in args.items()
        }
        try:
            alone = _vjp_alone(rec, values, cot.detach(), backend)
        except Exception:
            return None
        if alone is None:
            return None
        differs |= alone
    return differs


def _values(run: Run, group: str) -> list[Any]:
    if group == "out":
        return run.outputs or []
    if group == "inputs":
        return [t.detach() for t in run.inputs]
    return run.grads or []


def _gaps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| per element in float64: 0 where both are NaN or the same infinity, inf
    where only one is NaN."""
    x = x.detach().to(torch.float64)
    d = (x - ref).abs()
    d = torch.where((x == ref) | (x.isnan() & ref.isnan()), torch.zeros_like(d), d)
    return torch.where(d.isnan(), torch.full_like(d, float("inf")), d)


def _as_close_per_element(actual: torch.Tensor, expected: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether each element of ``actual`` is as close to the float64 ``ref`` as eager's
    is, within the table's tolerance of the float64 value: two roundings of one
    computation, element by element (a float32 gradient of a large attention: values
    up to 20, the largest errors 2e-5 and 4e-5 apart, the same distribution of errors;
    the whole-tensor criterion weighs those with the atol alone)."""
    rtol, atol = tolerance(expected.dtype)
    scale = ref.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    bound = _gaps(expected, ref) + atol + rtol * scale
    return bool((_gaps(actual, ref) <= bound).all())


def _accept(
    actual: torch.Tensor, expected: torch.Tensor, refs: _References, group: str, i: int
) -> str | None:
    """Which allowance accepts ``actual`` (a floating value beyond the table), or None."""
    flushed = refs.flushed()
    if flushed.error is None:
        values = _values(flushed, group)
        if i < len(values) and isinstance(values[i], torch.Tensor):
            if _close(actual, values[i]) is None:
                return SUBNORMAL
    ref = refs.float64()
    if ref.error is None:
        values = _values(ref, group)
        if i < len(values) and isinstance(values[i], torch.Tensor):
            r = values[i].detach().to(torch.float64)
            if r.shape == expected.shape:
                atol = max(tolerance(expected.dtype)[1], refs.weakest_atol())
                if distance(actual, r) <= distance(expected, r) + atol:
                    return FLOAT64
                if _as_close_per_element(actual, expected, r):
                    return FLOAT64
    if refs.amplified(grads=group == "grad"):
        return AMPLIFIED
    return None


def compare(
    actual: Run, expected: Run, refs: _References, call: int, *, requires_grad: bool = True
) -> tuple[Mismatch | None, list[str]]:
    """The first difference of a compiled run from eager's (None if none), and the
    allowances used on the way. ``requires_grad``: whether outputs' ``requires_grad``
    must be eager's (a JAX function's outputs carry no autograd history of their own)."""
    accepted: list[str] = []
    if expected.error is not None:
        etype = type(expected.error).__name__
        where = f"op {expected.error_op}" if expected.error_op is not None else expected.stage
        if actual.error is None:
            return Mismatch("raises", where, f"{etype}->nothing", str(expected.error), call), []
        if not isinstance(actual.error, type(expected.error)):
            ctype = type(actual.error).__name__
            return Mismatch(
                "raises", where, f"{etype}->{ctype}", error_text(actual.error), call
            ), []
        return None, []
    if actual.error is not None:
        text = error_text(actual.error)
        return Mismatch("crash", actual.stage, text.split(":")[0], text, call), []
    assert actual.outputs is not None and expected.outputs is not None
    if len(actual.outputs) != len(expected.outputs):
        detail = f"{len(actual.outputs)} outputs, eager {len(expected.outputs)}"
        return Mismatch("structure", "out", "", detail, call), []
    groups = [("out", actual.outputs, expected.outputs)]
    groups.append(("inputs", _values(actual, "inputs"), _values(expected, "inputs")))
    if (actual.grads is None) != (expected.grads is None):
        detail = f"gradients: {actual.grads is not None}, eager {expected.grads is not None}"
        return Mismatch("structure", "grad", "", detail, call), []
    if expected.grads is not None and actual.grads is not None:
        groups.append(("grad", actual.grads, expected.grads))
    for i, (a, e) in enumerate(zip(actual.outside or [], expected.outside or [], strict=False)):
        if a is not None and e is not None and not _bits_equal(a, e):
            detail = (
                f"its storage outside its view changed: {a.flatten()[:8]} where eager "
                f"left {e.flatten()[:8]}"
            )
            dtype = str(e.dtype).removeprefix("torch.")
            return Mismatch("inputs", f"storage[{i}]", dtype, detail, call), []
    for group, ours, theirs in groups:
        for i, (a, e) in enumerate(zip(ours, theirs, strict=True)):
            where = f"{group}[{i}]"
            if group == "grad" and (a is None or e is None):
                # aot_autograd returns zeros where eager returns None (README, Training)
                present = a if e is None else e
                if present is not None and not bool((present == 0).all()):
                    return Mismatch("grad", where, "", f"{a!r} != {e!r}", call), accepted
                continue
            if not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor):
                return Mismatch("structure", where, "", f"{type(a)} != {type(e)}", call), []
            dtype = str(e.dtype).removeprefix("torch.")
            if a.dtype != e.dtype:
                return Mismatch("dtype", where, dtype, f"{a.dtype} != {e.dtype}", call), []
            if a.shape != e.shape:
                return Mismatch("shape", where, dtype, f"{a.shape} != {e.shape}", call), []
            if requires_grad and group == "out" and a.requires_grad != e.requires_grad:
                detail = f"requires_grad {a.requires_grad} != {e.requires_grad}"
                return Mismatch("requires_grad", where, dtype, detail, call), []
            message = _close(a, e)
            if message is None:
                continue
            if e.is_floating_point():
                allowance = _accept(a, e, refs, group, i)
            else:
                allowance = NAN_BITS if _nan_bits_only(a, e) else None
            if allowance is None:
                kind = "value" if group == "out" else group
                return Mismatch(kind, where, dtype, message, call), accepted
            accepted.append(allowance)
    return None, accepted


_FLOAT_OF_BITS = {torch.int32: torch.float32, torch.int64: torch.float64}


def _nan_bits_only(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Integers that are floats' bits (``Tensor.view(torch.int32)``) and differ only
    where both are NaNs: in a NaN's sign and payload, which eager's own kernels set by
    an element's position (floor division of -inf: 0xffc00000 in the scalar tail of the
    loop, 0x7fffffff in its vectorized body)."""
    float_dtype = _FLOAT_OF_BITS.get(expected.dtype)
    if float_dtype is None or actual.dtype != expected.dtype:
        return False
    a = actual.detach().contiguous().view(float_dtype)
    e = expected.detach().contiguous().view(float_dtype)
    differ = actual != expected
    return bool(differ.any()) and bool((a.isnan() & e.isnan())[differ].all())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements, NaN where NaN (storage eager leaves alone must stay so)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _backend_instance(backend: Backend | str) -> Any:
    return backend if isinstance(backend, str) else backend()


def compiled(fn: Callable[..., Any], backend: Backend | str, instance: Any = None) -> Any:
    """``fn`` under test: ``torch.compile`` with the backend, or through
    ``dynajax.jax_function`` for ``"jax_function"`` (``fuzz/through_jax.py``)."""
    if backend == through_jax.BACKEND:
        return through_jax.via_jax_function(fn)
    if backend == through_jax.CONTROL:
        return through_jax.via_torch_export(fn)
    chosen = instance if instance is not None else _backend_instance(backend)
    if isinstance(fn, ModuleProgram):  # the model compiled, as users compile one
        return fn.with_target(lambda module: torch.compile(module, backend=chosen))
    return torch.compile(fn, backend=chosen)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One comparison of a program with eager (``run_check``).

    Attributes:
        status: ``ok``, ``raised`` (eager raised, dynajax raised the same type),
            ``fail``, or (through ``jax_function``) ``refused``: autograd refused an
            in-place write in eager (``autograd_refuses_the_write``).
        mismatch: the first difference, for ``fail``; eager's error, for ``refused``.
        accepted: the allowances some value needed (``subnormal``, ``float64``).
        aten_ops: ATen ops in the graphs the backend compiled (a dynajax backend).
        jax_ops: of those, the ops that ran in a JAX partition.
        fallbacks: ``target: reason`` of each op left to PyTorch.
        warnings: what dynajax logged at WARNING or above (a rule that raised where it
            should have refused, say): not failures, reported apart.
        measured: per choice the backend measured (``Report.cost_choices``: an op
            timed in PyTorch's kernel and in XLA at the first compile), ``op:where``,
            ``where`` ``pytorch`` or ``xla`` (``unmeasured`` when measuring failed
            and the default was taken).
    """

    status: str
    mismatch: Mismatch | None = None
    accepted: tuple[str, ...] = ()
    aten_ops: int = 0
    jax_ops: int = 0
    fallbacks: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    measured: tuple[str, ...] = ()


def run_check(program: Program, backend: Backend | str = dynajax_backend) -> Verdict:
    """Runs ``program`` eagerly and compiled with ``backend`` (a factory of backends, or
    a backend's name) on each call's inputs, and compares them."""
    torch._dynamo.reset()
    fn = to_function(program)
    accepted: list[str] = []
    raised = False
    instance = _backend_instance(backend)
    values_only = backend in (through_jax.BACKEND, through_jax.CONTROL)
    status, mismatch = OK, None
    collect = _Collect()
    try:
        with quiet(collect):
            under_test = compiled(fn, backend, instance)
            for call in CALLS:
                # A JAX function takes values, not storage: its reference is eager on
                # contiguous copies (as_strided past a view's elements has no JAX meaning).
                expected = execute(fn, program, call, contiguous=values_only)
                if values_only and autograd_refuses_the_write(expected.error):
                    status, mismatch = REFUSED, _raised(expected, call)
                    break
                actual = execute(under_test, program, call)
                refs = _References(program, fn, call, backend)
                mismatch, used = compare(
                    actual,
                    expected,
                    refs,
                    call,
                    requires_grad=backend not in (through_jax.BACKEND, through_jax.CONTROL),
                )
                accepted += used
                if mismatch is not None:
                    status = FAIL
                    break
                raised |= expected.error is not None
    finally:
        forget_function(fn)
        torch._dynamo.reset()
    if status == OK and raised:
        status = RAISED
    logged = tuple(dict.fromkeys(collect.messages))
    graphs = getattr(instance, "graphs", None)
    if not graphs:
        return Verdict(status, mismatch, tuple(sorted(set(accepted))), warnings=logged)
    report = dynajax.Report(graphs)
    fallbacks = tuple(f"{f.target}: {f.reason.name}" for f in report.fallbacks)
    measured = tuple(
        re.sub(r"aten\.|\.default", "", c.op)
        + (":pytorch" if c.in_pytorch else ":xla")
        + (":unmeasured" if isinstance(c, Unmeasured) else "")
        for c in report.cost_choices
    )
    return Verdict(
        status,
        mismatch,
        tuple(sorted(set(accepted))),
        report.aten_ops,
        report.jax_ops,
        fallbacks,
        logged,
        measured,
    )


def autograd_refuses_the_write(error: BaseException | None) -> bool:
    """Whether ``error`` is autograd's refusal of an in-place write: into a leaf tensor
    that requires grad (or a view of one), or into one of several views an op returned
    of a tensor that requires grad."""
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _AUTOGRAD_REFUSALS)


def _raised(run: Run, call: int) -> Mismatch:
    """What eager raised in ``run``, as a ``raises`` record (kept with a refusal)."""
    assert run.error is not None
    where = f"op {run.error_op}" if run.error_op is not None else run.stage
    return Mismatch("raises", where, type(run.error).__name__, str(run.error), call)


def _agree(a: Run, b: Run) -> bool:
    """Whether two eager runs agree within the table, with no allowance (an allowance
    explains two roundings, not one kernel reading other elements)."""
    if a.error is not None or b.error is not None:
        return type(a.error) is type(b.error)
    pairs = [
        *zip(a.outputs or [], b.outputs or [], strict=True),
        *zip(a.inputs, b.inputs, strict=True),
        *zip(a.grads or [], b.grads or [], strict=True),
    ]
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
    return all(_close(x, y) is None for x, y in pairs)


def _backward_broken(control: Mismatch, mismatch: Mismatch) -> bool:
    """Whether ``aot_eager`` raises in the backward of a program whose gradient dynajax
    gets wrong: then aot_autograd's own backward graph of it is broken, and dynajax
    compiles that graph. (An input mutated in place by a value that requires grad:
    ``aot_eager`` raises "modified by an inplace operation"; dynajax multiplies the
    mutated input's zero gradient by its old value, NaN where that is infinite; fuzz
    seeds 6 and 8.)"""
    return control.kind == "crash" and control.where == "backward" and mismatch.kind == "grad"


def eager_misreads_strides(program: Program, call: int, backend: Backend | str) -> bool:
    """Whether eager's answer to ``program`` (call ``call``) changes when its inputs
    come as contiguous copies of the same values, and dynajax's answer on the original
    inputs is eager's on the copies: a PyTorch kernel that misreads its input's strides
    (an answer cannot depend on strides), not a dynajax bug."""
    if all(spec.layout == CONTIGUOUS for spec in program.inputs):
        return False
    torch._dynamo.reset()
    fn = to_function(program)
    try:
        with quiet():
            strided = execute(fn, program, call)
            dense = execute(fn, program, call, contiguous=True)
            compiled_run = execute(compiled(fn, backend), program, call)
            if dense.error is not None or _agree(strided, dense):
                return False
            refs = _References(program, fn, call, backend)
            return compare(compiled_run, dense, refs, call)[0] is None
    finally:
        forget_function(fn)
        torch._dynamo.reset()


def eager_reads_uninitialized_memory(program: Program, call: int) -> bool:
    """Whether eager's answer to ``program`` (call ``call``) changes when PyTorch fills
    the memory it allocates before its kernels write it: a kernel that reads memory it
    never wrote (``F.pad(x, (-1, 1), "circular")`` of a width-1 ``x`` crops it to
    nothing and then copies from the empty crop), whose answer is undefined."""
    fn = to_function(program)
    try:
        with quiet():
            plain = execute(fn, program, call)
            filled = execute(fn, program, call, fill_uninitialized=True)
        return plain.error is None and filled.error is None and not _agree(plain, filled)
    finally:
        forget_function(fn)


def prefix(program: Program, n: int) -> Program:
    """The first ``n`` ops of ``program``, returning every value they define (and
    comparing gradients of all of them), so that any difference in them shows."""
    ops = program.ops[:n]
    outputs = tuple(r.out for r in ops if r.out is not None) or program.outputs[:1]
    return program.replace(ops=ops, outputs=outputs)


def culprit(program: Program, mismatch: Mismatch, backend: Backend | str) -> str:
    """The op to blame for ``mismatch``: the last op of the shortest prefix of the
    program that fails the same way (binary search), or ``?``. A prefix returns every
    value it defines, so "the same way" is the same kind of difference (a wrong float
    may show before the boolean computed from it), and for exceptions the same types
    and message."""
    if mismatch.kind == "raises":
        op = re.fullmatch(r"op (\d+)", mismatch.where)
        if op is not None and int(op.group(1)) < len(program.ops):
            return program.ops[int(op.group(1))].kind
        return "?"

    def fails(n: int) -> bool:
        try:
            m = run_check(prefix(program, n), backend).mismatch
        except Exception:  # a prefix the generator never ran; no verdict
            return False
        if m is None or m.kind != mismatch.kind:
            return False
        return m.key == mismatch.key or mismatch.kind not in ("raises", "crash")

    lo, hi = 1, len(program.ops)
    if hi == 0 or not fails(hi):
        return "?"
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return program.ops[lo - 1].kind


def signature(program: Program, mismatch: Mismatch, backend: Backend | str) -> str:
    """``kind:op:detail`` of a failure: what known bugs and de-duplication key on."""
    detail = mismatch.dtype
    if mismatch.kind == "crash":
        detail = f"{mismatch.dtype}:{_normalize(mismatch.detail)[:60]}"
    return f"{mismatch.kind}:{culprit(program, mismatch, backend)}:{detail}"


def check(
    program: Program,
    backend: Backend | str = dynajax_backend,
    *,
    classify: bool = True,
) -> Outcome:
    """The verdict on ``program`` (``Outcome``). With ``classify``, a failure is also
    run under ``aot_eager`` (``upstream`` when it fails the same way there) and given
    its signature (which runs prefixes of the program); the shrinker skips both."""
    verdict = run_check(program, backend)
    mismatch = verdict.mismatch
    if verdict.status == REFUSED:
        return Outcome(REFUSED, mismatch, verdict.accepted, verdict=verdict)
    if (
        backend == through_jax.BACKEND
        and mismatch is not None
        and mismatch.kind in ("crash", "raises")
        and (_REFUSAL in mismatch.detail or any(e in mismatch.detail for e in _DATA_DEPENDENT))
    ):
        # jax_function refuses the program as documented when it is built, before any
        # op runs: so also where eager raises at a later op (seed 102, program 12).
        return Outcome(REFUSED, mismatch, verdict.accepted, verdict=verdict)
    if verdict.status != FAIL or mismatch is None or not classify:
        return Outcome(verdict.status, mismatch, verdict.accepted, verdict=verdict)
    status = FAIL
    try:
        control_backend = through_jax.CONTROL if backend == through_jax.BACKEND else "aot_eager"
        control = run_check(program, control_backend).mismatch
    except Exception:
        control = None
    if control is not None and (control.kind, control.dtype) == (mismatch.kind, mismatch.dtype):
        status = UPSTREAM  # the same kind, dtype or exception types; messages may differ
    elif control is not None and _backward_broken(control, mismatch):
        status = UPSTREAM
    elif mismatch.kind in ("value", "inputs", "grad") and (
        eager_misreads_strides(program, mismatch.call, backend)
        or eager_reads_uninitialized_memory(program, mismatch.call)
    ):
        status = UPSTREAM
    sig = signature(program, mismatch, backend)
    return Outcome(status, mismatch, verdict.accepted, sig, verdict)


def fails_like(
    mismatch: Mismatch, backend: Backend | str = dynajax_backend
) -> Callable[[Program], bool]:
    """The shrinker's predicate: a candidate fails with ``mismatch``'s key (the same
    kind of difference, dtype and, for exceptions, types and message)."""

    def fails(candidate: Program) -> bool:
        try:
            outcome = check(candidate, backend, classify=False)
        except Exception:  # the checker itself failed on an odd candidate: not the same
            return False
        return outcome.mismatch is not None and outcome.mismatch.key == mismatch.key

    return fails

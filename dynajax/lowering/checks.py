"""Value checks inside the XLA program: eager's errors on argument values.

Eager PyTorch raises where an argument's *values* are invalid (an index past the end,
an integer division by zero, a negative probability); XLA clamps, fills or defines
those cases, so without a check the compiled program returns numbers where eager
raises. A rule states eager's check while it is traced:

    checks.fail_if(index >= n, IndexError, "index {value} is out of bounds", value=index)

``condition`` is a boolean JAX array (any true element is a failure); the message is a
``str.format`` template of the named payload values (an array shaped like the
condition contributes its element at the first failing position, in row-major order;
a scalar contributes itself). Checks are recorded by the ``Collector`` that
``to_jax_function`` activates while it traces a partition with checks on. The traced
function then returns one extra output: an int64 vector ``[code, *payload]``, code 0
when every check passed, else ``k`` for the k-th check (in graph order) that failed
first, computed inside the XLA program. ``CompiledPartition`` reads that vector on the
host after each call and raises eager's exception before handing any output back
(``CheckTable.raise_if_failed``). ``dynajax.jax_function`` activates one for
``fn.checked`` and direct calls of ``fn``, and returns the vector as a
``ValueCheckResult`` (``interop/checked.py``). Without an active collector (abstract
evaluation, a traced ``fn``, checks turned off, the padding proof) ``fail_if`` does
nothing and rules skip computing their conditions (``checking()``).

Bounds checks of indices go through ``fail_if_out_of_bounds``, so that ops which
PyTorch's decompositions turn into a checked op (``take`` into ``index``,
``index_copy`` into ``index_put``, ``nll_loss_forward`` into ``gather``) raise eager's
own error for the op the user called: the interpreter tells the collector each node's
``original_aten`` and ``ORIGINS`` maps it to eager's error and index range.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Check:
    """One value check of a traced partition: eager's exception for a failure.

    Attributes:
        error: eager's exception type.
        message: eager's message, a ``str.format`` template of ``fields``.
        fields: the payload names, in the order of the payload vector.
        floats: the payload names that hold float64 values (bit-cast to int64).
        op: the ATen overload whose rule recorded the check (for the error's note).
    """

    error: type[Exception]
    message: str
    fields: tuple[str, ...] = ()
    floats: frozenset[str] = frozenset()
    op: str = ""

    def exception(self, payload: Sequence[int], where: str = "", how: str = "") -> Exception:
        """Eager's exception, its message formatted with the failing ``payload``; with
        ``where``, a note that dynajax raised it from the check computed there (``how``:
        how to turn the checks off)."""
        values: dict[str, Any] = {}
        for name, raw in zip(self.fields, payload, strict=False):
            if name in self.floats:
                values[name] = _cxx_double(float(np.int64(raw).view(np.float64)))
            else:
                values[name] = int(raw)
        exc = self.error(self.message.format(**values))
        add_note = getattr(exc, "add_note", None)  # Python 3.11 on
        if where and add_note is not None:
            add_note(
                f"dynajax: raised by the value check of {self.op} in {where} (eager's "
                f"check, computed in the program; {how})"
            )
        return exc


def _cxx_double(v: float) -> str:
    """``v`` as C++'s ``ostream << double`` prints it (``%g``; NaN keeps its sign)."""
    if math.isnan(v):
        return "-nan" if math.copysign(1.0, v) < 0 else "nan"
    return format(v, "g")


@dataclasses.dataclass(frozen=True)
class Origin:
    """How eager reports an out-of-bounds index of an op that PyTorch decomposes.

    Attributes:
        error: eager's exception type.
        message: eager's message; fields ``value``, ``size`` and those the checking
            rule passes (``dim``, ``axis``).
        negative: whether eager's kernel accepts indices in ``[-size, 0)``.
        empty_dim: eager's error, whatever the index values, when the indexed dim has
            size 0, the index is not empty and the other dims are not (``index_fill``'s
            kernel views self with the index's size along that dim, and the view's
            storage check fails); other tensors with no elements are then unchecked.
    """

    error: type[Exception]
    message: str
    negative: bool
    empty_dim: Origin | None = None


_TARGET_OUT_OF_BOUNDS = Origin(IndexError, "Target {value} is out of bounds.", False)
_INDEX_FILL = Origin(
    IndexError,
    "index {value} is out of bounds for dimension {axis} with size {size}",
    True,
    empty_dim=Origin(
        RuntimeError,
        "setStorage: sizes {sizes}, strides {strides}, storage offset 0, and itemsize "
        "{itemsize} requiring a storage size of {required} are out of bounds for storage "
        "of size 0",
        False,
    ),
)

# original_aten of a node -> eager's error for an index out of bounds in that node
# (None: eager's kernel checks nothing there, and the decomposition keeps indices in
# range). Looked up by fail_if_out_of_bounds only, by the overload's name (a graph's
# meta may hold a copy of the OpOverload); see tests/lowering/value_checks.txt.
_ORIGINS: dict[Any, Origin | None] = {
    aten.take.default: Origin(
        IndexError,
        "out of range: tried to access index {value} on a tensor of {size} elements.",
        True,
    ),
    aten.index_copy.default: Origin(
        IndexError,
        "index_copy_(): index {value} is out of bounds for dimension {axis} with size {size}",
        False,
    ),
    aten.index_fill.int_Scalar: _INDEX_FILL,
    aten.index_fill.int_Tensor: _INDEX_FILL,
    aten.nll_loss_forward.default: _TARGET_OUT_OF_BOUNDS,
    aten.nll_loss2d_forward.default: _TARGET_OUT_OF_BOUNDS,
    aten.nll_loss_backward.default: _TARGET_OUT_OF_BOUNDS,
    aten.nll_loss2d_backward.default: _TARGET_OUT_OF_BOUNDS,
    # The decomposition clamps the indices; eager's kernel checks nothing.
    aten.embedding_dense_backward.default: None,
}
ORIGINS: dict[str, Origin | None] = {str(op): origin for op, origin in _ORIGINS.items()}


class Collector:
    """The checks recorded while one partition is traced, in graph order."""

    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.failed: list[jax.Array] = []  # per check, whether it failed
        self.payloads: list[list[jax.Array]] = []  # per check, its message's values
        self.origin = ""  # the current node's original_aten, by name (set by the interpreter)
        self.op: str = ""  # the current node's target

    def add(self, check: Check, failed: jax.Array, payload: list[jax.Array]) -> None:
        self.checks.append(check)
        self.failed.append(failed)
        self.payloads.append(payload)

    def any_failed(self) -> jax.Array:
        """Whether some check recorded so far failed (a traced bool), computed once:
        as the count of failed checks by a product, which XLA computes once and passes
        to the fusions that read it. An OR of the flags (or ``any`` of them, which XLA
        rewrites into one) is cheap enough that XLA recomputes it inside every fusion
        that reads it: in GPT-2 small's step, each of ~900 fusions of the update
        (48.7k instructions against 37.4k, its executable 191 MiB against 156)."""
        if not self.failed:
            return jnp.zeros((), bool)
        flags = jnp.stack(self.failed).astype(jnp.float32)
        return jnp.dot(flags, jnp.ones_like(flags)) > 0

    def result(self) -> jax.Array:
        """The int64 vector ``[code, *payload]`` of the first failing check (code 0:
        none failed; the payload of a passing program is zeros)."""
        width = max((len(p) for p in self.payloads), default=0)
        code = jnp.zeros((), np.int64)
        values = jnp.zeros((width,), np.int64)
        for k in reversed(range(len(self.checks))):
            failed = self.failed[k]
            payload = self.payloads[k] + [jnp.zeros((), np.int64)] * (width - len(self.payloads[k]))
            code = jnp.where(failed, np.int64(k + 1), code)
            if width:
                values = jnp.where(failed, jnp.stack(payload), values)
        return jnp.concatenate([code[None], values])


_ACTIVE: contextvars.ContextVar[Collector | None] = contextvars.ContextVar(
    "dynajax_value_checks", default=None
)
_SUSPENDED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dynajax_value_checks_suspended", default=False
)


def checking() -> bool:
    """Whether a collector records checks now (rules skip building conditions if not)."""
    return _ACTIVE.get() is not None


def active() -> Collector | None:
    """The collector that records checks now, if any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def collecting(like: Collector | None = None) -> Iterator[Collector]:
    """Records the checks of the rules traced inside the block (naming the node that
    ``like`` is at, for a rule traced apart from its partition)."""
    collector = Collector()
    if like is not None:
        collector.op, collector.origin = like.op, like.origin
    token = _ACTIVE.set(collector)
    try:
        yield collector
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Traces inside the block record no checks and return no check output.

    For traces that study the program rather than run it (the padding proof of
    ``runtime/buckets.py``), where the extra output would be noise.
    """
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


def is_suspended() -> bool:
    """Whether ``suspended()`` is in effect."""
    return _SUSPENDED.get()


def set_node(target: Any, origin: Any) -> None:
    """Tells the active collector which node is traced next (its op, its original_aten)."""
    collector = _ACTIVE.get()
    if collector is not None:
        collector.op = str(target)
        collector.origin = "" if origin is None else str(origin)


def fail_if(condition: Any, error: type[Exception], message: str, /, **payload: Any) -> None:
    """Records eager's check: the program raises ``error`` where ``condition`` holds.

    Args:
        condition: a boolean JAX array (or Python bool); any true element fails.
        error: eager's exception type.
        message: eager's message, a ``str.format`` template of ``payload``'s names.
        **payload: integer or floating values for the message: arrays broadcastable
            to ``condition`` (the element at the first failing position is reported)
            or scalars. They travel in an int64 vector, floats bit-cast.
    """
    collector = _ACTIVE.get()
    if collector is None:
        return
    cond = jnp.asarray(condition, dtype=bool)
    flat = cond.reshape(-1)
    if flat.size == 0:
        failed = jnp.zeros((), bool)
        pos = jnp.zeros((), np.int64)
    elif any(jnp.ndim(v) > 0 for v in payload.values()):
        # The first failing position as one min-reduction (XLA's CPU argmax, a
        # two-operand reduction, took twice as long over 1M elements).
        n = flat.size
        first = jnp.min(
            jnp.where(flat, jnp.arange(n, dtype=np.int32 if n < 2**31 else np.int64), n)
        )
        failed = first < n
        pos = jnp.minimum(first, n - 1)
    else:
        # Any element: a max over bytes (faster than XLA's CPU reduction over booleans).
        pos = jnp.zeros((), np.int64)
        failed = jnp.max(flat.astype(np.uint8)) > 0
    values, floats = [], set()
    for name, v in payload.items():
        v = jnp.asarray(v)
        if v.ndim > 0:
            v = (
                jnp.broadcast_to(v, cond.shape).reshape(-1)[pos]
                if flat.size
                else jnp.zeros((), v.dtype)
            )
        if jnp.issubdtype(v.dtype, jnp.inexact):
            floats.add(name)
            v = jax.lax.bitcast_convert_type(v.astype(np.float64), np.int64)
        else:
            v = v.astype(np.int64)
        values.append(v)
    check = Check(error, message, tuple(payload), frozenset(floats), collector.op)
    collector.add(check, failed, values)


def out_of_bounds(index: Any, size: Any, *, negative: bool) -> jax.Array:
    """Where ``index`` is outside ``[-size, size)`` (``negative``) or ``[0, size)``."""
    low = -size if negative else 0
    return (index < low) | (index >= size)


def for_another_op() -> bool:
    """Whether the current node's checks report the errors of another op, the one a
    decomposition came from (``ORIGINS``), not its own."""
    collector = _ACTIVE.get()
    return collector is not None and collector.origin in ORIGINS


def fail_if_out_of_bounds(
    index: Any,
    size: Any,
    error: type[Exception],
    message: str,
    /,
    *,
    negative: bool,
    shape: tuple[int, ...] | None = None,
    itemsize: int | None = None,
    **payload: Any,
) -> None:
    """``fail_if`` for indices outside their range, reported as eager reports them.

    The current node's ``original_aten`` may name an op that eager checks with
    another error, message or range (``ORIGINS``); that one is used instead.

    Args:
        index: the indices (a JAX integer array).
        size: the size they index (an int, or an array broadcastable to ``index``).
        error, message: eager's error for the op itself; the template sees ``value``
            (the failing index), ``size`` and the names of ``payload``.
        negative: whether the op accepts indices in ``[-size, 0)`` (Python wraps).
        shape: the indexed tensor's shape, for origins whose check depends on it
            (``Origin.empty_dim``).
        itemsize: the indexed tensor's element size in bytes (``Origin.empty_dim``).
        **payload: more message fields (``dim``, ``axis``).
    """
    collector = _ACTIVE.get()
    if collector is None:
        return
    if collector.origin in ORIGINS:
        origin = ORIGINS[collector.origin]
        if origin is None:
            return
        if shape is not None and origin.empty_dim is not None and math.prod(shape) == 0:
            axis = int(np.asarray(payload["axis"]).reshape(-1)[0])
            rest = math.prod(n for d, n in enumerate(shape) if d != axis)
            if shape[axis] == 0 and jnp.size(index) > 0 and rest > 0 and itemsize:
                empty = origin.empty_dim
                message = _restrided(empty.message, shape, axis, jnp.size(index), itemsize)
                fail_if(True, empty.error, message)
            return
        error, message, negative = origin.error, origin.message, origin.negative
    fail_if(
        out_of_bounds(index, size, negative=negative),
        error,
        message,
        value=index,
        size=size,
        **payload,
    )


def _restrided(template: str, shape: tuple[int, ...], axis: int, k: int, itemsize: int) -> str:
    """``Origin.empty_dim``'s message: eager's storage check of a contiguous ``shape``
    viewed with size ``k`` and stride 0 along ``axis`` (a size-0 dim strides as size 1)."""
    strides = [math.prod(max(n, 1) for n in shape[d + 1 :]) for d in range(len(shape))]
    sizes = [k if d == axis else n for d, n in enumerate(shape)]
    strides[axis] = 0
    required = itemsize * (1 + sum((n - 1) * st for n, st in zip(sizes, strides, strict=True)))
    text = template.format(sizes=sizes, strides=strides, itemsize=itemsize, required=required)
    return text.replace("{", "{{").replace("}", "}}")


class CheckTable:
    """The checks of one partition's function, as its traces record them.

    Every trace of one graph records the same list (rules record their checks
    whatever the shapes), so one table serves every executable of the partition.

    Attributes:
        checks: None before the first trace; then the checks, in graph order (empty:
            the function returns no check output).
    """

    def __init__(self) -> None:
        self.checks: tuple[Check, ...] | None = None

    def record(self, checks: Sequence[Check]) -> None:
        """Keeps the checks of a trace; they must equal every earlier trace's."""
        found = tuple(checks)
        if self.checks is None:
            self.checks = found
        elif found != self.checks:
            raise AssertionError(
                "dynajax bug: two traces of one partition recorded different value checks "
                f"({[c.op for c in self.checks]} and {[c.op for c in found]}); a rule "
                "records a check only for some shapes"
            )

    @staticmethod
    def failed(result: Any) -> bool:
        """Whether the check output ``result`` reports a failed check."""
        return failed(result)

    def raise_if_failed(self, result: Any, where: str = "") -> None:
        """Raises eager's exception if ``result`` (the check output) reports a failure.

        Args:
            result: the int64 vector ``[code, *payload]`` (a JAX array or NumPy array).
            where: the partition's name, for the exception's note.
        """
        if not failed(result):
            return
        assert self.checks is not None
        where = f"JAX partition {where or '?'}"
        found = error(self.checks, result, where, "the option checks=False turns value checks off")
        assert found is not None
        raise found


# -- decoding a check output on the host (every caller: the backend's partitions, the
# whole-graph program's callers, ``ValueCheckResult``) ---------------------------------


def failed(result: Any) -> bool:
    """Whether the check output ``result`` (``[..., code, *payload]``: one vector, or
    one per element of leading ``vmap``/``scan`` axes) reports a failed check."""
    vector = np.asarray(result)  # (fails on a tracer: read it outside transformations)
    if vector.ndim == 1:  # (every call of the backend's partitions: the cheap test)
        return int(vector[0]) != 0
    return bool(np.any(vector[..., 0]))


def error(checks: Sequence[Check], result: Any, where: str, how: str) -> Exception | None:
    """Eager's exception for the first failing check of ``result`` (the check output of
    a function whose trace recorded ``checks``; with leading axes, the first failing
    element in row-major order), or None when every check passed.

    Args:
        where: what ran (the exception's note), ``how``: what the user can do.
    """
    vector = np.asarray(result)
    rows = vector.reshape(-1, vector.shape[-1])
    failing = np.flatnonzero(rows[:, 0])
    if failing.size == 0:
        return None
    row = rows[failing[0]]
    check = checks[int(row[0]) - 1]
    batch = vector.shape[:-1]
    if batch:
        at = tuple(int(i) for i in np.unravel_index(failing[0], batch))
        where += f" at index {at} of the leading (vmap/scan) axes {tuple(batch)}"
    return check.exception(_payload(check, row[1:]), where, how)


def _payload(check: Check, raw: np.ndarray) -> list[int]:
    """The payload as ``Check.exception`` reads it: int64 values, floats as the bits of
    a float64. With JAX's 64-bit mode off the vector is int32 and floats are the bits
    of a float32, widened here."""
    if raw.dtype.itemsize == 8:
        return [int(v) for v in raw]
    values = []
    for name, v in zip(check.fields, raw, strict=False):
        if name in check.floats:
            wide = np.float64(np.int32(v).view(np.float32))
            values.append(int(wide.view(np.int64)))
        else:
            values.append(int(v))
    return values


class CheckedFunction:
    """A partition's JAX function that returns the check output last, and its table.

    Attributes:
        fn: the function, ``fn([seed,] *arrays)``.
        table: the checks its traces record (``CheckTable``).
    """

    def __init__(self, fn: Any, table: CheckTable) -> None:
        self.fn = fn
        self.table = table
        self.__name__ = getattr(fn, "__name__", "checked")

    def __call__(self, *arrays: Any) -> Any:
        return self.fn(*arrays)

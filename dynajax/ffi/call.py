"""Which calls PyTorch's kernel can run inside an XLA program, and the call itself.

``kernel_refusal`` says why an op's call cannot run there (None: it can): the op must be
an operator whose CPU kernel is C++ (aten's, or a user's C++ custom op: a kernel written
in Python would need the GIL, which XLA's thread does not hold), functional (it writes
none of its arguments), not random (its draws would not follow dynajax's keys), with
tensor results of static shapes and dtypes both PyTorch and JAX have, on the CPU, and
arguments the call's description can say.

``call_kernel`` writes the call into the trace as ``jax.ffi.ffi_call`` of the handler
(``torch_op.cc``): the JAX values among the arguments become its operands, the rest
its description. Where the op has an ``out=`` overload, the handler calls it with XLA's
result buffers as the outputs; otherwise it copies the results into them.

The handler's errors reach Python as XLA's ``JaxRuntimeError``; ``eager_error`` gives
back the exception eager PyTorch raised (its type and message), which the drivers
re-raise (``program/callbacks.eager_errors``, ``runtime/compiled.py``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import torch

from dynajax.errors import DynajaxError
from dynajax.ffi.extension import TARGET, available, unavailable_reason
from dynajax.lowering.dtypes import to_torch_dtype

# c10::ScalarType's codes (its enumeration is part of PyTorch's C++ ABI).
SCALAR_TYPE = {
    torch.uint8: 0,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float16: 5,
    torch.float32: 6,
    torch.float64: 7,
    torch.complex64: 9,
    torch.complex128: 10,
    torch.bool: 11,
    torch.bfloat16: 15,
}
_LAYOUT = {torch.strided: 0}
_MEMORY_FORMAT = {
    torch.contiguous_format: 0,
    torch.preserve_format: 1,
    torch.channels_last: 2,
    torch.channels_last_3d: 3,
}
# Ops whose result depends on their input's storage, not only its values: eager's
# as_strided of a view reads memory beyond it, which XLA's buffer does not hold.
_READS_STORAGE = frozenset(
    {"as_strided", "as_strided_copy", "as_strided_scatter", "_reshape_alias", "set_"}
)
# The dispatch keys whose kernel eager's CPU call would run (the first one registered).
_CPU_KEYS = (
    "CPU",
    "CompositeExplicitAutogradNonFunctional[alias]",
    "CompositeExplicitAutograd[alias]",
    "CompositeImplicitAutograd[alias]",
)


class NotEncodable(Exception):
    """An argument the call's description cannot say."""


class Strided(NamedTuple):
    """A tensor argument given as the array it is a view of, and the view (sizes,
    strides and offset in elements, as eager's view of the same storage): the handler
    takes the view of its tensor over ``base`` (``as_strided``). A transpose, a slice,
    an ``unbind`` that PyTorch's views make free then cost XLA no copy either."""

    base: Any
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


def _python_kernel(op: torch._ops.OpOverload) -> str | None:
    """Where the kernel eager's CPU call runs is registered, if in a Python file."""
    lines = torch._C._dispatch_dump(op.name())
    kernels = dict(
        line.split(": registered at ", 1)
        for line in lines.splitlines()
        if ": registered at " in line
    )
    for key in _CPU_KEYS:
        if key in kernels:
            where = kernels[key].split(" ::", 1)[0]
            return where if re.search(r"\.py:\d+$", where.strip()) else None
    return "no CPU kernel"


@functools.cache
def _op_refusal(op: torch._ops.OpOverload) -> str | None:
    schema = op._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it writes its arguments in place"
    if schema.name.split("::")[-1] in _READS_STORAGE:
        return "it reads its input's storage, which the kernel's view of XLA's buffer is not"
    if any("Generator" in str(a.type) for a in schema.arguments):
        return _RANDOM
    for r in schema.returns:
        if str(r.type) not in ("Tensor", "List[Tensor]", "Optional[Tensor]"):
            return f"it returns {r.type}, not tensors"
    python = _python_kernel(op)
    if python == "no CPU kernel":
        return "it has no CPU kernel"
    if python is not None:
        return f"its kernel is Python ({python}), which needs the GIL XLA's thread lacks"
    return None


@functools.cache
def _out_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The op's ``out=`` overload (same arguments, then the out tensor), for an op of one
    result, if it has one with a C++ kernel."""
    schema = op._schema
    # One result: an op of several may leave one undefined (a workspace it did not
    # need), which its out= overload then refuses to copy into XLA's buffer.
    if [str(r.type) for r in schema.returns] != ["Tensor"]:
        return None
    packet = getattr(getattr(torch.ops, op.namespace), schema.name.split("::")[-1])
    inputs = [(a.name, str(a.type)) for a in schema.arguments]
    for name in packet.overloads():
        other = getattr(packet, name)
        args = other._schema.arguments
        outs = [a for a in args if a.is_out]
        if (
            len(outs) == len(schema.returns)
            and [(a.name, str(a.type)) for a in args if not a.is_out] == inputs
            and _python_kernel(other) is None
        ):
            return other
    return None


_RANDOM = "it draws random numbers, which would not follow dynajax's keys"


def _draws(op: torch._ops.OpOverload, values: dict[str, Any]) -> bool:
    """Whether this call of an op tagged random draws: not an attention or dropout
    called with probability 0 or outside training (the fused CPU attention is tagged
    for its dropout)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    p = values.get("dropout_p", values.get("p"))
    return not (values.get("train") is False or (isinstance(p, int | float) and p == 0))


def _token(value: Any, jit_type: Any, operand: Callable[[Any], int | None]) -> str:
    """One argument in the description's syntax (``torch_op.cc``), typed by the schema."""
    kind = jit_type.kind()
    if kind == "OptionalType":
        return "N" if value is None else _token(value, jit_type.getElementType(), operand)
    if kind == "ListType":
        if not isinstance(value, list | tuple):
            raise NotEncodable(f"{value!r} where the schema takes {jit_type}")
        element = jit_type.getElementType()
        return "[" + ",".join(_token(v, element, operand) for v in value) + "]"
    if value is None:
        return "N"
    if isinstance(value, Strided):
        index = operand(value.base)
        if index is None:
            raise NotEncodable("a view whose base is not an array")
        sizes, strides = (".".join(map(str, v)) for v in (value.sizes, value.strides))
        return f"S{index}:{sizes}:{strides}:{value.offset}"
    index = operand(value)
    if index is not None:
        return f"T{index}"
    if kind == "TensorType":
        raise NotEncodable(f"{type(value).__name__} where the schema takes a tensor")
    if isinstance(value, bool):
        return "b1" if value else "b0"
    if isinstance(value, torch.dtype) and value in SCALAR_TYPE:
        return f"i{SCALAR_TYPE[value]}"
    if isinstance(value, torch.layout) and value in _LAYOUT:
        return f"i{_LAYOUT[value]}"
    if isinstance(value, torch.memory_format) and value in _MEMORY_FORMAT:
        return f"i{_MEMORY_FORMAT[value]}"
    if isinstance(value, torch.device) or (kind == "DeviceObjType" and isinstance(value, str)):
        return f"D{len(str(value))}:{value}"
    if isinstance(value, int | torch.SymInt):
        number = int(value) if isinstance(value, int) else 0  # (a refusal's check only)
        return f"f{float(number)!r}" if kind == "FloatType" else f"i{number}"
    if isinstance(value, float):
        return f"f{value!r}"
    if isinstance(value, complex):
        return f"c{value.real!r},{value.imag!r}"
    if isinstance(value, str):
        return f"s{len(value)}:{value}"
    raise NotEncodable(f"{type(value).__name__} argument {value!r}")


def _arguments(
    op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Each schema argument's value by name (defaults filled in)."""
    values = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            values[a.name] = args[i]
        elif a.name in kwargs:
            values[a.name] = kwargs[a.name]
        elif a.has_default_value():
            values[a.name] = a.default_value
        else:
            raise NotEncodable(f"no value for its argument '{a.name}'")
    return values


def _describe(
    op: torch._ops.OpOverload,
    values: dict[str, Any],
    is_tensor: Callable[[Any], bool],
    out: bool,
) -> tuple[torch._ops.OpOverload, str, list[Any]]:
    """The overload to call, the description of its arguments (``values``, by name),
    and the tensors among them (the call's operands) in order."""
    target = _out_overload(op) if out else None
    target = target or op
    operands: list[Any] = []

    def operand(value: Any) -> int | None:
        if not is_tensor(value):
            return None
        operands.append(value)
        return len(operands) - 1

    tokens = []
    results = 0
    for a in target._schema.arguments:
        if a.is_out:
            tokens.append(f"R{results}")
            results += 1
        else:
            tokens.append(_token(values[a.name], a.type, operand))
    return target, ";".join(tokens), operands


def flat_outputs(value: Any) -> list[Any]:
    """The leaves of a node's output (a tensor, or nested tuples/lists of them), with
    Nones (outputs an op was asked not to compute) left out; the order of
    ``rebuild_outputs`` and of a kernel's results."""
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in flat_outputs(v)]
    return [] if value is None else [value]


def rebuild_outputs(structure: Any, leaves: Any) -> Any:
    """``structure`` (a node's fake output) with its tensors replaced by ``leaves``
    (an iterator, in ``flat_outputs`` order)."""
    if isinstance(structure, list | tuple):
        return type(structure)(rebuild_outputs(v, leaves) for v in structure)
    return None if structure is None else next(leaves)


def kernel_refusal(
    op: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, *, static: bool = True
) -> str | None:
    """Why PyTorch's kernel cannot run this call (``args``/``kwargs`` with fake tensors,
    ``out`` its fake result) inside an XLA program; None where it can. With ``static``,
    a symbolic result shape refuses (the backend's partitions take the fake shapes; the
    whole-graph driver resolves them against the traced shapes). Asks for the extension
    (building it on the first call) last, only for a call it could run."""
    if not isinstance(op, torch._ops.OpOverload):
        return "not an operator"
    refusal = _op_refusal(op)
    if refusal is not None:
        return refusal
    tensors = flat_outputs(out)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "a result is not a tensor"
    try:
        values = _arguments(op, args, kwargs)
        if _draws(op, values):
            return _RANDOM
        _, _, inputs = _describe(op, values, lambda v: isinstance(v, torch.Tensor), False)
    except NotEncodable as e:
        return f"an argument the call cannot pass: {e}"
    for t in [*tensors, *inputs]:
        if t.device.type != "cpu":
            return f"a tensor on {t.device} (the handler runs CPU kernels)"
        if t.dtype not in SCALAR_TYPE:
            return f"a {t.dtype} tensor"
    for t in tensors if static else []:
        if not all(isinstance(s, int) for s in t.shape):
            return f"its result's shape {tuple(t.shape)} is symbolic"
    if not available():
        return f"the extension is unavailable: {unavailable_reason()}"
    return None


def call_kernel(
    op: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    avals: Sequence[jax.ShapeDtypeStruct],
    result_dtypes: Sequence[torch.dtype],
    operand_dtypes: Callable[[Sequence[Any]], Sequence[torch.dtype | None]] | None = None,
) -> tuple[Any, ...]:
    """``op(*args, **kwargs)`` by PyTorch's kernel, inside the program being traced.

    Args:
        op: the operator (``kernel_refusal`` said None for it).
        args, kwargs: its arguments, JAX values where it takes tensors.
        avals: each result's shape and dtype as the program holds it.
        result_dtypes: each result's torch dtype (an int64 result is int32 in JAX
            without 64-bit mode; the handler converts).
        operand_dtypes: given the operands, the torch dtype the op takes for each
            (None: the operand's own).

    Returns:
        The flat results, one JAX value per aval.
    """
    if not available():  # (registers the handler with JAX where this process has not yet)
        raise DynajaxError(
            f"PyTorch's kernel for {op} cannot run inside XLA: {unavailable_reason()}"
        )
    # The out= overload writes XLA's buffers where each result has one, of its dtype
    # (not where the op was asked to leave a result uncomputed, a None).
    exact = len(avals) == len(op._schema.returns) and all(
        SCALAR_TYPE[d] == SCALAR_TYPE.get(to_torch_dtype(jax.dtypes.canonicalize_dtype(a.dtype)))
        for a, d in zip(avals, result_dtypes, strict=True)
    )
    target, text, operands = _describe(op, _arguments(op, args, kwargs), _is_jax, exact)
    wanted = list(operand_dtypes(operands)) if operand_dtypes is not None else []
    wanted += [None] * (len(operands) - len(wanted))
    codes = [
        SCALAR_TYPE[d if d is not None else to_torch_dtype(x.dtype)]
        for x, d in zip(operands, wanted, strict=True)
    ]
    description = "|".join(
        [",".join(map(str, codes)), ",".join(str(SCALAR_TYPE[d]) for d in result_dtypes), text]
    )
    overload = target._overloadname
    call = jax.ffi.ffi_call(TARGET, tuple(avals), vmap_method="sequential")
    outs = call(
        *operands,
        op=target._schema.name,
        overload="" if overload == "default" else overload,
        call=description,
    )
    return tuple(outs)


def _is_jax(value: Any) -> bool:
    return isinstance(value, jax.Array | np.ndarray)


_ERROR = re.compile(r"dynajax-torch-error\[(\w+)\]: (.*)", re.S)
_TYPES: dict[str, type[BaseException]] = {
    "RuntimeError": RuntimeError,
    "IndexError": IndexError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "NotImplementedError": NotImplementedError,
    "LinAlgError": torch.linalg.LinAlgError,
    "OutOfMemoryError": torch.OutOfMemoryError,
    "DynajaxError": DynajaxError,
}


def eager_error(error: BaseException) -> BaseException | None:
    """The exception eager PyTorch raised inside the handler, from XLA's error
    reporting it (None: the error is not the handler's). XLA's error is a
    ``JaxRuntimeError``, or a ``ValueError`` where a jitted function's C++ fast path ran
    the program (a ``jax.jit`` called again, a ``Compiled`` called again)."""
    if not isinstance(error, (jax.errors.JaxRuntimeError, ValueError)):
        return None
    found = _ERROR.search(str(error))
    if found is None:
        return None
    message = found.group(2).split("; current tracing scope:", 1)[0].rstrip()
    kind = found.group(1)
    if kind == "DynajaxError":
        message += " (in dynajax's call of PyTorch's kernel inside XLA; please report this bug)"
    return _TYPES.get(kind, RuntimeError)(message)

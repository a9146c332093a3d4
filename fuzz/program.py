"""A random program as data: its inputs, its op records and its outputs.

A program is a list of op records over named values (``x0, x1, ...`` for the inputs,
``v<n>`` for what the ops compute). It is data, not code, so that the shrinker can drop
ops, shrink shapes and simplify dtypes and still get a program it can run; the code is
rendered from the data (``source``), and the same text is what a reproducer file holds.
The inputs are described, not stored: ``make_input`` rebuilds the same values from a
seed, so a program is small, JSON-serializable and independent of the run that made it.
"""

from __future__ import annotations

import dataclasses
import json
import linecache
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

FLOAT_DTYPES = ("float32", "float64", "bfloat16", "float16")
INT_DTYPES = ("int64", "int32")
DTYPES = (*FLOAT_DTYPES, *INT_DTYPES, "bool")

# How an input's values are drawn (``make_input``).
NORMAL, PROBABILITY = "normal", "probability"
INDEX, SIGNED_INDEX, UNIQUE = "index", "signed_index", "unique"
# How an input's memory is laid out: which strides the program sees.
CONTIGUOUS, TRANSPOSED, SLICED, EXPANDED = "contiguous", "transposed", "sliced", "expanded"


@dataclasses.dataclass(frozen=True)
class TensorInput:
    """One tensor argument of a program, described by how to rebuild it.

    Attributes:
        shape: the tensor's shape as the program sees it.
        dtype: a name of ``DTYPES``.
        seed: seeds the values (each call of the program adds its own offset).
        layout: ``contiguous``; ``transposed`` (the last two dims of a contiguous tensor
            swapped, so strides are not row-major); ``sliced`` (every other element of
            the last dim, from an offset: stride 2 and a storage offset); ``expanded``
            (dim 0 broadcast from size 1: stride 0, so elements share memory).
        kind: ``normal`` values; ``index`` (integers in ``[-high, high)``, valid indices
            of a dim of size ``high``); ``unique`` (distinct indices in ``[0, high)``
            along the last dim, for ops whose result is undefined with duplicates);
            ``probability`` (floats in [0, 1]).
        high: the size of the dim the indices address (``index`` and ``unique``).
        specials: a tenth of the floating values are 0, inf, -inf or NaN.
        requires_grad: a leaf that requires grad (floating dtypes only).
        scale: the standard deviation of normal floating values.
    """

    shape: tuple[int, ...]
    dtype: str
    seed: int
    layout: str = CONTIGUOUS
    kind: str = NORMAL
    high: int = 0
    specials: bool = False
    requires_grad: bool = False
    scale: float = 2.0


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op of a program: ``<name of out> = <kind rendered over args and params>``.

    Attributes:
        kind: the op's name in the catalog (``fuzz.ops.KINDS``), e.g. ``torch.sin``.
        args: the value ids the op reads (and, for in-place kinds, writes: ``args[0]``).
        params: literal parameters (dims, sizes, scalars, dtype names), sorted by name.
        out: the id of the value the op defines, or None for in-place kinds.
    """

    kind: str
    args: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()
    out: int | None = None

    @property
    def p(self) -> dict[str, Any]:
        """The parameters as a dict."""
        return dict(self.params)


@dataclasses.dataclass(frozen=True)
class Program:
    """A random program: inputs, ops in order, the values it returns.

    Attributes:
        inputs: the tensor arguments; input ``i`` is value id ``i`` (named ``x<i>``).
        ops: the op records; op outputs have ids from ``OUT_BASE`` up (``v<n>``).
        outputs: the value ids returned, as a tuple.
        grad: compare the gradients of a scalar loss of the outputs with respect to the
            inputs that require grad, too.
    """

    inputs: tuple[TensorInput, ...]
    ops: tuple[OpRecord, ...]
    outputs: tuple[int, ...]
    grad: bool = False

    def replace(self, **changes: Any) -> Program:
        """A copy with ``changes`` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The program as JSON (``from_json`` reads it back)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Program:
        """The program ``to_json`` wrote."""
        data = json.loads(text)
        inputs = tuple(TensorInput(**{**i, "shape": tuple(i["shape"])}) for i in data["inputs"])
        ops = tuple(
            OpRecord(
                kind=o["kind"],
                args=tuple(o["args"]),
                params=tuple((k, _tuples(v)) for k, v in o["params"]),
                out=o["out"],
            )
            for o in data["ops"]
        )
        return Program(inputs, ops, tuple(data["outputs"]), data["grad"])


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the records were made of."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# Value ids: input ``i`` is ``i`` (``x<i>``); op outputs are ``OUT_BASE + n`` (``v<n>``).
OUT_BASE = 1000


def name(vid: int) -> str:
    """The Python name of value ``vid``: ``x<i>`` for inputs, ``v<n>`` for op outputs."""
    return f"x{vid}" if vid < OUT_BASE else f"v{vid - OUT_BASE}"


# ---------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------

# The one definition of how inputs are built, also written into every reproducer
# (``INPUT_SOURCE``), so the reproducer rebuilds the very values the fuzzer used.
INPUT_SOURCE = '''
def make_input(shape, dtype, seed, layout="contiguous", kind="normal", high=0,
               specials=False, requires_grad=False, scale=2.0, upcast=False):
    """A tensor of ``shape`` and ``dtype`` (a name) with seeded values and strides."""
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if layout == "transposed":
        base = (*shape[:-2], shape[-1], shape[-2])
    elif layout == "sliced":
        base = (*shape[:-1], 2 * shape[-1] + 1)
    elif layout == "expanded":
        base = (1, *shape[1:])
    else:
        base = shape
    if kind in ("index", "signed_index"):
        low = -high if kind == "signed_index" else 0
        t = torch.randint(low, max(high, low + 1), base, generator=g)
    elif kind == "unique":
        t = torch.rand((*base[:-1], high), generator=g).argsort(-1)[..., : base[-1]]
    elif kind == "probability":
        t = torch.rand(base, generator=g, dtype=torch.float64)
    elif dtype.is_floating_point:
        t = torch.randn(base, generator=g, dtype=torch.float64) * scale
        if specials:
            which = torch.rand(base, generator=g) < 0.1
            pick = torch.randint(0, 4, base, generator=g)
            table = torch.tensor([0.0, float("inf"), float("-inf"), float("nan")],
                                 dtype=torch.float64)
            t = torch.where(which, table[pick], t)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, base, generator=g).bool()
    else:
        t = torch.randint(-8, 9, base, generator=g)
    t = t.to(dtype)
    if upcast and dtype.is_floating_point:
        t = t.to(torch.float64)
    if layout == "transposed":
        t = t.transpose(-1, -2)
    elif layout == "sliced":
        t = t[..., 1::2]
    elif layout == "expanded":
        t = t.expand(shape)
    if requires_grad:
        t = t.detach().requires_grad_(True)
    return t
'''

_input_namespace: dict[str, Any] = {"torch": torch}
exec(compile(INPUT_SOURCE, "<fuzz.program.INPUT_SOURCE>", "exec"), _input_namespace)
_make_input: Callable[..., torch.Tensor] = _input_namespace["make_input"]

# Each call of a program gets its own values: seed + CALL_STRIDE * call.
CALL_STRIDE = 7919


def input_call(spec: TensorInput) -> str:
    """The ``make_input(...)`` call that builds ``spec`` for the call numbered ``call``
    (a variable of the code it goes into), as source."""
    seed = f"{spec.seed} + {CALL_STRIDE} * call"
    args = [repr(spec.shape), repr(spec.dtype), seed]
    for field in ("layout", "kind", "high", "specials", "requires_grad", "scale"):
        value = getattr(spec, field)
        if value != TensorInput.__dataclass_fields__[field].default:
            args.append(f"{field}={value!r}")
    return f"make_input({', '.join(args)})"


def make_input(spec: TensorInput, call: int = 0, upcast: bool = False) -> torch.Tensor:
    """The tensor ``spec`` describes, for call ``call`` of the program (each call draws
    new values); with ``upcast``, the same values in float64 (the reference run)."""
    return _make_input(
        spec.shape,
        spec.dtype,
        spec.seed + CALL_STRIDE * call,
        layout=spec.layout,
        kind=spec.kind,
        high=spec.high,
        specials=spec.specials,
        requires_grad=spec.requires_grad,
        scale=spec.scale,
        upcast=upcast,
    )


def make_inputs(program: Program, call: int = 0, upcast: bool = False) -> list[torch.Tensor]:
    """Fresh tensors for every input of ``program`` (``make_input``)."""
    return [make_input(s, call, upcast) for s in program.inputs]


# ---------------------------------------------------------------------------------
# Source
# ---------------------------------------------------------------------------------


def source(program: Program, *, fn_name: str = "program", upcast: bool = False) -> str:
    """``program`` as a Python function definition over ``torch`` and ``F``.

    With ``upcast``, every floating dtype the ops name becomes float64: the function is
    then the float64 reference of the program (its inputs come from ``make_input(...,
    upcast=True)``).
    """
    from fuzz.ops import render  # the catalog imports this module

    args = ", ".join(name(i) for i in range(len(program.inputs)))
    lines = [f"def {fn_name}({args}):"]
    for rec in program.ops:
        lines.append("    " + render(rec, upcast=upcast))
    outs = "".join(f"{name(o)}, " for o in program.outputs)
    lines.append(f"    return ({outs})")
    return "\n".join(lines) + "\n"


def op_index(line: int) -> int:
    """The index of the op on line ``line`` (1-based) of ``source(program)``."""
    return line - 2


_counter = 0


def to_function(program: Program, *, upcast: bool = False) -> Callable[..., Any]:
    """The program as a Python function, compiled from ``source`` under a file name of
    its own that ``linecache`` knows (Dynamo and dynajax's report read source lines).

    Each call makes a new code object, so Dynamo never reuses another program's guards.
    """
    global _counter
    _counter += 1
    text = source(program, upcast=upcast)
    filename = f"<fuzz program {_counter}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch, "F": F}
    exec(compile(text, filename, "exec"), namespace)
    fn: Callable[..., Any] = namespace["program"]
    return fn


def forget_function(fn: Callable[..., Any]) -> None:
    """Drops the ``linecache`` entry of a function made by ``to_function``, and the
    globals Dynamo installed in its namespace (``__compiled_fn_*``, the compiled graphs).

    Dynamo's cleanup hooks, which remove those globals, run when the code object they
    are keyed by dies, which the namespace itself keeps alive through ``fn`` until a
    garbage collection of the cycle; meanwhile each program's executables stayed
    alive, and a 30-minute run ran out of memory maps (``LLVM compilation error:
    Cannot allocate memory`` after 5,500 programs, about 12 maps each).
    """
    linecache.cache.pop(fn.__code__.co_filename, None)
    namespace = fn.__globals__
    for key in namespace:
        if key.startswith("__compiled_fn"):
            namespace[key] = None  # the hook deletes the name when it runs


def compact(program: Program) -> Program:
    """``program`` without the inputs nothing reads, inputs and op outputs renumbered
    in order (so names stay ``x0, x1, ...`` and ``v0, v1, ...`` with no gaps)."""
    used = {a for rec in program.ops for a in rec.args} | set(program.outputs)
    mapping: dict[int, int] = {}
    inputs: list[TensorInput] = []
    for i, spec in enumerate(program.inputs):
        if i in used:
            mapping[i] = len(inputs)
            inputs.append(spec)
    ops: list[OpRecord] = []
    for rec in program.ops:
        out = rec.out
        if out is not None:
            mapping[out] = OUT_BASE + sum(1 for r in ops if r.out is not None)
            out = mapping[out]
        args = tuple(mapping[a] for a in rec.args)
        ops.append(dataclasses.replace(rec, args=args, out=out))
    outputs = tuple(mapping[o] for o in program.outputs)
    grad = program.grad and any(s.requires_grad for s in inputs)
    return Program(tuple(inputs), tuple(ops), outputs, grad)

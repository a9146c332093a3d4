"""A random program as data: its inputs, its op records and its outputs.

A program is a list of op records over named values (``x0, x1, ...`` for the inputs,
``v<n>`` for what the ops compute). It is data, not code, so that the shrinker can drop
ops, shrink shapes and simplify dtypes and still get a program it can run; the code is
rendered from the data (``fuzz.rendering.source``), and the same text is what a
reproducer file holds.
The inputs are described, not stored: ``make_input`` rebuilds the same values from a
seed, in the same layout (strides, storage offset, memory shared between elements), so
a program is small, JSON-serializable and independent of the run that made it.

A program whose inputs include parameters or buffers (``TensorInput.role``) is a
module (``fuzz.rendering.module_source``): those inputs are its state, the others its forward's
arguments, as ``torch.compile(model)`` hands a model's parameters and buffers to the
graph beside its inputs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch

FLOAT_DTYPES = ("float32", "float64", "bfloat16", "float16")
INT_DTYPES = ("int64", "int32")
DTYPES = (*FLOAT_DTYPES, *INT_DTYPES, "bool")

# How an input's values are drawn (``make_input``).
NORMAL, PROBABILITY = "normal", "probability"
INDEX, SIGNED_INDEX, UNIQUE = "index", "signed_index", "unique"
# How an input's memory is laid out: which strides the program sees (``TensorInput``).
CONTIGUOUS, TRANSPOSED, SLICED, EXPANDED = "contiguous", "transposed", "sliced", "expanded"
BROADCAST, OVERLAPPING, CHANNELS_LAST = "broadcast", "overlapping", "channels_last"
OFFSET, PERMUTED, STEPPED = "offset", "permuted", "stepped"
LAYOUTS = (
    CONTIGUOUS, TRANSPOSED, SLICED, EXPANDED, BROADCAST, OVERLAPPING, CHANNELS_LAST,
    OFFSET, PERMUTED, STEPPED,
)  # fmt: skip
# Layouts in which two elements share memory: nothing may write into them (eager
# raises), so they are no layouts for a parameter an optimizer updates.
SHARED_MEMORY = (EXPANDED, BROADCAST, OVERLAPPING)
# Where an input lives when the program is a module (``module_source``).
INPUT, PARAMETER, BUFFER = "input", "parameter", "buffer"


def layout_fits(layout: str, shape: tuple[int, ...]) -> bool:
    """Whether ``layout`` is one a tensor of ``shape`` can have (and differs from the
    contiguous one in some way: a stride or a storage offset)."""
    n = len(shape)
    numel = 1
    for d in shape:
        numel *= d
    return {
        CONTIGUOUS: True,
        TRANSPOSED: n >= 2,
        SLICED: n >= 1,
        EXPANDED: n >= 1 and shape[0] > 1,
        BROADCAST: n >= 1 and numel > 1,
        OVERLAPPING: n >= 2 and shape[-1] > 1 and shape[-2] > 1,
        CHANNELS_LAST: n == 4,
        OFFSET: True,
        PERMUTED: n >= 3,
        STEPPED: n >= 1,
    }[layout]


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
            (dim 0 broadcast from size 1: stride 0, so elements share memory);
            ``broadcast`` (one value expanded to every dim, all strides 0: diffusers'
            ``torch.tensor(t).expand(batch)``); ``overlapping`` (``as_strided`` with
            dim -2's stride half of dim -1's size: rows overlap, as ``unfold``'s);
            ``channels_last`` (4-D, ``memory_format=torch.channels_last``); ``offset``
            (contiguous, a view into a larger storage from a storage offset);
            ``permuted`` (dims 1 and 2 of a contiguous tensor swapped: attention's
            ``(N, L, H, E).transpose(1, 2)``); ``stepped`` (every other row of dim 0,
            from an offset). ``layout_fits`` says which apply to a shape.
        kind: ``normal`` values; ``index`` (integers in ``[0, high)``, valid indices
            of a dim of size ``high``); ``signed_index`` (in ``[-high, high)``);
            ``unique`` (distinct indices in ``[0, high)`` along the last dim, for ops
            whose result is undefined with duplicates); ``probability`` (floats in [0,
            1]).
        high: the size of the dim the indices address (``index`` and ``unique``).
        bad: an index input that now and then (on a call's values, drawn from its
            seed) holds one index out of range (``high``, ``high + 3`` or one below the
            lowest valid): eager's value check raises, and so must dynajax.
        role: ``input`` (an argument), or the program's module's ``parameter`` or
            ``buffer`` (``module_source``).
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
    bad: bool = False
    role: str = INPUT


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

    @property
    def module(self) -> bool:
        """Whether the program is a module: some inputs are its state (``role``)."""
        return any(spec.role != INPUT for spec in self.inputs)

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
               specials=False, requires_grad=False, scale=2.0, bad=False, upcast=False):
    """A tensor of ``shape`` and ``dtype`` (a name) with seeded values, in ``layout``."""
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    if layout == "transposed":
        base = (*shape[:-2], shape[-1], shape[-2])
    elif layout == "sliced":
        base = (*shape[:-1], 2 * shape[-1] + 1)
    elif layout == "expanded":
        base = (1, *shape[1:])
    elif layout == "broadcast":
        base = ()
    elif layout == "stepped":
        base = (2 * shape[0] + 1, *shape[1:])
    elif layout == "permuted":
        base = (shape[0], shape[2], shape[1], *shape[3:])
    elif layout == "offset":
        base = (numel + 5,)
    elif layout == "overlapping":  # rows overlap: dim -2's stride is half a row
        strides = [1] * len(shape)
        strides[-2] = max(1, shape[-1] // 2)
        for d in range(len(shape) - 3, -1, -1):
            strides[d] = 1 + sum((shape[k] - 1) * strides[k] for k in range(d + 1, len(shape)))
        base = (1 + sum((n - 1) * s for n, s in zip(shape, strides)) if numel else 0,)
    else:
        base = shape
    if kind in ("index", "signed_index"):
        low = -high if kind == "signed_index" else 0
        t = torch.randint(low, max(high, low + 1), base, generator=g)
    elif kind == "unique":
        low = 0
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
    if bad and t.numel() and bool(torch.rand((), generator=g) < 0.6):
        wrong = (high, high + 3, low - 1)[int(torch.randint(0, 3, (), generator=g))]
        t = t.contiguous()  # (unique indices are a slice of a permutation)
        t.view(-1)[int(torch.randint(0, t.numel(), (), generator=g))] = wrong
    t = t.to(dtype)
    if upcast and dtype.is_floating_point:
        t = t.to(torch.float64)
    if layout == "transposed":
        t = t.transpose(-1, -2)
    elif layout == "sliced":
        t = t[..., 1::2]
    elif layout in ("expanded", "broadcast"):
        t = t.expand(shape)
    elif layout == "stepped":
        t = t[1::2]
    elif layout == "permuted":
        t = t.transpose(1, 2)
    elif layout == "offset":
        t = t[3 : 3 + numel].view(shape)
    elif layout == "overlapping":
        t = t.as_strided(shape, strides)
    elif layout == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
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
    for field in ("layout", "kind", "high", "specials", "requires_grad", "scale", "bad"):
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
        bad=spec.bad,
        upcast=upcast,
    )


def make_inputs(program: Program, call: int = 0, upcast: bool = False) -> list[torch.Tensor]:
    """Fresh tensors for every input of ``program`` (``make_input``)."""
    return [make_input(s, call, upcast) for s in program.inputs]


# ---------------------------------------------------------------------------------
# Source
# ---------------------------------------------------------------------------------


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

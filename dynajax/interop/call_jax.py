"""A JAX function inside a PyTorch program: ``dynajax.call_jax``.

    def rms(x, w, *, eps):                       # any JAX function (jnp, lax, Pallas)
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    y = dynajax.call_jax(rms, x, w, eps=1e-6)     # tensors in, tensors out

Positional arguments are tensors (or tuples, lists and dicts of them) and Python scalars;
keyword arguments are static values handed to the function as they are (like
``jax.jit``'s ``static_argnames``). The result has the structure the function returns
(arrays in tuples, lists, dicts or None), with a tensor for every array.

Three ways it runs:

* eager PyTorch: the custom op ``dynajax::call_jax`` calls ``jax.jit`` of the function.
  CPU tensors cross as NumPy views of their storage, which ``jax.jit`` takes without
  copying; results come back as tensors viewing XLA's output buffers. Tensors on other
  devices cross through DLPack (``conversion.dlpack_to_jax`` / ``dlpack_to_torch``). The
  call runs with JAX's 64-bit mode on for this thread only, so int64 and float64 stay
  64-bit, and JAX's global configuration is never changed.
* autograd: the backward of every floating-point (or complex) input that needs a
  gradient is the function's VJP (``jax.vjp``). It is itself a ``call_jax`` of a derived
  JAX function, so it is differentiable again and lowers like any other.
* ``torch.compile``: Dynamo records ONE node, ``dynajax.call_jax.default``, whose fake
  implementation is ``jax.eval_shape`` of the function. Under ``backend="dynajax"`` the
  node's lowering rule (``dynajax/lowering/interop.py``) traces the function into the
  surrounding partition, so XLA compiles it together with its neighbours, forward and
  backward. Under any other backend the node runs the eager op.

The registry. A custom op cannot take a Python callable, so ``call_jax`` registers the
function and takes a string key. An entry is made per (function, static keyword
arguments, positional structure with its static scalars), with a key like
``"rms#3@9f2c01aa"``: a readable name, a counter, and a token drawn at import so that no
key of this process names a function of another (a graph cached on disk by another
process never finds a key of ours). Under Dynamo, ``_register`` runs at trace time as a
constant (``torch._dynamo.assume_constant_result``); ``id(jax_fn)`` in the traced code
makes Dynamo guard on the function's identity, so a call with another function (a
closure from the same factory included) recompiles instead of reusing a key, and
repeated calls with the same function reuse the compiled graph.

Lifetimes: the registry holds a strong reference to every function and static value it
was given, for the life of the process, because a compiled graph may call its key at
any later time and must find the same function. A function created anew for every call
(a lambda, a ``functools.partial``) therefore adds an entry per call in eager mode: bound
methods and partials of hashable arguments are recognized as the same function, but
define other functions once, or pass their parameters as keyword arguments. A warning
is logged when the registry passes ``_WARN_ENTRIES`` functions.

Shapes: the fake implementation evaluates the function on concrete shapes, so under
dynamic shapes a ``call_jax`` specializes its inputs' sizes (Dynamo guards on them). The
output structure must not depend on the input shapes.

Inside ``torch.compile``, a JAX function defined in the compiled code may close over
constants only: Dynamo cannot turn a closure over one of the compiled function's
arguments into a constant (it fails with ``ClosureConversionError``). Pass such values
as keyword arguments instead: ``call_jax(lambda v, *, s: v * s, x, s=scale)``.

Cost per call (2-core CPU, shared; a 4-element ``x + 1``, medians): eager ``call_jax``
~50 µs, against ~8 µs for ``jax.jit`` on a NumPy view and ~3 µs for torch's ``x + 1``.
Of the 50: the dispatcher and the autograd kernel of the custom op ~22 µs, the op's
body ~16 µs (``jax.jit`` ~8, conversions and checks), the registry lookup ~4 µs, the
rest flattening and rebuilding the arguments. With an input that requires grad, ~115 µs.
Inside a dynajax partition the function is part of the partition's executable and adds
no per-call cost of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
import os
import threading
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from dynajax.errors import CallJaxError, ConversionError
from dynajax.lowering.dtypes import JAX_TO_TORCH, TORCH_TO_JAX
from dynajax.runtime import conversion
from dynajax.runtime.jax_internals import X64

log = logging.getLogger("dynajax.interop")

# A structure (of positional arguments, or of a function's outputs) is a nested tuple of
# Python constants that Dynamo can hold as a constant:
#   ("leaf", i)              the i-th tensor (or array)
#   ("static", value)        a Python scalar, handed to the function as it is
#   ("none",)                None (outputs)
#   ("tuple", (s, ...)), ("list", (s, ...)), ("dict", ((key, s), ...))
Structure = tuple[Any, ...]

_STATIC_SCALARS = (bool, int, float, complex, str)

# Keys of this process never name a function of another one.
_TOKEN = os.urandom(4).hex()
_WARN_ENTRIES = 1024

# The op's schema is declared in dynajax/lowering/interop.py (see there why); importing
# dynajax.lowering above has declared it. Its implementations are registered below.
_OP = "dynajax::call_jax"
_CALL_JAX = torch.ops.dynajax.call_jax.default


# ---------------------------------------------------------------------------------
# The public function (traced by Dynamo: plain Python on tensors and constants)
# ---------------------------------------------------------------------------------


def call_jax(jax_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls the JAX function ``jax_fn`` on torch tensors; returns its outputs as tensors.

    ``jax_fn(*args, **kwargs)`` runs with each tensor of ``args`` replaced by a JAX array
    of the same shape and dtype (no copy on CPU), in eager PyTorch, under autograd (the
    backward is ``jax.vjp`` of ``jax_fn``) and inside ``torch.compile`` as a single op,
    which ``backend="dynajax"`` compiles into the surrounding XLA partition.

    Args:
        jax_fn: a function of JAX arrays (``jnp``, ``lax``, ``pallas_call``...) that
            returns an array, or tuples, lists or dicts of arrays (None allowed). It must
            be traceable by ``jax.jit``; it is kept alive by a registry for the life of
            the process (see the module docstring).
        *args: torch tensors, tuples, lists or dicts of them, and Python scalars (None,
            bool, int, float, complex, str), which reach ``jax_fn`` as static values.
            All tensors must be on one device.
        **kwargs: static values for ``jax_fn`` (numbers, strings, tuples, dtypes,
            functions...); they must be hashable once lists and dicts are read as
            tuples. Each distinct set of values traces ``jax_fn`` anew.

    Returns:
        ``jax_fn``'s result with the structure it returned, each array a tensor of the
        same shape and dtype on the inputs' device (CPU when there are no tensors).

    Raises:
        ConversionError: a positional argument is neither a tensor nor a static scalar,
            a static value is not hashable, or an output has a dtype torch lacks.
        CallJaxError: ``jax_fn`` failed on these shapes and dtypes; the message names it,
            the shapes and the static arguments.
    """
    tensors: list[torch.Tensor] = []
    structure = ("tuple", tuple(_flatten_args(a, tensors, i) for i, a in enumerate(args)))
    static = {name: _static_value(value) for name, value in kwargs.items()}
    # A bound method is registered as its function and object: Dynamo cannot hold a
    # bound method as a constant, and each attribute access makes a new one.
    owner = jax_fn.__self__ if isinstance(jax_fn, types.MethodType) else None
    fn = jax_fn.__func__ if isinstance(jax_fn, types.MethodType) else jax_fn
    # id() makes Dynamo guard on their identities (not only on the function's code).
    key = _register(fn, owner, (id(fn), id(owner)), static, structure)
    outputs = _CALL_JAX(key, tensors)
    return _build(_output_structure(key), outputs)


def _flatten_args(value: Any, tensors: list[torch.Tensor], index: int) -> Structure:
    """The structure of positional argument ``index`` (or of a part of it); its tensors
    appended to ``tensors`` in order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("leaf", len(tensors) - 1)
    if type(value) is tuple or type(value) is list:
        kind = "tuple" if type(value) is tuple else "list"
        return (kind, tuple(_flatten_args(v, tensors, index) for v in value))
    if type(value) is dict:
        return ("dict", tuple((k, _flatten_args(v, tensors, index)) for k, v in value.items()))
    if value is None or isinstance(value, _STATIC_SCALARS):
        return ("static", _static_value(value))
    raise ConversionError(
        f"call_jax: positional argument {index} is or contains a value of type "
        f"{_type_name(value)}. "
        "Positional arguments must be torch tensors (or tuples, lists and dicts of them) "
        "or Python scalars (None, bool, int, float, complex, str), which reach the JAX "
        "function as static values. Convert arrays with torch.as_tensor(...), and pass "
        "any other static value as a keyword argument."
    )


def _static_value(value: Any) -> Any:
    """``value`` with every int and float in it made a Python constant.

    Dynamo may hand a number that changed between calls as a symbolic value; a static
    argument needs the number itself (and Dynamo then guards on it). ``operator.index``
    makes Dynamo specialize an int; a float is specialized by hashing it as a dict key
    (Dynamo specializes dict keys). Both are the identity in eager mode.
    """
    if type(value) is tuple or type(value) is list:
        return type(value)(_static_value(v) for v in value)
    if type(value) is dict:
        return {k: _static_value(v) for k, v in value.items()}
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return operator.index(value)
    if isinstance(value, float):
        return next(iter({float(value): None}))
    return value


def _build(structure: Structure, leaves: Sequence[Any]) -> Any:
    """The value that ``structure`` describes, with ``leaves`` at its leaves."""
    kind = structure[0]
    if kind == "leaf":
        return leaves[structure[1]]
    if kind == "static":
        return structure[1]
    if kind == "none":
        return None
    if kind == "tuple":
        return tuple(_build(s, leaves) for s in structure[1])
    if kind == "list":
        return [_build(s, leaves) for s in structure[1]]
    return {k: _build(s, leaves) for k, s in structure[1]}


# ---------------------------------------------------------------------------------
# The registry (constant functions under Dynamo)
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Entry:
    """A registered JAX function, taking and returning flat sequences of arrays.

    Attributes:
        key: the string the custom op takes.
        name: what messages call the function (``module.qualname (file:line)``).
        flat_fn: ``flat_fn(*arrays) -> tuple of arrays``: the function with its static
            arguments bound, on flat inputs, its outputs flattened.
        static: the static arguments, as messages show them.
        owner: what the entry keeps alive: the user's function and static values, or
            the entry a VJP was derived from.
        output: the structure of the function's outputs, recorded at its first trace.
        jitted: ``jax.jit(flat_fn)``, the eager path.
        vjps: keys of the VJP entries derived from this one, by differentiated inputs.
    """

    key: str
    name: str
    flat_fn: Callable[..., tuple[Any, ...]]
    static: str
    owner: Any
    output: Structure | None = None
    jitted: Callable[..., Any] = dataclasses.field(init=False)
    vjps: dict[tuple[int, ...], str] = dataclasses.field(default_factory=dict)
    _shapes: dict[tuple[Any, ...], list[jax.ShapeDtypeStruct]] = dataclasses.field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self.jitted = jax.jit(self.flat_fn)

    def record(self, result: Any) -> tuple[Any, ...]:
        """Flattens ``result`` (an output of the user's function) and records its
        structure; a structure other than the first recorded one is an error."""
        leaves: list[Any] = []
        structure = _flatten_output(result, leaves, "output", self)
        with _LOCK:
            if self.output is None:
                self.output = structure
        if structure != self.output:
            raise CallJaxError(
                f"call_jax: {self.name} returned a different structure than at its first "
                f"call ({_describe_structure(structure)} instead of "
                f"{_describe_structure(self.output)}). Its outputs must have one structure "
                "whatever the input shapes; return the variable parts in a list or dict of "
                "fixed keys, or use two functions."
            )
        return tuple(leaves)

    def abstract(self, avals: tuple[jax.ShapeDtypeStruct, ...]) -> list[jax.ShapeDtypeStruct]:
        """The outputs' shapes and dtypes for inputs ``avals`` (``jax.eval_shape``)."""
        signature = tuple((a.shape, str(a.dtype)) for a in avals)
        found = self._shapes.get(signature)
        if found is None:
            token = X64.enable()
            try:
                found = list(jax.eval_shape(self.flat_fn, *avals))
            except (CallJaxError, ConversionError):
                raise
            except Exception as e:
                raise self.failure(avals, e) from e
            finally:
                X64.restore(token)
            self._shapes[signature] = found
        return found

    def failure(self, avals: Sequence[Any], error: BaseException) -> CallJaxError:
        """The error to raise when the function fails on inputs ``avals``."""
        shapes = ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in avals)
        text = str(error).strip()
        return CallJaxError(
            f"call_jax: {self.name} failed on inputs ({shapes}) with static arguments "
            f"{self.static}: {type(error).__name__}: {text}\nThe inputs are the torch "
            "tensors passed to call_jax, as JAX arrays of the same shapes and dtypes "
            "(64-bit types stay 64-bit). Check that the function accepts them: "
            "jax.eval_shape(fn, *[jax.ShapeDtypeStruct(t.shape, ...) ...], **static)."
        )


_LOCK = threading.RLock()
_ENTRIES: dict[str, _Entry] = {}
_KEYS: dict[Hashable, str] = {}
_COUNTER = itertools.count()


@torch._dynamo.assume_constant_result
def _register(
    fn: Callable[..., Any],
    owner: Any,
    guard_ids: tuple[int, int],
    static: dict[str, Any],
    structure: Structure,
) -> str:
    """The key of ``fn`` (bound to ``owner`` unless it is None) with these static
    arguments and positional structure, registering it on first use.

    Dynamo runs this at trace time and keeps the key as a constant of the graph.
    ``guard_ids`` are the ids of ``fn`` and ``owner`` as the traced code computed them;
    asking for them is what makes Dynamo guard on their identities. They are otherwise
    unused (for a function Dynamo rebuilt, they are not this object's ids).
    """
    del guard_ids
    jax_fn = fn if owner is None else types.MethodType(fn, owner)
    if not callable(jax_fn):
        raise ConversionError(
            f"call_jax: the first argument must be a JAX function, got a value of type "
            f"{_type_name(jax_fn)}. Call it as call_jax(fn, *tensors, **static)."
        )
    frozen = tuple((k, _freeze(v, f"keyword argument {k!r}")) for k, v in static.items())
    lookup = (_identity(jax_fn), frozen, _freeze(structure, "args"))
    with _LOCK:
        key = _KEYS.get(lookup)
        if key is not None:
            return key
        name = _describe_function(jax_fn)
        key = f"{_short_name(jax_fn)}#{next(_COUNTER)}@{_TOKEN}"
        kwargs = dict(static)

        def flat_fn(*arrays: Any) -> tuple[Any, ...]:
            return entry.record(jax_fn(*_build(structure, arrays), **kwargs))

        entry = _Entry(key, name, flat_fn, _describe_static(static), jax_fn)
        _KEYS[lookup] = key
        _add(entry)
    # Outputs are tensors viewing XLA buffers that NumPy calls read-only (they are not).
    conversion.quiet_readonly_warning()
    return key


@torch._dynamo.assume_constant_result
def _output_structure(key: str) -> Structure:
    """The structure of the outputs of ``key``'s function (recorded by the call that
    just ran, or by its fake implementation while Dynamo traced it)."""
    structure = _entry(key).output
    if structure is None:
        raise AssertionError(f"call_jax: {key} ran without recording its outputs")
    return structure


def _add(entry: _Entry) -> None:
    _ENTRIES[entry.key] = entry
    if len(_ENTRIES) == _WARN_ENTRIES:
        log.warning(
            "dynajax.call_jax has registered %d JAX functions, each kept alive for the "
            "life of the process. A function created anew for every call (a lambda or "
            "closure inside a loop) adds an entry per call: define it once, or pass its "
            "parameters as keyword arguments.",
            len(_ENTRIES),
        )


def _entry(key: str) -> _Entry:
    entry = _ENTRIES.get(key)
    if entry is None:
        raise CallJaxError(
            f"call_jax: no JAX function is registered under {key!r}. Keys name functions "
            "of the process that called dynajax.call_jax; a graph saved by another "
            "process cannot run here. Call dynajax.call_jax again in this process."
        )
    return entry


def _identity(fn: Any) -> Hashable:
    """What makes two callables the same function for the registry: the object itself,
    or for a bound method its object and function, or for a ``functools.partial`` its
    function and (hashable) arguments. The entry keeps ``fn`` alive, so ids are stable."""
    if isinstance(fn, types.MethodType):
        return ("method", id(fn.__self__), _identity(fn.__func__))
    if type(fn) is functools.partial:
        try:
            frozen = (_freeze(fn.args, "partial"), _freeze(fn.keywords, "partial"))
        except ConversionError:
            return ("id", id(fn))
        return ("partial", _identity(fn.func), frozen)
    return ("id", id(fn))


def _freeze(value: Any, path: str) -> Hashable:
    """A hashable, type-exact key of a static value (1, 1.0 and True differ)."""
    if type(value) is tuple or type(value) is list:
        return (type(value).__name__, *(_freeze(v, f"{path}[{i}]") for i, v in enumerate(value)))
    if type(value) is dict:
        items = [(k, _freeze(v, f"{path}[{k!r}]")) for k, v in value.items()]
        return ("dict", *sorted(items, key=lambda kv: repr(kv[0])))
    if isinstance(value, float | complex):
        return (type(value).__name__, repr(value))  # -0.0 and nan as written
    try:
        hash(value)
    except TypeError:
        raise ConversionError(
            f"call_jax: {path} is of type {_type_name(value)}, which is "
            "not hashable. Static values select the traced JAX function (like jax.jit's "
            "static_argnames), so they must be hashable: pass arrays as positional "
            "tensors, and lists and dicts of hashable values."
        ) from None
    return (type(value), value)


# ---------------------------------------------------------------------------------
# The custom op: eager implementation, fake implementation, autograd
# ---------------------------------------------------------------------------------


def _call_jax_op(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs ``key``'s JAX function on ``args`` (``jax.jit``, zero-copy on CPU)."""
    entry = _entry(key)
    device = _device_of(args, entry)
    view = device.type in _VIEW_DEVICES
    for i, t in enumerate(args):
        if t.dtype not in TORCH_TO_JAX:
            _aval(t, i, entry)  # raises, naming the dtype JAX lacks
    # Below autograd, an input may still say requires_grad (``numpy()`` refuses it).
    arrays = [
        conversion.fast_to_jax(t.detach() if t.requires_grad else t) if view else _to_jax(t)
        for t in args
    ]
    token = X64.enable()
    try:
        outputs = entry.jitted(*arrays)
    except (CallJaxError, ConversionError):
        raise
    except Exception as e:
        raise entry.failure(arrays, e) from e
    finally:
        X64.restore(token)
    if view:
        return [conversion.cpu_to_torch(a) for a in outputs]
    return [_to_torch(a) for a in outputs]


# Devices whose tensors cross as NumPy views of their storage (``jax.jit`` takes an
# aligned one without copying); tensors on any other device cross through DLPack.
_VIEW_DEVICES = frozenset({"cpu"})


def _to_jax(t: torch.Tensor) -> Any:
    """A tensor not on CPU as a JAX array on its device: DLPack, no copy (unless it is
    not contiguous, or has a lazy conjugate or negative bit)."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return conversion.dlpack_to_jax(t.detach().contiguous())


def _to_torch(a: jax.Array) -> torch.Tensor:
    """An output array not on CPU as a tensor on its device: DLPack, no copy."""
    return conversion.dlpack_to_torch(a)


def _call_jax_fake(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _entry(key)
    device = _device_of(args, entry)
    avals = tuple(_aval(t, i, entry) for i, t in enumerate(args))
    return [
        torch.empty(a.shape, dtype=JAX_TO_TORCH[np.dtype(a.dtype)], device=device)
        for a in entry.abstract(avals)
    ]


def _aval(t: torch.Tensor, index: int, entry: _Entry) -> jax.ShapeDtypeStruct:
    """The JAX abstract value of tensor ``t``. A symbolic size is specialized (``int``
    guards on it): the function is evaluated on concrete shapes."""
    dtype = TORCH_TO_JAX.get(t.dtype)
    if dtype is None:
        raise ConversionError(
            f"call_jax: tensor {index} passed to {entry.name} is {t.dtype}, which JAX has "
            "no dtype for. Convert it first (for example t.to(torch.float32))."
        )
    return jax.ShapeDtypeStruct(tuple(int(s) for s in t.shape), dtype)


def _device_of(args: Sequence[torch.Tensor], entry: _Entry) -> torch.device:
    """The one device of the inputs (CPU when there are none)."""
    if not args:
        return torch.device("cpu")
    device = args[0].device
    for t in args[1:]:
        if t.device != device:
            raise ConversionError(
                f"call_jax: the tensors passed to {entry.name} are on {device} and "
                f"{t.device}; a JAX function runs on one device. Move them to one device "
                "first (t.to(device))."
            )
    return device


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    key, args = inputs
    ctx.key = key
    ctx.save_for_backward(*args)
    ctx.outputs = [(o.shape, o.dtype, o.device) for o in output]


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[None, list[Any]]:
    """The gradients of the inputs: a ``call_jax`` of the function's VJP."""
    primals = list(ctx.saved_tensors)
    needs = ctx.needs_input_grad[1]
    wrt = tuple(
        i
        for i, (p, need) in enumerate(zip(primals, needs, strict=True))
        if need and (p.is_floating_point() or p.is_complex())
    )
    result: list[Any] = [None] * len(primals)
    if not wrt:
        return None, result
    cotangents = [
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(grads, ctx.outputs, strict=True)
    ]
    key = _vjp_key(ctx.key, wrt, len(primals))
    for i, g in zip(wrt, _CALL_JAX(key, [*primals, *cotangents]), strict=True):
        result[i] = g
    return None, result


torch.library.register_kernel(_OP, None, _call_jax_op)
torch.library.register_fake(_OP, _call_jax_fake)
torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)


def _vjp_key(key: str, wrt: tuple[int, ...], n_primals: int) -> str:
    """The key of the VJP of ``key``'s function with respect to inputs ``wrt``.

    The VJP takes the primals then one cotangent per output, and returns one gradient
    per input of ``wrt``, in PyTorch's convention: for complex values PyTorch's gradient
    is the conjugate of JAX's VJP of the conjugate cotangent (real values unchanged).
    """
    parent = _entry(key)
    with _LOCK:
        found = parent.vjps.get(wrt)
        if found is not None:
            return found

        def vjp_fn(*arrays: Any) -> tuple[Any, ...]:
            primals, cotangents = arrays[:n_primals], arrays[n_primals:]

            def of_wrt(*chosen: Any) -> tuple[Any, ...]:
                full = list(primals)
                for i, value in zip(wrt, chosen, strict=True):
                    full[i] = value
                return parent.flat_fn(*full)

            outputs, pullback = jax.vjp(of_wrt, *(primals[i] for i in wrt))
            cts = tuple(_cotangent(c, o) for c, o in zip(cotangents, outputs, strict=True))
            grads = pullback(cts)
            return vjp_entry.record(tuple(jnp.conj(g) if jnp.iscomplexobj(g) else g for g in grads))

        name = f"the VJP of {parent.name} with respect to inputs {list(wrt)}"
        vjp_key = f"{parent.key}.vjp{'_'.join(map(str, wrt))}"
        vjp_entry = _Entry(vjp_key, name, vjp_fn, parent.static, parent)
        parent.vjps[wrt] = vjp_key
        _add(vjp_entry)
    return vjp_key


def _cotangent(ct: Any, output: Any) -> Any:
    """The JAX cotangent of one output for PyTorch's gradient ``ct``: conjugated for
    complex outputs, ``float0`` zeros for integer and boolean ones (no gradient)."""
    if jnp.issubdtype(output.dtype, jnp.inexact):
        ct = ct.astype(output.dtype)
        return jnp.conj(ct) if jnp.iscomplexobj(ct) else ct
    return np.zeros(output.shape, dtype=jax.dtypes.float0)


# ---------------------------------------------------------------------------------
# The JAX side: what the lowering rule (dynajax/lowering/interop.py) calls
# ---------------------------------------------------------------------------------


def jax_call(key: str, arrays: Sequence[Any]) -> list[Any]:
    """``key``'s function applied to JAX arrays (or tracers): the lowering of one
    ``dynajax.call_jax.default`` node, traced into the surrounding partition."""
    return list(_entry(key).flat_fn(*arrays))


# ---------------------------------------------------------------------------------
# Outputs and messages
# ---------------------------------------------------------------------------------


def _flatten_output(value: Any, leaves: list[Any], path: str, entry: _Entry) -> Structure:
    """The structure of a function's result; its arrays appended to ``leaves``."""
    if value is None:
        return ("none",)
    if type(value) is tuple or type(value) is list:
        kind = "tuple" if type(value) is tuple else "list"
        return (
            kind,
            tuple(_flatten_output(v, leaves, f"{path}[{i}]", entry) for i, v in enumerate(value)),
        )
    if type(value) is dict:
        return (
            "dict",
            tuple(
                (k, _flatten_output(v, leaves, f"{path}[{k!r}]", entry)) for k, v in value.items()
            ),
        )
    if isinstance(value, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
        array = jnp.asarray(value)
        if np.dtype(array.dtype) not in JAX_TO_TORCH:
            raise ConversionError(
                f"call_jax: {path} of {entry.name} is {array.dtype}, which has no torch "
                "dtype dynajax converts to. Cast it in the JAX function (for example "
                "x.astype(jnp.int64))."
            )
        leaves.append(array)
        return ("leaf", len(leaves) - 1)
    raise ConversionError(
        f"call_jax: {path} of {entry.name} is of type {_type_name(value)}. A JAX function "
        "called from torch returns arrays, in tuples, lists or dicts (None allowed); "
        "convert other containers (a namedtuple, a dataclass) to one of those."
    )


def _describe_structure(structure: Structure | None) -> str:
    if structure is None:
        return "nothing"
    kind = structure[0]
    if kind == "leaf":
        return "array"
    if kind == "none":
        return "None"
    if kind == "dict":
        inner = ", ".join(f"{k!r}: {_describe_structure(s)}" for k, s in structure[1])
        return "{" + inner + "}"
    inner = ", ".join(_describe_structure(s) for s in structure[1])
    return f"({inner})" if kind == "tuple" else f"[{inner}]"


def _describe_static(static: dict[str, Any]) -> str:
    parts = [f"{k}={v!r}" for k, v in static.items()]
    return "{" + ", ".join(parts) + "}" if parts else "{}"


def _type_name(value: Any) -> str:
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _short_name(fn: Any) -> str:
    target = fn.func if type(fn) is functools.partial else fn
    name = getattr(target, "__name__", None) or type(target).__name__
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def _describe_function(fn: Any) -> str:
    """``module.qualname (file:line)`` where known, for messages."""
    target = fn.func if type(fn) is functools.partial else fn
    target = getattr(target, "__func__", target)
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    name = f"{module}.{qualname}" if module else qualname
    code = getattr(target, "__code__", None)
    if code is not None:
        name += f" ({code.co_filename}:{code.co_firstlineno})"
    return name

"""A torch model as a pure JAX function: ``fn, state = dynajax.jax_function(model, x)``.

    fn, state = dynajax.jax_function(model, x)          # state: {"0.weight": Array, ...}
    y = jax.jit(fn)(state, x)                            # eager's answer, as jax.Arrays
    grads = jax.grad(lambda p: loss(fn({**p, **buffers}, x)))(params)
    y, state = fn.with_state(state, x)                   # models that update buffers
    y = fn(state, x, key=jax.random.key(0))              # models with random ops

How it is built: ``torch.export.export`` captures the module (in its current train/eval
mode; a plain function is wrapped in a module), ``run_decompositions`` with dynajax's
table gives the core ATen graph the backend sees, then the whole-graph driver
(``program/``) lowers it under jax_function's ``Policy``: ``run_passes``, the capability
verdicts, and the lowering table through ``ExportInterpreter``. There is no
partitioning: the whole graph is one JAX function. Ops without a JAX rule run in eager
PyTorch through host callbacks (``program/callbacks.py``), listed in ``fn.callbacks``;
``strict=True`` refuses them.

The export's graph signature maps the graph's placeholders to state names
(``inputs_to_parameters``, ``inputs_to_buffers``), lifted tensor constants (closed over,
converted once, not state) and user inputs, and its outputs to user outputs and the new
values of mutated buffers.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from dynajax.capability import Reason, Unsupported, verdict_of
from dynajax.errors import DynajaxError, JaxFunctionError
from dynajax.interop import kv_caches as caches
from dynajax.interop import user_passes
from dynajax.interop.autograd import (
    TorchBackward,
    in_modes,
    recorded_modes,
    with_torch_backward,
)
from dynajax.interop.checked import ValueCheckResult
from dynajax.interop.signature import Signature
from dynajax.interop.torch_export import export
from dynajax.lowering.dtypes import JAX_TO_TORCH
from dynajax.passes.user import RewriteRecord
from dynajax.program import Policy, Program, lower
from dynajax.program.callbacks import eager_errors, from_numpy
from dynajax.program.interpreter import TRUNCATION_WARNING, SizeBindings
from dynajax.runtime.conversion import to_jax
from dynajax.sharding.placement import on_auto_axes

aten = torch.ops.aten

State = dict[str, jax.Array]


class BufferUpdatesDiscardedWarning(UserWarning):
    """``fn(state, ...)`` was called on a model that updates buffers: the updates are
    dropped (``fn.with_state`` returns them)."""


class InputUpdatesDiscardedWarning(UserWarning):
    """``fn(...)`` or ``fn.with_state(...)`` was called on a model that updates its
    inputs in place: the new values are dropped (``fn.with_updates`` returns them)."""


class _Run(NamedTuple):
    """What one trace of the graph computes."""

    outputs: Any  # the user outputs, nested as torch's
    updates: dict[str, jax.Array]  # new values of mutated buffers (and parameters)
    new_args: tuple[Any, ...]  # the arguments, mutated inputs replaced by their new values
    checked: ValueCheckResult | None  # the value checks, when asked for


# -- the function ------------------------------------------------------------------------


class JaxFunction:
    """A torch model as a pure JAX function of its state and inputs.

    ``fn(state, *args, key=None)`` returns the model's outputs as ``jax.Array``s, nested
    as the torch outputs (a tensor, tuple, list or dict; a ``transformers`` ModelOutput
    becomes a dict of its fields). ``state`` is a dict of every parameter and buffer by
    its torch name (``jax_function`` returns one); ``args`` are arrays (or NumPy
    arrays) nested as the example arguments.

    **Buffer updates.** A model may update buffers in place (BatchNorm's running
    statistics and ``num_batches_tracked`` in train mode). The convention is one
    function, one output structure: ``fn(...)`` always returns the outputs only, and
    ``fn.with_state(state, *args, key=None)`` always returns ``(outputs, new_state)``,
    ``new_state`` having exactly ``state``'s keys, with the updated buffers replaced. So
    each form has the same structure whatever the model does: ``fn`` drops into
    ``jax.grad`` and ``jax.vmap`` like any loss function, and ``with_state`` into
    ``jax.lax.scan`` with the state as the carry. What cannot be done by accident is
    losing the updates silently: calling ``fn(...)`` on a model that updates buffers
    warns once (``BufferUpdatesDiscardedWarning``), and ``fn.mutated_buffers`` names
    them; use ``fn.with_state(...)[0]`` to drop them on purpose, or ``model.eval()``
    before ``jax_function``.

    **Inputs updated in place.** JAX arrays are immutable, so a model that writes into
    an input (``x.add_(1)``, ``out=``, ``index_put_`` on an argument) cannot change the
    caller's array. ``fn.with_updates(state, *args, key=None)`` returns
    ``(outputs, new_state, new_args)``: ``new_args`` is ``args`` (a tuple nested the
    same way) with each input the model updates (``mutated_inputs``) replaced by its new
    value, the others passed through. ``fn`` and ``fn.with_state`` drop those values and
    warn once (``InputUpdatesDiscardedWarning``).

    **Value checks.** Where eager raises on argument *values* (an ``nn.Embedding`` index
    past the table, a ``gather`` index out of bounds, an integer division by zero), the
    rules compute eager's check in the JAX program, as in the backend
    (``lowering/checks.py``). A JAX program cannot raise from inside ``jax.jit``,
    ``jax.vmap``, ``jax.grad`` or ``jax.lax.scan``, so, as with
    ``jax.experimental.checkify``, the result of the checks is a value:
    ``outputs, err = fn.checked(state, *args)`` (also ``fn.checked.with_state`` and
    ``fn.checked.with_updates``, the same results with ``err`` last), ``err`` a
    ``ValueCheckResult`` pytree that goes through every transformation like an output;
    ``err.throw()`` outside them raises eager's exception type and message (the first
    failing element of a vmapped or scanned result). ``fn`` itself stays pure: under a
    transformation it computes no checks (invalid indices are clamped or filled, as
    everywhere in JAX), and called directly on arrays (no tracers) it checks and raises
    eager's error before returning (``jax_function(..., checks=False)`` turns that off).

    **Tied weights.** Parameters that are one tensor under two names (GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``) are one state entry, under the
    name ``model.named_parameters()`` gives it, so their gradient is the sum over both
    uses, as in PyTorch, and an optimizer keeps them tied.

    **Gradients.** Differentiate with respect to the parameters only (buffers may be
    integers, which ``jax.grad`` refuses): ``params, buffers = fn.split_state(state)``,
    then ``jax.grad(lambda p: loss(fn({**p, **buffers}, x)))(params)``.

    **Randomness.** Random ops (dropout in train mode) draw from the JAX PRNG key
    passed as ``key=``: the same key gives the same numbers, a model with random ops
    called without one raises ``JaxFunctionError``. The numbers are JAX's, not those
    eager PyTorch draws (same distributions).

    **64-bit types.** The function runs in the caller's JAX mode, because ``jax.jit``
    lowers it after it returns, under the caller's settings (a trace switching
    ``jax.enable_x64`` inside would be lowered in the other mode). With 64-bit mode on
    (``jax.config.update("jax_enable_x64", True)`` or ``with jax.enable_x64(True)``),
    torch's dtypes are kept exactly, as dynajax's backend keeps them: int64 token ids,
    buffers and outputs, float64 models, and the rules that compute in float64 to
    round as eager does. With it off (JAX's default), 64-bit values are 32-bit, as
    everywhere in JAX: ``num_batches_tracked`` and ``argmax`` are int32, a float64
    model computes in float32, and the few rules that divide or accumulate in float64
    for eager's exact rounding do it in float32 (results within float32 tolerance of
    eager's). Build the state in the mode the function will run in.

    Attributes:
        parameter_names: the state entries that are parameters, in the model's order.
        buffer_names: the state entries that are buffers.
        mutated_buffers: the buffers (and parameters) the model updates in place, whose
            new values ``with_state`` returns.
        mutated_inputs: positions (among the flattened user inputs) of inputs the model
            updates in place, whose new values ``with_updates`` returns.
        checked: the same function returning its value checks as a value
            (``fn.checked(state, *args) -> (outputs, ValueCheckResult)``).
        random_ops: the random ops that draw from ``key`` (empty: no key needed).
        callbacks: every op that runs in eager PyTorch through a host callback.
        rewrites: what each of the user's ``rewrites`` matched (``RewriteRecord``).
        graph_module: the annotated core ATen graph the function interprets.
        exported_program: the ``ExportedProgram`` it came from.
    """

    def __init__(
        self,
        ep: ExportedProgram,
        program: Program,
        aliases: Mapping[str, str],
        checks: bool = True,
        source: Any = None,
        fallback_ops: Iterable[str] = (),
        modes: Sequence[tuple[nn.Module, bool]] = (),
        rebuild: Callable[[tuple[Any, ...]], JaxFunction] | None = None,
        rewrites: Sequence[RewriteRecord] = (),
        strict: bool = False,
    ) -> None:
        self.exported_program = ep
        self.rewrites = tuple(rewrites)
        # Another export of the source at other sizes, per input shapes (_variant_for).
        self._rebuild = rebuild
        self._variants: dict[Any, JaxFunction] = {}
        self.checks = checks
        # the whole-graph driver's program (its graph, and the arrays of the tensors its
        # get_attr nodes read: a user's pass may add one)
        self.program = program
        self.graph_module = gm = program.gm
        self.callbacks = program.callbacks
        self.random_ops = program.random_ops
        sig = self.signature = Signature.of(ep, gm, aliases)
        self.parameter_names = sig.parameter_names
        self.buffer_names = sig.buffer_names
        self.mutated_buffers = sig.mutated_buffers
        self.mutated_inputs = sig.mutated_inputs
        self._warned = False
        self._warned_inputs = False
        # torch's backward as the VJP (None: JAX's autodiff of the rules).
        self.torch_backward = (
            TorchBackward(
                source,
                (*self.parameter_names, *self.buffer_names),
                self.parameter_names,
                self.signature.in_spec,
                tuple(fallback_ops),
                modes,
                strict=strict,
            )
            if source is not None
            else None
        )
        self.__name__ = "jax_function"
        self.__qualname__ = "jax_function"

    # -- public ------------------------------------------------------------------------

    def __call__(self, state: Mapping[str, Any], *args: Any, key: Any = None) -> Any:
        """The model's outputs on ``args`` with ``state`` (buffer updates dropped).

        Raises:
            Exception: eager's exception (``IndexError``, ``RuntimeError``...) when a value
                check fails in a direct call (no tracers; see the class docstring).
        """
        _warn_buffers_dropped(self)
        _warn_inputs_dropped(self)
        return self._run_checked(state, args, key).outputs

    def with_state(
        self, state: Mapping[str, Any], *args: Any, key: Any = None
    ) -> tuple[Any, State]:
        """``(outputs, new_state)``: ``new_state`` has ``state``'s keys, the buffers the
        model updates (``mutated_buffers``) replaced by their new values."""
        _warn_inputs_dropped(self)
        run = self._run_checked(state, args, key)
        return run.outputs, _new_state(state, run.updates)

    def with_updates(
        self, state: Mapping[str, Any], *args: Any, key: Any = None
    ) -> tuple[Any, State, tuple[Any, ...]]:
        """``(outputs, new_state, new_args)``: every update the model makes. ``new_args``
        is ``args`` with the inputs the model updates in place (``mutated_inputs``)
        replaced by their new values."""
        run = self._run_checked(state, args, key)
        return run.outputs, _new_state(state, run.updates), run.new_args

    @functools.cached_property
    def checked(self) -> CheckedJaxFunction:
        """This function with its value checks as a value: ``fn.checked(state, *args)``
        returns ``(outputs, err)``, ``fn.checked.with_state`` ``(outputs, new_state,
        err)``, ``fn.checked.with_updates`` ``(outputs, new_state, new_args, err)``; call
        ``err.throw()`` outside JAX transformations to raise eager's error."""
        return CheckedJaxFunction(self)

    def _run_checked(self, state: Mapping[str, Any], args: tuple[Any, ...], key: Any) -> _Run:
        """A run that raises eager's error for a failed value check, when the call is
        direct (no tracer among its arguments) and checks are on, and eager's own
        exception where an op run in eager PyTorch (a host callback) raised during the
        call."""
        traced = any(
            isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((dict(state), args, key))
        )
        direct = self.checks and not traced
        with eager_errors():  # (an op run in eager PyTorch raised: eager's exception)
            run = self._run(state, args, key, check=direct)
        if run.checked is not None:
            run.checked.throw()
        return run

    def load_into(self, model: nn.Module, state: Mapping[str, Any], *, copy: bool = True) -> None:
        """Writes ``state`` (the function's state dict, trained in JAX, say) into the
        torch module's parameters and buffers, for ``save_pretrained``, evaluation or
        more training in PyTorch.

        ``model`` is the module ``jax_function`` was built from or one of the same
        architecture; every state entry must name one of its parameters or buffers with
        the same shape (a tied weight is written once, under either name). Sharded
        arrays are gathered. ``copy=False`` makes each tensor a zero-copy view of its
        array where the devices allow (CPU arrays into a CPU module, a GPU array into a
        tensor on the same GPU): no memory is added, but the arrays are then shared
        with torch, and a torch in-place update (an optimizer step) writes into memory
        JAX takes as immutable; the default copies.

        Raises:
            JaxFunctionError: an entry the module does not have, or of another shape or
                dtype; nothing is written then.
        """
        self.signature.load_into(model, state, copy=copy)

    def split_state(self, state: Mapping[str, Any]) -> tuple[State, State]:
        """``(parameters, buffers)`` of a state dict: differentiate the first."""
        params = {n: state[n] for n in self.parameter_names if n in state}
        buffers = {n: v for n, v in state.items() if n not in params}
        return params, buffers

    @property
    def report(self) -> str:
        """What runs where: the op count in JAX and every host callback."""
        return _report(self)

    def __repr__(self) -> str:
        return (
            f"<dynajax.JaxFunction: {len(self.parameter_names)} parameters, "
            f"{len(self.buffer_names)} buffers, {len(self.callbacks)} host callback(s)>"
        )

    # -- the trace ---------------------------------------------------------------------

    def _run(
        self, state: Mapping[str, Any], args: tuple[Any, ...], key: Any, *, check: bool
    ) -> _Run:
        if key is None and self.random_ops:
            first = self.random_ops[0]
            more = len(self.random_ops) - 1
            raise JaxFunctionError(
                f"this model draws random numbers ({first}"
                + (f", and {more} more random op(s): fn.random_ops" if more else "")
                + "), so its JAX function needs a PRNG key: fn(state, *args, "
                "key=jax.random.key(0)). The same key gives the same numbers; split it "
                "(jax.random.split) for fresh ones. In eval mode dropout draws nothing."
            )
        if not isinstance(state, Mapping):
            raise JaxFunctionError(
                f"the first argument must be the state dict jax_function returned, got "
                f"{type(state).__name__}."
            )
        self.signature.check_state_keys(state)
        leaves, spec = caches.flatten_as(
            (tuple(args), {}), self.signature.in_spec, self.signature.jax_in_spec
        )
        variant = self._variant_for(leaves)
        if variant is not self:
            return variant._run(state, args, key, check=check)
        with warnings.catch_warnings():
            # Rules ask for int64/float64 by name; with JAX's 64-bit mode off JAX warns
            # that it gives 32 bits, which is this mode's documented behaviour.
            warnings.filterwarnings("ignore", TRUNCATION_WARNING, UserWarning)
            values, sizes = self.signature.values(state, leaves)
            results, checked = _interpret(self, values, key, sizes, check)
            outputs, updates, new_args = self.signature.decode(results, leaves, spec)
            return _Run(outputs, updates, new_args, checked)

    def _variant_for(self, leaves: list[Any]) -> JaxFunction:
        """The function for these inputs' sizes: ``self`` when every static size is the
        export's, else the model exported again at the new sizes (once per shape, as
        ``jax.jit`` retraces per shape)."""
        if self.signature.static_sizes_match(leaves) or self._rebuild is None:
            # (no source to export again: ``signature.values`` says which size differs)
            return self
        key = tuple(
            (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf)))) for leaf in leaves
        )
        found = self._variants.get(key)
        if found is None:
            found = _export_again(self._rebuild, leaves, self.signature.in_spec)
            self._variants[key] = found
        return found


class CheckedJaxFunction:
    """A ``JaxFunction`` that returns its value checks as a value (``fn.checked``).

    Each call returns the plain form's result with a ``ValueCheckResult`` last; it
    never raises for a failed check, so it works under every JAX transformation. An op
    run in eager PyTorch (a host callback) that raises during the call raises eager's
    own exception, as ``fn`` does.
    """

    def __init__(self, fn: JaxFunction) -> None:
        self.fn = fn
        self.__name__ = "jax_function_checked"
        self.__qualname__ = "jax_function_checked"

    def __call__(
        self, state: Mapping[str, Any], *args: Any, key: Any = None
    ) -> tuple[Any, ValueCheckResult]:
        """``(outputs, err)``; drops buffer and input updates, warning once as ``fn``."""
        _warn_buffers_dropped(self.fn)
        _warn_inputs_dropped(self.fn)
        with eager_errors():
            run = self.fn._run(state, args, key, check=True)
        assert run.checked is not None
        return run.outputs, run.checked

    def with_state(
        self, state: Mapping[str, Any], *args: Any, key: Any = None
    ) -> tuple[Any, State, ValueCheckResult]:
        """``(outputs, new_state, err)``, as ``JaxFunction.with_state``."""
        with eager_errors():
            run = self.fn._run(state, args, key, check=True)
        assert run.checked is not None
        return run.outputs, _new_state(state, run.updates), run.checked

    def with_updates(
        self, state: Mapping[str, Any], *args: Any, key: Any = None
    ) -> tuple[Any, State, tuple[Any, ...], ValueCheckResult]:
        """``(outputs, new_state, new_args, err)``, as ``JaxFunction.with_updates``."""
        with eager_errors():
            run = self.fn._run(state, args, key, check=True)
        assert run.checked is not None
        return run.outputs, _new_state(state, run.updates), run.new_args, run.checked


def _new_state(state: Mapping[str, Any], updates: Mapping[str, jax.Array]) -> State:
    """``state`` with the updated entries replaced (same keys)."""
    new_state = dict(state)
    new_state.update(updates)
    return new_state


def _is_host_scalar(n: torch.fx.Node) -> bool:
    verdict = verdict_of(n)
    return isinstance(verdict, Unsupported) and verdict.reason is Reason.HOST_SCALAR


def _interpret(
    fn: JaxFunction, values: list[Any], key: Any, sizes: SizeBindings, check: bool
) -> tuple[list[Any], ValueCheckResult | None]:
    """``fn``'s graph's outputs on ``values`` (and its value checks when ``check``),
    differentiated by torch's backward (``interop/autograd.py``) unless the model
    draws random numbers."""
    positions = [i for i, v in enumerate(values) if hasattr(v, "shape")]
    recorded: list[Any] = []

    def primal(*arrays: Any) -> tuple[tuple[Any, ...], Any]:
        vals = list(values)
        for i, a in zip(positions, arrays, strict=True):
            # JAX may hand a custom VJP's function NumPy-backed constants (empty
            # arrays): the rules take jax.Arrays.
            vals[i] = a if isinstance(a, jax.Array) else jnp.asarray(a)
        results, vector, found = fn.program.run(vals, key=key, sizes=sizes, check=check)
        if not check:
            return tuple(results), None
        recorded[:] = found
        return tuple(results), vector

    arrays = [values[i] for i in positions]
    results, vector = on_auto_axes(
        lambda *a: _differentiated(fn, primal, a, values, positions), arrays
    )
    checked = ValueCheckResult(vector, recorded) if check else None
    return list(results), checked


def _differentiated(
    fn: JaxFunction,
    primal: Callable[..., Any],
    arrays: Any,
    values: list[Any],
    positions: list[int],
) -> tuple[Any, Any]:
    """``primal(*arrays)``, with torch's backward as its VJP where ``fn`` has one and
    draws no random numbers."""
    if fn.torch_backward is None or fn.random_ops:
        results, vector = primal(*arrays)
    else:
        arg = {v: a for a, v in enumerate(positions)}
        first: dict[str, int] = {}
        leaves: dict[int, Any] = {}
        for i, inp in enumerate(fn.signature.inputs):
            if inp.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                first.setdefault(inp.name, arg[i])
            elif inp.kind is InputKind.USER_INPUT:
                leaves[int(inp.name)] = arg[i] if i in arg else ("value", values[i])
        layout = {
            "state": [first[n] for n in fn.torch_backward.state_names],
            "leaves": [leaves[k] for k in sorted(leaves)],
            "outputs": [
                k
                for k, (kind, _) in enumerate(fn.signature.outputs)
                if kind is OutputKind.USER_OUTPUT
            ],
        }
        results, vector = with_torch_backward(primal, fn.torch_backward, layout)(*arrays)
    return results, vector


def _warn_buffers_dropped(fn: JaxFunction) -> None:
    """Once per function: ``fn(state, ...)`` drops the buffers the model updates."""
    if fn.mutated_buffers and not fn._warned:
        fn._warned = True
        warnings.warn(
            f"this model updates buffers in place ({', '.join(fn.mutated_buffers)}), "
            "and fn(state, ...) returns the outputs only, dropping the new values. "
            "Use fn.with_state(state, ...) -> (outputs, new_state) to keep them (or "
            "[0] of it to drop them on purpose), or export the model in eval mode.",
            BufferUpdatesDiscardedWarning,
            stacklevel=3,
        )


def _warn_inputs_dropped(fn: JaxFunction) -> None:
    """Once per function: ``fn(...)`` and ``fn.with_state(...)`` drop the inputs the
    model updates in place."""
    if fn.mutated_inputs and not fn.signature.updates_returned and not fn._warned_inputs:
        fn._warned_inputs = True
        warnings.warn(
            f"this model updates its inputs in place (positions {list(fn.mutated_inputs)} "
            "of the flattened arguments), and JAX arrays are immutable: fn(...) and "
            "fn.with_state(...) drop the new values. Use fn.with_updates(state, ...) -> "
            "(outputs, new_state, new_args) to get them.",
            InputUpdatesDiscardedWarning,
            stacklevel=3,
        )


def _report(fn: JaxFunction) -> str:
    """``fn.report``: the op count in JAX, every host callback, the random ops, the
    buffers updated and the user's rewrites."""
    nodes = [
        n
        for n in fn.graph_module.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and not _is_host_scalar(n)
    ]
    lines = [
        f"dynajax jax_function: {len(nodes) - len(fn.callbacks)}/{len(nodes)} ATen ops "
        f"in JAX, {len(fn.callbacks)} host callback(s)"
    ]
    if fn.callbacks:
        lines.append("  run in eager PyTorch through host callbacks:")
        lines += [f"    {c.describe()}" for c in fn.callbacks]
    if fn.random_ops:
        lines.append(f"  random ops (need key=): {', '.join(fn.random_ops)}")
    if fn.mutated_buffers:
        lines.append(f"  buffers updated (fn.with_state): {', '.join(fn.mutated_buffers)}")
    lines += user_passes.describe(fn.rewrites)
    return "\n".join(lines)


def _export_again(
    rebuild: Callable[[tuple[Any, ...]], JaxFunction], leaves: list[Any], in_spec: Any
) -> JaxFunction:
    """The model exported again at the sizes of ``leaves`` (the flattened arguments),
    or ``JaxFunctionError`` saying torch.export's reason where it cannot be."""
    examples = [_example_like(leaf) for leaf in leaves]
    args, _ = pytree.tree_unflatten(examples, in_spec)
    try:
        return rebuild(tuple(args))
    except DynajaxError:
        raise
    except Exception as e:
        sizes = ", ".join(str(tuple(np.shape(leaf))) for leaf in leaves)
        raise JaxFunctionError(
            f"the model cannot run at these input sizes ({sizes}): torch.export of "
            f"it at them failed with {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e


# -- building ----------------------------------------------------------------------------


def jax_function(
    module_or_fn: nn.Module | Callable[..., Any],
    *example_args: Any,
    dynamic_shapes: Any = None,
    strict: bool = False,
    fallback_ops: Iterable[str] = (),
    checks: bool = True,
    passes: Any = None,
    rewrites: Any = (),
) -> tuple[JaxFunction, State]:
    """A torch model as a pure JAX function, and the model's state as a pytree.

        fn, state = dynajax.jax_function(model, x)
        y = jax.jit(fn)(state, x)                    # == model(x), as jax.Arrays

    Args:
        module_or_fn: an ``nn.Module`` (exported in its current train/eval mode) or a
            function of tensors (tensors it closes over become constants, not state).
        *example_args: example inputs (tensors or arrays, or tuples/lists/dicts of
            them), as for ``torch.export.export``; the function takes arrays nested the
            same way.
        dynamic_shapes: ``torch.export``'s ``dynamic_shapes`` (``torch.export.Dim``) for
            dims that may vary in one symbolic program (``dynajax.export``'s symbolic
            dims). Without them, a call at other sizes than the example's exports the
            model again at those sizes, once per shape (as ``jax.jit`` retraces per
            shape); where the model cannot run at a size, ``JaxFunctionError`` gives
            torch.export's reason.
        strict: raise ``CallbackOpsError`` listing every op without a JAX rule (with
            its source line), instead of running those ops in eager PyTorch through
            host callbacks. It holds for torch's backward too: where ``jax.grad``
            differentiates through torch's own backward graph (``interop/autograd.py``)
            and that graph has an op without a rule, the error comes when
            ``jax.grad`` traces, not here.
        fallback_ops: ops to run in eager PyTorch through host callbacks even where a
            JAX rule exists, as the backend's option of that name: ``"aten.sort"`` (all
            overloads) or ``"aten.sort.default"``. ``strict`` accepts these.
        checks: whether a direct call of ``fn`` (arrays, no tracers) computes eager's
            value checks and raises eager's error (an index out of range, an integer
            division by zero). Under JAX transformations ``fn`` computes none either
            way; ``fn.checked`` returns them as a value (``err.throw()`` raises).
        passes: the user's graph passes by stage, as the backend's option of that name
            (``{"pre_aot": [...], "post_aot": [...], "post_passes": [...]}``):
            ``pre_aot`` on the model's torch-level graph (captured with Dynamo),
            ``post_aot``/``post_passes`` on the exported ATen graph, before/after
            dynajax's passes (``interop/user_passes.py``).
        rewrites: ``dynajax.Rewrite``s applied to the torch-level graph, as the
            backend's option; ``fn.rewrites`` and ``fn.report`` say what matched. The
            gradients are those of the rewritten model.

    Returns:
        ``(fn, state)``: the ``JaxFunction`` (``fn(state, *args, key=None)``; see its
        docstring for buffer updates, gradients and random keys) and a dict of every
        parameter and buffer as a ``jax.Array`` (a copy), keyed by its torch name
        (``"0.weight"``).

    Raises:
        CallbackOpsError: ``strict`` and some ops have no JAX rule.
        JaxFunctionError: the graph has what a JAX function cannot express (sizes that
            depend on tensor data, dtypes JAX lacks, control-flow submodules).
    """
    examples = pytree.tree_map(_example_tensor, tuple(example_args))
    modes = recorded_modes(module_or_fn)
    user = user_passes.UserPasses.of(passes, rewrites)

    def build(examples: tuple[Any, ...]) -> JaxFunction:
        return _build(
            module_or_fn,
            examples,
            dynamic_shapes=dynamic_shapes,
            strict=strict,
            fallback_ops=tuple(fallback_ops),
            checks=checks,
            modes=modes,
            rebuild=build,
            user=user,
        )

    fn = build(examples)
    ep = fn.exported_program
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", TRUNCATION_WARNING, UserWarning)
        state = {name: _state_array(ep, name) for name in (*fn.parameter_names, *fn.buffer_names)}
    return fn, state


def _build(
    module_or_fn: nn.Module | Callable[..., Any],
    examples: tuple[Any, ...],
    *,
    dynamic_shapes: Any,
    strict: bool,
    fallback_ops: tuple[str, ...],
    checks: bool,
    modes: list[tuple[nn.Module, bool]],
    rebuild: Callable[[tuple[Any, ...]], JaxFunction] | None,
    user: user_passes.UserPasses,
) -> JaxFunction:
    """The ``JaxFunction`` of one export of ``module_or_fn`` at ``examples``' sizes (each
    submodule in the train/eval mode it had when ``jax_function`` was called), with the
    user's rewrites and passes."""
    with in_modes(modes):
        source, records = user_passes.rewritten(module_or_fn, examples, user)
        ep = export(source, examples, dynamic_shapes)
    program = lower(
        ep.graph_module,
        Policy(
            JaxFunctionError,
            "these ops of the exported graph cannot be part of a JAX function (JAX needs "
            "every shape at trace time, and the dtypes to exist in JAX):",
            fallback_ops=fallback_ops,
            strict=strict,
            before=user.at("post_aot"),
            after=user.at("post_passes"),
        ),
    )
    return JaxFunction(
        ep,
        program,
        _tied_names(module_or_fn),
        checks,
        source=source,
        fallback_ops=fallback_ops,
        modes=modes,
        rebuild=rebuild,
        rewrites=records,
        strict=strict,
    )


def _example_like(leaf: Any) -> Any:
    """An example input for another export at ``leaf``'s size: its values when it has
    them, zeros of its shape and dtype under a JAX trace."""
    if isinstance(leaf, jax.core.Tracer):
        return torch.zeros(leaf.shape, dtype=JAX_TO_TORCH[np.dtype(leaf.dtype)])
    if isinstance(leaf, jax.Array | np.ndarray):
        return _example_tensor(leaf)
    return leaf


def _example_tensor(value: Any) -> Any:
    """An example argument for torch.export: arrays (JAX or NumPy) as tensors (copies),
    tensors contiguous. The function takes arrays, which are values in row-major order,
    so ops that read memory order (``as_strided``) must be traced on that layout, not
    on the example's strides."""
    if isinstance(value, jax.Array | np.ndarray):
        return from_numpy(np.array(value))
    if isinstance(value, torch.Tensor) and not value.is_contiguous():
        return value.contiguous()
    return value


def _tied_names(module_or_fn: Any) -> dict[str, str]:
    """Each name of a parameter or buffer that is also reachable under an earlier name
    (a tied weight), mapped to that first name: the one ``named_parameters()`` and
    ``named_buffers()`` give it."""
    if not isinstance(module_or_fn, nn.Module):
        return {}
    first: dict[int, str] = {}
    aliases = {}
    for name, t in (
        *module_or_fn.named_parameters(remove_duplicate=False),
        *module_or_fn.named_buffers(remove_duplicate=False),
    ):
        canonical = first.setdefault(id(t), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _state_array(ep: ExportedProgram, name: str) -> jax.Array:
    value = ep.state_dict.get(name)
    if value is None:
        value = ep.constants.get(name)  # non-persistent buffers
    if not isinstance(value, torch.Tensor):
        raise JaxFunctionError(f"no tensor for the state entry '{name}' in the export.")
    return jnp.array(to_jax(value.detach()))

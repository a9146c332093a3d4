"""``jax.grad`` of a ``jax_function`` is ``torch.autograd``'s gradient.

JAX's autodiff of the lowering rules is not torch's derivative everywhere: an
``nn.Embedding`` with ``padding_idx`` gives its padding row no gradient in torch, a
``torch.autograd.Function`` has its own backward (a straight-through estimator), and
torch picks its own subgradients (``abs``, ``relu``, ``clamp`` and ``norm`` at 0, ties in
``max``), NaN and inf. So a ``JaxFunction`` is a ``jax.custom_vjp`` whose backward is
torch's: ``TorchBackward`` traces, per input signature, the function

    (state, inputs, cotangents) -> torch.autograd.grad(outputs, (parameters, inputs),
                                                       cotangents)

of the user's own module with ``aot.functional_graph`` (below autograd: torch's formulas
and every ``autograd.Function``'s backward are what it records), lowers that graph
through the same rules as the forward, and runs it as the VJP. The forward stays the
exported program. The backward graph recomputes the forward it needs (XLA shares what it
can with the forward's program under ``jax.jit``).

Forward mode of the function itself (``jax.jvp``, ``jax.jacfwd``) has no torch rule here:
JAX refuses forward mode of a custom VJP, and torch's backward gives VJPs only. The call
raises ``JaxFunctionError`` (``FORWARD_MODE_ERROR``: why, and what works instead) where
JAX would raise its own "can't apply forward-mode autodiff (jvp) to a custom_vjp
function" (JAX's remains where the function was traced before forward mode began:
``jax.jvp`` of a ``jax.jit`` of it, and applying ``jax.linearize``'s result). Forward
mode over the backward works: ``jax.hessian`` (``jacfwd`` of ``jacrev``) and
Hessian-vector products (``jax.jvp`` of ``jax.grad``) differentiate torch's backward
graph, ordinary JAX operations, and give ``torch.func.hessian``'s answer, except through
an op run in eager PyTorch (a host callback: its error names the op). A model with random
ops (dropout in train mode) keeps JAX's autodiff of the rules, forward mode included,
because its backward would draw other numbers than its forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree
from jax.custom_derivatives import SymbolicZero
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from dynajax.aot.tracing import functional_graph
from dynajax.errors import JaxFunctionError
from dynajax.lowering.dtypes import JAX_TO_TORCH
from dynajax.passes.recompute import recomputed_regions
from dynajax.program import Policy, Program, lower
from dynajax.program.callbacks import in_forward_mode
from dynajax.program.replay import ReplayedRandom
from dynajax.program.residuals import split_joint

FORWARD_MODE_ERROR = (
    "forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) of a jax_function is not "
    "supported: its derivatives are torch's backward (the function is a jax.custom_vjp whose "
    "VJP is torch.autograd.grad of the model, so that jax.grad equals torch.autograd), and "
    "JAX has no forward mode for a custom_vjp. Use reverse mode: jax.grad, jax.vjp, "
    "jax.value_and_grad or jax.jacrev (a Jacobian row by row). Second derivatives work: "
    "jax.hessian and jax.jvp of jax.grad run forward mode over torch's backward, which is "
    "ordinary JAX."
)
# JAX's own message for forward mode of a custom_vjp, which FORWARD_MODE_ERROR replaces.
_JAX_FORWARD_MODE = "forward-mode autodiff (jvp) to a custom_vjp"


def recorded_modes(source: Any) -> list[tuple[nn.Module, bool]]:
    """Each submodule of ``source`` (an ``nn.Module``; else none) with its train/eval
    mode now."""
    return [(m, m.training) for m in source.modules()] if isinstance(source, nn.Module) else []


@contextlib.contextmanager
def in_modes(modes: Sequence[tuple[nn.Module, bool]]) -> Iterator[None]:
    """The submodules in the recorded ``modes`` for the length of the block (a trace
    after the user switched the model to eval or train), restored after."""
    saved = [(m, m.training) for m, _ in modes]
    try:
        for m, mode in modes:
            m.training = mode
        yield
    finally:
        for m, mode in saved:
            m.training = mode


def _inexact(dtype: Any) -> bool:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


class TorchBackward:
    """torch's VJP of a ``jax_function``'s source, as JAX computations.

    Args:
        source: the user's ``nn.Module`` or function (what was exported).
        state_names: the state entries, in the order ``vjp`` takes them.
        parameter_names: which of them are parameters (differentiated).
        in_spec: the pytree spec of ``(args, kwargs)`` of the user inputs.
        fallback_ops: the backend option (ops kept in eager PyTorch).
        modes: each submodule's train/eval mode when ``jax_function`` was called
            (``recorded_modes``): the trace runs in them, as the export did.
        strict: the function's ``strict``: callbacks in the backward are refused too.
    """

    def __init__(
        self,
        source: nn.Module | Any,
        state_names: Sequence[str],
        parameter_names: Sequence[str],
        in_spec: pytree.TreeSpec,
        fallback_ops: Sequence[str],
        modes: Sequence[tuple[nn.Module, bool]] = (),
        *,
        strict: bool = False,
    ) -> None:
        self.strict = strict
        self.source = source
        self.state_names = list(state_names)
        self.parameter_names = set(parameter_names)
        self.in_spec = in_spec
        self.fallback_ops = tuple(fallback_ops)
        self.modes = list(modes)
        self._graphs: dict[Any, tuple[Program, list[int]]] = {}
        self._splits: dict[Any, tuple[Program, Program, list[int], int] | None] = {}

    def _key(
        self, arrays: Sequence[Any], leaves: Sequence[Any], perturbed: Sequence[bool]
    ) -> tuple[Any, ...]:
        return (
            tuple((tuple(a.shape), np.dtype(a.dtype)) for a in arrays),
            tuple(repr(v) for v in leaves if not _is_array(v)),
            tuple(perturbed),
        )

    def vjp(
        self,
        state: Sequence[Any],
        leaves: Sequence[Any],
        cotangents: Sequence[Any],
        perturbed: Sequence[bool],
    ) -> tuple[list[Any], list[Any]]:
        """The gradients of ``<cotangents, outputs>`` with respect to the state entries
        and the user inputs that are ``perturbed`` (being differentiated: one flag per
        state entry and user input), None elsewhere (and for buffers, integers and
        unused inputs), by the whole joint graph (the forward computed again). ``leaves``:
        the user inputs, arrays or the Python values the export fixed."""
        # JAX may pass NumPy-backed constants (empty arrays): the rules take jax.Arrays.
        arrays = _arrays((*state, *leaves, *cotangents))
        key = self._key(arrays, leaves, perturbed)
        found = self._graphs.get(key)
        if found is None:
            examples = _examples((*state, *leaves, *cotangents))
            gm, positions = self._joint(state, leaves, examples, perturbed, outputs=False)
            found = self._graphs[key] = (lower(gm, self._policy(True)), positions)
        program, positions = found
        grads, _, _ = program.run(arrays)
        return _placed(positions, grads, len(state), len(leaves))

    def split(
        self,
        state: Sequence[Any],
        leaves: Sequence[Any],
        outputs: Sequence[Any],
        perturbed: Sequence[bool],
    ) -> tuple[list[Any], list[Any]] | None:
        """torch's forward and backward for these inputs as two programs, the backward
        reading what the forward saved (``program/residuals.py``), where the joint
        graph splits: not where a checkpoint recomputes a region in the backward
        (saving it would undo the checkpoint) or the split is impossible (None: the
        VJP then runs the whole joint graph, ``vjp``). ``outputs``: the function's
        outputs (their shapes and dtypes are the cotangents'). Returns the forward's
        outputs and its residuals."""
        primals = _arrays((*state, *leaves))
        key = self._key(primals, leaves, perturbed)
        if key not in self._splits:
            cts = [jax.ShapeDtypeStruct(o.shape, _cotangent_dtype(o.dtype)) for o in outputs]
            examples = _examples((*state, *leaves, *cts))
            gm, positions = self._joint(state, leaves, examples, perturbed, outputs=True)
            parts = None
            if not recomputed_regions(gm.graph):
                parts = split_joint(gm, len(primals), len(outputs))
            self._splits[key] = (
                None
                if parts is None
                else (
                    lower(parts.forward, self._policy(False)),
                    lower(parts.backward, self._policy(False)),
                    positions,
                    len(outputs),
                )
            )
        found = self._splits[key]
        if found is None:
            return None
        forward, _, _, n_outputs = found
        # (a value the forward makes from constants alone, a ``full``, is a NumPy array)
        results = _arrays(forward.run(primals)[0])
        return results[:n_outputs], results[n_outputs:]

    def from_saved(
        self,
        state: Sequence[Any],
        leaves: Sequence[Any],
        residuals: Sequence[Any],
        cotangents: Sequence[Any],
        perturbed: Sequence[bool],
    ) -> tuple[list[Any], list[Any]]:
        """The gradients (as ``vjp``'s) by the split backward, from the ``residuals``
        its forward saved (``split``, called on the same inputs)."""
        found = self._splits[self._key(_arrays((*state, *leaves)), leaves, perturbed)]
        assert found is not None
        _, backward, positions, _ = found
        grads, _, _ = backward.run(_arrays([*residuals, *cotangents]))
        return _placed(positions, grads, len(state), len(leaves))

    def _policy(self, recompute: bool) -> Policy:
        return Policy(
            JaxFunctionError,
            "torch's backward of this function has ops a JAX function cannot hold:",
            fallback_ops=self.fallback_ops,
            strict=self.strict,
            keep_recomputation=recompute,
        )

    def _joint(
        self,
        state: Sequence[Any],
        leaves: Sequence[Any],
        examples: Sequence[torch.Tensor],
        perturbed: Sequence[bool],
        *,
        outputs: bool,
    ) -> tuple[torch.fx.GraphModule, list[int]]:
        """The joint graph ``(state, inputs, cotangents) -> ([outputs,] gradients)`` (the
        function's output tensors first where ``outputs``) and the positions, among
        state and inputs, of its gradients."""
        n_state = len(state)
        traced = [i for i, a in enumerate([*state, *leaves]) if _is_array(a)]
        # Only what JAX differentiates requires grad in the trace, as in the user's own
        # torch program (BatchNorm's running statistics never do; an input written in
        # place must not be a leaf that requires grad).
        wrt = [
            i
            for i, a in enumerate([*state, *leaves])
            if _is_array(a) and _inexact(a.dtype) and perturbed[i]
        ]
        positions: list[int] = []

        def joint(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tensors: list[Any] = [*state, *leaves]  # Python values stay as they are
            for i, t in zip(traced, flat, strict=False):
                tensors[i] = t
            cts = flat[len(traced) :]
            for i in wrt:
                tensors[i] = tensors[i].detach().requires_grad_(True)
            values = dict(zip(self.state_names, tensors[:n_state], strict=True))
            args, kwargs = pytree.tree_unflatten(tensors[n_state:], self.in_spec)
            replayed = ReplayedRandom()
            with contextlib.ExitStack() as scope:
                scope.enter_context(torch.enable_grad())
                scope.callback(replayed.restore)
                if isinstance(self.source, nn.Module):
                    # The traced state stays the module's through the backward too,
                    # where torch.utils.checkpoint runs the forward again.
                    scope.enter_context(
                        _reparametrize_module(self.source, values, tie_weights=True)
                    )
                scope.enter_context(replayed)
                out = self.source(*args, **kwargs)
                results = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
                if len(results) != len(cts):
                    raise JaxFunctionError(
                        f"torch's backward of this function sees {len(results)} output "
                        f"tensors where the export has {len(cts)}; please report this bug."
                    )
                pairs = [
                    (o, c)
                    for o, c in zip(results, cts, strict=True)
                    if o.requires_grad and (o.is_floating_point() or o.is_complex())
                ]
                inputs = [tensors[i] for i in wrt]
                grads = (
                    torch.autograd.grad(
                        [o for o, _ in pairs],
                        inputs,
                        [c.to(o.dtype) for o, c in pairs],
                        allow_unused=True,
                    )
                    if pairs
                    else [None] * len(inputs)
                )
            positions.clear()
            found = []
            for i, g in zip(wrt, grads, strict=True):
                if g is not None:
                    positions.append(i)
                    found.append(g.detach())
            forward = [o.detach() for o in results] if outputs else []
            return (*forward, *found)

        try:
            with in_modes(self.modes):
                gm = functional_graph(joint, examples)
        except JaxFunctionError:
            raise
        except Exception as e:
            raise JaxFunctionError(
                "torch's backward of this function could not be traced for jax.grad: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
        return gm, list(positions)


def _placed(
    positions: Sequence[int], grads: Sequence[Any], n_state: int, n_leaves: int
) -> tuple[list[Any], list[Any]]:
    """The gradients at their ``positions`` among state entries and inputs, None
    elsewhere: (state's, inputs')."""
    out: list[Any] = [None] * (n_state + n_leaves)
    for position, grad in zip(positions, grads, strict=True):
        out[position] = grad
    return out[:n_state], out[n_state:]


def _arrays(values: Sequence[Any]) -> list[Any]:
    """The arrays among ``values``, as ``jax.Array``s (JAX may pass NumPy-backed
    constants)."""
    return [a if isinstance(a, jax.Array) else jax.numpy.asarray(a) for a in values if _is_array(a)]


def _examples(values: Sequence[Any]) -> list[torch.Tensor]:
    """Tensors of the arrays' shapes and dtypes, for a trace (never read)."""
    return [
        torch.empty(a.shape, dtype=JAX_TO_TORCH[np.dtype(a.dtype)]) for a in values if _is_array(a)
    ]


def _cotangent_dtype(dtype: Any) -> Any:
    """The dtype of an output's cotangent as the VJP gets it (``_dense``)."""
    return dtype if _inexact(dtype) else jax.numpy.float32


def with_torch_backward(primal: Any, backward: TorchBackward, layout: Mapping[str, Any]) -> Any:
    """``primal(*arrays) -> (results, extra)`` as a ``jax.custom_vjp`` whose VJP is
    ``backward``'s. ``layout``: ``state`` (argument positions of the state entries, in
    ``backward.state_names`` order), ``leaves`` (per user input, its argument position,
    or its Python value as ``("value", v)``), ``outputs`` (positions among ``results`` of
    the user outputs)."""
    state_pos: list[int] = layout["state"]
    leaf_pos: list[Any] = layout["leaves"]
    out_pos: list[int] = layout["outputs"]

    @jax.custom_vjp
    def run(*arrays: Any) -> Any:
        return primal(*arrays)

    def inputs(arrays: Sequence[Any], flags: Sequence[Any]) -> tuple[Any, Any, Any]:
        """The state entries, the user inputs and which of both are differentiated."""
        mask = [f is not None for f in flags]
        state = [arrays[p] for p in state_pos]
        leaves = [p[1] if isinstance(p, tuple) else arrays[p] for p in leaf_pos]
        perturbed = [mask[p] for p in state_pos]
        perturbed += [False if isinstance(p, tuple) else mask[p] for p in leaf_pos]
        return state, leaves, perturbed

    def fwd(*primals: Any) -> Any:
        arrays = [p.value for p in primals]
        # Which inputs are differentiated, kept in the residuals' tree structure (static:
        # () where perturbed, None where not), so bwd reads it as Python values.
        flags = tuple(() if p.perturbed else None for p in primals)
        results, extra = primal(*arrays)
        state, leaves, perturbed = inputs(arrays, flags)
        split = backward.split(state, leaves, [results[p] for p in out_pos], perturbed)
        if split is None:
            return (results, extra), (arrays, flags, None)
        # torch's forward saved what its backward reads: its outputs are the function's
        # (the program's own, where only they would read them, XLA drops).
        outputs, saved = split
        results = list(results)
        for p, o in zip(out_pos, outputs, strict=True):
            if o.shape == results[p].shape and o.dtype == results[p].dtype:
                results[p] = o
        return (tuple(results), extra), (arrays, flags, saved)

    def bwd(residuals: Any, cts: Any) -> Any:
        arrays, flags, saved = residuals
        results_ct, _ = cts
        state, leaves, perturbed = inputs(arrays, flags)
        outs = [_dense(results_ct[p]) for p in out_pos]
        if saved is None:
            state_grads, leaf_grads = backward.vjp(state, leaves, outs, perturbed)
        else:
            state_grads, leaf_grads = backward.from_saved(state, leaves, saved, outs, perturbed)
        grads: list[Any] = [None] * len(arrays)
        for p, g in zip(state_pos, state_grads, strict=True):
            grads[p] = g
        for p, g in zip(leaf_pos, leaf_grads, strict=True):
            if not isinstance(p, tuple):
                grads[p] = g
        return tuple(grads)

    run.defvjp(fwd, bwd, symbolic_zeros=True)

    def call(*arrays: Any) -> Any:
        if any(in_forward_mode(a) for a in arrays):
            raise JaxFunctionError(FORWARD_MODE_ERROR)
        try:
            return run(*arrays)
        except TypeError as e:  # JAX's own refusal, where the check above could not tell
            if _JAX_FORWARD_MODE in str(e) and not isinstance(e, JaxFunctionError):
                raise JaxFunctionError(FORWARD_MODE_ERROR) from e
            raise

    return call


def _dense(ct: Any) -> Any:
    """A cotangent as an array of a real dtype: zeros for a symbolic zero, float32
    zeros for an integer output's float0 (torch never reads it)."""
    if ct.dtype == jax.dtypes.float0:
        return jax.numpy.zeros(ct.shape, jax.numpy.float32)
    if isinstance(ct, SymbolicZero):
        return jax.numpy.zeros(ct.shape, ct.dtype)
    return ct

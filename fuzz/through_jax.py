"""Programs through ``dynajax.jax_function`` (backend ``"jax_function"`` of the fuzzer).

``via_jax_function(fn)`` is a callable with ``fn``'s signature on tensors: each call
builds ``jax_function(fn, *inputs)`` for its input signature (once), runs it under
``jax.jit`` with JAX's 64-bit mode on (dtypes exact, as the backend keeps them), and
returns torch tensors. Inputs that require grad are differentiated by ``jax.vjp`` of
the function (torch's backward as its VJP, ``interop/autograd.py``) inside a
``torch.autograd.Function``, so the checker's ``torch.autograd.grad`` of its loss
compares ``jax.grad`` through ``jax_function`` with eager's autograd. The value checks
come as a value (``fn.checked``: under ``jax.vjp`` a JAX function computes none of its
own, as documented) and the harness raises eager's error from them (``err.throw()``)
after the call, as a user of ``jax.grad`` would. Inputs the
program writes into get their new values (``fn.with_updates``), written into them (an
input whose elements share memory, stride 0, takes the new value as its own: the
reference is eager on contiguous copies, and a JAX function's update is a value).

A module program (``fuzz.rendering.ModuleProgram``) goes through as a model: ``jax_function``
exports the module (its parameters and buffers in the layouts the call loaded into
them) and each call passes their values as the function's state; parameters that
require grad are differentiated as inputs are, and buffers (or parameters) it writes
into get their new values (``fn.mutated_buffers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree

import dynajax
from dynajax.runtime.conversion import to_jax, to_torch
from fuzz.rendering import ModuleProgram

BACKEND = "jax_function"
# Its control: torch.export of the program, run by torch (``ep.module()``), no dynajax.
# A failure the same there belongs to torch.export (``upstream``), as aot_eager's does
# for the backend.
CONTROL = "torch.export"


class _Call(torch.autograd.Function):
    """One call of a JAX function on tensors; backward by its ``jax.vjp``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        run: Callable[..., Any],
        holder: dict[str, Any],
        n_grad: int,
        *inputs: torch.Tensor,
    ) -> Any:
        grad_inputs = inputs[:n_grad]
        with jax.enable_x64(True):
            diff = [to_jax(t.detach()) for t in grad_inputs]
            if n_grad:
                outs, pullback, (updates, err) = jax.vjp(run, *diff, has_aux=True)
            else:
                (outs, (updates, err)), pullback = run(), None
        err.throw()  # eager's error for a failed value check (``fn.checked``)
        ctx.pullback = pullback
        ctx.n_rest = len(inputs) - n_grad
        holder["updates"] = updates  # the new values of inputs the program writes into
        ctx.out_dtypes = [o.dtype for o in outs]
        tensors = tuple(to_torch(jax.numpy.asarray(o)).clone() for o in outs)
        flags = holder["differentiable"] or [True] * len(tensors)
        ctx.mark_non_differentiable(
            *[
                t
                for t, d in zip(tensors, flags, strict=True)
                if not (d and (t.is_floating_point() or t.is_complex()))
            ]
        )
        return tensors

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> Any:  # type: ignore[override]
        with jax.enable_x64(True):
            cot = []
            for c, dtype in zip(cts, ctx.out_dtypes, strict=True):
                if jax.numpy.issubdtype(dtype, jax.numpy.inexact):
                    cot.append(to_jax(c.detach().contiguous()).astype(dtype))
                else:
                    cot.append(np.zeros(c.shape, jax.dtypes.float0))
            grads = ctx.pullback(tuple(cot))
        rest = [None] * ctx.n_rest
        grads = [to_torch(jax.numpy.asarray(g)).clone() for g in grads]
        return (None, None, None, *grads, *rest)


def via_jax_function(fn: Callable[..., Any]) -> Callable[..., list[torch.Tensor]]:
    """``fn`` run through ``dynajax.jax_function`` (see the module docstring)."""
    if isinstance(fn, ModuleProgram):
        function = fn.function
        return fn.with_target(lambda module: _through(module, function, module), every=True)
    return _through(fn, fn, None)


def _through(
    target: Any, function: Callable[..., Any], module: torch.nn.Module | None
) -> Callable[..., list[torch.Tensor]]:
    """A callable of the program's inputs (all of them, the module's tensors in the
    state's places) that runs ``target`` (``function``, or ``module``) through
    ``jax_function``: its state the module's parameters and buffers, by name."""
    built: dict[Any, Any] = {}
    state_at = [i for i, _ in module.STATE] if module is not None else []  # type: ignore[attr-defined]

    def call(*everything: torch.Tensor) -> list[torch.Tensor]:
        names = [f"x{i}" for i in state_at]
        inputs = [t for i, t in enumerate(everything) if i not in state_at]
        tensors = [everything[i] for i in state_at] + inputs
        key = tuple((tuple(t.shape), t.dtype, t.requires_grad, t.stride()) for t in tensors)
        if key not in built:
            with jax.enable_x64(True):
                jf, _ = dynajax.jax_function(target, *[t.detach().clone() for t in inputs])
            built[key] = jf
        jf = built[key]
        grad_pos = [i for i, t in enumerate(tensors) if t.requires_grad]
        with jax.enable_x64(True):
            arrays = [to_jax(t.detach().contiguous()) for t in tensors]

        def run(*diff: Any) -> tuple[tuple[Any, ...], dict[int, Any]]:
            args = list(arrays)
            for i, d in zip(grad_pos, diff, strict=True):
                args[i] = d
            state = dict(zip(names, args[: len(names)], strict=True))
            outs, new_state, new_args, err = jf.checked.with_updates(state, *args[len(names) :])
            updates = {len(names) + i: new_args[i] for i in jf.mutated_inputs}
            updates |= {names.index(n): new_state[n] for n in jf.mutated_buffers if n in names}
            return tuple(pytree.tree_leaves(outs)), (updates, err)

        order = grad_pos + [i for i in range(len(tensors)) if i not in grad_pos]
        holder: dict[str, Any] = {"differentiable": _differentiable_outputs(function, everything)}
        outputs = _Call.apply(run, holder, len(grad_pos), *[tensors[i] for i in order])
        with torch.no_grad(), jax.enable_x64(True):
            for i, value in holder.get("updates", {}).items():
                new = to_torch(jax.numpy.asarray(value))
                if torch._debug_has_internal_overlap(tensors[i]) == 0:
                    tensors[i].copy_(new)
                else:  # elements that share memory take no write: the new value, as is
                    tensors[i].data = new.clone()
        return list(outputs)

    return call


def _differentiable_outputs(fn: Callable[..., Any], inputs: Any) -> list[bool] | None:
    """Which outputs of ``fn`` carry autograd history from the inputs that require
    grad (a JAX function's outputs have none of their own), from a run on fake
    tensors; None (every floating output) where that run fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in inputs]
            outs = pytree.tree_leaves(fn(*fakes))
        return [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
    except Exception:
        return None


def via_torch_export(fn: Callable[..., Any]) -> Callable[..., list[torch.Tensor]]:
    """``fn`` exported by ``torch.export`` at each call's inputs and run by torch (a
    module program's function, its state passed as inputs)."""
    from dynajax.interop.torch_export import export

    if isinstance(fn, ModuleProgram):
        function = fn.function
        return fn.with_target(lambda module: via_torch_export(function), every=True)

    def call(*inputs: torch.Tensor) -> list[torch.Tensor]:
        ep = export(fn, tuple(t.detach().clone() for t in inputs))
        return list(pytree.tree_leaves(ep.module()(*inputs)))

    return call

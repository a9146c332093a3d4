"""Programs through ``dynajax.jax_function`` (backend ``"jax_function"`` of the fuzzer).

``via_jax_function(fn)`` is a callable with ``fn``'s signature on tensors: each call
builds ``jax_function(fn, *inputs)`` for its input signature (once), runs it under
``jax.jit`` with JAX's 64-bit mode on (dtypes exact, as the backend keeps them), and
returns torch tensors. Inputs that require grad are differentiated by ``jax.vjp`` of
the function (torch's backward as its VJP, ``interop/autograd.py``) inside a
``torch.autograd.Function``, so the checker's ``torch.autograd.grad`` of its loss
compares ``jax.grad`` through ``jax_function`` with eager's autograd. Inputs the
program writes into get their new values (``fn.with_updates``).
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
                outs, pullback, updates = jax.vjp(run, *diff, has_aux=True)
            else:
                (outs, updates), pullback = run(), None
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
    built: dict[Any, Any] = {}

    def call(*inputs: torch.Tensor) -> list[torch.Tensor]:
        key = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in inputs)
        if key not in built:
            with jax.enable_x64(True):
                jf, _ = dynajax.jax_function(fn, *[t.detach().clone() for t in inputs])
            built[key] = jf
        jf = built[key]
        grad_pos = [i for i, t in enumerate(inputs) if t.requires_grad]
        with jax.enable_x64(True):
            arrays = [to_jax(t.detach().contiguous()) for t in inputs]

        def run(*diff: Any) -> tuple[tuple[Any, ...], dict[int, Any]]:
            args = list(arrays)
            for i, d in zip(grad_pos, diff, strict=True):
                args[i] = d
            outs, _, new_args = jf.with_updates({}, *args)
            updates = {i: new_args[i] for i in jf.mutated_inputs}
            return tuple(pytree.tree_leaves(outs)), updates

        order = grad_pos + [i for i in range(len(inputs)) if i not in grad_pos]
        holder: dict[str, Any] = {"differentiable": _differentiable_outputs(fn, inputs)}
        outputs = _Call.apply(run, holder, len(grad_pos), *[inputs[i] for i in order])
        with torch.no_grad(), jax.enable_x64(True):
            for i, value in holder.get("updates", {}).items():
                inputs[i].copy_(to_torch(jax.numpy.asarray(value)))
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
    """``fn`` exported by ``torch.export`` at each call's inputs and run by torch."""
    from dynajax.interop.torch_export import export

    def call(*inputs: torch.Tensor) -> list[torch.Tensor]:
        ep = export(fn, tuple(t.detach().clone() for t in inputs))
        return list(pytree.tree_leaves(ep.module()(*inputs)))

    return call

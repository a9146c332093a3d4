"""The whole training step as one ATen graph: forward, loss, backward, optional gradient
clipping and the user's own ``torch.optim`` update.

How it is captured, in two traces:

1. ``make_fx`` runs the step on fake tensors: the loss through
   ``torch.func.functional_call`` (the module computes with the traced parameters and
   buffers), ``torch.autograd.grad`` (so the backward is torch's own derivative
   formulas and the user's ``autograd.Function`` backwards, as aot_autograd records
   them), ``clip_grad_norm_``, then the optimizer's own ``step()`` with its param groups
   pointed at the traced parameters and its state at traced state tensors. The
   optimizer runs as it does under ``torch.compile``: ``torch.compiler.is_compiling()``
   is true while it is traced, so its step counts stay tensors, and where it has the
   option it runs its ``capturable`` form (no ``.item()``). Each group's learning rate
   is a traced 0-d float64 tensor, an input of the program, so a scheduler changing it
   never retraces; scalar arguments that become tensors that way (``add_(g,
   alpha=-lr)``, ``addcdiv_(..., value=-clr)``) are rewritten as the products they
   stand for (``_TensorScalars``), as Dynamo does for the same calls.
2. ``functionalize`` and ``make_fx`` again, with dynajax's decomposition table: the
   in-place updates (parameters, buffers such as BatchNorm's running statistics,
   optimizer moments) become the new values the graph returns.

The graph's inputs are ``params + buffers + state + lrs + batch`` and its outputs
``loss, params, buffers, state`` (the state's entries after the step, which the first
step creates), each list in the order ``StepGraph`` records.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.overrides import TorchFunctionMode

from dynajax.aot import functional_graph
from dynajax.errors import TrainStepError

# State keys: (index of the parameter in the step's parameter list, key in its state).
StateKey = tuple[int, str]


@dataclasses.dataclass
class StepGraph:
    """One training step's functional ATen graph, and what its inputs and outputs are."""

    gm: torch.fx.GraphModule
    n_params: int
    n_buffers: int
    state_in: list[StateKey]  # the state tensors the step reads
    state_out: list[StateKey]  # the state tensors the step returns


class _LossModule(nn.Module):
    """``loss_fn(model, *batch)`` as a module, for ``functional_call``."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, *batch)


class _TensorScalars(TorchFunctionMode):
    """A tensor where a kernel takes a Python number (``alpha=``, ``value=``) would be
    read with ``.item()``, which a trace cannot do: such calls become the products they
    stand for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.add_, torch.Tensor.sub_) and isinstance(
            kwargs.get("alpha"), torch.Tensor
        ):
            alpha = kwargs.pop("alpha")
            self_, other = args
            return func(self_, other * alpha, **kwargs)
        if func in (torch.Tensor.addcdiv_, torch.Tensor.addcmul_) and isinstance(
            kwargs.get("value"), torch.Tensor
        ):
            value = kwargs.pop("value")
            self_, a, b = args
            product = a / b if func is torch.Tensor.addcdiv_ else a * b
            return self_.add_(product * value)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true, as under Dynamo: optimizers then keep
    their step counts as tensors instead of reading them with ``.item()``."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def optimizer_on(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    state: dict[StateKey, torch.Tensor],
    lrs: Sequence[torch.Tensor],
) -> Iterator[collections.defaultdict[torch.Tensor, Any]]:
    """The optimizer, for the length of the block, with its param groups' parameters
    replaced by ``params`` (in the order of ``optimizer.param_groups``), their state by
    ``state``, each group's ``lr`` by ``lrs`` and the options that pick a kernel set for
    a traced step; everything restored after. Yields the optimizer's state dict."""
    saved_groups = [dict(group) for group in optimizer.param_groups]
    saved_state = optimizer.state
    new_state: collections.defaultdict[torch.Tensor, Any] = collections.defaultdict(dict)
    for (i, key), value in state.items():
        new_state[params[i]][key] = value
    try:
        optimizer.state = new_state
        position = 0
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            count = len(group["params"])
            group["params"] = list(params[position : position + count])
            position += count
            group["lr"] = lr
            if "capturable" in group:
                group["capturable"] = True
            if "foreach" in group:
                group["foreach"] = False
            if "fused" in group:
                group["fused"] = None
        yield new_state
    finally:
        optimizer.state = saved_state
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            group.clear()
            group.update(saved)


def trace_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    param_names: Sequence[str],
    buffer_names: Sequence[str],
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    state: dict[StateKey, torch.Tensor],
    lrs: Sequence[float],
    batch: Sequence[torch.Tensor],
    clip_grad_norm: float | None,
    accumulate: int = 1,
) -> StepGraph:
    """The step's ``StepGraph``, traced on (fakes of) these example values.

    ``params`` are the optimizer's parameters, in the order of its param groups, named
    ``param_names`` in ``model``; ``buffers`` the model's buffers; ``accumulate``: the
    number of micro-batches (each batch tensor split along its first dim)."""
    wrapper = _LossModule(model, loss_fn)
    state_in = list(state)
    n_params, n_buffers, n_state = len(params), len(buffers), len(state_in)
    state_out: list[StateKey] = []

    def step(*flat: torch.Tensor) -> tuple[Any, ...]:
        ps = list(flat[:n_params])
        bufs = list(flat[n_params : n_params + n_buffers])
        at = n_params + n_buffers
        st = dict(zip(state_in, flat[at : at + n_state], strict=True))
        at += n_state
        group_lrs = list(flat[at : at + len(lrs)])
        xs = flat[at + len(lrs) :]
        values = {f"model.{n}": p for n, p in zip(param_names, ps, strict=True)}
        values.update({f"model.{n}": b for n, b in zip(buffer_names, bufs, strict=True)})
        # Micro-batches as an eager loop accumulates them: (loss_i / k).backward() each,
        # the gradients summed in order, the step's loss the sum of the scaled losses.
        micro = [tuple(xs)]
        if accumulate > 1:
            micro = [tuple(x.chunk(accumulate)[i] for x in xs) for i in range(accumulate)]
        loss: torch.Tensor | None = None
        grads: list[torch.Tensor | None] = [None] * n_params
        for part in micro:
            with torch.enable_grad():
                part_loss = torch.func.functional_call(wrapper, values, part)
                _check_loss(part_loss)
                if accumulate > 1:
                    part_loss = part_loss / accumulate
                part_grads = torch.autograd.grad(part_loss, ps, allow_unused=True)
            loss = part_loss if loss is None else loss + part_loss.detach()
            grads = [
                g if acc is None else (acc if g is None else acc + g)
                for acc, g in zip(grads, part_grads, strict=True)
            ]
        assert loss is not None
        with torch.no_grad():
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            if clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(ps, clip_grad_norm, foreach=False)
            with optimizer_on(optimizer, ps, st, group_lrs) as new_state, _TensorScalars():
                optimizer.step()
            for p in ps:
                p.grad = None
            out = []
            for i, p in enumerate(ps):
                for key, value in new_state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        raise TrainStepError(
                            f"{type(optimizer).__name__} keeps a {type(value).__name__} "
                            f"in its state ('{key}'), which a compiled step cannot carry; "
                            "only tensors can."
                        )
                    state_out.append((i, key))
                    out.append(value)
        return (loss.detach(), *ps, *bufs, *out)

    examples = [
        *[p.detach().requires_grad_(p.requires_grad) for p in params],
        *[b.detach() for b in buffers],
        *[state[k].detach() for k in state_in],
        *[torch.tensor(lr, dtype=torch.float64) for lr in lrs],
        *[x.detach() for x in batch],
    ]
    with _compiling():
        try:
            gm = functional_graph(step, examples)
        except TrainStepError:
            raise
        except Exception as e:
            raise TrainStepError(
                f"the training step could not be traced ({type(optimizer).__name__}, "
                f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r}): {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}"
            ) from e
    return StepGraph(gm, n_params, n_buffers, state_in, state_out)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (
            f"a {tuple(loss.shape)} {loss.dtype} tensor"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TrainStepError(
            f"loss_fn must return the loss as a floating tensor of one element, got {what} "
            "(reduce it, e.g. with .mean(), as loss.backward() would need)."
        )

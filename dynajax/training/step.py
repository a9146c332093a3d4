"""``step = dynajax.train_step(model, optimizer, loss_fn)``: one XLA program per step.

    step = dynajax.train_step(model, optimizer, loss_fn, clip_grad_norm=1.0)
    for x, y in data:
        loss = step(x, y)        # a jax.Array; float(loss) or loss.item() waits for it
        scheduler.step()         # read at the next step, no recompile
    step.sync()                  # model.state_dict(), optimizer.state_dict() trained

Where the state lives: the parameters, buffers and optimizer state are JAX arrays held
by the step (``step.state``). Each step's program takes them donated, so XLA writes the
new values into the same buffers, and returns them; nothing crosses to PyTorch per step
but the batch (zero-copy) and each group's learning rate (a float). The module and the
optimizer see the trained values after ``step.sync()``. A parameter or buffer the user
changes in the module (``load_state_dict``, an assignment under ``no_grad``) is taken up
at the next step: the step compares each tensor's version counter with the one it
recorded.

The program is ``training/graph.py``'s functional ATen graph of the whole step, lowered
through the rule table by ``ExportInterpreter`` (ops without a JAX rule run in eager
PyTorch through host callbacks, as in ``jax_function``) under ``jax.jit``, compiled once
per batch signature and once more for the first step of an optimizer without state
(that step creates the state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

from dynajax.capability import CapabilityChecker, Reason
from dynajax.errors import CallbackOpsError, TrainStepError
from dynajax.interop.interpreter import ExportInterpreter, SizeBindings
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.lowering.interpreter import needs_key
from dynajax.passes import run_passes
from dynajax.runtime.compiled import draw_seed
from dynajax.runtime.conversion import to_jax, to_torch
from dynajax.runtime.jax_internals import X64
from dynajax.training import checkpoint
from dynajax.training.graph import StateKey, StepGraph, trace_step

# Optimizers whose step cannot be one program: LBFGS re-evaluates the loss through a
# closure, SparseAdam takes sparse gradients.
_REFUSED = {
    "LBFGS": "its step() calls a closure that re-evaluates the loss several times",
    "SparseAdam": "it takes sparse gradients, which the compiled backward does not make",
}

# Verdicts that make a step impossible to compile: sizes known only from data, dtypes
# JAX lacks, and ops whose eager kernel refuses these dtypes (eager's step raises).
_IMPOSSIBLE = (Reason.DATA_DEPENDENT_SHAPE, Reason.DTYPE, Reason.EAGER_REFUSES)


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    """64-bit types on, as in the backend: int64 and float64 state stays 64-bit."""
    token = X64.enable()
    try:
        yield
    finally:
        X64.restore(token)


@dataclasses.dataclass
class _Program:
    graph: StepGraph
    run: Callable[..., Any]  # jitted (state, lrs, seed, batch) -> (loss, state)
    random: bool  # whether it draws random numbers (then each step draws a seed)


class TrainStep:
    """A compiled training step; see ``dynajax.train_step``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        *,
        clip_grad_norm: float | None = None,
        accumulate: int = 1,
        strict: bool = False,
        fallback_ops: Sequence[str] = (),
    ) -> None:
        if not isinstance(accumulate, int) or accumulate < 1:
            raise TrainStepError(f"accumulate must be a positive int, got {accumulate!r}.")
        name = type(optimizer).__name__
        if name in _REFUSED:
            raise TrainStepError(
                f"dynajax.train_step cannot compile {name}: {_REFUSED[name]}. "
                "Use torch.compile(model, backend='dynajax') with the optimizer in eager."
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.clip_grad_norm = clip_grad_norm
        self.accumulate = accumulate
        self.strict = strict
        self.fallback_ops = tuple(fallback_ops)
        names = {id(p): n for n, p in model.named_parameters()}
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(self._params) if id(p) not in names]
        if missing:
            raise TrainStepError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of "
                "the model (first: position "
                f"{missing[0]} of its param groups); train_step updates the model's own."
            )
        self._param_names = [names[id(p)] for p in self._params]
        self._buffer_names = [n for n, _ in model.named_buffers()]
        self._buffers = [b for _, b in model.named_buffers()]
        self._programs: dict[Any, _Program] = {}
        self.steps = 0
        self.traces = 0
        self._load_from_torch()

    # -- state --------------------------------------------------------------------

    def _load_from_torch(self) -> None:
        """The state as JAX arrays (copies), from the module and the optimizer."""
        self._load_module()
        self.state: dict[StateKey, jax.Array] = {}
        with _x64():
            for i, p in enumerate(self._params):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.state[(i, key)] = _array(value)

    def _load_module(self) -> None:
        """The parameters and buffers as JAX arrays (copies), from the module."""
        with _x64():
            self.params = [_array(p) for p in self._params]
            self.buffers = [_array(b) for b in self._buffers]
        self._versions = self._torch_versions()

    def reload(self) -> None:
        """Takes up the module's and the optimizer's current state (after
        ``optimizer.load_state_dict``, say), replacing the step's. A change to the
        module's own tensors is taken up without it, at the next step."""
        self._load_from_torch()

    def _torch_versions(self) -> list[int]:
        return [t._version for t in (*self._params, *self._buffers)]

    def sync(self) -> None:
        """Writes the trained state into the module's parameters and buffers and into
        the optimizer's state, so that ``model.state_dict()``, evaluation and
        ``optimizer.state_dict()`` see it."""
        with torch.no_grad():
            for t, a in zip(
                (*self._params, *self._buffers), (*self.params, *self.buffers), strict=True
            ):
                t.copy_(to_torch(a))
            for (i, key), a in self.state.items():
                p = self._params[i]
                value = to_torch(a).clone()
                self.optimizer.state[p][key] = value
        self._versions = self._torch_versions()

    # -- checkpoints and torch's view ---------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> int:
        """Writes a checkpoint of the whole training state (parameters, buffers,
        optimizer state, step count, RNG state) under ``directory`` with
        orbax-checkpoint, as ``directory/<step count>``; returns that number."""
        return checkpoint.save(self, directory)

    def restore(self, directory: str | os.PathLike[str], at: int | None = None) -> int:
        """Loads the checkpoint ``at`` (default: the latest) from ``directory``; a
        checkpoint of another model or optimizer raises ``TrainStepError`` and changes
        nothing. Returns its number."""
        with _x64():
            return checkpoint.restore(self, directory, at)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the trained values, as torch tensors (copies),
        for use outside dynajax; the module itself is unchanged (``sync`` writes it)."""
        return checkpoint.state_dict(self)

    def save_safetensors(self, path: str | os.PathLike[str]) -> None:
        """``state_dict()`` as a safetensors file."""
        checkpoint.save_safetensors(self, path)

    # -- the step -----------------------------------------------------------------

    def __call__(self, *batch: Any) -> jax.Array:
        """Runs one step on ``batch`` (tensors), returns the loss as a ``jax.Array``
        (reading it, ``float(loss)``, waits for the step; not reading it does not)."""
        if self._torch_versions() != self._versions:
            # The user changed the module's tensors (load_state_dict, an assignment under
            # no_grad); the optimizer's state stays the step's, as it would in eager.
            self._load_module()
        for i, x in enumerate(batch):
            if not isinstance(x, torch.Tensor):
                raise TrainStepError(
                    f"batch element {i} is a {type(x).__name__}; train_step takes tensors."
                )
            if x.device != self._params[0].device:
                raise TrainStepError(
                    f"batch element {i} is on {x.device}, the model on "
                    f"{self._params[0].device}: move the batch to the model's device."
                )
            if self.accumulate > 1 and (x.dim() == 0 or x.shape[0] % self.accumulate):
                raise TrainStepError(
                    f"batch element {i} has shape {tuple(x.shape)}: with accumulate="
                    f"{self.accumulate} its first dim must split into that many "
                    "equal micro-batches."
                )
        with _x64():
            return self._step(batch)

    def _step(self, batch: Sequence[torch.Tensor]) -> jax.Array:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        program = self._program(batch, lrs)
        graph = program.graph
        state_in = [self.state[k] for k in graph.state_in]
        seed = draw_seed() if program.random else np.int64(0)
        loss, params, buffers, state = program.run(
            (self.params, self.buffers, state_in),
            [np.float64(lr) for lr in lrs],
            seed,
            [to_jax(x) for x in batch],
        )
        self.params, self.buffers = list(params), list(buffers)
        self.state = dict(zip(graph.state_out, state, strict=True))
        self.steps += 1
        return loss

    def _program(self, batch: Sequence[torch.Tensor], lrs: list[float]) -> _Program:
        key = (
            tuple((tuple(x.shape), x.dtype) for x in batch),
            tuple(sorted(self.state)),
            _hyperparameters(self.optimizer),
        )
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._compile(batch, lrs)
        return program

    def _compile(self, batch: Sequence[torch.Tensor], lrs: list[float]) -> _Program:
        example_state = {k: to_torch(a) for k, a in self.state.items()}
        graph = trace_step(
            self.model,
            self.optimizer,
            self.loss_fn,
            param_names=self._param_names,
            buffer_names=self._buffer_names,
            params=self._params,
            buffers=self._buffers,
            state=example_state,
            lrs=lrs,
            batch=list(batch),
            clip_grad_norm=self.clip_grad_norm,
            accumulate=self.accumulate,
        )
        self.traces += 1
        gm = run_passes(graph.gm)
        refused = CapabilityChecker(self.fallback_ops).annotate(gm)
        impossible = [v for v in refused if v.reason in _IMPOSSIBLE]
        if impossible:
            raise TrainStepError(
                "these ops of the training step cannot be part of one XLA program "
                "(or eager PyTorch raises on them):\n"
                + "\n".join(f"  - {v.describe()}" for v in impossible)
            )
        callbacks = [v for v in refused if v.reason is not Reason.HOST_SCALAR]
        unwanted = [v for v in callbacks if not v.reason.is_choice]
        if self.strict and unwanted:
            raise CallbackOpsError(unwanted)
        random = needs_key(gm)
        constants = _constants(gm)

        def step(state, lrs, seed, xs):  # type: ignore[no-untyped-def]
            params, buffers, opt_state = state
            key = jax.random.key(seed) if random else None
            arrays = [*params, *buffers, *opt_state, *lrs, *xs]
            out = _StepInterpreter(gm, key, constants).run(*arrays)
            n, b = graph.n_params, graph.n_buffers
            loss = out[0]
            return loss, out[1 : 1 + n], out[1 + n : 1 + n + b], out[1 + n + b :]

        # Donated, the state's buffers are gone once the program starts; a host callback
        # (eager PyTorch) can still raise then, so a step with callbacks keeps them.
        donate = () if callbacks else (0,)
        return _Program(graph, jax.jit(step, donate_argnums=donate), random)


class _StepInterpreter(ExportInterpreter):
    """``ExportInterpreter`` with the graph's tensor constants (``get_attr``: tensors
    the model or the optimizer closes over, which ``make_fx`` keeps as attributes)."""

    def __init__(
        self, gm: torch.fx.GraphModule, key: jax.Array | None, constants: dict[str, Any]
    ) -> None:
        super().__init__(gm, key, SizeBindings())
        self.constants = constants

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.constants[target]


def _constants(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Each tensor attribute a ``get_attr`` node reads, as an array."""
    return {
        n.target: jnp.asarray(to_jax(getattr(gm, n.target)))
        for n in gm.graph.nodes
        if n.op == "get_attr"
    }


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What of the param groups a step bakes in (all but ``params`` and ``lr``): a
    change retraces."""
    return tuple(
        tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "lr")))
        for g in optimizer.param_groups
    )


def _array(t: torch.Tensor) -> jax.Array:
    """A JAX array holding a copy of ``t`` (the step donates its arrays, so it must own
    them)."""
    if t.dtype not in TORCH_TO_JAX:
        raise TrainStepError(f"a {t.dtype} tensor cannot be part of the training state.")
    return jnp.array(to_jax(t.detach()), copy=True)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    strict: bool = False,
    fallback_ops: Sequence[str] = (),
) -> TrainStep:
    """The whole training step (forward, loss, backward, gradient clipping, the
    optimizer's update, zeroed gradients) as one XLA program per batch signature.

        step = dynajax.train_step(model, optimizer, lambda m, x, y: F.mse_loss(m(x), y))
        loss = step(x, y)

    Args:
        model: the ``nn.Module`` to train (in its current train/eval mode).
        optimizer: the user's ``torch.optim`` optimizer over the model's parameters,
            with its param groups and hyperparameters. Each group's ``lr`` is read at
            every step (schedulers work without recompiling); a change of another
            hyperparameter compiles a new program.
        loss_fn: ``loss_fn(model, *batch)`` returns the loss (a tensor of one element),
            written in ordinary PyTorch.
        clip_grad_norm: clip the gradients' total 2-norm to this value
            (``torch.nn.utils.clip_grad_norm_``) before the update.
        accumulate: split each batch tensor along its first dim into this many
            micro-batches and accumulate their gradients, as an eager loop calling
            ``(loss / accumulate).backward()`` per micro-batch does; the step returns
            the sum of those scaled losses.
        strict: raise ``CallbackOpsError`` for ops without a JAX rule instead of running
            them in eager PyTorch through host callbacks.
        fallback_ops: ops to run in eager PyTorch even where a rule exists (as the
            backend's option).

    Returns:
        A ``TrainStep``: ``step(*batch)`` returns the loss (a ``jax.Array``);
        ``step.sync()`` writes the trained state back into the module and optimizer.

    Raises:
        TrainStepError: an optimizer that cannot be compiled (LBFGS, SparseAdam), or,
            at the first step, a loss that is not one floating element.
    """
    return TrainStep(
        model,
        optimizer,
        loss_fn,
        clip_grad_norm=clip_grad_norm,
        accumulate=accumulate,
        strict=strict,
        fallback_ops=fallback_ops,
    )

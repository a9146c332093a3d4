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
recorded. Other changes (param groups, ``requires_grad``, train/eval, replaced members,
dtypes, the loss's tensors) are seen by ``training/watch.py`` and taken up the same way.
Eager's value checks run in the program; where one fails, the program returns the state
it took and the step raises eager's error.

The program is ``training/graph.py``'s functional ATen graph of the whole step, lowered
by the whole-graph driver (``program/``, under train_step's ``Policy``; ops without a
JAX rule run in eager PyTorch through host callbacks, as in ``jax_function``) under
``jax.jit``, compiled once per batch signature. The optimizer's state is made before
its first step (``training/initial.py``), so that step runs the steady program; where
it cannot be (SGD's momentum, a copy of the first gradient), the first step has a
program of its own, which creates the state.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from dynajax.errors import TrainStepError
from dynajax.lowering import checks as value_checks
from dynajax.lowering.checks import Check
from dynajax.program.callbacks import eager_errors
from dynajax.runtime.cache import CompileStats
from dynajax.runtime.compiled import draw_seed
from dynajax.sharding.placement import placement_of
from dynajax.sharding.rules import RulesLike
from dynajax.training import checkpoint
from dynajax.training.graph import BatchLayout, InitialStateUnread, StateKey
from dynajax.training.holding import Holding, state_signature, x64
from dynajax.training.program import StepProgram, StepPrograms
from dynajax.training.state import StateLayout, TrainState, bytes_per_device

# Optimizers whose step cannot be one program: LBFGS re-evaluates the loss through a
# closure, SparseAdam takes sparse gradients.
_REFUSED = {
    "LBFGS": "its step() calls a closure that re-evaluates the loss several times",
    "SparseAdam": "it takes sparse gradients, which the compiled backward does not make",
}

# The step that holds each module's state (the last one to run on it): a second step
# over the same module takes it over, the first one syncing and letting go. Weak both
# ways: a released module keeps its step alive through the hooks that sync it (its
# values are the step's), and a module and step the user dropped are collected.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[TrainStep]] = weakref.WeakKeyDictionary()


def _owner(model: nn.Module) -> TrainStep | None:
    ref = _OWNERS.get(model)
    return ref() if ref is not None else None


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
        device: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        sharding: RulesLike = None,
        release_module: bool = True,
        checks: bool = True,
    ) -> None:
        _refuse_settings(optimizer, accumulate)
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # torch.compile's wrapper: its parameters are the module's own, which the
            # step compiles itself.
            model = model._orig_mod
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.clip_grad_norm = clip_grad_norm
        self.accumulate = accumulate
        self.strict = strict
        self.fallback_ops = tuple(fallback_ops)
        self.release_module = release_module
        self.checks = checks
        # The step's programs, per batch signature and settings; they persist as the
        # backend's executables do (DYNAJAX_CACHE_DIR), keyed by the step's first trace.
        self._programs = StepPrograms(
            model,
            optimizer,
            loss_fn,
            clip_grad_norm=clip_grad_norm,
            accumulate=accumulate,
            strict=strict,
            fallback_ops=self.fallback_ops,
            checks=checks,
        )
        self.steps = 0
        # The optimizer's state is made before its first step (which then runs the
        # steady program, ``training/initial.py``), but for the parameters found to get
        # no gradient (none made for these).
        self._unread: set[int] = set()
        self._held: Holding | None = None  # the state, while this step holds it
        owner = _owner(model)
        if owner is not None:
            owner._let_go()  # the module whole: its tensors say where the step runs
        self._placement = placement_of(list(model.parameters()), device, mesh, sharding)
        self._own()

    # -- who holds the state -------------------------------------------------------

    def _own(self) -> Holding:
        """Makes this step the holder of the module's state: a step that held it
        before syncs and lets go, and this one loads the module's and optimizer's
        current values (their tensors, param groups and values as they are now)."""
        owner = _owner(self.model)
        if owner is self and self._held is not None:
            return self._held
        if owner is not None and owner is not self:
            owner._let_go()
        _OWNERS[self.model] = weakref.ref(self)
        parts = (self.model, self.optimizer, self.loss_fn)
        self._held = held = Holding(*parts, self._placement, self.release_module, self.sync)
        return held

    def _reload(self, why: str) -> Holding:
        """Takes up a change of the module's or optimizer's make-up (``Watch``): the
        state written back, then loaded again as it is now."""
        self._let_go()
        self._programs.retraces.append(why)
        self._unread.clear()  # (positions of the parameters as they were)
        return self._own()

    def _let_go(self) -> None:
        """Writes the state back into the module and stops holding it (another step
        over the same module takes over)."""
        self.sync()
        if self._held is not None:
            self._held.detach()
        self._held = None

    def reload(self) -> None:
        """Takes up the module's and the optimizer's current state, replacing the
        step's. Not needed after ``model.load_state_dict``, an edit of the synced
        module or ``optimizer.load_state_dict``: the next step takes those up."""
        held = self._own()
        if held.view.released:
            self.sync()  # (a write into a released tensor is refused, not lost)
        held.load_from_torch()

    def sync(self) -> None:
        """Writes the trained state into the module's parameters and buffers and into
        the optimizer's state, so that ``model.state_dict()``, evaluation and
        ``optimizer.state_dict()`` see it.

        Calling the model, ``model.state_dict()``/``load_state_dict()`` or
        ``optimizer.state_dict()``/``load_state_dict()`` syncs by itself; reading a
        parameter directly (``model.fc.weight``) between steps needs ``sync()``
        first, as the module's tensors hold no values then (``release_module``)."""
        if self._held is None:
            # Another step over the module holds the state (a GAN's other step, or the
            # step before a ``train_step`` of other options): it syncs; or none does,
            # and the module has it.
            owner = _owner(self.model)
            if owner is not None and owner is not self:
                owner.sync()
            return
        self._held.write_back()

    # -- the state, as the user reads it ---------------------------------------------

    @property
    def params(self) -> list[jax.Array]:
        """The trained parameters' arrays (in the optimizer's param groups' order)."""
        return self._held.params if self._held is not None else []

    @property
    def buffers(self) -> list[jax.Array]:
        """The module's buffers' arrays."""
        return self._held.buffers if self._held is not None else []

    @property
    def frozen(self) -> list[jax.Array]:
        """The arrays of the module's parameters the optimizer does not hold."""
        return self._held.frozen if self._held is not None else []

    @property
    def state(self) -> dict[StateKey, jax.Array]:
        """The optimizer's state arrays, by (parameter position, entry name)."""
        return self._held.state if self._held is not None else {}

    @property
    def layout(self) -> StateLayout:
        """Where each array lives (``StateLayout``)."""
        return self._own().layout

    @property
    def traces(self) -> int:
        """The programs traced (new batch signatures, settings, make-ups)."""
        return self._programs.traces

    @property
    def retraces(self) -> list[str]:
        """Why each program after the first was traced."""
        return self._programs.retraces

    @property
    def compile_stats(self) -> CompileStats:
        """XLA's compiles and persistent-cache loads of the step's programs."""
        return self._programs.compile_stats

    # -- checkpoints, torch's view, the report ------------------------------------

    def train_state(self) -> TrainState:
        """The state this step holds (its arrays, not copies), as checkpoints see it."""
        return self._own().train_state(self.steps)

    def save(self, directory: str | os.PathLike[str]) -> int:
        """Writes a checkpoint of the whole training state (parameters, buffers,
        optimizer state, step count, RNG state) under ``directory`` with
        orbax-checkpoint, as ``directory/<step count>``; returns that number. Each
        process writes its own shards."""
        self._take_up()
        return checkpoint.save(self.train_state(), directory)

    def restore(self, directory: str | os.PathLike[str], at: int | None = None) -> int:
        """Loads the checkpoint ``at`` (default: the latest) from ``directory``, laid
        out on this step's devices (another mesh than the one that saved it works); a
        checkpoint of another model or optimizer raises ``TrainStepError`` and changes
        nothing. Returns its number."""
        held, _ = self._take_up()  # (what the checkpoint replaces: nothing left pending)
        state = held.train_state(self.steps)
        with x64():
            number = checkpoint.restore(state, directory, at)
        held.params, held.frozen, held.buffers = state.params, state.frozen, state.buffers
        held.state = state.state
        self.steps = state.steps
        held.view.release()  # the module's values are the old ones: sync on access
        return number

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the trained values, as torch tensors (copies),
        for use outside dynajax; the module itself is unchanged (``sync`` writes it)."""
        held, _ = self._take_up()
        with held.view.quiet_hooks():
            return checkpoint.state_dict(held.train_state(self.steps))

    def save_safetensors(self, path: str | os.PathLike[str]) -> None:
        """``state_dict()`` as a safetensors file."""
        held, _ = self._take_up()
        with held.view.quiet_hooks():
            checkpoint.save_safetensors(held.train_state(self.steps), path)

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of the training state (parameters, frozen parameters, buffers and
        optimizer state) each of this process's devices holds, measured from the
        arrays' shards."""
        return bytes_per_device([*self.params, *self.frozen, *self.buffers, *self.state.values()])

    def report(self) -> str:
        """Where the state lives: the device or mesh, and per part (parameters,
        buffers, optimizer state) its whole size and the bytes each device holds; then
        the programs traced and why each after the first was (``retraces``)."""
        return "\n".join([*self._own().report_lines(), *self._programs.report_lines()])

    # -- the step -----------------------------------------------------------------

    def __call__(self, *batch: Any) -> jax.Array | tuple[jax.Array, Any]:
        """Runs one step on ``batch`` (a pytree of tensors: tensors, tuples, lists,
        dicts; its other leaves are constants of the program), returns the loss as a
        ``jax.Array`` (reading it, ``float(loss)``, waits for the step; not reading it
        does not, unless the program computes eager's value checks). Where ``loss_fn``
        returns ``(loss, aux)``, returns ``(loss, aux)``: aux's tensors as ``jax.Array``s
        in its structure, computed in the same program (with ``accumulate=k``, each
        micro-batch's stacked along a new first dim)."""
        held, settings = self._take_up()
        layout, tensors = BatchLayout.of(batch)
        _check_batch(tensors, held.device(), self.accumulate)
        with x64():
            loss = self._step(held, layout, tensors, settings)
        held.view.release()
        return loss

    def _take_up(self) -> tuple[Holding, tuple[Any, ...]]:
        """Takes up what the user changed since the step last looked (``Watch``, and
        writes into the module or optimizer): makes this step the holder of the state,
        reloads it where its make-up changed; returns what it holds and the settings
        that key the program (a change of them is noted for ``retraces``)."""
        held = self._own()
        held.take_up_edits()
        changes = held.watch.look()
        if changes.reload is not None:
            held = self._reload(changes.reload)  # writes back and loads every tensor anew
            return held, held.watch.flags  # the settings as they are now (the new Watch's)
        if changes.retrace is not None:
            self._programs.why = changes.retrace
        return held, changes.program_key

    def _step(
        self,
        held: Holding,
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        settings: tuple[Any, ...],
    ) -> jax.Array | tuple[jax.Array, Any]:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        xs = [held.layout.put_batch(x) for x in batch]
        first = self.steps == 0
        initial = held.make_initial_state(lrs, self._unread)
        try:
            program = self._programs.get(
                held.state_signature,
                lambda: held.arrays(first, initial),  # (read only where a program is made)
                layout,
                batch,
                xs,
                lrs,
                settings,
                held.structure,
            )
        except InitialStateUnread as e:
            # Parameters given a state get no gradient (eager gives them none): theirs
            # is dropped, and the step traced again.
            held.drop_initial_state(initial)
            self._unread |= e.positions
            return self._step(held, layout, batch, settings)
        except BaseException:
            held.drop_initial_state(initial)
            raise
        loss = _run(held, program, lrs, xs, initial)
        self.steps += 1
        return loss


def _run(
    held: Holding,
    program: StepProgram,
    lrs: Sequence[float],
    xs: Sequence[jax.Array],
    initial: frozenset[int],
) -> jax.Array | tuple[jax.Array, Any]:
    """One step of ``program`` over the state ``held`` holds, which then holds what
    it returned; where the step raises (eager's error), the state and torch's generator
    as they were, and the state made before it for ``initial`` dropped."""
    rng = torch.get_rng_state() if program.random else None
    seed = draw_seed() if program.random else np.int64(0)
    taken = held.taken_by(program)
    try:
        with eager_errors():  # (an op run in eager PyTorch raised: eager's error)
            (loss, aux), params, buffers, state, err, frozen = program.run(
                tuple(taken),
                held.frozen,
                [np.float64(lr) for lr in lrs],
                seed,
                xs,
            )
    except BaseException:
        # The program raised (a host callback: eager's error): the state stays as it
        # was; so does torch's generator.
        held.not_taken(program, taken)
        held.drop_initial_state(initial)
        if rng is not None:
            torch.set_rng_state(rng)
        raise
    new_state = held.returned(program, params, buffers, state, frozen)
    if program.checks and value_checks.failed(err):
        # Eager raises on this batch: the program returned the state it took (the
        # parameters, buffers and moments as they were); state the step would have
        # created is dropped, and torch's generator rewound.
        held.state = {k: new_state[k] for k in held.state if k in new_state}
        held.drop_initial_state(initial)
        if rng is not None:
            torch.set_rng_state(rng)
        raise _eager_error(program.checks, err)
    signature = program.state_out_signature
    if signature is None:
        signature = program.state_out_signature = state_signature(new_state)
    held.stepped(new_state, signature)
    if program.aux is not None:
        return loss, pytree.tree_unflatten(list(aux), program.aux)
    return loss


def _refuse_settings(optimizer: torch.optim.Optimizer, accumulate: int) -> None:
    """Refuses an ``accumulate`` that is no positive int and an optimizer whose step
    cannot be one program, with what to do."""
    if not isinstance(accumulate, int) or accumulate < 1:
        raise TrainStepError(f"accumulate must be a positive int, got {accumulate!r}.")
    name = type(optimizer).__name__
    if name in _REFUSED:
        raise TrainStepError(
            f"dynajax.train_step cannot compile {name}: {_REFUSED[name]}. "
            "Use torch.compile(model, backend='dynajax') with the optimizer in eager."
        )


def _check_batch(tensors: Sequence[torch.Tensor], device: torch.device, accumulate: int) -> None:
    """Refuses a batch tensor on another device than the model's, or one that does not
    split into ``accumulate`` equal micro-batches, with what to do."""
    for i, x in enumerate(tensors):
        if x.device != device:
            raise TrainStepError(
                f"batch tensor {i} is on {x.device}, the model on "
                f"{device}: move the batch to the model's device."
            )
        if accumulate > 1 and (x.dim() == 0 or x.shape[0] % accumulate):
            raise TrainStepError(
                f"batch tensor {i} has shape {tuple(x.shape)}: with accumulate="
                f"{accumulate} its first dim must split into that many "
                "equal micro-batches."
            )


def _eager_error(checks: Sequence[Check], err: Any) -> Exception:
    """Eager's exception for the failed check that ``err`` (``[code, *payload]``) names,
    with a note that the step changed nothing."""
    found = value_checks.error(
        checks,
        err,
        "the train_step program",
        "the step changed nothing: the parameters, buffers, optimizer state, step count "
        "and torch's generator are as before it; train_step(..., checks=False) turns the "
        "checks off",
    )
    assert found is not None
    return found


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    strict: bool = False,
    fallback_ops: Sequence[str] = (),
    device: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    sharding: RulesLike = None,
    release_module: bool = True,
    checks: bool = True,
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
        device: the JAX device the state lives and the step runs on (a ``jax.Device``
            or ``"gpu:0"``, as the backend's option); by default the model's.
        mesh: a ``jax.sharding.Mesh``: the step runs SPMD on its devices, the state laid
            out by ``sharding``; the optimizer's moments are laid out as their
            parameters. Each process of a multi-process run passes the whole batch
            and holds only its devices' shards.
        sharding: ``dynajax.ShardingRules`` (e.g. ``ShardingRules.fsdp()``), as the
            backend's option; with ``mesh``.
        release_module: between syncs the module's parameters and buffers hold no
            values (meta tensors, swapped in with ``torch.utils.swap_tensors``), so the
            host keeps one copy of the state; calling the model, ``state_dict()`` or
            ``load_state_dict()`` syncs first. False keeps the module's own (untrained
            until ``sync()``) values alongside the step's.
        checks: compute eager's value checks in the program (an index out of range
            raises eager's error, the state unchanged); each step then waits for its
            program. False skips them.

    Returns:
        A ``TrainStep``: ``step(*batch)`` (``batch``: any pytree of tensors; its other
        leaves are constants of the program) returns the loss (a ``jax.Array``);
        ``step.sync()`` writes the trained state back into the module and optimizer.
        What the user changes between steps (param groups, ``requires_grad``,
        ``train()``/``eval()``, the module's tensors, dtypes, the loss's tensors) is
        taken up at the next step; ``step.retraces`` says why each new program was
        traced.

    Raises:
        TrainStepError: an optimizer that cannot be compiled (LBFGS, SparseAdam), or,
            at the first step, a loss that is not one floating element, a loss under
            float16 autocast, or a branch on a tensor's value.
        Eager's own error (``IndexError``, ``RuntimeError``): a batch whose values eager
            refuses; the training state is unchanged.
    """
    return TrainStep(
        model,
        optimizer,
        loss_fn,
        clip_grad_norm=clip_grad_norm,
        accumulate=accumulate,
        strict=strict,
        fallback_ops=fallback_ops,
        device=device,
        mesh=mesh,
        sharding=sharding,
        release_module=release_module,
        checks=checks,
    )

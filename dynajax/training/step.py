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
``jax.jit``, compiled once per batch signature and once more for the first step of an
optimizer without state (that step creates the state).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
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
from dynajax.runtime.jax_internals import X64
from dynajax.sharding.placement import gather_to_torch, placement_of
from dynajax.sharding.rules import RulesLike
from dynajax.training import checkpoint
from dynajax.training.graph import BatchLayout, StateKey
from dynajax.training.program import StepArrays, StepPrograms
from dynajax.training.state import StateLayout, TrainState, bytes_per_device, report_lines
from dynajax.training.view import ModuleView
from dynajax.training.watch import Watch

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


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    """64-bit types on, as in the backend: int64 and float64 state stays 64-bit."""
    token = X64.enable()
    try:
        yield
    finally:
        X64.restore(token)


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
        if not isinstance(accumulate, int) or accumulate < 1:
            raise TrainStepError(f"accumulate must be a positive int, got {accumulate!r}.")
        name = type(optimizer).__name__
        if name in _REFUSED:
            raise TrainStepError(
                f"dynajax.train_step cannot compile {name}: {_REFUSED[name]}. "
                "Use torch.compile(model, backend='dynajax') with the optimizer in eager."
            )
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
        self._view: ModuleView | None = None
        self.params: list[jax.Array] = []
        self.frozen: list[jax.Array] = []
        self.buffers: list[jax.Array] = []
        self.state: dict[StateKey, jax.Array] = {}
        owner = _owner(model)
        if owner is not None:
            owner._let_go()  # the module whole: its tensors say where the step runs
        self._placement = placement_of(list(model.parameters()), device, mesh, sharding)
        self._own()

    # -- state --------------------------------------------------------------------

    def _members(self) -> None:
        """The step's tensors as the module and optimizer have them now: the
        optimizer's parameters (trained, in its param groups' order), the model's other
        parameters (frozen: read, not written) and its buffers."""
        model, optimizer = self.model, self.optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise TrainStepError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of "
                f"the model (first: position {missing[0]} of its param groups); "
                "train_step updates the model's own. Where a parameter or submodule was "
                "replaced, put the new parameters in the optimizer's param groups in place "
                "of the old ones (or make a new optimizer and train_step)."
            )
        trained = {id(p) for p in params}
        self._params = params
        self._param_names = [names[id(p)] for p in params]
        frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in trained]
        self._frozen_names = [n for n, _ in frozen]
        self._frozen = [p for _, p in frozen]
        self._buffer_names = [n for n, _ in model.named_buffers()]
        self._buffers = [b for _, b in model.named_buffers()]
        # As the view's tensors: parameters, frozen parameters, buffers.
        self._state_names = [*self._param_names, *self._frozen_names, *self._buffer_names]
        tensors = [*self._params, *self._frozen, *self._buffers]
        # The names, shapes and dtypes of the step's tensors (its programs' inputs; a
        # change of them reloads the state, Watch).
        self._structure = (
            len(self._params),
            len(self._frozen),
            *[
                (n, tuple(t.shape), t.dtype)
                for n, t in zip(self._state_names, tensors, strict=True)
            ],
        )
        self.layout = StateLayout(
            self._placement,
            list(zip(self._param_names, self._params, strict=True)),
            list(zip(self._buffer_names, self._buffers, strict=True)),
            list(zip(self._frozen_names, self._frozen, strict=True)),
        )

    def _own(self) -> None:
        """Makes this step the holder of the module's state: a step that held it
        before syncs and lets go, and this one loads the module's and optimizer's
        current values (their tensors, param groups and values as they are now)."""
        owner = _owner(self.model)
        if owner is self and self._view is not None:
            return
        if owner is not None and owner is not self:
            owner._let_go()
        _OWNERS[self.model] = weakref.ref(self)
        self._members()
        tensors = [*self._params, *self._frozen, *self._buffers]
        self._view = ModuleView(
            self.model, self.optimizer, tensors, len(self._params), self.sync, self.release_module
        )
        self._watch = Watch(self.model, self.optimizer, self.loss_fn, self._params, tensors)
        self._load_from_torch()

    def _reload(self, why: str) -> None:
        """Takes up a change of the module's or optimizer's make-up (``Watch``): the
        state written back, then loaded again as it is now."""
        self._let_go()
        self._programs.retraces.append(why)
        self._own()

    def _let_go(self) -> None:
        """Writes the state back into the module and stops holding it (another step
        over the same module takes over)."""
        self.sync()
        if self._view is not None:
            self._view.detach()
        self._view = None
        self.params, self.frozen, self.buffers, self.state = [], [], [], {}

    def _load_from_torch(self) -> None:
        """The state as JAX arrays (copies), from the module and the optimizer; the
        module released after (the step's arrays are the one copy from here)."""
        self._load_module()
        self._load_optimizer()
        assert self._view is not None
        self._view.release()

    def _load_module(self, positions: Sequence[int] | None = None) -> None:
        """The parameters, frozen parameters and buffers (those at ``positions`` of
        the three, or all) as JAX arrays (copies), from the module."""
        layout = self.layout
        tensors = [*self._params, *self._frozen, *self._buffers]
        shardings = [*layout.params, *layout.frozen, *layout.buffers]
        arrays: list[Any] = (
            [*self.params, *self.frozen, *self.buffers] if positions else [None] * len(tensors)
        )
        with _x64():
            for i in range(len(tensors)) if positions is None else positions:
                arrays[i] = layout.put(tensors[i], shardings[i])
        n, f = len(self._params), len(self._frozen)
        self.params, self.frozen, self.buffers = arrays[:n], arrays[n : n + f], arrays[n + f :]
        assert self._view is not None
        self._view.record()

    def _load_optimizer(self) -> None:
        """The optimizer's state as JAX arrays (copies), from the optimizer."""
        self.state = {}
        with _x64():
            for i, p in enumerate(self._params):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        sharding = self.layout.state((i, key), value.shape)
                        self.state[(i, key)] = self.layout.put(value, sharding)
        assert self._view is not None
        self._view.optimizer_loaded = False
        self._view.record_optimizer(current=True)

    def reload(self) -> None:
        """Takes up the module's and the optimizer's current state, replacing the
        step's. Not needed after ``model.load_state_dict``, an edit of the synced
        module or ``optimizer.load_state_dict``: the next step takes those up."""
        view = self._view
        if view is not None and view.released:
            self.sync()  # (a write into a released tensor is refused, not lost)
        self._load_from_torch()

    def sync(self) -> None:
        """Writes the trained state into the module's parameters and buffers and into
        the optimizer's state, so that ``model.state_dict()``, evaluation and
        ``optimizer.state_dict()`` see it.

        Calling the model, ``model.state_dict()``/``load_state_dict()`` or
        ``optimizer.state_dict()``/``load_state_dict()`` syncs by itself; reading a
        parameter directly (``model.fc.weight``) between steps needs ``sync()``
        first, as the module's tensors hold no values then (``release_module``)."""
        if self._view is None:
            # Another step over the module holds the state (a GAN's other step, or the
            # step before a ``train_step`` of other options): it syncs; or none does,
            # and the module has it.
            owner = _owner(self.model)
            if owner is not None and owner is not self:
                owner.sync()
            return
        # What the user wrote since the step looked: into the whole module (the state,
        # not the step's older arrays) or a kept tensor, taken up; into a released
        # tensor or the optimizer's state while the step held it, refused (the write
        # had no effect, and the values written back would hide that).
        self._take_up_edits()
        self._sync_module()
        for (i, key), a in self.state.items():
            self.optimizer.state[self._params[i]][key] = gather_to_torch(a).clone()
        self._view.record_optimizer(current=True)

    def _sync_module(self) -> None:
        assert self._view is not None
        arrays = (*self.params, *self.frozen, *self.buffers)
        self._view.restore([gather_to_torch(a) for a in arrays])

    # -- checkpoints, torch's view, the report ------------------------------------

    def train_state(self) -> TrainState:
        """The state this step holds (its arrays, not copies), as checkpoints see it."""
        return TrainState(
            self.model,
            self.optimizer,
            self.layout,
            self._param_names,
            self._frozen_names,
            self._buffer_names,
            self.params,
            self.frozen,
            self.buffers,
            self.state,
            self.steps,
        )

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
        self._take_up()  # (what the checkpoint replaces, so that nothing is left pending)
        state = self.train_state()
        with _x64():
            number = checkpoint.restore(state, directory, at)
        self.params, self.frozen, self.buffers = state.params, state.frozen, state.buffers
        self.state = state.state
        self.steps = state.steps
        assert self._view is not None
        self._view.release()  # the module's values are the old ones: sync on access
        return number

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the trained values, as torch tensors (copies),
        for use outside dynajax; the module itself is unchanged (``sync`` writes it)."""
        self._take_up()
        assert self._view is not None
        with self._view.quiet_hooks():
            return checkpoint.state_dict(self.train_state())

    def save_safetensors(self, path: str | os.PathLike[str]) -> None:
        """``state_dict()`` as a safetensors file."""
        self._take_up()
        assert self._view is not None
        with self._view.quiet_hooks():
            checkpoint.save_safetensors(self.train_state(), path)

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of the training state (parameters, frozen parameters, buffers and
        optimizer state) each of this process's devices holds, measured from the
        arrays' shards."""
        return bytes_per_device([*self.params, *self.frozen, *self.buffers, *self.state.values()])

    def report(self) -> str:
        """Where the state lives: the device or mesh, and per part (parameters,
        buffers, optimizer state) its whole size and the bytes each device holds; then
        the programs traced and why each after the first was (``retraces``)."""
        lines = report_lines(
            self.layout,
            {
                "parameters": self.params,
                "frozen parameters": self.frozen,
                "buffers": self.buffers,
                "optimizer state": list(self.state.values()),
            },
        )
        view = self._view
        if view is not None and view.kept:
            names = self._state_names
            lines.append("  kept whole in the module (not released between syncs):")
            lines += [f"    {names[i]}: {why}" for i, why in view.kept.items()]
        lines.append(f"  programs traced: {self.traces}")
        stats = self.compile_stats
        if stats.events:
            lines.append(f"  of which loaded from the persistent cache: {stats.cache_hits}")
            lines.append(f"  XLA: {stats.line()}")
        lines.append(f"  persistent cache: {self._programs.keyed_by()}")
        if self.retraces:
            lines.append(
                "  retraced for a change of the module, optimizer or loss (step.retraces):"
            )
            counts: dict[str, int] = {}
            for why in self.retraces:
                counts[why] = counts.get(why, 0) + 1
            lines += [f"    {why}" + (f" x{n}" if n > 1 else "") for why, n in counts.items()]
        return "\n".join(lines)

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

    # -- the step -----------------------------------------------------------------

    def __call__(self, *batch: Any) -> jax.Array | tuple[jax.Array, Any]:
        """Runs one step on ``batch`` (a pytree of tensors: tensors, tuples, lists,
        dicts; its other leaves are constants of the program), returns the loss as a
        ``jax.Array`` (reading it, ``float(loss)``, waits for the step; not reading it
        does not, unless the program computes eager's value checks). Where ``loss_fn``
        returns ``(loss, aux)``, returns ``(loss, aux)``: aux's tensors as ``jax.Array``s
        in its structure, computed in the same program (with ``accumulate=k``, each
        micro-batch's stacked along a new first dim)."""
        settings = self._take_up()
        view = self._view
        assert view is not None
        layout, tensors = BatchLayout.of(batch)
        device = view.devices[0] if view.devices else torch.device("cpu")
        for i, x in enumerate(tensors):
            if x.device != device:
                raise TrainStepError(
                    f"batch tensor {i} is on {x.device}, the model on "
                    f"{device}: move the batch to the model's device."
                )
            if self.accumulate > 1 and (x.dim() == 0 or x.shape[0] % self.accumulate):
                raise TrainStepError(
                    f"batch tensor {i} has shape {tuple(x.shape)}: with accumulate="
                    f"{self.accumulate} its first dim must split into that many "
                    "equal micro-batches."
                )
        with _x64():
            loss = self._step(layout, tensors, settings)
        view.release()
        return loss

    def _take_up(self) -> tuple[Any, ...]:
        """Takes up what the user changed since the step last looked (``Watch``, and
        writes into the module or optimizer): makes this step the holder of the state,
        reloads it where its make-up changed; returns the settings that key the
        program (a change of them is noted for ``retraces``)."""
        self._own()
        self._take_up_edits()
        changes = self._watch.look()
        if changes.reload is not None:
            self._reload(changes.reload)  # writes back and loads every tensor anew
            return self._watch.flags  # the settings as they are now (the new Watch's)
        if changes.retrace is not None:
            self._programs.why = changes.retrace
        return changes.program_key

    def _take_up_edits(self) -> None:
        """Loads what the user wrote into the module's tensors (``load_state_dict``, an
        assignment under ``no_grad``: the optimizer's state stays the step's, as in
        eager) and into the optimizer's state (``load_state_dict``, an eager
        ``optimizer.step()``, an entry edited, replaced, added or removed) since the
        step last looked; a write into a released tensor, or into the optimizer's state
        while the step held it, is refused (``ModuleView``)."""
        view = self._view
        assert view is not None
        edited = view.check_not_edited(self._state_names)
        if edited:
            self._load_module(edited)
        if view.optimizer_loaded or view.optimizer_edited(self._param_names):
            self._load_optimizer()

    def _arrays(self) -> StepArrays:
        """The state as the step holds it now, for its programs."""
        view = self._view
        assert view is not None
        return StepArrays(
            self.params,
            self.buffers,
            self.frozen,
            self.state,
            self.layout,
            self._param_names,
            self._buffer_names,
            self._frozen_names,
            self._params,
            view.devices[0] if view.devices else torch.device("cpu"),
            view.quiet_hooks,
            self.steps == 0,
        )

    def _step(
        self, layout: BatchLayout, batch: Sequence[torch.Tensor], settings: tuple[Any, ...]
    ) -> jax.Array | tuple[jax.Array, Any]:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        xs = [self.layout.put_batch(x) for x in batch]
        program = self._programs.get(
            self._arrays(), layout, batch, xs, lrs, settings, self._structure
        )
        state_in = [self.state[k] for k in program.state_in]
        rng = torch.get_rng_state() if program.random else None
        seed = draw_seed() if program.random else np.int64(0)
        boundary = program.boundary
        taken = [self.params, self.buffers, state_in]
        if boundary is not None:
            taken = boundary.stored(taken)
        try:
            with eager_errors():  # (an op run in eager PyTorch raised: eager's error)
                (loss, aux), params, buffers, state, err, frozen = program.run(
                    tuple(taken),
                    self.frozen,
                    [np.float64(lr) for lr in lrs],
                    seed,
                    xs,
                )
        except BaseException:
            # The program raised (a host callback: eager's error): the state was not
            # donated and stays as it was; so does torch's generator.
            if boundary is not None:
                self.params, self.buffers, state_in = boundary.unstored(taken)
                self.state.update(zip(program.state_in, state_in, strict=True))
            if rng is not None:
                torch.set_rng_state(rng)
            raise
        if boundary is not None:
            params, buffers, state = boundary.shaped([params, buffers, state])
        self.params, self.buffers = list(params), list(buffers)
        for i, a in zip(program.frozen_out, frozen, strict=True):
            self.frozen[i] = a
        new_state = dict(zip(program.state_out, state, strict=True))
        if program.checks and value_checks.failed(err):
            # Eager raises on this batch: the program returned the state it took (the
            # parameters, buffers and moments as they were); state the step would have
            # created is dropped, and torch's generator rewound.
            self.state = {k: new_state[k] for k in self.state if k in new_state}
            if rng is not None:
                torch.set_rng_state(rng)
            raise _eager_error(program.checks, err)
        self.state = new_state
        self.steps += 1
        if program.aux is not None:
            return loss, pytree.tree_unflatten(list(aux), program.aux)
        return loss


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

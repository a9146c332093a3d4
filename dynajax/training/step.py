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
import dataclasses
import hashlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from dynajax.capability import Reason
from dynajax.config import Options
from dynajax.errors import TrainStepError
from dynajax.lowering import precision
from dynajax.lowering.checks import Check
from dynajax.lowering.dtypes import JAX_TO_TORCH
from dynajax.lowering.interpreter import output_vals
from dynajax.program import NEVER, Policy, failed, lower, on_cuda
from dynajax.program.callbacks import forget_host_error, raised_on_host
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.compiled import draw_seed
from dynajax.runtime.heap import release_freed_heap
from dynajax.runtime.jax_internals import X64
from dynajax.runtime.programs import describe_call, describe_graph
from dynajax.sharding.placement import gather_to_torch, placement_of
from dynajax.sharding.rules import RulesLike
from dynajax.training import checkpoint
from dynajax.training.boundary import FlatBoundary, flat_avals
from dynajax.training.graph import (
    AtUpdate,
    BatchLayout,
    StateKey,
    StepGraph,
    aux_text,
    describe_optimizer,
    trace_step,
)
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


@contextlib.contextmanager
def _unfilled() -> Iterator[None]:
    """``torch.empty`` leaves memory untouched even under
    ``torch.use_deterministic_algorithms(True)``, which fills it (NaN) by default: the
    trace's example tensors are never read, and filled, a model's worth of pages would
    be resident for nothing."""
    import torch.utils.deterministic as deterministic

    fill = getattr(deterministic, "fill_uninitialized_memory", False)
    setattr(deterministic, "fill_uninitialized_memory", False)  # noqa: B010 (a property)
    try:
        yield
    finally:
        setattr(deterministic, "fill_uninitialized_memory", fill)  # noqa: B010


@dataclasses.dataclass
class _Program:
    """A step's executable and what it takes and returns. The trace it was built from
    (its graphs, and the example tensors and first batch they ran on) is not kept."""

    state_in: list[StateKey]  # the optimizer state it reads, in order
    state_out: list[StateKey]  # the optimizer state it returns, in order
    frozen_out: list[int]  # the frozen parameters it writes, by position
    run: Callable[..., Any]  # jitted (state, frozen, lrs, seed, batch) -> (loss, state, err)
    random: bool  # whether it draws random numbers (then each step draws a seed)
    checks: list[Check]  # eager's value checks the program computes (its trace fills it)
    boundary: FlatBoundary | None = None  # the state arrays that cross it flat (one CPU)
    aux: pytree.TreeSpec | None = None  # the structure of loss_fn's aux (None: none)


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
        self._programs: dict[Any, _Program] = {}
        # Per batch signature and settings, the trace up to the optimizer's update as
        # the cache keys it (``_compile``).
        self._gradients: dict[Any, tuple[str | None, list[int], list[bool], bool, str]] = {}
        # Programs persist as the backend's executables do (DYNAJAX_CACHE_DIR,
        # DYNAJAX_CACHE_MAX_BYTES): keyed by the step's first trace, a hit skips the rest.
        options = Options.resolve({})
        self._cache = ExecutableCache.from_option(options.cache_dir, options.cache_max_bytes)
        self.compile_stats = CompileStats()
        self.steps = 0
        self.traces = 0
        self.retraces: list[str] = []  # why each program after the first was traced
        self._why: str | None = None  # a change of settings seen, for the next trace
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
        self.retraces.append(why)
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
            self._sync_module()
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
        if not self._view.released:
            # The module holds values: what the user wrote there since (load_state_dict)
            # is the state, not the step's older arrays.
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
        lines.append(f"  persistent cache: {self._keyed_by()}")
        if self.retraces:
            lines.append(
                "  retraced for a change of the module, optimizer or loss (step.retraces):"
            )
            counts: dict[str, int] = {}
            for why in self.retraces:
                counts[why] = counts.get(why, 0) + 1
            lines += [f"    {why}" + (f" x{n}" if n > 1 else "") for why, n in counts.items()]
        return "\n".join(lines)

    def _keyed_by(self) -> str:
        """What keys the step's programs in the persistent cache, in words."""
        if self._cache.directory is None:
            return "off (DYNAJAX_CACHE_DIR is empty)"
        if jax.process_count() > 1:
            return "not used (a multi-process step: each process compiles its programs)"
        name = type(self.optimizer).__name__
        if describe_optimizer(self.optimizer) is not None:
            return f"programs keyed by the trace up to {name}'s update and its configuration"
        return (
            f"programs keyed by the whole step's trace ({name}'s step is not torch's own: "
            "a subclass, a patched step or a step hook)"
        )

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
            self._why = changes.retrace
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

    def _step(
        self, layout: BatchLayout, batch: Sequence[torch.Tensor], settings: tuple[Any, ...]
    ) -> jax.Array | tuple[jax.Array, Any]:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        xs = [self.layout.put_batch(x) for x in batch]
        program = self._program(layout, batch, xs, lrs, settings)
        state_in = [self.state[k] for k in program.state_in]
        rng = torch.get_rng_state() if program.random else None
        seed = draw_seed() if program.random else np.int64(0)
        boundary = program.boundary
        taken = [self.params, self.buffers, state_in]
        if boundary is not None:
            taken = boundary.stored(taken)
        forget_host_error()
        try:
            (loss, aux), params, buffers, state, err, frozen = program.run(
                tuple(taken),
                self.frozen,
                [np.float64(lr) for lr in lrs],
                seed,
                xs,
            )
        except BaseException as e:
            # A host callback raised (eager's error): the state was not donated and
            # stays as it was; so does torch's generator.
            if boundary is not None:
                self.params, self.buffers, state_in = boundary.unstored(taken)
                self.state.update(zip(program.state_in, state_in, strict=True))
            if rng is not None:
                torch.set_rng_state(rng)
            original = raised_on_host()
            if isinstance(e, jax.errors.JaxRuntimeError) and original is not None:
                # An op run in eager PyTorch raised: its own error, as eager gives it.
                raise original from e
            raise
        if boundary is not None:
            params, buffers, state = boundary.shaped([params, buffers, state])
        self.params, self.buffers = list(params), list(buffers)
        for i, a in zip(program.frozen_out, frozen, strict=True):
            self.frozen[i] = a
        new_state = dict(zip(program.state_out, state, strict=True))
        if program.checks and failed(err):
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

    def _program(
        self,
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        xs: Sequence[jax.Array],
        lrs: list[float],
        settings: tuple[Any, ...],
    ) -> _Program:
        key = (
            layout.key(),
            tuple((tuple(x.shape), x.dtype) for x in batch),
            tuple(sorted(self.state)),
            _hyperparameters(self.optimizer),
            settings,
            self._structure,
        )
        program = self._programs.get(key)
        if program is None:
            if self._programs and self._why is not None:
                self.retraces.append(self._why)
            self._why = None
            # The optimizer's state only grows as it trains (Adam's moments appear at
            # its first step): a program for the same batch and settings over less
            # state runs again only after the state is reset, which loads it from the
            # persistent cache. Its executable is let go before the new one is built,
            # not beside it (an executable of GPT-2 small's step: 156 MiB resident).
            state = set(key[2])
            for old in [k for k in self._programs if k[:2] == key[:2] and k[3:] == key[3:]]:
                if set(old[2]) < state:
                    del self._programs[old]
            gradients_key = key[:2] + key[3:]  # (the same but for the optimizer's state)
            program = self._programs[key] = self._compile(layout, batch, xs, lrs, gradients_key)
            # What the trace, the passes and XLA's compiler freed goes back to the
            # system (else it stays resident beside the step's state).
            release_freed_heap()
        return program

    def _examples(self, arrays: Sequence[jax.Array]) -> list[torch.Tensor]:
        """Tensors of the arrays' shapes and dtypes on the module's device, for the
        trace, which reads no values (untouched memory, never written)."""
        view = self._view
        device = view.devices[0] if view is not None and view.devices else torch.device("cpu")
        with _unfilled():
            return [
                torch.empty(a.shape, dtype=JAX_TO_TORCH[np.dtype(a.dtype)], device=device)
                for a in arrays
            ]

    def _trace(
        self,
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        lrs: list[float],
        at_update: AtUpdate | None = None,
    ) -> StepGraph | None:
        """The step's first trace on examples of its state (``trace_step``; None where
        ``at_update`` stopped it)."""
        assert self._view is not None
        params = self._examples(self.params)
        for p, original in zip(params, self._params, strict=True):
            p.requires_grad_(original.requires_grad)
        state = self.state
        with self._view.quiet_hooks():
            return trace_step(
                self.model,
                self.optimizer,
                self.loss_fn,
                param_names=self._param_names,
                buffer_names=self._buffer_names,
                params=params,
                buffers=self._examples(self.buffers),
                state=dict(zip(state, self._examples(list(state.values())), strict=True)),
                frozen_names=self._frozen_names,
                frozen=self._examples(self.frozen),
                lrs=lrs,
                batch=list(batch),
                layout=layout,
                clip_grad_norm=self.clip_grad_norm,
                accumulate=self.accumulate,
                at_update=at_update,
            )

    def _compile(
        self,
        layout: BatchLayout,
        batch: Sequence[torch.Tensor],
        xs: Sequence[jax.Array],
        lrs: list[float],
        gradients_key: Any,
    ) -> _Program:
        """The step's program for this batch: loaded from the persistent cache where it
        is there, else traced, functionalized, lowered, compiled and stored.

        What keys it is the step's first trace (everything the user's Python computed).
        With one of torch's own optimizers, that is the trace up to the update, with the
        optimizer's configuration (``describe_optimizer``): the trace looks the program
        up when it reaches the update and stops there if it is found. Its digest is
        kept per batch signature and settings (``gradients_key``), so the program of
        the second step, over the state the first created, is looked up untraced."""
        self.traces += 1
        # One process's executables only: those of a multi-process step (each process
        # holding some of the mesh's devices) are neither stored nor loaded.
        single = jax.process_count() == 1
        cache = self._cache if single else ExecutableCache(None)
        state_in = list(self.state)
        taken = [self.params, self.buffers, [self.state[k] for k in state_in]]
        flat = self._flat_boundary()
        args = (
            tuple(flat_avals(taken) if flat else taken),
            self.frozen,
            [np.float64(lr) for lr in lrs],
            np.int64(0),
            list(xs),
        )
        shapes = ", ".join(str(list(np.shape(x))) for x in xs)
        name = f"train_step({shapes})"
        event = ("train_step", shapes, "first step" if self.steps == 0 else "new program")
        optimizer = describe_optimizer(self.optimizer) if cache.directory is not None else None
        description: str | None = None
        found: tuple[Any, Any] | str | None = None  # the cache's answer (a miss: why)

        def look_up(
            digest: str | None, frozen_out: list[int], graded: list[bool], cuda: bool, aux: str
        ) -> bool:
            """Looks for the program keyed by the trace up to the update (its digest)
            and the optimizer's configuration; True where it is found."""
            nonlocal description, found
            self._gradients[gradients_key] = (digest, frozen_out, graded, cuda, aux)
            if digest is None:
                return False
            description = self._describe(
                f"up to the update {digest}\n{optimizer}\ngraded={graded!r}\naux={aux}",
                (state_in, frozen_out),
                args,
                self._out_shardings(frozen_out),
                cuda,
            )
            found = cache.load_traced(description, self.compile_stats, name=name, event=event)
            return not isinstance(found, str)

        def at_update(
            so_far: torch.fx.GraphModule, graded: list[bool], written: list[int], aux: str
        ) -> bool:
            text = describe_graph(so_far, "train_step")
            # (kept as its digest: the text of a large model's graph is MBs)
            digest = text and hashlib.sha256(text.encode()).hexdigest()
            return look_up(digest, written, graded, on_cuda(so_far), aux)

        graph: StepGraph | None = None
        if optimizer is not None and gradients_key in self._gradients:
            # The trace up to the update is this batch signature's, as traced before.
            look_up(*self._gradients[gradients_key])
        if found is None or isinstance(found, str):
            # Not found: traced whole, looked up at the update where it was not yet.
            keyed = optimizer is not None and gradients_key not in self._gradients
            graph = self._trace(layout, batch, lrs, at_update if keyed else None)
        if graph is not None and description is None and cache.directory is not None:
            text = describe_graph(graph.joint, "train_step")
            if text is not None:
                text += f"\naux={aux_text(graph.aux)}"
                state_shapes = _output_shapes(graph.joint)[graph.state_at : graph.aux_at]
                description = self._describe(
                    text,
                    (state_in, graph.state_out, graph.frozen_out),
                    args,
                    self._out_shardings(graph.frozen_out, graph.state_out, state_shapes),
                    on_cuda(graph.joint),
                )
        checks: list[Check] = []
        traced: dict[str, Any] = {}

        def lower_step() -> jax.stages.Lowered:
            step = graph
            assert step is not None
            # (the first trace's outputs: the same values as the functional graph's)
            state_shapes = _output_shapes(step.joint)[step.state_at : step.aux_at]
            boundary = self._boundary(step.state_in, state_shapes) if flat else None
            policy = Policy(
                TrainStepError,
                "these ops of the training step cannot be part of one XLA program "
                "(or eager PyTorch raises on them):",
                impossible=NEVER | {Reason.EAGER_REFUSES},
                fallback_ops=self.fallback_ops,
                strict=self.strict,
                keep_recomputation=True,
                # On a mesh the barrier's predicate (an element of a sharded value) would
                # be a collective per parameter: one device only.
                donated=_donated(step) if self.layout.placement.mesh is None else (),
                flatten=(
                    tuple(boundary.flat_outputs([1, 1 + step.n_params, step.state_at]))
                    if boundary
                    else ()
                ),
            )
            program = lower(step.functional(), policy)
            traced.update(
                random=program.random,
                state_out=step.state_out,
                state_shapes=state_shapes,
                frozen_out=step.frozen_out,
                aux=aux_text(step.aux),
            )
            fn = _step_function(program, step, checks, self.checks, boundary)
            out_shardings = self._out_shardings(step.frozen_out, step.state_out, state_shapes)
            # Donated, the state's buffers are gone once the program starts; a host
            # callback (eager PyTorch) can still raise then, so a step with callbacks
            # keeps them. The outputs keep the state's layout (on a mesh, FSDP's shards
            # stay shards).
            donate = () if program.callbacks else (0,)
            return jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings).lower(*args)

        if found is not None and not isinstance(found, str):
            run, stored = found  # found before the trace reached the update
        else:
            run, stored = cache.compile_traced(
                description,
                lower_step,
                self.compile_stats,
                name=name,
                extra=lambda: (
                    list(checks),
                    traced["random"],
                    traced["state_out"],
                    traced["state_shapes"],
                    traced["frozen_out"],
                    traced["aux"],
                ),
                event=event,
                missed=found,
            )
        if stored is not None:  # loaded without tracing: what its trace recorded
            checks[:], random, state_out, state_shapes, frozen_out, aux = stored
            traced.update(
                random=random,
                state_out=state_out,
                state_shapes=state_shapes,
                frozen_out=frozen_out,
                aux=aux,
            )
        return _Program(
            state_in,
            traced["state_out"],
            traced["frozen_out"],
            run,
            traced["random"],
            checks,
            self._boundary(state_in, traced["state_shapes"]) if flat else None,
            pytree.treespec_loads(traced["aux"]) if traced["aux"] else None,
        )

    def _boundary(
        self, state_in: Sequence[StateKey], state_shapes: Sequence[tuple[int, ...]]
    ) -> FlatBoundary | None:
        """Which of the step's arrays cross its program flat (None: none do)."""
        own = [[a.shape for a in self.params], [a.shape for a in self.buffers]]
        ins = [tuple(self.state[k].shape) for k in state_in]
        boundary = FlatBoundary([*own, ins], [*own, state_shapes])
        return boundary if boundary else None

    def _out_shardings(
        self,
        frozen_out: Sequence[int],
        state_out: Sequence[StateKey] | None = None,
        state_shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> tuple[Any, ...]:
        """The layouts of the step's outputs: (loss, parameters, buffers, optimizer state,
        checks, written frozen parameters). Without ``state_out``, the state's as its
        rule (``StateLayout.state``) for the cache's key, where the state the step
        returns is not known before its trace."""
        layout = self.layout
        state: Any = "each entry as its parameter where of its shape, else replicated"
        if state_out is not None and state_shapes is not None:
            state = [layout.state(k, s) for k, s in zip(state_out, state_shapes, strict=True)]
        return (
            layout.replicated,
            layout.params,
            layout.buffers,
            state,
            layout.replicated,
            [layout.frozen[i] for i in frozen_out],
        )

    def _describe(
        self, text: str, layout: tuple[Any, ...], args: Any, out_shardings: Any, cuda: bool
    ) -> str:
        """The step's program as the persistent cache keys it: ``text`` (what its trace
        computed), the layout of its state, its policy and its call."""
        settings = (
            f"train_step {(len(self.params), len(self.buffers), *layout)!r} "
            f"fallback_ops={sorted(self.fallback_ops)!r} strict={self.strict} "
            f"deterministic={torch.are_deterministic_algorithms_enabled()}"
        )
        leaves = jax.tree.leaves(args)
        # (a sharding's repr names its mesh's shape, not which devices, in which order)
        devices = [_device_ids(getattr(a, "sharding", None)) for a in leaves]
        devices += [_device_ids(s) for s in jax.tree.leaves(out_shardings)]
        return describe_call(
            f"{text}\n{settings}\ndevices={devices!r}",
            [
                jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=getattr(a, "sharding", None))
                for a in leaves
            ],
            {},
            precision=precision.describe(cuda),
            needs_seed=True,
            checks=self.checks,
            out_sharding=out_shardings,
        )

    def _flat_boundary(self) -> bool:
        """Whether the step's arrays of 3 or more dimensions cross its program flat
        (``training/boundary.py``): on one CPU device, where XLA's CPU compiler emits
        their elementwise updates unvectorized in their own shapes."""
        if self.layout.placement.mesh is not None:
            return False
        return all(getattr(d, "platform", "") == "cpu" for d in self.layout.replicated.device_set)


def _step_function(
    program: Any,
    graph: StepGraph,
    checks: list[Check],
    check: bool,
    boundary: FlatBoundary | None = None,
) -> Callable[..., Any]:
    """The JAX function of one step: ``(state, frozen, lrs, seed, xs) -> (loss, params,
    buffers, optimizer state, err, written frozen)``, where eager's value checks
    (``check``) fail, the state it took; ``checks`` is filled by its trace."""
    random = program.random
    n, b = graph.n_params, graph.n_buffers
    after = graph.state_at
    # Where eager raises, the step changes nothing: each output that carries an input
    # (the parameters, buffers, optimizer state and frozen parameters it writes) is
    # that input's value (selected where the program computes it, ``run_graph``).
    frozen_at, frozen_in = 1 + n + b, n + b + len(graph.state_in)
    carried = {out: i for i, out in _donated(graph)}
    carried.update((frozen_at + j, frozen_in + i) for j, i in enumerate(graph.frozen_out))

    def step(state, frozen, lrs, seed, xs):  # type: ignore[no-untyped-def]
        params, buffers, opt_state = boundary.inside(state) if boundary else state
        key = jax.random.key(seed) if random else None
        arrays = [*params, *buffers, *opt_state, *frozen, *lrs, *xs]
        out, err, found = program.run(arrays, key=key, check=check, unless_failed=carried)
        checks[:] = found
        loss = out[0]
        new_params, new_buffers = out[1 : 1 + n], out[1 + n : 1 + n + b]
        new_frozen = out[1 + n + b : after]
        new_state = out[after : graph.aux_at]
        leaving = [list(new_params), list(new_buffers), list(new_state)]
        if boundary:
            leaving = boundary.leaving(leaving)
        return (loss, list(out[graph.aux_at :])), *leaving, err, list(new_frozen)

    return step


def _donated(graph: StepGraph) -> tuple[tuple[int, int], ...]:
    """The step graph's (input, output) pairs whose buffers its program donates: each
    parameter, buffer and optimizer state tensor to its new value."""
    n, b = graph.n_params, graph.n_buffers
    after = graph.state_at
    pairs = [(i, 1 + i) for i in range(n + b)]
    pairs += [
        (n + b + graph.state_in.index(k), after + j)
        for j, k in enumerate(graph.state_out)
        if k in graph.state_in
    ]
    return tuple(pairs)


def _device_ids(sharding: Any) -> tuple[int, ...] | None:
    """The ids of a sharding's devices, in its mesh's order (None: not a sharding, as
    ``TrainStep._out_shardings``'s rule for the state)."""
    if not hasattr(sharding, "device_set"):
        return None
    devices = getattr(getattr(sharding, "mesh", None), "devices", None)
    if devices is not None:
        return tuple(d.id for d in np.ravel(devices))
    return tuple(sorted(d.id for d in sharding.device_set))


def _eager_error(checks: Sequence[Check], err: Any) -> Exception:
    """Eager's exception for the failed check that ``err`` (``[code, *payload]``) names,
    with a note that the step changed nothing."""
    vector = np.asarray(err)
    return checks[int(vector[0]) - 1].exception(
        vector[1:].tolist(),
        "the train_step program",
        "the step changed nothing: the parameters, buffers, optimizer state, step count "
        "and torch's generator are as before it; train_step(..., checks=False) turns the "
        "checks off",
    )


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What of the param groups a step bakes in (all but ``params`` and ``lr``): a
    change retraces."""
    return tuple(
        tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "lr")))
        for g in optimizer.param_groups
    )


def _output_shapes(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    """The shapes of the graph's outputs, from their fake values."""
    return [tuple(v.shape) for v in output_vals(gm)]


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

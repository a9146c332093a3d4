"""What a ``TrainStep`` holds while it is the holder of a module's state: the state as
JAX arrays, and the module's and optimizer's tensors they are of.

``Holding`` loads the parameters, frozen parameters, buffers and optimizer state from
the module and optimizer as JAX arrays (copies, laid out by ``StateLayout``), takes up
what the user wrote into them since the step looked (``ModuleView``: version counters,
the optimizer's state entries) and writes the arrays back (``write_back``). One
``Holding`` lives from the step's taking over the module until it lets go (another step
over the module takes over, or the module's make-up changed: ``Watch``). Which step
holds a module is ``training/step.py``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import jax
import torch
from torch import nn

from dynajax.errors import TrainStepError
from dynajax.runtime.jax_internals import X64
from dynajax.sharding.placement import Placement, gather_to_torch
from dynajax.training.graph import StateKey
from dynajax.training.initial import initial_state
from dynajax.training.program import StepArrays, StepProgram
from dynajax.training.state import StateLayout, TrainState, report_lines
from dynajax.training.view import ModuleView
from dynajax.training.watch import Watch


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """64-bit types on, as in the backend: int64 and float64 state stays 64-bit."""
    token = X64.enable()
    try:
        yield
    finally:
        X64.restore(token)


class Holding:
    """The state one step holds, from the module and optimizer as they are now.

    Args:
        model, optimizer, loss_fn: the step's.
        placement: where the state lives (``placement_of``).
        release_module: release the module's tensors between syncs (``ModuleView``).
        sync: the step's ``sync``, which the view's hooks call.

    Attributes:
        params, frozen, buffers: the trained parameters', frozen parameters' and
            buffers' arrays.
        state: the optimizer's state arrays, by (parameter position, entry name).
        trained, frozen_tensors, buffer_tensors: the module's tensors they are of.
        param_names, frozen_names, buffer_names: their names in the module;
            ``state_names`` all three, in the view's order.
        structure: the names, shapes and dtypes of the step's tensors (its programs'
            inputs; a change of them reloads the state, ``Watch``).
        layout: each array's sharding (``StateLayout``).
        view: the module's view of the state between syncs; ``watch``: what the user
            changed since the last step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., Any],
        placement: Placement,
        release_module: bool,
        sync: Callable[[], None],
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.params: list[jax.Array] = []
        self.frozen: list[jax.Array] = []
        self.buffers: list[jax.Array] = []
        self._state: dict[StateKey, jax.Array] = {}
        self.state_signature: tuple[Any, ...] = ()
        # The state's signature when every parameter that requires a gradient was last
        # found to have state (``make_initial_state`` has nothing to make).
        self._complete: tuple[Any, ...] | None = None
        self._members(placement)
        tensors = [*self.trained, *self.frozen_tensors, *self.buffer_tensors]
        self.view = ModuleView(model, optimizer, tensors, len(self.trained), sync, release_module)
        self.watch = Watch(model, optimizer, loss_fn, self.trained, tensors)
        try:
            self.load_from_torch()
        except BaseException:
            self.view.detach()  # (the module still whole: nothing was released)
            raise

    @property
    def state(self) -> dict[StateKey, jax.Array]:
        """The optimizer's state arrays, by (parameter position, entry name)."""
        return self._state

    @state.setter
    def state(self, state: dict[StateKey, jax.Array]) -> None:
        self._state = state
        self.state_signature = state_signature(state)

    def stepped(self, state: dict[StateKey, jax.Array], signature: tuple[Any, ...]) -> None:
        """The state a step's program returned, and its signature (the program's own:
        the same every step)."""
        self._state = state
        self.state_signature = signature

    def taken_by(self, program: StepProgram) -> list[Any]:
        """What a step of ``program`` takes: the parameters, the buffers and the
        optimizer's entries it reads (stored by its boundary, where it has one)."""
        taken = [self.params, self.buffers, [self.state[k] for k in program.state_in]]
        return program.boundary.stored(taken) if program.boundary is not None else taken

    def not_taken(self, program: StepProgram, taken: list[Any]) -> None:
        """``taken`` held again: the step of ``program`` raised before it returned
        (its state was not donated and stays as it was)."""
        if program.boundary is not None:
            self.params, self.buffers, state_in = program.boundary.unstored(taken)
            self._state.update(zip(program.state_in, state_in, strict=True))

    def returned(
        self, program: StepProgram, params: Any, buffers: Any, state: Any, frozen: Any
    ) -> dict[StateKey, jax.Array]:
        """The parameters, buffers and frozen tensors a step of ``program`` returned,
        held; the optimizer's state it returned, by key (``stepped`` holds it)."""
        if program.boundary is not None:
            params, buffers, state = program.boundary.shaped([params, buffers, state])
        self.params, self.buffers = list(params), list(buffers)
        for i, a in zip(program.frozen_out, frozen, strict=True):
            self.frozen[i] = a
        return dict(zip(program.state_out, state, strict=True))

    def _members(self, placement: Placement) -> None:
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
        self.trained = params
        self.param_names = [names[id(p)] for p in params]
        frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in trained]
        self.frozen_names = [n for n, _ in frozen]
        self.frozen_tensors = [p for _, p in frozen]
        self.buffer_names = [n for n, _ in model.named_buffers()]
        self.buffer_tensors = [b for _, b in model.named_buffers()]
        self.state_names = [*self.param_names, *self.frozen_names, *self.buffer_names]
        tensors = [*self.trained, *self.frozen_tensors, *self.buffer_tensors]
        self.structure = (
            len(self.trained),
            len(self.frozen_tensors),
            *[(n, tuple(t.shape), t.dtype) for n, t in zip(self.state_names, tensors, strict=True)],
        )
        self.layout = StateLayout(
            placement,
            list(zip(self.param_names, self.trained, strict=True)),
            list(zip(self.buffer_names, self.buffer_tensors, strict=True)),
            list(zip(self.frozen_names, self.frozen_tensors, strict=True)),
        )

    # -- from torch --------------------------------------------------------------------

    def load_from_torch(self) -> None:
        """The state as JAX arrays (copies), from the module and the optimizer; the
        module released after (the step's arrays are the one copy from here)."""
        self._load_module()
        self._load_optimizer()
        self.view.release()

    def _load_module(self, positions: Sequence[int] | None = None) -> None:
        """The parameters, frozen parameters and buffers (those at ``positions`` of
        the three, or all) as JAX arrays (copies), from the module."""
        layout = self.layout
        tensors = [*self.trained, *self.frozen_tensors, *self.buffer_tensors]
        shardings = [*layout.params, *layout.frozen, *layout.buffers]
        arrays: list[Any] = (
            [*self.params, *self.frozen, *self.buffers] if positions else [None] * len(tensors)
        )
        with x64():
            for i in range(len(tensors)) if positions is None else positions:
                arrays[i] = layout.put(tensors[i], shardings[i])
        n, f = len(self.trained), len(self.frozen_tensors)
        self.params, self.frozen, self.buffers = arrays[:n], arrays[n : n + f], arrays[n + f :]
        self.view.record()

    def _load_optimizer(self) -> None:
        """The optimizer's state as JAX arrays (copies), from the optimizer."""
        state = {}
        with x64():
            for i, p in enumerate(self.trained):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        sharding = self.layout.state((i, key), value.shape)
                        state[(i, key)] = self.layout.put(value, sharding)
        self.state = state
        self.view.optimizer_loaded = False
        self.view.record_optimizer(current=True)

    def take_up_edits(self) -> None:
        """Loads what the user wrote into the module's tensors (``load_state_dict``, an
        assignment under ``no_grad``: the optimizer's state stays the step's, as in
        eager) and into the optimizer's state (``load_state_dict``, an eager
        ``optimizer.step()``, an entry edited, replaced, added or removed) since the
        step last looked; a write into a released tensor, or into the optimizer's state
        while the step held it, is refused (``ModuleView``)."""
        view = self.view
        edited = view.check_not_edited(self.state_names)
        if edited:
            self._load_module(edited)
        if view.optimizer_loaded or view.optimizer_edited(self.param_names):
            self._load_optimizer()

    # -- into torch --------------------------------------------------------------------

    def write_back(self) -> None:
        """Writes the arrays into the module's parameters and buffers and into the
        optimizer's state. What the user wrote since the step looked is taken up first:
        into the whole module (the state, not the step's older arrays) or a kept
        tensor; into a released tensor or the optimizer's state while the step held it,
        refused (the write had no effect, and the values written back would hide
        that)."""
        self.take_up_edits()
        self.write_module()
        for (i, key), a in self.state.items():
            self.optimizer.state[self.trained[i]][key] = gather_to_torch(a).clone()
        self.view.record_optimizer(current=True)

    def write_module(self) -> None:
        """The arrays into the module's parameters and buffers only."""
        arrays = (*self.params, *self.frozen, *self.buffers)
        self.view.restore([gather_to_torch(a) for a in arrays])

    def detach(self) -> None:
        """Stops holding (after a write-back): the view's hooks removed."""
        self.view.detach()
        self.params, self.frozen, self.buffers, self.state = [], [], [], {}

    # -- as others read it -------------------------------------------------------------

    def device(self) -> torch.device:
        """The module's device (where the batch must be)."""
        devices = self.view.devices
        return devices[0] if devices else torch.device("cpu")

    def make_initial_state(self, lrs: Sequence[float], skip: Collection[int]) -> frozenset[int]:
        """The state the optimizer creates at its next step, made now, held, for the
        parameters that require a gradient and have no state, but those at ``skip``
        (``training/initial.py``); returns their positions (none where it cannot be
        made before the step)."""
        if self.state_signature is self._complete:
            return frozenset()  # (a steady step: no parameter without state, as before)
        have = {i for i, _ in self._state}
        missing = [
            i
            for i, p in enumerate(self.trained)
            if p.requires_grad and i not in have and i not in skip
        ]
        if not missing:
            self._complete = self.state_signature
            return frozenset()
        with self.view.quiet_hooks():  # (the view's step hook: no step of the user's)
            made = initial_state(self.optimizer, self.trained, missing, lrs)
        if not made:
            return frozenset()
        state = dict(self._state)
        with x64():
            for key, start in made.items():
                state[key] = self.layout.put(start.tensor(), self.layout.state(key, start.shape))
        self.state = state
        return frozenset(i for i, _ in made)

    def drop_initial_state(self, positions: frozenset[int]) -> None:
        """The state ``make_initial_state`` made for ``positions`` let go (the step
        that would have created it did not run)."""
        if positions:
            self.state = {k: a for k, a in self._state.items() if k[0] not in positions}

    def arrays(self, first_step: bool, initial: frozenset[int] = frozenset()) -> StepArrays:
        """The state as held now, for the step's programs."""
        return StepArrays(
            self.params,
            self.buffers,
            self.frozen,
            self.state,
            self.layout,
            self.param_names,
            self.buffer_names,
            self.frozen_names,
            self.trained,
            self.state_signature,
            self.device(),
            self.view.quiet_hooks,
            first_step,
            initial,
        )

    def train_state(self, steps: int) -> TrainState:
        """The state held (its arrays, not copies), as checkpoints see it."""
        return TrainState(
            self.model,
            self.optimizer,
            self.layout,
            self.param_names,
            self.frozen_names,
            self.buffer_names,
            self.params,
            self.frozen,
            self.buffers,
            self.state,
            steps,
        )

    def report_lines(self) -> list[str]:
        """Where the state lives: the device or mesh, and per part its whole size and
        the bytes each device holds; the tensors kept whole in the module, and why."""
        lines = report_lines(
            self.layout,
            {
                "parameters": self.params,
                "frozen parameters": self.frozen,
                "buffers": self.buffers,
                "optimizer state": list(self.state.values()),
            },
        )
        if self.view.kept:
            names = self.state_names
            lines.append("  kept whole in the module (not released between syncs):")
            lines += [f"    {names[i]}: {why}" for i, why in self.view.kept.items()]
        return lines


def state_signature(state: dict[StateKey, jax.Array]) -> tuple[Any, ...]:
    """The optimizer state's entries with their dtypes and shapes, in order: a program
    is made for one (``optimizer.load_state_dict`` casts entries to their parameter's
    dtype: NAdam's ``mu_product`` becomes a float64 of a float64 model)."""
    return tuple(sorted((k, str(a.dtype), tuple(a.shape)) for k, a in state.items()))

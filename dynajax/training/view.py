"""The module's view of a ``TrainStep``'s state between syncs.

``ModuleView``: between syncs the state lives only in JAX, and the module's parameters
and buffers are *released*: each tensor object (the one the optimizer and the user hold)
is swapped, with ``torch.utils.swap_tensors``, for a meta tensor of the same shape and
dtype, so the host keeps one copy of the state, not two. The module comes back whole
by itself when the user reaches it through the module: calling any of its modules
(eagerly, or compiled: ``torch.compile(model)`` served between steps), ``state_dict()``,
``load_state_dict()`` (and the optimizer's ``state_dict()``) sync it first;
``step.sync()`` does so explicitly (before reading a parameter directly, or before a
compiled function that calls the module: its trace would read the released tensors). An
in-place edit of a released tensor is refused at the next step, with the advice to
sync first; an edit of a synced module is taken up at the next step (version counters).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dynajax.errors import TrainStepError


class ModuleView:
    """The module's (and the optimizer's) tensors between syncs; see the module doc.

    Args:
        model: the trained module.
        optimizer: its optimizer.
        tensors: the step's parameters, frozen parameters, then buffers (the tensor
            objects it holds).
        n_params: how many of ``tensors`` are the optimizer's parameters (the first).
        sync: the step's ``sync``, which the hooks call. They hold the step (the module
            keeps it alive while the state lives there).
        release: whether tensors are released between syncs (``release_module=``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        tensors: Sequence[torch.Tensor],
        n_params: int,
        sync: Callable[[], None],
        release: bool,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.tensors = list(tensors)
        self.params = self.tensors[:n_params]
        # The optimizer's state of each parameter as the step last wrote or read it:
        # each entry's object and version (``record_optimizer``); and whether those
        # hold the state's values (a load or a sync since the last step).
        self._optimizer_seen: _StateSeen | None = None
        self.optimizer_current = True
        self.release_enabled = release
        self.released = False
        self.quiet = 0  # > 0 while the step itself runs the module (tracing): no hooks
        self.optimizer_loaded = False  # optimizer.load_state_dict since the last load
        # An eager optimizer.step() since the last load: it wrote the parameters and the
        # state, and a fused kernel (fused=True) writes them without bumping their
        # version counters, which the looks below read.
        self.optimizer_stepped = False
        self.kept: dict[int, str] = {}  # tensors that could not be released, and why
        self.devices = [t.device for t in self.tensors]
        self._versions = self.versions()
        self._batch_statistics = _batch_statistics(model, self.tensors)
        self._handles: list[Any] = []
        self._released_handles: list[Any] = []  # the module's own hooks, while released

        def sync_first(*_: Any, **__: Any) -> None:
            if self.released and not self.quiet:
                sync()

        self.sync_first = sync_first
        self._handles.append(optimizer.register_state_dict_pre_hook(sync_first))
        self._handles.append(optimizer.register_load_state_dict_pre_hook(sync_first))

        def loaded(*_: Any) -> None:
            self.optimizer_loaded = True

        self._handles.append(optimizer.register_load_state_dict_post_hook(loaded))

        def stepped(*_: Any) -> None:
            if not self.quiet:  # (not the step's own trace of the update)
                self.optimizer_stepped = True

        # (describe_optimizer tells this hook from a user's: it changes nothing)
        stepped._dynajax_view = True  # type: ignore[attr-defined]
        self._handles.append(optimizer.register_step_post_hook(stepped))

    def _hook_module(self) -> None:
        """What syncs the released module when the user reaches it: a call of it or of
        any of its modules (``_released``, and a compiled one's wrapper), its
        ``state_dict()`` and ``load_state_dict()`` (its own hooks). Only while it is
        released."""
        hook = self.sync_first
        for module in self.model.modules():
            _RELEASED[module] = weakref.ref(self)
            if module not in _WATCHED:  # (one finalizer per module, not one per step)
                _WATCHED.add(module)
                weakref.finalize(module, _unhook_calls).atexit = False
            self._released_handles.append(module.register_state_dict_pre_hook(hook))
            self._released_handles.append(module.register_load_state_dict_pre_hook(hook))
        _hook_calls()

    def _unhook_module(self) -> None:
        for module in self.model.modules():
            _RELEASED.pop(module, None)
        for h in self._released_handles:
            h.remove()
        self._released_handles.clear()
        _unhook_calls()

    def detach(self) -> None:
        """Removes the hooks (the module must be whole: call after a sync)."""
        self._unhook_module()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- versions ----------------------------------------------------------------------

    def versions(self) -> list[int]:
        return [t._version for t in self.tensors]

    def changed(self) -> list[int]:
        """Positions of the tensors written in place since the last record. A batch
        norm's running statistics count as written where its ``num_batches_tracked`` is:
        eager's kernel updates them in place without bumping their version counters
        (``native_batch_norm`` does not declare the write)."""
        now = self.versions()
        edited = [i for i, (a, b) in enumerate(zip(now, self._versions, strict=True)) if a != b]
        for counter, statistics in self._batch_statistics:
            if counter in edited:
                edited = sorted({*edited, *statistics})
        return edited

    def record(self) -> None:
        self._versions = self.versions()

    def check_not_edited(self, names: Sequence[str]) -> list[int]:
        """While released: raises for a released tensor written in place (it holds no
        values, so the write is lost); returns the kept tensors written in place (to
        take up). Whole: returns every tensor written in place (every parameter after
        an eager ``optimizer.step()``)."""
        edited = self.changed()
        if self.optimizer_stepped:
            edited = sorted({*edited, *range(len(self.params))})
        if not self.released:
            return edited
        lost = [i for i in edited if i not in self.kept]
        if lost:
            shown = ", ".join(repr(names[i]) for i in lost[:3])
            self.record()
            self.optimizer_stepped = False
            raise TrainStepError(
                f"{shown} of the module were written in place while train_step held the "
                "state (between syncs the module's tensors hold no values), so the write "
                "had no effect. Call step.sync() before editing the module's tensors; "
                "the next step takes the edit up. The training state is unchanged."
            )
        return edited

    # -- the optimizer's state -------------------------------------------------------

    def record_optimizer(self, current: bool) -> None:
        """Records the optimizer's state as the step leaves it (``current``: holding the
        state's values, after a load or a sync; else meta stand-ins or older values)."""
        self._optimizer_seen = _StateSeen(self.optimizer.state)
        self.optimizer_current = current
        self.optimizer_stepped = False

    def optimizer_edited(self, names: Sequence[str]) -> bool:
        """Whether the user changed the optimizer's state since the step recorded it:
        an entry written in place (an eager ``optimizer.step()``, ``exp_avg.zero_()``),
        replaced, added or removed. True where the edit is to be taken up (the state
        held the step's values); raises where it held none (a step ran since: the
        edit would be lost), with what to do."""
        seen = self._optimizer_seen
        if self.optimizer_stepped:
            edited = list(range(len(self.params)))
        elif seen is None or not seen.changed(self.optimizer.state):
            return False
        else:
            state = self.optimizer.state
            edited = [i for i, p in enumerate(self.params) if seen.changed_for(p, state)]
        if not edited:  # (entries of the same parameters in another order)
            self.record_optimizer(self.optimizer_current)
            return False
        if self.optimizer_current:
            return True
        shown = ", ".join(repr(names[i]) for i in edited[:3])
        self.record_optimizer(current=False)
        raise TrainStepError(
            f"the optimizer's state of {shown} was changed while train_step held it (it "
            "lives in the step's arrays between syncs: the optimizer's tensors hold no "
            "values, or older ones), so the change had no effect. Call step.sync() "
            "before editing the optimizer's state; the next step takes the edit up. "
            "The training state is unchanged."
        )

    # -- release and restore -----------------------------------------------------------

    def release(self) -> None:
        """Swaps each tensor for a meta stand-in, freeing its memory (its values live
        in the step's arrays); the optimizer's state tensors likewise."""
        if not self.release_enabled or self.released:
            self.optimizer_current = False  # (a step ran: its arrays hold the state)
            return
        for i, t in enumerate(self.tensors):
            if i in self.kept:
                continue
            why = _unreleasable(t)
            if why is None:
                try:
                    torch.utils.swap_tensors(t, _like(t, torch.empty_like(t, device="meta")))
                except RuntimeError as e:  # another reference to its TensorImpl
                    why = str(e).splitlines()[0]
            if why is not None:
                self.kept[i] = why
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    state[key] = torch.empty_like(value, device="meta")
        self.record_optimizer(current=False)
        self.released = True
        self._hook_module()
        self.record()

    def restore(self, values: Sequence[torch.Tensor]) -> None:
        """Writes ``values`` (whole tensors, one per tensor, on any device) into the
        module: a released tensor gets new memory, swapped in; a kept one is copied
        into."""
        with torch.no_grad():
            for i, (t, v) in enumerate(zip(self.tensors, values, strict=True)):
                if t.device.type == "meta" and i not in self.kept:
                    device = self.devices[i]
                    real = torch.empty(t.shape, dtype=t.dtype, device=device)
                    real.copy_(v)
                    torch.utils.swap_tensors(t, _like(t, real))
                else:
                    t.copy_(v)
        self.released = False
        self._unhook_module()
        self.record()

    @contextlib.contextmanager
    def quiet_hooks(self) -> Iterator[None]:
        """The hooks off for the length of the block (the step reading the module
        itself: tracing, ``state_dict()``)."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1


# The released modules (each submodule too), and the view that syncs each.
_RELEASED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ModuleView]] = (
    weakref.WeakKeyDictionary()
)
# While a module is released: the global forward pre-hook's handle and the warnings
# filter entry installed with it (one pair, or none).
_CALL_HOOK: list[tuple[Any, Any]] = []
# The modules ever released, each with a finalizer that takes the global hook away once
# no released module is left alive (a model dropped with its step, never synced).
_WATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_GLOBAL_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def _batch_statistics(
    model: nn.Module, tensors: Sequence[torch.Tensor]
) -> list[tuple[int, tuple[int, ...]]]:
    """Each batch norm's ``num_batches_tracked`` and running statistics, by position in
    ``tensors`` (its ``add_(1)`` is the only version bump of a training forward)."""
    at = {id(t): i for i, t in enumerate(tensors)}
    found = []
    for module in model.modules():
        counter = getattr(module, "num_batches_tracked", None)
        if isinstance(counter, torch.Tensor) and id(counter) in at:
            statistics = [getattr(module, n, None) for n in ("running_mean", "running_var")]
            found.append((at[id(counter)], tuple(at[id(t)] for t in statistics if id(t) in at)))
    return found


_VERSION = operator.attrgetter("_version")


def _versions(values: list[Any]) -> list[int]:
    """Each tensor's version counter (0 for a value that is not a tensor)."""
    try:
        return list(map(_VERSION, values))
    except AttributeError:
        return [getattr(v, "_version", 0) for v in values]


class _StateSeen:
    """An optimizer's state (``optimizer.state``: parameter -> entries) as recorded:
    its dict, each parameter's entries' names, objects and versions. ``changed`` looks
    without hashing a parameter: one pass over the dicts' values, whose cost is
    reading each entry's version (docs/training.md gives it per step)."""

    def __init__(self, state: dict[Any, dict[str, Any]]) -> None:
        self.state = state
        self.per_param = {
            id(p): {k: (v, getattr(v, "_version", 0)) for k, v in entries.items()}
            for p, entries in state.items()
        }
        self.dicts = list(state.values())
        self.keys = list(itertools.chain.from_iterable(self.dicts))
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.dicts)))
        self.versions = _versions(self.values)

    def changed(self, state: dict[Any, dict[str, Any]]) -> bool:
        """Whether anything in ``state`` differs from the record (conservatively: an
        entry removed and added back counts)."""
        if state is not self.state or len(state) != len(self.dicts):
            return True
        dicts = list(state.values())
        if not all(map(operator.is_, dicts, self.dicts)):
            return True
        values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
        return (
            len(values) != len(self.values)
            or not all(map(operator.is_, values, self.values))
            or list(itertools.chain.from_iterable(dicts)) != self.keys
            or _versions(values) != self.versions
        )

    def changed_for(self, param: torch.Tensor, state: dict[Any, dict[str, Any]]) -> bool:
        """Whether ``param``'s entries in ``state`` differ from the record."""
        now = state.get(param, {})
        seen = self.per_param.get(id(param), {})
        if now.keys() != seen.keys():
            return True
        return any(
            now[k] is not v or getattr(v, "_version", 0) != version
            for k, (v, version) in seen.items()
        )


def _sync_released(module: nn.Module, args: Any) -> None:
    """Syncs the released module called (or the module a compiled one wraps:
    ``torch.compile(model)`` calls this hook with its wrapper before Dynamo's frame,
    which then reads and guards on whole tensors). Inside a compiled forward it traces
    to nothing: no guard, no graph break."""
    if torch.compiler.is_compiling():
        return
    target = getattr(module, "_orig_mod", module)
    ref = _RELEASED.get(target)
    if ref is None:
        return
    view = ref()
    if view is None:  # its step is gone: nothing to sync
        _RELEASED.pop(target, None)
        _unhook_calls()
    else:
        view.sync_first()


def _hook_calls() -> None:
    """The global forward pre-hook, while a module is released: a compiled module's
    wrapper is not one of the model's modules, and a hook of the model's own runs
    inside Dynamo's frame, after its guards read the released tensors."""
    if not _CALL_HOOK:
        handle = nn.modules.module.register_module_forward_pre_hook(_sync_released)
        # torch warns at each compiled module's call that global hooks fire for its
        # wrapper too: that is this hook's purpose, so not the user's concern.
        warnings.filterwarnings("ignore", _GLOBAL_HOOKS_WARNING, UserWarning)
        _CALL_HOOK.append((handle, warnings.filters[0]))


def _unhook_calls() -> None:
    """Takes the global hook away once no module is released (alive, with its step)."""
    if _CALL_HOOK and not any(ref() is not None for ref in _RELEASED.values()):
        handle, entry = _CALL_HOOK.pop()
        handle.remove()
        if entry in warnings.filters:
            warnings.filters.remove(entry)  # type: ignore[attr-defined]


def _unreleasable(t: torch.Tensor) -> str | None:
    if type(t) not in (torch.Tensor, nn.Parameter):
        return f"a {type(t).__name__} (a tensor subclass) is kept as it is"
    if t.device.type == "meta":
        return "already a meta tensor"
    return None


def _like(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as the same kind of tensor as ``t`` (a Parameter with its
    ``requires_grad``, or a plain tensor), for ``swap_tensors``."""
    if isinstance(t, nn.Parameter):
        return nn.Parameter(data, requires_grad=t.requires_grad)
    return data

"""Where a ``TrainStep``'s state lives: its arrays' layout, and the module's view of it.

``StateLayout``: the ``Sharding`` of every array of the step, on the step's
``Placement`` (one device, or a mesh with ``ShardingRules``, as the backend's):

    parameter, buffer        its name's rule (``ShardingRules.match``), as the backend
    (frozen ones too)
    optimizer state entry    as its parameter when it has the parameter's shape (the
                             moments: FSDP shards them too), else replicated (counts)
    batch tensor             the rules' batch spec (dim 0 over the batch axis)
    loss                     replicated

``ModuleView``: between syncs the state lives only in JAX, and the module's parameters
and buffers are *released*: each tensor object (the one the optimizer and the user hold)
is swapped, with ``torch.utils.swap_tensors``, for a meta tensor of the same shape and
dtype, so the host keeps one copy of the state, not two. The module comes back whole
by itself when the user reaches it through the module: calling any of its modules,
``state_dict()``, ``load_state_dict()`` (and the optimizer's ``state_dict()``) sync it
first; ``step.sync()`` does so explicitly (before reading a parameter directly). An
in-place edit of a released tensor is refused at the next step, with the advice to
sync first; an edit of a synced module is taken up at the next step (version counters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import PartitionSpec, Sharding
from torch import nn

from dynajax.errors import TrainStepError
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.runtime.conversion import to_jax
from dynajax.sharding import Placement, StateName, describe_mesh, per_device_bytes
from dynajax.sharding.report import size_text
from dynajax.training.graph import StateKey


class StateLayout:
    """The sharding of each array of a training step on ``placement``.

    Args:
        placement: where the step runs (``Placement``).
        params: the optimizer's parameters, in its param groups' order, and their names.
        buffers: the model's buffers and their names.
        frozen: the model's other parameters (which the step reads, not trains).
    """

    def __init__(
        self,
        placement: Placement,
        params: Sequence[tuple[str, torch.Tensor]],
        buffers: Sequence[tuple[str, torch.Tensor]],
        frozen: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> None:
        self.placement = placement
        self.replicated = placement.sharding(PartitionSpec())
        self.params = [self._decide(n, t, "parameter") for n, t in params]
        self.frozen = [self._decide(n, t, "parameter") for n, t in frozen]
        self.buffers = [self._decide(n, t, "buffer") for n, t in buffers]
        self._param_shapes = [tuple(t.shape) for _, t in params]

    def _decide(self, name: str, t: torch.Tensor, kind: str) -> Sharding:
        spec = self.placement.decide(StateName(name, kind), t).spec
        return self.placement.sharding(spec if spec is not None else PartitionSpec())

    def state(self, key: StateKey, shape: Sequence[int]) -> Sharding:
        """An optimizer state entry: laid out as its parameter when it has its shape."""
        i, _ = key
        return self.params[i] if tuple(shape) == self._param_shapes[i] else self.replicated

    def batch(self, x: torch.Tensor) -> Sharding:
        spec = self.placement.decide(None, x).spec
        return self.placement.sharding(spec if spec is not None else PartitionSpec())

    def put(self, t: torch.Tensor, sharding: Sharding) -> jax.Array:
        """A copy of ``t`` laid out by ``sharding``, owned by JAX (the step donates its
        arrays, so they must not alias torch's memory)."""
        if t.dtype not in TORCH_TO_JAX:
            raise TrainStepError(f"a {t.dtype} tensor cannot be part of the training state.")
        return self.placement.put(to_jax(t.detach()), sharding, copy=True)

    def put_batch(self, x: torch.Tensor) -> jax.Array:
        """A batch tensor on the step's devices (zero-copy where it can be)."""
        return self.placement.put(to_jax(x), self.batch(x))

    def describe(self) -> str:
        p = self.placement
        return f"mesh {describe_mesh(p.mesh)}" if p.mesh is not None else f"device {p.device}"


def bytes_per_device(arrays: Sequence[jax.Array]) -> dict[str, int]:
    """Bytes of ``arrays`` held on each of this process's devices (measured)."""
    total: dict[str, int] = {}
    for a in arrays:
        for dev, n in per_device_bytes(a).items():
            total[dev] = total.get(dev, 0) + n
    return total


def report_lines(layout: StateLayout, parts: dict[str, Sequence[jax.Array]]) -> list[str]:
    """The report's lines: where the state lives and, per part (parameters, buffers,
    optimizer state), its whole size and what each device holds, measured."""
    out = [f"train_step state on {layout.describe()}"]
    every: list[jax.Array] = []
    for label, arrays in parts.items():
        every.extend(arrays)
        out.append(_line(label, arrays))
    out.append(_line("in all", every))
    return out


def _line(label: str, arrays: Sequence[jax.Array]) -> str:
    whole = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays)
    per = bytes_per_device(arrays)
    held = ""
    if per:
        hi, lo = max(per.values()), min(per.values())
        spread = size_text(hi) if hi == lo else f"{size_text(lo)} to {size_text(hi)}"
        held = f"; per device {spread} ({len(per)} device(s) of this process)"
    return f"  {label}: {len(arrays)} array(s), {size_text(whole)} whole{held}"


class ModuleView:
    """The module's (and the optimizer's) tensors between syncs; see the module doc.

    Args:
        model: the trained module.
        optimizer: its optimizer.
        tensors: the step's parameters then buffers (the tensor objects it trains).
        sync: the step's ``sync``, which the hooks call. They hold the step (the module
            keeps it alive while the state lives there).
        release: whether tensors are released between syncs (``release_module=``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        tensors: Sequence[torch.Tensor],
        sync: Callable[[], None],
        release: bool,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.tensors = list(tensors)
        self.release_enabled = release
        self.released = False
        self.quiet = 0  # > 0 while the step itself runs the module (tracing): no hooks
        self.optimizer_loaded = False  # optimizer.load_state_dict since the last load
        self.kept: dict[int, str] = {}  # tensors that could not be released, and why
        self.devices = [t.device for t in self.tensors]
        self._versions = self.versions()
        self._handles: list[Any] = []

        def sync_first(*_: Any, **__: Any) -> None:
            if self.released and not self.quiet:
                sync()

        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(sync_first))
            self._handles.append(module.register_state_dict_pre_hook(sync_first))
            self._handles.append(module.register_load_state_dict_pre_hook(sync_first))
        self._handles.append(optimizer.register_state_dict_pre_hook(sync_first))
        self._handles.append(optimizer.register_load_state_dict_pre_hook(sync_first))

        def loaded(*_: Any) -> None:
            self.optimizer_loaded = True

        self._handles.append(optimizer.register_load_state_dict_post_hook(loaded))

    def detach(self) -> None:
        """Removes the hooks (the module must be whole: call after a sync)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- versions ----------------------------------------------------------------------

    def versions(self) -> list[int]:
        return [t._version for t in self.tensors]

    def changed(self) -> list[int]:
        """Positions of the tensors written in place since the last record."""
        now = self.versions()
        return [i for i, (a, b) in enumerate(zip(now, self._versions, strict=True)) if a != b]

    def record(self) -> None:
        self._versions = self.versions()

    def check_not_edited(self, names: Sequence[str]) -> list[int]:
        """While released: raises for a released tensor written in place (it holds no
        values, so the write is lost); returns the kept tensors written in place (to
        take up). Whole: returns every tensor written in place."""
        edited = self.changed()
        if not self.released:
            return edited
        lost = [i for i in edited if i not in self.kept]
        if lost:
            shown = ", ".join(repr(names[i]) for i in lost[:3])
            self.record()
            raise TrainStepError(
                f"{shown} of the module were written in place while train_step held the "
                "state (between syncs the module's tensors hold no values), so the write "
                "had no effect. Call step.sync() before editing the module's tensors; "
                "the next step takes the edit up. The training state is unchanged."
            )
        return edited

    # -- release and restore -----------------------------------------------------------

    def release(self) -> None:
        """Swaps each tensor for a meta stand-in, freeing its memory (its values live
        in the step's arrays); the optimizer's state tensors likewise."""
        if not self.release_enabled or self.released:
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
        self.released = True
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

"""Where a ``TrainStep``'s state lives: its arrays (``TrainState``) and their layout.

``TrainState``: the arrays a step holds (parameters, frozen parameters, buffers, the
optimizer's state), their names, the step count, and the module and optimizer they
belong to: what checkpoints (``checkpoint.py``) read and write, without the step.

``StateLayout``: the ``Sharding`` of every array of the step, on the step's
``Placement`` (one device, or a mesh with ``ShardingRules``, as the backend's):

    parameter, buffer        its name's rule (``ShardingRules.match``), as the backend
    (frozen ones too)
    optimizer state entry    as its parameter when it has the parameter's shape (the
                             moments: FSDP shards them too), else replicated (counts)
    batch tensor             the rules' batch spec (dim 0 over the batch axis)
    loss                     replicated
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


@dataclasses.dataclass
class TrainState:
    """A training step's state, as checkpoints see it.

    Attributes:
        model: the trained module.
        optimizer: its optimizer.
        layout: where each array lives (``StateLayout``).
        param_names: the optimizer's parameters' names, in its param groups' order.
        frozen_names: the model's other parameters' names.
        buffer_names: the model's buffers' names.
        params, frozen, buffers: their values, as JAX arrays.
        state: the optimizer's state: (index in ``param_names``, key) -> array.
        steps: the steps taken.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layout: StateLayout
    param_names: list[str]
    frozen_names: list[str]
    buffer_names: list[str]
    params: list[jax.Array]
    frozen: list[jax.Array]
    buffers: list[jax.Array]
    state: dict[StateKey, jax.Array]
    steps: int


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

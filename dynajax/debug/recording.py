"""Recording mode: each JAX partition's calls, with copies of their inputs and outputs.

``Recorder.wrap`` is a ``Backend.partition_hook``: the backend hands it every compiled
partition, and the stitched graph calls the ``RecordingPartition`` it returns instead.
Only a backend the debugger made carries the hook, so compiled programs of other
backends keep their per-call path as it is.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx

from dynajax.diagnostics import GraphReport
from dynajax.partition import PartitionModule


@dataclasses.dataclass
class PartitionCall:
    """One call of one JAX partition.

    Attributes:
        report: the graph the partition belongs to (its ``kind`` and ``index``).
        name: the partition's name (``jax_0``).
        graph_module: the ATen graph the partition computes.
        inputs: copies of the tensors (and sizes) it was called with, in placeholder
            order, taken before the call.
        outputs: copies of what it returned.
    """

    report: GraphReport
    name: str
    graph_module: torch.fx.GraphModule
    inputs: list[Any]
    outputs: list[Any]

    @property
    def where(self) -> str:
        """``graph 0 (forward) jax_1``."""
        return f"graph {self.report.index} ({self.report.kind}) {self.name}"


class RecordingPartition(torch.nn.Module):
    """A compiled partition that records each call in its ``Recorder``.

    It is what the stitched graph calls instead of the partition: a
    ``PartitionModule`` (``graph_module`` and ``run``) and an ``nn.Module``, so it can
    take the partition's place as the submodule ``jax_<n>``.
    """

    graph_module: torch.fx.GraphModule

    def __init__(
        self, recorder: Recorder, report: GraphReport, name: str, part: torch.nn.Module
    ) -> None:
        super().__init__()
        self.part = part
        self.name = name
        self._run = cast(PartitionModule, part).run
        # not a submodule: never called
        self.__dict__["graph_module"] = cast(PartitionModule, part).graph_module
        self._recorder = recorder
        self._report = report

    def run(self, tensors: Sequence[Any]) -> list[Any]:
        """Calls the partition and records the call."""
        inputs = [_copy(t) for t in tensors]
        outputs = self._run(tensors)
        self._recorder.add(
            PartitionCall(
                self._report, self.name, self.graph_module, inputs, [_copy(o) for o in outputs]
            )
        )
        return outputs

    def __call__(self, *tensors: Any) -> tuple[Any, ...]:
        return tuple(self.run(tensors))

    forward = __call__


class Recorder:
    """The partition calls of one backend, in the order they ran."""

    def __init__(self) -> None:
        self.calls: list[PartitionCall] = []
        self._lock = threading.Lock()

    def wrap(self, report: GraphReport, name: str, part: torch.nn.Module) -> torch.nn.Module:
        """The ``Backend.partition_hook``: ``part``, recording its calls here."""
        return RecordingPartition(self, report, name, part)

    def add(self, call: PartitionCall) -> None:
        with self._lock:
            self.calls.append(call)


def _copy(value: Any) -> Any:
    # Inputs may be parameters or buffers that aot_autograd updates in place after the
    # call (BatchNorm's running statistics); the copy keeps what the partition saw.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value

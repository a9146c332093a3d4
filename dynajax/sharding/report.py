"""The placement of one graph, for the report: the mesh, each parameter's and buffer's
spec, and the bytes each device holds, measured from the placed arrays.

Measured, not computed: the bytes are summed over the ``addressable_shards`` of the
arrays the partitions actually hold (``InputCache.resident``), so a spec that did not
apply, a copy that was never made or a layout XLA changed shows up as it is. State is
placed at a partition's first call; before that the report says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dynajax.sharding.placement import (
    PartitionPlacement,
    Placement,
    describe_mesh,
    per_device_bytes,
    total_bytes,
)
from dynajax.sharding.rules import describe_spec


@dataclasses.dataclass(frozen=True)
class StateInfo:
    """One parameter or buffer of a graph, as placed.

    Attributes:
        name: its name (``"0.weight"``).
        kind: ``"parameter"`` or ``"buffer"``.
        shape: its shape (None when symbolic).
        dtype: its dtype, as torch names it without the prefix (``"float32"``).
        spec: ``"P('data', None)"`` or ``"replicated"``.
        rule: the regex that gave the spec (None: no rule matched).
        note: why the rule's spec was not applied (else "").
        nbytes: bytes of the whole tensor (None when the shape is symbolic).
        per_device: bytes held on each of this process's devices, measured from the
            placed array's shards (empty before the first call).
    """

    name: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str
    spec: str
    rule: str | None
    note: str
    nbytes: int | None
    per_device: dict[str, int]


class GraphSharding:
    """Where one graph's partitions placed their state (``GraphReport.sharding``).

    Args:
        placement: the backend's ``Placement``.
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._parts: list[Any] = []

    def add(self, partition: Any) -> None:
        """Records a compiled partition (a ``CompiledPartition``: its ``placement``,
        ``inputs`` and ``executables.tensor_pos`` are read when the report is made)."""
        self._parts.append(partition)

    def state(self) -> list[StateInfo]:
        """Every parameter and buffer of the graph's partitions, once each, in the order
        the partitions take them."""
        found: dict[str, tuple[Any, jax.Array | None]] = {}
        for part in self._parts:
            pp: PartitionPlacement | None = getattr(part, "placement", None)
            if pp is None:
                continue
            slot = {p: k for k, p in enumerate(part.executables.tensor_pos)}
            resident = part.inputs.resident
            for i, d in pp.state():
                name = str(d.name)  # state always has a name
                array = resident.get(slot[i]) if i in slot else None
                if name not in found or (found[name][1] is None and array is not None):
                    found[name] = (d, array)
        out = []
        for name, (d, array) in found.items():
            spec = describe_spec(d.spec) if d.spec is not None else "per call"
            dtype = str(d.dtype).removeprefix("torch.")
            size = total_bytes(d.shape, d.dtype) if d.shape is not None else None
            measured = per_device_bytes(array) if array is not None else {}
            out.append(
                StateInfo(name, d.kind, d.shape, dtype, spec, d.rule, d.note, size, measured)
            )
        return out

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of parameters and buffers each device of this process holds, summed
        over the placed arrays' shards (measured)."""
        total: dict[str, int] = {}
        for info in self.state():
            for dev, n in info.per_device.items():
                total[dev] = total.get(dev, 0) + n
        return total

    def lines(self, indent: str = "  ", eager_ops: int = 0) -> list[str]:
        """The report's lines for this graph."""
        p = self.placement
        state = self.state()
        where = (
            f"mesh {describe_mesh(p.mesh)}; outputs gathered (replicated) back to PyTorch"
            if p.mesh is not None
            else f"device {p.device}; outputs back on the inputs' PyTorch device"
        )
        out = [f"{indent}placement: {where}"]
        whole = [s.nbytes for s in state if s.nbytes is not None]
        per_dev = self.bytes_per_device()
        summary = f"{len(state)} parameter(s)/buffer(s), {size_text(sum(whole))} in all"
        if p.mesh is not None:
            sharded = sum(s.spec not in ("replicated", "per call") for s in state)
            summary += f" ({sharded} sharded, {len(state) - sharded} replicated)"
        if per_dev:
            hi, lo = max(per_dev.values()), min(per_dev.values())
            spread = size_text(hi) if hi == lo else f"{size_text(lo)} to {size_text(hi)}"
            summary += f"; per device {spread} (measured on {len(per_dev)} device(s))"
        elif state:
            summary += "; placed at the first call (not measured yet)"
        out.append(f"{indent}  state: {summary}")
        if state:
            nw = max(len(s.name) for s in state)
            shapes = [str(list(s.shape)) if s.shape is not None else "?" for s in state]
            sw = max(map(len, shapes))
            pw = max(len(s.spec) for s in state)
            dw = max(len(s.dtype) for s in state)
            for s, shape in zip(state, shapes, strict=True):
                each = max(s.per_device.values()) if s.per_device else None
                held = f"{size_text(each)}/device" if each is not None else "not placed yet"
                line = (
                    f"{indent}    {s.name:<{nw}}  {shape:<{sw}}  {s.dtype:<{dw}}  "
                    f"{s.spec:<{pw}}  {held}"
                )
                if s.note:
                    line += f"  ({s.note})"
                out.append(line)
        if p.mesh is not None:
            axes = p.rules.batch_axes()
            if axes and all(a in p.mesh.axis_names for a in axes):
                names = " x ".join(repr(a) for a in axes)
                out.append(
                    f"{indent}  other inputs (model inputs, saved activations, tangents): "
                    f"dim {p.rules.batch_dim} over {names} where it divides, else replicated"
                )
            else:
                out.append(f"{indent}  other inputs: replicated (no batch axis in the mesh)")
            if eager_ops:
                out.append(
                    f"{indent}  in PyTorch: {eager_ops} op(s) run on whole tensors between "
                    "partitions (gathered outputs, re-sharded at the next partition)"
                )
        return out


def size_text(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    if n < 1024**3:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024**3:.2f} GiB"

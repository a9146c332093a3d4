"""Placement: where each input of a JAX partition lives, and its results come back.

The one home of that decision. The runtime asks it (``crossing``) and does not decide;
the conversions it uses (``runtime/conversion.py``) are a leaf below it. ``crossing``
gives each partition a ``Crossing``, one of four cases:

    where the tensors are, on the CPU   zero-copy: input arrays are the tensors' memory,
                                        outputs are NumPy views of XLA's buffers
    ... with JAX's default an accelerator  the same, committed to JAX's CPU device
    where the tensors are, an accelerator  DLPack both ways (``cross_as_on_an_accelerator``)
    placed (``device=``, ``mesh=``)     a ``PartitionPlacement``: a ``Sharding`` per
                                        input, state resident on its devices

A ``Placement`` belongs to a ``Backend`` (built from its ``device``, ``mesh`` and
``sharding`` options); ``Placement.for_partition`` decides, per input of one partition,
its ``jax.sharding.Sharding``:

    parameter / buffer  the first matching rule's PartitionSpec (else replicated)
    any other tensor    dim ``batch_dim`` over ``batch_axis`` when it divides, else
                        replicated (model inputs, saved activations, tangents,
                        outputs of ops that ran in PyTorch)

and ``PartitionPlacement`` holds those decisions and makes the converters that
``CompiledPartition`` hands to its ``InputCache``: a per-call copy for inputs that change
between calls, and a resident copy (made once per tensor version) for the inputs that
come back unchanged, parameters and buffers above all. Resident copies are shared
between the partitions and graphs of one backend (a training step's forward and
backward graphs use one copy of each weight, not two).

Outputs come back replicated (``out_shardings``): XLA gathers them on the devices as the
program's last step, so every process of a multi-host run holds whole results, and the
PyTorch ops between partitions, the optimizer and the user always see whole tensors.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch
import torch.fx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from dynajax.errors import OptionsError, ShardingError
from dynajax.lowering.dtypes import TORCH_TO_JAX
from dynajax.runtime.conversion import (
    accelerator_array,
    committed_cpu,
    cpu_device,
    cpu_to_torch,
    fast_to_jax,
    to_jax,
    to_torch,
    zero_copy_array,
)
from dynajax.sharding.names import StateName
from dynajax.sharding.rules import RulesLike, ShardingRules, describe_spec, misfit

if TYPE_CHECKING:  # what placement reads of a partition, handed over by the backend
    from dynajax.lowering.interpreter import LoweredPartition

Converter = Callable[[torch.Tensor], Any]


class InputDecision:
    """One input of a partition: what it is and how it is laid out.

    Attributes:
        name: the parameter or buffer name, None for any other input.
        kind: ``"parameter"``, ``"buffer"`` or ``"input"``.
        spec: its ``PartitionSpec`` (None: decided per call, for a symbolic shape).
        rule: the regex that gave the spec (None: no rule matched, or not state).
        note: why a rule's spec was not used (``indivisible="replicate"``), else "".
        shape: the input's shape when known at compile time (else None).
        dtype: its torch dtype (None for a non-tensor input).
    """

    __slots__ = ("name", "kind", "spec", "rule", "note", "shape", "dtype")

    def __init__(
        self,
        name: str | None,
        kind: str,
        spec: PartitionSpec | None,
        rule: str | None = None,
        note: str = "",
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.spec = spec
        self.rule = rule
        self.note = note
        self.shape = shape
        self.dtype = dtype

    def __repr__(self) -> str:
        spec = describe_spec(self.spec) if self.spec is not None else "per call"
        return f"InputDecision({self.name or self.kind}: {spec})"


class Placement:
    """Where a backend's JAX partitions run: one JAX device, or a mesh with rules.

    Args:
        device: one ``jax.Device`` (the ``device=`` option).
        mesh: a ``jax.sharding.Mesh`` (the ``mesh=`` option); a mesh of one device is
            the same as ``device=`` that device.
        rules: the ``sharding=`` option (``ShardingRules`` or what ``coerce`` takes).

    Exactly one of ``device`` and ``mesh``.
    """

    def __init__(
        self,
        *,
        device: jax.Device | None = None,
        mesh: Mesh | None = None,
        rules: RulesLike = None,
    ) -> None:
        if (device is None) == (mesh is None):
            raise OptionsError(
                "a Placement takes either device= or mesh=: one device runs every "
                "partition there, a mesh shards them; pass one of the two."
            )
        self.rules = ShardingRules.coerce(rules)
        self.mesh: Mesh | None = None
        if mesh is not None:
            self.rules.validate(mesh)
            if mesh.size == 1:
                device = mesh.devices.flat[0]
            else:
                # XLA's partitioner propagates shardings through the torch graph's ops,
                # which carry no sharding annotations of their own: Auto axes, whatever
                # the mesh's axis types (jax.make_mesh makes Explicit ones).
                self.mesh = auto_axes(mesh)
        self.device: jax.Device | None = device
        first = device if device is not None else mesh.devices.flat[0]  # type: ignore[union-attr]
        self.platform: str = first.platform
        self._store = _ResidentStore()
        self._shardings: dict[PartitionSpec, NamedSharding] = {}

    @property
    def multi_device(self) -> bool:
        """Whether partitions run on more than one device (a mesh, not ``device=``)."""
        return self.mesh is not None

    def __repr__(self) -> str:
        if self.mesh is None:
            return f"Placement(device={self.device})"
        return f"Placement(mesh={describe_mesh(self.mesh)}, rules={self.rules})"

    def sharding(self, spec: PartitionSpec) -> Sharding:
        """The ``Sharding`` of ``spec`` on this placement (one per spec, reused)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.device)
        found = self._shardings.get(spec)
        if found is None:
            found = self._shardings[spec] = NamedSharding(self.mesh, spec)
        return found

    def decide(self, name: StateName | None, val: Any) -> InputDecision:
        """The layout of one partition input (``val``: its fake tensor or SymInt)."""
        if not isinstance(val, torch.Tensor):
            return InputDecision(None, "static", None)
        shape = _concrete(val.shape)
        if name is None:
            kind = "input"
            if self.mesh is None:
                return InputDecision(None, kind, PartitionSpec(), shape=shape, dtype=val.dtype)
            spec = self.rules.batch_spec(self.mesh, shape) if shape is not None else None
            return InputDecision(None, kind, spec, shape=shape, dtype=val.dtype)
        if self.mesh is None:
            return InputDecision(name.name, name.kind, PartitionSpec(), None, "", shape, val.dtype)
        spec, rule = self.rules.match(name.name)
        note = ""
        if shape is None:  # symbolic sizes: divisibility is unknown until a call
            why = (
                "its shape is symbolic (dynamic shapes); state is sharded by static sizes only"
                if any(e is not None for e in spec)
                else None
            )
        else:
            why = misfit(spec, shape, self.mesh)
        if why is not None:
            if self.rules.indivisible == "error" and shape is not None:
                raise ShardingError(
                    f"sharding rule {rule!r} gives {name.kind} {name.name!r} (shape "
                    f"{list(shape)}) the spec {describe_spec(spec)} on mesh "
                    f"{describe_mesh(self.mesh)}, but {why}. Change the rule (a spec that "
                    "divides, or an earlier rule that replicates this tensor), or pass "
                    "ShardingRules(..., indivisible='replicate') to replicate such tensors."
                )
            note = f"rule {rule!r} -> {describe_spec(spec)} not applied: {why}"
            spec = PartitionSpec()
        return InputDecision(name.name, name.kind, spec, rule, note, shape, val.dtype)

    def for_partition(
        self, names: Sequence[StateName | None], placeholders: Sequence[Any]
    ) -> PartitionPlacement:
        """The placement of one partition, from its placeholders' ``meta["val"]`` and the
        state name of each (None where it is not a parameter or buffer)."""
        if len(names) != len(placeholders):
            names = [None] * len(placeholders)  # unknown: every input by the batch rule
        return PartitionPlacement(
            self, [self.decide(n, v) for n, v in zip(names, placeholders, strict=True)]
        )

    # -- arrays -------------------------------------------------------------------------

    def put(self, value: Any, sharding: Sharding, copy: bool = False) -> jax.Array:
        """``value`` (a NumPy view or a ``jax.Array`` of the whole tensor) laid out by
        ``sharding``. On a mesh spanning several processes, each process passes the
        whole value and builds only the shards of its own devices. ``copy``: the
        result never aliases ``value``'s memory (it may be donated)."""
        return _put(value, sharding, copy)

    def resident(self, t: torch.Tensor, sharding: Sharding) -> jax.Array | None:
        """The resident copy of ``t`` laid out by ``sharding``: made once per tensor
        version and shared by every partition of this placement; None for a tensor
        whose changes cannot be tracked (an inference tensor, an empty one)."""
        if t.is_inference() or t.numel() == 0 or t.dtype not in TORCH_TO_JAX:
            return None  # no version counter (inference tensor), or nothing to keep
        return self._store.get(t, sharding, lambda: self.put(to_jax(t), sharding))

    def to_torch(self) -> Callable[[jax.Array], torch.Tensor]:
        """Output conversion: a tensor viewing this process's copy of a (replicated)
        output, on the CPU for CPU devices (through DLPack elsewhere)."""
        base = cpu_to_torch if self.platform == "cpu" else to_torch
        if self.mesh is None:
            return base
        return lambda a: base(a.addressable_data(0))


def resolve_device(value: Any) -> jax.Device | None:
    """A ``jax.Device`` from a device or a ``"platform[:index]"`` string."""
    if value is None or isinstance(value, jax.Device):
        return value
    if not isinstance(value, str):
        raise OptionsError(
            f"device must be a jax.Device or a string like 'cpu:1' or 'gpu:0', got {value!r}."
        )
    platform, _, index = value.strip().partition(":")
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        available = sorted({d.platform for d in jax.devices()} | {"cpu"})
        raise OptionsError(
            f"device {value!r}: JAX has no {platform!r} devices here; available platforms: "
            f"{', '.join(available)}."
        ) from None
    if not index:
        return devices[0]
    if not index.isdigit() or int(index) >= len(devices):
        raise OptionsError(
            f"device {value!r}: JAX has {len(devices)} {platform} device(s), numbered "
            f"0 to {len(devices) - 1}."
        )
    return devices[int(index)]


def check_mesh(mesh: Any, device: Any) -> None:
    """Raises ``OptionsError`` unless ``mesh`` is None or a concrete ``Mesh`` given
    without ``device``."""
    if mesh is None:
        return
    if isinstance(mesh, jax.sharding.AbstractMesh):
        raise OptionsError(
            "mesh must be a concrete jax.sharding.Mesh with devices; an AbstractMesh has "
            "none to place tensors on (build one with jax.make_mesh or "
            "jax.sharding.Mesh(devices, axis_names))."
        )
    if not isinstance(mesh, jax.sharding.Mesh):
        raise OptionsError(
            f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,), ('data',))), got "
            f"{type(mesh).__name__}: {mesh!r}."
        )
    if device is not None:
        raise OptionsError(
            f"device={device} and mesh= both say where the JAX partitions run; pass one: "
            "device= for one device, mesh= for several (a mesh of one device is the same "
            "as device=)."
        )


def placement_of(
    tensors: Sequence[torch.Tensor], device: Any = None, mesh: Any = None, rules: RulesLike = None
) -> Placement:
    """Where one whole program runs (``train_step``'s options): ``mesh`` (laid out by
    ``rules``), ``device``, or by default the JAX device of ``tensors`` (the model's own:
    the CPU for a CPU model)."""
    device = resolve_device(device)
    check_mesh(mesh, device)
    if mesh is not None:
        return Placement(mesh=mesh, rules=rules)
    if rules is not None:
        raise OptionsError(
            "sharding= lays the state out on a mesh: pass mesh= too (e.g. "
            "jax.make_mesh((8,), ('data',)))."
        )
    if device is None:
        first = tensors[0] if tensors else torch.empty(0)
        device = cpu_device() if first.device.type == "cpu" else next(iter(to_jax(first).devices()))
    return Placement(device=device)


class PartitionPlacement:
    """The placement of one partition's inputs (``Placement.for_partition``).

    Attributes:
        placement: the backend's ``Placement``.
        inputs: one ``InputDecision`` per placeholder.
        default_sharding: the sharding of arguments that are not tensors of the graph
            (the random seed): replicated.
        out_sharding: the outputs' sharding (replicated on a mesh; None on one device,
            where outputs stay on it).
    """

    def __init__(self, placement: Placement, inputs: list[InputDecision]) -> None:
        self.placement = placement
        self.inputs = inputs
        self.default_sharding = placement.sharding(PartitionSpec())
        self.out_sharding = self.default_sharding if placement.multi_device else None

    @property
    def device(self) -> jax.Device | None:
        return self.placement.device

    @property
    def multi_device(self) -> bool:
        return self.placement.multi_device

    @property
    def platform(self) -> str:
        return self.placement.platform

    def state(self) -> list[tuple[int, InputDecision]]:
        """(placeholder position, decision) of every parameter and buffer."""
        return [(i, d) for i, d in enumerate(self.inputs) if d.name is not None]

    def converters(self, positions: Sequence[int]) -> tuple[list[Converter], list[Converter]]:
        """Per tensor input (``positions``: their placeholder positions), the per-call
        converter and the resident one, as ``InputCache`` takes them."""
        per_call: list[Converter] = []
        resident: list[Converter] = []
        for i in positions:
            d = self.inputs[i]
            if d.spec is None:
                per_call.append(self._by_shape(self._per_call))
                resident.append(self._by_shape(self._resident))
            else:
                sharding = self.placement.sharding(d.spec)
                per_call.append(_bind(self._per_call, sharding))
                resident.append(_bind(self._resident, sharding))
        return per_call, resident

    def _per_call(self, t: torch.Tensor, sharding: Sharding) -> jax.Array:
        return self.placement.put(to_jax(t), sharding)

    def _resident(self, t: torch.Tensor, sharding: Sharding) -> jax.Array | None:
        return self.placement.resident(t, sharding)

    def _by_shape(
        self, convert: Callable[[torch.Tensor, Sharding], Any]
    ) -> Callable[[torch.Tensor], Any]:
        """A converter that picks the batch spec from the concrete shape at each call
        (inputs with symbolic sizes under dynamic shapes)."""
        placement = self.placement
        mesh = placement.mesh

        def convert_by_shape(t: torch.Tensor) -> Any:
            spec = PartitionSpec() if mesh is None else placement.rules.batch_spec(mesh, t.shape)
            return convert(t, placement.sharding(spec))

        return convert_by_shape


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Crossing:
    """How one partition's tensors cross into JAX and its results back (``crossing``).

    Attributes:
        partition: the ``device=``/``mesh=`` decisions (None: where the tensors are).
        device_type: the torch device type eager runs the graph on (None: several, or a
            graph with no tensors).
        device: the JAX device partitions are placed on (None: where the tensors are,
            or a mesh).
        multi_device: placed on a mesh of several devices.
        on_accelerator: the tensors are on an accelerator and the partition runs there:
            they cross by DLPack, and results remember the arrays they view.
        zero_copy: CPU tensors run where they are: a cached input array is the tensor's
            memory and sees its in-place writes; outputs are NumPy views.
        convert: a tensor -> its array for this call (one for all inputs, or one per
            tensor input when placed).
        make_cached: a tensor -> the array kept across calls (None: convert per
            call); one for all, or one per tensor input.
        sharding: the executables' input sharding (None: JAX's default device).
        platform: the JAX platform the executables are compiled for.
        out_sharding: the outputs' sharding (replicated on a mesh, else None).
        to_torch: an output array -> a tensor (None ``on_accelerator``: the runtime's
            remembering importer for ``results_device``).
        results_device: the device results come from (one accelerator, else the CPU;
            None where the tensors span several).
        cpu_outputs: the outputs eager gives on the CPU from a partition that runs on
            an accelerator (a CPU scalar's arithmetic, a graph that only creates
            tensors): moved there after each call.
    """

    partition: PartitionPlacement | None
    device_type: str | None
    convert: Converter | list[Converter]
    make_cached: Converter | list[Converter]
    sharding: Sharding | None
    platform: str
    to_torch: Callable[[jax.Array], torch.Tensor] | None
    results_device: torch.device | None
    cpu_outputs: list[int]

    @property
    def on_accelerator(self) -> bool:
        return self.partition is None and self.device_type != "cpu"

    @property
    def zero_copy(self) -> bool:
        return self.partition is None and self.device_type == "cpu"

    @property
    def device(self) -> jax.Device | None:
        return self.partition.device if self.partition is not None else None

    @property
    def multi_device(self) -> bool:
        return self.partition is not None and self.partition.multi_device

    @property
    def persistent(self) -> bool:
        """Whether its executables may come from the persistent cache: not on a mesh of
        several devices (the cache keys a program by platform, not by devices, and a
        loaded executable must run on this mesh's devices)."""
        return not self.multi_device

    @property
    def out_sharding(self) -> Sharding | None:
        return self.partition.out_sharding if self.partition is not None else None

    def __repr__(self) -> str:
        where = (
            repr(self.partition.placement)
            if self.partition is not None
            else "accelerator, where the tensors are"
            if self.on_accelerator
            else "CPU, zero-copy"
        )
        return f"Crossing({where})"


def crossing(
    lowered: LoweredPartition,
    placement: Placement | None = None,
    names: Sequence[StateName | None] = (),
) -> Crossing:
    """Where the partition ``lowered`` runs and how its tensors cross: on ``placement``
    (the backend's ``device=``/``mesh=``; ``names``: each input's parameter or buffer
    name, for the mesh's rules), else where eager runs it, its tensors' device."""
    vals, out_vals = lowered.input_vals, lowered.output_vals
    # Where eager runs the graph: its inputs' device; with none, its outputs'. A 0-dim
    # CPU tensor may meet a GPU's tensors in one op (PyTorch takes it as a scalar): the
    # partition runs on the GPU and takes that tensor there per call.
    devices = _device_types(vals) or _device_types(out_vals)
    accelerators = devices - {"cpu"}
    device_type = (
        accelerators.pop() if len(accelerators) == 1 else "cpu" if devices == {"cpu"} else None
    )
    on_cpu = device_type == "cpu"
    results_device = _results_device([*vals, *out_vals])
    if placement is not None and not (
        on_cpu and placement.device == cpu_device()  # where CPU tensors run anyway
    ):
        partition = placement.for_partition(names, vals)
        tensor_pos = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
        convert, make_cached = partition.converters(tensor_pos)
        return Crossing(
            partition=partition,
            device_type=device_type,
            convert=convert,
            make_cached=make_cached,
            sharding=partition.default_sharding,
            platform=partition.platform,
            # On a mesh: this process's copy of the whole (replicated) output.
            to_torch=(
                placement.to_torch()
                if partition.multi_device
                else cpu_to_torch
                if on_cpu
                else to_torch
            ),
            results_device=results_device,
            cpu_outputs=[],
        )
    if on_cpu:
        cpu = SingleDeviceSharding(cpu_device())
        return Crossing(
            partition=None,
            device_type=device_type,
            # NumPy views would land on JAX's default device where it is an accelerator.
            convert=fast_to_jax if jax.default_backend() == "cpu" else committed_cpu,
            make_cached=zero_copy_array,
            sharding=cpu,
            platform="cpu",
            to_torch=cpu_to_torch,
            results_device=results_device,
            cpu_outputs=[],
        )
    return Crossing(
        partition=None,
        device_type=device_type,
        convert=fast_to_jax,
        # A CPU scalar among the accelerator's tensors is copied per call.
        make_cached=accelerator_array if "cpu" in devices else zero_copy_array,
        sharding=None,
        platform=jax.default_backend(),
        to_torch=None,
        results_device=results_device,
        cpu_outputs=[
            i
            for i, v in enumerate(out_vals)
            if isinstance(v, torch.Tensor) and v.device.type == "cpu"
        ],
    )


def _device_types(vals: Sequence[Any]) -> set[str]:
    """The device types of the tensors among ``meta["val"]`` values."""
    return {v.device.type for v in vals if isinstance(v, torch.Tensor)}


def _results_device(vals: Sequence[Any]) -> torch.device | None:
    """The one accelerator among the tensors of ``vals``, the CPU if they have none,
    None if they span several."""
    devices = {
        v.device for v in vals if isinstance(v, torch.Tensor) and v.device.type != "cpu"
    } or {torch.device("cpu")}
    return devices.pop() if len(devices) == 1 else None


def _bind(fn: Callable[[torch.Tensor, Sharding], Any], sharding: Sharding) -> Converter:
    return lambda t: fn(t, sharding)


class _ResidentStore:
    """Resident copies shared by the partitions of one placement, keyed by the tensor
    (identity, version counter, storage pointer) and the sharding.

    One entry per (tensor, sharding): a new version replaces the old copy, so at most
    one stale copy lives on while the partitions still holding it refresh; an entry
    dies with its tensor.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, Sharding], tuple[weakref.ref, int, int, jax.Array]] = {}
        self._lock = threading.Lock()

    def get(self, t: torch.Tensor, sharding: Sharding, make: Callable[[], jax.Array]) -> jax.Array:
        key = (id(t), sharding)
        version, ptr = t._version, t.data_ptr()
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found[0]() is t and found[1:3] == (version, ptr):
                return found[3]
        array = make()
        entries = self._entries

        def forget(_: weakref.ref, key: tuple[int, Sharding] = key) -> None:
            entries.pop(key, None)

        with self._lock:
            self._entries[key] = (weakref.ref(t, forget), version, ptr, array)
        return array


def place(state: Mapping[str, Any], mesh: Mesh, rules: RulesLike = None) -> dict[str, jax.Array]:
    """``state`` (name -> array or tensor, e.g. ``jax_function``'s) laid out on ``mesh``
    by ``rules``: each value a ``jax.Array`` with a ``NamedSharding`` on ``mesh`` as
    given (``jax.make_mesh``'s Explicit axes included: lay the function's inputs out on
    the same mesh; ``jax_function`` runs the torch graph with those axes Auto, since its
    ops carry no sharding annotations). ``jax.jit`` of a function taking them compiles
    with those input shardings and lets XLA's partitioner propagate the rest. A spec
    that does not fit its tensor raises ``ShardingError`` (or replicates under
    ``indivisible="replicate"``).
    """
    found = shardings(state, mesh, rules)
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            value = to_jax(value)
        out[name] = _put(value, found[name])
    return out


def shardings(
    state: Mapping[str, Any], mesh: Mesh, rules: RulesLike = None
) -> dict[str, NamedSharding]:
    """The ``NamedSharding`` ``rules`` give each entry of ``state`` on ``mesh`` (for
    ``jax.jit(..., in_shardings=...)``); values only need a ``shape``."""
    if not isinstance(mesh, Mesh):
        raise OptionsError(
            f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,), ('data',))), "
            f"got {type(mesh).__name__}."
        )
    rules = ShardingRules.coerce(rules)
    rules.validate(mesh)
    out = {}
    for name, value in state.items():
        shape = tuple(int(s) for s in np.shape(value))
        spec, rule = rules.match(name)
        why = misfit(spec, shape, mesh)
        if why is not None:
            if rules.indivisible == "error":
                raise ShardingError(
                    f"sharding rule {rule!r} gives {name!r} (shape {list(shape)}) the spec "
                    f"{describe_spec(spec)} on mesh {describe_mesh(mesh)}, but {why}. Change "
                    "the rule, or pass ShardingRules(..., indivisible='replicate')."
                )
            spec = PartitionSpec()
        out[name] = NamedSharding(mesh, spec)
    return out


def _put(value: Any, sharding: Sharding, copy: bool = False) -> jax.Array:
    if sharding.is_fully_addressable:
        if copy:
            # ``device_put(numpy_view, may_alias=False)`` still aliases an aligned NumPy
            # view on the CPU (a torch tensor's memory), and XLA copies a donated buffer
            # it does not own at each call that donates it (a second copy of a model's
            # parameters at ``train_step``'s first step). From a ``jax.Array``,
            # ``may_alias=False`` copies: one copy, into XLA's own memory.
            value = jax.device_put(value, sharding)
        return jax.device_put(value, sharding, may_alias=False if copy else None)
    # Several processes: each holds the whole value and builds its own devices' shards.
    if copy:
        return jax.make_array_from_callback(
            value.shape, sharding, lambda index: np.array(value[index], copy=True)
        )
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def gather_to_torch(a: jax.Array) -> torch.Tensor:
    """The whole value of ``a`` as a torch tensor: a view of this process's copy when
    it is replicated, else gathered (across processes with JAX's
    ``process_allgather``) into host memory."""
    if a.is_fully_replicated:
        return to_torch(a.addressable_data(0))
    if a.is_fully_addressable:
        return to_torch(jax.device_put(a, min(a.devices(), key=lambda d: d.id)))
    from jax.experimental import multihost_utils

    value = np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return to_torch(jax.device_put(value, jax.local_devices(backend="cpu")[0]))


def describe_mesh(mesh: Mesh) -> str:
    """``data=2 x model=4 (8 cpu devices)``."""
    axes = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    platform = mesh.devices.flat[0].platform
    return f"{axes} ({mesh.size} {platform} device{'s' if mesh.size != 1 else ''})"


def per_device_bytes(array: jax.Array) -> dict[str, int]:
    """Bytes of ``array`` held on each of this process's devices, measured from its
    addressable shards."""
    out: dict[str, int] = {}
    for shard in array.addressable_shards:
        key = str(shard.device)
        out[key] = out.get(key, 0) + int(shard.data.nbytes)
    return out


def _concrete(shape: Sequence[Any]) -> tuple[int, ...] | None:
    """The shape as ints, or None when a size is symbolic."""
    return tuple(shape) if all(isinstance(s, int) for s in shape) else None


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with ``Auto`` axis types (itself when they already are): the mesh
    dynajax lays tensors out on, so that XLA's partitioner propagates shardings through
    ops that carry none."""
    types = getattr(mesh, "axis_types", None)
    auto = jax.sharding.AxisType.Auto
    if types is None or all(t == auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def on_auto_axes(fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn(*arrays)``; where the arrays lie on a mesh with Explicit axes
    (``jax.make_mesh``'s default), with those axes Auto inside ``fn``: a torch graph's
    ops carry no sharding annotations, which Explicit axes require of every
    contraction, so XLA's partitioner propagates the inputs' shardings (as on the
    meshes ``auto_axes`` makes), and the outputs come back replicated on the user's
    mesh."""
    mesh = _explicit_mesh(arrays)
    if mesh is None:
        return fn(*arrays)
    explicit = tuple(
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == jax.sharding.AxisType.Explicit
    )
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=PartitionSpec())(*arrays)


def _explicit_mesh(arrays: Sequence[Any]) -> Any:
    """The (abstract) mesh of the first array laid out on a mesh with an Explicit axis,
    or None."""
    explicit = jax.sharding.AxisType.Explicit
    for a in arrays:
        if not isinstance(a, jax.Array):
            continue
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and explicit in tuple(mesh.axis_types):
            return mesh
    return None


def total_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a whole tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

"""Sharding rules: which ``PartitionSpec`` each parameter and buffer gets, and how the
other inputs are split.

The style is that of JAX model libraries (flax's ``match_partition_rules``, t5x and
maxtext logical-axis rules): an ordered list of ``(regex, PartitionSpec)`` pairs over
parameter and buffer names, the first regex that ``re.search``es the name wins, and a
name no rule matches is replicated. Names are PyTorch's own (``model.named_parameters()``:
``"0.weight"``, ``"transformer.h.0.attn.c_attn.weight"``).

    rules = dynajax.ShardingRules(
        [
            (r"mlp\\.c_fc\\.weight$", P(None, "model")),   # column-parallel
            (r"mlp\\.c_proj\\.weight$", P("model", None)), # row-parallel
        ],
        batch_axis="data",                              # inputs: dim 0 over "data"
    )

Every other tensor a JAX partition takes (the model's inputs, activations saved for the
backward, gradients flowing in) is split along ``batch_dim`` over ``batch_axis`` when that
dimension divides evenly, and replicated otherwise. A sharding never changes what a
partition computes (XLA's SPMD partitioner inserts whatever communication the program
needs), only where the data lives and how much moves, so that default is safe for any
tensor, batch or not.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from dynajax.errors import OptionsError

# The mesh axis inputs are split over unless told otherwise. A mesh without it (a
# tensor-parallel mesh of one "model" axis) replicates inputs.
DEFAULT_BATCH_AXIS = "data"

_POLICIES = ("error", "replicate")

SpecLike = PartitionSpec | Sequence[Any] | None
RulesLike = Any  # ShardingRules | Mapping[str, SpecLike] | Sequence[tuple[str, SpecLike]] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """How a model's state and inputs are laid out on a ``jax.sharding.Mesh``.

    Args:
        params: ``(regex, spec)`` pairs (a list, or a mapping in insertion order) over
            parameter and buffer names; the first regex that ``re.search``es a name gives
            its ``PartitionSpec`` (a tuple or list is converted; ``None`` means
            replicated); a name no rule matches is replicated.
        batch_axis: the mesh axis (or tuple of axes) the batch dimension of every other
            tensor input is split over; ``None`` replicates them. The default, ``"data"``,
            replicates inputs on a mesh without a ``"data"`` axis; any other axis must
            exist in the mesh.
        batch_dim: which dimension of an input is the batch (0).
        indivisible: what a rule whose spec does not fit its tensor (a sharded dimension
            not divisible by its mesh axes' size, or more spec entries than dimensions)
            does: ``"error"`` (the default; ``dynajax.ShardingError`` names the tensor,
            its shape and the rule) or ``"replicate"`` (the tensor is replicated and the
            report says why).

    Presets: ``ShardingRules.data_parallel()``, ``ShardingRules.fsdp()``.
    """

    params: tuple[tuple[str, PartitionSpec], ...] = ()
    batch_axis: str | tuple[str, ...] | None = DEFAULT_BATCH_AXIS
    batch_dim: int = 0
    indivisible: str = "error"

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _normalize_params(self.params))
        axis = self.batch_axis
        if isinstance(axis, list):
            axis = tuple(axis)
            object.__setattr__(self, "batch_axis", axis)
        if not (
            axis is None
            or isinstance(axis, str)
            or (isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis))
        ):
            raise OptionsError(
                f"batch_axis must be a mesh axis name, a tuple of names, or None (inputs "
                f"replicated), got {axis!r}."
            )
        if isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int):
            raise OptionsError(f"batch_dim must be an int, got {self.batch_dim!r}.")
        if self.batch_dim < 0:
            raise OptionsError(
                f"batch_dim must be >= 0 (inputs have different ranks), got {self.batch_dim}."
            )
        if self.indivisible not in _POLICIES:
            raise OptionsError(
                f"indivisible must be one of {list(_POLICIES)}, got {self.indivisible!r}."
            )

    # -- presets ------------------------------------------------------------------------

    @classmethod
    def data_parallel(cls, axis: str | tuple[str, ...] = DEFAULT_BATCH_AXIS) -> ShardingRules:
        """Parameters and buffers replicated, inputs split along dim 0 over ``axis``."""
        return cls((), batch_axis=axis)

    @classmethod
    def fsdp(cls, axis: str = DEFAULT_BATCH_AXIS) -> ShardingRules:
        """Fully sharded data parallel: every parameter and buffer split along dim 0 over
        ``axis`` where that dimension divides evenly (replicated otherwise, the reason in
        the report), inputs split along dim 0 over the same axis. XLA gathers each
        parameter where the program needs it whole."""
        return cls(((".*", PartitionSpec(axis)),), batch_axis=axis, indivisible="replicate")

    @classmethod
    def coerce(cls, value: RulesLike) -> ShardingRules:
        """``ShardingRules`` from itself, None (everything replicated, inputs split over
        ``"data"``), a mapping ``{regex: spec}`` or a list of ``(regex, spec)`` pairs."""
        if value is None:
            return cls()
        if isinstance(value, ShardingRules):
            return value
        if isinstance(value, Mapping):
            return cls(tuple(value.items()))
        if isinstance(value, list | tuple):
            return cls(tuple(value))
        raise OptionsError(
            "sharding must be a dynajax.ShardingRules, a mapping {regex: PartitionSpec} or "
            f"a list of (regex, PartitionSpec) pairs, got {type(value).__name__}: {value!r}."
        )

    # -- checks against a mesh ----------------------------------------------------------

    def validate(self, mesh: jax.sharding.Mesh) -> None:
        """Raises ``OptionsError`` for a spec naming an axis the mesh lacks (or one axis
        twice), or an explicit ``batch_axis`` the mesh lacks."""
        names = tuple(mesh.axis_names)
        for pattern, spec in self.params:
            used = _axes_of(spec)
            missing = [a for a in used if a not in names]
            if missing:
                raise OptionsError(
                    f"sharding rule {pattern!r} -> {spec} names mesh axis {missing[0]!r}, "
                    f"but the mesh has axes {list(names)} ({_describe(mesh)}); use those "
                    "names or build the mesh with this one."
                )
            twice = sorted({a for a in used if used.count(a) > 1})
            if twice:
                raise OptionsError(
                    f"sharding rule {pattern!r} -> {spec} uses mesh axis {twice[0]!r} "
                    "twice; an axis can split only one dimension of a tensor."
                )
        axes = self.batch_axes()
        if axes and self.batch_axis != DEFAULT_BATCH_AXIS:
            missing = [a for a in axes if a not in names]
            if missing:
                raise OptionsError(
                    f"batch_axis {self.batch_axis!r} names mesh axis {missing[0]!r}, but "
                    f"the mesh has axes {list(names)}; pass one of those, or None to "
                    "replicate the inputs."
                )

    def batch_axes(self) -> tuple[str, ...]:
        """The batch axis as a tuple (empty when inputs are replicated)."""
        if self.batch_axis is None:
            return ()
        return (self.batch_axis,) if isinstance(self.batch_axis, str) else self.batch_axis

    # -- decisions ----------------------------------------------------------------------

    def match(self, name: str) -> tuple[PartitionSpec, str | None]:
        """The spec of the first rule whose regex ``re.search``es ``name``, and that
        regex; ``(PartitionSpec(), None)`` when no rule matches (replicated)."""
        for pattern, spec in self.params:
            if _compiled(pattern).search(name):
                return spec, pattern
        return PartitionSpec(), None

    def batch_spec(self, mesh: jax.sharding.Mesh, shape: Sequence[int]) -> PartitionSpec:
        """The spec of a non-state input of this (concrete) shape: ``batch_dim`` over
        ``batch_axis`` when it exists, is in the mesh and divides evenly; else replicated."""
        axes = tuple(a for a in self.batch_axes() if a in mesh.axis_names)
        d = self.batch_dim
        if not axes or axes != self.batch_axes() or len(shape) <= d:
            return PartitionSpec()
        size = math.prod(mesh.shape[a] for a in axes)
        if size == 1 or shape[d] % size:
            return PartitionSpec()
        entry: Any = axes[0] if len(axes) == 1 else axes
        return PartitionSpec(*([None] * d), entry)


def misfit(spec: PartitionSpec, shape: Sequence[int], mesh: jax.sharding.Mesh) -> str | None:
    """Why ``spec`` cannot lay out a tensor of ``shape`` on ``mesh``, or None if it can."""
    if len(spec) > len(shape):
        return f"the spec has {len(spec)} entries but the tensor has {len(shape)} dimension(s)"
    for d, entry in enumerate(spec):
        axes = _entry_axes(entry)
        if not axes:
            continue
        size = math.prod(mesh.shape[a] for a in axes)
        if shape[d] % size:
            named = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
            return f"dimension {d} (size {shape[d]}) is not divisible by {size} (mesh {named})"
    return None


def describe_spec(spec: PartitionSpec) -> str:
    """``P('data', None)``, or ``replicated`` for a spec that splits nothing."""
    if not _axes_of(spec):
        return "replicated"
    inner = ", ".join(repr(e) if e is not None else "None" for e in spec)
    return f"P({inner})"


def _describe(mesh: jax.sharding.Mesh) -> str:
    return ", ".join(f"{a}={n}" for a, n in mesh.shape.items())


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _axes_of(spec: PartitionSpec) -> list[str]:
    return [a for entry in spec for a in _entry_axes(entry)]


def _to_spec(pattern: str, value: SpecLike) -> PartitionSpec:
    if value is None:
        return PartitionSpec()
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, str):
        return PartitionSpec(value)
    if isinstance(value, list | tuple) and all(
        e is None
        or isinstance(e, str)
        or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))
        for e in value
    ):
        return PartitionSpec(*value)
    raise OptionsError(
        f"sharding rule {pattern!r}: {value!r} is not a PartitionSpec; use "
        "jax.sharding.PartitionSpec('data', None), a tuple of axis names and None, or None "
        "(replicated)."
    )


def _normalize_params(params: Any) -> tuple[tuple[str, PartitionSpec], ...]:
    if isinstance(params, Mapping):
        params = tuple(params.items())
    if isinstance(params, str) or not isinstance(params, Iterable):
        raise OptionsError(f"sharding rules must be (regex, PartitionSpec) pairs, got {params!r}.")
    out = []
    for item in params:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise OptionsError(
                f"sharding rule {item!r} is not a (regex, PartitionSpec) pair; write e.g. "
                "(r'mlp\\.fc1\\.weight$', PartitionSpec('model', None))."
            )
        pattern, value = item
        try:
            _compiled(pattern)
        except re.error as e:
            raise OptionsError(f"sharding rule {pattern!r} is not a valid regex: {e}.") from None
        out.append((pattern, _to_spec(pattern, value)))
    return tuple(out)


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    found = _PATTERNS.get(pattern)
    if found is None:
        found = _PATTERNS[pattern] = re.compile(pattern)
    return found

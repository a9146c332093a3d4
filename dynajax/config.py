"""Backend options: one dataclass, validated, settable by ``DYNAJAX_*`` variables.

Precedence: explicit options (``Backend(**options)`` or ``torch.compile(...,
options={...})``) win over environment variables, which win over defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dynajax.errors import OptionsError
from dynajax.passes.user import normalize_passes, normalize_rewrites
from dynajax.sharding.placement import check_mesh, resolve_device
from dynajax.sharding.rules import ShardingRules

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of the dynajax backend.

    Attributes:
        min_block_size: a JAX partition with fewer ATen ops than this stays in PyTorch
            (reason BLOCK_TOO_SMALL). Env: ``DYNAJAX_MIN_BLOCK_SIZE``.
        fallback_ops: op names (``"aten.sort"``, ``"aten.sort.default"``) or
            ``OpOverload``/``OpOverloadPacket`` objects always left to PyTorch
            (reason USER_FALLBACK). Env: ``DYNAJAX_FALLBACK_OPS`` (comma separated).
        strict: raise ``UnsupportedNodesError`` listing every node that cannot run in
            JAX instead of falling back. Env: ``DYNAJAX_STRICT``.
        cache_dir: directory of the persistent XLA compilation cache; ``""`` turns it
            off, ``None`` picks the default (``$XDG_CACHE_HOME/dynajax/xla``, else
            ``~/.cache/dynajax/xla``). It holds executables, keyed by their program
            (graph, shapes, dtypes, everything the options changed in it), the device
            and the host; aot_autograd's inference graphs, keyed by Dynamo's graph and
            its inputs' metadata; and the abstract evaluations of dynajax's rules. Each
            entry is checked against the versions of torch, jax, jaxlib and dynajax.
            Env: ``DYNAJAX_CACHE_DIR``.
        cache_max_bytes: bound on the total size of the cache directory's entries
            (default 1 GiB); beyond it the least recently used entries are removed.
            ``None`` or ``0``: no bound. Env: ``DYNAJAX_CACHE_MAX_BYTES``.
        max_executables: under dynamic shapes, how many XLA executables (one per
            concrete shape, or per bucket) each JAX partition keeps; the least recently
            used is dropped beyond that (a later call with its shape compiles again, or
            loads it from the persistent cache). Env: ``DYNAJAX_MAX_EXECUTABLES``.
        pad_to_buckets: under dynamic shapes, pad each symbolic dimension up to the next
            power of two and slice the outputs back, so that batch sizes 1..64 need 7
            executables instead of 64. Applied per partition and per symbol only where
            the padding provably cannot reach the real rows (no reduction, contraction,
            reshape or data movement across that dimension; checked on the traced JAX
            program); elsewhere the partition compiles per exact size, and the
            ``dynajax.shapes`` logger says why. Env: ``DYNAJAX_PAD_TO_BUCKETS``.
        checks: raise where eager raises on argument values: an index out of range
            (``embedding``, ``gather``, ``x[idx]``, scatters, ...), an integer division
            or remainder by zero, invalid probabilities, ... (the list, with eager's
            messages, is ``tests/lowering/value_checks.txt``). JAX clamps or fills such
            values; with checks, each partition computes eager's checks inside its XLA
            program and the call raises eager's exception type and message before any
            output or in-place update reaches the user. Costs one small device-to-host
            read per call of a partition with checks. False: no checks (invalid values
            give unspecified numbers, as in ``jax.jit``). Env: ``DYNAJAX_CHECKS``.
        perf_fallbacks: keep in PyTorch the ops whose PyTorch kernel was measured faster
            than XLA's, boundary included (reason PERF, listed in
            ``dynajax/capability/cost.py``: today large fused CPU attentions and fused
            ``nn.TransformerEncoderLayer`` fast paths, with their measurements). Only
            where the JAX partitions run where the tensors are (not with ``device`` or
            ``mesh``, which ask for JAX-resident work). False: every op with a rule runs
            in JAX. Env: ``DYNAJAX_PERF_FALLBACKS``.
        measure_costs: with ``perf_fallbacks``, where the choice between XLA and a
            PyTorch kernel depends on the machine (the large attention, the fused
            encoder layer, a graph's convolutions), time both on this machine at the
            graph's first compile
            and keep the faster: the graph built both ways, a few calls each on random
            inputs of its shapes (the op alone where the graph cannot run on made-up
            inputs: a user's op, a symbolic size); the times are kept in the
            persistent cache (keyed by the machine and the graph, or the op, its
            shapes and dtypes) and listed in the report with the choice. False: the
            defaults measured on the project's machine (``capability/cost.py``). Env:
            ``DYNAJAX_MEASURE_COSTS``.
        device: the JAX device the JAX partitions run on: a ``jax.Device`` or
            ``"platform[:index]"`` (``"cpu:1"``, ``"gpu:0"``, ``"tpu"``). Parameters and
            buffers are copied there once and stay resident between calls, refreshed
            when PyTorch changes them (anything that bumps the tensor's version counter
            or replaces its storage: optimizer steps, ``load_state_dict``,
            ``p.data = ...``); other inputs are copied per call; outputs come back to
            the inputs' PyTorch device. This runs a model on a device PyTorch has no
            backend for. None (the default): where the tensors are (CPU tensors on
            JAX's first CPU device, zero-copy). Env: ``DYNAJAX_DEVICE``.
        mesh: a ``jax.sharding.Mesh``: the JAX partitions run on all its devices, SPMD,
            with parameters and buffers resident and laid out by ``sharding``, other
            tensor inputs split along their batch dimension, and outputs gathered back
            to PyTorch as whole tensors. A mesh of one device is ``device=`` that
            device. Not with ``device``. No environment variable (a mesh is an object).
        sharding: how state and inputs are laid out on ``mesh``: a
            ``dynajax.ShardingRules``, a mapping ``{regex: PartitionSpec}`` or a list of
            ``(regex, PartitionSpec)`` pairs over parameter and buffer names (first
            match wins; unmatched: replicated). None: everything replicated, inputs
            split along dim 0 over the mesh's ``"data"`` axis if it has one (data
            parallelism). Needs ``mesh``.
        passes: the user's graph passes, by the stage they run at:
            ``{"pre_aot": [...], "post_aot": [...], "post_passes": [...]}`` (each a
            ``torch.fx`` ``PassBase`` or a function of a ``GraphModule``; a single pass
            may stand alone). ``pre_aot``: Dynamo's torch-level graph, before
            aot_autograd; ``post_aot``: each ATen graph (inference, forward, backward)
            before dynajax's passes; ``post_passes``: after them, before the capability
            stage. The ATen stages run in dynajax's own pass list
            (``dynajax/passes/pipeline.py``). No environment variable.
        rewrites: pattern rewrites applied to Dynamo's torch-level graph before the
            ``pre_aot`` passes: ``dynajax.Rewrite(pattern, replacement, ...)`` objects or
            ``(pattern, replacement)`` pairs of functions (the pattern matched by
            torch.fx's ``SubgraphMatcher``; the replacement traced per match and may call
            ``dynajax.call_jax``). The report lists each rewrite with its matches and
            their source lines. No environment variable.
        profile: time every call of each graph and partition, and name them in the
            profilers users already run: each partition's call is a range
            ``dynajax/graph<i>/jax_<n>`` under ``torch.profiler.profile`` (a
            ``record_function``) and inside ``jax.profiler.trace`` (a
            ``TraceAnnotation``), each graph's call a range ``dynajax/graph<i>``; the
            report then gives each partition's time split into its crossings and XLA's
            run, and the time in PyTorch between partitions. Each call then takes the
            regular path (not the cached-input entry point) and waits for XLA's result:
            a 16-32-4 MLP's call went from 40 to 63 µs on a 2-core CPU. Off (the
            default), the per-call path has none of this. Env: ``DYNAJAX_PROFILE``.
    """

    min_block_size: int = 1
    fallback_ops: tuple[str, ...] = ()
    strict: bool = False
    cache_dir: str | None = None
    cache_max_bytes: int | None = 1 << 30
    max_executables: int = 16
    pad_to_buckets: bool = False
    checks: bool = True
    perf_fallbacks: bool = True
    measure_costs: bool = True
    device: Any = None
    mesh: Any = None
    sharding: Any = None
    passes: Any = ()
    rewrites: Any = ()
    profile: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.min_block_size, bool) or not isinstance(self.min_block_size, int):
            raise OptionsError(
                f"min_block_size must be an int >= 1 (1 keeps every JAX partition), "
                f"got {self.min_block_size!r}."
            )
        if self.min_block_size < 1:
            raise OptionsError(
                f"min_block_size must be >= 1 (1 keeps every JAX partition), "
                f"got {self.min_block_size}."
            )
        if not isinstance(self.strict, bool):
            raise OptionsError(f"strict must be True or False, got {self.strict!r}.")
        if not isinstance(self.profile, bool):
            raise OptionsError(f"profile must be True or False, got {self.profile!r}.")
        if not isinstance(self.checks, bool):
            raise OptionsError(f"checks must be True or False, got {self.checks!r}.")
        if not isinstance(self.measure_costs, bool):
            raise OptionsError(f"measure_costs must be True or False, got {self.measure_costs!r}.")
        if not isinstance(self.perf_fallbacks, bool):
            raise OptionsError(
                f"perf_fallbacks must be True or False, got {self.perf_fallbacks!r}."
            )
        if not isinstance(self.pad_to_buckets, bool):
            raise OptionsError(
                f"pad_to_buckets must be True or False, got {self.pad_to_buckets!r}."
            )
        if (
            isinstance(self.max_executables, bool)
            or not isinstance(self.max_executables, int)
            or self.max_executables < 1
        ):
            raise OptionsError(
                f"max_executables must be an int >= 1 (executables kept per partition "
                f"under dynamic shapes), got {self.max_executables!r}."
            )
        if self.cache_dir is not None and not isinstance(self.cache_dir, str | os.PathLike):
            raise OptionsError(f"cache_dir must be a path or None, got {self.cache_dir!r}.")
        if self.cache_max_bytes is not None and (
            isinstance(self.cache_max_bytes, bool)
            or not isinstance(self.cache_max_bytes, int)
            or self.cache_max_bytes < 0
        ):
            raise OptionsError(
                f"cache_max_bytes must be an int >= 0 (bytes; 0 or None: no bound), "
                f"got {self.cache_max_bytes!r}."
            )
        object.__setattr__(self, "fallback_ops", _normalize_ops(self.fallback_ops))
        object.__setattr__(self, "device", resolve_device(self.device))
        check_mesh(self.mesh, self.device)
        if self.sharding is not None and self.mesh is None:
            raise OptionsError(
                "sharding rules need a mesh to lay tensors out on: pass mesh=jax.sharding."
                "Mesh(...) as well (or drop sharding)."
            )
        try:
            object.__setattr__(self, "passes", normalize_passes(self.passes))
            object.__setattr__(self, "rewrites", normalize_rewrites(self.rewrites))
        except (TypeError, ValueError) as e:  # the validators' own refusals
            raise OptionsError(str(e)) from None
        if self.mesh is not None:
            rules = ShardingRules.coerce(self.sharding)
            rules.validate(self.mesh)
            object.__setattr__(self, "sharding", rules)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def resolve(cls, options: Mapping[str, Any] | None = None) -> Options:
        """Builds Options from environment variables overridden by ``options``."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise OptionsError(
                f"unknown dynajax option(s) {unknown}; valid options are {cls.names()}."
            )
        merged = _from_env()
        if options.get("mesh") is not None and "device" not in options:
            merged.pop("device", None)  # an explicit mesh beats DYNAJAX_DEVICE
        merged.update(options)
        return cls(**merged)


def _normalize_ops(ops: Any) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = [o for o in ops.split(",") if o.strip()]
    if not isinstance(ops, Iterable):
        raise OptionsError(
            f"fallback_ops must be a list of op names like ['aten.sort', "
            f"'aten.nonzero.default'], got {ops!r}."
        )
    names = []
    for op in ops:
        if isinstance(op, str):
            name = op.strip()
            if name.startswith("torch.ops."):
                name = name[len("torch.ops.") :]
            if name.count(".") not in (1, 2):
                raise OptionsError(
                    f"fallback_ops entry {op!r} is not an op name; use 'aten.sort' "
                    "(every overload) or 'aten.sort.default' (one overload)."
                )
            _check_exists(name)
            names.append(name)
        elif hasattr(op, "_schema") or hasattr(op, "_qualified_op_name"):
            names.append(_op_name(op))
        else:
            raise OptionsError(
                f"fallback_ops entry {op!r} is neither an op name nor a torch op; "
                "use 'aten.sort' or torch.ops.aten.sort."
            )
    return tuple(names)


# Namespaces always loaded with torch, so a misspelt name there is certainly wrong.
# Ops of other namespaces (custom ops) may be registered after the options are read.
_CHECKED_NAMESPACES = ("aten", "prims")


def _check_exists(name: str) -> None:
    """Raises OptionsError for an aten/prims op or overload that does not exist."""
    namespace, _, rest = name.partition(".")
    if namespace not in _CHECKED_NAMESPACES:
        return
    opname, _, overload = rest.partition(".")
    qualified = f"{namespace}::{opname}"
    known = set(torch._C._dispatch_get_all_op_names())
    packets = {n.split(".", 1)[0] for n in known}
    if qualified not in packets:
        close = difflib.get_close_matches(qualified, sorted(packets), n=3)
        hint = ", ".join(repr(c.replace("::", ".")) for c in close)
        raise OptionsError(
            f"fallback_ops entry {name!r}: there is no op {namespace}.{opname}"
            + (f"; did you mean {hint}?" if hint else ".")
        )
    if overload:
        overloads = getattr(getattr(torch.ops, namespace), opname).overloads()
        if overload not in overloads:
            valid = ", ".join(f"'{namespace}.{opname}.{o}'" for o in sorted(overloads))
            raise OptionsError(
                f"fallback_ops entry {name!r}: {namespace}.{opname} has no overload "
                f"{overload!r}; valid ones are {valid} (or '{namespace}.{opname}' for all)."
            )


def _op_name(op: Any) -> str:
    """'aten.sort.default' for an OpOverload, 'aten.sort' for a packet."""
    if hasattr(op, "_overloadname"):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    return op._qualified_op_name.replace("::", ".")


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    valid = ", ".join(sorted(_TRUE | (_FALSE - {""})))
    raise OptionsError(f"{name}={raw!r} is not a boolean; valid values are {valid}.")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise OptionsError(
            f"{name}={raw!r} is not an integer; use a whole number >= 1, e.g. {name}=3."
        ) from None


_ENV = {
    "DYNAJAX_MIN_BLOCK_SIZE": ("min_block_size", _parse_int),
    "DYNAJAX_FALLBACK_OPS": ("fallback_ops", lambda n, r: r),
    "DYNAJAX_STRICT": ("strict", _parse_bool),
    "DYNAJAX_CACHE_DIR": ("cache_dir", lambda n, r: r),
    "DYNAJAX_CACHE_MAX_BYTES": ("cache_max_bytes", _parse_int),
    "DYNAJAX_MAX_EXECUTABLES": ("max_executables", _parse_int),
    "DYNAJAX_PAD_TO_BUCKETS": ("pad_to_buckets", _parse_bool),
    "DYNAJAX_CHECKS": ("checks", _parse_bool),
    "DYNAJAX_PERF_FALLBACKS": ("perf_fallbacks", _parse_bool),
    "DYNAJAX_MEASURE_COSTS": ("measure_costs", _parse_bool),
    "DYNAJAX_DEVICE": ("device", lambda n, r: r),
    "DYNAJAX_PROFILE": ("profile", _parse_bool),
}


def _from_env() -> dict[str, Any]:
    out = {}
    for var, (field, parse) in _ENV.items():
        raw = os.environ.get(var)
        if raw is None:
            continue
        value = parse(var, raw)
        try:
            Options(**{field: value})  # validate alone, so the error names the variable
        except OptionsError as e:
            raise OptionsError(f"{var}={raw!r}: {e}") from None
        out[field] = value
    return out

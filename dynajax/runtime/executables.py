"""The XLA executables of one JAX partition, and the policy for changing shapes.

A partition is compiled ahead of time (``jax.jit(fn).lower(avals).compile()``, or loaded
from the persistent cache) and the executable is called directly:

* Static shapes (Dynamo guards every size): exactly one executable, built at the first
  call from the tensors of that call, then called for good.
* Dynamic shapes (``dynamic=True``, ``mark_dynamic``, Dynamo's automatic dynamic
  shapes): the partition's inputs have symbolic sizes, and symbolic sizes the graph
  uses as values (``view(x, [s0, -1])``) arrive as Python ints. Those ints are *static*
  in JAX: they are bound into the function, so every shape inside JAX is concrete.
  Each concrete shape gets its own executable, kept in a per-partition LRU bounded by
  ``max_executables``; the key is the static ints plus the sizes of the inputs with
  symbolic dimensions (a tuple, no per-call tracing).
* ``pad_to_buckets``: symbols that ``buckets.check_padding`` proves safe are padded to
  the next power of two, so the LRU holds one executable per bucket.

Each executable compiled (or loaded) is a ``CompileEvent`` in the partition's
``CompileStats`` with the reason it was needed: ``first call``, then a new shape, a new
bucket, or a shape whose executable the LRU dropped earlier (the Report's
``recompiles``). They are recorded on a miss of the LRU only.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import torch

from dynajax.lowering import dtypes, precision
from dynajax.runtime.buckets import (
    SymbolPlan,
    check_padding,
    free_symbols,
    next_bucket,
    occurrences,
    with_statics,
)
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.programs import describe_call, describe_partition

if TYPE_CHECKING:  # the values the backend hands the runtime
    from dynajax.lowering.interpreter import LoweredPartition
    from dynajax.sharding.placement import Crossing

log = logging.getLogger("dynajax.shapes")


class Executables:
    """Compiles and keeps the executables of one partition.

    Args:
        lowered: the partition, lowered (``lowering/interpreter.LoweredPartition``): its
            name (for logs), its placeholders' and outputs' ``meta["val"]`` (fake
            tensors, SymInts), whether its function takes a leading int64 seed, and the
            ``CheckTable`` its traces fill (None: no value checks; an executable loaded
            without tracing fills it from the cache).
        fn: its function as compiled, ``fn([seed,] *inputs)``, every input in
            placeholder order (static ones as Python ints).
        crossing: where it runs (``sharding/placement.Crossing``): the sharding of
            inputs that are not ``jax.Array``s (NumPy views, the seed; arrays keep their
            own; None: JAX's default device), the platform, the outputs' sharding (None:
            XLA's choice; on a mesh, replicated, so that every process holds whole
            outputs), and whether the persistent cache may serve it.
        cache: the persistent cache (None: off); stats: where compiles, hits and misses
            count. With a cache, the partition's graph is described
            (``programs.describe_partition``) so that the cache finds an executable
            without tracing; without, executables are keyed by their lowered text.
        max_executables: the LRU bound under dynamic shapes.
        pad_to_buckets: pad provably safe symbols to powers of two.
    """

    def __init__(
        self,
        lowered: LoweredPartition,
        fn: Callable[..., Any],
        crossing: Crossing,
        *,
        cache: ExecutableCache | None,
        stats: CompileStats,
        max_executables: int,
        pad_to_buckets: bool,
    ) -> None:
        if not crossing.persistent:
            cache = None  # compiled here (a mesh: see Crossing.persistent)
        self.name = lowered.name
        self.fn = fn
        self.placeholders = list(lowered.input_vals)
        self.outputs = list(lowered.output_vals)
        self.needs_seed = lowered.needs_key
        self.cache = cache if cache is not None else ExecutableCache(None)
        self.stats = stats
        self.max_executables = max_executables
        self.sharding = crossing.sharding
        self.platform_name = crossing.platform
        self.out_sharding = crossing.out_sharding
        self.program = (
            describe_partition(lowered.graph, lowered.name)
            if cache is not None and cache.directory is not None
            else None
        )
        self.check_table = lowered.checks
        # Every input stays an argument of the executables, also one the program never
        # reads (jax.jit drops those by default): on an accelerator an input may be the
        # fence whose definition event orders the call after torch's stream (InputCache).
        self.keep_unused = False
        vals = self.placeholders
        # Eager computes on CUDA tensors: its convolutions are cuDNN's (conv_precision),
        # its float-to-integer conversions CUDA's (dtypes.float_to_int).
        self.on_cuda = any(
            isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals + self.outputs
        )
        self.tensor_pos = tuple(i for i, v in enumerate(vals) if isinstance(v, torch.Tensor))
        self.static_pos = tuple(i for i, v in enumerate(vals) if not isinstance(v, torch.Tensor))
        self.shape_pos = tuple(
            i for i in self.tensor_pos if any(isinstance(s, torch.SymInt) for s in vals[i].shape)
        )
        self.dynamic = bool(self.static_pos or self.shape_pos)
        self._want_buckets = pad_to_buckets and self.dynamic
        self.plans: list[SymbolPlan] | None = None if self._want_buckets else []
        self._allowed: dict[tuple[Any, int], bool] = {}
        self._lru: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
        self._lock = threading.RLock()
        # Keys whose executable the LRU dropped, and the buckets compiled for (the sizes
        # of the padded symbols): for the reason of compiling another executable.
        self._evicted: set[Any] = set()
        self._buckets: set[tuple[int, ...]] = set()

    def __len__(self) -> int:
        """Executables currently kept."""
        return len(self._lru)

    # -- compiling ----------------------------------------------------------------------

    def compile(
        self, args: Sequence[Any], arrays: Sequence[Any], reason: str = "first call"
    ) -> jax.stages.Compiled:
        """The executable for the inputs ``args`` (placeholder order; the static ones are
        bound into it), called on ``arrays`` (``[seed,] *`` the tensor inputs, converted).
        The arrays' shapes, dtypes and devices are its signature. Call with x64 on.
        ``reason``: why it is needed, for its ``CompileEvent``."""
        statics = {i: _static(args[i]) for i in self.static_pos}
        avals = [
            jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=getattr(a, "sharding", None) or self.sharding
            )
            for a in arrays
        ]
        fn = with_statics(self.fn, len(self.placeholders), statics, self.needs_seed)

        def lower() -> jax.stages.Lowered:
            with precision.eager_precision(self.on_cuda), dtypes.eager_on_cuda(self.on_cuda):
                if self.out_sharding is None:
                    return jax.jit(fn, keep_unused=self.keep_unused).lower(*avals)
                return jax.jit(
                    fn, out_shardings=self.out_sharding, keep_unused=self.keep_unused
                ).lower(*avals)

        table = self.check_table
        program = self.program and describe_call(
            self.program,
            avals,
            statics,
            precision=precision.describe(self.on_cuda),
            needs_seed=self.needs_seed,
            checks=table is not None,
            out_sharding=self.out_sharding,
            keep_unused=self.keep_unused,
        )
        shapes = ", ".join(str(list(a.shape)) for a in avals)
        inputs = ", ".join(
            [_short_type(a) for a in avals[1 if self.needs_seed else 0 :]]
            + [str(v) for v in statics.values()]
        )
        compiled, checks = self.cache.compile_traced(
            program,
            lower,
            self.stats,
            name=f"{self.name}({shapes})",
            platform_name=self.platform_name,
            extra=lambda: table.checks if table is not None else None,
            event=(self.name, inputs, reason),
        )
        if table is not None and checks is not None:
            table.record(checks)  # loaded without a trace: the checks it recorded
        return compiled

    def lookup(self, args: Sequence[Any], arrays: Sequence[Any]) -> Callable[..., Any]:
        """The executable for ``args`` from the LRU, compiled on a miss (dynamic shapes)."""
        key = (
            *[args[i] for i in self.static_pos],
            *[args[i].shape for i in self.shape_pos],
        )
        with self._lock:
            call = self._lru.get(key)
            if call is not None:
                self._lru.move_to_end(key)
                return call
            call = self.compile(args, arrays, self._reason(key, args))
            self._lru[key] = call
            while len(self._lru) > self.max_executables:
                old, _ = self._lru.popitem(last=False)
                self._evicted.add(old)
                self.stats.evictions += 1
                log.debug("%s: dropped the executable of %s (max_executables)", self.name, old)
            return call

    def _reason(self, key: Any, args: Sequence[Any]) -> str:
        """Why the executable of ``key`` (missing from the LRU; ``args`` padded) is
        compiled: the partition's first, one the LRU dropped, or a new shape, which
        is a new bucket where the padded sizes are new."""
        bucket = tuple(p.size(args) for p in self.plans or ())
        new_bucket = bucket not in self._buckets
        self._buckets.add(bucket)
        if key in self._evicted:
            return f"evicted earlier (max_executables={self.max_executables})"
        if not self._lru and not self._evicted:
            return "first call"
        if self.plans and new_bucket:
            return "new bucket (no executable for it yet)"
        return "new shape (no executable for it yet)"

    # -- buckets ------------------------------------------------------------------------

    def pad(
        self, args: Sequence[Any]
    ) -> tuple[Sequence[Any], list[tuple[tuple[tuple[int, int], ...], int]]]:
        """``args`` padded to their buckets, and what to slice back from the outputs."""
        plans = self.plans
        if plans is None:
            plans = self._plan()
        if not plans:
            return args, []
        padded = list(args)
        restore = []
        for plan in plans:
            n = plan.size(args)
            size = next_bucket(n)
            if size == n or not self._allows(plan, size):
                continue
            for pos, dim in plan.in_dims:
                padded[pos] = _pad(padded[pos], dim, size)
            for pos, k in plan.statics:
                padded[pos] = k * size
            restore.append((plan.out_dims, n))
        return padded, restore

    @staticmethod
    def unpad(
        outs: list[torch.Tensor], restore: list[tuple[tuple[tuple[int, int], ...], int]]
    ) -> list[torch.Tensor]:
        touched = set()
        for out_dims, n in restore:
            for k, d in out_dims:
                outs[k] = outs[k].narrow(d, 0, n)
                touched.add(k)
        for k in touched:
            if not outs[k].is_contiguous():
                outs[k] = outs[k].contiguous()  # eager's outputs are contiguous
        return outs

    def _allows(self, plan: SymbolPlan, size: int) -> bool:
        key = (plan.symbol, size)
        ok = self._allowed.get(key)
        if ok is None:
            ok = self._allowed[key] = plan.allows(size)
            if not ok:
                log.info(
                    "%s: %s padded to %d would break Dynamo's guards on it; exact size",
                    self.name,
                    plan.symbol,
                    size,
                )
        return ok

    def _plan(self) -> list[SymbolPlan]:
        with self._lock:
            if self.plans is not None:
                return self.plans
            plans: list[SymbolPlan] = []
            present = [v is not None for v in self.outputs]
            for sym in sorted(free_symbols(self.placeholders), key=str):
                found = occurrences(sym, self.placeholders, self.outputs)
                if isinstance(found, SymbolPlan):
                    why = check_padding(
                        self.fn,
                        self.placeholders,
                        found,
                        seed=self.needs_seed,
                        out_present=present,
                    )
                else:
                    why = found
                if why is None and isinstance(found, SymbolPlan):
                    plans.append(found)
                    self.stats.buckets.append(f"{self.name}: {sym}")
                    log.info("%s: %s padded to powers of two", self.name, sym)
                else:
                    self.stats.exact.append(f"{self.name}: {sym}: {why}")
                    log.info("%s: %s not padded (%s); one executable per size", self.name, sym, why)
            self.plans = plans
            return plans


def _short_type(aval: Any) -> str:
    """``f32[8,3]``: an input's dtype and shape, as JAX prints them."""
    name = str(aval.dtype)
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
        name = name.replace(long, short)
    name = name.replace("complex", "c")
    return f"{name}[{','.join(map(str, aval.shape))}]"


def _static(value: Any) -> Any:
    if isinstance(value, torch.SymInt):  # not expected at run time; be exact anyway
        return int(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out

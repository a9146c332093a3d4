"""CompiledPartition: one JAX partition, jitted, with conversion at its edges.

The per-call path of a partition is, in full:

    arrays = InputCache.arrays(tensors)      # cached jax.Arrays, NumPy views for the rest
    x64 on (thread-local swap, ~0.3 µs)       # int64/float64 stay 64-bit (jax_internals)
    outs = executable(*arrays)               # the AOT executable's C++ dispatch
    value checks: outs[-1] read, may raise   # only where the partition has checks
    [torch.from_numpy(np.asarray(o)) ...]    # zero-copy views of XLA's output buffers

and, once a call has shown which inputs come back (parameters, buffers) and which are
new tensors every call (a token, a batch), the same through the executable's direct
entry point (``_build_direct``): the cached arrays as they are, each new tensor put into
an array of its own (~3.5 µs), no per-argument checks of the dispatch.

Mutation and aliasing are aot_autograd's: it hands us a functional graph, writes the new
values of mutated inputs back with ``copy_`` (or ``passes/writes.py`` does, where that
is all its runtime wrapper would do: an indexed update only where it wrote), and
regenerates outputs that alias inputs as views
of those inputs. A value check that fails (``lowering/checks.py``: an index out
of range, an integer division by zero) raises eager's error here, before any output is
handed back, so aot_autograd writes nothing back. What this module guarantees is that
every output owns its buffer: XLA never returns an input or constant buffer as an
output (it copies), and ``_own_outputs`` keeps JAX from forwarding an input array or
repeating one output at trace level. No buffer is donated: inputs are torch's memory,
which XLA must not reuse.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx

from dynajax.lowering.checks import CheckedFunction, CheckTable
from dynajax.lowering.interpreter import input_vals, needs_key, output_vals, to_jax_function
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.conversion import (
    cpu_device,
    fast_to_jax,
    from_source_or,
    quiet_readonly_warning,
    remembering,
    to_torch,
    torch_importer,
)
from dynajax.runtime.executables import Executables
from dynajax.runtime.inputs import InputCache
from dynajax.runtime.jax_internals import X64, array_putter, direct_executor, dispatch_of
from dynajax.runtime.programs import describe_partition

if TYPE_CHECKING:  # placement decides (the backend asks it), the runtime takes its answer
    from dynajax.sharding.placement import Crossing

_from_numpy = torch.from_numpy
_asarray = np.asarray
# The dtypes whose XLA buffers NumPy views and torch.from_numpy wraps directly.
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)

# From this many inputs, a call whose cached inputs are unchanged skips the executable's
# argument checks (``CompiledPartition._build_direct``). Measured side by side
# (``benchmarks/overhead.py``), the direct entry point is cheaper from one input up; with
# a new token tensor every call (``python -m benchmarks.decode --profile``) a decode step
# costs 6 µs more than with the same tensor, 44 µs more on the dispatch path.
DIRECT_MIN_INPUTS = 1


class CompiledPartition(torch.nn.Module):
    """Calls a jitted JAX function on torch tensors and returns torch tensors.

    It is an ``nn.Module`` so that the stitched GraphModule can hold it as the
    submodule ``jax_<n>``; ``__call__`` is overridden to skip nn.Module's hook
    machinery on the per-call path.

    Args:
        name: the partition's name (``jax_0``).
        fn: pure JAX function ``fn([seed,] *arrays) -> tuple of arrays``.
        needs_seed: ``fn`` takes a leading int64 seed for its random ops, drawn from
            PyTorch's default generator on every call (``torch.manual_seed`` applies).
        graph: the ATen graph this partition computes (kept for reports).
        cache: the persistent compilation cache (None: off).
        stats: where compiles, cache hits and misses are counted (the Report's).
        max_executables: executables kept under dynamic shapes (an LRU).
        pad_to_buckets: pad provably safe symbolic sizes to powers of two.
        crossing: where the partition runs and how its tensors cross, as placement
            decided it (``sharding/placement.py``'s ``crossing``): where the tensors
            are (zero-copy on the CPU, DLPack on an accelerator), or placed on one
            device or a mesh (a ``NamedSharding`` per input). Inputs that
            ``InputCache`` keeps (parameters, buffers) stay resident until PyTorch
            changes them; the rest cross per call; outputs come back to the tensors'
            device (on a mesh: replicated by the program, then this process's copy).

    Executables are compiled ahead of time and called directly (``executables.py``):
    one, built at the first call, for a graph of static shapes; one per concrete shape
    (or bucket), in a bounded LRU, under dynamic shapes.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., tuple[jax.Array, ...]],
        needs_seed: bool,
        graph: torch.fx.GraphModule,
        *,
        cache: ExecutableCache | None = None,
        stats: CompileStats | None = None,
        max_executables: int = 16,
        pad_to_buckets: bool = False,
        crossing: Crossing,
    ) -> None:
        super().__init__()
        self.name = name
        self.needs_seed = needs_seed
        self.__dict__["graph_module"] = graph  # not a submodule: never called
        owned = _own_outputs(fn)
        # The value checks that traces of ``fn`` record (lowering/checks.py): when there
        # are any, its last output reports the first that failed, and a call raises
        # eager's error before handing any output back (``_checked``).
        self.value_checks: CheckTable | None = fn.table if isinstance(fn, CheckedFunction) else None
        # The partition's function under plain jax.jit: the raw-JAX floor the benchmarks
        # compare against (the per-call path uses the AOT executable instead).
        self.jitted = jax.jit(owned)
        # Where it runs and how its tensors cross: placement's decision.
        vals, out_vals = input_vals(graph), output_vals(graph)
        self.crossing = crossing
        self.device_type = crossing.device_type
        self.placement = crossing.partition
        self.device = crossing.device
        if not crossing.persistent:
            cache = None  # compiled here (a mesh: see Crossing.persistent)
        self._cpu_outputs = crossing.cpu_outputs
        self.stats = stats if stats is not None else CompileStats()
        self.executables = Executables(
            name,
            owned,
            vals,
            out_vals,
            needs_seed,
            cache=cache if cache is not None else ExecutableCache(None),
            stats=self.stats,
            max_executables=max_executables,
            pad_to_buckets=pad_to_buckets,
            sharding=crossing.sharding,
            platform_name=crossing.platform,
            out_sharding=crossing.out_sharding,
            program=(
                describe_partition(graph, name)
                if cache is not None and cache.directory is not None
                else None
            ),
            check_table=self.value_checks,
        )
        # What a call of a static-shape partition runs: the AOT executable's dispatch,
        # set at the first call. Benchmarks may set it to ``jitted`` to compare paths.
        self.dispatch: Callable[..., Any] | None = None
        self._compiled: jax.stages.Compiled | None = None
        # The executable's own entry point, for calls whose cached inputs are unchanged.
        self._direct: _Direct | None = None
        # The direct entry point is checked on one device's outputs only.
        self._direct_failed = crossing.multi_device
        # A snapshot whose per-call inputs cannot take the direct entry point.
        self._no_direct: Any = None
        # The executable whose direct entry point gave the regular path's outputs.
        self._direct_checked: Any = None
        self._compile_lock = threading.Lock()
        n_inputs = len(self.executables.tensor_pos)  # static sizes are not converted
        if self.executables.dynamic:
            self._run = self._run_dynamic  # type: ignore[method-assign,assignment]
        # The device the partition's results come from (its one accelerator, else the
        # CPU; results eager gives on the CPU are moved there afterwards).
        self._results_device = crossing.results_device
        # Outputs that NumPy can view and torch.from_numpy can wrap as they are (CPU,
        # no bfloat16 or float8): wrapped by two C-level maps, no Python frame per output.
        self._numpy_outputs = crossing.zero_copy and all(
            isinstance(v, torch.Tensor) and v.dtype in _NUMPY_DTYPES for v in out_vals
        )
        # Inputs converted per call reach the direct entry point through a putter.
        self._fresh_by_putter = crossing.zero_copy
        if crossing.on_accelerator:
            self.cross_as_on_an_accelerator(crossing.convert, crossing.make_cached)
        else:
            # A resident copy on another device is stale after any in-place update; a
            # zero-copy array on the CPU is the tensor's memory and sees it.
            self.inputs = InputCache(
                n_inputs,
                crossing.convert,
                crossing.make_cached,
                same_layout_reuse=crossing.zero_copy,
            )
            assert crossing.to_torch is not None
            self._to_torch = crossing.to_torch
        quiet_readonly_warning()

    def cross_as_on_an_accelerator(self, convert: Any, make_cached: Any) -> None:
        """The torch/JAX crossings of a partition on an accelerator, where a tensor
        enters JAX by a DLPack import (~100 µs on an H100) and torch writes on its own
        stream. Results remember the arrays they view, and come back into a partition
        as those arrays while untouched (``conversion.from_source_or``: a forward's
        saved activations into its backward); cached inputs written in place cost one
        import per call, which orders the call after torch's stream (``InputCache``'s
        ``fence_writes``: the executables keep every input as an argument, read or not,
        so that the fence is one); inputs converted per call never take the direct
        entry point.

        ``__init__`` calls it for partitions on accelerators; tests call it on CPU
        partitions (``convert``, ``make_cached``: the per-call and cached conversions),
        where CI, which has no GPU, can run the same bookkeeping.
        """
        self.inputs = InputCache(
            len(self.executables.tensor_pos),
            from_source_or(convert),
            make_cached,
            same_layout_reuse=False,
            fence_writes=True,
        )
        self.executables.keep_unused = True  # the fence must be an argument XLA waits on
        device = self._results_device
        self._to_torch = remembering(torch_importer(device) if device is not None else to_torch)
        self._numpy_outputs = False
        self._fresh_by_putter = False

    def run_guarded(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``run`` for a caller whose inputs passed Dynamo's guards just before (the
        stitched graph's unboxed callable, which only Dynamo's compiled frame calls):
        sizes and strides are those of the first call, so a call whose inputs are all
        cached needs only their identities and data pointers (``InputCache.hit_guarded``).
        """
        direct = self._direct
        if direct is not None and self.inputs.hit_guarded(tensors) is direct.snap:
            args = _fresh_args(direct.args, direct.fresh, tensors) if direct.fresh else direct.args
            if args is not None:
                return self._run_direct(direct, args)
        return self.run(tensors)

    def _run_direct(self, direct: Any, args: list[Any]) -> list[torch.Tensor]:
        """One call through the executable's direct entry point (``_build_direct``),
        for inputs the caller has found cached in ``direct.snap`` (and ``args``, those
        arrays with the per-call inputs' arrays in their slots)."""
        results = direct.execute(args).consume_with_handlers(direct.handlers)
        if direct.checked:
            # Eager's error where a value check failed, before any output is handed
            # back; the code is an output of this same execution (no extra sync).
            direct.checked.raise_if_failed(results.pop(), self.name)
        if self._numpy_outputs:
            return list(map(_from_numpy, map(_asarray, results)))
        return self._outputs(results)

    def _outputs(self, results: Sequence[Any]) -> list[torch.Tensor]:
        """The executable's results as tensors on the devices eager gives them."""
        outs = list(map(self._to_torch, results))
        for i in self._cpu_outputs:
            outs[i] = outs[i].cpu()
        return outs

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The per-call path: a sequence of tensors in, a list of tensors out."""
        direct = self._direct
        if direct is not None and self.inputs.hit(tensors) is direct.snap:
            args = _fresh_args(direct.args, direct.fresh, tensors) if direct.fresh else direct.args
            if args is not None:
                return self._run_direct(direct, args)
        token = X64.enable()  # int64/float64 stay 64-bit, as in torch
        try:
            outs = self._run(tensors)
        finally:
            X64.restore(token)
        if len(tensors) >= DIRECT_MIN_INPUTS and not self._direct_failed:
            snap = self.inputs.current
            if (
                snap is not None
                and (direct is None or direct.snap is not snap)
                and snap is not self._no_direct
            ):
                if direct is not None and all(
                    map(operator.is_, direct.args, [snap.arrays[i] for i in direct.kept])
                ):  # versions moved on (in-place updates), arrays are the same memory
                    self._direct = direct._replace(snap=snap)
                else:
                    self._direct = self._build_direct(snap, tensors, outs)
        return outs

    def _build_direct(
        self, snap: Any, tensors: Sequence[torch.Tensor], outs: list[torch.Tensor]
    ) -> Any:
        """The executable's own entry point, for calls whose inputs are cached.

        The C++ dispatch of a compiled function checks every argument's type, shape and
        placement on each call (~0.5 µs each). When every input is a cached array whose
        identity, version and pointer ``InputCache.hit`` has just checked, those checks
        are known to pass, and the loaded executable can run the very same arrays
        (~0.15 µs per argument), and its outputs are wrapped by the same C++ result
        handlers the dispatch path uses. Worth it from ``DIRECT_MIN_INPUTS`` inputs up.

        Inputs that are new tensors on every call (a decode step's token, a batch of
        data, activations between partitions) are ``snap.volatile``: on the CPU each is
        put into an array of the shape and dtype the executable takes, as the dispatch
        path would (``jax_internals.array_putter``, ~3.5 µs), in its slot among the
        cached arrays (``_fresh_args``); a tensor of another shape or dtype takes the
        regular path. Elsewhere, or where this JAX release lacks the internal, such
        snapshots keep the regular path.

        Checked once against the regular path's outputs; on any mismatch, or where this
        JAX release lacks the entry point (``jax_internals.direct_executor``), the
        regular path stays for good.
        """
        compiled = self._compiled
        found = direct_executor(compiled) if compiled is not None else None
        if found is None or self.needs_seed or self.executables.dynamic:
            self._direct_failed = True
            return None
        args = [snap.arrays[i] for i in found.kept]
        fresh: list[_Fresh] = []
        if snap.volatile:
            slots = self._fresh_slots(compiled, found.kept, snap.volatile)
            if slots is None:
                self._no_direct = snap  # not tried again until the inputs change
                return None
            fresh = slots
            args_now = _fresh_args(args, fresh, tensors)
            if args_now is None:
                return None
        else:
            args_now = args
        checks = self.value_checks
        checked = checks if checks is not None and checks.checks else None
        if self._direct_checked is compiled:
            # Checked already with other arrays in its slots (the snapshot changed: an
            # input re-promoted to the cache, a parameter replaced); what the check
            # covers is the entry point and the handlers, the same for this executable.
            return _Direct(snap, found.execute, args, found.kept, found.handlers, checked, fresh)
        try:
            results = found.execute(args_now).consume_with_handlers(found.handlers)
        except (TypeError, ValueError, RuntimeError):  # XLA refused the arguments
            self._direct_failed = True
            return None
        if checked is not None:
            results = results[:-1]  # the regular path just passed the same inputs
        check = [self._to_torch(r) for r in results]
        if not (
            len(check) == len(outs)
            and all(
                a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                for a, b in zip(check, outs, strict=True)
            )
        ):
            self._direct_failed = True
            return None
        self._direct_checked = compiled
        return _Direct(snap, found.execute, args, found.kept, found.handlers, checked, fresh)

    def _fresh_slots(
        self, compiled: Any, kept: list[int], volatile: list[int]
    ) -> list[_Fresh] | None:
        """How each per-call input reaches the direct entry point (``_build_direct``):
        its slot among XLA's arguments, its input position and its putter; None where
        it cannot (not on the CPU, or no putter in this JAX release)."""
        if not self._fresh_by_putter:
            return None
        avals = list(compiled.in_avals[0])
        slot_of = {pos: slot for slot, pos in enumerate(kept)}
        fresh = []
        for pos in volatile:
            if pos not in slot_of:
                continue  # an input XLA dropped: never read
            aval = avals[pos]
            put = array_putter(tuple(aval.shape), aval.dtype, cpu_device())
            if put is None:
                return None
            fresh.append(_Fresh(slot_of[pos], pos, put, tuple(aval.shape), np.dtype(aval.dtype)))
        return fresh

    def _run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        arrays = self.inputs.arrays(tensors)
        if self.needs_seed:
            arrays.insert(0, draw_seed())
        call = self.dispatch
        outs = self._first_call(tensors, arrays) if call is None else call(*arrays)
        if (checks := self.value_checks) is not None and checks.checks:
            # Eager's error where a value check failed, before any output is handed back
            # (so aot_autograd writes no input back); then the outputs without it.
            checks.raise_if_failed(outs[-1], self.name)
            outs = outs[:-1]
        if self._numpy_outputs:
            return list(map(_from_numpy, map(_asarray, outs)))
        return self._outputs(outs)

    def run_in_phases(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], tuple[float, float, float] | None]:
        """``run``, timed (for the ``profile`` option; the regular path, never the
        direct entry point): the outputs and the seconds of its three phases, the
        crossing into JAX, XLA's run (waited for) and the crossing back; None for a
        partition under dynamic shapes, whose padding and LRU are not split."""
        if self.executables.dynamic:
            return self.run(tensors), None
        token = X64.enable()
        try:
            start = time.perf_counter()
            arrays = self.inputs.arrays(tensors)
            if self.needs_seed:
                arrays.insert(0, draw_seed())
            crossed = time.perf_counter()
            call = self.dispatch
            outs = self._first_call(tensors, arrays) if call is None else call(*arrays)
            jax.block_until_ready(outs)
            ran = time.perf_counter()
            if (checks := self.value_checks) is not None and checks.checks:
                checks.raise_if_failed(outs[-1], self.name)
                outs = outs[:-1]
            if self._numpy_outputs:
                result = list(map(_from_numpy, map(_asarray, outs)))
            else:
                result = self._outputs(outs)
            back = time.perf_counter()
        finally:
            X64.restore(token)
        return result, (crossed - start, ran - crossed, back - ran)

    def _first_call(self, tensors: Sequence[Any], arrays: list[Any]) -> Any:
        """Compiles (or loads) the one executable of a static-shape graph and calls it."""
        with self._compile_lock:
            if self.dispatch is None:
                exe = self.executables.compile(tensors, arrays)
                outs = exe(*arrays)  # sets up its C++ dispatch function
                self._compiled = exe
                self.dispatch = dispatch_of(exe)
                return outs
        return self.dispatch(*arrays)

    def _run_dynamic(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """The per-call path under dynamic shapes: buckets, then the LRU of executables."""
        ex = self.executables
        given = args
        restore: list[Any] = []
        if ex.plans != []:  # noqa: PLC1901 - None (undecided) or a non-empty list
            args, restore = ex.pad(args)
        tensors = [args[i] for i in ex.tensor_pos] if ex.static_pos else args
        arrays = self.inputs.arrays(tensors)
        if self.needs_seed:
            arrays.insert(0, draw_seed())
        results = ex.lookup(args, arrays)(*arrays)
        if (checks := self.value_checks) is not None and checks.checks:
            if restore and checks.failed(results[-1]):
                return self._run_exact(given)
            checks.raise_if_failed(results[-1], self.name)
            results = results[:-1]
        outs = self._outputs(results)
        return ex.unpad(outs, restore) if restore else outs

    def _run_exact(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """A padded call whose value check failed, run again at its exact size.

        The padding proof (``buckets.check_padding``) shows that padded rows never reach
        the real outputs, but a value check reads them too: zeros padded into a divisor
        fail an integer division's check. The exact size decides: where it passes, the
        padding was at fault, and this partition runs at exact sizes from now on (the
        reason is in the Report); where it fails too, eager's error is raised.
        """
        ex = self.executables
        plans, ex.plans = ex.plans, []
        try:
            outs = self._run_dynamic(args)
        except BaseException:
            ex.plans = plans  # the inputs were at fault, not the padding
            raise
        symbols = ", ".join(str(p.symbol) for p in plans or [])
        self.stats.exact.append(
            f"{self.name}: {symbols}: a value check fails on padded rows (exact sizes now)"
        )
        return outs

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.run(tensors))

    forward = __call__


class _Fresh(NamedTuple):
    """A per-call input of a direct call: where it goes and how it gets there."""

    slot: int  # its place among the arguments XLA takes
    pos: int  # its input position
    put: Callable[[Any], jax.Array]  # NumPy view -> array (jax_internals.array_putter)
    shape: tuple[int, ...]  # what the executable takes
    dtype: np.dtype


class _Direct(NamedTuple):
    """What a call whose inputs are cached runs (``CompiledPartition._build_direct``)."""

    snap: Any  # the InputCache snapshot these arguments were taken from
    execute: Callable[[Sequence[jax.Array]], Any]  # the executable's own entry point
    args: list[Any]  # the cached arrays XLA takes, in its order (None: a fresh slot)
    kept: list[int]  # their input positions
    handlers: list[Any]  # the results' handlers (output arrays as the dispatch makes)
    checked: CheckTable | None  # the value checks read from the last output, if any
    fresh: list[_Fresh]  # the per-call inputs among them (snap.volatile XLA reads)


def _fresh_args(
    cached: list[Any], fresh: list[_Fresh], tensors: Sequence[torch.Tensor]
) -> list[Any] | None:
    """The cached arrays with this call's arrays of the per-call inputs ``fresh`` in
    their slots, or None where one is not of the shape and dtype the executable takes."""
    args = cached.copy()
    for slot, pos, put, shape, dtype in fresh:
        view = fast_to_jax(tensors[pos])
        if not isinstance(view, np.ndarray) or view.shape != shape or view.dtype != dtype:
            return None
        args[slot] = put(view)
    return args


def _own_outputs(
    fn: Callable[..., tuple[jax.Array, ...]],
) -> Callable[..., tuple[jax.Array, ...]]:
    """``fn`` whose outputs are never an input array nor another output (trace-time)."""

    def owned(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        outs = fn(*arrays)
        seen = {id(a) for a in arrays}
        result = []
        for o in outs:
            if id(o) in seen:
                o = jnp.array(o, copy=True)
            seen.add(id(o))
            result.append(o)
        return tuple(result)

    return owned


def draw_seed() -> np.ndarray:
    """A seed for a program with random ops, drawn from PyTorch's default generator
    (so `torch.manual_seed` makes compiled programs reproducible)."""
    return np.asarray(torch.randint(0, 2**62, (), dtype=torch.int64).item(), np.int64)


def compile_partition(name: str, gm: torch.fx.GraphModule, **options: Any) -> CompiledPartition:
    """Lowers the ATen graph ``gm`` to JAX and wraps it for calls from torch.

    ``options``: ``crossing`` (required), ``cache``, ``stats``, ``max_executables``,
    ``pad_to_buckets`` of ``CompiledPartition``; ``checks`` (default True): the
    rules' value checks run in the program and raise eager's errors
    (``lowering/checks.py``).
    """
    fn = to_jax_function(gm, value_checks=options.pop("checks", True))
    return CompiledPartition(name, fn, needs_key(gm), gm, **options)

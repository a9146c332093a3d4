"""CompiledPartition: one JAX partition, jitted, with conversion at its edges.

The per-call path of a partition is, in full:

    arrays = InputCache.arrays(tensors)      # cached jax.Arrays, NumPy views for the rest
    x64 on (thread-local swap, ~0.3 µs)       # int64/float64 stay 64-bit (jax_internals)
    outs = executable(*arrays)               # the AOT executable's C++ dispatch
    value checks: outs[-1] read, may raise   # only where the partition has checks
    [torch.from_numpy(np.asarray(o)) ...]    # zero-copy views of XLA's output buffers

and, once a call has shown which inputs come back (parameters, buffers) and which are
new tensors every call (a token, a batch), the same through the executable's direct
entry point (``direct.py``): the cached arrays as they are, each new tensor put into
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

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx

from dynajax.ffi import eager_error
from dynajax.lowering.checks import CheckTable
from dynajax.runtime.cache import CompileStats, ExecutableCache
from dynajax.runtime.conversion import (
    from_source_or,
    quiet_readonly_warning,
    remembering,
    to_torch,
    torch_importer,
)
from dynajax.runtime.direct import DIRECT_MIN_INPUTS, Direct, DirectEntry, fresh_args
from dynajax.runtime.executables import Executables
from dynajax.runtime.inputs import InputCache
from dynajax.runtime.jax_internals import X64, dispatch_of

if TYPE_CHECKING:  # the lowering and placement answer (the backend asks them), the
    # runtime takes their answers
    from dynajax.lowering.interpreter import LoweredPartition
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


class CompiledPartition(torch.nn.Module):
    """Calls a jitted JAX function on torch tensors and returns torch tensors.

    It is an ``nn.Module`` so that the stitched GraphModule can hold it as the
    submodule ``jax_<n>``; ``__call__`` is overridden to skip nn.Module's hook
    machinery on the per-call path.

    Args:
        lowered: the partition lowered (``lowering/interpreter.lower_partition``): its
            name (``jax_0``), its pure JAX function ``fn([seed,] *arrays)``, whose seed
            (where it has random ops) is drawn from PyTorch's default generator on every
            call (``torch.manual_seed`` applies), its inputs' and outputs' values, its
            value checks, and the ATen graph it computes (kept for reports).
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
        lowered: LoweredPartition,
        *,
        cache: ExecutableCache | None = None,
        stats: CompileStats | None = None,
        max_executables: int = 16,
        pad_to_buckets: bool = False,
        crossing: Crossing,
    ) -> None:
        super().__init__()
        self.name = lowered.name
        self.needs_seed = lowered.needs_key
        self.__dict__["graph_module"] = lowered.graph  # not a submodule: never called
        owned = _own_outputs(lowered.fn)
        # The value checks that traces of its function record (lowering/checks.py):
        # when there are any, its last output reports the first that failed, and a call
        # raises eager's error before handing any output back.
        self.value_checks: CheckTable | None = lowered.checks
        # The partition's function under plain jax.jit: the raw-JAX floor the benchmarks
        # compare against (the per-call path uses the AOT executable instead).
        self.jitted = jax.jit(owned)
        # Where it runs and how its tensors cross: placement's decision.
        self.crossing = crossing
        self.device_type = crossing.device_type
        self.placement = crossing.partition
        self.device = crossing.device
        self._cpu_outputs = crossing.cpu_outputs
        self.stats = stats if stats is not None else CompileStats()
        self.executables = Executables(
            lowered,
            owned,
            crossing,
            cache=cache,
            stats=self.stats,
            max_executables=max_executables,
            pad_to_buckets=pad_to_buckets,
        )
        # What a call of a static-shape partition runs: the AOT executable's dispatch,
        # set at the first call. Benchmarks may set it to ``jitted`` to compare paths.
        self.dispatch: Callable[..., Any] | None = None
        self._compiled: jax.stages.Compiled | None = None
        # The executable's own entry point, for calls whose cached inputs are unchanged
        # (direct.py), and whether to take it (checked on one device's outputs only).
        self._direct: Direct | None = None
        self._entry = DirectEntry(is_open=not crossing.multi_device, value_checks=self.value_checks)
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
            isinstance(v, torch.Tensor) and v.dtype in _NUMPY_DTYPES for v in lowered.output_vals
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
            args = fresh_args(direct.args, direct.fresh, tensors) if direct.fresh else direct.args
            if args is not None:
                try:
                    return self._run_direct(direct, args)
                except jax.errors.JaxRuntimeError as e:
                    _raise_eager(e)
        return self.run(tensors)

    def _run_direct(self, direct: Direct, args: list[Any]) -> list[torch.Tensor]:
        """One call through the executable's direct entry point (``direct.py``),
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
            args = fresh_args(direct.args, direct.fresh, tensors) if direct.fresh else direct.args
            if args is not None:
                try:
                    return self._run_direct(direct, args)
                except jax.errors.JaxRuntimeError as e:
                    _raise_eager(e)
        token = X64.enable()  # int64/float64 stay 64-bit, as in torch
        try:
            outs = self._run(tensors)
        except jax.errors.JaxRuntimeError as e:
            _raise_eager(e)
        finally:
            X64.restore(token)
        entry = self._entry
        if entry.is_open and len(tensors) >= DIRECT_MIN_INPUTS:
            snap = self.inputs.current  # (a new snapshot only: attribute reads per call)
            if snap is None or snap is entry.refused:
                return outs
            if direct is not None and direct.snap is snap:
                return outs
            self._direct = entry.after_call(
                direct,
                self._compiled,
                snap,
                tensors,
                outs,
                needs_seed=self.needs_seed,
                dynamic=self.executables.dynamic,
                by_putter=self._fresh_by_putter,
                to_torch=self._to_torch,
            )
        return outs

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


def _raise_eager(error: jax.errors.JaxRuntimeError) -> NoReturn:
    """Raises the exception eager PyTorch raised in a kernel the program ran (``ffi``),
    else ``error`` itself."""
    eager = eager_error(error)
    if eager is None:
        raise error
    raise eager from error


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


def run_in_phases(
    part: CompiledPartition, tensors: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[float, float, float] | None]:
    """``part.run``, timed (the ``profile`` option's; the regular path, never the
    direct entry point): the outputs and the seconds of its three phases, the
    crossing into JAX, XLA's run (waited for) and the crossing back; None for a
    partition under dynamic shapes, whose padding and LRU are not split."""
    if part.executables.dynamic:
        return part.run(tensors), None
    token = X64.enable()
    try:
        start = time.perf_counter()
        arrays = part.inputs.arrays(tensors)
        if part.needs_seed:
            arrays.insert(0, draw_seed())
        crossed = time.perf_counter()
        call = part.dispatch
        outs = part._first_call(tensors, arrays) if call is None else call(*arrays)
        jax.block_until_ready(outs)
        ran = time.perf_counter()
        if (checks := part.value_checks) is not None and checks.checks:
            checks.raise_if_failed(outs[-1], part.name)
            outs = outs[:-1]
        if part._numpy_outputs:
            result = list(map(_from_numpy, map(_asarray, outs)))
        else:
            result = part._outputs(outs)
        back = time.perf_counter()
    finally:
        X64.restore(token)
    return result, (crossed - start, ran - crossed, back - ran)

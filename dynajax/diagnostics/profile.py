"""Where the time goes: each graph's and partition's calls named in the profilers users
already run, and with the option ``profile``, timed.

By default, while ``torch.profiler`` or ``jax.profiler`` records, every call of a
stitched graph opens a range named ``dynajax/graph<i>`` and each of its partitions one
named ``dynajax/graph<i>/jax_<n>`` (``torch.profiler.record_function``, and
``jax.profiler.TraceAnnotation`` while JAX traces), so a Perfetto or TensorBoard trace
shows dynajax's programs beside PyTorch's kernels. The ranges cover the dispatch, as a
CUDA kernel's launch range does: nothing waits for XLA's results. When no profiler
records, a call pays one check (``ranged_when_recording``: two attribute reads and a
Python frame) and runs the very graph it runs without: its partitions unwrapped.

With ``profile=True`` the backend hands each compiled partition to ``ProfiledPartition``
and each stitched graph to ``profiled_graph``. Every call then opens the same ranges
and adds its seconds to the graph's ``GraphTimes``: per partition the crossing into JAX,
XLA's run (waited for) and the crossing back (``runtime.compiled.run_in_phases``), and
per graph the time outside its partitions: PyTorch's ops between them and the stitching
around them. The first call of each is kept apart (it compiles).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import torch
import torch.fx

from dynajax.runtime.compiled import CompiledPartition, run_in_phases
from dynajax.runtime.jax_internals import jax_trace_state

# Set while torch's profiler records (``_is_profiler_enabled``), and while JAX's traces
# (``profile_session``; None: this JAX release keeps it elsewhere).
_TORCH_PROFILER = torch.autograd.profiler
_JAX_TRACE = jax_trace_state()


@dataclasses.dataclass
class Times:
    """Calls of one graph or partition and their seconds.

    Attributes:
        first_s: the first call (XLA's compile included), None before it.
        calls: the calls after the first.
        total_s: their seconds, wall time.
        cross_in_s, xla_s, cross_out_s: those seconds by phase (partitions of static
            shapes; a partition under dynamic shapes counts its whole call as XLA's).
    """

    first_s: float | None = None
    calls: int = 0
    total_s: float = 0.0
    cross_in_s: float = 0.0
    xla_s: float = 0.0
    cross_out_s: float = 0.0

    def add(self, seconds: float, phases: tuple[float, float, float] | None = None) -> bool:
        """Counts one call; False for the first, which is kept apart."""
        if self.first_s is None:
            self.first_s = seconds
            return False
        self.calls += 1
        self.total_s += seconds
        cross_in, xla, cross_out = phases if phases is not None else (0.0, seconds, 0.0)
        self.cross_in_s += cross_in
        self.xla_s += xla
        self.cross_out_s += cross_out
        return True

    def restart(self) -> None:
        """Forgets the calls after the first (``dynajax.explain`` times its own)."""
        self.calls = 0
        self.total_s = self.cross_in_s = self.xla_s = self.cross_out_s = 0.0

    def mean_ms(self, seconds: float) -> float:
        return 1e3 * seconds / self.calls if self.calls else 0.0


@dataclasses.dataclass
class GraphTimes:
    """One graph's calls (``GraphReport.times``): the graph's own, and each
    partition's by name."""

    label: str
    graph: Times = dataclasses.field(default_factory=Times)
    partitions: dict[str, Times] = dataclasses.field(default_factory=dict)
    # seconds in partitions during the graph's calls after its first
    inside_s: float = 0.0
    # False: calls take the graph's regular path, untimed (``dynajax.explain`` times the
    # whole program that way, with no wait for XLA's results inside it)
    timing: bool = True
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def restart(self) -> None:
        """Forgets the calls after the first, the graph's and its partitions'."""
        with self._lock:
            self.graph.restart()
            for t in self.partitions.values():
                t.restart()
            self.inside_s = 0.0

    @property
    def between_s(self) -> float:
        """Seconds of the graph's calls (after the first) outside its partitions: the
        PyTorch ops between them and the stitching."""
        return max(0.0, self.graph.total_s - self.inside_s)

    def lines(self, indent: str = "  ") -> list[str]:
        g = self.graph
        if g.first_s is None:
            return [f"{indent}time: not called yet"]
        if not g.calls:
            return [f"{indent}time: first call {1e3 * g.first_s:.2f} ms (compiles included)"]
        out = [
            f"{indent}time per call: {g.mean_ms(g.total_s):.3f} ms over {g.calls} call(s) "
            f"after the first ({1e3 * g.first_s:.1f} ms, compiles included)"
        ]
        for name, t in self.partitions.items():
            if not t.calls:
                continue
            out.append(
                f"{indent}  {name:<8} {t.mean_ms(t.total_s):9.3f} ms  (into JAX "
                f"{t.mean_ms(t.cross_in_s):.3f}, XLA {t.mean_ms(t.xla_s):.3f}, back to "
                f"torch {t.mean_ms(t.cross_out_s):.3f})"
            )
        out.append(
            f"{indent}  {'PyTorch':<8} {g.mean_ms(self.between_s):9.3f} ms  (ops kept in "
            "PyTorch between partitions, and the stitching)"
        )
        return out


class ProfiledPartition(torch.nn.Module):
    """A compiled partition whose calls are timed and named (``profile=True``).

    Args:
        times: the graph's ``GraphTimes``.
        name: the partition's name (``jax_0``).
        part: the ``CompiledPartition``.
    """

    part: Any  # the CompiledPartition

    def __init__(self, times: GraphTimes, name: str, part: Any) -> None:
        super().__init__()
        self.__dict__["part"] = part  # not a submodule: the graph calls this one
        self.graph_module = part.graph_module
        self.device_type = getattr(part, "device_type", None)  # where it runs
        self.name = name
        self.label = f"{times.label}/{name}"
        self._times = times
        self._own = times.partitions.setdefault(name, Times())
        self._timed = isinstance(part, CompiledPartition)  # (else a hook's wrapper)

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        start = time.perf_counter()
        with _torch_range(self.label), jax.profiler.TraceAnnotation(self.label):
            if self._timed:
                outs, phases = run_in_phases(self.part, tensors)
            else:  # a partition hook's wrapper: timed whole
                outs, phases = self.part.run(tensors), None
        seconds = time.perf_counter() - start
        with self._times._lock:
            if self._own.add(seconds, phases) and self._times.graph.first_s is not None:
                self._times.inside_s += seconds
        return outs

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.run(tensors))

    forward = __call__


def profiled_graph(
    run: Callable[..., Any], times: GraphTimes, regular: Callable[..., Any]
) -> Callable[..., Any]:
    """The stitched graph's callable ``run`` (aot_autograd's boxed convention, with its
    ``unboxed`` factory; its partitions ``ProfiledPartition``s), its calls timed and
    named ``times.label``; while ``times.timing`` is False, the graph's ``regular``
    callable (the same convention) instead."""

    # The first call of the unboxed callable runs aot_autograd's wrapper, which calls
    # the boxed one: that inner call is the same call, not another (one range, one time).
    inside = threading.local()

    def timed(call: Callable[..., Any], untimed: Callable[..., Any]) -> Callable[..., Any]:
        def profiled(*args: Any) -> Any:
            if not times.timing:
                return untimed(*args)
            if getattr(inside, "active", False):
                return call(*args)
            inside.active = True
            try:
                start = time.perf_counter()
                with _torch_range(times.label), jax.profiler.TraceAnnotation(times.label):
                    out = call(*args)
            finally:
                inside.active = False
            with times._lock:
                times.graph.add(time.perf_counter() - start)
            return out

        return profiled

    boxed = timed(run, regular)
    boxed._boxed_call = True  # type: ignore[attr-defined]
    boxed.graph_module = run.graph_module  # type: ignore[attr-defined]
    unboxed, regular_unboxed = run.unboxed, regular.unboxed  # type: ignore[attr-defined]
    boxed.unboxed = lambda *a, **k: timed(  # type: ignore[attr-defined]
        unboxed(*a, **k), regular_unboxed(*a, **k)
    )
    return boxed


class RangedPartition(torch.nn.Module):
    """A compiled partition whose calls are named ranges in torch's and JAX's profilers
    (no timing, no wait for XLA's results): the partitions of the graph a call runs
    while a profiler records (``ranged_when_recording``).

    Args:
        label: the range's name (``dynajax/graph0/jax_0``).
        part: the ``CompiledPartition`` (or what the backend's partition hook made of it).
    """

    part: Any

    def __init__(self, label: str, part: Any) -> None:
        super().__init__()
        self.__dict__["part"] = part  # not a submodule: the graph calls this one
        self.graph_module = part.graph_module
        self.device_type = getattr(part, "device_type", None)
        self.label = label
        self._guarded = getattr(part, "run_guarded", part.run)

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with _ranges(self.label):
            return self.part.run(tensors)

    def run_guarded(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with _ranges(self.label):
            return self._guarded(tensors)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.run(tensors))

    forward = __call__


def wrapped_copy(
    gm: torch.fx.GraphModule, names: Sequence[str], wrap: Callable[[str, Any], torch.nn.Module]
) -> torch.fx.GraphModule:
    """The stitched graph ``gm`` again, each of its partitions ``names`` as
    ``wrap(name, partition)`` (``gm`` itself keeps its own partitions, unwrapped): the
    ranged graph (``RangedPartition``s) and the timed one (``ProfiledPartition``s)."""
    copy = torch.fx.GraphModule(gm, gm.graph)
    for name in names:
        setattr(copy, name, wrap(name, getattr(gm, name)))
    return copy


def ranged_when_recording(
    run: Callable[..., Any], make_ranged: Callable[[], Callable[..., Any]], label: str
) -> Callable[..., Any]:
    """The stitched graph's callable (aot_autograd's boxed convention, with its
    ``unboxed`` factory): ``run``, except while torch's or JAX's profiler records, when
    a call runs the ranged graph (the same graph, its partitions ``RangedPartition``s;
    ``make_ranged()`` makes its stitched callable at the first such call) inside a range
    named ``label``."""
    inside = threading.local()  # (aot_autograd's first call calls the boxed callable)
    jax_trace = _JAX_TRACE
    torch_profiler = _TORCH_PROFILER
    # (made at the first recording call; two threads may both make it: the same graph)
    ranged = functools.cache(make_ranged)

    def choose(
        plain: Callable[..., Any], named: Callable[[], Callable[..., Any]]
    ) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if not (
                torch_profiler._is_profiler_enabled
                or (jax_trace is not None and jax_trace.profile_session is not None)
            ):
                return plain(*args)
            if getattr(inside, "active", False):
                return named()(*args)
            inside.active = True
            try:
                with _ranges(label):
                    return named()(*args)
            finally:
                inside.active = False

        return call

    boxed = choose(run, ranged)
    boxed._boxed_call = True  # type: ignore[attr-defined]
    boxed.graph_module = run.graph_module  # type: ignore[attr-defined]
    plain_unboxed = run.unboxed  # type: ignore[attr-defined]

    def unboxed(*a: Any, **k: Any) -> Callable[..., Any]:
        ranged_unboxed = functools.cache(lambda: ranged().unboxed(*a, **k))  # type: ignore[attr-defined]
        return choose(plain_unboxed(*a, **k), ranged_unboxed)

    boxed.unboxed = unboxed  # type: ignore[attr-defined]
    return boxed


@contextlib.contextmanager
def _ranges(label: str) -> Iterator[None]:
    """A range named ``label`` in torch's profiler while it records, and in JAX's while
    it traces."""
    tracing = _JAX_TRACE is not None and _JAX_TRACE.profile_session is not None
    with (
        _torch_range(label),
        jax.profiler.TraceAnnotation(label) if tracing else contextlib.nullcontext(),
    ):
        yield


def _torch_range(label: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.profiler.record_function(label)`` while torch's profiler records (a
    range costs a dispatcher call each way; none when nothing records it). With
    ``profile=True``, JAX's ``TraceAnnotation`` is always opened beside it (cheap when
    JAX's profiler is off)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()


def count_ops(events: Sequence[Any]) -> tuple[int, dict[str, int]]:
    """From a ``torch.profiler`` run of a program compiled with ``profile=True``: the
    ATen ops it ran outside any dynajax graph, and the calls of each graph (by its
    range's name).

    An op is counted as PyTorch's kernels ran it: the innermost ATen calls the profiler
    records (``aten::linear`` is its ``aten::addmm`` and the views under it; an eager
    ``aten::gru`` is the ops of every step), which is how the graphs count theirs, after
    decomposition to core ATen. Ops that torch.compile's own wrappers run around a
    graph (writing a mutated input back) count as outside too.
    """
    has_child: set[int] = set()
    for e in events:
        parent = _aten_parent(e)
        if e.name.startswith("aten::") and parent is not None:
            has_child.add(id(parent))
    outside = 0
    calls: dict[str, int] = {}
    for e in events:
        if e.name.startswith(_PREFIX) and e.name.count("/") == 1:
            calls[e.name] = calls.get(e.name, 0) + 1
        elif e.name.startswith("aten::") and id(e) not in has_child:
            if not any(p.name.startswith(_PREFIX) for p in _ancestors(e)):
                outside += 1
    return outside, calls


_PREFIX = "dynajax/"


def _ancestors(e: Any) -> Iterator[Any]:
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _aten_parent(e: Any) -> Any:
    return next((p for p in _ancestors(e) if p.name.startswith("aten::")), None)

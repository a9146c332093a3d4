"""Ops kept in PyTorch because PyTorch's kernel is faster (``Reason.PERF``).

The capability stage asks ``faster_in_pytorch`` about a node only after it has found
that JAX can run it (a rule, its check and its abstract evaluation all agree), and only
where the backend's partitions run where the tensors are (``Options.perf_fallbacks``,
not with ``device`` or ``mesh``). Each entry is a measurement, not a guess, and names
it; the report prints the detail beside the node.

Which of XLA and a PyTorch kernel is faster depends on the machine (XLA and
MKL/oneDNN rank differently on Intel and AMD, AVX2 and AVX-512, and by core count), so
for the large attention, the fused encoder layer and a graph's convolutions the choice
is measured where it runs (``Options.measure_costs``, on by default): at the first
compile, the node's whole graph is built with it in PyTorch and in JAX and each build
runs in blocks of calls on random inputs (``in_graph.py``), or, where the graph cannot
run on made-up inputs, the op alone runs both ways on random inputs of its shapes and
dtypes (``measure``; not convolutions, which then take the default); the faster is
kept. The times are remembered with the abstract evaluations (in the process, and in
the persistent cache keyed by the machine and the graph, or the op, its shapes and
dtypes: ``capability/memo.py``), and the report lists them with the choice
(``CostChoice``). The measurements below are the defaults, used with
``measure_costs=False`` and where a node cannot be measured (symbolic sizes).

* ``_scaled_dot_product_flash_attention_for_cpu``, when kept whole by aot_autograd
  (``lowering.attention.whole``: at least 2^27 flops in its products). PyTorch's CPU
  kernel is a blocked (flash) attention over both cores; XLA's program (the rule: one
  head at a time in a loop per CPU, causal ones in blocks of queries) runs each loop's
  products on one thread. On the benchmark row ``attention-512`` (8 x 4 heads x 512
  tokens x 64, causal; 2 cores) the attention alone took 9.7-11 ms in PyTorch and 16.2
  ms in XLA (19.3 not causal; 32-42 before the rule's loops), and the whole block 31.9
  ms with the attention in JAX against 24.4 ms with it in PyTorch (``benchmarks.run
  --peers ...,dynajax-jax``; 44.5 against 28.5 before the rule's loops). Smaller
  attentions are decomposed into JAX ops: there, on GPT-2 (4 x 4 heads x 128 tokens),
  PyTorch's kernel between JAX partitions made the model slower (25.0 -> 36.3 ms).
* ``_transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer``'s fused fast path
  in eval mode under no_grad: the whole layer, one op) on CPU tensors from
  ``ENCODER_LAYER_FLOPS``. PyTorch's kernel runs its products on MKL over both cores
  and its attention fused; XLA's program of the layer (``lowering/attention.py``) ran
  its batched products on one thread. Measured against eager's kernel, with the kernel
  run by dynajax beside it (µs; width, heads, feed-forward, batch, tokens):
  (32, 2, 64, 2, 8) JAX 130, PyTorch 145; (64, 4, 256, 4, 32) 371 and 410;
  (128, 4, 512, 8, 64) 2653 and 1548; (256, 4, 1024, 8, 128, the benchmark's
  ``encoder`` row) 11230 and 8214; (512, 8, 2048, 4, 256) 38390 and 29508.
* ``convolution`` and ``convolution_backward`` on CPU tensors, timed in their graph
  only (``_IN_GRAPH_ONLY``; the default is XLA). oneDNN's kernels beat XLA's
  convolution alone on most of ResNet's shapes (1.5-2x), but each convolution kept in
  PyTorch cuts the partition around it; on 2026-11-29 ResNet-18's inference graph
  (batch 8, 64x64) ran 21.97 ms with its convolutions in PyTorch and 29.05 ms all in
  JAX, its training backward 56.64 and 54.75 ms (``benchmarks/RECORD.md``).
* ``mm``, ``addmm`` and ``bmm`` on CPU tensors from ``PRODUCT_FLOPS``, timed in their
  graph only, where PyTorch's kernel runs inside the XLA program (``dynajax/ffi``; the
  default is XLA). MKL's products and XLA's rank by CPU: on an Intel Xeon with AVX-512
  and AMX, JAX's MLP (512-2048-512, batch 64) ran 1.13x eager's, below eager on AMD
  EPYC Zen 4 and 5. A product's transposed weight crosses as the array it was, the
  kernel's view transposing it (``ffi.Permuted``), as eager's ``t`` costs nothing.
* ``mode`` and ``kthvalue`` on CPU tensors. PyTorch's kernels select in place on each
  row; the rules sort the rows, and where values tie run PyTorch's own algorithms step
  by step to give its index (``lowering/eager_sorting.py``), a loop per step. Each op
  alone, compiled with ``perf_fallbacks=False`` against eager (ms; rows tied, 3 levels;
  2026-11-27, 2 cores): mode (64, 16) 0.139 and 0.007, (64, 64) 2.49 and 0.014, (8, 256)
  6.22 and 0.010, (64, 1000, 50 levels) 239 and 1.10; kthvalue at the middle (64, 16)
  0.408 and 0.008, (64, 64) 1.90 and 0.015, (64, 1000) 68.1 and 0.41.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes

from dynajax import ffi
from dynajax.lowering import attention
from dynajax.lowering.registry import Rule

aten = torch.ops.aten

# node.meta key of a measured choice (the report reads it).
COST_KEY = "dynajax_cost"
# Timed rounds of both paths (after one untimed call each, which compiles XLA's).
REPEATS = 7


@dataclasses.dataclass(frozen=True)
class CostChoice:
    """Both paths of a choice, timed on this machine, and the one kept.

    Attributes:
        op: the op (or ops) chosen for.
        node: the node (or nodes) it was chosen for.
        pytorch_s: the median time with PyTorch's kernel.
        xla_s: the median time with XLA's program of the rule.
        measure_s: what measuring took (XLA's compiles included), the first compile's
            added cost; 0 where the times came from the cache.
        scope: what was timed: ``"op"``, the op alone (``measure``), or ``"graph"``,
            the node's whole graph built both ways (``in_graph.choose``: every
            candidate of the graph in PyTorch, or all in JAX), or ``"block"``, the
            first of the graph's repeated blocks, built both ways, for the whole graph.
        block: with ``"block"``, how many blocks and which (``"12 alike blocks,
            transformer.h.* (GPT2Block)"``).
    """

    op: str
    node: str
    pytorch_s: float
    xla_s: float
    measure_s: float
    scope: str = "op"
    block: str = ""

    @property
    def in_pytorch(self) -> bool:
        return self.pytorch_s < self.xla_s

    def describe(self) -> str:
        where = "PyTorch" if self.in_pytorch else "JAX"
        took = f" (measuring took {self.measure_s:.2f} s)" if self.measure_s else " (cached)"
        if self.scope in ("graph", "block"):
            what = "its graph" if self.scope == "graph" else f"the first of its {self.block},"
            timed = (
                f"{what} with PyTorch's kernel {_ms(self.pytorch_s)}, all in JAX {_ms(self.xla_s)}"
            )
        else:
            timed = f"PyTorch's kernel {_ms(self.pytorch_s)}, XLA's program {_ms(self.xla_s)}"
        return f"{timed} on this machine: runs in {where}{took}"

    def why(self) -> str:
        """The detail of the node's verdict."""
        return (
            f"{self.describe()} (measured at the first compile; measure_costs=False takes "
            "the defaults of dynajax/capability/cost.py); perf_fallbacks=False runs it in JAX"
        )


@dataclasses.dataclass(frozen=True)
class Unmeasured:
    """A choice that measuring failed to make: an error while building the stand-in
    inputs, compiling or timing a candidate (``MeasureFailed``). The node takes the
    default of the choice; measuring never fails a compile.

    Attributes:
        op: the op (or ops) measuring was for.
        node: the node (or nodes).
        error: the stage that failed and its error.
        in_pytorch: where the default runs the node.
        scope: ``"op"`` or ``"graph"``, as ``CostChoice.scope``.
    """

    op: str
    node: str
    error: str
    in_pytorch: bool
    scope: str = "op"

    def describe(self) -> str:
        where = "PyTorch" if self.in_pytorch else "JAX"
        timed = "its graph" if self.scope == "graph" else "the op"
        return f"not measured (timing {timed}: {self.error}): runs in {where}, the default"


class MeasureFailed(Exception):
    """A stage of measuring a choice raised (``stage``); the choice takes its default."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage} raised {type(error).__name__}: {error}")
        self.stage = stage


@contextlib.contextmanager
def stage(name: str, passing: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Any error inside (but ``passing``'s, and a ``MeasureFailed`` already named) is a
    ``MeasureFailed`` of stage ``name``."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - measuring must not fail the compile
        if isinstance(e, (MeasureFailed, *passing)):
            raise
        raise MeasureFailed(name, e) from e


# A test-only seam: (PyTorch's time, XLA's time) that measuring reports in place of the
# clock's medians, for the tests that assert where a measured op runs. Everything else
# still runs: the stand-in inputs are built, both paths compiled and called, timed.
# None (always, outside tests): the clock's medians. ``times_key`` keys remembered times
# by it too.
fixed_times: tuple[float, float] | None = None


def reported(pytorch_s: float, xla_s: float) -> tuple[float, float]:
    """The measured medians, or the seam's ``fixed_times``."""
    return fixed_times if fixed_times is not None else (pytorch_s, xla_s)


def times_key() -> tuple[Any, ...]:
    """What remembered times are keyed by besides the op or graph: the machine, whether
    PyTorch's kernel runs inside the XLA program or between partitions (``ffi``: two
    different builds of the same choice), and the test seam's ``fixed_times``."""
    key = (machine(), "kernels inside XLA" if ffi.available() else "kernels between")
    return key if fixed_times is None else (*key, fixed_times)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _val(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _large_cpu_attention(node: torch.fx.Node) -> str | None:
    query, key = (_val(a) for a in node.args[:2])
    dropout_p = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    if not isinstance(dropout_p, float | int) or not attention.whole(query, key, float(dropout_p)):
        return None
    return (
        "PyTorch's fused CPU attention kernel ran 1.5-2x faster than XLA's program for a "
        "large attention (dynajax/capability/cost.py); perf_fallbacks=False runs it in JAX"
    )


# From this many floating-point operations (products and attention) a fused encoder
# layer runs faster in PyTorch: the measurements above cross between 13.6M and 0.2G.
ENCODER_LAYER_FLOPS = 1 << 25


def _large_encoder_layer(node: torch.fx.Node) -> str | None:
    if len(node.args) < 15:
        return None
    src, weight = (_val(node.args[i]) for i in (0, 14))  # src, ffn_weight_1
    if not isinstance(src, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return None
    sizes = (*src.shape, weight.shape[0])
    if src.device.type != "cpu" or len(sizes) != 4 or not all(isinstance(d, int) for d in sizes):
        return None  # (a symbolic size: no measurement covers it)
    batch, tokens, width, hidden = sizes
    flops = 2 * batch * tokens * (4 * width * width + 2 * width * hidden)
    flops += 4 * batch * tokens * tokens * width
    if flops < ENCODER_LAYER_FLOPS:
        return None
    return (
        "PyTorch's fused encoder-layer kernel ran 1.4-1.7x faster than XLA's program for "
        "a layer this size (dynajax/capability/cost.py); perf_fallbacks=False runs it in JAX"
    )


def _cpu_selection(node: torch.fx.Node) -> str | None:
    x = _val(node.args[0])
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.numel() < 2:
        return None
    op = node.target.__name__.split(".")[0] if callable(node.target) else str(node.target)
    return (
        f"PyTorch's CPU {op} kernel selects within each row; "
        "the rule sorts, and emulates PyTorch's algorithm where values tie (20-600x slower "
        "measured, dynajax/capability/cost.py); perf_fallbacks=False runs it in JAX"
    )


# op -> a function of the node: why PyTorch runs it faster, or None where it does not.
_FASTER_IN_PYTORCH: dict[torch._ops.OpOverload, Callable[[torch.fx.Node], str | None]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _large_cpu_attention,
    aten._transformer_encoder_layer_fwd.default: _large_encoder_layer,
    aten.mode.default: _cpu_selection,
    aten.kthvalue.default: _cpu_selection,
}


# From this many floating-point operations a matrix product's choice is measured: a
# smaller one is cheap either way (and the measuring would double its graph's compile).
PRODUCT_FLOPS = 1 << 24


def _large_product(node: torch.fx.Node) -> bool:
    """A CPU product (``mm``, ``addmm``, ``bmm``) of static sizes, of at least
    ``PRODUCT_FLOPS``, where PyTorch's kernel can run inside the XLA program (between
    partitions it would cut its graph at every layer)."""
    a, b = (_val(x) for x in node.args[-2:])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not _static_cpu(node):
        return False
    if not a.is_floating_point():
        return False
    flops = 2 * a.numel() * b.shape[-1]
    return flops >= PRODUCT_FLOPS and ffi.available()


# Ops whose choice is measured where they run (with measure_costs): which nodes are
# candidates (PyTorch's kernel could win), whatever the defaults say.
_MEASURED: dict[torch._ops.OpOverload, Callable[[torch.fx.Node], bool]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda n: (
        _large_cpu_attention(n) is not None
    ),
    aten._transformer_encoder_layer_fwd.default: lambda n: _static_cpu(n),
    aten.convolution.default: lambda n: _static_cpu(n),
    aten.convolution_backward.default: lambda n: _static_cpu(n),
    aten.mm.default: _large_product,
    aten.addmm.default: _large_product,
    aten.bmm.default: _large_product,
}

# Of those, the ones measured only in their graph (``in_graph.py``); where the graph
# cannot be timed they take the defaults (XLA). A network's convolutions are many
# nodes, and each is cheap: alone, oneDNN's kernel beat XLA's convolution on most of
# ResNet's shapes (``benchmarks/RECORD.md``, "Convolution algorithms"), yet the model
# with them in PyTorch pays a crossing and a cut partition per convolution; only the
# graph tells.
_IN_GRAPH_ONLY = frozenset(
    {
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
    }
)

# Of those, the ones timed alone where their graph is one program (``train_step``'s),
# whose kernels cut nothing: on the CPUs measured, a step's convolutions through
# oneDNN inside XLA won alone and in the step (ResNet-18's step 1.04 -> 0.79-0.84x
# eager, Intel Xeon, 2026-12-07), while its matrix products, faster alone through MKL
# at the MLP's and GPT-2's sizes, made those steps slower (``benchmarks/RECORD.md``).
_ALONE_IN_ONE_PROGRAM = frozenset({aten.convolution.default, aten.convolution_backward.default})

# Measures a candidate node, remembered: (node) -> (pytorch_s, xla_s, measure_s), or
# None where it cannot be measured. The capability stage passes one bound to its cache.
Measure = Callable[[torch.fx.Node], "tuple[float, float, float] | None"]


def is_measured(node: torch.fx.Node) -> bool:
    """Whether ``node``'s choice is one measured where it runs (``_MEASURED``)."""
    candidate = _MEASURED.get(node.target)  # type: ignore[call-overload]
    return candidate is not None and candidate(node)


def faster_in_pytorch(
    node: torch.fx.Node, measure: Measure | None = None, *, one_program: bool = False
) -> str | None:
    """Why ``node``, which JAX can run, runs faster in PyTorch; None where it does not.
    With ``measure``, the ops of ``_MEASURED`` are timed (``CostChoice``, stored in
    ``node.meta``) instead of judged by the defaults; with ``one_program`` (the
    whole-graph driver's: a kernel cuts nothing there), the convolutions too
    (``_ALONE_IN_ONE_PROGRAM``)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    alone = node.target not in _IN_GRAPH_ONLY or (
        one_program and node.target in _ALONE_IN_ONE_PROGRAM
    )
    if measure is not None and is_measured(node) and alone:
        times = measure(node)
        if times is not None:
            choice = CostChoice(str(node.target), node.name, *times)
            node.meta[COST_KEY] = choice
            return choice.why() if choice.in_pytorch else None
    default = _FASTER_IN_PYTORCH.get(node.target)
    return default(node) if default is not None else None


def _static_cpu(node: torch.fx.Node) -> bool:
    """Every tensor argument on the CPU, with sizes known now (measurable)."""
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and (
            v.device.type != "cpu" or not all(isinstance(d, int) for d in v.shape)
        ):
            return False
    return True


@functools.cache
def machine() -> str:
    """What the measured times depend on besides the op: the CPU, its cores, the thread
    counts and the instruction sets the libraries may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    names = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "XLA_FLAGS")
    settings = {k: os.environ[k] for k in names if k in os.environ}
    return (
        f"{model}; {os.cpu_count()} cpus; torch threads {torch.get_num_threads()}; "
        f"{torch.backends.cpu.get_cpu_capability()}; {sorted(settings.items())}"
    )


def measure(node: torch.fx.Node, rule: Rule) -> tuple[float, float, float] | None:
    """(PyTorch's median time, XLA's median time, what measuring took) of ``node`` on
    random inputs of its shapes and dtypes; None where an argument has no concrete
    size."""
    # Real tensors and real calls: outside the compile's fake-tensor mode.
    with _disable_current_modes():
        return _measure(node, rule)


def _measure(node: torch.fx.Node, rule: Rule) -> tuple[float, float, float] | None:
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)

    def concrete(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            a = a.meta.get("val")
        if isinstance(a, torch.Tensor):
            if not all(isinstance(d, int) for d in a.shape):
                raise _Symbolic
            return random_tensor(a.shape, a.dtype, gen)
        if isinstance(a, (list, tuple)):
            return type(a)(concrete(x) for x in a)
        return a

    try:
        with stage("building the stand-in inputs", passing=(_Symbolic,)):
            args = concrete(tuple(node.args))
            kwargs = {k: concrete(v) for k, v in node.kwargs.items()}
    except _Symbolic:
        return None
    target = node.target
    assert callable(target)
    with stage("building XLA's program"):
        run, tensors = rule.over(args, kwargs, lambda x: isinstance(x, torch.Tensor))
        program = jax.jit(run)
        arrays = [jax.numpy.asarray(np.asarray(t)) for t in tensors]

    def pytorch() -> None:
        with torch.no_grad():
            target(*args, **kwargs)

    def xla() -> None:
        jax.block_until_ready(program(*arrays))

    with stage("compiling and timing both"):
        pytorch_s, xla_s = reported(*median_times(pytorch, xla))
    return pytorch_s, xla_s, time.perf_counter() - start


def random_tensor(shape: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A stand-in argument to time an op or a graph on: normal numbers of ``shape`` and
    ``dtype`` drawn from ``gen``, zeros for integers and booleans (valid indices)."""
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, generator=gen)
    return torch.zeros(shape, dtype=dtype)


class _Symbolic(Exception):
    pass


def median_times(
    *calls: Callable[[], Any],
    rounds: int = REPEATS,
    untimed_first: bool = True,
    block: int = 0,
) -> list[float]:
    """Each call's median time over ``rounds``, the calls alternating within a round
    (so that a loaded machine slows them alike); with ``untimed_first``, after one
    untimed call each (XLA's compile, warm caches). With ``block``, each call's turn in
    a round is one untimed call and then ``block`` timed ones: how a program runs when
    called again and again, where PyTorch's OpenMP workers, spinning after one call's
    kernel, would otherwise slow the other call's first XLA program."""
    if untimed_first:
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, kept in zip(calls, times, strict=True):
            if block:
                call()
            for _ in range(max(block, 1)):
                t = time.perf_counter()
                call()
                kept.append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def result_of(times: tuple[float, float, float] | None) -> Any:
    """Times as the memo keeps them (text), and back: ``times_of``."""
    return None if times is None else json.dumps(times)


def times_of(text: str | None) -> tuple[float, float, float] | None:
    return None if text is None else tuple(json.loads(text))  # type: ignore[return-value]

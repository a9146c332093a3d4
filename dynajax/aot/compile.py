"""The aot stage's adapter for the backend: aot_autograd run on Dynamo's graph
(``aot_compile``), with the decomposition table of ``decompositions.py``, each ATen
graph it makes handed to the backend's compiler, and its result loaded from and stored
in the cache (``cache.py``; a training graph's wrapper: ``rebuild.py``).

Around aot_autograd: on a GPU, ``F.scaled_dot_product_attention`` is traced as
PyTorch's math attention (``_attention_as_math``); training graphs are split by the
min-cut partitioner unless its backward would read an input the forward mutates, or
recompute a value it compares (``_partition_without_reading_mutated_inputs``); backward
graphs compile under Dynamo's compile lock (``_under_compile_lock``); an inference
graph whose runtime wrapper would only write inputs back is called without it
(``_runtime_wrapper_plan``, ``passes/writes.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._dynamo import convert_frame as _convert_frame
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx.experimental.symbolic_shapes import fx_placeholder_vals

import dynajax.aot.cache as aot_cache
import dynajax.aot.rebuild as aot_rebuild
from dynajax.aot.table import _tracing_decompositions
from dynajax.passes.writes import Write, new_values, rewrite_writes, writing_back, written_outputs
from dynajax.store import BlobStore

aten = torch.ops.aten


def on_accelerator(example_inputs: Sequence[Any]) -> bool:
    """Whether a Dynamo graph's tensors live on an accelerator (a GPU)."""
    return any(
        isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") for t in example_inputs
    )


def _attention_as_math(example_inputs: Sequence[Any]) -> Any:
    """On an accelerator, ``F.scaled_dot_product_attention`` traced as PyTorch's math
    attention (matmuls, softmax, dropout: ops with rules), not as the GPU's fused
    kernel.

    ``scaled_dot_product_attention`` is CompositeImplicitAutograd: it picks its kernel
    from its inputs before aot_autograd's tracer sees it, and no decomposition table
    entry overrides that choice. On a GPU it picks ``_scaled_dot_product_efficient_-
    attention`` (float32) or the flash or cuDNN kernel, with their own backward ops and
    their own dropout RNG, none of which has a rule or a decomposition: each attention
    would run in eager PyTorch between JAX partitions (on an H100 the GPT-2 benchmark
    row did not lower to one partition). Restricting the choice to the math backend
    while tracing gives XLA the attention to fuse, with autograd's own formulas and
    dynajax's dropout. On the CPU
    the fused kernel's own decomposition (``_scaled_dot_product_flash_attention_for_-
    cpu``, with the correction above) stays: it follows eager's CPU kernel.
    """
    if not on_accelerator(example_inputs):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _partition_without_reading_mutated_inputs(
    joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The min-cut partition, unless its backward reads an input the forward mutates.

    The min-cut partitioner may recompute a value in the backward from a graph input
    (``sinc(x0)`` from ``x0``). When the program mutates that input in place (``x0.neg_()``
    after ``sinc``), aot_autograd saves the input itself, the mutation is applied to it
    after the forward, and the backward would read the new value; autograd's version
    counter catches it and backward raises "one of the variables needed for gradient
    computation has been modified by an inplace operation" where eager does not. (PyTorch's
    own ``aot_eager_decomp_partition`` fails the same way.) Such a graph is split by the
    default partitioner, which saves what the forward computed, as eager's autograd does.
    The joint graph's output descriptors name the mutated inputs.

    The partitioner's common-subexpression pass is off while it runs (functorch's ``cse``
    setting; compiles run under Dynamo's compile lock, so no other compile sees it): the
    pass imports inductor's pattern matcher, and with it all of inductor's lowerings,
    which cost every process 0.5-1 s at its first training graph, most of aot_autograd's
    time in a warm process (``benchmarks/cold_start.py``). XLA eliminates common
    subexpressions inside each partition, and the forward saves the same tensors without
    the pass (4, 27 and 183 on the MLP, encoder and ResNet-18 training rows)."""
    with functorch_config.patch(cse=False):
        fw, bw = min_cut_rematerialization_partition(
            joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
        )
    if _recomputes_a_compared_value(bw):
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    output = next(iter(joint.graph.find_nodes(op="output")))
    mutated = [
        d.mutated_input
        for d in output.meta.get("desc") or ()
        if isinstance(d, InputMutationAOTOutput)
    ]
    if not mutated:
        return fw, bw
    names = {
        n.name for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("desc") in mutated
    }
    if not any(n.name in names for n in bw.graph.find_nodes(op="placeholder")):
        return fw, bw
    return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)


_EQUALITY = (aten.eq.Tensor, aten.ne.Tensor)


def _recomputes_a_compared_value(bw: torch.fx.GraphModule) -> bool:
    """Whether the backward tests a floating value it recomputes for equality with
    another (``amax``'s gradient: ``eq(amax, x)``, with ``amax`` saved by the forward
    and ``x`` recomputed from the inputs).

    Recomputed, ``x`` need not have the forward's bits: the backward is another XLA
    program, fused otherwise, and XLA's CPU compiler contracts a product and a sum into
    one multiply-add where fusion allows (README, Numerics). Then no element equals the
    maximum, and the gradient is 0 / 0 = NaN (fuzz seed 5, program 3518: ``amax`` of
    ``asinh(rms_norm(x))``). Such a graph is split by the default partitioner, which
    saves what the forward computed."""
    for node in bw.graph.nodes:
        if node.op != "call_function" or node.target not in _EQUALITY:
            continue
        operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        vals = [a.meta.get("val") for a in operands]
        if not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals):
            continue
        if any(_computed_in_backward(a) for a in operands):
            return True
    return False


def _computed_in_backward(node: torch.fx.Node) -> bool:
    """Whether ``node`` is computed by the backward from saved values alone (not read
    from a saved value through views, nor derived from the incoming gradients)."""
    computed = False
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name.startswith("tangents"):
                return False
            continue
        if n.op == "call_function" and not getattr(n.target, "is_view", False):
            computed = True
        stack.extend(n.all_input_nodes)
    return computed


# compile_aten_graph(gm, example_inputs, kind=...) -> the compiled callable
GraphCompiler = Callable[..., Callable[..., Any]]


# Dynamo's lock around every compile it runs (a private name; a lock of our own where a
# torch release lacks it, which still keeps our backward compiles apart).
_COMPILE_LOCK = getattr(_convert_frame, "compile_lock", None) or threading.RLock()


def _under_compile_lock(compile_graph: GraphCompiler) -> GraphCompiler:
    """``compile_graph`` run under Dynamo's compile lock.

    aot_autograd compiles a backward graph lazily, at its first backward call, outside
    the lock that Dynamo holds while it compiles, so the first backwards of several
    threads compile at once, with each other and with Dynamo's compiles. torch.fx keeps
    its "preserve node meta" switch in a process-wide global: one thread's tracing then
    gave the nodes another thread's partitioning created meta they must not have, and
    fusing failed (``replace_with already has .meta keys``). Under Dynamo's lock (a
    reentrant one), a backward compiles alone, as forward graphs already do.
    """

    @functools.wraps(compile_graph)
    def locked(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        with _COMPILE_LOCK:
            return compile_graph(*args, **kwargs)

    return locked


def _runtime_wrapper_plan(n_graph_inputs: int, example_inputs: Sequence[Any]) -> list[int] | None:
    """What aot_autograd's runtime wrapper around the inference graph being compiled
    does (read while aot_autograd compiles it): None where it does something that
    dynajax leaves to it, else the positions of the inputs whose data the graph
    mutates, in order (empty where the wrapper would do nothing at all).

    The wrapper writes mutated inputs back, regenerates outputs that alias inputs or
    intermediates, threads effect tokens, wraps and unwraps tensor subclasses, drops
    duplicated inputs, merges aliased ones into synthetic bases, prepends parameters
    and RNG state, turns autocast off around the call and grad mode off (which changes
    nothing when no input requires grad). When all it does is write new data into
    inputs that do not require grad (a KV cache updated in place, a counter), the graph
    returns their new values first and ``passes/writes.py`` writes them as the wrapper's
    ``copy_``es would (``runtime_wrappers._create_runtime_wrapper``'s mutation epilogue)
    without the wrapper's layers, an indexed update only where it wrote; when it does
    nothing, its only effect is its cost (about 1.5 µs per call:
    ``benchmarks/overhead.py``).
    """
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None or torch._C._is_any_autocast_enabled():
        return None
    if not (
        n_graph_inputs == len(example_inputs)  # no dedupe, synthetic bases, params, RNG
        and not any(isinstance(x, list | tuple | dict) for x in example_inputs)
        and not meta.tokens
        and meta.num_intermediate_bases == 0
        and all(
            o.output_type == OutputType.non_alias and not o.requires_grad for o in meta.output_info
        )
        and not any(isinstance(m, SubclassCreationMeta) for m in meta.subclass_inp_meta)
        and not any(isinstance(m, SubclassCreationMeta) for m in meta.subclass_fw_graph_out_meta)
    ):
        return None
    mutated = []
    for i, info in enumerate(meta.input_info):
        if info.mutates_metadata or info.mutates_storage_metadata:
            return None
        if info.mutation_inductor_storage_resize:
            return None
        if info.mutates_data:
            if info.requires_grad or getattr(example_inputs[i], "requires_grad", False):
                return None
            mutated.append(i)
    if mutated != list(meta.mutated_inp_runtime_indices):
        return None  # a mutation kept in the graph, or one the wrapper skips
    streams = getattr(meta, "mutated_inp_stream_indices", None)
    if streams and any(s is not None for s in streams):
        return None
    return mutated


def _traced_metadata() -> Any:
    """aot_autograd's metadata of the graph it is compiling (its ``ViewAndMutationMeta``),
    or None outside its compile."""
    return getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)


def _mutated_inputs(meta: Any, n_inputs: int) -> list[int]:
    """The positions, among Dynamo's ``n_inputs`` inputs, of those whose data the graph
    described by aot_autograd's ``meta`` writes (its inputs may begin with parameters it
    prepended: not Dynamo's)."""
    if meta is None:
        return []
    first = len(meta.input_info) - n_inputs
    return [i - first for i, info in enumerate(meta.input_info) if info.mutates_data and i >= first]


def _eager_where_overlapping(
    compiled: Callable[..., Any], gm: torch.fx.GraphModule, mutated: Sequence[int]
) -> Callable[..., Any]:
    """``compiled``, except that a call where an input at a ``mutated`` position has
    internal overlap (several elements at one address: ``expand``) runs Dynamo's graph
    ``gm`` in eager PyTorch. Eager decides per op: most in-place kernels refuse such a
    tensor ("unsupported operation: more than one element of the written-to tensor
    refers to a single memory location"), before any other check of theirs, where
    ``fill_``, ``zero_`` and ``index_put_`` write it; a compiled graph computes new
    values and copies them back, which the copy refuses only after the program ran."""
    if not mutated:
        return compiled
    positions = tuple(mutated)
    overlap = torch._debug_has_internal_overlap
    YES = 1  # (torch's MemOverlap::Yes)

    def call(*args: Any) -> Any:
        for i in positions:
            x = args[i]
            if isinstance(x, torch.Tensor) and not x.is_contiguous() and overlap(x) == YES:
                return gm(*args)
        return compiled(*args)

    return functools.wraps(compiled)(call)


def _in_aot_convention(compiled: Callable[..., Any], writes: list[Write]) -> Callable[..., Any]:
    """``compiled`` as aot_autograd's runtime wrapper calls it (a graph's first call, or
    every call where dynajax does not bypass the wrapper): the mutated inputs' whole new
    values first, where ``rewrite_writes`` made the graph return indexed updates' values
    instead."""
    if all(w.kind == "copy" for w in writes):
        return compiled
    n = written_outputs(writes)

    def boxed(args: list[Any]) -> list[Any]:
        inputs = list(args)
        outs = compiled(args)
        return [*new_values(writes, inputs, outs), *outs[n:]]

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


def aot_compile(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    compile_aten_graph: GraphCompiler,
    cache: BlobStore | None = None,
) -> Callable[..., Any]:
    """Runs aot_autograd on Dynamo's graph and hands each ATen graph it makes to
    ``compile_aten_graph(graph, inputs, kind=..., aot=...)``, ``kind`` being
    ``inference``, ``forward`` or ``backward`` and ``aot`` what became of the graph in
    ``cache`` (``aot/cache.py``: loaded, traced and stored, or why not).

    For an inference graph whose runtime wrapper would do nothing but write new data
    into inputs (``_runtime_wrapper_plan``), Dynamo gets the compiled graph's own
    unboxed callable (``unboxed`` of ``stitched_callable``'s result), with those writes
    (``passes/writes.py``), instead of aot_autograd's wrapper chain; its first call still
    goes through the chain, which checks custom ops' aliasing on first calls. Such a
    graph is stored in ``cache``, and a later process loads it instead of running
    aot_autograd (a graph with custom ops, which that check is for, is not stored).

    A training graph is stored with the structures ``aot/rebuild.py`` records
    while aot_autograd traces it, and a later process rebuilds aot_autograd's
    autograd.Function around its two loaded graphs with aot_autograd's own code. An
    entry that cannot be rebuilt (another torch's structures) is traced and replaced.

    A call whose input the graph writes in place has internal overlap (an expanded
    tensor) runs Dynamo's graph in eager PyTorch (``_eager_where_overlapping``).
    """
    mutated: list[int] = []
    compiled = _aot_compiled(gm, example_inputs, compile_aten_graph, cache, mutated)
    return _eager_where_overlapping(compiled, gm, mutated)


def _aot_compiled(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    compile_aten_graph: GraphCompiler,
    cache: BlobStore | None,
    mutated: list[int],
) -> Callable[..., Any]:
    """``aot_compile``'s callable; sets ``mutated`` to the positions of the inputs the
    graph writes in place."""
    entry = aot_cache.lookup(cache, gm, example_inputs)
    found = entry.load()
    if found is not None and found.kind == "inference":
        assert found.graph is not None
        mutated[:] = found.plan
        writes = rewrite_writes(found.graph, found.plan)
        compiled = compile_aten_graph(found.graph, example_inputs, kind="inference", aot=entry)
        unboxed: Callable[..., Any] = compiled.unboxed  # type: ignore[attr-defined]
        return unboxed(None, writing_back(writes))
    if found is not None:
        try:
            mutated[:] = _mutated_inputs(
                aot_rebuild.runtime_metadata(found.record), len(example_inputs)
            )
            return aot_rebuild.rebuild(
                found.record,
                example_inputs,
                aot_cache.load_aten_graph,
                lambda graph, kind: compile_aten_graph(
                    graph, fx_placeholder_vals(graph), kind=kind, aot=entry
                ),
            )
        except Exception as e:  # noqa: BLE001 - an entry this torch cannot rebuild: trace
            entry.unloadable(e)

    inference: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = []

    def compile_inference(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        mutated[:] = _mutated_inputs(_traced_metadata(), len(example_inputs))
        plan = _runtime_wrapper_plan(len(inputs), example_inputs)
        if plan is None:
            entry.not_stored("aot_autograd's runtime wrapper has work to do for it")
        elif (data := entry.serialize(graph)) is not None:
            entry.store("inference", (data, plan))
        # (the graph is stored as aot_autograd made it: a hit rewrites it the same way)
        writes = rewrite_writes(graph, plan) if plan else []
        compiled = compile_aten_graph(graph, inputs, kind="inference", aot=entry)
        unboxed = getattr(compiled, "unboxed", None)
        if unboxed is not None and plan is not None:
            inference.append(lambda first: unboxed(first, writing_back(writes)))
        return _in_aot_convention(compiled, writes)

    recorder = aot_rebuild.Recorder()

    def compile_training(kind: str) -> GraphCompiler:
        def compile(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
            if kind == "forward":
                mutated[:] = _mutated_inputs(_traced_metadata(), len(example_inputs))
            if kind == "forward" and entry.key is not None:
                recorder.training = True
                try:
                    recorder.forward = aot_cache.serialize_aten_graph(graph)
                except aot_cache.Uncacheable as e:
                    recorder.refuse(str(e))
            return compile_aten_graph(graph, inputs, kind=kind, aot=entry)

        return compile

    compiler = aot_autograd(
        fw_compiler=compile_training("forward"),
        bw_compiler=_under_compile_lock(compile_training("backward")),
        inference_compiler=compile_inference,
        decompositions=_tracing_decompositions(),
        # What the backward needs is chosen as inductor chooses it: cheap ops (views,
        # transposes, pointwise masks) are recomputed inside the backward's JAX
        # partition instead of being materialized and saved by the forward. Random
        # ops are never recomputed, so the backward reuses the forward's dropout mask.
        # An input mutated in place is never read by the backward
        # (_partition_without_reading_mutated_inputs).
        partition_fn=_partition_without_reading_mutated_inputs,
    )
    with _attention_as_math(example_inputs), aot_rebuild.recording(recorder if entry.key else None):
        wrapped = compiler(gm, example_inputs)
    if recorder.record is not None and entry.key is not None:
        entry.store("training", recorder.record)
    elif recorder.training:
        entry.not_stored(recorder.refusal or "aot_autograd's structures were not recorded")
    if len(inference) != 1:
        return wrapped
    return inference[0](wrapped)

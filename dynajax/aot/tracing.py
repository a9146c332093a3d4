"""The aot stage's traces of whole programs, for the callers that trace a program
themselves instead of handing Dynamo's graphs to aot_autograd (``train_step``'s trace,
``jax_function``'s gradients): ``functional_graph`` (``joint_graph``, below autograd,
then ``functionalized`` with the backend's decomposition table), and ``compiling``,
torch's compiling flag for the length of a trace.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._decomp
import torch.fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from dynajax.aot.table import decompositions, eager_aware, with_mixed_dtype_kernels
from dynajax.runtime.held import Held

aten = torch.ops.aten


# Ops that write their inputs without saying so in their schema, which functionalization
# would therefore not see: native_batch_norm's running statistics. ``functional_graph``
# decomposes them in its first trace (below autograd: a backward still reads the op
# whole), into ops whose writes are visible (``copy_`` into the statistics).
_UNANNOTATED_MUTATIONS = (aten.native_batch_norm.default,)

_PROFILER = (
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def functional_graph(fn: Callable[..., Any], examples: Sequence[Any]) -> torch.fx.GraphModule:
    """``fn`` on ``examples`` as one functional ATen graph, decomposed as the backend's:
    ``functionalized(joint_graph(fn, examples), examples)``."""
    return functionalized(joint_graph(fn, examples), examples)


def joint_graph(fn: Callable[..., Any], examples: Sequence[Any]) -> torch.fx.GraphModule:
    """``fn`` on ``examples`` as ``make_fx`` records it on fake tensors, below autograd:
    a ``torch.autograd.grad`` inside it records torch's own derivative formulas and the
    backward of each ``autograd.Function`` (as aot_autograd's joint graph does); in-place
    updates stay in place. Everything the user's Python computed is in this graph (its
    ops, their arguments, the tensor constants it read), which is why a whole-step
    program can be keyed by it."""
    table = with_mixed_dtype_kernels(
        {op: torch._decomp.decomposition_table[op] for op in _UNANNOTATED_MUTATIONS}
    )
    with compiling(), _quiet_fake_tensors():
        return make_fx(
            fn, decomposition_table=table, tracing_mode="fake", _allow_non_fake_inputs=True
        )(*examples)


def functionalized(joint: torch.fx.GraphModule, examples: Sequence[Any]) -> torch.fx.GraphModule:
    """``joint_graph``'s graph (traced on ``examples``) functionalized and traced again
    with ``decompositions()``: in-place updates of the inputs become values, which the
    traced function must return itself (functionalization's ``copy_`` back into an
    input, and the profiler's markers, are dropped)."""
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in examples]
    # Node meta preserved: each node of a decomposition records the op it came from
    # (original_aten), so a value check raises eager's error for the op the user called
    # (nll_loss's "Target 9 is out of bounds.", not its gather's). The module is torch's
    # lazy kind: its Python code is made where something reads or calls it, not at each
    # recompile (the whole-graph driver interprets the graph: 0.17 s a recompile for a
    # GPT-2 step of 8 layers).
    with torch.fx.traceback.preserve_node_meta(), _use_lazy_graph_module(True):
        gm = make_fx(
            torch.func.functionalize(joint, remove="mutations_and_views"),
            decomposition_table=eager_aware(decompositions()),
            tracing_mode="fake",
            _allow_non_fake_inputs=True,
        )(*plain)
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function":
            continue
        copy_back = node.target is aten.copy_.default and node.args[0].op == "placeholder"
        if (copy_back or node.target in _PROFILER) and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _silence_fake_tensor_log() -> Callable[[], None]:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    return lambda: logger.setLevel(level)


# FakeTensor's error log off: where an op fails on fake tensors it logs the traceback at
# ERROR level before raising, and the caller's own error (which names the op's message)
# is then the only thing the user should see.
_quiet_fake_tensors = Held(_silence_fake_tensor_log)


def _set_compiling_flag() -> Callable[[], None]:
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True

    def undo() -> None:
        torch.compiler._is_compiling_flag = old

    return undo


_compiling = Held(_set_compiling_flag)


def compiling() -> contextlib.AbstractContextManager[None]:
    """``torch.compiler.is_compiling()`` true for the length of the block, as during
    torch.export and torch.compile: model code takes its traceable paths (transformers'
    experts call its ``grouped_mm_fallback`` op, not ``torch._grouped_mm``, whose fake
    kernel takes bfloat16 only), and optimizers keep their step counts as tensors
    instead of reading them with ``.item()``. The one place dynajax sets the flag
    (``functional_graph``, ``train_step``'s trace).

    The flag is torch's, process-wide (not per thread), as it is under torch.compile:
    while a trace runs, another thread's eager code also reads ``is_compiling()`` as
    true. Blocks in several threads overlap safely: the first to enter sets it, the
    last to leave restores it (a Dynamo compile in another thread saves and restores
    it on its own). A torch without the flag: nothing is set."""
    if not hasattr(torch.compiler, "_is_compiling_flag"):
        return contextlib.nullcontext()
    return _compiling()

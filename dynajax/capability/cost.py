"""Ops kept in PyTorch because PyTorch's kernel is faster (``Reason.PERF``).

The capability stage asks ``faster_in_pytorch`` about a node only after it has found
that JAX can run it (a rule, its check and its abstract evaluation all agree), and only
where the backend's partitions run where the tensors are (``Options.perf_fallbacks``,
not with ``device`` or ``mesh``). Each entry is a measurement, not a guess, and names
it; the report prints the detail beside the node.

* ``_scaled_dot_product_flash_attention_for_cpu``, when kept whole by aot_autograd
  (``lowering.attention.whole``: at least 2^27 flops in its products). PyTorch's CPU
  kernel is a blocked (flash) attention over both cores that never writes the scores
  to memory; XLA runs the product, softmax, product chain with the (N, H, L, S) scores
  in memory and its batched products on one thread each. On the benchmark row
  ``attention-512`` (8 x 4 heads x 512 tokens x 64, causal; 2 cores) the attention
  alone took 10.8 ms in PyTorch and 32-42 ms in XLA, and the whole block 44.5 ms with
  the attention in JAX against 28.5 ms with it in PyTorch (``benchmarks.run``). Smaller
  attentions are decomposed into JAX ops: there, on GPT-2 (4 x 4 heads x 128 tokens),
  PyTorch's kernel between JAX partitions made the model slower (25.0 -> 36.3 ms).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from dynajax.lowering import attention

aten = torch.ops.aten


def _large_cpu_attention(node: torch.fx.Node) -> str | None:
    query, key = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[:2])
    dropout_p = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    if not isinstance(dropout_p, float | int) or not attention.whole(query, key, float(dropout_p)):
        return None
    return (
        "PyTorch's fused CPU attention kernel ran 3-4x faster than XLA's program for a "
        "large attention (dynajax/capability/cost.py); perf_fallbacks=False runs it in JAX"
    )


# op -> a function of the node: why PyTorch runs it faster, or None where it does not.
_FASTER_IN_PYTORCH: dict[torch._ops.OpOverload, Callable[[torch.fx.Node], str | None]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _large_cpu_attention,
}


def faster_in_pytorch(node: torch.fx.Node) -> str | None:
    """Why ``node``, which JAX can run, runs faster in PyTorch; None where it does not."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    measured = _FASTER_IN_PYTORCH.get(node.target)
    return measured(node) if measured is not None else None

"""Ops kept in PyTorch because PyTorch's kernel is faster (``Reason.PERF``).

The capability stage asks ``faster_in_pytorch`` about a node only after it has found
that JAX can run it (a rule, its check and its abstract evaluation all agree), and only
where the backend's partitions run where the tensors are (``Options.perf_fallbacks``,
not with ``device`` or ``mesh``). Each entry is a measurement, not a guess, and names
it; the report prints the detail beside the node.

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
* ``mode`` and ``kthvalue`` on CPU tensors. PyTorch's kernels select in place on each
  row; the rules sort the rows, and where values tie run PyTorch's own algorithms step
  by step to give its index (``lowering/eager_sorting.py``), a loop per step. Each op
  alone, compiled with ``perf_fallbacks=False`` against eager (ms; rows tied, 3 levels;
  2026-11-27, 2 cores): mode (64, 16) 0.139 and 0.007, (64, 64) 2.49 and 0.014, (8, 256)
  6.22 and 0.010, (64, 1000, 50 levels) 239 and 1.10; kthvalue at the middle (64, 16)
  0.408 and 0.008, (64, 64) 1.90 and 0.015, (64, 1000) 68.1 and 0.41.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from dynajax.lowering import attention

aten = torch.ops.aten


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


def faster_in_pytorch(node: torch.fx.Node) -> str | None:
    """Why ``node``, which JAX can run, runs faster in PyTorch; None where it does not."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    measured = _FASTER_IN_PYTORCH.get(node.target)
    return measured(node) if measured is not None else None

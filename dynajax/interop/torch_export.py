"""torch.export of a model for ``jax_function``, with the export-time decompositions.

``export(module_or_fn, example_args, dynamic_shapes)``: the model's ATen graph as
``jax_function`` lowers it (``interop/function.py``). A function becomes a module
(``_FunctionModule``); the exported program is decomposed with the backend's table
(``aot.table``, each entry stepping aside for dtypes eager's kernel refuses),
with ``scaled_dot_product_attention`` as eager's CPU dispatch lays its output out
(``_sdpa_as_exported``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from dynajax.aot.table import causal_math_attention, decompositions, eager_aware
from dynajax.errors import JaxFunctionError
from dynajax.interop import kv_caches as caches
from dynajax.lowering import attention

aten = torch.ops.aten


def _fused_cpu_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
) -> bool:
    """Whether eager's CPU dispatch runs ``scaled_dot_product_attention`` through its
    fused kernel (``_scaled_dot_product_flash_attention_for_cpu``) for these
    arguments: the conditions of ``use_flash_attention_cpp`` in PyTorch's
    ``sdp_utils_cpp``, else it runs the math kernel."""
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if query.device.type != "cpu" or dropout_p != 0.0:
        return False
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    if query.dtype not in dtypes or not (query.dtype == key.dtype == value.dtype):
        return False
    batch, heads, length, dim = query.shape
    if not (key.size(0) == value.size(0) == batch and key.size(1) == value.size(1)):
        return False
    if heads % key.size(1) != 0 or not (key.size(-1) == value.size(-1) == dim):
        return False
    if length == 0 or key.size(2) == 0:
        return False
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    if attn_mask is None:
        return True
    if attn_mask.size(-2) not in (length, 1) or attn_mask.size(-1) not in (key.size(2), 1):
        return False
    if attn_mask.dim() == 2:
        return True
    return (
        attn_mask.dim() == 4 and attn_mask.size(0) in (batch, 1) and attn_mask.size(1) in (heads, 1)
    )


def _sdpa_as_exported(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the output strides torch.export recorded.

    torch.export records the op whole, with the strides of the kernel eager's CPU
    dispatch picks (the fused kernel lays its output out as (batch, sequence, heads,
    dim); the math kernel's is contiguous), and later views of the output rely on
    them. ``run_decompositions`` then decomposes it through its CompositeImplicit
    kernel, which on fake tensors takes the math kernel and its strides, so a later
    ``view`` fails ("Cannot view a tensor with shape ..."; pytorch/pytorch#136543;
    GPT-2 and LLaMA of ``transformers`` hit it). Here the math kernel computes the
    values (PyTorch's decomposition of the fused kernel does the same) and, where eager
    picks the fused kernel (``_fused_cpu_kernel``), a copy gives them its layout, so
    every recorded view stays valid, and a causal one is masked as that kernel masks
    (``aot.causal_math_attention``); XLA sees the copy as a transpose pair. A boolean
    mask becomes the additive one the kernels take (0 where kept, -inf elsewhere, in
    the query's dtype), as the op's own kernel does before dispatching. A large fused
    one (``attention.whole``) stays the fused op, for its rule (the ``attention-512``
    block through ``jax_function``: 57.9 -> 32.9 ms per call).
    """
    fused = _fused_cpu_kernel(query, key, value, attn_mask, dropout_p)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), zero)
    grouped_ok = enable_gqa or query.size(1) == key.size(1)
    if fused and grouped_ok and attention.whole(query, key, dropout_p):
        # A large one stays the fused op (its output in the fused layout): its JAX rule
        # (lowering/attention.py) takes one head at a time, its scores in the CPU's
        # cache, where the math attention makes the whole batch's.
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    if fused and is_causal and attn_mask is None and dropout_p == 0.0:
        out = causal_math_attention(query, key, value, scale, enable_gqa=enable_gqa)[0]
    else:
        out = aten._scaled_dot_product_attention_math.default(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            None,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0]
    if fused:
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return out


@functools.cache
def export_decompositions() -> dict[Any, Callable[..., Any]]:
    """The backend's decomposition table (``dynajax.aot.table``, each entry
    keeping its op whole for dtypes eager refuses, as the backend's tracing does), plus
    the attention entry that ``run_decompositions`` needs (``_sdpa_as_exported``)."""
    return {
        **eager_aware(decompositions()),
        aten.scaled_dot_product_attention.default: _sdpa_as_exported,
    }


class _FunctionModule(nn.Module):
    """A plain function as a module, for torch.export (it has no state of its own:
    tensors it closes over become constants of the JAX function)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def export(
    module_or_fn: nn.Module | Callable[..., Any],
    example_args: tuple[Any, ...],
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """The core ATen ``ExportedProgram`` of a module (in its current mode) or function."""
    caches.register()
    module = module_or_fn if isinstance(module_or_fn, nn.Module) else _FunctionModule(module_or_fn)
    try:
        ep = torch.export.export(module, example_args, dynamic_shapes=dynamic_shapes, strict=False)
        return caches.run_decompositions(ep, export_decompositions())
    except _DATA_DEPENDENT as e:
        raise JaxFunctionError(
            "torch.export cannot trace the model: it reads a tensor's value as a number "
            f"({type(e).__name__}: {str(e).splitlines()[0]}). A JAX function is traced "
            "once for every value, so pass such a number as a Python int, or compute "
            "with the tensor (torch.where, index_select) instead of reading it."
        ) from e


# torch's errors for a size or a branch that depends on a tensor's value.
_DATA_DEPENDENT = (
    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode,
    torch.fx.experimental.symbolic_shapes.PendingUnbackedSymbolNotFound,
    torch._subclasses.fake_tensor.DataDependentOutputException,
)

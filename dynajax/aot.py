"""The aot stage: how aot_autograd turns Dynamo's graph into ATen graphs for dynajax.

aot_autograd functionalizes Dynamo's FX graph, decomposes it to ATen with the table
``decompositions()`` and, for training, splits it into forward and backward graphs;
each ATen graph then goes to ``Backend.compile_aten_graph``. Every decision about that
table lives here:

* PyTorch's core ATen decompositions are the base.
* ``CORRECTIONS`` replace entries that are wrong for us (see below).
* ``FUSED_KERNELS`` are taken out of the table, because our JAX rules reproduce the
  rounding of PyTorch's fused CPU kernels for them, which their decompositions miss
  (the rules and the measurements are in ``lowering/fused.py``).
* ``CHECKED_KERNELS`` are taken out of the table, because eager's kernel raises on
  argument values that their decompositions accept; their rules check the values
  (``lowering/checks.py``).
* ``MIXED_DTYPE_KERNELS``: a LayerNorm or BatchNorm of a float16/bfloat16 input with
  float32 weights (autocast's) is traced as the CPU kernel computes it, in float32 with
  float32 statistics, where the meta kernels say the input's dtype and the backward's
  kernel then refused the statistics (both drivers; applied below autograd).
* On a GPU, ``F.scaled_dot_product_attention`` is traced as PyTorch's math attention
  (``_attention_as_math``), not as the fused GPU kernel it would pick, which has no
  rule and no decomposition.
* An op whose eager CPU kernel refuses the call's dtypes (``softplus`` of int64) is
  not decomposed for that call (the decompositions would compute a value); the
  capability stage sends it to eager PyTorch, which raises.
* A large CPU flash attention (``attention.whole``) is not decomposed: PyTorch's kernel
  runs it (a PERF verdict, ``capability/cost.py``), or with ``perf_fallbacks=False``
  its rule, one head at a time in a loop per CPU (``lowering/attention.py``); smaller
  ones are decomposed.

The corrections:

``_scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_attention``
and ``nn.MultiheadAttention`` dispatch to on CPU) is decomposed into the math
attention, whose second output is the attention-weight matrix, not the logsumexp that
the op's autograd formula saves for ``_scaled_dot_product_flash_attention_for_cpu_backward``.
That backward op is not decomposed, so it reads the wrong tensor and returns wrong
query/key gradients (on ``nn.TransformerEncoderLayer`` the ``in_proj`` gradients come
out several times their true size; eager and ``aot_eager`` are right). The backward
here recomputes the attention from query, key and value instead, so it never reads
the saved output or logsumexp:

    before: ..._for_cpu_backward(grad, q, k, v, out, lse, 0.0, False)   # wrong lse
    after:  s = q @ k^T * scale (+ mask); p = softmax(s)
            grad_v = p^T @ grad;  dp = grad @ v^T;  ds = p * (dp - sum(dp * p))
            grad_q = ds @ k * scale;  grad_k = ds^T @ q * scale

``addcmul``'s decomposition refuses a float ``value`` when the result is an integer
(ValueError while tracing); eager's kernel casts it to the result type, and so does
the correction before calling the decomposition.

``smooth_l1_loss_backward``'s decomposition takes ``sign(x)`` outside ``|x| < beta``,
which is 0 for a NaN difference; eager's kernel tests ``x <= -beta`` and ``x >= beta``
and otherwise returns ``x / beta``, NaN for NaN. The correction follows the kernel.

``nll_loss_backward``'s (and ``nll_loss2d_backward``'s) decomposition multiplies a
one-hot of the targets by the incoming gradient, so a NaN gradient reaches every class;
eager's kernel writes only the targets' entries. The correction zeroes the others.

``huber_loss``'s decomposition promotes its input and target and returns the promoted
dtype; eager's kernel computes in the promoted dtype (bfloat16 too, with ``delta``
rounded to it; float16 in float32) but stores each element's loss in the input's dtype before
reducing (a bfloat16 input with a float32 target: bfloat16). The correction does what
the kernel does.

``gelu_backward`` with ``approximate="tanh"`` is written with ``sigmoid`` instead of
``tanh``, as the forward rule is (``lowering/nn.py``): ``1 + tanh(z)`` cancels for
negative inputs, and the gradient through XLA's ``tanh`` was 2.6% off at x = -4.38
where eager's is within 1e-4 of float64.

``torch.cholesky`` raises inside its kernel when its input is not positive definite;
it becomes ``linalg_cholesky_ex`` (a JAX rule) plus the effectful
``_linalg_check_errors``, which raises eager's own error on the host.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._decomp
import torch.fx
from torch._decomp import core_aten_decompositions
from torch._dynamo import convert_frame as _convert_frame
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import fx_placeholder_vals

from dynajax.capability.eager_kernel import eager_refusal
from dynajax.lowering import attention
from dynajax.passes.writes import Write, new_values, rewrite_writes, writing_back, written_outputs
from dynajax.runtime import aot_cache, aot_rebuild
from dynajax.runtime.held import Held
from dynajax.store import BlobStore

aten = torch.ops.aten

# Ops kept whole (not decomposed): PyTorch runs each as one CPU kernel whose rounding
# its decomposition misses, and lowering/fused.py has a rule that follows the kernel.
# Autograd still differentiates them with PyTorch's own formulas.
FUSED_KERNELS: tuple[torch._ops.OpOverload, ...] = (
    aten.addcdiv.default,
    aten.addr.default,
    aten.linalg_cross.default,
    aten.linspace.default,
    aten.linspace.Tensor_Tensor,
    aten.linspace.Tensor_Scalar,
    aten.linspace.Scalar_Tensor,
    aten.logspace.default,
    aten.logspace.Tensor_Tensor,
    aten.logspace.Tensor_Scalar,
    aten.logspace.Scalar_Tensor,
)


# Ops kept whole (not decomposed) because eager's kernel raises on argument values that
# the decomposition accepts, and the op's rule checks them (lowering/checks.py):
# bernoulli(p) decomposes to rand < p, which takes any p; eager requires 0 <= p <= 1.
CHECKED_KERNELS: tuple[torch._ops.OpOverload, ...] = (
    aten.bernoulli.default,
    aten.index_add.default,
)


# -- corrections ---------------------------------------------------------------------------


def _flash_attention_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(dropout_p == 0.0, lambda: f"dropout probability must be zero, got {dropout_p}")
    dtype = query.dtype
    # Half-precision inputs accumulate in float32, as the math attention does on CPU.
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v, g = (t.to(compute) for t in (query, key, value, grad_out))
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    groups = query.size(1) // key.size(1)  # grouped-query attention shares k/v heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.size(-2), s.size(-1), dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(compute)
    p = torch._safe_softmax(s, -1)  # a fully masked row: weights 0, as eager's kernel
    if is_causal:  # past the window: weights 0 even in a row with a NaN score
        p = torch.where(keep, p, 0.0)
    grad_v = torch.matmul(p.transpose(-2, -1), g)
    dp = torch.matmul(g, v.transpose(-2, -1))
    ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
    grad_q = torch.matmul(ds, k) * scale
    grad_k = torch.matmul(ds.transpose(-2, -1), q) * scale
    if groups > 1:
        grad_k = grad_k.unflatten(1, (key.size(1), groups)).sum(dim=2)
        grad_v = grad_v.unflatten(1, (key.size(1), groups)).sum(dim=2)
    return grad_q.to(dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


def _cholesky(a: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """``torch.cholesky`` as ``linalg_cholesky_ex`` (a JAX rule) plus the effectful
    ``_linalg_check_errors`` (run on the host after the partition): it raises eager's
    own error, message included, where a JAX rule for the whole op could only give NaN."""
    factor, info = aten.linalg_cholesky_ex.default(a, upper=upper)
    aten._linalg_check_errors.default(info, "cholesky", is_matrix=a.dim() == 2)
    return factor


def _take(self: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``take`` as one gather (PyTorch's decomposition indexes with ``index`` in
    Python, which reads a 0-d index as a number: a data-dependent ``item()`` that no
    trace of a whole program can hold)."""
    return aten.index.Tensor(self.reshape(-1), [index])


def _addcmul(
    self: torch.Tensor, tensor1: torch.Tensor, tensor2: torch.Tensor, *, value: Any = 1
) -> torch.Tensor:
    """PyTorch's decomposition of ``addcmul``, with ``value`` cast as eager's CPU kernel
    casts it: to the result's type, so a float value truncates for integers
    (``addcmul(1, 3, 5, value=0.5)`` is 1), where the decomposition raises ValueError."""
    if isinstance(value, float):
        _, dtype = elementwise_dtypes(
            self, tensor1, tensor2, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
        )
        if dtype == torch.bool:
            value = bool(value)
        elif not (dtype.is_floating_point or dtype.is_complex):
            value = math.trunc(value)
    return torch._refs.addcmul(self, tensor1, tensor2, value=value)


def _smooth_l1_loss_backward(
    grad_output: torch.Tensor,
    self: torch.Tensor,
    target: torch.Tensor,
    reduction: int,
    beta: float,
) -> torch.Tensor:
    """The gradient of ``smooth_l1_loss`` as eager's CPU kernel computes it: a NaN
    difference gives NaN (PyTorch's decomposition gives 0 there)."""
    dtype = self.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x = self.to(compute) - target.to(compute)
    norm = 1.0 / self.numel() if reduction == 1 else 1.0  # 1: Reduction.MEAN
    g = norm * grad_output.to(compute)
    inside = g * x / beta if beta != 0 else g * x
    grad = torch.where(x <= -beta, -g, torch.where(x >= beta, g, inside))
    return grad.to(dtype)


def _huber_loss(
    self: torch.Tensor, target: torch.Tensor, reduction: int = 1, delta: float = 1.0
) -> torch.Tensor:
    """``huber_loss`` as eager's CPU kernel computes it: each element's loss in the
    promoted dtype, every step rounded to it and ``delta`` too (bfloat16 computes in
    bfloat16, float16 in float32: measured against the kernel), stored in ``self``'s
    dtype, then reduced. PyTorch's decomposition returns the promoted dtype (a bfloat16
    input with a float32 target gave float32, eager bfloat16), computes half types in
    float32 and reduces before rounding."""
    torch._check(delta > 0, lambda: "huber_loss does not support non-positive values for delta.")
    compute = torch.promote_types(self.dtype, target.dtype)
    if compute == torch.float16:  # the kernel's float16 path computes in float32
        compute = torch.float32
    d = torch.scalar_tensor(delta, dtype=compute)
    z = (self.to(compute) - target.to(compute)).abs()
    loss = torch.where(z < d, 0.5 * z * z, d * (z - 0.5 * d)).to(self.dtype)
    if reduction == 1:  # Reduction.MEAN
        return loss.mean()
    if reduction == 2:  # Reduction.SUM
        return loss.sum()
    return loss


def _flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """PyTorch's decomposition of the fused CPU attention, except for the large ones
    (``attention.whole``): those stay whole (NotImplemented), for PyTorch's kernel (PERF)
    or the JAX rule (``lowering/attention.py``)."""
    if attention.whole(query, key, dropout_p):  # the op is CPU-only
        return NotImplemented
    if is_causal and attn_mask is None and dropout_p == 0.0:
        out, weights = causal_math_attention(
            query, key, value, scale, enable_gqa=query.size(1) != key.size(1)
        )
        # (the fused kernel's layout, as PyTorch's decomposition gives it)
        out = out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        return out, weights
    return _decomposition(aten._scaled_dot_product_flash_attention_for_cpu.default)(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )


def causal_math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    *,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's math attention with ``is_causal=True`` (``_scaled_dot_product_-
    attention_math``: its scaling, its float32 compute for float16/bfloat16, its safe
    softmax, op for op, so the same rounding), except that the scores past the causal
    window are set to -inf where the math kernel adds -inf to them. Eager's fused
    kernels never read those keys: a NaN or infinite key past a query's window leaves
    that query's row alone in eager, where ``nan + -inf`` made it NaN. Returns the
    output and the attention weights (the math kernel's second output)."""
    dtype = query.dtype
    upcast = dtype in (torch.float16, torch.bfloat16)
    reduced = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", lambda: False)
    if upcast and not reduced():
        query, key, value = (t.to(torch.float32) for t in (query, key, value))
    else:
        upcast = False
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    factor = math.sqrt(abs(scale))
    query = query * (-factor if scale < 0 else factor)
    if enable_gqa and query.size(-3) != key.size(-3):
        repeats = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1) * factor)
    length, source = query.size(-2), key.size(-2)
    window = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
    scores = torch.where(window, scores, float("-inf"))
    # weights past the window exactly 0, as never computed (a NaN score in the row
    # leaves them NaN in a softmax): the values' gradient there is 0, as eager's
    weights = torch.where(window, torch._safe_softmax(scores, -1), 0.0)
    out = torch.matmul(weights, value)
    if upcast:
        return out.to(dtype), weights.to(dtype)
    return out, weights


def _gelu_backward(
    grad_output: torch.Tensor, self: torch.Tensor, *, approximate: str = "none"
) -> torch.Tensor:
    """The gradient of ``gelu``; for ``approximate="tanh"`` without cancellation: with
    ``s = sigmoid(2z)`` (``0.5 * (1 + tanh(z))``) and ``1 - s = sigmoid(-2z)``, the
    derivative of ``x * s`` is ``s + 2x * s * (1 - s) * dz/dx``."""
    if approximate != "tanh":
        return _decomposition(aten.gelu_backward.default)(
            grad_output, self, approximate=approximate
        )
    dtype = self.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, g = self.to(compute), grad_output.to(compute)
    k, c = math.sqrt(2 / math.pi), 0.044715
    z = k * (x + c * x * x * x)
    s, rest = torch.sigmoid(2 * z), torch.sigmoid(-2 * z)
    dz = k * (1 + 3 * c * x * x)
    return (g * (s + 2 * x * s * rest * dz)).to(dtype)


def _nll_loss_forward(
    self: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's decomposition of ``nll_loss_forward``, with eager's sign of a zero loss
    for a 1-D input (one sample, no batch dim) and ``reduction="none"``: eager's kernel
    accumulates that loss from zero (``0 - x[t] * w``), so a zero loss is +0 where the
    decomposition's ``-(x[t] * w)`` gives -0 (``y / cross_entropy(x, t,
    reduction="none")`` of a single class was +inf in eager, -inf here)."""
    output, total_weight = _decomposition(aten.nll_loss_forward.default)(
        self, target, weight, reduction, ignore_index
    )
    if self.dim() == 1 and reduction == 0:  # 0: Reduction.NONE
        output = torch.where(output == 0, 0.0, output)
    return output, total_weight


def _nll_loss_backward_of(op: Any) -> Callable[..., Any]:
    """PyTorch's decomposition of ``op`` (``nll_loss_backward`` or its 2-D form), which
    multiplies a one-hot of the targets by the incoming gradient, with eager's zeros
    off the targets: eager's kernel writes ``-w * grad`` at each sample's target and
    leaves the rest 0, so a NaN or infinite gradient (``sqrt`` of a negative loss)
    would reach every class where eager's is NaN at the targets only. The
    decomposition's scatter stays, and with it the targets' check."""

    def backward(
        grad_output: torch.Tensor,
        self: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        reduction: int,
        ignore_index: int,
        total_weight: torch.Tensor,
    ) -> torch.Tensor:
        grad_input = _decomposition(op)(
            grad_output, self, target, weight, reduction, ignore_index, total_weight
        )
        channel_dim = 0 if self.dim() < 2 else 1
        if self.dim() == 1 and target.dim() > 0:  # the kernel reads target[0] only
            target = target[0]
        target = target.unsqueeze(channel_dim)
        shape = [-1 if d == channel_dim else 1 for d in range(self.dim())]
        classes = torch.arange(self.shape[channel_dim], device=self.device).reshape(shape)
        written = (target == classes) & (target != ignore_index)
        return torch.where(written, grad_input, 0.0)

    return backward


_nll_loss_backward = _nll_loss_backward_of(aten.nll_loss_backward.default)
_nll_loss2d_backward = _nll_loss_backward_of(aten.nll_loss2d_backward.default)


def _mixed(x: torch.Tensor, params: Sequence[Any]) -> bool:
    """Whether a norm's call is autocast's mixed one: a float16/bfloat16 input, and its
    tensor parameters (at least one) all float32."""
    tensors = [t for t in params if isinstance(t, torch.Tensor)]
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and bool(tensors)
        and all(t.dtype == torch.float32 for t in tensors)
    )


def _mixed_layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> Any:
    """``native_layer_norm`` of a float16/bfloat16 input with float32 weights (what
    autocast makes of a LayerNorm): the CPU kernel computes in float32 and returns
    float32 mean and rstd, where its meta kernel says the input's dtype; the backward
    then saw those dtypes, which its kernel refuses ("expected scalar type Float but
    found BFloat16"), and the statistics were rounded. As the kernel: in float32, the
    output cast back. Any other call is traced whole (NotImplemented)."""
    if not _mixed(x, (weight, bias)):
        return NotImplemented
    out, mean, rstd = aten.native_layer_norm.default(
        x.to(torch.float32), normalized_shape, weight, bias, eps
    )
    return out.to(x.dtype), mean, rstd


def _mixed_batch_norm(op: Any) -> Callable[..., Any]:
    """``op`` (a batch norm) of a float16/bfloat16 input with float32 weights, as the
    CPU kernel computes it: in float32, with float32 saved statistics (its meta kernel
    says the input's dtype, which the backward's kernel refuses: "mixed dtype (CPU):
    expect parameter to have scalar type of Float"); the output cast back."""

    def mixed(x: torch.Tensor, weight: Any, bias: Any, *rest: Any) -> Any:
        # The affine parameters and the running statistics (affine=False still has them).
        if not _mixed(x, (weight, bias, *rest[:2])):
            return NotImplemented
        out, *others = op(x.to(torch.float32), weight, bias, *rest)
        return (out.to(x.dtype), *others)

    return mixed


# Applied below autograd (the joint trace of aot_autograd and of ``functional_graph``),
# so that the backward is derived from what eager's kernel computes; each returns
# NotImplemented for any other call (traced whole, or by the table's own entry).
MIXED_DTYPE_KERNELS: dict[Any, Callable[..., Any]] = {
    aten.native_layer_norm.default: _mixed_layer_norm,
    aten.native_batch_norm.default: _mixed_batch_norm(aten.native_batch_norm.default),
    aten._native_batch_norm_legit_functional.default: _mixed_batch_norm(
        aten._native_batch_norm_legit_functional.default
    ),
}


def with_mixed_dtype_kernels(table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``table`` with ``MIXED_DTYPE_KERNELS`` first where they apply (its own entry, or
    the op whole, elsewhere)."""
    for op, mixed in MIXED_DTYPE_KERNELS.items():
        whole = table.get(op)
        table[op] = mixed if whole is None else _first_of(mixed, whole)
    return table


def corrections() -> dict[Any, Callable[..., Any]]:
    """Entries that replace or extend PyTorch's core ATen decompositions."""
    table: dict[Any, Callable[..., Any]] = {
        aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
            _flash_attention_for_cpu_backward
        ),
        aten.addcmul.default: _addcmul,
        aten.take.default: _take,
        aten.smooth_l1_loss_backward.default: _smooth_l1_loss_backward,
        aten.huber_loss.default: _huber_loss,
        aten.gelu_backward.default: _gelu_backward,
        aten.nll_loss_forward.default: _nll_loss_forward,
        aten.nll_loss_backward.default: _nll_loss_backward,
        aten.nll_loss2d_backward.default: _nll_loss2d_backward,
    }
    if hasattr(aten, "cholesky"):  # removed in torch 2.14 (torch.cholesky is deprecated)
        table[aten.cholesky.default] = _cholesky
    return table


# -- the table and the compiler ------------------------------------------------------------


@functools.cache
def decompositions() -> dict[Any, Callable[..., Any]]:
    """aot_autograd's decomposition table: PyTorch's core ATen decompositions with
    ``corrections()``, less ``FUSED_KERNELS`` and ``CHECKED_KERNELS``."""
    return _ours({**core_aten_decompositions(), **corrections()})


def _ours(table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``table`` less ``FUSED_KERNELS`` and ``CHECKED_KERNELS``, with
    ``MIXED_DTYPE_KERNELS`` first where they apply."""
    for op in (*FUSED_KERNELS, *CHECKED_KERNELS):
        table.pop(op, None)
    return with_mixed_dtype_kernels(table)


def _first_of(first: Callable[..., Any], then: Callable[..., Any]) -> Callable[..., Any]:
    """A table entry: ``first``, or ``then`` where ``first`` returns NotImplemented."""

    @functools.wraps(first)
    def entry(*args: Any, **kwargs: Any) -> Any:
        out = first(*args, **kwargs)
        return then(*args, **kwargs) if out is NotImplemented else out

    return entry


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
    # (nll_loss's "Target 9 is out of bounds.", not its gather's).
    with torch.fx.traceback.preserve_node_meta():
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


def eager_aware(table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``table`` with each entry stepping aside (``_unless_eager_refuses``) for the
    dtypes its op's eager kernel refuses: such an op stays whole, and the capability
    stage sends it to eager PyTorch, which raises eager's error."""
    return {op: _unless_eager_refuses(op, fn) for op, fn in table.items()}


def _unless_eager_refuses(op: Any, decompose: Callable[..., Any]) -> Callable[..., Any]:
    """``decompose``, except where eager's CPU kernel of ``op`` refuses the dtypes.

    A decomposition computes a value for dtypes the kernel refuses (softplus of int64
    becomes exp and log1p, which take it); kept whole, the op reaches the capability
    stage, which sends it to eager PyTorch to raise eager's error (EAGER_REFUSES).
    NotImplemented from a table entry makes make_fx trace the op whole."""

    @functools.wraps(decompose)
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        if eager_refusal(op, args, kwargs) is not None:
            return NotImplemented
        return decompose(*args, **kwargs)

    return decomposition


@functools.cache
def _post_autograd_decompositions() -> dict[Any, Callable[..., Any]]:
    """PyTorch's core ATen decompositions less those of CompositeImplicitAutograd ops.

    ``core_aten_decompositions()`` adds an entry for every CompositeImplicitAutograd op
    of every namespace, which costs every process 0.1 s to enumerate (most of
    aot_autograd's time on a small graph). aot_autograd's tracing never needs them: the
    dispatcher decomposes such an op before the tracer sees it, and the tracer
    decomposes any that reaches it (``OpOverload.decompose``) with or without an entry
    (``tests/test_aot.py`` checks both, graph for graph)."""
    try:
        from torch._decomp import _core_aten_decompositions_post_autograd
    except ImportError:  # (a torch release without it: the whole table)
        return dict(core_aten_decompositions())
    return dict(_core_aten_decompositions_post_autograd())


def _decomposition(op: Any) -> Callable[..., Any]:
    """PyTorch's own decomposition of ``op`` (for the corrections that fall back to it)."""
    return _post_autograd_decompositions()[op]


@functools.cache
def _tracing_decompositions() -> dict[Any, Callable[..., Any]]:
    """The table aot_autograd traces with: ``decompositions()`` less the entries of
    CompositeImplicitAutograd ops (``_post_autograd_decompositions``), each entry
    stepping aside for the dtypes its op's eager kernel refuses
    (``_unless_eager_refuses``)."""
    return eager_aware(_ours({**_post_autograd_decompositions(), **corrections()}))


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
    ``cache`` (``runtime/aot_cache.py``: loaded, traced and stored, or why not).

    For an inference graph whose runtime wrapper would do nothing but write new data
    into inputs (``_runtime_wrapper_plan``), Dynamo gets the compiled graph's own
    unboxed callable (``unboxed`` of ``stitched_callable``'s result), with those writes
    (``passes/writes.py``), instead of aot_autograd's wrapper chain; its first call still
    goes through the chain, which checks custom ops' aliasing on first calls. Such a
    graph is stored in ``cache``, and a later process loads it instead of running
    aot_autograd (a graph with custom ops, which that check is for, is not stored).

    A training graph is stored with the structures ``runtime/aot_rebuild.py`` records
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

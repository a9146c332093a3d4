"""The aot stage's decomposition table: the one aot_autograd traces with, and its
corrections.

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
  (``_attention_as_math``, in ``compile.py``), not as the fused GPU kernel it would
  pick, which has no rule and no decomposition.
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

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch._decomp
from torch._decomp import core_aten_decompositions
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from dynajax.capability.eager_kernel import eager_refusal
from dynajax.lowering import attention

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


# Eager's hardsigmoid backward multiplies by a float constant, 1/6 rounded to float32
# (``one_sixth(1.0f / 6.0f)`` in its CPU and CUDA kernels), in every dtype: a float64
# gradient is 1.5e-8 relative from the decomposition's double 1/6.
_ONE_SIXTH_FLOAT = float(np.float32(1.0 / 6.0))


def _hardsigmoid_backward(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """The gradient of ``hardsigmoid`` as eager's kernels compute it: the slope is 1/6
    rounded to float32 (``_ONE_SIXTH_FLOAT``); half-precision inputs in float32."""
    dtype = self.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, g = self.to(compute), grad_output.to(compute)
    return torch.where((x > -3.0) & (x < 3.0), g * _ONE_SIXTH_FLOAT, 0.0).to(dtype)


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
        aten.hardsigmoid_backward.default: _hardsigmoid_backward,
        aten.nll_loss_forward.default: _nll_loss_forward,
        aten.nll_loss_backward.default: _nll_loss_backward,
        aten.nll_loss2d_backward.default: _nll_loss2d_backward,
    }
    if hasattr(aten, "cholesky"):  # removed in torch 2.14 (torch.cholesky is deprecated)
        table[aten.cholesky.default] = _cholesky
    return table


# -- the table -----------------------------------------------------------------------------


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

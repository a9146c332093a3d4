"""The fused CPU attention's rule (``dynajax/lowering/attention.py``): its outputs are
eager's kernel's (the attention and each row's log-sum-exp), large attentions reach it
whole through the backend and small ones are decomposed as before, and gradients
through a whole one are eager's. Where the partitions run where the tensors are, a
large one runs in PyTorch's kernel instead (``perf_fallbacks``, reason PERF:
``dynajax/capability/cost.py``); with ``perf_fallbacks=False`` or a ``device``, in JAX.

    pytest -q tests/lowering/test_attention.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dynajax
from dynajax.capability import Reason
from dynajax.lowering import attention
from dynajax.lowering.registry import get_rule
from tests.helpers import measured_faster
from tests.tolerances import assert_same

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def _masked_rows(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An additive mask (as SDPA hands the kernel a boolean one) with one fully masked
    query row and some masked keys elsewhere."""
    mask = torch.where(torch.rand(shape) > 0.3, 0.0, float("-inf")).to(dtype)
    mask[..., 0] = 0.0
    mask[..., 1, :] = float("-inf")  # every key of query 1 masked
    return mask


CASES = {  # id -> (q shape, k/v shape, is_causal, mask kind, scale)
    "full": ((2, 3, 6, 8), (2, 3, 6, 8), False, None, None),
    "causal": ((2, 3, 6, 8), (2, 3, 6, 8), True, None, None),
    "causal-fewer-queries": ((2, 3, 4, 8), (2, 3, 6, 8), True, None, 0.3),
    "float-mask": ((2, 3, 6, 8), (2, 3, 6, 8), False, "float", None),
    "masked-row": ((3, 2, 5, 8), (3, 2, 7, 8), False, "rows", 0.5),
    "masked-row-per-batch": ((3, 2, 5, 8), (3, 2, 7, 8), False, "rows-batch", None),
    "grouped-queries": ((2, 4, 5, 8), (2, 2, 6, 8), True, None, None),
    # Causal, in blocks of attention.CAUSAL_BLOCK queries (each over the keys it sees).
    "causal-blocks": ((2, 2, 300, 8), (2, 2, 300, 8), True, None, None),
    "causal-blocks-fewer-keys": ((2, 2, 300, 8), (2, 2, 260, 8), True, "rows", None),
    "causal-blocks-more-keys": ((1, 2, 260, 8), (1, 2, 400, 8), True, "float", 0.3),
    "causal-blocks-key-mask": ((2, 2, 300, 8), (2, 2, 300, 8), True, "keys", None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["rule", "batched"])
def test_rule_matches_the_eager_kernel(case: str, dtype: torch.dtype, path: str) -> None:
    """``rule``: the registered rule (on this CPU, its per-head loops); ``batched``: the
    program it runs on other platforms, called directly."""
    q_shape, kv_shape, causal, mask_kind, scale = CASES[case]
    torch.manual_seed(0)
    q = torch.randn(q_shape, dtype=dtype)
    k, v = torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(q_shape[-2], kv_shape[-2], dtype=dtype)
    elif mask_kind == "rows":
        mask = _masked_rows((1, 1, q_shape[-2], kv_shape[-2]), dtype)
    elif mask_kind == "rows-batch":
        mask = _masked_rows((q_shape[0], 1, q_shape[-2], kv_shape[-2]), dtype)
    elif mask_kind == "keys":  # one row per batch element, broadcast over the queries
        mask = torch.where(torch.rand(q_shape[0], 1, 1, kv_shape[-2]) > 0.3, 0.0, -torch.inf)
        mask = mask.to(dtype)
        mask[..., 0] = 0.0
    out, lse = FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    with jax.enable_x64(True):
        arrays = [jnp.asarray(t.numpy()) for t in (q, k, v)]
        jax_mask = None if mask is None else jnp.asarray(mask.numpy())
        if path == "rule":
            ours = get_rule(FLASH).fn(*arrays, 0.0, causal, attn_mask=jax_mask, scale=scale)
        else:
            ours = attention._batched(*arrays, jax_mask, causal, scale or 1 / np.sqrt(q_shape[-1]))
        ours = [torch.from_numpy(np.array(a)) for a in ours]
    assert_same(ours[0], out)
    assert_same(ours[1], lse)


def _whole_in_jax(backend: dynajax.Backend) -> bool:
    """Whether a JAX partition of the backend's graphs runs the fused op whole, by its
    rule (not PyTorch's kernel inside the partition)."""
    name = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    in_partitions = sum(p.ops.get(name, 0) for g in backend.graphs for p in g.partitions)
    as_kernels = sum(str(k.target) == name for g in backend.graphs for k in g.kernels)
    return in_partitions > as_kernels


class _Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, e // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=self.causal,
        )
        return self.out(o.transpose(1, 2).reshape(b, t, e))


def _attention_in_pytorch(backend: dynajax.Backend) -> list[str]:
    """The reasons the backend's graphs give for the fused op run by PyTorch's kernel
    (inside its partition, or between partitions)."""
    name = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    report = dynajax.Report(list(backend.graphs))
    in_pytorch = [*report.kernels, *report.fallbacks]
    return [f.reason.name for f in in_pytorch if str(f.target) == name]


@pytest.mark.parametrize(
    "tokens, causal, masked, whole",
    [(512, True, False, True), (512, False, True, True), (16, True, False, False)],
    ids=["large-causal", "large-masked", "small-decomposed"],
)
@pytest.mark.parametrize(
    "options",
    [{}, {"perf_fallbacks": False}, {"device": "cpu:0"}],
    ids=["default", "perf-off", "device"],
)
def test_backend_keeps_large_attention_whole(tokens, causal, masked, whole, options) -> None:
    torch.manual_seed(0)
    model = _Attention(128, 2, causal).eval()
    x = torch.randn(2, tokens, 128)
    mask = None
    if masked:  # a boolean mask with query 3 fully masked: its output row is the bias
        mask = torch.rand(tokens, tokens) > 0.2
        mask[:, 0] = True
        mask[3] = False
    # 4 * N * H * L * S * E flops against the threshold
    assert (4 * 2 * 2 * tokens * tokens * 64 >= attention.WHOLE_FLOPS) == whole
    backend = dynajax.Backend(**options)
    with torch.no_grad(), measured_faster("pytorch"):  # (this machine's times vary)
        expected = model(x, mask)
        actual = torch.compile(model, backend=backend)(x, mask)
    assert_same(actual, expected)
    # Large: PyTorch's kernel by default (PERF), the JAX rule when asked for JAX.
    in_pytorch = whole and not options
    report = dynajax.Report(list(backend.graphs))
    assert _attention_in_pytorch(backend) == (["PERF"] if in_pytorch else []), report
    assert all(f.reason is Reason.PERF for f in report.fallbacks), report
    assert _whole_in_jax(backend) == (whole and not in_pytorch), report


def test_strict_mode_accepts_perf_verdicts() -> None:
    """PERF is dynajax's choice, not a gap: strict mode compiles the model."""
    model = _Attention(128, 2, True).eval()
    x = torch.randn(2, 512, 128)
    backend = dynajax.Backend(strict=True)
    with torch.no_grad(), measured_faster("pytorch"):
        assert_same(torch.compile(model, backend=backend)(x), model(x))
    assert _attention_in_pytorch(backend) == ["PERF"]


@pytest.mark.parametrize("perf_fallbacks", [True, False], ids=["perf", "perf-off"])
def test_gradients_through_a_whole_attention(perf_fallbacks) -> None:
    torch.manual_seed(0)
    model = _Attention(128, 2, True)
    x = torch.randn(2, 512, 128, requires_grad=True)
    twin = _Attention(128, 2, True)
    twin.load_state_dict(model.state_dict())
    x_twin = x.detach().clone().requires_grad_(True)
    backend = dynajax.Backend(perf_fallbacks=perf_fallbacks)
    compiled = torch.compile(model, backend=backend)
    with measured_faster("pytorch"):
        compiled(x).square().mean().backward()
    twin(x_twin).square().mean().backward()
    # The forward's attention in PyTorch's kernel, or whole in JAX; the backward
    # recomputes it in JAX (aot/table.py's correction) either way.
    assert _whole_in_jax(backend) != perf_fallbacks
    assert _attention_in_pytorch(backend) == (["PERF"] if perf_fallbacks else [])
    assert_same(x.grad, x_twin.grad)
    for (name, p), p_twin in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert_same(p.grad, p_twin.grad, path=name)


@pytest.mark.parametrize(
    "width, tokens, perf_fallbacks, in_pytorch",
    [(128, 64, True, True), (128, 64, False, False), (32, 10, True, False)],
    ids=["large", "large-perf-off", "small"],
)
def test_fused_encoder_layer_by_size(width, tokens, perf_fallbacks, in_pytorch) -> None:
    """``nn.TransformerEncoderLayer``'s fused fast path (eval, no_grad) is one op: a
    large one runs in PyTorch's kernel (PERF), a small one or perf_fallbacks=False in
    JAX; the answer is eager's either way. These are the defaults by size: measuring
    (``tests/capability/test_cost.py``) off."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True).eval()
    x = torch.randn(8, tokens, width)
    backend = dynajax.Backend(perf_fallbacks=perf_fallbacks, measure_costs=False)
    with torch.no_grad():
        assert_same(torch.compile(layer, backend=backend)(x), layer(x), model=True)
    report = dynajax.Report(list(backend.graphs))
    name = "aten._transformer_encoder_layer_fwd.default"
    kept = [f.reason for f in report.fallbacks if str(f.target) == name]
    assert kept == ([Reason.PERF] if in_pytorch else []), report
    assert any(name in p.ops for p in report.partitions) != in_pytorch, report


@pytest.mark.parametrize("tokens, whole", [(512, True), (16, False)], ids=["large", "small"])
def test_jax_function_runs_a_large_attention_by_the_rule(tokens, whole) -> None:
    """``dynajax.jax_function``: a large fused attention stays whole in the exported
    graph (the rule runs it), a small one is the math attention; outputs and gradients
    under ``jax.grad`` are eager's either way."""
    torch.manual_seed(0)
    model = _Attention(128, 2, True).eval()
    x = torch.randn(2, tokens, 128)
    fn, state = dynajax.jax_function(model, x)
    graph_ops = {str(n.target) for n in fn.graph_module.graph.nodes}
    assert (str(FLASH) in graph_ops) == whole, graph_ops

    def loss(params, inputs):
        return jnp.mean(fn(params, inputs) ** 2)

    out = jax.jit(fn)(state, x.numpy())
    grads, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x.numpy())
    x_eager = x.clone().requires_grad_(True)
    expected = model(x_eager)
    expected.square().mean().backward()
    assert_same(torch.from_numpy(np.asarray(out)), expected.detach())
    assert_same(torch.from_numpy(np.asarray(grad_x)), x_eager.grad, path="grad[x]")
    for name, p in model.named_parameters():
        assert_same(torch.from_numpy(np.asarray(grads[name])), p.grad, path=f"grad[{name}]")

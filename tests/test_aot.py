"""The aot stage's decomposition policy (dynajax/aot/), in one place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd

import dynajax
from dynajax.aot.compile import _attention_as_math, on_accelerator
from dynajax.aot.table import (
    CHECKED_KERNELS,
    FUSED_KERNELS,
    MIXED_DTYPE_KERNELS,
    _tracing_decompositions,
    _unless_eager_refuses,
    corrections,
    decompositions,
)


def test_fused_kernels_are_kept_whole_and_have_rules() -> None:
    table = decompositions()
    for op in FUSED_KERNELS:
        assert op not in table, f"{op} is decomposed, so its rule in lowering/fused.py is dead"
        assert op in dynajax.supported_ops(), f"{op} is kept whole but has no JAX rule"


def test_checked_kernels_are_kept_whole_and_have_rules() -> None:
    table = decompositions()
    for op in CHECKED_KERNELS:
        assert op not in table, f"{op} is decomposed, so its rule's value check is dead"
        assert op in dynajax.supported_ops(), f"{op} is kept whole but has no JAX rule"


def test_corrections_replace_core_decompositions() -> None:
    # Built afresh: torch registers more decompositions as its modules are imported.
    decompositions.cache_clear()
    table = decompositions()
    core = core_aten_decompositions()
    fixes = corrections()
    for op, fn in fixes.items():
        assert table[op] is fn
    # Everything else is PyTorch's own table, and the mixed-dtype kernels' entries.
    kept = set(FUSED_KERNELS) | set(CHECKED_KERNELS)
    assert set(table) == (set(core) | set(fixes)) - kept | set(MIXED_DTYPE_KERNELS)


def _is_composite_implicit(op) -> bool:
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) or (
        key in getattr(op, "py_kernels", {})
    )


def test_tracing_table_leaves_out_only_composite_implicit_ops() -> None:
    # The table aot_autograd traces with is decompositions() less entries that the
    # dispatcher or the tracer apply anyway (CompositeImplicitAutograd kernels).
    full = decompositions()
    tracing = _tracing_decompositions()
    assert set(tracing) <= set(full)
    left_out = set(full) - set(tracing)
    assert left_out, "nothing left out: the cheap table is the whole table"
    assert all(_is_composite_implicit(op) for op in left_out), [
        op for op in left_out if not _is_composite_implicit(op)
    ][:5]


def _composites(x: torch.Tensor) -> torch.Tensor:
    # interpolate (nearest: an op whose CompositeImplicitAutograd kernel is Python's),
    # layer_norm, einsum, linalg.norm, std, flatten: composite ops of both kinds
    y = F.interpolate(x, scale_factor=2, mode="nearest")
    y = F.interpolate(y, size=(5, 7), mode="bilinear") + F.interpolate(y, size=(5, 7))
    z = F.layer_norm(y, (7,)).flatten(2)
    return torch.einsum("bcn,bdn->bcd", z, z) + torch.linalg.norm(z) + z.std()


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_tracing_table_traces_the_graphs_of_the_whole_table(train) -> None:
    def traced(table):
        graphs = []

        def keep(gm, _):
            graphs.append(gm.code)
            return gm.forward

        torch._dynamo.reset()
        backend = aot_autograd(
            fw_compiler=keep, bw_compiler=keep, inference_compiler=keep, decompositions=table
        )
        x = torch.randn(2, 3, 4, 4, requires_grad=train)
        out = torch.compile(_composites, backend=backend)(x)
        if train:
            out.sum().backward()
        return graphs

    full = {op: _unless_eager_refuses(op, fn) for op, fn in decompositions().items()}
    assert traced(_tracing_decompositions()) == traced(full)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)


@pytest.mark.parametrize("as_on_a_gpu", [False, True])
def test_attention_on_an_accelerator_is_traced_as_math(monkeypatch, as_on_a_gpu) -> None:
    """On a GPU, scaled_dot_product_attention would be traced as the fused kernel it
    picks there (no rule, no decomposition: an eager fallback); dynajax traces the math
    attention instead. CI has no GPU: the same choice, made on the CPU, runs in one JAX
    partition, with eager's forward and gradients."""
    monkeypatch.setattr("dynajax.aot.compile.on_accelerator", lambda inputs: as_on_a_gpu)
    torch.manual_seed(0)
    model, x = _Attention(), torch.randn(2, 8, 32)
    backend = dynajax.Backend()
    got = torch.compile(model, backend=backend)(x)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model(x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    report = dynajax.Report(backend.graphs)
    assert not report.fallbacks
    assert [len(g.partitions) for g in report.graphs] == [1, 1]


def test_math_attention_only_for_accelerator_graphs() -> None:
    """The restriction applies while tracing a graph of GPU tensors (fake ones here:
    CI has no GPU), never to a CPU graph, and is lifted afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_gpu = [torch.empty(2, 3, device="cuda"), 4]
    cpu = [torch.empty(2, 3), 4]
    assert on_accelerator(on_gpu) and not on_accelerator(cpu)
    backends = torch.backends.cuda
    with _attention_as_math(on_gpu):
        assert backends.math_sdp_enabled() and not backends.flash_sdp_enabled()
        assert not backends.mem_efficient_sdp_enabled() and not backends.cudnn_sdp_enabled()
    assert backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled()
    with _attention_as_math(cpu):
        assert backends.flash_sdp_enabled()


def _autocast_layer_norm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float().square().mean()


@pytest.mark.parametrize(
    "norm",
    [
        torch.nn.LayerNorm,
        torch.nn.BatchNorm1d,
        # No weights, float32 running statistics (the training fuzzer's seed 1, run 226).
        lambda n: torch.nn.BatchNorm1d(n, affine=False),
    ],
    ids=["layer", "batch", "batch-not-affine"],
)
def test_a_bfloat16_autocast_norm_trains_as_eager(norm) -> None:
    # A norm of a bfloat16 input with float32 weights: the CPU kernel's statistics are
    # float32 where its meta kernel says bfloat16, and the backward refused those
    # ("expected scalar type Float but found BFloat16"; MIXED_DTYPE_KERNELS).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), norm(8), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    compiled = torch.compile(
        lambda x: _autocast_layer_norm_loss(model, x), backend="dynajax", fullgraph=True
    )
    loss = compiled(x)
    loss.backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = _autocast_layer_norm_loss(model, x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for mine, p in zip(ours, model.parameters(), strict=True):
        # bfloat16 matmuls: the gradients agree to bfloat16's precision.
        torch.testing.assert_close(mine, p.grad, rtol=1e-2, atol=1e-2)


def test_the_compiling_flag_survives_overlapping_blocks_in_two_threads() -> None:
    """The first block to enter sets torch's process-wide flag, the last to leave
    restores it: with a save/restore per block, thread A leaving first would clear it
    under B, and B would then restore A's True for good."""
    import threading

    from dynajax.aot.tracing import compiling

    assert not torch.compiler.is_compiling()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def a() -> None:
        with compiling():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with compiling():
            b_in.set()
            a_out.wait(5)
            seen.append(torch.compiler.is_compiling())  # A has left, B is still in

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [True]
    assert not torch.compiler.is_compiling()

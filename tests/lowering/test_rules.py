"""Rule-by-rule conformance: each case compiles one small function with dynajax,
compares it with eager PyTorch (``tests.tolerances.assert_same``), and checks that the
op under test really ran in a JAX partition (no fallback, op present in a partition).

Cases with ``grad=True`` also run a backward pass and compare the input gradients, so
the backward ops of training graphs (convolution_backward, pooling backwards, ...) are
exercised through aot_autograd exactly as a training step reaches them.

    pytest -q tests/lowering/test_rules.py -k sort
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import pytest
import torch
import torch.nn.functional as F

import dynajax
from dynajax.lowering.interpreter import jax_literal
from dynajax.lowering.registry import get_rule
from dynajax.runtime.conversion import to_jax, to_torch
from tests.helpers import Case, case_params, measured_faster, randn, run_case
from tests.tolerances import assert_same

NAN = float("nan")


def with_nan(t, *where):
    t = t.clone()
    for idx in where:
        t[idx] = NAN
    return t


def distinct(*shape, dtype=torch.float32):
    """A random permutation of 0..n-1 (no ties, so indices are unambiguous)."""
    n = 1
    for s in shape:
        n *= s
    return torch.randperm(n).reshape(shape).to(dtype)


def ints(lo, hi, *shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, dtype=dtype)


# ---------------------------------------------------------------------------------
# Sorting and selection
# ---------------------------------------------------------------------------------

SORTING = [
    Case(
        "sort-float32",
        lambda x: torch.sort(x, dim=1),
        lambda: (distinct(3, 6),),
        ("aten.sort.default",),
    ),
    Case(
        "sort-descending-nan-float32",
        lambda x: torch.sort(x, dim=-1, descending=True),
        lambda: (with_nan(distinct(3, 6), (0, 2), (2, 0)),),
        ("aten.sort.default",),
    ),
    Case(
        "sort-ascending-nan-dim0-float64",
        lambda x: torch.sort(x, dim=0),
        lambda: (with_nan(distinct(4, 3, dtype=torch.float64), (1, 1)),),
        ("aten.sort.default",),
    ),
    Case(
        "sort-descending-int64-extremes",
        lambda x: torch.sort(x, descending=True),
        lambda: (torch.tensor([[3, -(2**63), 2**63 - 1, 0, -5]]),),
        ("aten.sort.default",),
    ),
    Case(
        "sort-stable-ties-int32",
        lambda x: torch.sort(x, stable=True, descending=True),
        lambda: (torch.tensor([2, 1, 2, 0, 1, 2], dtype=torch.int32),),
        ("aten.sort.stable",),
    ),
    Case(
        "sort-0dim-float32",
        lambda x: torch.sort(x),
        lambda: (torch.tensor(1.5),),
        ("aten.sort.default",),
    ),
    Case(
        "argsort-stable-bool",
        lambda x: torch.argsort(x, stable=True),
        lambda: (torch.tensor([True, False, True, False]),),
        ("aten.sort.stable",),
    ),
    Case(
        "topk-largest-float32",
        lambda x: torch.topk(x, 3),
        lambda: (distinct(4, 7),),
        ("aten.topk.default",),
    ),
    Case(
        "topk-smallest-dim0-float32",
        lambda x: torch.topk(x, 2, dim=0, largest=False),
        lambda: (distinct(5, 3),),
        ("aten.topk.default",),
    ),
    Case(
        "topk-nan-is-largest-float32",
        lambda x: torch.topk(x, 2),
        lambda: (with_nan(distinct(2, 5), (1, 3)),),
        ("aten.topk.default",),
    ),
]

# ---------------------------------------------------------------------------------
# FFT
# ---------------------------------------------------------------------------------

FFT = [
    Case(
        "rfft-float32",
        lambda x: torch.fft.rfft(x),
        lambda: (randn(3, 8),),
        ("aten._fft_r2c.default",),
    ),
    Case(
        "rfft2-ortho-float64",
        lambda x: torch.fft.rfft2(x, norm="ortho"),
        lambda: (randn(2, 4, 6, dtype=torch.float64),),
        ("aten._fft_r2c.default",),
    ),
    Case(
        "fft-complex64",
        lambda x: torch.fft.fft(torch.complex(x, x * 2)),
        lambda: (randn(5, 6),),
        ("aten._fft_c2c.default",),
    ),
    Case(
        "ifftn-forward-norm-complex64",
        lambda x: torch.fft.ifftn(torch.complex(x, -x), norm="forward"),
        lambda: (randn(3, 4, 5),),
        ("aten._fft_c2c.default",),
    ),
    Case(
        "irfft-odd-length-float32",
        lambda x: torch.fft.irfft(torch.fft.rfft(x), n=7),
        lambda: (randn(2, 7),),
        ("aten._fft_c2r.default",),
    ),
    Case(
        "irfft2-backward-norm-float64",
        lambda x: torch.fft.irfft2(torch.fft.rfft2(x)),
        lambda: (randn(4, 6, dtype=torch.float64),),
        ("aten._fft_c2r.default",),
    ),
]

# ---------------------------------------------------------------------------------
# Reducing scatters, masked scatter
# ---------------------------------------------------------------------------------


def _scatter_case(reduce, dtype=torch.float32):
    def inputs():
        if dtype.is_floating_point:
            x, src = randn(4, 3, dtype=dtype), randn(6, 3, dtype=dtype)
        else:
            x, src = ints(-9, 10, 4, 3, dtype=dtype), ints(-9, 10, 6, 3, dtype=dtype)
        return x, ints(0, 3, 5, 3), src  # row 3 never receives anything

    return Case(
        f"scatter_reduce-{reduce}-{str(dtype).removeprefix('torch.')}",
        lambda x, i, s: tuple(
            x.scatter_reduce(0, i, s, reduce, include_self=include_self)
            for include_self in (True, False)
        ),
        inputs,
        ("aten.scatter_reduce.two",),
    )


SCATTER = [
    *(_scatter_case(r) for r in ("sum", "prod", "mean", "amax", "amin")),
    _scatter_case("mean", torch.int64),
    _scatter_case("amax", torch.int32),
    *(
        Case(
            f"scatter-reduce-{reduce}-{str(dtype).removeprefix('torch.')}",
            lambda x, i, s, reduce=reduce: (
                x.scatter(0, i, s, reduce=reduce),  # Tensor.scatter_(..., reduce=) API
                x.scatter(0, i, 3, reduce=reduce),
            ),
            lambda dtype=dtype: (
                randn(4, 3, dtype=dtype) if dtype.is_floating_point else ints(-9, 10, 4, 3),
                ints(0, 3, 5, 3),
                randn(6, 3, dtype=dtype) if dtype.is_floating_point else ints(-9, 10, 6, 3),
            ),
            ("aten.scatter.reduce", "aten.scatter.value_reduce"),
        )
        for reduce in ("add", "multiply")
        for dtype in (torch.float32, torch.int64)
    ),
    Case(
        "masked_scatter-broadcast-mask-float32",
        lambda x, m, s: x.masked_scatter(m, s),
        lambda: (randn(3, 4), torch.tensor([True, False, True, True]), randn(20)),
        ("aten.masked_scatter.default",),
    ),
]

# ---------------------------------------------------------------------------------
# Resampling
# ---------------------------------------------------------------------------------

RESAMPLE: list[Case] = []  # upsampling is decomposed under torch.compile: see DIRECT


def _grid_case(mode, padding, dtype=torch.float32):
    def inputs():
        # Grid points partly outside [-1, 1], to exercise the padding mode.
        return randn(2, 3, 4, 5, dtype=dtype), (torch.rand(2, 3, 6, 2) * 2.6 - 1.3).to(dtype)

    return Case(
        f"grid_sampler_2d-{mode}-{padding}-{str(dtype).removeprefix('torch.')}",
        lambda x, g: tuple(
            F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)
            for align in (True, False)
        ),
        inputs,
        ("aten.grid_sampler_2d.default",),
    )


GRID = [
    _grid_case("bilinear", "zeros"),
    _grid_case("bilinear", "border", torch.float64),
    _grid_case("bilinear", "reflection"),
    _grid_case("nearest", "zeros"),
    _grid_case("nearest", "reflection", torch.float64),
]

# ---------------------------------------------------------------------------------
# Pairwise distances
# ---------------------------------------------------------------------------------

DISTANCES = [
    Case(
        "cdist-p2-float32",
        lambda a, b: torch.cdist(a, b),
        lambda: (randn(4, 3), randn(5, 3)),
        ("aten._cdist_forward.default",),
    ),
    Case(
        "cdist-p1-float32",
        lambda a, b: torch.cdist(a, b, p=1),
        lambda: (randn(3, 4), randn(2, 4)),
        ("aten._cdist_forward.default",),
    ),
    Case(
        "cdist-pinf-float32",
        lambda a, b: torch.cdist(a, b, p=float("inf")),
        lambda: (randn(3, 4), randn(2, 4)),
        ("aten._cdist_forward.default",),
    ),
    Case(
        "cdist-p0-float32",
        lambda a, b: torch.cdist(a, b.round(), p=0),
        lambda: (randn(3, 4).round(), randn(2, 4)),
        ("aten._cdist_forward.default",),
    ),
    Case(
        "pdist-p2-float32",
        lambda a: F.pdist(a),
        lambda: (randn(5, 3),),
        ("aten._pdist_forward.default",),
    ),
    Case(
        "pdist-p3-float64",
        lambda a: F.pdist(a, p=3),
        lambda: (randn(4, 2, dtype=torch.float64),),
        ("aten._pdist_forward.default",),
    ),
]

# ---------------------------------------------------------------------------------
# Gradients of convolution and pooling (backward graphs)
# ---------------------------------------------------------------------------------

BACKWARD = [
    Case(
        "convolution_backward-stride-padding-float32",
        lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
        lambda: (randn(2, 3, 7, 6), randn(4, 3, 3, 3), randn(4)),
        ("aten.convolution.default", "aten.convolution_backward.default"),
        grad=True,
    ),
    Case(
        "convolution_backward-groups-dilation-float64",
        lambda x, w: F.conv2d(x, w, groups=2, dilation=2),
        lambda: (randn(1, 4, 7, 7, dtype=torch.float64), randn(6, 2, 2, 3, dtype=torch.float64)),
        ("aten.convolution.default", "aten.convolution_backward.default"),
        grad=True,
    ),
    Case(
        "convolution_backward-transposed-float32",
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
        lambda: (randn(1, 3, 4, 5), randn(3, 2, 3, 3), randn(2)),
        ("aten.convolution.default", "aten.convolution_backward.default"),
        grad=True,
    ),
    Case(
        "convolution_backward-weight-only-float32",
        lambda x, w: F.conv2d(x.detach(), w, padding=1),  # output_mask [False, True, False]
        lambda: (randn(2, 3, 5, 5), randn(4, 3, 3, 3)),
        ("aten.convolution.default", "aten.convolution_backward.default"),
        grad=True,
    ),
    Case(
        "max_pool2d_with_indices_backward-overlap-float32",
        lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
        lambda: (distinct(2, 2, 7, 6),),
        ("aten.max_pool2d_with_indices.default", "aten.max_pool2d_with_indices_backward.default"),
        grad=True,
    ),
    Case(
        "max_pool3d_with_indices_backward-float32",
        lambda x: F.max_pool3d(x, 2),
        lambda: (distinct(1, 2, 4, 4, 4),),
        ("aten.max_pool3d_with_indices.default", "aten.max_pool3d_with_indices_backward.default"),
        grad=True,
    ),
    Case(
        "avg_pool2d_backward-ceil-nopadcount-float32",
        lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        lambda: (randn(1, 2, 6, 7),),
        ("aten.avg_pool2d.default", "aten.avg_pool2d_backward.default"),
        grad=True,
    ),
    Case(
        "avg_pool3d_backward-float32",
        lambda x: F.avg_pool3d(x, 2, stride=1),
        lambda: (randn(1, 1, 3, 4, 3),),
        ("aten.avg_pool3d.default", "aten.avg_pool3d_backward.default"),
        grad=True,
    ),
    Case(
        "adaptive_avg_pool2d_backward-uneven-float32",
        lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
        lambda: (randn(2, 3, 7, 5),),
        ("aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d_backward.default"),
        grad=True,
    ),
    Case(
        "adaptive_avg_pool3d_backward-float32",
        lambda x: F.adaptive_avg_pool3d(x, (2, 1, 3)),
        lambda: (randn(1, 2, 4, 3, 5),),
        ("aten._adaptive_avg_pool3d.default", "aten._adaptive_avg_pool3d_backward.default"),
        grad=True,
    ),
]

# ---------------------------------------------------------------------------------
# Embedding bags, adaptive max pooling, padding gradients, complex numbers
# ---------------------------------------------------------------------------------

_BAG_INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0])
_BAG_OFFSETS = torch.tensor([0, 2, 2, 5])


def _bag_case(mode, grad, padding_idx=None, per_sample=False, last=False, dtype=torch.float32):
    def fn(w, psw=None):
        return F.embedding_bag(
            _BAG_INDICES,
            w,
            _BAG_OFFSETS if not last else torch.cat([_BAG_OFFSETS, torch.tensor([9])]),
            mode=mode,
            per_sample_weights=psw,
            padding_idx=padding_idx,
            include_last_offset=last,
        )

    def inputs():
        w = randn(10, 3, dtype=dtype)
        return (w, torch.rand(9, dtype=dtype)) if per_sample else (w,)

    parts = [mode, "pad" if padding_idx is not None else "", "psw" if per_sample else ""]
    parts += ["last" if last else "", "grad" if grad else "", str(dtype).removeprefix("torch.")]
    op = "aten._embedding_bag.default" if grad else "aten._embedding_bag_forward_only.default"
    return Case("embedding_bag-" + "-".join(p for p in parts if p), fn, inputs, (op,), grad=grad)


EXTRA = [
    _bag_case("sum", False),
    _bag_case("mean", False, padding_idx=4),
    _bag_case("max", False, last=True),
    _bag_case("sum", False, per_sample=True, dtype=torch.float64),
    _bag_case("sum", True, padding_idx=2),
    _bag_case("mean", True),
    _bag_case("max", True, dtype=torch.float64),
    _bag_case("sum", True, per_sample=True, last=True),
    Case(
        "adaptive_max_pool2d-uneven-nan-float32",
        lambda x: F.adaptive_max_pool2d(x, (3, 2), return_indices=True),
        lambda: (with_nan(distinct(2, 2, 7, 5), (0, 1, 2, 2), (1, 0, 6, 4)),),
        ("aten.adaptive_max_pool2d.default",),
    ),
    Case(
        "adaptive_max_pool2d-grad-float32",
        lambda x: F.adaptive_max_pool2d(x, (2, 3)),
        lambda: (distinct(1, 3, 5, 7),),
        ("aten.adaptive_max_pool2d.default", "aten.adaptive_max_pool2d_backward.default"),
        grad=True,
    ),
    Case(
        "adaptive_max_pool3d-grad-float64",
        lambda x: F.adaptive_max_pool3d(x, (2, 1, 3)),
        lambda: (distinct(1, 2, 3, 4, 5, dtype=torch.float64),),
        ("aten.adaptive_max_pool3d.default", "aten.adaptive_max_pool3d_backward.default"),
        grad=True,
    ),
    Case(
        "replication_pad1d_backward-float32",
        lambda x: F.pad(x, (2, 3), mode="replicate"),
        lambda: (randn(2, 3, 4),),
        ("aten.replication_pad1d_backward.default",),
        grad=True,
    ),
    Case(
        "replication_pad2d_backward-float64",
        lambda x: F.pad(x, (1, 0, 2, 3), mode="replicate"),
        lambda: (randn(1, 2, 3, 4, dtype=torch.float64),),
        ("aten.replication_pad2d_backward.default",),
        grad=True,
    ),
    Case(
        "complex-view_as_real-float32",
        lambda a, b: torch.view_as_real(torch.complex(a, b) * (1 + 2j)),
        lambda: (randn(3, 4), randn(3, 4)),
        ("aten.complex.default", "aten.view_as_real.default"),
    ),
    Case(
        "polar-angle-float64",
        lambda r, t: torch.polar(r, t).angle(),
        lambda: (torch.rand(5, dtype=torch.float64) + 0.1, randn(5, dtype=torch.float64)),
        ("aten.polar.default", "aten.angle.default"),
    ),
    Case(
        "angle-real-nan-int-float32",
        lambda x, i: (torch.angle(x), torch.angle(i)),
        lambda: (with_nan(torch.tensor([-2.0, 0.0, 3.0, -0.0, 1.0]), 4), torch.tensor([-1, 0, 4])),
        ("aten.angle.default",),
    ),
]

# ---------------------------------------------------------------------------------
# Non-core ops that real programs reach: norms, order statistics, binary search, rrelu
# ---------------------------------------------------------------------------------

NONCORE = [
    Case(
        "linalg_vector_norm-2-dim-keepdim-float32",
        lambda x: torch.linalg.vector_norm(x, dim=(0, 2), keepdim=True),
        lambda: (randn(3, 4, 5),),
        ("aten.linalg_vector_norm.default",),
    ),
    Case(
        "linalg_vector_norm-inf-0-3-float64",
        lambda x: (
            torch.linalg.vector_norm(x, float("inf"), dim=-1),
            torch.linalg.vector_norm(x.round(), 0),
            torch.linalg.vector_norm(x, 3.0, dim=0),
        ),
        lambda: (randn(4, 6, dtype=torch.float64),),
        ("aten.linalg_vector_norm.default",),
    ),
    Case(
        "linalg_vector_norm-complex64",
        lambda a, b: torch.linalg.vector_norm(torch.complex(a, b), dim=1),
        lambda: (randn(3, 4), randn(3, 4)),
        ("aten.linalg_vector_norm.default",),
    ),
    Case(
        "linalg_vector_norm-dtype-arg-float16",
        lambda x: torch.linalg.vector_norm(x, dtype=torch.float32),
        lambda: (randn(8, 8, dtype=torch.float16),),
        ("aten.linalg_vector_norm.default",),
    ),
    Case(
        "linalg_vector_norm-grad-float32",
        lambda x: F.normalize(x, dim=-1),
        lambda: (randn(3, 5),),
        ("aten.linalg_vector_norm.default",),
        grad=True,
    ),
    Case(
        "median-nan-float32",
        lambda x, y: (torch.median(x), torch.median(y)),
        lambda: (distinct(3, 5), with_nan(distinct(7), 3)),
        ("aten.median.default",),
    ),
    Case(
        "median-dim-even-length-float32",
        lambda x: torch.median(x, dim=1),
        lambda: (with_nan(distinct(3, 6), (2, 4)),),
        ("aten.median.dim",),
    ),
    Case(
        "nanmedian-dim-keepdim-float64",
        lambda x: torch.nanmedian(x, dim=0, keepdim=True),
        lambda: (with_nan(distinct(5, 3, dtype=torch.float64), (0, 0), (3, 0), (1, 2)),),
        ("aten.nanmedian.dim",),
    ),
    Case(
        "kthvalue-int64",
        lambda x: torch.kthvalue(x, 3, dim=0),
        lambda: (distinct(6, 2, dtype=torch.int64),),
        ("aten.kthvalue.default",),
        perf_fallbacks=False,
    ),
    Case(
        "mode-ties-last-index-int64",
        lambda x, y: (torch.mode(x, 1), torch.mode(y, 0, keepdim=True)),
        lambda: (ints(0, 4, 3, 9), ints(0, 3, 6, 2).double()),
        ("aten.mode.default",),
        perf_fallbacks=False,
    ),
    # On the CPU PyTorch's selection kernels run 20-600x faster than the rules
    # (capability/cost.py): they stay in PyTorch, reason PERF.
    Case(
        "kthvalue-cpu-stays-in-pytorch",
        lambda x: torch.kthvalue(x, 3, dim=1),
        lambda: (ints(0, 3, 4, 40).float(),),
        ("aten.kthvalue.default",),
        refused="selects within each row",
    ),
    Case(
        "mode-cpu-stays-in-pytorch",
        lambda x: torch.mode(x, 1),
        lambda: (ints(0, 3, 4, 40),),
        ("aten.mode.default",),
        refused="selects within each row",
    ),
    Case(
        "bucketize-right-int32-out",
        lambda x, b: (torch.bucketize(x, b, right=True), torch.bucketize(x, b, out_int32=True)),
        lambda: (torch.tensor([[-1.0, 0.0, 0.5], [1.0, 2.0, 9.0]]), torch.tensor([0.0, 1.0, 2.0])),
        ("aten.bucketize.Tensor",),
    ),
    Case(
        "searchsorted-batched-sorter-int64",
        lambda s, v, order: (
            torch.searchsorted(s, v, side="right"),
            torch.searchsorted(s[:, order], v, sorter=order.argsort().expand(2, 5).contiguous()),
        ),
        lambda: (
            torch.tensor([[1, 3, 3, 7, 9], [0, 2, 4, 6, 8]]),
            torch.tensor([[3, 0, 10], [5, 8, -1]]),
            torch.tensor([4, 0, 3, 1, 2]),
        ),
        ("aten.searchsorted.Tensor",),
    ),
    Case(
        # imaginary parts add up past pi: PyTorch does not wrap them
        "logcumsumexp-complex64-unwrapped-phase",
        lambda x: torch.logcumsumexp(x, dim=1),
        lambda: (torch.complex(randn(3, 6), torch.rand(3, 6) * 3 + 2),),
        ("aten.logcumsumexp.default",),
    ),
    Case(
        "searchsorted-batched-empty-rows-and-values-float32",
        lambda s, v, s2, v2: (torch.searchsorted(s, v), torch.searchsorted(s2, v2)),
        lambda: (torch.empty(3, 0), randn(3, 4), randn(2, 5).sort().values, torch.empty(2, 0)),
        ("aten.searchsorted.Tensor",),
    ),
    Case(
        "rrelu-eval-grad-float32",
        lambda x: F.rrelu(x, training=False),
        lambda: (randn(4, 5),),
        ("aten.rrelu_with_noise_functional.default", "aten.rrelu_with_noise_backward.default"),
        grad=True,
    ),
    Case(
        "special-unary-float64",
        lambda x: (
            torch.special.i0e(x),
            torch.special.i1(x),
            torch.special.i1e(x),
            torch.special.erfcx(x),
            torch.special.ndtri(torch.sigmoid(x)),
            torch.polygamma(2, x.abs() + 0.5),
        ),
        lambda: (randn(7, dtype=torch.float64) * 3,),
        (
            "aten.special_i0e.default",
            "aten.special_i1.default",
            "aten.special_i1e.default",
            "aten.special_erfcx.default",
            "aten.special_ndtri.default",
            "aten.polygamma.default",
        ),
    ),
    Case(
        "polygamma-zeta-negative-arguments-float64",
        lambda x: (
            torch.polygamma(1, x),
            torch.polygamma(3, x),
            torch.special.zeta(torch.full_like(x, 4.0), x),
            torch.complex(x[:1], x[None, 1:]),
        ),
        lambda: (torch.tensor([-9.2, -20.5, -0.5, 0.3, 7.5], dtype=torch.float64),),
        ("aten.polygamma.default", "aten.special_zeta.default", "aten.complex.default"),
    ),
    Case(
        "special-binary-int-promotes-float32",
        lambda x, i: (
            torch.special.zeta(x.abs() + 1.5, i.abs() + 1),
            torch.igamma(x.abs() + 0.1, i.abs() + 0.5),
            torch.igammac(x.abs() + 0.1, x.abs() * 2),
        ),
        lambda: (randn(6), ints(-4, 5, 6)),
        ("aten.special_zeta.default", "aten.igamma.default", "aten.igammac.default"),
    ),
    Case(
        "bit-level-float32",
        lambda x, y, e: (
            torch.signbit(x),
            torch.frexp(x),
            torch.ldexp(x, e),
            torch.nextafter(x, y),
        ),
        lambda: (torch.tensor([-0.0, 0.0, -2.5, 3.0, 1e-30, NAN]), randn(6), ints(-3, 4, 6)),
        (
            "aten.signbit.default",
            "aten.frexp.Tensor",
            "aten.ldexp.Tensor",
            "aten.nextafter.default",
        ),
    ),
    Case(
        "gcd-lcm-shifts-int32",
        lambda a, b: (
            torch.gcd(a, b),
            torch.lcm(a, b),
            torch.bitwise_left_shift(a, b.abs()),
            torch.bitwise_right_shift(a, 3),
            torch.bitwise_right_shift(a, torch.tensor(40, dtype=torch.int32)),
        ),
        lambda: (
            torch.tensor([12, -18, 0, 7, -(2**31), 5], dtype=torch.int32),
            torch.tensor([8, 12, 0, -3, 2, 31], dtype=torch.int32),
        ),
        (
            "aten.gcd.default",
            "aten.lcm.default",
            "aten.bitwise_left_shift.Tensor",
            "aten.bitwise_right_shift.Tensor_Scalar",
            "aten.bitwise_right_shift.Tensor",
        ),
    ),
    Case(
        "cummax-cummin-ties-nan-float32",
        lambda x: (torch.cummax(x, 1), torch.cummin(x, 0)),
        lambda: (
            with_nan(torch.tensor([[1.0, 3.0, 3.0, 2.0, 5.0], [0.0, 0.0, -1.0, 4.0, 4.0]]), (0, 3)),
        ),
        ("aten.cummax.default", "aten.cummin.default"),
    ),
    Case(
        "cummax-int64-logcumsumexp-float64",
        lambda i, x: (torch.cummax(i, 0), torch.logcumsumexp(x, 1)),
        lambda: (ints(-3, 3, 6, 2), randn(2, 5, dtype=torch.float64) * 10),
        ("aten.cummax.default", "aten.logcumsumexp.default"),
    ),
    Case(
        "unfold-narrow_copy-float32",
        lambda x: (x.unfold(1, 3, 2), x.unfold(-1, 2, 1), torch.narrow_copy(x, 2, 1, 2)),
        lambda: (randn(2, 7, 4),),
        ("aten.unfold.default", "aten.narrow_copy.default"),
        grad=True,
    ),
    Case(
        "tril-triu-indices-int64",
        lambda x: (x[tuple(torch.tril_indices(4, 5, -1))], torch.triu_indices(3, 6, 2)),
        lambda: (randn(4, 5),),
        ("aten.tril_indices.default", "aten.triu_indices.default"),
    ),
    Case(
        "bilinear-trilinear-grad-float64",
        lambda a, b, w, bias: F.bilinear(a, b, w, bias),
        lambda: tuple(randn(*s, dtype=torch.float64) for s in ((3, 4), (3, 5), (2, 4, 5), (2,))),
        ("aten._trilinear.default",),
        grad=True,
    ),
    Case(
        "lu-det-solve-lu_factor-grad-float64",
        lambda A, B: (
            torch.linalg.det(A),
            torch.linalg.solve_ex(A, B).result,
            torch.linalg.lu_factor_ex(A).LU,
        ),
        lambda: (randn(2, 4, 4, dtype=torch.float64), randn(4, 3, dtype=torch.float64)),
        (
            "aten._linalg_det.default",
            "aten._linalg_solve_ex.default",
            "aten.linalg_lu_solve.default",
            "aten.lu_unpack.default",
        ),
        grad=True,
    ),
    Case(
        "lu-slogdet-inv-lu_factor-vector-solve-float64",
        lambda A, b: (
            torch.linalg.slogdet(A),
            torch.linalg.inv_ex(A),
            torch.linalg.lu_factor_ex(A),
            torch.linalg.solve_ex(A, b),
        ),
        lambda: (randn(2, 4, 4, dtype=torch.float64), randn(2, 4, dtype=torch.float64)),
        (
            "aten._linalg_slogdet.default",
            "aten.linalg_inv_ex.default",
            "aten.linalg_lu_factor_ex.default",
            "aten._linalg_solve_ex.default",
        ),
    ),
    Case(
        "cholesky-triangular-float64",
        lambda M, B: (
            torch.linalg.cholesky_ex(M @ M.mT + 4 * torch.eye(4, dtype=M.dtype)),
            torch.linalg.cholesky_ex(M @ M.mT + torch.eye(4, dtype=M.dtype), upper=True),
            torch.linalg.solve_triangular(M, B, upper=True),
            torch.linalg.solve_triangular(M, B.mT, upper=False, left=False, unitriangular=True),
            torch.cholesky_solve(B, torch.linalg.cholesky_ex(M @ M.mT + 4 * torch.eye(4))[0]),
        ),
        lambda: (
            randn(4, 4, dtype=torch.float64) + 3 * torch.eye(4),
            randn(2, 4, 3, dtype=torch.float64),
        ),
        (
            "aten.linalg_cholesky_ex.default",
            "aten.linalg_solve_triangular.default",
            "aten.cholesky_solve.default",
        ),
    ),
    Case(
        "cholesky_ex-info-not-positive-definite-float64",
        lambda A: torch.linalg.cholesky_ex(A).info,
        lambda: (
            torch.tensor(
                [[[4.0, 2, 1], [2, 1, 3], [1, 3, 5]], [[2.0, 0, 0], [0, 3, 0], [0, 0, -1]]]
            ),
        ),
        ("aten.linalg_cholesky_ex.default",),
    ),
    Case(
        "lu-slogdet-solve-complex128",
        lambda a, b, B: (
            torch.linalg.slogdet(torch.complex(a, b)),
            torch.linalg.solve_ex(torch.complex(a, b), B.to(torch.complex128)),
            torch.linalg.inv_ex(torch.complex(a, b)),
        ),
        lambda: tuple(randn(*s, dtype=torch.float64) for s in ((3, 3), (3, 3), (3, 2))),
        (
            "aten._linalg_slogdet.default",
            "aten._linalg_solve_ex.default",
            "aten.linalg_inv_ex.default",
        ),
    ),
    Case(
        "histc-range-and-auto-range-float32",
        lambda x: (torch.histc(x, 4, 0, 4), torch.histc(x, 3), torch.histc(x[:1], 3)),
        lambda: (torch.tensor([0.0, 1.0, 2.5, 3.0, 4.0, 4.0, 10.0, -1.0]),),
        ("aten.histc.default",),
    ),
    Case(
        "conv_tbc-float32",
        lambda x, w, b: torch.conv_tbc(x, w, b, 1),
        lambda: (randn(7, 2, 3), randn(3, 3, 4), randn(4)),
        ("aten.conv_tbc.default",),
        grad=True,
    ),
    Case(
        "diagonal_scatter-offsets-float32",
        lambda x: tuple(
            torch.diagonal_scatter(x, torch.diagonal(x, o, 0, 2) * 10, o, 0, 2) for o in (0, 2, -1)
        ),
        lambda: (randn(3, 2, 4),),
        ("aten.diagonal_scatter.default",),
    ),
    Case(
        "diagonal-fill-functionalized-float32",
        lambda x: x.clone().diagonal(1).fill_(5.0).sum() + x,
        lambda: (randn(4, 5),),
        ("aten.diagonal_scatter.default",),
    ),
    Case(
        "fill_diagonal-as_strided-float32",
        lambda x: x.clone().fill_diagonal_(0.0),
        lambda: (randn(4, 5),),
        ("aten.as_strided.default", "aten.as_strided_scatter.default"),
    ),
]

# ---------------------------------------------------------------------------------
# Semantics of existing core rules that are easy to get subtly wrong
# ---------------------------------------------------------------------------------

SEMANTICS = [
    Case(
        "atan2-out-functionalized-float32",
        lambda a, b, out: torch.atan2(a, b, out=out),
        lambda: (randn(3), randn(3), torch.empty(3)),
        ("aten.atan2.default",),
    ),
    # Half-precision sums accumulate in float32 and round once, like PyTorch's kernel
    # (summing in bfloat16 drifts by many ulps over 512 terms).
    Case(
        "sum-dim-accumulates-in-float32-bfloat16",
        lambda x: x.sum(0),
        lambda: (randn(512, 8, dtype=torch.bfloat16),),
        ("aten.sum.dim_IntList",),
    ),
    Case(
        "sum-accumulates-in-float32-float16",
        lambda x: x.sum(),
        lambda: (randn(4096, dtype=torch.float16),),
        ("aten.sum.dim_IntList",),  # what aot_autograd makes of a full sum
    ),
    # ldexp with a fractional bfloat16 exponent: 2**e is rounded to bfloat16 first.
    Case(
        "ldexp-fractional-exponent-bfloat16",
        torch.ldexp,
        lambda: (randn(64, dtype=torch.bfloat16), randn(64, dtype=torch.bfloat16) * 6),
        ("aten.ldexp.Tensor",),
    ),
    Case(
        "native_group_norm-empty-batch-float32",
        lambda x, w, b: torch.native_group_norm(x, w, b, 0, 2, 1, 1, 1e-5),
        lambda: (torch.randn(0, 2), randn(2), randn(2)),
        ("aten.native_group_norm.default",),
    ),
]

CASES = (
    SORTING + FFT + SCATTER + RESAMPLE + GRID + DISTANCES + BACKWARD + EXTRA + NONCORE + SEMANTICS
)


@pytest.mark.parametrize("case", case_params(CASES))
def test_rule(case: Case):
    run_case(case)


# ---------------------------------------------------------------------------------
# Rules that torch.compile never reaches on this torch (the op is decomposed while
# Dynamo traces), called directly on JAX arrays and compared with the eager kernel.
# ---------------------------------------------------------------------------------

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class DirectCase:
    id: str
    op: torch._ops.OpOverload
    args: Callable[[], tuple[Any, ...]]


DIRECT = [
    DirectCase(
        "upsample_nearest2d.vec-scale2-float32",
        aten.upsample_nearest2d.vec,
        lambda: (randn(1, 2, 3, 4), None, [2.0, 2.0]),
    ),
    DirectCase(
        "upsample_nearest2d.vec-size-float32",
        aten.upsample_nearest2d.vec,
        lambda: (randn(2, 1, 3, 7), [5, 3], None),
    ),
    DirectCase(
        "upsample_nearest2d.vec-scale1.7-uint8",
        aten.upsample_nearest2d.vec,
        lambda: (ints(0, 255, 1, 2, 4, 5, dtype=torch.uint8), None, [1.7, 1.3]),
    ),
    DirectCase(
        "upsample_nearest1d.vec-scale0.6-uint8",
        aten.upsample_nearest1d.vec,
        lambda: (ints(0, 99, 2, 1, 9, dtype=torch.uint8), None, [0.6]),
    ),
    DirectCase(
        "upsample_bilinear2d.vec-size-float32",
        aten.upsample_bilinear2d.vec,
        lambda: (randn(1, 2, 3, 4), [7, 5], False, None),
    ),
    DirectCase(
        "upsample_bilinear2d.vec-align-corners-scale2.5-float64",
        aten.upsample_bilinear2d.vec,
        lambda: (randn(1, 2, 3, 4, dtype=torch.float64), None, True, [2.5, 2.5]),
    ),
    DirectCase(
        "upsample_bilinear2d.vec-downsample-float32",
        aten.upsample_bilinear2d.vec,
        lambda: (randn(1, 1, 8, 7), [3, 2], False, None),
    ),
    DirectCase(
        "upsample_bilinear2d.vec-scale1.5-bfloat16",
        aten.upsample_bilinear2d.vec,
        lambda: (randn(1, 2, 4, 4, dtype=torch.bfloat16), None, False, [1.5, 1.5]),
    ),
    DirectCase(
        "upsample_trilinear3d.vec-float32",
        aten.upsample_trilinear3d.vec,
        lambda: (randn(1, 1, 2, 3, 4), [3, 5, 2], False, None),
    ),
    DirectCase(
        "_cdist_forward-p2-matmul-form-float64",
        aten._cdist_forward.default,
        lambda: (randn(2, 30, 4, dtype=torch.float64), randn(2, 6, 4, dtype=torch.float64), 2.0, 1),
    ),
]


def _to_jax_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return jax.numpy.asarray(to_jax(value))
    if isinstance(value, list | tuple):
        return type(value)(_to_jax_tree(v) for v in value)
    return jax_literal(value)


@pytest.mark.parametrize("case", DIRECT, ids=[c.id for c in DIRECT])
def test_rule_direct(case: DirectCase):
    torch.manual_seed(0)
    args = case.args()
    expected = case.op(*args)
    rule = get_rule(case.op)
    assert rule is not None
    with jax.enable_x64(True):
        jargs = _to_jax_tree(args)
        if rule.check is not None:
            assert rule.check(*jargs) is None
        out = rule.fn(*jargs)
    actual = tuple(to_torch(o) for o in out) if isinstance(out, tuple) else to_torch(out)
    assert_same(actual, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_half_convolution_rounds_once_with_its_bias(dtype: torch.dtype, transposed: bool):
    # The products sum to 2**k + 1, which rounds to 2**k in the dtype (ties to even);
    # with the bias 1 the exact result 2**k + 2 is representable. PyTorch's CPU
    # convolution accumulates in float32 and rounds once, bias included: 2**k + 2. Its
    # transposed convolution rounds the sum first (2**k), then adds the bias (2**k + 1,
    # rounded to 2**k again). The tolerance table would hide one ulp: compared exactly.
    k = 8 if dtype == torch.bfloat16 else 11
    x = torch.ones(1, 1, 1, 2, dtype=dtype)
    w = torch.tensor([2.0**k, 1.0], dtype=dtype).reshape(1, 1, 1, 2)
    b = torch.ones(1, dtype=dtype)

    def fn(x, w, b):
        if transposed:  # output (0, 0, 0, 1) sums x[0] * w[1] + x[1] * w[0]
            return F.conv_transpose2d(x, w, b)
        return F.conv2d(x, w, b)

    expected = fn(x, w, b)
    backend = dynajax.Backend()
    with measured_faster("xla"):  # (the rule's rounding is the point)
        actual = torch.compile(fn, backend=backend, fullgraph=True)(x, w, b)
    assert dynajax.Report(backend.graphs).fallbacks == []
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    if transposed:
        # Where oneDNN runs eager's half-precision convolutions (a CPU with bfloat16 or
        # float16 instructions), the transposed one rounds once too.
        onednn = {
            torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
        }[dtype]()
        assert expected.flatten()[1].item() == (2.0**k + 2 if onednn else 2.0**k)
    else:
        assert expected.flatten()[-1].item() == 2.0**k + 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["addmm", "linear", "baddbmm", "addmv", "addmm_beta0"])
def test_half_matmul_rounds_once_with_its_bias(dtype: torch.dtype, op: str):
    # As for convolutions above: a @ b = 2**k + 1 rounds to 2**k in the dtype, and
    # 2**k + 1 + bias (bias 1) = 2**k + 2 is representable. PyTorch's CPU kernels add
    # the bias to the float32 sum and round once (2**k + 2); rounding the product
    # first gives 2**k + 1, which rounds to 2**k. Compared exactly.
    k = 8 if dtype == torch.bfloat16 else 11
    a = torch.ones(1, 2, dtype=dtype)
    b = torch.tensor([[2.0**k], [1.0]], dtype=dtype)
    bias = torch.ones(1, dtype=dtype)
    fns = {
        "addmm": lambda a, b, c: torch.addmm(c, a, b),
        "linear": lambda a, b, c: F.linear(a, b.t(), c),
        "baddbmm": lambda a, b, c: torch.baddbmm(c, a[None], b[None]),
        "addmv": lambda a, b, c: torch.addmv(c, a, b[:, 0]),
        # beta=0 ignores the bias; alpha=2 scales the float32 sum before the rounding
        "addmm_beta0": lambda a, b, c: torch.addmm(c, a, b, beta=0, alpha=2),
    }
    fn = fns[op]
    expected = fn(a, b, bias)
    backend = dynajax.Backend()
    actual = torch.compile(fn, backend=backend, fullgraph=True)(a, b, bias)
    assert dynajax.Report(backend.graphs).fallbacks == []
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    want = 2.0 ** (k + 1) if op == "addmm_beta0" else 2.0**k + 2
    assert expected.flatten()[0].item() == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_division_is_correctly_rounded_and_never_reassociated(dtype: torch.dtype):
    # XLA's simplifier turns x / c into x * (1 / c) (an ulp off for a third of the
    # elements) and (a / b) / c into a / (b * c): in float16, 300 * 300 overflows and
    # (1000 / 300) / 300 came out 0. PyTorch divides, rounding each quotient once.
    torch.manual_seed(0)
    x, y = torch.randn(4096, dtype=dtype) * 10, torch.randn(4096, dtype=dtype) * 10
    col = torch.randn(64, 1, dtype=dtype) * 10
    # b * c overflows, a / b / c is a normal number (XLA flushes subnormals to zero)
    a, big = {torch.float16: (1e4, 300.0), torch.float64: (1e100, 1e200)}.get(dtype, (1e10, 1e20))
    squares = torch.randint(1, 100, (4096,)).to(dtype) ** 2  # exact square roots
    fns = {
        "tensor": (lambda x, y: x / y, (x, y)),
        "python scalar": (lambda x, y: x / 3.0, (x, y)),
        "broadcast column": (lambda x, c: x.view(64, 64) / c, (x, col)),
        "0-dim tensor": (lambda x, y: x / y[0], (x, y)),
        "chain": (lambda x, y: x / y / y, (x, y)),
        "over a quotient": (lambda x, y: x / (y / 7.0), (x, y)),
        "sqrt divisor": (lambda x, y: x / y.sqrt(), (x, squares)),
        "chain past the range": (lambda x, y: x / big / big, (x.abs() + a, y)),
        "floor": (lambda x, y: torch.div(x, 0.1, rounding_mode="floor"), (x, y)),
        "trunc": (lambda x, y: torch.div(x, y[0], rounding_mode="trunc"), (x, y)),
    }
    for name, (fn, args) in fns.items():
        backend = dynajax.Backend()
        actual = torch.compile(fn, backend=backend, fullgraph=True)(*args)
        expected = fn(*args)
        assert dynajax.Report(backend.graphs).fallbacks == [], name
        assert torch.equal(actual, expected), (name, (actual != expected).sum().item())
    assert (x.abs() + a).div(big).div(big).ne(0).all()  # the chain's answer is not 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_histc_bins_like_the_kernel(dtype: torch.dtype):
    # The kernel computes the bin (x - min) * bins / (max - min) in the input dtype,
    # rounding every step; a division by the broadcast range that XLA turns into a
    # multiplication by its reciprocal put about one float16 histogram in two off by
    # one element (data range, 100 bins). Counts are compared exactly.
    torch.manual_seed(0)
    fn = lambda x: [
        torch.histc(x, bins, lo, hi)
        for bins in (3, 10, 100)
        for lo, hi in ((0, 0), (-10, 10), (0, 10))
    ]  # noqa: E731
    backend = dynajax.Backend()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for _ in range(20):
        x = (torch.rand(125) * 18 - 9).to(dtype)
        for a, e in zip(compiled(x), fn(x), strict=True):
            assert torch.equal(a, e)
    assert dynajax.Report(backend.graphs).fallbacks == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_embedding_max_norm_renormalizes_the_weight_in_place(dtype, norm_type):
    # F.embedding(max_norm=) rescales, in the weight itself, the referenced rows whose
    # norm exceeds max_norm (rows 1, 2, 5, 9, 0 here; 3 stays as it was).
    torch.manual_seed(0)
    weight = (torch.randn(10, 4) * 3).to(dtype)
    indices = torch.tensor([[1, 2, 2, 5], [9, 0, 1, 1]])

    def fn(i, w):
        return F.embedding(i, w, max_norm=1.5, norm_type=norm_type)

    backend = dynajax.Backend()
    ours, theirs = weight.clone(), weight.clone()
    actual = torch.compile(fn, backend=backend, fullgraph=True)(indices, ours)
    expected = fn(indices, theirs)
    assert dynajax.Report(backend.graphs).fallbacks == []
    assert_same(actual, expected)
    assert_same(ours, theirs)
    assert not torch.equal(theirs, weight) and torch.equal(theirs[3], weight[3])
    if dtype != torch.float32:  # the half types match the kernel bit for bit
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_bilinear_and_renorm_round_like_the_kernels(dtype: torch.dtype):
    # F.bilinear's _trilinear contracts in two matmuls, each accumulating in float32 and
    # rounded to the dtype; one fused product-and-sum in float32 differed on 1 element
    # in 50. renorm's decomposition leaves prims.convert_element_type in the graph.
    torch.manual_seed(0)
    x1, x2 = torch.randn(5, 3, 8, dtype=dtype), torch.randn(5, 3, 6, dtype=dtype)
    w, b = torch.randn(7, 8, 6, dtype=dtype), torch.randn(7, dtype=dtype)

    def fn(x1, x2, w, b):
        return F.bilinear(x1, x2, w, b), torch.renorm(x1, 2, 0, 1.5)

    backend = dynajax.Backend()
    actual = torch.compile(fn, backend=backend, fullgraph=True)(x1, x2, w, b)
    assert dynajax.Report(backend.graphs).fallbacks == []
    expected = fn(x1, x2, w, b)
    assert_same(actual, expected)
    assert torch.equal(actual[1], expected[1])
    if dtype == torch.bfloat16:
        assert torch.equal(actual[0], expected[0])


@pytest.mark.parametrize("op", ["median", "nanmedian"])
def test_an_order_statistic_along_an_empty_dim_raises_eagers_error(op: str):
    # A shape check of eager's kernel (found by the fuzzer through jax_function): the
    # rule used to return a value; backend and jax_function now raise eager's error.
    def fn(x):
        return getattr(torch, op)(x, dim=1).values

    x = torch.zeros(1, 0, 1)
    message = r"median\(\): Expected reduction dim 1 to have non-zero size\."
    with pytest.raises(IndexError, match=message):
        fn(x)
    with pytest.raises(IndexError, match=message):
        torch.compile(fn, backend=dynajax.Backend(cache_dir=""))(x)
    jax_fn, _ = dynajax.jax_function(fn, x)
    with pytest.raises(IndexError, match=message):
        jax_fn({}, x.numpy())

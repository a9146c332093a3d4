"""Storage-addressing views (as_strided and its scatter), view-copy variants, put,
index_reduce, nonzero_static, segment_reduce, histograms and dist, compared with eager
PyTorch on semantics the OpInfo samples do not reach (layouts, offsets, empty segments,
NaN, duplicates), and refusals that must stay refusals.

    pytest -q tests/lowering/test_indexing_views.py -k as_strided
"""

from __future__ import annotations

import pytest
import torch

from dynajax.capability import Reason
from tests.helpers import (
    Case,
    assert_ops_in_jax,
    case_params,
    compare_with_eager,
    compile_with,
    partition_ops,
    run_case,
)
from tests.tolerances import assert_same

NAN = float("nan")

# PyTorch warns that index_reduce is a beta API on every eager call.
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")


def arange(*shape, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=dtype).reshape(shape)


# ---------------------------------------------------------------------------------
# as_strided: gathers from the input's storage, given eager's layout of the input
# ---------------------------------------------------------------------------------

AS_STRIDED = "aten.as_strided.default"

AS_STRIDED_CASES = [
    Case(
        "as_strided-contiguous-offset-float32",
        lambda x: torch.as_strided(x, (2, 3), (1, 2), 2),
        lambda: (arange(3, 4),),
        (AS_STRIDED,),
    ),
    Case(
        # Eager reads the storage of x (x.t() is a view): element order is x's, not
        # x.t()'s row-major order.
        "as_strided-of-transposed-input-float32",
        lambda x: torch.as_strided(x.t(), (2, 2), (1, 2), 1) + 1,
        lambda: (arange(3, 3),),
        (AS_STRIDED,),
    ),
    Case(
        "as_strided-of-slice-of-input-int64",
        lambda x: torch.as_strided(x[:, 1:], (3, 2), (4, 1)),
        lambda: (arange(3, 4, dtype=torch.int64),),
        (AS_STRIDED,),
    ),
    Case(
        # Overlapping windows (stride 1 on both dims) read elements more than once.
        "as_strided-overlapping-windows-float64",
        lambda x: torch.as_strided(x, (4, 3), (1, 1)),
        lambda: (arange(6, dtype=torch.float64),),
        (AS_STRIDED,),
    ),
    Case(
        "as_strided-of-contiguous-intermediate-bool",
        lambda x: torch.as_strided(x > 2, (2, 2), (3, 1), 1),
        lambda: (arange(2, 3),),
        (AS_STRIDED,),
    ),
    Case(
        "as_strided-empty-output-float32",
        lambda x: torch.as_strided(x, (0, 3), (3, 1)) + 1,
        lambda: (arange(2, 3),),
        (AS_STRIDED,),
    ),
    Case(
        "as_strided-of-expanded-input-float32",
        lambda x: torch.as_strided(x.expand(3, 4), (2, 2), (0, 1), 1) * 2,
        lambda: (arange(4),),
        (AS_STRIDED,),
    ),
    Case(
        "_reshape_alias_copy-of-transposed-input-float32",
        lambda x: torch.ops.aten._reshape_alias_copy.default(x.t(), [3, 2], [1, 3]),
        lambda: (arange(2, 3),),
        ("aten._reshape_alias_copy.default",),
    ),
    Case(
        "as_strided_scatter-contiguous-float32",
        lambda x, src: torch.as_strided_scatter(x, src, (2, 2), (1, 3), 1),
        lambda: (arange(3, 3), -arange(2, 2) - 1),
        ("aten.as_strided_scatter.default",),
    ),
    Case(
        # The scatter addresses the storage of x's clone, which keeps x's strides.
        "as_strided_scatter-of-transposed-int32",
        lambda x, src: torch.as_strided_scatter(x.t(), src, (3,), (4,)),
        lambda: (arange(3, 3, dtype=torch.int32), torch.tensor([-1, -2, -3], dtype=torch.int32)),
        ("aten.as_strided_scatter.default",),
    ),
]


@pytest.mark.parametrize("case", case_params(AS_STRIDED_CASES))
def test_as_strided(case: Case):
    run_case(case)


def test_as_strided_partial_view_input_reads_only_its_elements():
    base = arange(15)
    x = base[5:]  # storage offset 5

    def fn(x):
        return torch.as_strided(x, (2, 2), (1, 2), 10)

    report = compare_with_eager(fn, x, fullgraph=True)
    assert report.fallbacks == []
    assert AS_STRIDED in partition_ops(report)


def _refusal(report, target: str):
    found = [f for f in report.fallbacks if f.target == target]
    assert found, f"{target} was not refused"
    assert found[0].reason == Reason.CHECK_REFUSED
    return found[0].detail


def test_as_strided_outside_the_input_is_refused():
    # x = base[5:]; offset 0 reads base[0:5], memory the graph's value does not hold.
    base = arange(15)
    x = base[5:]

    def fn(x):
        return torch.as_strided(x, (2, 2), (1, 2), 0)

    report = compare_with_eager(fn, x, fullgraph=True)
    assert "holds no element of the input" in _refusal(report, AS_STRIDED)


def _eager_storage(report) -> dict[str, str]:
    return {f.target: f.detail for f in report.fallbacks if f.reason == Reason.EAGER_STORAGE}


def test_as_strided_of_noncontiguous_computed_tensor_is_refused():
    # The fake tensor of x.t() * 2 says strides (1, 3), as eager's kernel makes them, but
    # a computed tensor's layout is not guaranteed, so the rule does not rely on it. In
    # eager, as_strided then reads the product's storage in those strides: the JAX
    # result (row-major) is copied into them first.
    def fn(x):
        return torch.as_strided(x.t() * 2, (2, 2), (1, 2), 1)

    x = arange(3, 3)
    report = compare_with_eager(fn, x, fullgraph=True)
    assert "no known eager layout" in _refusal(report, AS_STRIDED)
    copies = _eager_storage(report)
    assert set(copies) == {"aten.empty_strided.default", "aten.copy.default"}
    assert "strides (1, 3)" in copies["aten.copy.default"]


def test_as_strided_in_eager_reads_views_of_a_computed_tensor_in_eager():
    # slice and transpose between the product and as_strided stay in eager, so that they
    # alias the (re-strided) product's storage as in eager; as_strided reads outside the
    # slice's elements, into the rest of that storage.
    def fn(x):
        y = (x.t() * 2)[1:].t()
        return torch.as_strided(y, (2, 3), (1, 4), 0) + 1

    x = arange(3, 4)
    report = compare_with_eager(fn, x, fullgraph=True)
    kept = _eager_storage(report)
    assert {"aten.slice.Tensor", "aten.permute.default", "aten.copy.default"} <= set(kept)


def test_as_strided_in_fallback_ops_reads_the_inputs_storage():
    # Listed by the user, as_strided runs in eager: the views of the graph input before
    # it must too, or it would read a compact JAX copy of the view instead of x's storage.
    def fn(x):
        return torch.as_strided(x.t()[1:], (2, 2), (1, 3), 2) * 3

    x = arange(3, 4)
    report = compare_with_eager(fn, x, fullgraph=True, fallback_ops=["aten.as_strided"])
    kept = _eager_storage(report)
    assert {"aten.slice.Tensor", "aten.permute.default"} <= set(kept)
    assert "aten.copy.default" not in kept  # the graph input owns eager's storage


def test_as_strided_scatter_with_overlapping_writes_is_refused():
    def fn(x, src):
        return torch.as_strided_scatter(x, src, (2, 2), (1, 1))

    report = compare_with_eager(fn, arange(3, 3), arange(2, 2), fullgraph=True)
    assert "twice" in _refusal(report, "aten.as_strided_scatter.default")


def test_as_strided_dynamic_shapes_stays_correct():
    def fn(x):
        return torch.as_strided(x, (2, 2), (1, 2), 1) * 2

    compiled, backend = compile_with(fn, dynamic=True)
    for n in (5, 7, 9):
        x = arange(n)
        assert_same(compiled(x), fn(x))
    assert_ops_in_jax(backend, AS_STRIDED)


# ---------------------------------------------------------------------------------
# View copies, put, index_reduce, nonzero_static, dist, conj
# ---------------------------------------------------------------------------------

aten = torch.ops.aten

CASES = [
    Case(
        "view_copy-infer-dim-int64",
        lambda x: aten.view_copy.default(x, [2, -1]),
        lambda: (arange(3, 4, dtype=torch.int64),),
        ("aten.view_copy.default",),
    ),
    Case(
        "view_copy.dtype-float32-as-int32",
        lambda x: aten.view_copy.dtype(x, torch.int32),
        lambda: (torch.randn(2, 3),),
        ("aten.view_copy.dtype",),
    ),
    Case(
        "permute_copy-negative-dims-bool",
        lambda x: aten.permute_copy.default(x, [-1, 0, 1]),
        lambda: (torch.randn(2, 3, 4) > 0,),
        ("aten.permute_copy.default",),
    ),
    Case(
        "unbind_copy-dim1-float32",
        lambda x: aten.unbind_copy.int(x, 1),
        lambda: (torch.randn(2, 3, 4),),
        ("aten.unbind_copy.int",),
    ),
    Case(
        "select_slice_split_copy-float64",
        lambda x: (
            aten.select_copy.int(x, 0, -1),
            aten.slice_copy.Tensor(x, 1, 1, None, 2),
            aten.split_copy.Tensor(x, 2, 1),
        ),
        lambda: (torch.randn(3, 5, dtype=torch.float64),),
        ("aten.select_copy.int", "aten.slice_copy.Tensor", "aten.split_copy.Tensor"),
    ),
    Case(
        "put-negative-indices-accumulate-duplicates-float32",
        lambda x, i, s: x.put(i, s, accumulate=True),
        lambda: (torch.randn(3, 4), torch.tensor([[0, -1], [5, 0]]), torch.randn(2, 2)),
        ("aten.put.default",),
    ),
    Case(
        "put-accumulate-bool",
        lambda x, i, s: x.put(i, s, accumulate=True),
        lambda: (
            torch.tensor([True, False, False]),
            torch.tensor([1, 1, 2]),
            torch.tensor([True, True, False]),
        ),
        ("aten.put.default",),
    ),
    Case(
        "put-0dim-int32",
        lambda x, i, s: x.put(i, s),
        lambda: (
            torch.tensor(4, dtype=torch.int32),
            torch.tensor([0]),
            torch.tensor(7, dtype=torch.int32),
        ),
        ("aten.put.default",),
    ),
    Case(
        "index_reduce-mean-int64-floor",
        lambda x, i, s: x.index_reduce(0, i, s, "mean", include_self=False),
        lambda: (
            torch.tensor([[7, -7], [1, 2], [5, 5]]),
            torch.tensor([0, 2, 0]),
            torch.tensor([[4, -3], [9, 9], [1, 2]]),
        ),
        ("aten.index_reduce.default",),
    ),
    Case(
        "index_reduce-amax-nan-float32",
        lambda x, i, s: x.index_reduce(1, i, s, "amax"),
        lambda: (
            torch.tensor([[0.0, 1.0, 2.0]]),
            torch.tensor([2, 0]),
            torch.tensor([[NAN, -5.0]]),
        ),
        ("aten.index_reduce.default",),
    ),
    Case(
        "index_reduce-prod-amin-float64",
        lambda x, i, s: (
            x.index_reduce(0, i, s, "prod"),
            x.index_reduce(0, i, s, "amin", include_self=False),
        ),
        lambda: (
            torch.randn(4, 3, dtype=torch.float64),
            torch.tensor([3, 1, 3]),
            torch.randn(3, 3, dtype=torch.float64),
        ),
        ("aten.index_reduce.default",),
    ),
    Case(
        "nonzero_static-pad-and-truncate-float32",
        lambda x: (torch.nonzero_static(x, size=8, fill_value=-7), torch.nonzero_static(x, size=2)),
        lambda: (torch.tensor([[0.0, 1.5, 0.0], [NAN, 0.0, -2.0]]),),
        ("aten.nonzero_static.default",),
    ),
    Case(
        "nonzero_static-0dim-bool",
        lambda x: torch.nonzero_static(x, size=3),
        lambda: (torch.tensor(True),),
        ("aten.nonzero_static.default",),
    ),
    Case(
        "dist-p-values-broadcast-float32",
        lambda x, y: tuple(
            torch.dist(x, y, p) for p in (0, 1, 2, 3.5, float("inf"), -float("inf"))
        ),
        lambda: (torch.randn(3, 4), torch.randn(4)),
        ("aten.dist.default",),
    ),
    Case(
        "dist-complex64",
        lambda x, y: torch.dist(x, y),
        lambda: (torch.randn(5, dtype=torch.complex64), torch.randn(5, dtype=torch.complex64)),
        ("aten.dist.default",),
    ),
    Case(
        "ihfft2-complex-output-float64",
        lambda x: torch.fft.ihfft2(x),
        lambda: (torch.randn(4, 6, dtype=torch.float64),),
        ("aten._conj_physical.default",),
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_rule(case: Case):
    run_case(case)


# ---------------------------------------------------------------------------------
# segment_reduce
# ---------------------------------------------------------------------------------

SEGMENT_DATA = torch.tensor([1.0, NAN, 3.0, 4.0, 5.0, -2.0])
SEGMENT_LENGTHS = torch.tensor([2, 0, 3, 1])


def _segment_case(reduce: str, initial: float | None, offsets: bool) -> Case:
    def fn(data, lengths):
        if offsets:
            bounds = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            return torch.segment_reduce(data, reduce, offsets=bounds, initial=initial)
        return torch.segment_reduce(data, reduce, lengths=lengths, initial=initial)

    kind = "offsets" if offsets else "lengths"
    return Case(
        f"segment_reduce-{reduce}-{kind}-initial{initial}-nan-empty-float32",
        fn,
        lambda: (SEGMENT_DATA.clone(), SEGMENT_LENGTHS.clone()),
        ("aten.segment_reduce.default",),
    )


SEGMENT_CASES = [
    _segment_case(r, init, offsets)
    for r in ("sum", "mean", "max", "min", "prod")
    for init in (None, 10.0)
    for offsets in (False, True)
] + [
    Case(
        "segment_reduce-batched-lengths-axis1-float64",
        lambda x, lengths: torch.segment_reduce(x, "max", lengths=lengths, axis=1),
        lambda: (torch.randn(2, 6, 3, dtype=torch.float64), torch.tensor([[2, 4, 0], [3, 1, 2]])),
        ("aten.segment_reduce.default",),
    ),
    Case(
        "segment_reduce-offsets-skip-leading-float32",
        lambda x, offsets: torch.segment_reduce(x, "mean", offsets=offsets),
        lambda: (arange(6), torch.tensor([1, 3, 4])),
        ("aten.segment_reduce.default",),
    ),
]


@pytest.mark.parametrize("case", case_params(SEGMENT_CASES))
def test_segment_reduce(case: Case):
    run_case(case)


# ---------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------

HISTOGRAM_CASES = [
    Case(
        "histogram-bin_ct-density-float32",
        lambda x: torch.histogram(x, 4, density=True),
        lambda: (torch.randn(7, 3),),
        ("aten.histogram.bin_ct",),
    ),
    Case(
        "histogram-range-outside-and-nan-float32",
        lambda x: torch.histogram(x, 5, range=(-1.0, 1.0)),
        lambda: (torch.tensor([-3.0, -1.0, 0.0, NAN, 0.3, 1.0, 2.0]),),
        ("aten.histogram.bin_ct",),
    ),
    Case(
        "histogram-constant-input-widened-float32",
        lambda x: torch.histogram(x, 2),
        lambda: (torch.tensor([3.0, 3.0]),),
        ("aten.histogram.bin_ct",),
    ),
    Case(
        "histogram-empty-input-float32",
        lambda x: torch.histogram(x, 3),
        lambda: (torch.zeros(0),),
        ("aten.histogram.bin_ct",),
    ),
    Case(
        # Every element lies exactly on an edge of linspace(0, 10, 11).
        "histogram-elements-on-edges-float64",
        lambda x: torch.histogram(x, 10),
        lambda: (torch.arange(11, dtype=torch.float64),),
        ("aten.histogram.bin_ct",),
    ),
    Case(
        "histogram-bins-tensor-weight-float32",
        lambda x, w: torch.histogram(
            x, torch.tensor([-1.0, 0.0, 0.5, 2.0]), weight=w, density=True
        ),
        lambda: (torch.randn(9), torch.rand(9)),
        ("aten.histogram.bins_tensor",),
    ),
    Case(
        "histogramdd-bin_cts-weight-density-float64",
        lambda x, w: torch.histogramdd(x, [2, 3, 4], weight=w, density=True),
        lambda: (torch.randn(7, 3, dtype=torch.float64), torch.rand(7, dtype=torch.float64)),
        ("aten._histogramdd_from_bin_cts.default", "aten._histogramdd_bin_edges.default"),
    ),
    Case(
        "histogramdd-range-float32",
        lambda x: torch.histogramdd(x, [2, 2], range=[-1.0, 1.0, 0.0, 0.0]),
        lambda: (torch.randn(4, 5, 2),),
        ("aten._histogramdd_from_bin_cts.default",),
    ),
    Case(
        "histogramdd-bin-tensors-float32",
        lambda x: torch.histogramdd(x, [torch.tensor([-1.0, 0.0, 1.0])] * 3),
        lambda: (torch.randn(8, 3),),
        ("aten._histogramdd_from_bin_tensors.default",),
    ),
]


@pytest.mark.parametrize("case", case_params(HISTOGRAM_CASES))
def test_histogram(case: Case):
    run_case(case)

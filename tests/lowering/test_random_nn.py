"""Neural-network rules next to the random ops: fractional max pooling (given its random
samples), volumetric grid sampling, antialiased bilinear resizing, batch norm with
running-stat updates, and the chunked linear + cross-entropy custom ops.

Each case compiles one function with dynajax, compares it with eager PyTorch
(``tests.tolerances.assert_same``), and checks that the op ran in a JAX partition.
The statistics of the random ops themselves (multinomial, rrelu's slopes, dropout
variants) are in ``tests/training/test_random.py``.

    pytest -q tests/lowering/test_random_nn.py -k fractional
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F

import dynajax
from tests.helpers import Case, case_params, randn, run_case
from tests.tolerances import assert_same

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------
# Fractional max pooling, with the random samples given (F's _random_samples)
# ---------------------------------------------------------------------------------


def _ties_and_nans(*shape, dtype=torch.float32):
    x = torch.randn(*shape).round()  # many ties: the first maximum must win
    x.view(-1)[::11] = NAN  # any NaN in a window wins (the last one)
    x.view(-1)[5::13] = -INF
    return x.to(dtype)


def _fractional2d(k, out, ret=True):
    def fn(x, u):
        return F.fractional_max_pool2d(x, k, output_size=out, return_indices=ret, _random_samples=u)

    return fn


def _fractional3d(k, out, ret=True):
    def fn(x, u):
        return F.fractional_max_pool3d(x, k, output_size=out, return_indices=ret, _random_samples=u)

    return fn


FRACTIONAL = [
    Case(
        "fractional_max_pool2d-float32",
        _fractional2d(3, (4, 5)),
        lambda: (randn(2, 3, 11, 13), torch.rand(2, 3, 2)),
        ("aten.fractional_max_pool2d.default",),
    ),
    Case(
        "fractional_max_pool2d-flush-window-float64",  # output + kernel - 1 == input
        _fractional2d((2, 3), (8, 5)),
        lambda: (randn(1, 2, 9, 7, dtype=torch.float64), torch.rand(1, 2, 2, dtype=torch.float64)),
        ("aten.fractional_max_pool2d.default",),
    ),
    Case(
        "fractional_max_pool2d-ties-nan-inf-float32",
        _fractional2d(2, (5, 6)),
        lambda: (_ties_and_nans(2, 2, 12, 12), torch.rand(2, 2, 2)),
        ("aten.fractional_max_pool2d.default",),
    ),
    Case(
        "fractional_max_pool2d-unbatched-bfloat16",
        _fractional2d(3, 4),
        lambda: (randn(3, 10, 9, dtype=torch.bfloat16), torch.rand(1, 3, 2, dtype=torch.bfloat16)),
        ("aten.fractional_max_pool2d.default",),
    ),
    Case(
        "fractional_max_pool2d-float16",
        _fractional2d(2, (7, 3)),
        lambda: (randn(1, 4, 30, 9, dtype=torch.float16), torch.rand(1, 4, 2, dtype=torch.float16)),
        ("aten.fractional_max_pool2d.default",),
    ),
    Case(
        "fractional_max_pool2d-grad-float32",
        _fractional2d(3, (4, 4), ret=False),
        lambda: (randn(2, 2, 9, 10), torch.rand(2, 2, 2)),
        ("aten.fractional_max_pool2d.default", "aten.fractional_max_pool2d_backward.default"),
        grad=(0,),
    ),
    Case(
        "fractional_max_pool3d-float32",
        _fractional3d(2, (3, 4, 2)),
        lambda: (randn(2, 2, 6, 7, 5), torch.rand(2, 2, 3)),
        ("aten.fractional_max_pool3d.default",),
    ),
    Case(
        "fractional_max_pool3d-ties-nan-unbatched-float32",
        _fractional3d((2, 3, 1), (3, 2, 4)),
        lambda: (_ties_and_nans(2, 6, 7, 5), torch.rand(1, 2, 3)),
        ("aten.fractional_max_pool3d.default",),
    ),
    Case(
        "fractional_max_pool3d-bfloat16",
        _fractional3d(2, 3),
        lambda: (randn(1, 3, 8, 6, 7, dtype=torch.bfloat16), torch.rand(1, 3, 3).bfloat16()),
        ("aten.fractional_max_pool3d.default",),
    ),
    Case(
        "fractional_max_pool3d-grad-float64",
        _fractional3d(2, (2, 3, 2), ret=False),
        lambda: (randn(1, 2, 5, 6, 5, dtype=torch.float64), torch.rand(1, 2, 3).double()),
        ("aten.fractional_max_pool3d.default", "aten.fractional_max_pool3d_backward.default"),
        grad=(0,),
    ),
]

# ---------------------------------------------------------------------------------
# grid_sampler_3d
# ---------------------------------------------------------------------------------


def _grid3d(mode, padding, align, dtype=torch.float32):
    def inputs():
        x = randn(2, 3, 4, 5, 6, dtype=dtype)
        grid = (torch.rand(2, 3, 4, 5, 3) * 2.6 - 1.3).to(dtype)  # some points outside
        return x, grid

    return Case(
        f"grid_sample3d-{mode}-{padding}-{'align' if align else 'noalign'}-{str(dtype)[6:]}",
        lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align),
        inputs,
        ("aten.grid_sampler_3d.default",),
    )


GRID = [
    _grid3d(mode, padding, align)
    for mode in ("bilinear", "nearest")
    for padding in ("zeros", "border", "reflection")
    for align in (False, True)
] + [
    _grid3d("bilinear", "zeros", False, torch.float64),
    _grid3d("bilinear", "reflection", True, torch.bfloat16),
    _grid3d("nearest", "border", False, torch.float16),
]


def _grid2d(mode, padding, align, dtype):
    def inputs():
        x = randn(2, 3, 7, 9, dtype=dtype)
        grid = (torch.rand(2, 5, 6, 2) * 2.6 - 1.3).to(dtype)
        return x, grid

    return Case(
        f"grid_sample2d-{mode}-{padding}-{'align' if align else 'noalign'}-{str(dtype)[6:]}",
        lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align),
        inputs,
        ("aten.grid_sampler_2d.default",),
    )


# Half precision in 2-D: the vectorized kernel's per-step rounding, reproduced.
GRID += [
    _grid2d("bilinear", padding, align, dtype)
    for padding in ("zeros", "border", "reflection")
    for align in (False, True)
    for dtype in (torch.bfloat16, torch.float16)
] + [_grid2d("nearest", "reflection", False, torch.bfloat16)]

# Bicubic (2-D only): every padding mode, both corner conventions, and the half-precision
# per-step rounding of the same vectorized kernel.
GRID += [
    _grid2d("bicubic", padding, align, torch.float32)
    for padding in ("zeros", "border", "reflection")
    for align in (False, True)
] + [
    _grid2d("bicubic", "zeros", True, torch.float64),
    _grid2d("bicubic", "reflection", False, torch.bfloat16),
    _grid2d("bicubic", "border", True, torch.float16),
    _grid2d("bicubic", "zeros", False, torch.float16),
]

# ---------------------------------------------------------------------------------
# Antialiased bilinear resizing
# ---------------------------------------------------------------------------------


def _aa(size=None, scale=None, align=False, shape=(2, 3, 10, 20), dtype=torch.float32):
    name = f"size{size[0]}x{size[1]}" if size else f"scale{scale[0]}x{scale[1]}"

    def fn(x):
        return F.interpolate(
            x,
            size=size,
            scale_factor=scale,
            mode="bilinear",
            antialias=True,
            align_corners=align,
        )

    return Case(
        f"upsample_bilinear2d_aa-{name}-{'align' if align else 'noalign'}-{str(dtype)[6:]}",
        fn,
        lambda: (randn(*shape, dtype=dtype),),
        ("aten._upsample_bilinear2d_aa.default",),
    )


ANTIALIAS = [
    _aa(size=(3, 7)),  # downsampling both axes: stretched triangle filter
    _aa(size=(5, 20)),  # width unchanged: only the height pass
    _aa(size=(23, 41)),  # upsampling: plain bilinear weights
    _aa(size=(4, 33), align=True),
    _aa(scale=(0.37, 1.7)),
    _aa(scale=(2.5, 0.3), align=True, dtype=torch.float64),
    _aa(size=(1, 3), shape=(1, 2, 9, 1)),
    _aa(size=(7, 2), shape=(1, 1, 1, 11)),
]

# ---------------------------------------------------------------------------------
# Batch norm with running-stat updates, chunked linear cross-entropy
# ---------------------------------------------------------------------------------


def _bn_update(x, w, b, mean, var):
    out = torch.ops.aten._batch_norm_with_update(x, w, b, mean, var, 0.3, 1e-4)
    return out[0], out[1], out[2], mean, var  # mean/var were updated in place


def _lce(reduction, weight=True, ignore_index=2, bias=True):
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    opts = LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=3)

    def fn(x, w, b, t, cw):
        return F.linear_cross_entropy(
            x,
            w,
            t,
            linear_bias=b if bias else None,
            weight=cw if weight else None,
            ignore_index=ignore_index,
            reduction=reduction,
            options=opts,
        )

    op = (
        "torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default"
        if reduction == "none"
        else "torch_nn._linear_cross_entropy_batch_chunked.default"
    )
    return Case(
        f"linear_cross_entropy-chunked-{reduction}-{'weight' if weight else 'noweight'}"
        f"-ignore{ignore_index}-{'bias' if bias else 'nobias'}-float32",
        fn,
        lambda: (
            randn(7, 5),
            randn(6, 5),
            randn(6),
            torch.tensor([0, 2, 5, 1, 2, 3, 4]),
            torch.rand(6),
        ),
        (op,),
        grad=(0, 1, 2),
    )


NORM_LOSS = [
    Case(
        "batch_norm_with_update-float32",
        _bn_update,
        lambda: (randn(4, 3, 5, 5), randn(3), randn(3), randn(3), torch.rand(3) + 0.5),
        ("aten._batch_norm_with_update_functional.default",),
    ),
    # (Without weight and bias, Dynamo cannot trace the op on this torch: its fake-tensor
    # rule passes None to _select_batch_norm_backend, a graph break.)
    Case(
        "batch_norm_with_update-float64",
        _bn_update,
        lambda: tuple(
            t.double() for t in (randn(6, 2, 7), randn(2), randn(2), randn(2), torch.rand(2))
        ),
        ("aten._batch_norm_with_update_functional.default",),
    ),
    Case(
        "batch_norm_with_update-bfloat16",
        _bn_update,
        lambda: tuple(
            t.bfloat16()
            for t in (randn(4, 3, 6), randn(3), randn(3), randn(3), torch.rand(3) + 0.5)
        ),
        ("aten._batch_norm_with_update_functional.default",),
    ),
]
# The chunked linear_cross_entropy exists from torch 2.13 on.
if importlib.util.find_spec("torch.nn.modules.linear_cross_entropy_options") is not None:
    NORM_LOSS += [
        _lce("mean"),
        _lce("sum", weight=False),
        _lce("mean", ignore_index=-100, bias=False),
        _lce("none"),
        _lce("none", weight=False, ignore_index=-100),
    ]

CASES = FRACTIONAL + GRID + ANTIALIAS + NORM_LOSS


@pytest.mark.parametrize("case", case_params(CASES))
def test_rule(case: Case):
    with warnings.catch_warnings():
        # linear_cross_entropy's options are a prototype and say so.
        warnings.filterwarnings("ignore", module=r"torch\.")
        run_case(case, fullgraph=False)


# ---------------------------------------------------------------------------------
# Refusals: eager's answer, for the reason the check gives
# ---------------------------------------------------------------------------------


def test_antialias_to_width_one_with_a_new_height_falls_back():
    """PyTorch's CPU kernel misreads a width-1 result when the height changes too; the
    node stays in eager PyTorch so the compiled answer is still eager's."""
    fn = lambda x: F.interpolate(x, size=(5, 1), mode="bilinear", antialias=True)  # noqa: E731
    x = randn(1, 2, 3, 4)
    backend = dynajax.Backend()
    assert_same(torch.compile(fn, backend=backend)(x), fn(x))
    (fallback,) = dynajax.Report(backend.graphs).fallbacks
    assert str(fallback.target) == "aten._upsample_bilinear2d_aa.default"
    assert "width 1" in fallback.detail


def test_multinomial_without_replacement_of_too_many_samples_raises_as_eager():
    fn = lambda p: torch.multinomial(p, 4)  # noqa: E731
    p = torch.rand(2, 3)
    with pytest.raises(RuntimeError):
        fn(p)
    with pytest.raises(Exception, match="cannot sample"):
        torch.compile(fn, backend=dynajax.Backend())(p)

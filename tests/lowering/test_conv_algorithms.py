"""The convolution algorithms of ``lowering/conv_algorithms.py``, each forced on shapes
the shape-based choice would not give it, against PyTorch's float64 convolution; and
the choice itself, end to end with gradients, on the shapes that pick each form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dynajax
from dynajax.lowering import conv_algorithms as ca
from dynajax.runtime.conversion import to_jax, to_torch
from tests.helpers import measured_faster

# (name, input shape, weight shape, stride, padding, dilation, groups)
FORWARD = [
    ("2d", (2, 6, 7, 5), (4, 6, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ("2d-stride-dilation", (2, 6, 9, 8), (4, 3, 3, 2), (2, 3), (2, 0), (2, 1), 2),
    ("2d-kernel-wider", (3, 8, 2, 2), (5, 8, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ("depthwise-multiplier", (2, 4, 6, 6), (8, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4),
    ("1d", (2, 3, 11), (5, 3, 4), (3,), (2,), (2,), 1),
    ("3d-grouped", (1, 4, 4, 5, 3), (6, 2, 2, 3, 2), (1, 2, 1), (1, 1, 0), (1, 1, 2), 2),
]

# (name, input shape, weight shape, stride, padding, dilation, output_padding, groups)
TRANSPOSED = [
    ("2d", (2, 4, 3, 3), (4, 3, 3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1),
    ("2d-small-input", (2, 6, 2, 2), (6, 5, 4, 4), (2, 2), (1, 1), (1, 1), (0, 0), 1),
    ("2d-grouped-dilated", (1, 4, 4, 3), (4, 2, 2, 3), (1, 3), (0, 2), (2, 1), (1, 2), 2),
    ("1d-padding-past-extent", (2, 3, 2), (3, 2, 5), (1,), (0,), (1,), (0,), 1),
    ("3d", (1, 2, 2, 3, 2), (2, 3, 2, 2, 2), (2, 1, 2), (0, 1, 1), (1, 1, 1), (1, 0, 1), 1),
]


def _expected(x, w, transposed, stride, padding, dilation, groups, output_padding=None):
    nd = w.ndim - 2
    conv = [F.conv1d, F.conv2d, F.conv3d][nd - 1]
    if transposed:
        conv = [F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d][nd - 1]
        return conv(x, w, None, stride, padding, output_padding, groups, dilation)
    return conv(x, w, None, stride, padding, dilation, groups)


@pytest.mark.parametrize("form", ["matmul", "tap_sum", "xla"])
@pytest.mark.parametrize("case", FORWARD, ids=[c[0] for c in FORWARD])
def test_convolution_forms_match_pytorch(case, form):
    _, xs, ws, stride, padding, dilation, groups = case
    x = torch.randn(xs, dtype=torch.float64)
    w = torch.randn(ws, dtype=torch.float64)
    expected = _expected(x, w, False, stride, padding, dilation, groups)
    out = list(expected.shape[2:])
    with jax.enable_x64(True):
        args = (to_jax(x), to_jax(w), list(stride), list(padding), list(dilation), groups)
        if form == "matmul":
            actual = ca.matmul_convolution(*args, out, jnp.float64)
        elif form == "tap_sum":
            actual = ca.tap_sum_convolution(*args, out, jnp.float64)
        else:
            actual = ca.xla_convolution(*args, jnp.float64)
    torch.testing.assert_close(to_torch(actual), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["col2im", "xla"])
@pytest.mark.parametrize("case", TRANSPOSED, ids=[c[0] for c in TRANSPOSED])
def test_transposed_forms_match_pytorch(case, form):
    _, xs, ws, stride, padding, dilation, output_padding, groups = case
    x = torch.randn(xs, dtype=torch.float64)
    w = torch.randn(ws, dtype=torch.float64)
    expected = _expected(x, w, True, stride, padding, dilation, groups, output_padding)
    with jax.enable_x64(True):
        args = (to_jax(x), to_jax(w)) + tuple(
            list(v) for v in (stride, padding, dilation, output_padding)
        )
        if form == "col2im":
            actual = ca.col2im_transposed(*args, groups, jnp.float64)
        else:
            actual = ca.xla_transposed(*args, groups, jnp.float64)
    torch.testing.assert_close(to_torch(actual), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "form,fn,xs,ws",
    [
        # ResNet's last stage: a 3x3 kernel over a 2x2 map (matmul, kernel wider)
        ("matmul_convolution", lambda x, w: F.conv2d(x, w, padding=1), (2, 8, 2, 2), (8, 8, 3, 3)),
        # MobileNet/ConvNeXt depthwise (tap sum)
        (
            "tap_sum_convolution",
            lambda x, w: F.conv2d(x, w, padding=3, groups=8),
            (2, 8, 9, 9),
            (8, 1, 7, 7),
        ),
        # a decoder's first upsampling of a 2x2 map (col2im)
        (
            "col2im_transposed",
            lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1),
            (2, 8, 2, 2),
            (8, 4, 4, 4),
        ),
        # large patches stay on XLA's convolution
        ("xla_convolution", lambda x, w: F.conv2d(x, w, padding=1), (4, 16, 96, 96), (4, 16, 3, 3)),
    ],
)
def test_each_form_trains_through_the_backend(form, fn, xs, ws, monkeypatch):
    chosen = []
    for name in (
        "matmul_convolution",
        "tap_sum_convolution",
        "col2im_transposed",
        "xla_convolution",
        "xla_transposed",
    ):
        original = getattr(ca, name)

        def spy(*args, _name=name, _original=original):
            chosen.append(_name)
            return _original(*args)

        monkeypatch.setattr(ca, name, spy)
    torch.manual_seed(0)
    x = torch.randn(xs, requires_grad=True)
    w = torch.randn(ws, requires_grad=True)
    expected = fn(x, w)
    expected.square().sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    backend = dynajax.Backend()
    with measured_faster("xla"):  # (each form in JAX is the point, on any CPU)
        actual = torch.compile(fn, backend=backend)(x, w)
        actual.square().sum().backward()
    assert dynajax.Report(backend.graphs).fallbacks == []
    assert chosen and set(chosen) == {form}, chosen  # forward and its VJP alike
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, grads[0], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.grad, grads[1], rtol=1e-4, atol=1e-3)


def test_half_precision_forms_accumulate_in_float32():
    # 2**k + 1 + 1: each form sums in float32 and rounds once (2**k + 2 is exact in
    # bfloat16 with k = 8); a bfloat16 accumulator would give 2**k.
    k = 8
    x = torch.ones(1, 3, 1, 1, dtype=torch.bfloat16)
    w = torch.tensor([2.0**k, 1.0, 1.0], dtype=torch.bfloat16).reshape(1, 3, 1, 1)
    args = (to_jax(x), to_jax(w), [1, 1], [0, 0], [1, 1], 1)
    for out in (
        ca.matmul_convolution(*args, [1, 1], jnp.float32),
        ca.tap_sum_convolution(*args, [1, 1], jnp.float32),
    ):
        assert out.dtype == jnp.float32
        assert np.asarray(out).item() == 2.0**k + 2


@pytest.mark.parametrize(
    "xs,ws,stride,groups,form",
    [
        ((8, 512, 2, 2), (512, 512, 3, 3), 1, 1, "matmul"),  # kernel wider than the map
        ((8, 64, 16, 16), (128, 64, 3, 3), 2, 1, "matmul"),  # small patches
        ((8, 64, 32, 32), (64, 64, 3, 3), 1, 1, "xla"),  # 4.7M patch elements
        ((8, 96, 56, 56), (96, 1, 7, 7), 1, 96, "tap_sum"),  # depthwise
        ((8, 256, 4, 4), (256, 16, 3, 3), 1, 16, "matmul"),  # 16 x 9 terms: too many
        ((8, 256, 8, 8), (256, 16, 3, 3), 1, 16, "xla"),  # and 1.2M patch elements
        ((0, 3, 8, 8), (4, 3, 3, 3), 1, 1, "xla"),  # empty batch
        ((2, 16, 16, 16, 16), (16, 16, 3, 3, 3), 1, 1, "matmul"),  # 3-D: 3.5M elements
        ((1, 32, 32, 32, 32), (32, 32, 3, 3, 3), 1, 1, "xla"),  # 28M elements
    ],
)
def test_choice_by_shape(xs, ws, stride, groups, form):
    nd = len(ws) - 2
    assert ca.choose(xs, ws, [stride] * nd, [1] * nd, [1] * nd, groups) == form


def test_choice_under_symbolic_batch():
    # jax.export's shape polymorphism: a form is chosen only if it suits every size the
    # symbolic batch may take (within its declared bounds); else XLA's convolution.
    ws, ones = (128, 64, 3, 3), [1, 1]
    (b,) = jax.export.symbolic_shape("b")
    assert ca.choose((b, 64, 16, 16), ws, [2, 2], ones, ones, 1) == "xla"
    (b,) = jax.export.symbolic_shape("b", constraints=["b <= 8"])
    assert ca.choose((b, 64, 16, 16), ws, [2, 2], ones, ones, 1) == "matmul"
    assert ca.choose((b, 512, 2, 2), (512, 512, 3, 3), ones, ones, ones, 1) == "matmul"
    assert ca.choose((b, 96, 56, 56), (96, 1, 7, 7), ones, ones, ones, 96) == "tap_sum"
    assert ca.choose_transposed((b, 64, 16, 16), (64, 32, 4, 4), [2, 2], 2) == "xla"
    assert ca.choose_transposed((b, 512, 2, 2), (512, 256, 4, 4), [2, 2], 1) == "col2im"


def test_transposed_choice_by_shape():
    # kernel wider than the dilated input; small columns; 2.1M column elements
    assert ca.choose_transposed((8, 512, 2, 2), (512, 256, 4, 4), [2, 2], 1) == "col2im"
    assert ca.choose_transposed((1, 4, 5, 5, 5), (4, 8, 3, 3, 3), [1, 1, 1], 1) == "col2im"
    assert ca.choose_transposed((8, 64, 16, 16), (64, 32, 4, 4), [2, 2], 2) == "xla"
    assert ca.choose_transposed((2, 64, 8, 8, 8), (64, 64, 4, 4, 4), [2, 2, 2], 1) == "col2im"


@pytest.mark.parametrize(
    "xs,ws,stride,padding,dilation,groups",
    [
        ((2, 4, 7, 6, 5), (6, 4, 3, 3, 2), 2, 1, 1, 1),  # 3-D, strided: drops rows
        ((1, 4, 9, 8, 7), (4, 2, 3, 2, 3), (1, 2, 3), (0, 1, 2), (2, 1, 1), 2),
        ((3, 6, 11, 10), (4, 3, 3, 3), 3, 2, 1, 2),  # 2-D, forced the same way
        ((5, 9, 8), (3, 5, 3, 3), 2, 1, 1, 1),  # unbatched
    ],
)
def test_input_gradient_by_col2im_matches_pytorch(
    xs, ws, stride, padding, dilation, groups, monkeypatch
):
    # Thresholds set so the forward stays on XLA's form and its input gradient goes
    # through col2im (the 3-D case of real sizes), against PyTorch's gradients.
    monkeypatch.setattr(ca, "MATMUL_ELEMENTS", 0)
    monkeypatch.setattr(ca, "MATMUL_ELEMENTS_3D", 0)
    monkeypatch.setattr(ca, "TAP_SUM_TERMS", 0)
    monkeypatch.setattr(ca, "COL2IM_ELEMENTS", 1 << 30)
    used = []
    original = ca.col2im_transposed
    monkeypatch.setattr(ca, "col2im_transposed", lambda *a: (used.append(1), original(*a))[1])
    nd = len(ws) - 2
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]

    def fn(x, w):
        return conv(x, w, None, stride, padding, dilation, groups)

    torch.manual_seed(0)
    x = torch.randn(xs, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ws, dtype=torch.float64, requires_grad=True)
    g = torch.randn(fn(x, w).shape, dtype=torch.float64)
    expected = torch.autograd.grad(fn(x, w), (x, w), g)
    backend = dynajax.Backend()
    with measured_faster("xla"):  # (col2im in JAX is the point, on any CPU)
        actual = torch.autograd.grad(torch.compile(fn, backend=backend)(x, w), (x, w), g)
    assert dynajax.Report(backend.graphs).fallbacks == []
    assert used, "the input gradient did not take col2im"
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def test_a_convolution_over_zero_input_channels_runs_in_pytorch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eager's convolution of an input with no channels has no channels either (conv1d
    of (3, 0, 2) by a (2, 0, 1) weight is (3, 0, 2)): the forward and its gradient run
    by PyTorch's kernel, refused by the check rather than by a rule that raises (fuzz seed
    8)."""

    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, w, b, stride=2, padding=1)

    w, b = torch.randn(2, 0, 1), torch.randn(2)
    for shape in [(0, 2), (3, 0, 2)]:
        torch._dynamo.reset()
        x = torch.randn(shape, requires_grad=True)
        mine = x.detach().clone().requires_grad_()
        backend = dynajax.Backend(cache_dir="")
        out = torch.compile(conv, backend=backend)(mine, w, b)
        expected = conv(x, w, b)
        assert out.shape == expected.shape
        out.sum().backward()
        expected.sum().backward()
        assert mine.grad is not None and mine.grad.shape == x.shape
        # (PyTorch's kernel, inside the partition or between partitions)
        reasons = [f.detail for g in backend.graphs for f in [*g.kernels, *g.fallbacks]]
        assert any("zero input channels" in r for r in reasons), reasons
    assert not [r for r in caplog.records if "probably wrong" in r.getMessage()]


# -- precision: eager's convolutions on a GPU are cuDNN's, TF32 by default ---------------


def _precisions(make, conv: str | None) -> list[str]:
    """The precision of every product in the program ``make()`` lowers to, with the
    matmul precision at "highest" and the convolutions at ``conv``. A new function per
    call: JAX reuses a function's trace, and the setting is not part of its key."""
    import re

    x = jax.ShapeDtypeStruct((2, 3, 8, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 3, 3, 3), jnp.float32)
    with jax.default_matmul_precision("highest"), ca.for_convolutions(conv):
        text = jax.jit(make()).lower(x, w).as_text()
    return re.findall(r"precision (\w+)>|precision = \[(\w+)", text)


FORMS = {
    "xla": lambda: lambda x, w: ca.xla_convolution(x, w, [1, 1], [1, 1], [1, 1], 1, jnp.float32),
    "matmul": lambda: (
        lambda x, w: ca.matmul_convolution(x, w, [1, 1], [1, 1], [1, 1], 1, [8, 8], jnp.float32)
    ),
    "xla-transposed": lambda: (
        lambda x, w: ca.xla_transposed(
            x, w.transpose(1, 0, 2, 3), [2, 2], [1, 1], [1, 1], [1, 1], 1, jnp.float32
        )
    ),
    "col2im": lambda: (
        lambda x, w: ca.col2im_transposed(
            x, w.transpose(1, 0, 2, 3), [2, 2], [1, 1], [1, 1], [1, 1], 1, jnp.float32
        )
    ),
    # the backward of a convolution: JAX's transposes keep the forward's precision
    "gradients": lambda: (
        lambda x, w: jax.grad(
            lambda x, w: ca.xla_convolution(x, w, [2, 2], [1, 1], [1, 1], 1, jnp.float32).sum(),
            argnums=(0, 1),
        )(x, w)
    ),
}


@pytest.mark.parametrize("form", FORMS)
def test_convolutions_take_their_own_precision(form) -> None:
    found = [a or b for a, b in _precisions(FORMS[form], "tensorfloat32")]
    assert found and set(found) == {"HIGH"}, found  # JAX's name for TF32
    found = [a or b for a, b in _precisions(FORMS[form], None)]
    assert found and set(found) == {"HIGHEST"}, found  # the matmul precision


def test_conv_precision_follows_cudnn_on_cuda_only() -> None:
    from dynajax.lowering.precision import conv_precision

    assert torch.backends.cudnn.allow_tf32  # PyTorch's default
    assert conv_precision(on_cuda=True) == "tensorfloat32"
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        assert conv_precision(on_cuda=True) == "highest"
    assert conv_precision(on_cuda=False) == "highest"  # oneDNN: float32
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert conv_precision(on_cuda=False) == "tensorfloat32"  # as before: the matmul's
    finally:
        torch.set_float32_matmul_precision(saved)

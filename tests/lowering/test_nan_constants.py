"""NaNs known at compile time: XLA's CPU ``exp`` of one stores garbage, and dynajax
guards the nodes that can carry one (``dynajax/lowering/nan_constants.py``)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dynajax
from dynajax.lowering.nan_constants import carrying_nan_constants
from tests.helpers import assert_no_fallbacks, compare_with_eager

NAN = float("nan")

# Each reads x + nan, a NaN that XLA knows while it compiles, fused with an input.
_READERS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("exp", torch.exp),
    ("exp2", torch.exp2),
    ("expm1", torch.expm1),
    ("sinh", torch.sinh),
    ("cosh", torch.cosh),
    ("sigmoid", torch.sigmoid),
    ("softmax", lambda v: torch.softmax(v, -1)),
    ("log_softmax", lambda v: torch.log_softmax(v, -1)),
    ("logsumexp", lambda v: torch.logsumexp(v, -1)),
    ("gelu", F.gelu),
    ("silu", F.silu),
    ("elu", F.elu),
    ("softplus", F.softplus),
    ("mish", F.mish),
    ("erf", torch.erf),
    ("erfc", torch.erfc),
    ("i0", torch.i0),
    ("i1e", torch.special.i1e),
    ("logaddexp", lambda v: torch.logaddexp(v, torch.ones_like(v))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [f for _, f in _READERS], ids=[n for n, _ in _READERS])
def test_a_nan_argument_read_by_an_exp(fn: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
    x = torch.linspace(-2, 2, 16, dtype=dtype).reshape(2, 8)
    report = compare_with_eager(lambda v: fn(v + NAN), x)
    assert_no_fallbacks(report)


def test_the_mean_of_an_empty_tensor_read_by_logaddexp() -> None:
    # Fuzz seed 7, program 4156: eager NaN, dynajax -1.1e-4 (float16), 5.8e16 (float32).
    def program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.logaddexp(torch.mean(x), y)

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        compare_with_eager(
            program, torch.zeros(1, 1, 0, dtype=dtype), torch.tensor(-0.3, dtype=dtype)
        )


def test_zero_over_zero_made_in_the_program() -> None:
    compare_with_eager(lambda x: torch.exp(x + torch.zeros(4) / torch.zeros(4)), torch.ones(4))


def test_the_gradient_of_an_exp_of_a_nan_constant() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        return torch.sinh(x * NAN).sum()

    x = torch.linspace(-1, 1, 8)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.compile(program, backend=dynajax.Backend(cache_dir=""))(mine).backward()
    program(theirs).backward()
    assert mine.grad is not None and theirs.grad is not None
    assert torch.equal(mine.grad.isnan(), theirs.grad.isnan())


def test_a_value_check_inside_a_guarded_rule_raises_eagers_error() -> None:
    def program(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.exp((x + NAN).index_select(0, i))

    x = torch.ones(4)
    compare_with_eager(program, x, torch.tensor([0, 3]))
    with pytest.raises(IndexError) as eager:
        program(x, torch.tensor([5]))
    compiled = torch.compile(program, backend=dynajax.Backend(cache_dir=""))
    with pytest.raises(IndexError) as mine:
        compiled(x, torch.tensor([5]))
    assert str(eager.value) in str(mine.value)


def _graph(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.fx.Graph:
    return torch.fx.experimental.proxy_tensor.make_fx(fn)(*args).graph


def _carrying(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> set[str]:
    return {str(n.target) for n in carrying_nan_constants(_graph(fn, *args))}


def test_a_causal_mask_carries_no_nan() -> None:
    # The masks of attention layers are known at compile time but made without
    # arithmetic on floats: their readers (the softmax) stay unguarded, at full speed.
    def attention(scores: torch.Tensor) -> torch.Tensor:
        t = scores.shape[-1]
        pos = torch.arange(t)
        mask = torch.full((t, t), float("-inf")).masked_fill(pos[:, None] >= pos[None, :], 0.0)
        return torch.softmax(scores + mask, -1)

    assert _carrying(attention, torch.randn(2, 4, 4)) == set()


def test_known_values_that_can_be_nan_are_carried_to_their_readers() -> None:
    def zero_over_zero(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x + torch.zeros(3) / torch.zeros(3))

    assert _carrying(zero_over_zero, torch.ones(3)) == {
        "aten.div.Tensor",
        "aten.add.Tensor",
        "aten.exp.default",
    }

    def mean_of_nothing(x: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x - empty.mean())

    assert _carrying(mean_of_nothing, torch.ones(3), torch.ones(0)) >= {
        "aten.mean.default",
        "aten.sigmoid.default",
    }
    assert _carrying(lambda x: torch.exp(x * 2.0 + 1.0), torch.ones(3)) == set()


def test_xla_still_needs_the_guard() -> None:
    """The XLA bug the guard works around, in plain JAX. When a jaxlib fixes it, this
    fails: then the guard (and this module) can go."""
    y = jnp.full((16,), -0.25, jnp.float32)
    out = np.asarray(jax.jit(lambda v: jnp.exp(v + jnp.nan))(y))
    assert not np.isnan(out).all()

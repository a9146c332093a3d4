"""Products read transposed and batch-broadcast operands in place
(``dynajax/lowering/transposes.py``).

Each case traces a function to an ATen graph, lowers it with ``to_jax_function`` and
checks two things: the answer is eager's (within the tolerance table), and the traced
JAX program's ``dot_general`` contracts the untransposed operand (no ``transpose``
feeding it) where the folding should apply, and is a plain matmul where it should not:
a swap that is not of the last two dimensions, a view that moves them, an integer op
on the transpose. A batch that repeats one matrix (``bmm(x, expand(w))``) is read as
that matrix: the dot has no batch dimension and no broadcast feeds it.

    pytest -q tests/lowering/test_transposes.py
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dynajax.lowering import transposes
from dynajax.lowering.interpreter import to_jax_function
from tests.tolerances import assert_same


def _linear(x, w):
    return torch.nn.functional.linear(x, w)  # mm(x, t(w))


def _weight_grad(g, x):
    return g.t() @ x  # mm(t(g), x)


def _attention_scores(q, k):
    # As SDPA's math decomposition reaches bmm: a permute, a scale, an expand, a view.
    kt = k.permute(0, 1, 3, 2) * 0.5
    return (q.expand(1, 4, 3, 8).reshape(4, 3, 8) @ kt.expand(1, 4, 8, 5).reshape(4, 8, 5)).view(
        1, 4, 3, 5
    )


def _batched_transpose(a, b):
    return torch.bmm(a, b.transpose(1, 2))


def _not_a_swap(a, b):
    # permute(0, 2, 1) of a 3-D tensor swaps the last two dims; (1, 0, 2) does not.
    return torch.bmm(a.permute(1, 0, 2), b)


def _moved_by_a_view(a, b):
    # The transpose's last two dims are reshaped: no longer a swap of a's.
    return a.t().reshape(8, 3) @ b


def _batch_times_matrix(x, w):
    # A non-contiguous batch @ a matrix: expand(w, [4, 6, 5]), view, bmm.
    return x.transpose(0, 1) @ w


def _batch_times_transposed_matrix(x, w):
    return torch.bmm(x, w.t().unsqueeze(0).expand(3, 8, 5))


def _matrix_times_batch(w, x):
    return torch.bmm(w.expand(3, 5, 8), x)


def _transposed_matrix_times_transposed_batch(w, x, bias):
    # Leading views of the expand (as attention's repeated keys), then baddbmm.
    left = w.t().expand(2, 3, 5, 8).reshape(6, 5, 8)
    return torch.baddbmm(bias, left, x.transpose(1, 2), alpha=0.5)


def _partly_broadcast(a, b):
    # b's leading dims are (1, 2): expanded along the first only, not one matrix.
    return torch.bmm(a, b.expand(3, 2, 8, 5).reshape(6, 8, 5))


def _both_broadcast(a, b):
    return torch.bmm(a.expand(3, 4, 8), b.expand(3, 8, 5))


CASES = {
    "linear": (_linear, [(1, 16), (32, 16)], True),
    "linear-batch": (_linear, [(6, 16), (32, 16)], True),
    "weight-grad": (_weight_grad, [(6, 16), (6, 12)], True),
    "attention-scores": (_attention_scores, [(1, 4, 3, 8), (1, 4, 5, 8)], True),
    "bmm-transposed": (_batched_transpose, [(3, 4, 8), (3, 5, 8)], True),
    "permute-not-a-swap": (_not_a_swap, [(4, 3, 8), (3, 8, 5)], False),
    "view-moves-dims": (_moved_by_a_view, [(6, 4), (3, 5)], False),
}

BROADCAST_CASES = {
    "batch-times-matrix": (_batch_times_matrix, [(8, 4, 6), (6, 5)], True),
    "batch-times-transposed-matrix": (_batch_times_transposed_matrix, [(3, 4, 8), (5, 8)], True),
    "matrix-times-batch": (_matrix_times_batch, [(5, 8), (3, 8, 4)], True),
    "transposed-matrix-times-transposed-batch": (
        _transposed_matrix_times_transposed_batch,
        [(8, 5), (6, 4, 8), (6, 5, 4)],
        True,
    ),
    "partly-broadcast": (_partly_broadcast, [(6, 4, 8), (1, 2, 8, 5)], False),
    "both-broadcast": (_both_broadcast, [(4, 8), (8, 5)], False),
}


def _folded_dots(jaxpr) -> int:
    """How many dot_general equations contract other than a plain matmul's dims (the
    lhs's last with the rhs's second-to-last): the folded ones."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), _ = eqn.params["dimension_numbers"]
            n = len(eqn.invars[0].aval.shape)
            count += (tuple(lc), tuple(rc)) != ((n - 1,), (n - 2,))
    return count


def _into_dots(jaxpr, primitive: str = "transpose", ndim: int | None = None) -> int:
    """How many dot_general operands (of ``ndim`` dimensions, if given) are the output
    of a ``primitive`` equation."""
    made_by = {}
    count = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            made_by[v] = eqn.primitive.name
        if eqn.primitive.name == "dot_general":
            count += sum(
                made_by.get(v) == primitive and ndim in (None, len(v.aval.shape))
                for v in eqn.invars
            )
    return count


def _batched_dots(jaxpr) -> int:
    """How many dot_general equations have batch dimensions."""
    return sum(
        bool(eqn.params["dimension_numbers"][1][0])
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "dot_general"
    )


def _lowered(fn, args):
    """``fn``'s answer on ``args`` through the lowering, and its jaxpr."""
    gm = make_fx(lambda *a: (fn(*a),))(*args)  # graphs return tuples, as aot's do
    lowered = to_jax_function(gm)
    arrays = [a.numpy() for a in args]
    with jax.enable_x64(True):
        out = jax.jit(lowered)(*arrays)
        jaxpr = jax.make_jaxpr(lowered)(*arrays).jaxpr
    return torch.from_numpy(np.array(out[0])), jaxpr


def _lowered_as_eager(fn, shapes, dtype):
    """The jaxpr of ``fn`` lowered on random inputs of ``shapes``, after checking that
    its answer is eager's."""
    torch.manual_seed(0)
    args = [torch.randn(s, dtype=dtype) for s in shapes]
    out, jaxpr = _lowered(fn, args)
    assert_same(out, fn(*args))
    return jaxpr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(CASES))
def test_products_fold_transposes(name: str, dtype: torch.dtype) -> None:
    fn, shapes, folded = CASES[name]
    jaxpr = _lowered_as_eager(fn, shapes, dtype)
    if folded:
        assert _into_dots(jaxpr) == 0 and _folded_dots(jaxpr) > 0, jaxpr
    else:
        assert _folded_dots(jaxpr) == 0, jaxpr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(BROADCAST_CASES))
def test_products_read_one_matrix_of_a_batch(name: str, dtype: torch.dtype) -> None:
    fn, shapes, one_matrix = BROADCAST_CASES[name]
    jaxpr = _lowered_as_eager(fn, shapes, dtype)
    if one_matrix:
        assert _batched_dots(jaxpr) == 0 and _into_dots(jaxpr, "broadcast_in_dim") == 0, jaxpr
        assert _into_dots(jaxpr, ndim=2) == 0, jaxpr  # a transposed matrix read in place
    else:
        assert _batched_dots(jaxpr) > 0, jaxpr


def test_nothing_is_noted_outside_a_trace() -> None:
    x = jax.numpy.ones((2, 3))
    xt = x.T
    transposes.note(torch.ops.aten.t.default, (x,), xt)
    assert transposes.source(xt) == (xt, False)


def test_a_rule_handing_back_its_input_is_not_a_transpose() -> None:
    x = jax.numpy.ones((3, 3))
    with transposes.tracing():
        transposes.note(torch.ops.aten.t.default, (x,), x)
        assert transposes.source(x) == (x, False)


@pytest.mark.parametrize(
    "name, fn, folded",
    [
        ("int64-weight-grad", lambda g, x: g.t() @ x, True),
        # An integer op on a transpose is not moved onto its source: an integer
        # division's rule states a value check, which would then be stated twice.
        ("int64-scaled", lambda g, x: (g.t() * 3) @ x, False),
    ],
    ids=["int64-weight-grad", "int64-scaled"],
)
def test_integer_products(name, fn, folded) -> None:
    g = torch.randint(-5, 5, (6, 4))
    x = torch.randint(-5, 5, (6, 3))
    out, jaxpr = _lowered(fn, [g, x])
    assert_same(out, fn(g, x))  # integers: exact
    assert (_folded_dots(jaxpr) > 0) == folded, jaxpr

"""ComputeSizesFromInputs (``dynajax/passes/sizes.py``) on ATen graphs traced with
symbolic sizes: a size read off an intermediate tensor (``sym_size.int(cat, 1)``)
becomes host arithmetic on the inputs' sizes, and the module gives the same values at
every size.

    pytest -q tests/passes/test_sizes.py -k cat
"""

from __future__ import annotations

import operator

import pytest
import torch

from dynajax.passes.sizes import ComputeSizesFromInputs
from tests.helpers import GraphCase, check_pass, run_graph, trace
from tests.tolerances import assert_same

SYM_SIZE, ADD, MUL = "aten.sym_size.int", "operator.add", "operator.mul"


def _kv_cache_step(cache, new):
    # The length of the cache after cat, as a decoder step asks for it.
    c = torch.cat([cache, new], dim=1)
    return c.view(c.shape[0] * c.shape[1], -1) * 2, c.sum()


def _doubled_rows(x):
    c = torch.cat([x, x], dim=0)
    return c.view(c.shape[0], -1).cos()


def _concatenated_twice(a, b):
    c = torch.cat([a, b], dim=1)
    d = torch.cat([c, c], dim=1)  # width 2*s1 + 2*s2
    return d.view(d.shape[0] * d.shape[1]) + 1


def _every_other_row(x):
    y = x[::2] * 2  # (s0 + 1) // 2 rows: not a sum or product of input sizes
    return y.view(y.shape[0] * 3)


def _sizes_of_inputs_only(x):
    return x.view(x.shape[0] * x.shape[1]).exp()


SIZES = [
    GraphCase(
        "cat-length-is-a-sum",
        _kv_cache_step,
        lambda: [
            (torch.randn(2, 3, 4), torch.randn(2, 1, 4)),
            (torch.randn(3, 7, 4), torch.randn(3, 1, 4)),
        ],
        {SYM_SIZE: 2, ADD: 0},
        after={SYM_SIZE: 2, ADD: 1},  # sym_size(cat, 1) -> sym_size(cache, 1) + 1
        modified=True,
        tracing_mode="symbolic",
    ),
    GraphCase(
        "cat-rows-are-a-product",
        _doubled_rows,
        lambda: [(torch.randn(3, 5),), (torch.randn(6, 2),)],
        {SYM_SIZE: 1, MUL: 0},
        after={SYM_SIZE: 1, MUL: 1},  # sym_size(cat, 0) -> 2 * sym_size(x, 0)
        modified=True,
        tracing_mode="symbolic",
    ),
    GraphCase(
        "width-is-a-sum-of-products",
        _concatenated_twice,
        lambda: [
            (torch.randn(2, 3), torch.randn(2, 4)),
            (torch.randn(5, 1), torch.randn(5, 2)),
        ],
        {SYM_SIZE: 2, ADD: 0, MUL: 1},  # rows of a, width of d; their product
        after={SYM_SIZE: 3, ADD: 1, MUL: 3},  # width of d: 2 * width of b + 2 * width of a
        modified=True,
        tracing_mode="symbolic",
    ),
    GraphCase(
        "floor-division-left-as-is",
        _every_other_row,
        lambda: [(torch.randn(7, 3),), (torch.randn(10, 3),)],
        {SYM_SIZE: 1},
        tracing_mode="symbolic",
    ),
    GraphCase(
        "sizes-of-inputs-left-as-they-are",
        _sizes_of_inputs_only,
        lambda: [(torch.randn(2, 3),), (torch.randn(4, 5),)],
        {SYM_SIZE: 2},
        tracing_mode="symbolic",
    ),
]


def _size_sources(gm: torch.fx.GraphModule) -> list[str]:
    """The op of the tensor each ``sym_size.int`` node reads its size off."""
    return [
        n.args[0].op if n.args[0].op == "placeholder" else str(n.args[0].target)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int
    ]


@pytest.mark.parametrize("case", SIZES, ids=[c.id for c in SIZES])
def test_compute_sizes_from_inputs(case: GraphCase) -> None:
    gm = check_pass(ComputeSizesFromInputs(), case)
    if case.modified:  # no size is read off an intermediate tensor any more
        assert set(_size_sources(gm)) == {"placeholder"}, gm.graph


def test_a_symint_input_is_used_as_it_is() -> None:
    """Graphs from Dynamo take the sizes as SymInt inputs first: the size of the cat is
    built from that input itself, with no sym_size node at all."""
    case = SIZES[0]
    gm, inputs = trace(case)
    cache = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_before(cache):
        length = gm.graph.placeholder("length")
    length.meta["val"] = cache.meta["val"].shape[1]
    gm.recompile()
    inputs = [(args[0].shape[1], *args) for args in inputs]
    expected = run_graph(gm, inputs)
    assert ComputeSizesFromInputs()(gm).modified
    gm.graph.lint()
    gm.recompile()
    [add] = [n for n in gm.graph.nodes if n.target is operator.add]
    assert add.args == (1, length)
    assert _size_sources(gm) == ["placeholder"]  # the batch size, of the cache
    assert_same(run_graph(gm, inputs), expected)

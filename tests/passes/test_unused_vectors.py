"""DropUnusedVectors (``dynajax/passes/unused_vectors.py``) on ATen graphs traced with
fake tensors, as Dynamo traces them: SVD and eigh nodes whose vectors nobody reads are
asked for values only, and the values stay the same.

    pytest -q tests/passes/test_unused_vectors.py -k svd
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dynajax.passes.unused_vectors import DropUnusedVectors
from tests.helpers import GraphCase, check_pass, draws

aten = torch.ops.aten

SVD, EIGH, GETITEM = "aten._linalg_svd.default", "aten._linalg_eigh.default", "operator.getitem"


def _dead_code_first(gm: torch.fx.GraphModule) -> None:
    """The getitems of the unused vectors go first (the pipeline runs dead-code
    elimination before this pass)."""
    gm.graph.eliminate_dead_code()


def _matrices():
    return (torch.randn(4, 3, dtype=torch.float64),)


def _symmetric():
    a = torch.randn(4, 4, dtype=torch.float64)
    return (a + a.mT,)


VECTORS = [
    GraphCase(
        "svdvals",
        torch.linalg.svdvals,
        draws(_matrices),
        {SVD: 1, GETITEM: 1},
        modified=True,
        tracing_mode="fake",
    ),
    GraphCase(
        "eigvalsh",
        torch.linalg.eigvalsh,
        draws(_symmetric),
        {EIGH: 1, GETITEM: 1},
        modified=True,
        tracing_mode="fake",
    ),
    GraphCase(
        "matrix-rank-and-cond",
        lambda a: (torch.linalg.matrix_rank(a), torch.linalg.cond(a)),
        draws(_matrices),
        {SVD: 2},
        modified=True,
        tracing_mode="fake",
    ),
    GraphCase(
        "svd-flag-given-positionally",
        lambda a: aten._linalg_svd.default(a, False, True)[1] * 2,
        draws(_matrices),
        {SVD: 1},
        modified=True,
        tracing_mode="fake",
    ),
    GraphCase(
        "svd-vectors-read-kept",
        lambda a: (lambda u, s, vh: (u.abs(), s))(*torch.linalg.svd(a, full_matrices=False)),
        draws(_matrices),
        {SVD: 1},
        tracing_mode="fake",
    ),
    GraphCase(
        "eigh-vectors-read-kept",
        lambda a: torch.linalg.eigh(a).eigenvectors.abs().sum(-1),
        draws(_symmetric),
        {EIGH: 1},
        tracing_mode="fake",
    ),
    GraphCase(
        "already-values-only",
        lambda a: aten._linalg_svd.default(a, False, False)[1],
        draws(_matrices),
        {SVD: 1},
        tracing_mode="fake",
    ),
]


def _vectors_requested(node: torch.fx.Node) -> bool:
    name = "compute_uv" if str(node.target) == SVD else "compute_v"
    return node.kwargs.get(name, node.args[2] if len(node.args) > 2 else True)


def _decompositions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if str(n.target) in (SVD, EIGH)]


@pytest.mark.parametrize("case", VECTORS, ids=[c.id for c in VECTORS])
def test_drop_unused_vectors(case: GraphCase) -> None:
    gm = check_pass(DropUnusedVectors(), case, prepare=_dead_code_first)
    if not case.modified:
        return
    for node in _decompositions(gm):
        assert not _vectors_requested(node), node.format_node()
        # The fake value follows: values only, empty vectors.
        vectors = node.meta["val"][0 if str(node.target) == SVD else 1]
        assert vectors.numel() == 0, node.meta["val"]


def test_unused_getitems_of_the_vectors_still_count_as_readers() -> None:
    """Without dead-code elimination first, make_fx's getitems of U and Vh (no users)
    are readers of the vectors: the pass leaves the node alone."""
    case = VECTORS[0]
    unchanged = dataclasses.replace(case, before={SVD: 1, GETITEM: 3}, after=None, modified=False)
    check_pass(DropUnusedVectors(), unchanged)

"""RemoveNoopOps and EliminateDeadCode (``dynajax/passes/noop.py``) on small traced ATen
graphs: which ops the pass leaves, and that the module computes what it did before.

    pytest -q tests/passes/test_noop.py -k alias
"""

from __future__ import annotations

import pytest
import torch

from dynajax.passes.noop import EliminateDeadCode, RemoveNoopOps
from tests.helpers import GraphCase, check_pass, draws

aten = torch.ops.aten


# ---------------------------------------------------------------------------------
# RemoveNoopOps: alias and detach vanish, unless they feed the output
# ---------------------------------------------------------------------------------

ALIAS, DETACH, SIN = "aten.alias.default", "aten.detach.default", "aten.sin.default"

NOOP = [
    GraphCase(
        "alias-before-sin",
        lambda x: aten.alias.default(x).sin(),
        draws(lambda: (torch.randn(3, 4),)),
        {ALIAS: 1, SIN: 1},
        after={ALIAS: 0, SIN: 1},
        modified=True,
    ),
    GraphCase(
        "detach-before-sin",
        lambda x: x.detach().sin() * 2,
        draws(lambda: (torch.randn(5),)),
        {DETACH: 1, SIN: 1},
        after={DETACH: 0, SIN: 1},
        modified=True,
    ),
    GraphCase(
        "alias-of-detach-chain",
        lambda x, y: aten.alias.default(x.detach()).cos() + y,
        draws(lambda: (torch.randn(4), torch.randn(4))),
        {ALIAS: 1, DETACH: 1},
        after={ALIAS: 0, DETACH: 0},
        modified=True,
    ),
    GraphCase(
        "alias-feeding-the-output-kept",
        lambda x: (aten.alias.default(x), x.sin()),
        draws(lambda: (torch.randn(3),)),
        {ALIAS: 1, SIN: 1},
    ),
    GraphCase(
        "detach-feeding-the-output-and-an-op-kept",
        lambda x: (lambda d: (d, d.sin()))(x.detach()),
        draws(lambda: (torch.randn(3),)),
        {DETACH: 1, SIN: 1},
    ),
    GraphCase(
        "nothing-to-remove",
        lambda x: x.sin() + 1,
        draws(lambda: (torch.randn(3),)),
        {ALIAS: 0, DETACH: 0, SIN: 1},
    ),
]


@pytest.mark.parametrize("case", NOOP, ids=[c.id for c in NOOP])
def test_remove_noop_ops(case: GraphCase) -> None:
    gm = check_pass(RemoveNoopOps(), case)
    # What used the removed node now reads its input directly.
    if case.modified:
        [sin_or_cos] = [n for n in gm.graph.nodes if str(n.target) in (SIN, "aten.cos.default")]
        assert sin_or_cos.args[0].op == "placeholder"


# ---------------------------------------------------------------------------------
# EliminateDeadCode: unused values go, side effects stay
# ---------------------------------------------------------------------------------

COS, EXP, ADD_ = "aten.cos.default", "aten.exp.default", "aten.add_.Tensor"
ASSERT = "aten._assert_async.msg"


def _unused_cos(x):
    x.cos()
    return x.sin()


def _unused_chain(x):
    x.cos().exp()
    return x.sin()


def _in_place_update(x, buf):
    buf.add_(1)
    return x.sin()


def _assertion(x):
    torch._assert_async(x.abs().sum() >= 0, "never fails")
    return x.sin()


DEAD = [
    GraphCase(
        "unused-op",
        _unused_cos,
        draws(lambda: (torch.randn(4),)),
        {COS: 1, SIN: 1},
        after={COS: 0, SIN: 1},
        modified=True,
    ),
    GraphCase(
        "unused-chain",
        _unused_chain,
        draws(lambda: (torch.randn(4),)),
        {COS: 1, EXP: 1, SIN: 1},
        after={COS: 0, EXP: 0, SIN: 1},
        modified=True,
    ),
    GraphCase(
        "in-place-update-kept",
        _in_place_update,
        draws(lambda: (torch.randn(4), torch.zeros(2))),
        {ADD_: 1, SIN: 1},
    ),
    GraphCase(
        "assertion-and-its-inputs-kept",
        _assertion,
        draws(lambda: (torch.randn(4),)),
        {ASSERT: 1, "aten.abs.default": 1, "aten.sum.default": 1},
    ),
    GraphCase(
        "no-dead-code",
        lambda x: x.cos() + x.sin(),
        draws(lambda: (torch.randn(4),)),
        {COS: 1, SIN: 1},
    ),
]


@pytest.mark.parametrize("case", DEAD, ids=[c.id for c in DEAD])
def test_eliminate_dead_code(case: GraphCase) -> None:
    check_pass(EliminateDeadCode(), case)

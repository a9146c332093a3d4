"""Value checks: where eager PyTorch raises on argument values, dynajax raises the same.

``value_checks.txt`` lists every check, one line per case: the case id, the overload
whose rule (or PyTorch's own graph) raises, eager's exception type and message for the
case's invalid input, and the eager kernel the check comes from. Its second section
lists invalid-looking inputs eager does *not* raise on, which dynajax must not raise
on either. For each case, the tests assert that

- eager raises the listed type and message (the file stays true to the installed torch),
- dynajax raises the same type with the same message (``str(e)``),
- a valid input gives eager's answer with the op in a JAX partition (no fallback),
- ``checks=False`` turns the check off.

    pytest -q tests/lowering/test_value_checks.py -k gather
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dynajax
from tests.helpers import assert_no_fallbacks, compile_with, partition_ops, randn, report_of
from tests.tolerances import assert_same

# eager's index_reduce warns that it is in beta; that is torch's, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta:UserWarning")

TABLE = pathlib.Path(__file__).with_name("value_checks.txt")
L = torch.tensor
aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Entry:
    """One line of ``value_checks.txt``."""

    id: str
    op: str
    error: str
    message: str
    kernel: str
    raises: bool  # False: the second section (eager does not raise)


def read_table() -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    raises = True
    for raw in TABLE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("## not checked"):
            raises = False
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(" | ")]
        assert len(fields) == 5, f"{TABLE.name}: 5 fields separated by ' | ' expected: {raw!r}"
        case_id, op, error, message, kernel = fields
        assert case_id not in entries, f"{TABLE.name}: {case_id} twice"
        message = message.replace("\\n", "\n")
        entries[case_id] = Entry(case_id, op, error, message, kernel, raises)
    return entries


@dataclasses.dataclass(frozen=True)
class ValueCase:
    """A function, an input eager raises on (or, in the second section, one that looks
    invalid but is not) and a valid input.

    Attributes:
        good_fn: the function run on the valid input, where ``fn`` itself is invalid
            whatever its input (a literal zero divisor): the same op, valid.
        random: the op draws random numbers: valid outputs are compared by shape and
            dtype only.
        host: the check is PyTorch's own host-side assertion (one_hot), not ours.
    """

    id: str
    fn: Callable[..., Any]
    bad: Callable[[], tuple[Any, ...]]
    good: Callable[[], tuple[Any, ...]]
    good_fn: Callable[..., Any] | None = None
    random: bool = False
    host: bool = False


def _x() -> torch.Tensor:
    return randn(3, 10)


def _w() -> torch.Tensor:
    return randn(10, 4)


def _ints(*values: int) -> torch.Tensor:
    return L(values)


def _lce(reduction: str) -> Callable[..., Any]:
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    opts = LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=2)

    def fn(x, w, t):
        return F.linear_cross_entropy(x, w, t, reduction=reduction, options=opts)

    return fn


_HAS_LCE = importlib.util.find_spec("torch.nn.modules.linear_cross_entropy_options") is not None


def _nll_backward(grad, x, t):
    return aten.nll_loss_backward(grad, x, t, None, 1, -100, torch.ones(()))


CASES: list[ValueCase] = [
    # -- embeddings ----------------------------------------------------------------------
    ValueCase(
        "embedding",
        lambda w, i: F.embedding(i, w),
        lambda: (_w(), _ints(1, 12)),
        lambda: (_w(), _ints(1, 9)),
    ),
    ValueCase(
        "embedding-negative",
        lambda w, i: F.embedding(i, w),
        lambda: (_w(), L([[1, 2], [-1, 3]])),
        lambda: (_w(), L([[1, 2], [0, 3]])),
    ),
    ValueCase(
        "embedding_renorm",
        lambda w, i: F.embedding(i, w.clone(), max_norm=1.0),
        lambda: (_w(), _ints(14, 12, -3)),
        lambda: (_w(), _ints(1, 9, 3)),
    ),
    ValueCase(
        "embedding_bag-sum",
        lambda w, i, o: F.embedding_bag(i, w, o),
        lambda: (_w(), _ints(1, 12, 3), _ints(0, 2)),
        lambda: (_w(), _ints(1, 9, 3), _ints(0, 2)),
    ),
    ValueCase(
        "embedding_bag-max",
        lambda w, i, o: F.embedding_bag(i, w, o, mode="max"),
        lambda: (_w(), _ints(1, -1, 3), _ints(0, 2)),
        lambda: (_w(), _ints(1, 0, 3), _ints(0, 2)),
    ),
    ValueCase(
        "embedding_bag-first-offset",
        lambda w, i, o: F.embedding_bag(i, w, o),
        lambda: (_w(), _ints(1, 12, 3), _ints(1, 2)),
        lambda: (_w(), _ints(1, 2, 3), _ints(0, 1)),
    ),
    ValueCase(
        "embedding_bag-last-offset",
        lambda w, i, o: F.embedding_bag(i, w, o, include_last_offset=True),
        lambda: (_w(), _ints(1, 2, 3), _ints(0, 2, 5)),
        lambda: (_w(), _ints(1, 2, 3), _ints(0, 2, 3)),
    ),
    # -- advanced indexing ---------------------------------------------------------------
    ValueCase(
        "index", lambda x, i: x[i], lambda: (_x(), _ints(0, 5)), lambda: (_x(), _ints(0, -3))
    ),
    ValueCase(
        "index-negative", lambda x, i: x[i], lambda: (_x(), _ints(0, -4)), lambda: (_x(), _ints(2))
    ),
    ValueCase(
        "index-two-tensors",
        lambda x, i, j: x[i, :, j],
        lambda: (randn(3, 4, 5), _ints(0, 1, 0), _ints(0, 0, 7)),
        lambda: (randn(3, 4, 5), _ints(0, 1, 0), _ints(0, 0, 4)),
    ),
    ValueCase(
        "index_put",
        lambda x, i, v: x.index_put((i,), v),
        lambda: (_x(), _ints(0, 5), randn(2, 10)),
        lambda: (_x(), _ints(0, 2), randn(2, 10)),
    ),
    ValueCase(
        "index_put-accumulate",
        lambda x, i, j, v: x.index_put((i, j), v, accumulate=True),
        lambda: (_x(), L([[0], [1]]), _ints(0, 12), L(1.0)),
        lambda: (_x(), L([[0], [1]]), _ints(0, 9), L(1.0)),
    ),
    ValueCase(
        "index_select",
        lambda x, i: x.index_select(1, i),
        lambda: (_x(), _ints(0, 12, -1)),
        lambda: (_x(), _ints(0, 9, 1)),
    ),
    ValueCase(
        "index_select-dim0",
        lambda x, i: x.index_select(0, i),
        lambda: (_x(), _ints(0, 5)),
        lambda: (_x(), _ints(0, 2)),
    ),
    ValueCase(
        "index_select-vector",
        lambda x, i: x.index_select(0, i),
        lambda: (randn(4), _ints(1, -1)),
        lambda: (randn(4), _ints(1, 3)),
    ),
    ValueCase(
        "index_select-empty-self",
        lambda x, i: x.index_select(0, i),
        lambda: (randn(3, 0), _ints(0, 3)),
        lambda: (randn(3, 0), _ints(0, 2)),
    ),
    ValueCase(
        "take",
        lambda x, i: torch.take(x, i),
        lambda: (_x(), L([[0, 40], [-50, 0]])),
        lambda: (_x(), L([[0, 29], [-30, 0]])),
    ),
    ValueCase(
        "take-0d-index",
        lambda x, i: torch.take(x, i),
        lambda: (_x(), L(-31)),
        lambda: (_x(), L(-30)),
    ),
    ValueCase(
        "put",
        lambda x, i, v: x.put(i, v),
        lambda: (_x(), _ints(0, 40, -50), L([1.0, 2.0, 3.0])),
        lambda: (_x(), _ints(0, 29, -30), L([1.0, 2.0, 3.0])),
    ),
    ValueCase(
        "put-accumulate",
        lambda x, i, v: x.put(i, v, accumulate=True),
        lambda: (_x(), _ints(0, 30), L([1.0, 2.0])),
        lambda: (_x(), _ints(0, 3), L([1.0, 2.0])),
    ),
    ValueCase(
        "index_add",
        lambda x, i, s: x.index_add(1, i, s),
        lambda: (_x(), _ints(0, -1), randn(3, 2)),
        lambda: (_x(), _ints(0, 9), randn(3, 2)),
    ),
    ValueCase(
        "index_add-loop",
        lambda x, i, s: x.index_add(1, i, s),
        lambda: (randn(2, 4, 3), _ints(0, 4), randn(2, 2, 3)),
        lambda: (randn(2, 4, 3), _ints(0, 3), randn(2, 2, 3)),
    ),
    ValueCase(
        "index_add-vector",
        lambda x, i, s: x.index_add(0, i, s),
        lambda: (randn(10), _ints(0, 12), randn(2)),
        lambda: (randn(10), _ints(0, 9), randn(2)),
    ),
    ValueCase(
        "index_add-scalar",
        lambda x, i, s: x.index_add(0, i, s),
        lambda: (randn(()), _ints(-1), randn(())),
        lambda: (randn(()), _ints(0), randn(())),
    ),
    ValueCase(
        "index_copy",
        lambda x, i, s: x.index_copy(1, i, s),
        lambda: (_x(), _ints(0, 12), randn(3, 2)),
        lambda: (_x(), _ints(0, 9), randn(3, 2)),
    ),
    ValueCase(
        "index_fill",
        lambda x, i: x.index_fill(1, i, 2.0),
        lambda: (_x(), _ints(0, -11)),
        lambda: (_x(), _ints(0, -1)),
    ),
    ValueCase(
        "index_fill-empty-dim",
        lambda x, i: x.index_fill(1, i, 2.0),
        lambda: (torch.zeros(3, 0), _ints(7, 0)),
        lambda: (torch.zeros(3, 0), torch.zeros(0, dtype=torch.long)),
    ),
    ValueCase(
        "index_reduce",
        lambda x, i, s: x.index_reduce(1, i, s, "amax"),
        lambda: (_x(), _ints(0, 12), randn(3, 2)),
        lambda: (_x(), _ints(0, 9), randn(3, 2)),
    ),
    ValueCase(
        "masked_scatter",
        lambda x, m, s: x.masked_scatter(m, s),
        lambda: (torch.zeros(2, 2), L([True, True]), L([1.0, 2.0, 3.0])),
        lambda: (torch.zeros(2, 2), L([True, False]), L([1.0, 2.0, 3.0])),
    ),
    # -- gather and scatter --------------------------------------------------------------
    ValueCase(
        "gather",
        lambda x, i: torch.gather(x, 1, i),
        lambda: (_x(), L([[0, 0], [11, 0], [0, 12]])),
        lambda: (_x(), L([[0, 0], [9, 0], [0, 3]])),
    ),
    ValueCase(
        "gather-negative",
        lambda x, i: torch.gather(x, 0, i),
        lambda: (_x(), L([[0, -1]])),
        lambda: (_x(), L([[0, 2]])),
    ),
    ValueCase(
        "scatter-src",
        lambda x, i, s: x.scatter(1, i, s),
        lambda: (_x(), L([[0, 12]]), randn(1, 2)),
        lambda: (_x(), L([[0, 9]]), randn(1, 2)),
    ),
    ValueCase(
        "scatter-value",
        lambda x, i: x.scatter(1, i, 2.0),
        lambda: (_x(), L([[0, -1]])),
        lambda: (_x(), L([[0, 9]])),
    ),
    ValueCase(
        "scatter-value-reduce",
        lambda x, i: x.scatter(1, i, 2.0, reduce="multiply"),
        lambda: (_x(), L([[0, 12]])),
        lambda: (_x(), L([[0, 9]])),
    ),
    ValueCase(
        "scatter_add",
        lambda x, i, s: x.scatter_add(1, i, s),
        lambda: (_x(), L([[0, 12]]), randn(1, 2)),
        lambda: (_x(), L([[0, 9]]), randn(1, 2)),
    ),
    ValueCase(
        "scatter_reduce",
        lambda x, i, s: x.scatter_reduce(1, i, s, "amax"),
        lambda: (_x(), L([[0, 12]]), randn(1, 2)),
        lambda: (_x(), L([[0, 9]]), randn(1, 2)),
    ),
    # -- losses --------------------------------------------------------------------------
    ValueCase(
        "nll_loss",
        lambda x, t: F.nll_loss(x, t),
        lambda: (_x(), _ints(0, 1, 12)),
        lambda: (_x(), _ints(0, 1, 9)),
    ),
    ValueCase(
        "nll_loss-negative-weight",
        lambda x, t, w: F.nll_loss(x, t, weight=w),
        lambda: (_x(), _ints(0, 1, -2), torch.rand(10)),
        lambda: (_x(), _ints(0, 1, -100), torch.rand(10)),
    ),
    ValueCase(
        "nll_loss2d",
        lambda x, t: F.nll_loss(x, t, reduction="none"),
        lambda: (randn(2, 10, 3, 3), torch.full((2, 3, 3), 12)),
        lambda: (randn(2, 10, 3, 3), torch.full((2, 3, 3), 9)),
    ),
    ValueCase(
        "cross_entropy",
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
        lambda: (_x(), _ints(0, 1, 12)),
        lambda: (_x(), _ints(0, 1, 9)),
    ),
    ValueCase(
        "nll_loss_backward",
        _nll_backward,
        lambda: (L(1.0), _x(), _ints(0, 1, 12)),
        lambda: (L(1.0), _x(), _ints(0, 1, 9)),
    ),
    ValueCase(
        "one_hot",
        lambda t: F.one_hot(t, 4),
        lambda: (_ints(0, 5),),
        lambda: (_ints(0, 3),),
        host=True,
    ),
    ValueCase(
        "one_hot-negative",
        lambda t: F.one_hot(t, 4),
        lambda: (_ints(0, -1),),
        lambda: (_ints(0, 3),),
        host=True,
    ),
    # -- integer division ----------------------------------------------------------------
    ValueCase(
        "floor_divide",
        lambda a, b: a // b,
        lambda: (_ints(1, 2), _ints(1, 0)),
        lambda: (_ints(-7, 2), _ints(2, 3)),
    ),
    ValueCase(
        "floor_divide-scalar",
        lambda a: a // 0,
        lambda: (_ints(1, 2),),
        lambda: (_ints(-7, 2),),
        good_fn=lambda a: a // 3,
    ),
    ValueCase(
        "div-trunc",
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        lambda: (L([[1, 2]], dtype=torch.int32), L([[1], [0]], dtype=torch.int32)),
        lambda: (L([[1, -7]], dtype=torch.int32), L([[1], [2]], dtype=torch.int32)),
    ),
    ValueCase(
        "remainder",
        lambda a, b: torch.remainder(a, b),
        lambda: (_ints(1, 2), _ints(1, 0)),
        lambda: (_ints(-7, 2), _ints(3, 3)),
    ),
    ValueCase(
        "fmod",
        lambda a, b: torch.fmod(a, b),
        lambda: (L([1, 2], dtype=torch.uint8), L([1, 0], dtype=torch.uint8)),
        lambda: (L([7, 2], dtype=torch.uint8), L([3, 3], dtype=torch.uint8)),
    ),
    # -- probabilities -------------------------------------------------------------------
    ValueCase(
        "multinomial-negative",
        lambda p: torch.multinomial(p, 1),
        lambda: (L([[0.0, 0.0], [0.5, -1.0]]),),
        lambda: (L([[0.2, 0.8], [0.5, 1.0]]),),
        random=True,
    ),
    ValueCase(
        "multinomial-nan",
        lambda p: torch.multinomial(p, 2, replacement=True),
        lambda: (L([0.5, float("nan")]),),
        lambda: (L([0.5, 0.5]),),
        random=True,
    ),
    ValueCase(
        "multinomial-inf",
        lambda p: torch.multinomial(p, 1),
        lambda: (L([[0.5, float("inf")]], dtype=torch.float64),),
        lambda: (L([[0.5, 3.0]], dtype=torch.float64),),
        random=True,
    ),
    ValueCase(
        "multinomial-zero-row",
        lambda p: torch.multinomial(p, 1),
        lambda: (L([[0.5, 0.5], [0.0, 0.0]]),),
        lambda: (L([[0.5, 0.5], [0.0, 1.0]]),),
        random=True,
    ),
    ValueCase(
        "multinomial-replacement-inf",
        lambda p: torch.multinomial(p, 3, replacement=True),
        lambda: (L([[0.5, float("inf"), -1.0]]),),
        lambda: (L([[0.5, 2.0, 1.0]]),),
        random=True,
    ),
    ValueCase(
        "multinomial-replacement-zero-row",
        lambda p: torch.multinomial(p, 2, replacement=True),
        lambda: (L([[0.0, 0.0], [0.5, -1.0]]),),
        lambda: (L([[0.0, 1.0], [0.5, 1.0]]),),
        random=True,
    ),
    ValueCase(
        "bernoulli",
        lambda p: torch.bernoulli(p),
        lambda: (L([0.5, 1.5]),),
        lambda: (L([0.5, 1.0]),),
        random=True,
    ),
    ValueCase(
        "bernoulli-tensor-p",
        lambda x, p: x.clone().bernoulli_(p),
        lambda: (torch.zeros(3), L([0.5, float("nan"), 0.5])),
        lambda: (torch.zeros(3), L([0.5, 0.0, 0.5])),
        random=True,
    ),
    ValueCase(
        "bernoulli-scalar-p",
        lambda x: x.clone().bernoulli_(-0.25),
        lambda: (torch.zeros(3),),
        lambda: (torch.zeros(3),),
        good_fn=lambda x: x.clone().bernoulli_(0.25),
        random=True,
    ),
    ValueCase(
        "uniform",
        lambda x: x.clone().uniform_(2.5, 1.0),
        lambda: (torch.zeros(3),),
        lambda: (torch.zeros(3),),
        good_fn=lambda x: x.clone().uniform_(1.0, 2.5),
        random=True,
    ),
    ValueCase(
        "poisson",
        lambda r: torch.poisson(r),
        lambda: (L([1.0, float("nan")]),),
        lambda: (L([1.0, 0.0]),),
        random=True,
    ),
    ValueCase(
        "normal-tensor-std",
        lambda m, s: torch.normal(m, s),
        lambda: (torch.zeros(3), L([1.0, -1.0, 1.0])),
        lambda: (torch.zeros(3), L([1.0, 0.0, 1.0])),
        random=True,
    ),
    ValueCase(
        "normal-float-mean",
        lambda s: torch.normal(2.0, s),
        lambda: (L([1.0, float("nan")]),),
        lambda: (L([1.0, 2.0]),),
        random=True,
    ),
    # -- histograms, searching, segments, factorizations ----------------------------------
    ValueCase(
        "histc",
        lambda x: torch.histc(x, 4),
        lambda: (L([-float("inf"), 2.123456789]),),
        lambda: (L([-1.0, 2.123456789]),),
    ),
    ValueCase(
        "histc-range",
        lambda x: torch.histc(x, 4, 0, float("inf")),
        lambda: (L([1.0, 2.0]),),
        lambda: (L([1.0, 2.0]),),
        good_fn=lambda x: torch.histc(x, 4, 0, 3),
    ),
    ValueCase(
        "histogram",
        lambda x: torch.histogram(x, 4),
        lambda: (L([1.0, float("inf")]),),
        lambda: (L([1.0, 4.0]),),
    ),
    ValueCase(
        "histogramdd",
        lambda x: torch.histogramdd(x, bins=[2, 2]),
        lambda: (L([[1.0, 2.0], [2.0, float("inf")]]),),
        lambda: (L([[1.0, 2.0], [2.0, 3.0]]),),
    ),
    ValueCase(
        "searchsorted-sorter",
        lambda s, v, o: torch.searchsorted(s, v, sorter=o),
        lambda: (L([3.0, 1.0, 2.0]), L([2.0]), _ints(1, 2, 5)),
        lambda: (L([3.0, 1.0, 2.0]), L([2.0]), _ints(1, 2, 0)),
    ),
    ValueCase(
        "segment_reduce-negative",
        lambda d, n: torch.segment_reduce(d, "sum", lengths=n),
        lambda: (L([1.0, 2.0, 3.0]), _ints(5, -2)),
        lambda: (L([1.0, 2.0, 3.0]), _ints(1, 2)),
    ),
    ValueCase(
        "segment_reduce-sum",
        lambda d, n: torch.segment_reduce(d, "sum", lengths=n),
        lambda: (L([1.0, 2.0, 3.0]), _ints(1, 1)),
        lambda: (L([1.0, 2.0, 3.0]), _ints(1, 2)),
    ),
    ValueCase(
        "segment_reduce-offsets",
        lambda d, o: torch.segment_reduce(d, "sum", offsets=o),
        lambda: (L([1.0, 2.0, 3.0]), _ints(0, 2, 1, 3)),
        lambda: (L([1.0, 2.0, 3.0]), _ints(0, 1, 1, 3)),
    ),
    ValueCase(
        "lu_unpack",
        lambda lu, p: torch.lu_unpack(lu, p),
        lambda: (randn(3, 4), L([1, 4, 3], dtype=torch.int32)),
        lambda: (randn(3, 4), L([1, 3, 3], dtype=torch.int32)),
    ),
    # -- not checked: eager does not raise -------------------------------------------------
    ValueCase(
        "take_along_dim-wraps",
        lambda x, i: torch.take_along_dim(x, i, 1),
        lambda: (_x(), L([[0, 12, -12]])),
        lambda: (_x(), L([[0, 2, -2]])),
    ),
    ValueCase(
        "div-float-by-zero",
        lambda a, b: a // b,
        lambda: (_ints(1, 2), L([1.0, 0.0])),
        lambda: (_ints(1, 2), L([1.0, 3.0])),
    ),
    ValueCase(
        "searchsorted-unsorted",
        lambda s, v: torch.searchsorted(s, v),
        lambda: (L([1.0, 3.0, 2.0]), L([2.0])),
        lambda: (L([1.0, 2.0, 3.0]), L([2.0])),
    ),
    ValueCase(
        "index_fill-empty-self",
        lambda x, i: x.index_fill(1, i, 2.0),
        lambda: (torch.zeros(0, 3), _ints(5)),
        lambda: (torch.zeros(0, 3), _ints(1)),
    ),
]

if _HAS_LCE:
    CASES += [
        ValueCase(
            "linear_cross_entropy-chunked",
            _lce("mean"),
            lambda: (randn(5, 4), randn(10, 4), _ints(0, 1, -100, 13, 12)),
            lambda: (randn(5, 4), randn(10, 4), _ints(0, 1, -100, 3, 9)),
        ),
        ValueCase(
            "linear_cross_entropy-chunked-none",
            _lce("none"),
            lambda: (randn(3, 4), randn(10, 4), _ints(0, -3, 1)),
            lambda: (randn(3, 4), randn(10, 4), _ints(0, 3, 1)),
        ),
    ]

BY_ID = {c.id: c for c in CASES}
ENTRIES = read_table()
PARAMS = [pytest.param(c, id=c.id) for c in CASES]
# A case missing from the table counts as raising (and fails the table test).
RAISING = [pytest.param(c, id=c.id) for c in CASES if c.id not in ENTRIES or ENTRIES[c.id].raises]
QUIET = [pytest.param(c, id=c.id) for c in CASES if c.id in ENTRIES and not ENTRIES[c.id].raises]


def _inputs(make: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
    torch.manual_seed(0)
    return make()


def _raised(fn: Callable[..., Any], args: tuple[Any, ...]) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is what is compared
        fn(*args)
    return info.value


def test_the_table_lists_every_case() -> None:
    optional = {"linear_cross_entropy-chunked", "linear_cross_entropy-chunked-none"}
    assert set(ENTRIES) - optional <= set(BY_ID), sorted(set(ENTRIES) - set(BY_ID))
    assert set(BY_ID) <= set(ENTRIES), sorted(set(BY_ID) - set(ENTRIES))


def test_the_table_names_checked_overloads_with_rules() -> None:
    supported = {str(op) for op in dynajax.supported_ops()}
    host = {c.id for c in CASES if c.host}
    for e in ENTRIES.values():
        if e.raises and e.id not in host:
            assert e.op in supported, f"{e.id}: {e.op} has no JAX rule"


@pytest.mark.parametrize("case", RAISING)
def test_eager_raises_as_listed(case: ValueCase) -> None:
    entry = ENTRIES[case.id]
    e = _raised(case.fn, _inputs(case.bad))
    assert type(e).__name__ == entry.error, e
    assert str(e) == entry.message


@pytest.mark.parametrize("case", RAISING)
def test_dynajax_raises_eagers_error(case: ValueCase) -> None:
    expected = _raised(case.fn, _inputs(case.bad))
    compiled, backend = compile_with(case.fn)
    got = _raised(compiled, _inputs(case.bad))
    assert type(got) is type(expected), got
    if case.host:  # PyTorch's decomposition asserts with the op's name in front
        assert str(got).endswith(str(expected)), (str(got), str(expected))
    else:
        assert str(got) == str(expected)
    assert_no_fallbacks(backend)


@pytest.mark.parametrize("case", PARAMS)
def test_valid_input_gives_eagers_answer_in_jax(case: ValueCase) -> None:
    fn = case.good_fn or case.fn
    compiled, backend = compile_with(fn)
    got = compiled(*_inputs(case.good))
    expected = fn(*_inputs(case.good))
    if case.random:
        flat_got, flat_expected = (torch.utils._pytree.tree_leaves(v) for v in (got, expected))
        assert [(t.shape, t.dtype) for t in flat_got] == [(t.shape, t.dtype) for t in flat_expected]
    else:
        assert_same(got, expected)
    assert_no_fallbacks(backend)
    entry = ENTRIES[case.id]
    if not case.host and entry.raises and entry.op in {str(op) for op in dynajax.supported_ops()}:
        assert entry.op in partition_ops(backend), (entry.op, sorted(partition_ops(backend)))


@pytest.mark.parametrize("case", QUIET)
def test_no_error_where_eager_raises_none(case: ValueCase) -> None:
    compiled, _ = compile_with(case.fn)
    got = compiled(*_inputs(case.bad))
    expected = case.fn(*_inputs(case.bad))
    if not case.random:
        assert_same(got, expected)


@pytest.mark.parametrize("case_id", ["gather", "embedding", "floor_divide"])
def test_checks_false_turns_the_check_off(case_id: str) -> None:
    case = BY_ID[case_id]
    compiled, backend = compile_with(case.fn, checks=False)
    compiled(*_inputs(case.bad))  # no error: numbers, as jax.jit gives
    assert_no_fallbacks(backend)
    assert report_of(backend).fallbacks == []

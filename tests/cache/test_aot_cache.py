"""aot_autograd's inference graphs, cached across processes (aot/cache.py;
training graphs: test_aot_training_cache.py).

A second compile of the same Dynamo graph with the same inputs' metadata loads the
ATen graph instead of running aot_autograd, and must give eager's answers all the same
(input mutations included); anything that changes what aot_autograd would trace is a
miss; what cannot be keyed is traced and the report says why.
"""

from __future__ import annotations

import pytest
import torch

import dynajax
from dynajax import store
from dynajax.aot import cache as aot_cache
from tests.helpers import run_python
from tests.models import mlp
from tests.tolerances import assert_same


def _compile(cache_dir, fn, **options):
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(cache_dir), **options)
    return torch.compile(fn, backend=backend), backend


def _aot(backend) -> list[str]:
    return [g.aot for g in backend.graphs]


def _mlp_program():
    torch.manual_seed(0)
    model = mlp().eval()
    return model, torch.randn(8, 32)


def test_second_compile_loads_the_graph_and_gives_eagers_answer(tmp_path, aot_runs) -> None:
    model, x = _mlp_program()
    with torch.no_grad():
        want = model(x)
        f, cold = _compile(tmp_path, model)
        assert_same(f(x), want)
        assert aot_runs[0] == 1
        assert _aot(cold) == ["traced and stored in the cache (cache miss: not cached yet)"]
        f, warm = _compile(tmp_path, model)
        assert_same(f(x), want)
        assert_same(f(x), want)  # and its later calls
        assert aot_runs[0] == 1  # aot_autograd did not run again
    assert _aot(warm) == ["loaded from the cache (not traced)"]
    assert "aot_autograd: loaded from the cache (not traced)" in warm.graphs[0].text(width=None)
    # the same verdicts and partitions, and the executable loaded by its program
    assert (
        warm.graphs[0].text(width=None).split("compile")[0]
        == cold.graphs[0].text(width=None).split("compile")[0]
    )
    assert dynajax.Report(warm.graphs).compile_stats.xla_compiles == 0


def _accumulate(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    buf.add_(x)  # an input mutated in place: the graph's first output is written back
    return buf.sin() * 2


def test_loaded_graph_writes_mutated_inputs_back(tmp_path, aot_runs) -> None:
    x = torch.randn(5)
    for _ in range(2):
        f, backend = _compile(tmp_path, _accumulate)
        buf, ref = torch.zeros(5), torch.zeros(5)
        for _ in range(3):
            assert_same(f(x, buf), _accumulate(x, ref))
            assert_same(buf, ref)
    assert aot_runs[0] == 1
    assert _aot(backend) == ["loaded from the cache (not traced)"]


def _two_graphs(x: torch.Tensor) -> torch.Tensor:
    y = x.cos() + 1
    torch._dynamo.graph_break()
    return (y * x).exp()


def test_each_graph_of_a_graph_break_is_its_own_entry(tmp_path, aot_runs) -> None:
    x = torch.randn(3, 4)
    for _ in range(2):
        f, backend = _compile(tmp_path, _two_graphs)
        assert_same(f(x), _two_graphs(x))
    assert aot_runs[0] == 2
    assert _aot(backend) == ["loaded from the cache (not traced)"] * 2


def _scale(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).tanh()


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: torch.randn(4, 5), id="shape"),
        pytest.param(lambda: torch.randn(4, 3, dtype=torch.float64), id="dtype"),
        pytest.param(lambda: torch.randn(3, 4).t(), id="stride"),
    ],
)
def test_other_input_metadata_is_another_entry(tmp_path, aot_runs, other) -> None:
    f, _ = _compile(tmp_path, _scale)
    f(torch.randn(4, 3))
    x = other()
    f, backend = _compile(tmp_path, _scale)
    assert_same(f(x), _scale(x))
    assert aot_runs[0] == 2
    assert _aot(backend) == ["traced and stored in the cache (cache miss: not cached yet)"]


def _offset(x: torch.Tensor) -> torch.Tensor:
    return x + torch.tensor([1.0, 2.0, 3.0])


def _other_offset(x: torch.Tensor) -> torch.Tensor:
    return x + torch.tensor([1.0, 2.0, 4.0])


def test_constants_are_part_of_the_key(tmp_path, aot_runs) -> None:
    x = torch.randn(2, 3)
    f, _ = _compile(tmp_path, _offset)
    assert_same(f(x), _offset(x))
    # the same graph but for the constant's values (and the function's source line)
    f, backend = _compile(tmp_path, _other_offset)
    assert_same(f(x), _other_offset(x))
    assert aot_runs[0] == 2
    assert "cache miss: not cached yet" in backend.graphs[0].aot


def test_dynamic_shapes_are_traced_and_say_why(tmp_path) -> None:
    torch._dynamo.reset()
    backend = dynajax.Backend(cache_dir=str(tmp_path))
    f = torch.compile(_scale, backend=backend, dynamic=True)
    x = torch.randn(5, 3)
    assert_same(f(x), _scale(x))
    assert backend.graphs[0].aot == "traced (not cached: dynamic shapes)"


@torch.library.custom_op("dynajax_test_aot::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def _with_custom_op(x: torch.Tensor) -> torch.Tensor:
    return _twice(x.sin()).cos()


def test_graph_with_a_custom_op_is_traced_and_says_why(tmp_path, aot_runs) -> None:
    x = torch.randn(6)
    for _ in range(2):
        f, backend = _compile(tmp_path, _with_custom_op)
        assert_same(f(x), _with_custom_op(x))
    assert aot_runs[0] == 2
    assert _aot(backend) == [
        "traced (not cached: the ATen graph calls dynajax_test_aot.twice.default)"
    ]


def test_function_allowed_in_the_graph_is_not_keyed_by_name(tmp_path) -> None:
    def user_fn(x):
        return x + 1

    allowed = torch._dynamo.allow_in_graph(user_fn)
    f, backend = _compile(tmp_path, lambda x: allowed(x).sin())
    x = torch.randn(3)
    assert_same(f(x), (x + 1).sin())
    assert "not cached: the graph calls" in backend.graphs[0].aot
    assert "not torch's or Python's" in backend.graphs[0].aot


def test_stale_or_tampered_entry_is_a_miss(tmp_path, aot_runs, monkeypatch) -> None:
    model, x = _mlp_program()
    with torch.no_grad():
        want = model(x)
        _compile(tmp_path, model)[0](x)
        entries = {p.name: p.read_bytes() for p in tmp_path.glob("*.*")}
        # another torch wrote it: stale, traced and replaced
        real = store.versions()
        monkeypatch.setattr(store, "versions", lambda: (*real, ("x", "other")))
        f, backend = _compile(tmp_path, model)
        assert_same(f(x), want)
        assert "stale entry (x changed)" in backend.graphs[0].aot
        monkeypatch.undo()
        # a damaged entry: a warning, traced, the right answer
        for name, blob in entries.items():
            (tmp_path / name).write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
        with pytest.warns(RuntimeWarning, match="failed authentication"):
            f, backend = _compile(tmp_path, model)
            assert_same(f(x), want)
    assert "unauthenticated entry" in backend.graphs[0].aot


def test_cache_off_traces_and_the_report_says_nothing_more(aot_runs) -> None:
    model, x = _mlp_program()
    with torch.no_grad():
        for _ in range(2):
            f, backend = _compile("", model)
            f(x)
    assert aot_runs[0] == 2
    assert _aot(backend) == ["traced"]
    assert "aot_autograd" not in backend.graphs[0].text(width=None)


def test_key_is_the_same_in_another_process(tmp_path) -> None:
    # every part of the description is stable across processes (no ids, no addresses)
    code = (
        "import torch, dynajax; from tests.models import mlp; torch.manual_seed(0);"
        f"m = mlp().eval(); b = dynajax.Backend(cache_dir={str(tmp_path)!r});"
        "torch.no_grad().__enter__(); torch.compile(m, backend=b)(torch.randn(8, 32));"
        "print(b.graphs[0].aot)"
    )
    out = [run_python("-c", code, timeout=300) for _ in range(2)]
    assert out == [
        "traced and stored in the cache (cache miss: not cached yet)",
        "loaded from the cache (not traced)",
    ]


def test_description_covers_inputs_aliasing_and_modes() -> None:
    gm = torch.fx.symbolic_trace(lambda a, b: a + b)
    base = torch.randn(4)
    apart = aot_cache.describe(gm, [torch.randn(4), torch.randn(4)])
    shared = aot_cache.describe(gm, [base, base])
    assert apart != shared  # two inputs sharing a storage trace differently
    with torch.no_grad():
        assert aot_cache.describe(gm, [torch.randn(4), torch.randn(4)]) != apart
    x = torch.randn(4, requires_grad=True)
    assert aot_cache.describe(gm, [x, torch.randn(4)]) != apart
    assert "0x" not in apart  # no object addresses: the same text in every process


@pytest.mark.parametrize("constant", [torch.tensor(2.5), torch.zeros(0), torch.ones(2, 3)])
def test_tensor_constants_of_any_shape_are_hashed(constant) -> None:
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.c = constant
    node = gm.graph.get_attr("c")
    gm.graph.output(node)
    gm.recompile()
    text = aot_cache.describe(gm, [])
    gm.c = constant + 1  # other values (an empty tensor has none)
    assert (aot_cache.describe(gm, []) != text) == (constant.numel() > 0)


def _data_dependent(x: torch.Tensor) -> torch.Tensor:
    n = (x > 0).sum().item()  # an unbacked size, captured in the graph
    return torch.ones(n).sum() + x.sin()


def test_data_dependent_sizes_are_traced_and_say_why(tmp_path) -> None:
    x = torch.randn(6)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for _ in range(2):
            f, backend = _compile(tmp_path, _data_dependent)
            assert_same(f(x), _data_dependent(x))
    assert {g.aot for g in backend.graphs} == {"traced (not cached: dynamic shapes)"}

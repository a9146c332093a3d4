"""The report tells the whole program: what Dynamo left out (graph breaks, their
reasons, lines and hints), the share of the program's ATen ops that ran in JAX, and
where the time goes (the ``profile`` option, and the ranges it names in
``torch.profiler`` and JAX's profiler)."""

from __future__ import annotations

import os
import time

import jax
import torch
from torch import nn

import dynajax
from dynajax.runtime.compiled import CompiledPartition
from tests.helpers import compare_with_eager, measured_faster


class RNNNet(nn.Module):
    """A conv, a BatchNorm, a GRU, an LSTM and a head: Dynamo breaks at the GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3)
        self.bn = nn.BatchNorm1d(8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().transpose(1, 2)
        o, _ = self.gru(h)  # the GRU's line
        o, _ = self.lstm(o)
        return self.head(o[:, -1])


def _rnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return RNNNet().eval(), torch.randn(2, 4, 10)


@torch.no_grad()
def test_an_rnn_dynamo_leaves_to_python_never_reads_as_all_in_jax() -> None:
    model, x = _rnn()
    with measured_faster("xla"):  # (the count is the point: the conv in JAX on any CPU)
        report = dynajax.explain(model, x)
    # dynajax's one graph is all in JAX, but the GRU, LSTM and head ran outside it
    assert report.jax_ops == report.aten_ops == 4
    assert report.outside_ops is not None and report.outside_ops > 100
    assert report.program_ops == 4 + report.outside_ops
    assert report.fraction_in_jax < 0.05
    [gb] = report.breaks or []
    assert gb.reason == "Attempted to wrap RNN, GRU, or LSTM"
    assert gb.where.endswith(f"test_explain.py:{_line_of('# the GRU')}")
    assert gb.code.startswith("o, _ = self.gru(h)")
    assert any("torch._dynamo.config.allow_rnn=True" in h for h in gb.hints)
    text = report.text(width=None)
    assert "4/" in text and "outside any graph" in text and "allow_rnn" in text


@torch.no_grad()
def test_with_allow_rnn_the_same_net_is_one_graph_in_jax() -> None:
    model, x = _rnn()
    with torch._dynamo.config.patch(allow_rnn=True):
        report = dynajax.explain(model, x)
    assert report.breaks == [] and report.outside_ops == 0
    assert report.graph_calls == {0: 1}
    assert report.fraction_in_jax > 0.9 and report.aten_ops > 100
    assert "no graph breaks" in report.text(width=None)
    with torch._dynamo.config.patch(allow_rnn=True):
        compare_with_eager(model, x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum().item() > 0:  # the data-dependent branch
            h = h * 2
        print("shape", tuple(h.shape))  # the print
        return self.b(h).relu()


@torch.no_grad()
def test_an_item_branch_and_a_print_are_listed_with_their_lines_and_hints(capsys) -> None:
    torch.manual_seed(0)
    report = dynajax.explain(Branchy(), torch.randn(2, 8))
    breaks = {b.where.rsplit(":", 1)[1]: b for b in report.breaks or []}
    item = breaks[str(_line_of("# the data-dependent branch"))]
    assert "item()" in item.reason and "capture_scalar_outputs" in " ".join(item.hints)
    shown = breaks[str(_line_of("# the print"))]
    assert "print" in shown.explanation and shown.code.startswith("print(")
    # the graphs around the breaks ran (three graphs, each once per call) and count
    assert sorted(report.graph_calls.values()) == [1] * len(report.graphs)
    assert report.program_ops >= report.aten_ops
    assert "shape (2, 8)" in capsys.readouterr().out  # the program's own print ran


def tagged(x: torch.Tensor) -> torch.Tensor:
    y = torch.tanh(x) * 2
    pid = os.getpid()  # the library call
    return y * (pid > 0) + 1


def test_a_library_function_dynamo_skips_is_listed() -> None:
    report = dynajax.explain(tagged, torch.randn(16))
    [gb] = report.breaks or []
    assert gb.reason == "Attempted to call function marked as skipped"
    assert gb.where.endswith(f":{_line_of('# the library call')}")
    assert len(report.graphs) == 2  # before and after it, each once per call
    assert report.graph_calls == {0: 1, 1: 1}


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


# -- where the time goes -------------------------------------------------------------


def mixed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    h = torch.sort(h, dim=-1).values  # kept in PyTorch: two partitions around it
    return torch.tanh(h @ w.T)


@torch.no_grad()
def test_each_partition_is_a_named_range_in_torch_profiler_with_its_time() -> None:
    backend = dynajax.Backend(profile=True, fallback_ops=["aten.sort"])
    compiled = torch.compile(mixed, backend=backend)
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    compiled(x, w)  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            out = compiled(x, w)
    torch.testing.assert_close(out, mixed(x, w))
    found = {e.key: e for e in prof.key_averages()}
    for name in ("dynajax/graph0", "dynajax/graph0/jax_0", "dynajax/graph0/jax_1"):
        assert found[name].count == 3, name
        assert found[name].cpu_time_total > 0, name
    # the partitions' ranges nest in the graph's, the sort between them outside both
    events = prof.events()
    sort = next(e for e in events if e.name == "aten::sort")
    parents = []
    p = sort.cpu_parent
    while p is not None:
        parents.append(p.name)
        p = p.cpu_parent
    assert "dynajax/graph0" in parents and not any("jax_" in n for n in parents)


@torch.no_grad()
def test_the_report_gives_each_partitions_time_by_phase(monkeypatch) -> None:
    annotations: list[str] = []
    real = jax.profiler.TraceAnnotation

    class Recorded(real):  # type: ignore[misc,valid-type]
        def __init__(self, name: str, **kwargs: object) -> None:
            annotations.append(name)
            super().__init__(name, **kwargs)

    monkeypatch.setattr(jax.profiler, "TraceAnnotation", Recorded)
    backend = dynajax.Backend(profile=True, fallback_ops=["aten.sort"])
    compiled = torch.compile(mixed, backend=backend)
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    for _ in range(5):
        compiled(x, w)
    # JAX's profiler sees the same names (a Perfetto trace of jax.profiler.trace)
    assert annotations.count("dynajax/graph0/jax_0") == 5
    assert annotations.count("dynajax/graph0") == 5
    [graph] = backend.graphs
    times = graph.times
    assert times is not None and times.graph.calls == 4 and times.graph.first_s > 0
    for name in ("jax_0", "jax_1"):
        t = times.partitions[name]
        assert t.calls == 4 and t.xla_s > 0 and t.cross_in_s > 0 and t.cross_out_s > 0
        assert t.cross_in_s + t.xla_s + t.cross_out_s <= t.total_s
    assert 0 < times.between_s < times.graph.total_s
    text = dynajax.Report(backend.graphs).text(width=None)
    assert "time per call:" in text and "XLA" in text and "PyTorch " in text


@torch.no_grad()
def test_without_profile_the_per_call_path_has_no_wrappers() -> None:
    backend = dynajax.Backend(fallback_ops=["aten.sort"])
    compiled = torch.compile(mixed, backend=backend)
    compiled(torch.randn(4, 8), torch.randn(8, 8))
    [graph] = backend.graphs
    kids = list(graph.graph_module.children())
    assert len(kids) == 2 and all(type(m) is CompiledPartition for m in kids), kids
    assert graph.times is None
    # with it, the graph's regular path is the same; a copy of it, its partitions
    # wrapped, times the calls while ``times.timing`` holds
    profiled = dynajax.Backend(profile=True, fallback_ops=["aten.sort"])
    torch._dynamo.reset()
    fn = torch.compile(mixed, backend=profiled)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    fn(x, w)
    [graph] = profiled.graphs
    kids = list(graph.graph_module.children())
    assert len(kids) == 2 and all(type(m) is CompiledPartition for m in kids), kids
    times = graph.times
    assert times is not None and times.graph.first_s is not None
    assert set(times.partitions) == {"jax_0", "jax_1"}
    timed_out = fn(x, w)
    assert times.graph.calls == 1 and all(t.calls == 1 for t in times.partitions.values())
    times.timing = False  # as explain times the whole program: not counted, not waited
    torch.testing.assert_close(fn(x, w), timed_out, rtol=0, atol=0)
    assert times.graph.calls == 1 and all(t.calls == 1 for t in times.partitions.values())
    times.timing = True
    fn(x, w)
    assert times.graph.calls == 2


@torch.no_grad()
def test_a_backends_own_report_says_where_its_graphs_ended_at_a_graph_break() -> None:
    """Without explain (no count of the ops outside), the report of a backend's graphs
    still never reads as the whole program: it says where Dynamo broke it."""
    model, x = _rnn()
    backend = dynajax.Backend()
    torch.compile(model, backend=backend)(x)
    report = dynajax.Report(backend.graphs)
    assert report.graph_breaks == 1
    text = report.text(width=None)
    assert "Dynamo broke the program at 1 place(s)" in text.splitlines()[0]
    assert f"ends at a graph break at {_short_here()}:{_line_of('# the GRU')}" in text

    torch._dynamo.reset()
    backend = dynajax.Backend()
    torch.compile(Branchy(), backend=backend)(torch.randn(2, 8))
    report = dynajax.Report(backend.graphs)
    # the graph before the .item() ends at its break; the print's break ends a piece
    # with no ops, which Dynamo hands no backend (explain lists both)
    assert report.graph_breaks == 1
    assert "Unsupported Tensor.item() call" in report.text(width=None)

    torch._dynamo.reset()
    whole = dynajax.Backend()
    torch.compile(mixed, backend=whole)(torch.randn(4, 8), torch.randn(8, 8))
    assert dynajax.Report(whole.graphs).graph_breaks == 0
    assert "broke" not in dynajax.Report(whole.graphs).text(width=None)


def _short_here() -> str:
    import os

    return os.path.relpath(__file__)


class _ColdFirstCall(nn.Module):
    """A linear layer whose first eager call is slow (as a kernel's first use is)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.cold = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.cold and not torch.compiler.is_compiling():
            self.cold = False
            time.sleep(0.2)
        return super().__call__(*args, **kwargs)


def test_eagers_time_is_warmed_and_interleaved_with_a_spread(capfd) -> None:
    # Eager's baseline is timed as the demo times it: after a first, untimed call, in
    # rounds beside the compiled calls; medians, with the fastest and slowest call.
    model, x = _ColdFirstCall(), torch.randn(4, 8)
    report = dynajax.explain(model, x)
    assert report.eager_s is not None and report.call_s is not None
    assert report.eager_s < 0.1  # the 0.2 s first call is not among the timed ones
    low, high = report.eager_range
    assert low <= report.eager_s <= high
    low, high = report.call_range
    assert low <= report.call_s <= high
    assert f"eager PyTorch {1e3 * report.eager_s:.3f} ms (" in report.text(width=None)
    assert "USDT" not in capfd.readouterr().err  # the profiler's own lines are dropped


def test_the_report_fits_a_terminal_of_100_columns() -> None:
    model, x = _rnn()
    report = dynajax.explain(model, x)
    text, whole = str(report), report.text(width=None)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert max(len(line) for line in whole.splitlines()) > 100  # (something was wrapped)
    assert text.split() == whole.split()  # the same words: nothing cut, nothing added


def test_explains_own_recompile_is_named_as_such() -> None:
    # A function compiled before with the default options is compiled again by
    # explain's own backend: the report says so, not "options changed".
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    torch.compile(model, backend="dynajax")(x)
    text = dynajax.explain(model, x).text(width=None)
    assert "dynajax.explain's own, with profile=True" in text
    assert "options changed" not in text


@torch.no_grad()
def test_with_the_default_options_a_recording_profiler_sees_every_graph_and_partition() -> None:
    # No option: while torch's profiler records, each call is a range and so is each
    # of its partitions; the compiled graph keeps its own partitions unwrapped.
    backend = dynajax.Backend(fallback_ops=["aten.sort"])
    compiled = torch.compile(mixed, backend=backend)
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    compiled(x, w)  # compiles (its first call, outside the profiler)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            out = compiled(x, w)
    torch.testing.assert_close(out, mixed(x, w))
    found = {e.key: e.count for e in prof.key_averages()}
    for name in ("dynajax/graph0", "dynajax/graph0/jax_0", "dynajax/graph0/jax_1"):
        assert found.get(name) == 3, (name, sorted(k for k in found if "dynajax" in k))
    [graph] = backend.graphs
    assert all(type(m) is CompiledPartition for m in graph.graph_module.children())
    # and outside the profiler, none
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pass
    compiled(x, w)
    assert not any("dynajax" in e.key for e in prof.key_averages())


def test_a_first_call_under_the_profiler_is_one_range(tmp_path) -> None:
    # The first call of a training graph runs aot_autograd's wrapper, which calls the
    # compiled graph again: one call, one range. JAX's profiler names the calls too.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="dynajax")
    x = torch.randn(4, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    found = {e.key: e.count for e in prof.key_averages()}
    assert found.get("dynajax/graph0") == 1 and found.get("dynajax/graph1") == 1, found
    jax.profiler.start_trace(str(tmp_path))
    try:
        compiled(x).sum().backward()
    finally:
        jax.profiler.stop_trace()
    traces = list(tmp_path.rglob("*.xplane.pb"))
    assert traces and any(b"dynajax/graph0/jax_0" in t.read_bytes() for t in traces)

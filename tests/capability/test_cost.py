"""Cost choices measured on the machine that runs them (option ``measure_costs``): both
paths timed at the first compile (the whole graph built both ways where it can be run on
made-up inputs, else the op alone), the faster kept, the times remembered per machine
and shown in the report."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import dynajax
from dynajax.capability import Reason, Unsupported, cost, in_graph, memo
from tests.tolerances import assert_same


@pytest.fixture(autouse=True)
def _new_cache(monkeypatch, tmp_path) -> None:
    """Each test starts as a new process with an empty cache: nothing measured yet."""
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(memo, "_MEMORY", {})
    monkeypatch.setattr(memo, "_STORES", {})


def _layer_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    return layer, torch.randn(2, 16, 64)


def _chosen_pytorch(report: dynajax.Report) -> list[Unsupported]:
    """The nodes measured (or known) faster in PyTorch: each runs PyTorch's kernel,
    inside its partition (XLA FFI) or, alone, between partitions."""
    return [v for v in [*report.kernels, *report.fallbacks] if v.reason is Reason.PERF]


def _compile(layer: nn.Module, x: torch.Tensor, **options: object) -> dynajax.Report:
    backend = dynajax.Backend(**options)
    with torch.no_grad():
        # dynamic=False: a new batch size is a new static graph (a symbolic size
        # cannot be measured; the defaults decide it).
        assert_same(torch.compile(layer, backend=backend, dynamic=False)(x), layer(x))
    return dynajax.Report(list(backend.graphs))


def _choices(report: dynajax.Report) -> list[cost.CostChoice]:
    return report.cost_choices


@torch.library.custom_op("dynajax_cost_test::halve", mutates_args=())
def _halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@_halve.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _WithUserOp(nn.Module):
    """The layer after a user's op (no JAX rule): its graph must not run on made-up
    inputs (the op may have effects), so the layer's choice is timed alone."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(_halve(x))


def _fixed_graph_times(monkeypatch, pytorch_s: float, xla_s: float) -> list[int]:  # type: ignore[no-untyped-def]
    """Replaces the timed rounds of a graph's two builds by fixed times (each build
    still runs, and compiles, once first); returns one entry per timing: the number of
    callables timed."""
    timed: list[int] = []

    def median_times(*calls, rounds, untimed_first, block):  # type: ignore[no-untyped-def]
        timed.append(len(calls))
        return [pytorch_s, xla_s]

    monkeypatch.setattr(cost, "median_times", median_times)
    return timed


@pytest.mark.parametrize("faster", ["pytorch", "xla"])
def test_the_graph_is_built_both_ways_and_the_faster_kept(monkeypatch, faster: str) -> None:
    monkeypatch.setattr(cost, "_measure", lambda node, rule: pytest.fail("timed alone"))
    times = (0.003, 0.004) if faster == "pytorch" else (0.004, 0.003)
    timed = _fixed_graph_times(monkeypatch, *times)
    report = _compile(*_layer_and_input(), measure_costs=True)
    assert timed == [2]
    (choice,) = _choices(report)
    assert (choice.pytorch_s, choice.xla_s, choice.scope) == (*times, "graph")
    assert choice.measure_s > 0
    assert [f.reason for f in report.fallbacks] == []
    # PyTorch's kernel, chosen, runs inside the layer's partition (XLA FFI).
    reasons = [k.reason for k in report.kernels]
    assert reasons == ([Reason.PERF] if faster == "pytorch" else [])
    text = report.text(width=None)
    pytorch_ms, xla_ms = (t * 1e3 for t in times)
    timed_text = f"its graph with PyTorch's kernel {pytorch_ms:.2f} ms, all in JAX {xla_ms:.2f} ms"
    assert timed_text in text
    where = "PyTorch" if faster == "pytorch" else "JAX"
    assert f"runs in {where} (measuring took {choice.measure_s:.2f} s)" in text


def test_the_graph_is_timed_on_this_machine_without_drawing_random_numbers() -> None:
    layer, x = _layer_and_input()
    state = torch.random.get_rng_state()
    report = _compile(layer, x, measure_costs=True)
    assert torch.equal(torch.random.get_rng_state(), state)
    (choice,) = _choices(report)
    assert choice.scope == "graph"
    assert choice.pytorch_s > 0 and choice.xla_s > 0 and choice.measure_s > 0
    in_pytorch = _chosen_pytorch(report)
    assert bool(in_pytorch) == (choice.pytorch_s < choice.xla_s)


def test_a_graph_timing_is_remembered_for_the_same_graph(monkeypatch) -> None:
    from dynajax.backend import Backend

    timed = _fixed_graph_times(monkeypatch, 0.004, 0.003)
    builds: list[str] = []
    partitioned = Backend._partitioned

    def counted(self, gm, kind, input_names):  # type: ignore[no-untyped-def]
        builds.append(kind)
        return partitioned(self, gm, kind, input_names)

    monkeypatch.setattr(Backend, "_partitioned", counted)
    layer, x = _layer_and_input()
    _compile(layer, x, measure_costs=True)
    assert len(builds) == 2  # both ways; the faster's build is the one that runs
    torch._dynamo.reset()
    report = _compile(layer, x, measure_costs=True)
    assert timed == [2]
    assert len(builds) == 3  # remembered: the faster built alone
    (choice,) = _choices(report)
    assert choice.measure_s == 0.0 and "(cached)" in choice.describe()
    torch._dynamo.reset()
    _compile(layer, torch.randn(3, 16, 64), measure_costs=True)  # other shapes
    assert timed == [2, 2]
    monkeypatch.setattr(cost, "machine", lambda: "another CPU; 64 cpus")
    torch._dynamo.reset()
    _compile(layer, x, measure_costs=True)
    assert timed == [2, 2, 2]


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, hidden), nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _MarkedBlock(_Block):
    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Stack(nn.Module):
    """Blocks in a ModuleList (``hidden``: each block's inner width), each product large
    enough to be measured (``cost.PRODUCT_FLOPS``) on (256, 256) inputs; ``marked``:
    each block's call a region traced once (``torch.compiler.nested_compile_region``)."""

    def __init__(self, hidden: list[int], marked: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList((_MarkedBlock if marked else _Block)(h) for h in hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _stack(depth: int, marked: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Stack([512] * depth, marked).eval(), torch.randn(256, 256)


def _counted_builds(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """Counts the backend's builds of graphs, each by its number of nodes."""
    from dynajax.backend import Backend

    builds: list[int] = []
    partitioned = Backend._partitioned

    def counted(self, gm, kind, input_names):  # type: ignore[no-untyped-def]
        builds.append(len(gm.graph.nodes))
        return partitioned(self, gm, kind, input_names)

    monkeypatch.setattr(Backend, "_partitioned", counted)
    return builds


@pytest.mark.parametrize("marked", [False, True], ids=["module-list", "marked"])
@pytest.mark.parametrize("faster", ["pytorch", "xla"])
def test_repeated_blocks_are_timed_on_the_first(monkeypatch, faster: str, marked: bool) -> None:
    """A ModuleList's alike layers, or a marked region's calls: the choice is timed on
    the first block's graph alone, both ways, and placed on every block's products."""
    times = (0.003, 0.004) if faster == "pytorch" else (0.004, 0.003)
    timed = _fixed_graph_times(monkeypatch, *times)
    builds = _counted_builds(monkeypatch)
    report = _compile(*_stack(4, marked), measure_costs=True)
    assert timed == [2]
    # The first block's graph built both ways, then the whole graph with the faster.
    assert len(builds) == 3 and builds[0] == builds[1] < builds[2] / 3, builds
    (choice,) = _choices(report)
    assert (choice.pytorch_s, choice.xla_s, choice.scope) == (*times, "block")
    name = "region " if marked else "layers.* (_Block)"
    assert choice.block.startswith("4 alike blocks, ") and name in choice.block, choice.block
    kernels = [k for k in report.kernels if k.reason is Reason.PERF]
    assert len(kernels) == (8 if faster == "pytorch" else 0)  # every block's two products
    text = report.text(width=None)
    assert f"the first of its {choice.block}, with PyTorch's kernel" in text


def test_the_backward_graphs_blocks_are_timed_on_the_first(monkeypatch) -> None:
    """Training: the backward graph's blocks (their nodes carry the forward's module
    stack) are timed on the first of them too, and the gradients are eager's."""
    timed = _fixed_graph_times(monkeypatch, 0.004, 0.003)
    model, x = _stack(4)
    model.train()
    backend = dynajax.Backend(measure_costs=True)
    out = torch.compile(model, backend=backend, dynamic=False)(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        assert_same(got, want, model=True)  # (four blocks of products: a model's sums)
    report = dynajax.Report(list(backend.graphs))
    assert [g.kind for g in report.graphs] == ["forward", "backward"]
    assert timed == [2, 2]
    choices = _choices(report)
    assert [c.scope for c in choices] == ["block", "block"]
    # (the first layer's gradient computes no gradient of the input, which needs none:
    # not alike to the others)
    blocks = ["4 alike blocks, layers.* (_Block)", "3 alike blocks, layers.* (_Block)"]
    assert [c.block for c in choices] == blocks, choices


def test_a_block_timing_serves_a_model_of_another_depth(monkeypatch) -> None:
    timed = _fixed_graph_times(monkeypatch, 0.004, 0.003)
    _compile(*_stack(3), measure_costs=True)
    torch._dynamo.reset()
    report = _compile(*_stack(6), measure_costs=True)
    assert timed == [2]  # the 6-block model's first block is the 3-block model's
    (choice,) = _choices(report)
    assert choice.scope == "block" and choice.block.startswith("6 alike blocks")
    assert choice.measure_s == 0.0 and "(cached)" in choice.describe()


def test_blocks_that_differ_are_timed_in_their_whole_graph(monkeypatch) -> None:
    """Layers of one ModuleList that are not alike (another inner width): none stands
    for the others, and the whole graph is timed."""
    timed = _fixed_graph_times(monkeypatch, 0.004, 0.003)
    torch.manual_seed(0)
    report = _compile(_Stack([512, 640, 768]).eval(), torch.randn(256, 256), measure_costs=True)
    assert timed == [2]
    (choice,) = _choices(report)
    assert choice.scope == "graph" and choice.block == ""


def test_repeated_blocks_are_timed_on_this_machine() -> None:
    """The default options: the first block timed both ways, for real."""
    model, x = _stack(3)
    backend = dynajax.Backend()
    with torch.no_grad():
        assert_same(torch.compile(model, backend=backend, dynamic=False)(x), model(x))
    (choice,) = dynajax.Report(list(backend.graphs)).cost_choices
    assert isinstance(choice, cost.CostChoice) and choice.scope == "block"
    assert choice.pytorch_s > 0 and choice.xla_s > 0 and choice.measure_s > 0


@pytest.mark.parametrize("faster", ["pytorch", "xla"])
def test_beside_a_users_op_the_op_is_timed_alone(monkeypatch, faster: str) -> None:
    monkeypatch.setattr(in_graph, "time_both", lambda runs, inputs: pytest.fail("graph timed"))
    times = (0.001, 0.002, 0.5) if faster == "pytorch" else (0.002, 0.001, 0.5)
    monkeypatch.setattr(cost, "_measure", lambda node, rule: times)
    layer, x = _layer_and_input()
    report = _compile(_WithUserOp(layer), x, measure_costs=True)
    (choice,) = _choices(report)
    assert (choice.pytorch_s, choice.xla_s, choice.measure_s, choice.scope) == (*times, "op")
    reasons = [f.reason for f in _chosen_pytorch(report)]
    assert reasons == ([Reason.PERF] if faster == "pytorch" else [])
    text = report.text(width=None)
    assert "PyTorch's kernel 1.00 ms" in text or "PyTorch's kernel 2.00 ms" in text
    assert f"runs in {'PyTorch' if faster == 'pytorch' else 'JAX'} (measuring took 0.50 s)" in text


def test_the_op_alone_is_timed_on_this_machine() -> None:
    layer, x = _layer_and_input()
    report = _compile(_WithUserOp(layer), x, measure_costs=True)
    (choice,) = _choices(report)
    assert choice.scope == "op"
    assert choice.pytorch_s > 0 and choice.xla_s > 0 and choice.measure_s > 0
    in_pytorch = _chosen_pytorch(report)
    assert bool(in_pytorch) == (choice.pytorch_s < choice.xla_s)


def _counted_measures(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """Replaces the timing by fixed times (XLA faster); returns the nodes measured."""
    calls: list[str] = []

    def measured(node, rule):  # type: ignore[no-untyped-def]
        calls.append(node.name)
        return (0.002, 0.001, 0.3)

    monkeypatch.setattr(cost, "_measure", measured)
    return calls


def test_an_op_timing_is_remembered_for_the_same_shapes(monkeypatch) -> None:
    calls = _counted_measures(monkeypatch)
    layer, x = _layer_and_input()
    _compile(_WithUserOp(layer), x, measure_costs=True)
    torch._dynamo.reset()
    report = _compile(_WithUserOp(layer), x, measure_costs=True)
    assert len(calls) == 1
    (choice,) = _choices(report)
    assert choice.measure_s == 0.0 and "(cached)" in choice.describe()
    torch._dynamo.reset()
    _compile(_WithUserOp(layer), torch.randn(3, 16, 64), measure_costs=True)  # other shapes
    assert len(calls) == 2
    monkeypatch.setattr(cost, "machine", lambda: "another CPU; 64 cpus")
    torch._dynamo.reset()
    _compile(_WithUserOp(layer), x, measure_costs=True)
    assert len(calls) == 3


def test_without_measuring_the_defaults_decide(monkeypatch) -> None:
    monkeypatch.setattr(cost, "_measure", lambda node, rule: pytest.fail("measured"))
    monkeypatch.setattr(in_graph, "time_both", lambda runs, inputs: pytest.fail("measured"))
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True).eval()
    report = _compile(layer, torch.randn(8, 128, 256), measure_costs=False)
    assert _choices(report) == []
    # The default for a layer this size (2^25 flops and more): PyTorch's kernel.
    (chosen,) = _chosen_pytorch(report)
    assert chosen.reason is Reason.PERF and "1.4-1.7x" in chosen.detail


def test_measure_costs_is_an_option_with_an_environment_variable(monkeypatch) -> None:
    from dynajax.config import Options
    from dynajax.errors import OptionsError

    monkeypatch.delenv("DYNAJAX_MEASURE_COSTS", raising=False)
    assert Options.resolve().measure_costs is True
    monkeypatch.setenv("DYNAJAX_MEASURE_COSTS", "0")
    assert Options.resolve().measure_costs is False
    with pytest.raises(OptionsError, match="measure_costs must be True or False"):
        dynajax.Backend(measure_costs=1)


def _cnn_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU()
    )
    return cnn, torch.randn(2, 3, 16, 16)


@pytest.mark.parametrize("faster", ["pytorch", "xla"])
def test_a_networks_convolutions_are_timed_together_in_their_graph(monkeypatch, faster) -> None:  # type: ignore[no-untyped-def]
    """Convolutions are a choice timed in the graph only: every convolution of the graph
    in PyTorch against all in JAX, forward and backward graphs each on their own."""
    monkeypatch.setattr(cost, "_measure", lambda node, rule: pytest.fail("timed alone"))
    times = (0.003, 0.004) if faster == "pytorch" else (0.004, 0.003)
    timed = _fixed_graph_times(monkeypatch, *times)
    cnn, x = _cnn_and_input()
    backend = dynajax.Backend(measure_costs=True)
    compiled = torch.compile(cnn, backend=backend, dynamic=False)
    out = compiled(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in cnn.parameters()]
    cnn.zero_grad()
    expected = cnn(x)
    expected.square().sum().backward()
    assert_same(out, expected)
    for g, p in zip(grads, cnn.parameters(), strict=True):
        assert_same(g, p.grad)
    assert timed == [2, 2]  # the forward graph, then the backward
    report = dynajax.Report(list(backend.graphs))
    ops = sorted(c.op for c in report.cost_choices)
    assert ops == ["aten.convolution.default", "aten.convolution_backward.default"]
    assert all(c.node.count("convolution") == 2 for c in report.cost_choices)
    in_pytorch = sorted({str(f.target) for f in _chosen_pytorch(report)})
    if faster == "pytorch":
        assert in_pytorch == ops
    else:
        assert in_pytorch == []


def test_convolutions_beside_a_users_op_take_the_defaults(monkeypatch) -> None:
    """Where the graph cannot be timed, convolutions are not timed one by one: XLA."""
    monkeypatch.setattr(cost, "_measure", lambda node, rule: pytest.fail("timed alone"))
    monkeypatch.setattr(in_graph, "time_both", lambda runs, inputs: pytest.fail("graph timed"))
    cnn, x = _cnn_and_input()
    report = _compile(_WithUserOp(cnn), x, measure_costs=True)
    assert report.cost_choices == []
    assert _chosen_pytorch(report) == []


def test_a_graph_with_large_inputs_is_not_copied_to_be_timed(monkeypatch) -> None:
    """Timing in place would copy the graph's inputs (a model's weights): past
    ``MAX_INPUT_BYTES`` the op is timed alone instead."""
    monkeypatch.setattr(in_graph, "MAX_INPUT_BYTES", 1024)
    monkeypatch.setattr(in_graph, "time_both", lambda runs, inputs: pytest.fail("graph timed"))
    _counted_measures(monkeypatch)
    report = _compile(*_layer_and_input(), measure_costs=True)
    (choice,) = _choices(report)
    assert choice.scope == "op"


def _layouts() -> dict[str, torch.Tensor]:
    base = torch.arange(40.0)
    return {
        "expanded": torch.tensor(5).expand(2),  # diffusers' timestep, t.expand(batch)
        "expanded rows": torch.randn(1, 8).expand(4, 8),
        "overlapping": base.as_strided((4, 5), (2, 1)),
        "transposed": torch.randn(3, 5).t(),
        "stepped": base[1::3],
        "offset": base[7:19].view(3, 4),
        "channels_last": torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
        "zero-size": torch.randn(3, 0, 2),
        "0-dim": torch.tensor(2.5),
        "int64": torch.arange(6).expand(2, 6),
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_stand_in_inputs_keep_the_real_layout_without_writing_through_it(name: str) -> None:
    x = _layouts()[name]
    (stand_in,) = in_graph.concrete_inputs([x])
    assert (stand_in.shape, stand_in.stride(), stand_in.dtype) == (x.shape, x.stride(), x.dtype)
    assert stand_in.storage_offset() == x.storage_offset()
    if x.numel():
        assert stand_in.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.isfinite(stand_in.float()).all()


class _Denoiser(nn.Module):
    """A diffusion model's first blocks: convolutions and a timestep embedding, the
    timestep passed as diffusers passes it (``t.expand(batch)``, stride 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 32, 3, padding=1)
        self.e = nn.Linear(1, 32)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.c1(x) + self.e(t.float()[:, None])[:, :, None, None]
        return self.c2(torch.relu(h))


def _denoiser_inputs() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _Denoiser().eval(), torch.randn(2, 4, 16, 16), torch.tensor(5).expand(2)


def test_an_expanded_input_beside_convolutions_is_timed_with_the_default_options() -> None:
    """``torch.compile(model, backend="dynajax")`` and nothing else: the graph's
    convolutions are timed in place, on stand-ins laid out as the expanded timestep."""
    model, x, t = _denoiser_inputs()
    backend = dynajax.Backend()
    assert backend.options.measure_costs  # the default
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x, t)
        assert_same(out, model(x, t))
    (choice,) = dynajax.Report(list(backend.graphs)).cost_choices
    assert isinstance(choice, cost.CostChoice) and choice.scope == "graph"
    assert choice.pytorch_s > 0 and choice.xla_s > 0


def _fail(*args: object, **kwargs: object) -> None:
    raise RuntimeError("planted failure")


# Each stage of measuring a graph: (what is replaced by _fail, the stage the report names).
_GRAPH_STAGES = {
    "stand-ins": ((cost, "random_tensor"), "building the stand-in inputs"),
    "copy": ((in_graph, "copy_graph"), "building its partitions both ways"),
    "build": (("dynajax.backend.Backend", "_partitioned"), "building its partitions both ways"),
    "compile and time": ((in_graph, "time_both"), "compiling and timing both builds"),
    "timing": ((cost, "median_times"), "compiling and timing both builds"),
    "fingerprint": ((in_graph, "fingerprint"), "remembering the times"),
}


def _plant(monkeypatch, where: tuple[object, str]) -> None:  # type: ignore[no-untyped-def]
    owner, name = where
    if isinstance(owner, str):  # a class, whose method fails only while measuring
        from dynajax.backend import Backend

        original = Backend._partitioned
        calls = []

        def once_fails(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 1:
                _fail()
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Backend, name, once_fails)
    elif owner is cost and name == "jax":  # jax.jit, as cost.py sees it (JAX's own stays)
        jax = cost.jax
        shim = types.SimpleNamespace(
            jit=_fail, numpy=jax.numpy, block_until_ready=jax.block_until_ready
        )
        monkeypatch.setattr(cost, "jax", shim)
    else:
        monkeypatch.setattr(owner, name, _fail)


@pytest.mark.parametrize("stage", list(_GRAPH_STAGES))
def test_a_failure_in_any_stage_of_timing_a_graph_takes_the_default(monkeypatch, stage) -> None:  # type: ignore[no-untyped-def]
    """Measuring never fails a compile: the convolutions take the default (XLA), the
    answer is eager's, and the report names the op and the error."""
    where, named = _GRAPH_STAGES[stage]
    _plant(monkeypatch, where)
    model, x, t = _denoiser_inputs()
    backend = dynajax.Backend()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x, t)
        assert_same(out, model(x, t))
    report = dynajax.Report(list(backend.graphs))
    choices = report.cost_choices
    assert [c.node for c in choices] == ["convolution", "convolution_1"]
    for c in choices:
        assert isinstance(c, cost.Unmeasured) and c.scope == "graph" and not c.in_pytorch
        assert named in c.error and "RuntimeError: planted failure" in c.error
    assert _chosen_pytorch(report) == []
    assert sum(p.op_count for g in report.graphs for p in g.partitions) == report.aten_ops
    text = report.text(width=None)
    assert "aten.convolution.default  convolution  not measured (timing its graph:" in text
    assert "planted failure): runs in JAX, the default" in text


_OP_STAGES = {
    "stand-ins": ((cost, "random_tensor"), "building the stand-in inputs"),
    "program": ((cost, "jax"), "building XLA's program"),
    "timing": ((cost, "median_times"), "compiling and timing both"),
}


@pytest.mark.parametrize("stage", list(_OP_STAGES))
def test_a_failure_in_any_stage_of_timing_an_op_alone_takes_the_default(monkeypatch, stage) -> None:  # type: ignore[no-untyped-def]
    """Beside a user's op the graph is not timed: the encoder layer is timed alone, and
    a failure there leaves the layer where the defaults put it (JAX, at this size)."""
    where, named = _OP_STAGES[stage]
    layer, x = _layer_and_input()
    model = _WithUserOp(layer)
    _plant(monkeypatch, where)
    report = _compile(model, x)
    (choice,) = report.cost_choices
    assert isinstance(choice, cost.Unmeasured) and choice.scope == "op"
    assert choice.op == "aten._transformer_encoder_layer_fwd.default"
    assert named in choice.error and "planted failure" in choice.error
    assert not choice.in_pytorch
    assert _chosen_pytorch(report) == []
    assert "not measured (timing the op:" in report.text(width=None)

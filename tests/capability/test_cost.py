"""Cost choices measured on the machine that runs them (option ``measure_costs``): both
paths timed at the first compile, the faster kept, the times remembered per machine and
shown in the report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dynajax
from dynajax.capability import Reason, cost, memo
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


def _compile(layer: nn.Module, x: torch.Tensor, **options: object) -> dynajax.Report:
    backend = dynajax.Backend(**options)
    with torch.no_grad():
        # dynamic=False: a new batch size is a new static graph (a symbolic size
        # cannot be measured; the defaults decide it).
        assert_same(torch.compile(layer, backend=backend, dynamic=False)(x), layer(x))
    return dynajax.Report(list(backend.graphs))


def _choices(report: dynajax.Report) -> list[cost.CostChoice]:
    return [c for g in report.graphs for c in g.cost_choices]


@pytest.mark.parametrize("faster", ["pytorch", "xla"])
def test_the_measured_faster_path_is_kept(monkeypatch, faster: str) -> None:
    times = (0.001, 0.002, 0.5) if faster == "pytorch" else (0.002, 0.001, 0.5)
    monkeypatch.setattr(cost, "_measure", lambda node, rule: times)
    report = _compile(*_layer_and_input(), measure_costs=True)
    (choice,) = _choices(report)
    assert (choice.pytorch_s, choice.xla_s, choice.measure_s) == times
    reasons = [f.reason for f in report.fallbacks]
    assert reasons == ([Reason.PERF] if faster == "pytorch" else [])
    text = str(report)
    assert "PyTorch's kernel 1.00 ms" in text or "PyTorch's kernel 2.00 ms" in text
    assert f"runs in {'PyTorch' if faster == 'pytorch' else 'JAX'} (measuring took 0.50 s)" in text


def test_both_paths_are_timed_on_this_machine() -> None:
    report = _compile(*_layer_and_input(), measure_costs=True)
    (choice,) = _choices(report)
    assert choice.pytorch_s > 0 and choice.xla_s > 0 and choice.measure_s > 0
    in_pytorch = [f for f in report.fallbacks if f.reason is Reason.PERF]
    assert bool(in_pytorch) == (choice.pytorch_s < choice.xla_s)


def _counted_measures(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """Replaces the timing by fixed times (XLA faster); returns the nodes measured."""
    calls: list[str] = []

    def measured(node, rule):  # type: ignore[no-untyped-def]
        calls.append(node.name)
        return (0.002, 0.001, 0.3)

    monkeypatch.setattr(cost, "_measure", measured)
    return calls


def test_a_measurement_is_remembered_for_the_same_shapes(monkeypatch) -> None:
    calls = _counted_measures(monkeypatch)
    layer, x = _layer_and_input()
    _compile(layer, x, measure_costs=True)
    torch._dynamo.reset()
    report = _compile(layer, x, measure_costs=True)
    assert len(calls) == 1
    (choice,) = _choices(report)
    assert choice.measure_s == 0.0 and "(cached)" in choice.describe()
    torch._dynamo.reset()
    _compile(layer, torch.randn(3, 16, 64), measure_costs=True)  # other shapes
    assert len(calls) == 2


def test_another_machine_measures_again(monkeypatch) -> None:
    calls = _counted_measures(monkeypatch)
    layer, x = _layer_and_input()
    _compile(layer, x, measure_costs=True)
    monkeypatch.setattr(cost, "machine", lambda: "another CPU; 64 cpus")
    torch._dynamo.reset()
    _compile(layer, x, measure_costs=True)
    assert len(calls) == 2


def test_without_measuring_the_defaults_decide(monkeypatch) -> None:
    monkeypatch.setattr(cost, "_measure", lambda node, rule: pytest.fail("measured"))
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True).eval()
    report = _compile(layer, torch.randn(8, 128, 256), measure_costs=False)
    assert _choices(report) == []
    # The default for a layer this size (2^25 flops and more): PyTorch's kernel.
    (fallback,) = report.fallbacks
    assert fallback.reason is Reason.PERF and "1.4-1.7x" in fallback.detail


def test_measure_costs_is_an_option_with_an_environment_variable(monkeypatch) -> None:
    from dynajax.config import Options
    from dynajax.errors import OptionsError

    monkeypatch.delenv("DYNAJAX_MEASURE_COSTS", raising=False)
    assert Options.resolve().measure_costs is True
    monkeypatch.setenv("DYNAJAX_MEASURE_COSTS", "0")
    assert Options.resolve().measure_costs is False
    with pytest.raises(OptionsError, match="measure_costs must be True or False"):
        dynajax.Backend(measure_costs=1)

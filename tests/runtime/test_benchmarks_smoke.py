"""The benchmark harness runs end to end on its tiniest workload (no timing is
asserted), and the JAX floor it takes from dynajax computes the eager answer."""

from __future__ import annotations

import importlib.util
import json

import jax
import numpy as np
import pytest
import torch

from benchmarks import harness, run
from benchmarks.workloads import WORKLOADS
from tests.tolerances import assert_same


def test_registry_rows_are_well_formed() -> None:
    assert {"add-one", "100-inputs", "mlp", "encoder-layer", "gpt2", "resnet18"} <= set(WORKLOADS)
    for name, w in WORKLOADS.items():
        assert w.name == name
        assert w.group in ("overhead", "model", "training")
        assert callable(w.setup)


def test_run_tiniest_workload(tmp_path, capsys) -> None:
    plot = importlib.util.find_spec("matplotlib") is not None
    argv = ["--workloads", "add-one", "--peers", "eager,dynajax,jax", "--repeats", "2"]
    argv += ["--warmup", "1", "--no-first-call", "--out", str(tmp_path)]
    if not plot:
        argv.append("--no-plot")
    assert run.main(argv) == 0
    printed = capsys.readouterr().out
    assert "steady state, median per call" in printed and "targets:" in printed

    out = json.loads((tmp_path / "latest.json").read_text())
    assert set(out) == {"meta", "workloads", "summary"}
    row = out["workloads"]["add-one"]
    assert row["group"] == "overhead"
    for peer in ("eager", "dynajax", "jax"):
        res = row["steady"][peer]
        assert res["status"] == "ok", res
        assert res["median_s"] > 0 and res["n"] == 2 * WORKLOADS["add-one"].inner
    mem = row["steady"]["dynajax"]["memory"]
    assert mem["calls"] == WORKLOADS["add-one"].memory_calls
    assert {"rss_delta_mib", "live_arrays_before", "live_arrays_after", "flat"} <= set(mem)
    ratios = out["summary"]["ratios"]["add-one"]
    assert ratios["dynajax/eager"] > 0 and ratios["dynajax/jax"] > 0
    assert ratios["dynajax/inductor"] is None  # inductor was not run
    assert "add-one: dynajax/inductor" in out["summary"]["targets"]
    if plot:
        assert (tmp_path / "latest.png").stat().st_size > 0


def test_first_call_worker_runs_in_a_fresh_process() -> None:
    res = harness.time_first_call("add-one", "dynajax", timeout_s=300)
    assert res["status"] == "ok", res
    assert res["first_s"] > 0 and res["second_s"] > 0


@pytest.mark.parametrize("name", ["mlp", "100-inputs"])  # 100-inputs: the direct path
def test_floor_from_the_dynajax_lowered_function(name: str) -> None:
    """The floor calls the JAX function dynajax lowered, on the arguments dynajax gave
    it: its result is the eager model's on the workload's (seeded) inputs."""
    w = WORKLOADS[name]
    floor = harness.dynajax_lowered_step(w)
    assert floor is not None, f"{name} did not lower to one JAX partition"
    eager = w.setup(lambda f: f)  # setup seeds: the same weights and inputs
    with torch.no_grad():
        expected = eager()
    actual = [torch.from_numpy(np.array(a)) for a in jax.tree_util.tree_leaves(floor())]
    assert_same(actual, [expected], model=True)

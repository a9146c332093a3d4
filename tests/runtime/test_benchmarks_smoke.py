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
from tests.helpers import assert_greedy_choices
from tests.tolerances import assert_same


def test_registry_rows_are_well_formed() -> None:
    assert {"add-one", "100-inputs", "mlp", "encoder-layer", "gpt2", "resnet18"} <= set(WORKLOADS)
    assert {"mlp-interleaved", "gpt2-interleaved"} <= set(WORKLOADS)
    for name, w in WORKLOADS.items():
        assert w.name == name
        assert w.group in ("overhead", "model", "training", "interleaved")
        assert callable(w.setup)


def test_interleaved_row_times_each_call(tmp_path, capsys) -> None:
    argv = ["--workloads", "mlp,mlp-interleaved", "--peers", "eager,dynajax", "--repeats", "2"]
    argv += ["--warmup", "1", "--no-first-call", "--no-memory", "--no-plot", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    assert "interleaved: each call's median" in capsys.readouterr().out
    out = json.loads((tmp_path / "latest.json").read_text())
    for peer in ("eager", "dynajax"):
        res = out["workloads"]["mlp-interleaved"]["steady"][peer]
        parts = res["parts_median_s"]
        assert set(parts) == {"compiled", "eager"} and all(v > 0 for v in parts.values())
        assert parts["compiled"] + parts["eager"] <= res["median_s"] * 1.5
    targets = out["summary"]["targets"]
    assert "mlp-interleaved: interleaved sum dynajax/inductor" in targets


def test_run_tiniest_workload(tmp_path, capsys) -> None:
    plot = importlib.util.find_spec("matplotlib") is not None
    argv = ["--workloads", "add-one", "--peers", "eager,dynajax,dynajax-jax,jax"]
    argv += ["--repeats", "2"]
    argv += ["--warmup", "1", "--no-first-call", "--out", str(tmp_path)]
    if not plot:
        argv.append("--no-plot")
    assert run.main(argv) == 0
    printed = capsys.readouterr().out
    assert "steady state, median per call" in printed and "targets:" in printed

    out = json.loads((tmp_path / "latest.json").read_text())
    assert set(out) == {"meta", "workloads", "summary"}
    settings = out["meta"]["cpu_settings"]  # what changes the CPU's kernels and threads
    assert settings["torch kernels"] == torch.backends.cpu.get_cpu_capability()
    row = out["workloads"]["add-one"]
    assert row["group"] == "overhead"
    for peer in ("eager", "dynajax", "dynajax-jax", "jax"):
        res = row["steady"][peer]
        assert res["status"] == "ok", res
        assert res["median_s"] > 0 and res["n"] == 2 * WORKLOADS["add-one"].inner
    # dynajax's first output against eager's, and its graphs, recorded per row
    assert row["steady"]["dynajax"]["max_abs_diff_vs_eager"] == 0.0
    assert row["steady"]["jax"]["max_abs_diff_vs_eager"] == 0.0
    assert row["steady"]["dynajax"]["graphs"].startswith("1 graph(s), partitions per graph [1]")
    assert "dynajax's graphs per row:" in printed
    assert (tmp_path / "partial.json").exists()
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


def test_profile_reports_each_peer(capsys, tmp_path) -> None:
    """benchmarks.profile on the CPU: each peer's wall time per step and its top host
    operators (no kernels to record), dynajax's graph summary, and the traces."""
    from benchmarks import profile

    argv = ["--workloads", "add-one", "--steps", "2", "--warmup", "1"]
    assert profile.main([*argv, "--trace-dir", str(tmp_path)]) == 0
    for peer in ("inductor", "dynajax"):
        trace = json.loads((tmp_path / f"add-one.{peer}.json").read_text())
        assert trace["traceEvents"], peer
    printed = capsys.readouterr().out
    for peer in ("inductor", "dynajax"):
        line = next(ln for ln in printed.splitlines() if ln.startswith(f"add-one / {peer}:"))
        wall = float(line.split("wall ")[1].split(" µs")[0])
        assert wall > 0, line
    assert "dynajax: 1 graph(s), partitions per graph [1]" in printed


def test_device_setting_places_rows(monkeypatch) -> None:
    """--device: a row's model and inputs are built on ``workloads.device()``."""
    from benchmarks import workloads

    monkeypatch.setenv(workloads.DEVICE_ENV, "meta")
    model, (x,) = workloads.placed(*workloads.mlp_model())
    assert x.device.type == "meta" and next(model.parameters()).device.type == "meta"


# -- decode, model suite, checks on every row (benchmarks/decode.py, suite.py, checks.py) --


def test_decode_benchmark_tokens_match_eager_generate() -> None:
    """Every path (transformers' generate with a static cache, the hand-written loop
    over ``StaticDecoder``, and the model in JAX over a StaticCache) gives eager
    generate's tokens, eager and compiled by dynajax, each dynajax graph one partition
    with no fallback."""
    from benchmarks import decode

    size = decode.Size(layers=2, width=64, heads=4, kv_heads=2, vocab=128, prompt=6, new_tokens=5)
    out = decode.measure(size, peers=("eager", "dynajax"), rounds=1)
    torch_paths = ("generate", "loop")
    assert set(out["results"]) == {
        f"{p}/{q}" for p in torch_paths for q in ("eager", "dynajax")
    } | {"jax/dynajax"}
    for key, res in out["results"].items():
        assert res["matches_eager"], key
        assert res["tokens_per_s"] > 0 and res["ttft_s"] > 0, key
    for path in torch_paths:
        graphs = out["results"][f"{path}/dynajax"]["graphs"]
        assert graphs.startswith("2 graph(s), partitions per graph [1, 1]"), graphs
        assert graphs.endswith("fallbacks none"), graphs


def test_decode_profile_times_every_layer() -> None:
    """``--profile``: every layer of a decode step timed, on the partition the step runs."""
    from benchmarks import decode

    size = decode.Size(layers=1, width=32, heads=4, kv_heads=2, vocab=64, prompt=4, new_tokens=2)
    layers = decode.profile(size, calls=2, rounds=1, peer="eager")
    assert list(layers) == [
        "eager, whole step, a new token tensor",
        "dynajax, whole step, a new token tensor",
        "dynajax, whole step, the same token tensor",
        "CompiledPartition.run, as decoding calls it",
        "CompiledPartition.run, every input unchanged",
        "the XLA program alone (jitted on jax.Arrays)",
        "aot_autograd's copy_ of the 2 KV buffers",
        "a token tensor's clone (in the rows above)",
    ]
    assert all(us > 0 for us in layers.values()), layers


def test_static_decoder_writes_its_cache_in_place() -> None:
    """The hand-written loop's cache is its state: a prefill writes the prompt's keys
    and nothing past them, and a one-token step at the last prompt position, which
    sees the earlier tokens only through the cache, gives the full forward's token."""
    from benchmarks import decode

    size = decode.Size(layers=1, width=32, heads=4, kv_heads=2, vocab=64, prompt=4, new_tokens=2)
    model = decode.build_llama(size)
    dec = decode.StaticDecoder(model, 1, size.prompt + size.new_tokens)
    ids = decode.prompt_ids(size)
    with torch.no_grad():
        dec(ids, torch.arange(size.prompt))
        assert dec.k0[:, :, : size.prompt].abs().sum() > 0
        assert dec.k0[:, :, size.prompt :].abs().sum() == 0
        token = dec(ids[:, -1:], torch.tensor([size.prompt - 1]))
        assert token.shape == (1, 1)
        # the full forward's argmax, up to a near-tie of its logits (two programs' roundings)
        assert_greedy_choices(model(ids).logits[:, -1:], token)


def test_suite_rows_cover_the_model_tests() -> None:
    from benchmarks.suite import suite_workloads
    from tests.test_models import CASES, ZOO

    rows = suite_workloads(train=True)
    assert set(rows) == (
        set(CASES)
        | {f"{n}-train" for n in CASES}
        | {f"hf-{n}" for n in ZOO}
        | {f"hf-{n}-train" for n in ZOO}
    )
    assert {w.group for n, w in rows.items() if n.endswith("-train")} == {"training"}


@pytest.mark.parametrize("name", ["llama", "hf-vit", "cnn-train"])
def test_suite_row_matches_eager(name: str) -> None:
    """A suite row's dynajax step computes its eager step's answer (same seed)."""
    from benchmarks.suite import suite_workloads

    w = suite_workloads(train=True)[name]
    eager, compiled = harness.build_step(w, "eager"), harness.build_step(w, "dynajax")
    expected, actual = eager(), compiled()
    if not isinstance(expected, torch.Tensor):  # a transformers ModelOutput
        expected, actual = expected[0], actual[0]
    assert_same(actual, expected, model=True)


def test_run_suite_mode(tmp_path, capsys) -> None:
    argv = ["--suite", "models", "--workloads", "mlp,mlp-train", "--train"]
    argv += ["--peers", "eager,dynajax", "--repeats", "1", "--warmup", "1"]
    argv += ["--no-plot", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    assert "models geomean: dynajax/eager" in capsys.readouterr().out
    out = json.loads((tmp_path / "latest.json").read_text())
    assert out["meta"]["suite"] == "models"
    assert {out["workloads"][n]["group"] for n in ("mlp", "mlp-train")} == {"model", "training"}
    for n in ("mlp", "mlp-train"):
        assert all(r["status"] == "ok" for r in out["workloads"][n]["steady"].values()), n
        assert out["workloads"][n]["first_call"] == {}


@pytest.mark.parametrize("name", ["mlp", "mlp-train"])
def test_checks_on_and_off_compute_the_eager_row(name: str) -> None:
    """benchmarks.checks --workloads: both variants of a main-table row compute its
    eager answer (the mlp's first call, or the training step's first loss)."""
    from benchmarks import checks

    w = WORKLOADS[name]
    eager = harness.build_step(w, "eager")
    expected = eager()
    for on in (False, True):
        assert_same(checks._workload(name)(on)(), expected, model=True)
    med = checks.measure(f"workload:{name}", rounds=1, scale=0.01)
    assert med["on"] > 0 and med["off"] > 0


def test_overhead_layers_and_cprofile(capsys, monkeypatch) -> None:
    """``benchmarks.overhead`` times every layer of both tiny functions and ranks the
    Python functions of each peer's whole call (tiny counts: nothing is timed here)."""
    from benchmarks import overhead

    monkeypatch.setattr(overhead, "N_INPUTS", 3)
    overhead.main(["--calls", "5", "--rounds", "1", "--no-context", "--cprofile", "5"])
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    for layer in ("jax.jit, jax.Array in/out", "dynajax partition", "inductor, whole call"):
        assert sum(ln.startswith(layer) for ln in lines) == 2, layer
    assert "cProfile, x + 1, dynajax" in printed and "cProfile, 3 inputs, inductor" in printed
    assert "dynajax / inductor, whole call" in printed
    # Dynamo's share by output: each kind of ready-made output, dropped and kept
    for kind in ("torch-allocated output", "output over an XLA buffer"):
        for fate in ("dropped", "kept"):
            assert sum(ln.startswith(f"{kind}, {fate}") for ln in lines) == 1, (kind, fate)
    assert "freeing the output (dropped - kept)" in printed


def test_the_memory_rows_device_peak_adds_jaxs_for_dynajax_only(monkeypatch) -> None:
    # (the GPU path of benchmarks.memory, on its own: PyTorch's allocator's peak, and
    # JAX's where the peer keeps its state there)
    from benchmarks import memory

    class Gpu:
        def memory_stats(self) -> dict[str, int]:
            return {"peak_bytes_in_use": 50, "bytes_in_use": 7}

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 100)
    monkeypatch.setattr(jax, "devices", lambda platform=None: [Gpu(), Gpu()])
    assert memory.device_peak_bytes("eager") == 100
    assert memory.device_peak_bytes("inductor") == 100
    assert memory.device_peak_bytes("dynajax") == 200

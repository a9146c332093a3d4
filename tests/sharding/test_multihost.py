"""Many hosts: two processes of four CPU devices each, joined by ``jax.distributed`` on
localhost (CPU collectives over gloo) into one mesh of eight, train an MLP with dynajax
(data parallel and FSDP) and match eager, each process holding the whole results; and
``dynajax.train_step`` with FSDP over both, checkpointed and restored in between."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROCESSES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> list[dict]:
    if "jax_cpu_collectives_implementation" not in jax.config.values:
        pytest.skip(
            f"jax {jax.__version__} has no jax_cpu_collectives_implementation option: its "
            "CPU client cannot run collectives across processes"
        )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    port = str(_free_port())
    directory = str(tmp_path_factory.mktemp("ckpt"))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.sharding.multihost_worker",
                str(i),
                str(PROCESSES),
                port,
                directory,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for i in range(PROCESSES)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def test_processes_form_one_mesh(facts) -> None:
    assert [f["process_index"] for f in facts] == list(range(PROCESSES))
    for f in facts:
        assert (f["process_count"], f["global_devices"], f["local_devices"]) == (2, 8, 4)
        assert f["collectives"] == "gloo"


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_training_across_processes_matches_eager(facts, strategy) -> None:
    for f in facts:
        s = f[strategy]
        for ours, eager in zip(s["losses"], s["ref_losses"], strict=True):
            assert ours == pytest.approx(eager, rel=1e-5, abs=1e-6)
        assert s["grad_diff"] < 1e-5
        assert s["param_diff"] < 1e-5
    # One SPMD program: every process computed the very same numbers.
    assert facts[0][strategy]["losses"] == facts[1][strategy]["losses"]


def test_each_process_measures_its_own_devices(facts) -> None:
    for f in facts:
        dp, fsdp = f["dp"], f["fsdp"]
        assert len(dp["bytes_per_device"]) == 4  # this process's devices only
        assert set(dp["bytes_per_device"].values()) == {dp["total_bytes"]}
        assert set(fsdp["bytes_per_device"].values()) == {fsdp["total_bytes"] // 8}
        assert "mesh data=8 (8 cpu devices)" in fsdp["report"]


def test_train_step_across_processes_is_eagers_and_checkpoints(facts) -> None:
    # dynajax.train_step with FSDP over both processes' 8 devices: AdamW, a checkpoint
    # after 5 steps (each process writing its shards) restored into a fresh model.
    for f in facts:
        s = f["train_step"]
        assert s["restored_at"] == 5
        for ours, eager in zip(s["losses"], s["ref_losses"], strict=True):
            assert ours == pytest.approx(eager, rel=1e-5, abs=1e-6)
        assert s["param_diff"] < 1e-5
        sharded = s["whole_bytes"] - s["replicated_bytes"]
        assert s["per_device"] == [sharded // 8 + s["replicated_bytes"]] * 4  # its 4 devices
    assert facts[0]["train_step"]["losses"] == facts[1]["train_step"]["losses"]

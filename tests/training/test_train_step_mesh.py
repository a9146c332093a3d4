"""``dynajax.train_step`` on a mesh of eight JAX CPU devices (one subprocess,
``train_step_mesh_worker``, so the rest of the suite keeps one device): FSDP and data
parallel train as eager does, the optimizer's moments are sharded like their
parameters, each device holds 1/8 of the state (measured from the arrays), and a
checkpoint saved on 8 devices continues on 4."""

from __future__ import annotations

import pytest

from tests.helpers import run_worker

CASES = ["fsdp_mlp", "dp_mlp", "fsdp_llama"]


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    return run_worker("tests.training.train_step_mesh_worker", str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("name", CASES)
def test_training_on_the_mesh_is_eagers(facts, name) -> None:
    f = facts[name]
    assert facts["devices"] == 8
    for ours, eager in zip(f["losses"], f["ref_losses"], strict=True):
        assert ours == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert f["param_diff"] < 5e-5  # every parameter after the run
    assert f["state_diff"] < 5e-6  # every optimizer moment
    # One program for every step (AdamW's state made before the first); SGD's momentum
    # buffer is a copy of the first gradient: a first program, which creates it.
    assert f["traces"] == (2 if name == "dp_mlp" else 1)


@pytest.mark.parametrize("name", ["fsdp_mlp", "fsdp_llama"])
def test_fsdp_holds_an_eighth_of_parameters_and_optimizer_state_per_device(facts, name) -> None:
    f = facts[name]
    # Measured from the arrays' shards: every tensor whose dim 0 divides by 8 is split
    # (moments as their parameters), only the optimizer's step counts are replicated.
    assert f["moment_specs"] == ["P('data',)"]
    sharded = f["whole_bytes"] - f["replicated_bytes"]
    assert f["replicated_bytes"] < 0.001 * f["whole_bytes"]
    assert f["per_device"] == [sharded // 8 + f["replicated_bytes"]] * 8
    assert "train_step state on mesh data=8 (8 cpu devices)" in f["report"]
    assert "optimizer state:" in f["report"]


def test_data_parallel_replicates_the_state(facts) -> None:
    f = facts["dp_mlp"]
    assert f["per_device"] == [f["whole_bytes"]] * 8
    assert f["moment_specs"] == []  # SGD keeps momentum_buffer only


def test_a_checkpoint_from_eight_devices_continues_on_four(facts) -> None:
    r = facts["restore"]
    assert r["saved_at"] == r["restored_at"] == 10
    # The same losses as the uninterrupted 8-device run; the reductions are split over
    # 4 devices instead of 8, so the last bits may differ.
    for ours, straight in zip(r["losses"], r["uninterrupted"], strict=True):
        assert ours == pytest.approx(straight, rel=1e-5, abs=1e-6)
    assert r["losses"][:10] == r["uninterrupted"][:10]
    assert r["devices_after"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    sharded = r["whole_after"] - r["replicated_after"]
    assert r["per_device_after"] == [sharded // 4 + r["replicated_after"]] * 4

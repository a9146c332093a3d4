"""``mesh=``/``sharding=``: models sharded on eight JAX CPU devices give eager's answers.

One subprocess (``sharding_worker``, eight host devices, so the rest of the suite keeps
one) runs every strategy, inference and five optimizer steps each, and prints facts:
data parallel, FSDP, tensor parallel (MLP; GPT-2 attention and MLP projections) and a
2-D data x model mesh; the per-device bytes of parameters are measured from the placed
arrays' shards.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_worker

STRATEGIES = ["dp_mlp", "fsdp_mlp", "tp_mlp", "tp_gpt2", "2d_mlp", "2d_gpt2"]
MLP_NAMES = {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.fixture(scope="module")
def facts() -> dict:
    return run_worker("tests.sharding.sharding_worker")


@pytest.mark.parametrize("name", STRATEGIES)
def test_inference_and_training_match_eager(facts, name) -> None:
    f = facts[name]
    assert f["inference_diff"] < 1e-5
    for ours, eager in zip(f["losses"], f["ref_losses"], strict=True):
        assert ours == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert f["grad_diff"] < 1e-5  # the last step's gradients
    assert f["param_diff"] < 1e-5  # after five steps
    assert f["output_is_whole"]  # PyTorch gets whole tensors back


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_program_is_partitioned_and_state_is_shared(facts, name) -> None:
    f = facts[name]
    assert facts["devices"] == 8
    assert f["collectives"], "XLA inserted no collective: nothing was sharded"
    assert f["backward_shares_forward_copies"]  # one resident copy per weight, not two
    assert all(s["devices"] == 8 for s in f["state"].values())


def test_data_parallel_replicates_state_and_splits_the_batch(facts) -> None:
    f = facts["dp_mlp"]
    assert set(f["state"]) == MLP_NAMES  # the names of model.named_parameters()
    assert {s["spec"] for s in f["state"].values()} == {"replicated"}
    assert f["bytes_per_device"] == [f["total_bytes"]]
    assert "P('data',)" in f["input_specs"]  # the batch


def test_fsdp_shards_what_divides_and_says_why_not_the_rest(facts) -> None:
    state = facts["fsdp_mlp"]["state"]
    for name in ("0.weight", "0.bias"):
        assert state[name]["spec"] == "P('data')"
        assert state[name]["per_device"] == [state[name]["nbytes"] // 8]  # measured
    for name in ("2.weight", "2.bias"):  # 12 output features: not divisible by 8
        assert state[name]["spec"] == "replicated"
        assert "dimension 0 (size 12) is not divisible by 8" in state[name]["note"]
        assert state[name]["per_device"] == [state[name]["nbytes"]]
    sharded = state["0.weight"]["nbytes"] + state["0.bias"]["nbytes"]
    replicated = state["2.weight"]["nbytes"] + state["2.bias"]["nbytes"]
    assert facts["fsdp_mlp"]["bytes_per_device"] == [sharded // 8 + replicated]


def test_tensor_parallel_splits_columns_then_rows(facts) -> None:
    state = facts["tp_mlp"]["state"]
    assert state["0.weight"]["spec"] == "P('model', None)"
    assert state["2.weight"]["spec"] == "P(None, 'model')"
    assert state["0.weight"]["per_device"] == [state["0.weight"]["nbytes"] // 8]
    assert state["2.weight"]["per_device"] == [state["2.weight"]["nbytes"] // 8]
    assert "other inputs: replicated (no batch axis in the mesh)" in facts["tp_mlp"]["report"]
    gpt = facts["tp_gpt2"]["state"]
    for name in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight"):
        s = gpt[f"transformer.h.0.{name}"]
        assert s["spec"] != "replicated"
        assert s["per_device"] == [s["nbytes"] // 8]
    assert gpt["transformer.wte.weight"]["spec"] == "replicated"


def test_two_dimensional_mesh_splits_model_axis_only_for_state(facts) -> None:
    state = facts["2d_gpt2"]["state"]
    s = state["transformer.h.0.mlp.c_proj.weight"]
    assert s["spec"] == "P('model', None)"
    assert s["per_device"] == [s["nbytes"] // 4]  # "model" has 4 devices
    assert "P('data',)" in facts["2d_gpt2"]["input_specs"]
    assert "mesh data=2 x model=4 (8 cpu devices)" in facts["2d_gpt2"]["report"]


def test_report_shows_mesh_specs_and_measured_bytes(facts) -> None:
    report = facts["fsdp_mlp"]["report"]
    assert "placement: mesh data=8 (8 cpu devices)" in report
    assert re.search(r"0\.weight +\[64, 32\] +float32 +P\('data'\) +1\.0 KiB/device\n", report)
    assert "(measured on 8 device(s))" in report


def test_a_mesh_of_one_device_is_device(facts) -> None:
    f = facts["one_device_mesh"]
    assert f["diff"] < 1e-6
    assert f["device"] == "cpu:1"
    assert f["multi_device"] is False
    assert f["resident_devices"] == ["cpu:1"]


def test_an_indivisible_rule_is_a_clear_error(facts) -> None:
    msg = facts["indivisible"]
    assert msg.startswith("ShardingError: sharding rule '^2\\\\.weight$' gives parameter")
    assert "(shape [12, 64])" in msg
    assert "dimension 0 (size 12) is not divisible by 8" in msg
    assert "indivisible='replicate'" in msg


def test_ops_in_pytorch_between_sharded_partitions_get_whole_tensors(facts) -> None:
    f = facts["eager_between"]
    assert f["partitions"] == 2
    assert f["loss_diff"] < 1e-6
    assert f["grad_diff"] < 1e-6
    assert "in PyTorch: 1 op(s) run on whole tensors between partitions" in f["report"]


def test_dynamic_batch_sizes_split_when_they_divide(facts) -> None:
    f = facts["dynamic"]
    assert f["dynamic"]
    assert max(f["diffs"]) < 1e-5


def test_jax_function_state_placed_by_the_same_rules(facts) -> None:
    # On jax.make_mesh's Explicit axes, state and input alike (the user's own mesh).
    f = facts["interop"]
    assert f["mesh_types"] == ["AxisType.Explicit"]
    assert f["diff"] < 1e-5
    assert f["grad_diff"] < 1e-5
    assert f["specs"]["0.weight"] == "P('model', None)"
    assert f["grad_specs"]["0.weight"] == "P('model', None)"  # laid out as the parameter
    assert f["specs"]["2.bias"] == "P()"
    assert f["per_device"]["0.weight"] == [64 * 32 * 4 // 4]  # 4 devices on "model"

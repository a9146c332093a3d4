"""``device=``: a model runs on a chosen JAX device with its parameters resident there
(a second CPU device here, in a subprocess with two host devices)."""

from __future__ import annotations

import pytest

import dynajax
from dynajax import OptionsError
from tests.helpers import run_worker


@pytest.fixture(scope="module")
def facts() -> dict:
    return run_worker("tests.runtime.placement_worker")


def test_parameters_are_resident_on_the_chosen_device(facts) -> None:
    assert facts["devices"] == 2
    assert facts["resident_count"] > 0
    assert facts["resident_devices"] == ["cpu:1"]
    assert facts["kept_between_calls"]  # no copy per call
    assert facts["output_device"] == "cpu"


def test_training_on_the_device_matches_eager(facts) -> None:
    for ours, eager in zip(facts["losses"], facts["ref_losses"], strict=True):
        assert ours == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert facts["param_diff"] < 1e-5  # optimizer steps reached the resident copies
    assert facts["buffer_diff"] < 1e-5  # BatchNorm statistics written back


def test_inference_and_load_state_dict_refresh(facts) -> None:
    assert facts["eval_diff"] < 1e-5
    assert facts["refreshed_after_load"]
    assert facts["after_load_diff"] < 1e-5


@pytest.mark.parametrize(
    "value, message",
    [
        ("cpu:7", "numbered 0 to 0"),
        ("tpu", "no 'tpu' devices"),
        (3, "a jax.Device or a string"),
    ],
    ids=["index", "platform", "type"],
)
def test_bad_device_is_a_clear_error(value, message) -> None:
    with pytest.raises(OptionsError, match=message):
        dynajax.Backend(device=value)


def test_device_option_resolves_strings() -> None:
    import jax

    assert dynajax.Backend(device="cpu").options.device == jax.devices("cpu")[0]
    assert dynajax.Backend(device="cpu:0").options.device == jax.devices("cpu")[0]

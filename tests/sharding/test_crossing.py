"""``crossing``: placement's one answer to where a partition runs and how its tensors
cross, for each of its four cases. The runtime takes it as it is
(``CompiledPartition(crossing=...)``); the GPU cases are built here from fake CUDA
tensors, which a CPU machine can trace."""

from __future__ import annotations

import jax
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dynajax.lowering.interpreter import LoweredPartition, lower_partition
from dynajax.runtime import conversion
from dynajax.sharding.placement import Placement, crossing


def _graph(device: str) -> LoweredPartition:
    """``x * s, s + 1`` of an (x, s) on ``device`` with ``s`` a 0-dim CPU tensor, lowered."""
    with FakeTensorMode():
        x = torch.empty(3, device=device)
        s = torch.empty(())
    return lower_partition("jax_0", make_fx(lambda x, s: (x * s, s + 1), tracing_mode="fake")(x, s))


def test_cpu_tensors_cross_where_they_are_without_copies() -> None:
    c = crossing(_graph("cpu"))
    assert (c.partition, c.device_type, c.on_accelerator, c.zero_copy) == (None, "cpu", False, True)
    assert c.convert is conversion.fast_to_jax
    assert c.make_cached is conversion.zero_copy_array
    assert c.to_torch is conversion.cpu_to_torch
    assert c.platform == "cpu" and c.cpu_outputs == [] and not c.multi_device
    assert c.sharding == jax.sharding.SingleDeviceSharding(conversion.cpu_device())


def test_cpu_tensors_are_committed_to_jax_cpu_when_jax_defaults_to_an_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    c = crossing(_graph("cpu"))
    assert c.zero_copy and c.convert is conversion.committed_cpu and c.platform == "cpu"
    a = c.convert(torch.arange(3.0))
    assert a.devices() == {conversion.cpu_device()}


def test_an_accelerators_tensors_cross_by_dlpack_and_cpu_results_go_back_to_the_cpu() -> None:
    c = crossing(_graph("cuda"))
    assert (c.partition, c.device_type, c.on_accelerator, c.zero_copy) == (
        None,
        "cuda",
        True,
        False,
    )
    # the 0-dim CPU tensor among the GPU's is copied per call, never cached as a CPU array
    assert c.make_cached is conversion.accelerator_array
    assert c.make_cached(torch.ones(())) is None
    # ``s + 1`` is a CPU tensor in eager: moved back there after each call
    assert c.cpu_outputs == [1]
    assert c.results_device == torch.device("cuda", 0)
    assert c.to_torch is None  # the runtime's remembering importer, for results_device


def test_a_placement_on_the_cpu_tensors_own_device_is_the_zero_copy_path() -> None:
    c = crossing(_graph("cpu"), Placement(device=conversion.cpu_device()))
    assert c.partition is None and c.zero_copy


def test_a_placement_elsewhere_decides_a_sharding_per_input() -> None:
    placement = Placement(device=conversion.cpu_device())
    c = crossing(_graph("cuda"), placement)
    assert c.partition is not None and c.partition.placement is placement
    assert c.device == conversion.cpu_device() and not c.multi_device
    assert not c.on_accelerator and not c.zero_copy
    assert isinstance(c.convert, list) and len(c.convert) == 2  # one per tensor input
    assert c.sharding == placement.sharding(jax.sharding.PartitionSpec())
    assert c.out_sharding is None  # one device: outputs stay on it
    assert [d.kind for d in c.partition.inputs] == ["input", "input"]

"""Sharding rules, parameter names and the one-device mesh, in this (one-device) process.

The decisions are checked on ``AbstractMesh``es of any shape (they need axis names and
sizes only); placing on many devices is ``test_mesh.py``'s subprocess.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
import torch
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dynajax
from dynajax import OptionsError, ShardingRules
from dynajax.sharding import StateName, dynamo_input_names, source_state_name
from dynajax.sharding.names import aten_input_names
from dynajax.sharding.rules import describe_spec, misfit
from tests.models import cnn, mlp
from tests.tolerances import assert_same

MESH_8 = AbstractMesh((8,), ("data",))
MESH_2X4 = AbstractMesh((2, 4), ("data", "model"))


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("data",))


# ---------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------


def test_first_matching_rule_wins_and_unmatched_is_replicated() -> None:
    rules = ShardingRules.coerce(
        [
            (r"attn\.c_attn\.weight$", P(None, "model")),
            (r"weight$", ("model", None)),  # a tuple is a PartitionSpec
            (r"\.bias$", None),  # None: replicated
        ]
    )
    assert rules.match("h.0.attn.c_attn.weight") == (P(None, "model"), r"attn\.c_attn\.weight$")
    assert rules.match("h.0.mlp.c_fc.weight") == (P("model", None), "weight$")
    assert rules.match("h.0.mlp.c_fc.bias") == (P(), r"\.bias$")
    assert rules.match("wte") == (P(), None)


def test_rules_from_a_mapping_keep_its_order() -> None:
    rules = ShardingRules.coerce({"a": P("data"), ".*": P()})
    assert [p for p, _ in rules.params] == ["a", ".*"]
    assert ShardingRules.coerce(None) == ShardingRules()
    assert ShardingRules.coerce(rules) is rules


@pytest.mark.parametrize(
    "value, message",
    [
        (3, "sharding must be a dynajax.ShardingRules, a mapping"),
        ([("(", P())], "not a valid regex"),
        ([("w", 3)], "is not a PartitionSpec"),
        (["w"], "is not a \\(regex, PartitionSpec\\) pair"),
    ],
    ids=["type", "regex", "spec", "pair"],
)
def test_bad_rules_are_clear_errors(value: Any, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        ShardingRules.coerce(value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_axis": 3}, "batch_axis must be a mesh axis name"),
        ({"batch_dim": -1}, "batch_dim must be >= 0"),
        ({"indivisible": "ignore"}, "indivisible must be one of \\['error', 'replicate'\\]"),
    ],
    ids=["batch-axis", "batch-dim", "policy"],
)
def test_bad_settings_are_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        ShardingRules(**kwargs)


def test_validate_names_missing_and_repeated_axes() -> None:
    with pytest.raises(OptionsError, match=r"names mesh axis 'model', but the mesh has axes"):
        ShardingRules([("w", P("model"))]).validate(MESH_8)
    with pytest.raises(OptionsError, match="uses mesh axis 'data' twice"):
        ShardingRules([("w", P("data", "data"))]).validate(MESH_8)
    with pytest.raises(OptionsError, match="batch_axis 'batch' names mesh axis 'batch'"):
        ShardingRules(batch_axis="batch").validate(MESH_8)
    # The default batch axis may be absent: a tensor-parallel mesh replicates inputs.
    tp = AbstractMesh((8,), ("model",))
    ShardingRules().validate(tp)
    assert ShardingRules().batch_spec(tp, (16, 4)) == P()


def test_batch_spec_splits_what_divides() -> None:
    rules = ShardingRules()
    assert rules.batch_spec(MESH_8, (16, 32)) == P("data")
    assert rules.batch_spec(MESH_8, (12, 32)) == P()  # not divisible: replicated
    assert rules.batch_spec(MESH_8, ()) == P()  # no batch dimension
    assert ShardingRules(batch_dim=1).batch_spec(MESH_8, (3, 16)) == P(None, "data")
    assert ShardingRules(batch_axis=None).batch_spec(MESH_8, (16,)) == P()
    both = ShardingRules(batch_axis=("data", "model"))
    assert both.batch_spec(MESH_2X4, (16, 2)) == P(("data", "model"))
    assert both.batch_spec(MESH_2X4, (4, 2)) == P()


def test_misfit_says_why() -> None:
    assert misfit(P("data", None), (16, 3), MESH_8) is None
    assert misfit(P(None, "model"), (3, 8), MESH_2X4) is None
    assert misfit(P("data"), (12,), MESH_8) == (
        "dimension 0 (size 12) is not divisible by 8 (mesh data=8)"
    )
    assert misfit(P(("data", "model")), (4,), MESH_2X4) == (
        "dimension 0 (size 4) is not divisible by 8 (mesh data=2 x model=4)"
    )
    assert misfit(P("data", None), (16,), MESH_8) == (
        "the spec has 2 entries but the tensor has 1 dimension(s)"
    )


def test_presets() -> None:
    assert ShardingRules.data_parallel().params == ()
    fsdp = ShardingRules.fsdp("batch")
    assert fsdp.match("anything") == (P("batch"), ".*")
    assert (fsdp.batch_axis, fsdp.indivisible) == ("batch", "replicate")
    assert describe_spec(P()) == describe_spec(P(None)) == "replicated"
    assert describe_spec(P(None, "model")) == "P(None, 'model')"


# ---------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "L['self']._modules['h']._modules['0']._parameters['weight']",
            ("h.0.weight", "parameter"),
        ),
        ("L['fn'].__self__._modules['1']._buffers['running_mean']", ("1.running_mean", "buffer")),
        ("L['fn']._modules['0']._parameters['bias']", ("0.bias", "parameter")),
        ("G['model']._modules['0']._parameters['weight']", ("model.0.weight", "parameter")),
        ("L['args'][0]", None),
        ("L['x']", None),
        ("L['self'].mask", None),  # a plain tensor attribute: not state
        ("___from_numpy(L['a'])", None),
    ],
)
def test_source_names(source: str, expected: tuple[str, str] | None) -> None:
    got = source_state_name(source)
    assert (None if got is None else (got.name, got.kind)) == expected


class _Recording(dynajax.Backend):
    """A backend that records the names it derives for each ATen graph."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.dynamo: list[StateName | None] = []
        self.aten: dict[str, dict[str, StateName]] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        self.dynamo = dynamo_input_names(gm)
        return super().__call__(gm, example_inputs, **kwargs)

    def compile_aten_graph(self, gm: Any, example_inputs: Any, *, kind: str, **kw: Any) -> Any:
        self.aten[kind] = {k: v for k, v in aten_input_names(gm, kw.get("input_names", ())).items()}
        return super().compile_aten_graph(gm, example_inputs, kind=kind, **kw)


def test_graph_inputs_are_named_like_named_parameters_and_buffers() -> None:
    model = cnn().train()
    backend = _Recording(mesh=one_device_mesh(), cache_dir="")
    torch.compile(model, backend=backend)(torch.randn(2, 3, 16, 16)).sum().backward()
    expected = {n: "parameter" for n, _ in model.named_parameters()}
    expected |= {n: "buffer" for n, _ in model.named_buffers()}
    assert {s.name: s.kind for s in backend.dynamo if s is not None} == expected
    assert backend.dynamo.count(None) == 1  # the image batch
    forward = {s.name: s.kind for s in backend.aten["forward"].values()}
    assert forward == expected
    # The backward graph's parameters keep their names (saved activations have none).
    backward = {s.name for s in backend.aten["backward"].values()}
    assert backward and backward <= set(expected)


# ---------------------------------------------------------------------------------
# A mesh of one device; place()
# ---------------------------------------------------------------------------------


def test_a_mesh_of_one_device_runs_there_like_device() -> None:
    mesh = one_device_mesh()
    backend = dynajax.Backend(mesh=mesh, sharding={"weight": P("data", None)}, cache_dir="")
    assert backend.placement is not None
    assert backend.placement.device == jax.devices()[0]
    assert not backend.placement.multi_device
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 32)
    assert_same(torch.compile(model, backend=backend)(x), model(x))


def test_torch_compile_passes_mesh_and_sharding_through() -> None:
    model = mlp()
    x = torch.randn(4, 32)
    options = {"mesh": one_device_mesh(), "sharding": ShardingRules.fsdp()}
    compiled = torch.compile(model, backend="dynajax", options=options)
    assert_same(compiled(x), model(x))


def test_place_lays_out_state_by_the_rules() -> None:
    mesh = one_device_mesh()
    fn, state = dynajax.jax_function(mlp(), torch.randn(4, 32))
    placed = dynajax.sharding.place(state, mesh, {r"0\.weight": P("data", None)})
    assert set(placed) == set(state)
    assert isinstance(placed["0.weight"].sharding, NamedSharding)
    assert placed["0.weight"].sharding.spec == P("data", None)
    assert placed["0.bias"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(placed["0.weight"]), np.asarray(state["0.weight"]))
    x = np.ones((4, 32), np.float32)
    np.testing.assert_allclose(jax.jit(fn)(placed, x), fn(state, x), rtol=1e-6)
    with pytest.raises(OptionsError, match="mesh must be a jax.sharding.Mesh"):
        dynajax.sharding.place(state, MESH_8, None)  # type: ignore[arg-type]

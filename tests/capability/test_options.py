"""Steering options: values, DYNAJAX_* variables, strict mode, torch.compile pass-through."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
import torch
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

import dynajax
from dynajax import Options, OptionsError, Reason, UnsupportedNodesError
from dynajax.diagnostics.logs import forget_logged_fallbacks
from tests.tolerances import assert_same


@torch.library.custom_op("dynajax_opttest::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


def two_fallbacks(x):
    y = opaque(x.sin())
    return torch.nonzero(y > 1).sum() + y.cos().sum()


# ---------------------------------------------------------------------------------
# Values and environment variables
# ---------------------------------------------------------------------------------


def test_env_vars_set_every_option(monkeypatch) -> None:
    monkeypatch.setenv("DYNAJAX_MIN_BLOCK_SIZE", "4")
    monkeypatch.setenv("DYNAJAX_FALLBACK_OPS", "aten.sort, aten.nonzero.default")
    monkeypatch.setenv("DYNAJAX_STRICT", "yes")
    o = Options.resolve()
    assert (o.min_block_size, o.fallback_ops, o.strict) == (
        4,
        ("aten.sort", "aten.nonzero.default"),
        True,
    )
    assert dynajax.Backend().options == o  # a Backend reads them too
    # Explicit options win over the environment.
    assert Options.resolve({"strict": False, "min_block_size": 2}).min_block_size == 2
    assert dynajax.Backend(min_block_size=2).options.min_block_size == 2
    monkeypatch.setenv("DYNAJAX_STRICT", "1")
    assert Options.resolve().strict is True
    monkeypatch.setenv("DYNAJAX_DEVICE", "cpu:0")
    assert Options.resolve().device == jax.devices("cpu")[0]
    assert Options.resolve().perf_fallbacks is True
    monkeypatch.setenv("DYNAJAX_PERF_FALLBACKS", "off")
    assert Options.resolve().perf_fallbacks is False


@pytest.mark.parametrize(
    "var, raw, message",
    [
        ("DYNAJAX_STRICT", "maybe", "valid values are 0, 1, false, no, off, on, true, yes"),
        ("DYNAJAX_MIN_BLOCK_SIZE", "many", "DYNAJAX_MIN_BLOCK_SIZE='many' is not an integer"),
        ("DYNAJAX_MIN_BLOCK_SIZE", "0", "DYNAJAX_MIN_BLOCK_SIZE='0': min_block_size must be >= 1"),
        ("DYNAJAX_FALLBACK_OPS", "aten.nonzer", "did you mean 'aten.nonzero'"),
        ("DYNAJAX_DEVICE", "cpu:9", "DYNAJAX_DEVICE='cpu:9': device 'cpu:9': JAX has 1 cpu"),
    ],
    ids=["strict", "block-not-int", "block-zero", "op-typo", "device"],
)
def test_bad_env_values_name_the_variable_and_valid_values(monkeypatch, var, raw, message) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(OptionsError, match=message):
        Options.resolve()


def test_mesh_and_sharding_options_are_validated(monkeypatch) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(OptionsError, match="mesh must be a jax.sharding.Mesh"):
        dynajax.Backend(mesh="cpu")
    with pytest.raises(OptionsError, match="an AbstractMesh has none"):
        dynajax.Backend(mesh=AbstractMesh((8,), ("data",)))
    with pytest.raises(OptionsError, match="pass one: device= for one device, mesh= for"):
        dynajax.Backend(mesh=mesh, device="cpu:0")
    with pytest.raises(OptionsError, match="sharding rules need a mesh"):
        dynajax.Backend(sharding={"weight": P("data")})
    with pytest.raises(OptionsError, match="names mesh axis 'model', but the mesh has axes"):
        dynajax.Backend(mesh=mesh, sharding={"weight": P("model")})
    o = dynajax.Backend(mesh=mesh, sharding={"weight": ("data",)}).options
    assert o.sharding == dynajax.ShardingRules([("weight", P("data"))])
    assert dynajax.Backend(mesh=mesh).options.sharding == dynajax.ShardingRules()
    # An explicit mesh beats a device from the environment.
    monkeypatch.setenv("DYNAJAX_DEVICE", "cpu:0")
    assert dynajax.Backend(mesh=mesh).options.device is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"strict": "yes"}, "strict must be True or False"),
        ({"perf_fallbacks": 1}, "perf_fallbacks must be True or False"),
        ({"min_block_size": 1.5}, "min_block_size must be an int >= 1"),
        ({"min_block_size": "3"}, "min_block_size must be an int >= 1"),
        ({"min_block_size": 0}, "min_block_size must be >= 1"),
        ({"fallback_ops": ["aten.sort.stabel"]}, "valid ones are .*'aten.sort.stable'"),
        ({"fallback_ops": ["sort"]}, "is not an op name; use 'aten.sort'"),
        ({"fallback_ops": [3]}, "neither an op name nor a torch op"),
        ({"min_blocksize": 3}, r"valid options are \['min_block_size', 'fallback_ops'"),
    ],
    ids=[
        "strict",
        "perf",
        "block",
        "block-str",
        "block-zero",
        "overload",
        "no-namespace",
        "not-a-name",
        "unknown",
    ],
)
def test_bad_option_values(options, message) -> None:
    with pytest.raises(OptionsError, match=message):
        dynajax.Backend(**options)


def test_custom_namespace_ops_are_accepted_unchecked() -> None:
    # Custom ops may be registered after the options are read.
    assert Options(fallback_ops=["mylib.later"]).fallback_ops == ("mylib.later",)


# ---------------------------------------------------------------------------------
# Strict mode
# ---------------------------------------------------------------------------------


def _strict_error(fn, *args, **options) -> UnsupportedNodesError:
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
            torch.compile(fn, backend=dynajax.Backend(strict=True, **options))(*args)
    err = info.value.inner_exception
    assert isinstance(err, UnsupportedNodesError)
    return err


def test_strict_raises_one_error_listing_every_node() -> None:
    err = _strict_error(two_fallbacks, torch.randn(8))
    got = {(v.target, v.reason) for v in err.verdicts}
    assert got == {
        ("dynajax_opttest.opaque.default", Reason.NO_LOWERING),
        ("aten.nonzero.default", Reason.DATA_DEPENDENT_SHAPE),
        ("aten.sum.dim_IntList", Reason.DATA_DEPENDENT_SHAPE),  # sums the nonzero rows
    }
    msg = str(err)
    assert msg.startswith("strict mode: 3 node(s) of the inference graph cannot run in JAX:")
    assert "dynajax_opttest.opaque.default (node 'opaque'): NO_LOWERING" in msg
    assert "aten.nonzero.default (node 'nonzero'): DATA_DEPENDENT_SHAPE" in msg
    assert "y = opaque(x.sin())" in msg  # source lines
    assert "fallback_ops=['aten.nonzero.default', 'aten.sum.dim_IntList', " in msg


def test_strict_accepts_the_users_own_fallback_ops() -> None:
    def f(x):
        return opaque(x.sin()).cos()

    backend = dynajax.Backend(strict=True, fallback_ops=["dynajax_opttest.opaque"])
    x = torch.randn(8)
    assert_same(torch.compile(f, backend=backend)(x), f(x))
    [fb] = dynajax.Report(backend.graphs).fallbacks
    assert fb.reason is Reason.USER_FALLBACK


# ---------------------------------------------------------------------------------
# torch.compile(m, backend="dynajax", options={...})
# ---------------------------------------------------------------------------------


def test_torch_compile_passes_strict_through() -> None:
    compiled = torch.compile(two_fallbacks, backend="dynajax", options={"strict": True})
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
            compiled(torch.randn(8))
    assert isinstance(info.value.inner_exception, UnsupportedNodesError)


def test_torch_compile_passes_fallback_ops_and_min_block_size_through(caplog) -> None:
    forget_logged_fallbacks()

    def f(x):
        return opaque(x.sin()).cos().exp()

    options = {"fallback_ops": ["aten.exp"], "min_block_size": 2}
    compiled = torch.compile(f, backend="dynajax", options=options)
    x = torch.randn(8)
    with caplog.at_level(logging.INFO, logger="dynajax.capability"):
        assert_same(compiled(x), f(x))
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "dynajax.capability")
    assert "aten.exp.default (node 'exp'): USER_FALLBACK" in logged
    assert "aten.sin.default (node 'sin'): BLOCK_TOO_SMALL" in logged
    assert "min_block_size=2" in logged


def test_torch_compile_rejects_bad_options() -> None:
    compiled = torch.compile(lambda x: x + 1, backend="dynajax", options={"strict": "1"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="strict must be"):
        compiled(torch.randn(2))


def test_torch_compile_rejects_unknown_options() -> None:
    compiled = torch.compile(lambda x: x + 1, backend="dynajax", options={"bogus": 1})
    with pytest.raises(
        torch._dynamo.exc.BackendCompilerFailed, match=r"unknown dynajax option\(s\) \['bogus'\]"
    ):
        compiled(torch.randn(2))

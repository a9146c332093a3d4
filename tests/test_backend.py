"""Registration, options and the public API."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import dynajax
from dynajax import OptionsError


def test_entry_point_in_fresh_process() -> None:
    # The child never imports dynajax: torch must find it through the entry point.
    code = textwrap.dedent(
        """
        import sys, torch
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="dynajax")
        x = torch.randn(5)
        torch.testing.assert_close(f(x), torch.sin(x) * 2)
        assert "dynajax" in sys.modules, "the entry point did not load dynajax"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_listed_by_dynamo() -> None:
    assert "dynajax" in torch._dynamo.list_backends()


def test_options_through_torch_compile() -> None:
    f = torch.compile(lambda x: torch.sin(x) + 1, backend="dynajax", options={"min_block_size": 1})
    x = torch.randn(3)
    torch.testing.assert_close(f(x), torch.sin(x) + 1)


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(OptionsError, match="min_block_size"):
        dynajax.Backend(min_blocksize=3)
    f = torch.compile(lambda x: x + 1, backend="dynajax", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown dynajax option"):
        f(torch.randn(2))


@pytest.mark.parametrize(
    "options",
    [{"min_block_size": 0}, {"min_block_size": "3"}, {"strict": "yes"}, {"fallback_ops": ["sin"]}],
    ids=["block-zero", "block-str", "strict-str", "op-name"],
)
def test_bad_option_values(options) -> None:
    with pytest.raises(OptionsError):
        dynajax.Backend(**options)


def test_env_variables(monkeypatch) -> None:
    monkeypatch.setenv("DYNAJAX_MIN_BLOCK_SIZE", "4")
    monkeypatch.setenv("DYNAJAX_FALLBACK_OPS", "aten.sort, aten.cos.default")
    monkeypatch.setenv("DYNAJAX_STRICT", "1")
    opts = dynajax.Backend().options
    assert opts.min_block_size == 4
    assert opts.fallback_ops == ("aten.sort", "aten.cos.default")
    assert opts.strict is True
    assert dynajax.Backend(min_block_size=2).options.min_block_size == 2
    monkeypatch.setenv("DYNAJAX_MIN_BLOCK_SIZE", "four")
    with pytest.raises(OptionsError, match="DYNAJAX_MIN_BLOCK_SIZE"):
        dynajax.Backend()


def test_fallback_ops_accepts_op_objects() -> None:
    aten = torch.ops.aten
    opts = dynajax.Backend(fallback_ops=[aten.sort, aten.add.Tensor]).options
    assert opts.fallback_ops == ("aten.sort", "aten.add.Tensor")


def test_strict_mode_raises_listing_nodes() -> None:
    def f(x):
        return torch.fake_quantize_per_tensor_affine(torch.sin(x), 0.1, 0, -128, 127)

    compiled = torch.compile(f, backend=dynajax.Backend(strict=True))
    with pytest.raises(
        Exception, match=r"aten\.fake_quantize_per_tensor_affine_cachemask\.default.*NO_LOWERING"
    ):
        compiled(torch.randn(3, 3))


def test_supported_ops_is_a_frozenset_of_overloads() -> None:
    ops = dynajax.supported_ops()
    assert isinstance(ops, frozenset)
    assert torch.ops.aten.add.Tensor in ops
    assert all(isinstance(op, torch._ops.OpOverload) for op in ops)


def test_import_changes_no_global_jax_config() -> None:
    code = "import jax, dynajax, torch; print(jax.config.jax_enable_x64, torch.get_default_dtype())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "torch.float32"]

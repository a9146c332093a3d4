"""Registration and the public API (the options: tests/capability/test_options.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import dynajax
from tests.helpers import run_python


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


def test_name_registered_on_import_without_an_entry_point() -> None:
    # A checkout on PYTHONPATH, not installed: no entry point, and importing dynajax is
    # what makes backend="dynajax" valid.
    code = textwrap.dedent(
        """
        import importlib.metadata as md
        found = md.entry_points
        md.entry_points = lambda **kw: (
            md.EntryPoints(()) if kw.get("group") == "torch_dynamo_backends" else found(**kw)
        )
        import torch, dynajax
        from torch._dynamo.backends.registry import lookup_backend
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="dynajax")
        x = torch.randn(5)
        torch.testing.assert_close(f(x), torch.sin(x) * 2)
        assert lookup_backend("dynajax") is dynajax.dynajax_backend
        print("ok")
        """
    )
    assert run_python("-c", code, timeout=300) == "ok"


def test_listed_by_dynamo() -> None:
    assert "dynajax" in torch._dynamo.list_backends()


def test_fallback_ops_accepts_op_objects() -> None:
    aten = torch.ops.aten
    opts = dynajax.Backend(fallback_ops=[aten.sort, aten.add.Tensor]).options
    assert opts.fallback_ops == ("aten.sort", "aten.add.Tensor")


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

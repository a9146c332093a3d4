"""The Makefile's install: which torch build it asks for (``make -n``, nothing run).

An ordinary Linux machine's pip resolves a bare ``torch==X`` from the package index to
a CUDA build of several GB; the demo and the tests install the CPU build from PyTorch's
own index unless ``TORCH_BUILD`` says otherwise, and say so."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _planned(target: str, *variables: str) -> str:
    """What ``make -n <target>`` would run, for a venv that does not exist yet."""
    out = subprocess.run(
        ["make", "-n", target, "VENV=/nonexistent/venv", *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def _torch_lines(plan: str) -> list[str]:
    return [line for line in plan.splitlines() if "torch==" in line]


@pytest.mark.parametrize("target", ["install-demo", "install", "wheel-check"])
def test_torch_comes_from_pytorchs_cpu_index_by_default(target: str) -> None:
    lines = _torch_lines(_planned(target))  # (the wheel's venv, and the checkout's)
    assert lines
    for line in lines:
        assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in line
        assert "the cpu build" in line  # said before it downloads
        # and where that index is out of reach, the package index's torch, with a note
        assert "did not serve torch" in line and "a CUDA build of several GB" in line


def test_a_cuda_build_is_one_word() -> None:
    (line,) = _torch_lines(_planned("install-demo", "TORCH_BUILD=cu128"))
    assert "--index-url https://download.pytorch.org/whl/cu128 torch==2.13.0" in line


def test_the_demo_installs_what_it_needs_only() -> None:
    plan = _planned("install-demo")
    assert 'install -q -e ".[hf]"' in plan
    assert "lint" not in plan and "docs" not in plan


def test_make_test_installs_no_system_package() -> None:
    plan = _planned("test")
    assert "apt-get" not in plan

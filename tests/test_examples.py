"""Every feature example under examples/ runs, each in a fresh process, and checks its
own answer against eager PyTorch (an example exits non-zero when it does not match).
The demo (``make demo``, timings of a larger GPT-2) is not run here."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "demo.py")


def test_every_feature_example_is_listed() -> None:
    assert {
        "attention_rewrite.py",
        "custom_op_rule.py",
        "debug_planted_bug.py",
        "export_gpt2.py",
        "graph_pass.py",
        "jax_training.py",
        "pallas_in_torch.py",
        "resident_device.py",
        "train_step.py",
    } <= set(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES, ids=[n.removesuffix(".py") for n in EXAMPLES])
def test_example_runs(name: str, tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"

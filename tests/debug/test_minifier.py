"""PyTorch's accuracy minifier works with backend="dynajax" (repro_after="dynamo").

With ``torch._dynamo.config.repro_after = "dynamo"`` and ``repro_level = 4``, Dynamo
compares each graph compiled by the backend with eager (and float64) and, where they
differ, raises ``AccuracyError`` and writes ``minifier_launcher.py``; running that
script shrinks the graph to the smallest one that still differs (``repro.py``). Here a
wrong rule is planted through ``dynajax.register_rule`` in this process, so the
launcher runs in-process too (a new process would not have the planted rule).
``repro_forward_only`` keeps backward compiles out of the minifier's queries: PyTorch
raises "Metric(s) {'is_forward'} have already been set" for a backward compiled inside
its minification (any aot_autograd backend).
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
import torch.fx.experimental._config
from torch import nn

import dynajax
from dynajax.lowering.registry import get_rule

CONFIGS = (
    torch._dynamo.config,
    torch._inductor.config,
    torch._functorch.config,
    torch.fx.experimental._config,
)


@pytest.fixture
def wrong_tanh() -> Iterator[None]:
    builtin = get_rule(torch.ops.aten.tanh.default)
    assert builtin is not None
    with pytest.warns(dynajax.RuleOverrideWarning):
        dynajax.register_rule(torch.ops.aten.tanh.default, override=True)(
            lambda x: builtin.fn(x) * 1.1
        )
    try:
        yield
    finally:
        dynajax.unregister_rule(torch.ops.aten.tanh.default)
        torch._dynamo.reset()


@pytest.fixture
def restored_configs(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> Iterator[None]:
    """The launcher sets torch's configs and environment variables; they are put back."""
    saved = [c.save_config() for c in CONFIGS]
    environ = dict(os.environ)
    monkeypatch.chdir(tmp_path)  # the minifier writes repro.py and checkpoints/ here
    try:
        yield
    finally:
        for c, s in zip(CONFIGS, saved, strict=True):
            c.load_config(s)
        os.environ.clear()
        os.environ.update(environ)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.tanh(h * 2) + h.sin()
        return self.b(h).softmax(-1)


def test_accuracy_minifier_shrinks_a_planted_bug_to_its_op(
    wrong_tanh: None,
    restored_configs: None,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 8)
    # Through config.patch, which puts them back: save_config/load_config skip the
    # repro_* settings (Dynamo's _save_config_ignore), and a minifier left on would wrap
    # every later compile of the process.
    with torch._dynamo.config.patch(
        repro_after="dynamo",
        repro_level=4,
        repro_forward_only=True,
        debug_dir_root=str(tmp_path / "debug"),
    ):
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="Bad accuracy"):
            torch.compile(model, backend="dynajax")(x)
        [launcher] = (tmp_path / "debug").glob("*/minifier/minifier_launcher.py")
        assert "backend='dynajax'" in launcher.read_text()
        torch._dynamo.reset()
        monkeypatch.setattr(sys, "argv", [str(launcher)])  # the launcher parses its arguments
        runpy.run_path(str(launcher), run_name="__main__")
    repro = (tmp_path / "repro.py").read_text()
    forward = repro.split("def forward", 1)[1].split("\n\n", 1)[0]
    calls = [line for line in forward.splitlines()[1:] if "=" in line and "return" not in line]
    assert len(calls) == 1 and "torch.tanh(" in calls[0], forward
    assert torch._dynamo.config.repro_after is None

"""``dynajax.export``: a torch model as a serialized JAX program that runs without torch.

The program must give eager's answer after a round trip through bytes, for every size
its symbolic dims allow, with the weights embedded or separate, in a process that
cannot import torch; ops without a JAX rule and rules that need concrete sizes must be
refused with errors naming the op.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim

import dynajax
from dynajax.errors import CallbackOpsError, ExportError, ExportOpsError
from tests import models
from tests.tolerances import assert_same


def to_torch(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: to_torch(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_torch(v) for v in tree)
    array = np.array(tree)  # a writable copy
    if array.dtype == np.dtype(jax.numpy.bfloat16):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# ---------------------------------------------------------------------------------
# Loaded with JAX alone: GPT-2, one export, two batch sizes
# ---------------------------------------------------------------------------------

# The loader a user writes: jax and numpy only. Importing torch fails in this process.
LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` now raises ImportError

    from pathlib import Path

    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)  # the program takes int64 token ids
    folder = Path(sys.argv[1])
    inputs = dict(np.load(folder / "inputs.npz"))
    outputs = {}
    for weights in ("embedded", "separate"):
        exp = jax.export.deserialize(bytearray((folder / f"{weights}.stablehlo").read_bytes()))
        state = dict(np.load(folder / "separate.npz")) if weights == "separate" else None
        for name, ids in inputs.items():
            out = exp.call(ids) if state is None else exp.call(state, ids)
            outputs[f"{weights}-{name}"] = np.asarray(out["logits"])
    np.savez(folder / "outputs.npz", **outputs)
    loaded = sorted(m for m, v in sys.modules.items() if v is not None)
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "dynajax")], loaded
    """
)


def test_gpt2_runs_without_torch_for_two_batch_sizes_from_one_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = models.gpt2().eval()
    shapes = ({0: Dim("batch", max=16)},)
    for weights in ("embedded", "separate"):
        exported = dynajax.export(
            model, models.tokens(2, 16), dynamic_shapes=shapes, weights=weights
        )
        written = exported.save(tmp_path / f"{weights}.stablehlo")
        assert [p.name for p in written] == [f"{weights}.stablehlo"] + (
            ["separate.npz"] if weights == "separate" else []
        )
    # The weights are in the embedded program only.
    embedded, separate = (tmp_path / f"{w}.stablehlo" for w in ("embedded", "separate"))
    assert embedded.stat().st_size > separate.stat().st_size + 4 * 64 * 128
    inputs = {f"b{b}": models.tokens(b, 16) for b in (3, 5)}
    np.savez(tmp_path / "inputs.npz", **{k: v.numpy() for k, v in inputs.items()})

    child = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-3000:]

    outputs = dict(np.load(tmp_path / "outputs.npz"))
    with torch.no_grad():
        for name, ids in inputs.items():
            expected = model(ids).logits
            for weights in ("embedded", "separate"):
                actual = torch.from_numpy(outputs[f"{weights}-{name}"])
                assert_same(actual, expected, model=True, path=f"{weights}-{name}")


# ---------------------------------------------------------------------------------
# In-process round trips through bytes
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["embedded", "separate"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_round_trip_through_bytes_equals_eager(name: str, weights: str) -> None:
    torch.manual_seed(0)
    if name == "mlp":
        model, x, other = models.mlp(), torch.randn(4, 32), torch.randn(7, 32)
    else:
        model, x, other = models.cnn(), torch.randn(2, 3, 16, 16), torch.randn(5, 3, 16, 16)
        model(torch.randn(8, 3, 16, 16))  # running statistics that are not 0 and 1
    model.eval()
    exported = dynajax.export(model, x, dynamic_shapes=({0: Dim("batch")},), weights=weights)
    loaded = jax.export.deserialize(bytearray(exported.serialize()))
    # BatchNorm's num_batches_tracked is int64: with separate weights, a 64-bit input.
    assert exported.needs_x64 == (name == "cnn" and weights == "separate")
    for inp in (x, other):
        args = (inp.numpy(),) if exported.state is None else (exported.state, inp.numpy())
        with jax.enable_x64(exported.needs_x64):
            out = loaded.call(*args)
        with torch.no_grad():
            assert_same(to_torch(out), model(inp), model=True)
        with torch.no_grad():
            assert_same(to_torch(exported.call(inp)), model(inp), model=True)


def test_bfloat16_weights_are_stored_as_uint16_and_run_from_the_npz(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = models.mlp().to(torch.bfloat16).eval()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    exported = dynajax.export(model, x, weights="separate")
    assert exported.state is not None
    assert {v.dtype for v in exported.state.values()} == {np.dtype(np.uint16)}
    _, weights = exported.save(tmp_path / "mlp.stablehlo")
    state = dict(np.load(weights))
    assert {v.dtype for v in state.values()} == {np.dtype(np.uint16)}
    np.testing.assert_array_equal(
        state["0.weight"].view(jax.numpy.bfloat16).astype(np.float32),
        model[0].weight.detach().float().numpy(),
    )
    loaded = jax.export.deserialize(bytearray((tmp_path / "mlp.stablehlo").read_bytes()))
    with torch.no_grad():
        assert_same(to_torch(loaded.call(state, to_torch_free(x))), model(x), model=True)


def to_torch_free(t: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor as the NumPy (ml_dtypes) array a torch-free caller has."""
    return t.view(torch.int16).numpy().view(jax.numpy.bfloat16)


# ---------------------------------------------------------------------------------
# Symbolic dims
# ---------------------------------------------------------------------------------


def test_dynamic_dims_are_symbolic_named_and_bounded() -> None:
    torch.manual_seed(0)
    model = models.gpt2().eval()
    shapes = ({0: Dim("batch", min=2, max=8), 1: Dim("seq", max=64)},)
    exported = dynajax.export(model, models.tokens(2, 16), dynamic_shapes=shapes)
    [ids] = exported.exported.in_avals
    assert all(jax.export.is_symbolic_dim(d) for d in ids.shape)
    assert str(ids) == "int64[batch,seq]"
    assert str(exported.exported.out_avals[0]) == "float32[batch,seq,128]"
    assert exported.dims == {"batch": (2, 8), "seq": (1, 64)}

    loaded = jax.export.deserialize(bytearray(exported.serialize()))
    with jax.enable_x64(True):
        for batch, seq in ((3, 5), (8, 64)):
            ids_ = models.tokens(batch, seq)
            with torch.no_grad():
                assert_same(to_torch(loaded.call(ids_.numpy())), dict(model(ids_)), model=True)
        # Dim(min=..., max=...) are constraints of the program, checked when called
        # (JAX's ValueError says so in its cause, a JaxRuntimeError).
        for batch, seq in ((1, 5), (9, 5), (3, 65)):
            with pytest.raises(ValueError) as info:
                loaded.call(models.tokens(batch, seq).numpy())
            assert "symbolic shape constraint" in f"{info.value} {info.value.__cause__}"


# A torch-free loader for any number of exported models: NAME.stablehlo with embedded
# weights, its inputs in NAME.inputs.npz; the outputs go to NAME.outputs.npz.
POOL_LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` now raises ImportError

    from pathlib import Path

    import jax
    import numpy as np

    folder = Path(sys.argv[1])
    for program in sorted(folder.glob("*.stablehlo")):
        name = program.name.removesuffix(".stablehlo")
        exp = jax.export.deserialize(bytearray(program.read_bytes()))
        inputs = dict(np.load(folder / f"{name}.inputs.npz"))
        outputs = {key: np.asarray(exp.call(x)) for key, x in inputs.items()}
        np.savez(folder / f"{name}.outputs.npz", **outputs)
    loaded = sorted(m for m, v in sys.modules.items() if v is not None)
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "dynajax")], loaded
    """
)


def pooling_models() -> dict[str, nn.Module]:
    """Max pooling in the forms that meet a symbolic height and width: the CNN of the
    model suite (conv, BatchNorm, 2x2 max pool, strided conv, adaptive average pool),
    and max pools with padding, stride and dilation over odd sizes."""
    torch.manual_seed(0)
    cnn = models.cnn()
    cnn(torch.randn(8, 3, 16, 16))  # running statistics that are not 0 and 1
    pools = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=1, dilation=2),
        nn.AvgPool2d(3, stride=2, padding=1),
    )
    return {"cnn": cnn.eval(), "pools": pools.eval()}


def test_symbolic_height_and_width_through_max_pooling_run_without_torch(
    tmp_path: Path,
) -> None:
    # min=12: no intermediate size may be 1 for some sizes only (torch.export refuses)
    shapes = ({2: Dim("height", min=12, max=64), 3: Dim("width", min=12, max=64)},)
    sizes = ((16, 16), (13, 19), (12, 64), (31, 17))
    expected = {}
    for name, model in pooling_models().items():
        exported = dynajax.export(model, torch.randn(2, 3, 16, 16), dynamic_shapes=shapes)
        [x] = exported.exported.in_avals
        assert str(x) == "float32[2,3,height,width]"
        exported.save(tmp_path / f"{name}.stablehlo")
        inputs = {f"{h}x{w}": torch.randn(2, 3, h, w) for h, w in sizes}
        np.savez(tmp_path / f"{name}.inputs.npz", **{k: v.numpy() for k, v in inputs.items()})
        with torch.no_grad():
            expected[name] = {k: model(v) for k, v in inputs.items()}

    child = subprocess.run(
        [sys.executable, "-c", POOL_LOADER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    for name, outputs in expected.items():
        actual = dict(np.load(tmp_path / f"{name}.outputs.npz"))
        assert actual.keys() == outputs.keys()
        for key, want in outputs.items():
            assert_same(torch.from_numpy(actual[key]), want, model=True, path=f"{name}-{key}")


def test_a_rule_that_needs_a_concrete_size_names_the_op() -> None:
    # Adaptive max pooling computes each window's bounds from the input size in
    # Python, which a symbolic height cannot give.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveMaxPool2d(3)).eval()
    shapes = ({2: Dim("height", min=8, max=64)},)
    with pytest.raises(ExportError, match="adaptive_max_pool2d") as info:
        dynajax.export(model, torch.randn(2, 3, 16, 16), dynamic_shapes=shapes)
    assert "symbolic sizes" in str(info.value)
    assert "dynamic_shapes" in str(info.value)


# ---------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------


class FakeQuantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.fake_quantize_per_tensor_affine(self.linear(x), 0.05, 0, -128, 127)
        return torch.relu(q)


def test_an_op_without_a_rule_fails_export_naming_the_op_and_its_line() -> None:
    with pytest.raises(ExportOpsError) as info:
        dynajax.export(FakeQuantized(), torch.randn(4, 8))
    message = str(info.value)
    assert isinstance(info.value, CallbackOpsError)
    assert "dynajax.export" in message and "cannot call PyTorch" in message
    assert "aten.fake_quantize_per_tensor_affine_cachemask.default" in message
    assert f"{__file__}:" in message
    assert "torch.fake_quantize_per_tensor_affine(self.linear(x)" in message


def test_train_mode_models_are_refused_with_what_to_do() -> None:
    with pytest.raises(ExportError, match=r"buffers in place .*model\.eval\(\)"):
        dynajax.export(models.cnn().train(), torch.randn(2, 3, 16, 16))
    dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    with pytest.raises(ExportError, match=r"random numbers .*model\.eval\(\)"):
        dynajax.export(dropout, torch.randn(4, 8))


def test_arguments_are_checked() -> None:
    model = models.mlp().eval()
    with pytest.raises(ExportError, match="weights='inline'"):
        dynajax.export(model, torch.randn(2, 32), weights="inline")  # type: ignore[arg-type]
    exported = dynajax.export(model, torch.randn(2, 32))
    with pytest.raises(ExportError, match="not an .npz file"):
        exported.save("model.npz")

"""GPT-2 exported once to a StableHLO file with a symbolic batch, then run by a process
that has no torch: two batch sizes, compared with eager.

    python examples/export_gpt2.py
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from torch.export import Dim

import dynajax

# The loader: jax and numpy only (importing torch is made to fail).
LOADER = """
import sys
sys.modules["torch"] = None
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
folder = sys.argv[1]
with open(f"{folder}/gpt2.stablehlo", "rb") as f:
    exp = jax.export.deserialize(bytearray(f.read()))
print("loaded:", exp.in_avals)
for batch in (3, 5):
    ids = np.load(f"{folder}/ids{batch}.npy")
    logits = np.asarray(exp.call(ids)["logits"])
    eager = np.load(f"{folder}/eager{batch}.npy")
    print(f"batch {batch}: max |exported - eager| = {np.abs(logits - eager).max():.2e}")
    assert np.allclose(logits, eager, atol=1e-4)
"""


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    exported = dynajax.export(model, ids, dynamic_shapes=({0: Dim("batch", max=16)},))
    with tempfile.TemporaryDirectory() as folder:
        exported.save(pathlib.Path(folder) / "gpt2.stablehlo")
        for batch in (3, 5):
            x = torch.randint(0, 128, (batch, 16))
            np.save(f"{folder}/ids{batch}.npy", x.numpy())
            with torch.no_grad():
                np.save(f"{folder}/eager{batch}.npy", model(x).logits.numpy())
        out = subprocess.run(
            [sys.executable, "-c", LOADER, folder], capture_output=True, text=True, check=False
        )
        print(out.stdout, end="")
        if out.returncode != 0:
            sys.exit(f"the torch-free loader failed:\n{out.stderr[-3000:]}")


if __name__ == "__main__":
    main()

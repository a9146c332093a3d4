"""A training process killed while it saves a checkpoint
(tests/training/test_train_step.py::test_a_process_killed_during_a_save...).

    python -m tests.training.killed_save_worker DIRECTORY

Trains 3 steps and saves (checkpoint 3), prints the trained parameters as JSON, trains
2 more and saves again, but SIGKILLs itself when orbax commits that checkpoint (renames
its finished temporary directory into place): every array is written by then, the
commit is not. The parent then restores from DIRECTORY.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

import dynajax

_rename = os.rename


def _killed_at_commit(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
    if "orbax-checkpoint-tmp" in os.fspath(src):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return _rename(src, dst, *args, **kwargs)


def main() -> None:
    directory = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = dynajax.train_step(model, optimizer, lambda m, x, y: F.mse_loss(m(x), y))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(5)
    ]
    for batch in batches[:3]:
        step(*batch)
    step.save(directory)
    saved = {k: v.tolist() for k, v in step.state_dict().items()}
    print(json.dumps({"saved": saved}), flush=True)
    for batch in batches[3:]:
        step(*batch)
    os.rename = _killed_at_commit
    step.save(directory)
    print(json.dumps({"error": "the second save completed: the kill did not happen"}))


if __name__ == "__main__":
    main()

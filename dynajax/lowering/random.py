"""Random ops. Each rule takes an explicit ``key`` (split per node from the seed that
the runtime draws from PyTorch's generator on every call)."""

from __future__ import annotations

import torch

aten = torch.ops.aten

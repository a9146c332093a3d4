"""What dynajax.explain reports for a net Dynamo cannot capture whole: a conv, a
BatchNorm, a GRU and an LSTM. Dynamo breaks the graph at the GRU (its default
``allow_rnn=False``), so the GRU, the LSTM and the head run in eager PyTorch, outside
any graph; the report counts them, says why, and how to capture them.

    python examples/explain_rnn.py              # as Dynamo does by default
    python examples/explain_rnn.py --allow-rnn  # torch._dynamo.config.allow_rnn = True
    python examples/explain_rnn.py --width 88   # lines wrapped at 88 columns (100 by default)
"""

from __future__ import annotations  # noqa: I001 (dynajax first: see below)

# dynajax before torch, so that its per-process settings apply (docs/architecture.md)
import dynajax
import sys
import torch
from torch import nn


class RNNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3)
        self.bn = nn.BatchNorm1d(16)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().transpose(1, 2)
        o, _ = self.gru(h)
        o, _ = self.lstm(o)
        return self.head(o[:, -1])


def main() -> None:
    if "--allow-rnn" in sys.argv:
        torch._dynamo.config.allow_rnn = True
    torch.manual_seed(0)
    model, x = RNNNet().eval(), torch.randn(8, 4, 32)
    width = int(sys.argv[sys.argv.index("--width") + 1]) if "--width" in sys.argv else 100
    with torch.no_grad():
        print(dynajax.explain(model, x).text(width))


if __name__ == "__main__":
    main()

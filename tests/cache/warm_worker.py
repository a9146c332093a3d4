"""Runs in subprocesses of tests/cache/test_warm.py: one process's first calls.

python -m tests.cache.warm_worker <cache_dir>
    compiles an MLP for inference and a small CNN for a training step (forward and
    backward), checks every answer and gradient against eager, and prints one JSON
    line: the compile stats, how many partitions were traced through the rule table,
    and the report's verdicts and partitions.
"""

from __future__ import annotations

import json
import sys

import torch

import dynajax
from dynajax.lowering import interpreter
from tests.models import mlp
from tests.tolerances import assert_same

traces = 0
_run = interpreter.JaxInterpreter.run


def _counted(self, *args, **kwargs):
    global traces
    traces += 1
    return _run(self, *args, **kwargs)


interpreter.JaxInterpreter.run = _counted  # type: ignore[method-assign]


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 5),
    )


def main(cache_dir: str) -> None:
    backend = dynajax.Backend(cache_dir=cache_dir)
    torch.manual_seed(0)
    model = mlp().eval()
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert_same(torch.compile(model, backend=backend)(x), model(x), model=True)

    torch.manual_seed(0)
    net = _cnn()
    ref = _cnn()
    ref.load_state_dict(net.state_dict())
    images = torch.randn(2, 3, 8, 8)
    loss = torch.compile(net, backend=backend)(images).square().mean()
    loss.backward()
    ref_loss = ref(images).square().mean()
    ref_loss.backward()
    assert_same(loss, ref_loss, model=True)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert_same(p.grad, q.grad, model=True)
    assert_same(net[1].running_mean, ref[1].running_mean, model=True)

    report = dynajax.Report(backend.graphs)
    stats = report.compile_stats
    print(
        json.dumps(
            {
                "compiles": stats.xla_compiles,
                "hits": stats.cache_hits,
                "misses": dict(stats.cache_misses),
                "traces": traces,
                # the training graph's partition never imported inductor's lowerings
                # (aot/compile.py turns the min-cut partitioner's CSE pass off)
                "inductor_lowerings": "torch._inductor.lowering" in sys.modules,
                "graphs": [g.kind for g in backend.graphs],
                "partitions": [(p.name, p.op_count, p.ops) for p in report.partitions],
                "nodes": [g.node_partition for g in backend.graphs],
                "fallbacks": [(f.target, f.node, f.reason.name) for f in report.fallbacks],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])

"""Runs in subprocesses of tests/lowering/test_eager_cpu.py, under the CPU capability
the parent forces (``ATEN_CPU_CAPABILITY``): the half-precision softmaxes whose bits
depend on where eager's kernel vectorizes, at each thread count, against eager.

python -m tests.lowering.eager_cpu_worker <threads...>
    prints one JSON line: the capability eager dispatched to, and each case whose
    answer differs from eager's in any bit (NaNs equal).
"""

from __future__ import annotations

import json
import sys

import torch

import dynajax

# (shape, dim): chunks shorter than a vector, rows crossing chunks, rows shorter than
# a vector, a tail in every row, several outer rows, a dim of one.
CASES = [
    ((4, 37), 0),
    ((4, 100), 0),
    ((4, 1000), 0),
    ((5, 64), 0),
    ((3, 5, 7), 1),
    ((3, 33, 5), 1),
    ((7, 3, 70), 1),
    ((2, 3, 4, 50), 1),
    ((64, 3, 3), 0),
    ((1, 40), 0),
]


def softmaxes(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [torch.softmax(x, dim) for x, (_, dim) in zip(xs, CASES, strict=True)]


def main(threads: list[int]) -> None:
    differs = []
    for count in threads:
        torch.set_num_threads(count)
        for dtype in (torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(7)
            xs = [(torch.randn(shape, generator=gen) * 3).to(dtype) for shape, _ in CASES]
            for x in xs:
                x.view(-1)[0] = -float("inf")
            torch._dynamo.reset()
            compiled = torch.compile(softmaxes, backend=dynajax.Backend(cache_dir=""))
            for (shape, dim), actual, expected in zip(
                CASES, compiled(*xs), softmaxes(*xs), strict=True
            ):
                same = (actual == expected) | (actual.isnan() & expected.isnan())
                if not bool(same.all()):
                    differs.append([count, str(dtype), list(shape), dim, int((~same).sum())])
    capability = torch.backends.cpu.get_cpu_capability()
    print(json.dumps({"capability": capability, "differs": differs}))


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]])

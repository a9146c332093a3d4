"""Convolution algorithms: PyTorch eager, XLA's own convolution, and the form dynajax
chooses (``dynajax/lowering/conv_algorithms.py``), on shapes real networks reach.

    python -m benchmarks.convolutions              # every shape
    python -m benchmarks.convolutions --rounds 5

Each row times the three side by side (interleaved rounds, median per call); compare
ratios, not absolute times, on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# (name, input shape, weight shape, stride, padding, groups, transposed)
SHAPES: list[tuple[str, tuple[int, ...], tuple[int, ...], int, int, int, bool]] = [
    ("ResNet stem 7x7/2, 3x64x64", (8, 3, 64, 64), (64, 3, 7, 7), 2, 3, 1, False),
    ("ResNet 3x3, 64x16x16", (8, 64, 16, 16), (64, 64, 3, 3), 1, 1, 1, False),
    ("ResNet 3x3/2, 128x8x8", (8, 128, 8, 8), (256, 128, 3, 3), 2, 1, 1, False),
    ("ResNet 3x3, 256x4x4", (8, 256, 4, 4), (256, 256, 3, 3), 1, 1, 1, False),
    ("ResNet 3x3, 512x2x2 (kernel wider)", (8, 512, 2, 2), (512, 512, 3, 3), 1, 1, 1, False),
    ("3x3, 64x32x32 (large patches)", (8, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1, False),
    ("depthwise 3x3, 128x28x28", (8, 128, 28, 28), (128, 1, 3, 3), 1, 1, 128, False),
    ("depthwise 7x7, 96x56x56 (ConvNeXt)", (8, 96, 56, 56), (96, 1, 7, 7), 1, 3, 96, False),
    ("grouped 3x3 g=64, 256x8x8", (8, 256, 8, 8), (256, 4, 3, 3), 1, 1, 64, False),
    ("conv1d k5, 80x300", (4, 80, 300), (256, 80, 5), 1, 2, 1, False),
    ("conv3d 3x3x3, 64x4x4x4", (2, 64, 4, 4, 4), (64, 64, 3, 3, 3), 1, 1, 1, False),
    ("conv3d 3x3x3, 16x16x16x16", (2, 16, 16, 16, 16), (16, 16, 3, 3, 3), 1, 1, 1, False),
    ("transposed 4x4/2, 512x2x2", (8, 512, 2, 2), (512, 256, 4, 4), 2, 1, 1, True),
    ("transposed 4x4/2, 64x16x16", (8, 64, 16, 16), (64, 32, 4, 4), 2, 1, 1, True),
    ("transposed 3d 2x2x2/2, 64x16^3", (1, 64, 16, 16, 16), (64, 32, 2, 2, 2), 2, 0, 1, True),
]


def _steps(xs, ws, stride, padding, groups, transposed) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    from benchmarks.workloads import device, jax_put
    from dynajax.lowering import conv_algorithms as ca

    torch.manual_seed(0)
    x, w = torch.randn(xs), torch.randn(ws)
    xa, wa = jax_put(x.numpy()), jax_put(w.numpy())
    x, w = x.to(device()), w.to(device())
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    nd = len(ws) - 2
    s, p, d, op = [stride] * nd, [padding] * nd, [1] * nd, [0] * nd
    if transposed:
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        chosen = jax.jit(lambda a, b: ca.transposed(a, b, s, p, d, op, groups, jnp.float32))
        xla = jax.jit(lambda a, b: ca.xla_transposed(a, b, s, p, d, op, groups, jnp.float32))

        def eager() -> Any:
            out = conv(x, w, None, stride, padding, 0, groups)
            sync()
            return out
    else:
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        chosen = jax.jit(lambda a, b: ca.convolution(a, b, s, p, d, groups, jnp.float32))
        xla = jax.jit(lambda a, b: ca.xla_convolution(a, b, s, p, d, groups, jnp.float32))

        def eager() -> Any:
            out = conv(x, w, None, stride, padding, 1, groups)
            sync()
            return out

    return {
        "eager": eager,
        "xla conv": lambda: xla(xa, wa).block_until_ready(),
        "dynajax": lambda: chosen(xa, wa).block_until_ready(),
    }


def _form(xs, ws, stride, padding, groups, transposed) -> str:
    from dynajax.lowering import conv_algorithms as ca

    nd = len(ws) - 2
    if transposed:
        return ca.choose_transposed(xs, ws, [stride] * nd, groups)
    return ca.choose(xs, ws, [stride] * nd, [padding] * nd, [1] * nd, groups)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    from benchmarks.workloads import DEVICE_ENV

    os.environ[DEVICE_ENV] = args.device
    print(f"torch threads: {torch.get_num_threads()}, median of {args.rounds} rounds\n")
    print("milliseconds per call; form: the one dynajax chooses for the shape")
    head = f"{'shape':38} {'form':>8} {'eager':>9} {'xla conv':>9} {'dynajax':>9} {'xla/dj':>7}"
    print(head + f" {'dj/eager':>8}")
    print("-" * (len(head) + 9))
    for name, xs, ws, stride, padding, groups, transposed in SHAPES:
        steps = _steps(xs, ws, stride, padding, groups, transposed)
        times: dict[str, list[float]] = {k: [] for k in steps}
        for f in steps.values():
            f()
            f()
        for _ in range(args.rounds):
            for k, f in steps.items():
                f()  # settle: the previous peer's threads
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        form = _form(xs, ws, stride, padding, groups, transposed)
        print(
            f"{name:38} {form:>8} {med['eager']:9.2f} {med['xla conv']:9.2f} "
            f"{med['dynajax']:9.2f} {med['xla conv'] / med['dynajax']:7.2f} "
            f"{med['dynajax'] / med['eager']:8.2f}"
        )


if __name__ == "__main__":
    main()

"""dynajax demo: a GPT-2 (4 layers, width 256, random weights) through
torch.compile(backend="dynajax"): what runs where, and eager vs dynajax timing.

    make demo        # or: python examples/demo.py
"""

from __future__ import annotations

import statistics
import time

import torch
import transformers

import dynajax


def median_ms(fn, *args, repeats: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=1024,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, config.vocab_size, (4, 128))

    with torch.no_grad():
        report = dynajax.explain(model, tokens)
        print(report)
        print()

        compiled = torch.compile(model, backend="dynajax")
        t0 = time.perf_counter()
        out = compiled(tokens).logits
        first_call = time.perf_counter() - t0
        expected = model(tokens).logits
        err = (out - expected).abs().max().item()
        print(f"max |dynajax - eager| on the logits: {err:.2e}  (dtype {out.dtype})")
        print(f"first call (trace + XLA compile): {first_call:.2f} s")

        eager = median_ms(model, tokens)
        jaxed = median_ms(compiled, tokens)
    print(f"eager   : {eager:8.2f} ms/call (median)")
    print(f"dynajax : {jaxed:8.2f} ms/call (median)  -> {eager / jaxed:.2f}x eager's speed")


if __name__ == "__main__":
    main()

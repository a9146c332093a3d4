"""dynajax demo: a GPT-2 (4 layers, width 256, random weights) through
torch.compile(backend="dynajax"): its first call timed (cold, or warm from the cache),
eager vs dynajax timed in interleaved rounds, then the report of what runs where.

    make demo        # or: python examples/demo.py
"""

from __future__ import annotations  # noqa: I001 (dynajax first: see below)

# dynajax before torch, so that its per-process settings apply (docs/architecture.md)
import dynajax
import statistics
import time
import torch
import transformers

ROUNDS = 15  # interleaved rounds of eager and dynajax
CALLS = 3  # calls per round and side (the round's time is their mean)


def interleaved(fns: dict[str, object], *args: object) -> dict[str, list[float]]:
    """Milliseconds per call of each function, over ``ROUNDS`` rounds that alternate
    between them (so that the machine's load weighs on both alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(*args)  # warm
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn(*args)
            times[name].append(1e3 * (time.perf_counter() - t0) / CALLS)
    return times


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
        backend = dynajax.Backend()
        compiled = torch.compile(model, backend=backend)
        t0 = time.perf_counter()
        out = compiled(tokens).logits  # the first call: Dynamo, aot_autograd, XLA
        first_call = time.perf_counter() - t0
        stats = dynajax.Report(backend.graphs).compile_stats
        expected = model(tokens).logits
        err = (out - expected).abs().max().item()
        print(f"max |dynajax - eager| on the logits: {err:.2e}  (dtype {out.dtype})")
        # Cold: every executable compiled by XLA; warm: loaded from the persistent cache
        # that an earlier run filled (DYNAJAX_CACHE_DIR; Dynamo still traces the model).
        kind = (
            "cold" if not stats.cache_hits else "warm" if not stats.xla_compiles else "partly warm"
        )
        print(
            f"first call, {kind}: {first_call:.2f} s ({stats.xla_compiles} XLA compile(s), "
            f"{stats.cache_hits} loaded from the persistent cache)"
        )

        times = interleaved({"eager": model, "dynajax": compiled}, tokens)
        median = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            print(
                f"{name:<8}: {median[name]:8.2f} ms/call (median of {ROUNDS} rounds; "
                f"{min(t):.2f} to {max(t):.2f})"
            )
        print(f"dynajax / eager time: {median['dynajax'] / median['eager']:.2f}")
        print(
            "(the ratio depends on the machine and its load; the measured tables are in "
            "README.md and benchmarks/RECORD.md)"
        )
        print()
        print(dynajax.explain(model, tokens))


if __name__ == "__main__":
    main()

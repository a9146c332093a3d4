"""Greedy decoding with a static KV cache: tokens per second and time to first token.

    python -m benchmarks.decode                       # eager, inductor, dynajax side by side
    python -m benchmarks.decode --layers 2 --new-tokens 16 --rounds 3
    python -m benchmarks.run --decode                 # the same, from the main command
    python -m benchmarks.decode --profile --threads 1  # where a decode step's time goes

A LLaMA-style model (``transformers.LlamaConfig``, random weights, built from a config)
generates greedily two ways, each peer with the same static cache:

* ``generate``: ``transformers``' ``model.generate(..., cache_implementation="static")``
  with ``model.forward = compile(model.forward)`` (the documented recipe); a streamer
  stamps the time each token arrives.
* ``loop``: a hand-written decode loop (``StaticDecoder``): the same weights, one KV
  buffer per layer updated in place with ``index_copy_``, one compiled prefill function
  and one compiled decode-step function called once per token.
* ``jax`` (dynajax only): the model as shipped in JAX (``JaxGreedy``): a prefill and a
  decode step, each ``dynajax.jax_function`` of the ``transformers`` model over a
  ``StaticCache`` (its arrays in and out) under ``jax.jit``, called once per token, the
  cache staying ``jax.Array``s from step to step.

Per peer and path: the *cold* time to first token (prefill including its compile, in
this process with the compile caches off) and the first decode step (its compile),
then, interleaved round by round with the other peers, the *warm* time to first token
(prefill alone) and decode tokens per second (batch / the median decode step). Every
peer's tokens are compared with eager ``generate``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.harness import graph_summary

PEERS = ("eager", "inductor", "dynajax")
PATHS = ("generate", "loop", "jax")


@dataclasses.dataclass(frozen=True)
class Size:
    """The model and the generation: a small LLaMA, batch 1 by default."""

    layers: int = 4
    width: int = 256
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 1024
    batch: int = 1
    prompt: int = 32
    new_tokens: int = 64


def build_llama(size: Size) -> nn.Module:
    """``LlamaForCausalLM`` from a config (seeded random weights), in eval mode."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=size.layers,
        hidden_size=size.width,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=2 * size.width,
        vocab_size=size.vocab,
        max_position_embeddings=max(256, size.prompt + size.new_tokens),
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        use_cache=True,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompt_ids(size: Size) -> torch.Tensor:
    """Seeded prompt without the pad token (no attention mask growing per step)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, size.vocab, (size.batch, size.prompt), generator=g)


class StaticDecoder(nn.Module):
    """A LLaMA decoder over ``LlamaForCausalLM``'s weights with a hand-written static cache.

    Keys and values live in one buffer per layer, shaped (batch, kv heads, max length,
    head dim), written in place with ``index_copy_`` at the positions of the tokens fed
    in; attention reads the whole buffer under a mask of the positions written so far.
    Every decode step therefore has the same shapes: one executable for the prefill,
    one for all decode steps. ``forward`` returns the greedy next token, (batch, 1).
    """

    def __init__(self, hf: nn.Module, batch: int, max_len: int) -> None:
        super().__init__()
        cfg = hf.config
        self.hf = hf
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.max_len = max_len
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        dev = hf.lm_head.weight.device
        for i in range(cfg.num_hidden_layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, device=dev), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, device=dev), persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        base = self.hf.model
        b, s = ids.shape
        x = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(x, pos[None])
        mask = pos[:, None] >= torch.arange(self.max_len, device=pos.device)[None]  # (s, max)
        rep = self.heads // self.kv_heads
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            o = nn.functional.scaled_dot_product_attention(
                q,
                kc.repeat_interleave(rep, dim=1),
                vc.repeat_interleave(rep, dim=1),
                attn_mask=mask,
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.hf.lm_head(base.norm(x[:, -1:]))
        return logits.argmax(-1)


def _compile_fn(peer: str) -> tuple[Callable[[Callable[..., Any]], Callable[..., Any]], Any]:
    """The peer's compile, through a code object of its own, and dynajax's backend
    (None for the other peers); dynajax's persistent cache off."""
    from benchmarks.harness import _own_code

    if peer == "eager":
        return (lambda f: f), None
    if peer == "inductor":
        return (lambda f: torch.compile(_own_code(f, peer))), None
    import dynajax

    backend = dynajax.Backend(cache_dir="")
    return (lambda f: torch.compile(_own_code(f, peer), backend=backend)), backend


class JaxGreedy:
    """Greedy decoding of the ``transformers`` model in JAX: ``jax_function`` of the
    model with a ``StaticCache`` for the prefill and for a one-token step, each under
    ``jax.jit`` returning the greedy token and the new cache (a dict of arrays)."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, size: Size) -> None:
        import jax
        import jax.numpy as jnp

        import dynajax

        self.jax, self.ids = jax, ids
        self.new_cache = functools.partial(
            _static_cache, model, ids.shape[0], size.prompt + size.new_tokens
        )
        prefill, self.state = dynajax.jax_function(model, ids, None, None, self.new_cache())
        step, _ = dynajax.jax_function(model, ids[:, :1], None, None, self.new_cache())

        def greedy(fn: Any) -> Any:
            def run(state: Any, ids: Any, cache: Any) -> Any:
                out = fn(state, ids, None, None, cache)
                return jnp.argmax(out["logits"][:, -1:], -1), out["cache"]

            return jax.jit(run)

        self.prefill, self.step = greedy(prefill), greedy(step)

    def run(self, new_tokens: int) -> tuple[torch.Tensor, float, list[float]]:
        """Greedy tokens (batch, new_tokens), the prefill's seconds, each step's."""
        import dynajax

        block = self.jax.block_until_ready
        cache = dynajax.jax_values(self.new_cache())
        t0 = time.perf_counter()
        tok, cache = block(self.prefill(self.state, self.ids.numpy(), cache))
        prefill_s = time.perf_counter() - t0
        toks, steps = [tok], []
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            tok, cache = block(self.step(self.state, tok, cache))
            steps.append(time.perf_counter() - t0)
            toks.append(tok)
        return torch.cat([torch.from_dlpack(t) for t in toks], 1), prefill_s, steps


def _static_cache(model: nn.Module, batch: int, length: int) -> Any:
    """An initialized ``transformers.StaticCache`` of ``length`` tokens for ``model``."""
    import transformers

    cfg = model.config
    cache = transformers.StaticCache(config=cfg, max_cache_len=length)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(batch, cfg.num_key_value_heads, head_dim, model.dtype, model.device)
    return cache


class Timed:
    """One peer's generation on one path: ``run(n)`` -> tokens, with its timings."""

    def __init__(self, peer: str, path: str, model: nn.Module, ids: torch.Tensor, size: Size):
        self.peer, self.path, self.ids, self.size = peer, path, ids, size
        compile, self.backend = _compile_fn(peer)
        self.prefill_s = 0.0
        self.decode_s: list[float] = []
        if path == "jax":
            if peer != "dynajax":
                raise ValueError("the jax path is dynajax's alone")
            self.model, self.greedy = model, None  # built on the first run, as compiles are
            self.backend = None  # no torch.compile here
        elif path == "generate":
            self.model = model
            self.forward = compile(type(model).forward.__get__(model))
        else:
            self.decoder = StaticDecoder(model, size.batch, size.prompt + size.new_tokens)
            self.prefill = compile(self.decoder)
            self.step = compile(self.decoder)

    def run(self, new_tokens: int) -> torch.Tensor:
        """Greedy tokens (batch, new_tokens); sets prefill_s and decode_s (per step)."""
        with torch.no_grad():
            if self.path == "jax":
                t0 = time.perf_counter()
                if self.greedy is None:  # its exports count in the cold prefill
                    self.greedy = JaxGreedy(self.model, self.ids, self.size)
                built = time.perf_counter() - t0
                toks, prefill_s, self.decode_s = self.greedy.run(new_tokens)
                self.prefill_s = built + prefill_s
                return toks
            if self.path == "generate":
                return self._generate(new_tokens)
            return self._loop(new_tokens)

    def _generate(self, new_tokens: int) -> torch.Tensor:
        # generate() hands each new token to a streamer as it is chosen: the time to
        # the first one is the time to first token, the times between are decode steps.
        self.model.forward = self.forward
        stamps = _Stamps()
        try:
            t0 = time.perf_counter()
            out = self.model.generate(
                self.ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
                disable_compile=True,
                streamer=stamps,
            )
        finally:
            del self.model.forward
        times = stamps.times[1:]  # the first put is the prompt
        self.prefill_s = times[0] - t0
        self.decode_s = [b - a for a, b in itertools.pairwise(times)]
        return out[:, self.ids.shape[1] :]

    def _loop(self, new_tokens: int) -> torch.Tensor:
        p, dev = self.ids.shape[1], self.ids.device
        pos = torch.arange(p, device=dev)
        t0 = time.perf_counter()
        tok = _synced(self.prefill(self.ids, pos))
        self.prefill_s = time.perf_counter() - t0
        toks, self.decode_s = [tok], []
        pos = torch.tensor([p], device=dev)
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            tok = _synced(self.step(tok, pos))
            self.decode_s.append(time.perf_counter() - t0)
            toks.append(tok)
            pos.add_(1)
        return torch.cat(toks, 1)


class _Stamps:
    """A ``transformers`` streamer that records when each chunk of tokens arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        _synced(value)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _synced(token: torch.Tensor) -> torch.Tensor:
    """``token`` once the device has computed it (a GPU runs kernels after the call
    returns; a decode loop reads each token before the next step)."""
    if token.is_cuda:
        torch.cuda.synchronize()
    return token


def _caches_off() -> None:
    """Cold compiles in this process: inductor's on-disk FX graph and autograd caches off."""
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def measure(
    size: Size,
    peers: tuple[str, ...] = PEERS,
    paths: tuple[str, ...] = PATHS,
    rounds: int = 5,
    log: Callable[[str], None] = lambda s: None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Per (path, peer): cold and warm time to first token, decode tokens/s, token match."""
    _caches_off()
    model = build_llama(size).to(device)
    ids = prompt_ids(size).to(device)
    with torch.no_grad():
        reference = model.generate(
            ids,
            max_new_tokens=size.new_tokens,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,
        )[:, ids.shape[1] :]
    results: dict[str, dict[str, Any]] = {}
    runners: dict[tuple[str, str], Timed] = {}
    for path in paths:
        for peer in peers:
            if path == "jax" and peer != "dynajax":
                continue  # JAX itself: dynajax's alone
            log(f"{path} / {peer}: first generation (compiles)")
            r = Timed(peer, path, model, ids, size)
            t0 = time.perf_counter()
            toks = r.run(size.new_tokens)
            total = time.perf_counter() - t0
            runners[path, peer] = r
            results[f"{path}/{peer}"] = {
                "cold_ttft_s": r.prefill_s,
                "cold_first_step_s": r.decode_s[0] if r.decode_s else None,
                "cold_total_s": total,
                "matches_eager": bool(torch.equal(toks, reference)),
                "graphs": graph_summary(r.backend) if r.backend is not None else None,
                "ttft": [],
                "decode": [],
            }
    order = list(runners)
    for rnd in range(rounds):
        log(f"round {rnd + 1}/{rounds}")
        k = rnd % len(order)
        for key in order[k:] + order[:k]:
            r = runners[key]
            toks = r.run(size.new_tokens)
            res = results[f"{key[0]}/{key[1]}"]
            res["matches_eager"] &= bool(torch.equal(toks, reference))
            res["ttft"].append(r.prefill_s)
            res["decode"].extend(r.decode_s)
    for res in results.values():
        res["ttft_s"] = statistics.median(res.pop("ttft"))
        # the median decode step over every round: a preemption stays one outlier
        res["tokens_per_s"] = size.batch / statistics.median(res.pop("decode"))
    for key, r in runners.items():  # after the rounds: recompiles would show here
        if r.backend is not None:
            results[f"{key[0]}/{key[1]}"]["graphs"] = graph_summary(r.backend)
    return {
        "size": dataclasses.asdict(size),
        "rounds": rounds,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "results": results,
    }


def profile(
    size: Size, calls: int = 200, rounds: int = 5, peer: str = "inductor"
) -> dict[str, float]:
    """Where one decode step of the hand-written loop spends its time, µs per call.

    Layers, each timed as the median over ``rounds`` (interleaved, rotating order) of
    the mean over ``calls`` calls: ``peer``'s and dynajax's whole compiled step, fed a
    new token tensor each call as decoding does (and dynajax's fed the same one: every
    input cached); the step's one JAX partition (``CompiledPartition.run``) on the very
    tensors it receives during the step, as decoding calls it (a new token tensor, the
    KV buffers at new versions after their in-place update) and with every input
    unchanged; the XLA program alone (the partition's ``jitted`` on ``jax.Array``
    copies: no torch edge); and the ``copy_`` of the updated KV buffers into the
    model's, which aot_autograd's epilogue runs after each call (XLA returns them in
    new buffers).
    """
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import Recorder
    from dynajax.runtime.compiled import CompiledPartition

    model = build_llama(size)
    ids = prompt_ids(size)
    p = ids.shape[1]
    steps: dict[str, Callable[[], Any]] = {}
    pos = torch.tensor([p])
    dyn: Timed | None = None
    for name in (peer, "dynajax"):
        r = Timed(name, "loop", model, ids, size)
        with torch.no_grad():
            tok = r.prefill(ids, torch.arange(p))
            r.step(tok, pos)  # compiles the decode step
        steps[f"{name}, whole step, a new token tensor"] = functools.partial(
            lambda step, t: step(t.clone(), pos), r.step, tok
        )
        dyn = r if name == "dynajax" else dyn
    assert dyn is not None and dyn.backend is not None
    steps["dynajax, whole step, the same token tensor"] = functools.partial(dyn.step, tok, pos)
    decode_graph = dyn.backend.graphs[-1].graph_module
    (part,) = [m for _, m in decode_graph.named_children() if isinstance(m, CompiledPartition)]
    recorder = Recorder(part.inputs)
    part.inputs = recorder  # type: ignore[assignment]
    with torch.no_grad():
        dyn.step(tok, pos)
    part.inputs = recorder.inner
    tensors = recorder.tensors
    caches = [t for t in tensors if t.dim() == 4]  # the KV buffers
    token = next(i for i, t in enumerate(tensors) if t is tok)

    def run_as_decoding() -> Any:
        for c in caches:
            # What the in-place update does to the buffer's metadata (a new version,
            # the same memory), without the write's own time.
            torch.autograd.graph.increment_version(c)
        args = list(tensors)
        args[token] = tok.clone()
        return part.run(args)

    steps["CompiledPartition.run, as decoding calls it"] = run_as_decoding
    steps["CompiledPartition.run, every input unchanged"] = functools.partial(part.run, tensors)
    with jax.enable_x64(True):
        arrays = [jnp.array(t.detach().numpy()) for t in tensors]
    jitted = part.jitted

    def floor() -> Any:
        with jax.enable_x64(True):
            return jax.block_until_ready(jitted(*arrays))

    steps["the XLA program alone (jitted on jax.Arrays)"] = floor
    news = [c.clone() for c in caches]

    def copy_back() -> None:
        for c, n in zip(caches, news, strict=True):
            c.copy_(n)

    steps[f"aot_autograd's copy_ of the {len(caches)} KV buffers"] = copy_back
    steps["a token tensor's clone (in the rows above)"] = tok.clone
    samples: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    with torch.no_grad():
        for name in names:
            steps[name]()  # warm
        for rnd in range(rounds):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                step = steps[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def print_report(out: dict[str, Any]) -> None:
    res = out["results"]
    print(f"\n{out['size']}, {out['rounds']} rounds interleaved, on {out['device']}")
    head = ["path", "peer", "tokens/s", "vs inductor", "TTFT warm", "TTFT cold", "1st step cold"]
    head += ["1st generation", "= eager"]
    lines = [head]
    for key, r in res.items():
        path, peer = key.split("/")
        ind = res.get(f"{path}/inductor", res.get("loop/inductor", {})).get("tokens_per_s")
        lines.append(
            [
                path,
                peer,
                f"{r['tokens_per_s']:.1f}",
                f"{r['tokens_per_s'] / ind:.2f}" if ind else "-",
                f"{r['ttft_s'] * 1e3:.2f} ms",
                f"{r['cold_ttft_s']:.2f} s",
                f"{r['cold_first_step_s']:.2f} s" if r["cold_first_step_s"] else "-",
                f"{r['cold_total_s']:.2f} s",
                "yes" if r["matches_eager"] else "NO",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    for j, row in enumerate(lines):
        print(
            "  ".join(
                c.rjust(w) if i > 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if j == 0:
            print("  ".join("-" * w for w in widths))
    for key, r in res.items():
        if r.get("graphs"):
            print(f"{key}: {r['graphs']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode", description=__doc__.split("\n")[0]
    )
    d = Size()
    for field in dataclasses.fields(Size):
        flag = "--" + field.name.replace("_", "-")
        p.add_argument(flag, type=int, default=getattr(d, field.name))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument(
        "--profile",
        action="store_true",
        help="time the layers of one decode step of the loop instead (µs per call)",
    )
    p.add_argument("--calls", type=int, default=200, help="calls per round (--profile)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        help="compute threads for every peer (as python -m benchmarks.run --threads)",
    )
    args = p.parse_args(argv)
    if args.threads:
        from benchmarks.threads import set_threads

        set_threads(args.threads)
    size = Size(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Size)})
    if args.profile:
        layers = profile(size, args.calls, args.rounds)
        width = max(map(len, layers))
        print(f"\n{dataclasses.asdict(size)}: one decode step, µs per call (median of rounds)")
        for name, us in layers.items():
            print(f"{name.ljust(width)}  {us:9.1f}")
        return 0
    out = measure(
        size,
        tuple(args.peers.split(",")),
        tuple(args.paths.split(",")),
        args.rounds,
        log=lambda s: print(f"[decode] {s}", file=sys.stderr, flush=True),
        device=args.device,
    )
    print_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

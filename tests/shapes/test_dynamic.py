"""Dynamic shapes: symbolic sizes run in JAX, give eager's results at every size, and
compile one executable per size (bounded) or per power-of-two bucket."""

from __future__ import annotations

import pytest
import torch

import dynajax
from tests.helpers import assert_greedy_decode, compile_with, report_of
from tests.models import gpt2, mlp, tokens
from tests.tolerances import assert_same


def _compile(fn, **options):
    """``fn`` compiled with dynamic shapes, without the persistent cache (so compile
    counts are this test's own)."""
    return compile_with(fn, dynamic=True, cache_dir="", **options)


def _compile_rows(fn, **options):
    """``fn`` compiled with only dimension 0 of its argument dynamic."""
    compiled, backend = compile_with(fn, cache_dir="", **options)

    def call(x):
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x)

    return call, backend


# -- sizes used as values inside JAX ----------------------------------------------------


def _view_rows(x):
    return (x.view(x.shape[0], -1) * 2).sum(1)


def _zeros_of_size(x):
    return x.sum((1, 2)) + torch.zeros(x.shape[0])


def _arange_rows(x):
    return x * torch.arange(x.shape[0], dtype=x.dtype)[:, None, None]


def _expand_and_mean(x):
    return x.mean(0).expand(x.shape[0], -1, -1) - x


def _reshape_both(x):
    return x.reshape(x.shape[0] * x.shape[1], -1).softmax(0).reshape(x.shape)


CASES = {
    "view-rows": _view_rows,
    "zeros-of-size": _zeros_of_size,
    "arange-rows": _arange_rows,
    "expand-mean": _expand_and_mean,
    "reshape-both": _reshape_both,
}


@pytest.mark.parametrize("fn", list(CASES.values()), ids=list(CASES))
def test_symbolic_sizes_run_in_jax(fn) -> None:
    f, backend = _compile(fn)
    for n in (2, 3, 5):
        x = torch.randn(n, n + 1, 4)
        assert_same(f(x), fn(x))
    report = report_of(backend)
    assert report.fallbacks == [], report.text(width=None)
    # one executable per concrete shape; Dynamo compiled the graph once
    assert len(backend.graphs) == 1
    assert report.compile_stats.xla_compiles == 3


def _cache_step(cache, new):
    k = torch.cat([cache, new], 2)  # (b, h, past + 1, d): a size of an intermediate
    scores = (new @ k.transpose(-1, -2)).softmax(-1)
    return k, (scores @ k).reshape(k.shape[0], -1, k.shape[3]) * k.shape[2]


def test_sizes_of_intermediates_keep_one_partition() -> None:
    # k.shape[2] is `past + 1`: passes/sizes.py computes it from the input's size on the
    # host, so the host never waits for `cat` and the graph stays one JAX partition.
    f, backend = _compile(_cache_step)
    for past in (3, 4, 6):
        cache, new = torch.randn(2, 4, past, 8), torch.randn(2, 4, 1, 8)
        assert_same(f(cache, new), _cache_step(cache, new))
    report = report_of(backend)
    assert report.fallbacks == [], report.text(width=None)
    [graph] = report.graphs
    assert len(graph.partitions) == 1, report.text(width=None)
    assert "aten.sym_size.int" not in {str(n.target) for n in graph.graph_module.graph.nodes}


def test_llama_greedy_generation_with_kv_cache_matches_eager() -> None:
    # transformers' generate(): a prefill graph, then decode steps whose cache length
    # grows by one per token (Dynamo's automatic dynamic shapes after the second).
    from tests.models import llama

    torch.manual_seed(0)
    model = llama().eval()
    model.config.use_cache = model.generation_config.use_cache = True
    model.generation_config.pad_token_id = 0
    ids = tokens(2, 8)
    eager = model.forward
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
        backend = dynajax.Backend(cache_dir="")
        model.forward = torch.compile(model.forward, backend=backend)
        actual = model.generate(ids, max_new_tokens=6, do_sample=False)
    # eager's tokens, or where a near-tie of two logits parts them, eager's greedy choices
    assert_greedy_decode(lambda t: eager(t).logits, actual, expected, ids.shape[1], eos=0)
    report = report_of(backend)
    assert report.fallbacks == [], report.text(width=None)
    # one JAX partition per graph: the cache's growing length never splits them
    assert all(len(g.partitions) == 1 for g in report.graphs), report.text(width=None)
    assert any(g.host_scalars for g in report.graphs), "no decode graph with a symbolic length"


def test_llama_generation_with_a_static_cache_compiles_two_executables() -> None:
    # cache_implementation="static": the cache is a fixed-size buffer updated in place,
    # so every decode step has the same shapes: a prefill graph and a decode graph, one
    # XLA executable each, however many tokens are generated.
    from tests.models import llama

    torch.manual_seed(0)
    model = llama().eval()
    model.config.use_cache = model.generation_config.use_cache = True
    model.generation_config.pad_token_id = 0
    ids = tokens(2, 8, vocab=127) + 1  # no pad token: no attention mask growing per step
    eager = model.forward
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=10, do_sample=False)
        backend = dynajax.Backend(cache_dir="")
        model.forward = torch.compile(model.forward, backend=backend)
        actual = model.generate(
            ids, max_new_tokens=10, do_sample=False, cache_implementation="static"
        )
    assert_greedy_decode(lambda t: eager(t).logits, actual, expected, ids.shape[1], eos=0)
    report = report_of(backend)
    assert report.fallbacks == [], report.text(width=None)
    assert len(report.graphs) == 2, report.text(width=None)
    assert report.compile_stats.xla_compiles == 2, report.text(width=None)


def test_mark_dynamic_and_automatic_dynamic() -> None:
    model = mlp().eval()
    backend = dynajax.Backend(cache_dir="")
    f = torch.compile(model, backend=backend)
    with torch.no_grad():
        x = torch.randn(3, 32)
        torch._dynamo.mark_dynamic(x, 0)
        assert_same(f(x), model(x))
        for n in (4, 9):
            x = torch.randn(n, 32)
            assert_same(f(x), model(x))
        # a static graph first, then Dynamo's automatic dynamic shapes
        torch._dynamo.reset()
        g = torch.compile(model, backend=backend)
        for n in (3, 5, 7, 11):
            y = torch.randn(n, 32)
            assert_same(g(y), model(y))
    assert not report_of(backend).fallbacks


def test_gpt2_dynamic_sequence_length_stays_in_jax() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=1).eval()
    backend = dynajax.Backend(cache_dir="")
    f = torch.compile(model, backend=backend)
    with torch.no_grad():
        for length in (5, 9):
            ids = tokens(2, length)
            torch._dynamo.mark_dynamic(ids, 1)
            assert_same(f(ids).logits, model(ids).logits, model=True)
    report = report_of(backend)
    assert len(backend.graphs) == 1, report.text(width=None)
    symbolic = [f for f in report.fallbacks if "symbolic" in f.detail]
    assert symbolic == [], report.text(width=None)
    assert report.fraction_in_jax > 0.95, report.text(width=None)


def test_encoder_layer_batch_padded_to_buckets() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    f, backend = _compile_rows(layer, pad_to_buckets=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 6, 32)
            assert_same(f(x), layer(x), model=True)
    stats = report_of(backend).compile_stats
    # layer norm, softmax and matmuls stay within a row of the batch
    assert len(stats.buckets) == 1 and not stats.exact, stats
    assert stats.xla_compiles == 3  # buckets 2, 4, 8


def test_gpt2_dynamic_batch_with_buckets_asked() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=1).eval()
    backend = dynajax.Backend(cache_dir="", pad_to_buckets=True)
    f = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in (2, 3, 5):
            ids = tokens(batch, 6)
            torch._dynamo.mark_dynamic(ids, 0)
            assert_same(f(ids).logits, model(ids).logits, model=True)
    stats = report_of(backend).compile_stats
    # One decision for the batch symbol, with its reason when refused (today: the
    # attention mask is indexed along the batch, and JAX's index normalization adds the
    # batch size as a value).
    assert len(stats.buckets) + len(stats.exact) == 1, stats
    assert stats.xla_compiles == 3  # buckets 2, 4, 8 or sizes 2, 3, 5


def test_training_with_dynamic_batch() -> None:
    torch.manual_seed(0)
    model = mlp()
    ref = mlp()
    ref.load_state_dict(model.state_dict())
    f, backend = _compile(model, pad_to_buckets=True)
    for n in (2, 3, 6):
        x = torch.randn(n, 32)
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert_same(p.grad, q.grad)
    stats = report_of(backend).compile_stats
    # the weight gradients contract over the batch: the backward is not padded
    assert any("dot_general contracts" in e for e in stats.exact), stats.exact


# -- the bounded LRU --------------------------------------------------------------------


def test_executables_per_partition_are_bounded() -> None:
    f, backend = _compile(lambda x: torch.tanh(x) * 3, max_executables=2)
    for n in (2, 3, 4, 2, 4):
        x = torch.randn(n, 3)
        assert_same(f(x), torch.tanh(x) * 3)
    stats = report_of(backend).compile_stats
    # 2, 3, 4 compile (2 is dropped), 2 compiles again (3 is dropped), 4 is kept
    assert stats.xla_compiles == 4
    assert stats.evictions == 2
    [part] = [m for n, m in backend.graphs[0].graph_module.named_children() if n == "jax_0"]
    assert len(part.executables) == 2


def test_max_executables_option_and_env(monkeypatch) -> None:
    with pytest.raises(dynajax.OptionsError, match="max_executables"):
        dynajax.Backend(max_executables=0)
    monkeypatch.setenv("DYNAJAX_MAX_EXECUTABLES", "lots")
    with pytest.raises(dynajax.OptionsError, match="DYNAJAX_MAX_EXECUTABLES"):
        dynajax.Backend()
    monkeypatch.setenv("DYNAJAX_MAX_EXECUTABLES", "5")
    monkeypatch.setenv("DYNAJAX_PAD_TO_BUCKETS", "1")
    options = dynajax.Backend().options
    assert options.max_executables == 5 and options.pad_to_buckets is True


# -- buckets ----------------------------------------------------------------------------


def _rowwise(x):
    return torch.relu(x @ torch.ones(x.shape[-1], 4)).cumsum(0) + x.view(x.shape[0], -1)[:, :1]


def _blocks(x):
    # [s, 4] -> [4s] -> [s, 2, 2]: rows stay contiguous blocks; arange(2*s) too
    flat = x.reshape(-1) * 2 + torch.arange(x.shape[0] * 4, dtype=x.dtype)
    return flat.view(x.shape[0], 2, 2).sum(-1)


@pytest.mark.parametrize("fn", [_rowwise, _blocks], ids=["rowwise", "blocks"])
def test_buckets_compile_once_per_power_of_two(fn) -> None:
    f, backend = _compile_rows(fn, pad_to_buckets=True)
    for n in range(2, 10):
        x = torch.randn(n, 4)
        assert_same(f(x), fn(x))
    stats = report_of(backend).compile_stats
    assert len(stats.buckets) == 1 and not stats.exact, stats
    assert stats.xla_compiles == 4  # buckets 2, 4, 8, 16


LEAKY = {
    "sum-over-rows": lambda x: x.sum(0),
    "mean-over-rows": lambda x: x - x.mean(0),
    "softmax-over-rows": lambda x: x.softmax(0),
    "rows-contracted": lambda x: x.t() @ x,
    "flip-rows": lambda x: x.flip(0) * 2,
    "reverse-cumsum": lambda x: x.flip(0).cumsum(0),
    "rows-flattened": lambda x: x.reshape(-1).softmax(0),
    "last-row": lambda x: x[-1] + x,
    "size-as-value": lambda x: x * x.shape[0],
    "size-in-arange": lambda x: x + torch.arange(x.shape[0] * 2 + 1)[:-1].view(-1, 2)[:, :1],
    "rows-interleaved": lambda x: x.t().reshape(-1).view(x.shape[0], -1) * 2,
}


@pytest.mark.parametrize("fn", list(LEAKY.values()), ids=list(LEAKY))
def test_buckets_refused_where_padding_would_leak(fn) -> None:
    f, backend = _compile_rows(fn, pad_to_buckets=True)
    for n in (3, 5, 6):
        x = torch.randn(n, 4) + 1
        assert_same(f(x), fn(x))
    stats = report_of(backend).compile_stats
    assert stats.buckets == [], stats
    assert stats.exact, stats
    assert stats.xla_compiles == 3  # one per exact size


def test_report_lists_buckets() -> None:
    f, backend = _compile_rows(lambda x: x.sum(0), pad_to_buckets=True)
    f(torch.randn(3, 2))
    text = report_of(backend).text(width=None)
    assert "compiles: 1 XLA compile(s)" in text
    assert "not padded: jax_0: " in text and "reduce_sum reduces over" in text

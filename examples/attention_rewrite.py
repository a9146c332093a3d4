"""A pattern rewrite: hand-written attention replaced by ``jax.nn.dot_product_attention``.

    python examples/attention_rewrite.py

The model computes attention the way many models spell it out:

    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)

The option ``rewrites`` takes ``dynajax.Rewrite(pattern, replacement)``: the pattern is
that computation written as a function of ``q, k, v``; the replacement calls one JAX
function through ``dynajax.call_jax``, which dynajax inlines into the surrounding XLA
partition (forward, and backward through ``jax.vjp``). Patterns are matched on Dynamo's
torch-level graph (before aot_autograd turns ``matmul`` into shape-specific
``expand``/``view``/``bmm`` chains), with torch.fx's ``SubgraphMatcher``.

The scale is a literal in the graph (``math.sqrt(8)`` is folded to ``2.828...``) that
differs per model, so the rewrite ignores literals while matching and a filter checks
them instead: every literal of the match must equal the pattern's, except the scale,
which must be ``sqrt(head_dim)``, the scale ``dot_product_attention`` applies. The
report lists the rewrite, its matches and the source line of each.
"""

from __future__ import annotations

import copy
import math
import operator

import jax
import torch
from torch import nn

import dynajax

# -- the model: attention written out by hand ---------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        weights = torch.softmax(scores, dim=-1)
        attended = torch.matmul(weights, v)
        return x + self.out(attended.transpose(1, 2).reshape(b, t, d))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


# -- the rewrite --------------------------------------------------------------------------


def attention_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) / 8.0  # any scale: checked by the filter
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _dot_product_attention(q, k, v):
    # torch's (batch, heads, tokens, head_dim) -> JAX's (batch, tokens, heads, head_dim)
    out = jax.nn.dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2))
    return out.swapaxes(1, 2)


def attention_jax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return dynajax.call_jax(_dot_product_attention, q, k, v)


def scale_is_sqrt_head_dim(match, graph, pattern) -> bool:
    """Keeps a match whose literals are the pattern's, its scale ``sqrt(head_dim)``."""
    head_dim = match.placeholder_nodes[0].meta["example_value"].shape[-1]
    for p, g in match.nodes_map.items():
        if p.op not in ("call_function", "call_method"):
            continue
        literals = [a for a in g.args if not isinstance(a, torch.fx.Node)]
        if p.target is operator.truediv:
            if len(literals) != 1 or not math.isclose(literals[0], math.sqrt(head_dim)):
                return False
        elif literals != [a for a in p.args if not isinstance(a, torch.fx.Node)]:
            return False
        elif g.kwargs != p.kwargs:
            return False
    return True


ATTENTION = dynajax.Rewrite(
    attention_pattern,
    attention_jax,
    name="attention",
    match_filters=(scale_is_sqrt_head_dim,),
    ignore_literals=True,
)


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 6, 32)

    backend = dynajax.Backend(rewrites=[ATTENTION])
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    out.pow(2).mean().backward()
    expected = reference(x)
    expected.pow(2).mean().backward()

    report = dynajax.Report(backend.graphs)
    print(report)
    err = float((out - expected).abs().max().detach())
    grad_err = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    print(f"\noutput vs eager: {err:.2e}; largest gradient difference: {grad_err:.2e}")
    assert err < 1e-5 and grad_err < 1e-5

    (rewrite,) = [r for g in report.graphs for r in g.rewrites]
    assert rewrite.name == "attention" and rewrite.matches == 2, rewrite
    assert [s.rsplit(" in ", 1)[-1] for s in rewrite.sources] == ["blocks.0", "blocks.1"]
    assert all("attention_rewrite.py" in s and "matmul(weights, v)" in s for s in rewrite.sources)
    assert report.fallbacks == [] and all(len(g.partitions) == 1 for g in report.graphs)
    in_jax = {op for p in report.partitions for op in p.ops}
    assert "dynajax.call_jax.default" in in_jax and "aten._softmax.default" not in in_jax


if __name__ == "__main__":
    main()

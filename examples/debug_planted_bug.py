"""Finding the op when a compiled model's answer drifts: a wrong rule planted in GPT-2.

    python examples/debug_planted_bug.py

A JAX rule that is off by 0.1% (here ``aten.tanh``, replaced through
``dynajax.register_rule(..., override=True)``) moves GPT-2's gradients out of
tolerance. ``dynajax.debug.compare`` runs the model compiled and eagerly, re-runs every
JAX partition in eager PyTorch node by node, evaluates each node's rule on the *eager*
values of its inputs, and names the first rule that disagrees: its op, partition,
inputs, error, and the line of ``transformers`` that made the node. The float64 check
tells a wrong rule from one that only rounds differently.
"""

from __future__ import annotations

import sys
import warnings

import torch
import transformers

import dynajax
from dynajax.lowering.registry import get_rule

aten = torch.ops.aten


def main() -> int:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout to compare
    ids = torch.randint(0, 128, (2, 8))

    builtin = get_rule(aten.tanh.default)
    assert builtin is not None
    with warnings.catch_warnings():  # replacing a built-in rule warns, as it should
        warnings.simplefilter("ignore", dynajax.RuleOverrideWarning)

        @dynajax.register_rule(aten.tanh.default, override=True)
        def slightly_wrong_tanh(x):
            return builtin.fn(x) * 1.001

    report = dynajax.debug.compare(model, ids, backward=True)
    print(report)
    dynajax.unregister_rule(aten.tanh.default)

    first = report.first
    found = (
        first is not None
        and first.op is aten.tanh.default
        and first.finding is dynajax.debug.Finding.WRONG
        and "activations.py" in first.source_line
    )
    print("\nthe debugger names the planted rule:", "yes" if found else "NO")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())

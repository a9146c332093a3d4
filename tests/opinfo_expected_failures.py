"""OpInfo samples that dynajax gets wrong today: data with a reason, a list that only
shrinks. Keys are ``(op name, variant test name, dtype)`` as in PyTorch's OpInfo
database; the value says why. ``tests/test_opinfo.py`` fails when a listed entry passes
every one of its samples (remove it then), and ``python -m tests.opinfo_full`` lists
those entries after a run.
"""

from __future__ import annotations

_DYNAMO_ADDCDIV = (
    "Dynamo itself rewrites torch.addcdiv(..., value=v) into div, mul and add before "
    "any backend sees it (aot_eager gives the same wrong bfloat16 answer); each rounds "
    "to bfloat16, where PyTorch's fused kernel computes in float32 and rounds once. "
    "Without value= the op reaches dynajax whole and matches (lowering/fused.py)"
)

EXPECTED_FAILURES: dict[tuple[str, str, str], str] = {
    ("addcdiv", "", "bfloat16"): _DYNAMO_ADDCDIV,
}

"""One architecture's record in the sweep's results (``benchmarks/sweep.py`` writes
them; ``benchmarks/figures.py`` tabulates them from its JSON): the stages dynajax runs,
and the stage that stopped an architecture.
"""

from __future__ import annotations

from typing import Any

# The stages that run dynajax (after build, eager and aot_eager).
OURS = ("dynajax", "jax_forward", "jax_grad")


def first_failure(res: dict[str, Any]) -> tuple[str, str]:
    stages = res.get("stages", {})
    for s in ("build", "eager", "aot_eager", *OURS):
        st = stages.get(s)
        if st is not None and not st.get("ok") and not st.get("upstream"):
            return s, st.get("error", "")
    for s, st in stages.items():  # upstream: the default config, or aot_eager's backward
        if st.get("upstream"):
            why = st.get("aot_eager_grad") or st["upstream"]
            return s, f"{st.get('error', '')} | upstream: {why}"
    return "", ""

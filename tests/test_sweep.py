"""A fast subset of the architecture sweep (``python -m benchmarks.sweep``): one tiny
random model per family, and a mixture of experts whose fresh router has tied scores
(AFMoE: every token's top-2 experts tie; with a stable sort's choice of experts the
backend's logits were 0.09 from eager's), give eager's answer through the backend and
through ``jax_function`` (``jax.jit`` forward, ``jax.grad`` against ``torch.autograd``)."""

from __future__ import annotations

import pytest

from benchmarks import sweep
from tests.helpers import measured_faster

CASES = {
    "llama": ("causal-lm", "LlamaForCausalLM"),
    "bert": ("masked-lm", "BertForMaskedLM"),
    "bart": ("seq2seq", "BartForConditionalGeneration"),
    "vit": ("image-classification", "ViTForImageClassification"),
    "afmoe": ("causal-lm", "AfmoeForCausalLM"),
}


@pytest.mark.parametrize("model_type", list(CASES))
def test_architecture_gives_eagers_answer(model_type: str) -> None:
    family, cls = CASES[model_type]
    with measured_faster("xla"):  # (every op in JAX is the point, on any CPU)
        res = sweep.run_case(family, model_type, cls, aot_eager=False)
    stages = res["stages"]
    for stage in ("build", "eager", "dynajax", "jax_forward"):
        assert stages[stage]["ok"], f"{stage}: {stages[stage]}"
    assert stages["dynajax"]["fallbacks"] == [], stages["dynajax"]
    assert stages["jax_forward"]["callbacks"] == [], stages["jax_forward"]
    # afmoe included: torch's backward of its float32 experts is traced with
    # torch.compiler.is_compiling() on, as the forward's export is, so transformers
    # takes its grouped_mm fallback op rather than torch._grouped_mm (whose fake kernel
    # takes bfloat16 only; "Expected inputs of BF16 type" before).
    assert stages["jax_grad"]["ok"], stages["jax_grad"]

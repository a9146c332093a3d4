"""Real pipelines, as users run them, with the options they leave alone.

Each test compiles a model with ``torch.compile(model, backend="dynajax")`` and nothing
else (no ``options``, no ``DYNAJAX_*`` variable: ``tests/conftest.py`` sets none), runs
the loop a library wraps around it, and compares the loop's result with eager's:

* a diffusers DDIM sampling loop with classifier-free guidance over a tiny
  ``UNet2DConditionModel``, the timestep passed as ``t.expand(batch)`` (a stride-0 view
  of the scheduler's timesteps, as diffusers' pipelines pass it);
* a transformers ``generate()`` with a static cache, greedy, over a tiny Llama, its
  ``forward`` compiled (transformers' own recipe for a static cache);
* an RT-DETR detector (transformers, its own ResNet backbone) between its image
  processor's pre-processing and ``post_process_object_detection``.

Why: each default option, ``measure_costs`` above all (at a graph's first compile it
times the graph with its convolutions in PyTorch and in JAX, on stand-in inputs of the
graph's layouts, and keeps the faster), runs here on the programs users compile. A
pipeline with an expanded timestep crashed at that measuring while every
test, run with ``measure_costs`` off, passed. The DDIM and RT-DETR tests check that
the measuring ran (``measured``), and every test that the loop compiled its graphs once.

The weights are random, the configurations tiny, nothing is downloaded. Tolerances are
eager's own rounding: each is about twice the largest distance of eager's float32
answer from the same pipeline run in float64 (two answers each within eager's rounding
of the exact one), the float32 tolerance of one op (tests/tolerances.py) in ``rtol``;
the distances measured are listed beside each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The stand-in inputs of each graph whose cost choice was timed in place, one list
    per timing that completed. ``in_graph.time_both`` is only watched: it runs as it
    would, on the stand-ins the backend built."""
    from dynajax.capability import in_graph

    timed: list[list[Any]] = []
    time_both = in_graph.time_both

    def watched(runs: Any, inputs: list[Any]) -> Any:
        result = time_both(runs, inputs)
        timed.append(inputs)
        return result

    monkeypatch.setattr(in_graph, "time_both", watched)
    return timed


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process (every compile and recompile)."""
    return counters["stats"]["unique_graphs"]


def _clear_of_ties(gaps: torch.Tensor, tol: float, what: str) -> None:
    """Eager's choices are not rounding's: each value chosen leads the next candidate by
    more than twice ``tol``, the most either may move within the tolerance (else a
    greedy token or a detection's rank could differ by an ulp, and comparing them
    exactly would test luck)."""
    gap = gaps.min().item()
    assert gap > 2 * tol, f"{what}: a near tie in eager ({gap:.3g}): pick another seed"


# --- diffusers: DDIM with classifier-free guidance ---------------------------------------

# The final latents. Seeds 0-2 (this config): compiled against eager 1.5e-4, 2.3e-4,
# 1.6e-4 at most (rtol 1.3e-5 needs atol 1.4e-4, 2.2e-4, 1.5e-4); eager float32 against
# float64 1.0e-4, 1.4e-4, 1.1e-4, and compiled against float64 8.6e-5, 1.2e-4, 7.9e-5:
# the compiled loop is as close to the exact answer as eager's. The guidance (7.5) and
# DDIM's first steps (x0 = (x - sqrt(1 - a) eps) / sqrt(a), sqrt(a) = 0.07 at t = 999)
# amplify the UNet's rounding (a few 1e-6 a call) some fiftyfold.
DDIM_RTOL, DDIM_ATOL = 1.3e-5, 3e-4


def _unet() -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    # Stable Diffusion's shape, shrunk: cross-attention down and up blocks around a plain
    # pair, a cross-attention mid block, down- and upsampling; linear projections in the
    # transformers (Stable Diffusion 2's), so that the convolutions are the ResNets'.
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        use_linear_projection=True,
    ).eval()


@torch.no_grad()
def _ddim(unet: Any, latents: torch.Tensor, prompt: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """diffusers' text-to-image loop (StableDiffusionPipeline's): the unconditional and
    the prompt's halves in one batch, the timestep expanded to it."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(steps)
    context = torch.cat([torch.zeros_like(prompt), prompt])
    latents = latents * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        both = scheduler.scale_model_input(torch.cat([latents] * 2), t)
        noise = unet(both, t.expand(both.shape[0]), encoder_hidden_states=context).sample
        uncond, cond = noise.chunk(2)
        latents = scheduler.step(uncond + 7.5 * (cond - uncond), t, latents).prev_sample
    return latents


def test_diffusers_ddim_loop_with_an_expanded_timestep_matches_eager(
    measured: list[list[Any]],
) -> None:
    torch.manual_seed(0)
    unet = _unet()
    gen = torch.Generator().manual_seed(10)
    latents = torch.randn(1, 4, 16, 16, generator=gen)
    prompt = torch.randn(1, 8, 16, generator=gen)

    expected = _ddim(unet, latents, prompt)
    graphs = _graphs()
    actual = _ddim(torch.compile(unet, backend="dynajax"), latents, prompt)

    torch.testing.assert_close(actual, expected, rtol=DDIM_RTOL, atol=DDIM_ATOL)
    assert _graphs() - graphs == 1, "the UNet compiled again within the loop"
    # The convolutions' choice was timed, the expanded timestep's layout among the
    # stand-ins (an expanded input once crashed there).
    assert measured, "measure_costs timed nothing"
    assert any(isinstance(x, torch.Tensor) and 0 in x.stride() for x in measured[0])


# --- transformers: generate() with a static cache -----------------------------------------

# Logits of each step. Three seeds of weights and prompts: compiled against eager 1.8e-5,
# 1.2e-5, 1.2e-5 at most (|logits| up to 8-13; rtol 1.3e-5 needs atol 8.6e-6, 1.1e-5,
# 9.5e-6); eager float32 against float64 1.2e-5, 9.8e-6, 8.6e-6.
GENERATE_RTOL, GENERATE_ATOL = 1.3e-5, 3e-5


def _llama() -> torch.nn.Module:
    import transformers

    # Weights drawn wider than transformers' 0.02: at 0.02 greedy decoding repeats one
    # token whatever the context, and its logits lie close together.
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.3,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 6 tokens, the second 4 long and padded on the left (as a tokenizer
    pads a batch for generation)."""
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


@torch.no_grad()
def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        cache_implementation="static",
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )


def test_transformers_generate_with_a_static_cache_matches_eager() -> None:
    torch.manual_seed(0)
    model = _llama()
    prompts = [_prompts(10), _prompts(11)]
    expected = [_generate(model, *p) for p in prompts]

    graphs = _graphs()
    model.forward = torch.compile(model.forward, backend="dynajax")
    first = _generate(model, *prompts[0])
    compiled = _graphs() - graphs
    second = _generate(model, *prompts[1])  # the static cache reused, emptied

    for actual, eager in zip([first, second], expected, strict=True):
        top = torch.stack(eager.logits).topk(2, dim=-1).values
        tol = GENERATE_ATOL + GENERATE_RTOL * top.abs().max().item()
        _clear_of_ties(top[..., 0] - top[..., 1], tol, "the greedy tokens' logits")
        assert torch.equal(actual.sequences, eager.sequences), (
            f"{actual.sequences.tolist()} != {eager.sequences.tolist()}"
        )
        for name in ("logits", "scores"):
            torch.testing.assert_close(
                torch.stack(getattr(actual, name)),
                torch.stack(getattr(eager, name)),
                rtol=GENERATE_RTOL,
                atol=GENERATE_ATOL,
                msg=lambda m, name=name: f"{name}: {m}",
            )
    # The prefill's graph and the decoding steps' one: a graph per new token would be a
    # recompile at every step.
    assert compiled == 2, f"{compiled} graphs for one generate()"
    assert _graphs() - graphs == compiled, "a second generate() compiled again"


# --- transformers: RT-DETR object detection -------------------------------------------------

# The model's outputs and the detections (scores in [0, 1], boxes in pixels up to 72).
# On the test's two batches: compiled against eager 1.8e-6 at most (the decoder's hidden
# states, |h| < 2.6; rtol 1.3e-5 needs atol 1.2e-6), 2.4e-7 in the scores, 7.6e-6 pixels
# in the boxes; eager float32 against float64 1.4e-6, 2.1e-7 and 1.0e-5 pixels.
DETECTION_RTOL, DETECTION_ATOL = 1.3e-5, 3e-6


def _rt_detr() -> torch.nn.Module:
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    # One feature level (stride 16) keeps the convolutions few (14: measuring compiles
    # the graph cut at each), with the hybrid encoder's attention, the query selection
    # (top-k over the encoder's proposals) and the deformable attention's sampling.
    backbone = RTDetrResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64],
        depths=[1, 1, 1],
        layer_type="basic",
        out_features=["stage3"],
    )
    cfg = RTDetrConfig(
        backbone_config=backbone,
        encoder_hidden_dim=32,
        encoder_in_channels=[64],
        feat_strides=[16],
        encode_proj_layers=[0],
        encoder_ffn_dim=64,
        encoder_attention_heads=2,
        d_model=32,
        num_queries=10,
        num_feature_levels=1,
        decoder_in_channels=[32],
        decoder_ffn_dim=64,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_n_points=2,
        num_labels=5,
        num_denoising=0,
    )
    model = RTDetrForObjectDetection(cfg).eval()
    # RT-DETR starts its box heads' last layers and the deformable attention's offsets
    # and weights at zero (the boxes are then the anchors, sampled at fixed points); a
    # trained model's are not.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.1)
    return model


def test_rt_detr_detections_match_eager(measured: list[list[Any]]) -> None:
    import numpy as np
    import transformers

    # The PIL processor (transformers 5 names it apart from the torchvision one, which
    # needs torchvision; before 5 it was RTDetrImageProcessor itself).
    image_processor = getattr(transformers, "RTDetrImageProcessorPil", None)
    image_processor = image_processor or transformers.RTDetrImageProcessor

    torch.manual_seed(0)
    model = _rt_detr()
    processor = image_processor(size={"height": 64, "width": 64})
    rng = np.random.default_rng(0)
    batches = [
        [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((48, 80), (64, 64))],
        [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((72, 56), (40, 40))],
    ]

    def detect(model: Any, images: list[Any]) -> tuple[Any, list[dict[str, torch.Tensor]]]:
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model(pixel_values=pixels)
        sizes = [image.shape[:2] for image in images]
        return out, processor.post_process_object_detection(out, threshold=0.0, target_sizes=sizes)

    expected = [detect(model, images) for images in batches]
    graphs = _graphs()
    compiled = torch.compile(model, backend="dynajax")
    actual = [detect(compiled, images) for images in batches]

    def close(actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        torch.testing.assert_close(
            actual,
            expected,
            rtol=DETECTION_RTOL,
            atol=DETECTION_ATOL,
            msg=lambda m: f"{path}: {m}",
        )

    for (out, detections), (eager_out, eager_detections) in zip(actual, expected, strict=True):
        assert out.keys() == eager_out.keys()
        for key in eager_out:
            close(out[key], eager_out[key], key)
        for found, eager in zip(detections, eager_detections, strict=True):
            # threshold=0 keeps the top num_queries (query, label) pairs, ranked.
            assert len(eager["scores"]) == 10
            gaps = eager["scores"][:-1] - eager["scores"][1:]
            _clear_of_ties(gaps, DETECTION_ATOL + DETECTION_RTOL, "ranked scores")  # (<= 1)
            assert torch.equal(found["labels"], eager["labels"])
            close(found["scores"], eager["scores"], "scores")
            close(found["boxes"], eager["boxes"], "boxes")
    assert _graphs() - graphs == 1, "the detector compiled again"
    assert measured, "measure_costs timed nothing"

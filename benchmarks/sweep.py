"""Every architecture, measured: ``python -m benchmarks.sweep``.

Every causal-LM, masked-LM, seq2seq and image-classification architecture that the
installed ``transformers`` ships (its auto mappings), each built from its config class's
defaults shrunk to a tiny random model (no downloads), goes through

    eager       the reference (run twice: a model that differs from itself is noted)
    aot_eager   torch.compile(backend="aot_eager"), PyTorch's own tracing
    dynajax     torch.compile(backend=dynajax.Backend()), with its fallback ops
    jax         dynajax.jax_function: jax.jit forward, and jax.grad of a scalar loss
                of the logits against torch.autograd's gradients of the parameters

and ends as

    ok          every stage gives eager's answer
    upstream    eager itself or aot_eager fails (an error, or aot_eager differs)
    failing     eager and aot_eager agree, and the backend or jax_function does not
    unbuilt     the sweep could not build a tiny model and inputs for it

    python -m benchmarks.sweep                          # everything (docs/sweep.json, .png)
    python -m benchmarks.sweep --only llama,t5,vit      # model types (substring: --match)
    python -m benchmarks.sweep --families causal-lm --workers 2 --timeout 300

Each model runs in a worker process (one at a time per worker; a worker is replaced
after a crash, a timeout or ``--recycle`` models), so one model's crash or hang costs
that model only. ``use_cache`` is off in every config: ``jax_function`` of a model that
returns a transformers cache is another matter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.sweep_record import OURS, first_failure

DOCS = Path(__file__).resolve().parent.parent / "docs"

FAMILIES = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
STATUSES = ("ok", "upstream", "failing", "unbuilt")

BATCH, SEQ, VOCAB, IMAGE = 2, 12, 96, 32


def architectures(families: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(family, model type, class name) of every architecture in transformers' auto
    mappings for the families (the first class where a mapping lists several)."""
    from transformers.models.auto import modeling_auto

    out = []
    for family, mapping in FAMILIES.items():
        if families and family not in families:
            continue
        for model_type, cls in getattr(modeling_auto, mapping).items():
            out.append((family, model_type, cls[0] if isinstance(cls, tuple) else cls))
    return out


# -- tiny configs --------------------------------------------------------------------------

# Integer config entries lowered to these values (never raised), wherever a config (or
# one of its sub-configs) has them.
SHRINK: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "emb_dim"), 32),
    **dict.fromkeys(("word_embed_proj_dim", "embedding_size", "n_embed", "d_embed"), 32),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers"), 1),
    **dict.fromkeys(("encoder_layers", "decoder_layers", "num_decoder_layers"), 1),
    **dict.fromkeys(("num_encoder_layers", "encoder_num_layers", "decoder_num_layers"), 1),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(
        ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2
    ),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "hidden_dim"), 64),
    **dict.fromkeys(("encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size", "inner_dim"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("expert_intermediate_size", "intermediate_size_mlp"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k"), 2),
    **dict.fromkeys(("moe_topk", "moe_top_k", "num_selected_experts"), 2),
    **dict.fromkeys(("rotary_dim", "rotary_emb_dim"), 8),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 0,
    **dict.fromkeys(("mamba_n_heads", "mamba_n_groups"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_d_state", "ssm_state_size", "state_size"), 16),
    "time_step_rank": 8,
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_size", "v_head_dim"), 8),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    "vocab_size": VOCAB,
    "image_size": IMAGE,
    "patch_size": 8,
    "num_labels": 4,
}
# Special token ids past the shrunk vocabulary become these.
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _shrink(value)  # a sub-config (text_config, vision_config, ...)
        elif key in SHRINK and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, SHRINK[key])
        elif key in ("depths", "num_layers_per_stage") and isinstance(value, list):
            out[key] = [min(v, 1) if isinstance(v, int) else v for v in value]
    vocab = out.get("vocab_size")
    if isinstance(vocab, int):
        for key, default in TOKEN_IDS.items():
            v = out.get(key)
            if isinstance(v, int) and v >= vocab:
                out[key] = default
    if "use_cache" in out:
        out["use_cache"] = False
    if "label2id" in out and out.get("num_labels") is not None:
        out.pop("label2id", None)
        out.pop("id2label", None)
    # Per-layer lists (layer_types, mlp_layer_types, ...): one layer of each kind that
    # any of them names, at least the shrunk number of layers.
    old_layers = next((d[k] for k in ("num_hidden_layers", "num_layers") if k in d), None)
    layers = next((out[k] for k in ("num_hidden_layers", "num_layers") if k in out), None)
    if isinstance(old_layers, int) and isinstance(layers, int) and old_layers != layers:
        lists = [
            k
            for k, v in out.items()
            if isinstance(v, list) and len(v) == old_layers and k not in ("depths",)
        ]
        keep: set[int] = set(range(layers))
        for k in lists:
            seen: dict[Any, int] = {}
            for i, v in enumerate(out[k]):
                try:
                    seen.setdefault(v, i)
                except TypeError:  # unhashable entries: no kinds to keep
                    break
            if k.endswith("types") or len(seen) <= 4:
                keep |= set(seen.values())
        if lists:
            idx = sorted(keep)
            for k in lists:
                out[k] = [out[k][i] for i in idx]
            for k in ("num_hidden_layers", "num_layers"):
                if k in out:
                    out[k] = len(idx)
    # Per-layer settings keyed by layer index: those of the kept layers.
    n_layers = out.get("num_hidden_layers")
    for key, value in d.items():
        if key.startswith("per_layer") and isinstance(value, dict) and isinstance(n_layers, int):
            out[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < n_layers}
    # Grouped-query attention keeps its kind: as many kv heads as heads (MHA, MLA), one
    # (MQA), or fewer (GQA).
    for heads_key, kv_key in (
        ("num_attention_heads", "num_key_value_heads"),
        ("n_head", "n_kv_heads"),
    ):
        h0, kv0 = d.get(heads_key), d.get(kv_key)
        if isinstance(h0, int) and isinstance(kv0, int) and isinstance(out.get(heads_key), int):
            out[kv_key] = out[heads_key] if kv0 >= h0 else (1 if kv0 == 1 else min(kv0, 2))
    out.pop("qk_head_dim", None)  # derived (deepseek): qk_nope_head_dim + qk_rope_head_dim
    # head_dim follows hidden/heads where both shrank
    hidden, heads = out.get("hidden_size"), out.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and hidden % heads:
        out["num_attention_heads"] = 4
    return out


def _changed(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``new`` that differ from ``old`` (sub-configs: theirs, as dicts)."""
    out = {}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict) and "model_type" in v:
            sub = _changed(v, old[k])
            if sub:
                out[k] = sub
        elif k not in old or old[k] != v:
            out[k] = v
    return out


def tiny_config(model_type: str) -> Any:
    """The config class's defaults with the entries of ``SHRINK`` lowered: only those
    entries are passed to its constructor (so what it derives, it derives again)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    d = default.to_dict()
    overrides = _changed(_shrink(d), d)
    overrides.pop("model_type", None)
    return type(default)(**overrides)


def inputs_for(family: str, model: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    config = model.config
    vocab = int(
        getattr(config, "vocab_size", None)
        or getattr(getattr(config, "text_config", None), "vocab_size", None)
        or VOCAB
    )
    low = 3 if vocab > 8 else 0  # clear of the pad/bos/eos ids the sweep sets

    def ids() -> Any:
        return torch.randint(low, vocab, (BATCH, SEQ), generator=g)

    if family == "image-classification":
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(vision, "num_channels", 3)
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=g)}
    if family == "seq2seq":
        return {"input_ids": ids(), "decoder_input_ids": ids()}
    return {"input_ids": ids()}


def _logits(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out.to_tuple()[0]
    return logits


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _compare(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None where ``actual`` is within tolerance of ``expected``, else what differs."""
    import numpy as np
    import torch

    a = torch.as_tensor(np.asarray(actual)) if not isinstance(actual, torch.Tensor) else actual
    a, e = a.detach(), expected.detach()
    if a.shape != e.shape:
        return f"shape {tuple(a.shape)} != eager's {tuple(e.shape)}"
    if a.dtype != e.dtype:
        a = a.to(e.dtype)
    if not torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
        diff = (a.double() - e.double()).abs().nan_to_num(float("inf")).max().item()
        return f"max abs difference {diff:.3g} (tolerance {atol:g} + {rtol:g}*|eager|)"
    return None


# -- one model, in a worker ---------------------------------------------------------------


def _wrapper(model: Any, names: list[str]) -> Any:
    from torch import nn

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return _logits(self.model(**dict(zip(names, args, strict=True))))

    return Logits()


def run_case(
    family: str, model_type: str, cls_name: str, stage_cb: Any = None, aot_eager: bool = True
) -> dict[str, Any]:
    """Every stage for one architecture; never raises (errors are data). Without
    ``aot_eager`` (the CI subset) that stage is not run and the status not classified."""
    import jax
    import numpy as np
    import torch
    import transformers

    import dynajax
    from dynajax.debug.accuracy import tolerance

    def stage(name: str) -> None:
        if stage_cb:
            stage_cb(name)

    result: dict[str, Any] = {"family": family, "model_type": model_type, "class": cls_name}
    stages: dict[str, Any] = {}
    result["stages"] = stages
    times: dict[str, float] = {}
    result["seconds"] = times

    def timed(name: str, fn: Any) -> Any:
        stage(name)
        t = time.perf_counter()
        try:
            return fn()
        finally:
            times[name] = round(time.perf_counter() - t, 2)

    torch.manual_seed(0)
    try:
        config = timed("build", lambda: tiny_config(model_type))
        cls = getattr(transformers, cls_name)
        model = timed("build", lambda: cls(config)).eval()
        kwargs = inputs_for(family, model)
    except Exception as e:  # noqa: BLE001 - the sweep records every failure as data
        stages["build"] = {"ok": False, "error": _short(e)}
        # Upstream where the config class's own defaults build no model either (on
        # the meta device: no memory for the full-size weights).
        try:
            from transformers import AutoConfig

            with torch.device("meta"):
                getattr(transformers, cls_name)(AutoConfig.for_model(model_type))
            result["status"] = "unbuilt"
        except Exception as e2:  # noqa: BLE001
            stages["build"]["upstream"] = f"the default config fails too: {_short(e2)}"
            result["status"] = "upstream"
        return result
    stages["build"] = {"ok": True, "parameters": sum(p.numel() for p in model.parameters())}
    names = list(kwargs)

    # eager, twice
    try:
        with torch.no_grad():
            expected = _logits(timed("eager", lambda: model(**kwargs)))
            again = _logits(model(**kwargs))
        if not isinstance(expected, torch.Tensor):
            raise TypeError(f"the model's first output is a {type(expected).__name__}")
    except Exception as e:  # noqa: BLE001
        stages["eager"] = {"ok": False, "error": _short(e)}
        result["status"] = "upstream"
        return result
    rtol, atol = tolerance(expected.dtype, model=True)
    nondeterministic = not torch.equal(expected, again)
    stages["eager"] = {"ok": True, "shape": list(expected.shape)}
    if nondeterministic:
        stages["eager"]["note"] = "eager differs from itself between two calls"

    def compiled(backend: Any) -> Any:
        torch._dynamo.reset()
        fn = torch.compile(model, backend=backend)
        with torch.no_grad():
            return _logits(fn(**kwargs))

    # aot_eager
    try:
        if not aot_eager:
            raise _NotRun
        diff = _compare(timed("aot_eager", lambda: compiled("aot_eager")), expected, rtol, atol)
        stages["aot_eager"] = {"ok": diff is None} | ({"error": diff} if diff else {})
    except _NotRun:
        pass
    except Exception as e:  # noqa: BLE001
        stages["aot_eager"] = {"ok": False, "error": _short(e)}

    # dynajax backend
    backend = dynajax.Backend()
    try:
        actual = timed("dynajax", lambda: compiled(backend))
        diff = _compare(actual, expected, rtol, atol)
        stages["dynajax"] = {"ok": diff is None} | ({"error": diff} if diff else {})
    except Exception as e:  # noqa: BLE001
        stages["dynajax"] = {"ok": False, "error": _short(e)}
    try:
        report = dynajax.Report(backend.graphs)
        fallbacks = sorted({f"{f.target} ({f.reason.name})" for f in report.fallbacks})
        stages["dynajax"]["fallbacks"] = fallbacks
        stages["dynajax"]["fraction_in_jax"] = round(report.fraction_in_jax, 4)
    except Exception as e:  # noqa: BLE001
        stages["dynajax"]["report_error"] = _short(e)
    torch._dynamo.reset()

    # jax_function: jit forward, then jax.grad against torch.autograd
    wrapper = _wrapper(model, names)
    args = [kwargs[n] for n in names]
    arrays = [a.numpy() for a in args]
    try:
        fn, state = timed("jax_export", lambda: dynajax.jax_function(wrapper, *args))
        stages["jax_forward"] = {"callbacks": sorted({str(c.op) for c in fn.callbacks})}
        actual = timed("jax_forward", lambda: np.asarray(jax.jit(fn)(state, *arrays)))
        diff = _compare(actual, expected, rtol, atol)
        stages["jax_forward"] |= {"ok": diff is None} | ({"error": diff} if diff else {})
    except Exception as e:  # noqa: BLE001
        stages["jax_forward"] = {"ok": False, "error": _short(e)}
        fn = None
    if fn is not None and expected.is_floating_point():
        weights = torch.cos(torch.arange(expected.numel(), dtype=torch.float32) * 0.37)
        weights = weights.reshape(expected.shape).to(expected.dtype)
        try:
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                (wrapper(*args) * weights).sum().backward()
            # Frozen parameters (sinusoidal position tables) have no torch gradient;
            # jax.grad differentiates every state entry it is given.
            want = {
                n: (p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in wrapper.named_parameters()
                if p.requires_grad
            }
        except Exception as e:  # noqa: BLE001
            stages["jax_grad"] = {"ok": False, "upstream": True, "error": _short(e)}
            want = None
        if want is not None:
            try:
                params, buffers = fn.split_state(state)
                w = weights.numpy()

                def loss(p: Any) -> Any:
                    return (fn({**p, **buffers}, *arrays) * w).sum()

                grads = timed("jax_grad", lambda: jax.jit(jax.grad(loss))(params))
                worst, where = None, None
                for n, torch_grad in want.items():
                    if n not in grads:
                        continue  # counted below
                    scale = max(1.0, float(torch_grad.abs().max())) if torch_grad.numel() else 1.0
                    d = _compare(grads[n], torch_grad, 1e-3, 1e-4 * scale)
                    if d is not None and worst is None:
                        worst, where = d, n
                missing = sorted(set(want) - set(grads))
                if missing:
                    worst, where = f"no gradient for {len(missing)} parameter(s)", missing[0]
                stages["jax_grad"] = {"ok": worst is None}
                if worst:
                    stages["jax_grad"]["error"] = f"{where}: {worst}"
            except Exception as e:  # noqa: BLE001
                stages["jax_grad"] = {"ok": False, "error": _short(e)}
            if not stages["jax_grad"]["ok"]:
                # Upstream too? aot_eager's backward, against the same gradients.
                upstream = timed(
                    "aot_eager_grad", lambda: _aot_eager_grads(wrapper, args, weights, want)
                )
                if upstream is not None:
                    stages["jax_grad"] |= {"upstream": True, "aot_eager_grad": upstream}
    elif fn is not None:
        stages["jax_grad"] = {"ok": True, "note": "integer output: no gradient"}

    result["status"] = classify(stages) if aot_eager else "not classified"
    return result


class _NotRun(Exception):
    pass


def _aot_eager_grads(
    wrapper: Any, args: list[Any], weights: Any, want: dict[str, Any]
) -> str | None:
    """None where aot_eager's backward gives ``want``, else how it fails."""
    import torch

    torch._dynamo.reset()
    try:
        wrapper.zero_grad(set_to_none=True)
        with torch.enable_grad():
            (torch.compile(wrapper, backend="aot_eager")(*args) * weights).sum().backward()
        for n, p in wrapper.named_parameters():
            if n not in want:
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            scale = max(1.0, float(want[n].abs().max())) if want[n].numel() else 1.0
            d = _compare(g, want[n], 1e-3, 1e-4 * scale)
            if d is not None:
                return f"aot_eager's gradient differs: {n}: {d}"
    except Exception as e:  # noqa: BLE001
        return _short(e)
    finally:
        torch._dynamo.reset()
    return None


def classify(stages: dict[str, Any]) -> str:
    if not stages.get("build", {}).get("ok"):
        return "upstream" if stages.get("build", {}).get("upstream") else "unbuilt"
    if not stages.get("eager", {}).get("ok") or not stages.get("aot_eager", {}).get("ok"):
        return "upstream"
    upstream = False
    for s in OURS:
        st = stages.get(s)
        if st is None or not st.get("ok"):
            if st and st.get("upstream"):
                upstream = True
                continue
            return "failing"
    return "upstream" if upstream else "ok"


def _worker(conn: Any) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.CRITICAL)
    import transformers

    transformers.logging.set_verbosity_error()
    while True:
        try:
            case = conn.recv()
        except EOFError:
            return
        if case is None:
            return
        try:
            family, model_type, cls_name = case
            res = run_case(family, model_type, cls_name, stage_cb=lambda s: conn.send(("stage", s)))
        except BaseException as e:  # noqa: BLE001 - report, then let the parent decide
            res = {"status": "failing", "error": _short(e), "trace": traceback.format_exc()}
        conn.send(("done", res))


class Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.done = 0

    def run(self, case: tuple[str, str, str], timeout: float) -> dict[str, Any]:
        family, model_type, cls_name = case
        self.conn.send(case)
        stage, start = "start", time.monotonic()
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                self.kill()
                return _dead(case, stage, f"timeout after {timeout:.0f} s in {stage}")
            try:
                if not self.conn.poll(min(left, 5.0)):
                    if not self.proc.is_alive():
                        raise EOFError
                    continue
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                code = self.proc.exitcode
                self.kill()
                return _dead(case, stage, f"worker crashed in {stage} (exit code {code})")
            if kind == "stage":
                stage = value
            else:
                self.done += 1
                return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        self.kill()


def _dead(case: tuple[str, str, str], stage: str, message: str) -> dict[str, Any]:
    family, model_type, cls_name = case
    key = stage if stage in ("eager", "aot_eager", "dynajax") else None
    if stage in ("jax_export", "jax_forward"):
        key = "jax_forward"
    elif stage in ("jax_grad", "aot_eager_grad"):
        key = "jax_grad"
    stages: dict[str, Any] = {}
    if key is None:
        stages["build"] = {"ok": False, "error": message}
    else:
        order = ("build", "eager", "aot_eager", "dynajax", "jax_forward", "jax_grad")
        for s in order[: order.index(key)]:
            stages[s] = {"ok": None, "note": "not recorded (the worker died later)"}
        stages[key] = {"ok": False, "error": message}
    res = {"family": family, "model_type": model_type, "class": cls_name, "stages": stages}
    # The stages before the one that died passed (the worker reports a stage as it starts).
    for st in stages.values():
        if st.get("ok") is None:
            st["ok"] = True
    res["status"] = classify(stages)
    return res


# -- the table, the JSON, the plot ---------------------------------------------------------


def fallback_ops(res: dict[str, Any]) -> list[str]:
    st = res.get("stages", {})
    ops = list(st.get("dynajax", {}).get("fallbacks", []))
    ops += [f"{c} (callback)" for c in st.get("jax_forward", {}).get("callbacks", [])]
    return ops


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    by_family: dict[str, Counter[str]] = {}
    for r in results:
        by_family.setdefault(r["family"], Counter())[r["status"]] += 1
    lines.append(f"{'family':<22}" + "".join(f"{s:>10}" for s in STATUSES) + f"{'total':>8}")
    total: Counter[str] = Counter()
    for fam, c in by_family.items():
        total.update(c)
        lines.append(
            f"{fam:<22}" + "".join(f"{c[s]:>10}" for s in STATUSES) + f"{sum(c.values()):>8}"
        )
    lines.append(
        f"{'all':<22}" + "".join(f"{total[s]:>10}" for s in STATUSES) + f"{sum(total.values()):>8}"
    )
    for status in ("failing", "upstream", "unbuilt"):
        rows = [r for r in results if r["status"] == status]
        if not rows:
            continue
        lines.append("")
        lines.append(f"{status}:")
        for r in rows:
            stage, err = first_failure(r)
            lines.append(f"  {r['family']:<20} {r['model_type']:<26} {stage:<11} {err[:160]}")
    with_fallbacks = [r for r in results if fallback_ops(r)]
    if with_fallbacks:
        lines.append("")
        lines.append("fallback ops (backend: in PyTorch; jax_function: host callbacks):")
        for r in with_fallbacks:
            lines.append(f"  {r['model_type']:<26} {', '.join(fallback_ops(r))}")
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Any]:
    """A run's JSON, or an interrupted run's ``.partial.jsonl`` (one result a line)."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {"meta": {"partial": str(path), "rows": len(rows)}, "results": rows}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--families", help=f"comma-separated, of {list(FAMILIES)}")
    p.add_argument("--only", help="comma-separated model types (exact)")
    p.add_argument("--match", help="comma-separated substrings of model types")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    p.add_argument("--recycle", type=int, default=15, help="models per worker process")
    p.add_argument("--json", type=Path, default=None, help="default: docs/sweep.json (full runs)")
    p.add_argument("--png", type=Path, default=None, help="default: docs/sweep.png (full runs)")
    p.add_argument(
        "--update",
        type=Path,
        default=None,
        help="merge these results into an earlier run's JSON (its rows for the same model "
        "types and families are replaced) and redraw the table and plot from it",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="with --update: take the results of these earlier runs' JSONs instead of "
        "running anything",
    )
    args = p.parse_args(argv)
    if args.merge and not args.update:
        p.error("--merge needs --update (the JSON to merge into)")

    import transformers

    cases = architectures(args.families.split(",") if args.families else None)
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c[1] in wanted]
    if args.match:
        subs = args.match.split(",")
        cases = [c for c in cases if any(s in c[1] for s in subs)]
    full = not (args.families or args.only or args.match)
    out_json = args.json or (DOCS / "sweep.json" if full else None)
    out_png = args.png or (DOCS / "sweep.png" if full else None)

    # Each result as it comes, one JSON line (an interrupted run's, for --merge).
    jsonl = out_json.with_suffix(".partial.jsonl") if out_json else None
    if jsonl is not None and jsonl.exists():
        jsonl.unlink()
    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    results: list[dict[str, Any] | None] = [None] * len(cases)
    pending = list(enumerate(cases))
    import threading

    lock = threading.Lock()

    def loop() -> None:
        worker: Worker | None = None
        while True:
            with lock:
                if not pending:
                    break
                i, case = pending.pop(0)
            if worker is None or not worker.proc.is_alive() or worker.done >= args.recycle:
                if worker is not None:
                    worker.close()
                worker = Worker(ctx)
            t = time.monotonic()
            res = worker.run(case, args.timeout)
            res["wall_s"] = round(time.monotonic() - t, 1)
            results[i] = res
            if jsonl is not None:
                with lock, jsonl.open("a") as f:
                    f.write(json.dumps(res) + "\n")
            stage, err = first_failure(res)
            print(
                f"[{sum(r is not None for r in results):>3}/{len(cases)}] {case[0]:<20} "
                f"{case[1]:<26} {res['status']:<9} {res['wall_s']:>6.1f}s  {stage} {err[:100]}",
                flush=True,
            )
        if worker is not None:
            worker.close()

    if args.merge:
        pending.clear()
        merged = [_load(m) for m in args.merge]
        results = [r for m in merged for r in m["results"]]
    threads = [threading.Thread(target=loop) for _ in range(max(1, args.workers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done = [r for r in results if r is not None]
    elapsed = time.monotonic() - t0
    earlier: dict[str, Any] = {}
    if args.update:
        earlier = json.loads(args.update.read_text())
        new = {(r["family"], r["model_type"]): r for r in done}
        done = [new.pop((r["family"], r["model_type"]), r) for r in earlier["results"]]
        done += list(new.values())
        out_json, out_png = out_json or args.update, out_png or args.update.with_suffix(".png")
    print()
    print(table(done))
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"\n{len(done)} architectures in {elapsed / 60:.1f} min ({now:%Y-%m-%d})")
    import jax
    import torch

    meta = {
        "date": now.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.sweep "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "runtime_s": round(elapsed, 1),
        **({"updated_from": earlier["meta"]} if earlier else {}),
        **({"merged_from": [m["meta"] for m in merged]} if args.merge else {}),
        "workers": args.workers,
        "timeout_s": args.timeout,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "counts": dict(Counter(r["status"] for r in done)),
        "counts_by_family": {
            f: dict(Counter(r["status"] for r in done if r["family"] == f))
            for f in dict.fromkeys(r["family"] for r in done)
        },
    }
    if out_json:
        out_json.write_text(json.dumps({"meta": meta, "results": done}, indent=1) + "\n")
        print(f"wrote {out_json}")
    if out_png:
        from benchmarks import figures

        data = {"meta": meta, "results": done}
        figures.draw_sweep(data, figures.sweep_table(data), out_png)
        print(f"wrote {out_png} (python -m benchmarks.figures writes the tables from the JSON)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

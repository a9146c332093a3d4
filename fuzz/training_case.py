"""Random training runs for ``python -m fuzz --through train_step``, as data.

A case is one whole training run: a small model, a ``torch.optim`` optimizer (or a
user-written one) with random hyperparameters (edge values included) and param groups,
and 3-8 steps with events between them, each a change docs/training.md says a step
takes up: schedulers and learning-rate edits (``lr``), other hyperparameters
(``hyper``), validation passes (``validate``), train/eval flips (``mode``), a new
``train_step`` with other ``clip_grad_norm=``/``accumulate=`` and the old one back
(``restep``, ``back``), writes into the synced module (``edit``), state dicts saved and
loaded back (``save``, ``rewind``), a checkpoint saved and restored (``checkpoint``),
the loss's captured class weights changed (``reweight``), the optimizer's state edited
after a sync (``STATE_EDITS``); and, optional
(``OPTIONAL_KINDS``), freezing and unfreezing and a param group added (``freeze``),
dict batches (``dict_batch``), bad batches (``bad_batch``). Options: clipping,
accumulation, bfloat16 autocast, a smaller last batch, several param groups, the
batch's inputs in another layout (``layout``: transposed, sliced, from a storage
offset, ..., ``fuzz.program.LAYOUTS`` that keep every value) and a CNN's model and
batches channels_last (``channels_last``). A program model's parameters, buffers and
batch inputs come in the layouts its program's inputs have (a parameter never in one
whose elements share memory, which no optimizer can write).

Case ``i`` of seed ``s`` is ``generate_case(s, i)``: deterministic, and JSON
(``Case.to_json``, ``fuzz.training_spec``), so a reproducer replays it without the
generator.
``fuzz.training_source`` renders it as Python.

What keeps the comparison with eager meaningful (each an eager fact, not a dynajax
allowance):

- no parameter whose gradient is rounding noise only (a bias before BatchNorm, the
  attention's key bias, which softmax ignores): Adam-like updates turn noise into steps
  of ``lr`` with arbitrary signs, in eager as under any other kernels;
- dropout with ``p > 0`` only where the training steps run in eval mode: train_step
  draws its masks from JAX's generator, seeded by torch's (docs/training.md: dropout
  seeded by ``torch.manual_seed``), not eager's masks;
- ``fuzz.generate``'s programs as models only where every floating value is float32,
  no op is discontinuous (a comparison or a rounding flips on an ulp of difference
  after a step) and eager computes finite losses and gradients on every batch.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings
from collections.abc import Callable
from typing import Any

from fuzz import ops
from fuzz.generate import generate
from fuzz.program import (
    CHANNELS_LAST,
    CONTIGUOUS,
    INPUT,
    NORMAL,
    OFFSET,
    PERMUTED,
    SHARED_MEMORY,
    SLICED,
    STEPPED,
    TRANSPOSED,
)
from fuzz.training_spec import (
    BUILTIN_OPTIMIZERS,
    OPTIONAL_KINDS,
    Case,
)


def case_seed(seed: int, index: int) -> int:
    """The seed of case ``index`` of a run with ``seed`` (stable across runs)."""
    return random.Random(f"dynajax-fuzz-train-{seed}-{index}").getrandbits(48)


def _weighted(rng: random.Random, weights: dict[Any, float]) -> Any:
    return rng.choices(list(weights), list(weights.values()))[0]


# ---------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------

_PARAM_LAYERS = {"linear", "layernorm", "conv", "bn", "mha", "encoder", "embedding", "gru"}
_ACTIVATIONS = ("tanh", "gelu", "gelu_tanh", "relu", "silu", "sigmoid")


def _dropout(rng: random.Random) -> float:
    return rng.choice([0.0, 0.0, 0.25])


def _mlp(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    d_in = rng.choice([4, 8, 12])
    layers: list[dict[str, Any]] = []
    width = d_in
    for _ in range(rng.randint(1, 3)):
        out = rng.choice([8, 16, 24])
        layers.append({"kind": "linear", "in": width, "out": out, "bias": rng.random() < 0.85})
        width = out
        layers.append({"kind": rng.choice(_ACTIVATIONS)})
        if rng.random() < 0.3:
            layers.append({"kind": "layernorm", "dim": width, "affine": rng.random() < 0.8})
        if rng.random() < 0.2:
            layers.append({"kind": "dropout", "p": _dropout(rng)})
    return {"kind": "float", "shape": [d_in]}, layers, width


def _cnn(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    c_in, size = rng.choice([1, 3]), rng.choice([6, 8])
    layers: list[dict[str, Any]] = []
    channels = c_in
    for i in range(rng.randint(1, 2)):
        out = rng.choice([4, 6, 8])
        norm = rng.random() < 0.8  # a conv's bias before BatchNorm has a noise gradient
        stride = rng.choice([1, 2]) if i else 1
        layers.append(
            {"kind": "conv", "in": channels, "out": out, "stride": stride, "bias": not norm}
        )
        if norm:
            # None: the cumulative average, float(num_batches_tracked): a branch on a
            # tensor's value, which train_step refuses (documented); now and then
            momentum = rng.choice([0.1, 0.5]) if i or rng.random() < 0.9 else None
            layers.append(
                {"kind": "bn", "dim": out, "momentum": momentum, "affine": rng.random() < 0.8}
            )
        layers.append({"kind": "relu"})
        channels = out
        if i == 0 and rng.random() < 0.3:
            layers.append({"kind": rng.choice(["maxpool", "avgpool"])})
    layers.append({"kind": "gap"})
    return {"kind": "float", "shape": [c_in, size, size]}, layers, channels


def _attention(rng: random.Random, e: int) -> dict[str, Any]:
    heads = rng.choice([h for h in (1, 2, 4) if e % h == 0])
    if rng.random() < 0.5:
        return {"kind": "mha", "dim": e, "heads": heads}
    return {
        "kind": "encoder",
        "dim": e,
        "heads": heads,
        "ff": rng.choice([16, 24]),
        "dropout": _dropout(rng),
        "activation": rng.choice(["relu", "gelu"]),
        "norm_first": rng.random() < 0.5,
    }


def _seq(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    s, e0, e = rng.choice([3, 5]), rng.choice([4, 6]), rng.choice([8, 12])
    layers = [{"kind": "linear", "in": e0, "out": e, "bias": rng.random() < 0.5}]
    layers += [_attention(rng, e) for _ in range(1 if rng.random() < 0.8 else 2)]
    if rng.random() < 0.4:
        layers.append({"kind": "layernorm", "dim": e, "affine": True})
    layers.append({"kind": "meanpool"})
    return {"kind": "float", "shape": [s, e0]}, layers, e


def _embed(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    vocab, e, s = rng.choice([10, 16, 20]), rng.choice([8, 12]), rng.choice([4, 6])
    pad = rng.choice([None, 0, vocab - 1])
    max_norm = 1.0 if rng.random() < 0.1 else None
    layers: list[dict[str, Any]] = [
        {"kind": "embedding", "vocab": vocab, "dim": e, "padding_idx": pad, "max_norm": max_norm}
    ]
    if rng.random() < 0.5:
        layers.append(_attention(rng, e))
    layers.append({"kind": "meanpool"})
    if rng.random() < 0.5:
        layers.append({"kind": "layernorm", "dim": e, "affine": True})
    return {"kind": "tokens", "vocab": vocab, "seq": s, "pad": pad}, layers, e


def _gru(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    t, d, h = rng.choice([3, 4]), rng.choice([4, 6]), rng.choice([8, 12])
    layers: list[dict[str, Any]] = [{"kind": "gru", "in": d, "out": h, "bias": rng.random() < 0.8}]
    if rng.random() < 0.3:
        layers.append({"kind": "dropout", "p": _dropout(rng)})
    if rng.random() < 0.4:
        layers.append({"kind": rng.choice(_ACTIVATIONS)})
    return {"kind": "float", "shape": [t, d]}, layers, h


_FAMILIES: dict[str, Callable[[random.Random], tuple[dict[str, Any], list[Any], int]]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "seq": _seq,
    "embed": _embed,
    "gru": _gru,
}
_FAMILY_WEIGHTS = {
    "mlp": 0.25,
    "cnn": 0.14,
    "seq": 0.14,
    "embed": 0.14,
    "gru": 0.1,
    "program": 0.23,
}


def _head(rng: random.Random, width: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last linear layer and the loss on it."""
    loss = _weighted(rng, {"ce": 0.45, "mse": 0.25, "smooth_l1": 0.1, "bce": 0.1, "l1": 0.1})
    out = rng.choice([3, 5, 7]) if loss == "ce" else rng.choice([1, 2, 4])
    spec: dict[str, Any] = {"kind": loss, "out": out}
    if loss == "ce" and rng.random() < 0.3:
        spec["label_smoothing"] = 0.1
    if loss == "ce" and rng.random() < 0.2:  # class weights: a tensor loss_fn captures
        spec["weights"] = [rng.choice([0.5, 1.0, 2.0]) for _ in range(out)]
    return {"kind": "linear", "in": width, "out": out, "bias": True}, spec


def _dropout_p(model: dict[str, Any]) -> bool:
    """Whether some layer drops with ``p > 0`` (then the steps run in eval mode)."""
    return any(
        layer.get("p", layer.get("dropout", 0.0)) > 0
        for layer in model.get("layers", [])
        if layer["kind"] in ("dropout", "encoder")
    )


def param_attrs(model: dict[str, Any]) -> list[str]:
    """The attributes of the model that hold parameters (``l3``: a layer, ``p0``: a
    parameter of a program model), in order: what param groups and freezing name."""
    if model["family"] == "program":
        return [f"p{i}" for i in model["params"]]
    return [
        f"l{i}"
        for i, layer in enumerate(model["layers"])
        if layer["kind"] in _PARAM_LAYERS
        and not (layer["kind"] in ("layernorm", "bn") and not layer["affine"])
    ]


# Programs as models --------------------------------------------------------------

_FLOAT32_ONLY = {"float32", "int64", "int32", "bool"}


def _program_model(rng: random.Random, steps: int) -> dict[str, Any] | None:
    """A program of ``fuzz.generate`` as a model, its float32 inputs of normal values
    (some of them) its parameters, now and then others its buffers, and the rest its
    batch, each in its input's layout (a parameter's made contiguous where elements
    share memory), or None if no program of 40 tried qualifies (module docstring)."""
    for _ in range(40):
        program = generate(rng.getrandbits(48), max_ops=6)
        names = {spec.dtype for spec in program.inputs}
        names |= {v for r in program.ops for k, v in r.params if k == "dtype"}
        if not names <= _FLOAT32_ONLY or len(program.ops) < 2:
            continue
        if any(ops.KINDS[r.kind].disc or ops.KINDS[r.kind].large for r in program.ops):
            continue
        inputs = [
            dataclasses.replace(s, specials=False, requires_grad=False, bad=False, role=INPUT)
            for s in program.inputs
        ]
        floats = [i for i, s in enumerate(inputs) if s.dtype == "float32" and s.kind == NORMAL]
        if not floats:
            continue
        # Not all of them, mostly: the batch's values then reach the loss too.
        most = len(floats) - 1 if len(floats) > 1 and rng.random() < 0.8 else len(floats)
        params = sorted(rng.sample(floats, rng.randint(1, most)))
        for i in params:
            if inputs[i].layout in SHARED_MEMORY:
                inputs[i] = dataclasses.replace(inputs[i], layout=CONTIGUOUS)
        rest = [i for i in range(len(inputs)) if i not in params]
        buffers = sorted(i for i in rest if rng.random() < 0.25)[: max(len(rest) - 1, 0)]
        program = program.replace(inputs=tuple(inputs), grad=False)
        spec = {
            "family": "program",
            "program": json.loads(program.to_json()),
            "params": params,
            "buffers": buffers,
            "loss_outputs": [],
        }
        trains = _program_trains(spec, steps)
        if trains:
            spec["loss_outputs"] = trains
            return spec
    return None


def _has_batch(model: dict[str, Any]) -> bool:
    """Whether a program model takes a batch (not every input a parameter or buffer)."""
    state = len(model["params"]) + len(model.get("buffers", []))
    return state < len(model["program"]["inputs"])


def _program_trains(spec: dict[str, Any], steps: int) -> list[int]:
    """The outputs of a program model that carry gradient to its parameters, if eager
    computes a finite loss and gradient from them on every batch of the run, in float32
    and in float64 alike (else []): the float64 mode's case is the float32 one in
    float64, and a program whose floating values do not all follow its inputs to float64
    (an integer's reciprocal is float32 by the default dtype) cannot be one."""
    from fuzz.training_source import namespace_of

    options = {"dict_batch": False, "autocast": False}
    spec = {**spec, "loss_outputs": [0]}
    try:
        with warnings.catch_warnings():  # eager warns about some of what it is given
            warnings.simplefilter("ignore")
            in_float32 = Case(0, 0, 0, spec, {}, options, steps, [])
            outputs = _trains(namespace_of(in_float32, training=False), steps)
            in_float64 = Case(0, 0, 0, spec, {}, {**options, "float64": True}, steps, [])
            if outputs and _trains(namespace_of(in_float64, training=False), steps, 64) != outputs:
                return []
            return outputs
    except Exception:
        return []


def _trains(namespace: dict[str, Any], steps: int, bits: int = 32) -> list[int]:
    import math

    import torch

    dtype = torch.float64 if bits == 64 else torch.float32
    model = namespace["make_model"]()
    outputs: list[int] = []
    for i in range(steps + 1):
        batch = [b.to(dtype) if b.is_floating_point() else b for b in namespace["batch"](i)]
        outs = model(*batch)
        if i == 0:
            outputs = [
                j
                for j, o in enumerate(outs)
                if isinstance(o, torch.Tensor) and o.dtype == dtype and o.requires_grad
            ]
            if not outputs:
                return []
        loss = sum(namespace["weighted"](outs[j]) for j in outputs)
        if not math.isfinite(float(loss.detach())):
            return []
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        if not any(g is not None and bool(g.abs().sum() > 0) for g in grads):
            return []
        if not all(g is None or bool(g.isfinite().all()) for g in grads):
            return []
    return outputs


# ---------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------

_LRS = {
    "SGD": [0.0, 1e-3, 0.01, 0.05, 0.1],
    "ASGD": [0.0, 1e-3, 0.01, 0.05],
    "Adadelta": [0.0, 0.1, 1.0],
    "Adagrad": [0.0, 1e-3, 0.01, 0.1],
    "RMSprop": [0.0, 1e-4, 1e-3, 1e-2],
    "Rprop": [0.0, 1e-3, 0.01, 0.05],
    "MomentumSGD": [0.0, 1e-3, 0.01, 0.05],
    "SignMomentum": [0.0, 1e-4, 1e-3, 1e-2],
}
_ADAM_LRS = [0.0, 1e-4, 1e-3, 1e-2, 3e-2]


def _lr(rng: random.Random, name: str) -> float:
    choices = _LRS.get(name, _ADAM_LRS)
    return 0.0 if rng.random() < 0.08 else rng.choice(choices[1:])


def _betas(rng: random.Random) -> list[float]:
    """Adam's betas, 0 among them; beta2 0 only with beta1 0: with ``beta1 > 0`` the
    step is ``m / |g|``, unbounded where the gradient nears 0 (eager's steps explode)."""
    beta1 = rng.choice([0.9, 0.9, 0.5, 0.0])
    return [beta1, rng.choice([0.999, 0.999, 0.9] + ([0.0] if beta1 == 0 else []))]


def _optimizer_options(rng: random.Random, name: str) -> dict[str, Any]:
    """Random hyperparameters of ``name``, edge values included (only those drawn; the
    others keep torch's defaults)."""
    o: dict[str, Any] = {"lr": _lr(rng, name)}
    wd = rng.choice([0.0, 0.0, 1e-4, 0.01, 0.1])
    flag = lambda p: rng.random() < p  # noqa: E731
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SignMomentum"):
        o["betas"] = _betas(rng)
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "Adagrad"):
        o["eps"] = rng.choice([None, None, 1e-12, 1e-3])
    if name == "SGD":
        o["momentum"] = rng.choice([0.0, 0.5, 0.9])
        o["nesterov"] = o["momentum"] > 0 and flag(0.4)
        o["dampening"] = 0.0 if o["nesterov"] else rng.choice([0.0, 0.0, 0.1, 0.5])
    if name in ("Adam", "AdamW"):
        o["amsgrad"] = flag(0.35)
    if name in ("Adam", "NAdam", "RAdam"):
        o["decoupled_weight_decay"] = flag(0.3)
    if name == "NAdam":
        o["momentum_decay"] = rng.choice([0.004, 0.0, 0.04])
    if name == "ASGD":
        o.update(lambd=rng.choice([1e-4, 0.01]), alpha=rng.choice([0.75, 0.5]))
        o["t0"] = rng.choice([1e6, 2.0])  # 2: the averaging starts inside the run
    if name == "Adadelta":
        o["rho"] = rng.choice([0.9, 0.5, 0.0])
    if name == "Adagrad":
        o["lr_decay"] = rng.choice([0.0, 0.01])
        o["initial_accumulator_value"] = rng.choice([0.0, 0.1])
    if name == "RMSprop":
        o["alpha"] = rng.choice([0.99, 0.5, 0.0])
        o["momentum"] = rng.choice([0.0, 0.5])
        # centered with alpha 0 divides by sqrt(g^2 - g^2): rounding noise, in eager too
        o["centered"] = o["alpha"] > 0 and flag(0.4)
    if name == "Rprop":
        o["etas"] = rng.choice([[0.5, 1.2], [0.3, 1.5]])
        o["step_sizes"] = rng.choice([[1e-6, 50.0], [1e-3, 0.01]])
    if name == "MomentumSGD":
        o.update(momentum=rng.choice([0.0, 0.9]), nesterov=flag(0.3))
    if name != "Rprop":
        o["weight_decay"] = wd
    if name in BUILTIN_OPTIMIZERS:
        o["maximize"] = flag(0.15)
        o["foreach"] = rng.choice([None, None, True, False])
        if name in ("SGD", "Adam", "AdamW", "Adagrad") and flag(0.25):
            o["fused"] = True
            o["foreach"] = None  # fused and foreach exclude each other
    return {k: v for k, v in o.items() if v is not None and v is not False}


def _group_options(rng: random.Random, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """What a param group overrides: its learning rate, weight decay, betas."""
    o: dict[str, Any] = {}
    if rng.random() < 0.7:
        o["lr"] = _lr(rng, name)
    if name != "Rprop" and rng.random() < 0.3:
        o["weight_decay"] = rng.choice([0.0, 0.05])
    if "betas" in defaults and rng.random() < 0.3:
        o["betas"] = _betas(rng)
    return o


def _hyper(rng: random.Random, optimizer: dict[str, Any]) -> dict[str, Any] | None:
    """A hyperparameter other than ``lr`` set between steps (a new program), or None."""
    name = optimizer["name"]
    if name == "Rprop":
        return {"key": "etas", "value": [0.4, 1.3]}
    if name == "SGD" and optimizer["options"].get("nesterov"):
        return {"key": "momentum", "value": rng.choice([0.5, 0.8])}
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam") and rng.random() < 0.5:
        return {"key": "betas", "value": [rng.choice([0.8, 0.0]), 0.99]}
    return {"key": "weight_decay", "value": rng.choice([0.0, 0.01, 0.05])}


def _optimizer(rng: random.Random, attrs: list[str]) -> dict[str, Any]:
    weights = {n: 1.0 for n in BUILTIN_OPTIMIZERS}
    weights.update(Adam=1.3, AdamW=1.1, SGD=1.2, MomentumSGD=0.45, SignMomentum=0.35)
    name = _weighted(rng, weights)
    options = _optimizer_options(rng, name)
    held_out = None
    trainable = list(attrs)
    if len(attrs) >= 3 and rng.random() < 0.2:
        held_out = rng.choice(attrs[:-1])  # frozen and outside the optimizer at first
        trainable.remove(held_out)
    n_groups = min(len(trainable), _weighted(rng, {1: 0.55, 2: 0.3, 3: 0.15}))
    cuts = sorted(rng.sample(range(1, len(trainable)), n_groups - 1)) if n_groups > 1 else []
    bounds = [0, *cuts, len(trainable)]
    groups = [
        {"attrs": trainable[a:b], "options": _group_options(rng, name, options) if g else {}}
        for g, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
    ]
    return {"name": name, "options": options, "groups": groups, "held_out": held_out}


# ---------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------


def _scheduler(rng: random.Random, steps: int, groups: int) -> dict[str, Any] | None:
    kind = _weighted(
        rng,
        {
            None: 0.55,
            "warmup_cosine": 0.15,
            "onecycle": 0.1,
            "cyclic": 0.08,
            "step": 0.06,
            "exponential": 0.06,
        },
    )
    if kind is None:
        return None
    if kind == "warmup_cosine":
        return {"kind": kind, "warmup": rng.randint(0, max(1, steps // 2)), "total": steps}
    if kind == "onecycle":
        return {
            "kind": kind,
            "max_lr": [rng.choice([1e-3, 1e-2, 5e-2]) for _ in range(groups)],
            "total": steps,
            "pct_start": rng.choice([0.3, 0.5]),
            "anneal": rng.choice(["cos", "linear"]),
            "three_phase": rng.random() < 0.3,
        }
    if kind == "cyclic":
        return {
            "kind": kind,
            "base_lr": [rng.choice([0.0, 1e-4]) for _ in range(groups)],
            "max_lr": [rng.choice([1e-3, 1e-2]) for _ in range(groups)],
            "up": rng.choice([1, 2]),
            "mode": rng.choice(["triangular", "triangular2", "exp_range"]),
        }
    if kind == "step":
        return {"kind": kind, "size": rng.choice([1, 2]), "gamma": rng.choice([0.5, 0.1])}
    return {"kind": kind, "gamma": rng.choice([0.9, 0.5])}


def generate_case(
    seed: int, index: int, *, optional: tuple[str, ...] = OPTIONAL_KINDS, float64: bool = False
) -> Case:
    """Case ``index`` of ``seed``: the same case for the same arguments and torch.

    ``optional``: the kinds of ``OPTIONAL_KINDS`` to keep; the others are drawn and then
    dropped, so a case differs only by them. ``float64``: the model, its batches and
    both loops in float64 (compared at 1e-10 relative; no autocast)."""
    rng = random.Random(case_seed(seed, index))
    steps = rng.randint(3, 8)
    family = _weighted(rng, _FAMILY_WEIGHTS)
    model: dict[str, Any] | None = None
    if family == "program":
        model = _program_model(random.Random(rng.getrandbits(48)), steps)
        family = "mlp" if model is None else family
    if model is None:
        data, layers, width = _FAMILIES[family](rng)
        head, loss = _head(rng, width)
        model = {"family": family, "input": data, "layers": [*layers, head], "loss": loss}
    attrs = param_attrs(model)
    optimizer = _optimizer(rng, attrs)
    program = family == "program"
    classify = not program and model["loss"]["kind"] == "ce"
    batch = rng.choice([4, 8])
    options: dict[str, Any] = {
        "batch": batch,
        "clip": rng.choice([0.01, 0.5, 1.0, 100.0]) if rng.random() < 0.3 else None,
        "accumulate": 1,
        "scheduler": _scheduler(rng, steps, len(optimizer["groups"])),
        "autocast": rng.random() < 0.08 and not program,
        "dict_batch": rng.random() < 0.2 and not (program and not _has_batch(model)),
        "train_mode": not _dropout_p(model),
        "last_batch": None,
    }
    accumulations = [1, 1, 1, 2, 2] + ([4] if batch == 8 else [])  # each one compiles more
    if not program and rng.random() < 0.25:
        options["accumulate"] = rng.choice(accumulations[3:])
    events: list[dict[str, Any]] = []
    training, frozen = options["train_mode"], set()
    in_optimizer = [a for g in optimizer["groups"] for a in g["attrs"]]
    held_out = optimizer["held_out"]
    add_at = rng.randint(1, steps - 1) if held_out and options["scheduler"] is None else None
    used_accumulations = {options["accumulate"]}
    # Events that compile another program (a second each, or so): two at most, so a
    # case takes seconds, not tens of them.
    programs = 2
    # The state saved (model and optimizer state dicts) and loaded back later: a rewind.
    save_at = rewind_at = None
    if steps >= 4 and rng.random() < 0.15:
        save_at = rng.randint(1, steps - 2)
        rewind_at = rng.randint(save_at + 1, steps - 1)
    for k in range(steps + 1):
        last = k == steps
        if 0 < k and not last:
            if rng.random() < 0.12:
                group = rng.randrange(len(optimizer["groups"]))
                events.append({"at": k, "kind": "lr", "group": group, "value": _lr(rng, "-")})
            if options["train_mode"] and rng.random() < 0.1 and programs:
                training, programs = not training, programs - 1
                events.append({"at": k, "kind": "mode", "train": training})
            if rng.random() < 0.1 and len(in_optimizer) > 1:
                attr = rng.choice(in_optimizer[:-1])
                if programs:
                    kind = "unfreeze" if attr in frozen else "freeze"
                    events.append({"at": k, "kind": kind, "attr": attr})
                    frozen, programs = frozen ^ {attr}, programs - 1
            if k == add_at:
                events.append({"at": k, "kind": "add_group", "attr": held_out})
                events[-1]["options"] = _group_options(rng, optimizer["name"], optimizer["options"])
            if rng.random() < 0.06:
                hyper = _hyper(rng, optimizer)
                if programs and hyper is not None:
                    programs -= 1
                    group = rng.randrange(len(optimizer["groups"]))
                    events.append({"at": k, "kind": "hyper", "group": group, **hyper})
            if rng.random() < 0.05:
                attr = rng.choice(attrs)
                events.append({"at": k, "kind": "edit", "attr": attr, "factor": 0.9})
            if k == save_at:
                events.append({"at": k, "kind": "save"})
            if k == rewind_at and not any(e["kind"] == "add_group" for e in events):
                events.append({"at": k, "kind": "rewind"})
            if rng.random() < 0.07:
                accumulate = 1 if program else rng.choice(accumulations)
                clip = rng.choice([None, 0.5, 1.0])
                if programs:
                    used_accumulations.add(accumulate)
                    programs -= 1
                    restep = {"at": k, "kind": "restep", "clip": clip, "accumulate": accumulate}
                    events.append(restep)
            elif any(e["kind"] == "restep" for e in events) and rng.random() < 0.3:
                events.append({"at": k, "kind": "back"})  # the step before it again
            if rng.random() < 0.04:
                events.append({"at": k, "kind": "checkpoint"})
            if model.get("loss", {}).get("weights") and rng.random() < 0.1 and programs:
                programs -= 1
                factor = rng.choice([0.5, 2.0])
                reweight = {"at": k, "kind": "reweight", "factor": factor}
                events.append({**reweight, "inplace": rng.random() < 0.5})
        if k > 0 and rng.random() < (0.35 if last else 0.1):
            size = batch if program else rng.choice([2, 3, batch])
            events.append({"at": k, "kind": "validate", "size": size})
        if not last and (classify or family == "embed") and rng.random() < 0.1:
            what = (
                "index" if family == "embed" and (not classify or rng.random() < 0.5) else "target"
            )
            events.append({"at": k, "kind": "bad_batch", "what": what, "value": rng.randrange(3)})
    if not program and rng.random() < 0.15:
        half = batch // 2
        if all(half % a == 0 for a in used_accumulations):
            options["last_batch"] = half
    if not program:
        options["layout"] = _batch_layout(rng, family)
        options["channels_last"] = family == "cnn" and rng.random() < 0.3
    if float64:  # (after every draw: the case is the float32 one in float64)
        options.update(float64=True, autocast=False)
    events += _state_edits(random.Random(case_seed(seed, index) ^ 0x5EED), steps)
    case = Case(seed, index, rng.getrandbits(31), model, optimizer, options, steps, events)
    return without_kinds(case, [k for k in OPTIONAL_KINDS if k not in optional])


# Edits of the optimizer's state between steps, each after a sync (docs/training.md:
# taken up at the next step): eager steps by hand on the synced module and optimizer
# (``hand_step``), every moment zeroed in place as a warm restart does (``reset_state``),
# every entry replaced by a copy, as state copied from another optimizer is
# (``replace_state``). Drawn from their own generator, so a seed's other events are
# what they were before these existed.
STATE_EDITS = ("hand_step", "reset_state", "replace_state")


def _state_edits(rng: random.Random, steps: int) -> list[dict[str, Any]]:
    events = []
    for k in range(1, steps):
        for kind in STATE_EDITS:
            if rng.random() < 0.05:
                events.append({"at": k, "kind": kind})
    return events


# The layouts of a batch's input, by model family (its dims): those that keep every
# value (``relayout``); contiguous the rest of the time.
_BATCH_LAYOUTS = {
    "mlp": (TRANSPOSED, SLICED, OFFSET, STEPPED),
    "cnn": (CHANNELS_LAST, CHANNELS_LAST, TRANSPOSED, SLICED, OFFSET, PERMUTED, STEPPED),
    "seq": (TRANSPOSED, PERMUTED, SLICED, OFFSET, STEPPED),
    "embed": (TRANSPOSED, SLICED, OFFSET, STEPPED),
    "gru": (TRANSPOSED, PERMUTED, SLICED, OFFSET, STEPPED),
}


def _batch_layout(rng: random.Random, family: str) -> str:
    layouts = _BATCH_LAYOUTS.get(family, ())
    return rng.choice(layouts) if layouts and rng.random() < 0.5 else CONTIGUOUS


def without_kinds(case: Case, kinds: list[str]) -> Case:
    """``case`` without the optional kinds ``kinds`` (``OPTIONAL_KINDS``)."""
    case = case.replace()
    if "freeze" in kinds:
        case.events = [
            e for e in case.events if e["kind"] not in ("freeze", "unfreeze", "add_group")
        ]
        held = case.optimizer["held_out"]
        if held is not None:  # trained as any other, in the first group
            case.optimizer["groups"][0]["attrs"].append(held)
            case.optimizer["held_out"] = None
    if "dict_batch" in kinds:
        case.options["dict_batch"] = False
    if "bad_batch" in kinds:
        case.events = [e for e in case.events if e["kind"] != "bad_batch"]
    return case


def event_kinds(case: Case) -> list[str]:
    """The features of a case, for the summary: its event kinds and options in use."""
    kinds = {e["kind"] for e in case.events}
    o = case.options
    for key in ("clip", "scheduler", "last_batch"):
        if o.get(key) is not None:
            kinds.add(key)
    kinds |= {key for key in ("autocast", "dict_batch", "channels_last") if o.get(key)}
    if o.get("layout", CONTIGUOUS) != CONTIGUOUS:
        kinds.add(f"layout:{o['layout']}")
    if case.model["family"] == "program":
        program = case.model["program"]
        if any(s["layout"] != CONTIGUOUS for s in program["inputs"]):
            kinds.add("layout:program")
        if case.model.get("buffers"):
            kinds.add("buffers")
    if o.get("accumulate", 1) > 1:
        kinds.add("accumulate")
    if case.optimizer.get("held_out"):
        kinds.add("held_out")
    if len(case.optimizer["groups"]) > 1:
        kinds.add("groups")
    return sorted(kinds)

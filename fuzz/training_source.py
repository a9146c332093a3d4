"""A training case (``fuzz.training_spec.Case``) as Python, and the harness that runs it.

``case_source(case)`` renders the case: the model class, ``setup(model)`` (the
optimizer, and what is frozen outside it), ``batch(i)`` and ``bad_batch(...)``,
``loss_fn`` and ``predict`` (the model's outputs, for validation), and ``run(twin)``:
the run as one straight list of calls (steps, scheduler steps, learning-rate edits,
train/eval flips, validation passes, freezing, a new train_step, bad batches). That
text is both what the fuzzer executes and what a reproducer holds, so a reproducer
runs exactly what failed.

``HARNESS_SOURCE`` (``fuzz.training``) defines the twins ``run`` is called on.
"""

from __future__ import annotations

import json
from typing import Any

from fuzz.program import INPUT_SOURCE, Program, input_call
from fuzz.rendering import source
from fuzz.training_spec import CUSTOM_OPTIMIZERS, Case

IMPORTS = """import collections
import copy
import math
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dynajax
"""

_SIMPLE = {
    "tanh": "nn.Tanh()",
    "relu": "nn.ReLU()",
    "silu": "nn.SiLU()",
    "sigmoid": "nn.Sigmoid()",
    "gelu": "nn.GELU()",
    "gelu_tanh": 'nn.GELU(approximate="tanh")',
    "maxpool": "nn.MaxPool2d(2)",
    "avgpool": "nn.AvgPool2d(2)",
    "gap": "nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())",
    "identity": "nn.Identity()",  # a layer the shrinker took out
}


def _layer_init(layer: dict[str, Any]) -> str | None:
    """The module of a layer, as source (None: a layer without a module)."""
    k, a = layer["kind"], layer
    if k in _SIMPLE:
        return _SIMPLE[k]
    if k == "linear":
        return f"nn.Linear({a['in']}, {a['out']}, bias={a['bias']})"
    if k == "layernorm":
        return f"nn.LayerNorm({a['dim']}, elementwise_affine={a['affine']})"
    if k == "dropout":
        return f"nn.Dropout({a['p']})"
    if k == "conv":
        return (
            f"nn.Conv2d({a['in']}, {a['out']}, 3, stride={a['stride']}, padding=1, "
            f"bias={a['bias']})"
        )
    if k == "bn":
        return f"nn.BatchNorm2d({a['dim']}, momentum={a['momentum']}, affine={a['affine']})"
    if k == "mha":
        return f"nn.MultiheadAttention({a['dim']}, {a['heads']}, bias=False, batch_first=True)"
    if k == "encoder":
        return (
            f"nn.TransformerEncoderLayer({a['dim']}, {a['heads']}, {a['ff']}, "
            f"dropout={a['dropout']}, activation={a['activation']!r}, batch_first=True, "
            f"norm_first={a['norm_first']}, bias=False)"
        )
    if k == "embedding":
        return (
            f"nn.Embedding({a['vocab']}, {a['dim']}, padding_idx={a['padding_idx']}, "
            f"max_norm={a['max_norm']})"
        )
    if k == "gru":
        return f"nn.GRUCell({a['in']}, {a['out']}, bias={a['bias']})"
    assert k == "meanpool", k
    return None


def _layer_forward(i: int, layer: dict[str, Any]) -> list[str]:
    k = layer["kind"]
    if k == "mha":
        return [f"h = h + self.l{i}(h, h, h, need_weights=False)[0]"]
    if k == "gru":
        return [
            "s = None",
            "for t in range(h.shape[1]):",
            f"    s = self.l{i}(h[:, t], s)",
            "h = s",
        ]
    if k == "meanpool":
        return ["h = h.mean(1)"]
    return [f"h = self.l{i}(h)"]


def _program(model: dict[str, Any]) -> Program:
    return Program.from_json(json.dumps(model["program"]))


def _batch_inputs(model: dict[str, Any]) -> list[int]:
    """The inputs of a program model that come with each batch (the others: its
    parameters and buffers)."""
    state = set(model["params"]) | set(model.get("buffers", []))
    return [i for i in range(len(model["program"]["inputs"])) if i not in state]


def _state_name(model: dict[str, Any], i: int) -> str:
    """Input ``i`` of a program model, as its forward reads it."""
    if i in model["params"]:
        return f"self.p{i}"
    return f"self.b{i}" if i in model.get("buffers", []) else f"x{i}"


def _model_source(case: Case) -> str:
    model = case.model
    if model["family"] == "program":
        program = _program(model)
        inputs = _batch_inputs(model)
        first = f"self.p{model['params'][0]}"
        args = ", ".join(_state_name(model, i) for i in range(len(program.inputs)))
        init = [
            f"        self.p{i} = nn.Parameter({input_call(program.inputs[i])})"
            for i in model["params"]
        ]
        init += [
            f'        self.register_buffer("b{i}", {input_call(program.inputs[i])})'
            for i in model.get("buffers", [])
        ]
        return "\n".join(
            [
                INPUT_SOURCE.strip(),
                "",
                "",
                source(program).strip(),
                "",
                "",
                source(program, fn_name="program64", upcast=True).strip(),
                "",
                "",
                "class Model(nn.Module):",
                '    """The program as a module: some of its inputs parameters or buffers."""',
                "",
                "    def __init__(self):",
                "        super().__init__()",
                "        call = 0",
                *init,
                "",
                f"    def forward(self{''.join(f', x{i}' for i in inputs)}):",
                f"        fn = program64 if {first}.dtype == torch.float64 else program",
                f"        return fn({args})",
            ]
        )
    lines = ["class Model(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    for i, layer in enumerate(model["layers"]):
        init = _layer_init(layer)
        if init is not None:
            lines.append(f"        self.l{i} = {init}")
    lines += ["", "    def forward(self, h):"]
    for i, layer in enumerate(model["layers"]):
        lines += [f"        {line}" for line in _layer_forward(i, layer)]
    lines.append("        return h")
    return "\n".join(lines)


def _data_source(case: Case) -> str:
    """``batch(i, size)``, ``bad_batch(i, what, value, size)``, ``loss_fn`` and
    ``predict`` (the model's outputs on a batch, for validation)."""
    model, o = case.model, case.options
    if model["family"] == "program":
        program = _program(model)
        inputs = _batch_inputs(model)
        names = [f"x{i}" for i in inputs]
        calls = [f"        {input_call(program.inputs[i])}," for i in inputs]
        if o["dict_batch"]:
            pack = "{" + ", ".join(f'"{n}": {n}' for n in names) + "}"
            params, args = "b", ", ".join(f'b["{n}"]' for n in names)
            body = [
                f"    {', '.join(names)}{',' if len(names) == 1 else ''} = batch",
                f"    return ({pack},)",
            ]
        else:
            params = args = ", ".join(names)
            body = ["    return tuple(batch)"]
        loss = " + ".join(f"weighted(outs[{j}])" for j in model["loss_outputs"])
        return "\n".join(
            [
                "def batch(i, size=None):",
                '    """The inputs of batch ``i`` (a program model\'s batch has one size)."""',
                "    call = i + 1",
                "    batch = [",
                *calls,
                "    ]",
                *body,
                "",
                "",
                "def weighted(o):",
                '    """Every element weighed, by a fixed non-uniform weight."""',
                "    w = torch.linspace(-1, 2, o.numel(), dtype=o.dtype).view(o.shape)",
                "    return (o * w).mean()",
                "",
                "",
                f"def loss_fn(model, {params}):",
                f"    outs = model({args})",
                f"    return {loss}",
                "",
                "",
                f"def predict(model, {params}):",
                f"    return model({args})",
            ]
        )
    data, loss = model["input"], model["loss"]
    if data["kind"] == "tokens":
        x = [f"    x = torch.randint(0, {data['vocab']}, (size, {data['seq']}), generator=g)"]
        if data["pad"] is not None:
            x.append(f"    x[torch.rand(size, {data['seq']}, generator=g) < 0.25] = {data['pad']}")
    else:
        shape = ", ".join(str(d) for d in data["shape"])
        x = [f"    x = torch.randn(size, {shape}, generator=g)"]
    if o.get("layout", "contiguous") != "contiguous":
        x.append(f"    x = relayout(x, {o['layout']!r})")
    if o.get("channels_last"):
        x.append("    x = x.contiguous(memory_format=torch.channels_last)")
    kind, out = loss["kind"], loss["out"]
    if kind == "ce":
        y = f"torch.randint(0, {out}, (size,), generator=g)"
    elif kind == "bce":
        y = f"torch.randint(0, 2, (size, {out}), generator=g).float()"
    else:
        y = f"torch.randn(size, {out}, generator=g)"
    pack = '({"x": x, "y": y},)' if o["dict_batch"] else "(x, y)"
    unpack = (
        'b = batch(i, size)[0]\n    x, y = b["x"], b["y"]'
        if o["dict_batch"]
        else "x, y = batch(i, size)"
    )
    params, take = ("b", '    x, y = b["x"], b["y"]\n') if o["dict_batch"] else ("x, y", "")
    call = {
        "ce": "F.cross_entropy(out, y"
        + (", weight=WEIGHTS" if loss.get("weights") else "")
        + (f", label_smoothing={loss['label_smoothing']})" if "label_smoothing" in loss else ")"),
        "mse": "F.mse_loss(out, y)",
        "smooth_l1": "F.smooth_l1_loss(out, y)",
        "l1": "F.l1_loss(out, y)",
        "bce": "F.binary_cross_entropy_with_logits(out, y)",
    }[kind]
    if o["autocast"]:
        forward = (
            '    with torch.autocast("cpu", dtype=torch.bfloat16):\n'
            "        out = model(x)\n"
            "    if out.dtype == torch.bfloat16:  # the float64 reference stays float64\n"
            "        out = out.float()\n"
        )
    else:
        forward = "    out = model(x)\n"
    vocab = data.get("vocab", 0)
    bad = [
        "",
        "",
        f"def bad_batch(i, what, value, size={o['batch']}):",
        '    """Batch ``i`` with one class target or one token index out of range."""',
        f"    {unpack}",
        '    if what == "target":',
        f"        y[size // 2] = [{out}, {out} + 3, -1][value]",
        "    else:",
        f"        x[size // 2, 0] = [{vocab}, {vocab} + 5, -1][value]",
        f"    return {pack}",
    ]
    return "\n".join(
        [
            f"def batch(i, size={o['batch']}):",
            "    g = torch.Generator().manual_seed(VALUES + 7919 * i)",
            *x,
            f"    y = {y}",
            f"    return {pack}",
            *(bad if any(e["kind"] == "bad_batch" for e in case.events) else []),
            "",
            "",
            f"def loss_fn(model, {params}):",
            f"{take}{forward}    return {call}",
            "",
            "",
            f"def predict(model, {params}):",
            f"{take}    return model(x)",
        ]
    )


CUSTOM_SOURCE = {
    "MomentumSGD": '''class MomentumSGD(torch.optim.Optimizer):
    """A user's momentum SGD in plain tensor ops (its state made at the first step)."""

    def __init__(self, params, lr=0.01, momentum=0.9, weight_decay=0.0, nesterov=False):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"] != 0:
                    grad = grad + group["weight_decay"] * p
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = grad.clone()
                else:
                    state["buf"].mul_(group["momentum"]).add_(grad)
                if group["nesterov"]:
                    update = grad + group["momentum"] * state["buf"]
                else:
                    update = state["buf"]
                p.sub_(group["lr"] * update)''',
    "SignMomentum": '''class SignMomentum(torch.optim.Optimizer):
    """A user's Lion-like optimizer: the sign of an interpolated momentum, decoupled
    weight decay, a step count kept as a tensor."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["exp_avg"] = torch.zeros_like(p)
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"] * beta1 + p.grad * (1 - beta1)
                p.add_(torch.sign(update), alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)''',
}

COSINE_SOURCE = """try:
    from transformers import get_cosine_schedule_with_warmup
except ImportError:  # the same schedule, as transformers defines it

    def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
        def factor(step):
            if step < num_warmup_steps:
                return float(step) / float(max(1, num_warmup_steps))
            progress = float(step - num_warmup_steps) / float(
                max(1, num_training_steps - num_warmup_steps)
            )
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)"""


def _literal(value: Any) -> str:
    """``repr`` with lists as tuples (betas, etas: how users write them)."""
    if isinstance(value, list):
        return "(" + ", ".join(_literal(v) for v in value) + ")"
    return repr(value)


def _params_expr(case: Case, attrs: list[str]) -> str:
    if case.model["family"] == "program":
        return "[" + ", ".join(f"model.{a}" for a in attrs) + "]"
    return "[" + ", ".join(f"*model.{a}.parameters()" for a in attrs) + "]"


def _group_literal(case: Case, attrs: list[str], options: dict[str, Any]) -> str:
    items = [f'"params": {_params_expr(case, attrs)}']
    items += [f'"{k}": {_literal(v)}' for k, v in options.items()]
    return "{" + ", ".join(items) + "}"


def _optimizer_source(case: Case) -> str:
    opt = case.optimizer
    name = opt["name"]
    cls = name if name in CUSTOM_OPTIMIZERS else f"torch.optim.{name}"
    lines = ["def setup(model):", '    """The optimizer (and what is frozen outside it)."""']
    if opt["held_out"] is not None:
        lines.append(f"    model.{opt['held_out']}.requires_grad_(False)  # added to it later")
    lines += [f"    return {cls}(", "        ["]
    for group in opt["groups"]:
        lines.append(f"            {_group_literal(case, group['attrs'], group['options'])},")
    lines.append("        ],")
    lines += [f"        {k}={_literal(v)}," for k, v in opt["options"].items()]
    lines.append("    )")
    return "\n".join(lines)


def _per_group(values: list[Any], n: int) -> list[Any]:
    return (values + [values[-1]] * n)[:n]


def _scheduler_source(case: Case) -> str | None:
    s = case.options["scheduler"]
    if s is None:
        return None
    n = len(case.optimizer["groups"])
    kind = s["kind"]
    sched = "torch.optim.lr_scheduler"
    if kind == "warmup_cosine":
        return (
            f"get_cosine_schedule_with_warmup(optimizer, num_warmup_steps={s['warmup']}, "
            f"num_training_steps={s['total']})"
        )
    if kind == "onecycle":
        return (
            f"{sched}.OneCycleLR(optimizer, max_lr={_per_group(s['max_lr'], n)}, "
            f"total_steps={s['total']}, pct_start={s['pct_start']}, "
            f"anneal_strategy={s['anneal']!r}, three_phase={s['three_phase']}, "
            "cycle_momentum=False)"
        )
    if kind == "cyclic":
        return (
            f"{sched}.CyclicLR(optimizer, base_lr={_per_group(s['base_lr'], n)}, "
            f"max_lr={_per_group(s['max_lr'], n)}, step_size_up={s['up']}, "
            f"mode={s['mode']!r}, gamma=0.9, cycle_momentum=False)"
        )
    if kind == "step":
        return f"{sched}.StepLR(optimizer, step_size={s['size']}, gamma={s['gamma']})"
    return f"{sched}.ExponentialLR(optimizer, gamma={s['gamma']})"


RELAYOUT_SOURCE = '''def relayout(t, layout):
    """``t``\'s values in ``layout`` (one of fuzz.program.LAYOUTS that keep them all)."""
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "permuted":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "sliced":  # every other element of a wider last dim
        base = t.new_zeros((*t.shape[:-1], 2 * t.shape[-1] + 1))
        base[..., 1::2] = t
        return base[..., 1::2]
    if layout == "stepped":  # every other row of a longer dim 0
        base = t.new_zeros((2 * t.shape[0] + 1, *t.shape[1:]))
        base[1::2] = t
        return base[1::2]
    if layout == "offset":  # a view into a larger storage
        base = t.new_zeros(t.numel() + 5)
        base[3 : 3 + t.numel()] = t.reshape(-1)
        return base[3 : 3 + t.numel()].view(t.shape)
    return t'''


def _event_lines(case: Case, e: dict[str, Any]) -> list[str]:
    kind, k = e["kind"], e["at"]
    if kind == "lr":
        group = e["group"] if e["group"] < len(case.optimizer["groups"]) else 0
        return [f'optimizer.param_groups[{group}]["lr"] = {e["value"]!r}']
    if kind == "mode":
        return [f"model.train({e['train']})"]
    if kind in ("freeze", "unfreeze"):
        return [f"model.{e['attr']}.requires_grad_({kind == 'unfreeze'})"]
    if kind == "add_group":
        return [
            f"model.{e['attr']}.requires_grad_(True)",
            f"optimizer.add_param_group({_group_literal(case, [e['attr']], e['options'])})",
        ]
    if kind == "hyper":
        group = e["group"] if e["group"] < len(case.optimizer["groups"]) else 0
        return [f'optimizer.param_groups[{group}]["{e["key"]}"] = {_literal(e["value"])}']
    if kind == "edit":  # a write into the module, synced first (docs/training.md)
        params = _params_expr(case, [e["attr"]])
        return [
            "twin.sync()",
            "with torch.no_grad():",
            f"    for p in {params}:",
            f"        p.mul_({e['factor']})",
        ]
    if kind == "hand_step":  # an eager step by hand on the synced module and optimizer
        return ["twin.sync()", f'twin.hand_step("hand[{k}]", batch({3000 + k}))']
    if kind == "reset_state":  # every moment zeroed in place (a warm restart)
        return [
            "twin.sync()",
            "for entry in optimizer.state.values():",
            "    for key, value in entry.items():",
            '        if key != "step" and torch.is_tensor(value) and value.is_floating_point():',
            "            value.zero_()",
        ]
    if kind == "replace_state":  # every entry a copy (state copied from another optimizer)
        return [
            "twin.sync()",
            "for p, entry in list(optimizer.state.items()):",
            "    optimizer.state[p] = {key: copy.deepcopy(value) for key, value in entry.items()}",
        ]
    if kind == "save":
        return ["saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())"]
    if kind == "rewind":
        return ["model.load_state_dict(saved[0])", "optimizer.load_state_dict(saved[1])"]
    if kind == "back":
        return ["twin.back()"]
    if kind == "checkpoint":
        return ["twin.checkpoint()"]
    if kind == "reweight":  # the loss's captured tensor, written in place or rebound
        if e["inplace"]:
            return [f"WEIGHTS.mul_({e['factor']})"]
        return [f"WEIGHTS = WEIGHTS * {e['factor']}"]
    if kind == "restep":
        return [f"twin.restep(clip_grad_norm={e['clip']!r}, accumulate={e['accumulate']})"]
    if kind == "validate":
        return [f'twin.validate("val[{k}]", batch({1000 + k}, {e["size"]}))']
    assert kind == "bad_batch", kind
    return [f'twin.bad_step("bad[{k}]", bad_batch({500 + k}, {e["what"]!r}, {e["value"]}))']


def _run_source(case: Case) -> str:
    lines = [
        "def run(twin):",
        '    """The run: the same calls on each twin (eager, float64 eager, train_step)."""',
        "    model, optimizer = twin.model, twin.optimizer",
    ]
    weights = case.model.get("loss", {}).get("weights")
    if weights:  # a tensor loss_fn captures: each run's own
        dtype = "next(model.parameters()).dtype"
        lines += ["    global WEIGHTS", f"    WEIGHTS = torch.tensor({weights}, dtype={dtype})"]
    scheduler = _scheduler_source(case)
    if scheduler is not None:
        lines.append(f"    scheduler = {scheduler}")
    for k in range(case.steps + 1):
        for e in case.events:
            if e["at"] == k:
                lines += [f"    {line}" for line in _event_lines(case, e)]
        if k == case.steps:
            break
        size = case.options["last_batch"] if k == case.steps - 1 else None
        lines.append(f'    twin.step("loss[{k}]", batch({k}{f", {size}" if size else ""}))')
        if scheduler is not None:
            lines.append("    scheduler.step()")
    lines.append("    twin.finish()")
    return "\n".join(lines)


def tolerances(case: Case) -> dict[str, tuple[float, float]]:
    """``(rtol, atol)`` per kind of record: losses (the eager steps by hand too) and
    validation outputs as the
    train_step tests compare losses; parameters, buffers and optimizer state with the
    model table of ``tests/tolerances.py``; bfloat16's table under autocast."""
    import torch

    from tests.tolerances import tolerance

    if case.options.get("float64"):  # (the float64 mode: eager's rounding, to 1e-10)
        f64 = (1e-10, 1e-12)
        return {"loss": f64, "hand": f64, "val": f64, "model": f64, "state": f64}
    if case.options["autocast"]:
        bf16 = tolerance(torch.bfloat16)
        return {"loss": bf16, "hand": bf16, "val": bf16, "model": bf16, "state": bf16}
    model = tolerance(torch.float32, model=True)
    loss = (1e-4, 1e-5)
    return {"loss": loss, "hand": loss, "val": loss, "model": model, "state": model}


def case_source(case: Case, *, training: bool = True) -> str:
    """The case as Python (module docstring); without ``training``, only its model and
    data (``make_model``, ``batch``, ``loss_fn``: what picking a program model runs)."""
    o = case.options
    parts = [
        f"VALUES = {case.values}",
        f"CLIP = {o.get('clip')!r}",
        f"ACCUMULATE = {o.get('accumulate', 1)}",
        f"TRAIN_MODE = {o.get('train_mode', True)}",
    ]
    float64 = bool(o.get("float64"))
    parts.append(f"DTYPE = {'torch.float64' if float64 else None}  # the loops' batches")
    if training:
        parts.append(f"TOLERANCES = {tolerances(case)!r}")
        dtype = "float64" if float64 else "bfloat16" if o["autocast"] else "float32"
        parts.append(f"NUDGE = torch.finfo(torch.{dtype}).eps  # nudged(): one ulp")
    blocks = ["\n".join(parts), _model_source(case)]
    layout = "" if not o.get("channels_last") else ".to(memory_format=torch.channels_last)"
    layout += ".double()" if float64 else ""
    blocks.append(
        "def make_model():\n    torch.manual_seed(VALUES)\n"
        f"    return Model(){layout}.train(TRAIN_MODE)"
    )
    if o.get("layout", "contiguous") != "contiguous":
        blocks.append(RELAYOUT_SOURCE)
    blocks.append(_data_source(case))
    if training:
        if case.optimizer["name"] in CUSTOM_SOURCE:
            blocks.append(CUSTOM_SOURCE[case.optimizer["name"]])
        blocks.append(_optimizer_source(case))
        if o["scheduler"] is not None and o["scheduler"]["kind"] == "warmup_cosine":
            blocks.append(COSINE_SOURCE)
        blocks.append(_run_source(case))
    return "\n\n\n".join(blocks) + "\n"


_counter = 0


def namespace_of(case: Case, harness: str = "", *, training: bool = True) -> dict[str, Any]:
    """The names ``IMPORTS + case_source(case) + harness`` defines, compiled under a
    file name ``linecache`` knows (tracebacks show the case's lines)."""
    import linecache

    global _counter
    _counter += 1
    text = "\n\n".join(
        part for part in (IMPORTS, case_source(case, training=training), harness) if part
    )
    filename = f"<fuzz train_step case {case.seed}-{case.index} #{_counter}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": "fuzz_case"}
    exec(compile(text, filename, "exec"), namespace)
    return namespace


# The twins a case's ``run(twin)`` is called on, and the comparison of what they
# recorded; executed after the case's source, whose names it reads (``setup``,
# ``loss_fn``, ``predict``, ``CLIP``, ``ACCUMULATE``, ``TOLERANCES``).
HARNESS_SOURCE = '''Raised = collections.namedtuple("Raised", "type message")


def cast(value, dtype):
    """A batch (tensors in tuples and dicts) with its floating tensors in ``dtype``."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: cast(v, dtype) for k, v in value.items()}
    return tuple(cast(v, dtype) for v in value)


def micro_batches(batch, k):
    """``batch`` split along dim 0 of each tensor into ``k`` micro-batches, as
    ``train_step(..., accumulate=k)`` splits it."""

    def part(value, i):
        if isinstance(value, torch.Tensor):
            return value.chunk(k)[i]
        if isinstance(value, dict):
            return {key: part(v, i) for key, v in value.items()}
        return tuple(part(v, i) for v in value)

    return [part(batch, i) for i in range(k)] if k > 1 else [batch]


class EagerTwin:
    """The eager loop. Records ``(name, value)`` of everything compared, in order;
    ``dtype``: float64 for the reference twin (each batch's floating tensors cast)."""

    def __init__(self, model, clip_grad_norm=CLIP, accumulate=ACCUMULATE, dtype=DTYPE):
        self.model, self.dtype = model, dtype
        self.clip_grad_norm, self.accumulate = clip_grad_norm, accumulate
        self.records = []
        self.at = "setup"
        self.optimizer = setup(model)

    def record(self, name, value):
        self.records.append((name, value))

    def restep(self, clip_grad_norm=None, accumulate=1):
        self.before = (self.clip_grad_norm, self.accumulate)
        self.clip_grad_norm, self.accumulate = clip_grad_norm, accumulate

    def back(self):
        """The loop before the last ``restep`` again."""
        self.clip_grad_norm, self.accumulate = self.before

    def sync(self):
        """Nothing to write back: the module is the state."""

    def checkpoint(self):
        """Nothing to save: the module is the state."""

    def step(self, name, batch):
        """zero_grad, (loss / k).backward() per micro-batch, clipping, step."""
        self.at = name
        self.optimizer.zero_grad()
        total = None
        for part in micro_batches(cast(batch, self.dtype), self.accumulate):
            loss = loss_fn(self.model, *part)
            if self.accumulate > 1:
                loss = loss / self.accumulate
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.optimizer.step()
        self.record(name, total)

    def hand_step(self, name, batch):
        """An eager step by hand on the module and optimizer (synced first: the same
        on both twins): zero_grad, backward, step; no clipping, no micro-batches."""
        self.at = name
        self.optimizer.zero_grad()
        loss = loss_fn(self.model, *cast(batch, self.dtype))
        loss.backward()
        self.optimizer.step()
        self.record(name, loss.detach())

    def bad_step(self, name, batch):
        """A batch eager may refuse, tried on a copy of the model (a forward that
        raises may have changed BatchNorm's statistics first): skipped if it raises,
        else a step as any other."""
        self.at = name
        probe = copy.deepcopy(self.model)
        try:
            for part in micro_batches(cast(batch, self.dtype), self.accumulate):
                loss_fn(probe, *part)
        except Exception as e:
            self.record(name, Raised(type(e), str(e)))
            self.record(name + ".kept", True)
            return
        self.record(name, None)
        self.step(name + ".loss", batch)

    def validate(self, name, batch):
        """A validation pass: eval mode and no_grad, the model's outputs recorded."""
        self.at = name
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            out = predict(self.model, *cast(batch, self.dtype))
        self.model.train(training)
        self.record(name, out)

    def finish(self):
        """Every parameter and buffer, every optimizer state tensor, each param
        group's hyperparameters."""
        self.at = "finish"
        for key, value in self.model.state_dict().items():
            self.record(f"model[{key!r}]", value.detach().clone())
        state = self.optimizer.state_dict()
        for i, entry in sorted(state["state"].items()):
            for key, value in sorted(entry.items()):
                if isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                self.record(f"state[{i}][{key!r}]", value)
        for g, group in enumerate(state["param_groups"]):
            self.record(f"groups[{g}]", group)


class StepTwin(EagerTwin):
    """The same calls through dynajax.train_step."""

    def __init__(self, model, clip_grad_norm=CLIP, accumulate=ACCUMULATE, dtype=DTYPE):
        super().__init__(model, clip_grad_norm, accumulate, dtype)
        self.at = "train_step"
        self.restep(clip_grad_norm, accumulate)

    def restep(self, clip_grad_norm=None, accumulate=1):
        """A new train_step over the same model and optimizer: it takes the state
        over from the one before."""
        self.before = getattr(self, "train_step", None)
        self.train_step = dynajax.train_step(
            self.model,
            self.optimizer,
            loss_fn,
            clip_grad_norm=clip_grad_norm,
            accumulate=accumulate,
        )

    def back(self):
        """The train_step before the last ``restep`` again (two steps over one
        module, as a GAN's): it takes the state back."""
        self.train_step = self.before

    def sync(self):
        self.train_step.sync()

    def checkpoint(self):
        """``step.save`` and ``step.restore`` (orbax): the state as it was."""
        with tempfile.TemporaryDirectory() as directory:
            self.train_step.save(directory)
            self.train_step.restore(directory)

    def step(self, name, batch):
        self.at = name
        loss = self.train_step(*cast(batch, self.dtype))
        self.record(name, torch.from_numpy(np.array(loss)))

    def snapshot(self):
        """The whole training state (step count, module, optimizer, torch's generator),
        as copies."""
        step = self.train_step
        module = {k: v.clone() for k, v in step.state_dict().items()}
        module["torch.get_rng_state()"] = torch.get_rng_state()
        return step.steps, module, {k: np.array(v) for k, v in step.state.items()}

    def bad_step(self, name, batch):
        """A batch eager may refuse: train_step must raise what eager raises and keep
        the training state bit for bit, or else take the step."""
        self.at = name
        before = self.snapshot()
        try:
            loss = np.array(self.train_step(*cast(batch, self.dtype)))
        except Exception as e:
            self.record(name, Raised(type(e), str(e)))
            self.record(name + ".kept", same_state(before, self.snapshot()))
            return
        self.record(name, None)
        self.record(name + ".loss", torch.from_numpy(loss))

    def finish(self):
        self.at = "finish"
        self.train_step.sync()
        super().finish()


def same_state(a, b):
    """Whether two snapshots are equal, bit for bit (NaN where NaN)."""
    if a[0] != b[0] or a[1].keys() != b[1].keys() or a[2].keys() != b[2].keys():
        return False
    for k, x in a[1].items():
        y = b[1][k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not (torch.equal(x, y) or bool(((x == y) | (x.isnan() & y.isnan())).all())):
            return False
    for k, x in a[2].items():
        y = b[2][k]
        nan = x.dtype.kind == "f"
        if x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=nan):
            return False
    return True


def gaps(x, y):
    """|x - y| per element in float64; 0 where both are NaN or the same infinity, inf
    where only one is NaN."""
    x, y = x.detach().double(), y.detach().double()
    d = (x - y).abs()
    d = torch.where((x.isnan() & y.isnan()) | (x == y), torch.zeros_like(d), d)
    return torch.where(d.isnan(), torch.full_like(d, float("inf")), d)


def tensor_difference(actual, expected, others, tolerance):
    """None if ``actual`` agrees with eager's ``expected``, else how it differs.

    It agrees within ``tolerance`` (rtol, atol); or, ``others`` being the float64
    run's value and the nudged eager run's, where it is at least as close to the
    float64 value as eager's is (two roundings of one computation: tests/tolerances.py's
    float64 criterion), or no farther from eager's than three times the spread of
    eager's own runs (from float64, from the nudged run): an ill-conditioned case
    (chaotic steps, tiny eps, signs of noise) moves eager under another rounding as
    much. Each plus atol + rtol * max |value|."""
    rtol, atol = tolerance
    gap = gaps(actual, expected)
    e = expected.detach().double()
    bound = torch.where(e.isfinite(), atol + rtol * e.abs(), torch.zeros_like(e))
    if gap.numel() == 0 or bool((gap <= bound).all()):
        return None
    finite = e[e.isfinite()]
    slack = atol + rtol * (float(finite.abs().max()) if finite.numel() else 0.0)
    worst = float(gap.max())
    text = f"max |train_step - eager| {worst:.3g} (rtol {rtol:g}, atol {atol:g})"
    reference, nudged = others
    spread = []
    if isinstance(reference, torch.Tensor) and reference.shape == expected.shape:
        ours, theirs = float(gaps(actual, reference).max()), float(gaps(expected, reference).max())
        if ours <= theirs + slack:
            return None
        spread.append(theirs)
        text += f"; from the float64 run: train_step {ours:.3g}, eager {theirs:.3g}"
    if isinstance(nudged, torch.Tensor) and nudged.shape == expected.shape:
        spread.append(float(gaps(nudged, expected).max()))
        text += f"; nudged eager from eager {spread[-1]:.3g}"
    if spread and worst <= 3 * max(spread) + slack:
        return None
    return text


def difference(actual, expected, others, tolerance):
    """None if ``actual`` (train_step's record) is eager's ``expected``, else why not;
    ``others``: the float64 and nudged eager runs' records of it."""
    if isinstance(expected, Raised):
        if not isinstance(actual, Raised):
            return (
                f"eager raised {expected.type.__name__}: {expected.message}; "
                "train_step did not"
            )
        if issubclass(actual.type, expected.type) and expected.message in actual.message:
            return None
        return (
            f"train_step raised {actual.type.__name__}: {actual.message}; "
            f"eager {expected.type.__name__}: {expected.message}"
        )
    if isinstance(actual, Raised):
        return f"train_step raised {actual.type.__name__}: {actual.message}; eager did not"
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"a {type(actual).__name__} where eager has a tensor"
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return (
                f"{actual.dtype} {list(actual.shape)} where eager has "
                f"{expected.dtype} {list(expected.shape)}"
            )
        if not expected.is_floating_point():
            same = torch.equal(actual, expected)
            return None if same else f"{actual.flatten()[:8]} != eager's {expected.flatten()[:8]}"
        return tensor_difference(actual, expected, others, tolerance)
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            return f"{actual!r} where eager has {len(expected)} values"
        for j, (a, e) in enumerate(zip(actual, expected)):
            parts = tuple(
                o[j] if isinstance(o, (tuple, list)) and len(o) == len(expected) else None
                for o in others
            )
            why = difference(a, e, parts, tolerance)
            if why is not None:
                return f"[{j}] {why}"
        return None
    return None if actual == expected else f"{actual!r} != eager's {expected!r}"


def nudged(model):
    """``model`` with each floating parameter and buffer moved by ``NUDGE`` relative
    (an ulp of the dtype the case computes in; a fixed pattern of signs): its run shows
    how far eager moves under another rounding."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                signs = 2 * torch.randint(0, 2, t.shape, generator=g) - 1
                t.mul_(1 + NUDGE * signs)
    return model


def first_difference(ours, eager, reference=None, nudge=None):
    """The first of train_step's records that differs from eager's, as ``(name,
    why)``, or None; ``reference``, ``nudge``: the float64 and nudged eager twins'
    records (None: not run)."""
    others = dict(reference or ()), dict(nudge or ())
    for i in range(max(len(ours), len(eager))):
        if i >= len(eager) or i >= len(ours):
            name = (ours if i < len(ours) else eager)[i][0]
            return name, "recorded by one side only"
        (name, actual), (eager_name, expected) = ours[i], eager[i]
        if name != eager_name:
            return eager_name, f"train_step recorded {name} where eager recorded {eager_name}"
        tolerance = TOLERANCES.get(name.split("[")[0], (0.0, 0.0))
        why = difference(actual, expected, tuple(o.get(name) for o in others), tolerance)
        if why is not None:
            return name, why
    return None


def others(model):
    """The records of the float64 and the nudged eager runs (None: one that raised)."""
    records = []
    for twin in (
        EagerTwin(copy.deepcopy(model).double(), dtype=torch.float64),
        EagerTwin(nudged(copy.deepcopy(model))),
    ):
        try:
            run(twin)
            records.append(twin.records)
        except Exception:  # no allowance from it
            records.append(None)
    return records
'''

# A reproducer's end: the three twins, the run on each, the comparison.
MAIN_SOURCE = """def main():
    model = make_model()
    eager = EagerTwin(copy.deepcopy(model))
    run(eager)
    ours = StepTwin(copy.deepcopy(model))
    run(ours)
    found = first_difference(ours.records, eager.records, *others(model))
    if found is not None:
        raise AssertionError("train_step differs from eager at %s: %s" % found)
    print("train_step agrees with eager")


if __name__ == "__main__":
    main()
"""

"""``python -m fuzz --through train_step``: whole training runs through
``dynajax.train_step`` against the eager loop.

Each case (``fuzz.training_case``) runs as ``fuzz.training_source`` renders it, eagerly
and through ``train_step``. After each step the losses are compared, and at the end
every parameter, buffer and optimizer state tensor (after ``step.sync()``) and each
param group's hyperparameters; validation outputs and bad batches where they happen. A
floating value agrees within the tolerance of its kind; where it does not, the case
runs twice more eagerly, in float64 and from weights nudged by an ulp, and the value
agrees when it is at least as close to the float64 run as eager's is (two roundings of
one computation), or within three times the spread of those eager runs around eager's
(an ill-conditioned case, a tiny ``eps`` or Rprop's signs, moves eager under another
rounding as much).

A case ends as:

``ok``
    train_step's run is eager's.
``fail``
    a difference (signature ``<record>:<optimizer>:<trigger>``: ``loss``, ``val``,
    ``model``, ``state`` or ``groups``; the trigger is the events of the one or two
    gaps before the first difference, or else the optimizer's mode flags, or
    ``forward:<family>`` for the first loss), a bad batch train_step did not refuse
    as eager does (``raised:<eager's type>-><train_step's>``) or whose refusal
    changed the training state (``kept:<optimizer>``), or an error train_step raised
    (``error:<type>:<message>``).
``upstream``
    eager itself raised on the case, or train_step could not trace it and neither can
    torch's own ``make_fx`` of the loss and its gradient: not dynajax's.
``refused``
    train_step refused the case by a documented limit (``TrainStepError``: an
    optimizer it cannot compile, data-dependent shapes, state that is not tensors).

Failures known and not fixed are ``fuzz.known_bugs.KNOWN_TRAINING_BUGS`` (patterns).
The first case of each new signature is shrunk (steps, events, options,
hyperparameters and layers dropped while it fails the same way) and written as a
reproducer: the case's JSON and a script of plain torch and dynajax that runs the twins
and raises while train_step differs.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import fnmatch
import gc
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fuzz.campaign import Failure
from fuzz.check import FAIL, OK, UPSTREAM, _Collect, _normalize, error_text, quiet
from fuzz.known_bugs import KNOWN_TRAINING_BUGS
from fuzz.training_case import event_kinds, generate_case
from fuzz.training_source import (
    HARNESS_SOURCE,
    IMPORTS,
    MAIN_SOURCE,
    case_source,
    namespace_of,
)
from fuzz.training_spec import MODE_FLAGS, OPTIONAL_KINDS, Case

REFUSED = "refused"
# TrainStepError messages of train_step's documented limits (docs/training.md): an
# optimizer it cannot compile, ops that cannot be one program (data-dependent sizes,
# dtypes JAX lacks; not ops "eager refuses", since eager ran the case), state that is
# not tensors, a model or loss that branches on a tensor's value.
_REFUSALS = (
    "cannot compile",
    "cannot be part of one XLA program",
    "which a compiled step cannot carry",
    "branches on a tensor's value",
)
Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class TrainingOutcome:
    """The verdict on a case.

    Attributes:
        status: ``ok``, ``fail``, ``upstream`` or ``refused`` (module docstring).
        where: the first record that differs (``loss[3]``, ``state[0]['exp_avg']``), or
            where an error was raised.
        detail: how it differs, or the error.
        signature: what known bugs and de-duplication key on.
        warnings: what dynajax logged at WARNING or above (not failures).
    """

    status: str
    where: str = ""
    detail: str = ""
    signature: str = ""
    warnings: tuple[str, ...] = ()


def _twin(
    namespace: dict[str, Any], kind: str, model: nn.Module, **kwargs: Any
) -> tuple[Any, BaseException | None, str]:
    """Runs the case on a new twin of ``kind``: (the twin, the error it raised, where)."""
    twin = None
    try:
        twin = namespace[kind](model, **kwargs)
        namespace["run"](twin)
    except Exception as e:
        return twin, e, twin.at if twin is not None else "construction"
    return twin, None, ""


def check_case(
    case: Case, *, control: bool = True, tamper: Callable[[Any], None] | None = None
) -> TrainingOutcome:
    """Runs ``case`` eagerly and through train_step, and compares (and, where they
    differ beyond the table, runs it in float64 and nudged too: module docstring).

    ``control``: on a trace failure, ask torch's own tracing whether it is upstream
    (the shrinker skips it). ``tamper``: called on the train_step twin after its run,
    before the comparison (the tests break the comparison with it)."""
    collect = _Collect()
    with quiet(collect):
        outcome = _check(case, control, tamper)
    return dataclasses.replace(outcome, warnings=tuple(dict.fromkeys(collect.messages)))


def _check(case: Case, control: bool, tamper: Callable[[Any], None] | None) -> TrainingOutcome:
    namespace = namespace_of(case, HARNESS_SOURCE)
    model = namespace["make_model"]()
    eager, error, at = _twin(namespace, "EagerTwin", copy.deepcopy(model))
    if error is not None:
        text = error_text(error)
        sig = f"eager:{type(error).__name__}:{_normalize(str(error))[:50]}"
        return TrainingOutcome(UPSTREAM, at, f"eager raised {text}", sig)
    ours, error, at = _twin(namespace, "StepTwin", copy.deepcopy(model))
    if error is not None:
        return _error_outcome(error, at, namespace, model, control)
    if tamper is not None:
        tamper(ours)
    first_difference = namespace["first_difference"]
    found = first_difference(ours.records, eager.records)
    if found is not None:  # beyond the table: weigh it by the float64 and nudged runs
        reference, nudge = namespace["others"](model)
        found = first_difference(ours.records, eager.records, reference, nudge)
    if found is None:
        return TrainingOutcome(OK)
    where, detail = found
    sig = signature(case, where, dict(ours.records), dict(eager.records))
    return TrainingOutcome(FAIL, where, detail, sig)


def _error_outcome(
    error: BaseException, at: str, namespace: dict[str, Any], model: nn.Module, control: bool
) -> TrainingOutcome:
    """An error train_step raised (eager ran the case): refused, upstream or a failure."""
    from dynajax.errors import TrainStepError

    message = str(error)
    detail = f"train_step raised {error_text(error)}"
    sig = f"error:{type(error).__name__}:{_normalize(message)[:60]}"
    traced = re.match(r"the training step could not be traced \([^)]*\): (.*)", message)
    if traced:  # torch's error inside, without the optimizer's and the loss's names
        sig = f"error:{type(error).__name__}:trace:{_normalize(traced.group(1))[:50]}"
    refused = re.findall(r"^  - (\S+) \(node '[^']*'\): ([A-Z_]+)", message, re.MULTILINE)
    if refused:  # the ops it cannot make one program of: named in the signature
        op, reason = refused[0]
        sig = f"error:{type(error).__name__}:{reason}:{op}"
    eager_ran = any(reason == "EAGER_REFUSES" for _, reason in refused)
    if isinstance(error, TrainStepError) and any(r in message for r in _REFUSALS) and not eager_ran:
        return TrainingOutcome(REFUSED, at, detail, sig)
    if control and ("could not be traced" in message or eager_ran):
        problem = torch_trace_problem(namespace, model)
        if problem is not None:
            return TrainingOutcome(UPSTREAM, at, f"{detail}; torch's make_fx: {problem}", sig)
    return TrainingOutcome(FAIL, at, detail, sig)


def torch_trace_problem(namespace: dict[str, Any], model: nn.Module) -> str | None:
    """What torch's own tracing raises on the case's loss and its gradient (``make_fx``
    of ``functional_call`` and ``autograd.grad`` on fake tensors, the first of
    train_step's two traces; no dynajax), or what its graph raises when run by torch on
    the first batch; None when it traces them and the graph runs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    loss_fn = namespace["loss_fn"]

    class LossModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(model)

        def forward(self, *batch: Any) -> torch.Tensor:
            return loss_fn(self.model, *batch)

    wrapper = LossModule()
    tensors = dict(wrapper.named_parameters()) | dict(wrapper.named_buffers())
    names = list(tensors)
    values = [t.detach().requires_grad_(t.requires_grad) for t in tensors.values()]
    flat, spec = pytree.tree_flatten(namespace["batch"](0))

    def step(*args: torch.Tensor) -> Any:
        batch = pytree.tree_unflatten(list(args[len(names) :]), spec)
        with torch.enable_grad():
            values = dict(zip(names, args[: len(names)], strict=True))
            loss = torch.func.functional_call(wrapper, values, tuple(batch))
            leaves = [a for a in args[: len(names)] if a.requires_grad]
            return torch.autograd.grad(loss, leaves, allow_unused=True)

    try:
        gm = make_fx(step, tracing_mode="fake")(*values, *flat)
    except Exception as e:
        return error_text(e).splitlines()[0][:200]
    try:
        gm(*[v.detach() for v in values], *flat)
    except Exception as e:
        return "its graph, run by torch: " + error_text(e).splitlines()[0][:200]
    return None


# ---------------------------------------------------------------------------------
# Signatures
# ---------------------------------------------------------------------------------


def _at_step(case: Case, where: str) -> int:
    """The position in the run of a record: ``k`` of ``loss[k]``, ``val[k]`` and
    ``bad[k]``; the end for the final state."""
    found = re.match(r"(loss|val|bad)\[(\d+)\]", where)
    return int(found.group(2)) if found else case.steps


def mode_flags(case: Case) -> list[str]:
    """The optimizer's flags that change its arithmetic (``MODE_FLAGS``) set in its
    defaults or a group, and ``custom`` for a user-written optimizer."""
    options = [case.optimizer["options"], *(g["options"] for g in case.optimizer["groups"])]
    flags = [f for f in MODE_FLAGS if any(o.get(f) for o in options)]
    return flags or (
        ["custom"] if case.optimizer["name"] in ("MomentumSGD", "SignMomentum") else []
    )


def signature(case: Case, where: str, ours: dict[str, Any], eager: dict[str, Any]) -> str:
    """The failure's signature (module docstring), from the first differing record."""
    optimizer = case.optimizer["name"]
    kind = where.split("[")[0]
    if kind == "bad":
        if where.endswith(".kept"):
            return f"kept:{optimizer}"
        if not where.endswith(".loss"):
            name = where.split(".")[0]
            mine, theirs = ours.get(name), eager.get(name)
            them = type(theirs).__name__ if theirs is None else theirs.type.__name__
            me = "nothing" if mine is None else getattr(mine, "type", type(mine)).__name__
            return f"raised:{them}->{me}"
        kind = "loss"
    k = _at_step(case, where)
    window = sorted({e["kind"] for e in case.events if e["at"] in (k - 1, k)})
    if window:
        return f"{kind}:{optimizer}:{'+'.join(window)}"
    if kind in ("loss", "val") and k == 0:
        return f"{kind}:forward:{case.model['family']}"
    return f"{kind}:{optimizer}:{'+'.join(mode_flags(case)) or '-'}"


def known_bug(sig: str) -> str | None:
    """The reason of the known bug whose pattern (``fnmatch``) ``sig`` matches."""
    for pattern, reason in KNOWN_TRAINING_BUGS.items():
        if fnmatch.fnmatchcase(sig, pattern):
            return reason
    return None


def _key(sig: str) -> str:
    """What a shrunk case must keep to fail "the same way": the kind of difference,
    and for raised errors the whole signature."""
    kind = sig.split(":")[0]
    return sig if kind in ("error", "raised", "kept", "eager") else kind


# ---------------------------------------------------------------------------------
# Shrinking
# ---------------------------------------------------------------------------------

_SHAPE_KEEPING = {
    "tanh", "gelu", "gelu_tanh", "relu", "silu", "sigmoid", "dropout",
    "layernorm", "bn", "mha", "encoder", "maxpool", "avgpool",
}  # fmt: skip


def _truncated(case: Case, steps: int) -> Case:
    events = [
        e for e in case.events if e["at"] < steps or (e["at"] == steps and e["kind"] == "validate")
    ]
    options = dict(case.options)
    if options["last_batch"] is not None and steps < case.steps:
        options["last_batch"] = None
    return case.replace(steps=steps, events=events, options=options)


def _candidates(case: Case, where: str) -> Iterator[Case]:
    """Simpler cases, most promising first."""
    k = _at_step(case, where)
    if k + 1 < case.steps:
        yield _truncated(case, k + 1)
    for i in reversed(range(len(case.events))):
        yield case.replace(events=case.events[:i] + case.events[i + 1 :])
    plain = {
        "scheduler": None,
        "clip": None,
        "accumulate": 1,
        "autocast": False,
        "dict_batch": False,
        "last_batch": None,
        "layout": "contiguous",
        "channels_last": False,
    }
    for key, value in plain.items():
        if key in case.options and case.options[key] != value:
            yield case.replace(options={**case.options, key: value})
    if case.model["family"] == "program":  # inputs contiguous, buffers batch inputs
        program = case.model["program"]
        for i, spec in enumerate(program["inputs"]):
            if spec["layout"] != "contiguous":
                inputs = copy.deepcopy(program["inputs"])
                inputs[i]["layout"] = "contiguous"
                yield case.replace(model={**case.model, "program": {**program, "inputs": inputs}})
        if case.model.get("buffers"):
            yield case.replace(model={**case.model, "buffers": []})
    opt = case.optimizer
    if len(opt["groups"]) > 1:
        merged = [{"attrs": [a for g in opt["groups"] for a in g["attrs"]], "options": {}}]
        yield case.replace(optimizer={**opt, "groups": merged})
    for g, group in enumerate(opt["groups"]):
        for key in group["options"]:
            groups = copy.deepcopy(opt["groups"])
            del groups[g]["options"][key]
            yield case.replace(optimizer={**opt, "groups": groups})
    for key in opt["options"]:
        if key != "lr":
            options = {k: v for k, v in opt["options"].items() if k != key}
            yield case.replace(optimizer={**opt, "options": options})
    if case.steps > 1:
        yield _truncated(case, case.steps - 1)
        for j in range(case.steps - 1):  # one step fewer at j, the events after it earlier
            events = [{**e, "at": e["at"] - 1} if e["at"] > j else e for e in case.events]
            options = {**case.options, "last_batch": None}
            yield case.replace(steps=case.steps - 1, events=events, options=options)
    for i, layer in enumerate(case.model.get("layers", [])):
        if layer["kind"] in _SHAPE_KEEPING:
            layers = copy.deepcopy(case.model["layers"])
            layers[i] = {"kind": "identity"}
            yield case.replace(model={**case.model, "layers": layers})


def shrink_case(
    case: Case,
    outcome: TrainingOutcome,
    *,
    seconds: float,
    check: Callable[[Case], TrainingOutcome] | None = None,
    beat: Callable[[], None] = lambda: None,
) -> tuple[Case, TrainingOutcome, int]:
    """The smallest case found in ``seconds`` that fails as ``outcome`` does (the same
    ``_key`` of its signature): greedy, the first simpler candidate that fails replaces
    the case, until none does. Returns it, its outcome and the candidates checked.
    ``beat`` is called per candidate (the supervisor's sign of life)."""
    check = check or (lambda c: check_case(c, control=False))
    deadline = time.monotonic() + seconds
    key = _key(outcome.signature)
    checked = 0
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        seen = {case.to_json()}
        for candidate in _candidates(case, outcome.where):
            if time.monotonic() >= deadline:
                break
            if candidate.to_json() in seen:
                continue
            seen.add(candidate.to_json())
            beat()
            checked += 1
            try:
                result = check(candidate)
            except Exception:  # the checker failed on an odd candidate: not the same
                continue
            if result.status == FAIL and _key(result.signature) == key:
                case, outcome, improved = candidate, result, True
                break
    return case, outcome, checked


# ---------------------------------------------------------------------------------
# Reproducers
# ---------------------------------------------------------------------------------


def reproducer_source(case: Case, outcome: TrainingOutcome, origin: str, filename: str) -> str:
    """A standalone script of plain torch and dynajax: the case, the three twins, the
    comparison; it raises while train_step differs from eager."""
    detail = "\n".join(outcome.detail.strip().splitlines()[:12]).replace('"""', "'''")
    doc = (
        f'"""dynajax train_step fuzz failure: {outcome.signature}\n\n{origin}\n'
        f"{outcome.where}: {detail}\n\nRun: python {filename}\n"
        f"(or python -m fuzz --through train_step --replay "
        f'{pathlib.Path(filename).with_suffix(".json")})\n"""'
    ).replace("\\", "\\\\")
    return "\n\n".join([doc, IMPORTS, case_source(case), HARNESS_SOURCE, MAIN_SOURCE])


def write_training_reproducer(
    directory: pathlib.Path, stem: str, case: Case, outcome: TrainingOutcome, origin: str
) -> pathlib.Path:
    """Writes ``<stem>.py`` (the script) and ``<stem>.json`` (the case, which ``python
    -m fuzz --through train_step --replay`` reads); returns the ``.py`` path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.py"
    path.write_text(reproducer_source(case, outcome, origin, str(path)))
    (directory / f"{stem}.json").write_text(case.to_json() + "\n")
    return path


def replay(path: str) -> int:
    """``--replay``: checks the case of a reproducer's ``.json`` again."""
    case = Case.from_json(pathlib.Path(path).read_text())
    outcome = check_case(case)
    print(f"status: {outcome.status}  signature: {outcome.signature or '-'}")
    if outcome.where:
        print(f"{outcome.where}: {outcome.detail}")
    return 1 if outcome.status == FAIL else 0


# ---------------------------------------------------------------------------------
# A fuzzing run
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainingSummary:
    """What a run did (``features``: how many cases had each optimizer, model family
    and event kind)."""

    seed: int
    runs: int = 0
    seconds: float = 0.0
    statuses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    features: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    refusals: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failures: dict[str, Failure] = dataclasses.field(default_factory=dict)
    warnings: dict[str, int] = dataclasses.field(default_factory=dict)
    optional: list[str] = dataclasses.field(default_factory=lambda: list(OPTIONAL_KINDS))
    float64: bool = False  # the float64 mode (every case in float64, compared at 1e-10)
    out_dir: str = ""

    @property
    def new_failures(self) -> list[Failure]:
        """Distinct dynajax failures that are not known bugs."""
        return [f for f in self.failures.values() if f.status == FAIL and f.known is None]

    def lines(self) -> list[str]:
        s = self.statuses
        fails = [f for f in self.failures.values() if f.status == FAIL]
        upstream = [f for f in self.failures.values() if f.status == UPSTREAM]
        optional = ", ".join(self.optional) or "none"
        out = [
            f"dynajax train_step fuzz{' in float64' if self.float64 else ''}: seed "
            f"{self.seed}, {self.runs} runs in {self.seconds:.0f} s (optional events: "
            f"{optional})",
            f"  ok {s[OK]}, failures {s[FAIL]} ({len(fails)} distinct, "
            f"{sum(1 for f in fails if f.known)} known), upstream (eager fails, or torch "
            f"cannot trace) {s[UPSTREAM]} ({len(upstream)} distinct), refused (documented "
            f"limits) {s[REFUSED]}",
        ]
        for prefix, title in (("opt:", "optimizers"), ("model:", "models"), ("event:", "events")):
            counts = sorted(
                (-n, k.removeprefix(prefix))
                for k, n in self.features.items()
                if k.startswith(prefix)
            )
            if counts:
                out.append(f"  {title}: " + ", ".join(f"{k} {-n}" for n, k in counts))
        if self.refusals:
            out.append("  refused:")
            out += [f"    {sig[:120]}  x{n}" for sig, n in self.refusals.most_common()]
        if self.warnings:
            out.append("  dynajax warnings (not failures; first run of each):")
            out += [f"    {w[:160]}  (run {i})" for w, i in self.warnings.items()]
        for title, group in (("failures", fails), ("upstream", upstream)):
            if group:
                out.append(f"  {title}:")
            for f in group:
                tag = "known" if f.known else "NEW" if f.status == FAIL else "upstream"
                where = f.reproducer or "(no reproducer)"
                out.append(
                    f"    [{tag}] {f.signature}  x{f.count}  run {f.index}, "
                    f"{f.ops[0]} -> {f.ops[1]} events  {where}"
                )
                out.append(f"        {f.detail[:200]}")
        if self.out_dir and any(f.reproducer for f in self.failures.values()):
            out.append(f"  reproducers in {self.out_dir}/")
        return out

    def to_json(self) -> str:
        data = {
            "seed": self.seed,
            "runs": self.runs,
            "seconds": round(self.seconds, 1),
            "statuses": dict(self.statuses),
            "features": dict(self.features),
            "refusals": dict(self.refusals),
            "failures": [dataclasses.asdict(f) for f in self.failures.values()],
            "warnings": self.warnings,
            "optional": self.optional,
            "float64": self.float64,
        }
        return json.dumps(data, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, out_dir: str = "") -> TrainingSummary:
        data = json.loads(text)
        failures = {}
        for f in data.pop("failures"):
            failure = Failure(**{**f, "ops": tuple(f["ops"])})
            failures[failure.signature] = failure
        return TrainingSummary(
            **{
                **data,
                "statuses": collections.Counter(data["statuses"]),
                "features": collections.Counter(data["features"]),
                "refusals": collections.Counter(data["refusals"]),
                "failures": failures,
                "out_dir": out_dir,
            }
        )


def _record(
    summary: TrainingSummary,
    case: Case,
    outcome: TrainingOutcome,
    directory: pathlib.Path | None,
    shrink_seconds: float,
    log: Log,
    beat: Callable[[], None],
) -> None:
    summary.statuses[outcome.status] += 1
    summary.features[f"opt:{case.optimizer['name']}"] += 1
    summary.features[f"model:{case.model['family']}"] += 1
    for kind in event_kinds(case):
        summary.features[f"event:{kind}"] += 1
    for message in outcome.warnings:
        summary.warnings.setdefault(message, case.index)
    if outcome.status == REFUSED:
        summary.refusals[outcome.signature] += 1
    if outcome.status not in (FAIL, UPSTREAM):
        return
    sig = outcome.signature
    if sig in summary.failures:
        summary.failures[sig].count += 1
        return
    known = known_bug(sig) if outcome.status == FAIL else None
    events = len(case.events)
    detail = f"{outcome.where}: {outcome.detail.strip().splitlines()[0][:200]}"
    failure = Failure(sig, outcome.status, case.index, known=known, ops=(events, events))
    failure.detail = detail
    summary.failures[sig] = failure
    tag = "known" if known else "NEW" if outcome.status == FAIL else "upstream"
    log(f"  run {case.index}: [{tag}] {sig}  ({detail[:120]})")
    if directory is None or known:
        return
    small, small_outcome = case, outcome
    if outcome.status == FAIL and shrink_seconds > 0:
        small, small_outcome, checked = shrink_case(
            case, outcome, seconds=shrink_seconds, beat=beat
        )
        events_steps = f"{events} -> {len(small.events)} events, {case.steps} -> {small.steps}"
        log(f"    shrunk {events_steps} steps ({checked} candidates)")
        if small_outcome.signature != sig:
            log(f"    the shrunk case's signature: {small_outcome.signature}")
    failure.ops = (events, len(small.events))
    where = directory if outcome.status == FAIL else directory / "upstream"
    origin = (
        f"Found by `python -m fuzz --through train_step --seed {summary.seed}` (run "
        f"{case.index}, signature {sig}); shrunk from {events} events and {case.steps} "
        f"steps to {len(small.events)} and {small.steps}."
    )
    stem = f"seed{summary.seed}-run{case.index}"
    path = write_training_reproducer(where, stem, small, small_outcome, origin)
    failure.reproducer = str(path)
    log(f"    reproducer: {path}")


def run_training(
    seed: int,
    *,
    runs: int | None = None,
    minutes: float | None = None,
    out_dir: str | pathlib.Path | None = "fuzz_failures",
    shrink_seconds: float = 90.0,
    start: int = 0,
    optional: tuple[str, ...] = OPTIONAL_KINDS,
    float64: bool = False,
    log: Log = print,
    state: pathlib.Path | None = None,
) -> TrainingSummary:
    """Checks cases ``start, start + 1, ...`` of ``seed`` until ``runs`` are done or
    ``minutes`` have passed (at least one is needed), in this process.

    The case being checked is written to ``<out_dir>/checking-train-seed<seed>.json``
    first (its mtime is touched while it is shrunk) and removed after: a process that
    dies inside a check leaves it behind for ``supervise_training``. ``state``: the
    summary so far, read if it exists and written after each case."""
    assert runs is not None or minutes is not None, "give runs or minutes"
    import jax

    began = time.monotonic()
    deadline = began + 60 * minutes if minutes is not None else float("inf")
    summary = TrainingSummary(seed, optional=list(optional), float64=float64)
    summary.out_dir = str(out_dir) if out_dir is not None else ""
    if state is not None and state.exists():
        summary = TrainingSummary.from_json(state.read_text(), summary.out_dir)
    done_before, seconds_before = summary.runs, summary.seconds
    directory = pathlib.Path(out_dir) if out_dir is not None else None
    checking = directory / f"checking-train-seed{seed}.json" if directory is not None else None

    def beat() -> None:
        if checking is not None and checking.exists():
            os.utime(checking)

    index = start
    while (runs is None or index - start < runs) and time.monotonic() < deadline:
        if checking is not None:
            checking.parent.mkdir(parents=True, exist_ok=True)
            checking.write_text(json.dumps({"index": index}))
        case = generate_case(seed, index, optional=optional, float64=float64)
        if checking is not None:
            checking.write_text(json.dumps({"index": index, "case": json.loads(case.to_json())}))
        try:
            outcome = check_case(case)
        except Exception as e:  # the harness itself: a failure to look at, not a crash
            sig = f"harness:{type(e).__name__}:{_normalize(str(e))[:50]}"
            outcome = TrainingOutcome(FAIL, "harness", error_text(e), sig)
        _record(summary, case, outcome, directory, shrink_seconds, log, beat)
        index += 1
        summary.runs = done_before + index - start
        summary.seconds = seconds_before + time.monotonic() - began
        if state is not None:
            state.write_text(summary.to_json() + "\n")
        if index % 20 == 0:
            jax.clear_caches()  # each case's programs, never reused
            gc.collect()
            log(f"  {index - start} runs, {time.monotonic() - began:.0f} s")
    summary.seconds = seconds_before + time.monotonic() - began
    if checking is not None:
        checking.unlink(missing_ok=True)
    if state is None:
        _write_summary(summary, directory)
    return summary


def _write_summary(summary: TrainingSummary, directory: pathlib.Path | None) -> None:
    if directory is not None and summary.failures:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"summary-train-seed{summary.seed}.json"
        path.write_text(summary.to_json() + "\n")


def supervise_training(
    seed: int,
    *,
    runs: int | None = None,
    minutes: float | None = None,
    out_dir: str | pathlib.Path = "fuzz_failures",
    shrink_seconds: float = 90.0,
    start: int = 0,
    optional: tuple[str, ...] = OPTIONAL_KINDS,
    float64: bool = False,
    log: Log = print,
    child: Callable[[list[str]], int] | None = None,
    case_limit: float = 300.0,
) -> TrainingSummary:
    """``run_training`` in child processes (as ``fuzz.campaign.supervise``): a case
    whose check kills its child (an XLA abort), or runs longer than ``case_limit``
    seconds plus its shrinking (the child is killed then), is a ``crash`` failure with
    a reproducer, and a new child goes on after it. ``child`` runs ``python -m fuzz``
    with the given arguments and returns its exit status (negative: the signal)."""
    assert runs is not None or minutes is not None, "give runs or minutes"
    directory = pathlib.Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = directory / f"run-train-seed{seed}.json"
    checking = directory / f"checking-train-seed{seed}.json"
    state.unlink(missing_ok=True)
    checking.unlink(missing_ok=True)
    began = time.monotonic()
    summary = TrainingSummary(seed, optional=list(optional), float64=float64, out_dir=str(out_dir))
    index = start
    limit = case_limit + shrink_seconds
    while True:
        args = ["--through", "train_step", "--seed", str(seed), "--start", str(index)]
        args += ["--out", str(out_dir), "--shrink-seconds", str(shrink_seconds)]
        args += ["--state", str(state), "--optional-events", ",".join(optional)]
        args += ["--float64"] if float64 else []
        if runs is not None:
            if runs - summary.runs <= 0:
                break
            args += ["--programs", str(runs - summary.runs)]
        if minutes is not None:
            left = minutes - (time.monotonic() - began) / 60
            if left <= 0:
                break
            args += ["--minutes", f"{left:.4f}"]
        status = child(args) if child is not None else _child_process(args, checking, limit)
        if state.exists():
            summary = TrainingSummary.from_json(state.read_text(), str(out_dir))
        if status >= 0 or not checking.exists():
            break
        killed = json.loads(checking.read_text())
        checking.unlink()
        index = killed["index"]
        case = Case.from_json(json.dumps(killed["case"])) if "case" in killed else None
        _record_death(summary, index, case, -status, directory, log)
        summary.runs += 1
        state.write_text(summary.to_json() + "\n")
        index += 1
        log(f"  run {index - 1} killed the process (signal {-status}); going on from {index}")
    summary.seconds = time.monotonic() - began
    state.unlink(missing_ok=True)
    _write_summary(summary, directory)
    return summary


def _child_process(args: list[str], checking: pathlib.Path, limit: float) -> int:
    """``python -m fuzz --in-process ARGS``; killed (SIGKILL) when the case it checks
    has given no sign of life (``checking``'s mtime) for ``limit`` seconds."""
    process = subprocess.Popen([sys.executable, "-m", "fuzz", "--in-process", *args])
    while True:
        try:
            return process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            try:
                idle = time.time() - checking.stat().st_mtime
            except FileNotFoundError:
                continue
            if idle > limit:
                process.kill()
                return process.wait()


def _record_death(
    summary: TrainingSummary,
    index: int,
    case: Case | None,
    signal: int,
    directory: pathlib.Path,
    log: Log,
) -> None:
    """A case whose check killed the process (or hung, and was killed: signal 9)."""
    sig = f"crash:?:process killed by signal {signal}"
    summary.statuses[FAIL] += 1
    if sig in summary.failures:
        summary.failures[sig].count += 1
        return
    detail = f"the process checking it was killed by signal {signal}"
    if signal == 9:
        detail += " (SIGKILL: out of memory, or no progress past the case limit)"
    failure = Failure(sig, FAIL, index, known=known_bug(sig), detail=detail)
    summary.failures[sig] = failure
    log(f"  run {index}: [{'known' if failure.known else 'NEW'}] {sig}")
    if case is None:
        return
    failure.ops = (len(case.events), len(case.events))
    outcome = TrainingOutcome(FAIL, "the process", detail, sig)
    origin = (
        f"Found by `python -m fuzz --through train_step --seed {summary.seed}` (run "
        f"{index}): checking it killed the process (signal {signal}); not shrunk."
    )
    path = write_training_reproducer(
        directory, f"seed{summary.seed}-run{index}", case, outcome, origin
    )
    failure.reproducer = str(path)
    log(f"    reproducer: {path}")

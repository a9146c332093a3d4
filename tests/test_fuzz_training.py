"""The train_step fuzzer (``python -m fuzz --through train_step``, ``fuzz/training.py``):
a short seeded run of whole training runs agrees with eager, and the machinery
(generation, comparison, classification, shrinking, supervision, reproducers) does what
it says.
"""

from __future__ import annotations

import copy
import json
import pathlib
import runpy
import subprocess
import sys
from typing import Any

import pytest
import torch

import dynajax
import fuzz.training
import fuzz.training_case
from fuzz.check import FAIL, OK, UPSTREAM
from fuzz.known_bugs import KNOWN_TRAINING_BUGS
from fuzz.training import (
    REFUSED,
    TrainingOutcome,
    check_case,
    run_training,
    shrink_case,
    supervise_training,
    write_training_reproducer,
)
from fuzz.training_case import generate_case, without_kinds
from fuzz.training_source import HARNESS_SOURCE, case_source, namespace_of
from fuzz.training_spec import OPTIONAL_KINDS, Case

CI_SEED, CI_RUNS = 0, 8


def test_seeded_training_runs_agree_with_eager(tmp_path: pathlib.Path) -> None:
    """Runs 0..7 of seed 0 (about 40 s): every difference from eager is a known bug
    (``fuzz.known_bugs.KNOWN_TRAINING_BUGS``) or not dynajax's. A new one fails the test
    with its signature and an (unshrunk) reproducer: shrink it with ``python -m fuzz
    --through train_step --seed 0 --programs 8``, then fix it or record it."""
    summary = run_training(CI_SEED, runs=CI_RUNS, out_dir=tmp_path, shrink_seconds=0)
    print("\n".join(summary.lines()))
    assert summary.runs == CI_RUNS
    assert summary.statuses[OK] >= CI_RUNS * 3 // 4, summary.lines()
    new = [f"{f.signature}: {f.detail}\n  {f.reproducer}" for f in summary.new_failures]
    assert not new, "train_step differs from eager:\n" + "\n".join(new)
    # ... and the runs were the mix they are meant to be
    features = summary.features
    assert len([k for k in features if k.startswith("opt:")]) >= 6, features
    assert len([k for k in features if k.startswith("model:")]) >= 4, features
    assert len([k for k in features if k.startswith("event:")]) >= 10, features
    # ... batches, parameters and buffers in other layouts among them
    assert any(k.startswith("event:layout") for k in features), features


def test_cases_are_deterministic_and_round_trip() -> None:
    for i in range(30):
        a, b = generate_case(7, i), generate_case(7, i)
        assert a.to_json() == b.to_json() and case_source(a) == case_source(b)
        assert Case.from_json(a.to_json()) == a
        # Without the optional kinds: the same case, less those.
        plain = generate_case(7, i, optional=())
        assert plain == without_kinds(a, list(OPTIONAL_KINDS))
        kinds = {e["kind"] for e in plain.events}
        assert not kinds & {"freeze", "unfreeze", "add_group", "bad_batch"}
        assert not plain.options["dict_batch"] and plain.optimizer["held_out"] is None
    assert generate_case(7, 0) != generate_case(8, 0)
    assert generate_case(7, 0) != generate_case(7, 1)


def _case(**changes: Any) -> Case:
    """A small run: an MLP classifier, Adam over two param groups, four steps with a
    learning-rate edit, a bad batch and a validation pass."""
    case = Case(
        seed=0,
        index=0,
        values=5,
        model={
            "family": "mlp",
            "input": {"kind": "float", "shape": [4]},
            "layers": [
                {"kind": "linear", "in": 4, "out": 8, "bias": True},
                {"kind": "tanh"},
                {"kind": "linear", "in": 8, "out": 3, "bias": True},
            ],
            "loss": {"kind": "ce", "out": 3},
        },
        optimizer={
            "name": "Adam",
            "options": {"lr": 0.01, "amsgrad": True},
            "groups": [
                {"attrs": ["l0"], "options": {}},
                {"attrs": ["l2"], "options": {"lr": 0.05}},
            ],
            "held_out": None,
        },
        options={
            "batch": 4,
            "clip": None,
            "accumulate": 1,
            "scheduler": None,
            "autocast": False,
            "dict_batch": False,
            "train_mode": True,
            "last_batch": None,
        },
        steps=4,
        events=[
            {"at": 1, "kind": "lr", "group": 0, "value": 0.001},
            {"at": 1, "kind": "bad_batch", "what": "target", "value": 0},
            {"at": 2, "kind": "validate", "size": 3},
        ],
    )
    return case.replace(**changes)


def test_the_float64_mode_trains_in_float64_and_compares_at_1e_10() -> None:
    """``--float64``: the model, batches and both loops in float64, compared at 1e-10
    relative: a parameter moved by 1e-8 relative (far below float32's table) fails,
    the run itself agrees."""
    case = _case(options={**_case().options, "float64": True})
    source = case_source(case)
    assert ".double()" in source and "DTYPE = torch.float64" in source
    assert check_case(case).status == OK

    def moved(twin: Any) -> None:
        name, value = next(r for r in twin.records if r[0].startswith("model["))
        assert value.dtype == torch.float64
        value.mul_(1 + 1e-8)

    outcome = check_case(case, tamper=moved)
    assert outcome.status == FAIL and outcome.where.startswith("model["), outcome
    assert check_case(_case(), tamper=moved_f32(1e-8)).status == OK  # float32's table


def moved_f32(relative: float) -> Any:
    def moved(twin: Any) -> None:
        name, value = next(r for r in twin.records if r[0].startswith("model["))
        value.mul_(1 + relative)

    return moved


def test_the_generator_draws_float64_cases_and_state_edits() -> None:
    cases = [generate_case(130, i, float64=True) for i in range(30)]
    assert all(c.options["float64"] and not c.options["autocast"] for c in cases)
    kinds = {e["kind"] for c in cases for e in c.events}
    assert {"hand_step", "reset_state", "replace_state"} <= kinds
    # the same case in float32 but for the mode (the edits have their own generator)
    assert generate_case(130, 3).events == cases[3].events


def test_a_program_model_trains_in_float64_too() -> None:
    """A program whose floating values do not all follow its inputs to float64 is no
    program model: an int64 buffer's reciprocal is float32 by the default dtype, and the
    float64 mode's eager loop then refuses the float64 weight of the convolution."""
    make = {"bad": False, "high": 0, "kind": "normal", "requires_grad": False}
    make.update(role="input", specials=False, layout="contiguous", scale=2.0)
    inputs = [
        {**make, "dtype": "int64", "seed": 1, "shape": [5, 7, 4]},
        {**make, "dtype": "float32", "seed": 2, "shape": [1, 5, 1, 1]},
        {**make, "dtype": "float32", "seed": 3, "shape": [1], "scale": 0.05},
    ]

    def spec(first: dict[str, Any]) -> dict[str, Any]:
        ops = [
            first,
            {"args": [1000], "kind": "torch.reciprocal", "out": 1001, "params": []},
            {
                "args": [1001, 1, 2],
                "kind": "F.conv2d",
                "out": 1002,
                "params": [["dilation", 1], ["groups", 1], ["padding", 0], ["stride", 1]],
            },
        ]
        program = {"grad": False, "inputs": inputs, "ops": ops, "outputs": [1002]}
        return {
            "family": "program",
            "program": program,
            "params": [1],
            "buffers": [0],
            "loss_outputs": [],
        }

    integer = {"args": [0], "kind": "torch.full_like", "out": 1000, "params": [["s", 3]]}
    assert fuzz.training_case._program_trains(spec(integer), 3) == []
    floating = {"args": [1], "kind": "torch.full_like", "out": 1000, "params": [["s", 3]]}
    assert fuzz.training_case._program_trains(spec(floating), 3) == [0]


# Found by seed 130 (case 14) once the fuzzer edits the optimizer's state: an eager
# step by hand with a fused AdamW between two train_steps over one module; the fused
# kernel bumps no version counter, so its writes were overwritten at the next step.
def test_an_eager_fused_step_between_train_steps_is_taken_up() -> None:
    assert check_case(generate_case(130, 14)).status == OK


def _records(case: Case) -> tuple[dict[str, Any], Any, Any, Any]:
    """The namespace of ``case`` and the records of its eager, float64 and train_step
    twins."""
    namespace = namespace_of(case, HARNESS_SOURCE)
    model = namespace["make_model"]()
    twins = []
    for kind, m, kwargs in (
        ("EagerTwin", copy.deepcopy(model), {}),
        ("EagerTwin", copy.deepcopy(model).double(), {"dtype": torch.float64}),
        ("StepTwin", copy.deepcopy(model), {}),
    ):
        twin = namespace[kind](m, **kwargs)
        namespace["run"](twin)
        twins.append(twin.records)
    return namespace, *twins


def test_a_broken_comparison_is_found() -> None:
    """The small run agrees; a parameter of the train_step twin moved by 1e-3 before the
    comparison (check_case's ``tamper``) is a ``model`` failure; and so is each record
    of the run changed as a wrong train_step would change it, while a change of rounding
    size is not."""
    case = _case()
    assert check_case(case).status == OK

    def moved(twin: Any) -> None:
        name, value = next(r for r in twin.records if r[0].startswith("model["))
        value.add_(1e-3)

    outcome = check_case(case, tamper=moved)
    assert outcome.status == FAIL, outcome
    assert outcome.where == "model['l0.weight']", outcome
    assert outcome.signature == "model:Adam:amsgrad", outcome

    namespace, eager, reference, ours = _records(case)
    first = namespace["first_difference"]
    assert first(ours, eager, reference) is None

    def changed(name: str, value: Any) -> list[tuple[str, Any]]:
        return [(n, value if n == name else v) for n, v in ours]

    by_name = dict(ours)
    loss = by_name["loss[2]"]
    assert first(changed("loss[2]", loss * (1 + 1e-7)), eager, reference) is None
    cases = {
        "loss[2]": (loss * 1.01, "loss:Adam:bad_batch+lr+validate"),
        "val[2]": (by_name["val[2]"] + 0.01, "val:Adam:bad_batch+lr+validate"),
        "bad[1]": (None, "raised:IndexError->nothing"),
        "bad[1].kept": (False, "kept:Adam"),
        "state[0]['exp_avg']": (by_name["state[0]['exp_avg']"] * 1.1, "state:Adam:amsgrad"),
        "groups[1]": ({**by_name["groups[1]"], "lr": 0.5}, "groups:Adam:amsgrad"),
    }
    for name, (value, sig) in cases.items():
        found = first(changed(name, value), eager, reference)
        assert found is not None and found[0] == name, (name, found)
        ours_now, eager_now = dict(changed(name, value)), dict(eager)
        assert fuzz.training.signature(case, name, ours_now, eager_now) == sig
    # Another error type, or another message, is not eager's error.
    raised = by_name["bad[1]"]
    assert raised.type is IndexError and "out of bounds" in raised.message
    other = raised._replace(type=ValueError)
    assert first(changed("bad[1]", other), eager, reference) is not None
    other = raised._replace(message="Target 7 is out of bounds.")
    assert first(changed("bad[1]", other), eager, reference) is not None


def test_a_difference_is_weighed_by_the_float64_run() -> None:
    """A value farther from eager's than the table allows is accepted when it is at
    least as close to the float64 run's (or within the spread of eager's own runs), and
    refused when it is not."""
    namespace = namespace_of(_case(), HARNESS_SOURCE)
    difference = namespace["tensor_difference"]
    tolerance = (1e-4, 1e-5)
    eager = torch.tensor([1.0, 2.0])
    far = torch.tensor([1.01, 2.0])
    assert difference(far, eager, (None, None), tolerance) is not None
    # float64: 1.02; eager is off by 0.02, train_step by 0.01
    assert difference(far, eager, (torch.tensor([1.02, 2.0]).double(), None), tolerance) is None
    # float64 at eager's value, but a nudged eager run 0.01 away: an ill-conditioned case
    nudged = torch.tensor([1.0, 2.01])
    assert difference(far, eager, (eager.double(), nudged), tolerance) is None
    assert difference(far, eager, (eager.double(), eager), tolerance) is not None


def test_upstream_and_refused_cases() -> None:
    """Eager raising on a good batch is upstream (the case is broken, not dynajax); a
    BatchNorm with ``momentum=None`` reads ``float(num_batches_tracked)``, a branch on a
    tensor's value, which train_step refuses as documented."""
    broken = _case()
    broken.model["layers"][0]["in"] = 5  # the batch has 4 features
    outcome = check_case(broken)
    assert outcome.status == UPSTREAM and outcome.signature.startswith("eager:RuntimeError")
    cnn = _case(
        model={
            "family": "cnn",
            "input": {"kind": "float", "shape": [1, 4, 4]},
            "layers": [
                {"kind": "conv", "in": 1, "out": 2, "stride": 1, "bias": False},
                {"kind": "bn", "dim": 2, "momentum": None, "affine": True},
                {"kind": "gap"},
                {"kind": "linear", "in": 2, "out": 3, "bias": True},
            ],
            "loss": {"kind": "ce", "out": 3},
        },
        optimizer={
            "name": "SGD",
            "options": {"lr": 0.1},
            "groups": [{"attrs": ["l0", "l1", "l3"], "options": {}}],
            "held_out": None,
        },
        events=[],
    )
    outcome = check_case(cnn)
    assert outcome.status == REFUSED, outcome
    assert "branches on a tensor's value" in outcome.detail


def test_shrinker_reduces_a_planted_failure() -> None:
    """With a check that fails whenever a ``mode`` event is in the case, a generated case
    with many events and options shrinks to that one event in a plain run."""
    case = next(
        c
        for c in (generate_case(3, i) for i in range(200))
        if any(e["kind"] == "mode" for e in c.events) and len(c.events) >= 4
    )

    def planted(candidate: Case) -> TrainingOutcome:
        modes = [e for e in candidate.events if e["kind"] == "mode"]
        if not modes:
            return TrainingOutcome(OK)
        k = modes[0]["at"]
        return TrainingOutcome(FAIL, f"loss[{k}]", "planted", f"loss:X:mode{k}")

    small, outcome, checked = shrink_case(case, planted(case), seconds=60, check=planted)
    assert [e["kind"] for e in small.events] == ["mode"], small.events
    assert small.steps == small.events[0]["at"] + 1
    assert small.options["scheduler"] is None and small.options["clip"] is None
    assert small.options["accumulate"] == 1 and not small.options["dict_batch"]
    assert len(small.optimizer["groups"]) == 1
    assert set(small.optimizer["options"]) <= {"lr"}
    assert outcome.status == FAIL and checked > 0


def test_reproducer_runs_standalone(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reproducer is a script of torch and dynajax only: here of a run train_step gets
    right, so it passes; its JSON is the case."""
    case = _case(events=[{"at": 2, "kind": "validate", "size": 3}])
    outcome = TrainingOutcome(FAIL, "loss[1]", "example", "loss:Adam:example")
    path = write_training_reproducer(tmp_path, "example", case, outcome, "An example.")
    assert Case.from_json(path.with_suffix(".json").read_text()) == case
    assert "import fuzz" not in path.read_text()
    runpy.run_path(str(path), run_name="__main__")
    assert "train_step agrees with eager" in capsys.readouterr().out


def test_known_training_bugs_have_reasons() -> None:
    for pattern, reason in KNOWN_TRAINING_BUGS.items():
        assert pattern.count(":") >= 2 and len(reason) > 20, pattern


def test_a_supervised_run_goes_on_after_a_case_that_killed_its_child(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``supervise_training`` records a case whose check killed its child as a ``crash``
    failure with a reproducer, starts a new child after it, and adds up the counts."""
    import fuzz.__main__

    kills = {generate_case(CI_SEED, i).to_json() for i in (2, 4)}
    checked: list[int] = []

    def check(case: Case, **kwargs: Any) -> TrainingOutcome:
        checked.append(case.index)
        if case.to_json() in kills:
            raise KeyboardInterrupt  # where XLA would abort the child
        return TrainingOutcome(OK)

    def child(args: list[str]) -> int:
        try:
            return fuzz.__main__.main(["--in-process", *args])
        except KeyboardInterrupt:
            return -6  # SIGABRT

    monkeypatch.setattr(fuzz.training, "check_case", check)
    lines: list[str] = []
    summary = supervise_training(CI_SEED, runs=6, out_dir=tmp_path, log=lines.append, child=child)
    assert checked == [0, 1, 2, 3, 4, 5]
    assert summary.runs == 6 and summary.statuses[OK] == 4 and summary.statuses[FAIL] == 2
    failure = summary.failures["crash:?:process killed by signal 6"]
    assert failure.index == 2 and failure.count == 2 and failure.reproducer is not None
    replayed = Case.from_json((tmp_path / f"seed{CI_SEED}-run2.json").read_text())
    assert replayed == generate_case(CI_SEED, 2)
    assert summary.new_failures == [failure]
    written = json.loads((tmp_path / f"summary-train-seed{CI_SEED}.json").read_text())
    assert written["runs"] == 6
    assert not (tmp_path / f"checking-train-seed{CI_SEED}.json").exists()
    assert any("going on from 3" in line for line in lines)


def test_python_m_fuzz_through_train_step(tmp_path: pathlib.Path) -> None:
    """``python -m fuzz --through train_step`` end to end: its child process checks the
    runs and the parent prints the summary."""
    result = subprocess.run(
        [sys.executable, "-m", "fuzz", "--through", "train_step", "--seed", "1"]
        + ["--programs", "1", "--shrink-seconds", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dynajax train_step fuzz: seed 1, 1 runs" in result.stdout
    assert "ok 1," in result.stdout


def test_parameters_buffers_and_batches_in_other_layouts_agree_with_eager() -> None:
    """Layouts PyTorch hands a compiled step: a program model whose
    parameter is transposed, whose buffer is one value broadcast (stride 0) and whose
    batch input is a view from a storage offset; and a CNN whose model and batches are
    channels_last. train_step agrees with eager on both."""
    from fuzz.program import OUT_BASE, OpRecord, Program, TensorInput

    inputs = (
        TensorInput((4, 3), "float32", 1, layout="transposed"),
        TensorInput((4, 3), "float32", 2, layout="broadcast"),
        TensorInput((4, 3), "float32", 3, layout="offset"),
    )
    ops = (
        OpRecord("torch.mul", (0, 1), (), OUT_BASE),
        OpRecord("torch.add", (OUT_BASE, 2), (), OUT_BASE + 1),
        OpRecord("torch.tanh", (OUT_BASE + 1,), (), OUT_BASE + 2),
    )
    program = Program(inputs, ops, (OUT_BASE + 2,))
    model = {
        "family": "program",
        "program": json.loads(program.to_json()),
        "params": [0],
        "buffers": [1],
        "loss_outputs": [0],
    }
    optimizer = {
        "name": "Adam",
        "options": {"lr": 0.01},
        "groups": [{"attrs": ["p0"], "options": {}}],
        "held_out": None,
    }
    case = _case(model=model, optimizer=optimizer, steps=3, events=[])
    source = case_source(case)
    assert 'layout="transposed"' in source.replace("'", '"'), source
    assert check_case(case).status == OK
    cnn = _case(
        model={
            "family": "cnn",
            "input": {"kind": "float", "shape": [3, 6, 6]},
            "layers": [
                {"kind": "conv", "in": 3, "out": 4, "stride": 1, "bias": True},
                {"kind": "relu"},
                {"kind": "gap"},
                {"kind": "linear", "in": 4, "out": 3, "bias": True},
            ],
            "loss": {"kind": "ce", "out": 3},
        },
        optimizer={
            "name": "SGD",
            "options": {"lr": 0.1, "momentum": 0.9},
            "groups": [{"attrs": ["l0", "l3"], "options": {}}],
            "held_out": None,
        },
        steps=3,
        events=[{"at": 2, "kind": "validate", "size": 3}],
    )
    cnn.options.update(channels_last=True, layout="sliced")
    source = case_source(cnn)
    assert "channels_last" in source and 'relayout(x, "sliced")' in source.replace("'", '"')
    assert check_case(cnn).status == OK


# Found by seed 122 (run 151): ``torch.take`` of a parameter by a 0-d index tensor (a
# batch) in the loss. Eager trains; train_step's trace raised "Pending unbacked symbols
# {u0} not in returned outputs" (PyTorch's decomposition of take indexed in Python,
# which reads a 0-d index as a number).
def test_take_of_a_0d_index_trains_as_eager() -> None:
    class Take(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2))

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return torch.take(self.p, i)

    model = Take()
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    step = dynajax.train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, i: m(i).square().sum()
    )
    for i in (4, 1, 4):
        loss = step(torch.tensor(i))
        eager_opt.zero_grad()
        expected = eager(torch.tensor(i)).square().sum()
        expected.backward()
        eager_opt.step()
        torch.testing.assert_close(torch.from_dlpack(loss), expected.detach())
    step.sync()
    torch.testing.assert_close(model.p.detach(), eager.p.detach())

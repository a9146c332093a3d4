"""The differential fuzzer (``fuzz/``, ``python -m fuzz``): a short seeded run agrees
with eager, and the machinery (generation, shrinking, reproducers) does what it says.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import runpy
import subprocess
import sys
from typing import Any

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import dynajax
import fuzz.check
import fuzz.ops
import fuzz.program
import fuzz.rendering
from fuzz import generate, program_seed, run, source, through_jax
from fuzz.campaign import supervise
from fuzz.check import (
    FAIL,
    NAN_BITS,
    OK,
    RAISED,
    UPSTREAM,
    Mismatch,
    Outcome,
    Verdict,
    check,
    execute,
    fails_like,
)
from fuzz.known_bugs import KNOWN_BUGS
from fuzz.program import OUT_BASE, OpRecord, Program, TensorInput
from fuzz.rendering import to_function
from fuzz.reproducer import write_reproducer
from fuzz.shrink import shrink

CI_SEED, CI_PROGRAMS = 0, 100


def test_seeded_run_agrees_with_eager(tmp_path: pathlib.Path) -> None:
    """Programs 0..99 of seed 0 (about 30 s): every difference from eager is a known bug (or is
    torch.compile's own, the same under aot_eager). A new one fails the test with its
    signature and an (unshrunk) reproducer: shrink it with ``python -m fuzz --seed 0
    --programs 100``, then fix it or record it (``fuzz/known_bugs.py`` and a strict xfail
    in ``tests/test_fuzz_regressions.py``)."""
    summary = run(CI_SEED, programs=CI_PROGRAMS, out_dir=tmp_path, shrink_seconds=0, log=print)
    print("\n".join(summary.lines()))
    assert summary.programs == CI_PROGRAMS
    assert summary.statuses[OK] > CI_PROGRAMS // 2, summary.lines()
    new = [f"{f.signature}: {f.detail}\n  {f.reproducer}" for f in summary.new_failures]
    assert not new, "dynajax differs from eager:\n" + "\n".join(new)
    # ... inputs in every layout, modules' parameters and buffers, indices out of range,
    # and convolutions measured at the first compile among them
    layouts = set(fuzz.program.LAYOUTS) - {"contiguous"}
    wanted = layouts | {"parameter", "buffer", "index out of range", "0-dim", "zero-size"}
    assert wanted <= set(summary.features), summary.lines()
    assert any(m.startswith("convolution:") for m in summary.measured), summary.lines()


def test_seeded_run_through_jax_function_agrees_with_eager(tmp_path: pathlib.Path) -> None:
    """Programs 0..34 of seed 0 through ``dynajax.jax_function`` (``--through
    jax_function``): forward, and ``jax.vjp`` of the JAX function against
    ``torch.autograd``; differences torch.export itself makes are upstream."""
    summary = run(
        CI_SEED,
        programs=35,
        out_dir=tmp_path,
        shrink_seconds=0,
        log=print,
        backend=through_jax.BACKEND,
    )
    print("\n".join(summary.lines()))
    assert summary.programs == 35
    assert summary.statuses[OK] > 26, summary.lines()
    new = [f"{f.signature}: {f.detail}\n  {f.reproducer}" for f in summary.new_failures]
    assert not new, "jax_function differs from eager:\n" + "\n".join(new)
    # ... inputs in other layouts and modules' parameters and buffers among them
    wanted = {"parameter", "buffer", "transposed", "sliced", "channels_last", "offset"}
    assert wanted <= set(summary.features), summary.lines()


def test_programs_are_deterministic_and_round_trip() -> None:
    for i in range(20):
        a, b = generate(program_seed(7, i)), generate(program_seed(7, i))
        assert a == b and source(a) == source(b)
        assert Program.from_json(a.to_json()) == a
    assert generate(program_seed(7, 0)) != generate(program_seed(8, 0))


def _planted_program() -> Program:
    """Six ops over three inputs (strided, half precision, requiring grad); the
    fourth is a cumsum."""
    x0 = TensorInput((4, 6), "float16", seed=1, layout="transposed", requires_grad=True)
    x1 = TensorInput((6,), "float32", seed=2, layout="sliced", requires_grad=True)
    x2 = TensorInput((4, 6), "int32", seed=3)
    v = [OUT_BASE + i for i in range(6)]
    ops = (
        OpRecord("torch.sin", (0,), (), v[0]),
        OpRecord("torch.add", (v[0], 1), (), v[1]),
        OpRecord("Tensor.mul_(scalar)", (v[1],), (("s", 2.0),)),
        OpRecord("torch.mul", (v[1], 2), (), v[2]),
        OpRecord("torch.cumsum", (v[2],), (("dim", 1),), v[3]),
        OpRecord("torch.softmax", (v[3],), (("dim", -1),), v[4]),
        OpRecord("torch.sum", (v[4],), (("dim", 0),), v[5]),
    )
    return Program((x0, x1, x2), ops, (v[5], v[1]), grad=True)


def test_shrinker_reduces_a_planted_failure_to_its_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a comparison that fails whenever a cumsum runs (and eager does not raise),
    the program shrinks to the cumsum alone, on one small contiguous float32 input."""

    def planted(program: Program, backend: object = None) -> Verdict:
        fn = to_function(program)
        if execute(fn, program, 0).error is None:
            if any(r.kind == "torch.cumsum" for r in program.ops):
                return Verdict(FAIL, Mismatch("value", "out[0]", "float32", "planted"))
        return Verdict(OK)

    monkeypatch.setattr(fuzz.check, "run_check", planted)
    program = _planted_program()
    outcome = check(program, classify=False)
    assert outcome.status == FAIL and outcome.mismatch is not None
    small = shrink(program, fails_like(outcome.mismatch))
    assert [r.kind for r in small.ops] == ["torch.cumsum"], source(small)
    (x,) = small.inputs
    assert x.dtype in ("float32", "int64") and x.layout == "contiguous"
    assert not x.requires_grad and not small.grad
    assert x.shape == (1, 1), x


def test_planted_dynajax_bug_is_found_with_its_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong lowering rule (neg as the identity) is a value failure blamed on
    ``torch.neg``, and the reproducer written for it fails on its own."""
    from dynajax.lowering import registry

    op = torch.ops.aten.neg.default
    monkeypatch.setitem(registry._TABLE, op, registry.Rule(op, lambda x: x))
    x0 = TensorInput((3, 4), "float32", seed=5)
    ops = (
        OpRecord("torch.sin", (0,), (), OUT_BASE),
        OpRecord("torch.neg", (OUT_BASE,), (), OUT_BASE + 1),
        OpRecord("torch.exp", (OUT_BASE + 1,), (), OUT_BASE + 2),
    )
    program = Program((x0,), ops, (OUT_BASE + 2,))
    outcome = check(program)
    assert outcome.status == FAIL and outcome.signature == "value:torch.neg:float32"


# A kernel that misreads a dim of stride 0, planted as a user's op: eager's median
# along such a dim read past the element (seed 2, program 840), but what it read there
# depends on the machine and the process's memory (right on some CPUs), so the test
# plants one whose misreading is certain. dynajax runs the op by its JAX rule.
@torch.library.custom_op("dynajax_fuzz_test::misread_mean", mutates_args=())
def misread_mean(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(0, keepdim=True)
    return mean + 1 if x.stride(0) == 0 else mean


@misread_mean.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((1, *x.shape[1:]))


def test_eager_kernel_misreading_strides_is_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager kernel whose answer changes when the same values come contiguous, where
    dynajax gives the answer on the contiguous copy: the difference is upstream."""
    name = "dynajax_fuzz_test::misread_mean"
    kind = fuzz.ops.OpKind(
        name, lambda a, p: f"torch.ops.dynajax_fuzz_test.misread_mean({a[0]})", gen=None
    )
    monkeypatch.setitem(fuzz.ops.KINDS, name, kind)
    dynajax.register_rule(name)(lambda x: jnp.mean(x, 0, keepdims=True))
    try:
        x0 = TensorInput((4, 3), "float32", seed=11, layout="expanded")
        ops = (
            OpRecord(name, (0,), (), OUT_BASE),
            OpRecord("torch.sin", (OUT_BASE,), (), OUT_BASE + 1),
        )
        program = Program((x0,), ops, (OUT_BASE + 1,))
        assert check(program, classify=False).status == FAIL
        outcome = check(program)
        # The same values contiguous: eager and dynajax agree.
        contiguous = dataclasses.replace(x0, layout="contiguous")
        dense = check(dataclasses.replace(program, inputs=(contiguous,)))
    finally:
        dynajax.unregister_rule(name)
    assert outcome.status == UPSTREAM, outcome
    assert dense.status == OK, dense


def test_eager_kernel_reading_uninitialized_memory_is_upstream() -> None:
    """Eager's circular pad that crops a dim to nothing and pads it again copies from
    memory it never wrote (seed 8, program 3697): its answer changes when PyTorch fills
    new memory first, so a difference from it is classified upstream."""
    x = torch.zeros(1, 1, dtype=torch.int64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        filled = F.pad(x, (-1, 1), "circular")
    finally:
        torch.use_deterministic_algorithms(False)
    premise = "eager's circular pad reads its input only now: plant another such kernel"
    assert int(filled) == torch.iinfo(torch.int64).max, premise
    x0 = TensorInput((1, 1), "int64", seed=3)
    ops = (OpRecord("F.pad", (0,), (("mode", "circular"), ("pad", (-1, 1))), OUT_BASE),)
    program = Program((x0,), ops, (OUT_BASE,))
    assert fuzz.check.eager_reads_uninitialized_memory(program, 0)
    # A kernel that reads only what it was given is not. (Not eager's median of a
    # stride-0 dim: it reads past its input, into whatever memory lies there, so filling
    # new memory can change its answer too, depending on the process's allocations; the
    # full suite saw that once.)
    sin = Program(
        (TensorInput((4, 3), "float32", seed=11),),
        (OpRecord("torch.sin", (0,), (), OUT_BASE),),
        (OUT_BASE,),
    )
    assert not fuzz.check.eager_reads_uninitialized_memory(sin, 0)


def test_a_gradient_where_aot_eagers_backward_raises_is_upstream() -> None:
    """An input mutated in place by a value that requires grad (seed 8, program 5018):
    ``aot_eager`` raises in the backward ("modified by an inplace operation"), and
    dynajax, compiling the same backward graph, multiplies the mutated input's zero
    gradient by its -inf: a NaN gradient where eager's is 0. That is classified
    upstream; a gradient dynajax alone gets wrong is not
    (``test_a_wrong_gradient_is_not_amplification``)."""
    x0 = TensorInput((1, 1, 5, 3), "float32", seed=582930704, specials=True, scale=100.0)
    x1 = TensorInput((1, 1, 1, 1), "float32", seed=829131004, requires_grad=True, scale=100.0)
    ops = (
        OpRecord("Tensor.mul_", (0, 1), (), None),
        OpRecord("torch.std", (1,), (("correction", 0), ("dim", (0, 1, 2, 3))), OUT_BASE),
    )
    program = Program((x0, x1), ops, (OUT_BASE,), grad=True)
    control = fuzz.check.run_check(program, "aot_eager").mismatch
    premise = "aot_eager runs this backward now: find another program it raises on"
    assert control is not None and control.kind == "crash", premise
    outcome = check(program)
    assert outcome.status == UPSTREAM, outcome


def test_dynajax_bug_on_a_strided_input_is_still_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong rule (neg as x + 1) on a transposed input is a dynajax failure: eager's
    answer is the same on the contiguous copy, so the strides are not to blame."""
    from dynajax.lowering import registry

    op = torch.ops.aten.neg.default
    monkeypatch.setitem(registry._TABLE, op, registry.Rule(op, lambda x: x + 1))
    x0 = TensorInput((4, 3), "float32", seed=11, layout="transposed")
    program = Program((x0,), (OpRecord("torch.neg", (0,), (), OUT_BASE),), (OUT_BASE,))
    assert not fuzz.check.eager_misreads_strides(program, 0, fuzz.check.dynajax_backend)
    outcome = check(program)
    assert outcome.status == FAIL, outcome


def test_float64_allowance_weighs_roundings_of_the_programs_weakest_dtype() -> None:
    """A float64 value computed from float32 ones (seed 3, program 5703: a float64
    scalar's gradient through a float32 cumprod, 0-dim tensors not promoting) carries
    float32 roundings: the float64 allowance adds float32's atol for such a program, and
    only float64's for a program wholly in float64."""
    from fuzz.check import _References
    from tests.tolerances import tolerance

    def atol(*dtypes: str) -> float:
        inputs = tuple(TensorInput((2,), d, seed=i) for i, d in enumerate(dtypes))
        program = Program(inputs, (OpRecord("torch.sin", (0,), (), OUT_BASE),), (OUT_BASE,))
        return _References(program, to_function(program), 0, "eager").weakest_atol()

    assert atol("float32", "float64") == tolerance(torch.float32)[1]
    assert atol("float64", "int64") == tolerance(torch.float64)[1]
    assert atol("bfloat16", "float64") == tolerance(torch.bfloat16)[1]


def test_reproducer_runs_standalone(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reproducer is a script: here of a program dynajax gets right, so it passes."""
    program = _planted_program()
    assert check(program, classify=False).status == OK
    outcome = Outcome(FAIL, Mismatch("value", "out[0]", "float32", "example"))
    path = write_reproducer(tmp_path, "example", program, outcome, "An example.")
    assert Program.from_json(path.with_suffix(".json").read_text()) == program
    runpy.run_path(str(path), run_name="__main__")
    assert "dynajax agrees with eager" in capsys.readouterr().out


def test_reproducer_of_a_jax_function_failure_replays_through_jax_function(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: a reproducer of a failure found ``--through jax_function`` ran the program
    through ``torch.compile`` and passed (seed 11, program 981); it replays it through
    jax_function now. Here a program eager refuses (an in-place write into a leaf that
    requires grad), which only the jax_function harness calls ``refused``."""
    x0 = TensorInput((3, 4), "float32", seed=1, requires_grad=True)
    program = Program((x0,), (OpRecord("Tensor.mul_(scalar)", (0,), (("s", 2.0),)),), (0,))
    outcome = Outcome(FAIL, Mismatch("raises", "op 0", "RuntimeError->nothing", "example"))
    path = write_reproducer(tmp_path, "example", program, outcome, "An example.", "jax_function")
    assert "torch.compile" not in path.read_text().split("def main():")[1]
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(path), run_name="__main__")
    assert exited.value.code == 0
    assert "status: refused" in capsys.readouterr().out


def test_known_bugs_have_reasons() -> None:
    for signature, reason in KNOWN_BUGS.items():
        assert signature.count(":") >= 2 and len(reason) > 20, signature


def test_gradient_amplified_by_later_ops_is_accepted() -> None:
    """Seed 4, program 6025: log2 of lgamma in float32, whose gradient is 1 / (lgamma(x)
    ln 2) * digamma(x), near lgamma's zero. Each op alone and each op's gradient alone
    agrees with eager within the table; the program's gradient, which divides by a
    value near 0, is then amplified, and accepted as such."""
    x0 = TensorInput((1, 1), "float32", seed=2073166533, requires_grad=True)
    ops = (
        OpRecord("torch.lgamma", (0,), (), OUT_BASE),
        OpRecord("torch.log2", (OUT_BASE,), (), OUT_BASE + 1),
    )
    outcome = check(Program((x0,), ops, (OUT_BASE + 1,), grad=True), classify=False)
    assert outcome.status == OK, outcome
    assert "amplified" in outcome.accepted, outcome


def test_a_wrong_gradient_is_not_amplification(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong backward (sin's gradient reads cos, planted 3% off) shows in that op's
    gradient alone, so the amplification allowance does not accept it."""
    from dynajax.lowering import registry

    op = torch.ops.aten.cos.default
    monkeypatch.setitem(registry._TABLE, op, registry.Rule(op, lambda x: 1.03 * jnp.cos(x)))
    x0 = TensorInput((4,), "float32", seed=5, requires_grad=True)
    ops = (
        OpRecord("torch.exp", (0,), (), OUT_BASE),
        OpRecord("torch.sin", (OUT_BASE,), (), OUT_BASE + 1),
    )
    program = Program((x0,), ops, (OUT_BASE + 1,), grad=True)
    assert not fuzz.check.amplified(program, 0, fuzz.check.dynajax_backend, grads=True)
    outcome = check(program, classify=False)
    assert outcome.status == FAIL and outcome.mismatch is not None, outcome
    assert outcome.mismatch.kind == "grad", outcome


def test_a_run_leaves_the_program_that_killed_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The program being checked is on disk while it is checked: a process that dies
    inside a check (an XLA abort) leaves it behind, and ``start`` goes on past it."""
    import fuzz.campaign

    checked: list[str] = []

    def dies_on_the_second(program: Program, *args: object, **kwargs: object) -> Outcome:
        checked.append(program.to_json())
        if len(checked) == 2:
            raise KeyboardInterrupt  # as good as the process dying, for the file
        return Outcome(OK)

    monkeypatch.setattr(fuzz.campaign, "check", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        run(CI_SEED, programs=3, start=5, out_dir=tmp_path, log=lambda _: None)
    left = tmp_path / f"checking-seed{CI_SEED}.json"
    assert Program.from_json(left.read_text()).to_json() == checked[1]
    assert json.loads(left.read_text())["index"] == 6
    assert checked[0] == generate(program_seed(CI_SEED, 5)).to_json()
    summary = run(CI_SEED, programs=2, start=7, out_dir=tmp_path, log=lambda _: None)
    assert summary.programs == 2 and not left.exists()
    assert checked[-1] == generate(program_seed(CI_SEED, 8)).to_json()


def test_a_supervised_run_goes_on_after_a_program_that_killed_its_child(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``supervise`` records a program whose check killed a child as a ``crash``
    failure with a reproducer, and one whose generation (eager ops) killed it as
    eager's own crash, and starts a new child after each; the counts of every child
    add up."""
    import fuzz.__main__
    import fuzz.campaign

    kills = {generate(program_seed(CI_SEED, i)).to_json() for i in (3, 6)}
    eager_kills = program_seed(CI_SEED, 5)
    checked: list[str] = []

    def check(program: Program, *args: object, **kwargs: object) -> Outcome:
        checked.append(program.to_json())
        if program.to_json() in kills:
            raise KeyboardInterrupt  # where XLA would abort the child
        return Outcome(OK)

    def generating(seed: int, **kwargs: Any) -> Program:
        if seed == eager_kills:
            raise KeyboardInterrupt  # where an eager kernel would segfault
        return generate(seed, **kwargs)

    def child(args: list[str]) -> int:
        try:
            return fuzz.__main__.main(["--in-process", *args])
        except KeyboardInterrupt:
            return -6  # SIGABRT

    monkeypatch.setattr(fuzz.campaign, "check", check)
    monkeypatch.setattr(fuzz.campaign, "generate", generating)
    lines: list[str] = []
    summary = supervise(
        CI_SEED, programs=8, start=1, out_dir=tmp_path, log=lines.append, child=child
    )
    expected = [generate(program_seed(CI_SEED, i)).to_json() for i in (1, 2, 3, 4, 6, 7, 8)]
    assert checked == expected
    assert summary.programs == 8
    assert summary.statuses[OK] == 5
    assert summary.statuses[FAIL] == 2 and summary.statuses[UPSTREAM] == 1
    failure = summary.failures["crash:?:process killed by signal 6"]
    assert failure.index == 3 and failure.count == 2
    assert failure.reproducer is not None
    replayed = Program.from_json((tmp_path / f"seed{CI_SEED}-program3.json").read_text())
    assert replayed.to_json() == generate(program_seed(CI_SEED, 3)).to_json()
    eagers = summary.failures["crash:generate:eager killed the process (signal 6)"]
    assert eagers.status == UPSTREAM and eagers.index == 5 and eagers.reproducer is None
    assert summary.new_failures == [failure]
    written = json.loads((tmp_path / f"summary-seed{CI_SEED}.json").read_text())
    assert written["programs"] == 8
    assert not (tmp_path / f"checking-seed{CI_SEED}.json").exists()
    assert not (tmp_path / f"run-seed{CI_SEED}.json").exists()
    assert any("going on from 6" in line for line in lines)
    assert any("going on from 7" in line for line in lines)


def test_python_m_fuzz_checks_in_a_child_process(tmp_path: pathlib.Path) -> None:
    """``python -m fuzz`` end to end: its child process checks the programs and the
    parent prints the summary."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fuzz",
            "--seed",
            str(CI_SEED),
            "--programs",
            "3",
            "--shrink-seconds",
            "0",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"dynajax fuzz: seed {CI_SEED}, 3 programs" in result.stdout


# ---------------------------------------------------------------------------------
# Inputs in every layout PyTorch hands a compiled graph
# ---------------------------------------------------------------------------------


def test_every_layout_is_rebuilt_from_its_description() -> None:
    """Each layout gives the shape asked for, the strides and storage it names, the
    same tensor again from the same description (so a reproducer's ``make_input``
    call rebuilds it), and survives the program's JSON."""
    from fuzz.program import INPUT_SOURCE, LAYOUTS, input_call, layout_fits, make_input

    namespace: dict[str, Any] = {"torch": torch}
    exec(INPUT_SOURCE, namespace)
    for layout in LAYOUTS:
        candidates = [(), (3,), (2, 3), (2, 3, 4), (2, 3, 4, 5), (0, 3)]
        shapes = [s for s in candidates if layout_fits(layout, s)]
        assert shapes, layout
        for shape in shapes:
            spec = TensorInput(shape, "float32", seed=3, layout=layout)
            t = make_input(spec)
            assert t.shape == shape
            again = eval(input_call(spec), {**namespace, "call": 0})
            assert torch.equal(t, again) and t.stride() == again.stride(), layout
            assert t.storage_offset() == again.storage_offset()
    t = make_input(TensorInput((2, 3, 4, 5), "float32", 1, layout="channels_last"))
    assert t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    assert make_input(TensorInput((4, 3), "float32", 1, layout="broadcast")).stride() == (0, 0)
    overlapping = make_input(TensorInput((3, 4), "float32", 1, layout="overlapping"))
    assert overlapping.untyped_storage().nbytes() // 4 < overlapping.numel()
    assert make_input(TensorInput((3, 4), "float32", 1, layout="offset")).storage_offset() > 0
    inputs = (
        TensorInput((4, 3), "float32", 1, layout="overlapping", role="parameter"),
        TensorInput((2,), "int64", 2, kind="index", high=3, bad=True, role="buffer"),
    )
    program = Program(inputs, (OpRecord("torch.take", (0, 1), (), OUT_BASE),), (OUT_BASE,))
    assert Program.from_json(program.to_json()) == program and program.module


def test_an_index_out_of_range_is_drawn_now_and_then() -> None:
    """A ``bad`` index input holds one index out of range on some calls' values (each
    call draws its own), and eager's check raises there."""
    from fuzz.program import make_input

    spec = TensorInput((5,), "int64", seed=0, kind="index", high=3, bad=True)
    out_of_range = [
        bool(((t < 0) | (t >= 3)).any())
        for t in (make_input(dataclasses.replace(spec, seed=s)) for s in range(40))
    ]
    assert 10 < sum(out_of_range) < 35, out_of_range


def _bad_index(high: int) -> TensorInput:
    """An index input out of range on the first call's values."""
    from fuzz.program import make_input

    for seed in range(100):
        spec = TensorInput((3,), "int64", seed=seed, kind="index", high=high, bad=True)
        t = make_input(spec)
        if bool(((t < 0) | (t >= high)).any()):
            return spec
    raise AssertionError("no seed draws an index out of range")


def test_a_missing_value_check_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """An index out of range into ``index_select``: eager raises, and dynajax raises
    eager's error (``raised``); with the rule's bounds check planted away, dynajax
    returns numbers where eager raises, a failure."""
    from dynajax.lowering import checks

    x0 = TensorInput((4, 3), "float32", seed=1, layout="transposed")
    ops = (OpRecord("torch.index_select", (0, 1), (("dim", 0),), OUT_BASE),)
    program = Program((x0, _bad_index(4)), ops, (OUT_BASE,))
    assert check(program, classify=False).status == fuzz.check.RAISED
    # (with the persistent cache off: the program compiled above would be loaded)
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", "")
    monkeypatch.setattr(checks, "fail_if_out_of_bounds", lambda *args, **kwargs: None)
    outcome = check(program, classify=False)
    assert outcome.status == FAIL and outcome.mismatch is not None, outcome
    assert outcome.mismatch.kind == "raises", outcome


def test_a_write_outside_an_inputs_view_is_found() -> None:
    """The elements of an input's storage outside its view (a sliced input, one from a
    storage offset) must be left as eager leaves them: a backend that writes there
    after the call is caught (``storage[i]``), and aot_eager is not."""
    x0 = TensorInput((4, 3), "float32", seed=1, layout="sliced")
    x1 = TensorInput((4, 3), "float32", seed=2, layout="offset")
    ops = (OpRecord("Tensor.add_", (0, 1), (), None), OpRecord("torch.sin", (0,), (), OUT_BASE))
    program = Program((x0, x1), ops, (OUT_BASE,))

    def clobbering() -> Any:
        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            def run(*args: Any) -> Any:
                out = gm(*args)
                for a in args:
                    if isinstance(a, torch.Tensor) and a.storage_offset() > 0:
                        a.as_strided((1,), (1,), 0).fill_(7.0)  # the element before it
                return out

            return run

        return backend

    assert check(program, "aot_eager", classify=False).status == OK
    outcome = check(program, clobbering, classify=False)
    assert outcome.status == FAIL and outcome.mismatch is not None, outcome
    assert outcome.mismatch.where.startswith("storage["), outcome


def test_a_module_program_compiles_its_state_as_parameters_and_buffers(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program whose inputs are a module's parameter (transposed, requiring grad)
    and buffer (expanded, written in place) runs as ``torch.compile(model)``: it agrees
    with eager, gradients of the parameter included; its reproducer (a ``Module``)
    passes standalone; and a wrong rule on the parameter's op is found."""
    from dynajax.lowering import registry
    from fuzz.rendering import ModuleProgram

    x0 = TensorInput(
        (4, 3), "float32", 1, layout="transposed", requires_grad=True, role="parameter"
    )
    x1 = TensorInput((4, 3), "float32", 2, layout="broadcast")
    x2 = TensorInput((4, 3), "float32", 3, layout="offset", role="buffer")
    v = [OUT_BASE + i for i in range(2)]
    ops = (
        OpRecord("torch.add", (0, 1), (), v[0]),
        OpRecord("Tensor.mul_", (2, 1), (), None),
        OpRecord("torch.mul", (v[0], 2), (), v[1]),
    )
    program = Program((x0, x1, x2), ops, (v[1],), grad=True)
    assert isinstance(fuzz.rendering.to_function(program), ModuleProgram)
    assert check(program, classify=False).status == OK
    assert check(program, through_jax.BACKEND, classify=False).status == OK
    outcome = Outcome(FAIL, Mismatch("value", "out[0]", "float32", "example"))
    path = write_reproducer(tmp_path, "module", program, outcome, "An example.")
    assert "class Module(torch.nn.Module)" in path.read_text()
    runpy.run_path(str(path), run_name="__main__")
    assert "dynajax agrees with eager" in capsys.readouterr().out
    op = torch.ops.aten.add.Tensor
    monkeypatch.setenv("DYNAJAX_CACHE_DIR", "")  # (else the program compiled above loads)
    monkeypatch.setitem(registry._TABLE, op, registry.Rule(op, lambda x, y, alpha=1: x - y))
    wrong = check(program, classify=False)
    assert wrong.status == FAIL, wrong


def test_shrinker_makes_layouts_and_state_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted failure that needs only a cumsum shrinks to a contiguous argument:
    no layout, no module state, no index out of range."""

    def planted(program: Program, backend: object = None) -> Verdict:
        if any(r.kind == "torch.cumsum" for r in program.ops):
            return Verdict(FAIL, Mismatch("value", "out[0]", "float32", "planted"))
        return Verdict(OK)

    monkeypatch.setattr(fuzz.check, "run_check", planted)
    x0 = TensorInput((4, 6), "float32", 1, layout="overlapping", role="parameter")
    x1 = TensorInput((2,), "int64", 2, kind="index", high=4, layout="broadcast", bad=True)
    ops = (
        OpRecord("torch.index_select", (0, 1), (("dim", 0),), OUT_BASE),
        OpRecord("torch.cumsum", (0,), (("dim", 1),), OUT_BASE + 1),
    )
    program = Program((x0, x1), ops, (OUT_BASE, OUT_BASE + 1))
    outcome = check(program, classify=False)
    assert outcome.mismatch is not None
    small = shrink(program, fails_like(outcome.mismatch))
    assert [r.kind for r in small.ops] == ["torch.cumsum"], source(small)
    (x,) = small.inputs
    assert (x.layout, x.role, x.bad) == ("contiguous", "input", False), x


# Programs of seed 0 past the CI run's with every layout and every measured op: every op
# whose placement the backend measures at the first compile (convolutions over a
# channels_last batch and their backward, a transposed one, a large attention kept
# whole, the fused encoder layer), module programs whose parameters and buffers are
# transposed, broadcast or overlapping, indices out of range into ops with value checks.
LAYOUT_PROGRAMS = (125, 141, 144, 173, 176, 181, 200)


def test_programs_with_layouts_and_measured_ops_agree_with_eager() -> None:
    """Each program of ``LAYOUT_PROGRAMS`` agrees with eager (or raises eager's error,
    or is torch.compile's own); between them they hold every layout, a module's state
    and indices out of range, and the backend measured each kind of op it measures.
    If the generator changed, pick the programs again (``fuzz.campaign.features``, the
    ops)."""
    import fuzz.campaign

    seen: set[str] = set()
    measured: set[str] = set()
    statuses = []
    for index in LAYOUT_PROGRAMS:
        program = generate(program_seed(CI_SEED, index))
        outcome = check(program)
        assert outcome.status != FAIL or outcome.signature in KNOWN_BUGS, (index, outcome)
        assert outcome.verdict is not None
        seen |= fuzz.campaign.features(program)
        measured |= {m.split(":")[0] for m in outcome.verdict.measured}
        statuses.append(outcome.status)
    wanted = {"parameter", "buffer", "channels_last", "permuted", "transposed"}
    assert wanted | {"index out of range"} <= seen, seen
    assert seen & {"expanded", "broadcast", "overlapping"}, seen  # memory shared
    ops = {"convolution", "_transformer_encoder_layer_fwd"}
    assert ops | {"_scaled_dot_product_flash_attention_for_cpu"} <= measured, measured
    assert fuzz.check.RAISED in statuses, statuses


def test_a_parameter_written_by_a_value_that_requires_grad_is_loaded_again() -> None:
    """Was (seed 104, program 469): a parameter that requires no grad, written in place
    by one that does, is no longer a leaf after the call, and loading the next call's
    values into it raised in the harness, which ended the run."""
    x0 = TensorInput((2,), "float32", 1)
    x1 = TensorInput((2,), "float32", 2, requires_grad=True, role="parameter")
    x2 = TensorInput((2,), "float32", 3, layout="sliced", role="parameter")
    program = Program((x0, x1, x2), (OpRecord("Tensor.add_", (2, 1), (), None),), (0,))
    assert check(program).status == OK


def test_a_check_that_raises_is_a_harness_failure_and_the_run_goes_on(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fuzz.campaign

    calls: list[int] = []

    def breaks_once(program: Program, *args: object, **kwargs: object) -> Outcome:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the checker broke")
        return Outcome(OK)

    monkeypatch.setattr(fuzz.campaign, "check", breaks_once)
    summary = run(CI_SEED, programs=3, out_dir=tmp_path, log=lambda _: None)
    assert summary.programs == 3 and summary.statuses[OK] == 2
    (failure,) = summary.failures.values()
    assert failure.signature == "harness:RuntimeError:the checker broke", failure
    assert failure.reproducer is not None


def test_zero_of_a_stride_0_input_is_eagers() -> None:
    """``x.zero_()`` of a broadcast (stride 0) input: eager fills it; aot_autograd writes
    the functionalized result back with ``copy_``, which refuses memory shared between
    elements (``aot_eager`` raises when it compiles; seed 107, program 192, was
    classified upstream). dynajax runs such a call eagerly now: eager's answer."""
    x0 = TensorInput((3,), "float32", 1, layout="broadcast")
    ops = (OpRecord("Tensor.zero_", (0,), (), None), OpRecord("torch.sin", (0,), (), OUT_BASE))
    program = Program((x0,), ops, (OUT_BASE,))
    outcome = check(program)
    assert outcome.status == OK, outcome


def test_an_expanded_input_index_added_in_place_raises_eagers_overlap_error() -> None:
    """Seed 123, program 480: ``x.index_add_(0, i, v)`` into an expanded int64 input
    with an index out of range: eager refuses the overlapping input (RuntimeError)
    before it reads an index; dynajax's value check raised IndexError."""
    inputs = (
        TensorInput((1,), "bool", 933766470),
        TensorInput((2,), "int64", 1864912578, layout="expanded", kind="index", high=2),
        TensorInput((2,), "int64", 1417883997, kind="index", high=2, bad=True),
        TensorInput((2,), "int64", 1111701215),
    )
    ops = (OpRecord("Tensor.index_add_", (1, 2, 3), (("alpha", 1), ("dim", 0)), None),)
    outcome = check(Program(inputs, ops, (0,)))
    assert outcome.status == RAISED, outcome  # eager's error, by both
    assert outcome.verdict is not None and outcome.verdict.jax_ops  # contiguous: in JAX


def _nan_bits_program() -> Program:
    """``torch.div(x, y, rounding_mode="floor").view(torch.int32)`` with -inf among x
    (seed 123, program 3350): the NaN's bits."""
    inputs = (
        TensorInput((5, 5, 1), "float32", 742525216, specials=True),
        TensorInput((5, 5, 1), "float32", 1722284132),
    )
    ops = (
        OpRecord("torch.div(floor)", (0, 1), (), OUT_BASE),
        OpRecord("Tensor.view(dtype)", (OUT_BASE,), (("dtype", "int32"),), OUT_BASE + 1),
    )
    return Program(inputs, ops, (OUT_BASE + 1,))


def test_a_nans_bits_may_differ_as_eagers_own_do() -> None:
    x = torch.full((25,), -math.inf)
    bits = torch.div(x, torch.ones(25), rounding_mode="floor").view(torch.int32)
    premise = "eager's NaN bits no longer depend on the position: remove the allowance"
    assert bits.unique().numel() == 2, premise
    outcome = check(_nan_bits_program())
    assert outcome.status == OK and outcome.accepted == (NAN_BITS,), outcome


def test_integers_that_are_not_nan_bits_must_be_equal() -> None:
    from fuzz.check import _nan_bits_only

    nan = torch.tensor([math.nan, 1.0]).view(torch.int32)
    other_nan = torch.tensor([-math.nan, 1.0]).view(torch.int32)
    assert _nan_bits_only(other_nan, nan)
    assert not _nan_bits_only(other_nan + torch.tensor([0, 1], dtype=torch.int32), nan)
    assert not _nan_bits_only(other_nan.long(), nan.long())  # not a float's bits


def test_unique_indices_out_of_range_are_drawn() -> None:
    """Was (seed 120, program 1034): a ``unique`` index input (a slice of a permutation,
    not contiguous) drawn out of range raised in ``make_input``, and the generator's
    rollback then raised KeyError, which ended the run."""
    from fuzz.program import make_input

    spec = TensorInput((2, 2), "int64", seed=897838375, kind="unique", high=4, bad=True)
    t = make_input(spec)
    assert t.shape == (2, 2) and bool(((t < 0) | (t >= 4)).any()), t
    assert generate(program_seed(120, 1034)).ops


def test_a_program_the_generator_raises_on_is_a_harness_failure_and_the_run_goes_on(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fuzz.campaign

    original = fuzz.campaign.generate
    calls: list[int] = []

    def breaks_once(seed: int, **kwargs: Any) -> Program:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("x1")
        return original(seed, **kwargs)

    monkeypatch.setattr(fuzz.campaign, "generate", breaks_once)
    summary = run(CI_SEED, programs=3, out_dir=tmp_path, log=lambda _: None)
    assert summary.programs == 3 and sum(summary.statuses.values()) == 3
    (failure,) = [f for f in summary.failures.values() if f.signature.startswith("harness")]
    assert failure.signature.startswith("harness:generate:KeyError"), failure
    assert "KeyError: 'x1'" in failure.detail, failure
    assert failure in summary.new_failures

"""A fuzzing run: generate, check, classify, shrink, write reproducers, summarize.

Program ``i`` of a run with seed ``s`` is ``generate(program_seed(s, i))``, so a run is
deterministic for its seed: ``--programs N`` checks the same N programs every time, and
a time-limited run checks a prefix of the same sequence.

Each failure is classified by its signature: the first program with a new signature is
shrunk (unless its signature is a known bug) and gets a reproducer; later programs
with the same signature are counted against it. ``upstream`` failures (the same under
``aot_eager``, or eager misreading its inputs' strides) get an unshrunk reproducer in
``upstream/``: they are PyTorch's, not dynajax's, and are reported apart.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import jax

from fuzz import through_jax
from fuzz.check import (
    FAIL,
    OK,
    RAISED,
    REFUSED,
    UPSTREAM,
    Backend,
    Mismatch,
    Outcome,
    _normalize,
    check,
    dynajax_backend,
    error_text,
    fails_like,
)
from fuzz.generate import generate, program_seed
from fuzz.known_bugs import KNOWN_BUGS
from fuzz.program import CONTIGUOUS, INPUT, Program
from fuzz.reproducer import write_reproducer
from fuzz.shrink import ShrinkStats, shrink

Log = Callable[[str], None]


@dataclasses.dataclass
class Failure:
    """A distinct failure of a run (the first program with its signature).

    Attributes:
        signature: ``kind:op:detail`` (``fuzz.check.signature``).
        status: ``fail`` (dynajax differs from eager) or ``upstream``.
        index: the program's index in the run.
        count: how many programs of the run failed with this signature.
        known: the known-bug reason (``fuzz.known_bugs``), if any.
        reproducer: the reproducer file, if one was written.
        ops: the op count of the program as generated, and as shrunk.
        detail: the first difference, in words.
    """

    signature: str
    status: str
    index: int
    count: int = 1
    known: str | None = None
    reproducer: str | None = None
    ops: tuple[int, int] = (0, 0)
    detail: str = ""


@dataclasses.dataclass
class Summary:
    """What a run did."""

    seed: int
    programs: int = 0
    seconds: float = 0.0
    statuses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    allowances: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    aten_ops: int = 0
    jax_ops: int = 0
    failures: dict[str, Failure] = dataclasses.field(default_factory=dict)
    warnings: dict[str, int] = dataclasses.field(default_factory=dict)
    out_dir: str = ""
    features: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    measured: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def new_failures(self) -> list[Failure]:
        """Distinct dynajax failures that are not known bugs."""
        return [f for f in self.failures.values() if f.status == FAIL and f.known is None]

    def lines(self) -> list[str]:
        """The summary as text."""
        s = self.statuses
        fails = [f for f in self.failures.values() if f.status == FAIL]
        upstream = [f for f in self.failures.values() if f.status == UPSTREAM]
        share = f"{100 * self.jax_ops / self.aten_ops:.1f}%" if self.aten_ops else "-"
        out = [
            f"dynajax fuzz: seed {self.seed}, {self.programs} programs in {self.seconds:.0f} s "
            f"(ATen ops in JAX: {share} of {self.aten_ops})",
            f"  ok {s[OK]}, eager raised and dynajax raised the same {s[RAISED]}, "
            f"failures {s[FAIL]} ({len(fails)} distinct, "
            f"{sum(1 for f in fails if f.known)} known), "
            f"upstream (aot_eager alike, or eager misreads strides) {s[UPSTREAM]} "
            f"({len(upstream)} distinct)",
        ]
        if s[REFUSED]:
            out.append(
                "  refused (jax_function: data-dependent output sizes, named; eager's "
                f"autograd: an in-place write into a leaf or a multi-output view): {s[REFUSED]}"
            )
        if self.allowances:
            used = ", ".join(f"{k} in {n}" for k, n in sorted(self.allowances.items()))
            out.append(f"  allowances used (programs): {used}")
        for title, counter in (
            ("inputs (programs with one)", self.features),
            ("choices measured at the first compile", self.measured),
        ):
            if counter:
                counts = ", ".join(f"{k} {n}" for k, n in sorted(counter.items()))
                out.append(f"  {title}: {counts}")
        if self.warnings:
            out.append("  dynajax warnings (not failures; first program of each):")
            out += [f"    {w[:160]}  (program {i})" for w, i in self.warnings.items()]
        for title, group in (("failures", fails), ("upstream", upstream)):
            if group:
                out.append(f"  {title}:")
            for f in group:
                tag = "known" if f.known else "NEW" if f.status == FAIL else "upstream"
                where = f.reproducer or "(no reproducer)"
                out.append(
                    f"    [{tag}] {f.signature}  x{f.count}  program {f.index}, "
                    f"{f.ops[0]} -> {f.ops[1]} ops  {where}"
                )
        if self.out_dir and self.failures:
            out.append(f"  reproducers in {self.out_dir}/")
        return out

    def to_json(self) -> str:
        """The summary as JSON (``summary-seed<seed>.json`` next to the reproducers)."""
        data = {
            "seed": self.seed,
            "programs": self.programs,
            "seconds": round(self.seconds, 1),
            "statuses": dict(self.statuses),
            "allowances": dict(self.allowances),
            "aten_ops": self.aten_ops,
            "jax_ops": self.jax_ops,
            "failures": [dataclasses.asdict(f) for f in self.failures.values()],
            "warnings": self.warnings,
            "features": dict(self.features),
            "measured": dict(self.measured),
        }
        return json.dumps(data, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, out_dir: str = "") -> Summary:
        """The summary ``to_json`` wrote."""
        data = json.loads(text)
        failures = {}
        for f in data["failures"]:
            failure = Failure(**{**f, "ops": tuple(f["ops"])})
            failures[failure.signature] = failure
        return Summary(
            data["seed"],
            programs=data["programs"],
            seconds=data["seconds"],
            statuses=collections.Counter(data["statuses"]),
            allowances=collections.Counter(data["allowances"]),
            aten_ops=data["aten_ops"],
            jax_ops=data["jax_ops"],
            failures=failures,
            warnings=data["warnings"],
            out_dir=out_dir,
            features=collections.Counter(data.get("features", {})),
            measured=collections.Counter(data.get("measured", {})),
        )


def _shrunk(
    program: Program, outcome: Outcome, seconds: float, backend: Backend, log: Log
) -> tuple[Program, Outcome]:
    """The shrunk program and its outcome (the original if shrinking lost the failure)."""
    assert outcome.mismatch is not None
    stats = ShrinkStats()
    small = shrink(program, fails_like(outcome.mismatch, backend), seconds=seconds, stats=stats)
    log(
        f"    shrunk {len(program.ops)} -> {len(small.ops)} ops "
        f"({stats.checks} candidates{', out of budget' if stats.out_of_budget else ''})"
    )
    final = check(small, backend)
    if final.status != FAIL:
        return program, outcome
    return small, final


def run(
    seed: int,
    *,
    programs: int | None = None,
    minutes: float | None = None,
    out_dir: str | pathlib.Path | None = "fuzz_failures",
    shrink_seconds: float = 90.0,
    max_ops: int = 8,
    backend: Backend = dynajax_backend,
    log: Log = print,
    start: int = 0,
    state: pathlib.Path | None = None,
) -> Summary:
    """Checks programs ``start, start + 1, ...`` of ``seed`` until ``programs`` are done
    or ``minutes`` have passed (whichever comes first; at least one is needed).

    The program being checked is written to ``<out_dir>/checking-seed<seed>.json``
    (with its ``index``) first and removed after: a process that dies inside a check
    (XLA's compiler aborts on some programs) leaves it behind, to replay (``python -m
    fuzz --replay``), and the run goes on with ``start`` past it (``supervise`` does
    that by itself).

    Args:
        seed: the run's seed.
        start: the first program's index.
        programs: how many programs to check.
        minutes: how long to run.
        out_dir: where reproducers go (None: none written, nothing shrunk).
        shrink_seconds: the time budget of each shrink (0: no shrinking).
        max_ops: the most ops a program gets.
        backend: makes the backend under test (a fresh one per program).
        log: prints progress lines.
        state: the summary so far, read if it exists and written after each program
            (for ``supervise``, which writes the final summary itself).
    """
    assert programs is not None or minutes is not None, "give programs or minutes"
    began = time.monotonic()
    deadline = began + 60 * minutes if minutes is not None else float("inf")
    summary = Summary(seed, out_dir=str(out_dir) if out_dir is not None else "")
    if state is not None and state.exists():
        summary = Summary.from_json(state.read_text(), summary.out_dir)
    done_before, seconds_before = summary.programs, summary.seconds
    directory = pathlib.Path(out_dir) if out_dir is not None else None
    checking = directory / f"checking-seed{seed}.json" if directory is not None else None
    index = start
    if start:
        log(f"  from program {start}")
    while (programs is None or index - start < programs) and time.monotonic() < deadline:
        if checking is not None:  # generating runs the program's ops eagerly
            checking.parent.mkdir(parents=True, exist_ok=True)
            checking.write_text(json.dumps({"index": index}))
        try:
            program = generate(program_seed(seed, index), max_ops=max_ops)
        except Exception as e:  # the generator's own bug: recorded, and the run goes on
            _record_generator_error(summary, index, e, log)
            program = None
        if program is not None:
            if checking is not None:
                checking.write_text(json.dumps({"index": index, **json.loads(program.to_json())}))
            try:
                outcome = check(program, backend)
            except Exception as e:  # the harness itself: a failure to look at, not the end
                outcome = harness_failure(e)
            _record(summary, index, program, outcome, directory, shrink_seconds, backend, log)
        index += 1
        summary.programs = done_before + index - start
        summary.seconds = seconds_before + time.monotonic() - began
        if state is not None:
            state.write_text(summary.to_json() + "\n")
        if index % 100 == 0:
            # JAX's tracing caches keep every program's functions alive: 2.5 MB per
            # program without this, 0.6 MB with it (no slower: they are rarely reused).
            jax.clear_caches()
        if index % 50 == 0:
            log(f"  {index} programs, {time.monotonic() - began:.0f} s")
    summary.seconds = seconds_before + time.monotonic() - began
    if checking is not None:
        checking.unlink(missing_ok=True)
    if state is None:
        _write_summary(summary, directory)
    return summary


def _record_generator_error(summary: Summary, index: int, error: Exception, log: Log) -> None:
    """A program the generator raised on: a ``harness`` failure (no program, so no
    reproducer; ``fuzz.generate(fuzz.program_seed(seed, index))`` raises it again)."""
    sig = f"harness:generate:{type(error).__name__}:{_normalize(str(error))[:50]}"
    summary.statuses[FAIL] += 1
    if sig in summary.failures:
        summary.failures[sig].count += 1
        return
    detail = (
        f"fuzz.generate(fuzz.program_seed({summary.seed}, {index})) raised: {error_text(error)}"
    )
    summary.failures[sig] = Failure(sig, FAIL, index, known=KNOWN_BUGS.get(sig), detail=detail)
    log(f"  program {index}: [NEW] {sig}")


def harness_failure(error: Exception) -> Outcome:
    """The outcome of a check that raised itself (not the program under test): a
    ``harness`` failure, so that the run records it and goes on."""
    text = error_text(error)
    sig = f"harness:{type(error).__name__}:{_normalize(str(error))[:50]}"
    return Outcome(FAIL, Mismatch("harness", "the checker", "-", text), signature=sig)


def _write_summary(summary: Summary, directory: pathlib.Path | None) -> None:
    if directory is not None and summary.failures:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"summary-seed{summary.seed}.json").write_text(summary.to_json() + "\n")


def supervise(
    seed: int,
    *,
    programs: int | None = None,
    minutes: float | None = None,
    out_dir: str | pathlib.Path = "fuzz_failures",
    shrink_seconds: float = 90.0,
    max_ops: int = 8,
    start: int = 0,
    log: Log = print,
    child: Callable[[list[str]], int] | None = None,
    through: str = "backend",
) -> Summary:
    """``run``, in child processes: when one dies (XLA's compiler aborts the whole
    process on some programs, SIGABRT), the program it was checking is recorded as a
    ``crash`` failure with a reproducer, and a new child goes on after it.

    ``child`` runs ``python -m fuzz`` with the given arguments and returns its exit
    status (negative: killed by that signal); by default in a new interpreter.
    ``through``: ``"backend"`` (``torch.compile``) or ``"jax_function"``.
    """
    assert programs is not None or minutes is not None, "give programs or minutes"
    directory = pathlib.Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = directory / f"run-seed{seed}.json"
    checking = directory / f"checking-seed{seed}.json"
    state.unlink(missing_ok=True)
    checking.unlink(missing_ok=True)
    began = time.monotonic()
    summary = Summary(seed, out_dir=str(out_dir))
    index = start
    while True:
        args = ["--seed", str(seed), "--start", str(index), "--out", str(out_dir)]
        args += ["--shrink-seconds", str(shrink_seconds), "--max-ops", str(max_ops)]
        args += ["--state", str(state), "--through", through]
        if programs is not None:
            if programs - summary.programs <= 0:
                break
            args += ["--programs", str(programs - summary.programs)]
        if minutes is not None:
            left = minutes - (time.monotonic() - began) / 60
            if left <= 0:
                break
            args += ["--minutes", f"{left:.4f}"]
        status = (child or _child_process)(args)
        if state.exists():
            summary = Summary.from_json(state.read_text(), str(out_dir))
        if status >= 0 or not checking.exists():  # it finished (or died out of a check)
            break
        killed = json.loads(checking.read_text())
        checking.unlink()
        index = killed.pop("index")
        program = Program.from_json(json.dumps(killed)) if "ops" in killed else None
        _record_death(summary, index, program, -status, directory, log, through)
        summary.programs += 1
        state.write_text(summary.to_json() + "\n")
        index += 1
        log(f"  program {index - 1} killed the process (signal {-status}); going on from {index}")
    summary.seconds = time.monotonic() - began
    state.unlink(missing_ok=True)
    _write_summary(summary, directory)
    return summary


def _child_process(args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "fuzz", "--in-process", *args]).returncode


def _record_death(
    summary: Summary,
    index: int,
    program: Program | None,
    signal: int,
    directory: pathlib.Path,
    log: Log,
    through: str = "backend",
) -> None:
    """Records a program that killed the process (checked ``through`` the backend or
    ``jax_function``).

    Killed while checking it: a ``crash`` failure with a reproducer (every such death
    shares one signature per signal: which op did it is not known without running its
    prefixes, each of which may kill the process too). Killed while generating it
    (``program`` None): eager PyTorch's own crash, ``upstream`` (the generator runs
    each op eagerly; seed 9's program 1400 is a float16 grouped ``conv1d`` that makes
    eager's kernel segfault).
    """
    if program is None:
        status, sig = UPSTREAM, f"crash:generate:eager killed the process (signal {signal})"
        detail = (
            f"eager PyTorch killed the process (signal {signal}) while the program was "
            f"generated: fuzz.generate(fuzz.program_seed({summary.seed}, {index}))"
        )
    else:
        status, sig = FAIL, f"crash:?:process killed by signal {signal}"
        detail = f"the process checking it was killed by signal {signal} (an XLA abort: SIGABRT 6)"
    summary.statuses[status] += 1
    if sig in summary.failures:
        summary.failures[sig].count += 1
        return
    failure = Failure(sig, status, index, known=KNOWN_BUGS.get(sig), detail=detail)
    summary.failures[sig] = failure
    log(f"  program {index}: [{'NEW' if status == FAIL else 'upstream'}] {sig}")
    if program is None:
        return
    failure.ops = (len(program.ops), len(program.ops))
    mismatch = Mismatch("crash", "the process", "-", detail)
    outcome = Outcome(FAIL, mismatch, signature=sig)
    option = " --through jax_function" if through == "jax_function" else ""
    origin = (
        f"Found by `python -m fuzz --seed {summary.seed}{option}` (program {index}): "
        f"checking it killed the process (signal {signal}); not shrunk."
    )
    path = write_reproducer(
        directory, f"seed{summary.seed}-program{index}", program, outcome, origin, through
    )
    failure.reproducer = str(path)
    log(f"    reproducer: {path}")


def features(program: Program) -> set[str]:
    """What a program's inputs are, for the summary: their layouts other than
    contiguous, 0-dim and zero-size ones, out-of-range indices, a module's state."""
    out = {spec.layout for spec in program.inputs if spec.layout != CONTIGUOUS}
    for spec in program.inputs:
        if spec.shape == ():
            out.add("0-dim")
        elif 0 in spec.shape:
            out.add("zero-size")
        if spec.bad:
            out.add("index out of range")
        if spec.role != INPUT:
            out.add(spec.role)
    return out


def _record(
    summary: Summary,
    index: int,
    program: Program,
    outcome: Outcome,
    directory: pathlib.Path | None,
    shrink_seconds: float,
    backend: Backend,
    log: Log,
) -> None:
    summary.statuses[outcome.status] += 1
    for allowance in outcome.accepted:
        summary.allowances[allowance] += 1
    summary.features.update(features(program))
    if outcome.verdict is not None:
        summary.aten_ops += outcome.verdict.aten_ops
        summary.jax_ops += outcome.verdict.jax_ops
        summary.measured.update(outcome.verdict.measured)
        for message in outcome.verdict.warnings:
            summary.warnings.setdefault(message, index)
    if outcome.status not in (FAIL, UPSTREAM):
        return
    assert outcome.mismatch is not None
    sig = outcome.signature
    if sig in summary.failures:
        summary.failures[sig].count += 1
        return
    known = KNOWN_BUGS.get(sig)
    failure = Failure(
        sig, outcome.status, index, known=known, ops=(len(program.ops), len(program.ops))
    )
    failure.detail = (
        f"{outcome.mismatch.kind} at {outcome.mismatch.where}: "
        + (outcome.mismatch.detail.strip().splitlines() or [""])[0][:200]
    )
    summary.failures[sig] = failure
    tag = "known" if known else "NEW" if outcome.status == FAIL else "upstream"
    log(f"  program {index}: [{tag}] {sig}")
    if directory is None or known:
        return
    small, small_outcome = program, outcome
    if outcome.status == FAIL and shrink_seconds > 0 and outcome.mismatch.kind != "harness":
        small, small_outcome = _shrunk(program, outcome, shrink_seconds, backend, log)
    failure.ops = (len(program.ops), len(small.ops))
    if small_outcome.signature and small_outcome.signature != sig:
        log(f"    shrunk program's signature: {small_outcome.signature}")
    where = directory if outcome.status == FAIL else directory / "upstream"
    option = " --through jax_function" if backend == through_jax.BACKEND else ""
    origin = (
        f"Found by `python -m fuzz --seed {summary.seed}{option}` (program {index}, "
        f"signature {sig}); shrunk from {len(program.ops)} to {len(small.ops)} ops."
    )
    stem = f"seed{summary.seed}-program{index}"
    small_outcome = dataclasses.replace(small_outcome, signature=sig)
    through = "jax_function" if backend == through_jax.BACKEND else "backend"
    path = write_reproducer(where, stem, small, small_outcome, origin, through)
    failure.reproducer = str(path)
    log(f"    reproducer: {path}")

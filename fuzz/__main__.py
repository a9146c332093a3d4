"""``python -m fuzz``: a differential fuzzing run of dynajax against eager PyTorch.

    python -m fuzz --seed 0 --minutes 30        # until 30 minutes have passed
    python -m fuzz --seed 0 --programs 200      # exactly programs 0..199 of seed 0
    python -m fuzz --replay fuzz_failures/seed0-program17.json   # check one again
    python -m fuzz --seed 0 --minutes 30 --start 6663   # from program 6663 on
    python -m fuzz --seed 0 --minutes 30 --through jax_function   # via jax_function
    python -m fuzz --seed 0 --minutes 30 --through train_step     # training runs

Prints the programs tried, the failures (distinct signatures, known bugs apart) and
where the reproducers are; exits 1 when a failure is new (not in ``fuzz.known_bugs``).
The programs are checked in a child process: a program that kills it (XLA's compiler
aborts the process on some) is a ``crash`` failure, and a new child goes on after it.

``--through train_step`` checks whole training runs instead (``fuzz/training.py``):
``dynajax.train_step`` against the eager loop; ``--programs`` counts runs there.

Every option is at its default (the persistent cache on, cost choices measured), with
the cache and its signing key under temporary ``XDG_CACHE_HOME``/``XDG_CONFIG_HOME``
directories of the run (its children's too), removed at its end: random programs would
fill the user's cache with executables no one reuses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from fuzz import through_jax, training
from fuzz.campaign import run, supervise
from fuzz.check import check, dynajax_backend
from fuzz.program import Program
from fuzz.rendering import source


def _replay(path: str, backend: Any) -> int:
    program = Program.from_json(pathlib.Path(path).read_text())
    print(source(program))
    outcome = check(program, backend)
    print(f"status: {outcome.status}  signature: {outcome.signature or '-'}")
    if outcome.mismatch is not None:
        print(f"{outcome.mismatch.kind} at {outcome.mismatch.where}: {outcome.mismatch.detail}")
    return 0 if outcome.status != "fail" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    parser.add_argument("--minutes", type=float, help="stop after this many minutes")
    parser.add_argument("--programs", type=int, help="stop after this many programs")
    parser.add_argument(
        "--start", type=int, default=0, help="the first program's index (default 0)"
    )
    parser.add_argument(
        "--out", default="fuzz_failures", help="reproducer directory (default fuzz_failures)"
    )
    parser.add_argument(
        "--shrink-seconds", type=float, default=90.0, help="budget per shrink (0: none)"
    )
    parser.add_argument("--max-ops", type=int, default=8, help="most ops per program")
    parser.add_argument("--replay", help="check the program of a reproducer's .json file")
    parser.add_argument(
        "--in-process", action="store_true", help="check in this process (no child process)"
    )
    parser.add_argument(
        "--through",
        choices=["backend", "jax_function", "train_step"],
        default="backend",
        help="what runs the programs: torch.compile with the dynajax backend (default), "
        "or dynajax.jax_function (forward, and jax.grad against torch.autograd); or "
        "train_step: whole training runs through dynajax.train_step against eager's loop",
    )
    parser.add_argument(
        "--optional-events",
        default=",".join(training.OPTIONAL_KINDS),
        help="train_step: the optional event kinds to generate, comma separated "
        f"(default all: {','.join(training.OPTIONAL_KINDS)}; '' for none)",
    )
    parser.add_argument(
        "--float64",
        action="store_true",
        help="train_step: every case in float64 (model, batches, both loops), compared "
        "with eager at 1e-10 relative",
    )
    parser.add_argument("--state", help=argparse.SUPPRESS)  # a child's summary so far
    args = parser.parse_args(argv)
    with _temporary_homes(args.state is None):  # (a child runs in its parent's)
        if args.through == "train_step":
            return _train_step(parser, args)
        return _check_programs(parser, args)


@contextlib.contextmanager
def _temporary_homes(make: bool) -> Iterator[None]:
    """With ``make``, the cache and config homes (``XDG_*``) are temporary directories
    while the run lasts; children inherit them."""
    if not make:
        yield
        return
    names = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME")
    saved = {name: os.environ.get(name) for name in names}
    root = tempfile.mkdtemp(prefix="dynajax-fuzz-")
    try:
        for name in names:
            os.environ[name] = os.path.join(root, name.lower())
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(root, ignore_errors=True)


def _check_programs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The backend and ``jax_function`` modes: random programs against eager."""
    backend: Any = {"backend": dynajax_backend, "jax_function": through_jax.BACKEND}[args.through]
    if args.replay:
        return _replay(args.replay, backend)
    if args.minutes is None and args.programs is None:
        parser.error("give --minutes or --programs")
    options: dict[str, Any] = {
        "programs": args.programs,
        "minutes": args.minutes,
        "out_dir": args.out,
        "shrink_seconds": args.shrink_seconds,
        "max_ops": args.max_ops,
        "start": args.start,
    }
    if args.state:  # a child of supervise: the parent prints the summary
        run(args.seed, state=pathlib.Path(args.state), backend=backend, **options)
        return 0
    if args.in_process:
        summary = run(args.seed, backend=backend, **options)
    else:
        summary = supervise(args.seed, through=args.through, **options)
    print("\n".join(summary.lines()))
    return 1 if summary.new_failures else 0


def _train_step(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--through train_step``: the training fuzzer (``fuzz.training``)."""
    if args.replay:
        return training.replay(args.replay)
    if args.minutes is None and args.programs is None:
        parser.error("give --minutes or --programs")
    optional = tuple(k for k in args.optional_events.split(",") if k)
    unknown = set(optional) - set(training.OPTIONAL_KINDS)
    if unknown:
        parser.error(f"unknown optional event kinds: {sorted(unknown)}")
    options: dict[str, Any] = {
        "runs": args.programs,
        "minutes": args.minutes,
        "out_dir": args.out,
        "shrink_seconds": args.shrink_seconds,
        "start": args.start,
        "optional": optional,
        "float64": args.float64,
    }
    if args.state:  # a child of supervise_training: the parent prints the summary
        training.run_training(args.seed, state=pathlib.Path(args.state), **options)
        return 0
    if args.in_process:
        summary = training.run_training(args.seed, **options)
    else:
        summary = training.supervise_training(args.seed, **options)
    print("\n".join(summary.lines()))
    return 1 if summary.new_failures else 0


if __name__ == "__main__":
    sys.exit(main())

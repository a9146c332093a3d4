"""Standalone reproducer files: plain torch code, the ``torch.compile`` call and the
comparison, runnable with nothing but torch and dynajax installed. A failure found
through ``jax_function`` (``--through jax_function``) is replayed by the fuzzer's own
harness (``fuzz/through_jax.py``: forward, ``jax.vjp`` against autograd, in-place
updates), so its file runs from the repository's root.

The comparison in the file is the tolerance table's (``tests/tolerances.py``, copied
in), without the fuzzer's allowances: a reproducer is only written for a difference
that no allowance accepted, so the plain comparison shows it. It compares what the
fuzzer compares: outputs, inputs after the call and the elements of their storage
outside their views, gradients; a module program is a ``Module`` (its parameters and
buffers loaded with each call's values) compiled as ``torch.compile(model)``.
"""

from __future__ import annotations

import pathlib
import textwrap

from fuzz.check import CALLS, Outcome
from fuzz.program import INPUT, INPUT_SOURCE, Program, input_call
from fuzz.rendering import module_source, source
from tests.tolerances import TOLERANCES

_TEMPLATE = '''"""dynajax fuzz failure: {signature}

{origin}
{kind} at {where} (call {call}):
{detail}

Run: python {filename}
"""

import torch
import torch.nn.functional as F

import dynajax

{input_source}

{program_source}

GRAD = {grad}
ARGS = {args}  # the inputs a call passes (a module's parameters and buffers: load)
TOLERANCES = {{{tolerances}}}  # tests/tolerances.py


def inputs(call):
    return [
{inputs}
    ]


def outside(t):
    """The elements of ``t``'s storage outside its view (in-place writes leave them)."""
    t = t.detach()
    size = t.untyped_storage().nbytes() // t.element_size()
    inside = torch.zeros(size, dtype=torch.bool)
    if t.numel():
        positions = torch.arange(size).as_strided(t.shape, t.stride(), t.storage_offset())
        inside[positions.reshape(-1)] = True
    return t.as_strided((size,), (1,), 0)[~inside].clone()


def same_outside(a, e):
    a, e = outside(a), outside(e)
    if a.is_floating_point():
        return bool(((a == e) | (a.isnan() & e.isnan())).all())
    return torch.equal(a, e)


def run(fn, call, module=None):
    """(error, outputs, inputs after the call, input gradients); a module's state
    loaded with the call's values first."""
    xs = inputs(call)
    if module is not None:
        xs = module.load(xs)
    try:
        out = fn(*[xs[i] for i in ARGS])
        grads = None
        if GRAD:
            leaves = [x for x in xs if x.requires_grad]
            outs = [o for o in out if o.requires_grad]
            if leaves and outs:
                loss = sum(
                    (o * torch.linspace(-1, 2, o.numel(), dtype=torch.float64)
                     .to(o.dtype).view(o.shape)).sum().to(torch.float64)
                    for o in outs
                )
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as e:
        return e, None, xs, None
    return None, out, xs, grads


def same(actual, expected, what):
    if actual is None or expected is None:  # a gradient eager leaves None: zeros match
        present = expected if actual is None else actual
        assert present is None or bool((present == 0).all()), f"{{what}}: None vs nonzero"
        return
    assert actual.dtype == expected.dtype, f"{{what}}: dtype {{actual.dtype}} != {{expected.dtype}}"
    assert actual.shape == expected.shape, f"{{what}}: shape {{actual.shape}} != {{expected.shape}}"
    if "out[" in what:
        assert actual.requires_grad == expected.requires_grad, f"{{what}}: requires_grad"
    rtol, atol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol,
                               equal_nan=True, msg=lambda m: f"{{what}}: {{m}}")


def main():
{setup}
    for call in {calls}:
        e_err, e_out, e_in, e_grads = run(eager, call, eager_module)
        c_err, c_out, c_in, c_grads = run(compiled, call, compiled_module)
        if e_err is not None:
            assert isinstance(c_err, type(e_err)), (
                f"call {{call}}: eager raised {{e_err!r}}, dynajax {{c_err!r}}"
            )
            continue
        assert c_err is None, f"call {{call}}: dynajax raised {{c_err!r}}"
        assert len(c_out) == len(e_out)
        for i, (a, e) in enumerate(zip(c_out, e_out)):
            same(a, e, f"call {{call}}: out[{{i}}]")
        for i, (a, e) in enumerate(zip(c_in, e_in)):
            same(a, e, f"call {{call}}: inputs[{{i}}]")
            assert same_outside(a, e), f"call {{call}}: storage[{{i}}] outside the view changed"
        assert (c_grads is None) == (e_grads is None), f"call {{call}}: gradients"
        for i, (a, e) in enumerate(zip(c_grads or (), e_grads or ())):
            same(a, e, f"call {{call}}: grad[{{i}}]")
    print("dynajax agrees with eager")


if __name__ == "__main__":
    main()
'''


_JAX_FUNCTION_MAIN = """def main():
    # Found through dynajax.jax_function: replayed by the fuzzer's harness, which runs
    # the program through jax_function (forward, jax.vjp against torch.autograd, in-place
    # updates) and compares with eager; run from the repository's root.
    import pathlib
    import sys

    from fuzz.__main__ import main as fuzz_main

    replay = str(pathlib.Path(__file__).with_suffix(".json"))
    sys.exit(fuzz_main(["--replay", replay, "--through", "jax_function"]))
"""


def reproducer_source(
    program: Program, outcome: Outcome, origin: str, filename: str, through: str = "backend"
) -> str:
    """The text of a standalone reproducer of ``outcome`` on ``program``; ``through``:
    what found it, ``"backend"`` (``torch.compile``) or ``"jax_function"``."""
    m = outcome.mismatch
    assert m is not None
    tolerances = ", ".join(
        f"torch.{str(d).removeprefix('torch.')}: ({rtol!r}, {atol!r})"
        for d, (rtol, atol) in TOLERANCES.items()
    )
    detail = textwrap.indent("\n".join(m.detail.strip().splitlines()[:12]), "    ")
    program_text = source(program).strip()
    backend = '"dynajax"'
    if program.module:
        program_text += "\n\n\n" + module_source(program).strip()
        setup = (
            "    eager_module, compiled_module = Module(), Module()\n"
            f"    eager, compiled = eager_module, torch.compile(compiled_module, backend={backend})"
        )
    else:
        setup = (
            "    eager_module = compiled_module = None\n"
            f"    eager, compiled = program, torch.compile(program, backend={backend})"
        )
    args = [i for i, spec in enumerate(program.inputs) if spec.role == INPUT]
    text = _TEMPLATE.format(
        signature=outcome.signature or m.key,
        origin=origin,
        kind=m.kind,
        where=m.where,
        call=m.call,
        detail=detail.replace('"""', "'''").replace("\\", "\\\\"),
        filename=filename,
        input_source=INPUT_SOURCE.strip(),
        program_source=program_text,
        grad=program.grad,
        args=repr(args),
        setup=setup,
        tolerances=tolerances,
        inputs="\n".join(f"        {input_call(s)}," for s in program.inputs),
        calls=repr(CALLS),
    )
    if through == "jax_function":
        start, end = text.index("def main():"), text.index("\n\nif __name__")
        text = text[:start] + _JAX_FUNCTION_MAIN.rstrip("\n") + text[end:]
    return text


def write_reproducer(
    directory: pathlib.Path,
    stem: str,
    program: Program,
    outcome: Outcome,
    origin: str,
    through: str = "backend",
) -> pathlib.Path:
    """Writes ``<directory>/<stem>.py`` (the reproducer) and ``<stem>.json`` (the
    program, which ``python -m fuzz --replay`` reads); returns the ``.py`` path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.py"
    path.write_text(reproducer_source(program, outcome, origin, str(path), through))
    (directory / f"{stem}.json").write_text(program.to_json() + "\n")
    return path

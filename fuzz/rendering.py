"""Programs as Python: a program's source (the function ``program``, and a module
program's class ``Module``), which reproducers hold, and functions compiled from it.

Rendering an op is the catalog's (``fuzz.ops.render``), which imports the program's
data types (``fuzz.program``): this module sits above both.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fuzz.ops import render
from fuzz.program import INPUT, PARAMETER, Program, name


def source(program: Program, *, fn_name: str = "program", upcast: bool = False) -> str:
    """``program`` as a Python function definition over ``torch`` and ``F``.

    With ``upcast``, every floating dtype the ops name becomes float64: the function is
    then the float64 reference of the program (its inputs come from ``make_input(...,
    upcast=True)``).
    """
    args = ", ".join(name(i) for i in range(len(program.inputs)))
    lines = [f"def {fn_name}({args}):"]
    for rec in program.ops:
        lines.append("    " + render(rec, upcast=upcast))
    outs = "".join(f"{name(o)}, " for o in program.outputs)
    lines.append(f"    return ({outs})")
    return "\n".join(lines) + "\n"


def module_source(program: Program) -> str:
    """The class ``Module`` of a module program (``Program.module``), over ``source``'s
    ``program``: its parameters and buffers are the inputs of those roles, which each
    call's values are loaded into (``load``: ``.data``, so the module's tensors take the
    values' layouts, as ``module.weight.data = w`` does), and its ``forward`` takes the
    other inputs and calls ``program`` with them all."""
    state = tuple((i, spec.role) for i, spec in enumerate(program.inputs) if spec.role != INPUT)
    forward_args = [name(i) for i, spec in enumerate(program.inputs) if spec.role == INPUT]
    call_args = [
        f"self.{name(i)}" if spec.role != INPUT else name(i)
        for i, spec in enumerate(program.inputs)
    ]
    lines = [
        "class Module(torch.nn.Module):",
        '    """The program as a module: the inputs in ``STATE`` its parameters and buffers."""',
        "",
        f"    STATE = {state!r}",
        "",
        "    def __init__(self):",
        "        super().__init__()",
    ]
    for i, role in state:
        if role == PARAMETER:
            lines.append(f"        self.{name(i)} = torch.nn.Parameter(torch.empty(0))")
        else:
            lines.append(f'        self.register_buffer("{name(i)}", torch.empty(0))')
    lines += [
        "",
        "    def load(self, xs):",
        '        """``xs`` (all the program\'s inputs) with the state\'s replaced by this',
        '        module\'s tensors, which now hold their values in their layouts."""',
        "        xs = list(xs)",
        "        for i, role in self.STATE:",
        '            t = getattr(self, f"x{i}")',
        "            if not t.is_leaf:  # written in place by a value that requires grad",
        '                t = torch.nn.Parameter(t.detach()) if role == "parameter" else t.detach()',
        '                setattr(self, f"x{i}", t)',
        "            t.data = xs[i].detach()",
        '            if role == "parameter":',
        "                t.requires_grad_(xs[i].requires_grad)",
        "            xs[i] = t",
        "        return xs",
        "",
        f"    def forward({', '.join(['self', *forward_args])}):",
        f"        return program({', '.join(call_args)})",
    ]
    return "\n".join(lines) + "\n"


def op_index(line: int) -> int:
    """The index of the op on line ``line`` (1-based) of ``source(program)``."""
    return line - 2


class ModuleProgram:
    """A module program (``module_source``) as a function of all of its inputs, which
    ``to_function`` returns for one: ``load`` puts a call's state values into
    ``module`` (and returns the inputs with the module's tensors in their places), and
    a call runs ``target`` (the module itself, or what runs it: ``torch.compile``'s
    module, ``jax_function``'s) on ``forward``'s inputs, or with ``every`` on them all.

    Attributes:
        module: the ``Module`` holding the state.
        target: what a call runs.
        function: the program's function over every input (its code names the file
            the source was compiled under).
        every: ``target`` takes every input, not only ``forward``'s.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        target: Callable[..., Any],
        function: Callable[..., Any],
        *,
        every: bool = False,
    ) -> None:
        self.module, self.target, self.function, self.every = module, target, function, every
        state = {i for i, _ in module.STATE}  # type: ignore[attr-defined]
        self.arguments = [i for i in range(function.__code__.co_argcount) if i not in state]

    def load(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        loaded: list[torch.Tensor] = self.module.load(inputs)  # type: ignore[operator]
        return loaded

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self.every:
            return self.target(*inputs)
        return self.target(*[inputs[i] for i in self.arguments])

    def with_target(
        self, make: Callable[[torch.nn.Module], Callable[..., Any]], *, every: bool = False
    ) -> ModuleProgram:
        """The same program over a new module, run by ``make(module)``."""
        module = type(self.module)()
        return ModuleProgram(module, make(module), self.function, every=every)


def function_of(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The program's Python function behind ``fn`` (a ``ModuleProgram``'s ``function``)."""
    return fn.function if isinstance(fn, ModuleProgram) else fn


_counter = 0


def to_function(program: Program, *, upcast: bool = False) -> Callable[..., Any]:
    """The program as a Python function, compiled from ``source`` under a file name of
    its own that ``linecache`` knows (Dynamo and dynajax's report read source lines);
    for a module program, a ``ModuleProgram`` over a new ``Module``.

    Each call makes a new code object, so Dynamo never reuses another program's guards.
    """
    global _counter
    _counter += 1
    text = source(program, upcast=upcast)
    if program.module:
        text += "\n\n" + module_source(program)
    filename = f"<fuzz program {_counter}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch, "F": F}
    exec(compile(text, filename, "exec"), namespace)
    fn: Callable[..., Any] = namespace["program"]
    if program.module:
        module = namespace["Module"]()
        return ModuleProgram(module, module, fn)
    return fn


def forget_function(fn: Callable[..., Any]) -> None:
    """Drops the ``linecache`` entry of a function made by ``to_function``, and the
    globals Dynamo installed in its namespace (``__compiled_fn_*``, the compiled graphs).

    Dynamo's cleanup hooks, which remove those globals, run when the code object they
    are keyed by dies, which the namespace itself keeps alive through ``fn`` until a
    garbage collection of the cycle; meanwhile each program's executables stayed
    alive, and a 30-minute run ran out of memory maps (``LLVM compilation error:
    Cannot allocate memory`` after 5,500 programs, about 12 maps each).
    """
    fn = function_of(fn)
    linecache.cache.pop(fn.__code__.co_filename, None)
    namespace = fn.__globals__
    for key in namespace:
        if key.startswith("__compiled_fn"):
            namespace[key] = None  # the hook deletes the name when it runs

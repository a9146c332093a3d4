"""A differential fuzzer of dynajax: random PyTorch programs, compiled by dynajax and
run eagerly, must agree (``python -m fuzz``; a tool of the repository, not shipped).

- ``fuzz.program``: a program as data (inputs described by seeds, op records, outputs)
  and its Python source;
- ``fuzz.ops``: the op catalog (how each kind renders and is generated);
- ``fuzz.generate``: random programs, validated op by op by eager PyTorch;
- ``fuzz.check``: eager against compiled, with the documented allowances;
- ``fuzz.through_jax``: the programs through ``dynajax.jax_function`` instead
  (``--through jax_function``), with ``torch.export`` as the upstream control;
- ``fuzz.shrink``: a failing program reduced to a small one failing the same way;
- ``fuzz.reproducer``: standalone reproducer files;
- ``fuzz.known_bugs``: dynajax bugs found and not fixed yet, by signature;
- ``fuzz.campaign``: a run (``python -m fuzz``);
- ``fuzz.training_case``, ``fuzz.training_source``, ``fuzz.training``: whole training
  runs through ``dynajax.train_step`` against the eager loop (``--through train_step``).
"""

from __future__ import annotations

from fuzz.campaign import Summary, run
from fuzz.check import Outcome
from fuzz.generate import generate, program_seed
from fuzz.program import Program
from fuzz.rendering import source

__all__ = ["Outcome", "Program", "Summary", "generate", "program_seed", "run", "source"]

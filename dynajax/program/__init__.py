"""The whole-graph driver (``driver.py``): one ATen graph as one JAX program under its
caller's ``Policy``; ``interpreter.py`` runs the graph over the lowering table, with
host callbacks (``callbacks.py``) for the ops that have no rule."""

from dynajax.program.driver import (
    NEVER,
    Policy,
    Program,
    lower,
    on_cuda,
    run_graph,
)

__all__ = [
    "NEVER",
    "Policy",
    "Program",
    "lower",
    "on_cuda",
    "run_graph",
]

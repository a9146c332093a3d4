"""A torch model as a serialized JAX program (StableHLO): ``dynajax.export``.

    exported = dynajax.export(model, ids, dynamic_shapes=({0: Dim("batch")},))
    exported.save("gpt2.stablehlo")          # loaded and run with jax and numpy only

Why the package is not called ``export``: the public function is ``dynajax.export``,
an attribute of the ``dynajax`` package. A subpackage ``dynajax/export/`` would be
bound to that same attribute the first time anything imports it (``import
dynajax.export.exporter`` sets ``dynajax.export`` to the module), replacing the
function, or be hidden behind it; ``dynajax.stablehlo`` names what it produces instead.
"""

from __future__ import annotations

from dynajax.stablehlo.exporter import ExportedModel, export

__all__ = ["ExportedModel", "export"]

"""FX passes over ATen graphs (torch.fx PassManager of PassBase passes)."""

from dynajax.passes.pipeline import run_passes

__all__ = ["run_passes"]

"""FX passes over ATen graphs (torch.fx ``PassBase`` passes, run in order by
``pipeline.run_pass_list``)."""

from dynajax.passes.pipeline import run_passes

__all__ = ["run_passes"]

"""Training as one XLA program: ``dynajax.train_step`` (``step.py``) and the step's
ATen graph (``graph.py``)."""

from dynajax.training.step import TrainStep, train_step

__all__ = ["TrainStep", "train_step"]

"""A training case as data (``Case``, JSON), and the names its fields hold: what
``fuzz.training_case`` generates and ``fuzz.training_source`` renders as Python."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

# Event kinds that train_step is gaining now (``--optional-events``): on by default.
OPTIONAL_KINDS = ("freeze", "dict_batch", "bad_batch")

BUILTIN_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam",
    "ASGD", "Adadelta", "Adagrad", "RMSprop", "Rprop",
)  # fmt: skip
CUSTOM_OPTIMIZERS = ("MomentumSGD", "SignMomentum")
# The flags that change an optimizer's arithmetic (failure signatures name them).
MODE_FLAGS = ("amsgrad", "maximize", "nesterov", "centered", "decoupled_weight_decay", "fused")


@dataclasses.dataclass
class Case:
    """One training run, as data (JSON-serializable).

    Attributes:
        seed: the fuzzing run's seed; ``index``: the case's index in it.
        values: seeds the model's weights and every batch.
        model: the family, its layers (or program), its input and its loss.
        optimizer: the class name, its options, its param groups (layer indices and
            per-group options) and a layer held out of it (frozen) if any.
        options: ``clip`` and ``accumulate`` (train_step's), ``scheduler``,
            ``autocast``, ``dict_batch``, ``train_mode``, ``batch`` (the batch size),
            ``last_batch`` (a smaller last batch), ``layout`` (the batch input's:
            ``relayout`` in the case's source), ``channels_last`` (a CNN's model and
            batches).
        steps: the number of training steps.
        events: what happens between steps, each ``{"at": k, "kind": ..., ...}``: before
            step ``k`` (``k == steps``: after the last).
    """

    seed: int
    index: int
    values: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    options: dict[str, Any]
    steps: int
    events: list[dict[str, Any]]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Case:
        return Case(**json.loads(text))

    def replace(self, **changes: Any) -> Case:
        """A deep copy with ``changes``."""
        return dataclasses.replace(copy.deepcopy(self), **copy.deepcopy(changes))

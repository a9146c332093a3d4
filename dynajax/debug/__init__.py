"""The accuracy debugger: which op makes a compiled model's answer drift from eager's.

    report = dynajax.debug.compare(model, x, backward=True)
    print(report)          # the first node whose JAX rule disagrees, its op and line

``debugger.py`` (``compare``) runs the model both ways and re-runs each JAX partition
in eager PyTorch, node by node; ``recording.py`` is the backend's recording mode (each
partition's inputs and outputs); ``accuracy.py`` holds the tolerance table and the
float64 criterion that separates "XLA rounds differently" from "the rule is wrong".
"""

from __future__ import annotations

from dynajax.debug.accuracy import Error, as_accurate, distance, tolerance
from dynajax.debug.debugger import (
    AccuracyReport,
    Finding,
    NodeMismatch,
    PartitionCheck,
    check_partition,
    compare,
)
from dynajax.debug.recording import PartitionCall, Recorder, RecordingPartition

__all__ = [
    "AccuracyReport",
    "Error",
    "Finding",
    "NodeMismatch",
    "PartitionCall",
    "PartitionCheck",
    "Recorder",
    "RecordingPartition",
    "as_accurate",
    "check_partition",
    "compare",
    "distance",
    "tolerance",
]

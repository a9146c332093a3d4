"""Reports of what runs where, and why; what-if lists; graph pictures; logging."""

from dynajax.diagnostics.report import GraphReport, PartitionInfo, Report, graph_report
from dynajax.diagnostics.whatif import WhatIf, snapshot_graph

__all__ = ["GraphReport", "PartitionInfo", "Report", "WhatIf", "graph_report", "snapshot_graph"]

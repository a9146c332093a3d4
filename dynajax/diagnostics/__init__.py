"""Reports of what runs where, and why."""

from dynajax.diagnostics.report import GraphReport, PartitionInfo, Report, graph_report

__all__ = ["GraphReport", "PartitionInfo", "Report", "graph_report"]

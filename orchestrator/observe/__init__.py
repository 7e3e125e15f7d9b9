"""Observability: the metrics exporter, progress lines, reading a run directory, the report."""

"""Observability: the metric definitions and exporter, progress lines, reading a run directory,
and the report (its numbers, figures and page)."""

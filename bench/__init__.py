"""Benchmarks for stalwart (run as scripts; see docs/benchmarks.md)."""

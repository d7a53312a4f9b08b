"""Benchmarks beside the package, not installed with it: `python -m benchmarks.NAME` from the repository root."""

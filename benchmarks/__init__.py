"""Reproducible benchmarks (run from the repository root, e.g. `python -m benchmarks.overhead`)."""

"""The benchmarks: each a module run from the project folder as ``python -m benchmarks.<name>``;
what they share (launching runs, reading records, writing docs/benchmarks.md) is ``common``."""

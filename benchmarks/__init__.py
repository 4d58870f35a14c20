"""The benchmarks a user runs, each ``python -m benchmarks.<name> --help`` to say what it measures; what
they share (launching runs, reading records, writing a file under docs/results/) is ``common``."""

"""Example strategies made by subclassing ParaBlock (docs/extending.md).

Run one with ``flwr run . --run-config 'strategy="parablock_flwr.examples.trimmed_mean:TrimmedMeanParaBlock"'``.
"""

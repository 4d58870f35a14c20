"""parablock-flwr: ParaBlock (federated block-coordinate LLM fine-tuning with
communication/computation overlap) on Flower. See docs/algorithm.md."""

__version__ = "0.1.0"

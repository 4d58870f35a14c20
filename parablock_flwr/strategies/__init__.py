"""Server strategies: sequential BCD and ParaBlock (a thin subclass of it)."""

from .fedbcd import FedBCD
from .parablock import ParaBlock

STRATEGIES = {"fedbcd": FedBCD, "parablock": ParaBlock}

__all__ = ["FedBCD", "ParaBlock", "STRATEGIES"]

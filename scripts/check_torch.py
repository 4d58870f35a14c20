"""Fail loudly when transformers would disable the installed torch (it does so with only a warning,
and the failure then shows when a model loads). scripts/install.sh runs this after installing."""

from __future__ import annotations

import importlib.metadata
import logging
import sys

TORCH_MIN = "2.6"  # transformers 5's own minimum (tests/test_install.py holds this to transformers' source)
FIX = (
    f'TORCH_SPEC="torch>={TORCH_MIN}" with the CUDA index of your driver, e.g. '
    'TORCH_SPEC="torch==2.7.1" TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash scripts/install.sh'
)


def main() -> int:
    logging.disable(logging.WARNING)  # transformers' own warning: this script says it in one line instead
    from transformers.utils import is_torch_available

    if is_torch_available():
        return 0
    try:
        have = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        have = "none"
    print(
        f"install: torch {have} is installed; transformers disables torch below {TORCH_MIN}. Fix: {FIX}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m benchmarks.network``: the experiment, with a setup failure as one line."""

import sys

from benchmarks.network import main

try:
    sys.exit(main())
except RuntimeError as error:  # a setup command or a process failed; everything is already cleaned up
    sys.exit(f"network: {error}")

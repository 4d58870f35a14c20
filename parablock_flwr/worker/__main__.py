"""`python -m parablock_flwr.worker --socket PATH` = `parablock-flwr worker --socket PATH`."""

import sys

from ..cli import main

sys.exit(main(["worker", *sys.argv[1:]]))

#!/usr/bin/env bash
# Install (if needed), then run the test suite. Tests start (and stop) every
# SuperLink and Ray process they need.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest "$@"

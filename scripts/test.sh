#!/usr/bin/env bash
# Install (if needed), then run the test suite. Tests start (and stop) every
# SuperLink and Ray process they need. Arguments go to pytest; the fast tier (no
# Flower process, no namespace, nothing of 20 s or more):  bash scripts/test.sh -m "not e2e and not netns and not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest "$@"

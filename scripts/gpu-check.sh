#!/usr/bin/env bash
# Qualify a GPU machine: the node worker on CUDA (bf16 weights, and fp32 where it fits) against
# `parablock-flwr plan`, then a local deployment with one SuperNode per GPU (two on one GPU only
# when two workers fit). Each step runs only where the plan says it fits, else a line says why it
# is skipped; the last line is `gpu-check: PASS (...)` or `gpu-check: FAIL (...)`. Figures and
# logs go under $OUT (default /tmp/parablock-gpu-check).
#
#   bash scripts/gpu-check.sh [MODEL_FOLDER]        # default: a tiny Llama made on the spot
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu-check.sh   # the same steps on the CPU (what the tests run)
#
# Python: $PYTHON, else .venv/bin/python, else python3. A machine without flwr (a bare GPU image
# with torch and transformers only) gets the missing packages from the git-ignored folder
# wheels/ (docs/deployment.md, "The GPU check", says how to fill it): they are
# installed, offline, into a virtual environment under /tmp that sees the system's torch.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import flwr, datasets, flwr_datasets" 2>/dev/null; then
    if [ ! -d wheels ]; then
        echo "gpu-check: FAIL ($PY lacks flwr/datasets and there is no wheels/ folder to install them from)"
        exit 1
    fi
    VENV=${GPU_CHECK_VENV:-/tmp/parablock-gpu-check-venv}
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install --quiet --no-index --find-links wheels --no-deps wheels/*.whl \
        || { echo "gpu-check: FAIL (installing wheels/ into $VENV)"; exit 1; }
    PY=$VENV/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
ARGS=()
[ -z "${GPU_CHECK_DRY_RUN:-}" ] || ARGS+=(--cpu)
exec "$PY" scripts/gpu_check.py "${ARGS[@]}" "$@"

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
# installed, offline, into a virtual environment under /tmp that also sees $PYTHON's torch.
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
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv --without-pip "$VENV" || { echo "gpu-check: FAIL (making a venv at $VENV with $PY)"; exit 1; }
        # $PY may itself be a venv's (a GPU image's /opt/torch/.venv): a new venv's --system-site-packages
        # would show the base interpreter's packages, not that venv's torch. This .pth adds $PY's
        # site-packages (their own .pth files included) after the venv's, so the wheels below come first.
        SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$PY" -c 'import sys; [print(f"import site; site.addsitedir({p!r})") for p in sys.path if p.endswith(("site-packages", "dist-packages"))]' \
            >"$SITE/_gpu_check_base_python.pth"
    fi
    "$VENV/bin/python" -m pip install --quiet --no-index --no-deps --ignore-installed wheels/*.whl \
        || { echo "gpu-check: FAIL (installing wheels/ into $VENV)"; exit 1; }
    PY=$VENV/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
ARGS=()
[ -z "${GPU_CHECK_DRY_RUN:-}" ] || ARGS+=(--cpu)
exec "$PY" scripts/gpu_check.py "${ARGS[@]}" "$@"

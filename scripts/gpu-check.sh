#!/usr/bin/env bash
# The worker path on CUDA with bf16 weights, and a local deployment with 2 workers on 2 devices
# (both on cuda:0 when there is only one). Prints what it measured. Needs a CUDA build of torch
# (TORCH_SPEC=... bash scripts/install.sh); this project's own machines have no GPU, so it has
# not run there. Usage: bash scripts/gpu-check.sh [MODEL]   (default: the embedded SmolLM2-135M)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODEL=${1:-embedded:smollm2-135m-instruct}
OUT=${GPU_CHECK_DIR:-$(mktemp -d -t parablock-gpu-check-XXXX)}

"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA device; install a CUDA build of torch first")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu-check: cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}")
PY

echo "gpu-check: 1. one worker, two rounds on cuda:0 (bf16 weights, fp32 master of x, fp32 block): peak memory"
"$PY" scripts/memory-check.py "$MODEL" --device cuda:0 --weights bf16
"$PY" scripts/memory-check.py "$MODEL" --device cuda:0 --weights fp32
"$PY" scripts/memory-check.py random-1b --device cuda:0 --weights bf16 --micro-batch-size 1 --max-seq-len 512

echo "gpu-check: 2. a local deployment: 2 SuperNodes, their workers on 2 devices, 3 rounds, client evaluation"
GPU_CHECK_MODEL="$MODEL" GPU_CHECK_OUT="$OUT" "$PY" - <<'PY'
import json, os, time
from pathlib import Path

import torch

from parablock_flwr.tools.launch import run_deployment
from parablock_flwr.tools.app_config import GSM_AS_MEASURED

devices = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
out = Path(os.environ["GPU_CHECK_OUT"])
config = {
    "model": os.environ["GPU_CHECK_MODEL"], **GSM_AS_MEASURED, "output-dir": str(out / "runs"), "num-server-rounds": 3,
    "weights": "bf16", "precision": "bf16", "evaluation": "clients", "micro-batch-size": 2,
    "gradient-checkpointing": True, "lr-schedule": "cosine", "lr-schedule-scope": "run", "warmup-steps": 1,
    "verify-invariant": True, "snapshot-every": 2, "generate-examples": 0,
}
started = time.time()
result = run_deployment(out / "flower", config, num_supernodes=2, timeout_s=1800,
                        node_settings=[f'device="{d}"' for d in devices])
print(f"gpu-check: deployment on {devices} exited {result.returncode} after {time.time() - started:.0f} s")
run_dir = result.run_dir
if run_dir is None:
    raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])
from parablock_flwr.metrics import RunRecorder  # noqa: E402  (one merged record per round)
for r in RunRecorder(run_dir).read():
    keep = ("round", "heldout_loss", "train_loss", "round_wall_s", "measured_compute_s", "measured_overlap_share",
            "invariant_checked", "invariant_failed", "truncated_examples")
    print("gpu-check:", json.dumps({k: r[k] for k in keep if k in r}))
print("gpu-check: step log:", sorted(p.name for p in (Path(run_dir) / "global-steps").iterdir()))
PY
echo "gpu-check: done ($OUT)"

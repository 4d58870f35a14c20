"""The GPU check's steps, sized to the GPUs found (scripts/gpu-check.sh runs it; read that first).

Steps, each run only where `parablock-flwr plan` says it fits, else skipped with a line that says why:

1. the plan of the model (bf16 weights) against each GPU's memory;
2. one node worker, two rounds, bf16 weights on the first GPU: its peak memory against the plan;
3. the same with fp32 weights (skipped when the plan says they do not fit);
4. a local deployment (SuperLink, SuperNodes with their workers, `flwr run`), 3 rounds (2 in the dry
   run), bf16 weights, client evaluation, every node accepted and the invariant checked in every
   round: one SuperNode per GPU, or two on one GPU only when two
   workers fit in it.

It ends with one line, ``gpu-check: PASS (...)`` or ``gpu-check: FAIL (...)``, and writes
``summary.json`` and each step's output under OUT. ``--cpu`` runs the same steps on the CPU with
the tests' tiny Llama and a pretend GPU size (``--gpu-memory-gb``): the dry run the tests make.
``--sizing-only`` prints the decisions for a model and ``--gpus N --gpu-memory-gb G`` without
running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


def gpus_found() -> list[tuple[str, int]]:
    """(device, bytes of memory) of every CUDA device."""
    import torch

    return [(f"cuda:{i}", torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())]


def plan_of(model: str, overrides: dict):
    from parablock_flwr.config import RunConfig
    from parablock_flwr.plan import make_plan, model_config, model_shape

    cfg = RunConfig.from_flower({**overrides, "model": model})
    return make_plan(cfg, model_shape(cfg, model_config(model)), num_nodes=2)


def sizing(model: str, overrides: dict, devices: list[tuple[str, int]]) -> dict:
    """What runs where: ``{"bf16": plan, "fp32": plan, "fp32_fits": bool, "nodes": [device, ...]}``."""
    bf16 = plan_of(model, {**overrides, "weights": "bf16"})
    fp32 = plan_of(model, {**overrides, "weights": "fp32"})
    memory = min(m for _, m in devices)
    if len(devices) > 1:
        nodes = [devices[0][0], devices[1][0]]
    elif 2 * bf16.device_total <= memory:
        nodes = [devices[0][0], devices[0][0]]
    else:
        nodes = [devices[0][0]] if bf16.device_total <= memory else []
    return {"bf16": bf16, "fp32": fp32, "fp32_fits": fp32.device_total <= memory, "nodes": nodes, "memory": memory}


def run_step(name: str, cmd: list[str], out: Path, timeout_s: float, shown: str = "") -> bool:
    started = time.time()
    say(f"{name}: {shown or ' '.join(cmd)}")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        ok, text = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        ok, text = False, f"timed out after {timeout_s:.0f} s\n{err.stdout or ''}{err.stderr or ''}"
    (out / f"{name}.log").write_text(text)
    say(f"{name}: {'ok' if ok else 'FAILED'} in {time.time() - started:.0f} s (log {out / (name + '.log')})")
    if not ok:
        print(text[-3000:], flush=True)
    return ok


def memory_step(name: str, model: str, device: str, weights: str, args, out: Path, data: str) -> bool:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.memory_check",
        model,
        "--device",
        device,
        "--weights",
        weights,
        "--dataset",
        data,
    ]
    cmd += ["--layers-per-block", str(args.layers_per_block), "--max-seq-len", str(args.max_seq_len)]
    ok = run_step(name, cmd, out, args.step_timeout_s)
    if ok:
        text = (out / f"{name}.log").read_text()
        figures = json.loads(text[text.index("{") : text.rindex("}") + 1])
        say(
            f"{name}: peak {figures['peak_mib']} MiB, plan {figures['plan_mib']} MiB "
            f"(plan/peak {figures['plan_over_peak']}), two rounds {figures['two_rounds_s']} s"
        )
    return ok


def deployment_step(model: str, nodes: list[str], args, out: Path, data: str) -> bool:
    """A local deployment: one SuperNode per entry of ``nodes`` (its worker's device)."""
    config = {
        "model": model, "dataset": data, "num-examples": 48, "heldout-examples": 8, "num-server-rounds": args.rounds,
        "layers-per-block": args.layers_per_block, "max-seq-len": args.max_seq_len, "output-dir": str(out / "runs"),
        "weights": "bf16", "evaluation": "clients", "micro-batch-size": 2, "gradient-checkpointing": True,
        "verify-invariant": True, "generate-examples": 0, "local-steps": 2,
    }  # fmt: skip
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from parablock_flwr.metrics import RunRecorder\n"
        "from parablock_flwr.tools.launch import run_deployment\n"
        "config, nodes, work = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])\n"
        "r = run_deployment(work, config, num_supernodes=len(nodes), timeout_s=float(sys.argv[4]),\n"
        "                   node_settings=[f'device=\"{d}\"' for d in nodes])\n"
        "print(r.summary()); print('run dir:', r.run_dir)\n"
        "bad = []\n"
        "for m in RunRecorder(r.run_dir).read() if r.run_dir else []:\n"
        "    print(json.dumps({k: m.get(k) for k in ('round', 'heldout_loss', 'train_loss', 'num_accepted',\n"
        "          'invariant_checked', 'invariant_failed', 'round_wall_s')}))\n"
        "    if m['round'] and (m.get('invariant_failed') or m.get('num_accepted') != len(nodes)):\n"
        "        bad.append(m['round'])\n"
        "print('rounds with a failed invariant or a missing node:', bad)\n"
        "sys.exit(r.returncode or (1 if bad else 0))\n"
    )
    timeout = args.step_timeout_s
    cmd = [sys.executable, "-c", script, json.dumps(config), json.dumps(nodes), str(out / "flower"), str(timeout)]
    shown = f"run_deployment: {len(nodes)} SuperNodes on {', '.join(nodes)}, {args.rounds} rounds, bf16 weights"
    return run_step(f"deployment-{len(nodes)}-nodes", cmd, out, timeout + 60, shown)


def check_data(folder: Path) -> str:
    """A small Alpaca-style file made here (the GPU machine has no reasoning-gym and no hub)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sums.jsonl"
    rows = [
        {"instruction": f"What is {a} + {b}?", "output": f"{a} + {b} = {a + b}."} for a in range(8) for b in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"alpaca:{path}"


def tiny_model(folder: Path, data: str) -> str:
    from parablock_flwr.data import load_examples
    from parablock_flwr.tools.tiny_model import build_tiny_model

    rows = load_examples(data, None, seed=0)
    texts = list(rows["prompt"]) + list(rows["response"])
    return str(build_tiny_model(folder, num_layers=4, hidden=64, vocab=512, texts=texts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="", help="a model folder (default: a tiny Llama made here)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/parablock-gpu-check"))
    parser.add_argument("--cpu", action="store_true", help="the dry run: the same steps on the CPU")
    parser.add_argument("--sizing-only", action="store_true", help="print the decisions, run nothing")
    parser.add_argument("--gpus", type=int, default=1, help="with --cpu or --sizing-only: GPUs to pretend")
    parser.add_argument("--gpu-memory-gb", type=float, default=2.0, help="with --cpu or --sizing-only")
    parser.add_argument("--layers-per-block", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--step-timeout-s", type=float, default=240)
    args = parser.parse_args()
    args.rounds = 2 if args.cpu else 3  # the dry run: as short as shows every step
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_CHECK_WORK") or "/tmp/parablock-gpu-check-work")
    data = check_data(work)
    model = args.model or tiny_model(work / "tiny-llama", data)
    if args.cpu or args.sizing_only:
        devices = [("cpu", int(args.gpu_memory_gb * 1e9))] * args.gpus
        say(f"{'dry run on the CPU' if args.cpu else 'sizing only'}: {args.gpus} pretend GPU(s) of "
            f"{args.gpu_memory_gb:g} GB")  # fmt: skip
    else:
        devices = gpus_found()
        if not devices:
            say("FAIL (torch sees no CUDA device: install a CUDA build of torch, scripts/install.sh)")
            return 1
        for device, memory in devices:
            say(f"{device}: {memory / 2**30:.0f} GiB")
    size = sizing(model, {"layers-per-block": args.layers_per_block, "max-seq-len": args.max_seq_len}, devices)
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    say(
        f"plan for {model}: one worker needs {gib(size['bf16'].device_total)} of device memory with bf16 "
        f"weights, {gib(size['fp32'].device_total)} with fp32; a device has {gib(size['memory'])}"
    )
    results: dict[str, str] = {}
    skip = lambda step, why: (results.__setitem__(step, f"skipped: {why}"), say(f"{step}: skipped: {why}"))  # noqa: E731
    if args.sizing_only:
        if not size["nodes"]:
            skip("worker-bf16", f"needs {gib(size['bf16'].device_total)}")
        if not size["fp32_fits"]:
            skip("worker-fp32", f"fp32 weights need {gib(size['fp32'].device_total)}")
        if len(size["nodes"]) < 2 and size["nodes"]:
            skip("second-supernode", f"two workers need {gib(2 * size['bf16'].device_total)} on one GPU")
        say(f"deployment: {len(size['nodes'])} SuperNode(s) on {', '.join(size['nodes']) or 'nothing'}")
        return 0
    first = devices[0][0]
    if size["nodes"]:
        results["worker-bf16"] = (
            "ok" if memory_step("worker-bf16", model, first, "bf16", args, args.out, data) else "FAIL"
        )
    else:
        skip("worker-bf16", f"one worker needs {gib(size['bf16'].device_total)}, a device has {gib(size['memory'])}")
    if size["fp32_fits"]:
        results["worker-fp32"] = (
            "ok" if memory_step("worker-fp32", model, first, "fp32", args, args.out, data) else "FAIL"
        )
    else:
        skip("worker-fp32", f"fp32 weights need {gib(size['fp32'].device_total)}, a device has {gib(size['memory'])}")
    if size["nodes"]:
        if len(size["nodes"]) == 1:
            say(f"deployment: one SuperNode only (two workers need {gib(2 * size['bf16'].device_total)} on {first})")
        ok = deployment_step(model, size["nodes"], args, args.out, data)
        results[f"deployment-{len(size['nodes'])}-nodes"] = "ok" if ok else "FAIL"
    else:
        skip("deployment", "no device holds one worker")
    failed = [k for k, v in results.items() if v == "FAIL"]
    ran = [k for k, v in results.items() if v == "ok"]
    skipped = [k for k, v in results.items() if v.startswith("skipped")]
    (args.out / "summary.json").write_text(json.dumps({"devices": devices, "model": model, "steps": results}) + "\n")
    verdict = "FAIL" if failed or not ran else "PASS"
    say(
        f"{verdict} ({len(ran)} passed{', failed: ' + ', '.join(failed) if failed else ''}"
        f"{', skipped: ' + ', '.join(skipped) if skipped else ''}; figures in {args.out})"
    )
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())

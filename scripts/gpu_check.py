"""The GPU check's steps, sized to the GPUs found (scripts/gpu-check.sh runs it; read that first).

Steps, each run only where `parablock-flwr plan` says it fits, else skipped with a line that says why:

1. the plan of the model (bf16 weights) against each GPU's memory;
2. one node worker, two rounds, bf16 weights on the first GPU: its peak memory against the plan;
3. the same with fp32 weights (skipped when the plan says they do not fit);
4. a local deployment (SuperLink, SuperNodes with their workers, `flwr run`), 3 rounds (2 in the dry
   run), bf16 weights, int8 transfer (quantised on the GPU), client evaluation, TLS and node
   authentication, the blocks on the run's stream (``transport = "direct"``); every node accepted,
   the invariant checked and no byte off the stream (no fallback, no refusal) in every round: one
   SuperNode per GPU, or two on one GPU only when two workers fit in it;
5. at the sizes this project is for (on a GPU only, not in the dry run): one node worker of a 1B and
   of an 8B Llama (random bf16 weights built on the GPU from docs/model-configs: a GPU machine has
   no hub), two rounds with docs/deploy-8b.md's settings (``AT_SIZE_CASES``) on rows that fill
   ``max-seq-len``, its peak device memory and host RSS against the plan;
6. ParaBlock against BCD at 1B (on a GPU only): ``benchmarks.round_compare`` deploys Llama-3.2-1B's random
   weights (4-layer blocks, 247 MB in int8; 24 local steps of 8 rows of 512 tokens, bf16), TLS and node
   authentication, ``transport = "direct"``, with 1 SuperNode and with 2 where two fit (``--compare-nodes``),
   in each of ``--compare-dtypes`` (default int8), ParaBlock with ``verify-invariant`` off and on; it prints
   each run's round wall, C, W, every leg of the critical path, ParaBlock/BCD beside the ideal, the held-out
   losses side by side and each target of issue 45 met or not, and writes ``compare.md`` under OUT.

It ends with one line, ``gpu-check: PASS (...)`` or ``gpu-check: FAIL (...)``, and writes
``summary.json`` and each step's output under OUT. ``--cpu`` runs the same steps on the CPU with
the tests' tiny Llama and a pretend GPU size (``--gpu-memory-gb``): the dry run the tests make.
``--sizing-only`` prints the decisions for a model and ``--gpus N --gpu-memory-gb G`` without
running anything; ``--at-size-only`` and ``--compare-only`` run step 5 or step 6 alone.
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


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def skip(results: dict, step: str, why: str) -> None:
    """A step that does not fit: recorded and said."""
    results[step] = f"skipped: {why}"
    say(f"{step}: skipped: {why}")


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


# Step 5: models of the sizes users have with docs/deploy-8b.md's settings, on rows that fill max-seq-len:
# its per-site row (4-layer blocks, micro-batch 1, gradient checkpointing) and its 80 GB card's line.
DEPLOY_8B_SETTINGS = {"weights": "bf16", "precision": "bf16", "max-seq-len": 1024, "batch-size": 8}
PER_SITE = {**DEPLOY_8B_SETTINGS, "layers-per-block": 4, "micro-batch-size": 1, "gradient-checkpointing": True}
CARD_80GB = {**DEPLOY_8B_SETTINGS, "layers-per-block": 8, "micro-batch-size": 4}
AT_SIZE_CASES = (("llama-3.2-1b", PER_SITE), ("llama-3.1-8b", PER_SITE), ("llama-3.1-8b", CARD_80GB))


def memory_step(
    name: str, model: str, device: str, weights: str, args, out: Path, data: str, settings: dict | None = None
) -> bool:
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
    settings = settings or {"layers-per-block": args.layers_per_block, "max-seq-len": args.max_seq_len}
    for key, value in settings.items():
        if key == "gradient-checkpointing":
            cmd += ["--gradient-checkpointing"] if value else []
        elif key != "weights":
            cmd += [f"--{key}", str(value)]
    ok = run_step(name, cmd, out, args.step_timeout_s)
    if ok:
        text = (out / f"{name}.log").read_text()
        figures = json.loads(text[text.index("{") : text.rindex("}") + 1])
        say(
            f"{name}: peak {figures['peak_mib']} MiB, plan {figures['plan_mib']} MiB "
            f"(plan/peak {figures['plan_over_peak']}), host peak {figures['host_peak_mib']} MiB, "
            f"plan {figures['plan_host_mib']} MiB, two rounds {figures['two_rounds_s']} s"
        )
    return ok


def tiny_steps(args, size: dict, devices: list[tuple[str, int]], model: str, data: str, results: dict) -> None:
    """Steps 2-4: the worker with bf16 and fp32 weights, then the deployment, each where it fits."""
    first = devices[0][0]
    if size["nodes"]:
        ok = memory_step("worker-bf16", model, first, "bf16", args, args.out, data)
        results["worker-bf16"] = "ok" if ok else "FAIL"
    else:
        need, has = gib(size["bf16"].device_total), gib(size["memory"])
        skip(results, "worker-bf16", f"one worker needs {need}, a device has {has}")
    if size["fp32_fits"]:
        ok = memory_step("worker-fp32", model, first, "fp32", args, args.out, data)
        results["worker-fp32"] = "ok" if ok else "FAIL"
    else:
        need, has = gib(size["fp32"].device_total), gib(size["memory"])
        skip(results, "worker-fp32", f"fp32 weights need {need}, a device has {has}")
    if size["nodes"]:
        if len(size["nodes"]) == 1:
            say(f"deployment: one SuperNode only (two workers need {gib(2 * size['bf16'].device_total)} on {first})")
        ok = deployment_step(model, size["nodes"], args, args.out, data)
        results[f"deployment-{len(size['nodes'])}-nodes"] = "ok" if ok else "FAIL"
    else:
        skip(results, "deployment", "no device holds one worker")


def at_size_steps(args, devices: list[tuple[str, int]], tokenizer_from: str, results: dict, work: Path) -> None:
    """Step 5: each case of AT_SIZE_CASES that the plan fits in the first GPU, random weights."""
    device, memory = devices[0]
    data = long_rows_data(work)
    for name, settings in AT_SIZE_CASES:
        step = f"worker-{name}-lpb{settings['layers-per-block']}-mb{settings['micro-batch-size']}"
        need = plan_of(str(ROOT / "docs" / "model-configs" / name), settings).device_total
        if need > memory:
            skip(results, step, f"needs {gib(need)}, {device} has {gib(memory)}")
            continue
        folder = random_weights(name, device, tokenizer_from, args, work)
        ok = folder is not None and memory_step(step, str(folder), device, "bf16", args, args.out, data, settings)
        results[step] = "ok" if ok else "FAIL"


def random_weights(name: str, device: str, tokenizer_from: str, args, work: Path) -> Path | None:
    """docs/model-configs/``name`` with random bf16 weights, built on ``device`` once (None: the build failed)."""
    folder = work / f"random-{name}"  # not under OUT: 16 GB for the 8B model
    build = (
        "import sys; from pathlib import Path; from benchmarks.memory_check import random_model; "
        "random_model(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])"
    )
    config_dir = ROOT / "docs" / "model-configs" / name
    built = (folder / "config.json").exists() or run_step(
        f"build-{name}", [sys.executable, "-c", build, str(config_dir), str(folder), tokenizer_from, device],
        args.out, args.step_timeout_s, f"random bf16 weights of {name} on {device} -> {folder}",
    )  # fmt: skip
    return folder if built else None


# Step 6: issue 45's comparison, at the size its targets name (Llama-3.2-1B, 4-layer blocks).
COMPARE_MODEL, COMPARE_SETTINGS = "llama-3.2-1b", {"layers-per-block": 4, "max-seq-len": 512, "batch-size": 8}


def compare_step(args, devices: list[tuple[str, int]], tokenizer_from: str, results: dict, work: Path) -> None:
    """Step 6: ParaBlock against BCD at 1B (``benchmarks.round_compare``), with the SuperNodes the GPUs hold."""
    device, memory = devices[0][0], min(m for _, m in devices[:2])
    settings = {**COMPARE_SETTINGS, "weights": "bf16", "precision": "bf16", "gradient-checkpointing": True}
    need = plan_of(str(ROOT / "docs" / "model-configs" / COMPARE_MODEL), settings).device_total
    if need > memory:
        skip(results, "compare", f"one worker of {COMPARE_MODEL} needs {gib(need)}, {device} has {gib(memory)}")
        return
    two = [devices[0][0], devices[1][0]] if len(devices) > 1 else [device, device] if 2 * need <= memory else []
    nodes = [n for n in args.compare_nodes if n == 1 or (n == 2 and two)]
    for n in set(args.compare_nodes) - set(nodes):
        say(f"compare: no run with {n} SuperNodes (two workers need {gib(2 * need)} on one GPU, {gib(memory)} here)")
    folder = random_weights(COMPARE_MODEL, device, tokenizer_from, args, work)
    if folder is None or not nodes:
        results["compare"] = "FAIL" if folder is None else "skipped: no setting fits"
        return
    cmd = [sys.executable, "-m", "benchmarks.round_compare", "--model", str(folder), "--dataset", long_rows_data(work),
           "--devices", *(two or [device]), "--nodes", *map(str, nodes), "--transfer-dtype", *args.compare_dtypes,
           "--verify-invariant", "--rounds", str(args.compare_rounds), "--out", str(args.out / "compare.md"),
           "--settings", json.dumps({**settings, "num-examples": 48, "heldout-examples": 8})]  # fmt: skip
    shown = f"ParaBlock against BCD, {COMPARE_MODEL}, {nodes} SuperNode(s), {' and '.join(args.compare_dtypes)}"
    ok = run_step("compare", cmd, args.out, args.compare_timeout_s, shown)
    if ok:
        print((args.out / "compare.md").read_text(), flush=True)
    results["compare"] = "ok" if ok else "FAIL"


def long_rows_data(folder: Path) -> str:
    """Rows whose answers run past 1024 tokens: every batch padded to ``max-seq-len``, as the plan assumes."""
    path = folder / "long.jsonl"
    answer = " ".join(f"{a} + {b} = {a + b}." for a in range(20) for b in range(20))
    rows = [{"instruction": f"Add the pairs from {k}.", "output": answer} for k in range(48)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"alpaca:{path}"


def deployment_step(model: str, nodes: list[str], args, out: Path, data: str) -> bool:
    """A local deployment: one SuperNode per entry of ``nodes`` (its worker's device)."""
    config = {
        "model": model, "dataset": data, "num-examples": 48, "heldout-examples": 8, "num-server-rounds": args.rounds,
        "layers-per-block": args.layers_per_block, "max-seq-len": args.max_seq_len, "output-dir": str(out / "runs"),
        "weights": "bf16", "evaluation": "clients", "micro-batch-size": 2, "gradient-checkpointing": True,
        "verify-invariant": True, "generate-examples": 0, "local-steps": 2, "transfer-dtype": "int8",
        "transport": "direct",
    }  # fmt: skip
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from parablock_flwr.metrics import RunRecorder\n"
        "from parablock_flwr.tools.launch import run_deployment\n"
        "config, nodes, work = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])\n"
        "r = run_deployment(work, config, num_supernodes=len(nodes), timeout_s=float(sys.argv[4]),\n"
        "                   node_settings=[f'device=\"{d}\"' for d in nodes], secure=True)\n"
        "print(r.summary()); print('run dir:', r.run_dir)\n"
        "bad = []\n"
        "for m in RunRecorder(r.run_dir).read() if r.run_dir else []:\n"
        "    print(json.dumps({k: m.get(k) for k in ('round', 'heldout_loss', 'train_loss', 'num_accepted',\n"
        "          'invariant_checked', 'invariant_failed', 'round_wall_s', 'direct_fallbacks', 'direct_refusals')}))\n"
        "    if m['round'] and (m.get('invariant_failed') or m.get('num_accepted') != len(nodes)\n"
        "                       or m.get('direct_fallbacks') or m.get('direct_refusals')):\n"
        "        bad.append(m['round'])\n"
        "print('rounds with a failed invariant, a missing node, or bytes off the stream:', bad)\n"
        "sys.exit(r.returncode or (1 if bad else 0))\n"
    )
    timeout = args.step_timeout_s
    cmd = [sys.executable, "-c", script, json.dumps(config), json.dumps(nodes), str(out / "flower"), str(timeout)]
    shown = f"run_deployment: {len(nodes)} SuperNodes on {', '.join(nodes)}, {args.rounds} rounds, bf16 weights, "
    shown += "int8, TLS and node authentication, transport=direct"
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
    parser.add_argument("--at-size-only", action="store_true", help="step 5 alone (the 1B and 8B workers)")
    parser.add_argument("--compare-only", action="store_true", help="step 6 alone (ParaBlock against BCD at 1B)")
    parser.add_argument("--compare-nodes", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--compare-dtypes", nargs="+", default=["int8"], choices=["int8", "bf16", "fp16"])
    parser.add_argument("--compare-rounds", type=int, default=5)
    parser.add_argument("--compare-timeout-s", type=float, default=3600)
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
    say(
        f"plan for {model}: one worker needs {gib(size['bf16'].device_total)} of device memory with bf16 "
        f"weights, {gib(size['fp32'].device_total)} with fp32; a device has {gib(size['memory'])}"
    )
    results: dict[str, str] = {}
    if args.sizing_only:
        if not size["nodes"]:
            skip(results, "worker-bf16", f"needs {gib(size['bf16'].device_total)}")
        if not size["fp32_fits"]:
            skip(results, "worker-fp32", f"fp32 weights need {gib(size['fp32'].device_total)}")
        if len(size["nodes"]) < 2 and size["nodes"]:
            skip(results, "second-supernode", f"two workers need {gib(2 * size['bf16'].device_total)} on one GPU")
        say(f"deployment: {len(size['nodes'])} SuperNode(s) on {', '.join(size['nodes']) or 'nothing'}")
        return 0
    alone = args.at_size_only or args.compare_only
    if alone:
        say("steps 2-4 (the tiny worker and the deployment): not run (--at-size-only, --compare-only)")
    else:
        tiny_steps(args, size, devices, model, data, results)
    if args.cpu:
        say("steps 5 and 6 (the 1B and 8B workers, ParaBlock against BCD at 1B): not in the dry run")
    else:
        if not args.compare_only:
            at_size_steps(args, devices, model, results, work)
        if not args.at_size_only:
            compare_step(args, devices, model, results, work)
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

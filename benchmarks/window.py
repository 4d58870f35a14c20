"""Measures a block's communication window against its size, leg by leg, beside Flower's own floor.

One node on loopback, with the separated-core set-up of benchmarks.overlap: the node
worker (every thread of it) on CPU 1, every other process (SuperLink, SuperNode, ClientApps, the
ServerApp) on CPU 0. Sequential BCD (``fedbcd``) on SmolLM2-135M with tiny compute (1 local step,
batch 1), so the window is what the rounds show; block sizes from ``layers-per-block``
(one layer = 14.2 MB fp32), LoRA adapters of 5 layers for 0.6 MB, and ``fedavg-full`` for a
full-model message (424.8 MB each way: what it trains; the tied embedding stays frozen). Beside
each, the same payload through a Flower-only app (benchmarks/flower_floor.py: no model, a ServerApp
pushing an ArrayRecord, a ClientApp returning one): what Flower's own processes cost. Both run
with ``launch.FLOWER_TRANSFER_SETTINGS`` and one packed array per record, side by side for each size.
Rounds 2..R each give one window (the repeats; their spread is shown). For each leg of the critical path (records'
``critical_path_*_s``) the benchmark fits ``fixed + bytes / throughput`` (bytes: the reply up plus
the message down), and checks the time model (``core.LinkModel``): calibrated on two sizes, it
predicts the round time of a third.

    .venv/bin/python -m benchmarks.window                      # all sizes, the app and Flower only (~25 min)
    .venv/bin/python -m benchmarks.window --sizes 14,70 --no-floor
    .venv/bin/python -m benchmarks.window --fast               # tiny model, a smoke run (no docs)

Writes into --out: window.json and window.png; without --fast also docs/results/window.json, the PNG
under docs/img/ and docs/results/window.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import PROJECT_DIR, RESULTS_DIR, command, fit, machine, read_records, write_report
from parablock_flwr import core
from parablock_flwr.strategies.round_stats import CLIENTAPP_RELAY_PARTS
from parablock_flwr.tools.launch import FLOWER_TRANSFER_SETTINGS, run_deployment

LAYER_PARAMS = 3_540_096  # one SmolLM2-135M decoder layer (9 tensors)
LORA_LAYER_PARAMS = 30_720  # its rank-8 adapters on q, k, v, o (8 tensors)
MODEL_PARAMS = 134_515_008  # the whole model, tied embedding once (272 tensors)
# name -> (run config, payload bytes each way, tensors): the sizes of the issue.
SIZES = {
    "0.6": ({"train": "lora", "layers-per-block": 5}, 4 * 5 * LORA_LAYER_PARAMS, 40),
    "14": ({"layers-per-block": 1}, 4 * LAYER_PARAMS, 9),
    "70": ({"layers-per-block": 5}, 4 * 5 * LAYER_PARAMS, 45),
    "212": ({"layers-per-block": 15}, 4 * 15 * LAYER_PARAMS, 135),
    # fedavg-full sends what it trains, 424.8 MB (the tied embedding stays frozen); the Flower-only app all 538 MB.
    "full": ({"algorithm": "fedavg-full"}, 4 * MODEL_PARAMS, 272),
}
APP_LEGS = ("aggregate", "dispatch", "delivery", "clientapp_relay", *CLIENTAPP_RELAY_PARTS, "reply_relay",
            "reply_to_server")  # fmt: skip
FLOOR_LEGS = ("dispatch", "delivery", "clientapp_relay", "clientapp_pull", "reply_to_server")
# CPU seconds of a round, per process: the server's (every thread), the ClientApp's up to its handler and in all.
CPU_KEYS = ("server_cpu_s", "clientapp_pull_cpu_s", "clientapp_cpu_s")
# The two directions: down = the message from the server's aggregate to the worker holding it, up = the
# reply from the worker to the server. (For a large message ``delivery`` is negative: the SuperNode
# pulls it and starts the ClientApp while the server is still pushing its objects; the sum holds.)
DIRECTIONS = {"down": ("dispatch", "delivery", "clientapp_relay"), "up": ("reply_relay", "reply_to_server")}
CALIBRATE, PREDICT = ("14", "212"), "70"
KINDS = ("app", "floor")


# ------------------------------------------------------------------ running
@contextlib.contextmanager
def environment(settings: dict[str, str]):
    """``settings`` in this process's environment (Flower's processes inherit it), then as before."""
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def pin_workers(deployment) -> None:
    """Every thread of every node worker on CPU 1 (threads started later inherit it)."""
    for worker in deployment.workers:
        for task in Path(f"/proc/{worker.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), {1})


def app_config(size: str, args, out: Path) -> dict:
    config = {
        "algorithm": "fedbcd",
        "model": args.model,
        "output-dir": str(out),
        "num-server-rounds": args.rounds,
        "local-steps": 1,
        "batch-size": 1,
        "num-examples": 32,
        "heldout-examples": 8,
        "eval-every": args.rounds,  # the server evaluates at rounds 0 and R only: CPU 0 stays Flower's
        "generate-examples": 0,
        "torch-threads": 1,
        "uplink-mbps": 1e6,  # loopback: the link's own time is not modeled here
        "downlink-mbps": 1e6,
        "latency-ms": 0.0,
    }
    config.update(SIZES[size][0])
    if args.transport == "direct":  # the blocks on the run's own stream (plaintext on loopback, as the SuperLink)
        config["transport"] = "direct"
    if args.fast:
        config.update({"layers-per-block": 1, "train": "full"})
    return config


def run_app(size: str, args) -> dict:
    """One deployment of the app: its records' windows and legs, rounds 2..R."""
    workdir = args.out / f"app-{size}"
    load = os.getloadavg()[0]
    with environment(FLOWER_TRANSFER_SETTINGS):
        result = run_deployment(workdir, app_config(size, args, workdir / "out"), 1, args.timeout_s,
                                app_dir=PROJECT_DIR, on_started=pin_workers)  # fmt: skip
    if result.run_dir is None or result.kind not in ("completed", "completed-with-exclusions"):
        return {"kind": "app", "size": size, "error": result.summary("window.py")}
    records = [r for r in read_records(result.run_dir) if r["round"] >= 1]
    points = []
    for prev, rec in zip(records, records[1:]):  # round r's window: r-1's reply up, r's message down
        point = {"round": rec["round"], "bytes": prev["wire_bytes_up"] + rec["wire_bytes_down"],
                 "window_s": rec.get("measured_comm_s"), "round_wall_s": rec["round_wall_s"],
                 "compute_s": rec["compute_s_mean"], "bytes_up": prev["wire_bytes_up"],
                 "bytes_down": rec["wire_bytes_down"]}  # fmt: skip
        point.update({leg: rec.get(f"critical_path_{leg}_s") for leg in APP_LEGS})
        node = (rec.get("timeline") or [{}])[0]  # one node
        point.update({"server_cpu_s": rec.get("server_cpu_s"), "clientapp_pull_cpu_s": node.get("clientapp_pull_cpu_s"),
                      "clientapp_cpu_s": node.get("clientapp_cpu_s")})  # fmt: skip
        points.append(point)
    return {"kind": "app", "size": size, "load_1min": load, "points": points, "run_dir": str(result.run_dir)}


FLOOR_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "flower-floor"
version = "1.0.0"

[tool.flwr.app]
publisher = "parablock"

[tool.flwr.app.components]
serverapp = "flower_floor:server"
clientapp = "flower_floor:client"

[tool.flwr.app.config]
rounds = 3
payload-bytes = 1000
arrays = 1
pull-interval-s = 0.1
min-available-nodes = 1
output-dir = "floor-out"
"""


def floor_app(folder: Path) -> Path:
    """The Flower-only app as a folder `flwr run` can bundle."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(FLOOR_PYPROJECT)
    shutil.copy(Path(__file__).with_name("flower_floor.py"), folder / "flower_floor.py")
    return folder


def run_floor(size: str, args) -> dict:
    """The same payload through the Flower-only app, as one packed array: each round's legs, rounds 2..R."""
    workdir = args.out / f"floor-{size}"
    nbytes = SIZES[size][1]
    config = {"rounds": args.rounds, "payload-bytes": nbytes, "arrays": 1, "output-dir": str(workdir / "out")}
    load = os.getloadavg()[0]
    with environment(FLOWER_TRANSFER_SETTINGS):
        run_deployment(workdir, config, 1, args.timeout_s, app_dir=floor_app(args.out / "floor-app"),
                       on_started=pin_workers)  # fmt: skip
    found = sorted((workdir / "out").glob("floor-*/floor.json"))
    if not found:
        return {"kind": "floor", "size": size, "error": f"no floor.json; see {workdir}"}
    points = []
    for r in json.loads(found[-1].read_text())["rounds"][1:]:
        legs = {"dispatch": r["pushed"] - r["push_start"], "delivery": r["clientapp_start"] - r["pushed"],
                "clientapp_relay": r["handler_start"] - r["clientapp_start"],
                "reply_to_server": r["pulled"] - r["handler_end"]}  # fmt: skip
        cpu = {key: r.get(key) for key in CPU_KEYS}
        points.append({"round": r["round"], "bytes": 2 * nbytes, "window_s": sum(legs.values()), **legs, **cpu,
                       "clientapp_pull": legs["clientapp_relay"]})  # its relay leg is all Flower's pull  # fmt: skip
    return {"kind": "floor", "size": size, "load_1min": load, "points": points}


# ------------------------------------------------------------------ analysis
def add_directions(point: dict) -> None:
    """``down`` and ``up`` (``DIRECTIONS``) from a point's legs, where it has them."""
    for direction, legs in DIRECTIONS.items():
        values = [point[leg] for leg in legs if point.get(leg) is not None]
        point[direction] = sum(values) if values else None


def fits(runs: list[dict], kind: str, legs: tuple[str, ...]) -> dict:
    """``fixed + bytes / throughput`` of the window, each direction and each leg, over ``kind``'s sizes."""
    ours = [r for r in runs if r["kind"] == kind and r.get("points")]
    if len({r["size"] for r in ours}) < 2:  # one size's rounds differ in bytes by headers only: no fit
        return {}
    points = [p for r in ours for p in r["points"]]
    out = {}
    for leg in ("window_s", *DIRECTIONS, *legs):
        pairs = [(p["bytes"], p[leg]) for p in points if p.get(leg) is not None]
        with contextlib.suppress(ValueError):
            out[leg] = fit([x for x, _ in pairs], [y for _, y in pairs])
    return out


def prediction(runs: list[dict]) -> dict | None:
    """The time model calibrated on two sizes' windows, asked for a third size's rounds (sequential
    BCD: compute + window), against the rounds measured."""
    app = {r["size"]: r for r in runs if r["kind"] == "app" and r.get("points")}
    if not all(s in app for s in (*CALIBRATE, PREDICT)):
        return None
    calib = [p for s in CALIBRATE for p in app[s]["points"] if p["window_s"] is not None]
    model = fit([p["bytes"] for p in calib], [p["window_s"] for p in calib])
    link = core.LinkModel(1e6, 1e6, 0.0, model["fixed_s"], model["throughput_mbs"] or 0.0)
    rows = []
    for p in app[PREDICT]["points"]:
        predicted = core.modeled_round_seconds([p["compute_s"]], [link.comm_seconds(p["bytes_up"], p["bytes_down"])],
                                               overlapped=False)  # fmt: skip
        rows.append({"round": p["round"], "predicted_s": predicted, "measured_s": p["round_wall_s"],
                     "error": predicted / p["round_wall_s"] - 1})  # fmt: skip
    return {"calibrated_on": list(CALIBRATE), "predicted": PREDICT, **model, "rounds": rows}


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def spread(values: list[float]) -> str:
    """Mean, and min-max across the repeats."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def tables(results: dict) -> str:
    """Each run's window and legs, the app against Flower alone per size, the fits and the model's check."""
    columns = (*DIRECTIONS, *APP_LEGS, *CPU_KEYS)
    runs = sorted(results["runs"], key=lambda r: (SIZES[r["size"]][1], KINDS.index(r["kind"])))
    lines = ["| payload MB each way | app | load (1 min) | window s, mean (min-max) | "
             + " | ".join(columns) + " |", "|---|---|---|---|" + "---|" * len(columns)]  # fmt: skip
    for r in runs:
        mb = np.mean([p["bytes"] for p in r["points"]]) / 2e6 if r.get("points") else SIZES[r["size"]][1] / 1e6
        if "error" in r:
            lines.append(f"| {mb:.1f} | {r['kind']} | | failed: {r['error'][:80]} |" + " |" * len(columns))
            continue
        legs = " | ".join(spread([p.get(leg) for p in r["points"]]) for leg in columns)
        window = spread([p["window_s"] for p in r["points"]])
        lines.append(f"| {mb:.1f} | {r['kind']} | {r['load_1min']:.1f} | {window} | {legs} |")
    lines += ["", "The app against Flower alone, mean window of the same payload:", "",
              "| payload MB each way | app s | Flower only s | app / Flower only |", "|---|---|---|---|"]  # fmt: skip
    for size in SIZES:
        pair = {r["kind"]: r for r in runs if r["size"] == size and r.get("points")}
        if set(pair) == set(KINDS):
            app, floor = (np.mean([p["window_s"] for p in pair[k]["points"]]) for k in KINDS)
            mb = np.mean([p["bytes"] for p in pair["app"]["points"]]) / 2e6
            lines.append(f"| {mb:.1f} | {app:.1f} | {floor:.1f} | {app / floor:.2f} |")
    lines += ["", "Fit `fixed + bytes / throughput` (bytes: the reply up plus the message down):", "",
              "| app | leg | fixed s | throughput MB/s |", "|---|---|---|---|"]  # fmt: skip
    for kind, legs in results["fits"].items():
        for leg, f in legs.items():
            lines.append(f"| {kind} | {leg} | {f['fixed_s']:.2f} | {_f(f['throughput_mbs'], 0)} |")
    if p := results.get("prediction"):
        lines += ["", f"Time model calibrated on {' and '.join(p['calibrated_on'])} MB: "
                  f"fixed {p['fixed_s']:.2f} s, {_f(p['throughput_mbs'], 0)} MB/s; predicted the {p['predicted']} MB "
                  "run's rounds (compute + window, sequential BCD):", "",
                  "| round | predicted s | measured s | error |", "|---|---|---|---|"]  # fmt: skip
        for row in p["rounds"]:
            lines.append(f"| {row['round']} | {row['predicted_s']:.2f} | {row['measured_s']:.2f} | "
                         f"{100 * row['error']:+.0f}% |")  # fmt: skip
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    """The window against the payload, every repeat a point, each fit a line."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.geomspace(0.5e6, 1.2e9, 100)
    for color, kind in enumerate(KINDS):
        color, marker = f"C{color}", "o" if kind == "app" else "^"
        points = [p for r in results["runs"] if r["kind"] == kind
                  for p in r.get("points", []) if p["window_s"] is not None]  # fmt: skip
        if not points:
            continue
        label = "ParaBlock app" if kind == "app" else "Flower only"
        ax.scatter([p["bytes"] / 2e6 for p in points], [p["window_s"] for p in points], color=color, marker=marker,
                   label=label, alpha=0.8)  # fmt: skip
        f = results["fits"].get(kind, {}).get("window_s")
        if f and f["throughput_mbs"]:
            ax.plot(grid / 2e6, f["fixed_s"] + grid / (f["throughput_mbs"] * 1e6), color=color,
                    ls="-" if kind == "app" else "--", lw=0.8)  # fmt: skip
    ax.set(xscale="log", xlabel="payload each way, MB (fp32)", ylabel="communication window, s",
           title="One exchange on loopback, worker on its own core")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_docs(results: dict, png: Path | None) -> None:
    """docs/results/window.json (the summary), docs/img/window.png and docs/results/window.md."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "window.json").write_text(json.dumps({k: v for k, v in results.items() if k != "tables"},
                                                        indent=1))  # fmt: skip
    if png:
        (PROJECT_DIR / "docs" / "img").mkdir(parents=True, exist_ok=True)
        shutil.copy(png, PROJECT_DIR / "docs" / "img" / "window.png")
    text = (
        "One node on loopback; the node worker on CPU 1, every other process on CPU 0 (the load average "
        "beside each run). SmolLM2-135M, sequential BCD (fedbcd; fedavg-full for the full model), 1 local "
        f"step of batch 1, {results['rounds']} rounds: rounds 2..R give the repeats. Window = from the "
        "worker's reply leaving it to the next message reaching it (`measured_comm_s`); legs: the records' "
        "`critical_path_*_s`. Flower only: benchmarks/flower_floor.py, the same payload as one packed array, "
        "its window the sum of its legs. Both with one packed array per record and "
        f"{', '.join(f'{k}={v}' for k, v in FLOWER_TRANSFER_SETTINGS.items())} "
        "(`launch.FLOWER_TRANSFER_SETTINGS`). Summary: docs/results/window.json.\n\n"
        + results["tables"]
        + ("\n\n![window](../img/window.png)\n" if png else "\n")
    )
    write_report("window", "The communication window against block size", text, how=results["command"])


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds per run (2..R are the repeats; default 3)")
    p.add_argument("--no-floor", action="store_true", help="skip the Flower-only app")
    p.add_argument("--no-app", action="store_true", help="skip the ParaBlock app")
    p.add_argument("--fast", action="store_true", help="tiny model, 0.6 and 14 MB floor: a smoke run (no docs)")
    p.add_argument("--report", type=Path, help="run nothing: the tables, figure and docs from this window.json")
    p.add_argument("--no-docs", action="store_true", help="leave docs/ alone (a partial run: its tables only)")
    p.add_argument("--transport", choices=("flower", "direct"), default="flower",
                   help="the app's transport (docs/transport.md); direct implies --no-docs")  # fmt: skip
    p.add_argument("--out", type=Path)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.sizes = args.sizes.split(",")
    if bad := [c for c in args.sizes if c not in SIZES]:
        p.error(f"--sizes {bad[0]!r}: expected one of {', '.join(SIZES)}")
    if args.rounds < 3:
        p.error(f"--rounds {args.rounds}: expected at least 3 (rounds 2..R are the repeats)")
    args.out = (args.out or PROJECT_DIR / "runs" / f"window-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        sys.exit("window.py: expected at least 2 CPUs (one for the worker, one for everything else)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return report(json.loads(args.report.read_text()), args)
    args.model = "embedded:smollm2-135m-instruct"
    if args.fast:
        from parablock_flwr.tools.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(args.out / "tiny-model"))
        args.sizes = ["0.6", "14"]
    os.sched_setaffinity(0, {0})  # every process started from here on: CPU 0 (the workers move to CPU 1)
    results: dict = {"command": command("window"), "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                     "machine": machine(), "runs": []}  # fmt: skip
    for size in args.sizes:  # side by side: each size through both apps before the next size
        for kind, run in (("floor", run_floor), ("app", run_app)):
            if (kind == "floor" and args.no_floor) or (kind == "app" and args.no_app):
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {kind} {size} MB ...", flush=True)
            results["runs"].append(run(size, args))
            last = results["runs"][-1]
            print(f"    {last.get('error') or [round(p['window_s'] or 0, 2) for p in last['points']]}", flush=True)
            (args.out / "window.json").write_text(json.dumps(results, indent=1))
    return report(results, args)


def report(results: dict, args) -> int:
    """Fits, the time model's check, tables, figure; the docs unless ``--fast``."""
    for run in results["runs"]:
        for point in run.get("points", []):
            add_directions(point)
    results["fits"] = {}
    for kind, legs in (("app", (*APP_LEGS, *CPU_KEYS)), ("floor", (*FLOOR_LEGS, *CPU_KEYS))):
        if found := fits(results["runs"], kind, legs):
            results["fits"][kind] = found
    results["prediction"] = prediction(results["runs"])
    results["tables"] = tables(results)
    png = plot(results, args.out / "window.png")
    (args.out / "window.json").write_text(json.dumps(results, indent=1))
    print(results["tables"])
    if not args.fast and not args.no_docs and args.transport == "flower":
        write_docs(results, png)
        print("wrote docs/results/window.json, docs/img/window.png and docs/results/window.md")
    return 0 if not any("error" in r for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

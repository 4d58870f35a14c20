"""Measures a block's communication window against its size, on each transport, beside Flower's own floor.

One node on loopback, with the separated-core set-up of benchmarks.overlap: the node
worker (every thread of it) on CPU 1, every other process (SuperLink, SuperNode, ClientApps, the
ServerApp) on CPU 0. For each size, one run after the other (side by side): the Flower-only app
(benchmarks/flower_floor.py: no model, a ServerApp pushing an ArrayRecord, a ClientApp returning one)
with an empty payload, Flower's control floor, and with the size's payload, what Flower's own processes
cost to move it; then the app with ``transport = "flower"`` and with ``transport = "direct"`` (the
blocks on the run's own stream, docs/transport.md; plaintext on loopback, as the SuperLink). The app
runs sequential BCD (``fedbcd``) with tiny compute (1 local step, batch 1), so the window is what the
rounds show: SmolLM2-135M's blocks from ``layers-per-block`` (one layer = 14.2 MB fp32), LoRA adapters of
5 layers for 0.6 MB, ``fedavg-full`` for a full-model message (424.8 MB each way), and a synthetic block
of about 1 GB (one random decoder layer of hidden 4096 and MLP 16384, fp32; built once under runs/).
Every run with ``launch.FLOWER_TRANSFER_SETTINGS`` and one packed array per record.

The app's window of round r is the records' timeline from the worker's computation of round r-1 ending
to that of round r starting: its reply packed (and on the stream uploaded), Flower's legs (the records'
``critical_path_*_s``), the message's records fetched (on the stream). Rounds 3..R (Flower's own app: 2..R)
each give one window (round 3 is the first whose message ``direct`` pushes a round ahead; ``relayed``: the same
with ``transport-replies-on-stream = false``, each reply through Flower; ``built``: that with
``transport-messages-ahead = false`` too, each message pushed once built): the repeats, their spread
shown. Issue 32's target: with ``direct``, a window at most the control floor + bytes / 300 MB/s; its
"Beyond" (Flower's control exchange off the path): at most bytes / 300 MB/s + 0.5 s. For each
kind and leg the benchmark fits ``fixed + bytes / throughput`` (bytes:
the reply up plus the message down), and checks the time model (``core.LinkModel``): calibrated on two
sizes on Flower's path, it predicts the round time of a third.

    .venv/bin/python -m benchmarks.window --rounds 4 --dtypes fp16,bf16,int8   # docs/results/window.md (~40 min)
    .venv/bin/python -m benchmarks.window                      # 14, 70, 212 MB and 1 GB, every kind, 4 rounds
    .venv/bin/python -m benchmarks.window --sizes 14,70 --kinds empty,direct --no-docs
    .venv/bin/python -m benchmarks.window --fast               # tiny model, 0.6 and 14 MB: a smoke run (no docs)
    .venv/bin/python -m benchmarks.window --report runs/window-.../window.json   # the tables again, as measured, no run

Writes into --out: window.json and window.png; without --fast or --no-docs also docs/results/window.json,
the PNG under docs/img/ and docs/results/window.md. The 1 GB runs need about 12 GiB of free memory; with less
they are not started, and the table says so.

Reading the page: on Flower's path a block's window is Flower's processes more than the bytes. With
``direct`` the bytes leave Flower's messages; with messages a round ahead, their content taken by the node's
worker from the stream, Flower's delivery and the ClientApp's start leave the critical path; with replies on
the stream, Flower's reply does too. What is left is the upload, the server's aggregation and the step's
download, each a pass over the bytes on one core (docs/transport.md, "Not done yet").
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

from benchmarks.common import PROJECT_DIR, RESULTS_DIR, command, commit, fit, machine, read_records, write_report
from parablock_flwr import core
from parablock_flwr.strategies.round_stats import CLIENTAPP_RELAY_PARTS
from parablock_flwr.tools.launch import FLOWER_TRANSFER_SETTINGS, run_deployment

LAYER_PARAMS = 3_540_096  # one SmolLM2-135M decoder layer (9 tensors)
LORA_LAYER_PARAMS = 30_720  # its rank-8 adapters on q, k, v, o (8 tensors)
MODEL_PARAMS = 134_515_008  # the whole model, tied embedding once (272 tensors)
# The synthetic block: one Llama decoder layer of hidden 4096 (32 heads, 8 key-value heads), Llama-3-8B's
# attention, its MLP widened to 16384 so that the block is about 1 GB in fp32 (9 tensors).
SYNTHETIC_SHAPE = {"hidden_size": 4096, "intermediate_size": 16384, "num_attention_heads": 32,
                   "num_key_value_heads": 8}  # fmt: skip
SYNTHETIC_LAYER_PARAMS = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 16384 + 2 * 4096
SYNTHETIC = "synthetic"  # the run config's model, replaced by the synthetic model's folder once built
# name -> (run config, payload bytes each way, tensors): the sizes of the issue.
SIZES = {
    "0.6": ({"train": "lora", "layers-per-block": 5}, 4 * 5 * LORA_LAYER_PARAMS, 40),
    "14": ({"layers-per-block": 1}, 4 * LAYER_PARAMS, 9),
    "70": ({"layers-per-block": 5}, 4 * 5 * LAYER_PARAMS, 45),
    "212": ({"layers-per-block": 15}, 4 * 15 * LAYER_PARAMS, 135),
    # fedavg-full sends what it trains, 424.8 MB (the tied embedding stays frozen); the Flower-only app all 538 MB.
    "full": ({"algorithm": "fedavg-full"}, 4 * MODEL_PARAMS, 272),
    # Evaluated on the node, so that the server holds no second replica of the 1 GB model (its evaluator's).
    "1g": ({"model": SYNTHETIC, "layers-per-block": 1, "evaluation": "clients"}, 4 * SYNTHETIC_LAYER_PARAMS, 9),
}
DEFAULT_SIZES = ("14", "70", "212", "1g")
# What runs for each size, in this order, side by side: the Flower-only app with an empty payload (Flower's
# control floor), the same with each message pushed a round ahead (Flower's cycle per message: the least a
# round costs while it sends each node one Flower message), the Flower-only app with the size's payload, and
# the app on each transport.
KINDS = ("empty", "ahead", "floor", "flower", "built", "relayed", "direct")
STREAM_KINDS = ("built", "relayed", "direct")  # the app with transport = "direct", less an option or none
APP_KINDS = ("flower", "direct")  # compared bit for bit (``same_model``)
FLOOR_KINDS = ("empty", "ahead", "floor")
LABELS = {"empty": "Flower only, empty payload (control floor)",
          "ahead": "Flower only, empty payload, messages a round ahead (Flower's cycle)",
          "floor": "Flower only, the payload", "flower": 'app, transport="flower"',
          "built": 'app, transport="direct", each message pushed once built',
          "relayed": 'app, transport="direct", each reply through Flower',
          "direct": 'app, transport="direct"'}  # fmt: skip
# The app's repeats: rounds 3..R, the first whose message can be pushed a round ahead on the stream (round 1's
# reply is a node's first commit there); Flower's own app: rounds 2..R.
APP_FIRST_ROUND = 3
APP_LEGS = ("aggregate", "dispatch", "delivery", "clientapp_relay", *CLIENTAPP_RELAY_PARTS, "reply_relay",
            "reply_to_server")  # fmt: skip
# The worker's own legs of an app's window, from the records' timeline: ``upload`` (its computation's end to its
# reply leaving it: packing, and on the stream the upload) and ``fetch`` (the message reaching it to the next
# computation's start: on the stream the download, then the start point).
WORKER_LEGS = ("upload", "fetch")
FLOOR_LEGS = ("dispatch", "delivery", "clientapp_relay", "clientapp_pull", "reply_to_server")
# CPU seconds of a round, per process: the server's (every thread), the ClientApp's up to its handler and in all.
CPU_KEYS = ("server_cpu_s", "clientapp_pull_cpu_s", "clientapp_cpu_s")
# The two directions: down = the message from the server's aggregate to the worker holding it, up = the
# reply from the worker to the server. (For a large message ``delivery`` is negative: the SuperNode
# pulls it and starts the ClientApp while the server is still pushing its objects; the sum holds.)
DIRECTIONS = {"down": ("dispatch", "delivery", "clientapp_relay", "fetch"), "up": ("upload", "reply_relay",
                                                                                    "reply_to_server")}  # fmt: skip
CALIBRATE, PREDICT = ("14", "212"), "70"
TARGET_MBS = 300.0  # issue 32: the direct transport's window at most the control floor + bytes / 300 MB/s
TARGET_WITHIN_S = {"70": 1.0, "1g": 5.0}  # and, stated there, within this many seconds of the floor
BEYOND_S = 0.5  # issue 32's "Beyond": with Flower's control exchange off the path, the bytes' time + at most 0.5 s
SYNTHETIC_MEMORY_GIB = 12.0  # what the 1 GB runs need free (three copies of the block in flight, AdamW's)


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


def synthetic_model(folder: Path, tokenizer_from: str) -> str:
    """The synthetic ~1 GB block's model: one random decoder layer of ``SYNTHETIC_SHAPE`` in fp32 and the
    tiny test tokenizer's small embedding, built once into ``folder`` (1 GB on disk)."""
    import torch
    from transformers import LlamaConfig

    from benchmarks.memory_check import random_model

    config = LlamaConfig(**SYNTHETIC_SHAPE, num_hidden_layers=1, max_position_embeddings=2048, vocab_size=1,
                         tie_word_embeddings=True)  # fmt: skip
    return random_model(config, folder, tokenizer_from, dtype=torch.float32)


def app_config(size: str, kind: str, args, out: Path, dtype: str = "") -> dict:
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
    if config["model"] == SYNTHETIC:
        config["model"] = args.synthetic_model
    if kind in STREAM_KINDS:  # the blocks on the run's own stream (plaintext on loopback, as the SuperLink)
        config["transport"] = "direct"
        config["transport-messages-ahead"] = kind != "built"
        config["transport-replies-on-stream"] = kind == "direct"
    if dtype:
        config["transfer-dtype"] = dtype
    if args.fast and size != "1g":
        config.update({"layers-per-block": 1, "train": "full"})
    return config


def app_point(prev: dict, rec: dict) -> dict:
    """Round ``rec``'s window from the records of it and the round before: the bytes (round r-1's reply up,
    round r's message down), the window (the worker's computation of r-1 ending to that of r starting) and
    its legs; ``comm_s`` is the records' ``measured_comm_s`` (the reply leaving the worker to the message
    reaching it), which on the stream leaves out the upload and the download."""
    node, before = (rec.get("timeline") or [{}])[0], (prev.get("timeline") or [{}])[0]  # one node
    point = {"round": rec["round"], "bytes": prev["wire_bytes_up"] + rec["wire_bytes_down"],
             "comm_s": rec.get("measured_comm_s"), "round_wall_s": rec["round_wall_s"],
             "compute_s": rec["compute_s_mean"], "bytes_up": prev["wire_bytes_up"],
             "bytes_down": rec["wire_bytes_down"], "direct_fallbacks": rec.get("direct_fallbacks"),
             "direct_refusals": rec.get("direct_refusals")}  # fmt: skip
    point.update({leg: rec.get(f"critical_path_{leg}_s") for leg in APP_LEGS})
    stamps = (before.get("compute_end"), node.get("prev_reply_sent"), node.get("request_received"),
              node.get("compute_start"))  # fmt: skip
    if None not in stamps:
        ended, sent, received, started = stamps
        point.update({"upload": sent - ended, "fetch": started - received, "window_s": started - ended})
    else:
        point["window_s"] = None
    point.update({"server_cpu_s": rec.get("server_cpu_s"), "clientapp_pull_cpu_s": node.get("clientapp_pull_cpu_s"),
                  "clientapp_cpu_s": node.get("clientapp_cpu_s")})  # fmt: skip
    return point


def run_app(size: str, kind: str, args, dtype: str = "") -> dict:
    """One deployment of the app on ``kind``'s transport (and ``transfer-dtype = dtype`` when given): its
    records' windows and legs, rounds ``APP_FIRST_ROUND``..R."""
    workdir = args.out / f"{kind}-{size}{'-' + dtype if dtype else ''}"
    load = os.getloadavg()[0]
    config = app_config(size, kind, args, workdir / "out", dtype)
    with environment(FLOWER_TRANSFER_SETTINGS):
        result = run_deployment(workdir, config, 1, args.timeout_s, app_dir=PROJECT_DIR, on_started=pin_workers)
    if result.run_dir is None or result.kind not in ("completed", "completed-with-exclusions"):
        return {"kind": kind, "size": size, "error": result.summary("window.py")}
    records = [r for r in read_records(result.run_dir) if r["round"] >= 1]
    points = [app_point(prev, rec) for prev, rec in zip(records, records[1:]) if rec["round"] >= APP_FIRST_ROUND]
    return {"kind": kind, "size": size, "load_1min": load, "points": points, "run_dir": str(result.run_dir)}


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
messages-ahead = 0
min-available-nodes = 1
output-dir = "floor-out"
"""


def floor_app(folder: Path) -> Path:
    """The Flower-only app as a folder `flwr run` can bundle."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(FLOOR_PYPROJECT)
    shutil.copy(Path(__file__).with_name("flower_floor.py"), folder / "flower_floor.py")
    return folder


def run_floor(size: str, kind: str, args) -> dict:
    """The Flower-only app, one packed array of the size's payload (``floor``) or no array at all (``empty``;
    ``ahead``: each message pushed before the previous round's reply is pulled): each round's legs, rounds 2..R."""
    workdir = args.out / f"{kind}-{size}"
    nbytes = SIZES[size][1] if kind == "floor" else 0
    config = {"rounds": args.rounds, "payload-bytes": nbytes, "arrays": 1, "output-dir": str(workdir / "out"),
              "messages-ahead": int(kind == "ahead")}  # fmt: skip
    load = os.getloadavg()[0]
    with environment(FLOWER_TRANSFER_SETTINGS):
        run_deployment(workdir, config, 1, args.timeout_s, app_dir=floor_app(args.out / "floor-app"),
                       on_started=pin_workers)  # fmt: skip
    points = floor_points(workdir / "out")
    if points is None:
        return {"kind": kind, "size": size, "error": f"no floor.json; see {workdir}"}
    return {"kind": kind, "size": size, "load_1min": load, "points": points}


def floor_points(out: Path) -> list[dict] | None:
    """The Flower-only app's rounds 2..R from its floor.json under ``out`` (its output-dir): each round's legs
    and its window, their sum (with messages pushed a round ahead the legs overlap, and the window is the time
    from the previous round's reply pulled to this one's); None when it wrote none. benchmarks.network reads
    its runs with it too."""
    found = sorted(out.glob("floor-*/floor.json"))
    if not found:
        return None
    floor = json.loads(found[-1].read_text())
    points, ahead = [], floor.get("messages_ahead", 0) > 0
    for previous, r in zip(floor["rounds"], floor["rounds"][1:]):
        legs = {"dispatch": r["pushed"] - r["push_start"], "delivery": r["clientapp_start"] - r["pushed"],
                "clientapp_relay": r["handler_start"] - r["clientapp_start"],
                "reply_to_server": r["pulled"] - r["handler_end"]}  # fmt: skip
        cpu = {key: r.get(key) for key in CPU_KEYS}
        # Its relay leg is all Flower's pull.
        window = r["pulled"] - previous["pulled"] if ahead else sum(legs.values())
        points.append({"round": r["round"], "bytes": 2 * floor["payload_bytes"], "window_s": window,
                       **legs, **cpu, "clientapp_pull": legs["clientapp_relay"]})  # fmt: skip
    return points


def memory_refusal(size: str) -> str | None:
    """Why the synthetic block's runs must not start now (this machine's memory is shared), or None."""
    if size != "1g":
        return None
    available = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable")) / 2**20  # fmt: skip
    if available < SYNTHETIC_MEMORY_GIB:
        return f"not run: {available:.1f} GiB available, expected at least {SYNTHETIC_MEMORY_GIB:.0f} GiB"
    return None


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
    """The time model calibrated on two sizes' windows on Flower's path, asked for a third size's rounds
    (sequential BCD: compute + window), against the rounds measured."""
    app = {r["size"]: r for r in runs if r["kind"] == "flower" and r.get("points")}
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


def mean(run: dict | None, key: str = "window_s") -> float | None:
    """A run's mean of ``key`` over its repeats, or None."""
    values = [p.get(key) for p in (run or {}).get("points", []) if p.get(key) is not None]
    return float(np.mean(values)) if values else None


def spread(values: list[float]) -> str:
    """Mean, and min-max across the repeats."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def by_size(results: dict) -> dict[str, dict[str, dict]]:
    """size -> kind -> run (the last of each), in the order of SIZES."""
    out: dict[str, dict[str, dict]] = {}
    for run in results["runs"]:
        out.setdefault(run["size"], {})[run["kind"]] = run
    return {size: out[size] for size in SIZES if size in out}


def targets(results: dict) -> list[dict]:
    """Per size, issue 32's targets for the direct transport against what was measured beside it: the window
    at most the control floor + bytes / TARGET_MBS (and, where the issue states one, within
    ``TARGET_WITHIN_S`` of the floor); and its "Beyond", Flower's control exchange off the path: at most
    bytes / TARGET_MBS + BEYOND_S (loopback's link taken at TARGET_MBS)."""
    rows = []
    for size, runs in by_size(results).items():
        floor, direct = mean(runs.get("empty")), mean(runs.get("direct"))
        nbytes = mean(runs.get("direct"), "bytes") or 2 * SIZES[size][1]
        row = {"size": size, "mb_each_way": nbytes / 2e6, "floor_s": floor, "direct_s": direct,
               "bytes_s": nbytes / (TARGET_MBS * 1e6), "floor": mean(runs.get("floor")),
               "flower": mean(runs.get("flower")), "cycle_s": mean(runs.get("ahead")),
               "built": mean(runs.get("built")), "relayed": mean(runs.get("relayed"))}  # fmt: skip
        if direct is not None:
            row["beyond_s"] = row["bytes_s"] + BEYOND_S
            row["beyond_met"] = direct <= row["beyond_s"]
        if floor is not None and direct is not None:
            row["target_s"] = floor + row["bytes_s"]
            row["over_floor_s"] = direct - floor
            row["met"] = direct <= row["target_s"]
            if size in TARGET_WITHIN_S:
                row["within_s"] = TARGET_WITHIN_S[size]
                row["met_within"] = direct - floor <= TARGET_WITHIN_S[size]
        rows.append(row)
    return rows


def same_model(runs: dict[str, dict]) -> dict | None:
    """The app's two runs of one size against each other (same seed, fp32 transfer): the wire bytes of every
    round and every global step in both step logs, bit for bit; None where either run has no run folder."""
    import torch

    from parablock_flwr.replica import StepLog

    flower, direct = (runs.get(k, {}).get("run_dir") for k in APP_KINDS)
    if not (flower and direct and Path(flower).is_dir() and Path(direct).is_dir()):
        return None
    records = [{r["round"]: (r.get("wire_bytes_up"), r.get("wire_bytes_down")) for r in read_records(Path(d))}
               for d in (flower, direct)]  # fmt: skip
    logs = [StepLog(d) for d in (flower, direct)]
    versions = sorted(set(logs[0].steps()) & set(logs[1].steps()))
    equal = 0
    for version in versions:
        (block_f, step_f), (block_d, step_d) = (log.read(version) for log in logs)
        equal += (
            block_f == block_d
            and step_f.keys() == step_d.keys()
            and all(torch.equal(step_f[n], step_d[n]) for n in step_f)
        )
    return {"rounds": len(records[0]), "same_bytes": records[0] == records[1], "steps": len(versions),
            "same_steps": equal}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _met(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "**no**")


def target_table(rows: list[dict]) -> list[str]:
    """The sizes against the target, and the kinds' windows as ratios side by side."""
    lines = [f"| payload MB each way | control floor s | direct s | direct - floor s | bytes / {TARGET_MBS:.0f} MB/s s "
             "| target s | met | Flower only s | flower s | direct / flower | flower / Flower only "
             f"| Flower's cycle s | direct, messages once built s | direct, replies through Flower s "
             f"| Beyond: bytes / {TARGET_MBS:.0f} MB/s + {BEYOND_S} s | Beyond met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        met = _met(r.get("met"))
        if "within_s" in r:
            met += f"; within {r['within_s']:.0f} s of the floor: " + _met(r["met_within"])
        lines.append(f"| {r['mb_each_way']:.1f} | {_f(r['floor_s'], 2)} | {_f(r['direct_s'], 2)} | "
                     f"{_f(r.get('over_floor_s'), 2)} | {r['bytes_s']:.2f} | {_f(r.get('target_s'), 2)} | {met} | "
                     f"{_f(r['floor'], 2)} | {_f(r['flower'], 2)} | {_ratio(r['direct_s'], r['flower'])} | "
                     f"{_ratio(r['flower'], r['floor'])} | {_f(r.get('cycle_s'), 2)} | "
                     f"{_f(r.get('built'), 2)} | {_f(r.get('relayed'), 2)} | {_f(r.get('beyond_s'), 2)} | "
                     f"{_met(r.get('beyond_met'))} |")  # fmt: skip
    return lines


def legs_table(results: dict) -> list[str]:
    """Where each window goes: every run's legs, means over its repeats."""
    legs = ("upload", "reply_relay", "reply_to_server", "aggregate", "dispatch", "delivery", "clientapp_pull",
            "relay_send", "worker_read", "fetch")  # fmt: skip
    lines = ["| payload MB each way | run | window s | " + " | ".join(legs) + " | " + " | ".join(DIRECTIONS) + " |",
             "|---|---|---|" + "---|" * (len(legs) + 2)]  # fmt: skip
    for size, runs in by_size(results).items():
        for kind in KINDS:
            run = runs.get(kind)
            if not run or not run.get("points"):
                continue
            cells = " | ".join(_f(mean(run, leg), 2) for leg in (*legs, *DIRECTIONS))
            lines.append(f"| {SIZES[size][1] / 1e6:.1f} | {kind} | {_f(mean(run), 2)} | {cells} |")
    return lines


def tables(results: dict) -> str:
    """The target table, every run's window with its spread and load, where the time goes, the fits and the
    time model's check."""
    results["targets"] = targets(results)
    last = results["rounds"]
    lines = ["Issue 32's target for the direct transport, and the windows side by side (means of the app's rounds "
             f"{APP_FIRST_ROUND}-{last} and Flower's 2-{last}, s):", "", *target_table(results["targets"]), "",
             "Every run: its window, mean (min-max) over the repeats, the 1-minute load average when it started, "
             "and on the stream its fallbacks and refusals (summed over the repeats):", "",
             "| payload MB each way | run | load | window s | records' comm_s | round s | compute s | "
             "bytes up + down MB | fallbacks | refusals |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for size, runs in by_size(results).items():
        for kind in KINDS:
            if (r := runs.get(kind)) is None:
                continue
            if "error" in r:
                lines.append(f"| {SIZES[size][1] / 1e6:.1f} | {kind} | | failed: {r['error'][:100]} | | | | | | |")
                continue
            pts = r["points"]
            summed = {k: sum(p.get(k) or 0 for p in pts) if kind in STREAM_KINDS else None
                      for k in ("direct_fallbacks", "direct_refusals")}  # fmt: skip
            cells = [spread([p.get(k) for p in pts]) for k in ("window_s", "comm_s", "round_wall_s", "compute_s")]
            lines.append(f"| {SIZES[size][1] / 1e6:.1f} | {kind} | {r['load_1min']:.1f} | {' | '.join(cells)} | "
                         f"{mean(r, 'bytes') / 1e6:.1f} | {_f(summed['direct_fallbacks'], 0)} | "
                         f"{_f(summed['direct_refusals'], 0)} |")  # fmt: skip
    if results.get("same_model"):
        lines += ["", "The app's two runs of each size, fp32 (`flower` against `direct`, the same seed): wire bytes "
                  "of every round, and the global steps in both step logs, bit for bit:", "",
                  "| payload MB each way | rounds | same bytes every round | global steps equal |",
                  "|---|---|---|---|"]  # fmt: skip
    for size, same in results.get("same_model", {}).items():
        lines.append(f"| {SIZES[size][1] / 1e6:.1f} | {same['rounds']} | {'yes' if same['same_bytes'] else '**no**'} "
                     f"| {same['same_steps']} of {same['steps']} |")  # fmt: skip
    if dtypes := results.get("same_model_dtypes"):
        lines += [
            "",
            f"The same at {SIZES[next(iter(dtypes.values()))['size']][1] / 1e6:.1f} MB each way with each transfer "
            "dtype (`--dtypes`):",
            "",
            "| transfer dtype | rounds | same bytes every round | global steps equal |",
            "|---|---|---|---|",
        ]
        for dtype, same in dtypes.items():
            if "error" in same:
                lines.append(f"| {dtype} | failed: {same['error'][:100]} | | |")
            else:
                lines.append(f"| {dtype} | {same['rounds']} | {'yes' if same['same_bytes'] else '**no**'} "
                             f"| {same['same_steps']} of {same['steps']} |")  # fmt: skip
    lines += ["", "Where the time goes, means over the repeats, s (up = upload + reply_relay + reply_to_server; "
              "down = dispatch + delivery + clientapp_relay + fetch; `aggregate` is in neither):", "",
              *legs_table(results)]  # fmt: skip
    lines += ["", "Fit `fixed + bytes / throughput` of the window (bytes: the reply up plus the message down):", "",
              "| run | leg | fixed s | throughput MB/s |", "|---|---|---|---|"]  # fmt: skip
    for kind, legs in results["fits"].items():
        for leg, f in legs.items():
            lines.append(f"| {kind} | {leg} | {f['fixed_s']:.2f} | {_f(f['throughput_mbs'], 0)} |")
    if p := results.get("prediction"):
        lines += ["", f"Time model calibrated on the flower runs' {' and '.join(p['calibrated_on'])} MB windows: "
                  f"fixed {p['fixed_s']:.2f} s, {_f(p['throughput_mbs'], 0)} MB/s; predicted the {p['predicted']} MB "
                  "run's rounds (compute + window, sequential BCD):", "",
                  "| round | predicted s | measured s | error |", "|---|---|---|---|"]  # fmt: skip
        for row in p["rounds"]:
            lines.append(f"| {row['round']} | {row['predicted_s']:.2f} | {row['measured_s']:.2f} | "
                         f"{100 * row['error']:+.0f}% |")  # fmt: skip
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    """The window against the payload, every repeat a point, each fit a line, the target's line."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.geomspace(10e6, 2.2e9, 100)
    markers = {"empty": "s", "ahead": "v", "floor": "^", "flower": "o", "built": "x", "relayed": "+", "direct": "D"}
    for color, kind in enumerate(KINDS):
        color = f"C{color}"
        points = [(p["bytes"] if kind not in ("empty", "ahead") else 2 * SIZES[r["size"]][1], p["window_s"])
                  for r in results["runs"]
                  if r["kind"] == kind for p in r.get("points", []) if p["window_s"] is not None]  # fmt: skip
        if not points:
            continue
        ax.scatter([b / 2e6 for b, _ in points], [w for _, w in points], color=color, marker=markers[kind],
                   label=LABELS[kind], alpha=0.8)  # fmt: skip
        f = results["fits"].get(kind, {}).get("window_s")
        if f and f["throughput_mbs"]:
            ax.plot(grid / 2e6, f["fixed_s"] + grid / (f["throughput_mbs"] * 1e6), color=color, ls="--", lw=0.8)
    floors = [mean(r) for r in results["runs"] if r["kind"] == "empty" and r.get("points")]
    if floors:
        ax.plot(grid / 2e6, np.mean(floors) + grid / (TARGET_MBS * 1e6), color="k", ls=":", lw=1,
                label=f"target: control floor + bytes / {TARGET_MBS:.0f} MB/s")  # fmt: skip
    ax.set(xscale="log", xlabel="payload each way, MB (fp32; the control floor: at its size's payload)",
           ylabel="communication window, s", title="One exchange on loopback, worker on its own core")  # fmt: skip
    ax.legend(fontsize=7)
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
    loads = [r["load_1min"] for r in results["runs"] if "load_1min" in r]
    text = (
        "One node on loopback; the node worker on CPU 1, every other process on CPU 0. For each size, one after "
        "the other: the Flower-only app (benchmarks/flower_floor.py) with an empty payload (Flower's control "
        "floor) and with the payload as one packed array, then the app, sequential BCD (fedbcd) with 1 local "
        'step of batch 1, with `transport = "flower"` and with `transport = "direct"` (plaintext on loopback, '
        f"as the SuperLink). {results['rounds']} rounds each: the app's rounds 3..R and Flower's 2..R give the repeats "
        "(round 3 is the first whose message `direct` pushes a round ahead; `relayed` is `direct` with "
        "`transport-replies-on-stream = false`, each reply through Flower, and `built` that with "
        "`transport-messages-ahead = false` too). The app's window: "
        "from the worker's computation of round r-1 ending to that of round r starting (the records' timeline: "
        "its reply packed and, on the stream, uploaded; Flower's legs; on the stream the download), so that the "
        "stream's time is in it; `comm_s` is the records' `measured_comm_s` (the reply leaving the worker to the "
        "message reaching it). The Flower-only app's window: the sum of its legs. SmolLM2-135M for 14-212 MB; "
        "the 1 GB block: one random decoder layer of hidden 4096, 8 key-value heads, MLP 16384, fp32 "
        f"({4 * SYNTHETIC_LAYER_PARAMS / 1e6:.1f} MB). With "
        f"{', '.join(f'{k}={v}' for k, v in FLOWER_TRANSFER_SETTINGS.items())} (`launch.FLOWER_TRANSFER_SETTINGS`). "
        f"This 2-core machine was shared with other work (1-minute load {min(loads, default=0):.1f}-"
        f"{max(loads, default=0):.1f} at the runs' starts): the seconds are noisy, the ratios of runs side by side "
        "are the claim. Summary: docs/results/window.json.\n\n"
        + results["tables"]
        + ("\n\n![window](../img/window.png)\n" if png else "\n")
    )
    write_report("window", "The communication window against block size, on each transport",
                 text, how=results["command"], measured=results)  # fmt: skip


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help=f"comma-separated, of {', '.join(SIZES)} (default {','.join(DEFAULT_SIZES)}; "
                   "with --fast 0.6,14)")  # fmt: skip
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} "
                   "(the Flower-only app empty and with the payload, the app on each transport)")  # fmt: skip
    p.add_argument("--dtypes", default="", help="also run the app on both transports with each of these "
                   "transfer dtypes at the first size, and compare their bytes and global steps (e.g. "
                   "fp32,fp16,bf16,int8)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=4, help="rounds per run (the app's rounds 3..R and Flower's "
                   "2..R are the repeats; default 4)")  # fmt: skip
    p.add_argument("--fast", action="store_true", help="the tiny model for SmolLM2's sizes: a smoke run (no docs)")
    p.add_argument("--report", type=Path, help="run nothing: the tables, figure and docs from this window.json")
    p.add_argument("--no-docs", action="store_true", help="leave docs/ alone (a partial run: its tables only)")
    p.add_argument("--out", type=Path)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.sizes = (args.sizes or ",".join(("0.6", "14") if args.fast else DEFAULT_SIZES)).split(",")
    args.kinds = [k for k in args.kinds.split(",") if k]  # none: only the --dtypes check
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if bad := [c for c in args.sizes if c not in SIZES]:
        p.error(f"--sizes {bad[0]!r}: expected one of {', '.join(SIZES)}")
    if bad := [k for k in args.kinds if k not in KINDS]:
        p.error(f"--kinds {bad[0]!r}: expected one of {', '.join(KINDS)}")
    if bad := [d for d in args.dtypes if d not in ("fp32", "fp16", "bf16", "int8")]:
        p.error(f"--dtypes {bad[0]!r}: expected fp32, fp16, bf16 or int8")
    if args.rounds < APP_FIRST_ROUND + 1:
        p.error(f"--rounds {args.rounds}: expected at least {APP_FIRST_ROUND + 1} (the app's rounds "
                f"{APP_FIRST_ROUND}..R are the repeats)")  # fmt: skip
    args.out = (args.out or PROJECT_DIR / "runs" / f"window-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return args


def prepare_models(args) -> None:
    """The model of each size: SmolLM2 (the tiny test model with ``--fast``); the synthetic 1 GB block's,
    built once under runs/ (it is 1 GB)."""
    from parablock_flwr.tools.tiny_model import build_tiny_model

    args.model = "embedded:smollm2-135m-instruct"
    tiny = str(build_tiny_model(PROJECT_DIR / "runs" / "window-models" / "tiny"))
    if args.fast:
        args.model = tiny
    if "1g" in args.sizes:
        args.synthetic_model = synthetic_model(PROJECT_DIR / "runs" / "window-models" / "synthetic-1g", tiny)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        sys.exit("window.py: expected at least 2 CPUs (one for the worker, one for everything else)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return report(json.loads(args.report.read_text()), args)
    prepare_models(args)
    # This benchmark's processes, not the shared machine's other work, are the ones the OOM killer takes first.
    Path("/proc/self/oom_score_adj").write_text("1000")
    os.sched_setaffinity(0, {0})  # every process started from here on: CPU 0 (the workers move to CPU 1)
    results: dict = {"command": command("window"), "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                     "commit": commit(), "machine": machine(), "runs": []}  # fmt: skip
    for size in args.sizes:  # side by side: each size through every kind before the next size
        for kind in (k for k in KINDS if k in args.kinds):
            print(f"[{time.strftime('%H:%M:%S')}] {kind} {size} MB ...", flush=True)
            if refusal := memory_refusal(size):
                results["runs"].append({"kind": kind, "size": size, "error": refusal})
            else:
                run = run_floor if kind in FLOOR_KINDS else run_app
                results["runs"].append(run(size, kind, args))
            last = results["runs"][-1]
            print(f"    {last.get('error') or [round(p['window_s'] or 0, 2) for p in last['points']]}", flush=True)
            (args.out / "window.json").write_text(json.dumps(results, indent=1))
    results["same_model_dtypes"] = same_model_dtypes(args)
    return report(results, args)


def same_model_dtypes(args) -> dict:
    """``--dtypes``: the app on both transports with each transfer dtype, at the first size: their records'
    bytes and global steps compared (``same_model``), or the run's error."""
    out = {}
    for dtype in args.dtypes:
        print(f"[{time.strftime('%H:%M:%S')}] flower and direct, {args.sizes[0]} MB, transfer-dtype {dtype} ...")
        runs = {kind: run_app(args.sizes[0], kind, args, dtype) for kind in APP_KINDS}
        errors = [f"{kind}: {run['error']}" for kind, run in runs.items() if "error" in run]
        out[dtype] = {"size": args.sizes[0], **({"error": "; ".join(errors)} if errors else same_model(runs))}
        print(f"    {out[dtype]}", flush=True)
    return out


def report(results: dict, args) -> int:
    """Fits, the time model's check, tables, figure; the docs unless ``--fast`` or ``--no-docs``."""
    for run in results["runs"]:
        run["kind"] = {"app": "flower"}.get(run["kind"], run["kind"])  # a window.json from before the transports
        for point in run.get("points", []):
            add_directions(point)
    results["fits"] = {}
    for kind in ("floor", *APP_KINDS):
        legs = FLOOR_LEGS if kind == "floor" else (*APP_LEGS, *WORKER_LEGS)
        if found := fits(results["runs"], kind, (*legs, *CPU_KEYS)):
            results["fits"][kind] = found
    results["prediction"] = prediction(results["runs"])
    if "same_model" not in results:  # the run folders are read once, after the runs (``--report`` keeps it)
        compared = {size: same_model(runs) for size, runs in by_size(results).items()}
        results["same_model"] = {size: same for size, same in compared.items() if same is not None}
    results["tables"] = tables(results)
    png = plot(results, args.out / "window.png")
    (args.out / "window.json").write_text(json.dumps(results, indent=1))
    print(results["tables"])
    if not args.fast and not args.no_docs:
        write_docs(results, png)
        print("wrote docs/results/window.json, docs/img/window.png and docs/results/window.md")
    compared = [*results["same_model"].values(), *results.get("same_model_dtypes", {}).values()]
    differ = any("error" in c or not c["same_bytes"] or c["same_steps"] != c["steps"] for c in compared)
    return 1 if differ or any("error" in r for r in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())

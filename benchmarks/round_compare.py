"""ParaBlock against sequential BCD in a local deployment, round by round, and the targets of a round on a GPU:
what ``benchmarks.stand_in`` (the computation a GPU's stand-in, on any machine) and the GPU check's comparison step
(``scripts/gpu_check.py``, the real computation on the GPUs found) both run and print.

For each setting (transfer dtype, SuperNodes), one deployment per algorithm with the same seed, model and data
(ParaBlock also with ``verify-invariant`` on, with ``--verify-invariant``). Each prints the means over the steady
rounds (``first_steady_round``: from the first after each block's first round and first step, round 3 at the
earliest) of the round's wall time T, the compute C, the communication window W, the worker's own
work in a round (``worker_non_compute``), the server's critical path (last reply to the next messages out) and
every leg of it (``critical_path_*``), the CPU seconds a round costs the ServerApp and each node worker (every
thread; beside a stand-in the worker's are all per-byte work, less moved than wall times by what else the
machine's cores run, though not unmoved); ParaBlock/BCD beside the ideal max(C, T_BCD − C) / T_BCD (ParaBlock hides
C, so at best its round costs what BCD's costs beside it); the held-out losses of both, round by round; and each
target as measured, met or not:

- the server, from the last reply to the next messages out: ≤ 0.3 s + the block's bytes at 1 GB/s;
- the worker, from its message coming in to its reply leaving, less the computation in that time: ≤ 0.3 s + the
  block's bytes at 1 GB/s;
- BCD's round ≤ C + the link's time + 1 s, and (beyond) ParaBlock's ≤ max(C, the link's time) + 1 s; on one
  machine the link is loopback, its time taken as 0;
- ParaBlock / BCD within 10 % of the ideal;
- ``verify-invariant`` costs at most 10 % of ParaBlock's round.

A run with a round that lost a node's reply, failed the invariant or moved bytes off the stream is no figure: the
benchmark stops there, saying which. ``main`` has the nodes evaluate ``x^0`` and ``x^R`` only (``evaluation =
"clients"``, ``eval-every = R``): a node evaluates between its message and its reply, which would count in its own
work in the rounds timed.

    .venv/bin/python -m benchmarks.round_compare --model FOLDER --devices cuda:0 --transfer-dtype int8 bf16 \\
        --nodes 1 2 --verify-invariant --out /tmp/compare.md       # the real computation (the GPU check's step)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import PROJECT_DIR, command, commit, machine_line, read_records
from parablock_flwr.messages import WORKER_LEGS
from parablock_flwr.strategies.round_stats import SERVER_LEGS
from parablock_flwr.tools import launch

LEGS = ("aggregate", "dispatch", "delivery", "clientapp_relay", "reply_relay", "reply_to_server", "wait_for_others")
ALGORITHMS = ("fedbcd", "parablock")
VERIFIED = "parablock, verify-invariant"  # ParaBlock again, verify-invariant on
PER_BYTE_GBPS, FIXED_S, ROUND_SLACK_S, WITHIN = 1.0, 0.3, 1.0, 0.10  # the targets' figures (issue 45)
TABLE_HEAD = (
    "| setting | algorithm | round T s | C s | W s | worker, message to reply less compute s | server critical path s "
    "| CPU s a round: server, worker | legs of the critical path s | the server's own legs s "
    "| the worker's own legs s |"
    "\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def deploy(
    algorithm: str, config: dict, workdir: Path, nodes: int = 1, secure: bool = False,
    node_settings: list[str] | None = None, worker: Callable[[list[str]], list[str]] | None = None,
) -> list[dict]:  # fmt: skip
    """One local deployment of ``algorithm`` (``config`` the run config's rest): its records, round 0 first.
    ``worker``: maps the real node worker's command to the one started instead (the stand-in's)."""
    real = launch.worker_command
    if worker is not None:
        launch.worker_command = lambda *a, **kw: worker(real(*a, **kw))
    try:
        proc = launch.run_deployment(workdir / f"flower-{algorithm}", {**config, "algorithm": algorithm},
                                     num_supernodes=nodes, timeout_s=1800, secure=secure,
                                     node_settings=node_settings or ())  # fmt: skip
    finally:
        launch.worker_command = real
    if proc.returncode != 0 or proc.run_dir is None:
        sys.exit(f"{algorithm} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{proc.summary()}")
    records = read_records(proc.run_dir)
    if bad := [r["round"] for r in records if r.get("round", 0) >= 1 and not whole(r, nodes)]:
        sys.exit(f"{algorithm}: rounds {bad} lost a node's reply, failed the invariant or moved bytes off the stream")
    return records


def whole(record: dict, nodes: int) -> bool:
    """Whether a round ran as timed: every node's reply accepted, the invariant held where checked, no
    fallback off the stream and no refusal on it (a round that did less is no figure of a round)."""
    return (record.get("num_accepted") == nodes and not record.get("invariant_failed")
            and not record.get("direct_fallbacks") and not record.get("direct_refusals"))  # fmt: skip


def compare(config: dict, workdir: Path, verify: bool = False, **deployment) -> dict[str, dict]:
    """BCD and ParaBlock (and ParaBlock with ``verify-invariant`` on, with ``verify``) deployed with ``config``:
    each one's means (``means``) and held-out losses by round (``heldout``). ``verify-invariant`` is off in the
    first two: its cost is the third's round against the second's. Each runs in a folder of its own in
    ``workdir``, its run folder in it."""
    runs = {a: (a, False) for a in ALGORITHMS} | ({VERIFIED: ("parablock", True)} if verify else {})
    measured = {}
    for name, (algorithm, verified) in runs.items():
        folder = workdir / name.replace(", ", "-")
        run_config = {**config, "verify-invariant": verified, "output-dir": str(folder / "out")}
        records = deploy(algorithm, run_config, folder, **deployment)
        measured[name] = {**means(records), "heldout": heldout(records)}
    return measured


def first_steady_round(records: list[dict]) -> int | None:
    """The first round of the means: the first after every block's first round and its first step (the round after
    it), round 3 at the earliest (round 1 overlaps nothing, round 2 makes the second block's update). A block's first
    round writes its buffers afresh on both sides (the node's residual, its encoding) and its first step is the first
    write to its ``x`` (on the CPU, pages copied from the model's file as they are written): seconds at 236 MB on
    this VM, once per block and run, not a round's cost. None where no round before the last is left (the last has no
    next message to time: fewer rounds than blocks + 3, in turn) or the records name no block."""
    first: dict[int, int] = {}  # each block's first round
    for r in sorted((r for r in records if "round" in r and "block" in r), key=lambda r: r["round"]):
        first.setdefault(r["block"], r["round"])
    rounds = [r["round"] for r in records if "round_wall_s" in r]
    start = max(3, max(first.values(), default=0) + 2)
    return start if first and rounds and start < max(rounds) else None  # the last round alone has no next message


def means(records: list[dict]) -> dict:
    """Means over rounds ``first_steady_round``..R, or 3..R where no round is steady (``steady_from`` says which,
    ``steady`` whether it is)."""
    steady = first_steady_round(records)
    start = steady or 3
    rounds = [r for r in records if r.get("round", 0) >= start and "round_wall_s" in r]
    keys = ["round_wall_s", "measured_compute_s", "measured_comm_s", "measured_overlap_share", "server_critical_path_s"]
    keys += ["server_cpu_s", "one_pass_ahead"]  # the last: the share of rounds whose pass ran before the last reply
    keys += [f"critical_path_{leg}_s" for leg in LEGS] + [f"measured_{leg}" for leg in WORKER_LEGS]
    keys += [f"server_{leg}" for leg in SERVER_LEGS]
    out = {k: statistics.mean(r[k] for r in rounds if k in r) for k in keys if any(k in r for r in rounds)}
    if busy := worker_non_compute(records, start):
        out["worker_non_compute_s"] = busy
    if cpu := worker_cpu(records, start):
        out["worker_round_cpu_s"] = cpu
    return {**out, "steady_from": start, "steady": steady is not None}


def window(settings: list[dict[str, dict]]) -> str:
    """The page's words for the rounds its means cover (``first_steady_round`` of each run)."""
    runs = [m for measured in settings for m in measured.values() if "steady_from" in m]
    starts = "/".join(map(str, sorted({m["steady_from"] for m in runs}) or [3]))
    if runs and all(m["steady"] for m in runs):
        return f"means of rounds {starts}..R (from the first after each block's first round and first step)"
    return f"means of rounds {starts}..R (some runs too short to leave out each block's first round and first step)"


def worker_cpu(records: list[dict], start: int = 3) -> float | None:
    """The CPU seconds a round costs a node worker, every thread: its running total ``worker_cpu_s`` at round r's
    reply less at round r-1's, per node, rounds r >= ``start`` (means' rounds); a total that fell (a restarted
    worker counts from 0 again) is no round's figure."""
    cpu = {r["round"]: {row["node"]: row.get("worker_cpu_s") for row in r.get("timeline", [])}
           for r in records if "round" in r}  # fmt: skip
    spans = [now - cpu[r - 1][node] for r, nodes in cpu.items() if r >= start and r - 1 in cpu
             for node, now in nodes.items() if now is not None and cpu[r - 1].get(node) is not None
             and now >= cpu[r - 1][node]]  # fmt: skip
    return statistics.mean(spans) if spans else None


def worker_non_compute(records: list[dict], start: int = 3) -> float | None:
    """The worker's own work in a round: from its message coming in to its reply leaving, less the computation
    that ran in that time (the step's apply, rounding, the residual's durable write, digests, the upload; BCD's
    computation runs in it, ParaBlock's mostly before it). From the timelines, per node, rounds r >= ``start``: round
    r's ``request_received`` to round r+1's ``prev_reply_sent``, less round r's ``compute_start..compute_end`` in it."""
    by_round = {r["round"]: {row["node"]: row for row in r.get("timeline", [])} for r in records if "round" in r}
    spans = []
    for r, rows_of in by_round.items():
        for node, row in rows_of.items() if r >= start and r + 1 in by_round else ():
            sent = by_round[r + 1].get(node, {}).get("prev_reply_sent", 0)
            if sent <= 0 or not row.get("request_received"):
                continue
            received = row["request_received"]
            computing = max(0.0, min(row["compute_end"], sent) - max(row["compute_start"], received))
            spans.append(sent - received - computing)
    return statistics.mean(spans) if spans else None


def heldout(records: list[dict]) -> dict[int, float]:
    """The held-out loss by round, where the run evaluated one."""
    return {r["round"]: r["heldout_loss"] for r in records if "round" in r and "heldout_loss" in r}


def against_ideal(bcd: dict, parablock: dict) -> tuple[float, float]:
    """(ParaBlock's round over BCD's, the ideal ``max(C, T_BCD − C) / T_BCD``)."""
    t_bcd, c = bcd["round_wall_s"], bcd["measured_compute_s"]
    return parablock["round_wall_s"] / t_bcd, max(c, t_bcd - c) / t_bcd


def rows(setting: str, measured: dict[str, dict]) -> list[str]:
    """The table's rows of one setting (``TABLE_HEAD``): each run, then ParaBlock / BCD against the ideal."""
    out = []
    for name, m in measured.items():
        legs = ", ".join(f"{leg} {m[f'critical_path_{leg}_s']:.2f}" for leg in LEGS if f"critical_path_{leg}_s" in m)
        cells = [m.get(k, float("nan")) for k in ("round_wall_s", "measured_compute_s", "measured_comm_s",
                                                    "worker_non_compute_s", "server_critical_path_s")]  # fmt: skip
        cpu = ", ".join(f"{m.get(k, float('nan')):.2f}" for k in ("server_cpu_s", "worker_round_cpu_s"))
        server = ", ".join(f"{leg.removesuffix('_s').replace('_', ' ')} {m[f'server_{leg}']:.2f}"
                           for leg in SERVER_LEGS if f"server_{leg}" in m)  # fmt: skip
        if m.get("one_pass_ahead"):  # the pass ahead's mean is over the rounds that kept it
            server += f" (kept in {m['one_pass_ahead']:.0%} of rounds)"
        own = ", ".join(f"{leg.removesuffix('_s').replace('_', ' ')} {m[f'measured_{leg}']:.2f}"
                        for leg in WORKER_LEGS if f"measured_{leg}" in m)  # fmt: skip
        out.append(f"| {setting} | {name} | " + " | ".join(f"{v:.2f}" for v in cells)
                   + f" | {cpu} | {legs} | {server} | {own} |")  # fmt: skip
    ratio, ideal = against_ideal(measured["fedbcd"], measured["parablock"])
    out.append(f"| {setting} | ParaBlock / BCD | **{ratio:.2f}** (ideal {ideal:.2f}: max(C, T_BCD − C) / T_BCD; "
               f"{ratio / ideal:.2f}× of it) | | | | | | | | |")  # fmt: skip
    return out


def targets(
    setting: str, block_bytes: float, measured: dict[str, dict], link_s: float = 0.0
) -> list[tuple[str, float, float]]:
    """Each target of one setting as ``(what, measured, bound)``; met where measured <= bound (NaN: not measured).
    ``link_s``: the link's time for a round's exchange (a block each way; 0: loopback), which the worker's and the
    rounds' bounds include."""
    bcd, parablock, nan = measured["fedbcd"], measured["parablock"], float("nan")
    per_byte = FIXED_S + block_bytes / (PER_BYTE_GBPS * 1e9)
    out = []
    for name in ALGORITHMS:
        m = measured[name]
        out.append((f"{setting}, {name}: server, last reply to next messages out (s)",
                    m.get("server_critical_path_s", nan), per_byte))  # fmt: skip
        out.append((f"{setting}, {name}: worker, message to reply less compute (s)", m.get("worker_non_compute_s", nan),
                    per_byte + link_s))  # fmt: skip
    c = bcd["measured_compute_s"]
    out.append((f"{setting}: BCD's round ≤ C + link + 1 s (s)", bcd["round_wall_s"], c + link_s + ROUND_SLACK_S))
    out.append((f"{setting}: ParaBlock's round ≤ max(C, link) + 1 s, beyond (s)", parablock["round_wall_s"],
                max(parablock["measured_compute_s"], link_s) + ROUND_SLACK_S))  # fmt: skip
    ratio, ideal = against_ideal(bcd, parablock)
    out.append((f"{setting}: ParaBlock / BCD, within 10 % of the ideal", ratio, ideal * (1 + WITHIN)))
    if VERIFIED in measured:
        cost = measured[VERIFIED]["round_wall_s"] / parablock["round_wall_s"] - 1
        out.append((f"{setting}: verify-invariant's cost, share of ParaBlock's round", cost, WITHIN))
    return out


def targets_table(found: list[tuple[str, float, float]], link: str = "loopback, its time taken as 0") -> str:
    lines = [f"| target (the link: {link}) | measured | bound | met |", "|---|---|---|---|"]
    for what, value, bound in found:
        met = "not measured" if value != value else "yes" if value <= bound else "**no**"
        lines.append(f"| {what} | {value:.2f} | {bound:.2f} | {met} |")
    return "\n".join(lines)


def losses_table(settings: dict[str, dict[str, dict]]) -> str:
    """The held-out losses of every run, round by round, side by side."""
    runs = [(s, name, m["heldout"]) for s, measured in settings.items() for name, m in measured.items()]
    rounds = sorted({r for _, _, losses in runs for r in losses})
    head = "| setting | algorithm | " + " | ".join(f"round {r}" for r in rounds) + " |"
    lines = [head, "|" + "---|" * (len(rounds) + 2)]
    for setting, name, losses in runs:
        cells = " | ".join(f"{losses[r]:.4f}" if r in losses else "" for r in rounds)
        lines.append(f"| {setting} | {name} | {cells} |")
    return "\n".join(lines)


def report(settings: dict[str, dict[str, dict]], found: list[tuple[str, float, float]]) -> str:
    """Every setting's rounds, the targets, the held-out losses: the page's body."""
    table = "\n".join([TABLE_HEAD, *(row for s, measured in settings.items() for row in rows(s, measured))])
    return f"{table}\n\n{targets_table(found)}\n\nHeld-out loss:\n\n{losses_table(settings)}\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", required=True, help="a model folder (the GPU check: random Llama-3.2-1B weights)")
    parser.add_argument(
        "--dataset", required=True, help="the run's dataset (the GPU check: rows that fill max-seq-len)"
    )
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="the devices, one SuperNode each per setting")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1], help="SuperNodes, a setting each")
    parser.add_argument("--transfer-dtype", nargs="+", default=["int8"], choices=["int8", "bf16", "fp16"])
    parser.add_argument("--verify-invariant", action="store_true", help="ParaBlock with it on too, in each setting")
    parser.add_argument("--rounds", type=rounds_from_3, default=5)
    parser.add_argument("--settings", default="{}", help="more of the run config, as JSON")
    parser.add_argument("--out", type=Path, help="write the page here")
    return parser.parse_args(argv)


def rounds_from_3(text: str) -> int:
    """``--rounds``: the means start at round 3 at the earliest (``first_steady_round``), so at least 3."""
    if not text.isdigit() or int(text) < 3:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number of rounds, at least 3 (the means start at round 3 at the earliest)"
        )
    return int(text)


def main(argv=None) -> dict:
    """The real computation on ``--devices``, with TLS and node authentication: every setting, then the page."""
    args = parse_args(argv)
    config = {
        "model": args.model, "dataset": args.dataset, "num-server-rounds": args.rounds, "schedule": "ascending",
        "layers-per-block": 4, "local-steps": 24, "batch-size": 8, "max-seq-len": 512, "weights": "bf16",
        "precision": "bf16", "evaluation": "clients", "eval-every": args.rounds, "num-examples": 256,
        "heldout-examples": 16,
        "generate-examples": 0, "transport": "direct", **json.loads(args.settings),
    }  # fmt: skip
    settings, found = {}, []
    with tempfile.TemporaryDirectory(prefix="parablock-compare-") as tmp:
        for dtype in args.transfer_dtype:
            for nodes in args.nodes:
                setting = f"{dtype}, {nodes} SuperNode(s)"
                devices = [args.devices[i % len(args.devices)] for i in range(nodes)]
                run = {**config, "transfer-dtype": dtype}
                measured = compare(run, Path(tmp) / f"{dtype}-{nodes}", args.verify_invariant, nodes=nodes,
                                   secure=True, node_settings=[f'device="{d}"' for d in devices])  # fmt: skip
                settings[setting] = measured
                found += targets(setting, block_bytes(args.model, config["layers-per-block"], dtype), measured)
                print("\n".join(rows(setting, measured)), flush=True)
    page = (f"`{command('round_compare')}` at {commit()}; {machine_line()}; devices {', '.join(args.devices)}. "
            f"TLS and node authentication, transport direct, {args.rounds} rounds, "
            f"{window(list(settings.values()))}.\n\n"
            f"{report(settings, found)}")  # fmt: skip
    print(page)
    if args.out is not None:
        args.out.write_text(f"# ParaBlock against BCD, the real computation\n\n{page}")
    return settings


def block_bytes(model: str, layers_per_block: int, transfer_dtype: str) -> float:
    """The wire bytes of the largest block's update in ``transfer_dtype`` (int8's scales aside), from the model's
    config and the run's partition (``plan.model_shape``)."""
    from parablock_flwr.config import RunConfig
    from parablock_flwr.plan import model_config, model_shape

    cfg = RunConfig.from_flower({"model": model, "layers-per-block": layers_per_block})
    return max(model_shape(cfg, model_config(model)).blocks) * (1 if transfer_dtype == "int8" else 2)


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT_DIR))
    main()

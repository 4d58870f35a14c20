"""ParaBlock's one round of staleness where the nodes' updates disagree: with its correction at the end of the K
local steps (``at-end``, the default with ``deterministic``), on receipt, and without it, against sequential BCD.

Issue 45's GPU run saw ParaBlock's held-out loss after 5 rounds at 0.53 against BCD's 0.0007 with 2 SuperNodes, and
the two equal with one. This measures why, on the CPU: the GPU check's rows (one long answer to learn by heart,
``scripts/gpu_check.py``'s ``long_rows_data``), a from-scratch tiny Llama (``--hidden``, 4 layers, 1 layer a block),
2 clients on Flower's simulation engine, 5 rounds of 24 local steps of 8 rows of 512 tokens, the ascending
schedule, int8 transfer. For each learning rate and seed, the held-out loss by round of each algorithm; for
ParaBlock's runs with the correction, how far apart the two nodes' last updates lie (``‖Δ_1 − Δ_2‖ / ‖Δ_1 + Δ_2‖``,
from each node's pending update).

ParaBlock's node trains block ``b_r`` on ``x^{r-2} + Δ_i^{r-1}``, its own update of the previous block, where BCD's
trains it on ``x^{r-1} = x^{r-2} + Δ̄^{r-1}``, the mean (``server-lr = 1``; docs/algorithm.md): the two bases differ by
``Δ_i^{r-1} − Δ̄^{r-1}``, nothing with one node, half of ``Δ_1 − Δ_2`` with two of equal weight. ``at-end`` trains the
whole round on that base; ``on-receipt`` takes the mean in as soon as it arrives (in simulation after the first step).

Each finished run is kept under ``--workdir`` (its run folder): a rerun with the same workdir reads it again.

    .venv/bin/python -m benchmarks.staleness                  # 2 learning rates x 2 seeds x 4 runs (about 45 min here)
    .venv/bin/python -m benchmarks.staleness --report         # the same, into docs/results/staleness.md
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import PROJECT_DIR, read_records, simulate, write_report
from parablock_flwr.data import load_examples
from parablock_flwr.node.state import PendingStore
from parablock_flwr.run_status import read_status
from parablock_flwr.tools.tiny_model import build_tiny_model

TITLE = "ParaBlock's staleness where the nodes' updates disagree"
RUNS = {  # label -> run config; the first is the reference
    "fedbcd": {"algorithm": "fedbcd"},
    "parablock at-end": {"algorithm": "parablock", "correction": "at-end"},
    "parablock on-receipt": {"algorithm": "parablock", "correction": "on-receipt"},
    "parablock none": {"algorithm": "parablock", "correction": "none"},
}
SETTINGS = {  # as issue 45's GPU run (benchmarks/round_compare.py), on a tiny model
    "num-server-rounds": 5, "schedule": "ascending", "layers-per-block": 1, "local-steps": 24, "batch-size": 8,
    "max-seq-len": 512, "num-examples": 256, "heldout-examples": 16, "evaluation": "clients", "generate-examples": 0,
    "transfer-dtype": "int8",
}  # fmt: skip


def disagreement(run_dir: Path) -> float | None:
    """``‖Δ_1 − Δ_2‖ / ‖Δ_1 + Δ_2‖`` of the two nodes' last updates, from their pending updates (as sent); None where
    a node kept none. Only for a run with the correction: ``correction = "none"`` keeps an offset of several blocks
    there, not an update."""
    pending = [PendingStore(run_dir / "node-state" / f"partition-{i}").load() for i in range(2)]
    if any(p is None for p in pending):
        return None
    a, b = (torch.cat([p.delta[n].reshape(-1) for n in sorted(p.delta)]) for p in pending)
    return float((a - b).norm() / (a + b).norm())


def heldout(records: list[dict]) -> list[float]:
    """The held-out loss of rounds 0..R."""
    return [r["heldout_loss"] for r in records if r.get("heldout_loss") is not None]


def finished(out: Path) -> Path | None:
    """The newest run folder under ``out`` whose run completed (a rerun reads it instead of running again)."""
    done = [d for d in sorted(out.glob("*")) if d.is_dir() and (read_status(d) or {}).get("kind") == "completed"]
    return done[-1] if done else None


def run_one(args, name: str, config: dict, corrected: bool) -> dict:
    """One run (or the one kept under ``--workdir``): its held-out losses and, with the correction, the nodes'
    disagreement."""
    out = args.workdir / "runs" / name
    run_dir, started = finished(out), time.perf_counter()
    if run_dir is None:
        run_dir, _ = simulate(args.workdir / "flower" / name, {**config, "output-dir": str(out)}, clients=2)
    result = {"heldout": heldout(read_records(run_dir)), "disagreement": disagreement(run_dir) if corrected else None}
    print(f"  {name}: {time.perf_counter() - started:.0f} s, held-out loss by round "
          f"{' '.join(f'{x:.3f}' for x in result['heldout'])}", flush=True)  # fmt: skip
    return result


def run_all(args) -> dict[tuple[float, int], dict[str, dict]]:
    """Every (learning rate, seed) setting's runs: {setting: {label: {"heldout": [...], "disagreement": x}}}."""
    sys.path.insert(0, str(PROJECT_DIR))  # scripts/ is no package of the install
    from scripts.gpu_check import long_rows_data  # the GPU check's own rows, one source

    data = long_rows_data(args.workdir)
    rows = load_examples(data, None, seed=0)
    texts = list(rows["prompt"]) + list(rows["response"])
    model = build_tiny_model(args.workdir / f"tiny-{args.hidden}", num_layers=4, hidden=args.hidden, vocab=512,
                             texts=texts)  # fmt: skip
    results = {}
    for lr in args.learning_rates:
        for seed in args.seeds:
            results[(lr, seed)] = {}
            for label, algorithm in RUNS.items():
                name = f"lr{lr:g}-s{seed}-{label.replace(' ', '-')}"
                config = {**SETTINGS, **algorithm, "model": str(model), "dataset": data, "learning-rate": lr,
                          "seed": seed}  # fmt: skip
                corrected = algorithm.get("correction") in ("at-end", "on-receipt")
                results[(lr, seed)][label] = run_one(args, name, config, corrected)
    return results


def table(results: dict[tuple[float, int], dict[str, dict]]) -> str:
    """One row per run: its held-out loss by round, its last round's against BCD's, its nodes' disagreement."""
    rounds = {len(run["heldout"]) for runs in results.values() for run in runs.values()}
    if len(rounds) != 1:
        raise ValueError(f"the runs evaluated {sorted(rounds)} rounds: expected as many in each")
    rounds = rounds.pop()
    head = "| learning rate | seed | run | " + " | ".join(f"round {r}" for r in range(rounds))
    head += " | last round − BCD's | ‖Δ_1 − Δ_2‖ / ‖Δ_1 + Δ_2‖, last round |\n"
    head += "|---" * (rounds + 5) + "|\n"
    lines = []
    for (lr, seed), runs in results.items():
        bcd = runs["fedbcd"]["heldout"][-1]
        for label, run in runs.items():
            gap = "" if label == "fedbcd" else f"{run['heldout'][-1] - bcd:+.3f}"
            apart = "" if run["disagreement"] is None else f"{run['disagreement']:.2f}"
            losses = " | ".join(f"{x:.3f}" for x in run["heldout"])
            lines.append(f"| {lr:g} | {seed} | {label} | {losses} | {gap} | {apart} |")
    return head + "\n".join(lines)


def reading(results: dict[tuple[float, int], dict[str, dict]]) -> str:
    """What the table says, from its figures: each ParaBlock run's last-round gap to BCD over every setting, and
    how far apart its two nodes' last updates lay."""
    parts = []
    for label in list(RUNS)[1:]:
        gaps = [runs[label]["heldout"][-1] - runs["fedbcd"]["heldout"][-1] for runs in results.values()]
        apart = [runs[label]["disagreement"] for runs in results.values() if runs[label]["disagreement"] is not None]
        spread = f"; its nodes' last updates {min(apart):.2f} to {max(apart):.2f} apart" if apart else ""
        parts.append(f"{label}: {min(gaps):+.3f} to {max(gaps):+.3f}{spread}")
    return (
        f"The last round's held-out loss against BCD's, over the {len(results)} settings (the nodes' last updates "
        "apart as ‖Δ_1 − Δ_2‖ / ‖Δ_1 + Δ_2‖; 0 with one node, where ParaBlock equals BCD bit for bit: "
        f"tests/test_simulation.py): {'; '.join(parts)}."
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staleness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--hidden", type=int, default=256, help="the tiny Llama's width")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/parablock-staleness"))
    parser.add_argument("--report", action="store_true", help="write docs/results/staleness.md")
    args = parser.parse_args(argv)
    if any(not (math.isfinite(lr) and lr > 0) for lr in args.learning_rates):
        parser.error(f"--learning-rates {args.learning_rates}: expected positive numbers")
    if args.hidden < 64 or args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: expected a multiple of 64 (the tiny Llama's heads of 64 or fewer)")
    if any(seed < 0 for seed in args.seeds):
        parser.error(f"--seeds {args.seeds}: expected numbers >= 0")
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = run_all(args)
    body = table(results) + "\n\n" + reading(results)
    print(body)
    if args.report:
        write_report("staleness", TITLE, body, doc=__doc__)
    return results


if __name__ == "__main__":
    main()

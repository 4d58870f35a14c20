"""Where ParaBlock's lower loss than sequential BCD at alpha 0.1 comes from, measured on the reference.

The convergence study's tiny setting (benchmarks/convergence.py's ``TINY``: a tiny Llama,
8 clients, Dirichlet over the instruction-mix families, half the clients each round, 40
rounds) run by parablock_flwr/reference.py, the spec's rounds as a plain loop, which
tests/test_reference.py holds bit for bit to the app. No Flower: a run takes about a
minute instead of five. Parts (each run's result is kept under ``--workdir``):

- ``seeds``: ParaBlock and BCD on the same clients each round, 8 seeds, 40 rounds;
- ``app-like``: the same, but each run samples its clients over its own random order of
  the partitions, as the app does (it samples Flower's random node ids): two runs of one
  seed do not train the same clients;
- shorter (``--sweep-rounds``, 20), on this shared 2-core machine: ``lr``: a learning-rate
  sweep (3 values) for each algorithm, 2 seeds; ``full``: ``fraction-train = 1``, 2 seeds;
  ``cause``: ParaBlock's start point ``x^{r-1} + (Δ_i^{r-1} − g^{r-1})`` taken apart: ``x^{r-1} +
  Δ_i^{r-1}`` (its own update, without taking the average step out), 2 seeds (the reference
  also has ``stale``, ``x^{r-2}``: staleness alone, not run here);
- ``app``: the app itself (`flwr run`, simulation) on this setting for a few rounds
  (``--app-rounds``), each algorithm, against the reference on the clients the app trained:
  the largest difference of the global model after every round.

    .venv/bin/python -m benchmarks.reference_gap                 # every part, the figure, the section
    .venv/bin/python -m benchmarks.reference_gap --parts seeds --no-write
    .venv/bin/python -m benchmarks.reference_gap --parts app --no-write   # the app against the reference
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import datasets

from benchmarks.common import PROJECT_DIR, command, replace_doc_section, simulate
from benchmarks.convergence import TINY
from parablock_flwr import reference
from parablock_flwr.config import RunConfig
from parablock_flwr.tools.tiny_model import build_tiny_model

SECTION = "## The alpha 0.1 gap, taken apart on the reference"
ALPHA = 0.1
LEARNING_RATES = (1e-3, 3e-3, 1e-2)


def config(model: Path, seed: int, rounds: int, **changes) -> RunConfig:
    values = {**TINY, "model": str(model), "dirichlet-alpha": ALPHA, "seed": seed, "num-server-rounds": rounds}
    values.update({k.replace("_", "-"): v for k, v in changes.items()})
    return RunConfig.from_flower(values)


def app_like(cfg: RunConfig, num_clients: int, salt: str):
    """The app's participation: the round's seeded sample over a random order of the clients
    (Flower's node ids), a different order in every run."""
    order = list(range(num_clients))
    random.Random(salt).shuffle(order)
    return lambda r: sorted(order[j] for j in reference.sample(cfg, num_clients, r))


def run_once(name: str, cfg: RunConfig, start: str, clients: int, workdir: Path, app_order: bool = False) -> dict:
    """One reference run (or its kept result): held-out loss every round and what each client did."""
    done = workdir / "results" / f"{name}.json"
    if done.exists():
        return json.loads(done.read_text())
    started = time.perf_counter()
    participants = app_like(cfg, clients, name) if app_order else None
    rounds = reference.run(cfg, clients, start, participants=participants, evaluate_every=1)
    result = {
        "name": name,
        "start": start,
        "seed": cfg.seed,
        "learning_rate": cfg.learning_rate,
        "fraction_train": cfg.fraction_train,
        "loss": [initial(cfg, workdir)] + [r.heldout_loss for r in rounds],
        "participants": [r.participants for r in rounds],
        "stale_starts": [r.stale_start for r in rounds],
        "steps": [sum(r.steps.values()) for r in rounds],
        "examples": [sum(r.examples.values()) for r in rounds],
        "batches": [r.batches for r in rounds],
        "wall_s": time.perf_counter() - started,
    }
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result))
    print(f"  {name}: {result['wall_s']:.0f} s, final held-out loss {result['loss'][-1]:.4f}", flush=True)
    return result


def initial(cfg: RunConfig, workdir: Path) -> float:
    """The held-out loss of x^0 (it depends on the seed only: the held-out rows)."""
    path = workdir / "results" / f"initial-s{cfg.seed}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(reference.initial_loss(cfg)))
    return json.loads(path.read_text())


def runs(args, model: Path) -> dict[str, dict[str, list[dict]]]:
    """{part: {label: [result per seed]}}."""
    out: dict[str, dict[str, list[dict]]] = {}
    clients, w = args.clients, args.workdir

    def series(part, label, start, seeds, app_order=False, **changes):
        results = []
        rounds = args.rounds if part in ("seeds", "app-like") else args.sweep_rounds
        for seed in seeds:
            cfg = config(model, seed, rounds, **changes)
            tag = "".join(f"-{k}{v:g}" for k, v in sorted(changes.items()))
            name = f"{start}{tag}{'-app' if app_order else ''}-s{seed}-r{rounds}"
            results.append(run_once(name, cfg, start, clients, w, app_order))
        out.setdefault(part, {})[label] = results

    for part in args.parts:
        if part == "seeds":
            for start in ("parablock", "fedbcd"):
                series(part, start, start, args.seeds)
        elif part == "app-like":
            for start in ("parablock", "fedbcd"):
                series(part, start, start, args.seeds, app_order=True)
        elif part == "cause":
            for start in ("parablock", "fedbcd", "fresh-plus-own"):
                series(part, start, start, args.seeds[:2])
        elif part == "lr":
            for start in ("parablock", "fedbcd"):
                for lr in LEARNING_RATES:
                    changes = {} if lr == TINY["learning-rate"] else {"learning_rate": lr}
                    series(part, f"{start}, lr {lr:g}", start, args.seeds[:2], **changes)
        elif part == "full":
            for start in ("parablock", "fedbcd"):
                series(part, start, start, args.seeds[:2], fraction_train=1.0)
        elif part != "app":
            raise SystemExit(f"--parts {part}: expected seeds, app-like, cause, lr, full or app")
    return out


APP = {"parablock": {"algorithm": "parablock", "correction": "at-end"}, "fedbcd": {"algorithm": "fedbcd"},
       "parablock-no-correction": {"algorithm": "parablock", "correction": "none"}}  # fmt: skip


def app_against_reference(args, model: Path) -> list[str]:
    """Each algorithm once in the app (seed 0, ``--app-rounds``), then the reference on the partitions
    it trained: the largest difference of x^r, round by round, and which partitions each run trained."""
    done = args.workdir / "results" / f"app-r{args.app_rounds}.json"
    if done.exists():
        return json.loads(done.read_text())
    out, trained = [], {}
    for label, algorithm in APP.items():
        values = {**TINY, **algorithm, "model": str(model), "dirichlet-alpha": ALPHA, "seed": 0,
                  "num-server-rounds": args.app_rounds}  # fmt: skip
        work = args.workdir / "app" / label
        run_dir, records = simulate(work / "flower", {**values, "output-dir": str(work / "runs")}, args.clients)
        cfg = RunConfig.from_flower(values)
        trained[label] = reference.app_participants(records)
        started = time.perf_counter()
        rounds = reference.run(cfg, args.clients, participants=trained[label].get)
        took = time.perf_counter() - started
        diffs = [reference.largest_difference(a, r.x) for a, r in zip(reference.app_models(run_dir, cfg), rounds)]
        out.append(f"- {label}: largest difference of x^r from the reference's, rounds 1-{args.app_rounds}: "
                   f"{', '.join(f'{d:.1e}' if d else '0 (same bits)' for d in diffs)}; the app's run "
                   f"{records[-1]['elapsed_s']:.0f} s, the reference's {took:.0f} s.")  # fmt: skip
    first = trained["parablock"]
    same = {label: sum(t[r] == first[r] for r in first) for label, t in trained.items()}
    out.append(
        "- partitions trained per round, seed 0: " + "; ".join(f"{label}: {t}" for label, t in trained.items())
        + ". Rounds in which each run trained the same partitions as ParaBlock's: "
        + ", ".join(f"{label} {n} of {len(first)}" for label, n in same.items()) + "."
    )  # fmt: skip
    done.write_text(json.dumps(out))
    return out


# ------------------------------------------------------------------ reading
def gaps(ours: list[dict], theirs: list[dict], at: int = -1) -> list[float]:
    """Seed by seed: ours' held-out loss at round ``at`` relative to theirs' (−: ours lower)."""
    return [a["loss"][at] / b["loss"][at] - 1 for a, b in zip(ours, theirs)]


def fmt_gaps(values: list[float]) -> str:
    mean, lower = statistics.fmean(values), sum(v < 0 for v in values)
    spread = f", sd {statistics.stdev(values):.1%}" if len(values) > 1 else ""
    return f"{', '.join(f'{v:+.1%}' for v in values)} (mean {mean:+.1%}{spread}; lower on {lower} of {len(values)})"


def same_work(a: list[dict], b: list[dict]) -> str:
    """Whether two series trained the same clients on the same batches, for as many steps and examples."""
    same_clients = all(x["participants"] == y["participants"] for x, y in zip(a, b))
    same_batches = all(x["batches"] == y["batches"] for x, y in zip(a, b))
    steps = {sum(x["steps"]) for x in a + b}
    examples = {sum(x["examples"]) for x in a + b}
    return (
        f"same clients every round: {'yes' if same_clients else 'no'}; the same batches (SHA-256 of their token "
        f"ids) per client and round: {'yes' if same_batches else 'no'}; local steps per run: "
        f"{', '.join(map(str, sorted(steps)))}; examples per run: {', '.join(map(str, sorted(examples)))}"
    )


def lines(found: dict) -> list[str]:
    """The section's findings, one line each (the reading is in docs/benchmarks.md)."""
    out = []
    if "seeds" in found:
        p, b = found["seeds"]["parablock"], found["seeds"]["fedbcd"]
        stale = statistics.fmean(sum(r["stale_starts"]) / sum(map(len, r["participants"])) for r in p)
        out += [
            f"- same clients, {len(p)} seeds: ParaBlock's final loss against BCD's: {fmt_gaps(gaps(p, b))}.",
            f"  Work counted on these runs: {same_work(p, b)}.",
            f"  ParaBlock's client rounds that started from the client's own previous update: {stale:.0%}.",
        ]
    if "app-like" in found:
        p, b = found["app-like"]["parablock"], found["app-like"]["fedbcd"]
        out.append(
            f"- clients sampled as the app does (its own order per run), {len(p)} seeds: {fmt_gaps(gaps(p, b))}."
        )
        out.append(f"  Work counted: {same_work(p, b)}.")
    if "cause" in found:
        c, rounds = found["cause"], len(found["cause"]["fedbcd"][0]["loss"]) - 1
        for label in ("parablock", "fresh-plus-own"):
            gap = fmt_gaps(gaps(c[label], c["fedbcd"]))
            out.append(f"- start `{label}` against BCD, {len(c[label])} seeds, {rounds} rounds: {gap}.")
    if "lr" in found:
        by, best = found["lr"], {}
        for start in ("parablock", "fedbcd"):
            finals = {lr: statistics.fmean(r["loss"][-1] for r in by[f"{start}, lr {lr:g}"]) for lr in LEARNING_RATES}
            best[start] = min(finals, key=finals.get)
            listed = ", ".join(f"lr {lr:g}: {v:.4f}" for lr, v in finals.items())
            seeds, rounds = len(by[f"{start}, lr 0.001"]), len(by[f"{start}, lr 0.001"][0]["loss"]) - 1
            out.append(f"- {start}, mean final loss ({seeds} seeds, {rounds} rounds): {listed}.")
        p, b = by[f"parablock, lr {best['parablock']:g}"], by[f"fedbcd, lr {best['fedbcd']:g}"]
        out.append(
            f"- each at its best learning rate (ParaBlock {best['parablock']:g}, BCD {best['fedbcd']:g}): "
            f"{fmt_gaps(gaps(p, b))}."
        )
    if "full" in found:
        p, b = found["full"]["parablock"], found["full"]["fedbcd"]
        rounds = len(p[0]["loss"]) - 1
        out.append(f"- `fraction-train = 1`, {len(p)} seeds, {rounds} rounds: {fmt_gaps(gaps(p, b))}.")
    return out


def plot(found: dict, path: Path) -> None:
    """ParaBlock's held-out loss against BCD's by round: the mean and range over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [
        ("seeds", "parablock", "ParaBlock, same clients"),
        ("app-like", "parablock", "ParaBlock, clients sampled as the app does (its own order per run)"),
        ("cause", "fresh-plus-own", "start x^{r-1} + own previous update"),
    ]
    for part, ours, label in series:
        if part not in found:
            continue
        a, b = found[part][ours], found[part]["fedbcd"]
        per_round = list(zip(*([x / y - 1 for x, y in zip(s["loss"], t["loss"])] for s, t in zip(a, b))))
        rounds = range(len(per_round))
        mean = [100 * statistics.fmean(v) for v in per_round]
        (line,) = ax.plot(rounds, mean, label=f"{label} ({len(a)} seeds)")
        ax.fill_between(rounds, [100 * min(v) for v in per_round], [100 * max(v) for v in per_round],
                        color=line.get_color(), alpha=0.15)  # fmt: skip
    study = json.loads((PROJECT_DIR / "docs" / "convergence.json").read_text())["summary"].get(f"tiny, alpha {ALPHA:g}")
    if study:  # the convergence study's app runs: each run sampled its clients over its own node order
        p, b = study["parablock"], study["fedbcd"]
        gap = [100 * (x / y - 1) for x, y in zip(p["heldout_loss_mean"], b["heldout_loss_mean"])]
        ax.plot(
            p["rounds"], gap, "k--", label=f"the app's study: mean of {len(p['seeds'])} seeds, other clients per run"
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.set(xlabel="round", ylabel="held-out loss against BCD's, % (mean, range over seeds)",
           title=f"tiny Llama, 8 clients, alpha {ALPHA:g}, half the clients per round (reference)")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", type=lambda s: s.split(","), default=["seeds", "app-like", "cause", "lr", "full", "app"]
    )
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=list(range(8)))
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the seeds and app-like parts")
    parser.add_argument("--sweep-rounds", type=int, default=20, help="rounds of the lr, full and cause parts")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--app-rounds", type=int, default=4, help="rounds of the app runs (part app)")
    parser.add_argument("--workdir", type=Path, default=Path("~/parablock-runs/reference-gap").expanduser())
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    datasets.disable_progress_bars()
    model = args.workdir / "tiny-model"
    if not (model / "config.json").exists():  # built once: parallel invocations share the folder
        build_tiny_model(model)
    found = runs(args, model)
    text = lines(found) + (app_against_reference(args, model) if "app" in args.parts else [])
    print("\n".join(text))
    if args.no_write:
        return
    figure = PROJECT_DIR / "docs" / "img" / "reference-gap-by-round.png"
    plot(found, figure)
    wall = sum(r["wall_s"] for part in found.values() for series in part.values() for r in series)
    body = [f"`{command('reference_gap')}` ({wall / 60:.0f} min of runs, wall times summed)", "\n".join(text),
            f"![the gap by round](img/{figure.name})"]  # fmt: skip
    replace_doc_section(SECTION, "\n\n".join(body))


if __name__ == "__main__":
    main()

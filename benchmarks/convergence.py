"""Measures whether ParaBlock converges like sequential BCD, and whether the correction is what makes it so.

Every run is a real `flwr run` on Flower's simulation engine. Three parts:

- ``tiny``: a tiny Llama on non-IID data (Dirichlet over the task families of
  ``reasoning-gym:instruction-mix``, two values of alpha), 8 virtual clients,
  half of them sampled each round, 40 rounds, 3 seeds; ParaBlock (``at-end``,
  ``on-receipt``), ParaBlock without the correction (``correction = "none"``),
  sequential BCD, FedAvg-LoRA and full FedAvg.
- ``schedules``: ParaBlock's four block schedules on one of those settings.
- ``smollm2``: the default job (SmolLM2-135M-Instruct, its data and settings)
  with 4 clients, half of them sampled each round, the same six algorithms,
  12 rounds, one seed, with the task accuracy before and after;
  ``smollm2-gsm``: the same on GSM-style math, whose loss keeps falling.

It prints the tables, draws held-out loss against rounds and against bytes sent
(mean and range over seeds) into docs/img/, writes the summary to
docs/results/convergence.json and docs/results/convergence.md. Each finished run's
records are kept under ``--workdir``: an interrupted study continues where it stopped.

    .venv/bin/python -m benchmarks.convergence                    # everything (about 100 min here)
    .venv/bin/python -m benchmarks.convergence --parts tiny       # one part
    .venv/bin/python -m benchmarks.convergence --quick --no-write # a smoke check

Reading the page: ParaBlock follows sequential BCD, and the correction is what keeps it there: without it the
clients' models drift from the global one and the gap grows with rounds. Per byte, block coordinate descent
beats full FedAvg. A page measured while the server sampled over Flower's node ids (random per run, as at
7f17889) compares, within one seed, algorithms that trained different clients; the same clients were compared
by an experiment no longer in the tree (``git show 774a9fb:benchmarks/reference_gap.py``). On the default
data SmolLM2 learns the answers' format and their prior, not the logic: read its held-out loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.common import PROJECT_DIR, RESULTS_DIR, command, simulate, write_report
from parablock_flwr.config import RunConfig
from parablock_flwr.tools.tiny_model import build_tiny_model

TITLE = "Convergence: ParaBlock against sequential BCD, without its correction, and the baselines"
REFERENCE = "fedbcd"

ALGORITHMS = {  # label -> run config; the LoRA learning rate is set per part
    "parablock": {"algorithm": "parablock", "correction": "at-end"},
    "parablock-on-receipt": {"algorithm": "parablock", "correction": "on-receipt"},
    "parablock-no-correction": {"algorithm": "parablock", "correction": "none"},
    "fedbcd": {"algorithm": "fedbcd"},
    "fedavg-lora": {"algorithm": "fedavg-lora"},
    "fedavg-full": {"algorithm": "fedavg-full"},
}
SCHEDULES = ("ascending", "descending", "random-permutation", "uniform-random")

TINY = {  # a from-scratch tiny Llama: every block, embeddings included, has much to learn
    "dataset": "reasoning-gym:instruction-mix",
    "num-examples": 960,
    "heldout-examples": 64,
    "partitioning": "dirichlet",
    "layers-per-block": 1,
    "non-layer-params": "block",
    "local-steps": 4,
    "batch-size": 8,
    "max-seq-len": 128,
    "learning-rate": 3e-3,
    "fraction-train": 0.5,
    "generate-examples": 0,
    "torch-threads": 1,
    "schedule": "descending",
    "eval-every": 1,
    "lr-schedule": "constant",
}
TINY_LORA_LR = 3e-3
SMOLLM2 = {  # the default job (model, data, steps, learning rate), for longer, half the clients each round
    "fraction-train": 0.5,
    "eval-every": 1,
}
SMOLLM2_LORA_LR = 5e-4  # as benchmarks/compare_algorithms.py


# ------------------------------------------------------------------ runs
WALL_S: dict[str, float] = {}  # each run's wall time, by name (a run shared by two parts counts once)


def run_once(name: str, config: dict, clients: int, workdir: Path) -> dict:
    """One simulation (or its kept result): the per-round records and the wall time."""
    done = workdir / "results" / f"{name}.json"
    if done.exists():
        result = json.loads(done.read_text())
        WALL_S.setdefault(name, result["wall_s"])
        return result
    out = workdir / "runs" / name
    started = time.perf_counter()
    _, records = simulate(workdir / "flower" / name, {**config, "output-dir": str(out)}, clients)
    result = {"name": name, "config": config, "wall_s": time.perf_counter() - started, "records": records}
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result))
    WALL_S[name] = result["wall_s"]
    print(f"  {name}: {result['wall_s']:.0f} s, held-out loss {final_loss(result):.4f}", flush=True)
    return result


def final_loss(result: dict) -> float:
    return [r["heldout_loss"] for r in result["records"] if r.get("heldout_loss") is not None][-1]


def curve(result: dict) -> tuple[list[int], list[float], list[float]]:
    """(rounds, held-out losses, cumulative MB on the wire) at each evaluated round."""
    rounds, losses, mb, sent = [], [], [], 0
    for r in result["records"]:
        sent += r.get("wire_bytes_up", 0) + r.get("wire_bytes_down", 0)
        if r.get("heldout_loss") is not None:
            rounds.append(r["round"]), losses.append(r["heldout_loss"]), mb.append(sent / 1e6)
    return rounds, losses, mb


def accuracy(result: dict) -> tuple[float | None, float | None]:
    """The task accuracy of x^0 and of the final model, where it was measured."""
    measured = [r["task_accuracy"] for r in result["records"] if r.get("task_accuracy") is not None]
    return (measured[0], measured[-1]) if len(measured) >= 2 else (None, None)


def tiny_part(args, model: Path, workdir: Path) -> dict:
    """Every algorithm at each alpha, over the seeds: {setting: {label: [result per seed]}}."""
    out = {}
    for alpha in args.alphas:
        setting = f"tiny, alpha {alpha:g}"
        out[setting] = {}
        for label, algorithm in ALGORITHMS.items():
            out[setting][label] = []
            for seed in args.seeds:
                config = {**TINY, **algorithm, "model": str(model), "dirichlet-alpha": alpha, "seed": seed}
                config["num-server-rounds"] = args.rounds
                if label == "fedavg-lora":
                    config["learning-rate"] = TINY_LORA_LR
                name = f"tiny-a{alpha:g}-{label}-s{seed}-r{args.rounds}"
                out[setting][label].append(run_once(name, config, args.clients, workdir))
    return out


def schedules_part(args, model: Path, workdir: Path) -> dict:
    """ParaBlock's schedules on the first alpha: {setting: {schedule: [result per seed]}}."""
    alpha = args.alphas[0]
    setting = f"tiny, alpha {alpha:g}, ParaBlock's schedules"
    out = {setting: {}}
    for schedule in SCHEDULES:
        out[setting][schedule] = []
        for seed in args.seeds:
            config = {**TINY, **ALGORITHMS["parablock"], "model": str(model), "dirichlet-alpha": alpha, "seed": seed}
            config.update({"num-server-rounds": args.rounds, "schedule": schedule})
            name = f"tiny-a{alpha:g}-parablock-{schedule}-s{seed}-r{args.rounds}"
            if schedule == RunConfig().schedule:  # the same run as the tiny part's
                name = f"tiny-a{alpha:g}-parablock-s{seed}-r{args.rounds}"
            out[setting][schedule].append(run_once(name, config, args.clients, workdir))
    return out


SMOLLM2_GSM = {  # GSM-style math: worked answers, a loss that keeps falling; held-out and generation as before
    "dataset": "reasoning-gym:gsm_symbolic",
    "heldout-examples": 16,
    "generate-examples": 0,  # SmolLM2-135M answers none of them, before or after (docs/results/compare_algorithms.md)
}


def smollm2_part(args, workdir: Path, gsm: bool = False) -> dict:
    """SmolLM2 as in the default job (or on GSM-style math), one seed: {setting: {label: [result]}}."""
    setting = "SmolLM2-135M, GSM-style math" if gsm else "SmolLM2-135M, default data"
    out = {setting: {}}
    for label, algorithm in ALGORITHMS.items():
        config = {**SMOLLM2, **(SMOLLM2_GSM if gsm else {}), **algorithm}
        config.update({"num-server-rounds": args.smollm2_rounds, "seed": args.seeds[0]})
        if label == "fedavg-lora":
            config["learning-rate"] = SMOLLM2_LORA_LR
        name = f"smollm2{'-gsm' if gsm else ''}-{label}-s{args.seeds[0]}-r{args.smollm2_rounds}"
        out[setting][label] = [run_once(name, config, args.smollm2_clients, workdir)]
    return out


# ------------------------------------------------------------------ summary
def summarise(runs: dict) -> dict:
    """Per setting and label: mean/min/max held-out loss per evaluated round, MB, final loss, accuracy."""
    summary = {}
    for setting, by_label in runs.items():
        summary[setting] = {}
        for label, results in by_label.items():
            curves = [curve(r) for r in results]
            rounds = curves[0][0]
            per_round = list(zip(*(c[1] for c in curves)))
            acc = [accuracy(r) for r in results]
            summary[setting][label] = {
                "seeds": [r["config"]["seed"] for r in results],
                "rounds": rounds,
                "heldout_loss_mean": [statistics.fmean(v) for v in per_round],
                "heldout_loss_min": [min(v) for v in per_round],
                "heldout_loss_max": [max(v) for v in per_round],
                "mb_sent_mean": [statistics.fmean(v) for v in zip(*(c[2] for c in curves))],
                "final_loss": [final_loss(r) for r in results],
                "accuracy_before": [a[0] for a in acc],
                "accuracy_after": [a[1] for a in acc],
                "wall_s": [r["wall_s"] for r in results],
                "config": results[0]["config"],
            }
    return summary


def gaps_to_reference(summary: dict, label: str, skip: int) -> list[float]:
    """``label``'s mean held-out loss relative to sequential BCD's (+: above, worse), at each evaluated
    round after the first ``skip``."""
    if REFERENCE not in summary or label not in summary:
        return []
    ours, ref = summary[label], summary[REFERENCE]
    return [
        a / b - 1 for r, a, b in zip(ours["rounds"], ours["heldout_loss_mean"], ref["heldout_loss_mean"]) if r > skip
    ]


def paired(summary: dict, label: str, reference: str) -> list[float]:
    """``label``'s final loss relative to ``reference``'s, seed by seed: a seed fixes the data split, the
    clients sampled each round (drawn over their partition ids) and each client's batches in a round."""
    return [a / b - 1 for a, b in zip(summary[label]["final_loss"], summary[reference]["final_loss"])]


def fmt_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ({min(values):.4f}–{max(values):.4f})"


def fmt_acc(before: list, after: list) -> str:
    if any(v is None for v in before + after):
        return "–"
    return " / ".join(f"{b:.0%} → {a:.0%}" for b, a in zip(before, after))


def table(setting: str, by_label: dict, skip: int) -> str:
    lines = [
        f"**{setting}**",
        "",
        "| run | final held-out loss, mean (min–max) | mean loss against BCD's after round "
        f"{skip}: most above / most below | MB sent per run | task accuracy r0 → rR | wall s per run |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in by_label.items():
        gaps = gaps_to_reference(by_label, label, skip)
        gap = f"{max(gaps):+.2%} / {min(gaps):+.2%}" if gaps and label != REFERENCE else "–"
        lines.append(
            f"| {label} | {fmt_spread(s['final_loss'])} | {gap} | "
            f"{s['mb_sent_mean'][-1]:.1f} | {fmt_acc(s['accuracy_before'], s['accuracy_after'])} | "
            f"{statistics.fmean(s['wall_s']):.0f} |"
        )
    return "\n".join(lines)


def claims(setting: str, by_label: dict, skip: int) -> list[str]:
    """The issue's claims, checked on this setting's numbers (one line each)."""
    lines = []
    for label in ("parablock", "parablock-on-receipt"):
        gaps = gaps_to_reference(by_label, label, skip)
        if gaps:
            worst = max(abs(g) for g in gaps)
            verdict = "holds" if worst <= 0.02 else "does not hold"
            seeds = ", ".join(f"{g:+.1%}" for g in paired(by_label, label, REFERENCE))
            ref = by_label[REFERENCE]["final_loss"]
            spread = f" (BCD's own spread over the seeds: {max(ref) / min(ref) - 1:.1%})" if len(ref) > 1 else ""
            lines.append(
                f"- {setting}: {label}'s mean held-out loss stays within {worst:.2%} of sequential BCD's after "
                f"round {skip} (from {max(gaps):+.2%} to {min(gaps):+.2%}; claim: within 2%, {verdict}); "
                f"final loss against BCD's, seed by seed: {seeds}{spread}."
            )
    if "parablock" in by_label and "parablock-no-correction" in by_label:
        change = paired(by_label, "parablock-no-correction", "parablock")
        worse = sum(c > 0 for c in change)
        if len(change) < 2:
            verdict = "one seed"
        elif worse == len(change):
            verdict = f"measurably worse: above on each of the {len(change)} seeds"
        else:
            verdict = f"not measurably worse: above on {worse} of {len(change)} seeds"
        seeds = ", ".join(f"{c:+.1%}" for c in change)
        with_c, without = by_label["parablock"], by_label["parablock-no-correction"]
        rounds = with_c["rounds"]
        at = sorted({rounds[len(rounds) * q // 4] for q in (1, 2, 3)} | {rounds[-1]})
        growth = ", ".join(
            f"{without['heldout_loss_mean'][rounds.index(r)] / with_c['heldout_loss_mean'][rounds.index(r)] - 1:+.1%} "
            f"at round {r}"
            for r in at
        )
        lines.append(
            f"- {setting}: without the correction the final loss is, seed by seed, {seeds} ({verdict}); "
            f"its mean loss against ParaBlock's: {growth}."
        )
    if "fedavg-full" in by_label and REFERENCE in by_label:
        ref, full = by_label[REFERENCE], by_label["fedavg-full"]
        budget = ref["mb_sent_mean"][-1]
        k = max(i for i, mb in enumerate(full["mb_sent_mean"]) if mb <= budget)
        lines.append(
            f"- {setting}: per byte: with the {budget:.0f} MB sequential BCD sends in its {ref['rounds'][-1]} rounds "
            f"(mean loss {ref['heldout_loss_mean'][-1]:.4f}), full FedAvg reaches round {full['rounds'][k]} "
            f"({full['mb_sent_mean'][k]:.0f} MB, mean loss {full['heldout_loss_mean'][k]:.4f})."
        )
    if set(SCHEDULES) <= set(by_label):
        ranked = sorted(SCHEDULES, key=lambda s: statistics.fmean(by_label[s]["final_loss"]))
        spread = (
            statistics.fmean(by_label[ranked[-1]]["final_loss"]) / statistics.fmean(by_label[ranked[0]]["final_loss"])
            - 1
        )
        best, worst = by_label[ranked[0]]["final_loss"], by_label[ranked[-1]]["final_loss"]
        overlap = "the seeds' ranges overlap" if max(best) >= min(worst) else "the seeds' ranges are apart"
        lines.append(
            f"- {setting}: best to worst mean final loss {' < '.join(ranked)}; the worst is {spread:+.2%} above "
            f"the best ({overlap})."
        )
    return lines


def plot(setting: str, by_label: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, s in by_label.items():
        style = "--" if "no-correction" in label else "-"
        (line,) = ax_r.plot(s["rounds"], s["heldout_loss_mean"], style, label=label)
        ax_r.fill_between(s["rounds"], s["heldout_loss_min"], s["heldout_loss_max"], color=line.get_color(), alpha=0.2)
        ax_b.plot(s["mb_sent_mean"], s["heldout_loss_mean"], style, color=line.get_color(), label=label)
    ax_r.set(xlabel="round", ylabel="held-out loss", title=f"{setting}: against rounds")
    ax_b.set(xlabel="MB sent (all messages and replies)", ylabel="held-out loss", title="against bytes sent")
    ax_b.set_xscale("log")
    ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rounded(value):
    """Floats to 5 significant digits, for a summary file that stays small and readable."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def slug(setting: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in setting.lower()).strip("-").replace("--", "-")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.convergence",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--parts",
        default="tiny,schedules,smollm2,smollm2-gsm",
        help="comma-separated: tiny, schedules, smollm2, smollm2-gsm",
    )
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the tiny-model runs")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--alphas", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 1.0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--smollm2-rounds", type=int, default=12)
    parser.add_argument("--smollm2-clients", type=int, default=4)
    parser.add_argument("--skip-rounds", type=int, default=5, help="the gap to BCD is taken after these rounds")
    parser.add_argument("--workdir", type=Path, default=Path("~/parablock-runs/convergence-study").expanduser())
    parser.add_argument("--quick", action="store_true", help="4 rounds, 1 seed, 4 clients, tiny parts only")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if args.quick:
        args.rounds, args.seeds, args.clients, args.skip_rounds, args.alphas = 4, [0], 4, 1, args.alphas[:1]
        parts -= {"smollm2", "smollm2-gsm"}
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    part_s: dict = {}
    model = build_tiny_model(args.workdir / "tiny-model")
    for part, fn in (
        ("tiny", lambda: tiny_part(args, model, args.workdir)),
        ("schedules", lambda: schedules_part(args, model, args.workdir)),
        ("smollm2", lambda: smollm2_part(args, args.workdir)),
        ("smollm2-gsm", lambda: smollm2_part(args, args.workdir, gsm=True)),
    ):
        if part in parts:
            print(f"{part} ...", flush=True)
            counted = set(WALL_S)
            runs.update(fn())
            part_s[part] = sum(s for name, s in WALL_S.items() if name not in counted)
    summary = summarise(runs)
    tables = [table(setting, by_label, args.skip_rounds) for setting, by_label in summary.items()]
    checked = [line for setting, by_label in summary.items() for line in claims(setting, by_label, args.skip_rounds)]
    print("\n\n".join(tables) + "\n\n" + "\n".join(checked))
    if args.no_write:
        return
    how = command("convergence")
    figures = []
    for setting, by_label in summary.items():
        path = PROJECT_DIR / "docs" / "img" / f"convergence-{slug(setting)}.png"
        plot(setting, by_label, path)
        figures.append(f"![{setting}](../img/{path.name})")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "convergence.json").write_text(
        json.dumps({"command": how, "runs_s": sum(WALL_S.values()), "part_s": part_s, "summary": rounded(summary)})
        + "\n"
    )  # fmt: skip
    parts_took = ", ".join(f"{p} {s / 60:.0f} min" for p, s in part_s.items())
    took = (
        f"Its {len(WALL_S)} runs took {sum(WALL_S.values()) / 60:.0f} min here, one after the other "
        f"({parts_took}; each run's time includes starting Flower and Ray, about 20 s)."
    )
    body = [took, "\n".join(checked), *tables, *figures]
    write_report("convergence", TITLE, "\n\n".join(body) + "\n", how=how)


if __name__ == "__main__":
    main()

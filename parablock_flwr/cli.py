"""`parablock-flwr`: what users do outside `flwr run`.

    parablock-flwr simulate [KEY=VALUE ...]      one simulation run (own SuperLink, stopped after)
    parablock-flwr deploy [KEY=VALUE ...]        a real local deployment: SuperLink, SuperNodes, workers
    parablock-flwr worker --socket PATH          the node worker to run beside a flower-supernode
    parablock-flwr evaluate MODEL_DIR            held-out loss, perplexity, math accuracy of a saved model
    parablock-flwr report RUN_DIR                the run's table, and PNG plots in RUN_DIR/plots
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from .launch import PROJECT_DIR


def _run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="run-config overrides, KEY=VALUE in TOML syntax")
    parser.add_argument("--num-supernodes", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=PROJECT_DIR / "runs" / ".flower")


def _run_config(args) -> dict:
    config: dict[str, object] = {"output-dir": str(PROJECT_DIR / "runs")}
    for item in args.overrides:
        try:
            config.update(tomllib.loads(item))
        except tomllib.TOMLDecodeError as err:
            sys.exit(f"override {item!r}: expected KEY=VALUE in TOML syntax, strings quoted ({err})")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parablock-flwr", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="run the app on Flower's simulation engine")
    _run_args(sim)
    sim.add_argument("--cpus-per-client", type=int, default=2)
    dep = sub.add_parser("deploy", help="run a real local deployment with node workers")
    _run_args(dep)
    dep.add_argument("--secure", action="store_true",
                     help="TLS and SuperNode authentication (credentials made in WORKDIR/credentials)")
    wrk = sub.add_parser("worker", help="the node worker beside a flower-supernode")
    wrk.add_argument("--socket", type=Path, required=True,
                     help="Unix socket path; give the SuperNode --node-config 'worker-socket=\"PATH\"'")
    wrk.add_argument("--idle-exit-s", type=float, default=3600.0, help="exit after this long idle (0: never)")
    ev = sub.add_parser("evaluate", help="held-out loss, perplexity and math accuracy of a saved model")
    ev.add_argument("model", help="a saved Hugging Face folder (e.g. RUN_DIR/final-model), an id or embedded:<name>")
    ev.add_argument("--config", type=Path, help="a run's RUN_DIR/config.json, for the same data (default: defaults)")
    ev.add_argument("--samples", type=Path, help="write the generated answers (math data) to this JSONL file")
    rep = sub.add_parser("report", help="print a run's table and write PNG plots")
    rep.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)

    if args.command == "simulate":
        from .launch import run_simulation

        return run_simulation(args.workdir, _run_config(args), args.num_supernodes, args.cpus_per_client,
                              capture=False).returncode
    if args.command == "deploy":
        from .launch import run_deployment

        return run_deployment(args.workdir, _run_config(args), args.num_supernodes, capture=False,
                              secure=args.secure).returncode
    if args.command == "worker":
        from .worker.server import run_worker

        run_worker(args.socket, args.idle_exit_s)
        return 0
    if args.command == "evaluate":
        print(json.dumps(evaluate(args.model, args.config, args.samples)))
        return 0
    from .report import report

    try:
        print(report(args.run_dir))
    except ValueError as err:
        sys.exit(str(err))
    return 0


def evaluate(model_spec: str, config_path: Path | None, samples_path: Path | None = None) -> dict:
    """A saved model (full or PEFT adapter folder) on a run's held-out split, with the server's own code."""
    from .config import RunConfig
    from .data import tokenized_splits
    from .evaluation import evaluate as evaluate_model
    from .model import load_saved, load_tokenizer, resolve_model

    cfg = RunConfig.from_flower(json.loads(config_path.read_text()) if config_path else {})
    model, tokenizer = load_saved(resolve_model(model_spec)), load_tokenizer(model_spec)
    _, heldout = tokenized_splits(cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer,
                                  cfg.max_seq_len)
    metrics, samples = evaluate_model(model, tokenizer, heldout, cfg, generate=True)
    if samples_path is not None:
        samples_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return {"model": model_spec, **metrics, "examples": len(heldout)}


if __name__ == "__main__":
    raise SystemExit(main())

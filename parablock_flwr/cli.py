"""`parablock-flwr`: what users do outside `flwr run`.

    parablock-flwr simulate [KEY=VALUE ...]      one simulation run (own SuperLink, stopped after)
    parablock-flwr simulate --tiny               a smoke run in seconds: a tiny Llama made on the spot
    parablock-flwr deploy [KEY=VALUE ...]        a real local deployment: SuperLink, SuperNodes, workers
    parablock-flwr worker --socket PATH          the node worker to run beside a flower-supernode
    parablock-flwr evaluate MODEL_DIR            held-out loss, perplexity, task accuracy of a saved model
    parablock-flwr report RUN_DIR                the run's status, its table, and PNG plots in RUN_DIR/plots
    parablock-flwr report RUN_DIR --jsonl        one JSON object per round (for pandas, jq)
    parablock-flwr report RUN_DIR --sites        one row per site: rounds aggregated, rejections, compute, bytes
    parablock-flwr plan MODEL [KEY=VALUE ...]    device, host and server memory of a run, from the model's config
    parablock-flwr check-data DATASET [KEY=VALUE ...]  a site's file as a run reads it (rows, malformed, lengths)
    parablock-flwr export RUN_DIR [OUT]          a Hugging Face folder of a run's model, rebuilt from its steps

`simulate` and `deploy` check every override against the app's run-config keys and
types before anything starts, and exit with the code of the run's status record
(run_status.EXIT_CODES; docs/usage.md, "Exit codes"), its reason on the last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from .config import parse_cpu_list
from .tools.app_config import OverrideError, ProjectNotFound, find_project_dir, parse_overrides

log = logging.getLogger(__name__)


def _run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="run-config overrides, KEY=VALUE in TOML syntax")
    parser.add_argument("--num-supernodes", type=int, default=2)
    parser.add_argument(
        "--app-dir",
        type=Path,
        help="the Flower app: the nearest folder, from this one upwards, "
        "whose pyproject.toml has [tool.flwr.app] (default: from the working directory)",
    )
    parser.add_argument(
        "--workdir", type=Path, help="Flower's home, logs and credentials (default: APP_DIR/runs/.flower)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a smoke run: a tiny Llama made in WORKDIR/tiny-model, 2 short rounds"
    )


def _run_config(args, app_dir: Path, workdir: Path) -> dict:
    """The overrides, after ``output-dir = APP_DIR/runs`` and with ``--tiny`` the smoke run's settings
    (``tools.tiny_model.SMOKE_CONFIG``: KEY=VALUE arguments win)."""
    config: dict = {"output-dir": str(app_dir / "runs")}
    if args.tiny:
        from .tools.tiny_model import SMOKE_CONFIG, smoke_model

        config |= {**SMOKE_CONFIG, "model": str(smoke_model(workdir / "tiny-model"))}
    return {**config, **parse_overrides(args.overrides)}


def _stop_on_sigterm() -> None:
    """On SIGTERM (`kill`, systemd, a CI runner's cancel) leave through the launcher's ``finally``
    blocks, as on Ctrl-C: they stop, by PID, the SuperLink, SuperNodes, workers and Ray this command
    started. Python's default is to die on the spot, and they kept running. A second SIGTERM while
    they are being stopped is ignored, so the stopping is not cut short."""

    def stop(signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("parablock-flwr: SIGTERM: stopping the processes this command started", file=sys.stderr, flush=True)
        stopping = SystemExit(128 + signum)
        stopping.began = time.time()  # what the run records from now on, it records because it is being stopped
        raise stopping

    signal.signal(signal.SIGTERM, stop)


def _launch(args) -> int:
    """`simulate` / `deploy`: check the overrides, run, and end with one line saying how the run ended."""
    from .tools.launch import refused, run_deployment, run_simulation

    _stop_on_sigterm()

    try:
        app_dir = find_project_dir(args.app_dir)  # None: from the working directory
        workdir = args.workdir or app_dir / "runs" / ".flower"
        config = _run_config(args, app_dir, workdir)
    except ProjectNotFound as err:
        result = refused(str(err), kind="error")
    except OverrideError as err:
        result = refused(str(err))
    else:
        launched = time.time()
        try:
            if args.command == "simulate":
                result = run_simulation(
                    workdir, config, args.num_supernodes, args.cpus_per_client, app_dir=app_dir, capture=False,
                    ray_address=args.ray_address, gpus_per_client=args.gpus_per_client,
                )  # fmt: skip
            else:
                result = run_deployment(
                    workdir, config, args.num_supernodes, app_dir=app_dir, capture=False, secure=args.secure
                )
        except SystemExit as stop:  # SIGTERM (``_stop_on_sigterm``): its processes are stopped by now
            if stop.code == 128 + signal.SIGTERM:
                _record_stopped(config, app_dir, launched, getattr(stop, "began", None))
            raise
    sys.stdout.flush()
    if result.run_dir is not None:
        print(f"run folder: {result.run_dir}", flush=True)
    print(result.summary(), file=sys.stdout if result.returncode == 0 else sys.stderr, flush=True)
    return result.returncode


def _record_stopped(config: dict, app_dir: Path, launched: float, stop_began: float | None) -> None:
    """The run the SIGTERM stopped gets its status record (``run_status.record_stopped``), said on the last line."""
    from .run_status import record_stopped
    from .tools.launch import output_dir_of

    why = "stopped by SIGTERM to parablock-flwr"
    written = record_stopped(output_dir_of(config, app_dir), launched, why, stop_began)
    if written is not None:
        print(f"parablock-flwr: run stopped: {json.loads(written.read_text())['reason']}", file=sys.stderr, flush=True)


def _cpu_list(text: str) -> set[int]:
    """``1``, ``0,2`` or ``2-7``: a set of CPU ids this machine has."""
    try:
        return parse_cpu_list(text, os.cpu_count() or 1)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _uid_list(text: str) -> list[int]:
    """``1001``, ``1001,1002`` or user names (``parablock-node``: a systemd unit cannot compute a uid)."""
    from .node.settings import user_id

    uids = [user_id(part) for part in text.split(",")]
    if None in uids:
        raise argparse.ArgumentTypeError(f"{text!r}: expected user ids or names like 1001,1002 or parablock-node")
    return uids


def _byte_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of bytes > 0, like 8000000000")
    return count


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0, like 2.5")
    return seconds


def _device(text: str) -> str:
    from .node.settings import device_valid

    if not device_valid(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cpu, cuda or cuda:<index>")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command line: every subcommand and its options, one function per subcommand."""
    parser = argparse.ArgumentParser(
        prog="parablock-flwr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _simulate_parser(sub)
    _deploy_parser(sub)
    _worker_parser(sub)
    _evaluate_parser(sub)
    rep = sub.add_parser("report", help="print a run's table and write PNG plots")
    rep.add_argument("run_dir", type=Path)
    view = rep.add_mutually_exclusive_group()
    view.add_argument("--jsonl", action="store_true", help="print one JSON object per round instead (merged)")
    view.add_argument("--sites", action="store_true", help="print one row per site: rounds, rejections, compute, bytes")
    _plan_parser(sub)
    _check_data_parser(sub)
    _export_parser(sub)
    return parser


def _simulate_parser(sub) -> None:
    """`simulate`: the run's options, and the Ray actors' share of this machine (or another Ray cluster)."""
    sim = sub.add_parser("simulate", help="run the app on Flower's simulation engine")
    _run_args(sim)
    sim.add_argument("--cpus-per-client", type=int, default=2, help="CPUs each virtual client's Ray actor reserves")
    sim.add_argument("--gpus-per-client", type=float, default=0.0, help="GPUs (or a share of one) per actor")
    sim.add_argument(
        "--ray-address",
        default="",
        help="an existing Ray cluster (HEAD_IP:6379, or auto) to run the clients on; default: a Ray of the run's own",
    )


def _deploy_parser(sub) -> None:
    """`deploy`: the run's options, and whether its local SuperLink and SuperNodes talk over TLS."""
    dep = sub.add_parser("deploy", help="run a real local deployment with node workers")
    _run_args(dep)
    dep.add_argument(
        "--secure",
        action="store_true",
        help="TLS and SuperNode authentication (credentials made in WORKDIR/credentials)",
    )


def _worker_parser(sub) -> None:
    """`worker`: what a site's operator decides for its node worker (socket, peers, CPUs, device, limits)."""
    wrk = sub.add_parser("worker", help="the node worker beside a flower-supernode")
    wrk.add_argument(
        "--socket",
        type=Path,
        required=True,
        help="Unix socket path; give the SuperNode --node-config 'worker-socket=\"PATH\"'",
    )
    wrk.add_argument(
        "--idle-exit-s",
        type=float,
        default=0.0,
        help="exit after this long without a message (default 0: never, it lives as long as its node)",
    )
    wrk.add_argument(
        "--state-dir",
        type=Path,
        help="where the node's error-feedback residuals outlive the worker (default: SOCKET.state beside the "
        "socket; put it on a persistent disk, not /run or /tmp); a node config's state-dir must name the same",
    )
    wrk.add_argument(
        "--compute-cpus",
        type=_cpu_list,
        help="pin the compute thread to these CPUs, e.g. 1 or 2-7 (the I/O threads stay off them)",
    )
    wrk.add_argument(
        "--device",
        type=_device,
        help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu; a node config's device wins)",
    )
    wrk.add_argument(
        "--allow-uid",
        type=_uid_list,
        action="append",
        default=[],
        help="also admit peers with this uid or user name (repeatable, or a comma list): a SuperNode run as another "
        "user, who must share the worker's group (the socket is then 0660, its directory 0710); default: own uid only",
    )
    wrk.add_argument(
        "--max-message-bytes",
        type=_byte_count,
        help="refuse a message whose arrays declare more bytes than this (default: the largest message "
        "the server sends for the run's model, with a margin; before the model is loaded, the machine's memory)",
    )


def _evaluate_parser(sub) -> None:
    """`evaluate`: a saved model, the data to score it on, and where it runs."""
    ev = sub.add_parser("evaluate", help="held-out loss, perplexity and task accuracy of a saved model")
    ev.add_argument("model", help="a saved Hugging Face folder (e.g. RUN_DIR/final-model), an id or embedded:<name>")
    ev.add_argument("--config", type=Path, help="a run's RUN_DIR/config.json, for the same data (default: defaults)")
    ev.add_argument(
        "--samples", type=Path, help="write the generated answers (data with exact answers) to this JSONL file"
    )
    ev.add_argument(
        "--dataset",
        default="",
        help="score on this data instead of the run's, in any format a run reads, e.g. alpaca:/data/bench.jsonl, "
        "messages:/data/chat.jsonl, mathinstruct:/data/math.jsonl (its first heldout-examples rows)",
    )
    ev.add_argument("--all-rows", action="store_true", help="every row of the data, each one answered and scored")
    ev.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ev.add_argument("--precision", choices=("fp32", "bf16"), help="the model's weights (default: the run's)")
    ev.add_argument("--max-new-tokens", type=int, default=0, help="tokens to generate per answer (default: the run's)")


def _plan_parser(sub) -> None:
    """`plan`: a model and run settings, and how one local step's time is known (given, probed or modeled)."""
    pln = sub.add_parser("plan", help="memory per site (device, host) and on the server, from the model's config")
    pln.add_argument("model", help="a model folder, its config.json, a Hugging Face id or embedded:<name>")
    pln.add_argument("overrides", nargs="*", help="run-config values, KEY=VALUE in TOML syntax")
    pln.add_argument("--gpu-memory-gb", type=float, help="also print the settings that fit a GPU of this size")
    pln.add_argument("--num-nodes", type=int, default=3, help="nodes replying each round (server memory)")
    step = pln.add_mutually_exclusive_group()
    step.add_argument("--step-time-s", type=_positive_seconds, help="one local step, measured: models compute")
    step.add_argument(
        "--probe", action="store_true", help="measure one local step here (loads the model; cuda if present)"
    )


def _check_data_parser(sub) -> None:
    """`check-data`: a site's file, and the run settings that decide how it is read."""
    chk = sub.add_parser("check-data", help="a site's data file as a run would read it: rows, malformed, token lengths")
    chk.add_argument("dataset", help="as a node config's dataset: alpaca:/srv/site/train.jsonl, messages:..., ...")
    chk.add_argument("overrides", nargs="*", help="the run's settings, KEY=VALUE in TOML syntax: model, max-seq-len")


def _check_data(args) -> int:
    """`check-data`: its report; exit 0 when every row trains, 1 when some are skipped or dropped, 2 when none would
    train or a setting is bad. Only counts and row numbers are printed, never a row's content."""
    from .config import ConfigError, RunConfig
    from .data import DataError, check_rows
    from .model import load_tokenizer

    try:
        cfg = RunConfig.from_flower({**parse_overrides(args.overrides), "dataset": args.dataset})
        check = check_rows(args.dataset, load_tokenizer(cfg.model, cfg.prompt_format), cfg.max_seq_len)
    except (ConfigError, OverrideError, DataError, OSError) as err:  # OSError: a model it cannot load
        print(f"parablock-flwr check-data: {err}", file=sys.stderr)
        return 2
    print("\n".join(check.lines()))
    return 0 if check.train == check.rows else 1 if check.train else 2


def _export_parser(sub) -> None:
    """`export`: a run folder, and where its model goes."""
    exp = sub.add_parser("export", help="a Hugging Face folder of a run's model, rebuilt from its steps")
    exp.add_argument("run_dir", type=Path, help="the run folder (RUN_DIR: its config, step log and checkpoints)")
    exp.add_argument("out", type=Path, nargs="?", help="where to write it (default: RUN_DIR/model-round-R)")


def _export(args) -> int:
    """`export`: the folder it wrote; a folder that is not a run's, or does not rebuild, is one line, exit 2."""
    from .export import export_run

    try:
        out, round_ = export_run(args.run_dir, args.out)
    except ValueError as err:
        print(f"parablock-flwr export: {err}", file=sys.stderr)
        return 2
    print(f"parablock-flwr export: the model after round {round_} in {out}")
    return 0


def _worker(args) -> int:
    """`worker`: claim the socket first (a refusal costs no torch import), then serve; give it back at exit."""
    from .worker.endpoint import SocketRefused, WorkerSocket

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [worker] %(message)s")
    try:
        endpoint = WorkerSocket.claim(args.socket, [uid for uids in args.allow_uid for uid in uids])
    except SocketRefused as err:
        sys.exit(f"parablock-flwr worker: {err}")
    try:
        from .memory import map_large_buffers
        from .worker.server import run_worker  # torch and transformers: seconds

        map_large_buffers()  # before the worker's threads: what it holds stays what its round uses
        device, limit = args.device or "", args.max_message_bytes or 0
        run_worker(endpoint, args.idle_exit_s, args.compute_cpus, device, limit, args.state_dir)
    finally:
        endpoint.release()
    return 0


def _evaluate(args) -> int:
    """`evaluate`: the metrics as one JSON line; a bad setting or data is one line and exit code 2."""
    from .config import ConfigError

    try:
        result = evaluate(
            args.model, args.config, args.samples, dataset=args.dataset, all_rows=args.all_rows,
            device=args.device, precision=args.precision or "", max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
    except (ConfigError, ValueError) as err:
        print(f"parablock-flwr evaluate: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _plan(args) -> int:
    """`plan`: a bad key or value is one line and exit code 2, as `simulate` refuses it."""
    from .config import ConfigError
    from .plan import plan_command

    try:
        overrides = parse_overrides(args.overrides)
        text = plan_command(args.model, overrides, args.gpu_memory_gb, args.num_nodes, args.step_time_s, args.probe)
    except (ConfigError, OverrideError) as err:
        print(f"parablock-flwr plan: {err}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        sys.exit(f"parablock-flwr plan: {err}")
    print(text)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; KEY=VALUE overrides may stand on both sides of options (argparse takes one run of
    positionals: ``simulate a=1 --num-supernodes 3 b=2`` left ``b=2`` unrecognised)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in arg and not arg.startswith("-") for arg in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    if args.command in ("simulate", "deploy"):
        return _launch(args)
    if args.command == "worker":
        return _worker(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command == "check-data":
        return _check_data(args)
    if args.command == "export":
        return _export(args)
    from .report import report, rounds_jsonl, sites

    try:
        print(rounds_jsonl(args.run_dir) if args.jsonl else sites(args.run_dir) if args.sites else report(args.run_dir))
    except ValueError as err:
        sys.exit(str(err))
    return 0


def evaluate(
    model_spec: str,
    config_path: Path | None,
    samples_path: Path | None = None,
    *,
    dataset: str = "",
    all_rows: bool = False,
    device: str = "cpu",
    precision: str = "",
    max_new_tokens: int = 0,
) -> dict:
    """A saved model (full or PEFT adapter folder) on held-out rows, with the server's own code.

    The rows: the run's held-out split (its config's ``dataset``), or ``dataset`` (any format a run
    reads), whose first ``heldout-examples`` rows are taken, or every row with ``all_rows`` (then
    every row is also answered, where answers are exact or chat rows have one answer turn)."""
    import dataclasses

    import torch

    from .config import RunConfig
    from .data import tokenized_rows_counted, tokenized_splits
    from .evaluation import evaluate as evaluate_model
    from .model import load_saved, load_tokenizer, resolve_model
    from .node import node_device

    values = json.loads(config_path.read_text()) if config_path else {}
    values |= {"dataset": dataset} if dataset else {}
    values |= {"precision": precision} if precision else {}
    values |= {"max-new-tokens": max_new_tokens} if max_new_tokens else {}
    cfg = RunConfig.from_flower(values)
    model, tokenizer = load_saved(resolve_model(model_spec)), load_tokenizer(model_spec, cfg.prompt_format)
    if cfg.precision == "bf16":  # the weights themselves, so that generation runs in bf16 too
        model.to(torch.bfloat16)
    model.to(node_device(device))
    if all_rows:
        limit = cfg.num_examples if cfg.dataset.startswith("reasoning-gym:") else None
        heldout, dropped, malformed = tokenized_rows_counted(cfg.dataset, limit, cfg.seed, tokenizer, cfg.max_seq_len)
        cfg = dataclasses.replace(cfg, generate_examples=len(heldout))
    else:
        split = tokenized_splits(
            cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer, cfg.max_seq_len
        )
        heldout, dropped, malformed = split.heldout, split.dropped_for_length, split.malformed
    metrics, samples = evaluate_model(model, tokenizer, heldout, cfg, generate=True, chat_exact_match=True)
    if samples_path is not None:
        samples_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return {
        "model": model_spec,
        "dataset": cfg.dataset,
        "device": device,
        "precision": cfg.precision,
        **metrics,
        "examples": len(heldout),
        "dropped_for_length": dropped,
        "malformed": malformed,
    }


if __name__ == "__main__":
    raise SystemExit(main())

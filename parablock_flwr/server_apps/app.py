"""The ServerApp: validate the config, load the global model, run the chosen strategy.

The server keeps the global model and evaluates it itself, beside the round loop on a replica
of its own in a process of its own (``ServerEvaluator``: held-out loss every ``eval-every`` rounds,
the task accuracy of generated answers), or with
``evaluation = "clients"`` aggregates the nodes' evaluations on their own
held-out rows and loads no data; messages carry only block-sized arrays. Models are exported in Hugging Face form.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from .. import core
from ..checkpoint import Checkpoint, check_resumable
from ..config import ConfigError, RunConfig, check_num_clients, parse_cpu_list
from ..data import tokenized_splits
from ..durable import fsync_path, make_dirs, replace_file
from ..memory import map_large_buffers, release_freed_memory
from ..metrics import RunRecorder, run_summary
from ..model import load_for_training, load_tokenizer, save_model
from ..node import node_device
from ..run_status import EXIT_CODES, write_status
from ..runtime import setup_torch
from ..strategies import strategy_class
from ..strategies.update_spill import IN_MEMORY
from ..transport import Limits, RunTransport, StreamSettings, TransportSetupError
from ..transport.channel import Channel
from ..transport.direct_channel import DirectChannel
from .evaluator import ServerEvaluator
from .run import Run, TooFewReplies

log = logging.getLogger(__name__)
app = ServerApp()


def make_run_dir(output_path: Path, algorithm: str, run_id: int) -> Path:
    """``OUTPUT_DIR/<time>-<algorithm>-<run_id>``: the launchers find a run's folder by its id."""
    run_dir = output_path / f"{time.strftime('%Y%m%d-%H%M%S')}-{algorithm}-{run_id}"
    make_dirs(output_path)
    run_dir.mkdir()  # a folder of that name already: FileExistsError, as a second run of one id must
    fsync_path(output_path)
    return run_dir


def wait_for_nodes(grid: Grid, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not (nodes := list(grid.get_node_ids())) and time.monotonic() < deadline:
        time.sleep(1.0)
    return len(nodes)


class RunFailed(Exception):
    """The run cannot go on: ``kind`` is a key of ``run_status.EXIT_CODES``."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the app and leave ``status.json`` in the run folder, whatever happens; exit with its code."""
    _log_to_stdout()
    run = {"dir": None, "run": None, "num_rounds": 0}
    try:
        run_app(grid, context, run)
    except RunFailed as err:
        kind, reason = err.kind, str(err)
    except Exception as err:  # an unexpected error: still a status record, then the traceback
        log.exception("The run failed")
        kind, reason = "error", f"{type(err).__name__}: {err}"
    else:
        kind, reason = "completed", f"{run['num_rounds']} rounds"
    excluded = run["run"].participation.excluded() if run["run"] else []
    if kind == "completed" and run["run"] is not None and run["run"].stopped_early:
        kind = "privacy-budget"
        reason = f"{run['run'].rounds_completed} of {run['num_rounds']} rounds: {run['run'].stopped_early}"
    if kind == "completed" and excluded:
        kind, reason = "completed-with-exclusions", f"{reason}; left out: {'; '.join(excluded)}"
    run_dir = run["dir"] or _run_dir_for_failure(context)
    if run_dir is not None:
        rounds_completed = run["run"].rounds_completed if run["run"] else 0
        write_status(run_dir, kind, reason, rounds_completed, run["num_rounds"], excluded)
    if kind in ("completed-with-exclusions", "privacy-budget"):
        summary = run_summary(RunRecorder(run_dir).read()) if run_dir is not None else ""
        how = "completed with exclusions" if kind == "completed-with-exclusions" else "stopped at its privacy budget"
        log.error("Run %s (exit code %d): %s%s", how, EXIT_CODES[kind], reason,
                  f"; run: {summary}" if summary else "")  # fmt: skip
        sys.exit(EXIT_CODES[kind])
    if kind != "completed":
        log.error("Run failed (%s): %s", kind, reason)
        sys.exit(EXIT_CODES[kind])
    if summary := run_summary(RunRecorder(run_dir).read()):
        log.info("Run: %s", summary)
    log.info("Done. Metrics: %s", run_dir / "metrics.jsonl")


@dataclass
class Loaded:
    """What a valid configuration gives before the run folder exists: the settings, the model and its
    blocks, the tokenizer, the algorithm's class, the server's held-out rows, a checkpoint to resume."""

    cfg: RunConfig
    model: torch.nn.Module
    partition: core.BlockPartition
    tokenizer: object
    strategy_cls: type
    num_clients: int
    heldout: object = None  # evaluation = "clients": the server reads no data and runs no forward pass
    checkpoint: Checkpoint | None = None


def load(grid: Grid, context: Context, run: dict) -> Loaded:
    """Validate the run config and load what it names; ``RunFailed("invalid-config")`` in one line."""
    try:
        cfg = RunConfig.from_flower(context.run_config)
        run["num_rounds"] = cfg.num_server_rounds
        setup_torch(cfg)
        model, partition = load_for_training(cfg)
        loaded = Loaded(cfg, model, partition, load_tokenizer(cfg.model, cfg.prompt_format),
                        strategy_class(cfg.algorithm, cfg.strategy), wait_for_nodes(grid))  # fmt: skip
        check_num_clients(loaded.num_clients)
        if cfg.evaluation == "server":
            check_eval_device(cfg.eval_device)
            check_eval_cpus(cfg.eval_cpus)
            _, loaded.heldout = tokenized_splits(cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed,
                                                 loaded.tokenizer, cfg.max_seq_len)  # fmt: skip
        loaded.checkpoint = check_resumable(cfg.resume_path, cfg.as_run_config()) if cfg.resume_path else None
        release_freed_memory()  # the load's transient copies
        if cfg.num_examples - cfg.heldout_examples < loaded.num_clients:
            needed, clients = cfg.heldout_examples + loaded.num_clients, loaded.num_clients
            raise ConfigError(f"num-examples={cfg.num_examples}: expected at least {needed} for {clients} clients")
    except (ConfigError, ValueError, FileNotFoundError) as err:
        raise RunFailed("invalid-config", f"Invalid configuration: {err}") from err
    return loaded


def in_simulation(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's in-memory Grid, a simulation's. Its module is looked up, not imported: it loads
    the SuperLink's state, a second of CPU that a deployment's ServerApp never needs, and a grid of that class
    exists only where its module was imported."""
    module = sys.modules.get("flwr.superlink.grid.inmemory_grid")
    return module is not None and isinstance(grid, module.InMemoryGrid)


def run_app(grid: Grid, context: Context, run: dict) -> None:
    """Validate, load, train; fills ``run`` (its folder, the ``Run``) as it goes. With the direct transport,
    the run's stream serves from before the first message to after the last reply."""
    # Block-sized buffers in mappings of their own, given back when freed (memory.map_large_buffers), in a
    # deployment's ServerApp, which has its process to itself (a simulation's and the tests' share theirs);
    # first, before the load's threads.
    if not in_simulation(grid):
        map_large_buffers()
    loaded = load(grid, context, run)
    channel = open_channel(loaded.cfg, grid, context.run_id)
    try:
        train(grid, context, run, loaded, channel)
    finally:
        channel.stop()


def open_channel(cfg: RunConfig, grid: Grid, run_id: int) -> Channel:
    """How the run's messages travel: ``transport = "direct"`` in a deployment, the run's stream, serving
    (``DirectChannel``); else Flower's path (always in a simulation, whose messages never leave the machine).
    A file or port the stream cannot use fails the run as an invalid configuration, before any round."""
    if cfg.transport != "direct":
        return Channel()
    if in_simulation(grid):
        log.info("transport='direct' is for deployments: this simulation moves blocks in Flower's messages")
        return Channel()
    try:
        idle_s = cfg.transport_idle_timeout_s
        settings, limits = StreamSettings.from_run_config(cfg), Limits(idle_s, header_timeout_s=min(10.0, idle_s))
        # Uploads past the blocks a round's aggregation holds in memory wait for their replies on the disk
        # the operator chose for runs.
        transport = RunTransport(settings, run_id, ttl_s=cfg.round_timeout_s, limits=limits, spill_dir=cfg.output_path,
                                 memory_uploads=IN_MEMORY)  # fmt: skip
        transport.start()
    except (TransportSetupError, OSError, RuntimeError) as err:
        raise RunFailed("invalid-config", f"Invalid configuration: {err}") from err
    return DirectChannel(transport, replies_on_stream=cfg.transport_replies_on_stream)


def train(grid: Grid, context: Context, run: dict, loaded: Loaded, channel: Channel) -> None:
    """The run folder, the algorithm, the evaluator and the ``Run``; then the rounds."""
    cfg, partition = loaded.cfg, loaded.partition
    run_dir = run["dir"] = make_run_dir(cfg.output_path, cfg.algorithm, context.run_id)
    replace_file(run_dir / "config.json", json.dumps(cfg.as_run_config(), indent=2, sort_keys=True) + "\n")
    log.info("Run folder: %s", run_dir)
    log.info("%s on %s: %d clients, %d blocks (%s), %d rounds", cfg.algorithm, cfg.model, loaded.num_clients,
             partition.num_blocks, ", ".join(partition.labels), cfg.num_server_rounds)  # fmt: skip
    params = dict(loaded.model.named_parameters())
    algorithm = loaded.strategy_cls(
        global_params={n: params[n] for n in partition.all_names()},
        partition=partition,
        schedule=core.block_schedule(cfg.schedule, partition.num_blocks, cfg.num_server_rounds, cfg.seed),
        run_dir=run_dir,
        config=cfg,
    )
    # The server's evaluation and the save-every exports run beside the loop, on a replica of x in a
    # process of its own (with evaluation = "clients" the nodes' evaluations complete the records instead).
    evaluator = None
    if loaded.heldout is not None or cfg.save_every:
        evaluator = ServerEvaluator(loaded.tokenizer, loaded.heldout, cfg, run_dir)
    # A deployment's workers start a resumed run (a new Flower run) at x^0: its nodes get x's values first.
    algorithm.sync.values_on_resume = not in_simulation(grid)
    this_run = Run(algorithm, evaluator, channel)
    try:  # Round 1 sends no step; a resumed run sends g^R in round R+1.
        first_step = this_run.resume(cfg.resume_path, loaded.checkpoint) if loaded.checkpoint else ArrayRecord()
    except ValueError as err:
        raise RunFailed("invalid-config", f"Cannot resume: {err}") from err
    run["run"] = this_run
    try:
        this_run.start(grid, first_step)
    except TooFewReplies as err:
        raise RunFailed(err.kind, f"Stopping the run: {err}") from err
    if cfg.save_final_model:
        save_model(loaded.model, loaded.tokenizer, run_dir / "final-model")


def check_eval_device(device: str) -> None:
    """An ``eval-device`` this machine has (checked before any work), as a node's ``device`` is."""
    try:
        node_device(device)
    except ValueError as err:
        raise ConfigError(f"eval-{err}") from err


def check_eval_cpus(cpus: str) -> None:
    """``eval-cpus`` that this machine has (the config checked their syntax; the server's CPUs are
    known only here)."""
    if cpus:
        try:
            parse_cpu_list(cpus, os.cpu_count() or 1)
        except ValueError as err:
            raise ConfigError(f"eval-cpus={err}") from None


def _run_dir_for_failure(context: Context) -> Path | None:
    """A folder for the status record of a run that failed before it had one (a bad configuration)."""
    output_dir, algorithm = (
        context.run_config.get("output-dir", "~/parablock-runs"),
        context.run_config.get("algorithm", "invalid"),
    )
    if not isinstance(output_dir, str):
        return None
    safe = algorithm if isinstance(algorithm, str) and algorithm.replace("-", "").isalnum() else "invalid"
    try:
        return make_run_dir(Path(output_dir).expanduser().resolve(), safe, context.run_id)
    except OSError:
        return None


def _log_to_stdout() -> None:
    """Our round lines reach `flwr run --stream` and the SuperLink's log: a handler on the package's
    logger, which every module's ``logging.getLogger(__name__)`` propagates to."""
    package = logging.getLogger(__name__.split(".")[0])
    if not package.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s [parablock] %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)
        package.propagate = False

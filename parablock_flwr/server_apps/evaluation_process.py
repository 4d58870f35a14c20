"""The server's evaluation process (``ServerEvaluator`` in ``evaluator.py`` starts it): its replica of ``x``
follows the run's step log (``Follower``), at the lowest CPU priority, and evaluates each round handed over."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from ..config import RunConfig, parse_cpu_list
from ..durable import crash_requested, replace_file
from ..evaluation import evaluate
from ..model import load_for_training, save_model
from ..replica import ModelReplica, StepLog
from ..runtime import setup_torch

log = logging.getLogger(__name__)


def follow_rounds(pipe, cfg, run_dir, tokenizer, heldout, version, threads, server_pid) -> None:
    """The process's body: lowest priority first, then the replica, then each round handed over.
    An error is sent back in one line (its traceback goes to the process's log) and the process exits 1."""
    lowest_cpu_priority(parse_cpu_list(cfg.eval_cpus) if cfg.eval_cpus else None)
    threading.Thread(target=_exit_with, args=(server_pid,), name="server-watch", daemon=True).start()
    _log_to_stdout()
    try:
        follower = Follower(cfg, Path(run_dir), tokenizer, heldout, version, threads, server_pid)
        pipe.send(("ready",))
        waiting: deque = deque()  # (round, handed over at), in order: integers, never models
        closed = False
        while (closed := _take(pipe, waiting, closed)) is False or waiting:
            server_round, handed_over = waiting.popleft()
            newest = waiting[-1][0] if waiting else server_round
            pipe.send(("round", server_round, follower.follow(server_round, handed_over, newest)))
    except BaseException as err:
        log.exception("The server's evaluation failed")
        try:
            pipe.send(("error", f"{type(err).__name__}: {err}"))
        finally:
            os._exit(1)


def _log_to_stdout() -> None:
    """The process's lines (a skipped round, an error's traceback) beside the ServerApp's own."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s [parablock evaluator] %(message)s"))
    package = logging.getLogger(__name__.split(".")[0])
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False


def lowest_cpu_priority(cpus: set[int] | None = None) -> None:
    """``SCHED_IDLE`` (else nice 19), and ``cpus`` when given, for every thread of this process;
    threads started later inherit both."""
    for task in os.listdir("/proc/self/task"):
        if cpus:
            os.sched_setaffinity(int(task), cpus)
        try:
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, int(task), 19)


def _exit_with(server_pid: int) -> None:
    """The process never outlives the ServerApp (a SIGKILLed server runs no clean-up)."""
    while os.getppid() == server_pid:
        time.sleep(0.5)
    os._exit(1)


def _take(pipe, waiting: deque, closed: bool) -> bool:
    """Every round already handed over joins ``waiting`` (blocking for the next one only when none
    waits); returns whether ``close`` said no more will come (``None`` in the pipe)."""
    while not closed and (not waiting or pipe.poll()):
        item = pipe.recv()
        if item is None:
            return True
        waiting.append(item)
    return closed


class Follower:
    """The evaluator's replica of ``x``, following the step log, and what it does with each ``x^r``."""

    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer, heldout, version: int, threads: int, server_pid):
        setup_torch(cfg)
        torch.set_num_threads(threads)  # the server's count: float sums, and so the results, depend on it
        self.cfg, self.run_dir, self.tokenizer, self.heldout = cfg, run_dir, tokenizer, heldout
        self.server_pid = server_pid
        model, _ = load_for_training(cfg)  # x^0, as every process of the run builds it
        self.replica = ModelReplica(model.to(cfg.eval_device), keeps_previous=False)  # it evaluates x^v only
        self.step_log = StepLog(run_dir)
        self.advance_to(version)

    def advance_to(self, version: int) -> None:
        """``x^version``: the steps after the replica's version, applied in order. The loop's prune keeps
        every step after the round this process last reported (``ServerEvaluator.version``); only a
        replica behind the log at its start (a resumed run's pruned log) starts from a snapshot."""
        self.step_log.rebase_if_pruned(self.replica, version)
        self.replica.advance_to(version, self.step_log.read)

    def follow(self, server_round: int, handed_over: float, newest: int) -> dict:
        """Round r's evaluation part: ``x^r`` evaluated when due, unless ``eval-max-lag`` allows a skip
        and more than that many newer rounds wait behind it (round 0 and the last are never skipped)."""
        self.advance_to(server_round)
        self._save_model(server_round)
        if not self._due(server_round):
            return {}
        lag, max_lag = newest - server_round, self.cfg.eval_max_lag
        if max_lag and lag > max_lag and server_round not in (0, self.cfg.num_server_rounds):
            log.info("round %d: evaluation skipped (the evaluator was %d rounds behind; eval-max-lag=%d)",
                     server_round, lag, max_lag)  # fmt: skip
            return {"evaluation_skipped": 1}
        return self._evaluate(server_round, handed_over)

    def _due(self, server_round: int) -> bool:
        last = server_round == self.cfg.num_server_rounds
        return self.heldout is not None and (server_round % self.cfg.eval_every == 0 or last)

    def _evaluate(self, server_round: int, handed_over: float) -> dict:
        started = time.time()
        cfg = self.cfg
        every = cfg.generate_every
        generate = server_round in (0, cfg.num_server_rounds) or bool(every and server_round % every == 0)
        metrics, samples = evaluate(self.replica.model, self.tokenizer, self.heldout, cfg, generate)
        if crash_requested("evaluation", server_round):  # the crash tests' point: the server dies here
            log.warning("PARABLOCK_CRASH_AT=evaluation@%d: killing the server here (crash test)", server_round)
            os.kill(self.server_pid, signal.SIGKILL)
            os._exit(1)
        if samples:
            write_samples(self.run_dir / "samples" / f"round-{server_round:05d}.jsonl", samples)
        # evaluation_waited_s: from the round's hand-over to this evaluation's start (how far behind it ran).
        return {**metrics, "evaluate_s": time.time() - started, "evaluation_waited_s": started - handed_over}

    def _save_model(self, server_round: int) -> None:
        """``save-every``: the Hugging Face export of ``x^r`` (from the replica: off the loop too)."""
        every, last = self.cfg.save_every, server_round == self.cfg.num_server_rounds
        if every and server_round and (server_round % every == 0 or last):
            save_model(self.replica.model, self.tokenizer, self.run_dir / "checkpoints" / f"round-{server_round:05d}")


def write_samples(path: Path, samples: list[dict]) -> None:
    """A round's generated answers, durably (``report`` reads them)."""
    replace_file(path, "".join(json.dumps(s) + "\n" for s in samples))

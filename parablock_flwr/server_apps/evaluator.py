"""The server's evaluation of ``x^r``, beside the round loop, in a process of its own.

The round loop hands each round to the evaluator once the round's record, step and checkpoint
are durable (``Run.conclude_round``): one small message down a pipe, and the loop goes straight
back to pulling replies. The evaluator process (spawned, not forked, from the ServerApp) holds its
own copy of the model on ``eval-device``: it builds ``x^0`` as every process of the run does
(``load_for_training``) and moves it from ``x^{r-1}`` to ``x^r`` by reading ``g^r`` from the run's
step log (``global-steps/``, written once round r+1's messages are out, before round r is handed
on) and applying the same ``x[b] += g`` every copy applies, so it evaluates exactly the model the
loop held, with the same torch thread count (the results are bit-identical to an evaluation in the loop).

Why a process and not a thread: a thread's priority covers that thread only, while torch's
intra-op pool is process-wide, and the thread shares the GIL with the loop that pulls and checks
replies. The process runs at the lowest CPU priority Linux gives an unprivileged process
(``SCHED_IDLE``, else nice 19), every thread of it, torch's pool included: on a busy CPU it only
takes the time Flower's processes leave. Priority does not stop it from sharing a core's caches
with Flower's copies of a block, which lengthens them (docs/results.md): ``eval-cpus`` gives
it cores of its own.

When it falls behind: the loop never waits. It hands over round numbers (a queue of integers, sent
down the pipe by a thread of its own, so a full pipe never holds the loop) and the evaluator takes
them in order, applying each round's step (a block add) and evaluating every round due. By default
(``eval-max-lag = 0``) none is skipped: the run's end waits for the queue to drain. With
``eval-max-lag = L`` a round due while more than L newer rounds wait behind it is skipped and
recorded so (``evaluation_skipped``, counted on the run's last line); round 0 and the last round
never are. The step log keeps what the evaluator still reads: the loop's prune (``snapshot-every``)
drops no step after the round the evaluator last reported (``version``), so the log's bound moves
with the evaluator's lag.

The process sends back each round's metrics; the ServerApp writes them into the round's record
(one writer of records). An error in the process, or the process dying, fails the run with one
line; the process is stopped on every way out of the run, and stops itself if the ServerApp dies.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
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


class ServerEvaluator:
    """``evaluation = "server"`` (held-out loss, generated answers) and ``save-every``, off the loop."""

    def __init__(self, tokenizer, heldout, cfg: RunConfig, run_dir: Path):
        self.tokenizer, self.heldout, self.cfg = tokenizer, heldout, cfg
        self.run_dir = Path(run_dir)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._receiver: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (round, handed over at) or None: no more
        self._error: BaseException | None = None
        self.version = 0  # the newest round the process reported: it never reads a step at or before it again

    @property
    def pid(self) -> int | None:
        """The evaluator process's id (None before ``begin``)."""
        return self._process.pid if self._process is not None else None

    # ------------------------------------------------------------ the loop's side
    def begin(self, run) -> None:
        """Start the process; its replica starts at ``x^{first_round - 1}``, the model the loop holds now."""
        self.run = run
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        args = (child_end, self.cfg, self.run_dir, self.tokenizer, self.heldout, run.first_round - 1,
                torch.get_num_threads(), os.getpid())  # fmt: skip
        self._process = context.Process(target=follow_rounds, args=args, name="parablock-evaluator", daemon=True)
        self._process.start()
        child_end.close()  # the pipe ends (EOF) when the process does
        self._wait_until_ready()
        self.version = run.first_round - 1
        self._receiver = threading.Thread(target=self._receive, name="parablock-evaluation-records", daemon=True)
        self._receiver.start()
        self._sender = threading.Thread(target=self._send, name="parablock-evaluation-queue", daemon=True)
        self._sender.start()

    def _wait_until_ready(self) -> None:
        """Once, before round 1: the process has built its replica of ``x`` (seconds: its imports and
        the model's load). A replica that cannot be built (a model, an ``eval-device``) fails the run
        here, before any round's work, and the first evaluations do not start rounds behind."""
        try:
            kind, *rest = self._pipe.recv()
        except EOFError:
            kind, rest = "ended", []
        if kind == "ready":
            return
        process, self._process = self._process, None
        process.join(30.0)
        _stop(process)
        self._pipe.close()
        raise RuntimeError(f"the server's evaluation failed: {rest[0]}") if rest else _ended(process)

    def submit(self, server_round: int) -> None:
        """Round r is durable (its step in the step log): evaluate ``x^r`` when its turn comes. Never
        blocks: the round number joins a queue that the sender thread feeds to the process."""
        self._raise_if_failed()
        self._queue.put((server_round, time.time()))

    def _send(self) -> None:
        """The sender thread: each queued round down the pipe, in order; ``None`` (``close``) last. A
        full pipe (the process far behind) holds this thread, never the loop."""
        while True:
            item = self._queue.get()
            try:
                self._pipe.send(item)
            except (OSError, ValueError):  # the process is gone (the receiver says why) or the pipe closed
                return
            if item is None:
                return

    def close(self, raise_error: bool = True) -> None:
        """Wait for the evaluations handed over (the last round's among them), then stop the process.
        ``raise_error=False`` (the run is failing already): stop it at once."""
        process, self._process = self._process, None
        if process is None:
            return
        try:
            self._queue.put(None)  # no more rounds: it finishes those handed over, then exits
            if raise_error:
                self._receiver.join()
                process.join(30.0)
                if self._error is None and process.exitcode != 0:
                    self._error = _ended(process)
        finally:  # every way out (an error, SIGTERM's SystemExit) stops the process and reaps it
            _stop(process)
            self._receiver.join()
            self._sender.join(30.0)  # its send fails once the process is gone
            self._pipe.close()
        if raise_error:
            self._raise_if_failed()

    def _receive(self) -> None:
        """The receiver thread: each round's evaluation into its record, as the process sends it."""
        try:
            while True:
                kind, *rest = self._pipe.recv()
                if kind == "round":
                    self.run.write_evaluation(*rest)
                    self.version = rest[0]
                else:
                    self._error = RuntimeError(f"the server's evaluation failed: {rest[0]}")
        except (EOFError, OSError):  # the process has closed its end: it ended, or died
            pass
        except BaseException as err:  # a record the loop cannot write fails the run too
            log.exception("Writing an evaluation record failed")
            self._error = err

    def _raise_if_failed(self) -> None:
        """The evaluator's error, or its process's end before ``close`` asked for it, as the run's error."""
        if self._error is None and self._process is not None and not self._receiver.is_alive():
            self._process.join(30.0)  # the pipe closed: the process is exiting
            self._error = _ended(self._process)
        if self._error is not None:
            raise self._error


def _stop(process) -> None:
    """SIGTERM, then SIGKILL if it has not gone within 10 s; reaped either way."""
    if process.exitcode is None:
        process.terminate()
        process.join(10.0)
    if process.exitcode is None:
        process.kill()
    process.join()


def _ended(process) -> RuntimeError:
    code = process.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
    return RuntimeError(f"the server's evaluation failed: its process (pid {process.pid}) ended ({how})")


# ---------------------------------------------------------------- the evaluator process
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
        self.replica = ModelReplica(model.to(cfg.eval_device))
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

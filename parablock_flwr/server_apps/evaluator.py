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
with Flower's copies of a block, which lengthens them: ``eval-cpus`` gives
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

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from pathlib import Path

import torch

from ..config import RunConfig
from .evaluation_process import follow_rounds

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

"""The server's evaluation of ``x^r``, beside the round loop, on a replica of its own.

The round loop hands each round to the evaluator once the round's record and checkpoint are
durable (``Run.finish_round``) and goes straight back to pulling replies: nothing of an
evaluation lies between a round's last reply and the next round's messages. The evaluator's
thread holds its own copy of the model on ``eval-device`` and moves it from ``x^{r-1}`` to
``x^r`` with the same ``x[b] += g`` every copy applies, so it evaluates exactly the model the
loop held (the results are those an evaluation in the loop would give). It runs at a lower CPU
priority than the loop (``EVALUATOR_NICE``).

When it falls behind: the loop never waits. The evaluator takes every round handed to it since
its last evaluation, applies their steps in order (a block add each) and evaluates only the
newest round due for evaluation; the older ones are recorded as skipped
(``evaluation_skipped``, counted on the run's last line). Round 0 and the last round are always
evaluated, and the run ends when the last round's evaluation has. Steps wait for it in memory:
as many blocks as rounds end during one evaluation.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from .. import core
from ..config import RunConfig
from ..durable import crash_point
from ..evaluation import evaluate
from ..model import save_model

log = logging.getLogger(__name__)
# The evaluator's thread (and the torch threads it starts) yield the CPU to the loop (nice 10 measured the same).
EVALUATOR_NICE = 19


class ServerEvaluator:
    """``evaluation = "server"`` (held-out loss, generated answers) and ``save-every``, off the loop."""

    def __init__(self, model, tokenizer, heldout, cfg: RunConfig, run_dir: Path):
        self.model, self.tokenizer, self.heldout, self.cfg = model, tokenizer, heldout, cfg
        self.run_dir = Path(run_dir)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------ the loop's side
    def begin(self, run) -> None:
        """Copy ``x`` as it is now (``x^{first_round - 1}``) and start the thread."""
        self.run = run
        self.replica = copy.deepcopy(self.model).to(self.cfg.eval_device)
        self.params = dict(self.replica.named_parameters())
        self._thread = threading.Thread(target=self._work, name="parablock-evaluator", daemon=True)
        self._thread.start()

    def submit(self, server_round: int, step: tuple[int, int, core.Tensors] | None) -> None:
        """Round r is durable: evaluate ``x^r`` when its turn comes (``step``: ``(r, b_r, g^r)``, None
        for ``x^0`` and for a resumed run's first round, which the replica holds already)."""
        self._raise_if_failed()
        self._queue.put((server_round, step, time.time()))

    def close(self, raise_error: bool = True) -> None:
        """Wait for the evaluations handed over (the last round's among them), then stop."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if raise_error:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the server's evaluation failed: {self._error}") from self._error

    # ------------------------------------------------------------ the thread
    def _work(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), EVALUATOR_NICE)  # this thread only
        try:
            while (backlog := self._take()) is not None:
                self._catch_up(backlog)
        except BaseException as err:  # the loop re-raises it (``submit``/``close``): the run fails
            log.exception("The server's evaluation failed")
            self._error = err

    def _take(self) -> list | None:
        """The next round handed over, and every other one already waiting (None: stop)."""
        backlog = [self._queue.get()]
        while backlog[-1] is not None:
            try:
                backlog.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if backlog[-1] is None:
            backlog.pop()
            if backlog:
                self._catch_up(backlog)
            return None
        return backlog

    def _catch_up(self, backlog: list) -> None:
        """Apply each round's step in order; evaluate the newest round that is due, skip older due ones."""
        due = [r for r, _, _ in backlog if self._due(r)]
        for server_round, step, handed_over in backlog:
            if step is not None:
                _, _, values = step
                core.apply_step(self.params, values)
            self._save_model(server_round)
            if not self._due(server_round):
                self.run.write_evaluation(server_round, {})
            elif server_round != due[-1] and server_round not in (0, self.cfg.num_server_rounds):
                log.info("round %d: evaluation skipped (the evaluator was %d rounds behind)",
                         server_round, due[-1] - server_round)  # fmt: skip
                self.run.write_evaluation(server_round, {"evaluation_skipped": 1})
            else:
                self.run.write_evaluation(server_round, self._evaluate(server_round, handed_over))

    def _due(self, server_round: int) -> bool:
        last = server_round == self.cfg.num_server_rounds
        return self.heldout is not None and (server_round % self.cfg.eval_every == 0 or last)

    def _evaluate(self, server_round: int, handed_over: float) -> dict:
        started = time.time()
        cfg = self.cfg
        every = cfg.generate_every
        generate = server_round in (0, cfg.num_server_rounds) or bool(every and server_round % every == 0)
        metrics, samples = evaluate(self.replica, self.tokenizer, self.heldout, cfg, generate)
        crash_point("evaluation", server_round)
        if samples:
            write_samples(self.run_dir / "samples" / f"round-{server_round:05d}.jsonl", samples)
        # evaluation_waited_s: from the round's hand-over to this evaluation's start (how far behind it ran).
        return {**metrics, "evaluate_s": time.time() - started, "evaluation_waited_s": started - handed_over}

    def _save_model(self, server_round: int) -> None:
        """``save-every``: the Hugging Face export of ``x^r`` (from the replica: off the loop too)."""
        every, last = self.cfg.save_every, server_round == self.cfg.num_server_rounds
        if every and server_round and (server_round % every == 0 or last):
            save_model(self.replica, self.tokenizer, self.run_dir / "checkpoints" / f"round-{server_round:05d}")


def write_samples(path: Path, samples: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))

"""A round's one pass started before its last reply, on the updates that landed ahead of their replies.

With ``transport = "direct"`` a ParaBlock node uploads its round-r update while it still waits for round r's
message: it trained the block ahead, from its own pending update, and its update does not depend on the step
the message brings. So the server holds every update of the round seconds before the replies that commit
them: each node must still download ``g^{r-1}`` and correct before it replies. ``StepAhead`` watches for that
moment on a thread of its own and runs the algorithm's one pass then (``FedBCD.precompute_step``);
``aggregate_train`` keeps its result where the replies commit those very updates (the same bits), else runs the
pass again. From the last reply to the next message there remain the replies' checks and the staging, not the
pass over the block. On Flower's path, and where no update comes before its reply, nothing changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from flwr.app import Message

from ..transport.channel import Channel

log = logging.getLogger(__name__)
POLL_S = 0.02  # how often the thread looks for the round's updates in the transport's inbox


class StepAhead:
    """One round at a time: ``start`` after its messages are out, its replies read through ``replies``,
    ``finish`` once it is aggregated (a pass still running is waited for: the algorithm's state has one owner
    again). ``close`` at the run's end."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-ahead")
        self._settled = threading.Event()
        self._future: Future | None = None

    def start(self, algorithm, channel: Channel, server_round: int, nodes: set[int], timeout_s: float) -> Future:
        """Round r's pass, once every one of ``nodes`` has its update landed and unclaimed (``Channel.landed_updates``),
        until the round's replies are all in (``replies``) or ``timeout_s`` passes. The future's result is the
        algorithm's ``PrecomputedStep``, or None (nothing ran, or it could not)."""
        self.finish()
        self._settled = threading.Event()
        deadline = time.monotonic() + timeout_s
        self._future = self._thread.submit(watch, algorithm, channel, server_round, set(nodes), self._settled, deadline)
        return self._future

    def replies(self, replies: Iterable[Message]) -> Iterator[Message]:
        """``replies`` as they come; once they are all in, an update that has not landed will not (each reply
        claimed its own): a pass not yet started is not started."""
        try:
            yield from replies
        finally:
            self._settled.set()

    def finish(self) -> None:
        """The round is aggregated (or failed): no pass starts now, one running is waited for, and what the
        aggregation did not take is dropped (its memory is a block's)."""
        self._settled.set()
        future, self._future = self._future, None
        if future is not None and (precomputed := future.result()) is not None:
            precomputed.discard()

    def close(self) -> None:
        self.finish()
        self._thread.shutdown(wait=True)


def watch(algorithm, channel: Channel, server_round: int, nodes: set[int], settled: threading.Event, deadline: float):
    """``StepAhead.start``'s thread: the pass once every update has landed, or None."""
    try:
        while not settled.is_set() and time.monotonic() < deadline:
            landed = channel.landed_updates(server_round, nodes)
            if landed is not None:
                return algorithm.precompute_step(server_round, landed)
            settled.wait(POLL_S)
    except Exception as err:  # noqa: BLE001 - the round aggregates as it would have: the pass runs after the replies
        log.warning("round %d: the pass ahead of the replies failed (%s); it runs after them", server_round, err)
    return None

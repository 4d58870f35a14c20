"""A round's one pass started before its last reply, on the updates that landed, or are landing, ahead of their
replies.

With ``transport = "direct"`` every node uploads its update on the stream before the reply that commits it. A
ParaBlock node does so while it still waits for round r's message: it trained the block ahead, from its own pending
update, and its update does not depend on the step the message brings; so the server holds every update of the
round seconds before the replies (each node must still download ``g^{r-1}`` and correct). A BCD node replies once
its upload has landed: there the pass reads each update as its bytes land (``wire.LandingArrays``), and ends about
when its last byte does, not a pass later. ``StepAhead`` watches for the moment every update of the round has
begun to land (its layout and scales in) on a thread of its own and runs the algorithm's one pass then
(``FedBCD.prepare_pass_ahead``, ``PassAhead``); ``aggregate_train`` keeps its result where the replies commit those
very updates (the same bits), else runs the pass again at once. From the last reply to the next message there
remain the replies' checks and the staging, not the pass over the block. On Flower's path, and where an update comes
only with its reply, nothing changes.
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
    """One round at a time: ``start`` once its messages are out, its replies read through ``replies``, ``finish``
    after its first aggregation (a pass ahead that was not kept is dropped: its memory goes, and if it still runs,
    it ends on its own thread, reading its own snapshot of ``x[b]``). ``close`` at the run's end waits for it."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-ahead")
        self._norms = ThreadPoolExecutor(max_workers=1, thread_name_prefix="norms-ahead")  # ``PassAhead.run_norms``
        self._settled = threading.Event()
        self._prepared: Future | None = None

    def start(self, algorithm, channel: Channel, server_round: int, nodes: set[int], timeout_s: float) -> Future:
        """Round r's pass, once every one of ``nodes`` has its update landed or landing, unclaimed
        (``Channel.landed_updates``), until the round's replies are all in (``replies``) or ``timeout_s`` passes. The
        future's result, set before the pass runs, is the algorithm's ``PassAhead`` (``prepare_pass_ahead``), or None
        (none could be)."""
        self.finish()
        self._settled = threading.Event()
        self._prepared = prepared = Future()
        deadline = time.monotonic() + timeout_s
        self._thread.submit(watch, algorithm, channel, server_round, set(nodes), self._settled, deadline, prepared,
                            self._norms)  # fmt: skip
        return prepared

    def replies(self, replies: Iterable[Message]) -> Iterator[Message]:
        """``replies`` as they come; once they are all in, an update that has not landed will not (each reply
        claimed its own): a pass not yet prepared is not."""
        try:
            yield from replies
        finally:
            self._settled.set()

    def finish(self) -> None:
        """The round's first aggregation is over: no pass is prepared now, and one the aggregation did not take is
        dropped, never waited for (it is on no path)."""
        self._settled.set()
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.done() and (ahead := prepared.result()) is not None:
            ahead.drop()

    def close(self) -> None:
        self.finish()
        self._thread.shutdown(wait=True)
        self._norms.shutdown(wait=True)


def watch(
    algorithm, channel: Channel, server_round: int, nodes: set[int], settled: threading.Event, deadline: float,
    prepared: Future, norms: ThreadPoolExecutor,
) -> None:  # fmt: skip
    """``StepAhead.start``'s thread: the pass prepared and run once every update has landed or begun to, and the
    updates' norms found beside it on ``norms``' thread (``PassAhead.run_norms``); ``prepared`` says it."""
    try:
        while not settled.is_set() and time.monotonic() < deadline:
            landed = channel.landed_updates(server_round, nodes)
            if landed is not None:
                ahead = algorithm.prepare_pass_ahead(server_round, landed)
                if ahead is not None and settled.is_set():  # the round's aggregation is over already
                    ahead.drop()
                elif ahead is not None:
                    norms.submit(ahead.run_norms)  # a check that finds a norm not started yet finds it itself
                prepared.set_result(ahead)
                if ahead is not None:
                    ahead.run()
                return
            settled.wait(POLL_S)
    except Exception as err:  # noqa: BLE001 - the round aggregates as it would have: its pass runs after the replies
        log.warning("round %d: the pass ahead of the replies failed (%s); it runs after them", server_round, err)
    finally:
        if not prepared.done():
            prepared.set_result(None)

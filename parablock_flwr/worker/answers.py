"""What a node worker answered: a repeat of a round gets the same reply, never a second computation."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ANSWERS_KEPT = 8  # rounds whose replies (headers only) answer a message Flower delivers late

Reply = tuple[dict, dict]  # a WorkerReply's header and its arrays


class Answers:
    """The worker's replies by request key ``(op, run, partition, round)``, read and changed under its lock.

    ``last`` is the last round computed (or tried) and its reply: a repeat (a ClientApp that gave up waiting, a
    retried round) gets it. ``kept`` holds the last rounds' replies that carry no arrays (their updates went on the
    stream): with rounds started from the stream, Flower may deliver a round's message after later rounds were
    answered. ``tried`` is the last key computed or tried: a round started from its content on the stream runs only
    if its message did not come first."""

    def __init__(self) -> None:
        self.last: tuple[tuple, Reply] | None = None
        self.last_failed = False  # ``last`` is the failure of a round started from its content
        self.kept: dict[tuple, Reply] = {}
        self.tried: tuple | None = None

    def answered(self, key: tuple, pushed_ahead: bool) -> Reply | None:
        """The reply already made for ``key``'s round, or None. A round started from its content that failed
        answers its message pushed ahead only, once: a retry of that round (its records inline, say) is computed."""
        if self.last is None or self.last[0] != key:
            return self.kept.get(key)  # a round's message that Flower delivers after later rounds were answered
        reply = self.last[1]
        if self.last_failed:
            if not pushed_ahead:
                return None
            self.last, self.last_failed = None, False
            return reply
        log.info("round %d again (or started from its content on the stream): the same reply, not a second "
                 "computation", key[3])  # fmt: skip
        return reply

    def keep(self, key: tuple, reply: Reply, failed: bool, from_stream: bool) -> None:
        """``key``'s reply: a success answers its repeats; a failure only the message of a round started from its
        content (``from_stream``); a success without arrays is kept for a message Flower delivers late."""
        if not failed or from_stream:
            self.last, self.last_failed = (key, reply), failed
        if not failed and not reply[1]:  # (its update on the stream: a header, a few kB)
            self.kept[key] = reply
            while len(self.kept) > ANSWERS_KEPT:
                del self.kept[next(iter(self.kept))]

    def forget(self) -> None:
        """A new run: nothing answered yet (``tried`` stays: its key names its run)."""
        self.last, self.last_failed, self.kept = None, False, {}

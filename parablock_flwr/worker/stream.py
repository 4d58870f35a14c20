"""The node worker's side of ``transport = "direct"``: a round's block records fetched from the run's stream
before the round runs, and its update uploaded once computed, so that Flower's messages carry only their
control data (docs/transport.md).

A message's ``stream-offer`` names the stream, the CA the node trusts for it, each record's size and
SHA-256, and the capabilities. When the stream cannot be used (the address does not answer, a TLS
failure, a refusal, or the site's node config says ``transport="flower"``), the update goes inline in the
Flower reply (``direct-fallbacks`` = 1 in its metrics); records the node could not fetch make the round
an error with the node's state intact (``messages.STREAM_UNUSABLE``), and the server sends that node its
next messages with their records inline. Each is logged once per address here, and counted by the server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .. import node
from ..messages import (
    MAX_MESSAGE_CONTENT,
    OFFER,
    ROUND,
    STREAM_UNUSABLE,
    MessageError,
    TransportOffer,
    UpdateCommit,
    WorkerReply,
    WorkerRequest,
)
from ..node.runtime import EarlyUpdate
from ..node.settings import NodeSettings
from ..transport import NodeTransport, StreamUnusable
from ..transport.node_side import Prefetched
from ..wire import pack_pieces

log = logging.getLogger(__name__)
FLOWER_ONLY = "flower"  # a site's node config ``transport``: keep to Flower's path


@dataclass(frozen=True)
class EarlyUpload:
    """Round r+1's update, rounded (``Node.early_update``), packed and uploaded before its message came:
    ``commit`` None when the upload failed (the round then uploads as usual)."""

    early: EarlyUpdate
    pieces: dict[str, list[np.ndarray]]
    commit: UpdateCommit | None
    name: str  # the slot it went to: round r+1's own (``RunTransport.upload_name``)


@dataclass(frozen=True)
class AheadTransfers:
    """What moves for round ``server_round`` of run ``run_id`` before its message comes: its global step's
    download (a ``Prefetched`` or None) and its update's upload (an ``EarlyUpload`` or None)."""

    run_id: int
    server_round: int
    step_name: str  # the name round r+1's step is published by (``RunTransport.step_name``)
    step: Future | None
    update: Future | None
    rounded: Future | None = None  # the update's rounding (an ``EarlyUpdate`` or None), before its upload

    def __post_init__(self) -> None:
        if self.update is not None and self.rounded is not None:
            # A function of ``rounded`` alone: a Future keeps its callbacks, and a bound method would make this
            # object and its futures a cycle, whose blocks only the garbage collector's rare full pass frees.
            self.update.add_done_callback(functools.partial(_never_rounded, self.rounded))

    def step_for(self, offer: TransportOffer) -> Prefetched | None:
        """The prefetched step when ``offer`` names it (it is published then: what is left to wait for is
        bytes on their way); else None at once (the records came inline: the download ends with the round).
        The fetch uses it only when its size and SHA-256 are the ones ``offer`` announces."""
        if self.step is None or all(ref.name != self.step_name for ref in offer.records):
            return None
        return _outcome(self.step, "its step's download")

    def early_update(self) -> EarlyUpdate | None:
        """The update moving ahead as it was rounded, once its computation is done: what the round's
        training takes, so that the next computation starts while the bytes are still on their way."""
        return None if self.rounded is None else _outcome(self.rounded, "its update's rounding")

    def early_upload(self) -> EarlyUpload | None:
        """The upload ahead, waited for (the round commits nothing of it before it is done)."""
        return None if self.update is None else _outcome(self.update, "its update's upload")


def _never_rounded(rounded: Future, update: Future) -> None:
    """The upload's task ended without handing over a rounding (its computation failed or left nothing to
    send, or a closing worker cancelled it before it ran): nobody waits for one."""
    if not rounded.done():
        rounded.set_result(None)


def _outcome(future: Future, what: str):
    """A transfer's result, or None when it failed in a way its thread did not expect: the round then
    moves those bytes as usual, never fails for it."""
    try:
        return future.result()
    except Exception as err:  # noqa: BLE001 - said, and the usual path takes over
        log.warning("direct transport: %s ahead failed (%s: %s); moved with the message instead", what,
                    type(err).__name__, err)  # fmt: skip
        return None


class WorkerStream:
    """One worker's channels to the run's stream (kept across rounds) and what it has logged."""

    def __init__(self) -> None:
        self.transport = NodeTransport()
        self._said: set[tuple[str, str]] = set()  # (what, address) logged once
        # Transfers a round ahead run here, beside the compute thread; a download that waits for a record
        # the server never publishes to this node holds one until its capability ends with the round.
        self._ahead_pool = ThreadPoolExecutor(max_workers=6, thread_name_prefix="transport-ahead")
        self.ahead: AheadTransfers | None = None
        # Round r+1's content, downloading since round r's reply (run, round, its future): the round it makes
        # starts when it comes, and the ClientApp's request for that round (pushed ahead) waits for it.
        self.content: tuple[int, int, Future] | None = None
        self._closed = threading.Event()  # the worker exits: a transfer ahead not yet started does not start

    def start_transfers_ahead(
        self,
        offer: TransportOffer,
        run_id: int,
        transfer_dtype: str,
        early: Callable[[], EarlyUpdate | None],
        step_size: int = 0,
    ) -> None:
        """After round r's reply committed on the stream: round r+1's global step fetched as soon as the server
        publishes it, and round r+1's update (``early``: its rounding, once the computation ahead is done)
        uploaded, both under the capabilities round r's offer issued ahead, in the background. ``step_size``:
        the size round r+1's step most likely has (round r's committed update: ``g^r`` is of the same block,
        packed alike), which the download receives into kept memory."""
        step = update = rounded = None
        if offer.ahead_step_name:
            step = self._ahead_pool.submit(self._prefetch, offer, step_size)
        if offer.ahead_upload_name:
            rounded = Future()
            update = self._ahead_pool.submit(self._upload_ahead, offer, transfer_dtype, early, rounded)
        self.ahead = AheadTransfers(run_id, offer.server_round + 1, offer.ahead_step_name, step, update, rounded)
        self.content = None
        if offer.ahead_message_name:
            view = dataclasses.replace(
                offer, server_round=offer.server_round + 1, message_name=offer.ahead_message_name,
                message_token=offer.ahead_message_token, message_max_size=MAX_MESSAGE_CONTENT,
                message_key=offer.ahead_message_key,
            )  # fmt: skip
            self.content = (run_id, view.server_round, self._ahead_pool.submit(self._download_content, view))

    def submit(self, fn, *args) -> None:
        """``fn(*args)`` in a thread beside the compute (a round started from its content), unless closing."""
        if not self._closed.is_set():
            with contextlib.suppress(RuntimeError):  # shut down meanwhile
                self._ahead_pool.submit(fn, *args)

    def content_for(self, run_id: int, server_round: int) -> Future | None:
        """The download of this round's content started a round ahead, if any (its result: ``content``'s)."""
        content = self.content
        return content[2] if content is not None and content[:2] == (run_id, server_round) else None

    def message_content(
        self, offer: TransportOffer, run_id: int, settings: NodeSettings, timeout_s: float
    ) -> tuple[dict, dict] | None:
        """A message pushed ahead (``offer``'s ``message_*``): its content's round config and offer, from the
        download this worker started a round ahead, else downloaded now under ``offer``'s capability (this
        waits until the server has built it); None when the server withdrew it. ``node.StateIntact`` when the
        stream cannot be used (``STREAM_UNUSABLE``) or the content is not the message's."""
        own = self.content_for(run_id, offer.server_round)
        if own is not None:
            try:
                return own.result()
            except Exception as err:  # noqa: BLE001 - said; the message's own capability is tried next
                log.info("direct transport: round %d's content not taken ahead (%s: %s)", offer.server_round,
                         type(err).__name__, err)  # fmt: skip
        try:
            self._use(settings, timeout_s)
            return self._download_content(offer)
        except StreamUnusable as err:
            raise node.StateIntact(f"{STREAM_UNUSABLE}{err}") from None
        except MessageError as err:
            raise node.StateIntact(f"message from the server: {err}") from None

    def _download_content(self, offer: TransportOffer) -> tuple[dict, dict] | None:
        """``offer``'s message content (its round config and offer), once the server publishes it; None when it
        withdrew it. Raises ``StreamUnusable`` or ``MessageError`` (the content is not the message's)."""
        from ..transport.message_bytes import content_ahead  # Flower's schema: only where a message is pushed ahead

        data = self.transport.message_content(offer)
        if data is None:
            return None
        content = content_ahead(offer, data)
        return dict(content[ROUND]), dict(content[OFFER])

    def close(self) -> None:
        """The channels closed (a download still waiting ends with them) and the transfers' threads let go."""
        self._closed.set()
        self.transport.close()
        self._ahead_pool.shutdown(wait=False, cancel_futures=True)

    def take_transfers_ahead(self, run_id: int, server_round: int) -> AheadTransfers | None:
        """The transfers started for this round of this run, if any; any other is forgotten."""
        ahead, self.ahead = self.ahead, None
        return ahead if ahead is not None and (ahead.run_id, ahead.server_round) == (run_id, server_round) else None

    def _prefetch(self, offer: TransportOffer, step_size: int) -> Prefetched | None:
        try:
            return self.transport.prefetch(offer, step_size)
        except StreamUnusable as err:  # the round then fetches its step as usual
            log.info("direct transport: round %d's global step not fetched ahead: %s", offer.server_round + 1, err)
            return None

    def _upload_ahead(
        self, offer: TransportOffer, transfer_dtype: str, early_update, rounded: Future
    ) -> EarlyUpload | None:
        """``early_update()`` (it waits for the computation), handed to ``rounded`` at once, then uploaded. The
        round's training reads the same tensors meanwhile, and changes none of them."""
        try:
            early = early_update()
        except Exception as err:  # noqa: BLE001 - the computation's failure is reported when its round comes
            log.info("direct transport: round %d's update not moved ahead: %s", offer.server_round + 1, err)
            return None  # ``rounded`` gets None when this task ends (``AheadTransfers._never_rounded``)
        if early is None or self._closed.is_set():  # (it waited for the computation; the worker may be exiting)
            return None
        rounded.set_result(early)
        pieces = pack_pieces(early.sent, transfer_dtype, early.encoded)
        try:
            commit = self.transport.upload_ahead(offer, pieces)
        except StreamUnusable as err:  # the round then uploads as usual
            log.info("direct transport: round %d's update not uploaded ahead: %s", offer.server_round + 1, err)
            commit = None
        return EarlyUpload(early, pieces, commit, offer.ahead_upload_name)

    def offer(self, request: WorkerRequest) -> TransportOffer | None:
        """The request's offer, read strictly (a malformed one refuses the round, state intact)."""
        if not request.stream_offer:
            return None
        try:
            return TransportOffer.from_config(request.stream_offer)
        except MessageError as err:
            raise node.StateIntact(str(err)) from None

    def fetch(
        self, offer: TransportOffer, settings: NodeSettings, timeout_s: float, prefetched: Prefetched | None = None
    ) -> dict[str, np.ndarray]:
        """The offered records as the relay's ``record/array`` arrays, each checked against Flower's message
        (a ``prefetched`` one used when it matches); ``node.StateIntact`` (``STREAM_UNUSABLE``) when they
        cannot be fetched."""
        if not offer.records:
            return {}
        try:
            self._use(settings, timeout_s)
            arrays = self.transport.fetch_arrays(offer, prefetched)
        except StreamUnusable as err:
            self._once("unusable", offer, f"direct transport: cannot fetch the round's records: {err}", log.warning)
            raise node.StateIntact(f"{STREAM_UNUSABLE}{err}") from None
        size = sum(r.size for r in offer.records)
        self._once("fetched", offer, f"direct transport: fetched {len(offer.records)} records ({size / 1e6:,.2f} MB) "
                   f"from {self._where(offer)}", log.info)  # fmt: skip
        return arrays

    def upload(
        self, offer: TransportOffer, settings: NodeSettings, pieces: dict[str, list[np.ndarray]], timeout_s: float
    ) -> UpdateCommit | None:
        """The update uploaded: its commit for the reply; None when it must go inline (a fallback)."""
        if not offer.upload_name:
            return None
        try:
            self._use(settings, timeout_s)
            commit = self.transport.upload_pieces(offer, pieces)
        except StreamUnusable as err:
            self._once("inline", offer, f"direct transport: the update goes inline on Flower's path ({err}); "
                       f"counted as a fallback, logged once", log.warning)  # fmt: skip
            return None
        self._once("uploaded", offer, f"direct transport: uploaded round {offer.server_round}'s update "
                   f"({commit.update_size / 1e6:,.2f} MB) to {self._where(offer)}", log.info)  # fmt: skip
        return commit

    def upload_reply(self, offer: TransportOffer | None, settings: NodeSettings, reply: dict, timeout_s: float) -> bool:
        """The round's reply (a ``WorkerReply`` header that commits its update on the stream) uploaded as the
        content the server reads as that node's reply, when the offer gives a capability for it: whether it went
        (if not, logged once: Flower's reply, which the ClientApp relays all the same, is the one the server
        takes)."""
        if offer is None or not offer.reply_name:
            return False
        # Flower's schema: imported only where a reply uses it.
        from ..transport.message_bytes import reply_content, reply_to_bytes

        answer = WorkerReply.from_header(reply)
        try:
            self._use(settings, timeout_s)
            self.transport.upload_reply(offer, reply_to_bytes(reply_content(answer.metrics, answer.trace,
                                                                            answer.stream_commit)))  # fmt: skip
        except (StreamUnusable, MessageError) as err:
            self._once("reply", offer, f"direct transport: the reply goes on Flower's path only ({err}); logged once",
                       log.warning)  # fmt: skip
            return False
        return True

    def _use(self, settings: NodeSettings, timeout_s: float) -> None:
        if settings.transport == FLOWER_ONLY:
            raise StreamUnusable('this site\'s node config says transport="flower"')
        self.transport.site = settings.stream
        self.transport.timeout_s = timeout_s  # a transfer cannot take longer than the server waits

    def _where(self, offer: TransportOffer) -> str:
        return f"{self.transport.address(offer)} ({'PLAINTEXT' if offer.insecure else 'TLS'})"

    def _once(self, what: str, offer: TransportOffer, line: str, say) -> None:
        key = (what, self.transport.address(offer))
        if key not in self._said:
            self._said.add(key)
            say(line)

"""The direct transport's two sides for a run (``transport.server_side.RunTransport``, the ServerApp's;
``transport.node_side.NodeTransport``, the node worker's) against a real ``TransportServer`` with TLS on
loopback, no Flower process: the records a round's message offers arrive as the very arrays Flower's
path carries, an update comes back only under the digest its reply commits, each node moves only its
own records, a round's end forgets it and counts its refusals and fallbacks, and a node that cannot use
the stream says so in one line (its caller falls back)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr import core, wire
from parablock_flwr.messages import (
    CATCH_UP,
    COMMIT,
    GLOBAL_STEP,
    METRICS,
    OFFER,
    STREAM_UNUSABLE,
    SYNC_VALUES,
    UPDATE,
    TrainMetrics,
    TransportOffer,
    UpdateCommit,
    metrics_to_record,
    relay_name,
    relay_split,
)
from parablock_flwr.node.settings import SiteStream
from parablock_flwr.npy import npy_view
from parablock_flwr.records import pieces_record, record_arrays, to_record, to_tensors
from parablock_flwr.strategies.reply_checks import Expected, parse_reply
from parablock_flwr.strategies.round_stats import array_bytes
from parablock_flwr.strategies.update_spill import fingerprint
from parablock_flwr.tools.credentials import make_tls
from parablock_flwr.transport import (
    CapabilityRegistry,
    Direction,
    Limits,
    NodeTransport,
    RefusalKind,
    Refused,
    RunTransport,
    StreamSettings,
    StreamUnusable,
    Ticket,
    TransportClient,
    TransportError,
    TransportSetupError,
    update_bound,
)
from parablock_flwr.transport.direct_channel import DirectChannel
from parablock_flwr.transport.framing import Buffers, FramingError, arrays, frame, framed_pieces, unframe
from parablock_flwr.transport.node_side import Prefetched
from parablock_flwr.transport.service import UploadBrokenOff
from parablock_flwr.wire import LandingArrays, pack, pack_pieces, unpack

from helpers import npy_bytes

RUN, TTL = 41, 30.0
LIMITS = Limits(idle_timeout_s=2.0, grace_s=1.0)
NOTHING_AHEAD = {
    "direct_updates_ahead": 0,
    "direct_steps_prefetched": 0,
    "direct_ahead_revoked": 0,
    "direct_messages_ahead": 0,
    "direct_contents_fetched": 0,
    "direct_messages_withdrawn": 0,
    "direct_revoked_used": 0,
    "direct_waits_ended": 0,
    "direct_uploads_spilled": 0,
    "direct_calls_cancelled": 0,
    "direct_replies_on_stream": 0,
    "direct_replies_audited": 0,
    "direct_replies_contradicted": 0,
    "direct_replies_unaudited": 0,
}


def block(seed: int, dtype: str = "int8"):
    """A block as it travels: a Flower ArrayRecord of its packed arrays (``records.to_record``)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"layers.0.w": torch.randn(64, 48, generator=gen), "layers.0.b": torch.randn(48, generator=gen)}
    return to_record(tensors, dtype)


def payloads(record) -> dict[str, bytes]:
    return {name: bytes(array.data) for name, array in record.items()}


def settings(tls, address: str = "localhost:0") -> StreamSettings:
    return StreamSettings(address, str(tls.server_cert), str(tls.server_key), str(tls.ca_cert))


@pytest.fixture
def hub(tls):
    with RunTransport(settings(tls), RUN, TTL, LIMITS) as run_transport:
        yield run_transport


@pytest.fixture
def node():
    side = NodeTransport(timeout_s=30)
    yield side
    side.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- server -> node


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_offered_records_arrive_as_the_arrays_flowers_path_carries(hub, node, dtype):
    step, catch_up = block(1, dtype), block(2, dtype)
    offer = hub.offer(3, node=7, records={GLOBAL_STEP: step, CATCH_UP: catch_up}, upload_max_size=None)
    assert hub.address.startswith("localhost:") and not hub.address.endswith(":0")  # the bound port
    fetched = node.fetch(offer)
    for name, record in ((GLOBAL_STEP, step), (CATCH_UP, catch_up)):
        assert {k: bytes(v) for k, v in fetched[name].items()} == payloads(record)
        got = unpack(arrays(frame(fetched[name]), name))
        assert all(torch.equal(got[k], v) for k, v in to_tensors(record).items())  # bit for bit
    assert [r.size for r in offer.records] == [len(frame(step)), len(frame(catch_up))]


def test_an_empty_record_is_not_offered(hub, node):
    offer = hub.offer(1, node=7, records={GLOBAL_STEP: {}}, upload_max_size=10)
    assert offer.records == () and node.fetch(offer) == {}


def test_a_record_every_node_gets_is_published_once_and_each_node_moves_only_its_own(hub, node):
    step = block(3)
    a = hub.offer(2, node=7, records={GLOBAL_STEP: step}, upload_max_size=None)
    b = hub.offer(2, node=8, records={GLOBAL_STEP: step, SYNC_VALUES: block(4)}, upload_max_size=None)
    assert a.records[0].name == b.records[0].name  # one published record, one capability per node
    assert a.records[0].token != b.records[0].token
    # Node 7 presenting node 8's capability for node 8's full sync: refused, counted, nothing moved.
    theirs = dataclasses.replace(a, records=(b.records[1]._replace(record=SYNC_VALUES),))
    with pytest.raises(StreamUnusable, match="refused foreign_record"):
        node.fetch(theirs)
    assert node.fetch(b)[SYNC_VALUES]  # the refusal changed nothing for node 8
    assert hub.end_round(2)["direct_refused_foreign_record"] == 1


def test_a_record_altered_on_the_service_is_caught_by_the_node(hub, node):
    offer = hub.offer(2, node=7, records={GLOBAL_STEP: block(5)}, upload_max_size=None)
    ref = offer.records[0]
    forged = dataclasses.replace(offer, records=(ref._replace(sha256="0" * 64),))
    with pytest.raises(StreamUnusable, match="SHA-256 differs"):
        node.fetch(forged)  # what Flower's message says wins over what the stream sends


# ---------------------------------------------------------------- node -> server


def test_an_update_is_claimed_only_under_the_digest_its_reply_commits(hub, node):
    update = block(6)
    offer = hub.offer(4, node=7, records={}, upload_max_size=update_bound(64 * 48 + 48, 2))
    commit = node.upload(offer, payloads(update))
    with pytest.raises(Refused) as refused:
        hub.claim(4, 7, dataclasses.replace(commit, update_sha256="f" * 64))
    assert refused.value.kind is RefusalKind.DIGEST_MISMATCH
    with pytest.raises(Refused):
        hub.claim(
            4, 7, dataclasses.replace(commit, update_size=commit.update_size + 1)
        )  # the digest matches, the size not
    claimed = hub.claim(4, 7, commit)  # the refusals changed nothing
    assert {k: bytes(v) for k, v in claimed.items()} == payloads(update)
    assert hub.claim(4, 7, commit) is None  # claimed once
    assert hub.claim(4, 8, commit) is None  # another node's reply cannot claim it
    counts = hub.end_round(4)
    assert counts["direct_refused_digest_mismatch"] == 1 and counts["direct_refused_size_mismatch"] == 1


def test_an_update_that_landed_is_read_ahead_of_its_reply_as_the_claim_hands_it_over(tls, node, tmp_path):
    """``landed_update`` reads an upload before any reply commits it, leaving it for the claim, which hands over
    the very same payloads (a pass run on them ahead reads the memory the reply's update reads:
    ``FedBCD.prepare_pass_ahead``); after the claim, nothing. An upload waiting in a file is not read ahead (it is
    decoded only when claimed), nor one whose payloads are no npy arrays (its decoding failed: the claim refuses
    it)."""
    with RunTransport(settings(tls), RUN, TTL, LIMITS, spill_dir=tmp_path / "spill", memory_uploads=1) as hub:
        bound = update_bound(64 * 48 + 48, 2)
        offers = {n: hub.offer(4, node=n, records={}, upload_max_size=bound) for n in (7, 8, 9)}
        assert hub.landed_update(4, 7) is None  # nothing uploaded yet
        commit = node.upload(offers[7], payloads(block(7)))
        landed = hub.landed_update(4, 7)
        assert {k: bytes(v) for k, v in landed.items()} == payloads(block(7))
        # Read where it landed (kept memory, ``KeptUpload``), read-only: a pass ahead takes only memory that stays.
        assert all(isinstance(v, memoryview) and v.readonly for v in landed.values())
        assert not any(npy_view(v, k).flags.writeable for k, v in landed.items())
        assert hub.landed_update(4, 7) is landed  # read again, still there
        node.upload(offers[8], payloads(block(8)))  # past the budget: in a file
        assert hub.server.inbox.spilled == 1 and hub.landed_update(4, 8) is None
        assert hub.claim(4, 7, commit) is landed and hub.landed_update(4, 7) is None
        node.upload(offers[9], {"values": b"not an npy payload"})  # in memory: node 7's claim freed its place
        assert hub.server.inbox.holds(RUN, 9, 4, hub.upload_name(4, 9)) and hub.server.inbox.spilled == 1
        assert hub.landed_update(4, 9) is None
        hub.end_round(4)


class Paused(Buffers):
    """A record's bytes whose upload stops after the first ``at`` of them until ``go`` is set, as on a slow link;
    then it goes on, or (``broken``) the link breaks there."""

    def __init__(self, parts, at: int) -> None:
        super().__init__(parts)
        self.at, self.go, self.broken = at, threading.Event(), False

    def chunks(self, size: int):
        yield self.read(0, self.at)
        self.go.wait(30)
        if self.broken:
            raise ConnectionAbortedError("the link broke")
        for start in range(self.at, len(self), size):
            yield self.read(start, min(start + size, len(self)))


def until(found, timeout_s: float = 20.0):
    """``found()`` once it is not None, polled."""
    deadline = time.monotonic() + timeout_s
    while (value := found()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


@pytest.mark.parametrize("how", ["lands", "broken off", "values not last"])
def test_the_rounds_pass_reads_an_update_as_its_bytes_land_and_the_same_bits_as_the_claimed_one(hub, how, monkeypatch):
    """An update still arriving (its upload paused halfway, as on a slow link) is offered for the round's pass
    once its layout and scales have landed (``DirectChannel.landed_updates``: ``wire.LandingArrays``); the pass
    reads its values as they land, a piece at a time (here two chunks, the last one short), beside an update that
    came whole, waiting for those still on their way, and its result is the pass's over the update the reply
    claims, bit for bit, read from the same memory (``update_spill.fingerprint``: the pass ahead is kept for it).
    An upload broken off ends the wait with ``UploadBrokenOff``, never a pass over bytes that never came. A record
    whose values do not come last (its scales after them: valid on the wire) is offered only once it has landed
    whole: its scales are read whole."""
    monkeypatch.setattr(wire, "LANDING_PIECE_VALUES", 2 * core.transfer_precision.ONE_PASS_CHUNK_VALUES)
    gen = torch.Generator().manual_seed(11)
    tensors = {"layers.0.w": torch.randn(2048, 1000, generator=gen), "layers.0.b": torch.randn(1000, generator=gen)}
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    x = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    other = unpack(pack({name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}, "int8"), lazy=True)
    offer = hub.offer(4, node=7, records={}, upload_max_size=update_bound(2048 * 1000 + 1000, 2))
    ticket = Ticket(bytes.fromhex(offer.upload_token), RUN, 7, 4, Direction.UPLOAD, offer.upload_name)
    pieces = pack_pieces(tensors, "int8")
    if how == "values not last":
        pieces = {name: pieces[name] for name in ("layout", "values", "scales")}
    framed = framed_pieces(pieces)
    # Paused mid-values; or, values not last, with them and the scales' header landed, the scales' values not.
    at = len(framed) // 2 if how != "values not last" else len(framed) - pieces["scales"][0].nbytes // 2
    data = Paused(framed.parts, at)
    channel = DirectChannel(hub)
    client = TransportClient(hub.address, ca_pem=hub.ca_pem.encode(), timeout_s=30)
    with client, ThreadPoolExecutor(2) as pool:
        assert channel.landed_updates(4, {7}) is None  # nothing uploaded yet
        uploading = pool.submit(client.upload, ticket, data)
        if how == "values not last":
            assert until(lambda: channel.landed_updates(4, {7}), timeout_s=1.0) is None  # not while it lands
            data.go.set()
            uploading.result(30)
            assert not isinstance(channel.landed_updates(4, {7})[7], LandingArrays)  # landed whole
            return
        landing = until(lambda: channel.landed_updates(4, {7}))[7]
        assert isinstance(landing, LandingArrays) and not any(a.flags.writeable for a in landing.values())
        updates = [unpack(landing, shapes, lazy=True), other]
        passing = pool.submit(core.applied_mean_step, updates, [1.0, 2.0], 1.0, x, "int8")
        time.sleep(0.5)
        assert not passing.done()  # waiting for the values still on their way
        data.broken = how == "broken off"
        data.go.set()
        if data.broken:
            with pytest.raises(TransportError):
                uploading.result(30)
            with pytest.raises(UploadBrokenOff, match="the upload ended at"):
                passing.result(30)
            return
        commit = UpdateCommit(update_size=len(data), update_sha256=uploading.result(30))
        ahead = passing.result(30)
    claimed = {name: npy_view(payload, name) for name, payload in hub.claim(4, 7, commit).items()}
    assert fingerprint(claimed) == fingerprint(landing)
    after = core.applied_mean_step([unpack(claimed, shapes, lazy=True), other], [1.0, 2.0], 1.0, x, "int8")
    for name in shapes:
        assert torch.equal(ahead[0][name][0], after[0][name][0]) and torch.equal(ahead[0][name][1], after[0][name][1])
        assert torch.equal(ahead[1][name], after[1][name])
    assert ahead[2] is None


def test_uploads_past_the_inboxs_budget_wait_for_their_replies_in_files_and_leave_nothing_behind(tls, node, tmp_path):
    """The inbox holds in memory as many uploads as a round's aggregation holds updates
    (``update_spill.IN_MEMORY``), however large (a block of 1 GB is not written to disk and read back on the
    critical path); one more is received into a file of the spill folder, unlinked at once: the claim reads the
    same bytes, the refusals still change nothing, and no file is left, whether the upload is claimed, refused
    or dropped with its round."""
    with RunTransport(settings(tls), RUN, TTL, LIMITS, spill_dir=tmp_path / "spill", memory_uploads=2) as hub:
        bound, inbox = update_bound(64 * 48 + 48, 2), hub.server.inbox
        large = {"values": npy_bytes(np.zeros(65 * 2**20, np.uint8))}
        large_offer = hub.offer(3, node=7, records={}, upload_max_size=70 * 2**20)
        commit = node.upload(large_offer, large)
        assert inbox.spilled == 0  # in memory, not written to disk and read back on the critical path
        assert hub.claim(3, 7, commit) == large and hub.end_round(3)["direct_uploads_spilled"] == 0
        fds = len(os.listdir("/proc/self/fd"))

        def upload(node_id: int, seed: int):
            return node.upload(hub.offer(4, node=node_id, records={}, upload_max_size=bound), payloads(block(seed)))

        in_memory = [upload(7, 7), upload(8, 8)]
        assert inbox.spilled == 0  # two in memory: the budget
        upload(10, 10)  # past it: a file (dropped with its round)
        spilled = upload(9, 9)
        assert inbox.spilled == 2
        with pytest.raises(Refused):
            hub.claim(4, 9, dataclasses.replace(spilled, update_sha256="f" * 64))
        assert {k: bytes(v) for k, v in hub.claim(4, 9, spilled).items()} == payloads(block(9))
        assert {k: bytes(v) for k, v in hub.claim(4, 7, in_memory[0]).items()} == payloads(block(7))
        upload(11, 11)  # node 7's claim freed a place in memory
        assert inbox.spilled == 2
        counts = hub.end_round(4)
        assert counts["direct_refused_digest_mismatch"] == 1 and counts["direct_uploads_spilled"] == 2
        assert list((tmp_path / "spill").iterdir()) == []  # unlinked when created: nothing to clean up
        assert len(os.listdir("/proc/self/fd")) == fds  # each file closed once claimed or dropped


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_the_workers_forms_move_the_same_bytes_as_flowers_records(hub, node, dtype):
    """The worker hands over the update as ``wire.pack_pieces``'s pieces and takes records as
    ``record/array`` arrays: what the server claims is the ``Array`` payloads Flower's path would carry."""
    gen = torch.Generator().manual_seed(11)
    update = {"a": torch.randn(300, generator=gen), "b": torch.randn(4, 70, generator=gen)}
    pieces = pack_pieces(update, dtype)
    offer = hub.offer(4, node=7, records={SYNC_VALUES: block(12, dtype)}, upload_max_size=update_bound(580, 2))
    commit = node.upload_pieces(offer, pieces)
    claimed = hub.claim(4, 7, commit)
    assert {k: bytes(v) for k, v in claimed.items()} == payloads(pieces_record(pieces))
    fetched = node.fetch_arrays(offer)
    assert sorted(fetched) == [relay_name(SYNC_VALUES, n) for n in sorted(block(12, dtype).keys())]
    got = unpack({relay_split(k)[1]: v for k, v in fetched.items()})
    assert all(torch.equal(got[k], v) for k, v in to_tensors(block(12, dtype)).items())


def test_an_update_above_the_bound_is_not_sent(hub, node):
    update = payloads(block(6))
    offer = hub.offer(4, node=7, records={}, upload_max_size=100)
    with pytest.raises(StreamUnusable, match="bounds it at 100"):
        node.upload(offer, update)
    assert hub.claim(4, 7, UpdateCommit(len(frame(update)), "0" * 64)) is None


def test_a_retried_message_and_the_first_upload_meet_in_one_slot(hub, node):
    first = hub.offer(5, node=7, records={}, upload_max_size=10**6)
    commit = node.upload(first, payloads(block(7)))
    retry = hub.offer(5, node=7, records={}, upload_max_size=10**6)  # the round re-sent: a new capability
    assert retry.upload_token != first.upload_token and retry.upload_name == first.upload_name
    assert hub.claim(5, 7, commit) is not None  # the node answers a repeat with the same reply


def test_a_claimed_record_that_is_not_framed_is_refused(hub):
    """Read as it arrived, but refused only when a reply claims it under its own digest and size."""
    ticket = hub.server.registry.issue(RUN, 7, 6, "upload", hub.upload_name(6, 7), ttl_s=TTL, max_size=100)
    hub.server.inbox.put(ticket, "a" * 64, bytearray(b"\x00\x00\x00\x05hello"))
    with pytest.raises(Refused) as other:
        hub.claim(6, 7, UpdateCommit(9, "b" * 64))
    assert other.value.kind is RefusalKind.DIGEST_MISMATCH
    with pytest.raises(Refused, match="not UTF-8 JSON") as refused:
        hub.claim(6, 7, UpdateCommit(9, "a" * 64))
    assert refused.value.kind is RefusalKind.BAD_HEADER
    assert hub.end_round(6)["direct_refused_bad_header"] == 1


# ---------------------------------------------------------------- a round's end


def test_a_rounds_end_forgets_it_and_counts_its_fallbacks_and_refusals(hub, node, caplog):
    offer = hub.offer(8, node=7, records={GLOBAL_STEP: block(8)}, upload_max_size=10**6)
    node.upload(offer, payloads(block(9)))  # never claimed: the reply did not come
    with caplog.at_level(logging.WARNING, logger="parablock_flwr.transport.server_side"):
        hub.fell_back(9, "the stream at x:1 did not connect within 5 s")
        hub.fell_back(9, "again")
    assert sum("node 9 uses Flower's path" in r.message for r in caplog.records) == 1  # logged once per node
    assert hub.end_round(8) == {"direct_fallbacks": 2, "direct_refusals": 0, **NOTHING_AHEAD}
    assert hub.end_round(9) == {"direct_fallbacks": 0, "direct_refusals": 0, **NOTHING_AHEAD}  # counts are per round
    assert len(hub.server.inbox) == 0 and hub.server.outbox.get(offer.records[0].name) is None
    with pytest.raises(StreamUnusable, match="refused late: round 8 of run"):
        node.fetch(offer)  # the round's capabilities have ended: a slow node's request, not a forged one


def test_a_capability_expires_with_the_rounds_timeout(tls, node):
    with RunTransport(settings(tls), RUN, ttl_s=0.3, limits=LIMITS) as short:
        offer = short.offer(1, node=7, records={GLOBAL_STEP: block(1)}, upload_max_size=None)
        import time

        time.sleep(0.4)
        with pytest.raises(StreamUnusable, match="refused expired"):
            node.fetch(offer)


# ---------------------------------------------------------------- a node that cannot use the stream


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_an_address_that_does_not_answer_is_one_line_and_not_dialled_again_for_a_while(hub):
    clock = Clock()
    wrong = NodeTransport(SiteStream(f"localhost:{free_port()}"), connect_timeout_s=0.5, retry_after_s=60, clock=clock)
    offer = hub.offer(1, node=7, records={GLOBAL_STEP: block(1)}, upload_max_size=10**6)
    with pytest.raises(StreamUnusable, match=r"failed: UNAVAILABLE") as err:
        wrong.upload(offer, payloads(block(2)))
    assert "\n" not in str(err.value) and offer.upload_token not in str(err.value)
    clock.now = 59.0
    with pytest.raises(StreamUnusable, match="not dialled again"):
        wrong.fetch(offer)
    clock.now = 61.0
    wrong.site = SiteStream()  # the site fixed its address: dialled again, and it works
    assert wrong.fetch(offer)[GLOBAL_STEP]
    wrong.close()


def test_a_node_trusts_only_the_ca_in_the_message(hub, tmp_path):
    other = make_tls(tmp_path).ca_cert.read_text()
    offer = hub.offer(1, node=7, records={GLOBAL_STEP: block(1)}, upload_max_size=None)
    stranger = NodeTransport(connect_timeout_s=0.5)
    with pytest.raises(StreamUnusable, match="UNAVAILABLE"):
        stranger.fetch(dataclasses.replace(offer, ca_pem=other))
    stranger.close()


def test_a_site_trusts_its_own_ca_and_refuses_plaintext_whatever_the_message_says(hub, tls, tmp_path):
    """A site's node config (``transport-ca``, ``transport-require-tls``) outranks the run's message: a message
    naming another CA is still checked against the site's own, and a plaintext offer is refused in one line."""
    offer = hub.offer(1, node=7, records={GLOBAL_STEP: block(1)}, upload_max_size=None)
    other_ca = make_tls(tmp_path).ca_cert
    other = other_ca.read_text()  # what a forged or mistaken message could name
    site = NodeTransport(SiteStream(ca=str(tls.ca_cert), require_tls=True), connect_timeout_s=0.5)
    assert site.fetch(dataclasses.replace(offer, ca_pem=other))[GLOBAL_STEP]
    with pytest.raises(StreamUnusable, match="plaintext stream; this site's node config requires TLS"):
        site.fetch(dataclasses.replace(offer, insecure=True, ca_pem=""))
    wrong = NodeTransport(SiteStream(ca=str(other_ca)), connect_timeout_s=0.5)
    with pytest.raises(StreamUnusable, match="UNAVAILABLE"):
        wrong.fetch(offer)
    unreadable = NodeTransport(SiteStream(certfile=str(tmp_path / "gone.pem"), keyfile=str(tmp_path / "gone.key")))
    with pytest.raises(StreamUnusable, match="this site's stream settings: cannot read .*gone.pem"):
        unreadable.fetch(offer)  # the worker's user cannot read it (or it was rotated away): Flower's path
    site.close(), wrong.close(), unreadable.close()


def test_plaintext_only_when_the_run_says_insecure(node):
    with RunTransport(StreamSettings("localhost:0", insecure=True), RUN, TTL, LIMITS) as plain:
        offer = plain.offer(1, node=7, records={GLOBAL_STEP: block(1)}, upload_max_size=None)
        assert offer.insecure and offer.ca_pem == ""
        assert node.fetch(offer)[GLOBAL_STEP]


@pytest.mark.parametrize("key", ["certfile", "keyfile", "ca"])
def test_a_missing_tls_file_stops_the_service_before_the_run_in_one_line(tls, key):
    bad = dataclasses.replace(settings(tls), **{key: "/nonexistent/x.pem"})
    with pytest.raises(TransportSetupError, match=f"transport-{key}='/nonexistent/x.pem': no such file"):
        RunTransport(bad, RUN, TTL)


# ---------------------------------------------------------------- the offer crosses Flower and the worker's frame


def test_an_offer_reads_back_through_a_config_record_and_a_json_frame(hub):
    offer = hub.offer(3, node=2**64 - 1, records={GLOBAL_STEP: block(1), CATCH_UP: block(2)}, upload_max_size=99)
    assert TransportOffer.from_config(dict(ConfigRecord(offer.to_config()))) == offer
    assert TransportOffer.from_config(json.loads(json.dumps(offer.to_config()))) == offer
    commit = UpdateCommit(12, "ab" * 32)
    assert UpdateCommit.from_config(json.loads(json.dumps(commit.to_config()))) == commit


def test_framing_refuses_what_is_not_a_framed_record():
    good = frame(payloads(block(1)))
    assert unframe(good, "x").keys() == {"values", "layout", "scales"}
    for bad, says in [
        (b"\x00\x00", "shorter than its index"),
        (b"\x00\x01\x00\x00" + b"x" * 10, "an index of 65536 bytes"),
        (good + b"!", "its index accounts for"),
        (b"\x00\x00\x00\x0c" + b'[["v",3]]   ' + b"abc", "unreadable array x/v"),
        (b"\x00\x00\x00\x0b" + b'[["v",-1]]\x20', r"expected \[array name, bytes\]"),
    ]:
        with pytest.raises(FramingError, match=says):
            unframe(bad, "x")
    assert record_arrays(block(1)).keys() == arrays(good, "x").keys()


# ---------------------------------------------------------------- the run's side around Flower's messages


def flower_message(node_id: int, content: RecordDict) -> Message:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = RUN, 5, 0
    return Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN)


def reply_to(msg: Message, content: RecordDict | None = None, error: str = "") -> Message:
    TaskIdentity.node_id = msg.metadata.dst_node_id
    if error:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=error), reply_to=msg)
    return Message(content=content, reply_to=msg)


def round_message(node_id: int, step, sync=None) -> Message:
    content = RecordDict({GLOBAL_STEP: step, "round": ConfigRecord({"x": 1})})
    if sync is not None:
        content[SYNC_VALUES] = sync
    return flower_message(node_id, content)


UPDATE_TENSORS = {"layers.0.w": (64, 48), "layers.0.b": (48,)}


def update_metrics(**extra) -> MetricRecord:
    metrics = TrainMetrics(server_round=4, block=0, partition_id=0, base_version=2, num_examples=8.0,
                           train_loss=0.5, compute_s=1.0, **extra)  # fmt: skip
    return MetricRecord(metrics_to_record(metrics))


def test_a_message_and_its_reply_through_the_stream_are_what_flowers_path_carries(hub, node):
    direct, step, sync = DirectChannel(hub), block(21, "bf16"), block(22, "bf16")
    msg = round_message(7, step, sync)
    before = array_bytes(msg.content)
    direct.message_on_stream(msg, 4, upload_max_size=update_bound(64 * 48 + 48, 2))
    assert array_bytes(msg.content) == 0 and set(msg.content.config_records) == {"round", OFFER}
    offer = TransportOffer.from_config(dict(msg.content[OFFER]))
    fetched = node.fetch_arrays(offer)
    assert sum(len(p) for p in payloads(step).values()) + sum(len(p) for p in payloads(sync).values()) == before
    for name, record in ((GLOBAL_STEP, step), (SYNC_VALUES, sync)):
        for array, payload in payloads(record).items():
            got, sent = fetched[relay_name(name, array)], npy_view(payload, array)
            assert got.dtype == sent.dtype and np.array_equal(got, sent)
    # The node trains and uploads; its reply commits the update.
    update = to_record({n: torch.randn(s, generator=torch.Generator().manual_seed(3)) for n, s in
                        UPDATE_TENSORS.items()}, "bf16")  # fmt: skip
    commit = node.upload(offer, payloads(update))
    reply = reply_to(msg, RecordDict({METRICS: update_metrics(), COMMIT: ConfigRecord(commit.to_config())}))
    taken = direct.incoming(reply, 4, 7)
    assert taken is reply and COMMIT not in reply.content.config_records
    assert payloads(reply.content[UPDATE]) == payloads(update)  # the Array payloads Flower's path carries
    expected = Expected(4, 0, UPDATE_TENSORS, 100.0, transfer_dtype="bf16")
    checked = parse_reply(reply, expected, 7)  # the reply checks, unchanged
    assert all(torch.equal(checked.update[n], t) for n, t in to_tensors(update).items())
    assert direct.end_round(4) == {"direct_fallbacks": 0, "direct_refusals": 0, **NOTHING_AHEAD}


def test_a_reply_whose_commit_does_not_match_the_upload_is_rejected_with_the_refusal(hub, node):
    direct = DirectChannel(hub)
    msg = direct.message_on_stream(round_message(7, block(1)), 4, upload_max_size=10**6)
    offer = TransportOffer.from_config(dict(msg.content[OFFER]))
    commit = node.upload(offer, payloads(block(2)))
    forged = ConfigRecord(dataclasses.replace(commit, update_sha256="e" * 64).to_config())
    expected = Expected(4, 0, UPDATE_TENSORS, 100.0)

    def rejection(content: RecordDict, server_round: int = 4) -> str:
        """What the reply checks say of the reply ``incoming`` hands on."""
        reply = direct.incoming(reply_to(msg, content), server_round, 7)
        assert reply.metadata.reply_to_message_id == msg.metadata.message_id  # it answers the same message
        return parse_reply(reply, expected, 7)

    why = rejection(RecordDict({METRICS: update_metrics(), COMMIT: forged}))
    assert why.startswith("client error: direct transport: refused digest_mismatch: node 7 round 4"), why
    never = RecordDict({METRICS: update_metrics(), COMMIT: ConfigRecord(commit.to_config())})
    assert rejection(never, 5).startswith("client error: direct transport: its update (")  # none in round 5
    malformed = RecordDict({METRICS: update_metrics(), COMMIT: ConfigRecord({"update-size": -1})})
    assert rejection(malformed).startswith("client error: direct transport: update commit: ")
    assert direct.end_round(4)["direct_refused_digest_mismatch"] == 1


def test_a_node_that_falls_back_gets_its_records_inline_until_it_commits_on_the_stream_again(hub, node):
    direct, step = DirectChannel(hub), block(1)
    first = direct.message_on_stream(round_message(7, step), 4, upload_max_size=10**6)
    inline = RecordDict({METRICS: update_metrics(direct_fallbacks=1), UPDATE: block(2)})
    assert direct.incoming(reply_to(first, inline), 4, 7).content[UPDATE] is inline[UPDATE]  # as it came
    again = direct.message_on_stream(round_message(7, step), 5, upload_max_size=10**6)
    assert GLOBAL_STEP in again.content.array_records  # inline now ...
    offer = TransportOffer.from_config(dict(again.content[OFFER]))
    assert offer.records == () and offer.upload_token  # ... with an upload capability still
    commit = node.upload(offer, payloads(block(3)))
    committed = RecordDict({METRICS: update_metrics(), COMMIT: ConfigRecord(commit.to_config())})
    assert UPDATE in direct.incoming(reply_to(again, committed), 5, 7).content.array_records
    assert GLOBAL_STEP not in direct.message_on_stream(round_message(7, step), 6, 10**6).content.array_records  # back
    lost = direct.message_on_stream(round_message(8, step), 6, 10**6)
    direct.incoming(reply_to(lost, error=f"state-intact: node worker failed: {STREAM_UNUSABLE}x"), 6, 8)
    assert GLOBAL_STEP in direct.message_on_stream(round_message(8, step), 7, 10**6).content.array_records
    assert direct.end_round(4)["direct_fallbacks"] == 2  # node 7 in round 4, node 8 in round 6


# ---------------------------------------------------------------- one round ahead


def ahead_offer(hub, server_round: int, node: int, records=None):
    """Round r's offer with round r+1's capabilities (an update of at most 10**6 bytes, a step of 10**6)."""
    return hub.offer(server_round, node, records or {}, upload_max_size=10**6, ahead=(10**6, 10**6))


def test_capabilities_issued_ahead_are_bound_to_the_next_round_its_slot_and_used_once(hub, node):
    offer = ahead_offer(hub, 3, 7)
    assert (offer.ahead_upload_name, offer.ahead_step_name) == (hub.upload_name(4, 7), hub.step_name(4))
    update = payloads(block(20))
    # Bound to round r+1: presented as round r's own upload capability, it is refused.
    with pytest.raises(StreamUnusable, match="refused bad_capability"):
        node.upload(dataclasses.replace(offer, upload_token=offer.ahead_upload_token), update)
    # Bound to its node: node 8 presenting node 7's capability is refused.
    with pytest.raises(StreamUnusable, match="refused foreign_record"):
        node.upload_ahead(dataclasses.replace(offer, node_id=8), pack_pieces(to_tensors(block(20))))
    # Bounded by round r+1's block: a larger declaration is refused before any byte is read.
    with pytest.raises(StreamUnusable, match="refused oversized"):
        node.upload_ahead(dataclasses.replace(offer, ahead_upload_max_size=2 * 10**6), {"w": [np.zeros(150_000)]})
    pieces = pack_pieces(to_tensors(block(20)), "int8")
    commit = node.upload_ahead(offer, pieces)
    with pytest.raises(StreamUnusable, match="refused replayed"):  # single use
        node.upload_ahead(offer, pieces)
    assert hub.end_round(3)["direct_refusals"] == 4  # the refusals, counted in round r ...
    # ... whose end keeps round r+1's upload: round r+1's reply claims it, from round r+1's own slot.
    claimed = hub.claim(4, 7, commit)
    assert {k: bytes(v) for k, v in claimed.items()} == payloads(pieces_record(pieces))


def test_at_most_half_the_services_workers_wait_ahead_for_a_step_and_the_others_fetch_it_on_arrival(hub):
    """A download issued ahead holds one of the service's workers until the step is out: past half of them
    a node gets no step capability ahead (its upload ahead still), so that the round's own uploads and
    fetches always find a worker; a retried message gets no second one (a node that never replies would
    hold more workers with each retry)."""
    half = hub.server.max_workers // 2
    offers = [ahead_offer(hub, 3, n) for n in range(half + 2)]
    assert [bool(o.ahead_step_name) for o in offers] == [True] * half + [False] * 2
    assert all(o.ahead_upload_name == hub.upload_name(4, i) for i, o in enumerate(offers))
    retried = ahead_offer(hub, 3, 0)
    assert retried.ahead_step_name == "" and retried.ahead_upload_name == hub.upload_name(4, 0)
    assert all(ahead_offer(hub, 4, n).ahead_step_name for n in range(half))  # the next round's budget is its own


def test_capabilities_issued_ahead_expire_when_the_next_round_may_end(tls, node):
    now = [0.0]
    registry = CapabilityRegistry(clock=lambda: now[0])
    with RunTransport(settings(tls), RUN, TTL, LIMITS, registry=registry) as hub:
        offer, late = ahead_offer(hub, 3, 7), ahead_offer(hub, 3, 8)
        now[0] = 1.5 * TTL  # round r's own capabilities have expired; those for round r+1 hold
        with pytest.raises(StreamUnusable, match="refused expired"):
            node.upload(offer, payloads(block(21)))
        assert node.upload_ahead(offer, pack_pieces(to_tensors(block(21)))).update_size > 0
        now[0] = 2 * TTL  # round r+1's timeout after round r's: expired
        with pytest.raises(StreamUnusable, match="refused expired"):
            node.upload_ahead(late, pack_pieces(to_tensors(block(21))))
        hub.end_round(4)  # round r+1 ended: late, whatever its expiry
        with pytest.raises(StreamUnusable, match="refused late: round 4 of run"):
            node.upload_ahead(late, pack_pieces(to_tensors(block(21))))


def test_a_download_issued_ahead_waits_for_its_step_and_a_revocation_ends_it_uncounted(hub, node):
    """Round 3's messages give nodes 7 and 8 round 4's step ahead; both wait. Round 4's messages are built for
    node 7 only: the step is published with the first, node 8's capability is revoked when all are built and
    its wait ends without the step, counted apart from the refusals; node 7 then gets the step, which is the
    record round 4's offer announces."""
    offers = {n: ahead_offer(hub, 3, n) for n in (7, 8)}
    with ThreadPoolExecutor(2) as pool:
        waiting = {n: pool.submit(node.prefetch, offer) for n, offer in offers.items()}
        time.sleep(0.5)
        assert not any(f.done() for f in waiting.values())  # nothing published yet: waiting, not refused
        round4 = hub.offer(4, 7, {GLOBAL_STEP: block(22)}, upload_max_size=10**6)
        time.sleep(0.5)
        assert not any(f.done() for f in waiting.values())  # published, held until the round's messages are built
        assert hub.messaged(4, {7}) == 1
        with pytest.raises(StreamUnusable, match="not published before its capability ended"):
            waiting[8].result(timeout=30)
        prefetched = waiting[7].result(timeout=30)
        assert round4.records[0].name == hub.step_name(4) and prefetched.matches(round4.records[0])
    assert hub.server.waits_ended == 1
    record = hub.end_round(4)
    assert (record["direct_ahead_revoked"], record["direct_refusals"]) == (1, 0), record


def test_a_download_issued_ahead_that_starts_after_its_step_is_published_still_waits_for_the_release(hub, node):
    """Between the step's publication (round 4's first message) and the release (all of round 4's messages
    built), a node issued the step ahead that starts its download only then (its reply of round 3 was
    late) waits like the others: revoked, it never gets the step; a round-4 download capability does."""
    offers = {n: ahead_offer(hub, 3, n) for n in (7, 8)}
    round4 = hub.offer(4, 7, {GLOBAL_STEP: block(22)}, upload_max_size=10**6)  # published, held
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(node.prefetch, offers[8])
        time.sleep(0.5)
        assert not late.done()
        hub.messaged(4, {7})
        with pytest.raises(StreamUnusable, match="not published before its capability ended"):
            late.result(timeout=30)
    assert len(node.fetch(round4)[GLOBAL_STEP]) > 0  # the round's own capability: no hold for it


def test_an_update_computed_ahead_under_a_revoked_capability_is_turned_away_uncounted(hub, node):
    """Round 3's messages give nodes 7 and 8 round 4's upload ahead; round 4's messages are built for node 7
    only, so node 8's capabilities are revoked. Its worker, which trains round 4 ahead all the same, then
    uploads: turned away in one line that says why, counted as the revocation (``direct_ahead_revoked``)
    and not as a refusal (nothing was attempted against the rules, as a partial participation does every
    round), its capability staying revoked; nothing lands in round 4's slot. A forged capability for the
    same slot is still refused as before."""
    offers = {n: ahead_offer(hub, 3, n) for n in (7, 8)}
    hub.offer(4, 7, {GLOBAL_STEP: block(22)}, upload_max_size=10**6)
    assert hub.messaged(4, {7}) == 1
    pieces = pack_pieces(to_tensors(block(21)))
    for _ in range(2):
        with pytest.raises(StreamUnusable, match=r"NOT_FOUND: .*round 4.* revoked") as turned_away:
            node.upload_ahead(offers[8], pieces)
        assert "\n" not in str(turned_away.value) and offers[8].ahead_upload_token not in str(turned_away.value)
    assert hub.server.revoked_used == 2 and len(hub.server.inbox) == 0
    with pytest.raises(StreamUnusable, match="refused bad_capability"):
        node.upload_ahead(dataclasses.replace(offers[8], ahead_upload_token="ab" * 32), pieces)
    record = hub.end_round(4)
    assert (record["direct_ahead_revoked"], record["direct_refusals"], record["direct_revoked_used"]) == (1, 1, 2)
    # A worker that finishes its computation ahead after round 4 ended: still turned away, not refused.
    with pytest.raises(StreamUnusable, match=r"NOT_FOUND: .*round 4.* revoked"):
        node.upload_ahead(offers[8], pieces)
    record = hub.end_round(5)
    assert (record["direct_refusals"], record["direct_revoked_used"]) == (0, 1), record


def test_a_prefetched_step_is_used_only_when_the_message_announces_its_size_and_sha256(hub, node):
    prefetch = ahead_offer(hub, 3, 7)
    step = block(23)
    round4 = hub.offer(4, 7, {GLOBAL_STEP: step}, upload_max_size=10**6)
    hub.messaged(4, {7})
    right = node.prefetch(prefetch)
    assert right.matches(round4.records[0])
    wrong = Prefetched(right.name, bytearray(right.data), "0" * 64)  # bytes whose SHA-256 is not the message's
    assert not wrong.matches(round4.records[0])
    # The wrong one is not used: the record comes from the stream (its capability is spent) ...
    fetched = node.fetch(round4, wrong)
    assert {k: bytes(v) for k, v in fetched[GLOBAL_STEP].items()} == payloads(step)
    with pytest.raises(StreamUnusable, match="refused replayed"):
        node.fetch(round4)
    # ... the right one is: round 4's capability stays unused.
    again = hub.offer(4, 7, {GLOBAL_STEP: step}, upload_max_size=10**6)
    assert {k: bytes(v) for k, v in node.fetch(again, right)[GLOBAL_STEP].items()} == payloads(step)
    assert node.fetch(again)[GLOBAL_STEP]  # its capability was not used by the fetch above


def test_around_flowers_messages_a_node_on_the_stream_moves_its_next_round_ahead_and_it_is_counted(hub, node):
    """Round 4's messages carry round 5's capabilities to a node on the stream (none to a node on Flower's
    path); the update uploaded ahead is claimed by round 5's reply, and the round's record counts it."""
    direct = DirectChannel(hub)
    direct.on_stream[8] = False  # node 8 fell back earlier
    to7 = direct.message_on_stream(round_message(7, block(1)), 4, upload_max_size=10**6, ahead=(10**6, 10**6))
    to8 = direct.message_on_stream(round_message(8, block(1)), 4, upload_max_size=10**6, ahead=(10**6, 10**6))
    offer7, offer8 = (TransportOffer.from_config(dict(m.content[OFFER])) for m in (to7, to8))
    assert offer7.ahead_upload_token and offer7.ahead_step_token and not offer8.ahead_upload_name
    pieces = pack_pieces({n: torch.ones(s) for n, s in UPDATE_TENSORS.items()}, "int8")
    commit = node.upload_ahead(offer7, pieces)
    direct.end_round(4)
    msg = direct.message_on_stream(round_message(7, block(2)), 5, upload_max_size=10**6)
    direct.transport.messaged(5, {7, 8})
    metrics = update_metrics(direct_update_ahead=1, direct_step_prefetched=1)
    reply = direct.incoming(reply_to(msg, RecordDict({METRICS: metrics, COMMIT: ConfigRecord(commit.to_config())})),
                            5, 7)  # fmt: skip
    assert payloads(reply.content[UPDATE]) == payloads(pieces_record(pieces))
    record = direct.end_round(5)
    assert (record["direct_updates_ahead"], record["direct_steps_prefetched"], record["direct_ahead_revoked"]) == (
        1, 1, 0)  # fmt: skip


def test_a_transfer_ahead_that_finds_no_server_does_not_keep_the_next_message_off_the_stream(hub):
    """A server killed while a node's download ahead waited, and resumed at the same address: the failure
    ahead says nothing of the next run, so the next message's records are dialled for at once (only a
    failure of a message's own transfer keeps the address off the stream for ``retry_after_s``)."""
    wrong = f"localhost:{free_port()}"  # nothing answers there
    offer = dataclasses.replace(ahead_offer(hub, 3, 7, {GLOBAL_STEP: block(24)}), address=wrong)
    side = NodeTransport(connect_timeout_s=0.5, timeout_s=10)
    try:
        for moved_ahead in (lambda: side.prefetch(offer), lambda: side.upload_ahead(offer, {"w": [np.zeros(3)]})):
            with pytest.raises(StreamUnusable, match="UNAVAILABLE"):
                moved_ahead()
        with pytest.raises(StreamUnusable) as first:
            side.fetch(offer)  # dialled: the failures ahead did not mark the address
        assert "not dialled again" not in str(first.value)
        with pytest.raises(StreamUnusable, match="not dialled again"):
            side.fetch(offer)  # the message's own failure did
    finally:
        side.close()


def test_a_server_that_dies_during_a_nodes_transfer_is_dialled_again_at_once(hub, monkeypatch):
    """The server is stopped (killed, in a deployment) during a node's ordinary upload: the call fails, but the
    address was reached, so the node does not keep it off the stream for ``retry_after_s`` (a resumed server at
    the same address within the minute would lose its first round, the one carrying hand-backs and syncs); only
    a failure to connect at all does."""
    from parablock_flwr.transport import node_side

    midway, go_on = threading.Event(), threading.Event()

    class Held(Buffers):  # the update's bytes, held after their first chunk until the server is gone
        def chunks(self, size):
            parts = super().chunks(size)
            yield next(parts)
            midway.set()
            go_on.wait(10)
            yield from parts

    framed_before = node_side.framed
    monkeypatch.setattr(node_side, "framed", lambda payloads: Held([b"".join(framed_before(payloads).chunks(2**30))]))
    offer = hub.offer(1, node=7, records={GLOBAL_STEP: block(1)}, upload_max_size=10**7)
    side, failed = NodeTransport(connect_timeout_s=0.5, timeout_s=10), {}
    uploading = threading.Thread(target=lambda: failed.update(err=pytest.raises(StreamUnusable, side.upload, offer,
                                                                                   payloads(block(24)))))  # fmt: skip
    try:
        uploading.start()
        assert midway.wait(10)
        hub.server.stop(0)
        go_on.set()
        uploading.join(20)
        # The call in flight ends UNAVAILABLE, or CANCELLED when the server's stop wins the race (a loaded
        # machine): either way the address was reached, not a failure to connect.
        why = str(failed["err"].value)
        assert ("UNAVAILABLE" in why or "CANCELLED" in why) and "failed to connect" not in why, why
        with pytest.raises(StreamUnusable) as next_call:
            side.fetch(offer)  # dialled at once: nothing answers now, and that failure to connect is what marks it
        assert "failed to connect" in str(next_call.value) and "not dialled again" not in str(next_call.value)
        with pytest.raises(StreamUnusable, match="not dialled again"):
            side.fetch(offer)
    finally:
        go_on.set()
        side.close()


def test_a_message_pushed_ahead_carries_its_content_sealed_and_is_withdrawn_when_it_cannot_be_used(hub, node):
    """Round 4's messages pushed ahead to nodes 7, 8 and 9 (each waiting on the stream for its content): node
    7's message is built and published, sealed with the key its message pushed ahead gave it (an altered byte,
    or another key, is refused); node 8's was pushed ahead so long ago (round 3 ran long) that it would expire
    before round 4 may end, and node 9's message carries its tensors inline (it fell back): both go on
    Flower's path, their messages pushed ahead are withdrawn and their ids handed to the run, whose replies it
    drops; each count is in the round's record."""
    from parablock_flwr.messages import MESSAGE_AHEAD, MessageError
    from parablock_flwr.transport.framing import unseal
    from parablock_flwr.transport.message_bytes import content_from_bytes

    flower_message(0, RecordDict())  # Flower's task identity, as in a ServerApp
    direct = DirectChannel(hub)
    direct.committed.update({7, 8, 9})
    ahead = {n: direct.message_ahead(4, n) for n in (7, 8, 9)}
    offers = {n: TransportOffer.from_config(dict(m.content[MESSAGE_AHEAD])) for n, m in ahead.items()}
    for n in ahead:
        direct.pushed(4, n, f"m{n}")
    direct.pushed_ahead[4][8] = ("m8", time.monotonic() + 0.5 * hub.ttl_s)
    built = {n: flower_message(n, RecordDict({"round": ConfigRecord({"server-round": 4, "n": n})})) for n in (7, 8, 9)}
    built[9].content[GLOBAL_STEP] = to_record({"w": torch.ones(3)})
    with ThreadPoolExecutor(3) as pool:
        waits = {n: pool.submit(node.message_content, offer) for n, offer in offers.items()}
        time.sleep(0.3)
        assert not any(w.done() for w in waits.values())  # waiting for the content, not refused
        assert [direct.deliver(built[n], 4) for n in (7, 8, 9)] == ["m7", None, None]
        assert direct.withdraw(4) == {"m8": 8, "m9": 9}
        sealed = waits[7].result(timeout=30)
        assert [waits[n].result(timeout=30) for n in (8, 9)] == [None, None]
    content = content_from_bytes(unseal(bytes.fromhex(offers[7].message_key), sealed))
    assert dict(content["round"]) == {"server-round": 4, "n": 7}
    for key, data in ((offers[7].message_key, sealed[:-1] + bytes([sealed[-1] ^ 1])), (offers[8].message_key, sealed)):
        with pytest.raises(MessageError, match="its HMAC is not the one the message's key gives"):
            unseal(bytes.fromhex(key), data)
    record = hub.end_round(4)
    counts = (record["direct_messages_ahead"], record["direct_messages_withdrawn"], record["direct_refusals"])
    assert counts == (1, 2, 0)
    assert not any(hub.server.outbox.get(hub.message_name(4, n)) for n in (7, 8, 9))  # forgotten with the round


def test_a_workers_capability_for_the_next_rounds_content_shares_its_messages_slot_and_key_and_ends_with_it(hub, node):
    """Round 3's message to a node whose last reply committed on the stream gives its worker a capability for
    round 4's content (none to a node that has not committed yet), bound to round 4 and that node's content,
    waiting until it is published. Round 4's message pushed ahead names the same content under the same key,
    in the same waiting slot. When the content is published both read it, once each; a node whose round-4
    message goes on Flower's path after all has its worker's wait ended with nothing."""
    from parablock_flwr.messages import MESSAGE_AHEAD, PROTOCOL_KEY
    from parablock_flwr.transport.message_bytes import content_ahead
    from parablock_flwr.versions import PROTOCOL_VERSION

    flower_message(0, RecordDict())  # Flower's task identity, as in a ServerApp
    direct = DirectChannel(hub)
    direct.committed.update({7, 8})
    offers = {}
    for n in (7, 8, 10):
        msg = direct.message_on_stream(
            flower_message(n, RecordDict()), 3, 10**6, ahead=(10**6, 10**6), messages_ahead=True
        )
        offers[n] = TransportOffer.from_config(dict(msg.content[OFFER]))
    assert [offers[n].ahead_message_name for n in (7, 8, 10)] == [hub.message_name(4, 7), hub.message_name(4, 8), ""]
    views = {n: dataclasses.replace(offers[n], server_round=4, message_name=offers[n].ahead_message_name,
                                    message_token=offers[n].ahead_message_token, message_max_size=2**20,
                                    message_key=offers[n].ahead_message_key) for n in (7, 8)}  # fmt: skip
    waiting = len(hub._waiting_messages[4])
    pushed = TransportOffer.from_config(dict(direct.message_ahead(4, 7).content[MESSAGE_AHEAD]))
    assert (pushed.message_name, pushed.message_key) == (views[7].message_name, views[7].message_key)
    assert pushed.message_token != views[7].message_token and len(hub._waiting_messages[4]) == waiting == 2
    direct.pushed(4, 7, "m7")  # node 8's message pushed ahead was not taken: its round-4 message goes on Flower's
    round_config = ConfigRecord({PROTOCOL_KEY: PROTOCOL_VERSION, "server-round": 4})
    with ThreadPoolExecutor(2) as pool:
        waits = {n: pool.submit(node.message_content, view) for n, view in views.items()}
        time.sleep(0.3)
        assert not any(w.done() for w in waits.values())  # waiting for the content, not refused
        for n in (7, 8):
            offer = hub.offer(4, n, {}, 10**6)
            built = flower_message(n, RecordDict({"round": round_config, OFFER: ConfigRecord(offer.to_config())}))
            assert direct.deliver(built, 4) == ("m7" if n == 7 else None)
        sealed, nothing = waits[7].result(timeout=30), waits[8].result(timeout=30)
    assert nothing is None
    assert dict(content_ahead(views[7], sealed)["round"]) == dict(round_config)
    assert node.message_content(pushed) == sealed  # the message's own capability reads the same content
    with pytest.raises(StreamUnusable, match="replayed"):
        node.message_content(views[7])  # each capability once
    record = hub.end_round(4)  # node 8's worker's wait ended: no message pushed ahead was withdrawn
    assert (record["direct_messages_ahead"], record["direct_messages_withdrawn"]) == (1, 0)


def test_a_retried_messages_reply_has_a_slot_of_its_own_and_a_node_behind_on_its_audits_gets_nothing_ahead(
    hub, node
):  # fmt: skip
    """``transport-replies-on-stream``: a round re-sent to a node is its second message of the round, whose reply
    has its own slot on the stream: the first message's reply, come late, is never taken for the retry's. And a
    node whose replies taken from the stream wait for more than ``AUDITS_BEHIND`` audits (Flower's cycle slower
    than the rounds) gets no capability for its next content and no message a round ahead."""
    from parablock_flwr.transport.direct_channel import AUDITS_BEHIND, Audit
    from parablock_flwr.transport.message_bytes import reply_content, reply_to_bytes

    direct = DirectChannel(hub, replies_on_stream=True)
    messages = [direct.message_on_stream(round_message(7, block(1)), 4, 10**6) for _ in range(2)]
    offers = [TransportOffer.from_config(dict(msg.content[OFFER])) for msg in messages]
    assert offers[0].reply_name != offers[1].reply_name
    commit = node.upload(offers[0], payloads(block(2)))
    node.upload_reply(offers[0], reply_to_bytes(reply_content(dict(update_metrics()), {}, commit.to_config())))
    assert direct.replies_from_stream(4, {"retry": 7}) == []  # the late first reply is not the retry's
    assert hub.take_reply(4, 7, 1) is not None
    direct.committed.add(7)
    ahead = (10**6, 10**6)
    for behind in range(AUDITS_BEHIND + 2):
        msg = direct.message_on_stream(round_message(7, block(1)), 5 + behind, 10**6, ahead, messages_ahead=True)
        offer = TransportOffer.from_config(dict(msg.content[OFFER]))
        late = behind > AUDITS_BEHIND
        assert bool(offer.ahead_message_name) is not late, behind
        assert (direct.message_ahead(6 + behind, 7) is None) is late, behind
        direct.audits[f"m{behind}"] = Audit(7, "0" * 64, float("inf"))

"""The direct transport's stream service and its security rules (parablock_flwr/transport).

Capability and header rules are tested without processes; the service over loopback with a real
gRPC server and client, TLS with a CA and certificate made here. Each refusal is checked three ways:
the caller gets its kind, the server counts it, and nothing else changed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parablock_flwr.kept_blocks import KEPT, KEPT_FROM_BYTES
from parablock_flwr.tools.credentials import make_client_cert, make_tls
from parablock_flwr.transport import (
    CapabilityRegistry,
    Direction,
    Limits,
    RefusalKind,
    Refused,
    Ticket,
    TransportClient,
    TransportError,
    TransportServer,
)
from parablock_flwr.transport.capabilities import EXPIRED_KEPT_S, Refusals
from parablock_flwr.transport.framing import Buffers, FramingError, frame, payloads, unframe
from parablock_flwr.transport.headers import MAX_HEADER_BYTES, encode_header, parse_header
from parablock_flwr.transport.service import DOWNLOAD, UPLOAD, Inbox, Outbox, contiguous

from helpers import npy_bytes

UP, DOWN = Direction.UPLOAD, Direction.DOWNLOAD


class Clock:
    """A clock the test moves (expiry without sleeping)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def refused_kind(fn) -> RefusalKind:
    with pytest.raises(Refused) as info:
        fn()
    return info.value.kind


# ---------------------------------------------------------------- capabilities, without processes


def test_capabilities_are_256_random_bits_and_distinct():
    reg = CapabilityRegistry()
    tickets = [reg.issue(1, 2, 3, UP, "update/2", ttl_s=10, max_size=10) for _ in range(50)]
    assert all(len(t.token) == 32 for t in tickets)
    assert len({t.token for t in tickets}) == 50


def test_a_capability_is_accepted_once_then_refused_as_replayed():
    reg = CapabilityRegistry()
    t = reg.issue(1, 2, 3, DOWN, "step/3", ttl_s=10)
    assert reg.reserve(t) == t
    assert refused_kind(lambda: reg.reserve(t)) is RefusalKind.REPLAYED  # in use
    reg.finish(t)
    assert refused_kind(lambda: reg.reserve(t)) is RefusalKind.REPLAYED  # spent


def test_a_refused_transfer_leaves_the_capability_usable():
    reg = CapabilityRegistry()
    t = reg.issue(1, 2, 3, UP, "update/2", ttl_s=10, max_size=100)
    assert refused_kind(lambda: reg.reserve(t, size=101)) is RefusalKind.OVERSIZED
    reg.reserve(t, size=100)
    reg.release(t)  # e.g. the bytes did not match their digest
    assert reg.reserve(t, size=100) == t


def test_an_unknown_or_altered_token_is_a_bad_capability():
    reg = CapabilityRegistry()
    t = reg.issue(1, 2, 3, DOWN, "step/3", ttl_s=10)
    flipped = bytes([t.token[0] ^ 1]) + t.token[1:]
    assert refused_kind(lambda: reg.reserve(dataclasses.replace(t, token=flipped))) is RefusalKind.BAD_CAPABILITY
    assert refused_kind(lambda: reg.reserve(dataclasses.replace(t, token=os.urandom(32)))) is RefusalKind.BAD_CAPABILITY


@pytest.mark.parametrize("change", [{"run_id": 9}, {"round": 4}, {"direction": UP}])
def test_a_capability_is_bound_to_its_run_round_and_direction(change):
    reg = CapabilityRegistry()
    t = reg.issue(1, 2, 3, DOWN, "step/3", ttl_s=10)
    assert refused_kind(lambda: reg.reserve(dataclasses.replace(t, **change), size=1)) is RefusalKind.BAD_CAPABILITY
    assert reg.reserve(t) == t  # the refusal changed nothing


@pytest.mark.parametrize("change", [{"node_id": 5}, {"record": "catchup/5"}])
def test_a_node_asking_for_another_nodes_record_is_refused(change):
    reg = CapabilityRegistry()
    t = reg.issue(1, 2, 3, DOWN, "catchup/2", ttl_s=10)
    refused = pytest.raises(Refused, reg.reserve, dataclasses.replace(t, **change)).value
    assert refused.kind is RefusalKind.FOREIGN_RECORD
    assert "\n" not in refused.line() and t.token.hex() not in refused.line()


def test_a_capability_expires_with_the_rounds_timeout():
    clock = Clock()
    reg = CapabilityRegistry(clock)
    t = reg.issue(1, 2, 3, DOWN, "step/3", ttl_s=5)
    clock.now = 4.99
    reg.reserve(t)
    reg.release(t)
    clock.now = 5.0
    assert refused_kind(lambda: reg.reserve(t)) is RefusalKind.EXPIRED


def test_dropping_a_round_ends_its_capabilities_only_and_a_late_request_is_counted_as_late():
    """A request under a capability of a round that has ended is a slow node's, not an attacker's: refused as
    ``late``; a token this server never issued is still a bad capability. The ended ones go with the expired
    ones (``_prune``): the registry does not grow with the rounds."""
    clock = Clock()
    reg = CapabilityRegistry(clock=clock)
    old = reg.issue(1, 2, 3, DOWN, "step/3", ttl_s=10)
    new = reg.issue(1, 2, 4, DOWN, "step/4", ttl_s=10)
    assert reg.drop_round(1, 3) == 1
    assert refused_kind(lambda: reg.reserve(old)) is RefusalKind.LATE and not reg.alive(old)
    assert (
        refused_kind(lambda: reg.reserve(dataclasses.replace(old, token=os.urandom(32)))) is RefusalKind.BAD_CAPABILITY
    )
    assert reg.reserve(new) == new
    clock.now = 10 + EXPIRED_KEPT_S
    reg.issue(1, 2, 5, DOWN, "step/5", ttl_s=10)  # issuing prunes
    assert refused_kind(lambda: reg.reserve(old)) is RefusalKind.BAD_CAPABILITY and len(reg._grants) == 1


def test_an_upload_whose_round_ends_while_it_arrives_is_refused_as_late_and_leaves_nothing_held(server, tls):
    """The round ends (``drop_round`` on the registry and the inbox, as ``RunTransport.end_round`` does) while an
    upload is half sent: its end is refused as ``late``, counted once, and the inbox holds nothing of it, in
    memory or in a file (before, it was filed under its ended round and held for the whole run)."""
    t = server.registry.issue(99, 2, 7, UP, "update/late", ttl_s=30, max_size=2000)  # a run of its own
    midway, go_on, data = threading.Event(), threading.Event(), os.urandom(2000)

    def sends():
        yield encode_header(t, len(data), sha(data))
        yield data[:1000]
        midway.set()
        go_on.wait(10)
        yield data[1000:]

    found = {}
    sender = threading.Thread(target=lambda: found.update(details=raw_upload(server, tls, sends())))
    before = server.refusals.counts().get("late", 0)
    sender.start()
    assert midway.wait(10)
    deadline = time.monotonic() + 10
    while not server.inbox._receiving and time.monotonic() < deadline:  # the service took the header: reserved
        time.sleep(0.01)
    server.registry.drop_round(t.run_id, t.round)
    server.inbox.drop_round(t.run_id, t.round)
    go_on.set()
    sender.join(20)
    assert found["details"].startswith("refused late: round 7 of run 99 ended"), found
    assert server.refusals.counts().get("late", 0) == before + 1
    assert not server.inbox.holds(t.run_id, t.node_id, t.round, t.record) and not server.inbox._receiving
    assert refused_kind(lambda: server.registry.reserve(t, size=10)) is RefusalKind.LATE


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"ttl_s": 0, "max_size": 1}, "ttl_s=0"),
        ({"ttl_s": 1}, "max_size=None"),
        ({"ttl_s": 1, "max_size": -1}, "max_size=-1"),
    ],
)
def test_issue_names_a_bad_argument(kwargs, names):
    with pytest.raises(ValueError, match=names):
        CapabilityRegistry().issue(1, 2, 3, UP, "update/2", **kwargs)


def test_inbox_commits_bytes_only_under_the_replys_digest():
    refusals = Refusals()
    inbox = Inbox(refusals)
    t = Ticket(os.urandom(32), 1, 2, 3, UP, "update/2")
    inbox.put(t, sha(b"abc"), bytearray(b"abc"))
    assert refused_kind(lambda: inbox.claim(1, 2, 3, "update/2", sha(b"abd"))) is RefusalKind.DIGEST_MISMATCH
    assert refusals.counts() == {"digest_mismatch": 1} and len(inbox) == 1  # counted, nothing changed
    assert inbox.claim(1, 2, 3, "update/2", sha(b"abc")) == b"abc"
    assert inbox.claim(1, 2, 3, "update/2", sha(b"abc")) is None  # claimed once; None: fall back


def test_uploads_still_arriving_count_toward_the_inboxs_memory_budget(tmp_path):
    """Uploads that arrive together cannot pass the in-memory budget together: one still being received in
    memory counts from its ``buffer`` on, so the next one past the budget goes to a file, however small; a
    buffer given back (``discard``: its upload refused or broken off) frees its place."""
    from parablock_flwr.transport.service import KeptUpload, SpillFile

    inbox = Inbox(Refusals(), spill_dir=tmp_path, memory_uploads=1)
    tickets = [Ticket(os.urandom(32), 1, 2, 3, UP, f"update/{i}") for i in range(3)]
    first = inbox.buffer(tickets[0], 600)
    assert isinstance(first, KeptUpload)
    second = inbox.buffer(tickets[1], 6)  # the first is still arriving: a second would pass one upload in memory
    assert isinstance(second, SpillFile) and inbox.spilled == 1
    inbox.discard(second)
    inbox.discard(first)
    assert isinstance(inbox.buffer(tickets[2], 600), KeptUpload)
    assert list(tmp_path.iterdir()) == []  # the spilled one was unlinked when created


def test_a_closed_inbox_still_hands_over_what_it_holds_and_what_arrives_late():
    """The service stops (``Inbox.close``) with uploads held and one still arriving: a claim still gets each,
    decoded (the late one decoded as it is put), never a cancelled decoding."""
    inbox = Inbox(Refusals())
    tickets = [Ticket(os.urandom(32), 1, 2, 3, UP, f"update/{i}") for i in range(2)]
    inbox.put(tickets[0], sha(b"abc"), Buffers([b"abc"]))
    late = inbox.buffer(tickets[1], 3)
    inbox.close()
    late.append(b"xyz")
    inbox.put(tickets[1], sha(b"xyz"), late)
    assert inbox.claim(1, 2, 3, "update/0", sha(b"abc")) == b"abc"
    assert inbox.claim(1, 2, 3, "update/1", sha(b"xyz")) == b"xyz"


def cut(data: bytes, points: list[int]) -> Buffers:
    """``data`` as the parts a stream may deliver it in, cut at ``points``."""
    edges = sorted({min(p, len(data)) for p in points} | {0, len(data)})
    return Buffers(data[a:b] for a, b in zip(edges, edges[1:]))


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),  # anything a client may upload
        st.lists(st.binary(max_size=80), max_size=4).map(  # a framed record, any payloads
            lambda vs: frame({f"a{i}": npy_bytes(np.frombuffer(v, np.uint8)) for i, v in enumerate(vs)})
        ),
    ),
    st.lists(st.integers(0, 400), max_size=8),
)
def test_a_record_read_in_the_parts_it_arrived_in_is_the_record_read_whole(data, points):
    """A record read in the parts it arrived in (``framing.payloads`` of ``Buffers``, as a spilled upload is read):
    any bytes, cut anywhere, give the payloads of the same bytes read whole (``unframe``), or the same one-line
    refusal."""
    parts = cut(data, points)
    assert len(parts) == len(data) and parts.tobytes() == data and parts.sha256() == sha(data)
    assert b"".join(parts.chunks(7)) == data and all(len(c) == 7 for c in list(parts.chunks(7))[:-1])
    try:
        whole = {name: bytes(p) for name, p in unframe(data, "r1/update/2").items()}
    except FramingError as err:
        with pytest.raises(FramingError) as refused:
            payloads(parts, "r1/update/2")
        assert str(refused.value) == str(err) and "\n" not in str(err)
        return
    got = payloads(parts, "r1/update/2")
    assert got == whole and all(type(p) is bytes for p in got.values())


def test_a_record_is_published_once_from_bytes_or_a_file(tmp_path):
    outbox = Outbox()
    record = outbox.publish("step/3", data=b"xyz")
    assert (record.size, record.sha256) == (3, sha(b"xyz"))
    with pytest.raises(ValueError, match="already published"):
        outbox.publish("step/3", data=b"other")
    (tmp_path / "f").write_bytes(b"0123456789")
    from_file = outbox.publish("full/3", path=tmp_path / "f")
    assert (from_file.size, from_file.sha256) == (10, sha(b"0123456789"))
    assert b"".join(from_file.chunks(3)) == b"0123456789"
    with pytest.raises(ValueError, match="either data or path"):
        outbox.publish("x", data=b"1", path=tmp_path / "f")


# ---------------------------------------------------------------- headers: what comes off the network

tickets = st.builds(
    Ticket,
    token=st.binary(min_size=32, max_size=32),
    run_id=st.integers(0, 2**64 - 1),
    node_id=st.integers(0, 2**64 - 1),
    round=st.integers(0, 2**64 - 1),
    direction=st.sampled_from(Direction),
    record=st.from_regex(r"[A-Za-z0-9_.:/-]{1,128}", fullmatch=True),
)


@given(tickets, st.integers(0, 2**63 - 1), st.binary(min_size=32, max_size=32))
def test_a_header_reads_back_as_written(ticket, size, digest):
    header = parse_header(encode_header(ticket, size, digest.hex()), ticket.direction)
    assert header.claim == ticket
    if ticket.direction is UP:
        assert (header.size, header.sha256) == (size, digest.hex())


@given(st.binary(max_size=MAX_HEADER_BYTES + 10), st.sampled_from(Direction))
def test_any_bytes_are_a_header_or_one_bad_header_refusal(data, direction):
    try:
        parse_header(data, direction)
    except Refused as refused:
        assert refused.kind is RefusalKind.BAD_HEADER and "\n" not in refused.line()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["token", "run_id", "node_id", "round", "direction", "record", "size", "sha256", "extra"]


@settings(max_examples=300)
@given(tickets, st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4), st.sets(st.sampled_from(FIELDS)))
def test_a_header_with_altered_fields_is_read_strictly(ticket, changes, dropped):
    fields = json.loads(encode_header(ticket, 10, "0" * 64))
    fields = {k: v for k, v in (fields | changes).items() if k not in dropped}
    data = json.dumps(fields).encode()
    try:
        header = parse_header(data, ticket.direction)
    except Refused as refused:
        assert refused.kind is RefusalKind.BAD_HEADER
        assert ticket.token.hex() not in refused.text  # a token is never echoed
        return
    # Accepted: every field is of its type and range.
    assert isinstance(header.claim.run_id, int) and not isinstance(header.claim.run_id, bool)
    assert len(header.claim.token) == 32


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda f: f | {"size": True}, "size=True"),
        (lambda f: f | {"size": -1}, "size=-1"),
        (lambda f: f | {"round": 1.0}, "round=1.0"),
        (lambda f: f | {"record": "../etc/passwd\n"}, "record="),
        (lambda f: f | {"direction": "download"}, "direction"),
        (lambda f: f | {"token": "AB" * 32}, "token=(hidden)"),
        (lambda f: f | {"more": 1}, "fields"),
        (lambda f: f | {"record": "x" * MAX_HEADER_BYTES}, f"at most {MAX_HEADER_BYTES}"),
    ],
)
def test_a_bad_header_is_named_in_one_line(edit, says):
    fields = json.loads(encode_header(Ticket(os.urandom(32), 1, 2, 3, UP, "update/2"), 10, "0" * 64))
    refused = pytest.raises(Refused, parse_header, json.dumps(edit(fields)).encode(), UP).value
    assert refused.kind is RefusalKind.BAD_HEADER and says in refused.text and "\n" not in refused.line()


# ---------------------------------------------------------------- the service over loopback, with TLS

LIMITS = Limits(idle_timeout_s=1.0, min_rate_bytes_s=1e6, grace_s=0.5)


@pytest.fixture(scope="module")
def server(tls):
    srv = TransportServer(address="127.0.0.1:0", cert_file=tls.server_cert, key_file=tls.server_key, limits=LIMITS)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server, tls):
    with TransportClient(f"localhost:{server.port}", ca_file=tls.ca_cert, timeout_s=30) as c:
        yield c


_records = iter(range(10**6))


def upload_ticket(server, max_size, ttl_s=30.0) -> Ticket:
    return server.registry.issue(1, 2, 7, UP, f"update/2/{next(_records)}", ttl_s=ttl_s, max_size=max_size)


def raw_upload(server, tls, messages):
    """An Upload call from a client that sends whatever ``messages`` yields: the status details."""
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca_cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
        call = channel.stream_unary(UPLOAD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            return call(messages, timeout=20).decode()
        except grpc.RpcError as error:
            return error.details()


def expect_refusal(server, kind, fn):
    """``fn`` is refused with ``kind``, counted once, and leaves the inbox as it was."""
    before, held = server.refusals.counts().get(kind, 0), len(server.inbox)
    result = fn()  # the kind the client raised, or a raw call's status details
    if isinstance(result, RefusalKind):
        assert result == kind
    else:
        assert result.startswith(f"refused {kind}: "), result
    assert server.refusals.counts().get(kind, 0) == before + 1
    assert len(server.inbox) == held


def test_random_bytes_round_trip_over_tls(server, client):
    data = os.urandom(9 * 2**20 + 123)  # messages of ``CHUNK_BYTES``, the last one short
    t = upload_ticket(server, len(data))
    digest = client.upload(t, data)
    assert digest == sha(data)
    assert server.inbox.claim(1, 2, 7, t.record, digest) == data
    declared = upload_ticket(server, len(data))  # a digest in the header instead of after the bytes
    assert client.upload(declared, data, digest) == digest
    assert server.inbox.claim(1, 2, 7, declared.record, digest) == data
    record = server.outbox.publish(f"step/{next(_records)}", data=data)
    down = server.registry.issue(1, 2, 7, DOWN, record.name, ttl_s=30)
    assert client.download(down, record.size, record.sha256) == data
    # Fetched a round ahead, its size unknown: the bytes that came, at most the bound, and their digest.
    ahead = server.registry.issue(1, 2, 7, DOWN, record.name, ttl_s=30)
    got, digest = client.download_unannounced(ahead, 2 * len(data))
    assert got == data and digest == sha(data)
    # Received into kept memory of the size expected, and into a growing buffer past it (from the first chunk
    # or from a later one): the same bytes and digest whatever the guess.
    for expected in (len(data), len(data) + 4096, len(data) - 1, 100, 2 * len(data)):
        again = server.registry.issue(1, 2, 7, DOWN, record.name, ttl_s=30)
        taken = KEPT.made + KEPT.reused
        got, digest = client.download_unannounced(again, 2 * len(data), expected)
        assert bytes(got) == data and digest == sha(data), expected
        assert isinstance(got, memoryview) == (expected >= len(data)), expected
        assert KEPT.made + KEPT.reused == taken + (expected >= KEPT_FROM_BYTES), expected  # the pool's, once
    short = server.registry.issue(1, 2, 7, DOWN, record.name, ttl_s=30)
    with pytest.raises(TransportError, match=f"more than the bound of {len(data) - 1} bytes"):
        client.download_unannounced(short, len(data) - 1)


def test_an_earlier_releases_4_mib_messages_are_still_accepted(server, tls):
    """The stream sends 512 KiB messages (``CHUNK_BYTES``, under the mapping threshold) but accepts an earlier
    release's 4 MiB ones: a site's worker and the server may be a release apart."""
    data = os.urandom(4 * 2**20)
    t = upload_ticket(server, len(data))
    assert raw_upload(server, tls, iter([encode_header(t, len(data), sha(data)), data])) == "accepted"
    assert server.inbox.claim(1, 2, 7, t.record, sha(data)) == data


def test_an_upload_is_decoded_as_it_arrives_and_handed_over_only_under_the_replys_digest_and_size(tls):
    """The server reads an upload (``decode``) as soon as it is accepted, before any reply claims it, so that
    the claim finds it ready; the claim still hands it over only under the reply's digest and size (a
    mismatch is refused and counted, and changes nothing), once, and a decoding's failure only then."""
    decoded = threading.Event()

    def decode(data, record):
        out = contiguous(data, record)  # the bytes where they landed (a view of kept memory)
        if bytes(out[:10]) == b"not framed":
            raise FramingError(f"record {record}: not framed")
        decoded.set()
        return out

    srv = TransportServer(address="127.0.0.1:0", cert_file=tls.server_cert, key_file=tls.server_key, decode=decode)
    srv.start()
    try:
        with TransportClient(f"localhost:{srv.port}", ca_file=tls.ca_cert, timeout_s=30) as client:
            data = os.urandom(9 * 2**20 + 5)
            t = srv.registry.issue(1, 2, 7, UP, "update/2", ttl_s=30, max_size=len(data))
            digest = client.upload(t, data)
            assert decoded.wait(10)  # before any claim
            size = len(data)

            def claim(sha256, size=size):
                return lambda: srv.inbox.claim(1, 2, 7, "update/2", sha256, size)

            assert refused_kind(claim(sha(b"other"))) is RefusalKind.DIGEST_MISMATCH
            assert refused_kind(claim(digest, len(data) + 1)) is RefusalKind.SIZE_MISMATCH
            assert srv.refusals.counts() == {"digest_mismatch": 1, "size_mismatch": 1} and len(srv.inbox) == 1
            assert claim(digest)() == data
            assert claim(digest)() is None  # claimed once
            bad = b"not framed, whatever it is"
            t = srv.registry.issue(1, 2, 8, UP, "update/2", ttl_s=30, max_size=len(bad))
            client.upload(t, bad)  # accepted: the digest is the declared one
            with pytest.raises(Refused):  # a reply with another digest: refused as ever, not decoded
                srv.inbox.claim(1, 2, 8, "update/2", sha(b"x"), len(bad))
            with pytest.raises(FramingError, match="not framed"):  # the reply's own digest: the decoding's error
                srv.inbox.claim(1, 2, 8, "update/2", sha(bad), len(bad))
    finally:
        srv.stop()


def test_a_record_published_from_a_file_downloads(server, client, tmp_path):
    data = os.urandom(5 * 2**20)
    (tmp_path / "block.bin").write_bytes(data)
    record = server.outbox.publish(f"full/{next(_records)}", path=tmp_path / "block.bin")
    t = server.registry.issue(1, 3, 7, DOWN, record.name, ttl_s=30)
    assert client.download(t, record.size, record.sha256) == data


def test_tls_is_required_unless_insecure_is_explicit(tls):
    with pytest.raises(ValueError, match="insecure=True"):
        TransportServer()
    with pytest.raises(ValueError, match="insecure=True"):
        TransportClient("localhost:1")
    with pytest.raises(ValueError, match="choose TLS"):
        TransportServer(cert_file=tls.server_cert, key_file=tls.server_key, insecure=True)


def test_plaintext_works_only_when_both_sides_say_insecure(tls):
    srv = TransportServer(address="127.0.0.1:0", insecure=True)
    srv.start()
    try:
        t = srv.registry.issue(1, 2, 7, UP, "update/2", ttl_s=30, max_size=3)
        with TransportClient(f"localhost:{srv.port}", ca_file=tls.ca_cert, timeout_s=5) as tls_client:
            with pytest.raises(TransportError, match="UNAVAILABLE"):  # a TLS client does not drop to plaintext
                tls_client.upload(t, b"abc")
        with TransportClient(f"localhost:{srv.port}", insecure=True, timeout_s=5) as plain:
            assert plain.upload(t, b"abc") == sha(b"abc")
    finally:
        srv.stop()


def test_a_client_refuses_a_server_its_ca_did_not_sign(server, tmp_path):
    other = make_tls(tmp_path)
    with TransportClient(f"localhost:{server.port}", ca_file=other.ca_cert, timeout_s=5) as stranger:
        t = upload_ticket(server, 10)
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            stranger.upload(t, b"0123456789")
    assert server.registry.reserve(t, size=10) == t  # nothing reached the service


def test_a_wrong_capability_is_refused(server, client):
    t = dataclasses.replace(upload_ticket(server, 10), token=os.urandom(32))
    expect_refusal(server, "bad_capability", lambda: refused_kind(lambda: client.upload(t, b"0123456789")))


def test_an_expired_capability_is_refused(server, client):
    t = upload_ticket(server, 10, ttl_s=0.2)
    time.sleep(0.3)
    expect_refusal(server, "expired", lambda: refused_kind(lambda: client.upload(t, b"0123456789")))


def test_a_replayed_capability_is_refused_both_ways(server, client):
    t = upload_ticket(server, 10)
    client.upload(t, b"0123456789")
    expect_refusal(server, "replayed", lambda: refused_kind(lambda: client.upload(t, b"9876543210")))
    assert server.inbox.claim(1, 2, 7, t.record, sha(b"0123456789")) == b"0123456789"  # the first upload stands
    record = server.outbox.publish(f"step/{next(_records)}", data=b"abc")
    down = server.registry.issue(1, 2, 7, DOWN, record.name, ttl_s=30)
    client.download(down, 3, record.sha256)
    expect_refusal(server, "replayed", lambda: refused_kind(lambda: client.download(down, 3, record.sha256)))


def test_bytes_that_do_not_match_their_digest_are_refused(server, client):
    t = upload_ticket(server, 10)
    expect_refusal(server, "digest_mismatch", lambda: refused_kind(lambda: client.upload(t, b"0123456789", sha(b"x"))))
    client.upload(t, b"0123456789")  # the refusal changed nothing: the capability still works


def test_a_node_asking_for_another_nodes_record_is_refused_by_the_service(server, client):
    theirs = server.outbox.publish(f"catchup/5/{next(_records)}", data=b"node 5's block")
    mine = server.registry.issue(1, 2, 7, DOWN, f"catchup/2/{next(_records)}", ttl_s=30)
    asking = dataclasses.replace(mine, record=theirs.name)
    expect_refusal(
        server, "foreign_record", lambda: refused_kind(lambda: client.download(asking, theirs.size, theirs.sha256))
    )


def test_an_oversized_declaration_is_refused_before_any_byte_is_read(server, tls):
    t = upload_ticket(server, 1000)
    header = encode_header(t, 2**62, "0" * 64)  # would not fit in memory if it were allocated
    started = time.monotonic()
    expect_refusal(server, "oversized", lambda: raw_upload(server, tls, iter([header, b"x" * 100])))
    assert time.monotonic() - started < LIMITS.idle_timeout_s
    assert server.registry.reserve(t, size=1000) == t


def test_more_or_fewer_bytes_than_declared_are_refused(server, tls):
    t = upload_ticket(server, 100)
    expect_refusal(
        server,
        "size_mismatch",
        lambda: raw_upload(server, tls, iter([encode_header(t, 10, sha(b"0" * 10)), b"0" * 11])),
    )
    expect_refusal(
        server, "size_mismatch", lambda: raw_upload(server, tls, iter([encode_header(t, 10, sha(b"0" * 10)), b"0" * 9]))
    )


def test_a_digest_that_follows_the_bytes_is_checked_like_a_declared_one(server, tls, client):
    """A client that hashes while it sends declares no SHA-256 in its header and sends it after the bytes;
    the size is still bounded by the header before any byte is read, and a wrong, missing or malformed
    trailer, or anything after it, is refused, counted, and changes nothing."""
    t, data = upload_ticket(server, 100), b"0123456789"
    head = encode_header(t, len(data), "")

    def upload(*messages):
        return lambda: raw_upload(server, tls, iter([head, *messages]))

    expect_refusal(server, "digest_mismatch", upload(data, sha(b"x").encode()))
    expect_refusal(server, "bad_header", upload(data))  # no trailer
    expect_refusal(server, "bad_header", upload(data, b"Z" * 64))
    expect_refusal(server, "bad_header", upload(data, sha(data).encode() + b"0"))  # not a SHA-256 either
    expect_refusal(server, "bad_header", upload(data, sha(data).encode()[:63]))
    expect_refusal(server, "size_mismatch", upload(data, sha(data).encode(), b"more"))
    expect_refusal(server, "size_mismatch", upload(data + b"0", sha(data + b"0").encode()))
    oversized = encode_header(t, 2**62, "")
    expect_refusal(server, "oversized", lambda: raw_upload(server, tls, iter([oversized, b"x" * 100])))
    assert raw_upload(server, tls, iter([head, data[:4], data[4:], sha(data).encode()])) == "accepted"
    assert server.inbox.claim(1, 2, 7, t.record, sha(data), len(data)) == data
    t = upload_ticket(server, 100)
    assert client.upload(t, data) == sha(data)  # the client's own: the digest follows the bytes
    assert server.inbox.claim(1, 2, 7, t.record, sha(data), len(data)) == data


@settings(max_examples=40, deadline=None)
@given(trailer=st.one_of(st.binary(max_size=80), st.text("0123456789abcdefABCDEF", min_size=60, max_size=68).map(
    str.encode)))  # fmt: skip
def test_any_bytes_after_an_uploads_bytes_are_its_sha256_or_one_refusal(server, tls, trailer):
    """Whatever message follows the bytes of an upload whose header declares no SHA-256, it is accepted only
    when it is their SHA-256; anything else is one refusal, ``bad_header`` (not 64 lowercase hex digits) or
    ``digest_mismatch``, counted, with nothing held and the capability free for a retry."""
    data = b"0123456789"
    t = upload_ticket(server, 100)
    head = encode_header(t, len(data), "")
    if trailer == sha(data).encode():
        assert raw_upload(server, tls, iter([head, data, trailer])) == "accepted"
        return
    kind = "digest_mismatch" if re.fullmatch(rb"[0-9a-f]{64}", trailer) else "bad_header"
    expect_refusal(server, kind, lambda: raw_upload(server, tls, iter([head, data, trailer])))
    assert raw_upload(server, tls, iter([head, data, sha(data).encode()])) == "accepted"  # the retry


def test_a_header_that_is_not_one_is_refused(server, tls):
    expect_refusal(server, "bad_header", lambda: raw_upload(server, tls, iter([b"\x00garbage"])))


def test_a_stalled_upload_is_refused(server, tls):
    t, release = upload_ticket(server, 10**6), threading.Event()

    def stalls():
        yield encode_header(t, 10**6, "0" * 64)
        yield b"x" * 1000
        release.wait(10)  # the client stops sending

    try:
        started = time.monotonic()
        expect_refusal(server, "stalled", lambda: raw_upload(server, tls, stalls()))
        assert LIMITS.idle_timeout_s <= time.monotonic() - started < LIMITS.idle_timeout_s + 3
    finally:
        release.set()
    assert server.registry.reserve(t, size=10) == t  # released: the capability is as before


def test_a_trickling_upload_is_refused(server, tls):
    t, stop = upload_ticket(server, 10**6), threading.Event()

    def trickles():
        yield encode_header(t, 10**6, "0" * 64)
        for _ in range(100):  # 1 kB every 50 ms: far below 1 MB/s, yet never idle
            if stop.wait(0.05):
                return
            yield b"x" * 1000

    try:
        started = time.monotonic()
        expect_refusal(server, "trickling", lambda: raw_upload(server, tls, trickles()))
        assert time.monotonic() - started < LIMITS.grace_s + 2
    finally:
        stop.set()


def test_a_download_of_an_unpublished_record_is_refused_and_can_be_retried(server, client):
    t = server.registry.issue(1, 2, 7, DOWN, f"step/{next(_records)}", ttl_s=30)
    expect_refusal(server, "unknown_record", lambda: refused_kind(lambda: client.download(t, 3, sha(b"abc"))))
    record = server.outbox.publish(t.record, data=b"abc")
    assert client.download(t, 3, record.sha256) == b"abc"


def test_a_client_checks_what_it_downloads_against_flowers_message(server, client):
    record = server.outbox.publish(f"step/{next(_records)}", data=b"abc")
    t = server.registry.issue(1, 2, 7, DOWN, record.name, ttl_s=30)
    with pytest.raises(TransportError, match="SHA-256 differs"):
        client.download(t, 3, sha(b"abd"))


class SilentProxy:
    """A TCP relay to ``port`` on loopback that can go silent (``silent.set()``): it stops forwarding either
    way and keeps both connections open, as a NAT or firewall that drops a connection without a reset."""

    def __init__(self, port: int) -> None:
        import socket

        self._socket, self.port, self.silent, self._open = socket, 0, threading.Event(), []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            far = self._socket.create_connection(("127.0.0.1", self._target))
            self._open += [near, far]
            for src, dst in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                if not self.silent.is_set():  # silent: read and dropped (a keepalive ping never arrives)
                    dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        for sock in self._open:
            sock.close()


@pytest.mark.slow
def test_a_connection_dropped_silently_ends_a_waiting_download_on_both_sides(tls):
    """A node waiting a round ahead moves no bytes: keepalive pings, answered while the connection lives,
    end the wait on both sides once it is dropped without a reset (the node's call fails as unavailable, the
    service's worker is freed and the wait counted as ended), long before the capability's own end."""
    srv = TransportServer(address="127.0.0.1:0", cert_file=tls.server_cert, key_file=tls.server_key, keepalive_s=1.0)
    srv.start()
    proxy = SilentProxy(srv.port)
    ticket = srv.registry.issue(1, 2, 7, DOWN, "step/ahead", ttl_s=300, waits=True)
    failed = {}
    try:
        with TransportClient(f"localhost:{proxy.port}", ca_file=tls.ca_cert, keepalive_s=1.0) as client:

            def wait() -> None:
                try:
                    client.download_unannounced(ticket, 1024)
                except TransportError as err:
                    failed["error"] = err

            waiting = threading.Thread(target=wait)
            waiting.start()
            time.sleep(3.0)  # pinged about three times each way, and answered
            assert waiting.is_alive() and srv.waits_ended == 0, failed
            proxy.silent.set()
            dropped = time.monotonic()
            waiting.join(60)
            assert not waiting.is_alive(), "the node still waits on a dropped connection"
            assert failed["error"].code == "UNAVAILABLE", failed
            while srv.waits_ended == 0 and time.monotonic() - dropped < 60:
                time.sleep(0.1)
            assert srv.waits_ended == 1 and time.monotonic() - dropped < 20
            assert sum(srv.refusals.counts().values()) == 0  # a lost connection, not an attempt against the rules
    finally:
        proxy.close()
        srv.stop()


# ---------------------------------------------------------------- who may hold the service's calls (mutual TLS)


@pytest.fixture(scope="module")
def sites(tls):
    """Three sites' client certificates from the consortium's CA: (cert, key) PEM bytes each."""
    return [tuple(p.read_bytes() for p in make_client_cert(tls, f"site-{i}")) for i in range(3)]


def mutual_server(tls, **limits) -> TransportServer:
    limits = Limits(**{"header_timeout_s": 2.0, "calls_per_peer": 4, **limits})
    srv = TransportServer(address="127.0.0.1:0", cert_file=tls.server_cert, key_file=tls.server_key, limits=limits,
                          max_workers=12, client_ca=tls.ca_cert)  # fmt: skip
    srv.start()
    return srv


def site_client(srv, tls, identity, timeout_s=20) -> TransportClient:
    return TransportClient(f"localhost:{srv.port}", ca_file=tls.ca_cert, timeout_s=timeout_s, identity=identity)


def test_a_peer_without_a_certificate_of_the_consortiums_ca_ends_at_the_handshake(tls, sites, tmp_path):
    """Mutual TLS: no client certificate, or one another CA signed, fails the handshake; no call reaches the
    service (nothing held, nothing counted), and a site's own certificate goes through."""
    srv = mutual_server(tls)
    stranger = make_tls(tmp_path)  # another CA, and a certificate it signed
    foreign = tuple(p.read_bytes() for p in make_client_cert(stranger, "stranger"))
    try:
        for identity in (None, foreign):
            with site_client(srv, tls, identity) as client, pytest.raises(TransportError) as err:
                client.upload(upload_ticket(srv, 10), b"x" * 10)
            assert err.value.code == "UNAVAILABLE", err.value
        assert len(srv.calls) == 0 and srv.refusals.counts() == {}
        t = upload_ticket(srv, 10)
        with site_client(srv, tls, sites[0]) as client:
            assert client.upload(t, b"y" * 10) == sha(b"y" * 10)
        assert srv.inbox.claim(1, 2, 7, t.record, sha(b"y" * 10)) == b"y" * 10
    finally:
        srv.stop()


def silent_calls(srv, tls, identity, n: int, release: threading.Event) -> list:
    """``n`` calls that never send their first message (a site holding the service's workers), Downloads and
    Uploads in turn: each one's status details once it ends."""
    cert, key = identity
    credentials = grpc.ssl_channel_credentials(tls.ca_cert.read_bytes(), private_key=key, certificate_chain=cert)
    channel = grpc.secure_channel(f"localhost:{srv.port}", credentials)
    same = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    download, upload = channel.stream_stream(DOWNLOAD, **same), channel.stream_unary(UPLOAD, **same)
    outcomes: list = []

    def never():
        release.wait(60)
        yield from ()

    def hold(i: int) -> None:
        try:
            list(download(never(), timeout=60)) if i % 2 else upload(never(), timeout=60)
            outcomes.append("ended")
        except grpc.RpcError as error:
            outcomes.append(error.details())

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    return [outcomes, threads, channel]


def test_a_flood_of_silent_calls_from_one_site_starves_no_other_and_is_counted_against_it(tls, sites):
    """Site 0 opens 20 downloads and uploads that never send a header (more than the pool's 12 workers). Past its
    share of 4 it is refused at once as ``busy``; the 4 it holds end at the header's deadline (``stalled``);
    every refusal is counted against site 0's certificate. Meanwhile site 1 moves a record both ways within a
    few seconds, and nothing is counted against it."""
    srv = mutual_server(tls)
    release = threading.Event()
    try:
        outcomes, threads, channel = silent_calls(srv, tls, sites[0], 20, release)
        time.sleep(0.5)
        assert len(srv.calls) <= 4
        data = os.urandom(3 * 2**20)
        started = time.monotonic()
        with site_client(srv, tls, sites[1]) as client:
            up = srv.registry.issue(1, 3, 7, UP, "update/3", ttl_s=30, max_size=len(data))
            assert client.upload(up, data) == sha(data)
            srv.outbox.publish("step/3", data)
            down = srv.registry.issue(1, 3, 7, DOWN, "step/3", ttl_s=30)
            assert client.download(down, len(data), sha(data)) == data
        assert time.monotonic() - started < 5
        for thread in threads:
            thread.join(30)
        release.set()
        channel.close()
        assert sum(o.startswith("refused busy: ") for o in outcomes) == 16, outcomes
        assert sum(o.startswith("refused stalled: no header within 2 s") for o in outcomes) == 4, outcomes
        by_peer = srv.refusals.by_peer()
        assert list(by_peer.values()) == [20] and list(by_peer)[0].startswith("cert:"), by_peer
        assert srv.refusals.counts() == {"busy": 16, "stalled": 4}
        assert len(srv.calls) == 0
    finally:
        release.set()
        srv.stop()


def test_a_stolen_token_without_the_nodes_key_is_refused_and_nothing_is_held(tls, sites):
    """A node's first completed transfer binds its capabilities to its certificate (a refused one before it binds
    nothing). Another site holding a token of that node (read from a log, a dump) is refused as ``foreign_peer``
    under its own certificate, counted against it; nothing is held for the slot, and the capability stays the
    node's: it uploads under it afterwards."""
    srv = mutual_server(tls)
    try:
        first = srv.registry.issue(1, 5, 1, UP, "r1/update/5", ttl_s=30, max_size=100)
        stolen = srv.registry.issue(1, 5, 2, UP, "r2/update/5", ttl_s=30, max_size=100)
        with site_client(srv, tls, sites[2]) as early, pytest.raises(Refused):  # refused before the node's first
            early.upload(first, b"x" * 101)  # transfer: it binds nothing (oversized)
        with site_client(srv, tls, sites[0]) as node:
            node.upload(first, b"a" * 100)
            with site_client(srv, tls, sites[1]) as thief, pytest.raises(Refused) as refused:
                thief.upload(stolen, b"forged" * 10)
            assert refused.value.kind is RefusalKind.FOREIGN_PEER, refused.value
            assert not srv.inbox.holds(1, 5, 2, stolen.record)
            assert node.upload(stolen, b"b" * 100) == sha(b"b" * 100)
        assert srv.inbox.claim(1, 5, 2, stolen.record, sha(b"b" * 100)) == b"b" * 100
        assert srv.refusals.counts() == {"oversized": 1, "foreign_peer": 1} and len(srv.refusals.by_peer()) == 2
    finally:
        srv.stop()


def test_a_download_nobody_reads_is_cancelled_when_its_round_ends(tls, sites):
    """A site that opens a large download and stops reading holds a worker while gRPC's flow control blocks
    the sender. When its round ends (``drop_round``) the service cancels the call: the worker is free, the
    capability released, and the cancellation counted."""
    srv = mutual_server(tls)
    srv.outbox.publish("r1/step", os.urandom(64 * 2**20))
    ticket = srv.registry.issue(1, 5, 1, DOWN, "r1/step", ttl_s=60)
    cert, key = sites[0]
    credentials = grpc.ssl_channel_credentials(tls.ca_cert.read_bytes(), private_key=key, certificate_chain=cert)
    try:
        with grpc.secure_channel(f"localhost:{srv.port}", credentials) as channel:
            call = channel.unary_stream(DOWNLOAD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            responses = call(encode_header(ticket), timeout=60)
            next(responses)  # one chunk read, then no more
            time.sleep(1.0)
            assert len(srv.calls) == 1 and srv.calls.cancelled == 0
            srv.registry.drop_round(1, 1)
            deadline = time.monotonic() + 10
            while len(srv.calls) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(srv.calls) == 0 and srv.calls.cancelled == 1
            with pytest.raises(grpc.RpcError):
                for _ in responses:
                    pass
    finally:
        srv.stop()


def test_mutual_tls_needs_tls():
    with pytest.raises(ValueError, match="client_ca with insecure=True"):
        TransportServer(insecure=True, client_ca="ca.crt")
    with pytest.raises(ValueError, match="a client certificate with insecure=True"):
        TransportClient("localhost:1", insecure=True, identity=(b"c", b"k"))
    with pytest.raises(ValueError, match="calls_per_peer=0"):
        Limits(calls_per_peer=0)

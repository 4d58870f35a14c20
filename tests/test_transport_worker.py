"""The node worker with ``transport = "direct"`` (``worker/stream.py``), in this process against a real
``RunTransport`` with TLS, no Flower process: a round's records come from the stream and its update goes
back on it (the reply commits it), and a worker that cannot use the stream says so the two ways the
server reads: records it could not fetch refuse the round with its state intact, an update it could not
upload comes inline, counted as a fallback."""

from __future__ import annotations

import dataclasses
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr import core, node
from parablock_flwr.client_apps.inline import train_inline
from parablock_flwr.config import RunConfig
from parablock_flwr.messages import (
    COMMIT,
    GLOBAL_STEP,
    METRICS,
    OFFER,
    PROTOCOL_KEY,
    ROUND,
    STREAM_UNUSABLE,
    UpdateCommit,
    key,
)
from parablock_flwr.npy import npy_view
from parablock_flwr.records import pieces_record
from parablock_flwr.tools.credentials import make_tls
from parablock_flwr.transport import NodeTransport, RunTransport, StreamSettings
from parablock_flwr.transport.message_bytes import content_to_bytes, reply_from_bytes
from parablock_flwr.versions import PROTOCOL_VERSION
from parablock_flwr.wire import join_pieces, pack_pieces, unpack
from parablock_flwr.worker.server import NodeWorker

from helpers import relayed, tiny_config, worker_request

RUN = 7


@pytest.fixture
def stream(tmp_path):
    tls = make_tls(tmp_path / "tls")
    settings = StreamSettings("localhost:0", str(tls.server_cert), str(tls.server_key), str(tls.ca_cert))
    with RunTransport(settings, RUN, ttl_s=60) as transport:
        yield transport


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(config, server_round: int, offer=None, **node_config) -> dict:
    """Round ``server_round``'s request to the worker, with the message's offer and the node's config."""
    header = worker_request(config, RUN, server_round, block=(server_round - 1) % 2, next_block=-1, num_partitions=2,
                            **{"step-block": (server_round - 2) % 2})  # fmt: skip
    header["node"] = node_config
    if offer is not None:
        header[key("stream_offer")] = offer.to_config()
    return header


def test_a_round_on_the_stream_and_its_two_fallbacks(tmp_path, tiny_model_dir, stream):
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2})
    worker = NodeWorker()
    names = {}
    try:
        # Round 1: nothing to fetch; the update goes on the stream and the reply commits it.
        offer = stream.offer(1, 0, {}, upload_max_size=10**7)
        reply, pieces = worker.serve_request(request(config, 1, offer), {})
        assert pieces == {} and key("direct_fallbacks") not in reply["metrics"], reply
        commit = UpdateCommit.from_config(reply[key("stream_commit")])
        update = unpack({n: npy_view(p, n) for n, p in stream.claim(1, 0, commit).items()})
        names = {n: tuple(t.shape) for n, t in update.items()}
        assert update and all(torch.isfinite(t).all() for t in update.values())

        assert stream.take_reply(1, 0, 1) is None  # the offer gave no capability for the reply's own content

        # Round 2: the global step waits on the stream; the worker fetches it, checked, and applies it. The offer
        # gives a capability for the reply's content too: the worker uploads it after the update, as the reply.
        step = pieces_record(pack_pieces({n: t * 0.5 for n, t in update.items()}))
        offer = stream.offer(2, 0, {GLOBAL_STEP: step}, upload_max_size=10**7, reply=1)
        reply, pieces = worker.serve_request(request(config, 2, offer), {})
        assert "error" not in reply and pieces == {} and key("stream_commit") in reply, reply
        assert node.resources(RunConfig.from_flower(config), RUN).replica.version == 1
        commit = UpdateCommit.from_config(reply[key("stream_commit")])
        on_stream = reply_from_bytes(stream.take_reply(2, 0, 1))
        assert UpdateCommit.from_config(dict(on_stream[COMMIT])) == commit
        assert dict(on_stream[METRICS]) == reply["metrics"] and worker.last_reply_round == 2
        update2 = unpack({n: npy_view(p, n) for n, p in stream.claim(2, 0, commit).items()})

        # Round 3 at an address that does not answer: the records cannot be fetched, the state is intact ...
        g2 = {n: t * 0.5 for n, t in update2.items()}
        wrong = f"localhost:{closed_port()}"  # the address the message names does not answer
        replica = node.resources(RunConfig.from_flower(config), RUN).replica
        before = (replica.version, core.digest(replica.params, replica.params), worker.node.state.last_round)
        offer = stream.offer(3, 0, {GLOBAL_STEP: pieces_record(pack_pieces(g2))}, 10**7)
        offer = dataclasses.replace(offer, address=wrong)
        reply, _ = worker.serve_request(request(config, 3, offer), {})
        assert reply["state-intact"] and reply["error"].startswith(STREAM_UNUSABLE), reply
        assert (replica.version, core.digest(replica.params, replica.params), worker.node.state.last_round) == before
        # ... and with them inline (the server's next message to it), the update comes inline, counted.
        offer = stream.offer(3, 0, {}, upload_max_size=10**7)
        offer = dataclasses.replace(offer, address=wrong)
        reply, pieces = worker.serve_request(request(config, 3, offer), relayed({GLOBAL_STEP: g2}))
        assert reply.get("metrics", {}).get(key("direct_fallbacks")) == 1 and key("stream_commit") not in reply, reply
        assert set(unpack(join_pieces(pieces))) == set(names)  # block 0 again
    finally:
        worker.compute_thread.shutdown(wait=True)
        worker.stream.transport.close()


def test_a_site_that_keeps_to_flowers_path_sends_its_update_inline(tmp_path, tiny_model_dir, stream):
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2})
    worker = NodeWorker()
    try:
        offer = stream.offer(1, 0, {}, upload_max_size=10**7)
        reply, pieces = worker.serve_request(request(config, 1, offer, transport="flower"), {})
        assert reply["metrics"][key("direct_fallbacks")] == 1 and pieces and len(stream.server.inbox) == 0
    finally:
        worker.compute_thread.shutdown(wait=True)


def test_a_node_without_a_worker_cannot_fetch_and_says_so_state_intact(tmp_path, tiny_model_dir, stream):
    """A SuperNode that runs its rounds in its ClientApp (no ``worker-socket``) moves nothing on the stream:
    a message whose records wait there is refused, state intact, with the marker the server reads."""
    config = tiny_config(tiny_model_dir, tmp_path)
    offer = stream.offer(2, 6, {GLOBAL_STEP: pieces_record(pack_pieces({"w": torch.ones(3)}))}, 10**6)
    round_config = worker_request(config, 4, 2, block=1, next_block=-1, num_partitions=2)["round"]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 4, 6, 0
    content = RecordDict({ROUND: ConfigRecord(round_config), OFFER: ConfigRecord(offer.to_config())})
    msg = Message(content=content, dst_node_id=6, message_type=MessageType.TRAIN)
    TaskIdentity.node_id = 6
    context = Context(run_id=4, node_id=6, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config=config)  # fmt: skip
    reply = train_inline(msg, context)
    assert reply.has_error() and reply.error.reason.startswith(f"state-intact: {STREAM_UNUSABLE}"), reply.error
    assert len(context.state) == 0


def worker_rounds_on_stream(
    tls, config: dict, run_id: int, ahead: bool, rounds: int = 3, worker: NodeWorker | None = None,
    wait_for_update: bool = True, content: bool = False, message_first: bool = False,
) -> list[dict]:  # fmt: skip
    """``rounds`` rounds of one node worker against a run's stream, the server's part played here: round r's
    step is half the update it claimed in round r-1. ``ahead``: each offer also carries round r+1's
    capabilities, and round r's request is served only once its update is in the server's inbox (moved
    before the message came; not waited for without ``wait_for_update``). ``content``: from round 2 on, each
    round's content is published on the stream (as a message pushed ahead is), the worker must have answered
    the round before its request comes, and the request is the message pushed ahead, as its ClientApp relays
    it (``message_first``: that request comes before the content is published, and waits for it). Each round's
    reply header, with the SHA-256 of the update claimed."""
    settings = StreamSettings("localhost:0", str(tls.server_cert), str(tls.server_key), str(tls.ca_cert))
    worker, replies, step = worker or NodeWorker(), [], {}
    try:
        with RunTransport(settings, run_id, ttl_s=120) as stream:
            for r in range(1, rounds + 1):
                records = {GLOBAL_STEP: pieces_record(pack_pieces(step))} if step else {}
                bounds = (10**7, 10**7) if ahead and r < rounds else None
                offer = stream.offer(r, 0, records, upload_max_size=10**7, ahead=bounds, content_ahead=content)
                message_ahead = stream.message_ahead_offer(r, 0) if content and r > 1 else None
                stream.messaged(r, {0})  # the round's messages are built: its step goes to the waiting download
                if ahead and r > 1 and wait_for_update:
                    slot = (run_id, 0, r, stream.upload_name(r, 0))
                    deadline = time.monotonic() + 120
                    while not stream.server.inbox.holds(*slot) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert stream.server.inbox.holds(*slot), f"round {r}: its update is not in the inbox"
                header = worker_request(config, run_id, r, block=(r - 1) % 2, next_block=r % 2 if r < rounds else -1,
                                        num_partitions=2, **{"step-block": (r - 2) % 2})  # fmt: skip
                header[key("stream_offer")] = offer.to_config()
                if message_ahead is not None:  # the content published, the worker starts the round by itself
                    round_config = ConfigRecord({PROTOCOL_KEY: PROTOCOL_VERSION, **header[key("round")]})
                    body = RecordDict({ROUND: round_config, OFFER: ConfigRecord(offer.to_config())})
                    header[key("round")] = {PROTOCOL_KEY: PROTOCOL_VERSION, key("server_round"): r}
                    header[key("stream_offer")] = message_ahead.to_config()
                    with ThreadPoolExecutor(1) as clientapp:
                        if message_first:
                            answer = clientapp.submit(worker.serve_request, header, {})
                            time.sleep(0.3)
                        stream.publish_message(r, 0, content_to_bytes(body))
                        if not message_first:
                            deadline = time.monotonic() + 120
                            answers = worker.answers
                            while (answers.last is None or answers.last[0][3] != r) and time.monotonic() < deadline:
                                time.sleep(0.02)
                            assert answers.last[0][3] == r, f"round {r} did not start from its content on the stream"
                            answer = clientapp.submit(worker.serve_request, header, {})
                        reply, pieces = answer.result(timeout=120)
                else:
                    reply, pieces = worker.serve_request(header, {})
                assert "error" not in reply and pieces == {}, reply
                commit = UpdateCommit.from_config(reply[key("stream_commit")])
                update = unpack({n: npy_view(p, n) for n, p in stream.claim(r, 0, commit).items()})
                step = {n: t * 0.5 for n, t in update.items()}
                replies.append({**reply, "sha256": commit.update_sha256})
                stream.end_round(r)
    finally:
        worker.compute_thread.shutdown(wait=True)
        worker.stream.close()
    return replies


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_round_r_plus_1s_update_moves_before_its_message_and_its_reply_has_the_same_bits(
    tmp_path, tiny_model_dir, dtype, monkeypatch
):
    """ParaBlock at-end on a node worker: with the capabilities issued a round ahead, rounds 2 and 3's updates
    are in the server's inbox before their requests are served, and their steps were fetched before; every
    round's update has the bits of the same rounds without them (int8: the error feedback's residuals too).
    A step fetched ahead lands in kept memory of the size of the node's own update (``download_unannounced``):
    in fp32 this test's steps have that size; in bf16 and int8 they are larger (its server sends fp32 steps),
    and grow as they come, the same bits either way."""
    prefetched, prefetch = [], NodeTransport.prefetch

    def kept(self, offer, expected_size=0):  # the real download, its result kept for the asserts below
        prefetched.append((expected_size, got := prefetch(self, offer, expected_size)))
        return got

    monkeypatch.setattr(NodeTransport, "prefetch", kept)
    tls = make_tls(tmp_path / "tls")
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "transfer-dtype": dtype,
                                                      "correction": "at-end"})  # fmt: skip
    plain = worker_rounds_on_stream(tls, config, RUN + 1, ahead=False)
    moved = worker_rounds_on_stream(tls, config, RUN, ahead=True)
    assert [r["sha256"] for r in moved] == [r["sha256"] for r in plain]
    flags = [(r["metrics"].get(key("direct_update_ahead")), r["metrics"].get(key("direct_step_prefetched")))
             for r in moved]  # fmt: skip
    assert flags == [(None, None), (1, 1), (1, 1)], flags
    assert all(key("direct_update_ahead") not in r["metrics"] for r in plain)
    assert len(prefetched) == 2 and all(expected > 0 for expected, _ in prefetched), prefetched
    fitted = [isinstance(got.data, memoryview) and len(got.data) == expected for expected, got in prefetched]
    assert fitted == [dtype == "fp32"] * 2, [(expected, type(got.data), len(got.data)) for expected, got in prefetched]


def test_an_update_moved_ahead_has_its_residual_written_before_its_message_and_its_round_only_renames_it(
    tmp_path, tiny_model_dir, monkeypatch
):
    """int8, ParaBlock at-end: round r+1's update, rounded ahead, starts its residual's durable write then
    (``ResidualStore.stage``, beside its upload), before round r+1's message is served; the round renames it
    (``commit``) and writes none (``save`` only in round 1, which had nothing ahead). The residual files have
    the bits of the same rounds without anything ahead, and no staged file is left."""
    from safetensors.torch import load_file

    from parablock_flwr.node.state import ResidualStore

    tls = make_tls(tmp_path / "tls")
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "transfer-dtype": "int8",
                                                      "correction": "at-end"})  # fmt: skip
    events = []

    def noting(real, before=None, after=None):  # each event with its round, as the call begins or once it returned
        def call(*args, **kwargs):
            if before:
                events.append(before(*args))
            out = real(*args, **kwargs)
            if after:
                events.append(after(*args))
            return out

        return call

    def round_of(path) -> int:
        return int(path.name[2:7])  # ".r00002-b1.safetensors.<token>.early.tmp"

    store = ResidualStore
    monkeypatch.setattr(store, "stage", noting(store.stage, lambda _, p, t: ("staged", round_of(p))))
    monkeypatch.setattr(store, "save", noting(store.save, lambda _, r, b, t: ("saved", r)))
    monkeypatch.setattr(store, "commit", noting(store.commit, after=lambda _, p, r, b: ("committed", r)))
    serve, handle = NodeWorker.serve_request, NodeWorker.handle_request
    monkeypatch.setattr(NodeWorker, "handle_request", noting(handle, lambda _, req, *a: ("served", req.server_round)))
    monkeypatch.setattr(NodeWorker, "serve_request", noting(serve, after=lambda *a, **k: ("replied",)))
    moved = NodeWorker(state_dir=tmp_path / "moved")
    worker_rounds_on_stream(tls, config, RUN, ahead=True, worker=moved)
    moved_events, events[:] = list(events), []
    worker_rounds_on_stream(tls, config, RUN + 1, ahead=False, worker=NodeWorker(state_dir=tmp_path / "plain"))
    assert [e for e in moved_events if e[0] == "saved"] == [("saved", 1)], moved_events
    for r in (2, 3):  # staged before its message was served, renamed before its reply left
        served = moved_events.index(("served", r))
        replied = moved_events.index(("replied",), served)
        assert moved_events.index(("staged", r)) < served < moved_events.index(("committed", r)) < replied, r
    assert [e[0] for e in events if e[0] != "replied"] == ["served", "saved"] * 3
    files = {d: sorted((tmp_path / d / "partition-0").iterdir()) for d in ("moved", "plain")}
    assert [p.name for p in files["moved"]] == ["r00001-b0.safetensors", "r00002-b1.safetensors",
                                                "r00003-b0.safetensors", f"run-{RUN}"]  # fmt: skip
    for mine, theirs in zip(files["moved"][:3], files["plain"][:3], strict=True):
        a, b = load_file(str(mine)), load_file(str(theirs))
        assert mine.name == theirs.name and a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_residual_staged_ahead_that_cannot_be_written_fails_its_rounds_reply(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    """The staged write's error (a full disk, played by raising it) is the round's: its reply is an error that
    names it, its text in the node's log, as a failed ``save``'s is
    (``test_a_residual_write_error_fails_the_reply_whatever_else_fails_in_the_round``)."""
    from parablock_flwr.node.state import ResidualStore

    def full_disk(store, path, residual):
        raise OSError(28, "No space left on device (staged)")

    monkeypatch.setattr(ResidualStore, "stage", full_disk)
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1, "transfer-dtype": "int8",
                                                      "correction": "at-end"})  # fmt: skip
    with pytest.raises(AssertionError, match="'error': \"OSError"):  # round 2's reply
        worker_rounds_on_stream(make_tls(tmp_path / "tls"), config, RUN, ahead=True,
                                worker=NodeWorker(state_dir=tmp_path / "state"))  # fmt: skip
    assert "No space left on device (staged)" in caplog.text


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_worker_starts_a_round_when_its_content_comes_on_the_stream_and_its_message_gets_that_answer(
    tmp_path, tiny_model_dir, dtype
):
    """Round r's offer gives the worker a capability for round r+1's content: once the server publishes it, the
    worker starts round r+1 by itself, before any request; the message pushed ahead, relayed when Flower
    delivers it, gets that round's answer, not a second computation; every round has the bits of the same
    rounds without it (int8: the error feedback's residuals too)."""
    tls = make_tls(tmp_path / "tls")
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "transfer-dtype": dtype,
                                                      "correction": "at-end"})  # fmt: skip
    plain = worker_rounds_on_stream(tls, config, RUN + 1, ahead=False)
    worker = NodeWorker()
    started = worker_rounds_on_stream(tls, config, RUN, ahead=True, wait_for_update=False, content=True, worker=worker)
    assert [r["sha256"] for r in started] == [r["sha256"] for r in plain]
    assert [r["metrics"].get(key("direct_content_fetched")) for r in started] == [None, 1, 1]
    # A round's message that Flower delivers after later rounds were answered gets its own round's answer.
    late, _ = worker.answers.answered(("train", RUN, 0, 2), pushed_ahead=True)
    assert late["metrics"] == started[1]["metrics"] and late[key("stream_commit")] == started[1][key("stream_commit")]


def count_computations(worker: NodeWorker) -> list[int]:
    """The rounds ``worker`` computes (or tries), in order: each call of its ``handle_request``."""
    computed, handle = [], worker.handle_request

    def counted(request, *args):
        computed.append(request.server_round)
        return handle(request, *args)

    worker.handle_request = counted
    return computed


def test_a_message_pushed_ahead_that_waits_for_its_content_gets_the_round_computed_once(tmp_path, tiny_model_dir):
    """The ClientApp's request for a message pushed ahead comes before the content is published, and waits for
    the worker's own download of it: whichever takes the round first (that request, or the round started from
    the content), the round is computed once, with the bits of the same rounds without anything ahead."""
    tls = make_tls(tmp_path / "tls")
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "correction": "at-end"})
    worker = NodeWorker()
    computed = count_computations(worker)
    plain = worker_rounds_on_stream(tls, config, RUN + 1, ahead=False)
    started = worker_rounds_on_stream(tls, config, RUN, ahead=True, worker=worker, wait_for_update=False, content=True,
                         message_first=True)  # fmt: skip
    assert computed == [1, 2, 3]
    assert [r["sha256"] for r in started] == [r["sha256"] for r in plain]
    assert [r["metrics"].get(key("direct_content_fetched")) for r in started] == [None, 1, 1]


def test_a_round_that_failed_from_its_content_answers_its_message_once_and_its_retry_is_computed(
    tmp_path, tiny_model_dir, stream
):
    """Round 2's content names its step with a wrong SHA-256: the round, tried once (by its message pushed
    ahead, which waits for the content, or by the worker when the content comes), fails with the node's state
    intact, and the message pushed ahead gets that failure. The server's retry of round 2, its step's digest
    right, is computed, not answered with the failure."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "correction": "at-end"})
    worker = NodeWorker()
    computed = count_computations(worker)
    try:
        offer = stream.offer(1, 0, {}, upload_max_size=10**7, ahead=(10**7, 10**7), content_ahead=True)
        stream.messaged(1, {0})
        reply, _ = worker.serve_request(request(config, 1, offer), {})
        commit = UpdateCommit.from_config(reply[key("stream_commit")])
        update = unpack({n: npy_view(p, n) for n, p in stream.claim(1, 0, commit).items()})
        step = {GLOBAL_STEP: pieces_record(pack_pieces({n: t * 0.5 for n, t in update.items()}))}
        message_ahead = stream.message_ahead_offer(2, 0)
        offer = stream.offer(2, 0, step, upload_max_size=10**7)
        stream.messaged(2, {0})
        forged = dataclasses.replace(offer, records=(offer.records[0]._replace(sha256="0" * 64),))
        header = request(config, 2, forged)
        body = RecordDict({ROUND: ConfigRecord({PROTOCOL_KEY: PROTOCOL_VERSION, **header[key("round")]}),
                           OFFER: ConfigRecord(forged.to_config())})  # fmt: skip
        ahead = {**header, key("round"): {PROTOCOL_KEY: PROTOCOL_VERSION, key("server_round"): 2},
                 key("stream_offer"): message_ahead.to_config()}  # fmt: skip
        with ThreadPoolExecutor(1) as clientapp:
            answer = clientapp.submit(worker.serve_request, ahead, {})
            time.sleep(0.3)
            stream.publish_message(2, 0, content_to_bytes(body))
            failed, _ = answer.result(timeout=120)
        time.sleep(0.5)  # the round started from its content, had it come second, would have run by now
        assert STREAM_UNUSABLE in failed["error"] and computed == [1, 2], (failed, computed)
        retried, _ = worker.serve_request(request(config, 2, stream.offer(2, 0, step, upload_max_size=10**7)), {})
        assert "error" not in retried and computed == [1, 2, 2], retried
    finally:
        worker.compute_thread.shutdown(wait=True)
        worker.stream.close()


def test_the_next_computation_starts_while_the_update_moving_ahead_is_still_on_its_way(tmp_path, tiny_model_dir):
    """Round r's message comes while its update, computed ahead, is still uploading (a slow link, played by
    holding the upload's bytes back): the round's training takes the update as it was rounded and starts round
    r+1's computation at once, before the upload ends; the reply waits for the upload and commits it, with the
    bits of the same rounds without anything ahead."""
    tls = make_tls(tmp_path / "tls")
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "correction": "at-end"})
    worker, overlapped = NodeWorker(), []
    upload_ahead = worker.stream.transport.upload_ahead

    def slow_upload(offer, pieces):
        deadline = time.monotonic() + 20  # the bytes are held until the next computation runs (or 20 s)
        while offer.server_round + 2 <= 4 and time.monotonic() < deadline:  # round 4 starts none
            running = worker.node.ahead
            if running is not None and running.server_round == offer.server_round + 2:
                overlapped.append(offer.server_round + 1)
                break
            time.sleep(0.01)
        return upload_ahead(offer, pieces)

    worker.stream.transport.upload_ahead = slow_upload
    moved = worker_rounds_on_stream(tls, config, RUN, ahead=True, rounds=4, worker=worker, wait_for_update=False)
    plain = worker_rounds_on_stream(tls, config, RUN + 1, ahead=False, rounds=4)
    assert overlapped == [2, 3], "round r+1's computation waited for round r's update to be uploaded"
    assert [r["metrics"].get(key("direct_update_ahead")) for r in moved] == [None, 1, 1, 1]
    assert [r["sha256"] for r in moved] == [r["sha256"] for r in plain]


def test_an_upload_ahead_cancelled_before_it_ran_leaves_the_round_nothing_to_wait_for():
    """A worker that closes cancels the transfers not yet started: their rounding never comes, and the
    round takes the usual path at once instead of waiting for it."""
    from concurrent.futures import Future

    from parablock_flwr.worker.stream import AheadTransfers

    cancelled = Future()
    assert cancelled.cancel()
    ahead = AheadTransfers(RUN, 2, "r2/global-step", None, cancelled, Future())
    started = time.monotonic()
    assert ahead.early_update() is None and ahead.early_upload() is None
    assert time.monotonic() - started < 1


def test_a_rounds_transfers_ahead_are_freed_when_dropped_without_the_garbage_collector():
    """What a round moved ahead (its update's upload holds the rounded block) is freed as soon as the round lets
    it go: no reference cycle (a Future keeps its callbacks) leaves it to the collector's rare full pass, under
    which a deployed ParaBlock worker grew by a block or two a round (docs/results/deployed_memory.md)."""
    import gc
    import weakref
    from concurrent.futures import Future

    from parablock_flwr.worker.stream import AheadTransfers

    gc.disable()
    try:
        update, rounded = Future(), Future()
        ahead = AheadTransfers(RUN, 2, "r2/global-step", None, update, rounded)
        block = torch.zeros(8)  # stands for the upload's result: the rounded block and its bytes
        freed_ahead, freed_block = weakref.ref(ahead), weakref.ref(block)
        update.set_result({"block": block})
        assert rounded.result(timeout=0) is None  # an upload that handed over no rounding: nobody waits
        del ahead, block, update
        assert freed_ahead() is None and freed_block() is None
    finally:
        gc.enable()

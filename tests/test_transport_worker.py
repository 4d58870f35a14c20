"""The node worker with ``transport = "direct"`` (``worker/stream.py``), in this process against a real
``RunTransport`` with TLS, no Flower process: a round's records come from the stream and its update goes
back on it (the reply commits it), and a worker that cannot use the stream says so the two ways the
server reads: records it could not fetch refuse the round with its state intact, an update it could not
upload comes inline, counted as a fallback."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr import core, node
from parablock_flwr.client_apps.inline import train_inline
from parablock_flwr.config import RunConfig
from parablock_flwr.messages import GLOBAL_STEP, OFFER, ROUND, STREAM_UNUSABLE, UpdateCommit, key
from parablock_flwr.npy import npy_view
from parablock_flwr.records import pieces_record
from parablock_flwr.tools.credentials import make_tls
from parablock_flwr.transport import RunTransport, StreamSettings
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

        # Round 2: the global step waits on the stream; the worker fetches it, checked, and applies it.
        step = pieces_record(pack_pieces({n: t * 0.5 for n, t in update.items()}))
        offer = stream.offer(2, 0, {GLOBAL_STEP: step}, upload_max_size=10**7)
        reply, pieces = worker.serve_request(request(config, 2, offer), {})
        assert "error" not in reply and pieces == {} and key("stream_commit") in reply, reply
        assert node.resources(RunConfig.from_flower(config), RUN).replica.version == 1
        commit = UpdateCommit.from_config(reply[key("stream_commit")])
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

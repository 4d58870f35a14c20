"""One protocol version (``parablock_flwr/versions.py``) in every frame between a ClientApp and its node
worker and in every round's config from the server: a side that meets another number refuses in one
line naming both, before it reads any array or loads anything."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import time

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr.client_apps import app
from parablock_flwr.messages import PROTOCOL_KEY
from parablock_flwr.versions import PROTOCOL_VERSION
from parablock_flwr.worker.protocol import ProtocolError, _frame, recv, request

OTHER = PROTOCOL_VERSION + 1


def raw_frame(header: dict) -> bytes:
    raw = json.dumps({"arrays": [], **header}).encode()
    return struct.pack(">Q", len(raw)) + raw


def receive(data: bytes, worker_side: bool):
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await recv(reader, (lambda header: (1 << 20, "the test's bound")) if worker_side else None)

    return asyncio.run(run())


def test_every_frame_carries_the_version_and_the_receiver_hides_it():
    sent = b"".join(bytes(b) for b in _frame({"op": "ping"}, None))
    assert json.loads(sent[8:])[PROTOCOL_KEY] == PROTOCOL_VERSION
    header, _ = receive(sent, worker_side=True)
    assert header == {"op": "ping"}


@pytest.mark.parametrize(
    "worker_side, peer, here",
    [(True, "the ClientApp", "this node worker"), (False, "the node worker", "this ClientApp")],
)
def test_a_frame_of_another_version_is_refused_naming_both(worker_side, peer, here):
    with pytest.raises(ProtocolError) as refused:
        receive(raw_frame({"op": "train", PROTOCOL_KEY: OTHER}), worker_side)
    assert str(refused.value).startswith(
        f"protocol version mismatch: {peer} speaks {OTHER}, {here} speaks {PROTOCOL_VERSION}; "
    )
    with pytest.raises(ProtocolError, match=rf"{peer} speaks no protocol version .*{here} speaks {PROTOCOL_VERSION}"):
        receive(raw_frame({"op": "train"}), worker_side)  # a release from before versions were sent


def server_message(round_cfg: dict) -> tuple[Message, Context]:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 5, 0
    msg = Message(content=RecordDict({"round": ConfigRecord(round_cfg)}), dst_node_id=5, message_type=MessageType.TRAIN)
    TaskIdentity.node_id = 5
    context = Context(run_id=1, node_id=5, node_config={"worker-socket": "/nonexistent/w.sock"}, state=RecordDict(),
                      run_config={})  # fmt: skip
    return msg, context


@pytest.mark.parametrize("handler", [app.train, app.evaluate])
def test_a_round_config_of_another_version_is_refused_by_the_node_before_anything(handler):
    """Refused before the ClientApp touches its worker (whose socket here does not exist) or loads anything."""
    msg, context = server_message({PROTOCOL_KEY: OTHER, "server-round": 1})
    reply = handler(msg, context)
    assert reply.has_error()
    assert reply.error.reason == (
        f"protocol version mismatch: the server speaks {OTHER}, this node speaks {PROTOCOL_VERSION}; "
        "install the same parablock-flwr release on the server and at every site"
    )
    msg, context = server_message({PROTOCOL_KEY: PROTOCOL_VERSION, "server-round": 1})
    assert "node worker is not running at /nonexistent/w.sock" in handler(msg, context).error.reason


def test_the_server_sends_the_version_in_every_round_config(tmp_path):
    """Every message the server builds (a round's, the nodes' final evaluation's) carries its config as
    ``RoundConfig`` writes it: with this release's protocol version."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, MessageType

    from parablock_flwr import core
    from parablock_flwr.config import RunConfig
    from parablock_flwr.messages import PROTOCOL_KEY, ROUND, RoundConfig
    from parablock_flwr.strategies import FedBCD

    partition = core.BlockPartition(blocks=(("w",),), labels=("w",))
    strategy = FedBCD(global_params={"w": torch.zeros(2)}, partition=partition, schedule=[0, 0], run_dir=tmp_path,
                      config=RunConfig(num_server_rounds=2))  # fmt: skip
    run_part = ConfigRecord(RoundConfig(server_round=1).to_config())
    strategy.stats.nodes = [5]
    for msg in [*strategy.configure_evaluate(3, ArrayRecord(), run_part, None)] + [*strategy.train_messages(1, [4])]:
        assert msg.content.config_records[ROUND][PROTOCOL_KEY] == PROTOCOL_VERSION, msg.metadata.message_type
    assert msg.metadata.message_type == MessageType.TRAIN


@pytest.mark.e2e
def test_a_real_worker_refuses_a_client_of_another_version_in_one_line(tmp_path):
    """A worker process (no model is loaded: a refusal needs none) answers one error frame naming both
    versions, logs the same line, and serves the next (matching) request."""
    path, log = tmp_path / "node" / "w.sock", tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "parablock_flwr.worker", "--socket", str(path)],
                                stdout=out, stderr=out, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(30)
            client.connect(str(path))
            client.sendall(raw_frame({"op": "train", "run-id": 1, PROTOCOL_KEY: OTHER}))
            (size,) = struct.unpack(">Q", client.recv(8, socket.MSG_WAITALL))
            reply = json.loads(client.recv(size, socket.MSG_WAITALL))
        want = f"the ClientApp speaks {OTHER}, this node worker speaks {PROTOCOL_VERSION}"
        assert reply["error"].startswith("ProtocolError: protocol version mismatch: " + want)
        assert reply[PROTOCOL_KEY] == PROTOCOL_VERSION and "\n" not in reply["error"]
        assert asyncio.run(request(str(path), {"op": "ping"}, timeout_s=30))[0]["pid"] == proc.pid
        assert want in log.read_text()
    finally:
        proc.terminate()
        proc.wait(60)

"""The deployment ClientApp's relay (`client_apps/app.py`'s `relay_to_worker`) moves Flower's payload bytes
to the node worker's socket and back without copying the values: the request's arrays are views of
Flower's own npy payloads, the reply is read from the socket behind its npy header and becomes the
`Array`'s data. A real socket, a real Flower `Message`, and a stand-in worker in a subprocess that speaks
the worker protocol (`protocol.recv` / `protocol.send`) and echoes the arrays it received: what the relay
does to the bytes is all that is measured."""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import SType
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr.client_apps.app import relay_to_worker
from parablock_flwr.messages import PROTOCOL_KEY
from parablock_flwr.npy import npy_header
from parablock_flwr.versions import PROTOCOL_VERSION
from parablock_flwr.worker.protocol import ProtocolError, SocketReader, recv, request

# A worker that echoes each array it receives as the update's array of the same name, unless the
# request's round says "truncate": then it declares 16 bytes, sends 12 and closes.
ECHO_WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from parablock_flwr.versions import PROTOCOL_VERSION
    from parablock_flwr.worker.protocol import recv, send

    async def serve(reader, writer):
        header, arrays = await recv(reader, lambda header: (1 << 40, "the echo worker"))
        if header["round"].get("mode") == "truncate":
            raw = b'{"metrics": {}, "protocol-version": %d, ' % PROTOCOL_VERSION
            raw += b'"arrays": [{"name": "w", "dtype": "float32", "shape": [4]}]}'
            writer.write(len(raw).to_bytes(8, "big") + raw + bytes(12))
        else:
            echoed = {name.split("/", 1)[1]: a for name, a in arrays.items()}
            await send(writer, {"metrics": {"received-bytes": sum(a.nbytes for a in arrays.values())}}, echoed)
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_unix_server(serve, sys.argv[1], limit=2**26)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())
    """
)

PAYLOAD_VALUES = 4 * 1024 * 1024  # 16 MiB of fp32: large beside everything else the relay allocates


@pytest.fixture(scope="module")
def echo_worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("relay") / "worker.sock"
    project = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", ECHO_WORKER, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=project)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield str(path)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def message(arrays: dict[str, Array], **round_config) -> tuple[Message, Context]:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 3, 5, 0
    content = RecordDict({"round": ConfigRecord({"round": 1, **round_config}), "global-step": ArrayRecord(arrays)})
    msg = Message(content=content, dst_node_id=5, message_type=MessageType.TRAIN)
    TaskIdentity.node_id = 5
    context = Context(run_id=3, node_id=5, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                      run_config={"round-timeout-s": 60.0})  # fmt: skip
    return msg, context


def test_the_relay_moves_the_payload_both_ways_with_one_copy_of_the_values(echo_worker):
    """The values come back bit for bit as npy payloads Flower reads (`Array.numpy()`), of the dtypes
    the wire uses; and the relay's own allocations peak at 1.2x the payload: the one copy of the reply
    into `bytes`. (Before, `Array.numpy()`, the StreamReader's buffer and `Array(ndarray)` took 3-4x.)"""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(PAYLOAD_VALUES, dtype=np.float32)
    sent = {"values": Array(values), "scales": Array(rng.integers(-128, 127, 1000, dtype=np.int8)),
            "layout": Array(np.frombuffer(b'{"w": [4, 4]}', np.uint8))}  # fmt: skip
    msg, context = message(sent)
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        reply = relay_to_worker(msg, context, echo_worker)
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not reply.has_error(), reply.error
    update = reply.content["update"]
    for name, array in sent.items():
        back = update[name]
        assert isinstance(back.data, bytes) and back.stype == SType.NUMPY
        assert (back.dtype, back.shape) == (array.dtype, array.shape)
        np.testing.assert_array_equal(back.numpy(), array.numpy())
    assert reply.content["metrics"]["received-bytes"] == values.nbytes + 1000 + 13
    print(f"relay of {values.nbytes / 2**20:.0f} MiB each way: {seconds:.3f} s, peak {peak / values.nbytes:.2f}x")
    assert peak < 1.2 * values.nbytes, f"peak {peak:,} bytes for a {values.nbytes:,}-byte payload"


def test_a_payload_that_is_not_npy_is_refused_in_one_line_before_the_worker_is_asked(tmp_path):
    """No worker is running at the path: the refusal comes from the payload, not the connection."""
    bad = Array(dtype="float32", shape=(4,), stype=SType.NUMPY, data=b"\x93NUMPY not a header")
    msg, context = message({"values": bad})
    reply = relay_to_worker(msg, context, str(tmp_path / "absent.sock"))
    assert reply.has_error()
    assert reply.error.reason == "message from the server: unreadable array global-step/values: ValueError"


def test_a_reply_shorter_than_it_declares_is_refused_by_what_arrived(echo_worker):
    msg, context = message({"values": Array(np.zeros(4, np.float32))}, mode="truncate")
    reply = relay_to_worker(msg, context, echo_worker)
    assert reply.has_error()
    assert "ProtocolError: the frame ended after 12 of the 16 bytes of array 'w'" in reply.error.reason
    # and the protocol's own answer, below the relay
    with pytest.raises(ProtocolError, match="ended after 12 of the 16 bytes"):
        asyncio.run(request(echo_worker, {"round": {"mode": "truncate"}}, {}, timeout_s=10, prefix=npy_header))


def test_a_reply_declaring_more_than_it_sends_allocates_only_what_arrived():
    """The relay reads its own worker's reply without a bound; a header declaring 2^49 bytes (512 TiB)
    that sends 10 gets one line (the mapping refused, or the frame ended early), and the process's
    peak memory does not grow by what was declared: the buffer is mapped, its pages made as bytes arrive."""
    left, right = socket.socketpair()
    header = b'{"metrics": {}, "protocol-version": %d, ' % PROTOCOL_VERSION
    header += b'"arrays": [{"name": "w", "dtype": "int8", "shape": [562949953421312]}]}'
    right.sendall(len(header).to_bytes(8, "big") + header + bytes(10))
    right.close()

    async def read():
        left.setblocking(False)
        return await recv(SocketReader(asyncio.get_running_loop(), left), prefix=npy_header)

    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with left, pytest.raises(ProtocolError) as refused:
        asyncio.run(read())
    assert str(refused.value) in (
        "array 'w' declares 562,949,953,421,312 bytes; more than this machine can map",
        "the frame ended after 10 of the 562,949,953,421,312 bytes of array 'w'",
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 * 1024  # KiB


def test_the_relay_stamps_its_handler_start_last_byte_sent_and_cpu(echo_worker):
    """What splits the ``clientapp_relay`` leg (round_stats.CLIENTAPP_RELAY_PARTS): the handler's start
    (Flower's pull done), the request's last byte in the worker's socket, the reply; and the process's CPU
    seconds at the start and at the reply. The server's checks accept them (messages.metrics_from_record)."""
    from parablock_flwr.messages import TrainMetrics, key, metrics_from_record

    msg, context = message({"values": Array(np.ones(1000, np.float32))})
    before = time.time()
    metrics = dict(relay_to_worker(msg, context, echo_worker).content["metrics"])
    assert before <= metrics["clientapp-handler-start"] <= metrics["clientapp-sent"] <= metrics["clientapp-reply"]
    assert 0 < metrics["clientapp-pull-cpu-s"] <= metrics["clientapp-cpu-s"]
    required = {"server-round": 1, "block": 0, "partition-id": 0, "base-version": 0, "num-examples": 1.0,
                "train-loss": 0.0, "compute-s": 0.0}  # fmt: skip
    read = metrics_from_record(TrainMetrics, {**metrics, **required})
    assert not isinstance(read, str), read
    fields = {key(name): getattr(read, name) for name in TrainMetrics.__dataclass_fields__}
    assert {k: fields[k] for k in metrics if k.startswith("clientapp-")} == {
        k: v for k, v in metrics.items() if k.startswith("clientapp-")
    }


def test_the_worker_reads_each_array_into_place_as_it_arrives():
    """The worker's side (a StreamReader, as ``asyncio.start_unix_server`` gives it): a 16 MiB array that
    crosses a real socket in many reads comes out bit for bit, read-only, and the reader's own Python
    allocations stay far below its size (the bytes go into a mapping a socket buffer at a time; before,
    ``readexactly`` gathered the whole array in the stream's buffer and copied it out: 2x)."""
    import json
    import threading

    values = np.random.default_rng(1).standard_normal(PAYLOAD_VALUES, dtype=np.float32)
    header = json.dumps({"op": "train", "arrays": [{"name": "w", "dtype": "float32", "shape": [PAYLOAD_VALUES]}],
                         PROTOCOL_KEY: PROTOCOL_VERSION})  # fmt: skip
    left, right = socket.socketpair()
    sender = threading.Thread(target=lambda: (right.sendall(len(header).to_bytes(8, "big") + header.encode()),
                                              right.sendall(memoryview(values)), right.close()))  # fmt: skip

    async def read():
        reader, writer = await asyncio.open_unix_connection(sock=left, limit=2**26)
        try:
            return await recv(reader, lambda header: (values.nbytes, "the test's bound"))
        finally:
            writer.close()

    tracemalloc.start()
    try:
        sender.start()
        _, arrays = asyncio.run(read())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sender.join()
    np.testing.assert_array_equal(arrays["w"], values)
    assert not arrays["w"].flags.writeable
    assert peak < 0.25 * values.nbytes, f"peak {peak:,} bytes for a {values.nbytes:,}-byte array"

"""The direct transport's stream service on loopback with TLS: the time to upload and to download a
block record of each size (synthetic bytes), with the SHA-256 check included, beside a plain TLS
socket of Python's standard library moving the same bytes one way with a SHA-256 at the receiver.

Upload: a node's update; the time from the call to the server's acceptance, which includes the
server hashing and assembling the bytes (the node's own SHA-256 is computed once for its Flower
reply, so it is timed on its own, in its own column). Download: the server's published record; the
time to the client holding the bytes, checked against the announced size and SHA-256. Socket: the
same bytes through ``ssl`` on a TCP socket in 4 MiB sends, hashed at the receiver, not assembled.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import write_report
from parablock_flwr.memory import HUGE_PAGES, huge_pages_asked, map_large_buffers
from parablock_flwr.tools.credentials import make_tls
from parablock_flwr.transport import Direction, TransportClient, TransportServer

CHUNK = 4 * 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sizes-mb", type=float, nargs="+", default=[14, 70.8, 212, 1000], help="record sizes in MB (1e6 B)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="runs per size and path, the paths taking turns; the best is reported"
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or any(s <= 0 for s in args.sizes_mb):
        p.error(f"--repeats {args.repeats}, --sizes-mb {args.sizes_mb}; expected positive numbers")
    return args


def best_interleaved(fns, repeats: int) -> list[float]:
    """The fastest of ``repeats`` timed calls of each of ``fns``, in seconds, the paths taking turns
    so that a change in the machine's load falls on all of them alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            started = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - started)
    return [min(spent) for spent in times]


def grpc_paths(server: TransportServer, client: TransportClient, data: bytes, digest: str, tag: str):
    """(upload, download, retire): one transfer of ``data`` through the service each, a fresh
    capability per call."""
    counter = iter(range(10**6))

    def upload():
        t = server.registry.issue(1, 1, 1, Direction.UPLOAD, f"up/{tag}/{next(counter)}", ttl_s=600, max_size=len(data))
        client.upload(t, data, digest)
        assert server.inbox.claim(1, 1, 1, t.record, digest) is not None  # accepted, then freed

    record = server.outbox.publish(f"down/{tag}", data=data)

    def download():
        t = server.registry.issue(1, 1, 1, Direction.DOWNLOAD, record.name, ttl_s=600)
        client.download(t, record.size, record.sha256)

    return upload, download, lambda: server.outbox.retire(record.name)


def socket_path(tls, data: bytes):
    """(send, close): one move of ``data`` over a stdlib TLS socket, the receiver hashing it."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tls.server_cert, tls.server_key)
    client_ctx = ssl.create_default_context(cafile=str(tls.ca_cert))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def receive_one():
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as s:
            buf, digest, got = bytearray(CHUNK), hashlib.sha256(), 0
            view = memoryview(buf)
            while got < len(data):
                n = s.recv_into(view)
                if not n:
                    break
                digest.update(view[:n])
                got += n
            s.sendall(digest.digest())

    def once():
        receiver = threading.Thread(target=receive_one)
        receiver.start()
        with client_ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as s:
            view = memoryview(data)
            for start in range(0, len(data), CHUNK):
                s.sendall(view[start : start + CHUNK])
            assert s.recv(32) == hashlib.sha256(data).digest()
        receiver.join()

    return once, listener.close


def main(argv=None) -> None:
    args = parse_args(argv)
    map_large_buffers()  # as the node worker and a deployment's ServerApp allocate (their huge pages: the environment)
    rows, rng, load_before = [], np.random.default_rng(0), load_average()
    with tempfile.TemporaryDirectory() as folder:
        tls = make_tls(Path(folder))
        server = TransportServer(address="127.0.0.1:0", cert_file=tls.server_cert, key_file=tls.server_key)
        server.start()
        try:
            with TransportClient(f"localhost:{server.port}", ca_file=tls.ca_cert) as client:
                for size_mb in args.sizes_mb:
                    data = rng.bytes(int(size_mb * 1e6))
                    started = time.perf_counter()
                    digest = hashlib.sha256(data).hexdigest()
                    hash_s = time.perf_counter() - started
                    upload, download, retire = grpc_paths(server, client, data, digest, f"{size_mb:g}")
                    send, close = socket_path(tls, data)
                    try:
                        up, down, sock = best_interleaved([upload, download, send], args.repeats)
                    finally:
                        retire()
                        close()
                    rows.append((size_mb, hash_s, up, down, sock))
                    print(f"{size_mb:g} MB: upload {up:.2f} s, download {down:.2f} s, socket {sock:.2f} s", flush=True)
                    del data
        finally:
            stop_and_count = server.refusals.counts()
            server.stop()
    assert not stop_and_count, f"refusals during the benchmark: {stop_and_count}"
    report = table(rows, args, load_before, load_average())
    print(report)
    print(f"written to {write_report('transport', 'The direct transport on loopback with TLS', report, __doc__)}")


def load_average() -> float:
    """The machine's 1-minute load average (the machine is shared: the figures say how busy it was)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def table(rows, args, load_before: float, load_after: float) -> str:
    mbs = lambda size_mb, s: f"{size_mb / s:.0f}"  # noqa: E731
    huge = "yes" if huge_pages_asked() else f"no (GLIBC_TUNABLES={HUGE_PAGES} asks for them, as tools.launch does)"
    lines = [
        f"Best of {args.repeats} per size and path, the paths taking turns in one run, so the ratios compare "
        f"paths under the same "
        f"load: 1-minute load average {load_before:.1f} at the start and {load_after:.1f} at the end "
        f"on {os.cpu_count()} CPUs shared with other work. Buffers of 1 MiB or more mapped as the node worker and "
        f"the ServerApp map them (``memory.map_large_buffers``); huge pages: "
        f"{huge}.",
        "",
        "| size (MB) | SHA-256 once (s) | upload (s) | upload MB/s | download (s) | download MB/s "
        "| TLS socket (s) | socket MB/s | upload / socket | download / socket |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size_mb, hash_s, up, down, sock in rows:
        lines.append(
            f"| {size_mb:g} | {hash_s:.2f} | {up:.2f} | {mbs(size_mb, up)} | {down:.2f} | {mbs(size_mb, down)} "
            f"| {sock:.2f} | {mbs(size_mb, sock)} | {up / sock:.2f} | {down / sock:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

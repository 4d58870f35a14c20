"""A TCP proxy that delays every byte by a fixed one-way latency, in both directions.

This kernel has no `netem`, so `tc` can limit a link's rate but cannot delay
it. benchmarks/network.py therefore puts this proxy on each node's path (in
the node's namespace, between its SuperNode and the SuperLink): each chunk
read from one side is held until ``delay`` after it arrived, then written to
the other side, in arrival order. Chunks are pipelined, so a bulk transfer
gains the delay once and keeps its rate; a request/response gains twice the
delay, as over a real link.

    python benchmarks/latency_proxy.py --listen 127.0.0.1:9092 --target 10.213.0.1:9093 --delay-ms 50

When it stops (SIGTERM), it prints one line with the bytes it moved each way (``moved_bytes`` reads it):
what crossed the link on this path alone, e.g. a run's stream beside its Flower traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

CHUNK = 64 * 1024
MOVED = "latency_proxy moved"  # the start of the line printed on stopping, then "<up> up <down> down" in bytes


def moved_bytes(log: str) -> tuple[int, int] | None:
    """(up, down) bytes from a stopped proxy's log (up: from the listening side to the target); None when
    the proxy did not say (it did not stop cleanly)."""
    for line in reversed(log.splitlines()):
        if line.startswith(MOVED):
            words = line.split()
            return int(words[2]), int(words[4])
    return None


async def _delayed_copy(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, moved: list[int], way: int
) -> None:
    """Copy reader to writer, each chunk ``delay_s`` after it was read; EOF is delayed the same way. The
    bytes written are added to ``moved[way]``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()  # unbounded: reading never waits on delay

    async def read_side() -> None:
        while chunk := await reader.read(CHUNK):
            queue.put_nowait((loop.time() + delay_s, chunk))
        queue.put_nowait((loop.time() + delay_s, b""))

    async def write_side() -> None:
        while True:
            due, chunk = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            moved[way] += len(chunk)
            await writer.drain()  # the rate limit of the link below pushes back here

    await asyncio.gather(read_side(), write_side())


async def _both_ways(client_r, client_w, server_r, server_w, delay_s: float, moved: list[int]) -> None:
    try:
        async with asyncio.TaskGroup() as tasks:  # an error in one direction cancels the other
            tasks.create_task(_delayed_copy(client_r, server_w, delay_s, moved, 0))
            tasks.create_task(_delayed_copy(server_r, client_w, delay_s, moved, 1))
    except* (ConnectionError, OSError):
        pass  # one side went away: close both


async def _serve_connection(client_r, client_w, target: tuple[str, int], delay_s: float, moved: list[int]) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    try:
        await _both_ways(client_r, client_w, server_r, server_w, delay_s, moved)
    except asyncio.CancelledError:
        pass  # the proxy is stopping (SIGTERM)
    finally:
        for w in (client_w, server_w):
            w.close()


async def serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    moved = [0, 0]  # bytes written towards the target, and back
    server = await asyncio.start_server(lambda r, w: _serve_connection(r, w, target, delay_s, moved), *listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
        print(f"{MOVED} {moved[0]} up {moved[1]} down", flush=True)  # before closing: that may wait on peers


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept connections on")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward them to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every chunk")
    args = parser.parse_args()
    if args.delay_ms < 0:
        parser.error(f"--delay-ms={args.delay_ms}: expected a number >= 0")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, args.target, args.delay_ms / 1e3))


if __name__ == "__main__":
    main()

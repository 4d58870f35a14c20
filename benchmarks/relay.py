"""The deployment ClientApp's relay on its own: time and peak memory of ``relay_to_worker`` moving one
block to a node worker's socket and back, this checkout against the code of a commit (issue 23).

A fresh process per variant builds a Flower ``Message`` holding a packed block (one fp32 ``values``
array of the given size, as the server sends it), then relays it ``--repeats`` times to a stand-in
worker (``ECHO_WORKER``: the worker protocol, echoing the arrays as the update; no model, so only what
the relay does to the bytes is measured). Peak = the process's high-water RSS less its RSS before the
first relay (the Message itself excluded).

    .venv/bin/python -m benchmarks.relay                       # 70.8 MB, this checkout against 083d97a
    .venv/bin/python -m benchmarks.relay --mb 212 --before 083d97a --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from benchmarks.common import PROJECT_DIR, command

# A worker that echoes each array it receives as the update's array of the same name, unless the
# request's round says "truncate": then it declares 16 bytes, sends 12 and closes (tests/test_relay.py).
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

# One variant's measurement, in a process of its own (argv: socket path, MB, repeats).
CHILD = textwrap.dedent(
    """
    import json, subprocess, sys, time
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from parablock_flwr.client_apps.app import relay_to_worker

    def kib(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])

    path, mb, repeats, echo = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    worker = subprocess.Popen([sys.executable, "-c", echo, path], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    values = np.random.default_rng(0).standard_normal(int(mb * 1e6 / 4), dtype=np.float32)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 3, 5, 0
    content = RecordDict({"round": ConfigRecord({"round": 1}), "global-step": ArrayRecord({"values": Array(values)})})
    msg = Message(content=content, dst_node_id=5, message_type=MessageType.TRAIN)
    TaskIdentity.node_id = 5
    context = Context(run_id=3, node_id=5, node_config={}, state=RecordDict(), run_config={"round-timeout-s": 600.0})
    del values
    before, seconds = kib("VmRSS"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reply = relay_to_worker(msg, context, path)
        seconds.append(time.perf_counter() - t0)
        assert not reply.has_error(), reply.error
        del reply
    worker.terminate()
    print(json.dumps({"seconds": seconds, "peak_mb": (kib("VmHWM") - before) * 1024 / 1e6}))
    """
)


def measure(code: Path, mb: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="relay-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(code)}
        out = subprocess.run([sys.executable, "-c", CHILD, f"{tmp}/w.sock", str(mb), str(repeats), ECHO_WORKER],
                             env=env, cwd=code, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def export(commit: str, folder: Path) -> Path:
    """The code of ``commit`` (git archive), made once."""
    if not folder.exists():
        folder.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(PROJECT_DIR), "archive", commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=70.8, help="the block's fp32 MB (default 70.8: 5 SmolLM2 layers)")
    p.add_argument("--before", default="083d97a", help="the commit to compare with (default: before the cut)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{command('relay')}; load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="relay-code-") as tmp:
        variants = {args.before: export(args.before, Path(tmp) / args.before), "this checkout": PROJECT_DIR}
        results = {name: measure(code, args.mb, args.repeats) for name, code in variants.items()}
    print(f"| code | relay of {args.mb:g} MB each way, s (each repeat) | peak RSS growth MB |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in r['seconds'])} | {r['peak_mb']:.0f} |")
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Flower's own floor: a ServerApp that pushes an ArrayRecord and a ClientApp that returns one, no model.

``benchmarks/window.py`` copies this file into an app folder of its own (with a pyproject.toml naming
``server`` and ``client``) and runs it through the same local deployment as the real app, with the
same payload sizes: what it measures is what Flower 1.42's processes cost to move the bytes, below
anything this project does. Every round sends fresh random arrays (Flower names objects by their
content hash, so a repeated payload could be found already stored), and the client returns the
negated arrays, the same size back.

With ``messages-ahead = 1`` the server pushes round r+1's message before it pulls round r's reply, so that
the SuperNode, which handles one message at a time and sleeps 3 s when it finds none, finds the next one
waiting as soon as it has pushed a reply: a round then costs Flower's cycle per message (the ClientApp's
start, its pull and its reply's push), not its round trip; it is the least a round can cost while each
round sends each node one Flower message, whatever moves its bytes.

The times written (wall clock, comparable on one host), per round: ``push_start`` / ``pushed`` (the
server's ``Grid.push_messages``), ``clientapp_start`` (the ClientApp process), ``handler_start`` (the
message in the handler's hands), ``handler_end`` (the reply built), ``pulled`` (the server holding it); and
CPU seconds: the ClientApp process's at its handler's start and end, the ServerApp's in the round.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp


def _process_start_time() -> float:
    """When this process started (Linux /proc), as the project's ClientApp reads it."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")


_PROCESS_STARTED = _process_start_time()
server = ServerApp()
client = ClientApp()


def payload(nbytes: int, arrays: int, seed: int) -> list[np.ndarray]:
    """``arrays`` float32 arrays of ``nbytes`` in all, random (no two chunks alike); none for 0 bytes, so that
    the messages carry Flower's control data alone (its floor)."""
    if nbytes <= 0:
        return []
    rng = np.random.default_rng(seed)
    per = max(1, nbytes // 4 // arrays)
    return [rng.random(per, dtype=np.float32) for _ in range(arrays)]


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, nbytes, arrays = int(cfg["rounds"]), int(cfg["payload-bytes"]), int(cfg["arrays"])
    pull_interval_s = float(cfg["pull-interval-s"])
    while not (nodes := list(grid.get_node_ids())):
        time.sleep(0.2)
    ahead = int(cfg.get("messages-ahead", 0))
    pending = {}  # round -> (push_start, pushed, CPU s at push, message ids)

    def push(r: int) -> None:
        data = payload(nbytes, arrays, seed=r)  # made before the clock starts: the app has its update ready too
        push_start, cpu_at_push = time.time(), time.process_time()
        record = ArrayRecord({f"a{i}": Array(a) for i, a in enumerate(data)})
        msg = Message(RecordDict({"payload": record}), dst_node_id=nodes[0], message_type="train", ttl=3600.0)
        ids = [mid for mid in grid.push_messages([msg]) if mid]
        pending[r] = (push_start, time.time(), cpu_at_push, ids)

    rows, next_push = [], 1
    for r in range(1, rounds + 1):
        while next_push <= min(r + ahead, rounds):
            push(next_push)
            next_push += 1
        push_start, pushed, cpu_at_push, ids = pending.pop(r)
        replies: list[Message] = []
        while not replies:
            replies = list(grid.pull_messages(ids))
            if not replies:
                time.sleep(pull_interval_s)
        pulled = time.time()
        times = dict(replies[0].content["times"])
        rows.append({"round": r, "push_start": push_start, "pushed": pushed, "pulled": pulled, **times,
                     "server_cpu_s": time.process_time() - cpu_at_push})  # push to pull  # fmt: skip
        del replies
    out = Path(str(cfg["output-dir"])).expanduser() / f"floor-{context.run_id}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps({"payload_bytes": nbytes, "arrays": arrays, "messages_ahead": ahead,
                                                "rounds": rows}))  # fmt: skip


@client.train()
def train(msg: Message, context: Context) -> Message:
    handler_start, pull_cpu = time.time(), time.process_time()
    arrays = {name: array.numpy() for name, array in msg.content["payload"].items()}
    reply = ArrayRecord({name: Array(-a) for name, a in arrays.items()})
    times = {"clientapp_start": _PROCESS_STARTED, "handler_start": handler_start, "handler_end": time.time(),
             "clientapp_pull_cpu_s": pull_cpu, "clientapp_cpu_s": time.process_time()}  # fmt: skip
    return Message(
        RecordDict({"payload": reply, "times": MetricRecord(times), "ok": ConfigRecord({"n": len(arrays)})}),
        reply_to=msg,
    )

"""Flower's simulation plumbing without Ray, for tests that drive a strategy in-process.

A real ``InMemoryLinkState`` and ``InMemoryGrid`` (what a ServerApp gets in simulation), and nodes
as threads that pull their messages from the LinkState and store their replies, as the
simulation engine's workers do (flwr/server/superlink/fleet/vce/vce_api.py): TTLs, expiry,
unavailable nodes and late replies behave as in Flower. What a node answers is the test's
``answer(node_index, message)``: a reply content, an ``Error``, or ``None`` for no reply; or the
project's real ClientApp, run in this process (``client_app_answer``).

Run as a script (``python tests/federation.py RUN_CONFIG_JSON NUM_NODES``) it is a whole run without
Ray: the project's ServerApp against nodes that run its real ClientApp (``run_server_app``), in one
process that a crash test may SIGKILL (``PARABLOCK_CRASH_AT``), server and nodes together, as if
their machine had died (tests/helpers.py, ``simulate_in_process``).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from uuid import uuid4

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, SUPERLINK_NODE_ID
from flwr.common.serde import recorddict_to_proto
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

REJECT_ENV = "PARABLOCK_TEST_REJECT"
Answer = Callable[[int, Message], RecordDict | Error | Message | None]


def client_app_answer(run_config: dict, num_nodes: int, node_configs: list[dict] | None = None) -> Answer:
    """The project's ClientApp (the simulation's inline path), one node's message at a time as one
    Ray actor would serve them, each node with its own Context (partition, ``context.state``, and
    ``node_configs[i]``'s keys: a site's own ``dataset``)."""
    from flwr.app import Context

    from parablock_flwr.client_apps.app import app

    contexts = [
        Context(
            run_id=1,
            node_id=i,
            node_config={"partition-id": i, "num-partitions": num_nodes, **(node_configs or [{}] * num_nodes)[i]},
            state=RecordDict(),
            run_config=dict(run_config),
        )  # fmt: skip
        for i in range(num_nodes)
    ]
    lock = threading.Lock()

    def answer(index: int, msg: Message) -> Message:
        with lock:
            return app(msg, contexts[index])

    return answer


class InMemoryFederation:
    """``num_nodes`` node threads answering through a real LinkState; ``grid`` is the server's."""

    def __init__(self, num_nodes: int, answer: Answer, heartbeat_s: float = 1e9):
        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
        self.state = factory.state()
        run = Run.create_empty(run_id=1)
        run.primary_task_id, run.federation_id = 1, NOOP_FEDERATION_ID
        self.state.run_ids[run.run_id] = RunRecord(run=run)
        self.state.task_store[1] = Task(task_id=1, run_id=run.run_id)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run.run_id, SUPERLINK_NODE_ID, 1
        self.grid = InMemoryGrid(state_factory=factory)
        self.grid.set_run(run)
        self.nodes: list[int] = []
        for _ in range(num_nodes):
            node = self.state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32), heartbeat_s)
            self.state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=heartbeat_s)
            self.nodes.append(node)
        self.answer = answer
        self.heartbeat_s = heartbeat_s
        self.heartbeat: Callable[[int], bool] = lambda index: True  # does node ``index`` still heartbeat?
        self.stop = threading.Event()
        self.errors: list[Exception] = []  # a message a SuperNode could not have received
        self.threads = [threading.Thread(target=self._serve, args=(i,), daemon=True) for i in range(num_nodes)]

    def __enter__(self) -> InMemoryFederation:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        if self.errors:
            raise AssertionError(f"a message Flower could not serialise: {self.errors[0]}")

    def _serve(self, index: int) -> None:
        node = self.nodes[index]
        while not self.stop.is_set():
            if self.heartbeat(index):
                self.state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=self.heartbeat_s)
            for msg in self.state.get_message_ins(node_id=node, limit=1):
                try:  # as a SuperNode receives it: serialised by protobuf, which takes only ``bytes``
                    recorddict_to_proto(msg.content)
                except TypeError as err:  # said at the federation's exit; the run fails now, not at its timeouts
                    self.errors.append(err)
                    content = Error(code=0, reason=f"not serialisable: {err}")
                else:
                    content = self.answer(index, msg)
                if content is None:
                    continue
                reply = content if isinstance(content, Message) else Message(content, reply_to=msg)
                reply.metadata.__dict__["_message_id"] = str(uuid4())
                self.state.store_message_res(reply)
            time.sleep(0.01)


def run_server_app(run_config: dict, num_nodes: int, node_configs: list[dict] | None = None) -> None:
    """The project's ServerApp (``server_apps.app.app``, as Flower calls it) over this federation,
    each node answering with the project's ClientApp: the simulation's code paths, one process."""
    from flwr.app import Context

    from parablock_flwr.server_apps.app import app

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config))
    with InMemoryFederation(num_nodes, rejecting(client_app_answer(run_config, num_nodes, node_configs))) as federation:
        app(federation.grid, context)


def rejecting(answer: Answer) -> Answer:
    """``answer``, with the reply of node ``I`` in round ``R`` made one the server rejects (it names another
    block) when ``PARABLOCK_TEST_REJECT=I@R``: a rejection at a known place, the same in every run."""
    spec = os.environ.get(REJECT_ENV, "")
    if not spec:
        return answer
    index, server_round = (int(x) for x in spec.split("@"))

    def answer_or_reject(i: int, msg: Message):
        reply = answer(i, msg)
        cfg = msg.content.config_records.get("round")
        if i == index and cfg is not None and int(cfg["server-round"]) == server_round and not reply.has_error():
            reply.content["metrics"]["block"] = 10_000
        return reply

    return answer_or_reject


if __name__ == "__main__":
    configs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None  # each node's own node-config keys
    run_server_app(json.loads(open(sys.argv[1]).read()), int(sys.argv[2]), configs)

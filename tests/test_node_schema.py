"""The node side speaks the message schema (``parablock_flwr/messages.py``) and nothing else: whatever
header reaches the node worker is read through the schema, or refused in one line with the node's state
as it was (that no module but the schema spells a key: tests/test_messages.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parablock_flwr.messages import RoundConfig, WorkerRequest
from parablock_flwr.node import Request, RequestRefused, StateIntact
from parablock_flwr.worker.server import NodeWorker

from helpers import worker_request

# ------------------------------------------------------------------ the worker's door
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
VALID = worker_request({}, 7, 3, block=0, next_block=1, num_partitions=2, **{"catch-up-versions": [1],
                       "catch-up-blocks": [0], "sync-version": 1})  # fmt: skip
header_changes = st.dictionaries(st.sampled_from([*VALID, "protocol-version", "other"]), json_values, max_size=3)
round_changes = st.dictionaries(st.sampled_from([*VALID["round"], "resume-pending-block", "other"]), json_values)


@settings(max_examples=300, deadline=None)
@given(header_changes, round_changes, st.booleans())
def test_any_header_reaches_the_node_read_through_the_schema_or_is_refused_in_one_line(change, round_change, drop):
    """Whatever a peer sends as a request's header: either the worker acts on a well-typed ``WorkerRequest``
    whose round config reads as a ``RoundConfig``, or it answers one line, `state-intact`, and nothing of the
    worker changed (its run, its partition, its cached reply, the node's state). The node itself is not
    run here (each well-formed request is recorded instead): what is tested is the worker's door."""
    header = {**VALID, **change}
    if isinstance(header.get("round"), dict):
        header["round"] = {**header["round"], **round_change}
    if drop:
        header.pop("node", None)
    worker = NodeWorker()
    handled = []
    worker.handle_request = lambda request, arrays, *_: handled.append(request) or ({"metrics": {}}, {})
    before = (worker.run_id, worker.partition_id, worker.answers.last, worker.node.state)
    try:
        reply, arrays = worker.serve_request(header, {})
    finally:
        worker.compute_thread.shutdown()
    if handled:
        request = handled[0]
        assert isinstance(request, WorkerRequest) and request.op in ("train", "evaluate")
        assert isinstance(RoundConfig.from_config(request.round), RoundConfig)
        assert type(request.run_id) is int and type(request.partition_id) is int and request.partition_id >= 0
        return
    assert set(reply) == {"error", "state-intact"} and reply["state-intact"] is True, reply
    assert "\n" not in reply["error"] and arrays == {}
    assert (worker.run_id, worker.partition_id, worker.answers.last, worker.node.state) == before


# ------------------------------------------------------------------ the runtime's door
@pytest.mark.parametrize(
    ("op", "change", "arrays", "reason"),
    [
        ("train", {"server-round": "3"}, {}, "round config: server-round='3' expected an integer"),
        ("train", {}, {}, "round 3: no global-step record; expected g^2"),
        ("train", {"catch-up-versions": [1], "catch-up-blocks": [0]}, {"global-step": {}},
         "round 3: catch-up versions without a catch-up record"),
        ("train", {}, {"global-step": {}, "resume-pending": {}},
         "round 3: a resume-pending record without its block and version"),
        ("train", {"evaluate-version": -1}, {"global-step": {}}, "round config: evaluate-version=-1 expected >= 0"),
        ("evaluate", {}, {"global-step": {}}, "round config: evaluate-version missing from an evaluation"),
    ],
)  # fmt: skip
def test_a_malformed_round_is_refused_by_the_runtime_in_one_line(op, change, arrays, reason):
    """What the schema reads but a round cannot use (a step the message does not carry, a hand-back without
    its block): ``RequestRefused``, a ``StateIntact``, naming it, before the node's state is touched."""
    round_cfg = {**worker_request({}, 7, 3, block=0, next_block=1)["round"], **change}
    with pytest.raises(RequestRefused) as refused:
        Request.parse(op, 7, round_cfg, arrays, 0, 2)
    assert str(refused.value) == reason and isinstance(refused.value, StateIntact)


def test_a_run_config_the_node_cannot_read_is_refused_with_its_state_intact():
    """A request whose run config is invalid changes nothing on the node: its reply says so, and the
    server keeps the node's sync state instead of sending it a full sync."""
    worker = NodeWorker()
    reply, arrays = worker.serve_request(worker_request({"local-steps": "x"}, 7, 1, 0, -1), {})
    assert reply.get("state-intact") is True and "local-steps" in reply["error"] and arrays == {}
    assert "\n" not in reply["error"] and worker.run_id is None and worker.node.state.last_round == 0

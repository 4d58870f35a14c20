"""The message schema (``parablock_flwr/messages.py``): what each side builds, the other reads back
exactly; what a peer sends malformed is a one-line reason, never an exception from deep inside."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parablock_flwr
from parablock_flwr import messages
from parablock_flwr.config import RunConfig
from parablock_flwr.messages import (
    EvaluateMetrics,
    MessageError,
    PartitionAnswer,
    RoundConfig,
    TrainMetrics,
    WorkerReply,
    WorkerRequest,
    metrics_from_record,
    metrics_to_record,
)
from parablock_flwr.versions import PROTOCOL_VERSION


def full_round() -> RoundConfig:
    return RoundConfig(
        server_round=7, block=2, step_block=1, next_block=3, algorithm="parablock", run_dir="/runs/a",
        evaluate_version=6, evaluate_generate=True, resumed_after=4, resume_dir="/runs/old", sync_version=5,
        catch_up_versions=(3, 4), catch_up_blocks=(0, 1), resume_pending_block=1, resume_pending_version=5,
    )  # fmt: skip


def test_a_round_config_reads_back_as_it_was_sent_with_every_field_set_or_none():
    for sent in (full_round(), RoundConfig(server_round=1)):
        assert RoundConfig.from_config(sent.to_config()) == sent
    assert RoundConfig(server_round=1).to_config() == {
        "server-round": 1, "block": -1, "step-block": -1, "next-block": -1, "algorithm": "", "run-dir": "",
        "protocol-version": PROTOCOL_VERSION, "resume-dir": "",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"server-round": "7"}, "round config: server-round='7' expected an integer"),
        ({"block": 1.5}, "round config: block=1.5 expected an integer"),
        ({"catch-up-versions": [1, 2], "catch-up-blocks": [0]}, "catch-up-versions and catch-up-blocks differ"),
        ({"catch-up-versions": ["v1"], "catch-up-blocks": [0]}, "catch-up-versions=['v1'] expected a list"),
        ({"run-dir": 3}, "run-dir=3 expected a string"),
    ],
)
def test_a_malformed_round_config_is_one_line_naming_the_field(change, reason):
    with pytest.raises(MessageError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        RoundConfig.from_config({**full_round().to_config(), **change})
    with pytest.raises(MessageError, match="server-round missing"):
        RoundConfig.from_config({})


def train_metrics(**extra) -> TrainMetrics:
    return TrainMetrics(server_round=3, block=1, partition_id=0, base_version=1, num_examples=12.0,
                        train_loss=0.5, compute_s=1.25, **extra)  # fmt: skip


def test_train_metrics_travel_flat_and_read_back_typed_with_an_evaluation():
    sent = train_metrics(own_data=1, waited_s=0.1,
                         evaluation=EvaluateMetrics(eval_version=2, heldout_loss=1.5, heldout_examples=8))  # fmt: skip
    record = metrics_to_record(sent)
    assert record["eval-version"] == 2 and record["own-data"] == 1 and "evaluation" not in record
    assert metrics_from_record(TrainMetrics, record) == sent
    assert metrics_from_record(TrainMetrics, metrics_to_record(train_metrics())) == train_metrics()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"num-examples": "12"}, "metric num-examples='12': expected a finite number"),
        ({"block": 1.0}, "metric block=1.0: expected an integer"),
        ({"train-loss": float("nan")}, "metric train-loss=nan: expected a finite number"),
        ({"waited-s": -1.0}, "metric waited-s=-1.0: expected >= 0"),
        ({"own-data": 2}, "metric own-data=2: expected 0 or 1"),
        ({"partition-id": -1}, "metric partition-id=-1: expected >= 0"),
        ({"heldout-loss": 1.0}, "without eval-version, heldout-examples: expected all or none"),
        ({"task-accuracy": 0.5}, "task-accuracy without heldout-loss"),
        ({"eval-version": 1, "heldout-loss": 1.0, "heldout-examples": 0}, "heldout-examples=0: expected > 0"),
        ({"eval-version": 1, "heldout-loss": 1.0, "heldout-examples": 2, "task-accuracy": 1.5, "task-examples": 2},
         "task-accuracy=1.5: expected at most 1"),
    ],
)  # fmt: skip
def test_malformed_metrics_are_a_reason_naming_the_metric(change, reason):
    got = metrics_from_record(TrainMetrics, {**metrics_to_record(train_metrics()), **change})
    assert isinstance(got, str) and reason in got


def test_a_reply_without_a_required_metric_names_it():
    record = metrics_to_record(train_metrics())
    del record["compute-s"]
    assert metrics_from_record(TrainMetrics, record) == "missing metric 'compute-s'"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
evaluation_keys = [messages.key(f.name) for f in dataclasses.fields(EvaluateMetrics)]
metric_keys = st.sampled_from([messages.key(f.name) for f in dataclasses.fields(TrainMetrics)] + evaluation_keys)
round_keys = st.sampled_from(list(full_round().to_config()) + ["other"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(metric_keys, json_values), st.dictionaries(round_keys, json_values))
def test_whatever_a_peer_sends_is_read_or_refused_in_one_line(metrics, round_config):
    for base in ({}, metrics_to_record(train_metrics())):
        got = metrics_from_record(TrainMetrics, {**base, **metrics})
        assert isinstance(got, TrainMetrics) or (isinstance(got, str) and "\n" not in got)
    try:
        RoundConfig.from_config({**full_round().to_config(), **round_config})
    except MessageError as err:
        assert "\n" not in str(err)


def test_the_worker_frames_and_the_partition_answer_read_back():
    request = WorkerRequest("train", 5, {"model": "m"}, full_round().to_config(), 2, 4, {"dataset": "d.jsonl"})
    assert WorkerRequest.from_header(request.to_header()) == request
    assert request.server_round == 7
    assert WorkerRequest.from_header({"op": "ping"}) == WorkerRequest("ping")
    with pytest.raises(MessageError, match="op='fit' expected one of train, evaluate, ping"):
        WorkerRequest.from_header({"op": "fit"})
    with pytest.raises(MessageError, match="partition-id=-1 expected an integer >= 0"):
        WorkerRequest.from_header({**request.to_header(), "partition-id": -1})
    for reply in (WorkerReply(metrics={"a": 1}, trace={"t": "x"}), WorkerReply(error="e", state_intact=True),
                  WorkerReply(pid=12, run_id=5)):  # fmt: skip
        assert WorkerReply.from_header(reply.to_header()) == reply
    assert PartitionAnswer.from_record(PartitionAnswer(3).to_record()) == PartitionAnswer(3)
    evaluated = messages.EvaluateReply(2, EvaluateMetrics(eval_version=4, heldout_loss=1.0, heldout_examples=3))
    assert messages.EvaluateReply.from_record(evaluated.to_record()) == evaluated
    assert messages.EvaluateReply.from_record({"partition-id": 1}) == "missing metric 'eval-version'"
    assert PartitionAnswer.from_record({"partition-id": "3"}) is None


# ------------------------------------------------------------------ one module spells the keys
PACKAGE = Path(parablock_flwr.__file__).parent
# Where a plain word that is a message key (``block``, ``round``, ``train``) means the message's: the node side
# and the algorithms. Elsewhere such words name the fields of what a run writes to disk, the CLI's commands and
# the run config's values; a key with a hyphen (``server-round``) is a message's everywhere.
MESSAGE_SIDE = [
    *PACKAGE.glob("node/*.py"),
    *PACKAGE.glob("node*.py"),
    PACKAGE / "replica.py",
    *PACKAGE.glob("worker/*.py"),
    *PACKAGE.glob("client_apps/*.py"),
    PACKAGE / "runtime.py",
    PACKAGE / "evaluation.py",
    PACKAGE / "training.py",
    *PACKAGE.glob("strategies/**/*.py"),
]
RECORD_FIELDS = {"round", "block", "algorithm", "node"}  # also fields of the records on disk (metrics.jsonl)
# Strings equal to a message key that are another schema's own key, each named once as a constant: the node
# config's (``--node-config``) and the metadata of two file formats (the step log, a virtual node's pending).
OTHER_SCHEMAS = {
    ("settings.py", "partition-id"),  # node.settings.PARTITION_ID
    ("settings.py", "num-partitions"),  # node.settings.NUM_PARTITIONS
    ("replica.py", "block"),  # replica.STEP_FILE_BLOCK
    ("state.py", "block"),  # PendingStore.BLOCK
    ("state.py", "base-version"),  # PendingStore.BASE_VERSION
    ("config.py", "heldout-examples"),  # the run config's key; the evaluation's metric has its name
}


def message_keys() -> set[str]:
    """Every key and record name a message carries, and the worker request's operations."""
    names = {*messages.BLOCK_RECORDS, messages.ROUND, messages.UPDATE, messages.METRICS, messages.TRACE}
    names |= {messages.LOCAL_MODEL_DIGEST, messages.NODE, messages.PROTOCOL_KEY, *WorkerRequest.OPS}
    for cls in vars(messages).values():
        if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == messages.__name__:
            names |= {messages.key(f.name) for f in dataclasses.fields(cls)}
    return names


def spelled(path: Path, keys: set[str], root: Path = PACKAGE) -> list[str]:
    """``file:line key`` for each string literal equal to a key (docstrings aside: they name keys in prose)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in keys
        and id(node) not in docstrings
        and (path.name, node.value) not in OTHER_SCHEMAS
    ]


def keys_read_in(path: Path, keys: set[str]) -> set[str]:
    """The keys that must not be spelled in ``path`` (``MESSAGE_SIDE``)."""
    if path in MESSAGE_SIDE:
        return keys - RECORD_FIELDS if path.is_relative_to(PACKAGE / "strategies") else keys
    return {k for k in keys if "-" in k}


def test_no_module_but_the_schema_spells_a_message_key():
    keys = message_keys()
    assert {"server-round", "global-step", "partition-id", "run-id", "state-intact", "train"} <= keys
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "messages.py"]
    found = [hit for path in modules for hit in spelled(path, keys_read_in(path, keys))]
    assert found == [], "message keys spelled outside messages.py: " + ", ".join(found)


def test_no_benchmark_or_script_spells_a_message_key():
    """The tools beside the package (a benchmark that drives a node worker) build messages through the
    schema too. A run config's own keys are theirs to spell (``num-examples`` also names a metric)."""
    project = Path(__file__).resolve().parents[1]
    tools = sorted([*project.glob("benchmarks/**/*.py"), *project.glob("scripts/**/*.py")])
    keys = {k for k in message_keys() if "-" in k} - set(RunConfig().as_run_config())
    assert tools and "server-round" in keys
    found = [hit for path in tools for hit in spelled(path, keys, project)]
    assert found == [], "message keys spelled in benchmarks/ or scripts/: " + ", ".join(found)


def test_the_scan_finds_a_key_spelled_in_a_module(tmp_path):
    """The scan above can fail: a module that reads a key by its string is found."""
    module = tmp_path / "reader.py"
    module.write_text('"""Reads ``server-round``."""\n\ndef read(config):\n    return config["server-round"]\n')
    assert spelled(module, message_keys(), tmp_path) == ["reader.py:4 'server-round'"]


# ------------------------------------------------------------------ transport = "direct"
def offer() -> messages.TransportOffer:
    ref = messages.RecordOffer(messages.GLOBAL_STEP, "r3/global-step/1", 1234, "ab" * 32, "cd" * 32)
    return messages.TransportOffer("server.example:9095", 2**64 - 1, 2**63 + 5, 3, "-----BEGIN CERTIFICATE-----",
                                   records=(ref,), upload_name="r3/update/5", upload_token="ef" * 32,
                                   upload_max_size=10**6, ahead_upload_name="r4/update/5", ahead_upload_token="ab" * 32,
                                   ahead_upload_max_size=10**6, ahead_step_name="r4/global-step",
                                   ahead_step_token="ba" * 32, ahead_step_max_size=10**6, message_name="r3/message/5",
                                   message_token="dc" * 32, message_max_size=2**20,
                                   message_key="ed" * 32)  # fmt: skip


def test_no_capability_or_key_is_in_a_repr():
    """An offer, its records and a ticket print (a log line, an error, a debugger) without the secrets they
    carry: every token and key is left out of their repr."""
    from parablock_flwr.transport import Direction, Ticket

    tokens = {f"{i:02x}" * 32 for i in range(7)}
    names = ("upload_token", "reply_token", "ahead_upload_token", "ahead_step_token", "ahead_message_token",
             "ahead_message_key", "message_token")  # fmt: skip
    secret = dict(zip(names, sorted(tokens), strict=True))
    ref = messages.RecordOffer(messages.GLOBAL_STEP, "r3/global-step/1", 1234, "ab" * 32, "77" * 32)
    full = dataclasses.replace(offer(), records=(ref,), message_key="88" * 32, **secret)
    ticket = Ticket(bytes.fromhex("99" * 32), 1, 2, 3, Direction.UPLOAD, "r3/update/5")
    printed = " ".join([repr(full), str(full), repr(ref), repr(ticket), str(ticket)])
    for value in [*tokens, "77" * 32, "88" * 32, "99" * 32]:
        assert value not in printed, value
    assert "r3/global-step/1" in printed and "r3/update/5" in printed  # what is not secret still shows


def test_a_transport_offer_and_a_commit_read_back():
    assert messages.TransportOffer.from_config(offer().to_config()) == offer()
    commit = messages.UpdateCommit(12, "0f" * 32)
    assert messages.UpdateCommit.from_config(commit.to_config()) == commit
    request = WorkerRequest("train", 5, {}, full_round().to_config(), 2, 4, {}, offer().to_config())
    assert WorkerRequest.from_header(request.to_header()) == request
    legacy = {k: v for k, v in request.to_header().items() if k != messages.key("stream_offer")}  # none sent
    assert WorkerRequest.from_header(legacy).stream_offer == {}
    reply = WorkerReply(metrics={"a": 1}, stream_commit=commit.to_config())
    assert WorkerReply.from_header(reply.to_header()) == reply


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"run-id": 5}, "run-id=5 expected a decimal id"),
        ({"node-id": str(2**64)}, "node-id='18446744073709551616' expected a decimal id"),
        ({"records-record": ["update"]}, "records-record='update' expected one of global-step"),
        ({"records-size": [-1]}, "records-size=-1 expected a size in bytes"),
        ({"records-token": ["AB" * 32]}, "records-token=(hidden) expected 64 lowercase hex digits"),
        ({"records-sha256": ["ab" * 32, "ab" * 32]}, "records-* lists of lengths [1, 1, 1, 2, 1]"),
        ({"upload-token": "x"}, "upload-name or upload-token malformed"),
        ({"ahead-upload-token": "AB" * 32}, "ahead-upload-name or ahead-upload-token malformed"),
        ({"ahead-step-name": "r4 step"}, "ahead-step-name or ahead-step-token malformed"),
        ({"ahead-step-max-size": -1}, "ahead-step-max-size=-1 expected an integer"),
        ({"message-token": "DC" * 32}, "message-name or message-token malformed"),
        ({"message-max-size": 2**21}, "message-max-size=2097152 expected an integer"),
        ({"message-key": "ED" * 32}, "message-key malformed"),
        ({"insecure": True}, "expected a CA certificate (ca-pem) or insecure, exactly one"),
        ({"address": ""}, "address='' expected a string of 1-300 characters"),
    ],
)
def test_a_malformed_transport_offer_is_one_line_naming_the_field(change, reason):
    with pytest.raises(MessageError) as err:
        messages.TransportOffer.from_config({**offer().to_config(), **change})
    assert reason in str(err.value) and "\n" not in str(err.value)
    assert not any(t * 32 in str(err.value) for t in ("cd", "ef", "ab", "ba", "dc", "ed", "AB", "DC", "ED"))


offer_keys = st.sampled_from(list(offer().to_config()) + ["other"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(offer_keys, json_values), st.sets(offer_keys))
def test_whatever_a_server_sends_as_an_offer_is_read_or_refused_in_one_line(changes, dropped):
    config = {k: v for k, v in {**offer().to_config(), **changes}.items() if k not in dropped}
    try:
        got = messages.TransportOffer.from_config(config)
    except MessageError as err:
        assert "\n" not in str(err) and not any(t * 32 in str(err) for t in ("cd", "ef", "ab", "ba", "dc", "ed"))
        return
    assert all(len(r.token) == 64 for r in got.records) and 0 <= got.upload_max_size
    for name, token in ((got.ahead_upload_name, got.ahead_upload_token), (got.ahead_step_name, got.ahead_step_token),
                        (got.message_name, got.message_token)):  # fmt: skip
        assert not name or len(token) == 64  # a capability ahead is whole or absent
    assert not got.message_name or len(got.message_key) == 64
    assert 0 <= got.message_max_size <= messages.MAX_MESSAGE_CONTENT


# ------------------------------------------------------------------ a message's content on the stream
def test_a_messages_config_records_read_back_from_their_bytes_and_tensors_never_travel_that_way():
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from parablock_flwr.transport.message_bytes import content_from_bytes, content_to_bytes

    content = RecordDict({messages.ROUND: ConfigRecord(full_round().to_config()),
                          messages.OFFER: ConfigRecord(offer().to_config())})  # fmt: skip
    back = content_from_bytes(content_to_bytes(content))
    assert {k: dict(v) for k, v in back.items()} == {k: dict(v) for k, v in content.items()}
    assert content_to_bytes(RecordDict({"a": ArrayRecord({"x": Array(np.zeros(3, np.float32))})})) is None
    assert content_to_bytes(RecordDict({"m": MetricRecord({"x": 1.0})})) is None
    big = RecordDict({"c": ConfigRecord({"x": "y" * (messages.MAX_MESSAGE_CONTENT + 1)})})
    assert content_to_bytes(big) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512) | st.sampled_from([b"\n\x03abc", b"\x0a\x00"]))
def test_any_bytes_on_the_stream_as_a_messages_content_are_config_records_or_one_refusal(data):
    from flwr.app import ConfigRecord

    from parablock_flwr.transport.message_bytes import content_from_bytes

    try:
        content = content_from_bytes(data)
    except MessageError as err:
        assert "\n" not in str(err) and str(err).startswith("message content on the stream:")
        return
    assert all(isinstance(record, ConfigRecord) for record in content.values())


def test_a_replys_content_reads_back_from_its_bytes_and_nothing_else_passes_for_one():
    """A reply's content on the stream (``transport-replies-on-stream``): its metrics, trace and commit read back
    as they were; an update inline, a reply without its commit, or one past ``MAX_REPLY_CONTENT`` is refused."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from parablock_flwr.transport.message_bytes import reply_content, reply_from_bytes, reply_to_bytes

    commit = messages.UpdateCommit(update_size=12, update_sha256="ab" * 32).to_config()
    content = reply_content({"server-round": 3, "train-loss": 1.5}, {"digest": "x"}, commit)
    back = reply_from_bytes(reply_to_bytes(content))
    assert {k: dict(v) for k, v in back.items()} == {k: dict(v) for k, v in content.items()}
    inline = reply_content({"server-round": 3}, {}, commit)
    inline["update"] = ArrayRecord({"x": Array(np.zeros(3, np.float32))})
    uncommitted = reply_content({"server-round": 3}, {}, {})
    for refused in (inline, uncommitted):
        with pytest.raises(MessageError, match="^reply content on the stream: .*expected"):
            reply_from_bytes(reply_to_bytes(refused))
    with pytest.raises(MessageError, match="^reply content: .* expected at most"):
        reply_to_bytes(reply_content({}, {"t": "y" * messages.MAX_REPLY_CONTENT}, commit))
    big = reply_content({}, {}, commit)
    big["c"] = ConfigRecord({"x": "y" * messages.MAX_REPLY_CONTENT})
    with pytest.raises(MessageError, match="^reply content on the stream: .* expected at most"):
        reply_from_bytes(recorddict_bytes(big))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512) | st.sampled_from([b"\n\x03abc", b"\x0a\x00"]))
def test_any_bytes_on_the_stream_as_a_replys_content_are_a_reply_or_one_refusal(data):
    from parablock_flwr.transport.message_bytes import reply_from_bytes

    try:
        content = reply_from_bytes(data)
    except MessageError as err:
        assert "\n" not in str(err) and str(err).startswith("reply content on the stream:")
        return
    assert messages.METRICS in content.metric_records and messages.COMMIT in content.config_records


def recorddict_bytes(content) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return recorddict_to_proto(content).SerializeToString()

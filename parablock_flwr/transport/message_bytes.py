"""A message's content as bytes, for a message pushed a round ahead on the direct transport, and a train reply's
content as bytes, for a reply uploaded on the stream (docs/transport.md).

The server pushes round r+1's message to a node on the stream before round r is aggregated, with only a
capability in it; once it has built the round's real content (its config records: the round's control
data and the offer of its block records, which are on the stream already), it publishes that content on
the stream, and the node's worker (or, without one, its ClientApp, started by Flower in the meantime)
downloads it. Flower's own
protobuf schema (``flwr.common.serde``) carries it: no format of ours. Only config records travel this way;
anything else is refused in one line, before the node acts on it.

A node's worker uploads its train reply's content (metrics, trace, the commit of its update, which went up
first) under the capability its round's offer gave (``reply_*``): the server aggregates it as soon as it is in,
and the same content in Flower's reply, when it comes, is its audit. Only config and metric records travel
this way, at most ``MAX_REPLY_CONTENT`` bytes.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from ..messages import (
    COMMIT,
    MAX_MESSAGE_CONTENT,
    MAX_REPLY_CONTENT,
    METRICS,
    OFFER,
    PROTOCOL_KEY,
    ROUND,
    TRACE,
    MessageError,
    TransportOffer,
    key,
)
from ..versions import mismatch
from .framing import TAG_BYTES, unseal


def content_to_bytes(content: RecordDict) -> bytes | None:
    """``content`` in Flower's protobuf schema; None when it holds anything but config records (tensors
    inline: such a message is pushed on Flower's path) or would be larger than ``MAX_MESSAGE_CONTENT``
    sealed (``transport.framing.seal``)."""
    if content.array_records or content.metric_records:
        return None
    data = recorddict_to_proto(content).SerializeToString()
    return data if len(data) <= MAX_MESSAGE_CONTENT - TAG_BYTES else None  # sealed, at most the bound


def content_from_bytes(data: bytes | bytearray) -> RecordDict:
    """The content ``content_to_bytes`` wrote; anything else (not Flower's schema, a record other than a
    config record) raises ``MessageError`` in one line that names no value."""
    return _records_from_bytes(data, "message content", MAX_MESSAGE_CONTENT, {"config_record": ConfigRecord})


def reply_content(metrics: dict, trace: dict, commit: dict) -> RecordDict:
    """A train reply's content but its update: its metrics (``metrics_to_record``'s entries), its trace and,
    when the update went on the stream, the commit of it (``UpdateCommit.to_config``). The ClientApp's reply and
    the worker's reply on the stream are built here alike."""
    content = RecordDict({METRICS: MetricRecord(metrics)})
    if commit:
        content[COMMIT] = ConfigRecord(commit)
    if trace:
        content[TRACE] = ConfigRecord(trace)
    return content


def reply_to_bytes(content: RecordDict) -> bytes:
    """``reply_content``'s record dict in Flower's protobuf schema, for its upload on the stream; ``MessageError``
    when it is larger than ``MAX_REPLY_CONTENT`` (the reply then goes on Flower's path alone)."""
    data = recorddict_to_proto(content).SerializeToString()
    if len(data) > MAX_REPLY_CONTENT:
        raise MessageError(f"reply content: {len(data)} bytes; expected at most {MAX_REPLY_CONTENT}")
    return data


def reply_from_bytes(data: bytes | bytearray) -> RecordDict:
    """A reply's content as a node uploaded it on the stream: Flower's schema, config and metric records only,
    with its metrics and the commit of its update (an update inline has no place here); else ``MessageError``
    in one line that names no value. The reply checks then read it as they read Flower's reply."""
    kinds = {"config_record": ConfigRecord, "metric_record": MetricRecord}
    content = _records_from_bytes(data, "reply content", MAX_REPLY_CONTENT, kinds)
    if METRICS not in content.metric_records or COMMIT not in content.config_records:
        raise MessageError(f"reply content on the stream: expected its {METRICS} and {COMMIT} records")
    return content


def _records_from_bytes(data: bytes | bytearray, what: str, limit: int, kinds: dict[str, type]) -> RecordDict:
    if len(data) > limit:
        raise MessageError(f"{what} on the stream: {len(data)} bytes; expected at most {limit}")
    try:
        proto = ProtoRecordDict.FromString(bytes(data))
        found = {item.WhichOneof("value") for item in proto.items}
        if found - set(kinds):
            raise MessageError(f"{what} on the stream: records of kind {sorted(found - set(kinds))}; expected "
                               f"{' or '.join(sorted(kinds))} only")  # fmt: skip
        content = recorddict_from_proto(proto)
    except MessageError:
        raise
    except Exception as err:  # protobuf's DecodeError, or a value Flower's records refuse
        raise MessageError(f"{what} on the stream: not a record dict ({type(err).__name__})") from None
    if not all(isinstance(record, tuple(kinds.values())) for record in content.values()):
        raise MessageError(f"{what} on the stream: expected {' or '.join(sorted(kinds))} only")
    return content


def content_ahead(offer: TransportOffer, data: bytes | bytearray) -> RecordDict:
    """The content of ``offer``'s message pushed ahead (its ``message_*``), as downloaded: its HMAC checked under
    the offer's key, read strictly, and for the offer's run, node and round, of this protocol version, with an
    offer of its records; else ``MessageError`` in one line."""
    content = content_from_bytes(unseal(bytes.fromhex(offer.message_key), data))
    sent = TransportOffer.from_config(dict(content[OFFER])) if OFFER in content.config_records else None
    round_config = content[ROUND] if ROUND in content.config_records else None
    round_of = round_config.get(key("server_round")) if round_config is not None else None
    if sent is None or (sent.run_id, sent.node_id, sent.server_round, round_of) != (
        offer.run_id, offer.node_id, offer.server_round, offer.server_round
    ):  # fmt: skip
        raise MessageError("message content on the stream: not for this run, node and round")
    if (problem := mismatch(round_config, PROTOCOL_KEY, "the server", "this node")) is not None:
        raise MessageError(problem)
    return content

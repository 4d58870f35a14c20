"""A message's content as bytes, for a message pushed a round ahead on the direct transport (docs/transport.md).

The server pushes round r+1's message to a node on the stream before round r is aggregated, with only a
capability in it; once it has built the round's real content (its config records: the round's control
data and the offer of its block records, which are on the stream already), it publishes that content on
the stream, and the node's worker (or, without one, its ClientApp, started by Flower in the meantime)
downloads it. Flower's own
protobuf schema (``flwr.common.serde``) carries it: no format of ours. Only config records travel this way;
anything else is refused in one line, before the node acts on it.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from .messages import MAX_MESSAGE_CONTENT, OFFER, PROTOCOL_KEY, ROUND, MessageError, TransportOffer, key
from .transport.framing import TAG_BYTES, unseal
from .versions import mismatch


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
    if len(data) > MAX_MESSAGE_CONTENT:
        raise MessageError(f"message content on the stream: {len(data)} bytes; expected at most {MAX_MESSAGE_CONTENT}")
    try:
        proto = ProtoRecordDict.FromString(bytes(data))
        kinds = {item.WhichOneof("value") for item in proto.items}
        if kinds - {"config_record"}:
            raise MessageError(f"message content on the stream: records of kind {sorted(kinds - {'config_record'})}; "
                               "expected config records only")  # fmt: skip
        content = recorddict_from_proto(proto)
    except MessageError:
        raise
    except Exception as err:  # protobuf's DecodeError, or a value Flower's records refuse
        raise MessageError(f"message content on the stream: not a record dict ({type(err).__name__})") from None
    if not all(isinstance(record, ConfigRecord) for record in content.values()):
        raise MessageError("message content on the stream: expected config records only")
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

"""The first message of every stream: a small JSON header, read strictly before any byte of a record.

A header arrives off the network, so it is parsed defensively: bounded length, UTF-8 JSON object,
exactly the expected fields, each of its type and range. Anything else is one ``bad_header`` refusal
that names the field, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from parablock_flwr.transport.capabilities import TOKEN_BYTES, Direction, RefusalKind, Refused, Ticket

MAX_HEADER_BYTES = 4096
MAX_ID = 2**64 - 1  # Flower's run and node ids are uint64
MAX_SIZE = 2**63 - 1
RECORD_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
HEX64 = re.compile(r"[0-9a-f]{64}")
DIGEST = re.compile(f"(?:{HEX64.pattern})?")  # an upload's declared SHA-256, or empty: it follows the bytes


@dataclass(frozen=True)
class Header:
    """A request: the capability presented, and for an upload the declared size and SHA-256 (hex; empty when
    the client sends it after the bytes, as the stream's last message: it hashes while it sends)."""

    claim: Ticket
    size: int | None = None
    sha256: str | None = None


def encode_header(ticket: Ticket, size: int | None = None, sha256: str | None = None) -> bytes:
    """The header a client sends (upload: with ``size`` and ``sha256``, "" when it follows the bytes)."""
    fields = {
        "token": ticket.token.hex(),
        "run_id": ticket.run_id,
        "node_id": ticket.node_id,
        "round": ticket.round,
        "direction": str(ticket.direction),
        "record": ticket.record,
    }
    if ticket.direction is Direction.UPLOAD:
        fields |= {"size": size, "sha256": sha256}
    return json.dumps(fields, separators=(",", ":")).encode()


def parse_header(data: bytes, direction: Direction) -> Header:
    """A header for ``direction``, or Refused(bad_header) naming what is wrong."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _bad(f"a header of type {type(data).__name__}; expected bytes")
    if len(data) > MAX_HEADER_BYTES:
        raise _bad(f"{len(data)} header bytes; at most {MAX_HEADER_BYTES}")
    try:
        fields = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _bad("the header is not UTF-8 JSON") from None
    if not isinstance(fields, dict):
        raise _bad(f"the header is a JSON {type(fields).__name__}; expected an object")
    expected = {"token", "run_id", "node_id", "round", "direction", "record"}
    if direction is Direction.UPLOAD:
        expected |= {"size", "sha256"}
    if set(fields) != expected:
        raise _bad(f"fields {sorted(map(str, fields))[:10]}; expected {sorted(expected)}")
    if fields["direction"] != str(direction):
        raise _bad(f"direction={_short(fields['direction'])} on the {direction} method")
    token = _text(fields, "token", re.compile(f"[0-9a-f]{{{2 * TOKEN_BYTES}}}"), "64 lowercase hex digits")
    claim = Ticket(
        token=bytes.fromhex(token),
        run_id=_int(fields, "run_id", MAX_ID),
        node_id=_int(fields, "node_id", MAX_ID),
        round=_int(fields, "round", MAX_ID),
        direction=direction,
        record=_text(fields, "record", RECORD_NAME, "1-128 of A-Z a-z 0-9 _ . : / -"),
    )
    if direction is Direction.DOWNLOAD:
        return Header(claim)
    digest = _text(fields, "sha256", DIGEST, "64 lowercase hex digits, or empty (it follows the bytes)")
    return Header(claim, _int(fields, "size", MAX_SIZE), digest)


def _int(fields: dict, name: str, high: int) -> int:
    value = fields[name]
    if type(value) is not int or not 0 <= value <= high:
        raise _bad(f"{name}={_short(value)}; expected an integer in [0, {high}]")
    return value


def _text(fields: dict, name: str, pattern: re.Pattern, what: str) -> str:
    value = fields[name]
    if not isinstance(value, str) or not pattern.fullmatch(value):
        shown = "(hidden)" if name == "token" else _short(value)
        raise _bad(f"{name}={shown}; expected {what}")
    return value


def _short(value) -> str:
    """A value as a refusal names it: its repr (one line), cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(text: str) -> Refused:
    return Refused(RefusalKind.BAD_HEADER, text)

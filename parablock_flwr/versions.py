"""The one version number of what crosses a process boundary (no imports: every side reads it).

A deployment mixes code from two sources: the ClientApp and the ServerApp come from the app bundle
``flwr run`` ships, the node worker from each site's own install. ``PROTOCOL_VERSION`` travels, under
``messages.PROTOCOL_KEY``, in every frame between a ClientApp and its worker (``worker/protocol.py``
adds and checks it) and in every round's config from the server (checked by the ClientApp): a side
that meets another number refuses the message in one line naming both, before anything is loaded or
changed.
Raise it whenever a message's meaning changes (a key added, renamed or read differently).
"""

from __future__ import annotations

from collections.abc import Mapping

PROTOCOL_VERSION = 2


def mismatch(header: Mapping[str, object], key: str, peer: str, here: str) -> str | None:
    """One line naming both versions when ``header[key]`` is not this release's (None: they match)."""
    theirs = header.get(key)
    if theirs == PROTOCOL_VERSION and type(theirs) is int:
        return None
    said = "no protocol version (a release before versions were sent)" if theirs is None else f"{theirs!r:.40}"
    return (
        f"protocol version mismatch: {peer} speaks {said}, {here} speaks {PROTOCOL_VERSION}; "
        f"install the same parablock-flwr release on the server and at every site"
    )

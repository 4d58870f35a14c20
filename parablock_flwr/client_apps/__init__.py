"""The ClientApps: ``app.py`` relays a message to the node's worker (or runs it inline, ``inline.py``)."""

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode


def error_reply(msg: Message, reason: str) -> Message:
    """The error reply to ``msg`` both ClientApps send: its reason is one line, never a row of data."""
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)

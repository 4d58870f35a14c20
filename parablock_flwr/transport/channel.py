"""How a run's messages reach its nodes and their replies come back: the one thing the server's round loop
(``server_apps/run.py``) asks of a transport.

``Channel`` is Flower's path: a message goes as the algorithm built it, a reply comes as Flower pulled it, and
every hook is a no-op. ``DirectChannel`` (``direct_channel.py``, ``transport = "direct"`` in a deployment)
overrides them: block records move onto the run's stream, messages go a round ahead, replies come on the
stream and Flower's trail as their audit. The loop calls the same methods either way, so it holds no
branch on the transport; what the stream knows stays here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from flwr.app import Message


class Channel:
    """Flower's path (the base of every channel): each hook leaves the message, the reply and the round as
    Flower has them."""

    replies_on_stream = False  # whether replies may come before Flower's pull (``replies_from_stream``)
    updates_land_ahead = False  # whether updates may be held before their replies come (``landed_updates``)

    def __init__(self) -> None:
        # Message id -> a reply taken early whose Flower reply is still awaited as its audit (``audit``).
        self.audits: dict[str, object] = {}

    def outgoing(
        self, messages: Iterable[Message], server_round: int, update_bound: Callable[[int], int] | None,
        last_round: bool, first: bool, messages_ahead: bool,
    ) -> Iterator[Message]:  # fmt: skip
        """``messages`` as they are pushed. ``update_bound(r)``: the most bytes a node's update of round r may
        take (None: the messages ask for no update); ``last_round``: no round follows; ``first``: the round's
        first push, not a retry's; ``messages_ahead``: the run pushes messages a round ahead."""
        return iter(messages)

    def deliver(self, msg: Message, server_round: int) -> str | None:
        """The id of a message already pushed ahead that stands for ``msg`` (which is then not pushed), or None."""
        return None

    def withdraw(self, server_round: int, nodes: set[int] | None = None) -> dict[str, int]:
        """Round r's messages pushed ahead and withdrawn (message id -> node): their replies are to be dropped."""
        return {}

    def message_ahead(self, server_round: int, node: int) -> Message | None:
        """``node``'s round-r message to push before round r-1 is aggregated, or None."""
        return None

    def pushed(self, server_round: int, node: int, message_id: str) -> None:
        """``message_ahead``'s message to ``node`` was taken by the SuperLink."""

    def replies_from_stream(self, server_round: int, waiting: dict[str, int]) -> list[Message]:
        """Replies of ``waiting``'s nodes (message id -> node) that came before Flower's pull."""
        return []

    def landed_updates(self, server_round: int, nodes: set[int]) -> dict[int, dict] | None:
        """Each of ``nodes``' round-r update as its reply will carry it (array name -> the array over the very bytes
        the reply's update will hold), once every one has landed before its reply or is landing (``wire.LandingArrays``:
        its values read as their bytes land); None until then, and always on Flower's path, where an update comes
        only with its reply."""
        return None

    def incoming(self, reply: Message, server_round: int, node: int) -> Message:
        """``reply`` as the algorithm checks it (its update where Flower's path carries it)."""
        return reply

    def audit(self, reply: Message) -> bool:
        """Whether ``reply`` is Flower's reply auditing one taken early (the run then drops it)."""
        return False

    def expire_audits(self, every: bool = False) -> None:
        """Audits that can no longer come (``every``: all, the run ends), counted."""

    def wait_for_replies(self, seconds: float) -> None:
        """Between pulls: at most ``seconds``."""
        time.sleep(seconds)

    def end_round(self, server_round: int) -> dict[str, int]:
        """The round's counts for its record (none on Flower's path)."""
        return {}

    def stop(self) -> None:
        """The run is over: what serves the channel stops."""

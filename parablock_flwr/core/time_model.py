"""The time model: what a round would cost on a given link, from measured compute times and byte counts.

Apart from the algorithm because it only reports (each round's record, ``plan``'s estimate): it never
changes a value. Plain floats, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TRANSPORTS  # the choices live with the other settings (no torch there)


@dataclass(frozen=True)
class LinkModel:
    """A client's link and the framework's cost of one exchange: rates in Mbit/s, one-way latency in
    ms, the fixed cost of one exchange (``message_overhead_s``: Flower's delivery, process start, polls,
    the server's aggregation: its control round trip, which every transport keeps) and the rate at which
    the framework moves a block's bytes besides the link (MB/s; 0: not modeled): an exchange costs
    ``overhead + bytes / throughput`` besides the link. The rate is the ``transport``'s: inside Flower's
    messages (``"flower"``, ``message_throughput_mbs``), or on the run's own stream (``"direct"``,
    ``stream_throughput_mbs``). ``python -m benchmarks.time_model`` fits Flower's two costs to two runs
    of two message sizes."""

    uplink_mbps: float
    downlink_mbps: float
    latency_ms: float
    message_overhead_s: float = 0.0
    message_throughput_mbs: float = 0.0
    transport: str = "flower"
    stream_throughput_mbs: float = 0.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: expected one of {', '.join(TRANSPORTS)}")

    @classmethod
    def from_config(cls, cfg, transport: str | None = None) -> LinkModel:
        """The time model of a ``config.RunConfig``, for its own transport or the one named (``plan``
        shows the other beside it)."""
        return cls(cfg.uplink_mbps, cfg.downlink_mbps, cfg.latency_ms, cfg.message_overhead_s,
                   cfg.message_throughput_mbs, transport or cfg.transport, cfg.stream_throughput_mbs)  # fmt: skip

    @property
    def throughput_mbs(self) -> float:
        """The MB/s at which this transport moves a block's bytes besides the link (0: not modeled)."""
        return self.stream_throughput_mbs if self.transport == "direct" else self.message_throughput_mbs

    def comm_seconds(self, bytes_up: int, bytes_down: int) -> float:
        """Time from a reply leaving the client to the next message reaching it: the fixed cost, the
        transport's per-byte cost and the link's, added (on one host they share the same CPUs). With
        ``"direct"`` Flower's messages still go up and down, and the node's upload and download are two
        calls on the stream, each a round trip of the link besides its bytes."""
        throughput = self.throughput_mbs * 1e6
        framework = (bytes_up + bytes_down) / throughput if throughput else 0.0
        round_trips = 1 + (2 if self.transport == "direct" else 0)
        return (
            self.message_overhead_s
            + framework
            + round_trips * 2 * self.latency_ms / 1e3
            + 8 * bytes_up / (self.uplink_mbps * 1e6)
            + 8 * bytes_down / (self.downlink_mbps * 1e6)
        )

    def ahead_seconds(self, bytes_up: int) -> float:
        """The part of ``comm_seconds`` an update takes with it when it moves a round ahead on the direct
        stream (ParaBlock, correction ``at-end``): its upload, a call with its round trip, its bytes at the
        stream's rate and the uplink's. It then runs as soon as the update is computed, beside the next
        computation (docs/transport.md, "One round ahead"); 0 on Flower's path."""
        if self.transport != "direct":
            return 0.0
        throughput = self.stream_throughput_mbs * 1e6
        stream = bytes_up / throughput if throughput else 0.0
        return stream + 2 * self.latency_ms / 1e3 + 8 * bytes_up / (self.uplink_mbps * 1e6)


def modeled_round_seconds(
    compute_s: list[float], comm_s: list[float], overlapped: bool, ahead_s: list[float] | None = None
) -> float:
    """Round time of the slowest client: compute + comm, or their max.

    ParaBlock hides the exchange of round r-1 behind the compute of round r,
    so an overlapped round costs ``max(compute, comm)``; sequential BCD
    waits for both, ``compute + comm``. An update that moves a round ahead
    (``ahead_s``, ``LinkModel.ahead_seconds``) leaves as soon as it is
    computed, beside the next computation, and the round's reply waits for
    it: the node's loop settles at ``max(compute, comm - ahead, (compute +
    comm) / 2)``, the compute once it covers the exchange, the exchange less
    the upload once the upload is done before the message comes (the middle
    term is where the reply waits for part of it). Without one (``ahead``
    0) that is ``max(compute, comm)``.
    """
    ahead_s = ahead_s or [0.0] * len(compute_s)
    per_client = [
        max(c, m - a, (c + m) / 2) if overlapped else c + m for c, m, a in zip(compute_s, comm_s, ahead_s, strict=True)
    ]
    return max(per_client, default=0.0)

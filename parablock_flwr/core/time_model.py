"""The time model: what a round would cost on a given link, from measured compute times and byte counts.

Apart from the algorithm because it only reports (each round's record, ``plan``'s estimate): it never
changes a value. Plain floats, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    """A client's link and the framework's cost of one exchange: rates in Mbit/s, one-way latency in
    ms, the fixed cost of one exchange (``message_overhead_s``: delivery, process start, polls, the
    server's aggregation) and the rate at which the framework's processes move a message's bytes
    besides the link (``message_throughput_mbs``, MB/s; 0: not modeled): an exchange costs
    ``overhead + bytes / throughput`` besides the link. ``python -m benchmarks.time_model`` fits both
    to two runs of two message sizes."""

    uplink_mbps: float
    downlink_mbps: float
    latency_ms: float
    message_overhead_s: float = 0.0
    message_throughput_mbs: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> LinkModel:
        """The time model of a ``config.RunConfig``."""
        return cls(cfg.uplink_mbps, cfg.downlink_mbps, cfg.latency_ms, cfg.message_overhead_s,
                   cfg.message_throughput_mbs)  # fmt: skip

    def comm_seconds(self, bytes_up: int, bytes_down: int) -> float:
        """Time from a reply leaving the client to the next message reaching it: the fixed cost, the
        framework's per-byte cost and the link's, added (on one host they share the same CPUs)."""
        throughput = self.message_throughput_mbs * 1e6
        framework = (bytes_up + bytes_down) / throughput if throughput else 0.0
        return (
            self.message_overhead_s
            + framework
            + 2 * self.latency_ms / 1e3
            + 8 * bytes_up / (self.uplink_mbps * 1e6)
            + 8 * bytes_down / (self.downlink_mbps * 1e6)
        )


def modeled_round_seconds(compute_s: list[float], comm_s: list[float], overlapped: bool) -> float:
    """Round time of the slowest client: compute + comm, or their max.

    ParaBlock hides the exchange of round r-1 behind the compute of round r,
    so an overlapped round costs ``max(compute, comm)``; sequential BCD
    waits for both, ``compute + comm``.
    """
    per_client = [max(c, m) if overlapped else c + m for c, m in zip(compute_s, comm_s)]
    return max(per_client, default=0.0)

"""A new algorithm added exactly as docs/extending.md says ("A new algorithm"), for
tests/test_extending.py: a server half (a ``FedBCD`` subclass) and a client half (a ``BCDClient``
subclass), each registered by its ``"module:Class"`` name."""

from parablock_flwr import core
from parablock_flwr.strategies import BCDClient, FedBCD


class DampedBCD(FedBCD):
    """Sequential BCD whose global step is half the server's usual one."""

    algorithm = "damped-bcd"

    def server_update(self, server_round: int, block: int, mean_update: core.Tensors) -> core.Tensors:
        return {n: 0.5 * t for n, t in super().server_update(server_round, block, mean_update).items()}


class DampedClient(BCDClient):
    """The client half: BCD's, counting the rounds it finished (the test checks it ran)."""

    rounds_finished = 0

    def finish_round(self, *args, **kwargs):
        DampedClient.rounds_finished += 1
        return super().finish_round(*args, **kwargs)

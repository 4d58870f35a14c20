"""A message to a node, read once from the schema (``messages.RoundConfig``), and the node's reply.

Both drivers (the inline ClientApp, the node worker) hand the runtime a ``Request``; a message that
does not hold what a round must is refused here, in one line, before anything changes (``RequestRefused``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import core
from ..messages import EVALUATE, SYNC_VALUES, EvaluateReply, MessageError, RoundConfig, TrainMetrics, key
from ..replica import Step, catch_up_steps, resumed_pending


class StateIntact(Exception):
    """A request failed and the node's model state is as it was before it (or as consistent: the
    replica at an exact version, the pending update unchanged): the server may keep its sync state.
    Its reply's reason starts with ``messages.STATE_INTACT``."""


class RequestRefused(StateIntact):
    """A message the node must not act on (an older round, another run, another partition, a malformed one)."""


@dataclass
class Request:
    """One message to a node: who asks (the driver says: its run and partition), the server's round
    config, and the tensors that came with it. The round config's fields read as the request's own
    (``req.server_round`` is ``req.config.server_round``)."""

    op: str  # messages.TRAIN or messages.EVALUATE
    run_id: int
    partition_id: int
    num_partitions: int
    config: RoundConfig
    steps: dict[int, Step]  # g^{r-1} and any catch-up steps, by version
    sync_values: core.Tensors | None = None  # a full sync's x^{sync_version} (None: the driver replays it)
    handed_back: core.PendingUpdate | None = None  # a resumed server's Δ_i^R

    @classmethod
    def parse(
        cls, op: str, run_id: int, round_cfg, arrays: dict[str, core.Tensors], partition_id: int, num_partitions: int
    ) -> Request:
        """``round_cfg`` is the message's round config; ``arrays`` its array records as tensors. A
        malformed one is ``RequestRefused`` in one line naming the field."""
        try:
            config = RoundConfig.from_config(round_cfg)
            if config.evaluate_version is not None and config.evaluate_version < 0:
                raise MessageError(f"round config: {key('evaluate_version')}={config.evaluate_version} expected >= 0")
            if op == EVALUATE and config.evaluate_version is None:
                raise MessageError(f"round config: {key('evaluate_version')} missing from an evaluation")
            steps, handed_back = catch_up_steps(config, arrays), resumed_pending(config, arrays)
        except MessageError as err:
            raise RequestRefused(str(err)) from None
        return cls(op, int(run_id), int(partition_id), int(num_partitions), config, steps,
                   arrays.get(SYNC_VALUES), handed_back)  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        if name == "config":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.config, name)

    def step(self, version: int) -> core.Tensors:
        return self.steps[version][1]


@dataclass
class NodeAnswer:
    """What a node answers: its metrics, its update (train only) and its trace (``verify-invariant``)."""

    metrics: TrainMetrics | EvaluateReply
    update: core.Tensors = field(default_factory=dict)
    trace: dict[str, str] = field(default_factory=dict)
    used_early: bool = False  # the update is the one rounded ahead (``Node.early_update``), bit for bit
    encoded: core.Encoded | None = None  # the update as it travels (``core.round_with_feedback_encoded``)
    # ``Node.train(defer_write=True)``: the residual's durable write, still running; the driver waits for it
    # (``runtime.wait_for_write``) before the reply leaves, while the update's bytes move.
    residual_written: Callable[[], None] | None = None


def check_blocks(req: Request, num_blocks: int) -> None:
    """A round's block (and the next one, -1: none) among this model's, refused in one line before any
    work: only a server of another model or partition, or a forged message, names another."""
    if not 0 <= req.block < num_blocks:
        raise RequestRefused(f"block={req.block} refused: this node's model has blocks 0..{num_blocks - 1}")
    if not (0 <= req.next_block < num_blocks or req.next_block == -1):
        raise RequestRefused(f"next-block={req.next_block} refused: this node's model has blocks 0..{num_blocks - 1}")

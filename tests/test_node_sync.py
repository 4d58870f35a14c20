"""What the server keeps to resynchronise nodes (strategies/node_sync.py), and for how long."""

from __future__ import annotations

import gc
import weakref

import torch

from parablock_flwr import core
from parablock_flwr.messages import SYNC_VALUES
from parablock_flwr.replica import StepLog
from parablock_flwr.strategies.node_sync import NodeSync


def test_a_rounds_full_sync_copy_of_the_model_is_freed_once_the_round_ends(tmp_path):
    """A full sync carries a copy of every trainable tensor, shared by the round's messages. For an 8B
    model that is 28 GB: it must not outlive its round (before: it stayed until the next full sync,
    for a resumed run the rest of the run)."""
    x = {"a": torch.zeros(4), "b": torch.ones(4)}
    sync = NodeSync(x, num_blocks=2, step_log=StepLog(tmp_path))
    sync.failed(7)  # node 7's state is unknown: its next message carries a full sync
    parts = sync.parts_for(3, node=7)
    assert parts.full_sync and parts.fields == {"sync_version": 1}
    record = weakref.ref(parts.records[SYNC_VALUES])
    del parts  # the message has been pushed
    sync.applied(core.apply_step_keeping(x, {"a": torch.ones(4)}))  # round 3's step: its messages are all out
    gc.collect()
    assert record() is None


def test_a_resumed_deployment_brings_each_known_node_x_keeping_its_state_and_a_simulation_its_steps(tmp_path):
    """After a resume, a node the stopped server knew at version v: in a deployment (a new Flower run, whose
    worker starts at x^0) its first message carries x^{r-2}'s values and says the node keeps its own state
    (residuals), once; in a simulation (nodes catch up from the step log) it gets the steps it missed. A
    node the stopped server had dropped gets a full sync that drops its state, either way."""
    x = {"a": torch.zeros(4), "b": torch.ones(4)}
    log = StepLog(tmp_path)
    for version in (1, 2, 3):
        log.write(version, version % 2, {"a": torch.full((4,), float(version))})
    stopped = {"versions": {"0": 2, "1": 3}, "full_sync": [2]}  # by partition; round R = 3 resumed at round 4
    for deployment in (True, False):
        sync = NodeSync(x, num_blocks=2, step_log=log)
        sync.values_on_resume = deployment
        sync.carry(stopped)
        sync.partitions.update({10: 0, 11: 1, 12: 2})  # the resumed server's node ids, asked their partitions
        behind, current, dropped = (sync.parts_for(5, node) for node in (10, 11, 12))
        assert dropped.full_sync and not dropped.keeps_state and "sync_keeps_state" not in dropped.fields
        if deployment:
            for parts in (behind, current):
                assert parts.full_sync and parts.keeps_state and SYNC_VALUES in parts.records
                assert parts.fields == {"sync_version": 3, "sync_keeps_state": True}
            sync.accepted(10, 5, 0)
            assert sync.parts_for(6, 10).fields == {}  # once: then it is current
        else:
            assert behind.fields == {"catch_up_versions": (3,), "catch_up_blocks": (1,)} and not behind.full_sync
            assert current.fields == {} and not current.full_sync

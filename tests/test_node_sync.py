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

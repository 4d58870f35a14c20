"""A node's residual store (node.state.ResidualStore): what a resume reads back, and how much it keeps."""

from __future__ import annotations

import torch

from parablock_flwr.node.state import KEEP_ROUNDS, ResidualStore


def residual(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), value)}


def test_the_residuals_as_of_a_round_ignore_later_rounds_and_stop_at_a_full_sync(tmp_path):
    """A node that answered rounds 1-3 (blocks 0, 1, 0) when the server died after round 2's checkpoint
    resumes with round 2's residuals: block 0's from round 1, block 1's from round 2, not round 3's."""
    store = ResidualStore(tmp_path / "partition-0")
    store.save(1, 0, residual(1.0))
    store.save(2, 1, residual(2.0))
    store.save(3, 0, residual(3.0))
    as_of_2 = store.as_of(2)
    assert sorted(as_of_2) == [0, 1] and torch.equal(as_of_2[0]["w"], residual(1.0)["w"])
    assert torch.equal(as_of_2[1]["w"], residual(2.0)["w"]) and torch.equal(store.as_of(3)[0]["w"], residual(3.0)["w"])
    store.reset(4)  # a full sync in round 4 dropped them: round 4's state has none, round 3's is kept
    store.save(4, 1, residual(4.0))
    assert sorted(store.as_of(4)) == [1] and sorted(store.as_of(3)) == [0, 1]
    store.restart_at(2, as_of_2)  # a resumed run: exactly round 2's residuals, nothing after
    assert sorted(store.as_of(10)) == [0, 1] and torch.equal(store.as_of(10)[0]["w"], residual(1.0)["w"])
    assert not list(tmp_path.glob("partition-0/.*.tmp"))  # written by rename: no temporary left behind


def test_the_store_keeps_a_bounded_number_of_files(tmp_path):
    """Over 100 rounds on 3 blocks: each block's newest old file plus the last KEEP_ROUNDS rounds."""
    store = ResidualStore(tmp_path / "partition-0")
    for r in range(1, 101):
        store.save(r, r % 3, residual(float(r)))
    assert len(list(store.dir.iterdir())) <= 3 + KEEP_ROUNDS
    assert sorted(store.as_of(100 - KEEP_ROUNDS)) == [0, 1, 2]


def test_a_staged_residual_is_read_only_once_committed_and_none_outlives_the_stores_next_write(tmp_path):
    """A residual written ahead (``stage``, under a fresh name each time) is invisible to a resume until
    ``commit`` renames it into its round; one never committed (its round took another, or failed) is gone by the
    store's next write once its own has ended, and ``clear`` removes it too: over 100 rounds the folder stays
    bounded."""
    store = ResidualStore(tmp_path / "partition-0")
    store.save(1, 0, residual(1.0))
    first, second = store.staged_name(2, 0), store.staged_name(2, 0)
    assert first != second  # two stagings of one round never write one file
    store.stage(first, residual(2.0))
    store.stage(second, residual(5.0))
    assert torch.equal(store.as_of(2)[0]["w"], residual(1.0)["w"])  # staged: not the round's yet
    store.commit(first, 2, 0)
    assert torch.equal(store.as_of(2)[0]["w"], residual(2.0)["w"]) and not list(store.dir.glob(".*"))
    for r in range(3, 101):  # every round leaves a staged file behind, as rounds that failed after rounding would
        store.stage(store.staged_name(r, r % 3), residual(float(r)))
        store.save(r, r % 3, residual(float(r)))
    assert len(list(store.dir.iterdir())) <= 3 + KEEP_ROUNDS and not list(store.dir.glob(".*"))
    store.stage(store.staged_name(101, 0), residual(1.0))
    store.clear()
    assert not list(store.dir.iterdir())


def test_a_node_first_sampled_rounds_after_a_resume_goes_on_from_the_checkpoints_residuals(tmp_path):
    """The server stopped with its checkpoint at round 2 while this node had answered round 3 too. In
    the resumed run (fraction-train < 1) the node is first sampled in round 5, without a hand-back:
    it must go on from round 2's residuals, which the message names (``resumed-after``), not from those
    of the round before its message (round 4's, i.e. the killed run's round 3)."""
    from parablock_flwr.config import RunConfig
    from parablock_flwr.node import Node, Request

    before = ResidualStore(tmp_path / "killed-run")
    before.save(1, 0, residual(1.0))
    before.save(3, 0, residual(3.0))
    cfg = RunConfig(transfer_dtype="bf16", resume_from="killed-run")
    round_cfg = {"server-round": 5, "block": 0, "step-block": 1, "resumed-after": 2}
    req = Request.parse("train", 1, round_cfg, {"global-step": {}}, 0, 2)
    node = Node()
    node.begin_run(cfg, req, ResidualStore(tmp_path / "resumed-run"), before)
    assert torch.equal(node.state.residuals[0]["w"], residual(1.0)["w"])

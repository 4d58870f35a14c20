"""A bounded step log (``snapshot-every``): the disk a run uses stops growing with the number of
rounds, and what reads the log (resume, catch-up, Ray actors) still finds what it needs."""

from __future__ import annotations

import json

import pytest
import torch

from parablock_flwr.config import RunConfig
from parablock_flwr.core import apply_step
from parablock_flwr.plan import make_plan, model_config, model_shape
from parablock_flwr.replica import ModelReplica, StepLog
from parablock_flwr.tensor_file import DIRECT_ALIGNMENT

from helpers import simulate


@pytest.mark.parametrize("dtype, share", [("bf16", 0.5), ("fp16", 0.5), ("int8", 0.26)])
def test_a_step_is_logged_as_it_travelled_and_read_back_bit_for_bit(tmp_path, dtype, share):
    """The server's step as it travels (``wire.round_and_pack``) is logged in that encoding, not decoded to fp32:
    its file is a half (bf16, fp16) or a quarter (int8, with its scales) of the fp32 step's, and what reads it
    (resume, catch-up, a replica) gets the very values the server applied, also once it is copied to another log
    (a resume's). A file whose tensors are not its encoding's is refused, naming it."""
    from safetensors.torch import load_file, save_file

    from parablock_flwr.replica import STEP_FILE_ENCODING
    from parablock_flwr.wire import round_and_pack

    g = {"w": torch.randn(256, 300) * 1e-3, "b": torch.randn(7) * 1e-3}
    step, _ = round_and_pack(g, dtype, lazy=True)
    log, fp32_log, copy = StepLog(tmp_path / "a"), StepLog(tmp_path / "b"), StepLog(tmp_path / "c")
    log.write(1, 0, step)
    fp32_log.write(1, 0, {n: step[n] for n in step})
    copy.write(1, 0, log.read(1)[1])
    size = [(lg.dir / "v00001.safetensors").stat().st_size for lg in (log, fp32_log, copy)]
    assert size[0] == size[2] < share * size[1] + DIRECT_ALIGNMENT, size  # beside each file's header, padded to a page
    for read in (log.read(1), fp32_log.read(1), copy.read(1)):
        assert read[0] == 0 and all(torch.equal(read[1][n], step[n]) for n in g)
    path = log.dir / "v00001.safetensors"
    tensors = load_file(str(path))
    tensors["w"] = tensors["w"].float()
    save_file(tensors, str(path), metadata={"block": "0", "version": "1", STEP_FILE_ENCODING: dtype})
    with pytest.raises(ValueError, match=f"{path}: w: torch.float32 values"):
        log.read(1)


def test_prune_keeps_two_snapshots_and_the_steps_after_the_older_and_a_replica_behind_rebases(tmp_path):
    log = StepLog(tmp_path)
    x = {"w": torch.zeros(1, 3)}
    for version in range(1, 9):
        step = {"w": torch.full((1, 3), 0.1 * version)}
        apply_step(x, step)
        log.write(version, 0, step)
        if version % 2 == 0:
            log.write_snapshot(version, x)
            log.prune()
    assert log.snapshots() == [6, 8] and log.steps() == [7, 8]
    assert torch.equal(log.read_snapshot(8)["w"], x["w"])

    model = torch.nn.Linear(3, 1, bias=False)  # a replica at x^0 (weights 0), far behind the log
    with torch.no_grad():
        model.weight.zero_()
    replica = ModelReplica(model)
    replica.params["w"] = replica.params.pop("weight")
    log.rebase_if_pruned(replica, needed=7)
    assert replica.version == 6
    replica.advance_to(8, log.read)
    assert torch.equal(replica.params["w"].detach(), x["w"])


ROUNDS = 6


@pytest.mark.e2e  # starts Flower processes
def test_a_bounded_log_catches_up_nodes_that_missed_rounds_and_stops_growing(tmp_path, tiny_model_dir):
    """3 clients, one sampled per round, 6 rounds, a snapshot every 2: nodes come back after steps were
    dropped and get a full sync instead of a catch-up; every client's local model is still exactly
    x^{r-1} + its own update; the log holds 2 snapshots and 2 steps at the end. The same run checks
    client-side evaluation in simulation (the inline ClientApp)."""
    run = simulate(
        tmp_path,
        tiny_model_dir,
        num_supernodes=3,
        fraction_train=0.3,
        num_server_rounds=ROUNDS,
        snapshot_every=2,
        verify_invariant=True,
        generate_examples=0,
        evaluation="clients",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = run.records[1:]
    assert [r["num_accepted"] for r in records] == [1] * ROUNDS
    assert all(r["invariant_checked"] == 1 and r["invariant_failed"] == 0 for r in records)
    assert sum(r["full_syncs_sent"] for r in records) > 0  # a returning node whose steps were pruned
    # evaluation = "clients" in simulation: x^0..x^R each evaluated by the node(s) of the next round
    # (x^R by an evaluate message), on the run's held-out rows (8), and recorded in that round's record.
    for rec in run.records:
        assert rec["evaluated_by"] == "clients" and rec["heldout_examples"] == 8, rec["round"]
        assert [n["heldout_examples"] for n in rec["heldout_nodes"]] == [8]
    assert run.records[-1]["heldout_loss"] < run.records[0]["heldout_loss"]
    log = StepLog(run.run_dir)
    assert log.snapshots() == [4, 6] and log.steps() == [5, 6]
    assert len(list(log.dir.iterdir())) == 4
    # `parablock-flwr plan`'s server disk: the smaller of the unbounded log (6 steps) and the bounded log's
    # peak (3 snapshots of the 2 blocks, the oldest not yet pruned, and 2N steps: 10 steps' bytes); 6
    # steps' bytes is what the log holds at the end (2 snapshots and 2 steps), up to the files' headers.
    cfg = RunConfig.from_flower(json.loads((run.run_dir / "config.json").read_text()))
    planned = make_plan(cfg, model_shape(cfg, model_config(str(tiny_model_dir))), num_nodes=3).disk["step_log"]
    on_disk = sum(f.stat().st_size for f in log.dir.iterdir())
    assert planned <= on_disk <= planned * 1.02, (planned, on_disk)

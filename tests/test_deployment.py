"""A real local deployment: SuperLink, SuperNodes and node workers as separate processes on loopback.

Flower 1.42 starts a new ClientApp process per message; the node worker keeps
the model and trains block r+1 while block r's reply is in flight.
"""

import os
import signal

import pytest
import torch

from parablock_flwr.launch import run_deployment

from conftest import FinishedRun, finished, simulate, tiny_config

ROUNDS = 3


def deploy(tmp_path, model_dir, on_started=None, **overrides) -> FinishedRun:
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, **{k.replace("_", "-"): v for k, v in overrides.items()})
    proc = run_deployment(tmp_path / "flower", config, num_supernodes=2, timeout_s=900, on_started=on_started)
    return finished(proc, out)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, tiny_model_dir):
    return deploy(tmp_path_factory.mktemp("deploy"), tiny_model_dir, num_server_rounds=ROUNDS,
                  verify_invariant=True, schedule="ascending")


def _ok(run):
    assert run.returncode == 0 and run.run_dir is not None, run.stdout[-4000:] + run.stderr[-2000:]
    return run


def test_deployment_equals_simulation_bit_for_bit(deployed, tmp_path, tiny_model_dir):
    sim = simulate(tmp_path, tiny_model_dir, num_supernodes=2, num_server_rounds=ROUNDS,
                   verify_invariant=True, schedule="ascending")
    _ok(deployed), _ok(sim)
    for version in range(1, ROUNDS + 1):
        (bd, sd), (bs, ss) = deployed.step(version), sim.step(version)
        assert bd == bs
        assert all(torch.equal(sd[n], ss[n]) for n in sd), f"global step {version} differs"
    for rec in deployed.records[1:]:
        assert rec["num_accepted"] == 2 and rec["invariant_failed"] == 0 and rec["invariant_checked"] == 2


def test_next_block_is_computed_while_the_reply_is_in_flight(deployed):
    for rec in _ok(deployed).records[2:]:  # from round 2 on, round r was computed in the background
        for row in rec["timeline"]:
            # Round r's compute started right after round r-1's correction, before F_r arrived...
            assert row["compute_start"] < row["request_received"], row
            assert row["compute_start"] <= row["prev_reply_sent"] + 1.0, row
            # ...so it overlapped the communication window.
            assert row["overlap_share"] > 0, row
        assert rec["measured_overlap_share"] > 0


def test_clientapp_process_does_not_import_torch(deployed):
    rows = [row for rec in _ok(deployed).records[1:] for row in rec["timeline"]]
    assert rows and all(row["clientapp_imported_torch"] == 0 for row in rows)


def test_a_dead_worker_makes_its_node_reply_an_error_and_the_run_goes_on(tmp_path, tiny_model_dir):
    def kill_first_worker(workers):
        os.killpg(workers[0].pid, signal.SIGKILL)
        workers[0].wait()

    run = _ok(deploy(tmp_path, tiny_model_dir, on_started=kill_first_worker, num_server_rounds=2))
    for rec in run.records[1:]:
        assert rec["num_accepted"] == 1 and rec["num_rejected"] == 1, rec
        assert "node worker is not running" in rec["rejected"][0]["reason"]
    losses = [r["heldout_loss"] for r in run.records]
    assert losses[-1] < losses[0]


def test_on_receipt_applies_the_aggregate_at_a_step_boundary_of_the_running_computation(tmp_path, tiny_model_dir):
    """Compute (~40 s) much longer than the round trip (~16 s): the aggregate lands mid-computation."""
    steps = 120
    run = _ok(deploy(tmp_path, tiny_model_dir, num_server_rounds=2, correction="on-receipt", local_steps=steps,
                     batch_size=16, verify_invariant=True))
    rows = [row for rec in run.records[2:] for row in rec["timeline"]]
    assert any(0 < row["correction_after_step"] < steps for row in rows), rows
    for rec in run.records[1:]:
        assert rec["num_accepted"] == 2 and rec["invariant_failed"] == 0
    losses = [r["heldout_loss"] for r in run.records]
    assert losses[-1] < losses[0]

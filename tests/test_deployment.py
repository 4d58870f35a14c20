"""A real local deployment: SuperLink, SuperNodes and node workers as separate processes on loopback.

Flower 1.42 starts a new ClientApp process per message; the node worker keeps
the model and trains block r+1 while block r's reply is in flight.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from stream_probes import Shared, SocketTap, kinds, outsider, site_identity

from parablock_flwr.messages import WORKER_LEGS
from parablock_flwr.metrics import RunRecorder
from parablock_flwr.tools.credentials import make_node_key
from parablock_flwr.tools.launch import free_port, run_deployment, stop_process_group, supernode_command
from parablock_flwr.transport import Refused

from helpers import (
    FinishedRun,
    finished,
    kill_server_after_round,
    simulate,
    simulate_in_process,
    succeeded,
    tiny_config,
)

pytestmark = pytest.mark.e2e  # every test here starts a SuperLink, SuperNodes and workers

ROUNDS = 3
# The module's deployment and every run compared with it; int8 so that the direct transport is held to
# Flower's path bit for bit in a rounded dtype (fp32 and bf16 runs on the stream: the tests below). With
# central differential privacy (docs/privacy.md; a clip norm that binds, a known noise seed): the noisy steps
# are the same in simulation, in a deployment and on the direct stream, and ParaBlock's invariant holds.
COMPARED = dict(num_server_rounds=ROUNDS, verify_invariant=True, schedule="ascending", transfer_dtype="int8",
                weighting="uniform", dp_clip_norm=0.05, dp_noise_multiplier=0.3, dp_noise_seed=3)  # fmt: skip


def deploy(
    tmp_path, model_dir, on_started=None, num_supernodes=2, secure=False, node_settings=(), **overrides
) -> FinishedRun:
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, **{k.replace("_", "-"): v for k, v in overrides.items()})
    proc = run_deployment(
        tmp_path / "flower", config, num_supernodes=num_supernodes, timeout_s=900, on_started=on_started,
        secure=secure, node_settings=node_settings,
    )  # fmt: skip
    return finished(proc, out)


# A strategy of the user's own, outside the package (extensions/, which the bundle Flower ships includes): it
# records each round's largest update norm and changes no bit (the TLS test compares the default with it).
EXTENSION = "extensions.update_norms:UpdateNormParaBlock"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, tiny_model_dir):
    return deploy(tmp_path_factory.mktemp("deploy"), tiny_model_dir, strategy=EXTENSION, **COMPARED)


def test_deployment_equals_simulation_bit_for_bit(deployed, tmp_path, tiny_model_dir):
    """The same global steps in a deployment and a simulation; the simulation keeps to Flower's path
    whatever its ``transport`` says. Both run a strategy from the app's extensions/ folder, outside the package
    (docs/extending.md): `flwr run` ships it in the bundle to the simulation and to the deployment's server."""
    sim = simulate(
        tmp_path,
        tiny_model_dir,
        num_supernodes=2,
        strategy=EXTENSION,
        **COMPARED,
        transport="direct",
        transport_address="localhost:0",
        transport_insecure=True,
    )
    succeeded(deployed), succeeded(sim)
    assert "transport='direct' is for deployments" in sim.stdout
    assert "direct_fallbacks" not in sim.records[1]
    for version in range(1, ROUNDS + 1):
        (bd, sd), (bs, ss) = deployed.step(version), sim.step(version)
        assert bd == bs
        assert all(torch.equal(sd[n], ss[n]) for n in sd), f"global step {version} differs"
    for rec in deployed.records[1:]:
        assert rec["num_accepted"] == 2 and rec["invariant_failed"] == 0 and rec["invariant_checked"] == 2
    for run in (deployed, sim):  # the extension ran in both: its number is in every round's record
        assert all(r["max_update_norm_seen"] > 0 for r in run.records[1:]), run.records[1:]
        assert sum(r["dp_clipped"] for r in run.records[1:]) > 0 and run.records[ROUNDS]["dp_releases"] == ROUNDS
        assert "UpdateNormParaBlock:" in run.stdout  # the strategy's summary line names the class


def test_next_block_is_computed_while_the_reply_is_in_flight(deployed):
    for rec in succeeded(deployed).records[2:]:  # from round 2 on, round r was computed in the background
        for row in rec["timeline"]:
            # Round r's compute started right after round r-1's correction, before F_r arrived...
            assert row["compute_start"] < row["request_received"], row
            assert row["compute_start"] <= row["prev_reply_sent"] + 1.0, row
            # ...so it overlapped the communication window.
            assert row["overlap_share"] > 0, row
        assert rec["measured_overlap_share"] > 0


def test_round_r_is_evaluated_after_round_r_plus_1_is_sent(deployed):
    """In a real deployment too, the server's evaluation of round r is off the critical path: it is
    handed to the evaluator once round r+1's messages are out; the legs of the path are measured for
    every node."""
    records = succeeded(deployed).records
    assert all(rec["evaluation_waited_s"] >= 0 and rec["evaluate_s"] > 0 for rec in records[1:-1])
    for rec in records[2:]:
        assert all(rec[f"critical_path_{leg}_s"] >= -0.05 for leg in ("aggregate", "dispatch", "delivery")), rec


def test_the_relay_leg_splits_into_flowers_pull_the_send_and_the_workers_read(deployed):
    """The ClientApp's stamps reach the record: its relay leg is the sum of its three parts, each one
    measured, and the CPU seconds of the ClientApp, the server and the worker are there for every round (the
    worker's a running total, so each round's costs what it grew by)."""
    records = succeeded(deployed).records
    worker_cpu = [{row["node"]: row["worker_cpu_s"] for row in rec["timeline"]} for rec in records[1:]]
    assert all(0 < cpu[node] < later[node] for cpu, later in zip(worker_cpu, worker_cpu[1:]) for node in cpu)
    for rec in records[2:]:
        parts = [rec[f"critical_path_{part}_s"] for part in ("clientapp_pull", "relay_send", "worker_read")]
        # The worker may stamp the last byte read before the ClientApp's sendall returns to stamp it sent:
        # two processes' clocks on one host, so worker_read can be a hair below zero (CI saw it), never more.
        assert parts[0] > 0 and parts[1] >= 0 and parts[2] >= -0.05, f"{parts} in round {rec['round']}"
        assert sum(parts) == pytest.approx(rec["critical_path_clientapp_relay_s"], abs=1e-6)
        assert rec["server_cpu_s"] > 0 and rec["server_times"]["previous_finished"] >= rec["server_times"]["pushed"]
        assert all(0 < row["clientapp_pull_cpu_s"] <= row["clientapp_cpu_s"] for row in rec["timeline"])


def test_each_round_says_where_the_workers_own_time_went_leg_by_leg(deployed):
    """Every round's timeline row carries the worker's own legs (``messages.WORKER_LEGS``): its records fetched,
    the update moved ahead waited for (none moves on Flower's path), g applied before a computation started now,
    the update rounded (int8), the correction, the residual's write waited for; on Flower's path there is no
    upload of the worker's own. Together they fit in the worker's own window of the round: from its request
    coming in to its reply leaving (the next round's ``prev_reply_sent``)."""
    records = succeeded(deployed).records
    windows = 0
    for rec, later in zip(records[1:], records[2:] + [None]):
        for row in rec["timeline"]:
            legs = {leg: row.get(leg) for leg in WORKER_LEGS}
            assert legs.pop("upload_s") is None, row
            assert all(value is not None and value >= 0 for value in legs.values()), row
            assert legs["rounding_s"] > 0 and legs["correction_s"] > 0, row
            sent = {r["node"]: r["prev_reply_sent"] for r in later["timeline"]}.get(row["node"]) if later else None
            if sent:
                assert sum(legs.values()) <= sent - row["request_received"], (legs, rec["round"], row["node"])
                windows += 1
    assert windows >= 2 * (len(records) - 2)  # both nodes, every round but the last


def test_the_serverapp_and_the_workers_map_their_block_sized_buffers_on_huge_pages(deployed):
    """``tools.launch`` starts the SuperLink (which starts the ServerApp) and each node worker with glibc's
    huge-page tunable: each process says so at its start (``memory.map_large_buffers``), the ServerApp in the
    run's log, the worker in its own."""
    succeeded(deployed)
    said = "large buffers mapped, given back when freed: yes; on huge pages: yes"
    assert said in deployed.stdout, deployed.stdout[-3000:]
    assert said in (deployed.run_dir.parents[1] / "flower" / "worker-0.log").read_text()  # run_dir: out/RUN


def test_clientapp_process_does_not_import_torch(deployed):
    rows = [row for rec in succeeded(deployed).records[1:] for row in rec["timeline"]]
    assert rows and all(row["clientapp_imported_torch"] == 0 for row in rows)


LONG_ROUNDS = 9  # more than 2M+1 rounds for M = 2 blocks (4 layers, 2 per block), and three after the resume
RESUMED = dict(num_server_rounds=LONG_ROUNDS, verify_invariant=True, schedule="ascending", transfer_dtype="bf16",
               fraction_train=0.5)  # fmt: skip


def test_killed_server_resumes_at_any_round_in_a_restarted_deployment_bit_for_bit(tmp_path, tiny_model_dir):
    """The ServerApp is SIGKILLed in round R+1, and a new deployment (SuperLink, SuperNodes, workers:
    every process restarted) resumes from round R's checkpoint: killed in round 7 (R = 6 > 2M+1), a
    second deployment ends the run. 3 nodes, 2 sampled a round, ParaBlock. At the resume the nodes
    are asked their partition. The resumed run is a new Flower run, which each worker starts at x^0: a ParaBlock
    node whose round-R reply was aggregated gets the exact values of x^{R-1} (a full sync) and its own Δ_i^R
    back, and computes round R+1 from x^{R-1} + Δ_i^R; every other node (the one that sat out round R, as
    every FedBCD node would) gets x's values with its first message and keeps its own state (FedBCD's resume,
    killed and resumed in one process: tests/test_simulation.py). With bf16 transfer each
    worker also reads its error-feedback residuals back from its `state-dir` as of round R (written durably
    each round; the killed workers may have answered round R+1 already): every later global step equals the
    uninterrupted run's, bit for bit, and no reply is rejected. Both deployments run with TLS and SuperNode
    authentication (each its own CA and node keys), the resumed one with ``transport = "direct"`` (the first
    one on Flower's path): the values and hand-backs move on the stream over mutual TLS, and no node falls
    back. (A resumed run killed and resumed again, and a kill at every stage of a round:
    tests/test_simulation.py, without Ray.)"""
    same = dict(algorithm="parablock", **RESUMED)
    # What the resumed deployment must reproduce: the same config, uninterrupted, simulated without Ray
    # (``simulate_in_process``: a deployment's steps equal a simulation's bit for bit, the first test here).
    uninterrupted = simulate_in_process(tmp_path / "uninterrupted", tiny_model_dir, num_supernodes=3, **same)
    states = [f'state-dir="{tmp_path / "state" / f"node-{i}"}"' for i in range(3)]
    after_round, workdir = 6, tmp_path / "killed"

    def kill(deployment):
        return kill_server_after_round(deployment.workdir / "flwr-home", workdir / "out", after_round=after_round)

    killed = deploy(workdir, tiny_model_dir, node_settings=states, on_started=kill, secure=True, num_supernodes=3,
                    **same)  # fmt: skip
    assert killed.run_dir is not None, killed.stdout[-4000:]
    assert (killed.run_dir / "checkpoint" / f"round-{after_round:05d}").exists()
    assert not (killed.run_dir / "global-steps" / f"v{after_round + 1:05d}.safetensors").exists()
    resumed = deploy(tmp_path / "resumed", tiny_model_dir, node_settings=states, secure=True, num_supernodes=3,
                     **same, resume_from=str(killed.run_dir), transport="direct")  # fmt: skip
    succeeded(resumed)

    # The resumed deployment took over after round R = 6 and computed rounds 7..9, as the uninterrupted run did.
    uninterrupted = succeeded(uninterrupted)
    assert f"after round {after_round} (2 pending client updates" in resumed.stdout  # round R's two hand them back
    for server_round in range(after_round + 1, LONG_ROUNDS + 1):
        (block, step), (expected_block, expected) = resumed.step(server_round), uninterrupted.step(server_round)
        assert block == expected_block and all(torch.equal(step[n], expected[n]) for n in expected), server_round
    records = {r["round"]: r for r in resumed.records}
    assert sorted(records) == list(range(LONG_ROUNDS + 1))
    for server_round in range(2, LONG_ROUNDS + 1):
        record = records[server_round]
        assert record["num_accepted"] == 2 and record["num_rejected"] == 0, record
        assert record["invariant_checked"] == 2 and record["invariant_failed"] == 0, record
    # Each node's first message after the resume brought x (a hand-back's full sync, or x's values), once.
    resumed_rounds = [records[r] for r in range(after_round + 1, LONG_ROUNDS + 1)]
    assert sum(r["full_syncs_sent"] for r in resumed_rounds) == 3 and records[after_round + 1]["full_syncs_sent"] == 2
    # ParaBlock's nodes that trained from x^{r-1} (they sat out round r-1) are the uninterrupted run's
    expected_records = {r["round"]: r for r in uninterrupted.records}
    assert all(r.get("num_resynchronised") == expected_records[r["round"]].get("num_resynchronised") for r in
               resumed_rounds)  # fmt: skip
    assert (records[LONG_ROUNDS]["direct_fallbacks"], records[LONG_ROUNDS]["direct_refusals"]) == (0, 0)
    assert (records[LONG_ROUNDS]["final_direct_fallbacks"], records[LONG_ROUNDS]["final_direct_refusals"]) == (0, 0)
    for i in range(3):  # the stream carried the last deployment's records (its hand-backs, values), over TLS
        log = (tmp_path / "resumed" / "flower" / f"worker-{i}.log").read_text()
        assert any("direct transport: fetched" in line and line.endswith("(TLS)") for line in
                   log.splitlines()), log  # fmt: skip


def test_crashed_worker_restarts_and_nodes_resynchronise_under_partial_participation(tmp_path, tiny_model_dir):
    """4 nodes, half sampled per round, 5 rounds, TLS with SuperNode authentication and ``transport =
    "direct"``; node 0's worker is SIGKILLed after round 1 and restarted after round 2. Its node replies
    errors meanwhile (rejected, counted); the server then sends what it missed (steps or full values, on the
    stream) and it trains again with the invariant intact.

    The same run's stream (mutual TLS: each node has its client certificate) meets what can be attempted
    against it (tests/stream_probes.py): an outsider without a certificate, whose every attempt ends at the
    handshake; one with a site's certificate and no capability (forged ones up and down, a first message that
    is no header, an upload that stalls, a plaintext dial at the TLS port); the site of node 1 or 2 misusing
    its own node's capabilities, read from its ClientApp's request (an oversized declaration, another node's
    slot, another record, a wrong SHA-256, a wrong length, a trickle; a record's capability used again once
    its worker answered); and the other site presenting that capability under its own certificate (a stolen
    token). Each is refused with one line that names no token, counted by kind in the records
    (``direct_refused_*``, the last round's ``final_direct_refused_*``) and on the run's last line, and changes
    nothing: that node's reply of that round is accepted, no node falls back, every accepted reply's
    invariant holds."""
    events, outside, anonymous, taps, starting = {}, {}, {}, [], threading.Lock()
    credentials: list[Path] = []

    def first_offer(offer):
        """The outsider starts once the stream's address is known (a port scan would find it as well); the
        site's misuse waits for the outsider's stall to be refused (``share.hold``), so that it is in the run."""
        with starting:
            if "outsider" not in events:
                args = (offer.address, offer.ca_pem.encode(), outside, share.hold, site_identity(credentials[0], 3))
                events["outsider"] = threading.Thread(target=outsider, args=args, daemon=True)
                events["outsider"].start()
                args = (offer.address, offer.ca_pem.encode(), anonymous, threading.Event())
                events["anonymous"] = threading.Thread(target=outsider, args=args, daemon=True)
                events["anonymous"].start()

    share = Shared(on_offer=first_offer)

    def crash_and_restart(deployment):
        workers = deployment.workers
        credentials.append(deployment.tls.ca_cert.parent)
        for i in (1, 2):  # their sites' own processes between ClientApp and worker; each steals from the other
            own, other = site_identity(credentials[0], i), site_identity(credentials[0], 3 - i)
            taps.append(SocketTap(Path(workers[i].args[workers[i].args.index("--socket") + 1]), i, share, own, other))

        def watch():
            metrics = tmp_path / "out"
            while not events.get("done"):
                rounds = [len(RunRecorder(f.parent).read()) - 1 for f in metrics.glob("*/metrics.jsonl")]
                done = max(rounds, default=-1)
                if done >= 1 and "killed" not in events:
                    os.killpg(workers[0].pid, signal.SIGKILL)
                    workers[0].wait()
                    events["killed"] = done
                if done >= 2 and "restarted" not in events:
                    socket_path = workers[0].args[workers[0].args.index("--socket") + 1]
                    events["restarted"] = subprocess.Popen(
                        [sys.executable, "-m", "parablock_flwr.worker", "--socket", socket_path],
                        start_new_session=True,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                time.sleep(0.3)

        threading.Thread(target=watch, daemon=True).start()

    try:
        run = deploy(
            tmp_path,
            tiny_model_dir,
            on_started=crash_and_restart,
            num_supernodes=4,
            secure=True,
            transport="direct",
            transport_idle_timeout_s=5.0,  # the outsider's stall is refused within seconds (its header's deadline)
            num_server_rounds=5,
            fraction_train=0.5,
            verify_invariant=True,
            schedule="ascending",
            save_final_model=True,
        )
    finally:
        events["done"] = True
        if "restarted" in events:
            stop_process_group(events["restarted"])
        for tap in taps:
            tap.close()
        for name in ("outsider", "anonymous"):
            if name in events:
                events[name].join(timeout=120)
    succeeded(run)
    assert events["killed"] == 1 and "restarted" in events
    records = run.records[1:]
    # Every accepted reply came from a model that is exactly x^{r-1} + its own update.
    assert all(r["invariant_failed"] == 0 and r["invariant_checked"] == r["num_accepted"] for r in records)
    assert all(r["num_accepted"] >= 1 for r in records)
    # Nodes that sat out rounds were sent what they missed; the crash was seen and counted.
    assert sum(r["catch_up_steps_sent"] + r["full_syncs_sent"] for r in records) > 0
    # Rejections (if node 0 was sampled while down or right after the restart) are the crash's only.
    reasons = [x["reason"] for r in records for x in r["rejected"]]
    assert all("node worker is not running" in x or "lacks global step" in x for x in reasons), reasons
    final = run.final_model()
    assert all(torch.isfinite(t).all() for t in final.values())
    assert records[-1]["heldout_loss"] < run.records[0]["heldout_loss"]

    # What the outsider and the misusing site met: each refused with its kind, in one line, no token in it.
    assert kinds(outside) == {
        "stalled": "stalled",
        "forged upload": "bad_capability",
        "forged download": "bad_capability",
        "not a header": "bad_header",
        "plaintext": "TransportError",
    }, outside
    assert outside["plaintext"].code == "UNAVAILABLE"  # its handshake failed: it reached no handler
    # Without a certificate of the consortium's CA, nothing reaches a handler: each ends at the handshake.
    assert set(kinds(anonymous).values()) == {"TransportError"}, anonymous
    assert {o.code for o in anonymous.values()} == {"UNAVAILABLE"}, anonymous
    inside = dict(share.found)
    offer, partition = inside.pop("offer"), inside.pop("partition")
    # The record's capability used again once the worker has answered: refused as replayed, or (None) the
    # site's own first use where its worker took that record ahead (the step it prefetched), then refused as
    # replayed; or, where the server took the worker's reply from the stream and the round ended first (its
    # capabilities ended), refused as late: a slow site's, not an attack.
    after = [o for o in (inside.pop("download again"), inside.pop("replayed download")) if o is not None]
    assert len(after) >= 1 and all(isinstance(o, Refused) for o in after), after
    assert all(o.kind in ("replayed", "late") for o in after), after
    assert kinds(inside) == {
        "stolen token": "foreign_peer",
        "oversized": "oversized",
        "another node's slot": "foreign_record",
        "another record": "foreign_record",
        "digest": "digest_mismatch",
        "size": "size_mismatch",
        "trickling": "trickling",
    }, inside
    tokens = [t for t in (offer.upload_token, offer.ahead_upload_token, offer.ahead_step_token) if t]
    tokens += [r.token for r in offer.records]
    for refused in [o for o in (*outside.values(), *inside.values()) if isinstance(o, Refused)]:
        assert "\n" not in refused.line() and not any(t in refused.line() for t in tokens), refused.line()
    # ...counted by kind, in the rounds' records and the last one's final_*, and said on the run's last line.
    counted = Counter()
    for record in run.records:
        for name, n in record.items():
            if name.removeprefix("final_").startswith("direct_refused_"):
                counted[name.removeprefix("final_").removeprefix("direct_refused_")] += n
    expected = Counter(bad_capability=2, bad_header=1, stalled=1, oversized=1, foreign_record=2, digest_mismatch=1,
                       size_mismatch=1, trickling=1, foreign_peer=1) + Counter(str(o.kind) for o in after)  # fmt: skip
    assert counted == expected, counted
    total = sum(expected.values())
    assert sum(r["direct_refusals"] for r in records) + records[-1]["final_direct_refusals"] == total
    by_kind = ", ".join(f"{kind} {n}" for kind, n in sorted(expected.items()))
    assert f"{total} requests refused by the direct stream ({by_kind})" in run.stdout, run.stdout[-3000:]
    # ...and changed nothing: the misused node's reply of that round was accepted, no node fell back.
    misused = next(r for r in records if r["round"] == offer.server_round)
    assert partition in {w["partition_id"] for w in misused["client_weights"]}, misused["client_weights"]
    assert all(r["direct_fallbacks"] == 0 for r in records) and records[-1]["final_direct_fallbacks"] == 0


def test_on_receipt_corrects_every_node_in_a_deployment_wherever_the_aggregate_lands(tmp_path, tiny_model_dir):
    """on-receipt in a real deployment: each node's round-2 computation, started ahead, takes the aggregate at
    a step boundary or, when it arrives after the last step, at the end; either way the invariant holds to the
    bit. Which step it lands on is the machine's speed, so it is not asserted here: tests/test_worker.py holds
    the computation at a known step and asserts that very boundary."""
    steps = 8
    run = succeeded(deploy(tmp_path, tiny_model_dir, num_server_rounds=2, correction="on-receipt", local_steps=steps,
                     verify_invariant=True))  # fmt: skip
    rows = [row for rec in run.records[2:] for row in rec["timeline"]]
    assert len(rows) == 2 and all(1 <= row["correction_after_step"] <= steps for row in rows), rows
    for rec in run.records[1:]:
        assert rec["num_accepted"] == 2 and rec["invariant_failed"] == 0 and rec["invariant_checked"] == 2
        assert rec["correction_drift_max"] < 1e-5, rec["correction_drift_max"]


def test_tls_node_authentication_and_the_direct_transport_give_the_same_model(deployed, tmp_path, tiny_model_dir):
    """TLS on the SuperLink, SuperNode authentication, keys registered with `flwr supernode register`,
    and ``transport = "direct"``: the registered nodes train, their blocks on the run's stream (mutual TLS,
    the SuperLink's certificate and CA, each node's own client certificate), node 0's last message pushed a
    round ahead; node 1 dials a wrong address for it, so its updates come on Flower's path and its records
    follow them there, each counted; the global model is the one ``deployed`` (Flower's path, the same seed,
    int8 transfer) reaches, bit for bit, with the same bytes.
    A node with an unregistered key is refused by the SuperLink."""
    stranger = {}

    def start_stranger(deployment):
        key, _ = make_node_key(tmp_path / "stranger", "stranger")  # its public key is never registered
        cmd = supernode_command(
            deployment.superlink,
            free_port(),
            free_port(),
            "partition-id=0 num-partitions=1",
            root_certificates=deployment.tls.ca_cert,
            auth_key=key,
        )
        stranger["log"] = tmp_path / "stranger.log"
        with open(stranger["log"], "w") as log:
            stranger["proc"] = subprocess.Popen(
                cmd, env=deployment.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    try:
        run = deploy(
            tmp_path,
            tiny_model_dir,
            on_started=start_stranger,
            secure=True,
            node_settings=("", f'transport-address="localhost:{free_port()}"'),  # nothing listens there
            transport="direct",
            **COMPARED,
        )
        returncode = stranger["proc"].wait(timeout=120)
    finally:
        if "proc" in stranger:
            stop_process_group(stranger["proc"])
    succeeded(run), succeeded(deployed)
    flower = tmp_path / "flower"
    assert "Uvicorn running on https://" in (flower / "superlink.log").read_text()
    assert "(mutual TLS) for run" in run.stdout, run.stdout[-3000:]  # each node presented its certificate
    assert returncode != 0 and "Failed to activate SuperNode" in stranger["log"].read_text()
    for version in range(1, ROUNDS + 1):
        (bd, sd), (bs, ss) = run.step(version), deployed.step(version)
        assert bd == bs and all(torch.equal(sd[n], ss[n]) for n in sd), f"global step {version} differs"
    for rec in run.records[1:]:  # only the registered nodes were asked; node 1 fell back every round
        assert rec["num_replies"] == 2 and rec["num_accepted"] == 2 and rec["invariant_failed"] == 0, rec
        assert rec["direct_fallbacks"] == 1 and rec["direct_refusals"] == 0, rec
        # Node 0's bytes from round 2 on moved before their message came: its update, committed by the reply
        # without a second upload, and its step, fetched as soon as it was published.
        ahead = (rec["direct_updates_ahead"], rec["direct_steps_prefetched"], rec["direct_ahead_revoked"])
        assert ahead == ((0, 0, 0) if rec["round"] == 1 else (1, 1, 0)), rec
        # Its message of round 3 was pushed while round 2 was in flight (its round-1 reply had committed on the
        # stream), and its worker took the content from the stream once the server had built it, and started
        # round 3 with it (round 2's offer gave it the capability).
        moved = (rec["direct_messages_ahead"], rec["direct_messages_withdrawn"], rec["direct_contents_fetched"])
        assert moved == ((1, 0, 1) if rec["round"] == 3 else (0, 0, 0)), rec
        # Node 0's reply came on the stream each round (its worker uploaded it after its update), and the round
        # took it from there; Flower's reply trailed as its audit, each with the same commit.
        assert rec["direct_replies_on_stream"] == 1 and rec["direct_replies_contradicted"] == 0, rec
        same = deployed.records[rec["round"]]  # the bytes per round, as on Flower's path
        assert (rec["wire_bytes_up"], rec["wire_bytes_down"]) == (same["wire_bytes_up"], same["wire_bytes_down"])
    audits = [rec["direct_replies_audited"] + rec.get("final_direct_replies_audited", 0) for rec in run.records[1:]]
    assert sum(audits) == ROUNDS and run.records[-1]["final_direct_replies_unaudited"] == 0, audits
    on_stream, fell_back = (flower / "worker-0.log").read_text(), (flower / "worker-1.log").read_text()
    assert "direct transport: fetched" in on_stream and "direct transport: uploaded" in on_stream
    assert "large buffers mapped, given back when freed: yes; on huge pages: yes" in on_stream  # at its start
    assert on_stream.count("moved before the message: its update, its step") == ROUNDS - 1
    assert on_stream.count("moved before the message: its update, its step, its content") == 1  # round 3
    assert fell_back.count("direct transport: the update goes inline") == 1  # logged once
    assert run.records[-1]["heldout_loss"] < run.records[0]["heldout_loss"]

"""Malformed replies are rejected with a reason and counted; they never touch the global model.

Real Flower Messages, real strategy, real tiny Llama and a real local update.
"""

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr import core
from parablock_flwr.config import RunConfig
from parablock_flwr.messages import TrainMetrics
from parablock_flwr.model import load_model
from parablock_flwr.records import to_record, to_tensors
from parablock_flwr.server_apps.run import Run, TooFewReplies
from parablock_flwr.strategies import ParaBlock
from parablock_flwr.strategies.reply_checks import honest_update_bound, read_update
from parablock_flwr.strategies.round_stats import RoundStats

BLOCK = 1


@pytest.fixture
def setup(tmp_path, tiny_model_dir):
    model = load_model(str(tiny_model_dir))
    partition = core.partition_blocks(model, layers_per_block=2)
    params = dict(model.named_parameters())
    global_params = {n: params[n] for n in partition.all_names()}
    strategy = ParaBlock(
        global_params=global_params,
        partition=partition,
        schedule=[BLOCK, 0],
        run_dir=tmp_path,
        config=RunConfig(max_update_norm=10.0, min_accepted_replies=0, num_server_rounds=2),
    )
    torch.manual_seed(0)
    update = {n: 1e-3 * torch.randn_like(params[n]) for n in partition.names(BLOCK)}
    before = core.snapshot(global_params, global_params)
    return Run(strategy), update, before  # the run: the step log, the records, the message counts


def aggregate(run: Run, replies: list[Message]) -> dict:
    """Round 1's replies through the run (no grid: too few valid replies stop it); the round's record."""
    return run.aggregate(1, replies, {}, grid=None).record


def reply(node: int, update: dict | None, server_round=1, block=BLOCK, num_examples=10, error=None) -> Message:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, node, 0
    request = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    TaskIdentity.node_id = node
    if error is not None:
        return Message(error, reply_to=request)
    content = RecordDict(
        {
            "metrics": MetricRecord(
                {
                    "server-round": server_round,
                    "block": block,
                    "num-examples": num_examples,
                    "train-loss": 1.0,
                    "compute-s": 0.1,
                    "partition-id": node,
                    "base-version": server_round - 1,
                }
            )
        }
    )
    if update is not None:
        content["update"] = to_record(update) if not isinstance(update, ArrayRecord) else update
    return Message(content, reply_to=request)


def train_metrics(**fields) -> TrainMetrics:
    """A reply's metrics, as the schema reads them: these ``fields`` and the rest plausible."""
    required = dict(server_round=1, block=BLOCK, partition_id=0, base_version=0, num_examples=10, train_loss=1.0,
                    compute_s=0.1)  # fmt: skip
    return TrainMetrics(**{**required, **fields})


def malformed(update):
    name = next(iter(update))
    wrong_shape = dict(update, **{name: torch.zeros(3, 3)})
    nan = dict(update, **{name: torch.full_like(update[name], math.nan)})
    inf = dict(update, **{name: torch.full_like(update[name], math.inf)})
    missing = {n: t for n, t in list(update.items())[1:]}
    fp16 = to_record(update, "fp16")  # the server expects fp32
    huge = dict(update, **{name: update[name] + 100.0})
    return [
        (reply(11, wrong_shape), "wrong shape"),
        (reply(12, update, block=0), "wrong block id 0"),
        (reply(13, nan), "non-finite"),
        (reply(14, inf), "non-finite"),
        (reply(15, update, server_round=0), "stale round"),
        (reply(16, None), "missing 'update'"),
        (reply(17, missing), "wrong parameters"),
        (reply(18, fp16), "wrong dtype"),
        (reply(19, update, num_examples=0), "num-examples=0"),
        (reply(20, None, error=Error(code=0, reason="worker crashed")), "client error: worker crashed"),
        (reply(21, huge), "above max-update-norm=10.0"),
    ]


@pytest.mark.parametrize("gradients", ["steady", "noisy", "spike last", "spike first"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_no_adamw_update_reaches_the_default_bound(gradients, weight_decay):
    """``max-update-norm = -1`` (the default): a real AdamW (the training loop's optimizer, torch's default betas)
    over any gradients, steady, noisy or with a spike at either end, moves a block by less than
    ``honest_update_bound``: steady gradients, the largest an honest update can be, reach about a seventh."""
    torch.manual_seed(0)
    for steps, lr in ((1, 1e-2), (8, 3e-4), (60, 1e-3)):
        p = torch.nn.Parameter(torch.randn(4096))
        start = p.detach().clone()
        optimizer = torch.optim.AdamW([p], lr=lr, weight_decay=weight_decay)
        for t in range(steps):
            scale = {"spike last": 1e3 if t == steps - 1 else 1e-3, "spike first": 1e3 if t == 0 else 1e-3}
            p.grad = torch.randn(4096) if gradients == "noisy" else torch.ones(4096) * scale.get(gradients, 1.0)
            optimizer.step()
        norm = float((p.detach() - start).norm())
        bound = honest_update_bound(4096, steps, lr, weight_decay, float(start.norm()))
        assert norm < bound / 6, (norm, bound)


def test_the_default_bound_rejects_a_forged_update_and_takes_an_honest_one(setup):
    """With the default ``max-update-norm = -1``, an update a stolen capability could carry (a block moved by
    1.0 per value: the size of the weights themselves) is rejected, counted with its reason; an honest one
    (1e-3 per value, as a few AdamW steps at the default 3e-4 give) is taken."""
    run, update, _ = setup
    cfg = run.algorithm.config = run.config = RunConfig(min_accepted_replies=0, num_server_rounds=2)
    bound = run.algorithm.max_update_norm(BLOCK)
    assert bound == honest_update_bound(sum(t.numel() for t in update.values()), cfg.local_steps, cfg.learning_rate,
                                        0.0, 0.0)  # fmt: skip
    forged = {n: torch.ones_like(t) for n, t in update.items()}
    rec = aggregate(run, [reply(10, update), reply(11, forged)])
    assert rec["num_accepted"] == 1 and rec["num_rejected"] == 1
    assert f"above max-update-norm={bound}" in rec["rejected"][0]["reason"]


def test_each_malformed_kind_is_rejected_and_counted(setup):
    run, update, before = setup
    strategy = run.algorithm
    bad = malformed(update)
    good = reply(10, update)
    outcome = run.aggregate(1, [good] + [m for m, _ in bad], {}, grid=None)
    step_record, rec = outcome.arrays, outcome.record
    assert rec["num_accepted"] == 1 and rec["num_rejected"] == len(bad)
    reasons = {r["node"]: r["reason"] for r in rec["rejected"]}
    for msg, expected in bad:
        assert expected in reasons[msg.metadata.src_node_id], (expected, reasons)
    # Only the valid update moved the model: one client, so g == its update exactly.
    for n, t in strategy.global_params.items():
        expected = before[n] + update[n] if n in update else before[n]
        assert torch.equal(t.detach(), expected), n
    assert set(to_tensors(step_record)) == set(update)


def test_all_rejected_leaves_the_model_unchanged(setup):
    run, update, before = setup
    assert aggregate(run, [m for m, _ in malformed(update)])["num_accepted"] == 0
    for n, t in run.algorithm.global_params.items():
        assert torch.equal(t.detach(), before[n]), n
    # The (zero) step reaches the log when the run makes round 1 durable, after round 2's messages are out.
    assert not run.history.step_log.has(1)
    run.history.write(1, run.algorithm.global_params)
    assert all(torch.count_nonzero(t) == 0 for t in run.history.step_log.read(1)[1].values())


def test_too_few_valid_replies_stop_the_run_with_one_line(setup):
    run, update, before = setup
    strategy = run.algorithm
    strategy.config = run.config = RunConfig(max_update_norm=10.0, min_accepted_replies=2, on_too_few_replies="stop")
    strategy.stats = RoundStats(1, nodes=[10, 13])  # as configure_train leaves it
    with pytest.raises(
        TooFewReplies,
        match=r"round 1: 1 valid replies, expected at least "
        r"min-accepted-replies=2 \(node 13: non-finite values",
    ):
        aggregate(run, [reply(10, update), malformed(update)[2][0]])
    for n, t in strategy.global_params.items():  # nothing was applied
        assert torch.equal(t.detach(), before[n]), n


def test_the_invariant_check_hashes_each_replys_update_and_x_only_where_the_checkpoint_did_not(setup, monkeypatch):
    """verify-invariant on the server: each reply's check hashes the reply's update as it came; ``x``'s tensors
    are hashed once and kept (``FedBCD.x_hashes``) until a step moves them, and the checkpoint's digest of
    ``x^r``, made while round r+1 is out, leaves round r+1's checks nothing of ``x`` to hash. A node's replica
    keeps its hashes too (``ModelReplica.hashes``): neither side's check grows with the model's size."""
    run, update, before = setup
    strategy = run.algorithm
    strategy.config = RunConfig(verify_invariant=True, min_accepted_replies=0, num_server_rounds=2)
    names = strategy.partition.all_names()
    replies = [reply(node, update) for node in (10, 11, 12)]
    for r in replies:
        r.content["trace"] = ConfigRecord({"local-model-sha256": core.model_digest(before, names, update)})
    hashed, hash_tensor, hash_update = [], core.tensor_sha256, core.update_sha256
    monkeypatch.setattr(core.digests, "tensor_sha256", lambda t: hashed.append(("x", t.numel())) or hash_tensor(t))
    monkeypatch.setattr(core.digests, "update_sha256", lambda u, n: hashed.append(("update", n)) or hash_update(u, n))
    rec = aggregate(run, replies)
    assert (rec["num_accepted"], rec["invariant_checked"], rec["invariant_failed"]) == (3, 3, 0)
    model = sum(before[n].numel() for n in names)
    assert sum(n for kind, n in hashed if kind == "x") == model  # once, for the three replies
    assert sorted(n for kind, n in hashed if kind == "update") == sorted(3 * list(update))

    hashed.clear()
    run.save_checkpoint(1)  # x^1: the block round 1 moved is hashed again, here
    assert sum(n for kind, n in hashed if kind == "x") == sum(t.numel() for t in update.values())
    hashed.clear()
    as_read = read_update(to_record(update), {n: tuple(t.shape) for n, t in update.items()})  # as a reply's
    core.model_digest(strategy.global_params, names, as_read, strategy.x_hashes)  # round 2's check, as ParaBlock's
    assert [kind for kind, _ in hashed] == ["update"] * len(update)  # nothing of x^1 left to hash


def test_a_failed_invariant_check_rejects_the_update_and_resynchronises_the_node(setup):
    """With verify-invariant, a client whose local model is not x^{r-1} + its update is rejected
    (counted), x does not move, and its next message is a full sync that drops its own state."""
    run, update, before = setup
    strategy = run.algorithm
    strategy.config = RunConfig(verify_invariant=True, min_accepted_replies=0, num_server_rounds=2)
    good, bad = reply(10, update), reply(11, update)
    names = strategy.partition.all_names()
    good.content["trace"] = ConfigRecord({"local-model-sha256": core.model_digest(before, names, update)})
    bad.content["trace"] = ConfigRecord({"local-model-sha256": core.digest(before, names)})  # its update is missing
    rec = aggregate(run, [good, bad])
    assert (rec["num_accepted"], rec["invariant_checked"], rec["invariant_failed"]) == (1, 2, 1)
    assert "invariant broken" in rec["rejected"][0]["reason"]
    run.history.write(1, run.algorithm.global_params)
    step, run_part = to_record(run.history.step_log.read(1)[1]), run.round_part(2, {})
    messages = {m.metadata.dst_node_id: m for m in strategy.train_messages(2, [10, 11], step, run_part)}
    assert "sync-values" not in messages[10].content and "sync-values" in messages[11].content
    assert messages[11].content["round"]["sync-version"] == 0
    sent = to_tensors(messages[11].content["sync-values"])
    assert all(torch.equal(sent[n], before[n]) for n in names)  # x^0, exactly


def test_a_reply_whose_on_receipt_correction_drifted_too_far_is_rejected(setup):
    run, update, before = setup
    run.algorithm.config = RunConfig(max_correction_drift=1e-4, min_accepted_replies=0, num_server_rounds=2)
    drifted = reply(11, update)
    drifted.content["metrics"]["correction-drift"] = 0.5
    rec = aggregate(run, [reply(10, update), drifted])
    assert (
        rec["num_accepted"] == 1
        and "correction drift 0.5 above max-correction-drift=0.0001" in rec["rejected"][0]["reason"]
    )


def test_a_rounds_full_syncs_share_one_copy_of_the_model(setup):
    """After a resume every node gets a full sync: the server builds it once per round (O(|x|)
    memory, not one copy per node), and the round's messages are built as they are pushed."""
    strategy = setup[0].algorithm
    strategy.stats = RoundStats(2)
    strategy.sync.needs_full_sync |= {1, 2, 3}
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    messages = strategy.train_messages(2, [1, 2, 3], ArrayRecord(), setup[0].round_part(2, {}))
    assert not isinstance(messages, list)  # a generator: RoundDriver.push builds and pushes in batches
    syncs = [m.content["sync-values"] for m in messages]
    assert syncs[0] is syncs[1] is syncs[2] and strategy.stats.full_syncs_sent == 3


def test_rows_dropped_for_length_are_counted_once_per_dataset():
    """Each node with its own data counts its own dropped rows; nodes on partitions of the run's
    dataset all report that dataset's count, which the round counts once (not once per node)."""
    from parablock_flwr.strategies.reply_checks import Reply
    from parablock_flwr.strategies.round_stats import dropped_for_length

    def reply(node: int, own: int, dropped: int) -> Reply:
        return Reply(node, train_metrics(partition_id=node, own_data=own, dropped_examples=dropped), None)

    assert dropped_for_length([reply(0, 1, 4), reply(1, 1, 7)]) == 11
    assert dropped_for_length([reply(0, 0, 5), reply(1, 0, 5), reply(2, 1, 2)]) == 7
    assert dropped_for_length([]) == 0


def test_a_site_with_its_own_data_keeps_the_count_of_its_first_accepted_reply():
    """A site's data does not change during a run: a later reply of a site with its own data
    (`own-data = 1`) claiming another count than its first accepted one is rejected (within the bound
    every node has: `max-num-examples`, else `num-examples`)."""
    from parablock_flwr.strategies.reply_checks import Reply, check_own_count

    def reply(num_examples: float, own: int = 1) -> Reply:
        return Reply(4, train_metrics(partition_id=2, own_data=own, num_examples=num_examples), None)

    counts = {}
    assert check_own_count(reply(48), counts) is None  # the first: nothing to compare with
    counts[2] = 48.0
    assert check_own_count(reply(48), counts) is None
    assert (
        check_own_count(reply(1e300), counts)
        == "num-examples=1e+300, expected 48 (this site's count in its first accepted reply)"
    )
    assert check_own_count(reply(1e300, own=0), counts) is None  # a partitioned node: the run's bound applies


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 4_999, 9_999])
def test_one_non_finite_value_anywhere_is_found(bad, where):
    """The reply check's finiteness test (minimum and maximum, no mask) finds one NaN or infinity
    wherever it sits, beside finite values as large as float32 holds, as torch.isfinite would."""
    from parablock_flwr.core import all_finite

    values = torch.randn(10_000)
    values[1], values[2] = torch.finfo(torch.float32).max, torch.finfo(torch.float32).min
    assert all_finite(values) and all_finite(torch.zeros(0)) and all_finite(torch.tensor(3.0))
    values[where] = bad
    assert not all_finite(values) and not all_finite(values.view(100, 100).t())


def test_the_model_digest_is_sha256_of_the_tensors_bytes_in_order():
    """``core.digest`` reads each tensor in place; its value must stay what checkpoints already hold:
    SHA-256 over each name and the tensor's C-order bytes (0-d, empty and non-contiguous tensors too)."""
    import hashlib

    params = {"w": torch.randn(3, 4).t(), "s": torch.tensor(2.5), "e": torch.zeros(0, 2), "b": torch.arange(5.0)}
    expected = hashlib.sha256()
    for name in ("b", "w", "s", "e"):
        expected.update(name.encode())
        expected.update(params[name].contiguous().numpy().tobytes())
    assert core.digest(params, ["b", "w", "s", "e"]) == expected.hexdigest()


@pytest.mark.parametrize("transfer_dtype", ["fp32", "bf16"])
def test_a_replys_update_is_checked_where_it_arrived_and_copied_once_when_it_is_combined(transfer_dtype):
    """The server's checks read an fp32 update in the reply's own payload (no copy on the critical path:
    1 GB of fp32 cost a clone there); what it combines is decoded from the record into memory of its own."""
    from parablock_flwr.records import record_arrays

    update = {"a": torch.randn(64, 32), "b": torch.randn(1000)}
    shapes = {n: tuple(t.shape) for n, t in update.items()}
    record = to_record(core.round_with_feedback(update, None, transfer_dtype)[0], transfer_dtype)
    payload = record_arrays(record)["values"]
    start = payload.__array_interface__["data"][0]
    inside = {
        n: start <= t.data_ptr() < start + payload.nbytes
        for n, t in read_update(record, shapes, transfer_dtype).items()
    }
    assert inside == {n: transfer_dtype == "fp32" for n in update}  # bf16 is widened to fp32: new memory anyway
    combined = to_tensors(record, shapes, transfer_dtype)
    assert not any(start <= t.data_ptr() < start + payload.nbytes for t in combined.values())
    combined["a"].add_(1.0)  # its own: writable, and the payload is unchanged
    assert torch.equal(read_update(record, shapes, transfer_dtype)["a"] + 1.0, combined["a"])


def test_a_rounds_record_names_each_sites_reply_and_report_sites_sums_them(setup, tmp_path):
    """Each accepted reply's site in the record with its compute and bytes, each rejected one with its site
    (from the reply it sent): ``parablock-flwr report --sites`` sums them per site, the first rejection's
    reason beside it."""
    from parablock_flwr.metrics import RunRecorder
    from parablock_flwr.report import sites

    run, update, _ = setup
    forged = {n: torch.ones_like(t) for n, t in update.items()}
    rec = aggregate(run, [reply(10, update), reply(11, forged)])
    (weights,), (rejected,) = rec["client_weights"], rec["rejected"]
    assert (weights["partition_id"], weights["compute_s"]) == (10, 0.1) and weights["bytes_up"] > 0
    assert (rejected["node"], rejected["partition_id"]) == (11, 11)
    recorder = RunRecorder(tmp_path / "run")
    for server_round in (1, 2):
        recorder.write({**rec, "round": server_round})
    lines = sites(tmp_path / "run").splitlines()
    assert lines[0].split()[:4] == ["site", "accepted", "rejected", "examples"]
    assert lines[1].split()[:7] == ["site", "10", "2", "0", "10", "0.2", f"{2 * weights['bytes_up'] / 1e6:.1f}"]
    assert lines[2].split()[:6] == ["site", "11", "0", "2", "0", "0.0"] and "above max-update-norm" in lines[2]


def test_a_rounds_prepared_buffers_are_its_own_and_none_outlives_its_aggregate(setup):
    """The round's sum and new ``x[b]`` are taken once by its aggregate and dropped after it: a later round that
    finds none prepared (or aggregates again with no reply, ``min-accepted-replies = 0``) makes new memory, never
    writing into ``x``'s own storage, and ``x`` keeps its values when no reply is valid."""
    run, update, before = setup
    strategy = run.algorithm
    strategy.buffers.prepare(1, {n: strategy.global_params[n] for n in strategy.partition.names(BLOCK)})
    record = aggregate(run, [reply(11, update)])
    assert record["num_accepted"] == 1
    assert record["server_one_pass_s"] > 0 and "server_combine_s" not in record  # one reply, the default mean
    assert strategy._sum_into == {} and strategy._new_x_into == {}  # nothing of round 1's is kept
    x1 = {n: (t.data_ptr(), t.detach().clone()) for n, t in strategy.global_params.items()}
    outcome = strategy.aggregate_train(2, [], {})  # no reply, no buffers prepared: a zero step
    assert outcome.step is not None and all(float(t.abs().max()) == 0 for _, t in outcome.step.items())
    for n, (ptr, values) in x1.items():
        assert torch.equal(strategy.global_params[n], values)
        assert n not in outcome.step or strategy.global_params[n].data_ptr() != ptr  # new storage, x^1 kept apart

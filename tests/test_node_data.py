"""Real sites: each node trains on its own data (its node config names it) and, with
``evaluation = "clients"``, evaluates the global model on its own held-out rows; the server then
reads no data. In process (the node worker, real tiny Llama) and in a real 3-SuperNode deployment."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parablock_flwr import core, node
from parablock_flwr.client_apps.app import unknown_node_config_key
from parablock_flwr.config import RunConfig
from parablock_flwr.data import tokenized_rows
from parablock_flwr.evaluation import evaluate
from parablock_flwr.messages import EvaluateMetrics, EvaluateReply
from parablock_flwr.metrics import RunRecorder
from parablock_flwr.model import load_for_training, load_tokenizer
from parablock_flwr.node.settings import NodeSettings, node_settings_problem
from parablock_flwr.server_apps.client_evaluation import aggregate as aggregate_client_evaluation
from parablock_flwr.tools.launch import run_deployment
from parablock_flwr.wire import join_pieces, unpack
from parablock_flwr.worker.server import NodeWorker

from helpers import finished, relayed, tiny_config

SITES = {0: (12, 4), 1: (20, 5), 2: (28, 6)}  # partition id -> (training rows, held-out rows): all different


def site_file(folder, site: int, split: str, rows: int):
    """An Alpaca-schema file of rows no other site has (the site's number is in every row)."""
    path = folder / f"site-{site}-{split}.jsonl"
    lines = [
        {"instruction": f"Site {site} {split} item {i}: add {i} and {site}.", "input": "", "output": f"{i + site}"}
        for i in range(rows)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def site_settings(folder, site: int) -> str:
    """The extra ``--node-config`` of a site: its own training file and its own held-out file."""
    train_rows, heldout_rows = SITES[site]
    train, heldout = site_file(folder, site, "train", train_rows), site_file(folder, site, "heldout", heldout_rows)
    return f'dataset="alpaca:{train}" heldout-dataset="alpaca:{heldout}"'


def test_node_settings_are_checked_in_one_line():
    assert unknown_node_config_key({"partition-id": 0, "dataset": "csv:/a.csv"}) == (
        "node config dataset='csv:/a.csv': expected reasoning-gym:<task>, alpaca:<path or hub id>, "
        "mathinstruct:<path or hub id> or messages:<path or hub id>"
    )
    assert "also set partition-id=<an integer unique among the nodes>" in unknown_node_config_key(
        {"dataset": "alpaca:/srv/a.jsonl"}
    )
    assert unknown_node_config_key({"partition-id": 1, "device": "gpu0"}) == (
        "node config device='gpu0': expected cpu, cuda or cuda:<index>"
    )
    assert unknown_node_config_key({"partition-id": 1, "dataset": "alpaca:/a.jsonl", "device": "cuda:1"}) is None
    assert unknown_node_config_key({"transport": "direct"}).startswith(
        "node config transport='direct': expected \"flower\""
    )
    assert unknown_node_config_key({"transport-address": "site-a"}) == (
        "node config transport-address='site-a': expected host:port (the run's stream as this site dials it)"
    )
    assert unknown_node_config_key({"transport": "flower", "transport-address": "10.0.0.5:9095"}) is None
    with pytest.raises(ValueError, match=r"device='cuda:3': this machine has \d+ CUDA devices"):
        node.node_device("cuda:3" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}")


def test_client_evaluation_is_the_example_weighted_mean_and_completes_earlier_records(tmp_path):
    rows = [
        EvaluateReply(0, EvaluateMetrics(eval_version=0, heldout_loss=2.0, heldout_examples=4)),
        EvaluateReply(1, EvaluateMetrics(eval_version=0, heldout_loss=1.0, heldout_examples=12)),
    ]
    out = aggregate_client_evaluation(rows)
    assert out["heldout_loss"] == pytest.approx((2.0 * 4 + 1.0 * 12) / 16) and out["heldout_examples"] == 16
    assert out["perplexity"] == pytest.approx(math.exp(out["heldout_loss"]))
    recorder = RunRecorder(tmp_path)
    recorder.write({"round": 0})
    recorder.write({"round": 1, "train_loss": 3.0})
    recorder.write({"round": 0, "heldout_loss": 2.5})  # completes round 0's record by appending
    assert recorder.read() == [{"round": 0, "heldout_loss": 2.5}, {"round": 1, "train_loss": 3.0}]


def test_a_worker_with_node_local_data_reads_only_its_own_files_and_evaluates_what_it_holds(tmp_path, tiny_model_dir):
    """The run config's dataset does not exist: the node trains on its own 20 rows (its weight), and
    round 1's reply carries its evaluation of x^0 on its own 5 held-out rows, computed on the model
    it holds before the computation of round 2 starts. The evaluate op then evaluates x^1."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        **{"dataset": "alpaca:/nonexistent/central.jsonl", "evaluation": "clients", "local-steps": 2},
    )
    settings = site_settings(tmp_path, 1).replace('"', "").split()
    own = dict(s.split("=", 1) for s in settings)
    header = {
        "op": "train",
        "run-id": 11,
        "run-config": config,
        "partition-id": 1,
        "num-partitions": 1,
        "node": {"dataset": own["dataset"], "heldout-dataset": own["heldout-dataset"], "device": "cpu"},
        "round": {"server-round": 1, "block": 0, "step-block": -1, "next-block": 1, "algorithm": "parablock",
                  "run-dir": "unused", "evaluate-version": 0, "evaluate-generate": 1},
    }  # fmt: skip
    worker = NodeWorker()
    reply, update = worker.serve_request(header, {})
    metrics = reply["metrics"]
    assert metrics["num-examples"] == 20 and metrics["heldout-examples"] == 5 and metrics["eval-version"] == 0

    cfg = RunConfig.from_flower(config)
    model, partition = load_for_training(cfg)  # x^0, evaluated independently of the worker
    tokenizer = load_tokenizer(cfg.model)
    heldout = tokenized_rows(own["heldout-dataset"], None, cfg.seed, tokenizer, cfg.max_seq_len)
    expected, _ = evaluate(model, tokenizer, heldout, cfg, generate=False)
    assert metrics["heldout-loss"] == pytest.approx(expected["heldout_loss"], rel=1e-5)

    g1 = unpack(join_pieces(update))  # the server's step: its only client's update
    evaluate_header = dict(header, op="evaluate")
    evaluate_header["round"] = {"server-round": 2, "block": -1, "step-block": 0, "next-block": -1,
                                "algorithm": "parablock", "run-dir": "unused", "evaluate-version": 1}  # fmt: skip
    reply, _ = worker.serve_request(evaluate_header, relayed({"global-step": g1}))
    params = dict(model.named_parameters())
    core.apply_step(params, g1)
    expected, _ = evaluate(model, tokenizer, heldout, cfg, generate=False)
    assert reply["metrics"]["eval-version"] == 1 and reply["metrics"]["partition-id"] == 1
    assert reply["metrics"]["heldout-loss"] == pytest.approx(expected["heldout_loss"], rel=1e-5)
    assert node.resources(cfg, 11, NodeSettings(own["dataset"], own["heldout-dataset"], "cpu")).replica.version == 1


def test_without_a_heldout_file_the_first_rows_of_the_own_data_are_held_out(tmp_path, tiny_model_dir):
    cfg = RunConfig.from_flower(tiny_config(tiny_model_dir, tmp_path, evaluation="clients", **{"heldout-examples": 3}))
    train = site_file(tmp_path, 0, "train", 12)
    resources = node.resources(cfg, 12, NodeSettings(f"alpaca:{train}"))
    assert len(resources.heldout_rows) == 3 and len(resources.rows(cfg, 0, 1)) == 9
    assert not set(resources.heldout_rows["prompt"]) & set(resources.train_rows["prompt"])


ROUNDS = 2


@pytest.fixture(scope="module")
def three_sites(tmp_path_factory, tiny_model_dir):
    """3 SuperNodes, each told only its own training and held-out files; the run config's dataset
    does not exist (a node or the server that read it would fail the run)."""
    tmp_path = tmp_path_factory.mktemp("sites")
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "out"
    config = tiny_config(
        tiny_model_dir,
        out,
        **{
            "dataset": "alpaca:/nonexistent/central.jsonl",
            "evaluation": "clients",
            "max-num-examples": 28,  # the largest site's row count: each reply's weight is checked against it
            "num-server-rounds": ROUNDS,
            "local-steps": 2,
            "verify-invariant": True,
        },
    )
    result = run_deployment(
        tmp_path / "flower",
        config,
        num_supernodes=3,
        timeout_s=900,
        node_settings=[site_settings(data, site) for site in range(3)],
    )
    return finished(result, out)


@pytest.mark.e2e  # starts Flower processes
def test_three_sites_train_on_their_own_files_and_evaluate_on_their_own_heldout_rows(three_sites):
    run = three_sites
    assert run.returncode == 0 and run.run_dir is not None, run.stdout[-4000:] + run.stderr[-2000:]
    records = {r["round"]: r for r in run.records}
    assert sorted(records) == list(range(ROUNDS + 1))
    for server_round in range(1, ROUNDS + 1):
        rec = records[server_round]
        assert rec["num_accepted"] == 3 and rec["invariant_failed"] == 0
        weights = {w["partition_id"]: (w["num_examples"], w["weight"]) for w in rec["client_weights"]}
        assert weights == {site: (rows, rows) for site, (rows, _) in SITES.items()}
    for version in range(ROUNDS + 1):  # x^0..x^R, each evaluated by the nodes on their own rows
        rec = records[version]
        nodes = rec["heldout_nodes"]
        assert rec["evaluated_by"] == "clients"
        assert {n["partition_id"]: n["heldout_examples"] for n in nodes} == {s: h for s, (_, h) in SITES.items()}
        mean = sum(n["heldout_loss"] * n["heldout_examples"] for n in nodes) / sum(n["heldout_examples"] for n in nodes)
        assert rec["heldout_loss"] == pytest.approx(mean, rel=1e-12)
        assert rec["perplexity"] == pytest.approx(math.exp(mean))
    assert records[ROUNDS]["heldout_loss"] < records[0]["heldout_loss"]


@pytest.mark.parametrize(
    "config, says",
    [
        ({"transport-require-tls": "yes"}, "transport-require-tls='yes': expected true or false"),
        ({"transport-certfile": "/etc/site.pem"}, "expected both (the site's client certificate and its key)"),
        ({"transport-ca": "/nonexistent/ca.crt"}, "transport-ca='/nonexistent/ca.crt': no such file"),
    ],
)
def test_a_sites_stream_settings_are_checked_in_one_line(config, says):
    problem = node_settings_problem(config)
    assert problem is not None and says in problem and "\n" not in problem

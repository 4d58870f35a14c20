"""A node config's ``allow-models`` / ``allow-data`` bound what a run config may make the node load:
another model or data file is refused in one line naming the value and the list, before anything is
loaded, through the same node runtime as in simulation and deployment (``node.resources``); and its
``memory-limit-gib`` (else the machine's free memory) bounds what the run's plan may need."""

from __future__ import annotations

import os
import re

import pytest

from parablock_flwr import node
from parablock_flwr.client_apps.app import unknown_node_config_key
from parablock_flwr.config import RunConfig
from parablock_flwr.node.settings import NodeSettings, allows
from parablock_flwr.worker.server import NodeWorker

from helpers import tiny_config, worker_request


def test_entries_match_values_or_paths_under_a_folder(tmp_path):
    (tmp_path / "models" / "ok").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "models" / "link")
    models = f"{tmp_path}/models/"
    assert allows(models, f"{tmp_path}/models/ok")
    assert not allows(models, f"{tmp_path}/models/../elsewhere")  # '..' resolved first
    assert not allows(models, f"{tmp_path}/models/link")  # a symlink out of the folder
    assert not allows(models, f"{tmp_path}/models-evil/ok")  # a sibling with the same prefix
    assert allows("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct")
    assert not allows("meta-llama/", "meta-llama/Llama-3.1-8B-Instruct")  # a hub id is not a folder
    assert allows(f"alpaca:{tmp_path}/", f"alpaca:{tmp_path}/models/a.jsonl")
    assert not allows(f"alpaca:{tmp_path}/", f"messages:{tmp_path}/models/a.jsonl")  # the kind must match
    assert allows(f"{tmp_path}/", f"messages:{tmp_path}/models/a.jsonl")  # a bare folder: any kind
    assert not allows("reasoning-gym:syllogism", "reasoning-gym:syllogism,gsm_symbolic")


def test_refusal_names_the_value_and_the_list():
    settings = NodeSettings(allow_models="/models/ embedded:smollm2-135m-instruct", allow_data="alpaca:/srv/site0/")
    assert settings.refusal("/models/llama-8b", "alpaca:/srv/site0/train.jsonl") is None
    assert settings.refusal("/tmp/evil", "alpaca:/srv/site0/train.jsonl") == (
        "model='/tmp/evil' refused: this node's allow-models is '/models/ embedded:smollm2-135m-instruct'"
    )
    assert settings.refusal("/models/llama-8b", "alpaca:/etc/passwd") == (
        "dataset='alpaca:/etc/passwd' refused: this node's allow-data is 'alpaca:/srv/site0/'"
    )
    own = NodeSettings("alpaca:/srv/site0/train.jsonl", "alpaca:/srv/other/dev.jsonl", allow_data="alpaca:/srv/site0/")
    assert own.refusal("m", "alpaca:/anything/the/run/says.jsonl") == (  # the run's dataset is not read
        "dataset='alpaca:/srv/other/dev.jsonl' refused: this node's allow-data is 'alpaca:/srv/site0/'"
    )
    assert NodeSettings().refusal("/anything", "alpaca:/anything") is None  # no list: any value
    assert unknown_node_config_key({"allow-models": "/models/", "allow-data": "alpaca:/srv/"}) is None


def test_a_run_config_pointing_the_worker_elsewhere_is_refused_before_loading(tmp_path, tiny_model_dir):
    """The node worker's own path (a request as the ClientApp relays it): refused, state intact, nothing
    loaded; the same worker then serves the allowed model."""
    config = tiny_config(tiny_model_dir, tmp_path)
    allowed = {"allow-models": f"{tiny_model_dir}/", "allow-data": config["dataset"]}
    elsewhere = dict(config, model=str(tmp_path / "not-a-model"))  # loading it would fail otherwise
    worker = NodeWorker()
    header = dict(worker_request(elsewhere, 31, 1, 0, 1), node={**NodeSettings().as_header(), **allowed})
    reply, update = worker.serve_request(header, {})
    assert reply == {
        "error": f"model={str(tmp_path / 'not-a-model')!r} refused: this node's allow-models is '{tiny_model_dir}/'",
        "state-intact": True,
    }
    assert update == {} and (node.loaded() is None or node.loaded().key[0] != 31)  # nothing loaded for it
    other_data = dict(config, dataset="reasoning-gym:syllogism")
    reply, _ = worker.serve_request(dict(header, **{"run-config": other_data}), {})
    assert (
        reply["error"] == f"dataset='reasoning-gym:syllogism' refused: this node's allow-data is {config['dataset']!r}"
    )
    reply, _ = worker.serve_request(dict(header, **{"run-config": config}), {})
    assert "error" not in reply, reply
    assert node.resources(
        RunConfig.from_flower(config), 31, NodeSettings(**{k.replace("-", "_"): v for k, v in allowed.items()})
    )


def test_the_simulation_path_refuses_the_same(tmp_path, tiny_model_dir):
    cfg = RunConfig.from_flower(tiny_config(tiny_model_dir, tmp_path))
    with pytest.raises(node.RequestRefused, match=r"^model=.* refused: this node's allow-models is '/nowhere/'$"):
        node.resources(cfg, 32, NodeSettings(allow_models="/nowhere/"))


def test_a_refused_run_does_not_take_the_worker_from_the_run_it_serves(tmp_path, tiny_model_dir):
    """A new run whose model the allow-list refuses is answered with the refusal and changes nothing:
    the worker goes on serving its current run (before: it had already switched to the refused run, so
    the current run's next round was refused as a run this worker had left)."""
    config = tiny_config(tiny_model_dir, tmp_path)
    allowed = {"allow-models": f"{tiny_model_dir}/", "allow-data": config["dataset"]}
    worker = NodeWorker()
    node_header = {**NodeSettings().as_header(), **allowed}
    reply, _ = worker.serve_request(dict(worker_request(config, 41, 1, 0, 1), node=node_header), {})
    assert "error" not in reply, reply
    elsewhere = dict(config, model=str(tmp_path / "not-a-model"))
    reply, _ = worker.serve_request(dict(worker_request(elsewhere, 42, 1, 0, 1), node=node_header), {})
    assert reply["error"].startswith("model=") and reply["state-intact"], reply
    assert worker.run_id == 41
    reply, _ = worker.serve_request(dict(worker_request(config, 41, 2, 1, -1), node=node_header), {})
    assert "error" not in reply, reply


def test_a_run_that_needs_more_memory_than_the_node_has_is_refused_before_loading(tmp_path, tiny_model_dir):
    """plan's peak for the worker against ``memory-limit-gib``: one line with both figures and what to lower,
    state intact, the run the worker serves kept; a bad limit is named; without a limit, the machine's free
    memory (this machine holds the tiny model)."""
    config = tiny_config(tiny_model_dir, tmp_path)
    worker = NodeWorker()
    reply, _ = worker.serve_request(worker_request(config, 51, 1, 0, 1), {})  # no limit: it fits here
    assert "error" not in reply, reply
    small = {**NodeSettings().as_header(), "memory-limit-gib": "0.25"}
    reply, update = worker.serve_request(dict(worker_request(config, 52, 1, 0, 1), node=small), {})
    assert reply["state-intact"] and update == {}, reply
    needed = float(re.search(r"needs about ([\d.]+) GiB", reply["error"])[1])
    assert needed > 0.25 and re.fullmatch(
        r"memory: this run needs about [\d.]+ GiB on this node \(parablock-flwr plan's peak for its worker: "
        r"algorithm=parablock, .*\) and it has 0\.2 GiB \(node config memory-limit-gib\); nothing loaded: "
        r"lower layers-per-block, micro-batch-size or max-seq-len, or set gradient-checkpointing = true",
        reply["error"],
    ), reply["error"]
    assert worker.run_id == 51 and node.loaded().key[0] == 51  # the run it serves keeps its model
    bad = {**NodeSettings().as_header(), "memory-limit-gib": "lots"}
    reply, _ = worker.serve_request(dict(worker_request(config, 53, 1, 0, 1), node=bad), {})
    assert (
        reply["error"]
        == "node config memory-limit-gib='lots': expected a number of GiB > 0 (plan prints what a run needs)"
    )


def test_a_machine_that_does_not_say_its_free_memory_loads_without_a_check(tmp_path, tiny_model_dir, monkeypatch):
    """No /proc/meminfo (macOS): nothing to hold the plan against, so no refusal (and no error)."""
    from parablock_flwr.node import cache

    monkeypatch.setattr(cache, "available_bytes", lambda: None)
    cfg = RunConfig.from_flower(tiny_config(tiny_model_dir, tmp_path))
    assert cache.memory_refusal(cfg, NodeSettings()) is None
    assert cache.memory_refusal(cfg, NodeSettings(memory_limit_gib="0.25")).startswith("memory: this run needs")

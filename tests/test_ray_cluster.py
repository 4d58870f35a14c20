"""The simulation on an existing Ray cluster of two nodes (both on this machine, each with its own raylet
and CPU): both nodes' actors serve clients, and the run equals the single-machine run bit for bit."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psutil
import pytest

from parablock_flwr.tools.launch import run_simulation

from helpers import finished, simulate_in_process, tiny_config

pytestmark = pytest.mark.e2e

SETTINGS = {"num_server_rounds": 2, "local_steps": 2, "generate_examples": 0, "transfer_dtype": "int8"}
CLIENTS = 4


def final_digest(run_dir: Path) -> str:
    """The digest of the run's last global model, as its checkpoint holds it."""
    (state,) = (run_dir / "checkpoint").glob("round-*/state.json")
    return json.loads(state.read_text())["global_sha256"]


class ActorWatch:
    """Which raylet (Ray node) each worker process belongs to, sampled while the run goes: a Ray actor is a
    child of its node's raylet, and it is gone once the run ends."""

    def __init__(self, raylets: dict[str, int]):
        self.raylets, self.node_of, self.done = raylets, {}, threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self) -> None:
        while not self.done.is_set():
            for label, pid in self.raylets.items():
                try:
                    for child in psutil.Process(pid).children(recursive=True):
                        self.node_of[child.pid] = label
                except psutil.Error:
                    pass
            self.done.wait(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def test_a_simulation_across_two_ray_nodes_equals_the_single_machine_run(tmp_path, tiny_model_dir):
    from ray import ray_constants
    from ray.cluster_utils import Cluster

    # The single-machine run: the same ServerApp and ClientApp in one process, without Ray (seconds to start).
    alone = simulate_in_process(tmp_path / "alone", tiny_model_dir, num_supernodes=CLIENTS, **SETTINGS)
    assert alone.returncode == 0, alone.stderr[-3000:]

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        raylets = {
            f"node-{i}": node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
            for i, node in enumerate(cluster.list_all_nodes())
        }
        assert len(set(raylets.values())) == 2
        config = tiny_config(
            tiny_model_dir, tmp_path / "cluster", **{k.replace("_", "-"): v for k, v in SETTINGS.items()}
        )
        with ActorWatch(raylets) as watch:
            result = run_simulation(tmp_path / "cluster-flower", config, CLIENTS, 1, 600, ray_address=cluster.address)
        run = finished(result, tmp_path / "cluster")
        assert run.returncode == 0, run.stdout[-3000:]
    finally:
        cluster.shutdown()  # its own raylets and GCS, by the processes it started

    served = [row for record in run.records for row in record.get("served_by", [])]
    assert len(served) == CLIENTS * SETTINGS["num_server_rounds"]
    nodes = {watch.node_of.get(row["process_id"]) for row in served}
    assert nodes == {"node-0", "node-1"}, (served, watch.node_of)
    assert final_digest(run.run_dir) == final_digest(alone.run_dir)

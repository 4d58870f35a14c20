"""docs/deploy-8b.md followed end to end on one machine: its bash blocks marked ``<!-- loopback: PHASE -->``
run as written (with ``/`` moved under a folder, loopback addresses, a tiny Llama, one site, two
rounds), and the shipped units (deploy/) start the SuperLink, the worker and the SuperNode as systemd
would (tests/test_systemd_units.py), with TLS from ``openssl`` and a node key from ``ssh-keygen``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_systemd_units import UNITS, USERS, Unit, site_root, systemd_start, wait_until  # noqa: F401 (site_root: a fixture)

from parablock_flwr.tools.app_config import find_project_dir
from parablock_flwr.tools.launch import descendants, free_port, listens
from parablock_flwr.tools.tiny_model import build_tiny_model

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
RECIPE = PROJECT_DIR / "docs" / "deploy-8b.md"
MARK = re.compile(r"^<!--\s*loopback:\s*(\w+)\s*-->$")
MODEL = "/models/Meta-Llama-3.1-8B-Instruct"
ROUNDS = 4  # the SuperLink and its ServerApp are killed once round 1 is checkpointed; the rest is resumed
TRAIN_ROWS, HELDOUT_ROWS = 24, 6


def bash_blocks(doc: Path) -> list[tuple[int, str | None, str]]:
    """(line of the fence, the ``loopback:`` phase or None, the block's text) of every ```bash block."""
    lines, blocks, i = doc.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            mark = MARK.match(lines[i - 1].strip()) if i else None
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 1, mark.group(1) if mark else None, "\n".join(ln.strip() for ln in lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


def phase(name: str, subs: list[tuple[str, str]]) -> str:
    """The phase's blocks, in page order, with the loopback's substitutions."""
    text = "\n".join(body for _, mark, body in bash_blocks(RECIPE) if mark == name)
    assert text, f"docs/deploy-8b.md has no block marked loopback: {name}"
    for old, new in subs:
        text = text.replace(old, new)
    return text


def run_phase(name: str, subs: list[tuple[str, str]], env: dict[str, str], timeout_s: float) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", phase(name, subs)], cwd=PROJECT_DIR, env=env,
                          capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    assert done.returncode == 0, (
        f"loopback: {name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout + done.stderr


def start_phase(name: str, subs: list[tuple[str, str]], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The phase's blocks running, in a session of their own (stopped by PID if they outlive the SuperLink)."""
    with open(log, "wb") as out:
        return subprocess.Popen(["bash", "-euo", "pipefail", "-c", phase(name, subs)], cwd=PROJECT_DIR, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process, what it started and its process group, by PID: a machine's death, for them."""
    for pid in [*descendants(proc.pid), proc.pid]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def site_data(folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, rows in (("train", TRAIN_ROWS), ("heldout", HELDOUT_ROWS)):
        lines = [{"instruction": f"What is {i} + 3?", "output": f"{i + 3}."} for i in range(rows)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for path in (folder, folder.parent):
        os.chmod(path, 0o755)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_recipe_runs_on_loopback_with_the_shipped_units(site_root):  # noqa: F811
    root = site_root
    port, app_port, node_health, link_health = free_port(), free_port(), free_port(), free_port()
    user, group = USERS["parablock"]
    subs = [
        (
            "/opt/parablock-flwr",
            str(PROJECT_DIR),
        ),  # commands run by root from the checkout; the units use /opt's stand-in
        ("SERVER_DNS:9093", f"localhost:{port}"),
        ("CLIENTAPP_PORT=9094", f"CLIENTAPP_PORT={app_port}"),
        ("127.0.0.1:9096", f"127.0.0.1:{node_health}"),
        ("SERVER_DNS", "localhost"),
        ("SERVER_IP", "127.0.0.1"),
        ("-o parablock -g parablock", f"-o {user} -g {group}"),
        ("-o parablock-superlink -g parablock-superlink", "-o {} -g {}".format(*USERS["parablock-superlink"])),
        ('worker-uid="parablock"', f'worker-uid="{user}"'),
        ("/etc/parablock", f"{root}/etc/parablock"),
        ("/srv/", f"{root}/srv/"),
        ("/models/", f"{root}/models/"),
        ("/run/parablock", f"{root}/run/parablock"),
        ("/data/", f"{root}/data/"),
        ("min-available-nodes=3", "min-available-nodes=1"),
        ("num-server-rounds=64", f"num-server-rounds={ROUNDS} local-steps=2"),
    ]
    (root / "models").mkdir(mode=0o755)
    build_tiny_model(root / "models" / MODEL.rsplit("/", 1)[1])
    site_data(root / "srv" / "site0")
    home = root / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(PROJECT_DIR)}
    env.pop("FLWR_HOME", None)

    planned = run_phase("plan", subs, env, 300)
    assert "GiB" in planned  # plan's own figures, whatever they are today
    run_phase("setup", subs, env, 300)
    checked = run_phase("check", subs, env, 300)  # the site's file, before its SuperNode starts
    assert f"{TRAIN_ROWS} rows, {TRAIN_ROWS} train at max-seq-len=1024" in checked, checked
    etc = root / "etc" / "parablock"
    assert oct(os.stat(etc / "node_key-0").st_mode & 0o777) == "0o600"
    (etc / "superlink.env").write_text(f"HOST=127.0.0.1\nPORT={port}\nHEALTH_ADDRESS=127.0.0.1:{link_health}\n")
    (etc / "worker-0.env").write_text("DEVICE=cpu\n")  # the CPU in place of cuda:0
    env_files = {str(p): p.read_text() for p in etc.glob("*.env")}

    link = Unit.read(UNITS / "parablock-superlink.service", root=root)
    worker = Unit.read(UNITS / "parablock-worker@.service", "0", root)
    node = Unit.read(UNITS / "parablock-supernode@.service", "0", root)
    flwr = [str(PROJECT_DIR / ".venv" / "bin" / "flwr")]
    with systemd_start(link, root, env_files, root / "superlink.log") as (link_proc, _):
        wait_until(lambda: listens(f"127.0.0.1:{port}"), link_proc, root / "superlink.log")
        registered = run_phase("register", subs, env, 120)
        assert "registered successfully" in registered, registered
        with systemd_start(worker, root, env_files, root / "worker.log") as (worker_proc, argv):
            wait_until(Path(argv[argv.index("--socket") + 1]).exists, worker_proc, root / "worker.log")
            with systemd_start(node, root, env_files, root / "supernode.log") as (node_proc, _):

                def online() -> bool:
                    listed = subprocess.run([*flwr, "supernode", "list", "mylink"], env=env, capture_output=True,
                                            text=True, timeout=120)  # fmt: skip
                    return "online" in listed.stdout

                wait_until(online, node_proc, root / "supernode.log")
                runs = root / "data" / "parablock-runs"
                first = start_phase("run", subs, env, root / "first-run.log")
                try:  # the SuperLink dies, its ServerApp with it, once round 1 is checkpointed
                    wait_until(lambda: any(runs.glob("*/checkpoint/round-00001")), first, root / "superlink.log")
                    kill_group(link_proc)
                    first.wait(timeout=120)
                finally:
                    kill_group(first)
                (killed,) = list(runs.glob("*-parablock-*"))
                assert not (killed / "status.json").exists()  # killed outright: no status, as the page says
                with systemd_start(link, root, env_files, root / "superlink-restarted.log") as (link_proc, _):
                    wait_until(lambda: listens(f"127.0.0.1:{port}"), link_proc, root / "superlink-restarted.log")
                    wait_until(online, node_proc, root / "supernode.log")
                    resumed = run_phase("resume", subs, env, 900)

    statuses = list((root / "data" / "parablock-runs").glob("*/status.json"))
    assert len(statuses) == 1 and statuses[0].parent != killed, statuses
    status = json.loads(statuses[0].read_text())
    assert status["status"] == "completed", status.get("reason", status)
    completed = max(int(p.name.split("-")[1]) for p in (killed / "checkpoint").glob("round-*"))
    assert 1 <= completed < ROUNDS and f"after round {completed}" in resumed, resumed[-3000:]
    nodes = [json.loads(line) for line in (statuses[0].parent / "nodes.jsonl").read_text().splitlines()]
    weights = [w for rec in nodes for w in rec.get("client_weights", [])]
    assert weights and all(w["num_examples"] == TRAIN_ROWS for w in weights), weights
    assert f"Loading model {root}/models/" in (root / "worker.log").read_text()
    assert (statuses[0].parent / "final-model" / "model.safetensors").exists()  # save-final-model in the recipe
    reported = run_phase("after", subs, env, 120)
    assert reported.startswith(f"status: completed ({ROUNDS}/{ROUNDS} rounds)"), reported
    run_phase("export", subs, env, 300)  # the model rebuilt from the run's steps: the weights it saved at its end
    rebuilt, saved = (
        load_file(str(statuses[0].parent / f / "model.safetensors"))
        for f in (f"model-round-{ROUNDS:05d}", "final-model")
    )
    assert rebuilt.keys() == saved.keys() and all(torch.equal(rebuilt[n], saved[n]) for n in saved)

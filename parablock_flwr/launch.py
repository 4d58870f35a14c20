"""Start a local SuperLink we own (by PID), run the app with `flwr run`, stop it.

`flwr run .` alone starts a detached local SuperLink that keeps running and
whose PID is not recorded. Tests and scripts use this module instead: same
SuperLink command, but started by us, on free ports, in a FLWR_HOME of the
run's own, and stopped by its PID (with its process group) at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower's processes: own home, no runtime `uv sync` of torch."""
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
    })
    return env


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@contextlib.contextmanager
def local_superlink(workdir: Path, simulation: bool = True) -> Iterator[str]:
    """A SuperLink on a free port (simulation mode or not); yields its address."""
    workdir = Path(workdir)
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    port = free_port()  # Flower 1.42 serves Control, Fleet and Runtime APIs on one HTTP port
    control = f"127.0.0.1:{port}"
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{control}"\ninsecure = true\n'
    )
    cmd = [_bin("flower-superlink"), "--insecure", *(["--simulation"] if simulation else []),
           "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(port),
           "--health-server-address", f"127.0.0.1:{free_port()}",
           "--database", str(flwr_home / "state.db")]
    with started(cmd, workdir / "superlink.log", flower_env(flwr_home)) as proc:
        _wait_for(lambda: _listens(control), proc, workdir / "superlink.log")
        yield control


@contextlib.contextmanager
def started(cmd: list[str], log_path: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """A process in its own session, logging to a file, stopped by PID on exit."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process's group (its Ray and SuperExec children), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _listens(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.5):
        return True
    return False


def _wait_for(ready, proc: subprocess.Popen, log_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(proc.args[0]).name} exited with {proc.returncode}; see {log_path}")
        if ready():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{Path(proc.args[0]).name} was not ready within {timeout_s}s; see {log_path}")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_simulation(workdir: Path, run_config: Mapping[str, object], num_supernodes: int = 2,
                   cpus_per_client: int = 2, timeout_s: float = 1800,
                   app_dir: Path = PROJECT_DIR, capture: bool = True) -> subprocess.CompletedProcess:
    """`flwr run` the app on Flower's simulation engine; returns the finished process.

    With ``capture``, stdout holds the streamed logs of the run (our per-round
    lines included); otherwise they go to this process's stdout as they come.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with local_superlink(workdir) as _:
        return _flwr_run(workdir, run_config, app_dir, timeout_s, capture, [
            "--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client}"])


def _flwr_run(workdir: Path, run_config: Mapping[str, object], app_dir: Path, timeout_s: float, capture: bool,
              extra: list[str]) -> subprocess.CompletedProcess:
    overrides = workdir / "run-config.toml"
    overrides.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
    cmd = [_bin("flwr"), "run", str(app_dir), "local", "--stream", "--run-config", str(overrides), *extra]
    return subprocess.run(cmd, env=flower_env(workdir / "flwr-home"), capture_output=capture, text=True,
                          timeout=timeout_s)


def run_deployment(workdir: Path, run_config: Mapping[str, object], num_supernodes: int = 2,
                   timeout_s: float = 1800, app_dir: Path = PROJECT_DIR, capture: bool = True,
                   on_started=None) -> subprocess.CompletedProcess:
    """A real local deployment: a SuperLink, N SuperNodes each with its node worker, then `flwr run`.

    Every process is started here and stopped by its PID at the end.
    ``on_started(workers)`` is called with the worker processes once all are up.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_config = {"min-available-nodes": num_supernodes, **run_config}  # start once every node is connected
    env = flower_env(workdir / "flwr-home")
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.2"  # the only Flower poll that can be tuned
    with contextlib.ExitStack() as stack:
        # Unix socket paths are limited to ~100 bytes: keep them short, under /tmp.
        sockets = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parablock-")))
        superlink = stack.enter_context(local_superlink(workdir, simulation=False))
        workers = []
        for i in range(num_supernodes):
            sock = sockets / f"worker-{i}.sock"
            proc = stack.enter_context(started(
                [sys.executable, "-m", "parablock_flwr.worker", "--socket", str(sock), "--idle-exit-s", "900"],
                workdir / f"worker-{i}.log", env))
            workers.append(proc)
        for i, proc in enumerate(workers):
            _wait_for((sockets / f"worker-{i}.sock").exists, proc, workdir / f"worker-{i}.log")
        for i in range(num_supernodes):
            node_config = (f'partition-id={i} num-partitions={num_supernodes} '
                           f'worker-socket="{sockets / f"worker-{i}.sock"}"')
            stack.enter_context(started(
                [_bin("flower-supernode"), "--insecure", "--superlink", superlink, "--port", str(free_port()),
                 "--health-server-address", f"127.0.0.1:{free_port()}", "--node-config", node_config],
                workdir / f"supernode-{i}.log", env))
        if on_started is not None:
            on_started(workers)
        return _flwr_run(workdir, run_config, app_dir, timeout_s, capture, [])

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .security import TlsFiles, make_node_key, make_tls

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
        # The SuperLink and SuperNodes start `flower-superexec` through PATH: find ours without an activated venv.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    return env


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@contextlib.contextmanager
def local_superlink(workdir: Path, simulation: bool = True, tls: TlsFiles | None = None,
                    node_auth: bool = False) -> Iterator[str]:
    """A SuperLink on a free port (simulation mode or not, TLS or not); yields its address."""
    workdir = Path(workdir)
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    port = free_port()  # Flower 1.42 serves Control, Fleet and Runtime APIs on one HTTP port
    control = f"127.0.0.1:{port}"
    write_connection(flwr_home, control, tls.ca_cert if tls else None)
    cmd = superlink_command(port, free_port(), simulation=simulation, tls=tls, node_auth=node_auth)
    with started(cmd, workdir / "superlink.log", flower_env(flwr_home)) as proc:
        _wait_for(lambda: _listens(control), proc, workdir / "superlink.log")
        yield control


def write_connection(flwr_home: Path, address: str, root_certificates: Path | None = None) -> None:
    """``$FLWR_HOME/config.toml`` naming the SuperLink that `flwr run ... local` talks to."""
    security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
    (Path(flwr_home) / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{address}"\n{security}\n'
    )


def superlink_command(port: int, health_port: int, database: Path | None = None, *, host: str = "127.0.0.1",
                      simulation: bool = False, tls: TlsFiles | None = None, node_auth: bool = False) -> list[str]:
    """`flower-superlink` serving every API on ``host:port`` (``host`` 0.0.0.0 to accept other machines),
    over TLS with ``tls``, admitting only registered SuperNodes with ``node_auth``.

    Without ``database`` the SuperLink keeps its state and the messages' arrays in memory.
    A SQLite file also stores every array: with 70-425 MB messages that costs seconds per
    message and, under load, fails runs with "database is locked".
    """
    security = (["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                 "--ssl-keyfile", str(tls.server_key)] if tls else ["--insecure"])
    return [_bin("flower-superlink"), *security, *(["--enable-supernode-auth"] if node_auth else []),
            *(["--simulation"] if simulation else []),
            "--isolation", "subprocess", "--host", host, "--port", str(port),
            "--health-server-address", f"127.0.0.1:{health_port}",
            *(["--database", str(database)] if database else [])]


def supernode_command(superlink: str, port: int, health_port: int, node_config: str, *,
                      root_certificates: Path | None = None, auth_key: Path | None = None) -> list[str]:
    """`flower-supernode` connected to ``superlink`` (host:port), its ClientApp API on ``port``;
    TLS when given the CA to trust, signing in with ``auth_key`` (its public key must be registered)."""
    security = ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    auth = ["--auth-supernode-private-key", str(auth_key)] if auth_key else []
    return [_bin("flower-supernode"), *security, *auth, "--superlink", superlink, "--port", str(port),
            "--health-server-address", f"127.0.0.1:{health_port}", "--node-config", node_config]


def register_supernode(public_key: Path, env: dict[str, str]) -> None:
    """`flwr supernode register PUBLIC_KEY local`: admit a SuperNode to an authenticated SuperLink."""
    proc = subprocess.run([_bin("flwr"), "supernode", "register", str(public_key), "local"], env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or "registered successfully" not in proc.stdout:
        raise RuntimeError(f"flwr supernode register {public_key} failed: {proc.stdout[-500:]}{proc.stderr[-500:]}")


def worker_command(socket_path: Path, idle_exit_s: int = 900) -> list[str]:
    """The node worker listening on the Unix socket ``socket_path``."""
    return [sys.executable, "-m", "parablock_flwr.worker", "--socket", str(socket_path),
            "--idle-exit-s", str(idle_exit_s)]


def node_config(partition_id: int, num_partitions: int, worker_socket: Path) -> str:
    """The SuperNode's ``--node-config``: its data partition and its worker's socket."""
    return f'partition-id={partition_id} num-partitions={num_partitions} worker-socket="{worker_socket}"'


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
              extra: list[str], prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`flwr run` against ``$FLWR_HOME/config.toml``'s SuperLink; ``prefix`` wraps the command
    (e.g. ``ip netns exec NS`` to run it inside a network namespace)."""
    overrides = workdir / "run-config.toml"
    overrides.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
    cmd = [*prefix, _bin("flwr"), "run", str(app_dir), "local", "--stream", "--run-config", str(overrides), *extra]
    return subprocess.run(cmd, env=flower_env(workdir / "flwr-home"), capture_output=capture, text=True,
                          timeout=timeout_s)


def _start_supernode(stack: contextlib.ExitStack, log_path: Path, env: dict[str, str],
                     command: Callable[[int], list[str]], attempts: int = 3) -> subprocess.Popen:
    """Start a SuperNode and wait until its ClientApp API listens.

    A free port can be taken by another process between ``free_port()`` and the
    bind (other runs on the same machine): the SuperNode then exits at once, so
    we try again on another port instead of leaving the run waiting for a node.
    """
    for attempt in range(attempts):
        port = free_port()
        with contextlib.ExitStack() as trial:
            proc = trial.enter_context(started(command(port), log_path, env))
            try:
                _wait_for(lambda: _listens(f"127.0.0.1:{port}"), proc, log_path, timeout_s=60)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                continue
            stack.push(trial.pop_all())  # keep it running until the deployment ends
            return proc
    raise AssertionError("unreachable")


@dataclass
class LocalDeployment:
    """What `run_deployment` started, handed to its ``on_started`` hook (tests use it to make faults)."""

    workdir: Path
    superlink: str  # host:port of the SuperLink
    env: dict[str, str]  # the environment Flower's processes run with
    workers: list[subprocess.Popen]
    tls: TlsFiles | None = None


def run_deployment(workdir: Path, run_config: Mapping[str, object], num_supernodes: int = 2,
                   timeout_s: float = 1800, app_dir: Path = PROJECT_DIR, capture: bool = True,
                   on_started: Callable[[LocalDeployment], None] | None = None,
                   secure: bool = False) -> subprocess.CompletedProcess:
    """A real local deployment: a SuperLink, N SuperNodes each with its node worker, then `flwr run`.

    Every process is started here and stopped by its PID at the end. With ``secure``,
    the SuperLink serves TLS (a CA and certificate made in ``workdir/credentials``)
    and admits only SuperNodes whose keys were registered with `flwr supernode
    register`; each SuperNode gets its own key, registered before it starts.
    ``on_started(deployment)`` is called once every process is up.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_config = {"min-available-nodes": num_supernodes, **run_config}  # start once every node is connected
    env = flower_env(workdir / "flwr-home")
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.2"  # the only Flower poll that can be tuned
    tls = make_tls(workdir / "credentials") if secure else None
    with contextlib.ExitStack() as stack:
        # Unix socket paths are limited to ~100 bytes: keep them short, under /tmp.
        sockets = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parablock-")))
        superlink = stack.enter_context(local_superlink(workdir, simulation=False, tls=tls, node_auth=secure))
        workers = []
        for i in range(num_supernodes):
            sock = sockets / f"worker-{i}.sock"
            proc = stack.enter_context(started(worker_command(sock), workdir / f"worker-{i}.log", env))
            workers.append(proc)
        for i, proc in enumerate(workers):
            _wait_for((sockets / f"worker-{i}.sock").exists, proc, workdir / f"worker-{i}.log")
        for i in range(num_supernodes):
            auth_key = None
            if secure:
                auth_key, public_key = make_node_key(workdir / "credentials", f"supernode-{i}")
                register_supernode(public_key, env)
            config = node_config(i, num_supernodes, sockets / f"worker-{i}.sock")
            _start_supernode(stack, workdir / f"supernode-{i}.log", env, lambda port: supernode_command(
                superlink, port, free_port(), config, root_certificates=tls.ca_cert if tls else None,
                auth_key=auth_key))
        if on_started is not None:
            on_started(LocalDeployment(workdir, superlink, env, workers, tls))
        return _flwr_run(workdir, run_config, app_dir, timeout_s, capture, [])

"""Start a local SuperLink we own (by PID), run the app with `flwr run`, stop it; tell how the run ended.

`flwr run .` alone starts a detached local SuperLink that keeps running and
whose PID is not recorded. Tests and scripts use this module instead: same
SuperLink command, but started by us, on free ports, in a FLWR_HOME of the
run's own, and stopped by its PID (with its process group) at the end.

`flwr run` exits 0 whether the run completed or the ServerApp stopped early, so
how a run ended is read from the run folder's ``status.json``
(``parablock_flwr/run_status.py``), found from the run id `flwr run` prints:
``RunResult.returncode`` is its exit code (docs/usage.md, "Exit codes").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, RunConfig
from ..memory import with_huge_pages
from ..run_status import EXIT_CODES, read_status
from .app_config import OverrideError, app_config, check_overrides, find_project_dir, strategy_problem, toml_value
from .credentials import TlsFiles, make_client_cert, make_node_key, make_tls, tls_files

log = logging.getLogger(__name__)

STARTED_RUN = re.compile(r"Successfully started run (\d+)")  # what `flwr run` prints (flwr/cli/run/run.py)


RAY_NOTICE_FILTER = "ignore::FutureWarning:ray._private.worker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How Flower 1.42 moves arrays (private settings every Flower process reads at import; the ServerApp
# and ClientApp processes inherit them): an Array travels as objects of at most this many bytes, each
# hashed, stored and fetched by one HTTP request, pushed and pulled by min(N, CPU count) threads.
# Flower's defaults are 5 MiB and 2 threads. Fewer, larger objects save requests, but each process
# copies every object a few times, and objects of 32 MiB and more are served by fresh mmaps, page
# faults each time: 8 MiB. A value already set in the environment wins (docs/deployment.md,
# "Flower's transfer settings", which says what was measured).
FLOWER_TRANSFER_SETTINGS = {
    "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE": str(8 * 2**20),
    "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES": "4",
    "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS": "4",
}


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower's processes: own home, no runtime `uv sync` of torch, the transfer
    settings (``FLOWER_TRANSFER_SETTINGS``) unless the environment sets them."""
    env = {**FLOWER_TRANSFER_SETTINGS, **os.environ}
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            # Ray's notice, at every `ray.init`, that a future version will stop hiding GPUs from actors
            # that asked for none (ray/_private/worker.py, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"): the
            # behaviour we keep, so the notice is dropped (only that FutureWarning, only from there).
            "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), RAY_NOTICE_FILTER])),
            # The SuperLink and SuperNodes start `flower-superexec` through PATH: find ours without an activated venv.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    return env


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@contextlib.contextmanager
def local_superlink(
    workdir: Path,
    simulation: bool = True,
    tls: TlsFiles | None = None,
    node_auth: bool = False,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A SuperLink on a free port (simulation mode or not, TLS or not); yields its address. ``env``: more
    environment for it and the simulation it starts (``RAY_ADDRESS``)."""
    workdir = Path(workdir)
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    port = free_port()  # Flower 1.42 serves Control, Fleet and Runtime APIs on one HTTP port
    control = f"127.0.0.1:{port}"
    write_connection(flwr_home, control, tls.ca_cert if tls else None)
    cmd = superlink_command(port, free_port(), simulation=simulation, tls=tls, node_auth=node_auth)
    with started(cmd, workdir / "superlink.log", {**flower_env(flwr_home), **(env or {})}) as proc:
        wait_for(lambda: listens(control), proc, workdir / "superlink.log")
        yield control


def write_connection(flwr_home: Path, address: str, root_certificates: Path | None = None) -> None:
    """``$FLWR_HOME/config.toml`` naming the SuperLink that `flwr run ... local` talks to."""
    security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
    (Path(flwr_home) / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{address}"\n{security}\n'
    )


def superlink_command(
    port: int,
    health_port: int,
    database: Path | None = None,
    *,
    host: str = "127.0.0.1",
    simulation: bool = False,
    tls: TlsFiles | None = None,
    node_auth: bool = False,
) -> list[str]:
    """`flower-superlink` serving every API on ``host:port`` (``host`` 0.0.0.0 to accept other machines),
    over TLS with ``tls``, admitting only registered SuperNodes with ``node_auth``.

    Without ``database`` the SuperLink keeps its state and the messages' arrays in memory.
    A SQLite file also stores every array: with 70-425 MB messages that costs seconds per
    message and, under load, fails runs with "database is locked".
    """
    security = (
        [
            "--ssl-ca-certfile",
            str(tls.ca_cert),
            "--ssl-certfile",
            str(tls.server_cert),
            "--ssl-keyfile",
            str(tls.server_key),
        ]
        if tls
        else ["--insecure"]
    )
    return [
        _bin("flower-superlink"),
        *security,
        *(["--enable-supernode-auth"] if node_auth else []),
        *(["--simulation"] if simulation else []),
        "--isolation",
        "subprocess",
        "--host",
        host,
        "--port",
        str(port),
        "--health-server-address",
        f"127.0.0.1:{health_port}",
        *(["--database", str(database)] if database else []),
    ]


def supernode_command(
    superlink: str,
    port: int,
    health_port: int,
    node_config: str,
    *,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
) -> list[str]:
    """`flower-supernode` connected to ``superlink`` (host:port), its ClientApp API on ``port``;
    TLS when given the CA to trust, signing in with ``auth_key`` (its public key must be registered)."""
    security = ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    auth = ["--auth-supernode-private-key", str(auth_key)] if auth_key else []
    return [
        _bin("flower-supernode"),
        *security,
        *auth,
        "--superlink",
        superlink,
        "--port",
        str(port),
        "--health-server-address",
        f"127.0.0.1:{health_port}",
        "--node-config",
        node_config,
    ]


def register_supernodes(public_keys: Sequence[Path], env: dict[str, str]) -> None:
    """`flwr supernode register PUBLIC_KEY local` for each key, side by side: admit SuperNodes to an
    authenticated SuperLink."""
    cmds = [[_bin("flwr"), "supernode", "register", str(key), "local"] for key in public_keys]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in cmds]
    outputs = [_communicate(proc, timeout_s=120) for proc in procs]  # every one ends before any is judged
    for key, proc, (stdout, stderr) in zip(public_keys, procs, outputs, strict=True):
        if proc.returncode != 0 or "registered successfully" not in stdout:
            raise RuntimeError(f"flwr supernode register {key} failed: {stdout[-500:]}{stderr[-500:]}")


def _communicate(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """A process's output, killing it past ``timeout_s``."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def worker_command(socket_path: Path, idle_exit_s: int = 0, compute_cpus: str = "", state_dir: str = "") -> list[str]:
    """The node worker listening on the Unix socket ``socket_path`` (its compute thread pinned to
    ``compute_cpus``, e.g. "1", when given; its state in ``state_dir``, when given)."""
    pin = ["--compute-cpus", compute_cpus] if compute_cpus else []
    state = ["--state-dir", state_dir] if state_dir else []
    return [sys.executable, "-m", "parablock_flwr.worker", "--socket", str(socket_path),
            "--idle-exit-s", str(idle_exit_s), *pin, *state]  # fmt: skip


def node_state_dir(settings: str) -> str:
    """The ``state-dir="..."`` of a SuperNode's extra node-config text, given to its worker too: the worker
    takes its state dir from its own command line only, and the node config's must name the same."""
    found = re.search(r'state-dir="([^"]*)"', settings)
    return found[1] if found else ""


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
            stop_process_tree(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process's group (its Ray and SuperExec children), then SIGKILL what is left after
    ``grace_s``; returns once the group is gone (not only its leader)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_process_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Every process below ``proc`` first, then ``stop_process_group``: Flower starts SuperExec in a
    session of its own, and below it the run's processes (`flwr-simulation` and Ray, or the
    ServerApp and ClientApps), which outlive a run stopped early, e.g. at the time limit. In this
    order a SuperLink finds its SuperExec gone when it stops; it waits only 1 s for it, and logs a
    WARNING when that is not enough (flwr/superlink/cli/flower_superlink.py, ``stop``)."""
    below = descendants(proc.pid) if proc.poll() is None else []
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(running(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in below:
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    stop_process_group(proc, grace_s)


def stop_side_by_side(procs: Sequence[subprocess.Popen]) -> None:
    """``stop_process_tree`` for each process at once: a deployment's nodes and workers each take a few
    seconds to exit, and wait for none of the others."""
    with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        list(pool.map(stop_process_tree, procs))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def listens(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.5):
        return True
    return False


def wait_for(ready, proc: subprocess.Popen, log_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(proc.args[0]).name} exited with {proc.returncode}; see {log_path}")
        if ready():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{Path(proc.args[0]).name} was not ready within {timeout_s}s; see {log_path}")


@dataclass
class RunResult:
    """How one run of the app ended, as the project's commands report it (``summary()``, ``returncode``)."""

    returncode: int  # the exit code: the status record's; 1 without one; 2 for a bad override; 4 at the time limit
    kind: str  # a key of run_status.EXIT_CODES
    reason: str  # one line
    stdout: str = ""
    stderr: str = ""
    run_id: int | None = None  # what `flwr run` printed; None if no run started
    run_dir: Path | None = None  # OUTPUT_DIR/<time>-<algorithm>-<run id>, if the ServerApp made it
    status: dict | None = None  # its status.json (run_status.read_status), if written
    flwr_returncode: int | None = None  # `flwr run`'s own exit code (None: not started, or stopped at the limit)
    refused: bool = False  # nothing was started (a bad override, no app found)

    def summary(self, prog: str = "parablock-flwr") -> str:
        """The one line a command prints last."""
        if self.kind == "completed":
            rounds = f"{self.status['rounds_completed']}/{self.status['num_rounds']} rounds" if self.status else ""
            return f"{prog}: run completed ({rounds}): {self.run_dir}"
        if self.kind == "completed-with-exclusions":
            return f"{prog}: run completed with exclusions: {self.reason}"
        if self.kind == "privacy-budget":
            return f"{prog}: run stopped at its privacy budget after {self.reason}"
        if self.refused:
            return f"{prog}: {self.reason}"
        return f"{prog}: run failed ({self.kind}): {self.reason}"


def refused(reason: str, kind: str = "invalid-config") -> RunResult:
    """A run that was not started."""
    return RunResult(EXIT_CODES[kind], kind, reason, refused=True)


def check_run_config(run_config: Mapping[str, object], app_dir: Path) -> RunResult | None:
    """None if every key is one of the app's, every value of its type and the whole run config valid
    (``RunConfig.validate``: choices, ranges, relations, as the ServerApp checks them once Flower has started,
    seconds later); else the refused run. What needs the model (``layers-per-block`` against its layers) is
    still the ServerApp's to check."""
    try:
        check_overrides(run_config, app_config(app_dir))
        RunConfig.from_flower({**app_config(app_dir), **run_config})
    except (OverrideError, ConfigError) as err:
        return refused(str(err))
    if (problem := strategy_problem(run_config.get("strategy"), app_dir)) is not None:
        return refused(problem)
    return None


def output_dir_of(run_config: Mapping[str, object], app_dir: Path) -> Path:
    """Where the ServerApp makes the run folder. A relative output-dir is taken from the working
    directory, as the ServerApp (a descendant of this process, same directory) takes it."""
    value = run_config.get("output-dir", app_config(app_dir).get("output-dir", "~/parablock-runs"))
    return Path(str(value)).expanduser().resolve()


def find_run_dir(output_dir: Path, run_id: int) -> Path | None:
    """The run folder of ``run_id``: its name ends with ``-<run id>``."""
    found = sorted(d for d in Path(output_dir).glob(f"*-{run_id}") if d.is_dir())
    return found[-1] if found else None


def run_finished(run_id: int, env: dict[str, str], prefix: Sequence[str] = ()) -> bool:
    """Does the SuperLink list the run as finished (`flwr ls --run-id ID --format json`)?
    True also when it cannot be asked: then there is nothing more to wait for."""
    cmd = [*prefix, _bin("flwr"), "ls", "local", "--run-id", str(run_id), "--format", "json"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        runs = json.loads(proc.stdout).get("runs", [])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, AttributeError):
        return True
    return not runs or str(runs[0].get("status", "")).startswith("finished")


def await_status(
    output_dir: Path, run_id: int, env: dict[str, str], prefix: Sequence[str] = (), grace_s: float = 20.0
) -> tuple[Path | None, dict | None]:
    """The run folder and its status record. `flwr run --stream` can return before the ServerApp
    has ended: wait (at most ``grace_s``) until the record is there or the SuperLink says the run
    finished without one (killed or crashed)."""
    deadline = time.monotonic() + grace_s
    while True:
        run_dir = find_run_dir(output_dir, run_id)
        status = read_status(run_dir) if run_dir else None
        if status is not None or time.monotonic() >= deadline:
            return run_dir, status
        if run_finished(run_id, env, prefix):
            run_dir = find_run_dir(output_dir, run_id)
            return run_dir, read_status(run_dir) if run_dir else None
        time.sleep(1.0)


def _pump(stream, lines: list[str], echo) -> None:
    """Collect a pipe's lines; also pass them on as they come when ``echo`` is a stream."""
    for line in stream:
        lines.append(line)
        if echo is not None:
            echo.write(line)
            echo.flush()


def flwr_run(
    workdir: Path,
    run_config: Mapping[str, object],
    app_dir: Path,
    timeout_s: float,
    capture: bool = True,
    extra: Sequence[str] = (),
    prefix: Sequence[str] = (),
) -> RunResult:
    """`flwr run` against ``$FLWR_HOME/config.toml``'s SuperLink, then how the run ended.

    ``prefix`` wraps the command (e.g. ``ip netns exec NS`` to run it inside a network
    namespace). Without ``capture`` the run's output also goes to this process's stdout
    and stderr as it comes. Past ``timeout_s`` `flwr run` is stopped: exit code 4.
    """
    from .app_bundle import bundled  # (it imports flwr.cli: about 1 s, only where a run starts)

    workdir = Path(workdir)
    overrides = workdir / "run-config.toml"
    overrides.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
    env = flower_env(workdir / "flwr-home")
    with bundled(app_dir) as app:  # a copy of what the FAB holds: `flwr run` lists every file of the app, .venv too
        cmd = [*prefix, _bin("flwr"), "run", str(app), "local", "--stream", "--run-config", str(overrides), *extra]
        stdout, stderr, returncode = _run_streaming(cmd, env, timeout_s, capture)
    started_runs = STARTED_RUN.findall(stdout)
    run_id = int(started_runs[-1]) if started_runs else None
    output_dir = output_dir_of(run_config, app_dir)
    common = dict(stdout=stdout, stderr=stderr, run_id=run_id, flwr_returncode=returncode)
    if returncode is None:
        run_dir = find_run_dir(output_dir, run_id) if run_id is not None else None
        return RunResult(
            EXIT_CODES["timeout"],
            "timeout",
            f"the launcher's time limit of {timeout_s:g} s passed; `flwr run` was stopped",
            run_dir=run_dir,
            **common,
        )
    if run_id is None:
        return RunResult(
            EXIT_CODES["error"],
            "error",
            f"`flwr run` started no run (it exited with {returncode}); its output says why",
            **common,
        )
    return _ended_run(output_dir, run_id, env, prefix, common)


def _run_streaming(
    cmd: Sequence[str], env: dict[str, str], timeout_s: float, capture: bool
) -> tuple[str, str, int | None]:
    """Run ``cmd`` in a session of its own, its output collected (and echoed unless ``capture``) as it
    comes, so that a long run shows progress; stopped with its process group at ``timeout_s`` or on
    Ctrl-C. Returns its stdout, its stderr and its exit code (None: it was stopped at the time limit)."""
    out: list[str] = []
    err: list[str] = []
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, out, None if capture else sys.stdout), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, err, None if capture else sys.stderr), daemon=True),
    ]
    for pump in pumps:
        pump.start()
    timed_out = False
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on Ctrl-C: `flwr run` has a session of its own
        stop_process_group(proc)
    for pump in pumps:
        pump.join(10)
    return "".join(out), "".join(err), None if timed_out else proc.returncode


def _ended_run(output_dir: Path, run_id: int, env: dict[str, str], prefix: Sequence[str], common: dict) -> RunResult:
    """How a started run ended, from its status record: `flwr run` exits 0 however it ended."""
    run_dir, status = await_status(output_dir, run_id, env, prefix)
    if status is None:
        where = f"run folder {run_dir}" if run_dir else f"no folder ending in -{run_id} in {output_dir}"
        return RunResult(
            EXIT_CODES["error"],
            "error",
            f"the ServerApp wrote no status record: it was killed or crashed ({where})",
            run_dir=run_dir,
            **common,
        )
    log.info("run %s ended: %s", run_id, status["kind"])
    return RunResult(
        int(status["exit_code"]), str(status["kind"]), str(status["reason"]), run_dir=run_dir, status=status, **common
    )


def run_simulation(
    workdir: Path,
    run_config: Mapping[str, object],
    num_supernodes: int = 2,
    cpus_per_client: int = 2,
    timeout_s: float = 1800,
    app_dir: Path | None = None,
    capture: bool = True,
    ray_address: str = "",
    gpus_per_client: float = 0.0,
) -> RunResult:
    """`flwr run` the app on Flower's simulation engine; how it ended.

    ``ray_address``: an existing Ray cluster to run the virtual clients on (``ray start --head`` prints
    it; ``auto``: the one this machine belongs to), else a Ray instance of the run's own on this machine.
    Flower's engine calls ``ray.init()`` with no address, so it is handed over as ``RAY_ADDRESS`` in the
    SuperLink's environment, which the simulation process inherits (docs/scale.md).
    ``cpus_per_client``, ``gpus_per_client``: what each virtual client's Ray actor reserves; the cluster
    runs as many actors at once as its resources hold.
    ``app_dir``: the Flower app (default: ``find_project_dir()``, from the working directory up).
    Overrides are checked against the app's keys first: a bad one starts nothing (exit code 2).
    With ``capture`` the run's streamed logs (our per-round lines included) are only in the
    result; otherwise they also go to this process's stdout as they come.
    """
    app_dir = find_project_dir() if app_dir is None else Path(app_dir)
    if (bad := check_run_config(run_config, app_dir)) is not None:
        return bad
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    federation = f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client}"
    if gpus_per_client:
        federation += f" client-resources-num-gpus={gpus_per_client:g}"
    with local_superlink(workdir, env={"RAY_ADDRESS": ray_address} if ray_address else None) as _:
        return flwr_run(workdir, run_config, app_dir, timeout_s, capture, ["--federation-config", federation])


def _start_supernode(
    stack: contextlib.ExitStack,
    log_path: Path,
    env: dict[str, str],
    command: Callable[[int], list[str]],
    attempts: int = 3,
) -> subprocess.Popen:
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
                wait_for(lambda port=port: listens(f"127.0.0.1:{port}"), proc, log_path, timeout_s=60)
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


def run_deployment(
    workdir: Path,
    run_config: Mapping[str, object],
    num_supernodes: int = 2,
    timeout_s: float = 1800,
    app_dir: Path | None = None,
    capture: bool = True,
    on_started: Callable[[LocalDeployment], None] | None = None,
    secure: bool = False,
    node_settings: Sequence[str] = (),
) -> RunResult:
    """A real local deployment: a SuperLink, N SuperNodes each with its node worker, then `flwr run`.

    Every process is started here and stopped by its PID at the end. With ``secure``,
    the SuperLink serves TLS (a CA and certificate made in ``workdir/credentials``)
    and admits only SuperNodes whose keys were registered with `flwr supernode
    register`; each SuperNode gets its own key, registered before it starts.
    ``on_started(deployment)`` is called once every process is up. ``app_dir`` and the
    check of the overrides: as ``run_simulation``. ``node_settings[i]``, when given, is added to
    SuperNode i's ``--node-config`` (its own data and device, e.g. ``dataset="alpaca:/srv/a.jsonl"``).
    """
    app_dir = find_project_dir() if app_dir is None else Path(app_dir)
    workdir = Path(workdir)
    run_config = {"min-available-nodes": num_supernodes, **run_config}  # start once every node is connected
    run_config = {**direct_transport(run_config, tls_files(workdir / "credentials") if secure else None), **run_config}
    if (bad := check_run_config(run_config, app_dir)) is not None:
        return bad
    workdir.mkdir(parents=True, exist_ok=True)
    tls = make_tls(workdir / "credentials") if secure else None
    # Huge pages for the block-sized buffers of the node workers and the ServerApp (memory.map_large_buffers).
    env = with_huge_pages(flower_env(workdir / "flwr-home"))
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.2"  # the only Flower poll that can be tuned
    with contextlib.ExitStack() as stack:
        # Unix socket paths are limited to ~100 bytes: keep them short, under /tmp.
        sockets = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parablock-")))
        # The SuperLink starts the ServerApp's process, which inherits its environment: the same tunables.
        tunables = {"GLIBC_TUNABLES": env["GLIBC_TUNABLES"]}
        superlink = stack.enter_context(local_superlink(workdir, simulation=False, tls=tls, node_auth=secure,
                                                        env=tunables))  # fmt: skip
        workers = _start_workers(stack, workdir, sockets, env, num_supernodes, node_settings)
        nodes = _start_nodes(stack, workdir, sockets, env, superlink, tls, num_supernodes, node_settings)
        stack.callback(stop_side_by_side, [*nodes, *workers])  # first, then the SuperLink
        if on_started is not None:
            on_started(LocalDeployment(workdir, superlink, env, workers, tls))
        return flwr_run(workdir, run_config, app_dir, timeout_s, capture)


def direct_transport(run_config: Mapping[str, object], tls: TlsFiles | None) -> dict[str, object]:
    """``transport = "direct"`` on loopback, where the run config leaves it open: the stream on any free port
    of ``localhost`` (the ServerApp runs on the SuperLink's host), secured as the SuperLink is: its own
    certificate and CA with ``secure``, and mutual TLS (each node's client certificate from that CA: ``_start_nodes``),
    else plaintext, as its ``--insecure``."""
    if run_config.get("transport") != "direct":
        return {}
    out: dict[str, object] = {"transport-address": "localhost:0"}
    keys = ("transport-certfile", "transport-keyfile", "transport-ca", "transport-insecure")
    if any(key in run_config for key in keys):
        return out  # the run config chose how the stream is secured
    if tls is None:
        return {**out, "transport-insecure": True}
    files = (str(tls.server_cert), str(tls.server_key), str(tls.ca_cert))
    return {**out, **dict(zip(keys, files, strict=False)), "transport-client-ca": str(tls.ca_cert)}


def _start_workers(
    stack: contextlib.ExitStack,
    workdir: Path,
    sockets: Path,
    env: dict[str, str],
    num_supernodes: int,
    node_settings: Sequence[str],
) -> list[subprocess.Popen]:
    """One node worker per SuperNode, all started before waiting for any (each imports torch), and
    returned once every socket exists: a SuperNode's first message must find its worker listening."""
    workers = []
    for i in range(num_supernodes):
        sock = sockets / f"worker-{i}.sock"
        state_dir = node_state_dir(node_settings[i]) if i < len(node_settings) else ""
        command = worker_command(sock, state_dir=state_dir)
        proc = stack.enter_context(started(command, workdir / f"worker-{i}.log", env))
        workers.append(proc)
    for i, proc in enumerate(workers):
        wait_for((sockets / f"worker-{i}.sock").exists, proc, workdir / f"worker-{i}.log")
    return workers


def _start_nodes(
    stack: contextlib.ExitStack,
    workdir: Path,
    sockets: Path,
    env: dict[str, str],
    superlink: str,
    tls: TlsFiles | None,
    num_supernodes: int,
    node_settings: Sequence[str],
) -> list[subprocess.Popen]:
    """Every SuperNode, each pointed at its worker's socket with its own node config; with TLS, every key
    is registered with the SuperLink first, since it admits only registered nodes. Each is a Python
    process importing Flower: they start side by side, so a deployment waits for the slowest, not the sum."""
    auth_keys: list[Path | None] = [None] * num_supernodes
    if tls is not None:
        keys = [make_node_key(workdir / "credentials", f"supernode-{i}") for i in range(num_supernodes)]
        register_supernodes([public for _, public in keys], env)
        auth_keys = [key for key, _ in keys]

    def start(i: int) -> subprocess.Popen:
        config = node_config(i, num_supernodes, sockets / f"worker-{i}.sock")
        if tls is not None:  # the run's stream, if it uses one, with mutual TLS: the node's own certificate
            cert, cert_key = make_client_cert(tls, f"supernode-{i}")
            config += f' transport-certfile="{cert}" transport-keyfile="{cert_key}" transport-require-tls=true'
        if i < len(node_settings) and node_settings[i]:
            config = f"{config} {node_settings[i]}"
        ca, key = (tls.ca_cert if tls else None), auth_keys[i]

        def command(port: int) -> list[str]:
            return supernode_command(superlink, port, free_port(), config, root_certificates=ca, auth_key=key)

        return _start_supernode(stack, workdir / f"supernode-{i}.log", env, command)

    with ThreadPoolExecutor(max_workers=num_supernodes) as pool:
        return list(pool.map(start, range(num_supernodes)))  # re-raises the first failure, once all have ended

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
def local_superlink(workdir: Path) -> Iterator[str]:
    """A simulation-mode SuperLink on free ports; yields its control API address."""
    workdir = Path(workdir)
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    port = free_port()  # Flower 1.42 serves Control, Fleet and Runtime APIs on one HTTP port
    control = f"127.0.0.1:{port}"
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{control}"\ninsecure = true\n'
    )
    cmd = [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
           "--host", "127.0.0.1", "--port", str(port),
           "--health-server-address", f"127.0.0.1:{free_port()}",
           "--database", str(flwr_home / "state.db")]
    log = open(workdir / "superlink.log", "w")
    proc = subprocess.Popen(cmd, env=flower_env(flwr_home), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_for_port(control, proc, workdir / "superlink.log")
        yield control
    finally:
        stop_process_group(proc)
        log.close()


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


def _wait_for_port(address: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 60) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}; see {log_path}")
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.5):
            return
        time.sleep(0.3)
    raise RuntimeError(f"flower-superlink did not listen on {address} within {timeout_s}s; see {log_path}")


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
    overrides = workdir / "run-config.toml"
    overrides.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
    with local_superlink(workdir) as _:
        cmd = [_bin("flwr"), "run", str(app_dir), "local", "--stream", "--run-config", str(overrides),
               "--federation-config",
               f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client}"]
        return subprocess.run(cmd, env=flower_env(workdir / "flwr-home"), capture_output=capture, text=True,
                              timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    """`python -m parablock_flwr.launch [KEY=VALUE ...]`: one simulation run, then cleanup."""
    import argparse
    import tomllib

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("overrides", nargs="*", help="run-config overrides, KEY=VALUE in TOML syntax")
    parser.add_argument("--num-supernodes", type=int, default=2)
    parser.add_argument("--cpus-per-client", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=PROJECT_DIR / "runs" / ".flower")
    args = parser.parse_args(argv)
    run_config: dict[str, object] = {"output-dir": str(PROJECT_DIR / "runs")}
    for item in args.overrides:
        run_config.update(tomllib.loads(item))
    proc = run_simulation(args.workdir, run_config, args.num_supernodes, args.cpus_per_client, capture=False)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())

"""The `parablock-flwr` command: overrides checked before anything starts, the project found from the
working directory, and an exit code that tells how the run ended (docs/usage.md, "Exit codes").

The fast tests run the real installed command and start no Flower process (its work folder is never
made). The `e2e` ones run real simulations; they read the run folder's status.json, which the ServerApp
writes at the end of every run (parablock_flwr/run_status.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parablock_flwr.cli import main
from parablock_flwr.run_status import EXIT_CODES, write_status
from parablock_flwr.tools.app_config import (
    OverrideError,
    ProjectNotFound,
    app_config,
    check_overrides,
    find_project_dir,
    parse_overrides,
    toml_value,
)
from parablock_flwr.tools.launch import RunResult, check_run_config, find_run_dir, run_simulation, running

from helpers import flower_pids, kill, side_by_side, tiny_config

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
COMMAND = str(Path(sys.executable).parent / "parablock-flwr")  # the installed console script


def parablock_flwr(*args: str, cwd: Path = PROJECT_DIR, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """The real command, its stderr after its stdout (the last line is the verdict)."""
    return subprocess.run(
        [COMMAND, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
    )


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------ fast: nothing starts
@pytest.mark.parametrize("command", ["simulate", "deploy"])
def test_a_misspelt_key_exits_2_naming_it_and_the_closest_key(tmp_path, command):
    proc = parablock_flwr(command, "--workdir", str(tmp_path / "flower"), "learnin-rate=0.1")
    assert proc.returncode == EXIT_CODES["invalid-config"] == 2, proc.stdout
    assert last_line(proc) == "parablock-flwr: learnin-rate: unknown key; did you mean learning-rate?"
    assert not (tmp_path / "flower").exists()  # no SuperLink, no FLWR_HOME: nothing was started


@pytest.mark.parametrize(
    "override, line",
    [
        ('layers-per-block="5"', 'layers-per-block="5": expected an integer'),
        ("learning-rate=true", "learning-rate=true: expected a number"),
        ("deterministic=1", "deterministic=1: expected true or false"),
        ("model=5", "model=5: expected a string (in double quotes)"),
        ("model=foo", "'model=foo': expected KEY=VALUE in TOML syntax, strings quoted"),
    ],
)
def test_a_wrongly_typed_value_exits_2_naming_key_value_and_type(tmp_path, override, line):
    proc = parablock_flwr("simulate", "--workdir", str(tmp_path / "flower"), "num-server-rounds=2", override)
    assert proc.returncode == 2, proc.stdout
    assert last_line(proc).startswith("parablock-flwr: " + line), proc.stdout
    assert not (tmp_path / "flower").exists()


@pytest.mark.parametrize(
    "override, line",
    [
        ('schedule="backwards"', "schedule='backwards': expected one of"),
        ("num-server-rounds=0", "num-server-rounds=0"),
        ('transport="direct"', "transport-address='': expected host:port"),
    ],
)
def test_a_bad_value_exits_2_before_flower_starts(tmp_path, override, line, capsys):
    """A value the ServerApp's checks refuse (RunConfig.validate) is refused by ``simulate`` before any Flower
    process starts (no Flower home made): before, ``schedule`` was refused about 25 s into Flower's start-up."""
    assert main(["simulate", "--workdir", str(tmp_path), override]) == 2
    err = capsys.readouterr().err
    assert line in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "flwr-home").exists()


def test_outside_a_project_the_command_says_so_in_one_line(tmp_path):
    proc = parablock_flwr("simulate", "--workdir", str(tmp_path / "flower"), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        f"parablock-flwr: no Flower app in {tmp_path.resolve()} or above it: expected a folder whose "
        "pyproject.toml has [tool.flwr.app]; run from the project's folder or name it (--app-dir)"
    ]


def test_in_process_the_launcher_refuses_a_bad_key_before_starting_anything(tmp_path, capsys):
    """`main` -> `run_simulation`, which checks the overrides before it starts a SuperLink."""
    assert main(["simulate", "--workdir", str(tmp_path / "flower"), "num-server-round=2"]) == 2
    expected = "parablock-flwr: num-server-round: unknown key; did you mean num-server-rounds?"
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    assert not (tmp_path / "flower").exists()
    result = check_run_config({"num-server-round": 2}, PROJECT_DIR)
    assert (result.returncode, result.kind, result.run_id, result.run_dir) == (2, "invalid-config", None, None)
    assert result.refused and result.summary() == expected
    assert check_run_config({"num-server-rounds": 2, "learning-rate": 1}, PROJECT_DIR) is None


def test_project_dir_is_the_nearest_folder_with_a_flower_app(tmp_path, monkeypatch):
    app = tmp_path / "app"
    (app / "pkg" / "sub").mkdir(parents=True)
    (app / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.flwr.app]\npublisher = "me"\n')
    (app / "pkg" / "pyproject.toml").write_text('[project]\nname = "not-an-app"\n')  # no [tool.flwr.app]
    (app / "pkg" / "sub" / "pyproject.toml").write_text("not = [valid toml")
    assert find_project_dir(app / "pkg" / "sub") == app.resolve()
    monkeypatch.chdir(app / "pkg")
    assert find_project_dir() == app.resolve()
    with pytest.raises(ProjectNotFound, match=r"^no Flower app in .* or above it: expected a folder"):
        find_project_dir(tmp_path)
    assert find_project_dir(PROJECT_DIR / "parablock_flwr" / "tools") == PROJECT_DIR


def test_override_types_follow_the_apps_defaults():
    defaults = app_config(PROJECT_DIR)
    check_overrides({"learning-rate": 1, "server-lr": 0.5, "seed": 3, "deterministic": False, "model": "m"}, defaults)
    for overrides, message in [
        ({"seed": 1.5}, "seed=1.5: expected an integer"),
        ({"seed": True}, "seed=true: expected an integer"),
        ({"server-lr": "1"}, 'server-lr="1": expected a number'),
        ({"save-every": [1]}, "save-every=[1]: expected an integer"),
        ({"zzzzzz": 1}, "zzzzzz: unknown key; docs/configuration.md lists the keys"),
    ]:
        with pytest.raises(OverrideError) as err:
            check_overrides(overrides, defaults)
        assert str(err.value) == message
    assert parse_overrides(['algorithm="fedbcd"', "seed=1", "seed=2"]) == {"algorithm": "fedbcd", "seed": 2}


scalars = st.text() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.floats(allow_nan=False)


@given(scalars)
def test_toml_value_reads_back_as_the_same_value(value):
    """What the launcher writes into the run-config file that `flwr run` reads."""
    read = tomllib.loads(f"key = {toml_value(value)}")["key"]
    assert read == value and type(read) is type(value)


def test_run_result_summaries():
    done = RunResult(
        0,
        "completed",
        "3 rounds",
        run_dir=Path("/runs/x-7"),
        run_id=7,
        status={"status": "completed", "rounds_completed": 3, "num_rounds": 3},
    )
    assert done.summary() == "parablock-flwr: run completed (3/3 rounds): /runs/x-7"
    failed = RunResult(
        3, "too-few-replies", "round 2: 1 valid reply, expected at least min-accepted-replies=5", run_id=7
    )
    assert failed.summary() == (
        "parablock-flwr: run failed (too-few-replies): round 2: 1 valid reply, expected at least min-accepted-replies=5"
    )


def test_run_folder_is_found_by_run_id_and_report_prints_its_status_first(tmp_path, capsys):
    run_dir = tmp_path / "20261130-010203-parablock-4242"
    run_dir.mkdir()
    (tmp_path / "20261130-010203-parablock-14242").mkdir()  # another run whose id ends the same way
    assert find_run_dir(tmp_path, 4242) == run_dir and find_run_dir(tmp_path, 42) is None
    with pytest.raises(SystemExit, match="no metrics.jsonl with records and no status.json; expected a run folder"):
        main(["report", str(run_dir)])
    write_status(run_dir, "too-few-replies", "round 2: 0 valid replies", rounds_completed=1, num_rounds=3)
    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "status: failed (too-few-replies, exit code 3, 1/3 rounds): round 2: 0 valid replies"


def test_report_of_a_folder_that_is_not_a_run_says_so(tmp_path):
    proc = parablock_flwr("report", str(tmp_path / "nothing"))
    assert proc.returncode == 1 and "not a folder; expected a run folder" in last_line(proc)
    assert not (tmp_path / "nothing").exists()


# ------------------------------------------------------------------ e2e: real runs, real status records
def simulate_command(tmp_path: Path, model_dir: Path, num_supernodes: int, **overrides) -> subprocess.Popen:
    """`parablock-flwr simulate` on the tiny model, its output into ``tmp_path/out``."""
    config = tiny_config(model_dir, tmp_path / "out", **{k.replace("_", "-"): v for k, v in overrides.items()})
    return parablock_flwr(
        "simulate",
        "--num-supernodes",
        str(num_supernodes),
        "--cpus-per-client",
        "1",
        "--workdir",
        str(tmp_path / "flower"),
        *(f"{k}={toml_value(v)}" for k, v in config.items()),
        timeout_s=900,
    )


def run_folder(tmp_path: Path) -> tuple[Path, dict]:
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    return run_dir, json.loads((run_dir / "status.json").read_text())


# The WARNING lines Flower 1.42 logs whatever the settings, so no run can leave them out (flwr/...):
FLOWER_WARNS_ALWAYS = (
    "Since flwr 1.32, default simulated SuperNodes changed",  # simulation/app.py:249, every simulation
    "Manually terminating ClientAppActor",  # simulation/ray_transport/ray_actor.py:40, each Ray actor at its end
    "Option `--insecure` was set",  # superlink/cli/flower_superlink.py:539: the local SuperLink, on 127.0.0.1 only
    "SuperNode authentication is disabled",  # flower_superlink.py:402: a simulation has no SuperNodes
)


@pytest.fixture(scope="module")
def outcome_runs(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The command's runs whose outcome the tests below read, side by side (``helpers.side_by_side``: each in its own
    folders, with its own SuperLink and ports): a completed run, an invalid value, too few replies."""
    runs = {
        "completed": (2, {"num_server_rounds": 2, "dataset": "reasoning-gym:syllogism"}),
        "invalid": (1, {"layers_per_block": 99}),
        "too_few": (3, {"num_server_rounds": 2, "min_accepted_replies": 5, "on_too_few_replies": "stop"}),
    }
    folders = {label: tmp_path_factory.mktemp(label) for label in runs}
    done = side_by_side({
        label: lambda label=label, nodes=nodes, overrides=overrides: simulate_command(
            folders[label], tiny_model_dir, nodes, **overrides
        )
        for label, (nodes, overrides) in runs.items()
    })  # fmt: skip
    return {label: (folders[label], proc) for label, proc in done.items()}


@pytest.mark.e2e
def test_a_completed_run_exits_0_and_logs_no_warning(outcome_runs):
    """A normal run (the default job's data, whose rows all fit `max-seq-len`) says nothing it would
    warn about: no WARNING line from us, Flower, Ray or transformers, in the command's output (the
    ServerApp's and the ClientApps' logs streamed) or in the SuperLink's log (issue 24), but those
    Flower always logs. Before: also Ray's FutureWarning about GPUs, and at the end the SuperLink's
    "SuperExec subprocess did not terminate within 1 second" and "Connection attempt failed"."""
    tmp_path, proc = outcome_runs["completed"]
    run_dir, status = run_folder(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert status["status"] == "completed" and status["rounds_completed"] == status["num_rounds"] == 2
    assert last_line(proc) == f"parablock-flwr: run completed (2/2 rounds): {run_dir}"
    superlink_log = (tmp_path / "flower" / "superlink.log").read_text()
    warnings = [line for line in (proc.stdout + superlink_log).splitlines()
                if "WARNING" in line.upper() and not any(known in line for known in FLOWER_WARNS_ALWAYS)]  # fmt: skip
    assert warnings == [], "\n".join(warnings)


@pytest.mark.e2e
def test_an_invalid_value_exits_2_with_a_failed_status_record(outcome_runs):
    tmp_path, proc = outcome_runs["invalid"]
    run_dir, status = run_folder(tmp_path)
    assert proc.returncode == 2, proc.stdout[-4000:]
    run_id = re.search(r"Successfully started run (\d+)", proc.stdout).group(1)
    assert run_dir.name.endswith(f"-{run_id}") and status["kind"] == "invalid-config"
    assert status["status"] == "failed" and status["exit_code"] == 2 and "layers-per-block=99" in status["reason"]
    assert last_line(proc) == f"parablock-flwr: run failed (invalid-config): {status['reason']}"


@pytest.mark.e2e
def test_too_few_replies_exits_3(outcome_runs):
    tmp_path, proc = outcome_runs["too_few"]
    _, status = run_folder(tmp_path)
    assert proc.returncode == 3, proc.stdout[-4000:]
    assert status["kind"] == "too-few-replies" and status["rounds_completed"] == 0
    assert last_line(proc) == f"parablock-flwr: run failed (too-few-replies): {status['reason']}"
    assert "min-accepted-replies=5" in status["reason"]


@pytest.mark.e2e
def test_the_launchers_time_limit_exits_4(tmp_path, tiny_model_dir):
    # Enough rounds that the run cannot end before the signal (a tiny round takes 0.1 s).
    config = tiny_config(tiny_model_dir, tmp_path / "out", **{"num-server-rounds": 2000})
    result = run_simulation(tmp_path / "flower", config, num_supernodes=1, cpus_per_client=1, timeout_s=20)
    assert (result.returncode, result.kind) == (EXIT_CODES["timeout"], "timeout") == (4, "timeout")
    assert result.summary() == (
        "parablock-flwr: run failed (timeout): the launcher's time limit of 20 s passed; `flwr run` was stopped"
    )


def command_line(pid: int) -> str:
    """The process's argv as one line ("" if it has gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.e2e
def test_sigterm_stops_every_process_the_command_started(tmp_path, tiny_model_dir):
    """`parablock-flwr simulate` SIGTERMed mid-run (`kill`, systemd, a CI runner's cancel) stops, by
    PID, what it started: the SuperLink, SuperExec, the simulation and Ray's processes, writes the run's
    status record (``stopped``) and exits 143 (before: it died on the spot and they kept running)."""
    workdir, flwr_home = tmp_path / "flower", tmp_path / "flower" / "flwr-home"
    # Enough rounds that the run cannot end before the signal (a tiny round takes 0.1 s).
    config = tiny_config(tiny_model_dir, tmp_path / "out", **{"num-server-rounds": 2000})
    overrides = [f"{k}={toml_value(v)}" for k, v in config.items()]
    cmd = [COMMAND, "simulate", "--num-supernodes", "1", "--cpus-per-client", "1", "--workdir", str(workdir)]
    started: list[int] = []
    with open(tmp_path / "output.log", "w") as output:
        proc = subprocess.Popen([*cmd, *overrides], cwd=PROJECT_DIR, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        # Any checkpoint: only the newest is kept, so round 1's may be gone before a poll sees it.
        while not list((tmp_path / "out").glob("*/checkpoint/round-*")) and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "output.log").read_text()[-3000:]
            time.sleep(0.5)
        started = flower_pids(flwr_home, lambda argv: True)  # every process with the run's FLWR_HOME
        commands = " ".join(command_line(pid) for pid in started)
        assert "flower-superlink" in commands and "raylet" in commands, commands
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        assert [pid for pid in started if running(pid)] == []
        output = (tmp_path / "output.log").read_text()
        assert "SIGTERM: stopping the processes this command started" in output
        # ...and the run's status record says so, with how to continue it (before: none was written).
        (run_dir,) = (p.parent for p in (tmp_path / "out").glob("*/config.json"))
        status = json.loads((run_dir / "status.json").read_text())
        assert (status["kind"], status["exit_code"], status["num_rounds"]) == ("stopped", 143, 2000), status
        assert status["rounds_completed"] >= 1 and f'resume-from="{run_dir}"' in status["reason"], status
        assert output.strip().splitlines()[-1] == f"parablock-flwr: run stopped: {status['reason']}", output[-2000:]
    finally:  # what a failed test left running
        for pid in [pid for pid in [proc.pid, *started] if running(pid)]:
            kill(pid)


def test_a_stopped_run_replaces_the_status_it_recorded_once_the_stop_began_but_keeps_an_earlier_one(tmp_path):
    """The launcher stops its processes one by one: a ServerApp that sees its evaluator end first records an error
    before it is stopped itself (a race CI met). ``record_stopped`` takes a record written once the stop began for
    the stop's, and replaces it; a run that recorded its own end before the stop keeps its record."""
    from parablock_flwr.run_status import read_status, record_stopped

    launched = time.time()
    run_dir = tmp_path / "out" / time.strftime("%Y%m%d-%H%M%S-parablock-7", time.localtime(launched))
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"num-server-rounds": 50}))
    write_status(run_dir, "error", "RuntimeError: the server's evaluation failed: killed by SIGTERM", 2, 50)
    before = time.time() + 60  # a stop that began after the record: the record stands
    assert record_stopped(tmp_path / "out", launched, "stopped by SIGTERM", stop_began=before) is None
    assert read_status(run_dir)["kind"] == "error"
    began = (run_dir / "status.json").stat().st_mtime - 1  # the record came once the stop began: the stop's
    assert record_stopped(tmp_path / "out", launched, "stopped by SIGTERM", stop_began=began) is not None
    status = read_status(run_dir)
    assert (status["kind"], status["exit_code"]) == ("stopped", 143) and "resume-from=" in status["reason"], status


def test_tiny_makes_a_smoke_run_config_on_a_tiny_model_made_once(tmp_path):
    """``simulate --tiny`` (and ``deploy --tiny``): the tiny Llama made in WORKDIR/tiny-model once and reused,
    the smoke run's settings, the user's KEY=VALUE winning; a config the app takes as it is (a run of it:
    about 30 s on this 2-core machine, most of it Flower's start)."""
    from parablock_flwr.cli import _run_config, build_parser
    from parablock_flwr.tools.app_config import find_project_dir
    from parablock_flwr.tools.tiny_model import SMOKE_CONFIG

    app = find_project_dir()
    args = build_parser().parse_args(["simulate", "--tiny", "num-server-rounds=3"])
    config = _run_config(args, app, tmp_path)
    weights = tmp_path / "tiny-model" / "model.safetensors"
    assert config["model"] == str(tmp_path / "tiny-model") and weights.exists()
    assert config["num-server-rounds"] == 3 and config["local-steps"] == SMOKE_CONFIG["local-steps"]
    made = weights.stat().st_mtime_ns
    assert _run_config(args, app, tmp_path)["model"] == config["model"] and weights.stat().st_mtime_ns == made
    assert check_run_config(config, app) is None
    plain = _run_config(build_parser().parse_args(["simulate"]), app, tmp_path)
    assert "model" not in plain and "num-server-rounds" not in plain


def test_overrides_may_stand_on_both_sides_of_options():
    """``simulate a=1 --num-supernodes 3 b=2``: both overrides, in order (before: ``b=2`` was unrecognised)."""
    from parablock_flwr.cli import parse_args

    args = parse_args(["simulate", "local-steps=2", "--num-supernodes", "3", "batch-size=4", "--tiny"])
    assert args.overrides == ["local-steps=2", "batch-size=4"] and args.num_supernodes == 3 and args.tiny
    assert parse_args(["plan", "m", "a=1", "--num-nodes", "4", "b=2"]).overrides == ["a=1", "b=2"]
    with pytest.raises(SystemExit):
        parse_args(["simulate", "a=1", "--num-supernodes", "3", "--no-such-option"])

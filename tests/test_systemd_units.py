"""The shipped systemd units (deploy/) start as shipped: ``systemd-analyze verify`` accepts each, and each
unit's ``ExecStart`` (parsed from the unit file, its specifiers and ``${VAR}``s expanded as systemd does)
runs as the unit's user with what systemd would create for it: the ``RuntimeDirectory`` and
``StateDirectory`` owned by that user with the unit's modes, ``LoadCredential`` copies readable by it
alone, ``SupplementaryGroups``. No systemd runs here (a container): the test stands in for it, with
the machine's ``nobody``, ``daemon`` and ``www-data`` users in place of ``parablock``, ``parablock-node``
and ``parablock-superlink``, and a folder in place of ``/``. Flower's processes and the worker are real;
everything is stopped by PID."""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from parablock_flwr.tools.app_config import find_project_dir
from parablock_flwr.tools.credentials import make_node_key, make_tls
from parablock_flwr.tools.launch import FLOWER_TRANSFER_SETTINGS, descendants, free_port, listens
from parablock_flwr.worker.protocol import request

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
UNITS = PROJECT_DIR / "deploy"
# The unit's users, and who stands in for them here.
USERS = {
    "parablock": ("nobody", "nogroup"),
    "parablock-node": ("daemon", "daemon"),
    "parablock-superlink": ("www-data", "www-data"),
}
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what systemd gives a service


@dataclass
class Unit:
    """One unit file's [Service] settings (repeated keys kept in order), for instance ``instance``."""

    name: str
    instance: str
    service: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path, instance: str = "", root: Path | None = None) -> Unit:
        text = path.read_text()
        if root is not None:  # the site's file system, moved under ``root``
            for top in ("/opt/parablock-flwr", "/run/", "/var/lib/", "/etc/parablock"):
                text = text.replace(top, f"{root}{top}")
        unit, section = cls(path.name.replace("@.", f"@{instance}.") if instance else path.name, instance), ""
        for line in text.splitlines():
            if line.startswith("["):
                section = line.strip("[]")
            elif section == "Service" and "=" in line and not line.startswith("#"):
                key, value = line.split("=", 1)
                unit.service.setdefault(key, []).append(value)
        return unit

    def one(self, key: str, default: str = "") -> str:
        return self.service.get(key, [default])[-1]

    def specifiers(self, value: str, credentials: Path | None = None) -> str:
        """systemd's ``%i`` (instance), ``%d`` (credentials folder) and ``%%``."""
        out = value.replace("%%", "\0").replace("%i", self.instance)
        if credentials is not None:
            out = out.replace("%d", str(credentials))
        assert "%" not in out.replace("\0", ""), f"{self.name}: a specifier this test does not know in {value!r}"
        return out.replace("\0", "%")

    def environment(self, env_files: dict[str, str], strict: bool = True) -> dict[str, str]:
        """``Environment=`` then ``EnvironmentFile=`` (later wins), as systemd builds it (``strict``: a
        required file the test does not give fails, as the unit would)."""
        env: dict[str, str] = {}
        for line in self.service.get("Environment", []):
            for word in shlex.split(self.specifiers(line)):
                key, _, value = word.partition("=")
                env[key] = value
        for path in self.service.get("EnvironmentFile", []):
            optional, path = path.startswith("-"), self.specifiers(path.lstrip("-"))
            if path not in env_files:
                assert optional or not strict, f"{self.name}: EnvironmentFile={path} is required and the test gave none"
                continue
            for line in env_files[path].splitlines():
                if line.strip() and not line.startswith("#"):
                    key, _, value = shlex.split(line)[0].partition("=")
                    env[key] = value
        return env

    def exec_start(self, env: dict[str, str], credentials: Path | None) -> list[str]:
        """``ExecStart``'s words: ``${VAR}`` one word, ``$VAR`` split on whitespace (systemd.service(5))."""
        argv = []
        for word in shlex.split(self.specifiers(self.one("ExecStart"), credentials)):
            if m := re.fullmatch(r"\$\{(\w+)\}", word):
                argv.append(env[m.group(1)])
            elif m := re.fullmatch(r"\$(\w+)", word):
                argv.extend(env[m.group(1)].split())
            else:
                argv.append(re.sub(r"\$\{(\w+)\}", lambda v: env[v.group(1)], word))
        return argv


def test_every_unit_passes_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    for path in sorted(UNITS.glob("*.service")):
        # The checkout stands in for /opt/parablock-flwr (verify checks that ExecStart's program exists).
        name = path.name.replace("@.", "@0.")
        (tmp_path / name).write_text(path.read_text().replace("/opt/parablock-flwr", str(PROJECT_DIR)))
        done = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(tmp_path / name)], capture_output=True, text=True, timeout=60
        )
        problems = [ln for ln in done.stderr.splitlines() if name in ln and "parablock-worker@0.service" not in ln]
        assert done.returncode == 0 and not problems, f"{name}: {done.stderr}"


def test_supernode_and_superlink_use_the_transfer_settings_the_project_uses():
    for name in ("parablock-supernode@.service", "parablock-superlink.service"):
        env = Unit.read(UNITS / name, "0").environment({}, strict=False)
        assert {k: env.get(k) for k in FLOWER_TRANSFER_SETTINGS} == FLOWER_TRANSFER_SETTINGS, name


def test_units_agree_on_users_groups_and_paths():
    """The SuperNode reaches the worker's socket: its folder's group is the worker's, the SuperNode has
    that group, the worker admits the SuperNode's user, and the node config names that very socket."""
    worker, node = (
        Unit.read(UNITS / "parablock-worker@.service", "0"),
        Unit.read(UNITS / "parablock-supernode@.service", "0"),
    )
    argv = worker.exec_start(worker.environment({}), None)
    socket_path = argv[argv.index("--socket") + 1]
    assert Path(socket_path).parent == Path("/run") / worker.one("RuntimeDirectory").replace("%i", "0")
    assert worker.one("RuntimeDirectoryMode") == "0710"  # endpoint.py: 0710 when another uid is admitted
    assert argv[argv.index("--allow-uid") + 1] == node.one("User")
    assert worker.one("Group") in node.one("SupplementaryGroups").split()
    assert "Restart" in worker.service and worker.one("Restart") != "always"
    doc = (PROJECT_DIR / "docs" / "deploy-8b.md").read_text()
    assert f'worker-socket="{socket_path}"' in doc


def test_the_docs_say_what_the_shipped_units_do():
    """What the docs and the units' own comments claim of the units is what the units do: the users they
    create are the units' users, every restart policy named is one a unit has, and the SuperLink's state is
    in the database the unit gives it (registrations survive its restart), not in memory."""
    units = {path.name: Unit.read(path, "0") for path in sorted(UNITS.glob("*.service"))}
    users, policies = {u.one("User") for u in units.values()}, {u.one("Restart") for u in units.values()}
    for name, unit in units.items():
        created = re.findall(r"useradd\b[^#\n]*?(\S+)\s*(?:#.*)?$", (UNITS / name).read_text(), re.M)
        assert set(created) <= users, f"{name}: useradd {created}, but the units run as {sorted(users)}"
        assert not created or unit.one("User") in created, f"{name} runs as {unit.one('User')}; creates {created}"
    docs = {path.name: path.read_text() for path in [PROJECT_DIR / "README.md", *(PROJECT_DIR / "docs").glob("*.md")]}
    for name, text in docs.items():
        for policy in re.findall(r"Restart=([\w-]+)", text):
            assert policy in policies, f"{name} says Restart={policy}; the units use {sorted(policies)}"
    database = re.search(r"--database (\S+)", (UNITS / "parablock-superlink.service").read_text()).group(1)
    for name in ("reliability.md", "deployment.md"):
        assert database in docs[name], f"docs/{name} does not say where the SuperLink keeps its state"
    assert "keeps its state in memory" not in docs["reliability.md"]


# ---------------------------------------------------------------- standing in for systemd
def need_root_and_users() -> None:
    if os.geteuid() != 0:
        pytest.skip("runs each unit as its user: needs root")
    for user, group in USERS.values():
        try:
            pwd.getpwnam(user), grp.getgrnam(group)
        except KeyError:
            pytest.skip(f"this machine has no user {user} or group {group} to stand in for the unit's")


def make_dir(path: Path, owner: str | None, group: str | None, mode: int) -> None:
    """A folder as systemd makes a unit's ``RuntimeDirectory``/``StateDirectory``: parents root 0755."""
    for parent in reversed([p for p in path.parents if not p.exists()]):
        parent.mkdir(mode=0o755)
    path.mkdir(exist_ok=True)
    os.chown(path, pwd.getpwnam(owner).pw_uid if owner else 0, grp.getgrnam(group).gr_gid if group else 0)
    os.chmod(path, mode)


@contextmanager
def systemd_start(
    unit: Unit, root: Path, env_files: dict[str, str], log: Path
) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """What ``systemctl start`` does before ``exec``, then ``ExecStart`` as the unit's user; stopped at exit
    (SIGTERM to its process group, as ``KillMode=control-group`` would, by PID)."""
    user, group = USERS[unit.one("User")]
    _, unit_group = USERS[unit.one("Group")][0], USERS[unit.one("Group")][1]
    for key, mode_key, top in (("RuntimeDirectory", "RuntimeDirectoryMode", "run"),
                               ("StateDirectory", "StateDirectoryMode", "var/lib")):  # fmt: skip
        for name in " ".join(unit.service.get(key, [])).split():
            make_dir(root / top / unit.specifiers(name), user, unit_group, int(unit.one(mode_key, "0755"), 8))
    credentials = None
    if unit.service.get("LoadCredential"):
        credentials = root / "run" / "credentials" / unit.name
        make_dir(credentials, user, unit_group, 0o500)
        for line in unit.service["LoadCredential"]:
            name, source = unit.specifiers(line).split(":", 1)
            shutil.copyfile(source, credentials / name)  # root reads the 0600 original; the copy is the user's
            os.chown(credentials / name, pwd.getpwnam(user).pw_uid, grp.getgrnam(unit_group).gr_gid)
            os.chmod(credentials / name, 0o400)
    env = unit.environment(env_files)
    argv = unit.exec_start(env, credentials)
    argv = [USERS[w][0] if w in USERS else w for w in argv]  # a user named on the command line
    supplementary = [USERS[g][1] for g in unit.one("SupplementaryGroups").split()]
    home = pwd.getpwnam(user).pw_dir
    base = {"PATH": SYSTEMD_PATH, "HOME": home, "USER": user, "LANG": "C.UTF-8"}
    full_env = {**base, **env, "PYTHONPATH": str(PROJECT_DIR)}  # this checkout's code, as /opt/parablock-flwr's
    cwd = unit.specifiers(unit.one("WorkingDirectory", "/"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=full_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, user=user,
                                group=unit_group, extra_groups=supplementary, start_new_session=True)  # fmt: skip
    try:
        yield proc, argv
    finally:
        for pid in descendants(proc.pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def wait_until(ready, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready in {timeout_s}s: {log.read_text()[-3000:]}"
        time.sleep(0.3)


# The console scripts the units run, or Flower starts through PATH.
SCRIPTS = ("parablock-flwr", "flower-superlink", "flower-supernode", "flower-superexec", "flwr", "flwr-clientapp",
           "flwr-serverapp", "flwr-simulation")  # fmt: skip


def runs_as(user: str, python: str) -> bool:
    with suppress(OSError, subprocess.SubprocessError):
        return subprocess.run([python, "-c", "import sys"], user=user, timeout=60, capture_output=True).returncode == 0
    return False


def install_site(opt: Path) -> None:
    """``/opt/parablock-flwr/.venv`` as a site has it: an interpreter the units' users can run (this test's
    own may sit under a private home), this environment's packages, and its console scripts."""
    users = [u for u, _ in USERS.values()]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [os.path.realpath(sys._base_executable), f"/usr/bin/{version}", f"/usr/local/bin/{version}"]
    python = next((c for c in candidates if all(runs_as(u, c) for u in users)), None)
    if python is None:
        pytest.skip(f"no {version} that the units' stand-in users can run ({', '.join(candidates)})")
    venv = opt / ".venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = sysconfig.get_paths()["purelib"]
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    target = subprocess.run([venv / "bin" / "python", "-c", where], capture_output=True, text=True, check=True)
    target = target.stdout.strip()
    Path(target, "this-environment.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
    for name in SCRIPTS:
        body = (Path(sys.executable).parent / name).read_text().split("\n", 1)[1]
        (venv / "bin" / name).write_text(f"#!{venv}/bin/python\n{body}")
        os.chmod(venv / "bin" / name, 0o755)


@pytest.fixture
def site_root():
    """A folder standing in for ``/`` (the units' users may traverse it: pytest's tmp_path is 0700),
    with the install at ``/opt/parablock-flwr`` (this checkout's code first on the path)."""
    need_root_and_users()
    root = Path(tempfile.mkdtemp(prefix="pb-units-"))
    os.chmod(root, 0o755)
    try:
        (root / "opt" / "parablock-flwr").mkdir(parents=True)
        os.chmod(root / "opt", 0o755)
        install_site(root / "opt" / "parablock-flwr")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


PING_AS = """
import asyncio, sys
from parablock_flwr.worker.protocol import request
try:
    reply = asyncio.run(request(sys.argv[1], {"op": "ping"}, timeout_s=20))[0]
    print(reply.get("pid", reply.get("error")))
except OSError as err:
    print(type(err).__name__)
"""


def ping_as(root: Path, user: str, groups: list[str], socket_path: str) -> str:
    python = root / "opt" / "parablock-flwr" / ".venv" / "bin" / "python"
    done = subprocess.run(
        [python, "-c", PING_AS, socket_path], capture_output=True, text=True, timeout=120, user=user,
        group=pwd.getpwnam(user).pw_gid, extra_groups=groups, env={"PYTHONPATH": str(PROJECT_DIR), "HOME": "/"},
    )  # fmt: skip
    return done.stdout.strip() or done.stderr[-500:]


@pytest.mark.e2e
def test_worker_unit_starts_and_admits_its_supernode_user_only(site_root):
    """The worker unit as shipped: its RuntimeDirectory (0710, its user) holds a 0660 socket; the
    SuperNode unit's user and groups reach it, a user outside the group does not (before: systemd made
    the folder 0755 and the worker refused to start, in a Restart=always loop)."""
    unit = Unit.read(UNITS / "parablock-worker@.service", "0", site_root)
    env_file = {f"{site_root}/etc/parablock/worker-0.env": "DEVICE=cpu\n"}
    log = site_root / "worker.log"
    with systemd_start(unit, site_root, env_file, log) as (proc, argv):
        socket_path = Path(argv[argv.index("--socket") + 1])
        wait_until(socket_path.exists, proc, log)
        st_dir, st_sock = os.stat(socket_path.parent), os.lstat(socket_path)
        assert (oct(st_dir.st_mode & 0o777), pwd.getpwuid(st_dir.st_uid).pw_name) == ("0o710", "nobody")
        assert oct(st_sock.st_mode & 0o777) == "0o660"
        node = Unit.read(UNITS / "parablock-supernode@.service", "0", site_root)
        node_user = USERS[node.one("User")][0]
        node_groups = [USERS[g][1] for g in node.one("SupplementaryGroups").split()]
        assert ping_as(site_root, node_user, node_groups, str(socket_path)) == str(proc.pid)
        assert ping_as(site_root, node_user, [], str(socket_path)) == "PermissionError"  # not in the worker's group
        other = ping_as(site_root, "bin", ["nogroup"], str(socket_path))  # in the group, a uid not admitted
        assert other.startswith(f"uid {pwd.getpwnam('bin').pw_uid} may not use this node worker"), other
        root_reply = asyncio.run(request(str(socket_path), {"op": "ping"}, timeout_s=20))[
            0
        ]  # root passes modes, not uids
        assert root_reply["error"].startswith("uid 0 may not use this node worker"), root_reply


@pytest.mark.e2e
def test_superlink_and_supernode_units_start_with_tls_node_keys_and_the_worker(site_root):
    """The three units as shipped, on loopback: the SuperLink (TLS, node authentication, its key a
    root-owned 0600 file handed over by LoadCredential), the node's key registered with `flwr supernode
    register`, the worker, and the SuperNode (its key root 0600 too), which the SuperLink lists online."""
    etc = site_root / "etc" / "parablock"
    tls = make_tls(etc / "ca")
    assert (tls.ca_cert.name, tls.server_cert.name, tls.server_key.name) == ("ca.crt", "server.pem", "server.key")
    private, public = make_node_key(etc, "node_key-0")
    assert oct(os.stat(private).st_mode & 0o777) == "0o600" and os.stat(private).st_uid == 0
    port, health, app_port, node_health = free_port(), free_port(), free_port(), free_port()
    link_env = {f"{etc}/superlink.env": f"HOST=127.0.0.1\nPORT={port}\nHEALTH_ADDRESS=127.0.0.1:{health}\n"}
    socket_path = f"{site_root}/run/parablock/worker-0/worker.sock"
    node_env = {
        f"{etc}/supernode-0.env": f"SUPERLINK=127.0.0.1:{port}\nCLIENTAPP_PORT={app_port}\n"
        f"HEALTH_ADDRESS=127.0.0.1:{node_health}\n"
        f'NODE_CONFIG=\'partition-id=0 worker-socket="{socket_path}" worker-uid="{USERS["parablock"][0]}"\'\n'
    }
    link = Unit.read(UNITS / "parablock-superlink.service", root=site_root)
    worker = Unit.read(UNITS / "parablock-worker@.service", "0", site_root)
    node = Unit.read(UNITS / "parablock-supernode@.service", "0", site_root)
    flwr_home = site_root / "operator"
    flwr_home.mkdir()
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "mylink"\n[superlink.mylink]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{tls.ca_cert}"\n'
    )
    op_env = {**os.environ, "FLWR_HOME": str(flwr_home), "PYTHONPATH": str(PROJECT_DIR)}
    flwr = str(Path(sys.executable).parent / "flwr")
    with systemd_start(link, site_root, link_env, site_root / "superlink.log") as (link_proc, _):
        wait_until(lambda: listens(f"127.0.0.1:{port}"), link_proc, site_root / "superlink.log")
        done = subprocess.run([flwr, "supernode", "register", str(public), "mylink"], env=op_env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert "registered successfully" in done.stdout, done.stdout + done.stderr
        with systemd_start(worker, site_root, {f"{etc}/worker-0.env": "DEVICE=cpu\n"}, site_root / "w.log") as (w, _):
            wait_until(Path(socket_path).exists, w, site_root / "w.log")
            with systemd_start(node, site_root, node_env, site_root / "supernode.log") as (node_proc, _):

                def online() -> bool:
                    listed = subprocess.run([flwr, "supernode", "list", "mylink"], env=op_env, capture_output=True,
                                            text=True, timeout=120)  # fmt: skip
                    return "online" in listed.stdout

                wait_until(online, node_proc, site_root / "supernode.log")
    assert "ERROR" not in (site_root / "supernode.log").read_text()

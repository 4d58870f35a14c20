"""A node worker's socket is its node's only: private modes whatever the umask, peers checked by uid,
a message's declared size bounded before anything is read, and a socket file never taken from
another worker. The parser is tested in process (hypothesis); start, refusal and exit with real
worker processes (`python -m parablock_flwr.worker`, which loads no model until a run's first
message: a ping needs none)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parablock_flwr import node
from parablock_flwr.cli import build_parser
from parablock_flwr.client_apps.app import relay_to_worker
from parablock_flwr.config import RunConfig
from parablock_flwr.messages import PROTOCOL_KEY
from parablock_flwr.versions import PROTOCOL_VERSION
from parablock_flwr.worker.endpoint import MESSAGE_MARGIN_BYTES, MessageLimit, SocketRefused, WorkerSocket
from parablock_flwr.worker.protocol import MAX_HEADER_BYTES, ProtocolError, _frame, recv, request

from helpers import tiny_config

PETABYTE = 10**15  # more than any machine's memory: refused before the model is known, by any default


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def frame(header: dict, payload: bytes = b"") -> bytes:
    raw = json.dumps({PROTOCOL_KEY: PROTOCOL_VERSION, **header}).encode()
    return struct.pack(">Q", len(raw)) + raw + payload


# ---------------------------------------------------------------- the parser, in process
def receive(data: bytes, bound: int, eof: bool = True, timeout_s: float | None = None):
    """``recv`` on exactly ``data`` (then EOF), with a fixed bound on the array bytes."""

    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await asyncio.wait_for(recv(reader, lambda header: (bound, "the test's bound")), timeout_s)

    return asyncio.run(run())


names = st.text(max_size=8)
dtypes = st.sampled_from(["float32", "float16", "int16", "bool", "object", "V8", ">f4", "complex64", "", 3, None])
dims = st.one_of(st.integers(-2, 6), st.integers(0, 2**70), st.booleans(), st.floats(), st.text(max_size=2))
specs = st.one_of(
    st.fixed_dictionaries({"name": names, "dtype": dtypes, "shape": st.lists(dims, max_size=4)}),
    st.fixed_dictionaries({"name": names, "dtype": dtypes, "shape": st.lists(st.integers(0, 4), max_size=40)}),
    st.integers(),
    st.none(),
)
headers = st.fixed_dictionaries({"op": st.sampled_from(["train", "ping"]), "arrays": st.lists(specs, max_size=4)})
BOUND = 64 * 1024


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.one_of(
        st.binary(max_size=64),  # anything at all, its first 8 bytes read as a header length
        st.builds(lambda h, p: frame(h, p), headers, st.binary(max_size=256)),  # well-framed, any arrays
        st.builds(lambda n, p: struct.pack(">Q", n) + p, st.integers(0, 2**64 - 1), st.binary(max_size=64)),
    )
)
def test_arbitrary_frames_never_crash_the_parser_nor_allocate_beyond_the_bound(raw):
    """Whatever arrives is either one frame whose arrays are exactly what its header declared, within
    the bound, or one `ProtocolError` line (or the end of a connection that sent nothing): no other
    exception, and the memory used stays within what was sent plus a small constant, whatever
    sizes the header declares (up to 2^70 elements per dimension here)."""
    tracemalloc.start()
    try:
        header, arrays = receive(raw, BOUND)
    except ProtocolError as err:
        assert "\n" not in str(err)
    except asyncio.IncompleteReadError:
        assert len(raw) < 8  # only when not even the header's length arrived
    else:
        assert sum(a.nbytes for a in arrays.values()) <= BOUND
        assert isinstance(header, dict) and "arrays" not in header
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * len(raw) + 256 * 1024, peak


def test_an_array_sent_as_its_pieces_arrives_as_the_one_array_they_make():
    """The worker writes its reply's values as one piece per tensor (no joined copy of the block): the
    receiver reads one array, equal to the pieces joined; pieces that cannot make one 1-D array are
    refused by the sender, in one line."""
    pieces = [np.arange(5, dtype=np.int16), np.zeros(0, np.int16), np.arange(3, dtype=np.int16) * -7]
    single = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = b"".join(bytes(b) for b in _frame({"op": "train"}, {"values": pieces, "layout": [single]}))
    header, arrays = receive(raw, BOUND)
    assert header == {"op": "train"} and list(arrays) == ["values", "layout"]
    assert arrays["values"].dtype == np.int16 and arrays["values"].tolist() == np.concatenate(pieces).tolist()
    assert arrays["layout"].shape == (2, 3) and arrays["layout"].tolist() == single.tolist()
    with pytest.raises(ValueError, match=r"array 'v': pieces of \['float32', 'int16'\]; expected 1-D pieces"):
        _frame({}, {"v": [np.zeros(2, np.int16), np.zeros(2, np.float32)]})


def test_a_header_declaring_too_much_is_refused_before_any_array_byte_is_read():
    """100 GB declared, no byte of it sent, the connection left open: the refusal is immediate (today's
    parser waited for the 100 GB), one line naming the declared size and the bound."""
    header = {"op": "train", "arrays": [{"name": "w", "dtype": "float32", "shape": [25 * 10**9]}]}
    with pytest.raises(ProtocolError) as refused:
        receive(frame(header), bound=10**9, eof=False, timeout_s=5)
    assert str(refused.value) == (
        "message declares 100,000,000,000 bytes of arrays; this worker accepts at most 1,000,000,000 (the test's bound)"
    )


def test_a_frame_shorter_than_it_declares_is_refused_by_what_arrived():
    header = {"op": "train", "arrays": [{"name": "w", "dtype": "float32", "shape": [4]}]}
    with pytest.raises(ProtocolError, match="the frame ended after 12 of the 16 bytes of array 'w'"):
        receive(frame(header, b"\0" * 12), BOUND)
    too_long = struct.pack(">Q", MAX_HEADER_BYTES + 1)
    with pytest.raises(ProtocolError, match=f"header of {MAX_HEADER_BYTES + 1:,} bytes; expected at most"):
        receive(too_long, BOUND)


def test_the_bound_is_the_largest_message_for_the_loaded_model(tmp_path, tiny_model_dir):
    """Once a run's model is loaded: (blocks + 2) x the largest block's fp32 bytes, plus the margin, which
    a full sync (every trainable value), g^{r-1} and a handed-back update fit in; another run's
    message is bounded by the machine's memory until its model is loaded; the flag wins."""
    cfg = RunConfig.from_flower(tiny_config(tiny_model_dir, tmp_path))
    loaded = node.resources(cfg, 7)
    blocks = [sum(loaded.replica.params[n].numel() * 4 for n in names) for names in loaded.partition.blocks]
    bound, source = MessageLimit()({"run-id": 7})
    assert bound == (len(blocks) + 2) * max(blocks) + MESSAGE_MARGIN_BYTES and "run 7's model" in source
    assert sum(blocks) + 2 * max(blocks) <= bound  # the largest full sync
    assert MessageLimit()({"run-id": 8})[0] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert MessageLimit(1234)({"run-id": 7}) == (1234, "--max-message-bytes")


def test_the_worker_options_take_uid_lists_and_a_byte_count(capsys):
    args = build_parser().parse_args(
        ["worker", "--socket", "w.sock", "--allow-uid", "1001,1002", "--allow-uid", "7", "--max-message-bytes", "99"]
    )
    assert (args.allow_uid, args.max_message_bytes) == ([[1001, 1002], [7]], 99)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--socket", "w.sock", "--allow-uid", "no-such-user-here"])
    err = capsys.readouterr().err
    assert "argument --allow-uid: 'no-such-user-here': expected user ids or names like 1001,1002" in err
    args = build_parser().parse_args(["worker", "--socket", "w.sock", "--allow-uid", "nobody,0"])  # a unit names users
    assert args.allow_uid == [[pwd.getpwnam("nobody").pw_uid, 0]]


def test_the_node_configs_worker_uid_takes_a_uid_as_a_number_a_quoted_number_or_a_user_name():
    """``worker-uid=1001``, ``worker-uid="1001"`` (a node config quotes what a unit file writes) and
    ``worker-uid="nobody"`` name a user, as ``--allow-uid`` does (before: a quoted number was refused as
    no user's name); what is neither is refused in one line."""
    from parablock_flwr.client_apps.app import trusted_worker_uids, unknown_node_config_key

    nobody = pwd.getpwnam("nobody").pw_uid
    for value, uid in ((1001, 1001), ("1001", 1001), ("nobody", nobody)):
        assert unknown_node_config_key({"worker-uid": value}) is None, value
        assert uid in trusted_worker_uids({"worker-uid": value}), value
    for value in (-1, "-1", "no-such-user-here", ""):
        assert "node config worker-uid=" in unknown_node_config_key({"worker-uid": value}), value


# ---------------------------------------------------------------- the socket file, in process
def test_socket_and_the_directories_it_creates_are_private_under_umask_002(tmp_path):
    """Under umask 002 (today: directory 0775, socket 0775): 0700 and 0600; with --allow-uid 0710 and 0660."""
    old = os.umask(0o002)
    try:
        private = WorkerSocket.claim(tmp_path / "a" / "b" / "w.sock")
        shared = WorkerSocket.claim(tmp_path / "s" / "w.sock", allowed_uids=[65534])
    finally:
        os.umask(old)
    try:
        assert (mode(tmp_path / "a"), mode(tmp_path / "a" / "b"), mode(private.path)) == (0o700, 0o700, 0o600)
        assert (mode(tmp_path / "s"), mode(shared.path)) == (0o710, 0o660)
    finally:
        private.release()
        shared.release()
    assert not private.path.exists() and not shared.path.exists()


def test_a_directory_others_can_enter_or_a_file_that_is_not_a_socket_is_refused(tmp_path):
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(SocketRefused) as refused:
        WorkerSocket.claim(tmp_path / "open" / "w.sock")
    own = tmp_path / "open" / "parablock" / "w.sock"
    assert str(refused.value) == (
        f"socket directory {tmp_path / 'open'}: mode 0755, owner uid {os.geteuid()}; expected a directory of uid "
        f"{os.geteuid()} with mode 0700, e.g. one the worker creates: --socket {own}"
    )
    assert mode(tmp_path / "open") == 0o755  # never tightened: it may be shared
    (tmp_path / "w.sock").write_text("notes")
    with pytest.raises(SocketRefused, match="a file that is not a socket is there"):
        WorkerSocket.claim(tmp_path / "w.sock")
    assert (tmp_path / "w.sock").read_text() == "notes"


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a folder of another user: needs root")
def test_every_folder_above_the_socket_is_checked_not_only_its_own(tmp_path):
    """The socket's whole path, as ssh checks the path to its keys: a folder above the socket's that another
    user owns, or that group or others may write (not root's with the sticky bit), is refused with one line
    naming it, before anything is created below it (before: only the socket's own folder was checked, and a
    user who could rename folders above it could put their own socket folder in its place). A root-owned
    sticky folder like /tmp is fine, and so is a symlinked path whose real folders are safe."""
    cases = {"world-writable": (0, 0o777), "group-writable": (0, 0o775), "another-users": (65534, 0o755)}
    for name, (uid, folder_mode) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        os.chmod(folder, folder_mode)
        os.chown(folder, uid, -1)
        with pytest.raises(SocketRefused) as refused:
            WorkerSocket.claim(folder / "deeper" / "parablock" / "w.sock")
        assert str(refused.value) == (
            f"--socket {folder / 'deeper' / 'parablock' / 'w.sock'}: folder {folder} above it has mode "
            f"{folder_mode:04o}, owner uid {uid}; expected every folder above the socket to be writable only by "
            f"root or uid {os.geteuid()} (a root-owned folder with the sticky bit, like /tmp, is fine)"
        ), name
        assert not (folder / "deeper").exists(), name
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    ok = WorkerSocket.claim(sticky / "parablock" / "w.sock")
    ok.release()
    (tmp_path / "link").symlink_to(tmp_path / "world-writable")
    with pytest.raises(SocketRefused, match=f"folder {tmp_path / 'link'} above it has mode 0777"):
        WorkerSocket.claim(tmp_path / "link" / "parablock" / "w.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a link of another user: needs root")
def test_a_link_on_the_socket_path_that_another_user_owns_is_refused(tmp_path):
    """A symbolic link on the socket's path belongs to whoever made it, whatever it points at: in a
    sticky folder like /tmp another user may plant ``/tmp/pb -> a folder of the worker's`` and later point
    it at a folder of their own. Such a link (not root's nor the worker's) is refused in one line naming
    it (before: every check followed it to the worker's own folder and passed); the worker's own link
    and root's are fine."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for name, owner, refused in (("theirs", 65534, True), ("mine", os.geteuid(), False), ("roots", 0, False)):
        link = sticky / name
        link.symlink_to(private)
        os.lchown(link, owner, -1)
        for socket_path in (link / "w.sock", link / "deeper" / "w.sock"):  # the socket's folder, or one above it
            if refused:
                with pytest.raises(SocketRefused) as err:
                    WorkerSocket.claim(socket_path)
                assert str(err.value) == (
                    f"--socket {socket_path}: {link} on its path is a symbolic link of uid 65534; expected links "
                    f"on the socket's path to be root's or uid {os.geteuid()}'s (another user may re-point theirs)"
                ), socket_path
            else:
                WorkerSocket.claim(socket_path).release()
        link.unlink()
        shutil.rmtree(private / "deeper", ignore_errors=True)


def impostor(path: Path, uid: int):
    """A process of ``uid`` listening at ``path`` (its folder made that user's) that counts the bytes a
    client sends it; returns (its pid, a function that waits for the count)."""
    path.parent.mkdir(mode=0o700)
    os.chown(path.parent, uid, -1)
    ready_r, ready_w = os.pipe()
    count_r, count_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        received = -1
        try:
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as server:
                server.bind(str(path))
                server.listen(1)
                os.write(ready_w, b"1")
                server.settimeout(20)
                conn, _ = server.accept()
                conn.settimeout(3)
                received = 0
                with contextlib.suppress(OSError):
                    while chunk := conn.recv(1 << 16):
                        received += len(chunk)
                conn.close()
        finally:
            os.write(count_w, str(received).encode())
            os._exit(0)
    os.close(ready_w), os.close(count_w)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)

    def count() -> int:
        with os.fdopen(count_r) as answer:
            value = int(answer.read())
        os.waitpid(pid, 0)
        return value

    return pid, count


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="listens as another user: needs root")
def test_the_clientapp_sends_nothing_to_a_worker_of_an_unexpected_user(monkeypatch):
    """The relay checks whom it talks to (``SO_PEERCRED``) before it sends a byte: a process of uid 65534
    listening at the node's socket path gets nothing, and the round's reply is one line naming it (before:
    the message, the global step among it, went to whoever listened there). The node config's ``worker-uid``
    names a worker run as another user on purpose: that one is sent the message."""
    root = Path(tempfile.mkdtemp(prefix="pb-peer-", dir="/tmp"))  # /tmp: uid 65534 may traverse it
    os.chmod(root, 0o711)
    path = root / "node" / "w.sock"
    pid, received = impostor(path, 65534)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the ClientApp's own user, neither root nor the listener's
    reason = relay_error(path)["reason"]
    monkeypatch.undo()
    assert received() == 0
    assert reason == (
        f"node worker socket {path}: the process listening there (pid {pid}) runs as uid 65534; expected uid 1000 "
        "(this ClientApp's) or root, or the node config's worker-uid; nothing was sent"
    )
    shutil.rmtree(path.parent)
    _, received = impostor(path, 65534)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    relay_error(path, worker_uid=65534)
    monkeypatch.undo()
    assert received() > 0
    shutil.rmtree(root)


# ---------------------------------------------------------------- real worker processes
def start_worker(path: Path, *options: str, log: Path, umask: int = 0o022) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "parablock_flwr.worker", "--socket", str(path), *options]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True, umask=umask)


def ping(path: Path) -> dict:
    return asyncio.run(request(str(path), {"op": "ping"}, timeout_s=20))[0]


def wait_until_serving(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(OSError):
            return ping(path)
        time.sleep(0.2)
    raise AssertionError(f"no worker answered at {path}: {log.read_text()}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        return proc.wait(30)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """One worker, started under umask 002 on a socket in a directory it creates."""
    root = tmp_path_factory.mktemp("sockets")
    path, log = root / "node" / "w.sock", root / "worker.log"
    proc = start_worker(path, log=log, umask=0o002)
    try:
        wait_until_serving(path, proc, log)
        yield path, proc, log
    finally:
        stop(proc)


@pytest.mark.e2e
def test_a_worker_started_under_umask_002_serves_a_private_socket(running):
    path, proc, log = running
    assert (mode(path.parent), mode(path)) == (0o700, 0o600)  # today: 0775 and 0775
    assert ping(path)["pid"] == proc.pid


@pytest.mark.e2e
def test_an_oversized_header_gets_one_error_line_and_the_worker_allocates_nothing(running):
    """1 PB declared to a worker with no model loaded (bound: the machine's memory): one error line back
    at once, the worker's RSS unchanged (today: no answer, the worker waits for the bytes)."""
    path, proc, _ = running
    before = rss_bytes(proc.pid)
    header = {"op": "train", "run-id": 1, "arrays": [{"name": "w", "dtype": "float32", "shape": [PETABYTE // 4]}]}
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(20)
        client.connect(str(path))
        client.sendall(frame(header))
        (size,) = struct.unpack(">Q", client.recv(8, socket.MSG_WAITALL))
        reply = json.loads(client.recv(size, socket.MSG_WAITALL))
        assert client.recv(1) == b""  # and the connection is closed
    assert reply["error"].startswith(f"ProtocolError: message declares {PETABYTE:,} bytes of arrays; this worker")
    assert "this machine's memory" in reply["error"] and "\n" not in reply["error"]
    assert rss_bytes(proc.pid) - before < 32 * 1024 * 1024
    assert ping(path)["pid"] == proc.pid  # and it serves on


@pytest.mark.e2e
def test_a_second_worker_on_the_same_path_is_refused_and_the_first_stays_reachable(running, tmp_path):
    """Today the second one deleted the first's socket: the first ran on, unreachable."""
    path, proc, _ = running
    second = subprocess.run(
        [sys.executable, "-m", "parablock_flwr.worker", "--socket", str(path)], capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert second.returncode == 1
    assert second.stderr.strip().splitlines()[-1] == (
        f"parablock-flwr worker: --socket {path}: a node worker (pid {proc.pid}) is answering there; "
        "stop it or choose another path"
    )
    assert ping(path)["pid"] == proc.pid


@pytest.mark.e2e
def test_a_stale_socket_is_replaced_and_a_socket_that_is_not_its_own_survives_the_exit(running, tmp_path):
    """The module's worker, killed, leaves its socket file: the next one removes it (nothing listens)
    and serves. When that file is then replaced by another's (here the test's own listening
    socket), the worker's exit leaves the replacement in place and reachable (today: deleted)."""
    path, first, _ = running  # the last test to use it
    stop(first, signal.SIGKILL)
    assert path.exists()  # stale: nothing listens on it
    second = start_worker(path, log=tmp_path / "second.log")
    try:
        assert wait_until_serving(path, second, tmp_path / "second.log")["pid"] == second.pid
        path.unlink()
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(path))
        other.listen(1)
        before = os.lstat(path)
        assert stop(second) == 0
    finally:
        stop(second, signal.SIGKILL)
    with other:
        after = os.lstat(path)
        assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
    assert "is no longer the socket this worker created" in (tmp_path / "second.log").read_text()


def raw_ping(path: Path) -> dict:
    """A ping frame over a plain socket, its reply's header (the standard library only)."""
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(20)
        try:
            client.connect(str(path))
        except OSError as err:
            return {"oserror": type(err).__name__}
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused: answered, then closed
            client.sendall(frame({"op": "ping", "arrays": []}))
        (size,) = struct.unpack(">Q", client.recv(8, socket.MSG_WAITALL))
        return json.loads(client.recv(size, socket.MSG_WAITALL))


def as_uid(uid: int, call) -> dict:
    """``call()`` in a forked process of ``uid`` that keeps root's groups (so the file system lets it
    reach a socket shared with the group): only the worker's own check can tell it apart."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.setuid(uid)
            result = call()
        except BaseException as err:
            result = {"child-error": repr(err)}
        finally:
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        result = json.loads(answer.read())
    os.waitpid(pid, 0)
    return result


def relay_error(path: Path, **node_config) -> dict:
    """What the deployment's ClientApp replies when it relays a round to the worker at ``path``."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 5, 0
    msg = Message(content=RecordDict({"round": ConfigRecord({"server-round": 1})}), dst_node_id=5,
                  message_type=MessageType.TRAIN)  # fmt: skip
    TaskIdentity.node_id = 5
    node_config = {"worker-socket": str(path), **{k.replace("_", "-"): v for k, v in node_config.items()}}
    context = Context(run_id=1, node_id=5, node_config=node_config, state=RecordDict(),
                      run_config={"round-timeout-s": 20.0})  # fmt: skip
    reply = relay_to_worker(msg, context, str(path))
    return {"reason": reply.error.reason if reply.has_error() else None}


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other users: needs root")
def test_peers_are_admitted_by_uid(tmp_path):
    """With --allow-uid 65534 the socket is shared with the group (0660, directory 0710): uid 65534 is
    admitted, uid 65533 (same groups, so the file system lets it through) gets one error line from
    the worker's own check, and the worker logs it (today: no such option, and any peer the file
    modes let through was served). The ClientApp relays the refusal as its error reply, and names the
    option when the file system keeps its user out."""
    root = Path(tempfile.mkdtemp(prefix="pb-uid-", dir="/tmp"))  # /tmp: others may traverse it
    os.chmod(root, 0o710)
    path, log = root / "w.sock", tmp_path / "worker.log"
    worker = start_worker(path, "--allow-uid", "65534", log=log)
    try:
        assert wait_until_serving(path, worker, log)["pid"] == worker.pid
        assert mode(path) == 0o660
        assert as_uid(65534, lambda: raw_ping(path))["pid"] == worker.pid
        refused = as_uid(65533, lambda: raw_ping(path))["error"]
        assert refused == f"uid 65533 may not use this node worker (allowed uids: {os.geteuid()}, 65534)"
        assert as_uid(65533, lambda: relay_error(path)) == {"reason": f"node worker failed: {refused}"}
        assert ping(path)["pid"] == worker.pid
        with socket.socket(socket.AF_UNIX) as private:  # a socket only its own user may open
            private.bind(str(root / "private.sock"))
            private.listen(1)
            os.chmod(root / "private.sock", 0o600)
            assert as_uid(65534, lambda: relay_error(root / "private.sock"))["reason"] == (
                f"node worker socket {root / 'private.sock'}: permission denied for uid 65534; run the SuperNode as "
                "the worker's user, or start the worker with --allow-uid 65534 (docs/deployment.md)"
            )
        os.unlink(root / "private.sock")
    finally:
        stop(worker)
        shutil.rmtree(root)
    assert "refused a connection from pid" in log.read_text() and "uid 65533" in log.read_text()

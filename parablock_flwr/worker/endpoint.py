"""Who may reach a node worker, how much a message may carry, and whose socket file is whose.

The worker holds its node's only copy of the model, and a message to it can replace that copy,
set the paths the node reads, or ask it to hold arrays in memory. So:

- **Directory.** A socket directory the worker creates is made 0700 (0710 with ``--allow-uid``:
  the shared group may traverse it), whatever the umask. One that exists must be owned by the
  worker's user and give nothing to others (nor write access to its group): otherwise the worker
  refuses to start with one line naming it and its mode. It never changes the mode of a directory
  it did not create: tightening a shared ``/tmp`` or ``/run`` would break its other users.
- **Path.** Every folder above the socket's must be writable only by root or the worker's user
  (a root-owned folder with the sticky bit, such as ``/tmp``, is fine: others may not rename what is
  not theirs in it), as ``ssh`` checks the path to its keys; otherwise someone else could move the
  socket's folder aside and put their own in its place. For the same reason no symbolic link on the
  path, the socket's folder included, may be another user's. Checked before anything is created.
- **Socket.** Bound under a umask that leaves it 0600 (0660 with ``--allow-uid``), then set to
  exactly that mode before ``listen()``: a connection before ``listen()`` is refused, so nobody
  can connect while the mode is anything else.
- **Peers.** Each connection's uid (``SO_PEERCRED``) must be the worker's own or one named by
  ``--allow-uid``; any other peer gets a one-line error and is closed before a byte is read.
- **Size.** ``MessageLimit`` bounds the array bytes a message declares (``protocol.recv`` refuses
  a header over it before reading any array).
- **Ownership.** At start, a socket file already at the path is connected to: if a process
  listens there, the worker refuses to start, naming the path and that pid; if nothing does (a
  stale file from a killed worker), it is removed. At exit the path is removed only if it is
  still the file this worker created (device, inode and change time: an inode number the file
  system reused is not mistaken for it). Both steps hold an ``flock`` on the directory, so two
  workers started at once cannot both find the path free.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..messages import WorkerReply, WorkerRequest
from .protocol import send

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0  # for the start-up check of a socket file found at the path
SUN_PATH_MAX = 107  # bytes in a Unix socket path (sockaddr_un.sun_path, less its NUL)
MESSAGE_MARGIN_BYTES = 64 * 1024 * 1024  # above the largest message the server sends for a model

Handler = Callable[..., Awaitable[None]]


class SocketRefused(Exception):
    """The worker does not start: its one-line reason names the path and what was found there."""


def peer_credentials(sock) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


@dataclass
class WorkerSocket:
    """The listening socket this worker created at ``path``, and who may use it."""

    path: Path
    allowed_uids: frozenset[int]
    sock: socket.socket
    identity: tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns) of the file this worker created

    @classmethod
    def claim(cls, path: Path, allowed_uids: Iterable[int] = ()) -> WorkerSocket:
        """Listen at ``path``, or raise ``SocketRefused`` with the reason (nothing is removed then)."""
        path = Path(os.path.abspath(path))
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            raise SocketRefused(f"--socket {path}: {len(os.fsencode(path))} bytes; expected at most {SUN_PATH_MAX}")
        allowed = frozenset((os.geteuid(), *allowed_uids))
        shared = len(allowed) > 1
        try:
            _prepare_directory(path, shared)
            with _directory_lock(path.parent):
                _remove_if_stale(path)
                sock = _listen(path, 0o660 if shared else 0o600)
                st = os.lstat(path)
        except OSError as err:  # e.g. a directory this user may not create or write
            raise SocketRefused(f"--socket {path}: {err.strerror or err} ({err.filename or path})") from None
        return cls(path, allowed, sock, (st.st_dev, st.st_ino, st.st_ctime_ns))

    def describe(self) -> str:
        mode = stat.S_IMODE(os.lstat(self.path).st_mode)
        return f"{self.path} (mode {mode:04o}, peers with uid {', '.join(map(str, sorted(self.allowed_uids)))})"

    def admitting(self, handler: Handler) -> Handler:
        """``handler`` for each connection whose peer's uid is allowed; any other peer is answered one
        error line and closed before anything it sent is read. A peer that leaves before its reply
        is a warning line, not a traceback."""

        async def connection(reader, writer) -> None:
            pid, uid, _ = peer_credentials(writer.get_extra_info("socket"))
            if uid not in self.allowed_uids:
                allowed = ", ".join(map(str, sorted(self.allowed_uids)))
                log.warning("refused a connection from pid %d, uid %d: allowed uids are %s", pid, uid, allowed)
                with contextlib.suppress(OSError):
                    refusal = WorkerReply(error=f"uid {uid} may not use this node worker (allowed uids: {allowed})")
                    await send(writer, refusal.to_header())
                writer.close()
                return
            try:
                await handler(reader, writer)
            except ConnectionError as err:  # e.g. a ClientApp that stopped waiting (round-timeout-s)
                log.warning("pid %d left before its reply (%s)", pid, type(err).__name__)

        return connection

    def release(self) -> None:
        """Stop listening; remove the path only if it is still the file this worker created."""
        self.sock.close()  # a second call (or after the server closed it) does nothing
        if not self.path.parent.is_dir():
            return  # the directory went first (a launcher's temporary one): nothing left to remove
        with _directory_lock(self.path.parent):
            try:
                st = os.lstat(self.path)
            except FileNotFoundError:
                return
            if (st.st_dev, st.st_ino, st.st_ctime_ns) == self.identity:
                self.path.unlink()
            else:
                log.warning("left %s in place: it is no longer the socket this worker created", self.path)


def _prepare_directory(path: Path, shared: bool) -> None:
    """Create the socket's missing directories with its directory's mode; check the one that holds it."""
    directory, mode = path.parent, 0o710 if shared else 0o700
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    _check_ancestors(path, directory)
    for created in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another worker made it meanwhile: checked below
            created.mkdir(mode)
            os.chmod(created, mode)  # mkdir's mode is masked by the umask
    st = os.stat(directory)
    forbidden = 0o027 if shared else 0o077  # shared: the group may traverse and list, never write
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & forbidden:
        have, own = stat.S_IMODE(st.st_mode), directory / "parablock" / path.name
        raise SocketRefused(
            f"socket directory {directory}: mode {have:04o}, owner uid {st.st_uid}; expected a directory of uid "
            f"{os.geteuid()} with mode {mode:04o}, e.g. one the worker creates: --socket {own}"
        )


def _check_ancestors(path: Path, directory: Path) -> None:
    """``SocketRefused`` if a folder above the socket's (as written, and as its links resolve) may be
    changed by a user other than root and the worker's: owned by another user, or writable by group
    or others without being root's with the sticky bit; or if a link on the path, the socket's folder
    included, is another user's (its owner may point it elsewhere later)."""
    for entry in (directory, *directory.parents):  # a link is its maker's, whatever it points at
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(entry)
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
                raise SocketRefused(
                    f"--socket {path}: {entry} on its path is a symbolic link of uid {st.st_uid}; expected links on "
                    f"the socket's path to be root's or uid {os.geteuid()}'s (another user may re-point theirs)"
                )
    above = [*directory.parents, *Path(os.path.realpath(directory)).parents]
    for folder in dict.fromkeys(above):
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            continue  # created below, by the worker, with the socket directory's mode
        sticky_root = st.st_uid == 0 and st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not sticky_root):
            raise SocketRefused(
                f"--socket {path}: folder {folder} above it has mode {stat.S_IMODE(st.st_mode):04o}, owner uid "
                f"{st.st_uid}; expected every folder above the socket to be writable only by root or uid "
                f"{os.geteuid()} (a root-owned folder with the sticky bit, like /tmp, is fine)"
            )


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the socket directory: start-up and exit of workers there, one at a time."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_if_stale(path: Path) -> None:
    """Remove a socket file nothing listens on; refuse (``SocketRefused``) anything else at ``path``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketRefused(f"--socket {path}: a file that is not a socket is there; remove it or choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:  # nothing listens: a file left by a worker that was killed
            path.unlink()
            log.info("removed a stale socket file at %s (nothing listened on it)", path)
            return
        except OSError as err:
            raise SocketRefused(
                f"--socket {path}: a socket is there and connecting to it failed ({err}); not replacing it"
            ) from None
        pid = peer_credentials(probe)[0]
    raise SocketRefused(
        f"--socket {path}: a node worker (pid {pid}) is answering there; stop it or choose another path"
    )


def _listen(path: Path, mode: int) -> socket.socket:
    """A listening socket at ``path`` whose mode is exactly ``mode`` before anyone can connect."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o777 & ~mode)  # the file is created with at most ``mode``
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(umask)
    os.chmod(path, mode)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class MessageLimit:
    """The most array bytes one message may declare, for ``protocol.recv``.

    ``--max-message-bytes`` when given. Otherwise, once a run's model is loaded, the largest message
    the server sends for it, plus a margin: a full sync (every block's values) or a catch-up (at
    most one step per block), each with ``g^{r-1}`` and a handed-back update, so at most
    ``(blocks + 2) x`` the largest block's fp32 bytes. Before that (a new run's first message, a
    resumed run's full sync) the machine's physical memory: a message larger than that could not
    be held anyway."""

    def __init__(self, fixed_bytes: int = 0) -> None:
        self.fixed_bytes = fixed_bytes

    def __call__(self, header: dict) -> tuple[int, str]:
        if self.fixed_bytes:
            return self.fixed_bytes, "--max-message-bytes"
        from .. import node  # the worker's loaded run, if any (torch: only in the worker process)

        loaded = node.loaded()
        if loaded is not None and loaded.key[0] == WorkerRequest.run_of(header):
            largest = model_message_bytes(loaded.partition.blocks, loaded.replica.params)
            return largest, f"the largest message for run {loaded.key[0]}'s model, with a margin"
        return physical_memory(), "this machine's memory; no model is loaded for this run yet"


def model_message_bytes(blocks: Iterable[Iterable[str]], params: dict) -> int:
    """``(blocks + 2) x`` the largest block's fp32 bytes, plus ``MESSAGE_MARGIN_BYTES``."""
    block_bytes = [sum(params[n].numel() for n in names) * 4 for names in blocks]
    return (len(block_bytes) + 2) * max(block_bytes, default=0) + MESSAGE_MARGIN_BYTES


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

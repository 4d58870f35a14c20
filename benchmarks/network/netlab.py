"""The plumbing of a shaped network on one machine: namespaces, veth pairs, `tc tbf`, the latency proxy.

benchmarks/network.py runs its experiment over what this module builds:

    namespace PREFIX-link     the SuperLink's side of every link
         |  one veth pair per node: 10.213.<i>.1 (link side) <-> 10.213.<i>.2 (node side),
         |  `tc tbf` on both ends: node-side egress = uplink, link-side egress = downlink
    namespace PREFIX-n<i>     node i; `proxy_command` runs benchmarks/latency_proxy.py there
                              (this kernel has no netem: the one-way delay is added in user space)

Everything made is registered on an ``ExitStack`` as it is made, so closing the
stack (also on Ctrl-C, SIGTERM with ``stop_on_sigterm``, or an error) deletes it;
processes are stopped by PID (``terminate_all``, ``wait_gone``). Needs root and
iproute2's ``ip`` and ``tc`` (``check_machine``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parablock_flwr.tools.launch import started

log = logging.getLogger(__name__)

PROXY = Path(__file__).resolve().parent / "latency_proxy.py"
IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"


@dataclass
class Node:
    index: int
    ns: str
    dev: str  # node-side veth: its egress is the uplink
    link_dev: str  # link-side veth, in the SuperLink's namespace: its egress is the downlink
    link_ip: str  # the SuperLink's address on this node's link


@dataclass
class Network:
    prefix: str
    link_ns: str
    nodes: list[Node]


def sh(*cmd: str) -> str:
    """Run a setup command; fail with its own error message in one line."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def in_netns(ns: str) -> list[str]:
    """Prefix that runs a command inside ``ns``; `ip netns exec` execs it, so the PID stays the command's."""
    return [IP, "netns", "exec", ns]


def started_in(ns: str, cmd: list[str], log_path: Path, env: dict[str, str]):
    """``launch.started`` inside ``ns``: a process in its own session, logging to a file, stopped by PID."""
    return started([*in_netns(ns), *cmd], log_path, env)


def build_network(stack: contextlib.ExitStack, prefix: str, num_clients: int) -> Network:
    """The namespaces and veth pairs, each deleted again when ``stack`` closes (registered as made)."""
    link_ns = f"{prefix}-link"
    _add_netns(stack, link_ns)
    nodes = []
    for i in range(num_clients):
        ns = f"{prefix}-n{i}"
        _add_netns(stack, ns)
        tag = prefix.removeprefix("pbn-")  # interface names: 15 characters at most
        node = Node(i, ns, dev=f"pb{tag}n{i}", link_dev=f"pb{tag}l{i}", link_ip=f"10.213.{i}.1")
        sh(IP, "link", "add", node.link_dev, "netns", link_ns, "type", "veth", "peer", "name", node.dev, "netns", ns)
        stack.callback(_quietly, IP, "-n", link_ns, "link", "del", node.link_dev)  # takes its peer with it
        sh(IP, "-n", link_ns, "addr", "add", f"{node.link_ip}/30", "dev", node.link_dev)
        sh(IP, "-n", ns, "addr", "add", f"10.213.{i}.2/30", "dev", node.dev)
        sh(IP, "-n", link_ns, "link", "set", node.link_dev, "up")
        sh(IP, "-n", ns, "link", "set", node.dev, "up")
        nodes.append(node)
    return Network(prefix, link_ns, nodes)


def _add_netns(stack: contextlib.ExitStack, ns: str) -> None:
    sh(IP, "netns", "add", ns)
    stack.callback(_quietly, IP, "netns", "delete", ns)
    sh(IP, "-n", ns, "link", "set", "lo", "up")  # the SuperNode talks to its proxy and ClientApp on loopback


def _quietly(*cmd: str) -> None:
    subprocess.run(cmd, capture_output=True)


def tbf(rate_mbps: float, latency_ms: float = 0.0, least_burst: int = 64 * 1024) -> list[str]:
    """The root qdisc that limits a device's egress to ``rate_mbps``.

    The burst must hold a whole (GSO) packet of up to 64 KiB (``least_burst``), else large packets
    never pass; 10 ms of traffic above that. The queue holds 400 ms plus a round
    trip of the proxy's delay, so TCP keeps the link busy.
    """
    burst = max(least_burst, int(rate_mbps * 1e6 / 8 * 0.01))
    return ["root", "tbf", "rate", f"{rate_mbps * 1000:.0f}kbit", "burst", str(burst), "latency",
            f"{400 + 2 * latency_ms:.0f}ms"]  # fmt: skip


LOOPBACK_BURST = 4 * 65536  # bytes: a segment on ``lo`` (MTU 65536) and its headers pass whole, with room


@contextlib.contextmanager
def shaped_loopback(rate_mbps: float):
    """Loopback limited to ``rate_mbps`` while the block runs (tbf on ``lo``: every loopback byte, both ways
    together), and its root qdisc deleted after, whatever happens (also on SIGTERM: ``stop_on_sigterm``; a
    second signal during the cleanup is ignored). A process killed outright leaves it: ``tc qdisc del dev lo
    root`` removes it (``loopback_shaped`` says so)."""
    sh(TC, "qdisc", "replace", "dev", "lo", *tbf(rate_mbps, least_burst=LOOPBACK_BURST))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _quietly(TC, "qdisc", "del", "dev", "lo", "root")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def loopback_shaped() -> bool:
    """Whether ``lo`` has a tbf qdisc (one left by a run killed outright: loopback is not what it seems)."""
    if not Path(TC).exists():
        return False
    shown = subprocess.run([TC, "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    return " tbf " in f" {shown.stdout} "


def shape(net: Network, rate_mbps: float, latency_ms: float) -> None:
    """Limit every link to ``rate_mbps`` each way (``tbf`` on both ends of each veth pair)."""
    args = tbf(rate_mbps, latency_ms)
    for node in net.nodes:
        sh(TC, "-n", node.ns, "qdisc", "replace", "dev", node.dev, *args)
        sh(TC, "-n", net.link_ns, "qdisc", "replace", "dev", node.link_dev, *args)


def wire_bytes(node: Node) -> tuple[int, int]:
    """(sent, received) bytes of the node's veth so far: what really crossed its link."""
    stats = json.loads(sh(IP, "-n", node.ns, "-s", "-j", "link", "show", node.dev))[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def listens_in(ns: str, port: int) -> bool:
    """Does something accept TCP connections on 127.0.0.1:port inside ``ns``?"""
    probe = [*in_netns(ns), "bash", "-c", f": </dev/tcp/127.0.0.1/{port}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def descendants(pids: list[int]) -> list[int]:
    """Every live process below ``pids``: Flower starts some children in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def terminate_all(pids: list[int]) -> None:
    """SIGTERM every process (its group, when it leads one) at once: they shut down in parallel
    (1-3 s each) instead of one after the other in the ExitStack."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:  # not a group leader, or gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def alive(pid: int) -> bool:
    """Running (a zombie is dead, only not yet reaped by its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs any more; those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a live process (its peak resident memory), in MB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def proxy_command(listen: str, target: str, delay_ms: float) -> list[str]:
    """The latency proxy: every chunk from ``listen`` to ``target`` (host:port) and back held ``delay_ms``."""
    return [sys.executable, str(PROXY), "--listen", listen, "--target", target, "--delay-ms", str(delay_ms)]


def check_machine() -> None:
    """Network namespaces need root and iproute2's `ip` and `tc`."""
    if os.geteuid() != 0:
        sys.exit("network.py: needs root to create network namespaces (`ip netns add`); run it as root")
    for tool in (IP, TC):
        if not Path(tool).exists():
            sys.exit(f"network.py: {tool} not found: expected iproute2's `ip` and `tc`")


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every process is stopped and every namespace deleted."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

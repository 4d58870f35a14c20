"""A SuperNode's own data and device, named in its node config (no torch here: the thin ClientApp reads it).

``--node-config 'dataset="alpaca:/srv/site-a/train.jsonl" heldout-dataset="alpaca:/srv/site-a/dev.jsonl"'``:
such a node trains on its own rows only and never reads the run config's ``dataset``; its
aggregation weight is its own example count. A node without ``dataset`` trains on its
``partition-id`` share of the run config's dataset, as in simulation. Both kinds may serve one run.
``device="cuda:1"`` puts the node's model on that device (default: the worker's ``--device``,
else ``cuda`` when there is one, else ``cpu``). ``state-dir="/var/lib/parablock/site-a"`` confirms where the
node worker keeps its error-feedback residuals (the worker's own ``--state-dir``, else ``SOCKET.state``):
the worker refuses a message naming another, since no peer chooses where it writes.

``transport="flower"`` keeps this site's blocks on Flower's path when the run offers its stream
(``transport = "direct"``, docs/transport.md); ``transport-address="10.0.0.5:9095"`` is the stream's address
as this site reaches it, when it is not the one the run names.

``allow-models`` and ``allow-data`` (each a list separated by spaces) bound what a run config may make
the node load: its ``model`` and, for a node without its own ``dataset``, its ``dataset``. An entry is
a value as the run config writes it (``/models/llama-8b``, ``meta-llama/Llama-3.1-8B-Instruct``,
``alpaca:/srv/site0/train.jsonl``, ``reasoning-gym:syllogism``), or a folder ending in ``/``
(``/models/``, ``alpaca:/srv/site0/``) that allows every path under it once symlinks and ``..`` are
resolved. When set, any other value is refused in one line naming it and the list, before anything
is loaded. The node's own data (``dataset``, ``heldout-dataset``) must be in ``allow-data`` too.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DATASET_KINDS = ("reasoning-gym", "alpaca", "mathinstruct", "messages")
# The node config (``--node-config``), a schema of its own, not a message: each key is named here once.
PARTITION_ID = "partition-id"  # the node's identity: its data partition (or its own data's id), its seed
NUM_PARTITIONS = "num-partitions"
WORKER_SOCKET = "worker-socket"  # deployment: the node worker's Unix socket (none: the round runs inline)
WORKER_UID = "worker-uid"  # the node worker's user, when it is not the ClientApp's
NODE_SETTINGS_KEYS = ("dataset", "heldout-dataset", "device", "state-dir", "allow-models", "allow-data", "transport",
                      "transport-address", "transport-ca", "transport-certfile", "transport-keyfile",
                      "transport-require-tls", "memory-limit-gib")  # fmt: skip
NODE_CONFIG_KEYS = (PARTITION_ID, NUM_PARTITIONS, WORKER_SOCKET, WORKER_UID, *NODE_SETTINGS_KEYS)


def user_id(value) -> int | None:
    """A user as a uid: an integer (quoted or not), or a user name (a unit file cannot compute a uid);
    None when it is neither. The worker's ``--allow-uid`` and the node config's ``worker-uid`` read it."""
    if type(value) is int:
        return value if value >= 0 else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(str(value)).pw_uid
    except KeyError:
        return None


def error_line(err: BaseException) -> str:
    """What of a node's error may leave the site: its type, and its text only when this project wrote
    it (its errors name a file, a row number and a field, never a row); a library's text may quote the
    site's data, so it stays in the node's own log."""
    if type(err).__module__.startswith("parablock_flwr."):
        return f"{type(err).__name__}: {err}"
    return f"{type(err).__name__} (its text is in the node's log: it may quote the site's data)"


@dataclass(frozen=True)
class NodeSettings:
    """The node's own settings: empty strings mean "the run config's" (data) or "the default" (device)."""

    dataset: str = ""  # the node's own training data (every form of the run config's ``dataset``)
    heldout_dataset: str = ""  # its own held-out split for ``evaluation = "clients"``
    device: str = ""  # cpu, cuda, cuda:N
    state_dir: str = ""  # where the node worker keeps what must outlive it (default: beside its socket)
    allow_models: str = ""  # the models a run config may name here (space-separated; empty: any)
    allow_data: str = ""  # the datasets this node may load (space-separated; empty: any)
    transport: str = ""  # "flower": this site moves blocks on Flower's path even when the run offers the stream
    transport_address: str = ""  # host:port this site dials for the run's stream (default: the one the run names)
    transport_ca: str = ""  # the CA this site trusts for the stream (default: the one the run's message names)
    transport_certfile: str = ""  # this site's client certificate, for a stream that requires mutual TLS
    transport_keyfile: str = ""  # its key
    transport_require_tls: str = ""  # "true": this site never uses a plaintext stream, whatever a message offers
    # The memory this node's process may use, in GiB, as plan prints it (default: what the machine has free).
    memory_limit_gib: str = ""

    @property
    def local(self) -> bool:
        return bool(self.dataset)

    @property
    def stream(self) -> SiteStream:
        """The site's own settings for the run's stream."""
        return SiteStream(self.transport_address, self.transport_ca, self.transport_certfile, self.transport_keyfile,
                          self.transport_require_tls.lower() == "true")  # fmt: skip

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, object]) -> NodeSettings:
        return cls(*(str(node_config.get(key, "")) for key in NODE_SETTINGS_KEYS))

    @classmethod
    def from_header(cls, header: Mapping[str, object] | None) -> NodeSettings:
        """What the relay sent the node worker (``as_header``: the node-config keys)."""
        return cls.from_node_config(header or {})

    def as_header(self) -> dict[str, str]:
        return {key: getattr(self, key.replace("-", "_")) for key in NODE_SETTINGS_KEYS}

    def refusal(self, model: str, dataset: str) -> str | None:
        """Why this node must not load the run config's ``model`` and ``dataset`` (None: allowed). The
        node's own data replaces the run's ``dataset``; its own held-out file is checked as well."""
        data = [self.dataset] if self.local else [dataset]
        data += [self.heldout_dataset] if self.heldout_dataset else []
        checks = [("allow-models", self.allow_models, "model", model)]
        checks += [("allow-data", self.allow_data, "dataset", value) for value in data]
        for key, allow_list, what, value in checks:
            entries = allow_list.split()
            if entries and not any(allows(entry, value) for entry in entries):
                return f"{what}={value!r} refused: this node's {key} is {' '.join(entries)!r}"
        return None


@dataclass(frozen=True)
class SiteStream:
    """What a site sets for the stream in its node config, whatever a run's message says: the address it dials,
    the CA it trusts (instead of the message's), its client certificate and key (for a service that requires
    mutual TLS), and whether it refuses plaintext. Paths; read when a channel is made."""

    address: str = ""
    ca: str = ""
    certfile: str = ""
    keyfile: str = ""
    require_tls: bool = False

    def problem(self) -> str | None:
        """One line naming a setting that cannot work, or None."""
        if bool(self.certfile) != bool(self.keyfile):
            return (f"node config transport-certfile={self.certfile!r}, transport-keyfile={self.keyfile!r}: expected "
                    f"both (the site's client certificate and its key) or neither")  # fmt: skip
        for key, path in (("transport-ca", self.ca), ("transport-certfile", self.certfile),
                          ("transport-keyfile", self.keyfile)):  # fmt: skip
            if path and not Path(path).expanduser().is_file():
                return f"node config {key}={path!r}: no such file"
        return None

    def identity(self) -> tuple[bytes, bytes] | None:
        if not self.certfile:
            return None
        return Path(self.certfile).expanduser().read_bytes(), Path(self.keyfile).expanduser().read_bytes()


def allows(entry: str, value: str) -> bool:
    """``value`` is ``entry``, or the folder ``entry`` (ending in ``/``) or a path under it (a dataset's kind, if
    the entry names one, must match), compared once symlinks and ``..`` are resolved."""
    if value == entry:
        return True
    if not entry.endswith("/"):
        return False
    kind, folder = _kind_and_path(entry)
    value_kind, path = _kind_and_path(value)
    if kind and kind != value_kind or not path.startswith("/"):
        return False
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _kind_and_path(value: str) -> tuple[str, str]:
    """``("alpaca", "/srv/a.jsonl")`` for ``alpaca:/srv/a.jsonl``; ``("", value)`` for a bare path or id."""
    kind, colon, rest = value.partition(":")
    return (kind, rest) if colon and kind in DATASET_KINDS else ("", value)


def node_settings_problem(node_config: Mapping[str, object]) -> str | None:
    """One line saying what is wrong with the node config's data, device or transport settings, or None."""
    if "device" in node_config and not device_valid(node_config["device"]):
        return f"node config device={node_config['device']!r}: expected cpu, cuda or cuda:<index>"
    if node_config.get("transport", "flower") != "flower":
        return (f"node config transport={node_config['transport']!r}: expected \"flower\" (this site keeps to Flower's "
                f"path), or no key (the run's transport)")  # fmt: skip
    address = node_config.get("transport-address", "x:0")
    host, colon, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (host and colon and port.isdigit() and int(port) <= 65535):
        return f"node config transport-address={address!r}: expected host:port (the run's stream as this site dials it)"
    if "transport-require-tls" in node_config and type(node_config["transport-require-tls"]) is not bool:
        return f"node config transport-require-tls={node_config['transport-require-tls']!r}: expected true or false"
    if (problem := NodeSettings.from_node_config(node_config).stream.problem()) is not None:
        return problem
    for key in ("dataset", "heldout-dataset"):
        if key not in node_config:
            continue
        value = node_config[key]
        kind, _, source = value.partition(":") if isinstance(value, str) else ("", "", "")
        if kind not in DATASET_KINDS or not source:
            return (
                f"node config {key}={value!r}: expected reasoning-gym:<task>, alpaca:<path or hub id>, "
                f"mathinstruct:<path or hub id> or messages:<path or hub id>"
            )
    if "dataset" in node_config and PARTITION_ID not in node_config:
        return (
            f"node config dataset={node_config['dataset']!r}: also set {PARTITION_ID}=<an integer unique among "
            f"the nodes> (the node's identity: its batches' seed, its place in the aggregation order, resume)"
        )
    return None


def partition_of(node_config: Mapping[str, object]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of the node config (default: the only partition, 0 of 1)."""
    return int(node_config.get(PARTITION_ID, 0)), int(node_config.get(NUM_PARTITIONS, 1))


def device_valid(value: object) -> bool:
    """``cpu``, ``cuda`` or ``cuda:<index>`` (whether that GPU exists is checked where torch runs)."""
    if not isinstance(value, str):
        return False
    kind, colon, index = value.partition(":")
    return value == "cpu" or (kind == "cuda" and (not colon or index.isdigit()))

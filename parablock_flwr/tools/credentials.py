"""Credentials for a TLS + SuperNode-authenticated deployment: a CA, a SuperLink certificate, node keys.

Flower secures a deployment with two things (docs/deployment.md):
TLS on the SuperLink (``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``, and
``--root-certificates`` on SuperNodes and in the ``flwr`` connection), and
SuperNode authentication (``--enable-supernode-auth`` on the SuperLink; each
SuperNode signs with an ECDSA key, ``--auth-supernode-private-key``, whose
public half an operator registers with ``flwr supernode register``).

The run's own stream (``transport = "direct"``) uses the same CA: the ServerApp
serves it with the SuperLink's certificate, and with ``transport-client-ca`` it
requires each node's client certificate (mutual TLS), which ``make_client_cert``
signs.

Real deployments bring their own PKI. This module makes the same files for a
loopback set-up and its test, with the ``cryptography`` package Flower already
depends on (no openssl or ssh-keygen needed): a short-lived self-signed CA, a
SuperLink certificate for the given hosts, and keys in the OpenSSH format that
``ssh-keygen -t ecdsa -b 384`` writes.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path  # what SuperNodes and `flwr` trust (--root-certificates, root-certificates)
    server_cert: Path  # the SuperLink's --ssl-certfile
    server_key: Path  # the SuperLink's --ssl-keyfile
    ca_key: Path  # what signs the nodes' client certificates (``make_client_cert``)


def tls_files(folder: Path) -> TlsFiles:
    """Where ``make_tls`` writes its files in ``folder`` (a launcher names them before they exist)."""
    folder = Path(folder)
    return TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key", folder / "ca.key")


def make_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 7) -> TlsFiles:
    """A CA and a SuperLink certificate valid for ``hosts`` (IP addresses or DNS names)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "parablock-flwr CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = tls_files(folder)
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    log.debug("TLS files for %s in %s", ", ".join(hosts), folder)
    _write_private(files.server_key, _pem(server_key))
    _write_private(files.ca_key, _pem(ca_key))
    return files


def make_client_cert(tls: TlsFiles, name: str, days: int = 7) -> tuple[Path, Path]:
    """A node's client certificate for the stream's mutual TLS, signed by ``tls``'s CA: (certificate, key),
    PEM, beside the CA. ``name`` is its common name (a site's name; the service binds a node's capabilities to
    the certificate, not to the name)."""
    ca_key = serialization.load_pem_private_key(tls.ca_key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = tls.ca_cert.parent / f"{name}.pem", tls.ca_cert.parent / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_path, _pem(key))
    return cert_path, key_path


def _pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's ECDSA P-384 key pair: (private key, public key ``.pub``), OpenSSH format."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    _write_private(
        private,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    return private, public


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600)
    path.write_bytes(data)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False

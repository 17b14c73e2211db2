"""TLS for untrusted networks: a self-signed certificate made on first run, pinned by its
SHA-256 fingerprint.

The coordinator serves https/wss with its certificate (given, or made once under
``$EDGEPIPE_HOME/tls``) and prints its fingerprint; a worker started with that fingerprint
fetches the certificate once, checks the fingerprint (constant time) and from then on trusts
exactly that certificate for its control channel and its file downloads. Each worker's data
port serves wss with a certificate of its own; a predecessor pins it when the coordinator
passes its fingerprint (``next.fingerprint``), and otherwise encrypts without pinning (the
per-plan secret still decides who may send). Certificates are made with the ``openssl``
command (no Python dependency on workers); standard library otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import ssl
import subprocess
from pathlib import Path


class PinMismatch(ValueError):
    """The peer's certificate is not the pinned one (not an OSError: retrying cannot help)."""


def _san(hosts) -> str:
    out = []
    for host in dict.fromkeys(hosts):
        try:
            ipaddress.ip_address(host)
            out.append(f"IP:{host}")
        except ValueError:
            out.append(f"DNS:{host}")
    return ",".join(out)


def make_self_signed(directory: Path, hosts=("127.0.0.1", "localhost")) -> tuple[Path, Path]:
    """``(cert, key)`` under ``directory``, made with openssl on first use (P-256, 10 years)."""
    directory = Path(directory)
    cert, key = directory / "cert.pem", directory / "key.pem"
    if cert.is_file() and key.is_file():
        return cert, key
    directory.mkdir(parents=True, exist_ok=True)
    # Local workers share one home and start together: without the lock two of them made a
    # certificate each and one served its own while announcing the other's fingerprint.
    with _exclusive(directory / ".lock"):
        if cert.is_file() and key.is_file():
            return cert, key
        _make_pair(cert, key, hosts)
    return cert, key


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive lock between processes (flock where there is one)."""
    try:
        import fcntl
    except ImportError:  # Windows: one worker per home is the norm there
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make_pair(cert: Path, key: Path, hosts) -> None:
    directory = cert.parent
    tmp_cert, tmp_key = directory / f".cert.{os.getpid()}", directory / f".key.{os.getpid()}"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "3650",
                        "-subj", "/CN=edgepipe", "-addext", f"subjectAltName={_san(hosts)}", "-keyout", str(tmp_key), "-out", str(tmp_cert)],
                       check=True, capture_output=True, timeout=60)
    except FileNotFoundError:
        raise RuntimeError("making a TLS certificate needs the openssl command (or pass --tls-cert/--tls-key)") from None
    os.chmod(tmp_key, 0o600)
    tmp_key.replace(key)
    tmp_cert.replace(cert)


def fingerprint_pem(pem: str) -> str:
    """SHA-256 of the certificate's DER bytes, lowercase hex."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def normalize(fp: str) -> str:
    return fp.replace(":", "").strip().lower()


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def server_certificate(host: str, port: int, timeout: float = 10) -> str:
    """The PEM certificate ``host:port`` presents (``ssl.SSLError`` when it does not answer in TLS)."""
    return ssl.get_server_certificate((host, port), timeout=timeout)


def answers_plain_http(host: str, port: int, timeout: float = 5) -> bool:
    """Whether ``host:port`` answers a plain-HTTP request (what a TLS handshake's failure means)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(f"HEAD /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            return sock.recv(5) == b"HTTP/"
    except OSError:
        return False


def pinned_context(host: str, port: int, fingerprint: str, timeout: float = 10) -> ssl.SSLContext:
    """A client context that trusts exactly the certificate ``host:port`` presents now, after
    checking it has ``fingerprint`` (raises :class:`PinMismatch` otherwise)."""
    pem = server_certificate(host, port, timeout)
    if not hmac.compare_digest(fingerprint_pem(pem), normalize(fingerprint)):
        raise PinMismatch(f"{host}:{port} presented a certificate with another fingerprint than the pinned one")
    return trusting(pem)


def trusting(pem: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=pem)
    ctx.check_hostname = False  # the pin names the certificate; addresses change (DHCP, NAT)
    return ctx


def unpinned_context() -> ssl.SSLContext:
    """Encryption without authentication of the server (a data port whose pin is unknown)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx

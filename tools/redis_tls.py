"""A real ``redis-server`` speaking TLS on loopback, for tests: ``make_pki``
writes, with the ``openssl`` command, a test CA, a server certificate for
127.0.0.1 and a client certificate it signed, and another CA that signed
neither; ``redis_tls_server`` serves TLS with them, requiring a client
certificate (``--tls-auth-clients yes``)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.redis_server import NO_PERSISTENCE, RedisProcess, free_port

#: Short-lived EC keys: quick to make, as good as RSA for a test.
_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  #: a CA that signed neither certificate


def _openssl(*args: str | Path, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError(
            "openssl not found: run scripts/setup.sh --with-test-services"
        )
    subprocess.run(
        [binary, *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=60
    )


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl(
        "req", "-x509", *_KEY, "-keyout", key, "-out", cert,
        "-days", "2", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    return cert, key


def _signed(
    directory: Path, name: str, ca: tuple[Path, Path], extensions: str
) -> tuple[Path, Path]:
    cert, key, csr = (directory / f"{name}{s}" for s in (".pem", ".key", ".csr"))
    extfile = directory / f"{name}.ext"
    extfile.write_text(extensions + "\n")
    _openssl(
        "req", "-new", *_KEY, "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1],
        "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", extfile,
        cwd=directory,
    )  # fmt: skip
    return cert, key


def make_pki(directory: Path) -> Pki:
    """Writes the certificates and keys into ``directory``."""
    ca = _ca(directory, "test-ca")
    server = _signed(
        directory,
        "server",
        ca,
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth",
    )
    client = _signed(directory, "client", ca, "extendedKeyUsage=clientAuth")
    other, _ = _ca(directory, "other-ca")
    return Pki(ca[0], *server, *client, other)


@contextmanager
def redis_tls_server(pki: Pki) -> Iterator[int]:
    """Runs ``redis-server`` with TLS on a free loopback port, which it yields
    (its plain port answers only the start-up check)."""
    tls_port = free_port()
    args = (
        *NO_PERSISTENCE,
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key),
        "--tls-ca-cert-file", str(pki.ca),
        "--tls-auth-clients", "yes",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="redis-tls-") as directory:
        server = RedisProcess(args, free_port(), directory)
        try:
            yield tls_port
        finally:
            server.stop()
